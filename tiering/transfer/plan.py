"""Transfer jobs and their copy plans: which bytes move between the KV caches and the pool.

A :class:`PoolTransfer` names engine block ids per group and pool slots (as a store plan gives
them). :class:`TransferPlanner` validates all of it before anything moves (ids, slots, group
sizes, ``first_sub_block``, double writes) and turns it into a :class:`CopyPlan`: one entry per
(run of a group's bytes in a canonical tensor, engine block), each entry a byte range on both
sides, plus the same entries merged where both sides continue each other. Strategies
(:mod:`tiering.transfer.strategy`) only ever execute plans; they never validate.

Where the bytes are (the row layout is in :mod:`tiering.pool`): block ``b`` of canonical tensor
``t`` starts at byte ``b * block_stride_bytes[t]`` of the tensor; sub-block ``k`` of tensor
``t`` in slot ``s`` starts at byte ``s * row_bytes + part_offset[t] + k * page_bytes[t]`` of this
rank's part of the pool. A group's refs into one tensor (the layers of a cross-layer page) that
continue each other are one run, so a cross-layer block copies as one range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from tiering.errors import BackendError, ConfigurationError, LayoutError
from tiering.groups import GroupKind
from tiering.layout import CanonicalKVCaches
from tiering.pool import CPUBlockPool

__all__ = [
    "NULL_BLOCK_ID",
    "CopyEntries",
    "CopyPlan",
    "PoolGeometry",
    "PoolTransfer",
    "TransferPlanner",
    "TransferResult",
]

#: Engine block id meaning "no block" (outside a sliding window, Mamba padding).
NULL_BLOCK_ID = 0
_SKIPS_NULL_BLOCKS = (GroupKind.SLIDING_WINDOW, GroupKind.MAMBA)


@dataclass(frozen=True, eq=False)
class PoolTransfer:
    """Which engine blocks of each group go to (or come from) which pool slots.

    ``engine_block_ids`` is flat, grouped by group: ``group_sizes[g]`` ids belong to group
    ``g``. Position ``p`` of group ``g`` is sub-block ``first_sub_block[g] + p`` of the group's
    run of offloaded blocks, so group ``g`` uses ``ceil((first_sub_block[g] + group_sizes[g]) /
    block_size_factor)`` slots, listed flat in ``slots`` in the same group order.
    ``first_sub_block`` (default all 0) is vLLM's ``block_indices[g] % block_size_factor``.
    """

    engine_block_ids: np.ndarray
    group_sizes: tuple[int, ...]
    slots: np.ndarray
    first_sub_block: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "engine_block_ids", _as_ids(self.engine_block_ids, "engine ids"))
        object.__setattr__(self, "slots", _as_ids(self.slots, "slots"))
        sizes = _as_counts(self.group_sizes, "group_sizes")
        object.__setattr__(self, "group_sizes", sizes)
        first = _as_counts(self.first_sub_block, "first_sub_block") or (0,) * len(sizes)
        if len(first) != len(sizes):
            raise LayoutError(
                f"first_sub_block has {len(first)} entries but group_sizes has {len(sizes)}"
            )
        object.__setattr__(self, "first_sub_block", first)
        if sum(sizes) != len(self.engine_block_ids):
            raise LayoutError(
                f"group_sizes {sizes} add up to {sum(sizes)} but there are "
                f"{len(self.engine_block_ids)} engine block ids"
            )

    @classmethod
    def from_block_indices(
        cls,
        engine_block_ids: Sequence[int] | np.ndarray,
        group_sizes: Sequence[int],
        block_indices: Sequence[int],
        slots: Sequence[int] | np.ndarray,
        block_size_factor: int,
    ) -> PoolTransfer:
        """From a store plan's ``block_indices`` (first listed GPU block index per group)."""
        _check_positive(block_size_factor, "block_size_factor")
        first = tuple(int(i) % block_size_factor for i in block_indices)
        return cls(np.asarray(engine_block_ids), tuple(group_sizes), np.asarray(slots), first)

    def slots_per_group(self, block_size_factor: int) -> tuple[int, ...]:
        """How many slots each group's listed engine blocks span."""
        return tuple(
            -(-(first + size) // block_size_factor) if size else 0
            for first, size in zip(self.first_sub_block, self.group_sizes, strict=True)
        )


@dataclass(frozen=True)
class TransferResult:
    """What a copy really moves: null blocks skipped are not counted as copied."""

    engine_blocks_copied: int
    null_blocks_skipped: int
    bytes_copied: int
    engine_blocks_per_group: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class PoolGeometry:
    """Where one rank's KV caches and its part of the pool rows are, in bytes.

    Per canonical tensor ``t``: ``page_bytes[t]``, ``block_stride_bytes[t]`` (engine side) and
    ``part_offset[t]`` (where its ``block_size_factor`` pages start in a row part). ``rows`` is
    this rank's part of every row, ``(num_slots, block_bytes)`` with a row stride of
    ``row_bytes``; it keeps the pool's memory mapped.
    """

    caches: CanonicalKVCaches
    pool: CPUBlockPool
    rank: int
    block_size_factor: int
    rows: torch.Tensor
    page_bytes: np.ndarray
    block_stride_bytes: np.ndarray
    part_offset: np.ndarray

    @classmethod
    def of(
        cls,
        caches: CanonicalKVCaches,
        pool: CPUBlockPool,
        rank: int = 0,
        block_size_factor: int | None = None,
    ) -> PoolGeometry:
        """Check that ``pool`` fits ``caches`` (block bytes, rank) and describe both."""
        factor = caches.spec.block_size_factor if block_size_factor is None else block_size_factor
        _check_positive(factor, "block_size_factor")
        needed = caches.offloaded_block_bytes_per_rank(factor)
        if pool.block_bytes != needed:
            raise LayoutError(
                f"the pool's block_bytes={pool.block_bytes} but the registered KV caches need "
                f"{needed} bytes per rank for one offloaded block (block_size_factor={factor})"
            )
        rows = pool.rank_view(rank)  # validates rank
        pages = np.array([t.page_bytes for t in caches.tensors], dtype=np.int64)
        strides = np.array([t.block_stride_bytes for t in caches.tensors], dtype=np.int64)
        part_offset = np.concatenate(([0], np.cumsum(pages * factor)[:-1])).astype(np.int64)
        return cls(caches, pool, rank, factor, rows, pages, strides, part_offset)

    @property
    def device(self) -> torch.device:
        return self.caches.device

    @property
    def num_tensors(self) -> int:
        return len(self.caches.tensors)

    @property
    def block_bytes(self) -> int:
        """Bytes of this rank's part of a row."""
        return self.pool.block_bytes

    @property
    def row_bytes(self) -> int:
        return self.pool.row_bytes

    @property
    def num_slots(self) -> int:
        return self.pool.num_blocks

    def tensor_address(self, tensor_idx: int) -> int:
        """Address of block 0 of canonical tensor ``tensor_idx``."""
        return int(self.caches.tensors[tensor_idx].tensor.data_ptr())

    @property
    def rows_address(self) -> int:
        """Address of this rank's part of row 0."""
        return int(self.rows.data_ptr())

    @property
    def rows_extent_bytes(self) -> int:
        """Bytes from this rank's part of row 0 to the end of its part of the last row."""
        return (self.num_slots - 1) * self.row_bytes + self.block_bytes


@dataclass(frozen=True)
class CopyEntries:
    """Byte ranges to copy: per entry, a canonical tensor, an offset in it (from block 0), an
    offset in this rank's part of the pool (from row 0) and a length."""

    tensor_idx: np.ndarray
    engine_offset: np.ndarray
    pool_offset: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)


@dataclass(frozen=True)
class CopyPlan:
    """A validated job: ``entries`` (one per run and engine block, grouped by group, run-major)
    and ``runs`` (the entries merged where both sides continue each other)."""

    to_pool: bool
    entries: CopyEntries
    runs: CopyEntries
    result: TransferResult

    @property
    def nbytes(self) -> int:
        return self.result.bytes_copied


@dataclass(frozen=True)
class _GroupRuns:
    """One group's runs: per run, its canonical tensor, offset in the page and length."""

    tensor_idx: np.ndarray
    page_offset: np.ndarray
    nbytes: np.ndarray
    skips_null: bool


class TransferPlanner:
    """Validates transfer jobs against one rank's geometry and plans their copies.

    Null block ids (``null_block_id``) are skipped in sliding-window and Mamba groups; in
    full-attention groups every id is a real block.
    """

    def __init__(self, geometry: PoolGeometry, *, null_block_id: int = NULL_BLOCK_ID) -> None:
        self.geometry = geometry
        self._null_block_id = null_block_id
        self._groups = [self._group_runs(g) for g in range(len(geometry.caches.group_refs))]

    def _group_runs(self, group_idx: int) -> _GroupRuns:
        caches = self.geometry.caches
        refs = caches.group_refs[group_idx]
        # A group's refs into one tensor that continue each other (the layers of a cross-layer
        # page) are one run.
        runs: list[tuple[int, int, int]] = []
        order = sorted(range(len(refs)), key=lambda i: (refs[i].tensor_idx, refs[i].offset_bytes))
        for i in order:
            ref = refs[i]
            last = runs[-1] if runs else None
            if last and last[0] == ref.tensor_idx and last[1] + last[2] == ref.offset_bytes:
                runs[-1] = (last[0], last[1], last[2] + ref.page_bytes)
            else:
                runs.append((ref.tensor_idx, ref.offset_bytes, ref.page_bytes))
        columns = np.array(runs, dtype=np.int64).reshape(-1, 3)
        skips = caches.spec.groups[group_idx].kind in _SKIPS_NULL_BLOCKS
        return _GroupRuns(columns[:, 0], columns[:, 1], columns[:, 2], skips)

    def plan(self, job: PoolTransfer, *, to_pool: bool) -> CopyPlan:
        """Validate ``job`` completely and plan its copies; raises :class:`LayoutError` (or
        :class:`BackendError` for a closed pool) and changes nothing on a bad job."""
        geometry = self.geometry
        if geometry.pool.closed:
            raise BackendError(f"{geometry.pool!r} is closed")
        group_slots = self._check_shape(job)
        parts: list[_Entries] = []
        copied, skipped = [], 0
        id_start = slot_start = 0
        for g, runs in enumerate(self._groups):
            size, num_slots = job.group_sizes[g], group_slots[g]
            ids = job.engine_block_ids[id_start : id_start + size]
            slots = job.slots[slot_start : slot_start + num_slots]
            id_start, slot_start = id_start + size, slot_start + num_slots
            positions = job.first_sub_block[g] + np.arange(size, dtype=np.int64)
            keep = ids != self._null_block_id if runs.skips_null else np.ones(size, dtype=bool)
            ids, positions = ids[keep], positions[keep]
            _check_range(ids, geometry.caches.num_blocks, f"group {g}: engine block id")
            _check_range(slots, geometry.num_slots, f"group {g}: slot")
            copied.append(len(ids))
            skipped += size - len(ids)
            block_slots = slots[positions // geometry.block_size_factor]
            parts.append(self._entries(g, runs, ids, block_slots, positions))
        entries = _Entries.concatenate(parts)
        entries.check_no_double_write(to_pool)
        result = TransferResult(sum(copied), skipped, int(entries.nbytes.sum()), tuple(copied))
        plain = entries.plain()
        return CopyPlan(to_pool, plain, _merge_adjacent(plain), result)

    def _entries(
        self,
        group_idx: int,
        runs: _GroupRuns,
        ids: np.ndarray,
        slots: np.ndarray,
        positions: np.ndarray,
    ) -> _Entries:
        """Entries ordered run-major, so consecutive blocks of one tensor can merge."""
        geometry = self.geometry
        t = runs.tensor_idx
        sub = (positions % geometry.block_size_factor)[None, :] * geometry.page_bytes[t][:, None]
        pool_start = geometry.part_offset[t] + runs.page_offset
        pool = slots[None, :] * geometry.row_bytes + pool_start[:, None] + sub
        engine = geometry.block_stride_bytes[t][:, None] * ids[None, :] + runs.page_offset[:, None]
        count = len(t) * len(ids)
        return _Entries(
            tensor_idx=np.repeat(t, len(ids)),
            engine_offset=engine.reshape(-1),
            pool_offset=pool.reshape(-1),
            nbytes=np.repeat(runs.nbytes, len(ids)),
            group=np.full(count, group_idx, dtype=np.int64),
            block_id=np.tile(ids, len(t)),
            slot=np.tile(slots, len(t)),
        )

    def _check_shape(self, job: PoolTransfer) -> tuple[int, ...]:
        factor = self.geometry.block_size_factor
        num_groups = len(self._groups)
        if len(job.group_sizes) != num_groups:
            raise LayoutError(
                f"the transfer lists {len(job.group_sizes)} groups; the caches have {num_groups}"
            )
        for g, first in enumerate(job.first_sub_block):
            if first >= factor:
                raise LayoutError(
                    f"group {g}: first_sub_block={first} is out of range; valid: "
                    f"0..{factor - 1} (block_size_factor={factor})"
                )
        expected = job.slots_per_group(factor)
        if sum(expected) != len(job.slots):
            raise LayoutError(
                f"the transfer lists {len(job.slots)} slots; its engine blocks need "
                f"{sum(expected)} (per group: {expected})"
            )
        return expected


@dataclass(frozen=True)
class _Entries:
    """Copy entries plus what each came from (for error messages)."""

    tensor_idx: np.ndarray
    engine_offset: np.ndarray
    pool_offset: np.ndarray
    nbytes: np.ndarray
    group: np.ndarray
    block_id: np.ndarray
    slot: np.ndarray

    @classmethod
    def concatenate(cls, parts: Sequence[_Entries]) -> _Entries:
        names = [f.name for f in fields(cls)]
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in names))

    def plain(self) -> CopyEntries:
        return CopyEntries(self.tensor_idx, self.engine_offset, self.pool_offset, self.nbytes)

    def check_no_double_write(self, to_pool: bool) -> None:
        """Raise if two entries would write the same bytes (a racy, lossy transfer)."""
        if len(self.nbytes) < 2:
            return
        # Canonical tensors never overlap (registration checks it): (tensor, offset) orders them.
        space = np.zeros_like(self.tensor_idx) if to_pool else self.tensor_idx
        start = self.pool_offset if to_pool else self.engine_offset
        order = np.lexsort((start, space))
        same_space = space[order][1:] == space[order][:-1]
        ends = start[order][:-1] + self.nbytes[order][:-1]
        overlaps = same_space & (start[order][1:] < ends)
        if not overlaps.any():
            return
        i = int(np.argmax(overlaps))
        a, b = int(order[i]), int(order[i + 1])
        if to_pool:
            what = f"slot {int(self.slot[b])}"
            sources = f"engine blocks {int(self.block_id[a])} and {int(self.block_id[b])}"
        else:
            what = f"engine block id {int(self.block_id[b])}"
            sources = f"slots {int(self.slot[a])} and {int(self.slot[b])}"
        raise LayoutError(
            f"the transfer writes {what} twice, from {sources} (groups {int(self.group[a])} "
            f"and {int(self.group[b])}); list each destination once"
        )


def _merge_adjacent(entries: CopyEntries) -> CopyEntries:
    """Merge entries that continue each other on both sides into one longer copy."""
    t, e, p, n = entries.tensor_idx, entries.engine_offset, entries.pool_offset, entries.nbytes
    if len(n) < 2:
        return entries
    continues = (t[1:] == t[:-1]) & (e[1:] == e[:-1] + n[:-1]) & (p[1:] == p[:-1] + n[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    return CopyEntries(t[starts], e[starts], p[starts], np.add.reduceat(n, starts))


def _check_range(values: np.ndarray, limit: int, what: str) -> None:
    bad = (values < 0) | (values >= limit)
    if bad.any():
        value = int(values[np.argmax(bad)])
        raise LayoutError(f"{what} {value} is out of range; valid: 0..{limit - 1}")


def _as_ids(values: object, what: str) -> np.ndarray:
    array = values.cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise LayoutError(f"{what} must be a 1-D integer sequence, got {array.dtype} {array.shape}")
    return array.astype(np.int64, copy=False)


def _as_counts(values: Sequence[int], what: str) -> tuple[int, ...]:
    counts = tuple(values)
    for i, count in enumerate(counts):
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise LayoutError(f"{what}[{i}] must be a non-negative int, got {count!r}")
    return tuple(int(c) for c in counts)


def _check_positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{what} must be a positive int, got {value!r}")
