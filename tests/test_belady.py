"""tiering.replay.belady: MIN against hand counts and brute force, LRU against libCacheSim."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Hashable, Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.core.hashing import PrefixHasher
from tiering.errors import ConfigurationError
from tiering.policies import ARCPolicy, LRUPolicy, available_policies, get_policy_class
from tiering.replay.belady import (
    REFERENCE_POLICIES,
    Stats,
    belady_hits,
    belady_request_hits,
    lru_hits,
    simulate,
)
from tiering.replay.study import simulate_cpu
from tiering.replay.traces import builtin_trace, hash_requests

FAST = settings(max_examples=150, deadline=None)

# Reference sequence of the limits study. With 3 slots, MIN:
#   1 2 3      3 compulsory misses                         cache {1, 2, 3}
#   1 2        hits
#   4          miss; next uses 1@6, 2@7, 3@11 -> evict 3   cache {1, 2, 4}
#   1 2        hits
#   5          miss; next uses 1@9, 2@10, 4 never -> evict 4   cache {1, 2, 5}
#   1 2        hits
#   3          miss
# 6 hits of 12 accesses: hit ratio 0.5. LRU evicts the same keys here (3, then 4): 6 hits too.
TINY = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2, 3]

# A loop one larger than the cache. LRU always evicts the key needed next: 0 hits. MIN:
#   idx 0-2 miss {1,2,3}; 3 (4) miss, evict 3 (next 6) {1,2,4}; 4, 5 hit;
#   6 (3) miss, evict 2 (next 9) {1,4,3}; 7, 8 hit; 9 (2) miss, evict 1 (never) {4,3,2};
#   10, 11 hit -> 6 hits.
LOOP = [1, 2, 3, 4] * 3


def test_tiny_example_hand_counted() -> None:
    assert belady_hits(TINY, 3) == 6
    assert belady_hits(TINY, 3) / len(TINY) == 0.5
    assert lru_hits(TINY, 3) == 6


def test_loop_min_beats_lru() -> None:
    assert belady_hits(LOOP, 3) == 6
    assert lru_hits(LOOP, 3) == 0
    assert belady_hits(LOOP, 4) == 8  # everything fits: only the 4 compulsory misses


def test_bypass_keeps_the_key_that_returns_first() -> None:
    # One slot, a c a: demand paging must put c in the slot and lose a; bypass keeps a.
    assert belady_hits(["a", "c", "a"], 1) == 0
    assert belady_hits(["a", "c", "a"], 1, bypass=True) == 1


def test_zero_capacity_never_hits() -> None:
    assert belady_hits(TINY, 0) == 0
    assert belady_hits(TINY, 0, bypass=True) == 0
    assert lru_hits(TINY, 0) == 0
    assert simulate("arc", [TINY], 0).block_hits == 0


@pytest.mark.parametrize("capacity", [-1, 1.5, True, "3"])
def test_bad_capacity_is_rejected(capacity: object) -> None:
    with pytest.raises(ConfigurationError, match=r"capacity \(blocks\) must be an int >= 0"):
        belady_hits(TINY, capacity)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"capacity \(blocks\) must be an int >= 0"):
        simulate("lru", [TINY], capacity)  # type: ignore[arg-type]


def test_mixed_key_types_never_compared() -> None:
    # Many keys are never used again (tied "furthest" uses); the heap must not compare keys.
    trace: list[Hashable] = [1, "a", b"a", (1,), 2.5, "b", 1, b"a", None, 7, "a"]
    assert belady_hits(trace, 2) == brute_force_optimal_hits(trace, 2, bypass=False)


# -- brute force ---------------------------------------------------------------------------------


def brute_force_optimal_hits(trace: Sequence[Hashable], capacity: int, *, bypass: bool) -> int:
    """The most hits over every eviction choice (and, with ``bypass``, every admission)."""

    @functools.cache
    def best(i: int, cache: frozenset[Hashable]) -> int:
        if i == len(trace):
            return 0
        key = trace[i]
        if key in cache:
            return 1 + best(i + 1, cache)
        options = []
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {key}))
        else:
            options += [best(i + 1, (cache - {victim}) | {key}) for victim in cache]
            if bypass:
                options.append(best(i + 1, cache))
        return max(options) if options else best(i + 1, cache)

    return best(0, frozenset())


def naive_min_hits(trace: Sequence[Hashable], capacity: int) -> int:
    """MIN by scanning the future for each held key on every eviction: O(n^2), obviously right."""
    cache: set[Hashable] = set()
    hits = 0
    for i, key in enumerate(trace):
        if key in cache:
            hits += 1
            continue
        if capacity == 0:
            continue
        if len(cache) == capacity:
            future = list(trace[i + 1 :])

            def next_use(held: Hashable, future: list[Hashable] = future) -> int:
                return future.index(held) if held in future else len(future)

            cache.remove(max(cache, key=next_use))
        cache.add(key)
    return hits


small_traces = st.lists(st.integers(0, 4), max_size=10)


@FAST
@given(trace=small_traces, capacity=st.integers(1, 3))
def test_min_equals_brute_force_optimum(trace: list[int], capacity: int) -> None:
    assert belady_hits(trace, capacity) == brute_force_optimal_hits(trace, capacity, bypass=False)


@FAST
@given(trace=small_traces, capacity=st.integers(1, 3))
def test_min_with_bypass_equals_brute_force_optimum(trace: list[int], capacity: int) -> None:
    expected = brute_force_optimal_hits(trace, capacity, bypass=True)
    assert belady_hits(trace, capacity, bypass=True) == expected


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), keys=st.integers(2, 60), capacity=st.integers(1, 12))
def test_min_equals_naive_min_on_long_traces(seed: int, keys: int, capacity: int) -> None:
    # Long enough, with a small cache, that the heap of stale entries gets compacted.
    rng = np.random.default_rng(seed)
    trace = (rng.zipf(1.3, size=2_000) % keys).tolist()
    assert belady_hits(trace, capacity) == naive_min_hits(trace, capacity)


@FAST
@given(trace=st.lists(st.integers(0, 30), max_size=300), capacity=st.integers(0, 20))
def test_min_has_at_least_the_hits_of_lru_and_arc(trace: list[int], capacity: int) -> None:
    min_hits = belady_hits(trace, capacity)
    assert min_hits >= lru_hits(trace, capacity)
    assert min_hits >= simulate("arc", [trace], capacity).block_hits
    assert belady_hits(trace, capacity, bypass=True) >= min_hits
    assert min_hits <= len(trace) - len(set(trace))  # never more than an unbounded cache


# -- simulate ------------------------------------------------------------------------------------

requests_strategy = st.lists(
    st.lists(st.integers(0, 25), min_size=1, max_size=12, unique=True), max_size=40
)


@FAST
@given(requests=requests_strategy, capacity=st.integers(0, 16))
def test_prefix_hits_bounded_by_min_block_hits(requests: list[list[int]], capacity: int) -> None:
    bound = simulate("belady", requests, capacity)
    for policy in ("lru", "arc", "belady", "belady-bypass"):
        stats = simulate(policy, requests, capacity)
        assert stats.prefix_hit_blocks <= stats.block_hits <= stats.max_block_hits
        if policy != "belady-bypass":
            assert stats.prefix_hit_blocks <= stats.block_hits <= bound.block_hits


@FAST
@given(requests=requests_strategy, capacity=st.integers(0, 16))
def test_reference_lru_equals_the_projects_lru_policy(
    requests: list[list[int]], capacity: int
) -> None:
    reference = simulate("lru", requests, capacity)
    ours = simulate(LRUPolicy, requests, capacity)
    assert ours.block_hits == reference.block_hits
    assert ours.prefix_hit_blocks == reference.prefix_hit_blocks
    flat = [key for keys in requests for key in keys]
    assert reference.block_hits == lru_hits(flat, capacity)


def test_min_is_not_optimal_for_prefix_hits() -> None:
    # Two slots; requests [2, 0], [0, 1, 2], [0]; accesses 2 0 | 0 1 2 | 0.
    # MIN: at 1 (idx 3) the cache is {2, 0}; next uses 2@4, 0@5 -> evict 0. Then 2 hits but
    #   follows the miss on 1 (useless to the prefix), and 0 misses. Block hits 2 (0@2, 2@4),
    #   prefix hits 1 (request 2's leading 0).
    # ARC: 2 sits in T1, 0 in T2 after its hit; the 1 evicts 2 (T1), the 2 evicts 1 (T1),
    #   so 0 stays: block hits 2 (0@2, 0@5), prefix hits 2.
    requests = [[2, 0], [0, 1, 2], [0]]
    min_stats = simulate("belady", requests, 2)
    arc_stats = simulate("arc", requests, 2)
    assert (min_stats.block_hits, min_stats.prefix_hit_blocks) == (2, 1)
    assert (arc_stats.block_hits, arc_stats.prefix_hit_blocks) == (2, 2)
    assert arc_stats.prefix_hit_blocks > min_stats.prefix_hit_blocks


def test_stats_fields() -> None:
    # One slot, requests [1], [1, 2], [2, 1]: accesses 1 | 1 2 | 2 1 -> hits at idx 1 and 3.
    # Prefix hits: request 2 leads with a hit (1), request 3 leads with a hit (1): 2.
    stats = simulate("lru", [[1], [1, 2], [2, 1]], 1)
    assert stats == Stats(
        policy="lru",
        capacity_blocks=1,
        requests=3,
        block_accesses=5,
        block_hits=2,
        prefix_hit_blocks=2,
        unique_blocks=2,
    )
    assert stats.block_misses == 3
    assert stats.block_hit_ratio == pytest.approx(0.4)
    assert stats.prefix_hit_ratio == pytest.approx(0.4)
    assert stats.max_block_hits == 3
    empty = simulate("belady", [], 4)
    assert (empty.block_accesses, empty.block_hit_ratio, empty.prefix_hit_ratio) == (0, 0.0, 0.0)


def test_prefix_hits_stop_at_the_first_miss() -> None:
    # Two slots hold a and b; request [a, c, b]: a hits, c misses, b hits but is past the miss.
    stats = simulate("belady", [["a", "b"], ["a", "c", "b"]], 2)
    assert (stats.block_hits, stats.prefix_hit_blocks) == (2, 1)


def test_policy_names_and_factories() -> None:
    requests = [[b"x", b"y"], [b"x", b"z"], [b"y"]]
    assert simulate("ARC", requests, 2).policy == "ARC"
    assert simulate(ARCPolicy, requests, 2).policy == "arc"
    assert simulate("tiering.policies:LRUPolicy", requests, 2).block_hits == lru_hits(
        [key for keys in requests for key in keys], 2
    )
    assert set(REFERENCE_POLICIES) == {"lru", "belady", "belady-bypass"}
    with pytest.raises(ConfigurationError, match=r"unknown policy 'fifo'.*belady.*arc"):
        simulate("fifo", requests, 2)
    with pytest.raises(ConfigurationError, match=r"callable that makes a fresh EvictionPolicy"):
        simulate(LRUPolicy(2), requests, 2)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"returned dict, not an EvictionPolicy"):
        simulate(lambda capacity: {}, requests, 2)  # type: ignore[arg-type,return-value]


def test_policies_get_bytes_keys_for_any_key_type() -> None:
    # Distinct keys that look alike (1, "1", b"1") must stay distinct once mapped to bytes.
    requests: list[list[Hashable]] = [[1, "1", b"1"], [1, "1", b"1"]]
    for policy in ("arc", ARCPolicy, "lru", "belady"):
        stats = simulate(policy, requests, 3)
        assert (stats.block_hits, stats.unique_blocks) == (3, 3)


# -- against libCacheSim -------------------------------------------------------------------------


def test_lru_and_min_match_libcachesim_on_a_chat_trace() -> None:
    lcs = pytest.importorskip("libcachesim")
    key_lists = list(hash_requests(builtin_trace("chat", "tiny"), PrefixHasher(16)))
    ids: dict[bytes, int] = {}
    trace = [ids.setdefault(key, len(ids)) for keys in key_lists for key in keys]
    assert len(trace) > 10_000 and len(ids) < len(trace) / 3  # plenty of reuse
    never = 2**62
    next_use = [never] * len(trace)
    last: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        next_use[i] = last.get(trace[i], never)
        last[trace[i]] = i
    for fraction in (0.02, 0.1, 0.3):
        capacity = max(1, int(len(ids) * fraction))
        expected = {}
        for name, cache_class in (("lru", lcs.LRU), ("belady", lcs.Belady)):
            cache = cache_class(capacity)
            expected[name] = sum(
                bool(cache.get(lcs.Request(obj_size=1, obj_id=key, next_access_vtime=nxt)))
                for key, nxt in zip(trace, next_use, strict=True)
            )
        assert lru_hits(trace, capacity) == expected["lru"]
        assert belady_hits(trace, capacity) == expected["belady"]
        assert simulate("lru", key_lists, capacity).block_hits == expected["lru"]
        assert simulate("belady", key_lists, capacity).block_hits == expected["belady"]
        assert expected["belady"] > expected["lru"]


# -- requests looked up whole (the study's model) ------------------------------------------------


def brute_force_request_optimum(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """Most block hits of any eviction choices when each request is looked up whole, then its
    misses are inserted in order (each insert may evict any held key): exhaustive search."""

    @functools.cache
    def best(r: int, cache: frozenset[int]) -> int:
        if r == len(requests):
            return 0
        keys = requests[r]
        hits = sum(1 for k in keys if k in cache)
        states = {cache}
        for key in (k for k in keys if k not in cache):
            following: set[frozenset[int]] = set()
            for state in states:
                if len(state) < capacity:
                    following.add(state | {key})
                else:
                    following.update((state - {victim}) | {key} for victim in state)
            states = following
        return hits + max(best(r + 1, state) for state in states)

    return best(0, frozenset())


small_requests = st.lists(
    st.lists(st.integers(0, 4), min_size=1, max_size=3, unique=True), max_size=5
)


def test_whole_request_lookups_let_a_policy_beat_flat_min() -> None:
    # Capacity 1: LRU keeps b from the first request and hits it in the second; MIN on the
    # flattened accesses a b a b c hits nothing. The request model's MIN hits b as well.
    requests = [[1, 2], [1, 2, 3]]
    keys = [[k.to_bytes(1, "little") for k in r] for r in requests]
    assert sum(simulate_cpu(LRUPolicy(1), keys).flags) == 1
    assert belady_hits([k for r in requests for k in r], 1) == 0
    assert belady_request_hits(requests, 1) == 1


def brute_force_free_choice_optimum(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """Most block hits when, after each request, the cache may keep any ``capacity`` of the
    blocks held and the request's own (the model belady_request_hits solves)."""

    @functools.cache
    def best(r: int, cache: frozenset[int]) -> int:
        if r == len(requests):
            return 0
        hits = sum(1 for k in requests[r] if k in cache)
        pool = sorted(cache | set(requests[r]))
        keep = min(capacity, len(pool))
        return hits + max(
            best(r + 1, frozenset(choice)) for choice in itertools.combinations(pool, keep)
        )

    return best(0, frozenset())


@FAST
@given(requests=small_requests, capacity=st.integers(1, 3))
def test_request_min_is_optimal_for_its_model_and_bounds_the_managers(
    requests: list[list[int]], capacity: int
) -> None:
    bound = belady_request_hits(requests, capacity)
    assert bound == brute_force_free_choice_optimum(requests, capacity)
    assert bound >= brute_force_request_optimum(requests, capacity)
    assert bound >= belady_hits([k for r in requests for k in r], capacity)


@FAST
@given(requests=requests_strategy, capacity=st.integers(0, 16))
def test_request_min_bounds_every_registered_policy_in_the_study(
    requests: list[list[int]], capacity: int
) -> None:
    keys = [[k.to_bytes(2, "little") for k in r] for r in requests]
    bound = belady_request_hits(requests, capacity)
    assert bound <= sum(map(len, requests)) - len({k for r in requests for k in r})
    for name in available_policies():
        flags = simulate_cpu(get_policy_class(name)(capacity), keys).flags if capacity else b""
        assert sum(flags) <= bound, name
