"""The file backend's index: which key lives in which slot, which slots are free, which are
pinned by readers, and the last sequence number. Event-loop state: I/O threads never touch it.

Two puts of one key may finish out of order: the one that started later (higher sequence
number) wins, in memory as on disk after a restart. The index switches to a slot only once it
is written; the slot it leaves is retired, and zeroed on disk before it is reused
(:mod:`tiering.backends.file.invalidation`).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

from tiering.backends.base import BackendStats, Outcome
from tiering.backends.file.buffers import Job
from tiering.errors import CorruptBlockError

# One logger for the whole backend, named as before it became a package.
logger = logging.getLogger("tiering.backends.file")


class Entry(NamedTuple):
    slot: int
    seq: int


class SlotTable:
    """Free slots (a min-heap) and reader pins. Used from the event-loop thread only.

    A slot leaves the table on ``allocate_many`` and comes back on ``release``. ``retire`` says
    whether a slot that left the index may be invalidated now, or must wait for its readers
    (``unpin`` returns True when the last reader of a retired slot leaves).
    """

    def __init__(self, n_slots: int, used: set[int]) -> None:
        self._free = [slot for slot in range(n_slots) if slot not in used]
        heapq.heapify(self._free)
        self._pins: dict[int, int] = {}
        self._retired: set[int] = set()

    def __len__(self) -> int:
        return len(self._free)

    def allocate_many(self, n: int) -> list[int]:
        """Up to ``n`` slots, lowest first (fewer when fewer are free)."""
        free = self._free
        pop = heapq.heappop
        return [pop(free) for _ in range(min(n, len(free)))]

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def pin(self, slot: int) -> None:
        self._pins[slot] = self._pins.get(slot, 0) + 1

    def unpin(self, slot: int) -> bool:
        left = self._pins[slot] - 1
        if left:
            self._pins[slot] = left
            return False
        del self._pins[slot]
        if slot in self._retired:
            self._retired.discard(slot)
            return True
        return False

    def retire(self, slot: int) -> bool:
        if slot in self._pins:
            self._retired.add(slot)
            return False
        return True


class SlotIndex:
    """The keys' slots (``entries``), the slot table and the sequence counter of one backend.

    The ``commit_*`` methods apply a batch's outcomes and count them in the backend's stats;
    the methods that take slots out of use return those that may be zeroed now (the rest wait
    for their readers).
    """

    __slots__ = ("entries", "slots", "seq", "_stats", "_block_bytes", "_path")

    def __init__(self, stats: BackendStats, block_bytes: int, path: Path) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.slots = SlotTable(0, set())
        self.seq = 0
        self._stats = stats
        self._block_bytes = block_bytes
        self._path = path

    def reset(self) -> None:
        """Forget every entry (the backend closed)."""
        self.entries = {}
        self.slots = SlotTable(0, set())

    def rebuild(self, entries: dict[bytes, Entry], n_slots: int, seq: int) -> None:
        """Start from recovered ``entries`` in a file of ``n_slots``; ``seq``: the highest seen."""
        self.entries = entries
        self.slots = SlotTable(n_slots, {entry.slot for entry in entries.values()})
        self.seq = seq

    # -- put -------------------------------------------------------------------------------------

    def allocate_jobs(
        self,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        wanted: int,
        needs_bounce: Callable[[memoryview], bool],
    ) -> list[Job]:
        """A job in a free slot, with a fresh sequence number, for each of the first ``wanted``
        keys (fewer when fewer slots are free)."""
        # Per-block work on the loop thread delays the first write: kept to the bare minimum.
        slots = self.slots.allocate_many(wanted)
        first_seq = self.seq + 1
        self.seq += len(slots)
        return [
            Job(position, keys[position], view, slot, first_seq + position, needs_bounce(view))
            for position, (slot, view) in enumerate(zip(slots, views, strict=False))
        ]

    def commit_puts(
        self, jobs: list[Job], errors: list[BaseException | None], results: list[Outcome]
    ) -> list[int]:
        """Point each written key at its slot; return the slots that left (or never entered)
        the index: failed writes, replaced entries, writes overtaken by a later put."""
        retired: list[int] = []
        index = self.entries
        written = 0
        for job, error in zip(jobs, errors, strict=True):
            if error is not None:
                logger.warning("file backend %s: put failed: %s", self._path, error)
                self._stats.put_failures += 1
                results[job.position] = Outcome.FAILED
                retired.append(job.slot)  # may hold a whole block whose fsync failed
                continue
            results[job.position] = Outcome.OK
            written += 1
            current = index.get(job.key)
            if current is not None and current.seq > job.seq:
                retired.append(job.slot)  # a put of this key that started later landed first
                continue
            index[job.key] = Entry(job.slot, job.seq)
            if current is not None:
                retired.append(current.slot)
        self._stats.bytes_written += written * self._block_bytes
        return retired

    # -- get -------------------------------------------------------------------------------------

    def pin_jobs(
        self,
        keys: Sequence[bytes],
        views: Sequence[memoryview],
        needs_bounce: Callable[[memoryview], bool],
    ) -> list[Job]:
        """A job for each key in the index, its slot pinned until :meth:`unpin`; slot order."""
        jobs: list[Job] = []
        for position, (key, view) in enumerate(zip(keys, views, strict=True)):
            entry = self.entries.get(key)
            if entry is None:
                continue
            self.slots.pin(entry.slot)
            jobs.append(Job(position, key, view, entry.slot, entry.seq, needs_bounce(view)))
        jobs.sort(key=lambda job: job.slot)  # neighbouring slots are read with one preadv
        return jobs

    def commit_gets(
        self, jobs: list[Job], errors: list[BaseException | None], results: list[Outcome]
    ) -> None:
        """Count each read; drop the keys whose slot did not verify or could not be read."""
        dropped: list[int] = []
        for job, error in zip(jobs, errors, strict=True):
            if error is None:
                results[job.position] = Outcome.OK
                self._stats.hits += 1
                self._stats.bytes_read += self._block_bytes
                continue
            if isinstance(error, CorruptBlockError):
                logger.warning("file backend %s: corrupt block: %s", self._path, error)
                results[job.position] = Outcome.CORRUPT
                self._stats.corrupt += 1
            else:
                logger.warning("file backend %s: read failed: %s", self._path, error)
                results[job.position] = Outcome.FAILED
                self._stats.read_failures += 1
            if self.entries.get(job.key) == (job.slot, job.seq):
                del self.entries[job.key]
                dropped.append(job.slot)
        # The slots are still pinned by this get: retiring them defers the invalidation to
        # unpin, which runs right after.
        for slot in dropped:
            self.slots.retire(slot)

    def unpin(self, jobs: list[Job]) -> list[int]:
        """Unpin the jobs' slots; return the retired ones whose last reader this was."""
        return [job.slot for job in jobs if self.slots.unpin(job.slot)]

    # -- delete ----------------------------------------------------------------------------------

    def retire(self, slots: list[int]) -> list[int]:
        """Retire slots that left the index; return those no reader pins (zero them now)."""
        return [slot for slot in slots if self.slots.retire(slot)]

    def drop(self, keys: Sequence[bytes]) -> tuple[list[bool], list[int]]:
        """Drop each key: whether it was there, and the slots that may be zeroed now."""
        results: list[bool] = []
        ready: list[int] = []
        for key in keys:
            entry = self.entries.pop(key, None)
            results.append(entry is not None)
            if entry is not None and self.slots.retire(entry.slot):
                ready.append(entry.slot)
        return results, ready
