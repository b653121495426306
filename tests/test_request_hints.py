"""The caller's continuation hint (``continues``): ``chain`` classes a hinted request by it and
learns as before; the managers and the study pass it on, checked first; a policy whose
``note_request`` takes no hint (a plugin older than hints) is never given one."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
import torch

from tiering.cli import main as cli_main
from tiering.config import parse_config
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import InvalidArgumentError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.observability.metrics import read_samples
from tiering.policies import ChainPolicy, EvictionPolicy, LRUPolicy, register_policy
from tiering.policies import registry as policy_registry
from tiering.policies.base import takes_hints, tell_request
from tiering.replay import ReplayOptions, run_replay
from tiering.replay.block_trace import (
    BlockRequest,
    read_block_trace,
    to_requests,
    write_mooncake,
)
from tiering.replay.study import (
    policy_study,
    prefix_hits,
    simulate_cpu,
    study_trace_from_blocks,
)
from tiering.replay.trace_jsonl import read_jsonl, write_jsonl
from tiering.replay.trace_requests import Request, TraceError
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


def test_hints_that_tell_nothing_stop_being_followed() -> None:
    """Every fresh request hinted to be continued, none continued: the hint is followed while
    the belief that hints are right outweighs what was seen, then no more."""
    policy = ChainPolicy(1000)
    followed = []
    for i in range(12):
        before = policy.class_stats[1].requests
        policy.note_request([k(10 * i), k(10 * i + 1)], continues=True)
        followed.append(policy.class_stats[1].requests > before)
    # The share of hinted requests continued, from a prior of 4 right ones: 4 / (n + 4) with
    # n requests counted; followed while it is at least 0.1 above all requests' share (0 here).
    assert followed == [True] * 12  # 4 / 16 = 0.25 >= 0.1: still followed
    for i in range(12, 40):
        policy.note_request([k(10 * i), k(10 * i + 1)], continues=True)
    assert policy.hint_stats[True] == (40.0, 0.0)
    before = policy.class_stats[0].requests
    policy.note_request([k(9000)], continues=True)  # 4 / 45 < 0.1: not followed
    assert policy.class_stats[0].requests == before + 1


def test_hints_that_tell_continued_requests_apart_keep_being_followed() -> None:
    policy = ChainPolicy(1000)
    for i in range(40):  # one hinted request continued (True), one not (False), in turn
        kept, dropped = [k(100 * i), k(100 * i + 1)], [k(100 * i + 50)]
        policy.note_request(kept, continues=True)
        policy.note_request(dropped, continues=False)
        policy.note_request([*kept, k(100 * i + 2)])  # continues ``kept``
    requests_true, continued_true = policy.hint_stats[True]
    assert (requests_true, continued_true) == (40.0, 40.0)
    assert policy.hint_stats[False] == (40.0, 0.0)
    before = [stats.requests for stats in policy.class_stats]
    policy.note_request([k(5000)], continues=True)
    policy.note_request([k(6000), k(5000)], continues=False)  # continues it, hinted the end
    after = [stats.requests for stats in policy.class_stats]
    assert [a - b for a, b in zip(after, before, strict=True)][:3] == [1, 1, 0]


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
        tell_request(LRUPolicy(4), [k(1)], continues=hint)  # type: ignore[arg-type]
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


# -- hints followed: the policy's counter, the managers' counts --------------------------------


def managers(policy: str) -> list[CPUOffloadingManager | TieringOffloadingManager]:
    """A CPU manager and a tiering manager (no tiers), each with its own ``policy``."""
    tiering = TieringOffloadingManager(
        CPUOffloadingManager(4, policy), [], pool=torch.zeros(4, 8, dtype=torch.uint8)
    )
    return [CPUOffloadingManager(4, policy), tiering]


def primary_policy(manager: CPUOffloadingManager | TieringOffloadingManager) -> EvictionPolicy:
    return manager.policy if isinstance(manager, CPUOffloadingManager) else manager.primary.policy


def hint_growth(manager: CPUOffloadingManager | TieringOffloadingManager) -> tuple[int, ...]:
    """``hinted_requests`` (and ``hints_followed``, if reported) since the previous call."""
    cpu = manager.get_stats()["CPU"]
    return tuple(cpu[name] for name in ("hinted_requests", "hints_followed") if name in cpu)


def tell_right_hints(
    manager: CPUOffloadingManager | TieringOffloadingManager, rounds: range
) -> None:
    """Per round, a request hinted to be continued (the round's last request, unhinted,
    continues it) and one hinted not to be (none does)."""
    for i in rounds:
        kept, dropped = [key(100 * i), key(100 * i + 1)], [key(100 * i + 50)]
        manager.note_request(kept, continues=True)
        manager.note_request(dropped, continues=False)
        manager.note_request([*kept, key(100 * i + 2)])


@pytest.mark.parametrize("kind", ["cpu", "tiering"])
def test_chain_follows_right_hints_and_the_managers_count_them(kind: str) -> None:
    manager = managers("chain")[kind == "tiering"]
    policy = primary_policy(manager)
    assert isinstance(policy, ChainPolicy)
    assert hint_growth(manager) == (0, 0)
    tell_right_hints(manager, range(40))
    # Every True; every False but the first: while no request had been continued, all
    # requests' share continued is 0, and hints False tell none apart from the others.
    assert hint_growth(manager) == (80, 79)
    assert policy.hints_followed == 79
    with pytest.raises(InvalidArgumentError):
        manager.note_request([key(9000)], continues="yes")  # type: ignore[arg-type]
    assert hint_growth(manager) == (0, 0)  # a bad hint counts nothing
    tell_right_hints(manager, range(40, 50))
    assert hint_growth(manager) == (20, 20)
    manager.reset_cache()  # the policy forgets what it learned; its counter is kept
    assert policy.hints_followed == 99 and policy.hint_stats[True] == (0.0, 0.0)
    assert hint_growth(manager) == (0, 0)
    if isinstance(manager, CPUOffloadingManager):
        totals = manager.counters()
    else:
        totals = manager.metrics()["primary"]
    assert (totals["hinted_requests"], totals["hints_followed"]) == (100, 99)


@pytest.mark.parametrize("kind", ["cpu", "tiering"])
def test_chain_stops_following_hints_that_tell_nothing(kind: str) -> None:
    """Every request hinted to be continued, none continued: the hints are followed while the
    prior (4 right ones) outweighs what was seen, 4 / (n + 4) >= 0.1 for the n-th: 36 of them;
    then the hinted requests grow and the hints followed do not."""
    manager = managers("chain")[kind == "tiering"]
    for i in range(40):
        manager.note_request([key(10 * i), key(10 * i + 1)], continues=True)
    assert hint_growth(manager) == (40, 36)
    for i in range(40, 100):
        manager.note_request([key(10 * i), key(10 * i + 1)], continues=True)
    assert hint_growth(manager) == (60, 0)
    for i in range(100, 110):  # unhinted: counted in neither
        manager.note_request([key(10 * i)])
    assert hint_growth(manager) == (0, 0)


@pytest.mark.parametrize("policy", ["lru", "arc", "hybrid"])
def test_a_policy_that_follows_no_hints_reports_hinted_requests_only(policy: str) -> None:
    for manager in managers(policy):
        assert primary_policy(manager).hints_followed is None
        manager.note_request([key(0)], continues=True)
        manager.note_request([key(1)], continues=False)
        manager.note_request([key(2)])
        assert hint_growth(manager) == (2,)  # no hints_followed
    assert _OldPlugin(4).hints_followed is None  # a plugin that does not say: none


def test_the_hints_followed_are_scraped_for_chain_only() -> None:
    sampled = {}
    for policy in ("chain", "lru"):
        manager = managers(policy)[1]
        assert isinstance(manager, TieringOffloadingManager)
        tell_right_hints(manager, range(3))
        sampled[policy] = {
            sample.name: sample.value
            for sample in read_samples(manager)
            if sample.name.startswith("tiering_hint")
        }
    assert sampled == {
        "chain": {"tiering_hinted_requests": 6, "tiering_hints_followed": 5},
        "lru": {"tiering_hinted_requests": 6},
    }


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

    def note_request(self, keys: Sequence[bytes], **hints: object) -> None:  # type: ignore[override]
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


def conversation_truth() -> tuple[list[BlockRequest], list[list[bytes]], list[bool | None]]:
    """The tiny generated conversation trace (seed 0) by arrival, its study keys, and per
    request whether a later request holds its last block (the truth a hint could tell)."""
    requests = sorted(workload_trace("conversation", "tiny", 0), key=lambda r: r.arrival_s)
    key_lists = study_trace_from_blocks(requests, 512).key_lists
    later: set[bytes] = set()
    truth: list[bool | None] = []
    for keys in reversed(key_lists):
        truth.append(bool(keys) and keys[-1] in later)
        later.update(keys)
    truth.reverse()
    return requests, key_lists, truth


def test_chain_hinted_the_truth_closes_more_of_the_gap() -> None:
    """On a generated conversation trace, chain told which requests are continued holds more
    prefix hits than chain alone (the table in docs/benchmarks.md measures how many)."""
    _, key_lists, truth = conversation_truth()  # 9,072 unique blocks
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


# -- traces carry hints: the study and the replay give them to the policy -------------------


def test_a_block_trace_line_s_hint_is_read_written_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "hinted.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 1024, "hash_ids": [1, 2], "continues": True},
        {"timestamp": 5, "input_length": 1024, "hash_ids": [3, 4], "continues": False},
        {"timestamp": 9, "input_length": 1024, "hash_ids": [1, 2, 5], "continues": None},
        {"timestamp": 9, "input_length": 512, "hash_ids": [6]},
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    requests = read_block_trace(path).requests
    assert [r.continues for r in requests] == [True, False, None, None]
    again = tmp_path / "again.jsonl"
    write_mooncake(requests, again)
    assert [r.continues for r in read_block_trace(again).requests] == [True, False, None, None]
    assert '"continues"' not in again.read_text().splitlines()[2]  # none: not written
    assert [r.continues for r in to_requests(requests, 512)] == [True, False, None, None]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 512, "hash_ids": [1], "continues": 1}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:1: field 'continues': must be true, false"):
        read_block_trace(bad)


def test_a_tiering_jsonl_line_s_hint_is_read_written_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "hinted.jsonl"
    requests = [
        Request("a", np.arange(1, 40), continues=True),
        Request("b", np.arange(1, 50), continues=False),
        Request("c", np.arange(1, 60)),
    ]
    write_jsonl(requests, path)
    assert list(read_jsonl(path)) == requests
    assert Request("c", np.arange(1, 60)) != Request("c", np.arange(1, 60), continues=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "tokens": [1, 2], "continues": "yes"}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:1: field 'continues': must be true, false"):
        list(read_jsonl(bad))


def hinted_conversation_file(tmp_path: Path) -> tuple[Path, list[list[bytes]], list[bool | None]]:
    """The tiny generated conversation trace as a Mooncake file, every request hinted with
    whether a later one holds its last block; its study keys and hints."""
    requests, key_lists, truth = conversation_truth()
    path = tmp_path / "conversation.jsonl"
    hinted = [dataclasses.replace(r, continues=t) for r, t in zip(requests, truth, strict=True)]
    write_mooncake(hinted, path)
    return path, key_lists, truth


def test_policy_study_gives_a_trace_s_hints_to_the_policies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, key_lists, truth = hinted_conversation_file(tmp_path)
    config = tmp_path / "tiering.yaml"
    config.write_text("version: 1\nprimary: {capacity: 1MiB}\nsecondary_tiers: []\n")
    args = ["policy-study", "--config", str(config), "--trace", str(path), "--json"]
    assert cli_main([*args, "--policies", "chain,lru", "--sizes", "0.05", "--no-progress"]) == 0
    rows = {row["policy"]: row for row in json.loads(capsys.readouterr().out)["policy_study"]}
    capacity = rows["chain"]["capacity_blocks"]
    assert capacity == 454  # 5 % of the 9,072 unique blocks, rounded up
    total = sum(map(len, key_lists))

    def ratio(policy: str, hints: list[bool | None] | None) -> float:
        run = simulate_cpu(make(policy, capacity), key_lists, hints=hints)
        return round(sum(prefix_hits(run.flags, key_lists)) / total, 4)

    assert rows["chain"]["prefix_hit_ratio"] == ratio("chain", truth) > ratio("chain", None)
    assert rows["lru"]["prefix_hit_ratio"] == ratio("lru", None)


class _HintRecorder(LRUPolicy):
    name = "test-hint-recorder"
    hints: ClassVar[list[bool | None]] = []

    def note_request(self, keys: Sequence[bytes], continues: bool | None = None) -> None:
        type(self).hints.append(continues)


def test_the_replay_gives_each_request_s_hint_to_the_primary_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(policy_registry, "_registry", dict(policy_registry._registry))
    register_policy(_HintRecorder.name, _HintRecorder)
    _HintRecorder.hints = []
    trace = tmp_path / "hinted.jsonl"
    hints = [True, None, False, True]
    write_jsonl(
        [
            Request(f"r{i}", np.arange(1 + i, 80 + i), arrival_s=i, continues=h)
            for i, h in enumerate(hints)
        ],
        trace,
    )
    cfg = parse_config(
        {
            "version": 1,
            "model": {"shape": "tiny"},
            "hashing": {"hash_block_size": 16},
            "primary": {"capacity": "400KiB", "policy": _HintRecorder.name},
            "secondary_tiers": [],
        },
        source=str(tmp_path / "tiering.yaml"),
        base_dir=tmp_path,
        env={},
    )
    run_replay(cfg, ReplayOptions(trace=str(trace), engine_blocks=512, progress=False))
    assert _HintRecorder.hints == hints


def test_replay_s_policy_study_gives_the_hints_too() -> None:
    _, key_lists, truth = conversation_truth()
    rows = policy_study(key_lists, [453], ["chain", "lru"], hints=truth)
    ratios = {row["policy"]: row["prefix_hit_ratio"] for row in rows}
    total = sum(map(len, key_lists))
    hinted = simulate_cpu(make("chain", 453), key_lists, hints=truth)
    assert ratios["chain"] == round(sum(prefix_hits(hinted.flags, key_lists)) / total, 4)
    unhinted = policy_study(key_lists, [453], ["chain"], hints=[None] * len(key_lists))
    assert unhinted[0]["prefix_hit_ratio"] < ratios["chain"]
