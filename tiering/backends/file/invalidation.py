"""Slot invalidation: a slot that left the index is zeroed on disk before it is reused.

Deletes
    ``delete`` drops the key from the index at once (it is no longer visible), then zeroes the
    slot's header area and, with ``durability="fsync"``, runs ``fdatasync`` before returning;
    only then is the slot reused. If a concurrent ``get`` is reading the slot, the zeroing
    waits for it and runs in the background. Deletes without fsync are durable against a
    process crash, not a power loss: a lost invalidation can bring back an entry, but only
    one that verifies in full (it is the key's bytes, never another key's).

The same holds for the slots a put leaves (a replaced entry, a failed write) and for a slot a
get found corrupt or unreadable.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from tiering.backends.base import BackendStats
from tiering.backends.file.buffers import Job
from tiering.backends.file.slot_index import SlotIndex
from tiering.backends.file.slot_io import SlotIO
from tiering.backends.file.workers import IoWorkers

# One logger for the whole backend, named as before it became a package.
logger = logging.getLogger("tiering.backends.file")


class SlotInvalidator:
    """Zeroes the header areas of slots that left the index, then frees them (tracked as an
    operation in flight). Read-only, a slot is only dropped from memory."""

    __slots__ = ("_index", "_io", "_workers", "_stats", "_path", "_read_only", "_sync")

    def __init__(
        self,
        index: SlotIndex,
        io: SlotIO,
        workers: IoWorkers,
        stats: BackendStats,
        *,
        path: Path,
        read_only: bool,
        sync: bool,
    ) -> None:
        self._index = index
        self._io = io
        self._workers = workers
        self._stats = stats
        self._path = path
        self._read_only = read_only
        self._sync = sync  # durability="fsync": fdatasync after zeroing

    def discard(self, slots: list[int]) -> list[asyncio.Future[Any]]:
        """Invalidate slots that left the index (or never entered it), then free them.

        Slots pinned by a reader are invalidated when the last reader leaves.
        """
        ready = self._index.retire(slots)
        return [self.in_background(ready)] if ready else []

    def unpin(self, jobs: list[Job]) -> list[asyncio.Future[Any]]:
        """Unpin a get's slots; invalidate the retired ones it was the last reader of."""
        ready = self._index.unpin(jobs)
        return [self.in_background(ready)] if ready else []

    def in_background(self, slots: list[int]) -> asyncio.Future[Any]:
        """Zero the slots' header areas on an I/O thread; free them when done (tracked op).

        Read-only, a slot is only dropped from memory: nothing on disk changes."""
        assert self._workers.pool is not None
        if self._read_only:
            for slot in slots:
                self._index.slots.release(slot)
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        self._workers.begin_op()
        future = self._workers.submit(self._io.invalidate_slots, slots, self._sync)

        def finished(done: asyncio.Future[Any]) -> None:
            error = done.exception() if not done.cancelled() else None
            if error is not None:
                logger.warning("file backend %s: invalidation failed: %s", self._path, error)
                self._stats.extra["invalidate_failures"] += 1
            # Free the slots even so: the next put overwrites them.
            for slot in slots:
                self._index.slots.release(slot)
            self._workers.end_op()

        future.add_done_callback(finished)
        return future
