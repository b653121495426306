"""The caller's continuation hint (``continues``): ``chain`` classes a hinted request by it and
learns as before; the managers and the study pass it on, checked first; a policy whose
``note_request`` takes no hint (a plugin older than hints) is never given one."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import InvalidArgumentError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.policies import ChainPolicy, LRUPolicy
from tiering.policies.base import note_request, takes_hints
from tiering.replay.study import prefix_hits, simulate_cpu, study_trace_from_blocks
from tiering.replay.workloads import workload_trace


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def classes(policy: ChainPolicy) -> tuple[tuple[bytes, ...], ...]:
    return tuple(policy.list_keys(c) for c in range(3))


def test_a_fresh_request_hinted_to_continue_is_class_1() -> None:
    policy = ChainPolicy(100)
    policy.note_request([k(0), k(1)], continues=True)
    policy.insert_new([k(0), k(1)])
    policy.note_request([k(5)])
    policy.insert_new([k(5)])
    assert classes(policy) == ((k(5),), (k(1), k(0)), ())
    assert [stats.requests for stats in policy.class_stats] == [1, 1, 0, 0]


def test_a_continuation_hinted_not_to_continue_is_class_0_and_still_learned() -> None:
    policy = ChainPolicy(100)
    policy.note_request([k(0), k(1)])
    policy.insert_new([k(0), k(1)])
    turn = [k(0), k(1), k(2)]
    policy.note_request(turn, continues=False)  # it continues the first request
    policy.touch([k(0), k(1)])
    policy.insert_new([k(2)])
    assert k(2) in policy.list_keys(0)
    assert policy.class_stats[0].continued == 1  # what the requests did is learned
    # Classed as continuing nothing: the blocks it used are shared (two waits begin).
    assert [stats.requests for stats in policy.class_stats] == [2, 0, 0, 2]
    assert set(policy.list_keys(3)) == {k(0), k(1)}
    assert k(2) in policy.tail_keys  # its own tails, as class 0's


def test_a_continuation_hinted_to_continue_keeps_its_learned_class() -> None:
    policy = ChainPolicy(100)
    for i in range(3):  # hinted, the first is class 1; each next turn one up (at most 2)
        policy.note_request([k(j) for j in range(i + 1)], continues=True)
        policy.touch([k(j) for j in range(i)])
        policy.insert_new([k(i)])
    assert [stats.requests for stats in policy.class_stats] == [0, 1, 2, 0]
    assert set(policy.list_keys(2)) == {k(0), k(1), k(2)}


def test_a_hint_at_the_request_s_end_classes_it_then() -> None:
    policy = ChainPolicy(100)
    policy.insert_new([k(0), k(1)])
    policy.note_finished_request([k(0), k(1)], continues=True)
    assert classes(policy) == ((), (k(1), k(0)), ())


@pytest.mark.parametrize("hint", ["yes", 1, 0])
def test_a_bad_hint_is_refused_by_every_layer_changing_nothing(hint: object) -> None:
    policy = ChainPolicy(8)
    policy.note_request([k(0)])
    policy.insert_new([k(0)])
    before = (classes(policy), policy.tail_keys, policy.class_stats)
    message = "continues must be True, False or None"
    with pytest.raises(InvalidArgumentError, match=message):
        policy.note_request([k(1)], continues=hint)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=message):
        note_request(LRUPolicy(4), [k(1)], continues=hint)  # type: ignore[arg-type]
    assert (classes(policy), policy.tail_keys, policy.class_stats) == before
    cpu = CPUOffloadingManager(4, "chain")
    tiering = TieringOffloadingManager(
        CPUOffloadingManager(4, "chain"), [], pool=torch.zeros(4, 8, dtype=torch.uint8)
    )
    for manager in (cpu, tiering):
        with pytest.raises(InvalidArgumentError, match=message):
            manager.note_request([key(0)], continues=hint)  # type: ignore[arg-type]
        chain = manager.policy if manager is cpu else tiering.primary.policy
        assert isinstance(chain, ChainPolicy)
        assert chain.class_stats[0].requests == 0 and chain.tail_keys == ()


@pytest.mark.parametrize("ended", [False, True])
def test_both_managers_pass_the_hint_to_the_primary_policy(ended: bool) -> None:
    keys = [key(0), key(1)]
    cpu = CPUOffloadingManager(4, "chain")
    tiering = TieringOffloadingManager(
        CPUOffloadingManager(4, "chain"), [], pool=torch.zeros(4, 8, dtype=torch.uint8)
    )
    for manager, policy in ((cpu, cpu.policy), (tiering, tiering.primary.policy)):
        assert isinstance(policy, ChainPolicy)
        manager.note_request(keys, ended=ended, continues=True)
        assert [stats.requests for stats in policy.class_stats] == [0, 1, 0, 0]


class _OldPlugin(LRUPolicy):
    """A plugin written before hints: its ``note_request`` takes the keys only."""

    name = "test-old-plugin"
    noted: list[list[bytes]]

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.noted = []

    def note_request(self, keys: Sequence[bytes]) -> None:  # type: ignore[override]
        self.noted.append(list(keys))


class _AnyKeywords(LRUPolicy):
    name = "test-any-keywords"

    def note_request(self, keys: Sequence[bytes], **hints: object) -> None:
        return


def test_a_policy_whose_signature_takes_no_hint_is_never_given_one() -> None:
    assert takes_hints(ChainPolicy(4)) and takes_hints(LRUPolicy(4))  # the base takes it
    assert takes_hints(_AnyKeywords(4))
    assert not takes_hints(_OldPlugin(4))
    manager = CPUOffloadingManager(4, _OldPlugin(4))
    manager.note_request([key(0)], continues=True)
    manager.note_request([key(1)], continues=None)
    assert manager.policy.noted == [[key(0)], [key(1)]]  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy", ["lru", "arc", "hybrid"])
def test_a_policy_that_ignores_hints_takes_the_same_victims_hinted(policy: str) -> None:
    requests = sorted(workload_trace("conversation", "tiny", 1), key=lambda r: r.arrival_s)
    key_lists = study_trace_from_blocks(requests, 512).key_lists
    hints = [i % 3 == 0 if i % 2 else None for i in range(len(key_lists))]
    plain = simulate_cpu(make(policy, 40), key_lists, record_victims=True)
    hinted = simulate_cpu(make(policy, 40), key_lists, record_victims=True, hints=hints)
    assert hinted.victims == plain.victims and hinted.flags == plain.flags


def test_chain_hinted_the_truth_closes_more_of_the_gap() -> None:
    """On a generated conversation trace, chain told which requests are continued holds more
    prefix hits than chain alone (the table in docs/benchmarks.md measures how many)."""
    requests = sorted(workload_trace("conversation", "tiny", 0), key=lambda r: r.arrival_s)
    key_lists = study_trace_from_blocks(requests, 512).key_lists  # 9,072 unique blocks
    later: set[bytes] = set()
    truth: list[bool | None] = []
    for keys in reversed(key_lists):
        truth.append(bool(keys) and keys[-1] in later)
        later.update(keys)
    truth.reverse()
    capacity = 453  # 5 %: 2,183 blocks hit unhinted, 3,241 hinted

    def held(hints: list[bool | None] | None) -> int:
        run = simulate_cpu(make("chain", capacity), key_lists, hints=hints)
        return sum(prefix_hits(run.flags, key_lists))

    assert held(truth) > held(None)


def test_the_study_wants_one_hint_per_request() -> None:
    with pytest.raises(InvalidArgumentError, match=r"one entry per request \(2\), got 1"):
        simulate_cpu(ChainPolicy(4), [[k(0)], [k(1)]], hints=[True])


def make(name: str, capacity: int) -> ChainPolicy | LRUPolicy:
    from tiering.policies import make_policy

    return make_policy(name, capacity)  # type: ignore[return-value]
