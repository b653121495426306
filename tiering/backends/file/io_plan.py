"""How the file backend cuts a batch into I/O: chunks per thread hand-off, runs per system call,
parts per slot, and how many lanes read side by side. Each size, and why (measured here).

A put hands its slots to the backend's threads in chunks (:func:`tiering.backends.lanes.
run_in_lanes`); each chunk moves each run of neighbouring slots with one ``pwritev``. A get does
the same with ``preadv``, in runs small enough that the bytes are still in the CPU cache when
they are checksummed. ``benchmarks/bench_file_tier.py`` measures these paths against raw I/O.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tiering.backends.file.slot_format import SlotGeometry
from tiering.backends.settings import Durability

_READ_TASK_BYTES = 8 << 20  # the most one read chunk moves (see read_task_slots)
_READ_RUN_BYTES = 1 << 20  # the most one buffered preadv moves (see read_run_slots)
_WRITE_CHUNK_BYTES = 4 << 20  # the most one write chunk moves (see write_chunk_slots)
_BOUNCE_BYTES = 8 << 20  # the most one O_DIRECT run of bounced slots moves (see bounce_run)


@dataclass(frozen=True, slots=True)
class IoPlan:
    """The sizes of a backend's chunks, runs and parts (see :meth:`build` for the reasons)."""

    read_task_slots: int  # slots per read chunk
    read_lanes: int  # threads one get reads on
    write_chunk_slots: int  # slots per write chunk
    start_writeback: bool  # start each run's writeback as soon as it is written
    max_run: int  # the most slots one pwritev/preadv moves
    read_run_slots: int  # the most slots one read call moves
    read_part_bytes: int  # read a slot in parts of this many bytes (0: whole)
    bounce_run: int  # the most bounced slots one O_DIRECT call moves

    @classmethod
    def build(
        cls,
        geometry: SlotGeometry,
        *,
        o_direct: bool,
        io_threads: int,
        batch_blocks: int,
        durability: Durability,
    ) -> IoPlan:
        slot_bytes = geometry.slot_bytes
        # Each slot of a run takes up to 3 iovecs; the kernel takes at most IOV_MAX per call.
        max_run = max(1, min(batch_blocks, os.sysconf("SC_IOV_MAX") // 3))
        return cls(
            read_task_slots=_read_task_slots(slot_bytes, o_direct, batch_blocks),
            # A buffered get is one sequential stream: a second stream beside it defeats the
            # kernel's readahead (cold reads fell from ~0.95x to ~0.7x of raw preadv), and two
            # lanes taking turns on one stream lost more to thread wake-ups than the checksums
            # they overlapped (0.38x at 256 KiB under load). O_DIRECT has no readahead, and two
            # streams keep the device busier (~0.97x vs ~0.9x measured).
            read_lanes=io_threads if o_direct else 1,
            # A put checksums a chunk, then copies it: chunks small enough to stay in the cache
            # between the two passes read memory once (2 MiB blocks in chunks of 16 fell to
            # ~0.8x).
            write_chunk_slots=max(1, min(batch_blocks, _WRITE_CHUNK_BYTES // slot_bytes)),
            # A durable put starts the writeback of each run as soon as it is written, so that
            # the device works while the next runs are checksummed and copied; the put's one
            # fdatasync then waits for less (durable puts ~1.3x faster than write-all-then-sync).
            start_writeback=durability == "fsync" and not o_direct,
            max_run=max_run,
            read_run_slots=_read_run_slots(slot_bytes, o_direct, max_run),
            # A buffered slot bigger than that is read in parts of 1 MiB, each checksummed as it
            # arrives (cold reads of 2 MiB blocks: ~0.90x of raw read whole, ~0.94x in parts).
            read_part_bytes=(
                0 if o_direct or geometry.block_bytes <= _READ_RUN_BYTES else _READ_RUN_BYTES
            ),
            # O_DIRECT from unaligned buffers: a run of neighbouring slots goes through a
            # per-thread bounce area of up to 8 MiB with one call, not one call per slot (one
            # 256 KiB call at a time kept the device at ~0.6x of raw O_DIRECT reads).
            bounce_run=max(1, min(max_run, _BOUNCE_BYTES // geometry.payload_area_bytes)),
        )


def _read_task_slots(slot_bytes: int, o_direct: bool, batch_blocks: int) -> int:
    # Buffered read chunks stay within 8 MiB, so the payloads a chunk read are still in the
    # cache when they are verified. O_DIRECT has no readahead: the bigger the call, the
    # more requests the device gets at once.
    if o_direct:
        return batch_blocks
    return max(1, min(batch_blocks, _READ_TASK_BYTES // slot_bytes))


def _read_run_slots(slot_bytes: int, o_direct: bool, max_run: int) -> int:
    # A buffered read checksums each run right after its preadv: runs of at most 1 MiB
    # are still in the CPU cache then, and the kernel's readahead keeps the device busy
    # meanwhile (cold reads at 256 KiB, pairs of passes: 0.86-0.92x of raw preadv in runs
    # of 16 slots, 0.87-1.03x in runs of 2-3 slots). O_DIRECT has no readahead: the bigger the
    # call, the more the device is asked at once.
    if o_direct:
        return max_run
    return max(1, min(max_run, _READ_RUN_BYTES // slot_bytes))
