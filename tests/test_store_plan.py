"""Store planning with null blocks and several groups (the bug of seed 003 cannot happen)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.core.store_plan import plan_store
from tiering.errors import InvalidKeyError


def spec_with_window(factor: int) -> KVCacheSpec:
    return KVCacheSpec(
        (
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (1024,)),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, (512,), sliding_window=32),
        ),
        hash_block_size=16,
        block_size_factor=factor,
    )


def keys_for(spec: KVCacheSpec, num_hash_blocks: int) -> list[list[OffloadKey]]:
    return spec.offload_keys([i.to_bytes(8, "big") for i in range(num_hash_blocks)])


def test_null_blocks_are_skipped_and_counts_match_listed_ids() -> None:
    spec = spec_with_window(factor=2)
    keys = keys_for(spec, 8)  # 4 offloaded blocks per group
    full_ids = [11, 12, 13, 14, 15, 16, 17, 18]
    window_ids = [0, 0, 0, 24, 25, 26, 27, 28]  # blocks 0-2 fell out of the window
    plan = plan_store(spec, keys, [full_ids, window_ids])
    # Offloaded block 0 of the window group ends in a null block: not a candidate.
    assert plan.keys == (*keys[0], *keys[1][1:])
    job = plan.build_job(plan.keys)
    assert job.group_sizes == (8, 5)
    assert sum(job.group_sizes) == len(job.src_block_ids)
    assert job.src_block_ids.tolist() == full_ids + [24, 25, 26, 27, 28]
    # The window group's first listed GPU block is index 3: one sub-block into offloaded block 1.
    assert job.block_indices == (0, 3)


def test_job_for_a_subset_keeps_candidate_order() -> None:
    spec = spec_with_window(factor=1)
    keys = keys_for(spec, 3)
    plan = plan_store(spec, keys, [[5, 6, 7], [0, 8, 9]], first_block_idx_per_group=[1, 0])
    assert plan.keys == (keys[0][1], keys[0][2], keys[1][1], keys[1][2])
    job = plan.build_job([keys[1][2], keys[0][2]])
    assert job.keys == (keys[0][2], keys[1][2])
    assert job.src_block_ids.tolist() == [7, 9]
    assert job.group_sizes == (1, 1)
    assert job.block_indices == (2, 2)
    assert plan.next_block_idx == (3, 3)


def test_unknown_key_in_job_is_rejected() -> None:
    spec = spec_with_window(factor=1)
    plan = plan_store(spec, keys_for(spec, 1), [[5], [6]])
    with pytest.raises(InvalidKeyError, match="not candidates of this plan"):
        plan.build_job([make_offload_key(b"other", 0)])


def test_partial_offloaded_blocks_are_not_candidates() -> None:
    spec = spec_with_window(factor=2)
    keys = keys_for(spec, 4)  # 2 offloaded blocks per group
    plan = plan_store(spec, keys, [[1, 2, 3], [4, 5, 6]])  # only 1.5 blocks allocated
    assert plan.keys == (keys[0][0], keys[1][0])
    assert plan.next_block_idx == (1, 1)


@given(
    factor=st.integers(1, 4),
    window_ids=st.lists(st.integers(0, 50), min_size=0, max_size=24),
    accept=st.lists(st.booleans(), min_size=24, max_size=24),
)
def test_counts_always_equal_listed_ids(
    factor: int, window_ids: list[int], accept: list[bool]
) -> None:
    spec = spec_with_window(factor)
    num_blocks = len(window_ids) // factor
    keys = keys_for(spec, num_blocks * factor)
    full_ids = list(range(100, 100 + num_blocks * factor))
    plan = plan_store(spec, keys, [full_ids, window_ids])
    chosen = [k for k, ok in zip(plan.keys, accept, strict=False) if ok]
    job = plan.build_job(chosen)
    assert sum(job.group_sizes) == len(job.src_block_ids)
    assert 0 not in job.src_block_ids.tolist()
    assert np.all(job.src_block_ids >= 0)
