"""The local-NVMe file backend: fixed-size slots in one preallocated file.

Layout
    The backend owns a directory (mode 0700) holding ``slots.bin``, ``manifest.json`` and
    tiering's marker (:mod:`tiering.backends.ownership`): it claims only an absent or empty
    directory, or one that carries the marker, and refuses any other.
    ``slots.bin`` is ``capacity_blocks`` slots of ``slot_bytes`` each, preallocated with
    ``posix_fallocate`` so that writes into it cannot run out of space. A slot is a 4096-byte
    *header area* followed by the payload rounded up to 4096 bytes (so every slot, header and
    payload is aligned for ``O_DIRECT``). The header area holds the block header of
    :mod:`tiering.core.block_format` (128 bytes) and, right after it, a 16-byte *stamp*
    (a u64 sequence number and an xxh3-64 of header + sequence number); the rest is zero.
    Keys only ever live in headers: a slot is a number, so a hostile key never reaches the file
    system. ``manifest.json`` records the format version, slot size, block size, layout
    fingerprint and capacity; it is replaced atomically (temp file, fsync, rename, fsync dir).

Writes
    ``put`` allocates a free slot per key (lowest number first, so a fresh file fills
    sequentially) and hands the slots to a thread pool the backend owns, in chunks of at most
    ``batch_blocks`` slots and 4 MiB (small enough that the bytes checksummed are still in the
    CPU cache when they are copied). Up to ``io_threads`` threads share the chunks, each taking
    the next one in order (:func:`tiering.backends.lanes.run_in_lanes`), so a put costs one
    thread hand-off per thread, not per chunk. A chunk writes each run of neighbouring slots
    with one ``os.pwritev`` whose iovecs are, per slot, the header area and the caller's payload
    (plus a zero pad when the payload is not a multiple of 4096): bytes go straight from the
    caller's buffer to the kernel. If that call fails, the run is retried slot by slot, so that
    only the slots that fail again are ``FAILED``. Only when a slot is written (and, with
    ``durability="fsync"``, ``fdatasync`` returned) does the index switch to it; the slot a
    replaced key used is freed afterwards, so a failed replace never destroys the old entry.
    A replace therefore needs a free slot: at full capacity it reports ``FULL``.

Reads
    ``get`` reads each run of neighbouring slots with one ``os.preadv`` (header areas into
    small buffers, payloads straight into the caller's buffers) and verifies header, stamp,
    key, fingerprint and payload checksum on the caller's bytes, right after each run's read.
    A buffered get reads in chunks of at most 8 MiB on one lane, in slot order, and in runs of
    at most 1 MiB (a bigger slot in parts of 1 MiB, its checksum computed part by part), so the
    bytes are still in the CPU cache when they are checksummed and the kernel's readahead keeps
    the device busy meanwhile (O_DIRECT gets take ``batch_blocks`` slots per chunk and per call
    on every lane: bigger calls, deeper device queue). A failed call is retried slot by slot,
    as for writes. A slot being read is pinned: it is not invalidated or reused until the read
    finishes, so a concurrent put or delete of the same key never tears a read. A block that
    does not verify is counted, dropped from the index, its header zeroed on disk, and reported
    ``CORRUPT``. A read error (EIO) does the same and reports ``FAILED``.

O_DIRECT
    With ``o_direct=True`` the slot file bypasses the page cache. The kernel then needs buffers
    whose address and length are multiples of 4096; a caller buffer that is not goes through a
    per-thread bounce buffer (``mmap``), which costs one extra memcpy per block (~0.1 ms per
    MiB here) and is counted in ``stats.extra["o_direct_bounces"]``. Note that torch's CPU
    allocator aligns tensors to 64 bytes only: a pool meant for O_DIRECT should be carved out
    at a 4096-byte boundary (:class:`tiering.managers.pool.CPUBlockPool` rows are). A run of
    neighbouring bounced slots moves with one call through up to 8 MiB of bounce area per
    thread. Whether O_DIRECT pays is a property of the machine: see
    ``benchmarks/bench_file_tier.py``.

Durability
    ``durability="none"`` acknowledges a put once its bytes are in the page cache (they survive
    a process crash, not a power loss); ``"fsync"`` runs one ``fdatasync`` after all the put's
    writes and acknowledges only after it succeeds. Meanwhile each run's writeback is started
    as soon as it is written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, a hint that waits for
    nothing and promises nothing), so the device works while later runs are checksummed and
    copied and the ``fdatasync`` has less left to wait for. An fsync error is fatal for the
    keys it covers (the kernel may have dropped their pages; a retried fsync could falsely
    succeed): they are ``FAILED`` and never visible. Because one file descriptor is shared, a
    failed fsync in one put also fails every put whose writes overlapped it. ``close`` always
    flushes.

Concurrency and cancellation
    The index and the free list live on the event loop; threads only move bytes. Two puts of
    one key may finish out of order: the one that started later (higher sequence number) wins,
    in memory as on disk after a restart. A cancelled put waits for its in-flight writes (it
    never reads the caller's buffers after it returns), then drops them: each key keeps its
    earlier state. A cancelled get waits for its in-flight reads for the same reason. ``close``
    waits for every operation, including background header zeroing.

Deletes
    ``delete`` drops the key from the index at once (it is no longer visible), then zeroes the
    slot's header area and, with ``durability="fsync"``, runs ``fdatasync`` before returning;
    only then is the slot reused. If a concurrent ``get`` is reading the slot, the zeroing
    waits for it and runs in the background. Deletes without fsync are durable against a
    process crash, not a power loss: a lost invalidation can bring back an entry, but only
    one that verifies in full (it is the key's bytes, never another key's).

Recovery
    ``open`` rebuilds the index by reading every slot's header area (``recover="verify"`` also
    reads and checksums every payload; ``"trust_header"`` checks header, key, fingerprint,
    stamp and that the file holds the whole payload, leaving payload checks to ``get``;
    ``"wipe"`` starts empty). A slot that cannot be read (EIO) is skipped, not zeroed: an I/O
    error is no proof of damage, and a later open may recover it. Every slot that held
    something and is not recovered is counted: rejected (its header, stamp or payload does not
    verify, or it is not zero and has no header), unreadable, missing from a truncated file, or
    past the capacity (a capacity change keeps the entries of the slots that still fit). If
    the manifest (or, without one, the marker) names another block size, fingerprint or slot
    format, the data are another layout's: the open is refused (``on_layout_mismatch``), or
    they are set aside or wiped as configured, never emptied silently. A missing or damaged
    manifest costs a full verification of every slot (``manifest_damaged``), not the data.
    When one key is found in two slots (a crash
    between writing a new slot and invalidating the old one), the copy with the highest
    sequence number that verifies is kept: newer wins, and a torn newer copy (an
    unacknowledged put) falls back to the older, acknowledged one. Losing copies and rejected
    headers are zeroed.

Errors
    An ``OSError`` on one slot makes that key ``FAILED`` and the backend keeps serving. ENOSPC
    is reported as ``FAILED``, not ``FULL``: the file is preallocated, so running out of disk
    means the file system itself is full (a sparse or copy-on-write file), which evicting
    blocks from this tier would not fix; ``FULL`` means "no free slot", which eviction does.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import heapq
import json
import logging
import mmap
import os
import secrets
import stat
import struct
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple, TypeVar, get_args

import aiofiles
import aiofiles.os
import numpy as np
import xxhash

from tiering.backends._fileops import FileOps
from tiering.backends.base import (
    BackendCapabilities,
    Outcome,
    StorageBackend,
    is_block_view,
)
from tiering.backends.disk_guard import DiskGuard, allocated_bytes
from tiering.backends.lanes import run_in_lanes
from tiering.backends.ownership import (
    LayoutMismatchError,
    LayoutRecord,
    MismatchPolicy,
    TierDirectory,
    TierMarker,
    UntrustedEntryError,
    check_backend,
    claim_directory,
    created_by,
    examine_directory,
    foreign_directory_error,
    set_aside,
    write_marker,
)
from tiering.backends.settings import Durability, RecoverMode
from tiering.backends.tier_lock import lock_exclusive
from tiering.core.block_format import (
    HEADER_BYTES,
    MAGIC,
    MAX_KEY_BYTES,
    checksum_in_parts,
    pack_header,
    unpack_header,
    verify_block,
)
from tiering.core.keys import check_keys
from tiering.errors import BackendError, ConfigurationError, CorruptBlockError

__all__ = [
    "ALIGN_BYTES",
    "HEADER_AREA_BYTES",
    "MANIFEST_NAME",
    "SLOTS_NAME",
    "Durability",
    "FileBackend",
    "RecoverMode",
    "slot_bytes_for",
]

logger = logging.getLogger(__name__)

ALIGN_BYTES = 4096  # O_DIRECT alignment of addresses, lengths and offsets
HEADER_AREA_BYTES = 4096  # the block header + stamp, padded to the alignment
SLOTS_NAME = "slots.bin"
MANIFEST_NAME = "manifest.json"
SLOT_FORMAT_VERSION = 1
_MANIFEST_FORMAT = "tiering-file-backend"
_MANIFEST_MAX_BYTES = 64 * 1024
_TMP_PREFIX = MANIFEST_NAME + "."
_TMP_SUFFIX = ".tmp"
_STAMP = struct.Struct("<QQ")  # sequence number, xxh3-64(header + sequence number)
_STAMP_END = HEADER_BYTES + _STAMP.size
_SEQ = struct.Struct("<Q")
_SCAN_SLOTS_PER_TASK = 256
_READ_TASK_BYTES = 8 << 20  # the most one read chunk moves (see _read_task_slots)
_READ_RUN_BYTES = 1 << 20  # the most one buffered preadv moves (see _read_run_slots)
_WRITE_CHUNK_BYTES = 4 << 20  # the most one write chunk moves (see _write_chunk_slots)
_BOUNCE_BYTES = 8 << 20  # the most one O_DIRECT run of bounced slots moves (see _bounce_run)
_MAX_BLOCK_BYTES = 1 << 30  # one pwritev moves at most ~2 GiB on Linux
_MAX_IO_THREADS = 64
_MAX_BATCH_BLOCKS = 1024

_T = TypeVar("_T")
# A parsed manifest; None: there is none; "damaged": there is one, but not one we wrote.
_Manifest = dict[str, object] | Literal["damaged"] | None


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def slot_bytes_for(block_bytes: int) -> int:
    """The bytes one slot of ``block_bytes`` takes in the slot file (header area included)."""
    return HEADER_AREA_BYTES + _round_up(block_bytes, ALIGN_BYTES)


def _stamp(header: bytes, seq: int) -> bytes:
    return _STAMP.pack(seq, xxhash.xxh3_64_intdigest(header + _SEQ.pack(seq)))


def _read_stamp(area: memoryview) -> int:
    """The sequence number of a header area whose block header parsed; raises if it is bad."""
    seq, check = _STAMP.unpack_from(area, HEADER_BYTES)
    if xxhash.xxh3_64_intdigest(bytes(area[:HEADER_BYTES]) + _SEQ.pack(seq)) != check:
        raise CorruptBlockError("slot stamp checksum mismatch")
    return int(seq)


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _is_aligned(view: memoryview) -> bool:
    return view.nbytes % ALIGN_BYTES == 0 and _address(view) % ALIGN_BYTES == 0


def _advance(buffers: list[memoryview], done: int) -> list[memoryview]:
    """The iovecs left after a short transfer of ``done`` bytes."""
    rest: list[memoryview] = []
    for buf in buffers:
        if done >= buf.nbytes:
            done -= buf.nbytes
            continue
        rest.append(buf[done:])
        done = 0
    return rest


class _Entry(NamedTuple):
    slot: int
    seq: int


@dataclass(slots=True)
class _Job:
    """One slot of a batch: written by put, read by get (runs on an I/O thread)."""

    position: int  # index in the caller's batch
    key: bytes
    view: memoryview
    slot: int
    seq: int
    bounce: bool  # O_DIRECT and the caller's buffer is not aligned


@dataclass(slots=True)
class _Found:
    slot: int
    key: bytes
    seq: int


@dataclass(slots=True)
class _ScanResult:
    found: list[_Found]
    rejected: list[int]  # slots that held something that did not verify
    read_errors: int
    missing: int = 0  # slots past the end of a truncated file
    over_capacity: int = 0  # used slots past the capacity (dropped)


class _Scratch:
    """Per-thread aligned buffers: header areas for one run of slots and, lazily, padded
    payload areas for ``payload_slots`` slots (the O_DIRECT bounce buffer of one run; the
    recovery scan uses the first) and a pad sink."""

    def __init__(
        self, max_run: int, payload_area_bytes: int, pad_bytes: int, payload_slots: int
    ) -> None:
        self._payload_area_bytes = payload_area_bytes
        self._payload_slots = payload_slots
        self._areas = memoryview(mmap.mmap(-1, max_run * HEADER_AREA_BYTES))
        self._payloads: memoryview | None = None
        self.pad_sink = memoryview(bytearray(pad_bytes))

    def area(self, i: int) -> memoryview:
        return self._areas[i * HEADER_AREA_BYTES : (i + 1) * HEADER_AREA_BYTES]

    def payload(self, i: int) -> memoryview:
        """The ``i``-th padded payload area (0 <= i < payload_slots), page-aligned."""
        if self._payloads is None:
            self._payloads = memoryview(
                mmap.mmap(-1, self._payload_slots * self._payload_area_bytes)
            )
        size = self._payload_area_bytes
        return self._payloads[i * size : (i + 1) * size]


class _SlotTable:
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


async def _wait_all(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Wait for the futures without raising their errors (a cancellation still propagates)."""
    if futures:
        await asyncio.wait(futures)


async def _wait_through_cancellation(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every future is done, even if the waiting task is cancelled meanwhile."""
    pending = [f for f in futures if not f.done()]
    while pending:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait(pending)
        pending = [f for f in pending if not f.done()]


def _nofollow_opener(extra_flags: int) -> Callable[[str, int], int]:
    def opener(path: str, flags: int) -> int:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | extra_flags, 0o600)

    return opener


class FileBackend(StorageBackend):
    """Blocks in fixed-size slots of one preallocated file (see the module docstring).

    Parameters
    ----------
    path:
        A directory the backend owns (created with mode 0700; refused if group- or
        world-writable). Two backends cannot open one directory (``flock``).
    capacity_bytes:
        Size of the slot file; ``capacity_blocks = capacity_bytes // slot_bytes``.
    block_bytes, fingerprint:
        Payload size of every block and the 16-byte layout fingerprint.
    o_direct:
        Open the slot file with ``O_DIRECT`` (unaligned caller buffers are bounced).
    durability:
        ``"none"``: acknowledge once written to the page cache; ``"fsync"``: after fdatasync.
    recover:
        On open: ``"verify"`` every entry in full (payload checksum included),
        ``"trust_header"`` (header, key, fingerprint; payloads are checked on ``get``), or
        ``"wipe"`` (start empty).
    io_threads:
        Threads of the backend's own pool; all blocking I/O runs there. A put spreads its
        chunks over all of them: checksumming and copying into the page cache are CPU work,
        and two threads write at ~0.95x of raw ``pwritev`` here where one reaches ~0.85x. A
        buffered get reads on one thread (one sequential stream keeps the kernel's readahead:
        two streams side by side fell to ~0.7x of raw ``preadv``, and two threads taking turns
        on one stream to ~0.4-0.8x on this loaded VM); concurrent gets and puts use the other
        threads. An ``O_DIRECT`` get uses all of them.
    batch_blocks:
        Slots per chunk: neighbouring slots of a chunk move with one ``pwritev``/``preadv``.
        With ``durability="fsync"`` a put ends with one fdatasync, after all its writes.
    file_ops:
        The system-call seam (:class:`~tiering.backends._fileops.FileOps`); tests pass a
        fault-injecting one. Defaults to plain ``os`` calls.

    on_layout_mismatch:
        When the directory holds blocks of another layout (block size or fingerprint):
        ``"refuse"`` to open (:class:`~tiering.backends.ownership.LayoutMismatchError`, nothing
        changed), ``"set_aside"`` (move the files to a sibling folder) or ``"wipe"`` (delete
        them).
    read_only:
        Open for reading only (``tiering inspect``): no file is created, changed or deleted;
        ``put`` and ``delete`` raise :class:`BackendError`; a layout mismatch always raises.
    layout_description:
        What the fingerprint stands for (written in the directory's marker, named in errors).

    ``stats.extra`` keys: ``put_full``, ``recovered``, ``recovery_rejected`` (slots that held
    something that did not verify), ``recovery_duplicates``, ``recovery_read_errors``,
    ``recovery_missing_slots`` (slots past the end of a truncated file),
    ``recovery_over_capacity`` (used slots past the capacity, dropped), ``manifest_damaged``,
    ``layout_mismatches``, ``stale_temp_removed``,
    ``o_direct_bounces``, ``fsync_failures``, ``invalidate_failures``.
    """

    name: ClassVar[str] = "file"
    owned_files: ClassVar[tuple[str, ...]] = (
        SLOTS_NAME,
        MANIFEST_NAME,
        f"{_TMP_PREFIX}*{_TMP_SUFFIX}",
    )
    lock_files: ClassVar[tuple[str, ...]] = (".",)

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        block_bytes: int,
        fingerprint: bytes,
        o_direct: bool = False,
        durability: Durability = "none",
        recover: RecoverMode = "verify",
        io_threads: int = 2,
        batch_blocks: int = 16,
        on_layout_mismatch: MismatchPolicy = "refuse",
        min_free_bytes: int | None = None,
        max_fs_used_fraction: float | None = None,
        read_only: bool = False,
        layout_description: Mapping[str, Any] | None = None,
        file_ops: FileOps | None = None,
    ) -> None:
        super().__init__(
            block_bytes=block_bytes,
            fingerprint=fingerprint,
            layout_description=layout_description,
        )
        if block_bytes > _MAX_BLOCK_BYTES:
            raise ConfigurationError(
                f"block_bytes must be at most {_MAX_BLOCK_BYTES} for the file backend, "
                f"got {block_bytes}"
            )
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigurationError(f"path must be a non-empty directory path, got {path!r}")
        self.slot_bytes = slot_bytes_for(block_bytes)
        _check_int("capacity_bytes", capacity_bytes, 1, None)
        if capacity_bytes < self.slot_bytes:
            raise ConfigurationError(
                f"capacity_bytes={capacity_bytes} holds no slot: one block of {block_bytes} "
                f"bytes takes {self.slot_bytes} bytes (4096-byte header area + payload rounded "
                "up to 4096)"
            )
        _check_choice("durability", durability, Durability)
        _check_choice("recover", recover, RecoverMode)
        _check_choice("on_layout_mismatch", on_layout_mismatch, MismatchPolicy)
        if not isinstance(read_only, bool):
            raise ConfigurationError(f"read_only must be a bool, got {read_only!r}")
        if not isinstance(o_direct, bool):
            raise ConfigurationError(f"o_direct must be a bool, got {o_direct!r}")
        if o_direct and not hasattr(os, "O_DIRECT"):
            raise ConfigurationError("o_direct=True needs O_DIRECT, which this OS does not have")
        _check_int("io_threads", io_threads, 1, _MAX_IO_THREADS)
        _check_int("batch_blocks", batch_blocks, 1, _MAX_BATCH_BLOCKS)
        if file_ops is not None and not isinstance(file_ops, FileOps):
            raise ConfigurationError(f"file_ops must be a FileOps, got {file_ops!r:.80}")
        self.path = Path(path)
        self.o_direct = o_direct
        self.durability: Durability = durability
        self.recover: RecoverMode = recover
        self.on_layout_mismatch: MismatchPolicy = on_layout_mismatch
        self.read_only = read_only
        self.io_threads = io_threads
        self.batch_blocks = batch_blocks
        self._ops = file_ops or FileOps()
        self._capacity_bytes = capacity_bytes
        # The disk guard (tiering.backends.disk_guard): the slots the disk allows now.
        self._guard = DiskGuard.build(Path(path), min_free_bytes, max_fs_used_fraction)
        self._capacity_blocks = capacity_bytes // self.slot_bytes
        self._allowed_blocks = self._capacity_blocks
        self._payload_area_bytes = self.slot_bytes - HEADER_AREA_BYTES
        self._pad_bytes = self._payload_area_bytes - block_bytes  # between payload and next slot
        self._zero_pad = memoryview(bytes(self._pad_bytes))
        # Buffered read chunks stay within 8 MiB, so the payloads a chunk read are still in the
        # cache when they are verified. O_DIRECT has no readahead: the bigger the call, the
        # more requests the device gets at once.
        self._read_task_slots = (
            batch_blocks
            if o_direct
            else max(1, min(batch_blocks, _READ_TASK_BYTES // self.slot_bytes))
        )
        # A buffered get is one sequential stream: a second stream beside it defeats the
        # kernel's readahead (cold reads fell from ~0.95x to ~0.7x of raw preadv), and two
        # lanes taking turns on one stream lost more to thread wake-ups than the checksums
        # they overlapped (0.38x at 256 KiB under load). O_DIRECT has no readahead, and two
        # streams keep the device busier (~0.97x vs ~0.9x measured).
        self._read_lanes = io_threads if o_direct else 1
        # A put checksums a chunk, then copies it: chunks small enough to stay in the cache
        # between the two passes read memory once (2 MiB blocks in chunks of 16 fell to ~0.8x).
        self._write_chunk_slots = max(1, min(batch_blocks, _WRITE_CHUNK_BYTES // self.slot_bytes))
        # A durable put starts the writeback of each run as soon as it is written, so that the
        # device works while the next runs are checksummed and copied; the put's one
        # fdatasync then waits for less (durable puts ~1.3x faster than write-all-then-sync).
        self._start_writeback = durability == "fsync" and not o_direct
        # Each slot of a run takes up to 3 iovecs; the kernel takes at most IOV_MAX per call.
        self._max_run = max(1, min(batch_blocks, os.sysconf("SC_IOV_MAX") // 3))
        # A buffered read checksums each run right after its preadv: runs of at most 1 MiB
        # are still in the CPU cache then, and the kernel's readahead keeps the device busy
        # meanwhile (cold reads at 256 KiB, pairs of passes: 0.86-0.92x of raw preadv in runs
        # of 16 slots, 0.87-1.03x in runs of 2-3 slots). O_DIRECT has no readahead: the bigger the
        # call, the more the device is asked at once.
        self._read_run_slots = (
            self._max_run
            if o_direct
            else max(1, min(self._max_run, _READ_RUN_BYTES // self.slot_bytes))
        )
        # A buffered slot bigger than that is read in parts of 1 MiB, each checksummed as it
        # arrives (cold reads of 2 MiB blocks: ~0.90x of raw read whole, ~0.94x in parts).
        self._read_part_bytes = 0 if o_direct or block_bytes <= _READ_RUN_BYTES else _READ_RUN_BYTES
        # O_DIRECT from unaligned buffers: a run of neighbouring slots goes through a per-thread
        # bounce area of up to 8 MiB with one call, not one call per slot (one 256 KiB call at
        # a time kept the device at ~0.6x of raw O_DIRECT reads).
        self._bounce_run = max(1, min(self._max_run, _BOUNCE_BYTES // self._payload_area_bytes))
        self._state: Literal["new", "open", "closing", "closed"] = "new"
        self._fd = -1
        self._dir_fd = -1
        self._pool: ThreadPoolExecutor | None = None
        self._index: dict[bytes, _Entry] = {}
        self._slots = _SlotTable(0, set())
        self._seq = 0
        self._active_ops = 0
        self._idle: asyncio.Event | None = None
        self._close_task: asyncio.Task[None] | None = None
        self._local = threading.local()
        self._zero_area = memoryview(mmap.mmap(-1, HEADER_AREA_BYTES))
        self._sync_lock = threading.Lock()
        self._sync_failures = 0  # generation counter, read and bumped by I/O threads
        for name in (
            "put_full",
            "recovered",
            "recovery_rejected",
            "recovery_duplicates",
            "recovery_read_errors",
            "recovery_missing_slots",
            "recovery_over_capacity",
            "manifest_damaged",
            "layout_mismatches",
            "stale_temp_removed",
            "o_direct_bounces",
            "fsync_failures",
            "invalidate_failures",
        ):
            self.stats.extra[name] = 0

    # -- properties ------------------------------------------------------------------------------

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            persistent=True,
            supports_delete=True,
            max_value_bytes=self.block_bytes,
            zero_copy_reads=True,
        )

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def capacity_blocks(self) -> int:
        return self._capacity_blocks

    @property
    def usage_bytes(self) -> int:
        return len(self._index) * self.slot_bytes

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    @property
    def slots_path(self) -> Path:
        """The slot file (for tools and tests; never write to it while the backend is open)."""
        return self.path / SLOTS_NAME

    def __repr__(self) -> str:
        return (
            f"FileBackend(path={str(self.path)!r}, capacity_blocks={self._capacity_blocks}, "
            f"block_bytes={self.block_bytes}, state={self._state})"
        )

    # -- lifecycle -------------------------------------------------------------------------------

    async def open(self) -> list[bytes]:
        """Create or reopen the directory, rebuild the index; return the recovered keys."""
        if self._state in ("open", "closing"):
            raise BackendError(f"{self!r} is already open")
        self._pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="tiering-file")
        self._idle = asyncio.Event()
        self._idle.set()
        self._active_ops = 0
        self._close_task = None
        try:
            recovered = await self._open_storage()
        except BaseException as exc:
            self._release_resources()
            self._state = "new"
            if isinstance(exc, OSError) and not isinstance(exc, BackendError):
                raise BackendError(f"cannot open {self!r}: {exc}") from exc
            raise
        self._state = "open"
        self.stats.extra["recovered"] = len(recovered)
        return recovered

    async def close(self) -> None:
        """Wait for in-flight operations, flush, release the file and the threads. Idempotent."""
        if self._state in ("new", "closed"):
            return
        if self._close_task is None:
            self._state = "closing"
            self._close_task = asyncio.ensure_future(self._close_now())
        await asyncio.shield(self._close_task)

    async def _close_now(self) -> None:
        assert self._idle is not None
        await self._idle.wait()
        try:
            if self._fd >= 0 and not self.read_only:
                error = await self._call(self._sync)
                if error is not None:
                    logger.error("file backend %s: final fdatasync failed: %s", self.path, error)
        finally:
            self._release_resources()
            self._state = "closed"

    def _release_resources(self) -> None:
        # Only called once no thread uses the fd: a reused fd number would redirect writes.
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                self._ops.close(self._fd)
            self._fd = -1
        if self._dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)  # releases the directory's flock
            self._dir_fd = -1
        self._index = {}
        self._slots = _SlotTable(0, set())

    async def _open_storage(self) -> list[bytes]:
        found = await self._call(self._examine_or_claim)
        if found.state == "absent":  # read-only: nothing was ever stored here
            self._rebuild_index(_ScanResult([], [], 0))
            return []
        manifest = await self._read_manifest()
        on_disk = self._stored_layout(manifest, found)
        data_bytes = await self._call(self._slot_file_bytes)
        if data_bytes and on_disk is not None and not self._layout_matches(manifest, on_disk):
            await self._call(self._resolve_mismatch, on_disk)
            manifest, data_bytes = None, 0
        verify = self.recover == "verify"
        if data_bytes and not isinstance(manifest, dict):
            # The manifest is gone or unreadable but the directory is ours: every slot still
            # verifies itself (header, fingerprint, payload checksum), so check each in full.
            self.stats.extra["manifest_damaged"] += 1
            logger.warning(
                "file backend %s: %s is missing or damaged; verifying every slot",
                self.path,
                MANIFEST_NAME,
            )
            verify = True
        self._fd = await self._open_slot_file()
        if self._fd < 0:  # read-only, no slot file
            self._rebuild_index(_ScanResult([], [], 0))
            return []
        size = await self._call(self._ops.size, self._fd)
        scan = _ScanResult([], [], 0)
        if self.recover == "wipe":
            if size > 0 and not self.read_only:
                await self._call(self._ops.ftruncate, self._fd, 0)
                await self._call(self._ops.fdatasync, self._fd)
                size = 0
        else:
            scan = await self._scan(size, verify, manifest)
        if not self.read_only:
            await self._call(self._preallocate, size)
        recovered = self._rebuild_index(scan)
        if scan.rejected and not self.read_only:
            try:  # zero rejected and losing copies so that no later open considers them again
                await self._call(self._invalidate_slots, scan.rejected, True)
            except OSError as exc:
                logger.warning("file backend %s: invalidation failed: %s", self.path, exc)
                self.stats.extra["invalidate_failures"] += 1
        if not self.read_only:
            await self._write_manifest()
            await self._call(write_marker, self.path, self._marker())
        return recovered

    # -- the directory, its marker and its manifest ---------------------------------------------

    @classmethod
    def recognizes_directory(cls, path: Path) -> bool:
        """A directory of an earlier tiering: its manifest names this backend's format."""
        try:
            with open(path / MANIFEST_NAME, "rb", opener=_nofollow_opener(0)) as f:
                manifest = json.loads(f.read(_MANIFEST_MAX_BYTES))
        except (OSError, ValueError):
            return False
        return isinstance(manifest, dict) and manifest.get("format") == _MANIFEST_FORMAT

    def _configured_layout(self) -> LayoutRecord:
        return LayoutRecord(self.block_bytes, self.fingerprint, self.layout_description)

    def _marker(self) -> TierMarker:
        return TierMarker(
            self.name,
            f"{_MANIFEST_FORMAT}/{SLOT_FORMAT_VERSION}",
            self._configured_layout(),
            created_by(),
        )

    def _examine_or_claim(self) -> TierDirectory:
        """Claim the directory (refusing one that is not tiering's); read-only: just look."""
        what = "the file backend's directory"
        if self.read_only:
            found = examine_directory(
                self.path, owned_files=self.owned_files, recognizes=self.recognizes_directory
            )
            if found.state == "foreign":
                raise foreign_directory_error(found, what=what)
            check_backend(found, self.name)
        else:
            found = claim_directory(
                self.path,
                self._marker(),
                owned_files=self.owned_files,
                recognizes=self.recognizes_directory,
                what=what,
            )
        if found.state == "absent":
            return found
        self._lock_directory()
        st = os.stat(self.path)
        if st.st_mode & 0o022 and not self.read_only:
            raise BackendError(
                f"refusing the directory {str(self.path)!r}: it is group- or world-writable "
                f"(mode {st.st_mode & 0o777:o}); the file backend needs a private directory"
            )
        if not self.read_only:
            for name in os.listdir(self.path):
                if name.startswith(_TMP_PREFIX) and name.endswith(_TMP_SUFFIX):
                    with contextlib.suppress(FileNotFoundError):
                        if stat.S_ISREG(os.lstat(self.path / name).st_mode):
                            os.unlink(self.path / name)  # ours: a write cut short
                            self.stats.extra["stale_temp_removed"] += 1
        return found

    def _lock_directory(self) -> None:
        """Hold an exclusive ``flock`` on the directory while open: one backend (or inspection)
        at a time decides what happens to its files."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            lock_exclusive(fd, self.path, what="the file backend's directory")
        except BaseException:
            os.close(fd)
            raise
        self._dir_fd = fd

    def _slot_file_bytes(self) -> int:
        """The size of the slot file (0 if there is none, or a symlink is in its place)."""
        try:
            st = os.lstat(self.slots_path)
        except FileNotFoundError:
            return 0
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    def _stored_layout(self, manifest: _Manifest, found: TierDirectory) -> LayoutRecord | None:
        """The layout the stored blocks were written for, from the manifest, else the marker."""
        marker = found.marker.layout if found.marker is not None else None
        if isinstance(manifest, dict):
            try:
                block_bytes = manifest["block_bytes"]
                fingerprint = bytes.fromhex(str(manifest["fingerprint"]))
            except (KeyError, ValueError):
                return marker
            if not isinstance(block_bytes, int):
                return marker
            described = marker.description if marker is not None else None
            record = LayoutRecord(block_bytes, fingerprint, described)
            if marker is None or not marker.matches(record):
                record = LayoutRecord(block_bytes, fingerprint)
            return record
        return marker

    def _layout_matches(self, manifest: _Manifest, on_disk: LayoutRecord) -> bool:
        if not on_disk.matches(self._configured_layout()):
            return False
        if not isinstance(manifest, dict):
            return True
        wanted = self._manifest()
        layout = ("format", "format_version", "header_area_bytes", "slot_bytes")
        return all(manifest.get(name) == wanted[name] for name in layout)

    def _resolve_mismatch(self, on_disk: LayoutRecord) -> None:
        """Data of another layout: refuse, set it aside or wipe it (``on_layout_mismatch``)."""
        error = LayoutMismatchError(
            self.path, on_disk, self._configured_layout(), what="the file backend's directory"
        )
        if self.read_only or self.on_layout_mismatch == "refuse":
            raise error
        self.stats.extra["layout_mismatches"] += 1
        if self.on_layout_mismatch == "set_aside":
            target = set_aside(self.path, owned_files=self.owned_files)
            logger.warning(
                "file backend %s: blocks of another layout moved to %s (%s)",
                self.path,
                target,
                on_disk.difference(self._configured_layout()),
            )
        else:
            for name in (SLOTS_NAME, MANIFEST_NAME):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path / name)
            logger.warning(
                "file backend %s: blocks of another layout deleted (on_layout_mismatch: wipe; %s)",
                self.path,
                on_disk.difference(self._configured_layout()),
            )
        write_marker(self.path, self._marker())

    def _manifest(self) -> dict[str, object]:
        return {
            "format": _MANIFEST_FORMAT,
            "format_version": SLOT_FORMAT_VERSION,
            "header_area_bytes": HEADER_AREA_BYTES,
            "slot_bytes": self.slot_bytes,
            "block_bytes": self.block_bytes,
            "fingerprint": self.fingerprint.hex(),
            "capacity_bytes": self._capacity_bytes,
            "capacity_blocks": self._capacity_blocks,
        }

    async def _read_manifest(self) -> _Manifest:
        """The manifest; None if there is none, "damaged" if it is not one we wrote."""
        try:
            async with aiofiles.open(
                self.path / MANIFEST_NAME,
                "rb",
                opener=_nofollow_opener(0),
                executor=self._pool,
            ) as f:
                raw = await f.read(_MANIFEST_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a planted symlink; never followed, never trusted
            logger.warning("file backend %s: unreadable manifest: %s", self.path, exc)
            return "damaged"
        if len(raw) > _MANIFEST_MAX_BYTES:
            return "damaged"
        try:
            manifest = json.loads(raw)
        except ValueError:
            return "damaged"
        if not isinstance(manifest, dict) or manifest.get("format") != _MANIFEST_FORMAT:
            return "damaged"
        return manifest

    async def _write_manifest(self) -> None:
        wanted = self._manifest()
        if await self._read_manifest() == wanted:
            return
        text = json.dumps(wanted, indent=1, sort_keys=True) + "\n"
        tmp = self.path / f"{_TMP_PREFIX}{secrets.token_hex(8)}{_TMP_SUFFIX}"
        try:
            async with aiofiles.open(
                tmp, "w", opener=_nofollow_opener(os.O_EXCL), executor=self._pool
            ) as f:
                await f.write(text)
                await f.flush()
                await self._call(os.fsync, f.fileno())
            await aiofiles.os.replace(tmp, self.path / MANIFEST_NAME, executor=self._pool)
            await self._call(self._fsync_directory)
        except OSError as exc:
            with contextlib.suppress(OSError):
                await aiofiles.os.unlink(tmp, executor=self._pool)
            raise BackendError(
                f"cannot write {MANIFEST_NAME} in {str(self.path)!r}: {exc}"
            ) from exc

    def _fsync_directory(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def _open_slot_file(self) -> int:
        """The slot file's descriptor, locked; -1 if read-only and there is no slot file."""
        path = str(self.slots_path)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.read_only:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if self.o_direct:
            flags |= os.O_DIRECT
        try:
            try:
                fd = await self._call(self._ops.open, path, flags, 0o600)
            except FileNotFoundError:
                if not self.read_only:
                    raise
                return -1
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                # A symlink planted where our file belongs since the directory was examined
                raise UntrustedEntryError(
                    f"refusing the slot file {path!r}: it is a symlink, so tiering did not "
                    "make it; tiering neither follows nor removes it and changed nothing. Move "
                    "it out of the directory, or give the tier another directory",
                    self.path,
                    entries=(SLOTS_NAME,),
                ) from exc
        except OSError as exc:
            hint = " (does this file system support O_DIRECT?)" if self.o_direct else ""
            raise BackendError(f"cannot open the slot file {path!r}: {exc}{hint}") from exc
        try:
            lock_exclusive(fd, self.path, what="the file backend's slot file in")
        except BaseException:
            self._ops.close(fd)
            raise
        return fd

    def _preallocate(self, size: int) -> None:
        total = self._capacity_blocks * self.slot_bytes
        reserve = total
        if self._guard is not None:  # reserve no more than the disk allows: the rest is sparse
            reserve = min(total, self._refresh_guard() * self.slot_bytes)
        try:
            if size != total:
                self._ops.ftruncate(self._fd, total)
            if reserve:
                self._ops.fallocate(self._fd, 0, reserve)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENODEV, errno.ESPIPE):
                return  # no fallocate here: the file stays sparse; ENOSPC becomes FAILED
            raise BackendError(
                f"cannot preallocate {total} bytes for {str(self.slots_path)!r}: {exc}"
            ) from exc

    def _refresh_guard(self) -> int:
        """Sample the disk guard (an I/O thread): the slots the tier may use now."""
        assert self._guard is not None
        try:
            occupied = allocated_bytes(self._fd) if self._fd >= 0 else 0
            allowed = self._guard.allowed_blocks(occupied, block_bytes=self.slot_bytes)
        except OSError as exc:  # cannot tell: keep the last answer
            logger.warning("file backend %s: disk guard cannot read the filesystem: %s",
                           self.path, exc)  # fmt: skip
            return self._allowed_blocks
        self._allowed_blocks = min(self._capacity_blocks, allowed)
        return self._allowed_blocks

    @property
    def effective_capacity_blocks(self) -> int:
        return min(self._capacity_blocks, self._allowed_blocks)

    # -- recovery --------------------------------------------------------------------------------

    async def _scan(self, size: int, verify: bool, manifest: _Manifest) -> _ScanResult:
        """Read every slot's header area (and payload, if ``verify``); count every slot that
        held something and is not recovered: rejected, unreadable, missing from a truncated
        file, or past the capacity."""
        whole_slots = size // self.slot_bytes + (size % self.slot_bytes >= HEADER_AREA_BYTES)
        slots = range(min(self._capacity_blocks, whole_slots))
        beyond = range(self._capacity_blocks, whole_slots)
        chunks = [
            slots[i : i + _SCAN_SLOTS_PER_TASK] for i in range(0, len(slots), _SCAN_SLOTS_PER_TASK)
        ]
        chunks += [
            beyond[i : i + _SCAN_SLOTS_PER_TASK]
            for i in range(0, len(beyond), _SCAN_SLOTS_PER_TASK)
        ]
        parts = await self._run_tasks(
            [(self._scan_slots, (chunk, size, verify)) for chunk in chunks]
        )
        result = _ScanResult([], [], 0)
        for part in parts:
            result.found += part.found
            result.rejected += part.rejected
            result.read_errors += part.read_errors
            result.over_capacity += part.over_capacity
        # Slots the file should hold but does not (it was truncated): whatever they held is lost.
        expected = self._capacity_blocks if size else 0
        stored_capacity = manifest.get("capacity_blocks") if isinstance(manifest, dict) else None
        if isinstance(stored_capacity, int):
            expected = min(self._capacity_blocks, stored_capacity)
        result.missing = max(0, expected - len(slots))
        return result

    def _scan_slots(self, slots: range, size: int, verify: bool) -> _ScanResult:
        scratch = self._scratch()
        result = _ScanResult([], [], 0)
        area = scratch.area(0)
        for slot in slots:
            offset = slot * self.slot_bytes
            try:
                if self._pread_all([area], offset) < HEADER_AREA_BYTES:
                    result.missing += 1  # the file ends inside this slot's header
                    continue
                if area == self._zero_area:
                    continue  # never written, or invalidated
                if slot >= self._capacity_blocks:
                    result.over_capacity += 1  # dropped: the capacity no longer covers it
                    continue
                if bytes(area[: len(MAGIC)]) != MAGIC:
                    raise CorruptBlockError("no block header (overwritten)")
                result.found.append(self._check_slot(slot, size, verify, scratch))
            except CorruptBlockError as exc:
                logger.info("file backend %s: slot %d rejected: %s", self.path, slot, exc)
                result.rejected.append(slot)
            except OSError as exc:
                logger.warning("file backend %s: slot %d unreadable: %s", self.path, slot, exc)
                result.read_errors += 1
        return result

    def _check_slot(self, slot: int, size: int, verify: bool, scratch: _Scratch) -> _Found:
        header = unpack_header(scratch.area(0)[:HEADER_BYTES])
        seq = _read_stamp(scratch.area(0))
        if header.fingerprint != self.fingerprint:
            raise CorruptBlockError("block was written for another layout (fingerprint)")
        if header.payload_bytes != self.block_bytes:
            raise CorruptBlockError(f"payload is {header.payload_bytes} bytes")
        offset = slot * self.slot_bytes + HEADER_AREA_BYTES
        if size < offset + self.block_bytes:
            raise CorruptBlockError("payload truncated")
        if verify:
            payload = scratch.payload(0)
            if self._pread_all([payload], offset) < self.block_bytes:
                raise CorruptBlockError("payload truncated")
            verify_block(
                header,
                payload[: self.block_bytes],
                expected_key=header.key,
                expected_fingerprint=self.fingerprint,
            )
        return _Found(slot, header.key, seq)

    def _rebuild_index(self, scan: _ScanResult) -> list[bytes]:
        self.stats.extra["recovery_rejected"] += len(scan.rejected)
        self.stats.extra["recovery_read_errors"] += scan.read_errors
        self.stats.extra["recovery_missing_slots"] += scan.missing
        self.stats.extra["recovery_over_capacity"] += scan.over_capacity
        lost = len(scan.rejected) + scan.read_errors + scan.missing + scan.over_capacity
        if lost:
            logger.warning(
                "file backend %s: %d slot(s) lost at open: %d did not verify, %d unreadable, "
                "%d missing from a truncated file, %d past the capacity",
                self.path,
                lost,
                len(scan.rejected),
                scan.read_errors,
                scan.missing,
                scan.over_capacity,
            )
        best: dict[bytes, _Found] = {}
        for found in sorted(scan.found, key=lambda f: (-f.seq, f.slot)):
            if found.key in best:
                scan.rejected.append(found.slot)  # an older (or equal, later) duplicate
                self.stats.extra["recovery_duplicates"] += 1
            else:
                best[found.key] = found
        self._index = {key: _Entry(f.slot, f.seq) for key, f in best.items()}
        self._slots = _SlotTable(self._capacity_blocks, {f.slot for f in best.values()})
        self._seq = max((f.seq for f in scan.found), default=0)
        return list(best)

    # -- batch operations ------------------------------------------------------------------------

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        """Store each value in a fresh slot; ``OK``, ``FULL`` (no free slot) or ``FAILED``.

        A cancelled put waits for its in-flight writes (it never touches the caller's buffers
        after it returns), then drops them: each key keeps its previous state.
        """
        self._require_writable()
        checked = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        views = self._check_buffers(values, len(checked), writable=False)
        results = [Outcome.FULL] * len(checked)
        wanted = len(checked)
        if self._guard is not None:  # past what the disk allows: FULL (the tier evicts)
            allowed = await self._call(self._refresh_guard)
            wanted = min(wanted, max(0, allowed - len(self._index)))
        # Per-block work on the loop thread delays the first write: kept to the bare minimum.
        slots = self._slots.allocate_many(wanted)
        first_seq = self._seq + 1
        self._seq += len(slots)
        bounce = self._needs_bounce
        jobs = [
            _Job(position, checked[position], view, slot, first_seq + position, bounce(view))
            for position, (slot, view) in enumerate(zip(slots, views, strict=False))
        ]
        self.stats.puts += len(checked)
        self.stats.extra["put_full"] += len(checked) - len(jobs)
        if self.o_direct:
            self.stats.extra["o_direct_bounces"] += sum(job.bounce for job in jobs)
        with self._operation():
            with self._sync_lock:
                generation = self._sync_failures
            try:
                errors = await self._run_jobs(
                    self._write_jobs, jobs, self._write_chunk_slots, self.io_threads
                )
                if self.durability == "fsync" and None in errors:
                    # One fdatasync for the whole put, after all its writes: the put is
                    # acknowledged only when it returns, so syncing per chunk buys nothing.
                    errors = await self._call(self._sync_writes, errors, generation)
            except asyncio.CancelledError:
                await _wait_through_cancellation(self._discard_slots([job.slot for job in jobs]))
                raise
            # Wait until the slots this put freed (failed writes, replaced entries) are free
            # again, so that a put right after this one sees the capacity it expects.
            await _wait_all(self._commit_puts(jobs, errors, results))
        return results

    def _commit_puts(
        self, jobs: list[_Job], errors: list[BaseException | None], results: list[Outcome]
    ) -> list[asyncio.Future[Any]]:
        retired: list[int] = []
        index = self._index
        written = 0
        for job, error in zip(jobs, errors, strict=True):
            if error is not None:
                logger.warning("file backend %s: put failed: %s", self.path, error)
                self.stats.put_failures += 1
                results[job.position] = Outcome.FAILED
                retired.append(job.slot)  # may hold a whole block whose fsync failed
                continue
            results[job.position] = Outcome.OK
            written += 1
            current = index.get(job.key)
            if current is not None and current.seq > job.seq:
                retired.append(job.slot)  # a put of this key that started later landed first
                continue
            index[job.key] = _Entry(job.slot, job.seq)
            if current is not None:
                retired.append(current.slot)
        self.stats.bytes_written += written * self.block_bytes
        return self._discard_slots(retired)

    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        """Read and verify each key into its buffer; ``OK``, ``MISSING``, ``CORRUPT``, ``FAILED``.

        A cancelled get waits for its in-flight reads before it raises, so it never writes into
        the caller's buffers after it returns.
        """
        self._require_open()
        checked = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        views = self._check_buffers(buffers, len(checked), writable=True)
        results = [Outcome.MISSING] * len(checked)
        jobs: list[_Job] = []
        for position, (key, view) in enumerate(zip(checked, views, strict=True)):
            entry = self._index.get(key)
            if entry is None:
                continue
            self._slots.pin(entry.slot)
            jobs.append(_Job(position, key, view, entry.slot, entry.seq, self._needs_bounce(view)))
        jobs.sort(key=lambda job: job.slot)  # neighbouring slots are read with one preadv
        self.stats.gets += len(checked)
        self.stats.misses += len(checked) - len(jobs)
        self.stats.extra["o_direct_bounces"] += sum(job.bounce for job in jobs)
        with self._operation():
            try:
                errors = await self._run_jobs(
                    self._read_jobs, jobs, self._read_task_slots, self._read_lanes
                )
            except asyncio.CancelledError:
                self._unpin(jobs)
                raise
            self._commit_gets(jobs, errors, results)
            await _wait_all(self._unpin(jobs))
        return results

    def _commit_gets(
        self, jobs: list[_Job], errors: list[BaseException | None], results: list[Outcome]
    ) -> None:
        dropped: list[int] = []
        for job, error in zip(jobs, errors, strict=True):
            if error is None:
                results[job.position] = Outcome.OK
                self.stats.hits += 1
                self.stats.bytes_read += self.block_bytes
                continue
            if isinstance(error, CorruptBlockError):
                logger.warning("file backend %s: corrupt block: %s", self.path, error)
                results[job.position] = Outcome.CORRUPT
                self.stats.corrupt += 1
            else:
                logger.warning("file backend %s: read failed: %s", self.path, error)
                results[job.position] = Outcome.FAILED
                self.stats.read_failures += 1
            if self._index.get(job.key) == (job.slot, job.seq):
                del self._index[job.key]
                dropped.append(job.slot)
        # The slots are still pinned by this get: retiring them defers the invalidation to
        # _unpin, which runs right after.
        for slot in dropped:
            self._slots.retire(slot)

    def _unpin(self, jobs: list[_Job]) -> list[asyncio.Future[Any]]:
        ready = [job.slot for job in jobs if self._slots.unpin(job.slot)]
        return [self._invalidate_in_background(ready)] if ready else []

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is in the index (no I/O)."""
        self._require_open()
        index = self._index
        return [key in index for key in check_keys(keys, max_bytes=MAX_KEY_BYTES)]

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Drop each key; zero its slot header (then fdatasync, with durability="fsync")."""
        self._require_writable()
        checked = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        results: list[bool] = []
        ready: list[int] = []
        for key in checked:
            entry = self._index.pop(key, None)
            results.append(entry is not None)
            if entry is not None and self._slots.retire(entry.slot):
                ready.append(entry.slot)
        self.stats.deletes += sum(results)
        if ready:
            # Wait for the zeroing (not for its outcome: a failure is counted, not raised);
            # a cancelled delete lets it finish in the background.
            await _wait_all([self._invalidate_in_background(ready)])
        return results

    # -- slot invalidation -----------------------------------------------------------------------

    def _discard_slots(self, slots: list[int]) -> list[asyncio.Future[Any]]:
        """Invalidate slots that left the index (or never entered it), then free them.

        Slots pinned by a reader are invalidated when the last reader leaves.
        """
        ready = [slot for slot in slots if self._slots.retire(slot)]
        return [self._invalidate_in_background(ready)] if ready else []

    def _invalidate_in_background(self, slots: list[int]) -> asyncio.Future[Any]:
        """Zero the slots' header areas on an I/O thread; free them when done (tracked op).

        Read-only, a slot is only dropped from memory: nothing on disk changes."""
        assert self._pool is not None
        if self.read_only:
            for slot in slots:
                self._slots.release(slot)
            done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done
        self._begin_op()
        sync = self.durability == "fsync"
        future = asyncio.wrap_future(self._pool.submit(self._invalidate_slots, slots, sync))

        def finished(done: asyncio.Future[Any]) -> None:
            error = done.exception() if not done.cancelled() else None
            if error is not None:
                logger.warning("file backend %s: invalidation failed: %s", self.path, error)
                self.stats.extra["invalidate_failures"] += 1
            # Free the slots even so: the next put overwrites them.
            for slot in slots:
                self._slots.release(slot)
            self._end_op()

        future.add_done_callback(finished)
        return future

    def _invalidate_slots(self, slots: list[int], sync: bool) -> None:
        first_error: OSError | None = None
        for slot in slots:
            try:
                self._write_all([self._zero_area], slot * self.slot_bytes)
            except OSError as exc:
                first_error = first_error or exc
        if sync:
            first_error = first_error or self._sync()
        if first_error is not None:
            raise first_error

    # -- I/O threads -----------------------------------------------------------------------------

    def _scratch(self) -> _Scratch:
        scratch: _Scratch | None = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = _Scratch(
                self._max_run, self._payload_area_bytes, self._pad_bytes, self._bounce_run
            )
            self._local.scratch = scratch
        return scratch

    def _runs(self, jobs: list[_Job], max_run: int | None = None) -> Iterator[list[_Job]]:
        """Split jobs into runs of consecutive slots that one pwritev/preadv can move, each of
        at most ``max_run`` slots (default: as many as one call takes)."""
        limit = self._max_run if max_run is None else max_run
        run: list[_Job] = []
        for job in jobs:
            if run and (
                job.bounce != run[-1].bounce
                or job.slot != run[-1].slot + 1
                or len(run) == (self._bounce_run if job.bounce else limit)
            ):
                yield run
                run = []
            run.append(job)
        if run:
            yield run

    def _iovecs(self, run: list[_Job], scratch: _Scratch, pad: memoryview) -> list[memoryview]:
        """[header area, payload, pad] per slot: the slots' bytes, contiguous in the file. A
        bounced slot's payload area is padded already."""
        iovecs: list[memoryview] = []
        for i, job in enumerate(run):
            iovecs += [scratch.area(i), scratch.payload(i) if job.bounce else job.view]
            if self._pad_bytes and not job.bounce and i + 1 < len(run):
                iovecs.append(pad)
        return iovecs

    def _write_jobs(self, index: int, jobs: list[_Job]) -> list[BaseException | None]:
        del index  # chunks are written in any order
        scratch = self._scratch()
        errors: list[BaseException | None] = []
        for run in self._runs(jobs):
            errors += self._write_run(run, scratch)
        return errors

    def _sync_writes(
        self, errors: list[BaseException | None], generation: int
    ) -> list[BaseException | None]:
        """fdatasync after a put's writes; on failure every write of the put fails.

        ``generation`` is the failure count when the put began: a failed fdatasync of another
        put that overlapped these writes may have consumed the error this one would see.
        """
        sync_error = self._sync()
        with self._sync_lock:
            overlapped_failure = self._sync_failures != generation
        if sync_error is None and overlapped_failure:
            sync_error = OSError(errno.EIO, "an fdatasync that covered these writes failed")
        if sync_error is None:
            return errors
        return [error or sync_error for error in errors]

    def _write_run(self, run: list[_Job], scratch: _Scratch) -> list[BaseException | None]:
        try:
            for i, job in enumerate(run):
                header = pack_header(job.key, job.view, self.fingerprint)
                area = scratch.area(i)
                area[:HEADER_BYTES] = header
                area[HEADER_BYTES:_STAMP_END] = _stamp(header, job.seq)
                if job.bounce:
                    scratch.payload(i)[: self.block_bytes] = job.view
            offset = run[0].slot * self.slot_bytes
            self._write_all(self._iovecs(run, scratch, self._zero_pad), offset)
            if self._start_writeback:
                with contextlib.suppress(OSError):  # a hint: the put's fdatasync decides
                    self._ops.start_writeback(self._fd, offset, len(run) * self.slot_bytes)
        except Exception as exc:
            if len(run) == 1:
                return [exc]
            # Retry slot by slot, so that only the slots that fail again are FAILED.
            return [self._write_run([job], scratch)[0] for job in run]
        return [None] * len(run)

    def _read_jobs(self, index: int, jobs: list[_Job]) -> list[BaseException | None]:
        """Read and verify a chunk, each run verified right after its read (bytes in cache)."""
        del index  # lanes read side by side (O_DIRECT) or there is one (buffered)
        scratch = self._scratch()
        errors: list[BaseException | None] = []
        for run in self._runs(jobs, self._read_run_slots):
            if self._read_part_bytes:  # buffered (never bounced), one big slot a run
                errors.append(self._read_in_parts(run[0], scratch))
            else:
                errors += self._verified(run, self._read_run(run, scratch))
        return errors

    def _read_in_parts(self, job: _Job, scratch: _Scratch) -> BaseException | None:
        """Read and verify one slot in parts of ``_read_part_bytes`` (the header area with the
        first), checksumming each part right after its read; None, or why it cannot be used."""
        part_bytes = self._read_part_bytes
        offset = job.slot * self.slot_bytes
        payload_sum = checksum_in_parts()
        try:
            for start in range(0, self.block_bytes, part_bytes):
                part = job.view[start : start + part_bytes]
                if start:
                    done = self._pread_all([part], offset + HEADER_AREA_BYTES + start)
                    wanted = part.nbytes
                else:
                    done = self._pread_all([scratch.area(0), part], offset)
                    wanted = HEADER_AREA_BYTES + part.nbytes
                if done < wanted:
                    return CorruptBlockError(f"slot {job.slot} truncated")
                payload_sum.update(part)
        except OSError as exc:
            return exc
        try:
            head = bytes(scratch.area(0)[:_STAMP_END])
            self._verify_read(job, head, payload_sum.intdigest())
        except Exception as exc:  # CorruptBlockError: this key only
            return exc
        return None

    def _read_run(self, run: list[_Job], scratch: _Scratch) -> list[BaseException | bytes]:
        """Read a run of slots into the jobs' buffers; per slot, a copy of its header and stamp
        (the scratch is reused by the next run), or why it cannot be used."""
        try:
            iovecs = self._iovecs(run, scratch, scratch.pad_sink)
            done = self._pread_all(iovecs, run[0].slot * self.slot_bytes)
        except OSError as exc:
            if len(run) == 1:
                return [exc]
            return [self._read_run([job], scratch)[0] for job in run]  # find the bad slot(s)
        reads: list[BaseException | bytes] = []
        for i, job in enumerate(run):
            if done < i * self.slot_bytes + HEADER_AREA_BYTES + self.block_bytes:
                reads.append(CorruptBlockError(f"slot {job.slot} truncated"))
                continue
            if job.bounce:
                job.view[:] = scratch.payload(i)[: self.block_bytes]
            reads.append(bytes(scratch.area(i)[:_STAMP_END]))
        return reads

    def _verified(
        self, jobs: list[_Job], reads: list[BaseException | bytes]
    ) -> list[BaseException | None]:
        errors: list[BaseException | None] = []
        for job, read in zip(jobs, reads, strict=True):
            if isinstance(read, BaseException):
                errors.append(read)
                continue
            try:
                self._verify_read(job, read)
                errors.append(None)
            except Exception as exc:  # CorruptBlockError: this key only
                errors.append(exc)
        return errors

    def _verify_read(self, job: _Job, head: bytes, payload_checksum: int | None = None) -> None:
        """Check a slot read into ``job.view``; ``head``: its header area's header and stamp;
        ``payload_checksum``: the payload's, if computed while it was read."""
        header = unpack_header(head)
        if _read_stamp(memoryview(head)) != job.seq:
            raise CorruptBlockError(f"slot {job.slot} holds another write of the key")
        verify_block(
            header,
            job.view,
            expected_key=job.key,
            expected_fingerprint=self.fingerprint,
            payload_checksum=payload_checksum,
        )

    def _write_all(self, buffers: list[memoryview], offset: int) -> None:
        total = sum(buf.nbytes for buf in buffers)
        while True:
            done = self._ops.pwritev(self._fd, buffers, offset)
            if done >= total:
                return
            if done <= 0:
                raise OSError(errno.EIO, f"pwritev wrote nothing at offset {offset}")
            buffers, offset, total = _advance(buffers, done), offset + done, total - done

    def _pread_all(self, buffers: list[memoryview], offset: int) -> int:
        """Read until the buffers are full or the file ends; return the bytes read."""
        total = sum(buf.nbytes for buf in buffers)
        read = 0
        while read < total:
            done = self._ops.preadv(self._fd, buffers, offset + read)
            if done <= 0:
                break
            read += done
            buffers = _advance(buffers, done)
        return read

    def _sync(self) -> OSError | None:
        """fdatasync the slot file; a failure bumps the generation every writer checks."""
        try:
            self._ops.fdatasync(self._fd)
        except OSError as exc:
            with self._sync_lock:
                self._sync_failures += 1
            logger.error("file backend %s: fdatasync failed: %s", self.path, exc)
            return exc
        return None

    # -- helpers ---------------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., _T], *args: Any) -> _T:
        (result,) = await self._run_tasks([(fn, args)])
        return result

    async def _run_tasks(self, tasks: list[tuple[Callable[..., _T], tuple[Any, ...]]]) -> list[_T]:
        """Run tasks on the pool; if cancelled, cancel those not started and wait for the rest.

        Waiting matters: a running task may be reading from or writing into caller buffers, or
        using the fd that close() would release.
        """
        assert self._pool is not None
        if not tasks:
            return []
        raw: list[Future[_T]] = [self._pool.submit(fn, *args) for fn, args in tasks]
        futures = [asyncio.wrap_future(f) for f in raw]
        try:
            await asyncio.wait(futures)
        except asyncio.CancelledError:
            for f in raw:
                f.cancel()
            await _wait_through_cancellation(futures)
            raise
        return [f.result() for f in futures]

    async def _run_jobs(
        self,
        work: Callable[[int, list[_Job]], list[BaseException | None]],
        jobs: list[_Job],
        step: int,
        max_lanes: int,
    ) -> list[BaseException | None]:
        """Run ``work(index, chunk)`` on chunks of ``step`` jobs; one result per job, in order.

        Up to ``max_lanes`` lanes share the chunks, in order, each taking the next one free
        (:func:`tiering.backends.lanes.run_in_lanes`): one thread hand-off per lane rather than
        per chunk, and one loop wake-up per call. Each hand-off costs the I/O threads the GIL
        while the loop thread wakes up, and per chunk that was ~10% of a put into the page
        cache. If the caller is cancelled, the lanes stop before their next chunk and this
        waits for them.
        """
        assert self._pool is not None
        chunks = [jobs[start : start + step] for start in range(0, len(jobs), step)]

        def run_chunk(index: int) -> list[BaseException | None]:
            return work(index, chunks[index])

        parts = await run_in_lanes(
            self._pool, max_lanes, len(chunks), lambda: contextlib.nullcontext(run_chunk)
        )
        return [error for part in parts for error in part]

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        self._begin_op()
        try:
            yield
        finally:
            self._end_op()

    def _begin_op(self) -> None:
        assert self._idle is not None
        self._active_ops += 1
        self._idle.clear()

    def _end_op(self) -> None:
        assert self._idle is not None
        self._active_ops -= 1
        self.stats.extra["fsync_failures"] = self._sync_failures
        if self._active_ops == 0:
            self._idle.set()

    def _require_open(self) -> None:
        if self._state != "open":
            raise BackendError(f"{self!r} is not open (call and await open() first)")

    def _require_writable(self) -> None:
        self._require_open()
        if self.read_only:
            raise BackendError(f"{self!r} is open read-only: it changes nothing on disk")

    def _needs_bounce(self, view: memoryview) -> bool:
        return self.o_direct and not _is_aligned(view)

    def _check_buffers(
        self, buffers: Sequence[memoryview], n_keys: int, *, writable: bool
    ) -> list[memoryview]:
        if isinstance(buffers, (bytes, bytearray, memoryview, str)):
            raise ValueError(
                f"expected a sequence of {n_keys} buffers, got a single {type(buffers).__name__}"
            )
        if len(buffers) != n_keys:
            raise ValueError(f"got {n_keys} keys but {len(buffers)} buffers")
        views = []
        block_bytes = self.block_bytes
        for i, buffer in enumerate(buffers):
            if is_block_view(buffer, block_bytes, writable=writable):
                views.append(buffer)
                continue
            try:
                view = memoryview(buffer)
            except TypeError:
                raise TypeError(
                    f"buffer {i} is a {type(buffer).__name__}, not a buffer (use a memoryview)"
                ) from None
            if view.nbytes != self.block_bytes:
                raise ValueError(
                    f"buffer {i} is {view.nbytes} bytes; every block is {self.block_bytes} bytes"
                )
            if not view.c_contiguous:
                raise ValueError(f"buffer {i} is not C-contiguous")
            if writable and view.readonly:
                raise ValueError(f"buffer {i} is read-only; get() needs writable buffers")
            views.append(view if view.ndim == 1 and view.format == "B" else view.cast("B"))
        return views


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigurationError(f"{name} must be {bounds}, got {value}")


def _check_choice(name: str, value: object, choices: object) -> None:
    valid = get_args(choices)
    if value not in valid:
        raise ConfigurationError(
            f"{name} must be one of {', '.join(map(repr, valid))}; got {value!r}"
        )
