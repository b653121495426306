"""``CopyStrategyTests``: the conformance suite for copy strategies (:mod:`tiering.transfer`).

Every strategy must move exactly the bytes a plan names, bit for bit, for every KV layout an
engine registers. Subclass the suite in a test module, name the strategy and the device::

    from tiering.testing.copy_strategy_tests import CopyStrategyTests


    class TestStagingOnCPU(CopyStrategyTests):
        copy_backend = "staging"
        device = "cpu"

What it checks, each through a :class:`~tiering.transfer.TransferEngine` built with that
strategy, storing from one set of engine tensors and loading into another: a hybrid model of
four groups (two full attention, blocks-first over-allocated and fp32 K/V split; sliding window
with null blocks; Mamba states in a padded page) with ``block_size_factor`` 1 and 2 and an
unaligned ``first_sub_block``; pool bytes the job does not name left as they were; null blocks
skipped; two groups sharing one tensor; two ranks in one pool row; cross-layer layouts
(one tensor, per-layer views of it, K/V-split per-layer views); odd page sizes (byte-sized
words); empty jobs; and seeded random jobs. The model builders (:class:`HybridModel`,
:func:`transfer`, :func:`group_block`) are public for tests of their own. Requires pytest.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pytest
import torch

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.layout import (
    CanonicalKVCaches,
    LayerTensors,
    register_cross_layer_kv_cache,
    register_kv_caches,
)
from tiering.managers.pool import CPUBlockPool
from tiering.transfer import (
    CopyBackend,
    PoolTransfer,
    StrategyOptions,
    TransferEngine,
    TransferHandle,
    TransferResult,
)

__all__ = [
    "GROUP_LAYERS",
    "MAMBA_PAGE",
    "NUM_BLOCKS",
    "NUM_SLOTS",
    "PER_RANK_ENGINE_BLOCK_BYTES",
    "CopyStrategyTests",
    "HybridModel",
    "group_block",
    "layer_block",
    "make_hybrid_kv",
    "make_hybrid_spec",
    "random_tensor",
    "run",
    "transfer",
]

NUM_BLOCKS = 24
NUM_SLOTS = 12
MAMBA_PAGE = 256  # 96 bytes conv + 128 bytes SSM, padded
# Groups: 0 full attention (bf16, 2 layers, blocks-first), 1 full attention (fp32 K/V split,
# bigger pages), 2 sliding window (fp16 K/V split), 3 Mamba (states in one padded page).
GROUP_PAGES = ((512, 512), (4096,), (1024,), (224,))
GROUP_LAYERS = (("f.0", "f.1"), ("g.0",), ("w.0",), ("m.0",))
PER_RANK_ENGINE_BLOCK_BYTES = 512 + 512 + 4096 + 1024 + MAMBA_PAGE


def random_tensor(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, device: str = "cpu"
) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaN patterns included: compare bytes, not values)."""
    numel = int(np.prod(shape))
    size = torch.tensor([], dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    return raw.to(device).view(dtype).view(shape)


def make_hybrid_spec(factor: int = 1) -> KVCacheSpec:
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


def make_hybrid_kv(seed: int, zero: bool = False, device: str = "cpu") -> dict[str, LayerTensors]:
    """The engine tensors of :func:`make_hybrid_spec`'s model, random bytes (or zeros)."""
    gen = torch.Generator().manual_seed(seed)
    mamba_raw = random_tensor((NUM_BLOCKS * MAMBA_PAGE,), torch.uint8, gen, device)
    kv: dict[str, LayerTensors] = {
        "f.0": random_tensor((NUM_BLOCKS, 16, 2, 8), torch.bfloat16, gen, device),
        # over-allocated: the cache config's num_blocks, not the shape, counts
        "f.1": random_tensor((NUM_BLOCKS + 3, 16, 2, 8), torch.bfloat16, gen, device),
        "g.0": random_tensor((2, NUM_BLOCKS, 16, 4, 8), torch.float32, gen, device),
        "w.0": random_tensor((2, NUM_BLOCKS, 16, 2, 8), torch.float16, gen, device),
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


def layer_block(kv: dict[str, LayerTensors], layer: str, block: int) -> bytes:
    """The bytes a layer really uses for one engine block (no padding)."""
    value = kv[layer]
    if not isinstance(value, torch.Tensor):
        parts = [state[block] for state in value]
    elif value.shape[0] == 2 and value.dim() == 5:
        parts = [value[0, block], value[1, block]]
    else:
        parts = [value[block]]
    return b"".join(
        bytes(p.contiguous().reshape(-1).view(torch.uint8).cpu().numpy()) for p in parts
    )


def group_block(kv: dict[str, LayerTensors], group: int, block: int) -> bytes:
    return b"".join(layer_block(kv, layer, block) for layer in GROUP_LAYERS[group])


def transfer(
    ids: list[list[int]], slots: list[list[int]], first: tuple[int, ...] = ()
) -> PoolTransfer:
    """A job from per-group lists of engine block ids and slots."""
    return PoolTransfer(
        np.array([i for group in ids for i in group], dtype=np.int64),
        tuple(len(group) for group in ids),
        np.array([s for group in slots for s in group], dtype=np.int64),
        first,
    )


def run(handle: TransferHandle, engine: TransferEngine) -> TransferResult:
    """Wait for ``handle`` and return its result; raise its error if the copy failed."""
    engine.wait(handle)
    assert handle.done
    if handle.error is not None:
        raise handle.error
    return handle.result


class HybridModel:
    """One rank of the hybrid model: engine tensors, their registration, a pool, an engine."""

    def __init__(
        self,
        seed: int,
        pool: CPUBlockPool | None = None,
        *,
        factor: int = 1,
        rank: int = 0,
        zero: bool = False,
        device: str = "cpu",
        copy_backend: CopyBackend = "auto",
        options: StrategyOptions | None = None,
        store_copy_backend: CopyBackend | None = None,
    ) -> None:
        self.spec = make_hybrid_spec(factor)
        self.kv = make_hybrid_kv(seed, zero, device)
        self.caches: CanonicalKVCaches = register_kv_caches(self.kv, self.spec, NUM_BLOCKS)
        self.pool = pool or CPUBlockPool(
            NUM_SLOTS, self.caches.offloaded_block_bytes_per_rank(), pin_memory=device != "cpu"
        )
        self.engine = TransferEngine(
            self.caches,
            self.pool,
            rank=rank,
            copy_backend=copy_backend,
            options=options,
            store_copy_backend=store_copy_backend,
        )

    def store(self, job: PoolTransfer) -> TransferResult:
        return run(self.engine.submit_store(job), self.engine)

    def load(self, job: PoolTransfer) -> TransferResult:
        return run(self.engine.submit_load(job), self.engine)

    def snapshot(self) -> tuple[bytes, ...]:
        """Every byte of the pool and of the registered engine tensors."""
        tensors = [bytes(t.tensor.cpu().numpy()) for t in self.caches.tensors]
        return (bytes(self.pool.rows_view().numpy()), *tensors)


def _cross_layer_spec(layers: int, page: int) -> KVCacheSpec:
    names = tuple(f"layer.{i}" for i in range(layers))
    group = KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (page,) * layers, layer_names=names)
    return KVCacheSpec((group,), 16)


class CopyStrategyTests:
    """Conformance suite for one copy strategy on one device (see the module docstring)."""

    copy_backend: ClassVar[CopyBackend]
    device: ClassVar[str] = "cpu"
    options: ClassVar[StrategyOptions | None] = None
    #: Another strategy for stores (the engine's ``store_copy_backend``); None: the same.
    store_copy_backend: ClassVar[CopyBackend | None] = None

    def model(self, seed: int, pool: CPUBlockPool | None = None, **kwargs: object) -> HybridModel:
        return HybridModel(
            seed,
            pool,
            device=self.device,
            copy_backend=self.copy_backend,
            options=self.options,
            store_copy_backend=self.store_copy_backend,
            **kwargs,  # type: ignore[arg-type]
        )

    def engine(self, caches: CanonicalKVCaches, pool: CPUBlockPool) -> TransferEngine:
        return TransferEngine(
            caches,
            pool,
            copy_backend=self.copy_backend,
            options=self.options,
            store_copy_backend=self.store_copy_backend,
        )

    def pool(self, num_slots: int, block_bytes: int, world_size: int = 1) -> CPUBlockPool:
        return CPUBlockPool(
            num_slots, block_bytes, world_size=world_size, pin_memory=self.device != "cpu"
        )

    def test_the_engine_uses_the_strategy(self) -> None:
        model = self.model(0)
        assert model.engine.strategy.name == self.copy_backend
        store = self.store_copy_backend or self.copy_backend
        assert model.engine.store_strategy.name == store

    @pytest.mark.parametrize("factor", [1, 2])
    def test_round_trip_is_bit_exact_for_every_group(self, factor: int) -> None:
        source = self.model(1, factor=factor)
        ids = [[3, 7, 1], [5, 9], [0, 0, 11, 2], [4]]  # group 2 (window) starts with null blocks
        slots = [[0, 6, 2], [9, 4], [1, 10, 3, 8], [11]]
        if factor == 2:
            slots = [[0, 6], [9], [1, 10], [11]]
        job = transfer(ids, slots)
        stored = source.store(job)
        assert stored.engine_blocks_per_group == (3, 2, 2, 1)
        assert stored.null_blocks_skipped == 2 and stored.engine_blocks_copied == 8
        assert stored.bytes_copied == 3 * 1024 + 2 * 4096 + 2 * 1024 + 224

        target = self.model(2, source.pool, factor=factor, zero=True)
        new_ids = [[10, 12, 14], [1, 2], [0, 0, 20, 21], [23]]
        assert target.load(transfer(new_ids, slots)) == stored
        for g in range(4):
            for old, new in zip(ids[g], new_ids[g], strict=True):
                if old != 0:
                    assert group_block(target.kv, g, new) == group_block(source.kv, g, old)
        assert group_block(target.kv, 2, 0) == bytes(1024)  # the null block was not written

    def test_pool_bytes_outside_the_job_keep_their_value(self) -> None:
        model = self.model(3, factor=2)
        model.pool.rows_view().fill_(0xAB)
        model.store(transfer([[5, 6], [], [], [7]], [[4], [], [], [9]]))
        row = model.pool.block_view(4).numpy()
        part = 0
        used = {ref.tensor_idx: ref.page_bytes for ref in model.caches.group_refs[0]}
        for index, canonical in enumerate(model.caches.tensors):
            for sub, block in enumerate((5, 6)):
                start = part + sub * canonical.page_bytes
                page = canonical.tensor[block].cpu().numpy()
                if index not in used:  # not group 0's tensor: untouched
                    assert (row[start : start + canonical.page_bytes] == 0xAB).all()
                else:
                    assert np.array_equal(row[start : start + used[index]], page[: used[index]])
            part += 2 * canonical.page_bytes
        assert part == model.pool.row_bytes
        mamba_part = part - 2 * MAMBA_PAGE
        mamba_row = model.pool.block_view(9).numpy()
        mamba = model.caches.tensors[-1].tensor[7, :224].cpu().numpy()
        assert np.array_equal(mamba_row[mamba_part : mamba_part + 224], mamba)
        assert (mamba_row[mamba_part + 224 : mamba_part + MAMBA_PAGE + 224] == 0xAB).all()
        for other in (0, 1, 2, 3, 5, 6, 7, 8, 10, 11):
            assert (model.pool.block_view(other) == 0xAB).all()

    def test_unaligned_first_sub_block_with_factor_2(self) -> None:
        source = self.model(4, factor=2)
        source.pool.rows_view().fill_(0xCD)
        # Group 0 starts at sub-block 1 of its first offloaded block: 3 ids span slots 2 and 5.
        job = transfer([[8, 9, 10], [], [], []], [[2, 5], [], [], []], first=(1, 0, 0, 0))
        assert source.store(job).engine_blocks_copied == 3
        first = source.caches.tensors[0]
        page = first.page_bytes
        pool = source.pool
        assert (pool.block_view(2)[:page] == 0xCD).all()  # sub-block 0 of slot 2 untouched
        assert torch.equal(pool.block_view(2)[page : 2 * page], first.tensor[8].cpu())
        assert torch.equal(pool.block_view(5)[:page], first.tensor[9].cpu())
        assert torch.equal(pool.block_view(5)[page : 2 * page], first.tensor[10].cpu())

        target = self.model(5, source.pool, factor=2, zero=True)
        target.load(transfer([[1, 2, 3], [], [], []], [[2, 5], [], [], []], first=(1, 0, 0, 0)))
        for old, new in ((8, 1), (9, 2), (10, 3)):
            assert group_block(target.kv, 0, new) == group_block(source.kv, 0, old)
        assert group_block(target.kv, 0, 0) == bytes(1024)

    def test_null_blocks_are_skipped_in_window_and_mamba_groups_only(self) -> None:
        model = self.model(6, factor=2)
        model.pool.rows_view().fill_(0xEE)
        result = model.store(transfer([[0, 4], [], [0, 0, 0, 7], [0, 0]], [[1], [], [2, 3], [6]]))
        assert result.engine_blocks_per_group == (2, 0, 1, 0)
        assert result.null_blocks_skipped == 5
        assert result.bytes_copied == 2 * 1024 + 1024
        assert (model.pool.block_view(2) == 0xEE).all()
        assert (model.pool.block_view(6) == 0xEE).all()
        window_k = model.caches.tensors[4]
        part = sum(2 * t.page_bytes for t in model.caches.tensors[:4])
        stored = model.pool.block_view(3)[part + 512 : part + 1024]
        assert torch.equal(stored, window_k.tensor[7].cpu())

    def test_two_groups_sharing_one_tensor(self) -> None:
        full = KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (1024,), layer_names=("full",))
        window = KVCacheGroup(
            GroupKind.SLIDING_WINDOW, 16, (1024,), sliding_window=32, layer_names=("swa",)
        )
        gen = torch.Generator().manual_seed(10)
        engine = random_tensor((2, NUM_BLOCKS, 16, 2, 8), torch.float16, gen, self.device)
        original = engine.clone()
        caches = register_kv_caches(
            {"full": engine, "swa": engine}, KVCacheSpec((full, window), 16), NUM_BLOCKS
        )
        pool = self.pool(4, caches.offloaded_block_bytes_per_rank())
        transfers = self.engine(caches, pool)
        job = transfer([[1, 2], [0, 3]], [[0, 1], [2, 3]])
        run(transfers.submit_store(job), transfers)
        engine.zero_()
        assert run(transfers.submit_load(job), transfers).engine_blocks_per_group == (2, 1)
        for block in (1, 2, 3):
            assert torch.equal(
                engine[:, block].view(torch.int16), original[:, block].view(torch.int16)
            )
        assert not engine[:, 0].any()

    def test_two_ranks_fill_one_row_each_with_their_part(self) -> None:
        block_bytes = PER_RANK_ENGINE_BLOCK_BYTES
        pool = self.pool(NUM_SLOTS, block_bytes, world_size=2)
        rank0 = self.model(20, pool, rank=0)
        rank1 = self.model(21, pool, rank=1)
        job = transfer([[1], [2], [3], [4]], [[5], [6], [7], [8]])
        rank0.store(job)
        rank1.store(job)
        for g, (slot, block) in enumerate(((5, 1), (6, 2), (7, 3), (8, 4))):
            row = bytes(pool.block_view(slot).numpy())
            for rank, model in ((0, rank0), (1, rank1)):
                part = row[rank * block_bytes : (rank + 1) * block_bytes]
                expected = group_block(model.kv, g, block)
                assert _used_bytes(model, g, part) == expected

    def test_cross_layer_tensor_round_trip(self) -> None:
        layers, page = 4, 2 * 16 * 8 * 2
        gen = torch.Generator().manual_seed(30)
        big = random_tensor((NUM_BLOCKS + 2, layers, 2, 16, 8), torch.bfloat16, gen, self.device)
        spec = _cross_layer_spec(layers, page)
        caches = register_cross_layer_kv_cache(big, spec, NUM_BLOCKS)
        self._cross_layer_round_trip(big, caches, block_bytes=layers * page)

    @pytest.mark.parametrize("kv_first", [False, True])
    def test_cross_layer_views_round_trip(self, kv_first: bool) -> None:
        layers, page = 3, 2 * 16 * 4 * 4
        gen = torch.Generator().manual_seed(31)
        if kv_first:  # (2, num_blocks, layers, ...): K of every layer one run, V another
            big = random_tensor((2, NUM_BLOCKS, layers, 16, 4), torch.float32, gen, self.device)
            views = {f"layer.{i}": big[:, :, i] for i in range(layers)}
        else:
            big = random_tensor((NUM_BLOCKS, layers, 2, 16, 4), torch.float32, gen, self.device)
            views = {f"layer.{i}": big[:, i] for i in range(layers)}
        caches = register_kv_caches(views, _cross_layer_spec(layers, page), NUM_BLOCKS)
        assert len(caches.tensors) == (2 if kv_first else 1)
        self._cross_layer_round_trip(big, caches, block_bytes=layers * page, kv_first=kv_first)

    def _cross_layer_round_trip(
        self,
        big: torch.Tensor,
        caches: CanonicalKVCaches,
        *,
        block_bytes: int,
        kv_first: bool = False,
    ) -> None:
        assert caches.offloaded_block_bytes_per_rank() == block_bytes
        pool = self.pool(6, block_bytes)
        pool.rows_view().fill_(0x5A)
        transfers = self.engine(caches, pool)
        job = transfer([[4, 5, 6, 9]], [[1, 2, 3, 5]])  # 4 and 5 (slots 1, 2) merge into one run
        stored = run(transfers.submit_store(job), transfers)
        assert stored.bytes_copied == 4 * block_bytes
        original = big.clone()
        for slot, block in zip((1, 2, 3, 5), (4, 5, 6, 9), strict=True):
            row = pool.block_view(slot)
            if kv_first:
                expected = torch.cat([_bytes_of(big[0, block]), _bytes_of(big[1, block])])
            else:
                expected = _bytes_of(big[block])
            assert torch.equal(row, expected)
        assert (pool.block_view(0) == 0x5A).all() and (pool.block_view(4) == 0x5A).all()
        big.zero_()
        loaded = run(transfers.submit_load(job), transfers)
        assert loaded == stored
        blocks = [4, 5, 6, 9]
        dim = 1 if kv_first else 0
        assert torch.equal(
            _bytes_of(big.index_select(dim, _ids(blocks, big.device))),
            _bytes_of(original.index_select(dim, _ids(blocks, big.device))),
        )
        others = [b for b in range(big.shape[dim]) if b not in blocks]
        assert not big.index_select(dim, _ids(others, big.device)).any()

    def test_byte_sized_pages_round_trip(self) -> None:
        # Pages of 99 and 37 bytes: nothing is word-aligned, so copies move single bytes.
        groups = (
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (99,), layer_names=("a",)),
            KVCacheGroup(
                GroupKind.SLIDING_WINDOW, 16, (37,), sliding_window=16, layer_names=("b",)
            ),
        )
        gen = torch.Generator().manual_seed(40)
        kv = {
            "a": random_tensor((NUM_BLOCKS, 99), torch.uint8, gen, self.device),
            "b": random_tensor((NUM_BLOCKS + 1, 41), torch.uint8, gen, self.device)[:, :37],
        }
        caches = register_kv_caches(kv, KVCacheSpec(groups, 16, 2), NUM_BLOCKS)
        pool = self.pool(5, caches.offloaded_block_bytes_per_rank())
        transfers = self.engine(caches, pool)
        job = transfer([[3, 4, 5], [0, 7]], [[0, 1], [3]])
        run(transfers.submit_store(job), transfers)
        original = {name: t.clone() for name, t in kv.items()}
        for tensor in kv.values():
            tensor.zero_()
        run(transfers.submit_load(job), transfers)
        for block in (3, 4, 5):
            assert torch.equal(kv["a"][block], original["a"][block])
        assert torch.equal(kv["b"][7], original["b"][7])
        assert not kv["b"][0].any() and not kv["a"][6].any()

    def test_an_empty_job_copies_nothing(self) -> None:
        model = self.model(50)
        before = model.snapshot()
        result = model.store(transfer([[], [], [], []], [[], [], [], []]))
        assert result == TransferResult(0, 0, 0, (0, 0, 0, 0))
        only_nulls = model.load(transfer([[], [], [0, 0], [0]], [[], [], [1, 3], [2]]))
        assert only_nulls.bytes_copied == 0 and only_nulls.null_blocks_skipped == 3
        assert model.snapshot() == before

    @pytest.mark.parametrize("factor", [1, 3])
    def test_random_jobs_round_trip(self, factor: int) -> None:
        rng = np.random.default_rng(factor)
        source = self.model(12, factor=factor)
        target = self.model(13, source.pool, factor=factor, zero=True)
        for _ in range(6):
            ids, slots, firsts = [], [], []
            free_slots = list(rng.permutation(NUM_SLOTS))
            for _g in range(4):
                first = int(rng.integers(0, factor))
                max_slots = min(2, len(free_slots))
                count = int(rng.integers(0, max(0, max_slots * factor - first) + 1))
                group_ids = rng.permutation(np.arange(1, NUM_BLOCKS))[:count].tolist()
                num_slots = -(-(first + count) // factor) if count else 0
                ids.append(group_ids)
                slots.append([int(s) for s in free_slots[:num_slots]])
                firsts.append(first)
                free_slots = free_slots[num_slots:]
            job = transfer(ids, slots, tuple(firsts))
            stored = source.store(job)
            assert target.load(job) == stored
            assert stored.bytes_copied == sum(
                len(ids[g]) * source.caches.bytes_per_gpu_block(g) for g in range(4)
            )
            for g in range(4):
                for block in ids[g]:
                    assert group_block(target.kv, g, block) == group_block(source.kv, g, block)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8).cpu()


def _ids(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _used_bytes(model: HybridModel, group: int, part: bytes) -> bytes:
    """The bytes of ``group`` in one rank's part of a row, in layer order."""
    out = b""
    offsets = np.concatenate(([0], np.cumsum([t.page_bytes for t in model.caches.tensors])))
    by_layer: dict[str, list[tuple[int, int]]] = {}
    for ref in model.caches.group_refs[group]:
        canonical = model.caches.tensors[ref.tensor_idx]
        start = int(offsets[ref.tensor_idx]) + ref.offset_bytes
        by_layer.setdefault(canonical.layer_names[0], []).append((start, ref.page_bytes))
    for layer in GROUP_LAYERS[group]:
        for start, length in by_layer[layer]:
            out += part[start : start + length]
    return out
