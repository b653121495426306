"""Transfer jobs and their copy plans: which bytes move between the KV caches and the pool.

A :class:`PoolTransfer` names engine block ids per group and pool slots (as a store plan gives
them). :class:`TransferPlanner` validates all of it before anything moves (ids, slots, group
sizes, ``first_sub_block``, double writes) and turns it into a :class:`CopyPlan`: one entry per
(run of a group's bytes in a canonical tensor, engine block), each entry a byte range on both
sides, plus the same entries merged where both sides continue each other. Strategies
(:mod:`tiering.transfer.strategy`) only ever execute plans; they never validate.

Where the bytes are (the row layout is in :mod:`tiering.managers.pool`): block ``b`` of canonical
tensor
``t`` starts at byte ``b * block_stride_bytes[t]`` of the tensor; sub-block ``k`` of tensor
``t`` in slot ``s`` starts at byte ``s * row_bytes + part_offset[t] + k * page_bytes[t]`` of this
rank's part of the pool. A group's refs into one tensor (the layers of a cross-layer page) that
continue each other are one run, so a cross-layer block copies as one range.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tiering.core.groups import GroupKind
from tiering.core.layout import CanonicalKVCaches
from tiering.errors import BackendError, ConfigurationError, LayoutError
from tiering.managers.pool import CPUBlockPool

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

    def columns(self) -> list[tuple[int, int, int]]:
        """Per run: (tensor, offset in the page, length)."""
        return list(
            zip(
                self.tensor_idx.tolist(),
                self.page_offset.tolist(),
                self.nbytes.tolist(),
                strict=True,
            )
        )


class TransferPlanner:
    """Validates transfer jobs against one rank's geometry and plans their copies.

    Null block ids (``null_block_id``) are skipped in sliding-window and Mamba groups; in
    full-attention groups every id is a real block.
    """

    def __init__(self, geometry: PoolGeometry, *, null_block_id: int = NULL_BLOCK_ID) -> None:
        self.geometry = geometry
        self._null_block_id = null_block_id
        self._groups = [self._group_runs(g) for g in range(len(geometry.caches.group_refs))]
        self._overlaps = self._overlapping_groups()

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
        blocks: list[_GroupBlocks] = []
        skipped = 0
        id_start = slot_start = 0
        for g, runs in enumerate(self._groups):
            size, num_slots = job.group_sizes[g], group_slots[g]
            ids = job.engine_block_ids[id_start : id_start + size]
            slots = job.slots[slot_start : slot_start + num_slots]
            id_start, slot_start = id_start + size, slot_start + num_slots
            positions = job.first_sub_block[g] + np.arange(size, dtype=np.int64)
            if runs.skips_null:
                keep = ids != self._null_block_id
                ids, positions = ids[keep], positions[keep]
            _check_range(ids, geometry.caches.num_blocks, f"group {g}: engine block id")
            _check_range(slots, geometry.num_slots, f"group {g}: slot")
            skipped += size - len(ids)
            factor = geometry.block_size_factor
            blocks.append(_GroupBlocks(ids, slots[positions // factor], positions % factor))
        self._check_no_double_write(blocks, to_pool)
        parts = [self._entries(runs, b) for runs, b in zip(self._groups, blocks, strict=True)]
        entries = CopyEntries(*(np.concatenate(column) for column in zip(*parts, strict=True)))
        copied = tuple(len(b.ids) for b in blocks)
        result = TransferResult(sum(copied), skipped, int(entries.nbytes.sum()), copied)
        return CopyPlan(to_pool, entries, _merge_adjacent(entries), result)

    def _entries(self, runs: _GroupRuns, blocks: _GroupBlocks) -> tuple[np.ndarray, ...]:
        """Entries ordered run-major, so consecutive blocks of one tensor can merge."""
        geometry = self.geometry
        t = runs.tensor_idx
        count = len(blocks.ids)
        sub = blocks.subs[None, :] * geometry.page_bytes[t][:, None]
        pool_start = geometry.part_offset[t] + runs.page_offset
        pool = blocks.slots[None, :] * geometry.row_bytes + pool_start[:, None] + sub
        stride = geometry.block_stride_bytes[t]
        engine = stride[:, None] * blocks.ids[None, :] + runs.page_offset[:, None]
        return (
            np.repeat(t, count),
            engine.reshape(-1),
            pool.reshape(-1),
            np.repeat(runs.nbytes, count),
        )

    def _overlapping_groups(self) -> list[tuple[int, int]]:
        """Pairs of groups (a <= b) whose runs share bytes of some page: their blocks must not
        meet at one destination (a slot and sub-block, or an engine block id)."""
        pairs = []
        for a, first in enumerate(self._groups):
            for b in range(a, len(self._groups)):
                second = self._groups[b]
                shared = any(
                    ta == tb and oa < ob + nb and ob < oa + na
                    for ta, oa, na in first.columns()
                    for tb, ob, nb in second.columns()
                )
                if shared:
                    pairs.append((a, b))
        return pairs

    def _check_no_double_write(self, blocks: list[_GroupBlocks], to_pool: bool) -> None:
        """Raise if two blocks would write the same bytes (a racy, lossy transfer).

        A store writes (slot, sub-block) places, a load engine block ids; two blocks collide
        when they share a place and their groups share bytes of a page (a group always does
        with itself). Checked per block, not per page: a job's pages are many.
        """
        factor = self.geometry.block_size_factor
        for a, b in self._overlaps:
            pair = (a,) if a == b else (a, b)
            keys = [
                blocks[g].slots * factor + blocks[g].subs if to_pool else blocks[g].ids
                for g in pair
            ]
            joined = np.concatenate(keys)
            if len(joined) < 2:
                continue
            order = np.argsort(joined, kind="stable")
            repeats = joined[order][1:] == joined[order][:-1]
            if not repeats.any():
                continue
            i = int(np.argmax(repeats))
            first, second = (_locate(int(order[k]), pair, keys) for k in (i, i + 1))
            (g1, j1), (g2, j2) = first, second
            if to_pool:
                what = f"slot {int(blocks[g2].slots[j2])}"
                sources = f"engine blocks {int(blocks[g1].ids[j1])} and {int(blocks[g2].ids[j2])}"
            else:
                what = f"engine block id {int(blocks[g2].ids[j2])}"
                sources = f"slots {int(blocks[g1].slots[j1])} and {int(blocks[g2].slots[j2])}"
            raise LayoutError(
                f"the transfer writes {what} twice, from {sources} (groups {g1} and {g2}); "
                "list each destination once"
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
class _GroupBlocks:
    """One group's blocks in a job (null blocks dropped): engine ids, slots, sub-blocks."""

    ids: np.ndarray
    slots: np.ndarray
    subs: np.ndarray

    def place(self, to_pool: bool, factor: int) -> np.ndarray:
        """What each block writes: a (slot, sub-block) number on a store, an id on a load."""
        return self.slots * factor + self.subs if to_pool else self.ids


def _locate(index: int, groups: tuple[int, ...], keys: list[np.ndarray]) -> tuple[int, int]:
    """(group, position in it) of position ``index`` in the groups' concatenated keys."""
    for group, group_keys in zip(groups, keys, strict=True):
        if index < len(group_keys):
            return group, index
        index -= len(group_keys)
    raise AssertionError("index past the keys")


def _merge_adjacent(entries: CopyEntries) -> CopyEntries:
    """Merge entries that continue each other on both sides into one longer copy."""
    t, e, p, n = entries.tensor_idx, entries.engine_offset, entries.pool_offset, entries.nbytes
    if len(n) < 2:
        return entries
    continues = (t[1:] == t[:-1]) & (e[1:] == e[:-1] + n[:-1]) & (p[1:] == p[:-1] + n[:-1])
    if not continues.any():
        return entries
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
