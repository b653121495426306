"""The ``chain`` policy: requests classed by whether they continue an earlier one, victims by
the learned chance of being continued soon; the managers and the replay tell it requests.

The lockstep reference below is written from the module docstring alone (ordered dicts, one
tick per key stored or touched), not from the policy's code.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.config import parse_config
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import InvalidArgumentError, InvalidKeyError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.policies import ChainPolicy, LRUPolicy, register_policy
from tiering.policies import registry as policy_registry
from tiering.policies.chain import ChainClassStats
from tiering.replay import ReplayOptions, run_replay
from tiering.replay.study import simulate_cpu


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


class Reference:
    """The docstring's rule, plainly: class 0 / class 1 ordered dicts of key -> stamp."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.lists: tuple[OrderedDict[bytes, int], OrderedDict[bytes, int]] = (
            OrderedDict(),
            OrderedDict(),
        )
        self.clock = -1  # the last tick given
        self.tails: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self.requests = [0.0, 0.0]
        self.continued = [0.0, 0.0]
        self.delays = [0.0, 0.0]
        self.stored = 0
        self.request: tuple[int, set[bytes], bytes] | None = None

    def held(self, key: bytes) -> bool:
        return key in self.lists[0] or key in self.lists[1]

    def note_request(self, keys: Sequence[bytes]) -> None:
        deepest = None
        for i, key in enumerate(keys):
            if key in self.tails:
                deepest = i
        cls = 0
        if deepest is not None:
            key = keys[deepest]
            old_cls, at = self.tails[key]
            cls = 1
            self.continued[old_cls] += 1
            self.delays[old_cls] += self.clock - at
            if deepest == len(keys) - 1:
                self.tails[key] = (1, self.clock)
                self.tails.move_to_end(key)
            else:
                del self.tails[key]
        self.requests[cls] += 1
        self.request = (cls, set(keys), keys[-1])

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            for lst in self.lists:
                if key in lst:
                    del lst[key]
                    self.clock += 1
                    self.lists[1][key] = self.clock
                    break

    def insert_new(self, keys: Sequence[bytes]) -> None:
        request = self.request
        in_request = request is not None and keys[0] in request[1]
        cls = request[0] if request is not None and in_request else 0
        for key in keys:  # insert_many's order: the last most recent
            self.clock += 1
            self.lists[cls][key] = self.clock
        if request is not None and in_request and request[2] in keys:
            self.tails[request[2]] = (cls, self.clock)
            self.tails.move_to_end(request[2])
            while len(self.tails) > 4 * self.capacity:
                self.tails.popitem(last=False)
        self.stored += len(keys)
        if self.stored >= 10 * self.capacity:
            self.stored = 0
            for counts in (self.requests, self.continued, self.delays):
                counts[0] /= 2
                counts[1] /= 2

    def rank(self, cls: int, stamp: int) -> float:
        all_requests = sum(self.requests)
        all_continued = sum(self.continued)
        pooled_share = all_continued / all_requests if all_requests else 0.5
        pooled_delay = sum(self.delays) / all_continued if all_continued else self.capacity
        share = (self.continued[cls] + 4 * pooled_share) / (self.requests[cls] + 4)
        share = min(max(share, 1e-3), 1 - 1e-3)
        delay = max((self.delays[cls] + 4 * pooled_delay) / (self.continued[cls] + 4), 1.0)
        s = math.exp(-(self.clock - stamp) / delay)
        chance = share * s * (1 - math.exp(-self.capacity / delay)) / (1 - share + share * s)
        return math.log(chance) if chance > 0 else -math.inf

    def evict(self, n: int, protected: set[bytes]) -> list[bytes]:
        taken: list[bytes] = []
        for _ in range(n):
            heads = [next((k for k in lst if k not in protected), None) for lst in self.lists]
            if heads[0] is None and heads[1] is None:
                break
            if heads[1] is None or (
                heads[0] is not None
                and self.rank(0, self.lists[0][heads[0]]) <= self.rank(1, self.lists[1][heads[1]])
            ):
                cls = 0
            else:
                cls = 1
            key = heads[cls]
            assert key is not None
            del self.lists[cls][key]
            taken.append(key)
        return taken


# -- behaviour, call by call ----------------------------------------------------------------


def test_a_continuation_files_its_new_blocks_with_reused_ones_and_learns_the_delay() -> None:
    policy = ChainPolicy(100)
    first = [k(0), k(1), k(2)]
    policy.note_request(first)
    policy.insert_new(first)  # ticks 0-2: its tail k(2) at tick 2
    assert (policy.t1_keys, policy.t2_keys, policy.tail_keys) == (tuple(first), (), (k(2),))
    other = [k(10), k(11)]
    policy.note_request(other)
    policy.insert_new(other)  # ticks 3-4
    turn = [*first, k(3), k(4)]  # the next turn: the conversation so far, then new blocks
    policy.note_request(turn)  # at tick 4: continues k(2), 2 ticks later
    policy.touch(first)
    policy.insert_new([k(3), k(4)])
    assert policy.t1_keys == (k(10), k(11))
    assert set(policy.t2_keys) == {k(0), k(1), k(2), k(3), k(4)}
    assert policy.tail_keys == (k(11), k(4))  # k(2) was continued: forgotten
    assert policy.class_stats == (ChainClassStats(2, 1, 2), ChainClassStats(1, 0, 0))


def test_a_prompt_read_again_whole_keeps_its_tail() -> None:
    policy = ChainPolicy(10)
    prompt = [k(0), k(1)]
    policy.note_request(prompt)
    policy.insert_new(prompt)
    policy.note_request(prompt)
    policy.touch(prompt)
    assert policy.tail_keys == (k(1),)
    assert policy.class_stats == (ChainClassStats(1, 1, 0), ChainClassStats(1, 0, 0))
    assert policy.t2_keys == (k(1), k(0))  # reused: the head most recent


def test_a_request_told_at_its_end_moves_its_blocks_when_it_continued() -> None:
    """vLLM's order: stores first, the request whole at its end."""
    policy = ChainPolicy(100)
    first = [k(0), k(1)]
    policy.insert_new(first)
    policy.note_finished_request(first)  # fresh: its blocks stay in T1, its tail remembered
    assert (policy.t1_keys, policy.t2_keys, policy.tail_keys) == (tuple(first), (), (k(1),))
    turn = [*first, k(2), k(3)]
    policy.insert_new([k(2), k(3)])
    policy.note_finished_request(turn)  # continues k(1): its new blocks move to T2
    assert policy.t1_keys == ()
    assert set(policy.t2_keys) == set(turn)
    assert policy.tail_keys == (k(3),)
    assert policy.class_stats == (ChainClassStats(1, 1, 2), ChainClassStats(1, 0, 0))
    policy.note_finished_request([k(0)])  # ends inside a prefix held before: starts no tail
    assert policy.tail_keys == (k(3),)


def test_stores_of_no_noted_request_are_fresh() -> None:
    policy = ChainPolicy(10)
    policy.note_request([k(0), k(1)])
    policy.insert_new([k(5)])  # not the noted request's
    policy.insert_new([k(0), k(1)])
    assert policy.t1_keys == (k(5), k(0), k(1))
    assert policy.tail_keys == (k(1),)


def test_the_victim_is_the_head_least_likely_to_be_continued_soon() -> None:
    # A conversation continued every few requests (class 1, continued 2 times of 3, after 3
    # ticks) among one-off prompts never continued (class 0: 1 of 16, the conversation's
    # first request). Emptied down to 8 blocks, it keeps the conversation's first blocks
    # (100, 101) and takes one-offs newer than them (9, 10); LRU takes the conversation.
    policy, ref, lru = ChainPolicy(50), Reference(50), LRUPolicy(50)
    one_off = 0

    def one_offs(count: int) -> None:
        nonlocal one_off
        for key in (k(i) for i in range(one_off, one_off + count)):
            for p in (policy, ref):
                p.note_request([key])
                p.insert_new([key])
            lru.insert_new([key])
        one_off += count

    conversation: list[bytes] = []
    for turn in range(4):
        new = [k(100 + 2 * turn), k(101 + 2 * turn)]
        request = [*conversation, *new]
        for p in (policy, ref):
            p.note_request(request)
            p.touch(conversation)
            p.insert_new(new)
        lru.touch(conversation)
        lru.insert_new(new)
        conversation = request
        one_offs(3)
    one_offs(3)
    assert policy.class_stats == (ChainClassStats(16, 1, 3), ChainClassStats(3, 2, 6))
    victims = policy.evict(15)
    assert victims is not None
    assert victims == ref.evict(15, set())
    assert [int.from_bytes(v, "big") for v in victims] == [*range(9), 105, 104, 103, 9, 102, 10]
    assert [int.from_bytes(v, "big") for v in lru.evict(15) or []] == [
        *range(9),
        105,
        104,
        103,
        102,
        101,
        100,
    ]


def test_protected_and_pinned_heads_are_passed_over() -> None:
    policy = ChainPolicy(10)
    policy.note_request([k(0), k(1), k(2)])
    policy.insert_new([k(0), k(1), k(2)])
    policy.set_evictable(k(0), False)
    assert policy.evict(1, protected={k(1)}) == [k(2)]
    assert policy.evict(2) is None  # k(0) pinned: one evictable key left, nothing changed
    assert list(policy) == [k(0), k(1)]


def test_tails_are_bounded_and_counts_halve() -> None:
    policy = ChainPolicy(2)
    for i in range(12):  # 12 one-key requests: 8 tails kept (4 x capacity)
        policy.note_request([k(i)])
        policy.insert_new([k(i)])
        if len(policy) > 2:
            assert policy.evict(1) is not None
    assert policy.tail_keys == tuple(k(i) for i in range(4, 12))
    # 20 stored blocks (10 x capacity) halved the counts once, at the 20th: 12 - 20/2 ...
    assert policy.class_stats[0].requests == 12  # 12 stored: not yet
    for i in range(12, 20):
        policy.note_request([k(i)])
        policy.insert_new([k(i)])
        policy.evict(1)
    assert policy.class_stats[0].requests == 10  # 20 requests, halved at the 20th store


def test_a_key_for_a_request_is_a_typed_error() -> None:
    policy = ChainPolicy(10)
    with pytest.raises(InvalidKeyError, match=r"note_request\(\) takes a sequence of keys"):
        policy.note_request(k(0))  # type: ignore[arg-type]
    assert policy.class_stats == (ChainClassStats(0, 0, 0), ChainClassStats(0, 0, 0))


def test_clear_forgets_what_was_learned() -> None:
    policy = ChainPolicy(10)
    policy.note_request([k(0)])
    policy.insert_new([k(0)])
    policy.clear()
    assert (len(policy), policy.tail_keys) == (0, ())
    assert policy.class_stats == (ChainClassStats(0, 0, 0), ChainClassStats(0, 0, 0))


# -- lockstep with the reference -------------------------------------------------------------

_conversations = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 4), st.booleans()), min_size=1, max_size=60
)


@settings(max_examples=150, deadline=None)
@given(steps=_conversations, capacity=st.integers(4, 12))
def test_victims_and_lists_match_the_reference(
    steps: list[tuple[int, int, bool]], capacity: int
) -> None:
    """Conversations that go on or start over, as the study drives a policy."""
    policy, ref = ChainPolicy(capacity), Reference(capacity)
    histories: dict[int, list[bytes]] = {}
    fresh = 1000
    for conversation, new_blocks, restart in steps:
        history = [] if restart else histories.get(conversation, [])
        new = [k(fresh + i) for i in range(new_blocks)]
        fresh += new_blocks
        request = (history + new)[-capacity:]
        histories[conversation] = request
        held = [key for key in request if key in policy]
        assert held == [key for key in request if ref.held(key)]
        missing = [key for key in request if key not in policy]
        for p in (policy, ref):
            p.note_request(request)
        if held:
            policy.touch(request)
            ref.touch(request)
        shortfall = len(policy) + len(missing) - capacity
        if shortfall > 0:
            victims = policy.evict(shortfall, set(request))
            assert victims is not None
            assert victims == ref.evict(shortfall, set(request))
        if missing:
            policy.insert_new(missing)
            ref.insert_new(missing)
        assert policy.t1_keys == tuple(ref.lists[0])
        assert policy.t2_keys == tuple(ref.lists[1])
        assert policy.tail_keys == tuple(ref.tails)
    assert list(policy)[: len(policy)] == _reference_order(ref)


def _reference_order(ref: Reference) -> list[bytes]:
    order = []
    while ref.lists[0] or ref.lists[1]:
        order += ref.evict(1, set())
    return order


# -- managers and the replay tell it requests -----------------------------------------------


class _Recording(LRUPolicy):
    name = "test-recording"
    noted: list[list[bytes]] = []

    def note_request(self, keys: Sequence[bytes]) -> None:
        type(self).noted.append(list(keys))


def test_the_managers_pass_a_request_on_to_the_primary_policy(tmp_path: Path) -> None:
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(3)]
    manager = CPUOffloadingManager(4, "chain")
    manager.note_request(keys)
    out = manager.prepare_store(keys)
    assert out is not None
    manager.complete_store(out.keys_to_store)
    policy = manager.policy
    assert isinstance(policy, ChainPolicy)
    assert policy.tail_keys == (keys[-1],)
    assert policy.class_stats[0].requests == 1
    more = [*keys, make_offload_key((9).to_bytes(32, "big"), 0)]
    out = manager.prepare_store(more)
    assert out is not None
    manager.complete_store(out.keys_to_store)
    manager.note_request(more, ended=True)  # at its end: it continued the first request
    assert policy.class_stats[0].continued == 1 and more[-1] in policy.t2_keys
    with pytest.raises(InvalidArgumentError):
        manager.note_request(keys, "req-1")  # req_context is keyword-only
    with pytest.raises(InvalidKeyError):
        manager.note_request(["not a key"])  # type: ignore[list-item]


def test_the_replay_notes_each_request_once_before_its_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(policy_registry, "_registry", dict(policy_registry._registry))
    register_policy(_Recording.name, _Recording)
    _Recording.noted = []
    cfg = parse_config(
        {
            "version": 1,
            "model": {"shape": "tiny"},
            "hashing": {"hash_block_size": 16},
            "primary": {"capacity": "400KiB", "policy": _Recording.name},
            "secondary_tiers": [],
        },
        source=str(tmp_path / "tiering.yaml"),
        base_dir=tmp_path,
        env={},
    )
    options = ReplayOptions(trace="chat", scale="tiny", seed=3, engine_blocks=512, progress=False)
    report = run_replay(cfg, options)
    assert len(_Recording.noted) == report["requests"]
    assert all(_Recording.noted)


def test_chain_in_a_tiering_manager_and_in_the_study_agree() -> None:
    def key(i: int) -> OffloadKey:
        return make_offload_key(i.to_bytes(32, "big"), 0)

    key_lists = [[key(10 * r + i) for i in range(3)] for r in (0, 1)]
    key_lists.append([*key_lists[0], key(99)])  # the first request's next turn
    manager = TieringOffloadingManager(
        CPUOffloadingManager(8, "chain"), [], pool=torch.zeros(8, 8, dtype=torch.uint8)
    )
    manager.wait_ready()
    try:
        flags = bytearray()
        for request in key_lists:
            manager.note_request(request)
            hits = [manager.lookup(k) is True for k in request]
            flags += bytes(hits)
            if any(hits):
                manager.touch(request)
            out = manager.prepare_store(request)
            assert out is not None
            manager.complete_store(out.keys_to_store)
        assert flags == simulate_cpu(ChainPolicy(8), cast("list[list[bytes]]", key_lists)).flags
        assert flags[-4:] == bytes([1, 1, 1, 0])
        policy = manager.primary.policy
        assert isinstance(policy, ChainPolicy)
        assert policy.class_stats[0].continued == 1
    finally:
        manager.shutdown()


@settings(max_examples=60, deadline=None)
@given(
    requests=st.lists(st.lists(st.integers(0, 20), min_size=1, max_size=6), max_size=60),
    capacity=st.integers(2, 8),
)
def test_told_no_requests_it_is_lru(requests: list[list[int]], capacity: int) -> None:
    """Under a caller that never calls ``note_request`` (vLLM's drop-in) both classes learn
    nothing alike, and the older head goes: LRU's victims, call for call."""
    chain, lru = ChainPolicy(capacity), LRUPolicy(capacity)
    for request in requests:
        keys = list(dict.fromkeys(k(i) for i in request))
        held = [key for key in keys if key in lru]
        assert held == [key for key in keys if key in chain]
        for p in (chain, lru):
            p.touch(keys)
        missing = [key for key in keys if key not in lru][-capacity:]
        shortfall = len(lru) + len(missing) - capacity
        if shortfall > 0:
            assert chain.evict(shortfall, set(keys)) == lru.evict(shortfall, set(keys))
        for p in (chain, lru):
            p.insert_new(missing)
    assert list(chain) == list(lru)


_ops = st.lists(
    st.tuples(
        st.sampled_from(["note", "note_end", "touch", "store", "pin", "unpin", "evict"]),
        st.lists(st.integers(0, 9), min_size=1, max_size=4, unique=True),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops=_ops)
def test_notes_in_any_order_keep_what_is_held_and_pinned(ops: list[tuple[str, list[int]]]) -> None:
    """Any interleaving of notes (either form), touches, stores, pins and evictions: a note
    changes no held key and no pin, and no eviction returns a pinned or protected key."""
    policy = ChainPolicy(6)
    pinned: set[bytes] = set()
    for op, ids in ops:
        keys = [k(i) for i in ids]
        held = {key for key in map(k, range(10)) if key in policy}
        if op in ("note", "note_end"):
            (policy.note_request if op == "note" else policy.note_finished_request)(keys)
            assert {key for key in map(k, range(10)) if key in policy} == held
            assert all(not _evictable(policy, key) for key in pinned)
        elif op == "touch":
            policy.touch(keys)
        elif op == "store":
            missing = [key for key in keys if key not in policy]
            policy.insert_new(missing, evictable=False)  # written, then made ready
            policy.set_evictable_many(missing, True)
        elif op in ("pin", "unpin"):
            chosen = [key for key in keys if key in policy and (key in pinned) == (op == "unpin")]
            policy.set_evictable_many(chosen, op == "unpin")
            pinned.symmetric_difference_update(chosen)
        else:
            protected = set(keys[:1])
            victims = policy.evict(1, protected) or []
            assert not set(victims) & (pinned | protected)
            assert set(victims) <= held


def _evictable(policy: ChainPolicy, key: bytes) -> bool:
    return policy._t1.is_evictable(key) and policy._t2.is_evictable(key)
