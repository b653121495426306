"""The CPU block pool: bit-exact copies for every group and layout, validation, shared memory."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.errors import BackendError, ConfigurationError, LayoutError
from tiering.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.layout import CanonicalKVCaches, LayerTensors, register_kv_caches
from tiering.pool import CopyBackend, CPUBlockPool, KVBlockCopier, PoolTransfer

NUM_BLOCKS = 24
NUM_SLOTS = 12
MAMBA_PAGE = 256  # 96 bytes conv + 128 bytes SSM, padded
# Groups: 0 full attention (bf16, 2 layers, blocks-first), 1 full attention (fp32 K/V split,
# bigger pages), 2 sliding window (fp16 K/V split), 3 Mamba (states in one padded page).
GROUP_PAGES = ((512, 512), (4096,), (1024,), (224,))
PER_RANK_ENGINE_BLOCK_BYTES = 512 + 512 + 4096 + 1024 + MAMBA_PAGE


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    numel = int(np.prod(shape))
    size = torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def make_spec(factor: int = 1) -> KVCacheSpec:
    return KVCacheSpec(
        (
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16, GROUP_PAGES[0], layer_names=("f.0", "f.1")),
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16, GROUP_PAGES[1], layer_names=("g.0",)),
            KVCacheGroup(
                GroupKind.SLIDING_WINDOW,
                16,
                GROUP_PAGES[2],
                sliding_window=32,
                layer_names=("w.0",),
            ),
            KVCacheGroup(GroupKind.MAMBA, 16, GROUP_PAGES[3], layer_names=("m.0",)),
        ),
        hash_block_size=16,
        block_size_factor=factor,
    )


def make_kv(seed: int, zero: bool = False) -> dict[str, LayerTensors]:
    """The engine tensors of the model of ``make_spec`` filled with random bytes (or zeros)."""
    gen = torch.Generator().manual_seed(seed)
    mamba_raw = random_tensor((NUM_BLOCKS * MAMBA_PAGE,), torch.uint8, gen)
    kv: dict[str, LayerTensors] = {
        "f.0": random_tensor((NUM_BLOCKS, 16, 2, 8), torch.bfloat16, gen),
        "f.1": random_tensor((NUM_BLOCKS + 3, 16, 2, 8), torch.bfloat16, gen),  # over-allocated
        "g.0": random_tensor((2, NUM_BLOCKS, 16, 4, 8), torch.float32, gen),
        "w.0": random_tensor((2, NUM_BLOCKS, 16, 2, 8), torch.float16, gen),
        "m.0": [
            mamba_raw.view(torch.float16).as_strided((NUM_BLOCKS, 3, 16), (MAMBA_PAGE // 2, 16, 1)),
            mamba_raw.view(torch.float32).as_strided(
                (NUM_BLOCKS, 4, 8), (MAMBA_PAGE // 4, 8, 1), 96 // 4
            ),
        ],
    }
    if zero:
        mamba_raw.zero_()
        for value in kv.values():
            if isinstance(value, torch.Tensor):
                value.zero_()
    return kv


def block_bytes(kv: dict[str, LayerTensors], layer: str, block: int) -> bytes:
    """The bytes a layer really uses for one engine block (no padding)."""
    value = kv[layer]
    if not isinstance(value, torch.Tensor):
        parts = [state[block] for state in value]
    elif value.shape[0] == 2 and value.dim() == 5:
        parts = [value[0, block], value[1, block]]
    else:
        parts = [value[block]]
    return b"".join(bytes(p.contiguous().reshape(-1).view(torch.uint8).numpy()) for p in parts)


GROUP_LAYERS = (("f.0", "f.1"), ("g.0",), ("w.0",), ("m.0",))


def group_block(kv: dict[str, LayerTensors], group: int, block: int) -> bytes:
    return b"".join(block_bytes(kv, layer, block) for layer in GROUP_LAYERS[group])


class Model:
    """One rank: engine tensors, their registration, a pool and a copier."""

    def __init__(
        self,
        seed: int,
        pool: CPUBlockPool | None = None,
        *,
        factor: int = 1,
        rank: int = 0,
        zero: bool = False,
        copy_backend: CopyBackend = "auto",
    ) -> None:
        self.spec = make_spec(factor)
        self.kv = make_kv(seed, zero)
        self.caches: CanonicalKVCaches = register_kv_caches(self.kv, self.spec, NUM_BLOCKS)
        self.pool = pool or CPUBlockPool(NUM_SLOTS, self.caches.offloaded_block_bytes_per_rank())
        self.copier = KVBlockCopier(self.caches, self.pool, rank=rank, copy_backend=copy_backend)

    def snapshot(self) -> tuple[bytes, ...]:
        return (bytes(self.pool.rows_view().numpy()),) + tuple(
            bytes(t.tensor.numpy()) for t in self.caches.tensors
        )


def test_offloaded_block_bytes_cover_every_registered_tensor() -> None:
    model = Model(seed=0, factor=2)
    assert model.caches.offloaded_block_bytes_per_rank() == 2 * PER_RANK_ENGINE_BLOCK_BYTES
    assert model.pool.row_bytes == 2 * PER_RANK_ENGINE_BLOCK_BYTES


@pytest.mark.parametrize("copy_backend", ["auto", "torch"])
def test_round_trip_is_bit_exact_for_every_group(copy_backend: CopyBackend) -> None:
    source = Model(seed=1, copy_backend=copy_backend)
    ids = [[3, 7, 1], [5, 9], [0, 0, 11, 2], [4]]  # group 2 (window) starts with null blocks
    slots = [[0, 6, 2], [9, 4], [1, 10, 3, 8], [11]]
    store = source.copier.store(transfer(ids, slots))

    assert store.engine_blocks_per_group == (3, 2, 2, 1)
    assert store.null_blocks_skipped == 2 and store.engine_blocks_copied == 8
    per_group = [source.caches.bytes_per_gpu_block(g) for g in range(4)]
    assert per_group == [1024, 4096, 1024, 224]
    assert store.bytes_copied == 3 * 1024 + 2 * 4096 + 2 * 1024 + 224

    target = Model(seed=2, pool=source.pool, zero=True, copy_backend=copy_backend)
    new_ids = [[10, 12, 14], [1, 2], [0, 0, 20, 21], [23]]
    load = target.copier.load(transfer(new_ids, slots))
    assert load == store
    for g in range(4):
        for old, new in zip(ids[g], new_ids[g], strict=True):
            if old != 0:
                assert group_block(target.kv, g, new) == group_block(source.kv, g, old)
    assert group_block(target.kv, 2, 0) == bytes(1024)  # the null block was not written


def transfer(
    ids: list[list[int]], slots: list[list[int]], first: tuple[int, ...] = ()
) -> PoolTransfer:
    return PoolTransfer(
        np.array([i for group in ids for i in group], dtype=np.int64),
        tuple(len(group) for group in ids),
        np.array([s for group in slots for s in group], dtype=np.int64),
        first,
    )


def test_pool_rows_follow_the_documented_layout() -> None:
    model = Model(seed=3, factor=2)
    model.pool.rows_view().fill_(0xAB)
    model.copier.store(transfer([[5, 6], [], [], [7]], [[4], [], [], [9]]))

    row = model.pool.block_view(4).numpy()
    caches = model.caches
    part = 0
    for index, canonical in enumerate(caches.tensors):
        pages = [canonical.tensor[block].numpy() for block in (5, 6)]
        used = {ref.tensor_idx: ref.page_bytes for ref in caches.group_refs[0]}.get(index)
        for sub, page in enumerate(pages):
            start = part + sub * canonical.page_bytes
            if used is None:  # not group 0's tensor: untouched
                assert (row[start : start + canonical.page_bytes] == 0xAB).all()
            else:
                assert np.array_equal(row[start : start + used], page[:used])
        part += 2 * canonical.page_bytes
    assert part == model.pool.row_bytes
    mamba_part = part - 2 * MAMBA_PAGE
    mamba_row = model.pool.block_view(9).numpy()
    assert np.array_equal(
        mamba_row[mamba_part : mamba_part + 224], caches.tensors[-1].tensor[7, :224].numpy()
    )
    assert (mamba_row[mamba_part + 224 : mamba_part + MAMBA_PAGE + 224] == 0xAB).all()


def test_factor_2_with_an_unaligned_first_sub_block() -> None:
    source = Model(seed=4, factor=2)
    source.pool.rows_view().fill_(0xCD)
    # Group 0 starts at sub-block 1 of its first offloaded block: 3 ids span slots 2 and 5.
    job = transfer([[8, 9, 10], [], [], []], [[2, 5], [], [], []], first=(1, 0, 0, 0))
    result = source.copier.store(job)
    assert result.engine_blocks_copied == 3

    first_tensor = source.caches.tensors[0]
    page = first_tensor.page_bytes
    assert (source.pool.block_view(2)[:page] == 0xCD).all()  # sub-block 0 of slot 2 untouched
    assert torch.equal(source.pool.block_view(2)[page : 2 * page], first_tensor.tensor[8])
    assert torch.equal(source.pool.block_view(5)[:page], first_tensor.tensor[9])
    assert torch.equal(source.pool.block_view(5)[page : 2 * page], first_tensor.tensor[10])

    target = Model(seed=5, pool=source.pool, factor=2, zero=True)
    target.copier.load(transfer([[1, 2, 3], [], [], []], [[2, 5], [], [], []], first=(1, 0, 0, 0)))
    for old, new in ((8, 1), (9, 2), (10, 3)):
        assert group_block(target.kv, 0, new) == group_block(source.kv, 0, old)
    assert group_block(target.kv, 0, 0) == bytes(1024)


def test_from_block_indices_takes_the_offset_modulo_the_factor() -> None:
    job = PoolTransfer.from_block_indices([4, 5, 6], [2, 1], [7, 4], [0, 1, 2], 2)
    assert job.first_sub_block == (1, 0)
    assert job.slots_per_group(2) == (2, 1)


def test_null_blocks_are_skipped_in_window_and_mamba_groups_only() -> None:
    model = Model(seed=6, factor=2)
    model.pool.rows_view().fill_(0xEE)
    job = transfer([[0, 4], [], [0, 0, 0, 7], [0, 0]], [[1], [], [2, 3], [6]])
    result = model.copier.store(job)
    # Full attention copies block 0 like any block; the window group skips three nulls, the
    # Mamba group skips both (slot 6 stays untouched).
    assert result.engine_blocks_per_group == (2, 0, 1, 0)
    assert result.null_blocks_skipped == 5
    assert result.bytes_copied == 2 * 1024 + 1024
    assert (model.pool.block_view(2) == 0xEE).all()
    assert (model.pool.block_view(6) == 0xEE).all()
    window_k = model.caches.tensors[4]
    part = sum(2 * t.page_bytes for t in model.caches.tensors[:4])
    assert torch.equal(model.pool.block_view(3)[part + 512 : part + 1024], window_k.tensor[7])


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
]


@pytest.mark.parametrize("direction", ["store", "load"])
@pytest.mark.parametrize(("job", "message"), BAD_JOBS)
def test_bad_input_raises_and_changes_nothing(
    direction: str, job: PoolTransfer, message: str
) -> None:
    model = Model(seed=7)
    model.copier.store(transfer([[1, 2], [3], [4], [5]], [[0, 1], [2], [3], [4]]))
    before = model.snapshot()
    with pytest.raises(LayoutError, match=message):
        getattr(model.copier, direction)(job)
    assert model.snapshot() == before


def test_double_writes_are_rejected_before_copying() -> None:
    model = Model(seed=8)
    before = model.snapshot()
    duplicate_slot = transfer([[1, 4], [2], [3], [5]], [[0, 0], [5], [6], [7]])
    with pytest.raises(LayoutError, match=r"writes slot 0 twice, from engine blocks 1 and 4"):
        model.copier.store(duplicate_slot)
    duplicate_block = transfer([[9, 9], [2], [], []], [[0, 1], [2], [], []])
    with pytest.raises(LayoutError, match=r"writes engine block id 9 twice, from slots 0 and 1"):
        model.copier.load(duplicate_block)
    assert model.snapshot() == before
    # Two groups may share a slot when their tensors differ: no byte is written twice.
    shared_slot = transfer([[1], [2], [], []], [[0], [0], [], []])
    assert model.copier.store(shared_slot).bytes_copied == 1024 + 4096


def test_transfer_description_is_validated() -> None:
    with pytest.raises(LayoutError, match=r"group_sizes \(2, 1\) add up to 3 but there are 2"):
        PoolTransfer(np.array([1, 2]), (2, 1), np.array([0, 1]))
    with pytest.raises(LayoutError, match=r"engine ids must be a 1-D integer sequence"):
        PoolTransfer(np.array([1.0, 2.0]), (2,), np.array([0, 1]))
    with pytest.raises(LayoutError, match=r"group_sizes\[1\] must be a non-negative int"):
        PoolTransfer(np.array([1]), (1, -1), np.array([0]))
    with pytest.raises(LayoutError, match=r"first_sub_block has 1 entries but group_sizes has 2"):
        PoolTransfer(np.array([1]), (1, 0), np.array([0]), (0,))


def test_pool_must_match_the_registered_block_bytes_and_rank() -> None:
    model = Model(seed=9)
    wrong = CPUBlockPool(2, PER_RANK_ENGINE_BLOCK_BYTES + 1)
    with pytest.raises(LayoutError, match=rf"block_bytes={PER_RANK_ENGINE_BLOCK_BYTES + 1} but"):
        KVBlockCopier(model.caches, wrong)
    with pytest.raises(LayoutError, match=r"rank 1 is out of range; valid: 0\.\.0"):
        KVBlockCopier(model.caches, model.pool, rank=1)


def test_two_groups_sharing_one_tensor_round_trip() -> None:
    full = KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (1024,), layer_names=("full",))
    window = KVCacheGroup(
        GroupKind.SLIDING_WINDOW, 16, (1024,), sliding_window=32, layer_names=("swa",)
    )
    spec = KVCacheSpec((full, window), 16)
    gen = torch.Generator().manual_seed(10)
    engine = random_tensor((2, NUM_BLOCKS, 16, 2, 8), torch.float16, gen)
    original = engine.clone()
    caches = register_kv_caches({"full": engine, "swa": engine}, spec, NUM_BLOCKS)
    pool = CPUBlockPool(4, caches.offloaded_block_bytes_per_rank())
    assert pool.block_bytes == 1024
    copier = KVBlockCopier(caches, pool)
    job = transfer([[1, 2], [0, 3]], [[0, 1], [2, 3]])
    copier.store(job)
    engine.zero_()
    assert copier.load(job).engine_blocks_per_group == (2, 1)
    for block in (1, 2, 3):
        assert torch.equal(engine[:, block].view(torch.int16), original[:, block].view(torch.int16))
    assert not engine[:, 0].any()


def test_closed_pool_refuses_copies_and_views() -> None:
    model = Model(seed=11)
    model.pool.close()
    model.pool.close()  # idempotent
    with pytest.raises(BackendError, match=r"is closed"):
        model.copier.store(transfer([[1], [], [], []], [[0], [], [], []]))
    with pytest.raises(BackendError, match=r"is closed"):
        model.pool.rows_view()


@settings(max_examples=25, deadline=None)
@given(data=st.data(), factor=st.integers(1, 3))
def test_any_valid_transfer_round_trips(data: st.DataObject, factor: int) -> None:
    source = Model(seed=12, factor=factor)
    target = Model(seed=13, pool=source.pool, factor=factor, zero=True)
    ids, slots, firsts = [], [], []
    free_slots = list(range(NUM_SLOTS))
    free_ids = list(range(1, NUM_BLOCKS))
    for _ in range(4):
        first = data.draw(st.integers(0, factor - 1))
        max_slots = min(2, len(free_slots))
        count = data.draw(st.integers(0, max(0, max_slots * factor - first)))
        group_ids = list(data.draw(st.permutations(free_ids))[:count])
        num_slots = -(-(first + count) // factor) if count else 0
        ids.append(group_ids)
        slots.append(free_slots[:num_slots])
        firsts.append(first)
        free_slots = free_slots[num_slots:]
    job = transfer(ids, slots, tuple(firsts))
    stored = source.copier.store(job)
    loaded = target.copier.load(job)
    assert stored == loaded
    assert stored.bytes_copied == sum(
        len(ids[g]) * source.caches.bytes_per_gpu_block(g) for g in range(4)
    )
    for g in range(4):
        for block in ids[g]:
            assert group_block(target.kv, g, block) == group_block(source.kv, g, block)


# --- pool memory -------------------------------------------------------------------------


def test_pool_is_preallocated_zeroed_and_unpinned_without_cuda() -> None:
    pool = CPUBlockPool(4, 1000, world_size=2, pin_memory="auto")
    assert pool.rows_view().shape == (4, 2000) and pool.nbytes == 8000
    assert not pool.rows_view().any()
    assert pool.is_pinned == torch.cuda.is_available()
    assert pool.rank_view(1).shape == (4, 1000)
    assert pool.rank_view(1).data_ptr() == pool.rows_view().data_ptr() + 1000


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_forced_pinning_without_cuda_falls_back_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tiering.pool"):
        pool = CPUBlockPool(2, 64, pin_memory=True)
    assert not pool.is_pinned
    assert "pinned host memory unavailable" in caplog.text
    pool.rows_view()[1].fill_(3)  # usable
    assert pool.block_view(1).sum() == 3 * 64


def test_bad_pool_settings_are_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match=r"pin_memory must be True, False or 'auto'"):
        CPUBlockPool(2, 64, pin_memory="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"num_blocks must be a positive int, got 0"):
        CPUBlockPool(0, 64)
    with pytest.raises(ConfigurationError, match=r"shared pool name '\.\.' is invalid"):
        CPUBlockPool.create_shared("..", 2, 64)


def test_rows_memoryview_is_writable_zero_copy_for_preadv(tmp_path: Path) -> None:
    pool = CPUBlockPool(6, 100, world_size=2)
    payload = bytes(range(256)) * 2  # rows 2 and 3: 400 bytes
    path = tmp_path / "rows.bin"
    path.write_bytes(payload[:400])
    view = pool.rows_memoryview(2, 4)
    assert len(view) == 400 and not view.readonly
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.preadv(fd, [view], 0) == 400
    finally:
        os.close(fd)
    assert bytes(pool.rows_view()[2:4].numpy()) == payload[:400]
    assert not pool.rows_view()[1].any() and not pool.rows_view()[4].any()
    with pytest.raises(LayoutError, match=r"slot range \[4, 7\) is empty or out of range"):
        pool.rows_memoryview(4, 7)
    with pytest.raises(LayoutError, match=r"slot range \[6, 7\)"):
        pool.block_view(6)


def test_two_ranks_fill_one_row_each_with_their_part() -> None:
    rank0 = Model(seed=20)
    pool = CPUBlockPool(NUM_SLOTS, rank0.caches.offloaded_block_bytes_per_rank(), world_size=2)
    rank0 = Model(seed=20, pool=pool, rank=0)
    rank1 = Model(seed=21, pool=pool, rank=1)
    job = transfer([[1], [2], [3], [4]], [[5], [6], [7], [8]])
    rank0.copier.store(job)
    rank1.copier.store(job)
    half = pool.block_bytes
    for slot, tensor_idx in ((5, 0), (6, 2)):
        row = pool.block_view(slot)
        block = job.engine_block_ids[slot - 5]
        page = rank0.caches.tensors[tensor_idx].page_bytes
        offset = sum(t.page_bytes for t in rank0.caches.tensors[:tensor_idx])
        assert torch.equal(
            row[offset : offset + page], rank0.caches.tensors[tensor_idx].tensor[block]
        )
        assert torch.equal(
            row[half + offset : half + offset + page],
            rank1.caches.tensors[tensor_idx].tensor[block],
        )


# --- shared memory -----------------------------------------------------------------------


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"tiering-test-{os.getpid()}-{time.monotonic_ns()}"
    yield name
    for base in (Path("/dev/shm"), Path(tempfile.gettempdir())):
        (base / name).unlink(missing_ok=True)


CHILD_STORE = """
import sys
sys.path.insert(0, sys.argv[1])
from test_pool import Model, transfer
from tiering.pool import CPUBlockPool
name, block_bytes = sys.argv[2], int(sys.argv[3])
pool = CPUBlockPool.open_shared(name, 12, block_bytes, world_size=2, timeout_s=30)
model = Model(seed=31, pool=pool, rank=1)
model.copier.store(transfer([[1, 2], [3], [0, 4], [5]], [[0, 1], [2], [3, 4], [5]]))
assert not pool.is_creator
pool.close()
print("stored")
"""


def test_blocks_written_by_one_process_read_bit_exact_by_another(shm_name: str) -> None:
    rank0 = Model(seed=30)
    block_bytes = rank0.caches.offloaded_block_bytes_per_rank()
    pool = CPUBlockPool.create_shared(shm_name, NUM_SLOTS, block_bytes, world_size=2)
    assert pool.is_creator and pool.path is not None and pool.path.exists()
    job = transfer([[1, 2], [3], [0, 4], [5]], [[0, 1], [2], [3, 4], [5]])
    rank0 = Model(seed=30, pool=pool, rank=0)
    rank0.copier.store(job)

    tests_dir = str(Path(__file__).parent)
    child = subprocess.run(
        [sys.executable, "-c", CHILD_STORE, tests_dir, shm_name, str(block_bytes)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "stored"

    # Read the child's (rank 1) blocks back through this process, into fresh tensors.
    reader = Model(seed=32, pool=pool, rank=1, zero=True)
    reader.copier.load(job)
    expected = make_kv(31)
    for g, blocks in enumerate(([1, 2], [3], [4], [5])):
        for block in blocks:
            assert group_block(reader.kv, g, block) == group_block(expected, g, block)
    # Rank 0's parts are intact next to them in the same rows.
    rank0_view = pool.rank_view(0)
    assert torch.equal(rank0_view[0, :512], rank0.caches.tensors[0].tensor[1])
    pool.close()
    assert not pool.path.exists()


def test_joiner_waits_for_a_late_creator(shm_name: str) -> None:
    joined: list[CPUBlockPool] = []
    thread = threading.Thread(
        target=lambda: joined.append(CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=30))
    )
    thread.start()
    time.sleep(0.05)
    creator = CPUBlockPool.create_shared(shm_name, 3, 128)
    thread.join(timeout=30)
    (joiner,) = joined
    creator.rows_view()[2].fill_(9)
    assert (joiner.block_view(2) == 9).all()
    joiner.close()
    assert creator.path is not None and creator.path.exists()  # only the creator unlinks
    creator.close()
    assert not creator.path.exists()


def test_joiner_times_out_with_a_clear_error(shm_name: str) -> None:
    with pytest.raises(BackendError, match=r"timed out after 0\.2 s waiting for the shared pool"):
        CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=0.2)
    # A file of the right size that nobody initialised never becomes ready either.
    path = Path("/dev/shm") / shm_name
    if path.parent.is_dir():
        path.write_bytes(bytes(4096 + 3 * 128))
        with pytest.raises(BackendError, match=r"timed out"):
            CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=0.1)


def test_joiner_rejects_a_pool_of_another_geometry(shm_name: str) -> None:
    with CPUBlockPool.create_shared(shm_name, 3, 128, world_size=2):
        with pytest.raises(
            LayoutError, match=r"world_size=2 num_blocks=3 block_bytes=128.*expected"
        ):
            CPUBlockPool.open_shared(shm_name, 4, 128, world_size=2, timeout_s=1)
        with pytest.raises(FileExistsError):
            CPUBlockPool.create_shared(shm_name, 3, 128, world_size=2)
        second = CPUBlockPool.open_or_create_shared(shm_name, 3, 128, world_size=2)
        assert not second.is_creator
        second.close()


CHILD_CRASH = """
import os, signal, sys
from tiering.pool import CPUBlockPool
pool = CPUBlockPool.create_shared(sys.argv[1], 3, 128)
pool.rows_view()[1].fill_(5)
print("created", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a crash: never closes, never unlinks
"""


def _orphan_pool(shm_name: str) -> Path:
    """A pool file left behind by a creator killed with SIGKILL."""
    child = subprocess.run(
        [sys.executable, "-c", CHILD_CRASH, shm_name], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL and child.stdout == "created\n", child.stderr
    (path,) = [
        p
        for p in (Path("/dev/shm") / shm_name, Path(tempfile.gettempdir()) / shm_name)
        if p.exists()
    ]
    return path


def test_a_pool_left_by_a_crashed_creator_is_never_joined_and_is_replaced(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = _orphan_pool(shm_name)
    orphan_inode = path.stat().st_ino
    with pytest.raises(BackendError, match=r"left by a creator that exited"):
        CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=0.1)
    pool = CPUBlockPool.open_or_create_shared(shm_name, 3, 128)
    assert pool.is_creator and path.stat().st_ino != orphan_inode
    assert "its creator had exited" in caplog.text
    assert (pool.block_view(1) == 0).all()  # a fresh pool, not the orphan's bytes
    assert not list(path.parent.glob(f".{shm_name}.*.tmp"))  # no temp file left
    pool.close()
    assert not path.exists()


def test_a_waiting_joiner_attaches_to_the_replacement_not_the_orphan(shm_name: str) -> None:
    _orphan_pool(shm_name)
    joined: list[CPUBlockPool] = []
    thread = threading.Thread(
        target=lambda: joined.append(CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=30))
    )
    thread.start()
    time.sleep(0.05)
    assert not joined  # the orphan is there, but its creator is gone: keep waiting
    creator = CPUBlockPool.create_shared(shm_name, 3, 128)
    thread.join(timeout=30)
    (joiner,) = joined
    creator.rows_view()[2].fill_(9)
    assert (joiner.block_view(2) == 9).all() and (joiner.block_view(1) == 0).all()
    joiner.close()
    creator.close()


def test_a_live_creator_in_another_process_is_not_replaced(shm_name: str) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD_CRASH.replace("os.kill(os.getpid(), signal.SIGKILL)", "sys.stdin.read()"),
            shm_name,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "created\n"
        with pytest.raises(FileExistsError):
            CPUBlockPool.create_shared(shm_name, 3, 128)
        joiner = CPUBlockPool.open_or_create_shared(shm_name, 3, 128, timeout_s=5)
        assert not joiner.is_creator and (joiner.block_view(1) == 5).all()
        joiner.close()
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0


def test_a_file_system_without_hard_links_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(BackendError, match=r"cannot link the shared pool into place.*hard links"):
        CPUBlockPool.create_shared(tmp_path / "pool.mmap", 2, 64)
    assert list(tmp_path.iterdir()) == []  # neither the pool nor its temporary file


def test_shared_pool_at_an_explicit_path(tmp_path: Path) -> None:
    path = tmp_path / "pool.mmap"
    with CPUBlockPool.create_shared(path, 2, 64) as pool:
        pool.rows_memoryview(1, 2)[:] = bytes([7]) * 64
        assert path.stat().st_size == 4096 + 128
        with open(path, "rb") as f:  # the row is on the file, after the header page
            f.seek(4096 + 64)
            assert f.read(64) == bytes([7]) * 64
    assert not path.exists()


def test_touching_pages_without_madvise_populate_still_gives_a_zeroed_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiering import pool as pool_module

    monkeypatch.setattr(pool_module._SharedRegion, "_populate", lambda self: False)
    with CPUBlockPool.create_shared(tmp_path / "pool.mmap", 3, 5000) as pool:
        assert pool.rows_view().shape == (3, 5000) and not pool.rows_view().any()


def test_shared_pool_errors_are_backend_errors(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match=r"cannot create the shared pool .*missing"):
        CPUBlockPool.create_shared(tmp_path / "missing" / "pool.mmap", 2, 64)


def test_closing_a_shared_pool_under_a_copier_is_safe(shm_name: str) -> None:
    model = Model(seed=40)
    block_bytes = model.caches.offloaded_block_bytes_per_rank()
    pool = CPUBlockPool.create_shared(shm_name, NUM_SLOTS, block_bytes)
    model = Model(seed=40, pool=pool)
    view = pool.rows_memoryview(0, 1)
    pool.close()  # the copier and the memoryview still reference the mapping
    assert pool.path is not None and not pool.path.exists()
    with pytest.raises(BackendError, match=r"is closed"):
        model.copier.load(transfer([[1], [], [], []], [[0], [], [], []]))
    view[0] = 1  # still mapped, so no crash


def test_shared_mapping_is_released_once_the_last_view_is_gone(shm_name: str) -> None:
    import gc
    import weakref

    pool = CPUBlockPool.create_shared(shm_name, 4, 4096)
    assert pool._shared is not None
    mapping = weakref.ref(pool._shared._mmap)
    view = pool.rows_memoryview(0, 2)
    pool.close()
    gc.collect()
    assert mapping() is not None  # the view keeps the memory mapped
    del view
    gc.collect()
    assert mapping() is None
