"""The ``staging`` strategy: gather on the device into a bounded staging buffer, then few DMAs.

Pure torch, so it works on any GPU and driver (and on CPU, where it is only a fallback). The
staging buffer holds up to ``staging_bytes // block_bytes`` rows laid out like this rank's part
of the pool rows; a job's distinct slots go through it in batches of that many rows:

* store: per (canonical tensor, run) one ``index_select`` of the engine blocks and one
  ``index_put_`` into the staging rows, then one copy per range that is contiguous in both the
  staging buffer and the pool (a whole row, or a run of consecutive slots, when the job writes
  whole rows);
* load: the same copies in reverse, then per (tensor, run) one gather from the staging rows
  and one ``index_copy_`` into the engine blocks.

Only the bytes the plan names reach the pool: bytes of a staging row the job does not write are
never copied out. Index tables go to the device in one copy from pinned memory. With an
unpinned pool a CUDA copy to or from the pool is synchronous in the driver, so the caller waits:
pin the pool.
"""

from __future__ import annotations

import numpy as np
import torch

from tiering.errors import ConfigurationError
from tiering.transfer.plan import CopyPlan, PoolGeometry
from tiering.transfer.strategy import CopyStrategy, flat_byte_view

__all__ = ["DEFAULT_STAGING_BYTES", "StagingCopy"]

DEFAULT_STAGING_BYTES = 64 << 20

#: Entries copied by one gather: (tensor, offset in its page, length, entry positions).
_Gather = tuple[int, int, int, np.ndarray]


class StagingCopy(CopyStrategy):
    """Gather/scatter through a staging buffer of at most ``staging_bytes`` (at least one row)."""

    name = "staging"

    def __init__(
        self, geometry: PoolGeometry, *, staging_bytes: int = DEFAULT_STAGING_BYTES
    ) -> None:
        if (
            isinstance(staging_bytes, bool)
            or not isinstance(staging_bytes, int)
            or staging_bytes < 1
        ):
            raise ConfigurationError(f"staging_bytes must be a positive int, got {staging_bytes!r}")
        super().__init__(geometry)
        self.rows_per_batch = max(1, staging_bytes // geometry.block_bytes)
        self._staging: torch.Tensor | None = None  # allocated on first use
        self._pool = flat_byte_view(geometry.rows, geometry.rows_extent_bytes)
        self._non_blocking = geometry.pool.is_pinned

    def _staging_buffer(self, rows: int) -> torch.Tensor:
        """At least ``rows`` staging rows; grows up to ``rows_per_batch`` rows, never shrinks.

        Reusing (or freeing) it while earlier copies may still run is safe: every use is on the
        same stream (CUDA) or thread (CPU), in order.
        """
        needed = rows * self.geometry.block_bytes
        if self._staging is None or self._staging.numel() < needed:
            device = self.geometry.device
            self._staging = torch.empty(needed, dtype=torch.uint8, device=device)
        return self._staging

    def copy(self, plan: CopyPlan) -> object:
        entries = plan.entries
        if not len(entries):
            return None
        g = self.geometry
        t = entries.tensor_idx
        slot = entries.pool_offset // g.row_bytes
        in_row = entries.pool_offset - slot * g.row_bytes
        block = entries.engine_offset // g.block_stride_bytes[t]
        page_offset = entries.engine_offset - block * g.block_stride_bytes[t]
        sub = (in_row - g.part_offset[t] - page_offset) // g.page_bytes[t]
        slots, row = np.unique(slot, return_inverse=True)
        keepalive: list[torch.Tensor] = []
        for first in range(0, len(slots), self.rows_per_batch):
            rows = min(self.rows_per_batch, len(slots) - first)
            staging = self._staging_buffer(rows)
            in_batch = np.flatnonzero((row >= first) & (row < first + rows))
            batch_row = row[in_batch] - first
            gathers = self._gathers(t[in_batch], page_offset[in_batch], entries.nbytes[in_batch])
            index = self._device_index(gathers, block[in_batch], batch_row, sub[in_batch])
            keepalive.append(index)
            segments = self._segments(
                entries.pool_offset[in_batch],
                batch_row * g.block_bytes + in_row[in_batch],
                entries.nbytes[in_batch],
            )
            views = self._views(staging, rows, gathers, index)
            if plan.to_pool:
                for engine, staged, blocks, batch_rows, subs in views:
                    staged.index_put_((batch_rows, subs), engine.index_select(0, blocks))
                self._move(staging, segments, to_pool=True)
            else:
                self._move(staging, segments, to_pool=False)
                for engine, staged, blocks, batch_rows, subs in views:
                    engine.index_copy_(0, blocks, staged[batch_rows, subs])
        return keepalive

    @staticmethod
    def _gathers(
        tensor_idx: np.ndarray, page_offset: np.ndarray, nbytes: np.ndarray
    ) -> list[_Gather]:
        """Entries grouped by (tensor, offset in page, length): each group one gather."""
        keys = np.stack([tensor_idx, page_offset, nbytes], axis=1)
        unique, inverse = np.unique(keys, axis=0, return_inverse=True)
        inverse = inverse.reshape(-1)
        return [
            (int(k[0]), int(k[1]), int(k[2]), np.flatnonzero(inverse == i))
            for i, k in enumerate(unique)
        ]

    def _device_index(
        self,
        gathers: list[_Gather],
        block: np.ndarray,
        row: np.ndarray,
        sub: np.ndarray,
    ) -> torch.Tensor:
        """Per gather, its engine blocks, staging rows and sub-blocks, in one device tensor."""
        order = np.concatenate([members for *_, members in gathers])
        table = torch.from_numpy(np.concatenate([block[order], row[order], sub[order]]))
        device = self.geometry.device
        if device.type == "cuda":
            return table.pin_memory().to(device, non_blocking=True)
        return table

    def _views(
        self,
        staging: torch.Tensor,
        rows: int,
        gathers: list[_Gather],
        index: torch.Tensor,
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Per gather: engine pages, staging pages, and its block, row and sub-block indices."""
        g = self.geometry
        total = len(index) // 3
        views = []
        start = 0
        for t, offset, nbytes, members in gathers:
            count = len(members)
            blocks = index[start : start + count]
            staging_rows = index[total + start : total + start + count]
            subs = index[2 * total + start : 2 * total + start + count]
            start += count
            engine = g.caches.tensors[t].tensor[:, offset : offset + nbytes]
            staged = staging.as_strided(
                (rows, g.block_size_factor, nbytes),
                (g.block_bytes, int(g.page_bytes[t]), 1),
                int(g.part_offset[t]) + offset,
            )
            views.append((engine, staged, blocks, staging_rows, subs))
        return views

    @staticmethod
    def _segments(
        pool_offset: np.ndarray, staging_offset: np.ndarray, nbytes: np.ndarray
    ) -> list[tuple[int, int, int]]:
        """Ranges contiguous in both the pool and the staging buffer, as few as possible."""
        order = np.argsort(pool_offset, kind="stable")
        p, s, n = pool_offset[order], staging_offset[order], nbytes[order]
        continues = (p[1:] == p[:-1] + n[:-1]) & (s[1:] == s[:-1] + n[:-1])
        starts = np.flatnonzero(np.concatenate(([True], ~continues)))
        lengths = np.add.reduceat(n, starts)
        return list(zip(p[starts].tolist(), s[starts].tolist(), lengths.tolist(), strict=True))

    def _move(
        self, staging: torch.Tensor, segments: list[tuple[int, int, int]], *, to_pool: bool
    ) -> None:
        for p, s, n in segments:
            pooled, staged = self._pool[p : p + n], staging[s : s + n]
            dst, src = (pooled, staged) if to_pool else (staged, pooled)
            dst.copy_(src, non_blocking=self._non_blocking)
