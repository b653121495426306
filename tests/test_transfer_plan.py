"""Transfer jobs and their plans: validation before anything moves, and what the copies are."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.layout import register_cross_layer_kv_cache, register_kv_caches
from tiering.errors import BackendError, ConfigurationError, LayoutError
from tiering.managers.pool import CPUBlockPool
from tiering.testing.copy_strategy_tests import (
    NUM_BLOCKS,
    NUM_SLOTS,
    PER_RANK_ENGINE_BLOCK_BYTES,
    HybridModel,
    transfer,
)
from tiering.transfer import PoolGeometry, PoolTransfer, TransferEngine, TransferPlanner

BAD_JOBS = [
    (
        transfer([[1], [2], [3], [NUM_BLOCKS]], [[0], [1], [2], [3]]),
        rf"group 3: engine block id {NUM_BLOCKS} is out of range; valid: 0\.\.{NUM_BLOCKS - 1}",
    ),
    (
        transfer([[1], [2], [3], [-1]], [[0], [1], [2], [3]]),
        rf"group 3: engine block id -1 is out of range; valid: 0\.\.{NUM_BLOCKS - 1}",
    ),
    (
        transfer([[1], [2], [3], [4]], [[0], [1], [2], [NUM_SLOTS]]),
        rf"group 3: slot {NUM_SLOTS} is out of range; valid: 0\.\.{NUM_SLOTS - 1}",
    ),
    (
        transfer([[1], [2], [3], [4]], [[0], [1], [2]]),
        r"lists 3 slots; its engine blocks need 4 \(per group: \(1, 1, 1, 1\)\)",
    ),
    (transfer([[1], [2], [3]], [[0], [1], [2]]), r"lists 3 groups; the caches have 4"),
    (
        transfer([[1], [2], [3], [4]], [[0], [1], [2], [3]], first=(0, 0, 0, 1)),
        r"group 3: first_sub_block=1 is out of range; valid: 0\.\.0",
    ),
    (
        transfer([[1, 4], [2], [3], [5]], [[0, 0], [5], [6], [7]]),
        r"writes slot 0 twice, from engine blocks 1 and 4",
    ),
]


@pytest.mark.parametrize("copy_backend", ["memmove", "staging"])
@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize(("job", "message"), BAD_JOBS)
def test_a_bad_job_is_a_typed_error_and_nothing_is_submitted(
    copy_backend: str, direction: str, job: PoolTransfer, message: str
) -> None:
    model = HybridModel(7, copy_backend=copy_backend)  # type: ignore[arg-type]
    model.store(transfer([[1, 2], [3], [4], [5]], [[0, 1], [2], [3], [4]]))
    before = model.snapshot()
    submit = getattr(model.engine, f"submit_{direction}")
    if "twice" in message and direction == "load":
        message = r"writes engine block id|twice"
        job = transfer([[9, 9], [2], [], []], [[0, 1], [2], [], []])
    with pytest.raises(LayoutError, match=message):
        submit(job)
    assert model.engine.in_flight == 0 and model.engine.poll() == []
    assert model.snapshot() == before


def test_double_writes_are_named_and_shared_slots_of_distinct_tensors_are_allowed() -> None:
    model = HybridModel(8)
    with pytest.raises(LayoutError, match=r"writes engine block id 9 twice, from slots 0 and 1"):
        model.engine.submit_load(transfer([[9, 9], [2], [], []], [[0, 1], [2], [], []]))
    # Two groups may share a slot when their tensors differ: no byte is written twice.
    shared_slot = transfer([[1], [2], [], []], [[0], [0], [], []])
    assert model.store(shared_slot).bytes_copied == 1024 + 4096


def test_transfer_description_is_validated() -> None:
    with pytest.raises(LayoutError, match=r"group_sizes \(2, 1\) add up to 3 but there are 2"):
        PoolTransfer(np.array([1, 2]), (2, 1), np.array([0, 1]))
    with pytest.raises(LayoutError, match=r"engine ids must be a 1-D integer sequence"):
        PoolTransfer(np.array([1.0, 2.0]), (2,), np.array([0, 1]))
    with pytest.raises(LayoutError, match=r"group_sizes\[1\] must be a non-negative int"):
        PoolTransfer(np.array([1]), (1, -1), np.array([0]))
    with pytest.raises(LayoutError, match=r"first_sub_block has 1 entries but group_sizes has 2"):
        PoolTransfer(np.array([1]), (1, 0), np.array([0]), (0,))
    ids = PoolTransfer(torch.tensor([3, 4]), (2,), [5, 6])  # type: ignore[arg-type]
    assert ids.engine_block_ids.dtype == np.int64 and ids.slots.tolist() == [5, 6]


def test_from_block_indices_takes_the_offset_modulo_the_factor() -> None:
    job = PoolTransfer.from_block_indices([4, 5, 6], [2, 1], [7, 4], [0, 1, 2], 2)
    assert job.first_sub_block == (1, 0)
    assert job.slots_per_group(2) == (2, 1)


def test_the_pool_must_match_the_registered_block_bytes_and_rank() -> None:
    model = HybridModel(9)
    wrong = CPUBlockPool(2, PER_RANK_ENGINE_BLOCK_BYTES + 1)
    with pytest.raises(LayoutError, match=rf"block_bytes={PER_RANK_ENGINE_BLOCK_BYTES + 1} but"):
        TransferEngine(model.caches, wrong)
    with pytest.raises(LayoutError, match=r"rank 1 is out of range; valid: 0\.\.0"):
        TransferEngine(model.caches, model.pool, rank=1)
    with pytest.raises(ConfigurationError, match=r"block_size_factor must be a positive int"):
        TransferEngine(model.caches, model.pool, block_size_factor=0)


def test_a_closed_pool_refuses_jobs() -> None:
    model = HybridModel(11)
    model.pool.close()
    with pytest.raises(BackendError, match=r"is closed"):
        model.engine.submit_store(transfer([[1], [], [], []], [[0], [], [], []]))
    assert model.engine.in_flight == 0


def _planner(caches: object, pool: CPUBlockPool) -> TransferPlanner:
    return TransferPlanner(PoolGeometry.of(caches, pool))  # type: ignore[arg-type]


def test_plan_entries_and_runs_of_the_hybrid_model() -> None:
    model = HybridModel(12)
    planner = _planner(model.caches, model.pool)
    plan = planner.plan(transfer([[3, 4], [], [0, 5], []], [[6, 7], [], [1, 2]]), to_pool=True)
    # group 0: two blocks-first tensors; group 2 (window): K and V, the null block skipped.
    assert plan.entries.tensor_idx.tolist() == [0, 0, 1, 1, 4, 5]
    assert plan.entries.nbytes.tolist() == [512, 512, 512, 512, 512, 512]
    row = model.pool.row_bytes
    part = planner.geometry.part_offset
    assert plan.entries.pool_offset.tolist() == [
        6 * row,
        7 * row,
        6 * row + 512,
        7 * row + 512,
        2 * row + int(part[4]),
        2 * row + int(part[5]),
    ]
    assert plan.entries.engine_offset.tolist() == [3 * 512, 4 * 512, 3 * 512, 4 * 512, 2560, 2560]
    # Blocks 3, 4 of a tensor are adjacent in the engine but slots 6, 7 are a row apart.
    assert len(plan.runs) == 6
    assert plan.result.engine_blocks_per_group == (2, 0, 1, 0)


def _cross_layer(layers: int = 4) -> tuple[torch.Tensor, KVCacheSpec, int]:
    page = 2 * 16 * 8 * 2
    names = tuple(f"layer.{i}" for i in range(layers))
    group = KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (page,) * layers, layer_names=names)
    big = torch.zeros((NUM_BLOCKS, layers, 2, 16, 8), dtype=torch.bfloat16)
    return big, KVCacheSpec((group,), 16), layers * page


@pytest.mark.parametrize("whole", [True, False])
def test_a_cross_layer_block_is_one_run(whole: bool) -> None:
    big, spec, block_bytes = _cross_layer()
    if whole:
        caches = register_cross_layer_kv_cache(big, spec, NUM_BLOCKS)
    else:
        views = {f"layer.{i}": big[:, i] for i in range(4)}
        caches = register_kv_caches(views, spec, NUM_BLOCKS)
    pool = CPUBlockPool(8, block_bytes)
    plan = _planner(caches, pool).plan(transfer([[2, 9, 10, 11]], [[0, 5, 6, 3]]), to_pool=True)
    assert plan.entries.nbytes.tolist() == [block_bytes] * 4  # one entry per block
    # blocks 9, 10 go to slots 5, 6: contiguous on both sides, one copy
    assert plan.runs.nbytes.tolist() == [block_bytes, 2 * block_bytes, block_bytes]
    assert plan.runs.pool_offset.tolist() == [0, 5 * block_bytes, 3 * block_bytes]
    assert plan.runs.engine_offset.tolist() == [2 * block_bytes, 9 * block_bytes, 11 * block_bytes]
    assert plan.result.bytes_copied == 4 * block_bytes


def test_consecutive_blocks_into_consecutive_slots_merge_into_one_copy() -> None:
    engine = torch.zeros((NUM_BLOCKS, 1024), dtype=torch.uint8)
    group = KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (1024,), layer_names=("layer",))
    caches = register_kv_caches({"layer": engine}, KVCacheSpec((group,), 16), NUM_BLOCKS)
    pool = CPUBlockPool(8, 1024)
    plan = _planner(caches, pool).plan(transfer([[4, 5, 6, 7]], [[2, 3, 4, 5]]), to_pool=False)
    assert plan.runs.nbytes.tolist() == [4096]
    assert len(plan.entries) == 4
