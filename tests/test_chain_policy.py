"""The ``chain`` policy: requests classed by whether they continue an earlier one, victims by
the learned chance of being continued soon; the managers and the replay tell it requests.

The lockstep reference below is written from the module docstring alone (ordered dicts, one
tick per key stored or touched), not from the policy's code.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tiering.config import parse_config
from tiering.config.workload_shape import parse_shape
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import InvalidArgumentError, InvalidKeyError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.policies import ChainPolicy, LRUPolicy, register_policy
from tiering.policies import registry as policy_registry
from tiering.policies._chain_ranks import delay_bin, rank_knots
from tiering.policies._chain_search import rank_at, sure_stamp
from tiering.policies._two_lists import stamped_keys
from tiering.policies.chain import ChainClassStats
from tiering.replay import ReplayOptions, run_replay
from tiering.replay.study import prefix_hits, simulate_cpu, study_trace_from_blocks
from tiering.replay.workloads import workload_trace


def k(i: int) -> bytes:
    return i.to_bytes(4, "big")


class Reference:
    """The docstring's rule, plainly: four ordered dicts of key -> stamp (classes 0-2, then
    the shared list), tails, the shared list's ghosts, counts."""

    def __init__(self, capacity: int, reach: int = 32) -> None:
        self.capacity = capacity
        self.reach = reach  # tails past the last two keys: in the last 1/reach of a request
        self.lists: list[OrderedDict[bytes, int]] = [OrderedDict() for _ in range(4)]
        self.clock = -1  # the last tick given
        self.tails: OrderedDict[bytes, tuple[int, int, int]] = OrderedDict()
        self.ghosts: OrderedDict[bytes, int] = OrderedDict()
        self.to_shared: set[bytes] = set()
        self.requests = [0.0] * 4
        self.continued = [0.0] * 4
        self.delays = [[0.0] * 64 for _ in range(4)]
        self.stored = 0
        self.request: tuple[int, set[bytes]] | None = None
        self.ranks: list[list[float]] | None = None
        self.since = 0  # requests noted since the ranks were computed
        self.window_start = -1  # the clock at the last halving
        self.ticks_per_store = 1.0

    def class_of(self, key: bytes) -> int | None:
        return next((c for c in range(4) if key in self.lists[c]), None)

    def held(self, key: bytes) -> bool:
        return self.class_of(key) is not None

    def note_request(self, keys: Sequence[bytes]) -> None:
        self.to_shared = {key for key in keys if key in self.ghosts}
        for key in keys:  # a use that ends a wait of an evicted shared block
            if key in self.to_shared:
                self.continued[3] += 1
                self.requests[3] += 1
                self.delays[3][int(2 * math.log2(self.clock - self.ghosts.pop(key) + 1))] += 1
        found = next((key for key in reversed(keys) if key in self.tails), None)
        cls = 0
        if found is not None:
            old_cls, at, depth = self.tails.pop(found)
            self.continued[old_cls] += 1
            self.delays[old_cls][int(2 * math.log2(self.clock - at + 1))] += 1
            if depth <= 4:  # a continuation; deeper, a branch: class 0, found as any key
                cls = min(2, old_cls + 1)
            else:
                found = None
        self.requests[cls] += 1
        self.since += 1
        for depth in (64, 32, 16, 8, 4, 2, 1):  # the deepest first
            if depth <= min(len(keys), max(2, len(keys) // self.reach)):
                key = keys[-depth]
                if key == found or not self.held(key):
                    self.tails[key] = (cls, self.clock, depth)
                    self.tails.move_to_end(key)
        while len(self.tails) > 4 * self.capacity:
            self.tails.popitem(last=False)
        self.request = (cls, set(keys))

    def touch(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        for key in keys:  # a use of a shared block ends a wait and starts one
            if key in self.lists[3]:
                self.continued[3] += 1
                self.requests[3] += 1
                self.delays[3][int(2 * math.log2(self.clock - self.lists[3][key] + 1))] += 1
        request = self.request
        target = 1
        if request is not None and keys[0] in request[1]:
            target = request[0] or 3  # continuing nothing: what it uses is shared
        if target == 3:
            self.requests[3] += sum(1 for key in keys if self.class_of(key) in (0, 1, 2))
        for key in reversed(keys):  # up to the target class, keys[0] last
            cls = self.class_of(key)
            if cls is not None and cls <= target:
                del self.lists[cls][key]
                self.clock += 1
                self.lists[target][key] = self.clock
        for key in reversed(keys):  # then the keys of a higher class, in their class
            cls = self.class_of(key)
            if cls is not None and cls > target:
                del self.lists[cls][key]
                self.clock += 1
                self.lists[cls][key] = self.clock

    def insert_new(self, keys: Sequence[bytes]) -> None:
        request = self.request
        in_request = request is not None and keys[0] in request[1]
        cls = request[0] if request is not None and in_request else 0
        ordered = list(reversed(keys)) if in_request else list(keys)
        back = self.to_shared if in_request else set()
        # The class's keys, then the request's ghosts, back to the shared list.
        for key in [key for key in ordered if key not in back] + [k for k in ordered if k in back]:
            self.clock += 1
            self.lists[3 if key in back else cls][key] = self.clock
        self.stored += len(keys)
        if self.stored >= 10 * self.capacity:
            self.ticks_per_store = (self.clock - self.window_start) / self.stored
            self.window_start = self.clock
            self.stored = 0
            for c in range(4):
                self.requests[c] /= 2
                self.continued[c] /= 2
                self.delays[c] = [count / 2 for count in self.delays[c]]

    def tables(self) -> list[list[float]]:
        """Per class, ranks at ages 2**(j/2) - 1, each the least of those at younger ages;
        computed when first needed and again after 64 more requests."""
        if self.ranks is not None and self.since < 64:
            return self.ranks
        self.since = 0
        ratio = self.ticks_per_store
        if self.stored >= self.capacity:
            ratio = (self.clock - self.window_start) / self.stored
        horizon = max(1, round(self.capacity * ratio))
        requests, continued = sum(self.requests[:3]), sum(self.continued[:3])
        pooled_share = continued / requests if requests else 0.5
        pooled = [sum(self.delays[c][b] for c in range(3)) for b in range(64)]
        if sum(pooled):
            prior = [4 * count / sum(pooled) for count in pooled]
        else:
            prior = [0.0] * 64
            prior[int(2 * math.log2(self.capacity + 1))] = 4
        self.ranks = []
        for cls in range(4):
            prior_share = pooled_share if cls < 3 else 0.5
            share = (self.continued[cls] + 4 * prior_share) / (self.requests[cls] + 4)
            share = min(max(share, 1e-3), 1 - 1e-3)
            weights = [count + extra for count, extra in zip(self.delays[cls], prior, strict=True)]
            knots = [0.0]
            for weight in weights:
                knots.append(knots[-1] + weight / sum(weights))

            def cdf(t: float, knots: list[float] = knots) -> float:
                x = 2 * math.log2(t + 1)
                b = int(x)
                return 1.0 if b >= 64 else knots[b] + (knots[b + 1] - knots[b]) * (x - b)

            def mean(age: float, knots: list[float] = knots) -> float:
                """F's mean over [age, age + horizon], exactly: in a bin F is linear in
                x = 2 log2(t + 1), whose integral is (t + 1)(x - 2/ln 2)."""
                end = age + horizon
                area = max(0.0, end - max(age, 2**32 - 1))  # F = 1 past the last bin

                def integral_of_x(t: float) -> float:
                    return (t + 1) * (2 * math.log2(t + 1) - 2 / math.log(2))

                for b in range(64):
                    low, high = max(age, 2 ** (b / 2) - 1), min(end, 2 ** ((b + 1) / 2) - 1)
                    if low < high:
                        slope = knots[b + 1] - knots[b]
                        area += (knots[b] - slope * b) * (high - low)
                        area += slope * (integral_of_x(high) - integral_of_x(low))
                return area / horizon

            ranks: list[float] = []
            for j in range(64):
                age = 2 ** (j / 2) - 1
                chance = share * (cdf(age + horizon) - knots[j])
                chance /= max(1e-12, 1 - share * mean(age))
                ranks.append(min([chance, *ranks[-1:]]))
            self.ranks.append(ranks)
        return self.ranks

    def rank(self, cls: int, stamp: int) -> float:
        ranks = self.tables()[cls]
        x = 2 * math.log2(self.clock - stamp + 1)
        j = int(x)
        return ranks[-1] if j >= 63 else ranks[j] + (ranks[j + 1] - ranks[j]) * (x - j)

    def evict(self, n: int, protected: set[bytes]) -> list[bytes]:
        taken: list[bytes] = []
        for _ in range(n):
            heads = [next((k for k in lst if k not in protected), None) for lst in self.lists]
            ranked = [
                (self.rank(c, self.lists[c][key]), self.lists[c][key], c)
                for c, key in enumerate(heads)
                if key
            ]
            if not ranked:
                break
            cls = min(ranked)[2]
            key = heads[cls]
            assert key is not None
            stamp = self.lists[cls].pop(key)
            if cls == 3:  # remembered as a ghost
                self.ghosts[key] = stamp
            taken.append(key)
        while len(self.ghosts) > 2 * self.capacity:
            self.ghosts.popitem(last=False)
        return taken


def _lists(policy: ChainPolicy) -> tuple[tuple[bytes, ...], ...]:
    return tuple(policy.list_keys(c) for c in range(3))


def _stamps(policy: ChainPolicy) -> list[dict[bytes, int]]:
    return [dict(stamped_keys(order)) for order in policy._lists]


def _stats(requests: int, continued: int, **delays: int) -> ChainClassStats:
    bins = [0.0] * 64
    for name, count in delays.items():
        bins[int(name[1:])] = count
    return ChainClassStats(requests, continued, tuple(bins))


# -- behaviour, call by call ----------------------------------------------------------------


def test_a_continuation_moves_up_a_class_and_learns_the_delay() -> None:
    policy = ChainPolicy(100)
    first = [k(0), k(1), k(2)]
    policy.note_request(first)  # at tick -1: its last two keys are its tails
    policy.insert_new(first)  # ticks 0-2, the deepest oldest
    assert _lists(policy) == ((k(2), k(1), k(0)), (), ())
    assert policy.tail_keys == (k(1), k(2))
    other = [k(10), k(11)]
    policy.note_request(other)
    policy.insert_new(other)  # ticks 3-4
    turn = [*first, k(3), k(4)]  # the next turn: the conversation so far, then new blocks
    policy.note_request(turn)  # at tick 4: continues k(2), 5 ticks later (bin 5)
    policy.touch(first)
    policy.insert_new([k(3), k(4)])
    assert _lists(policy) == ((k(11), k(10)), (k(2), k(1), k(0), k(4), k(3)), ())
    assert policy.tail_keys == (k(1), k(10), k(11), k(3), k(4))  # k(2) continued: forgotten
    assert policy.class_stats == (_stats(2, 1, b5=1), _stats(1, 0), _stats(0, 0), _stats(0, 0))
    third = [*turn, k(5)]  # continues class 1: class 2, and so on (at most 2)
    policy.note_request(third)
    policy.touch(turn)
    policy.insert_new([k(5)])
    assert _lists(policy)[2] == (k(4), k(3), k(2), k(1), k(0), k(5))
    policy.note_request([*third, k(6)])
    assert policy.class_stats[2].requests == 2
    assert policy.class_stats[1].continued == policy.class_stats[2].continued == 1


def test_a_document_asked_about_again_continues_at_its_last_block() -> None:
    """A question that fills a block of its own hides the document's last block: the
    second-to-last key is a tail too (deeper ones only near the end of a long request)."""
    policy = ChainPolicy(100)
    document = [k(0), k(1), k(2)]
    policy.note_request([*document, k(50)])
    policy.insert_new([*document, k(50)])
    assert policy.tail_keys == (k(2), k(50))  # depth 4 is k(0), far from the end: no tail
    policy.note_request([*document, k(60)])  # continues k(2); k(60) is new, k(2) its own again
    assert policy.tail_keys == (k(50), k(2), k(60))
    assert policy.class_stats[1].requests == 1


def test_a_question_far_from_the_shared_point_is_a_branch() -> None:
    """In small blocks a question fills many, and the document's last block is keys from the
    request's end: the keys at depths 1, 2, 4, ... in a request's last 1/32 are tails.
    Through one more than 4 deep a request branches: the continued class learns a
    continuation, the request is class 0 and what it uses is shared."""
    policy = ChainPolicy(1000)
    document = [k(i) for i in range(300)]
    first = [*document, *(k(1000 + i) for i in range(8))]  # 308 keys: tails to depth 9
    policy.note_request(first)
    policy.insert_new(first)
    assert policy.tail_keys == (k(1000), k(1004), k(1006), k(1007))  # depths 8, 4, 2, 1
    second = [*first[:301], *(k(2000 + i) for i in range(6))]  # holds k(1000), 8 deep
    policy.note_request(second)
    policy.touch(second[:301])
    policy.insert_new(second[301:])
    stats = policy.class_stats
    assert (stats[0].requests, stats[0].continued, stats[1].requests) == (2, 1, 0)
    assert policy.list_keys(3) == tuple(reversed(second[:301]))  # what it used: shared
    # k(1000) is forgotten (found, then held: a tail only as any other key); k(299) is held
    assert policy.tail_keys == (k(1004), k(1006), k(1007), k(2002), k(2004), k(2005))


def test_a_shared_prefix_held_before_is_nobodys_tail() -> None:
    policy = ChainPolicy(100)
    policy.note_request([k(0), k(1), k(2)])  # a system prompt k(0), then a message
    policy.insert_new([k(0), k(1), k(2)])
    policy.note_request([k(0), k(3)])  # k(0) is held and continues nothing: not a tail
    assert policy.tail_keys == (k(1), k(2), k(3))
    assert policy.class_stats[0].requests == 2


def test_blocks_a_request_continuing_nothing_uses_are_shared_and_stay_shared() -> None:
    policy = ChainPolicy(100)
    system = [k(1), k(2)]
    policy.note_request([*system, k(10), k(11)])  # stores the system prompt: tails k(10), k(11)
    policy.insert_new([*system, k(10), k(11)])
    policy.note_request([*system, k(20)])  # continues nothing: the prompt it uses is shared
    policy.touch([*system, k(20)])
    policy.insert_new([k(20)])
    assert policy.list_keys(3) == (k(2), k(1))  # keys[0] the most recent
    assert policy.class_stats[3].requests == 2  # two waits begun, none ended yet
    policy.note_request([*system, k(20), k(21)])  # continues k(20): class 1
    policy.touch([*system, k(20), k(21)])
    policy.insert_new([k(21)])
    assert policy.list_keys(3) == (k(2), k(1))  # still shared, used again
    assert policy.list_keys(1) == (k(20), k(21))
    stats = policy.class_stats[3]
    assert (stats.requests, stats.continued, sum(stats.delay_bins)) == (4, 2, 2)


def test_a_shared_victim_is_a_ghost_that_comes_back_shared() -> None:
    policy = ChainPolicy(8)
    system = [k(1), k(2)]
    policy.note_request([*system, k(10), k(11)])
    policy.insert_new([*system, k(10), k(11)])
    policy.note_request([*system, k(20)])
    policy.touch([*system, k(20)])
    policy.insert_new([k(20)])
    victims = policy.evict(2, protected={k(10), k(11), k(20)})
    assert victims is not None and sorted(victims) == system
    policy.note_request([*system, k(30)])  # its system blocks were ghosts: two waits ended
    assert policy.class_stats[3].continued == 2
    policy.insert_new([*system, k(30)])
    assert (policy.list_keys(3), policy.list_keys(0)[-1:]) == ((k(2), k(1)), (k(30),))
    policy.note_request([*system, k(40)])  # no longer ghosts: nothing more learned
    assert policy.class_stats[3].continued == 2


def test_told_at_its_end_a_request_continuing_nothing_makes_what_it_used_shared() -> None:
    """vLLM's order: the uses and stores first, the request whole at its end."""
    policy = ChainPolicy(100)
    policy.insert_new([k(1), k(2), k(10), k(11)])
    policy.note_finished_request([k(1), k(2), k(10), k(11)])
    policy.touch([k(1), k(2)])  # a later request uses the system prompt: class 1 for now
    policy.insert_new([k(20)])
    assert policy.list_keys(1) == (k(2), k(1))
    policy.note_finished_request([k(1), k(2), k(20)])  # continues nothing
    assert (policy.list_keys(1), policy.list_keys(3)) == ((), (k(2), k(1)))
    assert k(20) in policy.list_keys(0)


def test_a_request_told_at_its_end_moves_its_blocks_when_it_continued() -> None:
    """vLLM's order: stores first, the request whole at its end."""
    policy = ChainPolicy(100)
    first = [k(0), k(1)]
    policy.insert_new(first)  # no request noted: class 0, in the order given
    policy.note_finished_request(first)  # fresh: its blocks stay, its tails remembered
    assert (_lists(policy), policy.tail_keys) == (((k(0), k(1)), (), ()), (k(0), k(1)))
    turn = [*first, k(2), k(3)]
    policy.insert_new([k(2), k(3)])
    policy.note_finished_request(turn)  # continues k(1): its blocks move to class 1
    assert _lists(policy) == ((), (k(3), k(2), k(1), k(0)), ())
    assert policy.tail_keys == (k(0), k(2), k(3))
    assert policy.class_stats == (_stats(1, 1, b3=1), _stats(1, 0), _stats(0, 0), _stats(0, 0))
    policy.note_finished_request([k(0), k(1)])  # continues the first request's tail k(0);
    assert policy.tail_keys == (k(2), k(3), k(0))  # k(1), a block it used, is no tail of its


def test_stores_of_no_noted_request_are_fresh_in_the_order_given() -> None:
    policy = ChainPolicy(10)
    policy.note_request([k(0), k(1)])
    policy.insert_new([k(5), k(6)])  # not the noted request's
    policy.insert_new([k(0), k(1)])
    assert _lists(policy) == ((k(5), k(6), k(1), k(0)), (), ())


def test_the_victim_is_the_head_least_likely_to_be_continued_soon() -> None:
    # A conversation continued every few requests among one-off prompts never continued:
    # emptied down to a few blocks, it keeps the conversation's first blocks and takes
    # one-offs newer than them; LRU takes the whole conversation.
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
    victims = policy.evict(15)
    assert victims is not None
    assert victims == ref.evict(15, set())
    assert [int.from_bytes(v, "big") for v in victims] == [
        *range(9),
        105,  # the conversation's deepest blocks first: useless without those before them
        104,
        103,
        102,
        9,  # one-offs newer than the conversation's first blocks go before them
        10,
    ]
    assert [int.from_bytes(v, "big") for v in lru.evict(15) or []] == [
        *range(9),
        105,
        104,
        103,
        102,
        101,
        100,
    ]


def test_of_two_blocks_as_likely_back_the_one_back_sooner_ranks_higher() -> None:
    """Hit density: half of each class's requests are continued, all within the horizon
    (2,000 ticks), one class's after about 10 ticks, the other's after about 900; by the
    chance alone both rank 0.5 when fresh, but the one back sooner frees its place sooner.
    Expected: 0.5 / (1 - 0.5 M), M the mean of F over the horizon (by 200,000 trapezoids)."""
    tables = []
    for delay_ticks in (10, 900):
        bins = [0.0] * 64
        bins[delay_bin(delay_ticks)] = 1.0
        tables.append(rank_knots(0.5, list(itertools.accumulate(bins, initial=0.0)), 2000))
    soon, late = tables
    assert soon[0] == pytest.approx(0.5 / (1 - 0.5 * 0.99571933), rel=1e-6)
    assert late[0] == pytest.approx(0.5 / (1 - 0.5 * 0.56780307), rel=1e-6)
    assert all(s > lt for s, lt in zip(soon[: delay_bin(10)], late, strict=False))


def test_protected_and_pinned_heads_are_passed_over() -> None:
    policy = ChainPolicy(10)
    policy.note_request([k(0), k(1), k(2)])
    policy.insert_new([k(0), k(1), k(2)])  # the deepest oldest: k(2), k(1), k(0)
    policy.set_evictable(k(2), False)
    assert policy.evict(1, protected={k(1)}) == [k(0)]
    assert policy.evict(2) is None  # k(2) pinned: one evictable key left, nothing changed
    assert list(policy) == [k(2), k(1)]


def test_tails_are_bounded_and_counts_halve() -> None:
    policy = ChainPolicy(2)
    for i in range(12):  # 12 one-key requests: 8 tails kept (4 x capacity)
        policy.note_request([k(i)])
        policy.insert_new([k(i)])
        if len(policy) > 2:
            assert policy.evict(1) is not None
    assert policy.tail_keys == tuple(k(i) for i in range(4, 12))
    assert policy.class_stats[0].requests == 12  # 12 stored: not yet halved
    for i in range(12, 20):
        policy.note_request([k(i)])
        policy.insert_new([k(i)])
        policy.evict(1)
    assert policy.class_stats[0].requests == 10  # 20 requests, halved at the 20th store


def test_a_key_for_a_request_is_a_typed_error() -> None:
    policy = ChainPolicy(10)
    with pytest.raises(InvalidKeyError, match=r"note_request\(\) takes a sequence of keys"):
        policy.note_request(k(0))  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError, match=r"note_finished_request\(\) takes a sequence"):
        policy.note_finished_request(k(0))  # type: ignore[arg-type]
    assert policy.class_stats == (_stats(0, 0),) * 4


def test_clear_forgets_what_was_learned() -> None:
    policy = ChainPolicy(10)
    policy.note_request([k(0)])
    policy.insert_new([k(0)])
    policy.note_request([k(0), k(1)])
    policy.clear()
    assert (len(policy), policy.tail_keys) == (0, ())
    assert policy.class_stats == (_stats(0, 0),) * 4
    policy.insert_new([k(1), k(0)])  # no request noted any more: the order given
    assert _lists(policy) == ((k(1), k(0)), (), ())


# -- lockstep with the reference -------------------------------------------------------------

# (conversation, new blocks, how: 0 goes on, 1 starts over, 2 branches from 3/4 of it)
_conversations = st.lists(
    st.tuples(st.integers(0, 5), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=60
)
_ROOT = [k(1), k(2)]  # a system prompt the even conversations share


def _history(histories: dict[int, list[bytes]], conversation: int, how: int) -> list[bytes]:
    """What a request of ``conversation`` starts from: all of its last request, nothing, or
    its first three quarters (another question about a document: a branch where the tail
    found is more than 4 keys deep)."""
    history = histories.get(conversation, [])
    return history if how == 0 else [] if how == 1 else history[: len(history) * 3 // 4]


def _requests(steps: list[tuple[int, int, int]], capacity: int) -> Iterator[list[bytes]]:
    """The requests of ``steps`` (conversation, new blocks, how it starts: :func:`_history`):
    a conversation's history and its new blocks, after the shared system prompt for even
    conversations, cut to fit ``capacity``."""
    histories: dict[int, list[bytes]] = {}
    fresh = 1000
    for conversation, new_blocks, how in steps:
        history = _history(histories, conversation, how)
        new = [k(fresh + i) for i in range(new_blocks)]
        fresh += new_blocks
        root = _ROOT if conversation % 2 == 0 else []
        own = (history + new)[-(capacity - len(root)) :]
        histories[conversation] = own
        yield root + own


def _misses(request: list[bytes], policy: ChainPolicy, capacity: int) -> tuple[list[bytes], int]:
    """The keys of ``request`` that ``policy`` does not hold, and how many it must evict to
    store them."""
    missing = [key for key in request if key not in policy]
    return missing, len(policy) + len(missing) - capacity


class _SearchedTheGeneralWay(ChainPolicy):
    _PLAIN_SEARCH = False  # the victim search of lists with pinned or released keys


class _ReachingHalfway(ChainPolicy):
    _TAIL_REACH = 2  # tails in a request's second half: deep ones, and branches, in short requests


@pytest.mark.parametrize("policy_class", [ChainPolicy, _SearchedTheGeneralWay, _ReachingHalfway])
@settings(max_examples=150, deadline=None)
@given(steps=_conversations, capacity=st.integers(4, 40))
# A request of class 1 that uses class-2 and shared blocks: the shared stamps follow class 2's.
@example(steps=[(0, 2, 0), (0, 6, 0), (2, 1, 0), (0, 1, 0), (0, 1, 2)], capacity=11)
def test_victims_and_lists_match_the_reference(
    policy_class: type[ChainPolicy], steps: list[tuple[int, int, int]], capacity: int
) -> None:
    """Conversations that go on or start over, half of them after a shared system prompt, as
    the study drives a policy; both searches."""
    policy, ref = policy_class(capacity), Reference(capacity, policy_class._TAIL_REACH)
    for request in _requests(steps, capacity):
        held = [key for key in request if key in policy]
        assert held == [key for key in request if ref.held(key)]
        missing, shortfall = _misses(request, policy, capacity)
        for p in (policy, ref):
            p.note_request(request)
        if held:
            policy.touch(request)
            ref.touch(request)
        if shortfall > 0:
            victims = policy.evict(shortfall, set(request))
            assert victims is not None
            assert victims == ref.evict(shortfall, set(request))
        if missing:
            policy.insert_new(missing)
            ref.insert_new(missing)
        assert (*_lists(policy), policy.list_keys(3)) == tuple(tuple(lst) for lst in ref.lists)
        assert _stamps(policy) == [dict(lst) for lst in ref.lists]  # ages rank the victims
        assert policy.tail_keys == tuple(ref.tails)
        assert policy.class_stats == tuple(
            ChainClassStats(ref.requests[c], ref.continued[c], tuple(ref.delays[c]))
            for c in range(4)
        )
    assert list(policy)[: len(policy)] == _reference_order(ref)


@settings(max_examples=150, deadline=None)
@given(
    steps=_conversations,
    capacity=st.integers(4, 40),
    protect=st.lists(st.integers(0, 11), max_size=8),
    extra=st.integers(0, 3),
)
def test_both_searches_take_the_same_victims_whatever_is_protected(
    steps: list[tuple[int, int, int]], capacity: int, protect: list[int], extra: int
) -> None:
    """The plain search (lists read in place, victims deleted after) and the general one agree
    on the victims, on None where too few keys are unprotected, and on what is left, with
    protected keys anywhere in the lists (the heads included) and every list count."""
    plain, general = ChainPolicy(capacity), _SearchedTheGeneralWay(capacity)
    for request in _requests(steps, capacity):
        missing, shortfall = _misses(request, plain, capacity)
        for policy in (plain, general):
            policy.note_request(request)
            if len(missing) < len(request):
                policy.touch(request)
        if shortfall > 0:
            assert plain.evict(shortfall, set(request)) == general.evict(shortfall, set(request))
        for policy in (plain, general):
            policy.insert_new(missing)
    held = list(plain)
    guard = {held[i] for i in protect if i < len(held)}
    wanted = len(held) - len(guard) + 1 - extra  # from one too many down to a few less
    if wanted > 0:
        victims = plain.evict(wanted, guard)
        assert victims == general.evict(wanted, guard)
        assert (victims is None) == (wanted > len(held) - len(guard))
    assert [plain.list_keys(c) for c in range(4)] == [general.list_keys(c) for c in range(4)]


@settings(max_examples=150, deadline=None)
@given(steps=_conversations, capacity=st.integers(4, 40), stores_in_flight=st.booleans())
def test_both_searches_agree_with_loads_in_flight(
    steps: list[tuple[int, int, int]], capacity: int, stores_in_flight: bool
) -> None:
    """As a connector with a step's copies in flight calls it: a request's hits are pinned
    (a load) and let go one request later, and its stores too if ``stores_in_flight``. The
    plain search passes over the keys pinned in place; the general one parks them. Both take
    the same victims, never a pinned key, and leave the same lists."""
    plain, general = ChainPolicy(capacity), _SearchedTheGeneralWay(capacity)
    loading: list[bytes] = []
    storing: list[bytes] = []
    for request in _requests(steps, capacity):
        in_flight = {*loading, *storing}
        hits = [k for k in itertools.takewhile(plain.__contains__, request) if k not in in_flight]
        missing, shortfall = _misses(request, plain, capacity)
        for policy in (plain, general):
            policy.note_request(request)
            if hits:  # loaded: pinned while the copy is in flight, and used
                policy.pin_evictable(hits)
                policy.touch(hits)
        if shortfall > 0:
            found = [policy.evict(shortfall, set(request)) for policy in (plain, general)]
            assert found[0] == found[1]
            assert found[0] is None or not set(found[0]) & {*in_flight, *hits}
            missing = missing if found[0] is not None else []  # too many pinned: none stored
        for policy in (plain, general):
            policy.insert_new(missing, not stores_in_flight)
            for done in (loading, storing):
                if done:
                    policy.set_evictable_many(done, True)
        loading, storing = hits, missing if stores_in_flight else []
        assert [plain.list_keys(c) for c in range(4)] == [general.list_keys(c) for c in range(4)]
        assert plain.class_stats == general.class_stats


def _reference_order(ref: Reference) -> list[bytes]:
    order = []
    while any(ref.lists):
        order += ref.evict(1, set())
    return order


# -- managers and the replay tell it requests -----------------------------------------------


class _Recording(LRUPolicy):
    name = "test-recording"
    noted: list[list[bytes]] = []

    def note_request(self, keys: Sequence[bytes], continues: bool | None = None) -> None:
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
    assert policy.tail_keys == tuple(keys[-2:])
    assert policy.class_stats[0].requests == 1
    more = [*keys, make_offload_key((9).to_bytes(32, "big"), 0)]
    out = manager.prepare_store(more)
    assert out is not None
    manager.complete_store(out.keys_to_store)
    manager.note_request(more, ended=True)  # at its end: it continued the first request
    assert policy.class_stats[0].continued == 1 and more[-1] in policy.list_keys(1)
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
    """Under a caller that never calls ``note_request`` the classes learn nothing, so they
    rank alike, and the older head goes: LRU's victims, call for call."""
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
    return all(order.is_evictable(key) for order in policy._lists)


@settings(max_examples=300, deadline=None)
@given(
    drops=st.lists(st.sampled_from([0.0, 0.0, 0.01, 0.1, 0.3]), min_size=64, max_size=64),
    start=st.sampled_from([1.0, 0.5, 0.25]),
    bound_at=st.integers(0, 63),
    bound_stamp=st.integers(0, 5000),
    floor=st.booleans(),
)
def test_the_sure_stamp_never_skips_a_block_that_ranks_above_the_bound(
    drops: list[float], start: float, bound_at: int, bound_stamp: int, floor: bool
) -> None:
    """Every stamp at or before ``sure_stamp`` goes before the bound: a smaller rank, or the
    same rank and an older stamp (where the table's last ranks equal the bound, exactly)."""
    table, rank = [], start
    for drop in drops:
        rank = max(0.0, rank - drop)
        table.append(rank)
    if floor:
        table = [max(value, table[bound_at]) for value in table]
    bound_rank, now = table[bound_at], 6000
    surely = sure_stamp(table, bound_rank, bound_stamp, now)
    for stamp in range(0, now + 1):
        value = rank_at(table, now - stamp)
        goes_first = value < bound_rank or (value == bound_rank and stamp < bound_stamp)
        if stamp <= surely:
            assert goes_first, (stamp, surely, value, bound_rank)


@pytest.mark.parametrize("capacity", [25, 50])
def test_agents_behind_shared_tool_prompts_keep_the_prompts(capacity: int) -> None:
    """Agent loops with five times the calibrated pauses (the tiny scale: 1 and 2 % of the
    unique blocks): their steps come back too late to hit, and the tenants' tool prompts every
    loop starts from are what pays. Shared, they leave by their own reuse delays, not with the
    steps' new blocks (LRU: 873 and 1,980 prefix hits here, ARC 1,039 and 2,858)."""
    requests = workload_trace("toolagent", "tiny", 0, parse_shape("think_time_scale=5"))
    key_lists = study_trace_from_blocks(requests, 512).key_lists

    def hits(name: str) -> int:
        run = simulate_cpu(policy_registry.make_policy(name, capacity), key_lists)
        return sum(prefix_hits(run.flags, key_lists))

    assert hits("chain") > hits("arc") > hits("lru")
