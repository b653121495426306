"""Miss ratios of our LRU and ARC against libCacheSim's on a synthetic prefix-reuse trace.

The trace is a smaller version of the one in the reference limits study: conversations share a
system prompt, are picked by Zipf popularity, re-read their whole prefix and append a few
blocks. Policies are driven as a unit-size cache: a hit touches the key; a miss evicts one key
when full, then inserts.

LRU matches exactly. ARC adapts to a ghost hit when the key is inserted, i.e. after the
eviction that made room for it (libCacheSim, like the paper, adapts first), and breaks the
``|T1| == p`` tie towards T2 without knowing the incoming key; the miss ratio differs by a few
hundredths of a percentage point.
"""

from __future__ import annotations

import numpy as np
import pytest

from tiering.policies import ARCPolicy, EvictionPolicy, LRUPolicy

lcs = pytest.importorskip("libcachesim")

MAX_MISS_RATIO_GAP = 0.005


def prefix_trace(
    seed: int = 0,
    conversations: int = 400,
    system_blocks: int = 20,
    requests: int = 2_500,
    zipf_alpha: float = 0.9,
    max_own_blocks: int = 60,
) -> list[int]:
    """Block ids read by ``requests`` multi-turn requests (about 140,000 accesses)."""
    rng = np.random.default_rng(seed)
    popularity = 1.0 / np.arange(1, conversations + 1) ** zipf_alpha
    popularity /= popularity.sum()
    conversation_of_rank = rng.permutation(conversations)
    length = [0] * conversations
    trace: list[int] = []
    for rank in rng.choice(conversations, size=requests, p=popularity):
        conv = int(conversation_of_rank[rank])
        grow = min(int(rng.integers(2, 9)), max_own_blocks - length[conv])
        trace += range(system_blocks)
        base = 1_000_000 + conv * 1_000
        trace += range(base, base + length[conv] + grow)  # the prefix, then new blocks
        length[conv] += grow
    return trace


def our_misses(policy: EvictionPolicy, trace: list[bytes]) -> int:
    misses = 0
    for key in trace:
        if key in policy:
            policy.touch([key])
            continue
        misses += 1
        if len(policy) == policy.capacity:
            assert policy.evict(1) is not None
        policy.insert(key)
    return misses


def libcachesim_misses(cache: object, trace: list[int]) -> int:
    get, request = cache.get, lcs.Request  # type: ignore[attr-defined]
    return sum(not get(request(obj_size=1, obj_id=block)) for block in trace)


@pytest.fixture(scope="module")
def trace() -> list[int]:
    return prefix_trace()


@pytest.mark.parametrize("fraction_of_unique", [0.01, 0.05, 0.10])
@pytest.mark.parametrize(
    ("policy_class", "reference_name"), [(LRUPolicy, "LRU"), (ARCPolicy, "ARC")]
)
def test_miss_ratio_matches_libcachesim(
    trace: list[int],
    fraction_of_unique: float,
    policy_class: type[EvictionPolicy],
    reference_name: str,
) -> None:
    unique = len(set(trace))
    capacity = max(1, int(unique * fraction_of_unique))
    keys = [block.to_bytes(8, "big") for block in trace]
    ours = our_misses(policy_class(capacity), keys) / len(trace)
    theirs = libcachesim_misses(getattr(lcs, reference_name)(capacity), trace) / len(trace)
    assert 0.05 < theirs < 0.95  # the cache size is in the interesting range
    if policy_class is LRUPolicy:
        assert ours == theirs
    assert abs(ours - theirs) <= MAX_MISS_RATIO_GAP, (ours, theirs)
