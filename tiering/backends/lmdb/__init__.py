"""The LMDB backend: every block is one value of an LMDB environment (a memory-mapped B+tree).

Layout
    One environment per directory, with two named databases: ``blocks`` (offload key ->
    ``block_format`` header + payload) and ``meta`` (the layout the blocks were written for, and a
    commit counter). A file lock in the directory keeps a second backend, in this process or
    another, from opening it: the backend's in-memory index must be the only writer's view.

Threads
    Every write transaction runs on ONE writer thread the backend owns (LMDB binds a write
    transaction to the thread that began it). Concurrent ``put``/``delete`` calls are coalesced:
    the writer takes what is queued and writes it in one transaction of at most ``max_txn_bytes``
    of values (a bigger batch is split into several transactions; its keys become visible when
    ``put`` returns, as the index is what ``get`` and ``contains`` consult). A value is built in
    the writer's scratch buffer (payload copied in, header packed over the copy) and handed to
    ``txn.put``: py-lmdb has no ``MDB_RESERVE``, and the extra in-cache copy costs less than the
    measurement noise of LMDB's own write path (puts run at parity with raw py-lmdb puts of the
    bare payload; ``benchmarks/bench_lmdb_tier.py``). Reads run on up to ``read_threads``
    threads that share a get's blocks, each taking the next block not yet taken, in one read
    transaction per thread (:func:`tiering.backends.lanes.run_in_lanes`; the thread that finishes
    last wakes the event loop, once per get), with ``buffers=True``: the header is checked
    first, then the payload is copied once, straight from the map into the caller's buffer,
    and its checksum computed over that buffer as it is filled (see
    :func:`copy_and_checksum`; both steps release the GIL).

Durability flags (they only matter for an OS crash or power loss; a killed *process* never loses
a committed transaction in any mode)
    ``sync=True, metasync=True`` (default)
        ACID: a ``put`` that returned ``OK`` survives power loss. Costs one fsync per write
        transaction (coalescing amortizes it).
    ``metasync=False``
        Data pages are flushed, the meta page is not: a system crash may undo the last committed
        transaction, but the database stays consistent.
    ``sync=False``
        No flush at commit: a system crash may lose recent transactions, and may corrupt the
        database unless the filesystem keeps write order. Blocks are verified on read, and a
        cache can be rebuilt, so this is a reasonable trade for speed.
    ``writemap=True``
        Writes go straight into the memory map (no malloc'd dirty pages); faster on some
        machines, but a full disk (ENOSPC) then kills the process with SIGBUS instead of failing a
        put, and stray writes through the map could corrupt the file.
    ``map_async=True`` (requires ``writemap``)
        Flushes the map asynchronously: like ``sync=False``.

Capacity (``page`` = the environment's page size, 4096 on x86-64 Linux)
    A block's value is ``HEADER_BYTES + block_bytes``. A value too large for a leaf node (almost
    every KV block) lives on overflow pages: ``ceil((value + 16) / page)`` whole pages (16 = the
    page header), which is one block's footprint. A small value lives in a leaf node of
    ``8 + key + value`` bytes plus a 2-byte slot; leaves may be half empty after splits, so its
    footprint is twice that (with the longest key). ``capacity_blocks = capacity_bytes //
    footprint``, ``usage_bytes = stored blocks x footprint``. The backend reports ``FULL`` for a
    put that would store more than ``capacity_blocks`` distinct keys.

Map size
    ``map = capacity_blocks x footprint + overhead``, where the overhead, in pages, is: 64 (meta
    pages, database roots, margin); the B+tree over the keys, with half-full pages (leaves of
    ``8 + 80 + 8 + 2``-byte nodes for overflow values; branches of ``8 + 80 + 2``-byte nodes;
    plus the tree depth); and copy-on-write slack for 4 write transactions of ``txn_blocks``
    blocks (the one being written, and pages freed by the last ones, which LMDB reuses only two
    commits later and only once no reader still sees them), with their freelist records
    (8 bytes per freed page). ``map_size_bytes`` overrides it (tests; experts).

``MapFullError``
    A put transaction that hits it is aborted (committed data stays intact). The writer commits a
    tiny transaction (so pages freed by the last commit become reusable) and retries once; if the
    map is still full, the keys that fitted are committed and the rest reported ``FULL``, for the
    owning tier to evict and retry. A put that did not return ``OK`` leaves its key absent (an
    older value of that key is deleted too). A delete that hits it grows the map by a few pages
    (with no read transaction active): deletes must always make progress.

Files and damage
    The directory is claimed as tiering's (:mod:`tiering.backends.ownership`): absent, empty or
    marked. Before ``lmdb.open`` maps the data file,
    :func:`tiering.backends.lmdb.check.check_data_file` reads it with plain reads (meta pages,
    file size against the last page, every B-tree page and overflow run): LMDB would die of
    SIGBUS on a truncated file. A file that fails is moved
    to ``data.mdb.damaged`` (one copy kept), its blocks counted in ``recovery_dropped_blocks``
    and ``damaged_files``, and the tier starts empty. Blocks of another layout (``meta``'s
    record) are refused by default (``on_layout_mismatch``), or set aside or wiped as
    configured. ``read_only`` opens the environment without a lock file write or any change.

Recovery (``recover``)
    ``"trust_header"`` (default): at open, every stored value's header is checked (its own
    checksum, the key it names, the layout fingerprint, the payload size); payload checksums are
    checked on every get anyway. ``"verify"``: the payload checksum is checked too (reads the whole
    database). ``"wipe"``: start empty. Entries that fail are deleted, and so counted; entries the
    blocks database claims but a damaged page hides from the cursor or from a lookup are
    counted too. If more blocks verify than ``capacity_blocks`` (a smaller capacity than the
    last run), the surplus is deleted.

Fork safety
    An LMDB environment must not be used after ``fork()``. Every call checks the process id and
    raises :class:`BackendError` in a forked child; ``close`` there forgets the backend without
    touching the environment. Reader slots left by dead processes (which pin old pages and can
    fill the table) are reclaimed with ``reader_check()`` at open, every 30 s by the writer, and
    when a read finds the table full (a read that still finds it full is ``FAILED``, not a hang).

Stats
    ``puts``/``gets`` count keys asked for; ``bytes_written``/``bytes_read`` count payload bytes
    of ``OK`` results. ``extra``: ``write_txns`` (committed write transactions),
    ``map_full_errors``, ``map_grows``, ``stale_readers_cleared``, ``recovered_blocks``,
    ``recovery_dropped_blocks``, ``damaged_files``, ``layout_mismatches``.

Never open an LMDB directory from an untrusted source: LMDB trusts its own file format.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import functools
import logging
import math
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Final, Literal, TypeVar, cast

import lmdb
import numpy as np
import xxhash

from tiering.backends.base import (
    BackendCapabilities,
    Outcome,
    StorageBackend,
    is_block_view,
)
from tiering.backends.disk_guard import DiskGuard, allocated_bytes
from tiering.backends.lanes import LaneStep, run_in_lanes
from tiering.backends.lmdb.check import check_data_file
from tiering.backends.ownership import (
    DamagedStorageError,
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
from tiering.backends.settings import RecoverMode
from tiering.backends.tier_lock import lock_exclusive
from tiering.core.block_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAX_KEY_BYTES,
    checksum,
    unpack_header,
    verify_block,
)
from tiering.core.block_format import pack_header as _pack_header
from tiering.core.keys import check_keys
from tiering.errors import BackendError, ConfigurationError, CorruptBlockError

__all__ = ["LMDBBackend", "LMDBGeometry", "RecoverMode", "copy_and_checksum", "lmdb_geometry"]

_log = logging.getLogger(__name__)

_RECOVER_MODES: Final = ("verify", "trust_header", "wipe")

# LMDB (0.9, 64-bit) layout constants used by the capacity formula.
_PAGE_HEADER_BYTES: Final = 16
_NODE_HEADER_BYTES: Final = 8
_NODE_SLOT_BYTES: Final = 2
_PGNO_BYTES: Final = 8
_FIXED_OVERHEAD_PAGES: Final = 64
_SLACK_TXNS: Final = 4
_MAX_VALUE_BYTES: Final = 0xFFFFFFFF  # mv_size of an LMDB value is 32-bit on disk
_GROW_PAGES: Final = 64  # how much a delete that hits MapFullError grows the map
_GROW_ATTEMPTS: Final = 4
_READER_CHECK_INTERVAL_S: Final = 30.0  # the writer reclaims stale reader slots this often
_FUSED_CHUNK_BYTES: Final = 512 << 10  # a chunk the read path copies, then hashes from L2

_BLOCKS_DB: Final = b"blocks"
_META_DB: Final = b"meta"
_LAYOUT_KEY: Final = b"layout"
_TICK_KEY: Final = b"tick"
_LOCK_FILE: Final = "tiering-lmdb.lock"  # only tiering creates it: it marks tiering's LMDB
_DATA_FILE: Final = "data.mdb"
_LMDB_LOCK_FILE: Final = "lock.mdb"
_DAMAGED_SUFFIX: Final = ".damaged"

_T = TypeVar("_T")


# -- geometry ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LMDBGeometry:
    """How blocks map onto LMDB pages (see the module docstring for the formulas)."""

    page_bytes: int
    value_bytes: int  # header + payload
    footprint_bytes: int  # storage one stored block takes
    capacity_blocks: int
    txn_blocks: int  # the most blocks one write transaction carries
    map_bytes: int


def lmdb_geometry(
    *, block_bytes: int, capacity_bytes: int, page_bytes: int, max_txn_bytes: int
) -> LMDBGeometry:
    """The footprint of one block, the capacity in blocks and the map size for these settings."""
    value_bytes = HEADER_BYTES + block_bytes
    usable = page_bytes - _PAGE_HEADER_BYTES
    node_max = (usable // 2) & ~1  # LMDB's me_nodemax: larger nodes go to overflow pages
    overflow_footprint = math.ceil((value_bytes + _PAGE_HEADER_BYTES) / page_bytes) * page_bytes
    longest_inline = _NODE_HEADER_BYTES + MAX_KEY_BYTES + value_bytes + _NODE_SLOT_BYTES
    inline_footprint = 2 * longest_inline
    shortest_node = _NODE_HEADER_BYTES + 1 + value_bytes
    longest_node = _NODE_HEADER_BYTES + MAX_KEY_BYTES + value_bytes
    footprints = []
    if shortest_node <= node_max:  # some keys leave the value inline
        footprints.append(inline_footprint)
    if longest_node > node_max:  # some keys push it to overflow pages
        footprints.append(overflow_footprint)
    footprint = max(footprints)
    capacity_blocks = capacity_bytes // footprint
    txn_blocks = max(1, min(capacity_blocks, max_txn_bytes // footprint))

    leaf_node = _NODE_HEADER_BYTES + MAX_KEY_BYTES + _PGNO_BYTES + _NODE_SLOT_BYTES
    branch_node = _NODE_HEADER_BYTES + MAX_KEY_BYTES + _NODE_SLOT_BYTES
    overflow_values = longest_node > node_max
    leaf_pages = math.ceil(capacity_blocks * 2 * leaf_node / usable) if overflow_values else 0
    data_pages = math.ceil(capacity_blocks * footprint / page_bytes)
    tree_pages = leaf_pages + math.ceil((leaf_pages + data_pages) * 2 * branch_node / usable) + 8
    txn_pages = math.ceil(txn_blocks * footprint / page_bytes) + min(txn_blocks, leaf_pages) + 8
    freelist_pages = math.ceil(txn_pages * _PGNO_BYTES / usable) + 2
    slack_pages = _SLACK_TXNS * (txn_pages + freelist_pages)
    map_pages = data_pages + tree_pages + slack_pages + _FIXED_OVERHEAD_PAGES
    return LMDBGeometry(
        page_bytes=page_bytes,
        value_bytes=value_bytes,
        footprint_bytes=footprint,
        capacity_blocks=capacity_blocks,
        txn_blocks=txn_blocks,
        map_bytes=map_pages * page_bytes,
    )


# -- small helpers -----------------------------------------------------------------------------


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be a bool, got {value!r}")
    return value


def _byte_view(buf: object, nbytes: int, kind: str, index: int, *, writable: bool) -> memoryview:
    """``buf`` as a flat, C-contiguous uint8 memoryview of exactly ``nbytes``, or ValueError.

    ``kind`` and ``index`` name the buffer in the error (``"value", 3`` -> "value 3").
    """
    if is_block_view(buf, nbytes, writable=writable):
        return buf
    what = f"{kind} {index}"
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(cast(Any, buf))
    except TypeError:
        raise ValueError(
            f"{what} must be a buffer (memoryview), got {type(buf).__name__}"
        ) from None
    if view.nbytes != nbytes:
        raise ValueError(f"{what} is {view.nbytes} bytes; every block is {nbytes} bytes")
    if writable and view.readonly:
        raise ValueError(f"{what} is read-only; get() writes into the buffers it is given")
    if not view.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view


def copy_and_checksum(dst: memoryview, src: memoryview) -> int:
    """Copy ``src`` into ``dst`` and return ``block_format.checksum`` of the copy.

    Copies and hashes ``_FUSED_CHUNK_BYTES`` at a time, so that the hash reads each chunk from
    the CPU cache the copy just wrote it to instead of from memory (xxh3 streamed in chunks gives
    the one-shot digest). Both steps release the GIL.
    """
    dst_array = np.frombuffer(dst, np.uint8)
    src_array = np.frombuffer(src, np.uint8)
    size = dst.nbytes
    if size <= _FUSED_CHUNK_BYTES:
        np.copyto(dst_array, src_array)
        return checksum(dst)
    state = xxhash.xxh3_64()
    for start in range(0, size, _FUSED_CHUNK_BYTES):
        stop = start + _FUSED_CHUNK_BYTES
        np.copyto(dst_array[start:stop], src_array[start:stop])
        state.update(dst[start:stop])
    return state.intdigest()


async def _wait_uncancellable(futures: Sequence[concurrent.futures.Future[_T]]) -> list[_T]:
    """The results of ``futures`` (work on the backend's threads).

    If the caller is cancelled, work that has not started is cancelled, and work that has started
    is waited for before ``CancelledError`` propagates: a thread must never touch a caller's
    buffer after the call that lent it has returned.
    """
    wrapped = [asyncio.wrap_future(f) for f in futures]
    try:
        await asyncio.shield(asyncio.gather(*wrapped))
    except asyncio.CancelledError:
        for f in futures:
            f.cancel()  # only succeeds for work that has not started
        while not all(w.done() for w in wrapped):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([asyncio.shield(w) for w in wrapped if not w.done()])
        raise
    return [w.result() for w in wrapped]


class _DirectoryLock:
    """An exclusive ``flock`` on a file in the directory: one backend (or inspection) at a
    time. Read-only, the file is not created: if there is none, no backend ever wrote here and
    the directory itself is locked."""

    def __init__(self, directory: str, *, read_only: bool = False) -> None:
        path = os.path.join(directory, _LOCK_FILE)
        if not read_only:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        elif os.path.exists(path):
            self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        else:
            self._fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            lock_exclusive(self._fd, Path(directory), what="the LMDB backend's directory")
        except BaseException:
            os.close(self._fd)
            raise

    def release(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


class _ReaderGate:
    """Read transactions run concurrently; a map resize waits until none is active."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._readers = 0
        self._resizing = False

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            while self._resizing:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            self._resizing = True
            while self._readers:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._resizing = False
                self._cond.notify_all()


# -- the writer's work items ---------------------------------------------------------------------

_Kind = Literal["put", "delete", "purge"]


@dataclass(eq=False)
class _Job:
    """One put/delete/purge batch queued for the writer; ``results`` holds one entry per key."""

    kind: _Kind
    keys: Sequence[bytes]
    values: list[memoryview] | None
    future: concurrent.futures.Future[list[Any]] = field(default_factory=concurrent.futures.Future)
    results: list[Any] = field(default_factory=list)


@dataclass(eq=False)
class _Call:
    """A function to run on the writer thread (open and close touch the environment there)."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


_STOP: Final = object()
_Op = tuple[_Job, int]


class _MapFull(Exception):
    """MapFullError while applying op ``index`` of a chunk (or at commit: ``index`` = its end)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


# -- the backend -------------------------------------------------------------------------------


class LMDBBackend(StorageBackend):
    """Blocks stored as LMDB values; see the module docstring for layout, threads and limits.

    Settings (validated here, no I/O): ``path`` (a directory, created at open),
    ``capacity_bytes``, ``block_bytes``, ``fingerprint``, the durability flags ``sync``,
    ``metasync``, ``writemap``, ``map_async``, ``max_readers`` (LMDB's reader table, shared by
    every process that opens the directory), ``read_threads``, ``recover``, ``max_txn_bytes``
    (values per write transaction) and ``map_size_bytes`` (overrides the derived map size).
    """

    name: ClassVar[str] = "lmdb"
    owned_files: ClassVar[tuple[str, ...]] = (
        _DATA_FILE,
        _LMDB_LOCK_FILE,
        _DATA_FILE + _DAMAGED_SUFFIX,
        _LOCK_FILE,
    )
    # Writable: the lock file; read-only without one: the directory (_DirectoryLock).
    lock_files: ClassVar[tuple[str, ...]] = (_LOCK_FILE, ".")

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        block_bytes: int,
        fingerprint: bytes,
        sync: bool = True,
        metasync: bool = True,
        writemap: bool = False,
        map_async: bool = False,
        max_readers: int = 126,
        read_threads: int = 2,
        recover: RecoverMode = "trust_header",
        max_txn_bytes: int = 64 << 20,
        map_size_bytes: int | None = None,
        on_layout_mismatch: MismatchPolicy = "refuse",
        min_free_bytes: int | None = None,
        max_fs_used_fraction: float | None = None,
        read_only: bool = False,
        layout_description: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(
            block_bytes=block_bytes,
            fingerprint=fingerprint,
            layout_description=layout_description,
        )
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise ConfigurationError(f"path must be a directory path, got {path!r}")
        self.path = os.path.abspath(os.fspath(path))
        self._capacity_bytes = _check_int("capacity_bytes", capacity_bytes, 1)
        if block_bytes > _MAX_VALUE_BYTES - HEADER_BYTES:
            raise ConfigurationError(
                f"block_bytes={block_bytes} is over LMDB's largest value "
                f"({_MAX_VALUE_BYTES - HEADER_BYTES} bytes of payload)"
            )
        self.sync = _check_bool("sync", sync)
        self.metasync = _check_bool("metasync", metasync)
        self.writemap = _check_bool("writemap", writemap)
        self.map_async = _check_bool("map_async", map_async)
        if map_async and not writemap:
            raise ConfigurationError("map_async=True requires writemap=True (LMDB ignores it)")
        self.read_threads = _check_int("read_threads", read_threads, 1)
        self.max_readers = _check_int("max_readers", max_readers, 1)
        if max_readers < read_threads:
            raise ConfigurationError(
                f"max_readers={max_readers} is below read_threads={read_threads}: "
                f"each read thread holds a reader slot"
            )
        if recover not in _RECOVER_MODES:
            raise ConfigurationError(f"recover must be one of {_RECOVER_MODES}, got {recover!r}")
        self.recover: RecoverMode = recover
        if on_layout_mismatch not in ("refuse", "set_aside", "wipe"):
            raise ConfigurationError(
                "on_layout_mismatch must be one of 'refuse', 'set_aside', 'wipe'; "
                f"got {on_layout_mismatch!r}"
            )
        self.on_layout_mismatch: MismatchPolicy = on_layout_mismatch
        self.read_only = _check_bool("read_only", read_only)
        self.max_txn_bytes = _check_int("max_txn_bytes", max_txn_bytes, 1)
        self._geometry = self._derive_geometry(mmap.PAGESIZE)
        if map_size_bytes is not None:
            _check_int("map_size_bytes", map_size_bytes, 1)
        self._map_size_override = map_size_bytes
        # The disk guard (tiering.backends.disk_guard): the map is capped at what the disk
        # allows, so LMDB answers MapFullError (FULL: the tier evicts) before ENOSPC.
        self._guard = DiskGuard.build(self.path, min_free_bytes, max_fs_used_fraction)
        self._allowed_blocks = self._geometry.capacity_blocks
        self._guard_map_bytes = 0  # the map size the guard last asked for

        self._state: Literal["closed", "opening", "open", "closing"] = "closed"
        self._pid = os.getpid()
        self._index: set[bytes] = set()  # keys stored; mutated by the writer thread only
        self._env: lmdb.Environment | None = None
        self._blocks_db: lmdb._Database | None = None
        self._meta_db: lmdb._Database | None = None
        self._lock: _DirectoryLock | None = None
        self._gate = _ReaderGate()
        self._jobs: queue.SimpleQueue[_Job | _Call | object] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        # The writer's value buffer (header + payload), and a numpy view of its payload part.
        self._scratch = bytearray()
        self._scratch_payload = np.empty(0, np.uint8)
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self._closed: asyncio.Event | None = None
        self._ticks = 0
        self._extra_lock = threading.Lock()  # stats.extra is updated from the backend's threads
        self._last_reader_check = 0.0

    def _count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to ``stats.extra[name]`` (callable from any of the backend's threads)."""
        with self._extra_lock:
            self.stats.extra[name] = self.stats.extra.get(name, 0) + n

    def _check_readers(self, env: lmdb.Environment) -> None:
        """Free reader slots left by dead processes (they pin old pages and fill the table)."""
        self._last_reader_check = time.monotonic()
        self._count("stale_readers_cleared", env.reader_check())

    def _derive_geometry(self, page_bytes: int) -> LMDBGeometry:
        geometry = lmdb_geometry(
            block_bytes=self.block_bytes,
            capacity_bytes=self._capacity_bytes,
            page_bytes=page_bytes,
            max_txn_bytes=self.max_txn_bytes,
        )
        if geometry.capacity_blocks < 1:
            raise ConfigurationError(
                f"capacity_bytes={self._capacity_bytes} holds no block: one block of "
                f"{self.block_bytes} bytes takes {geometry.footprint_bytes} bytes of LMDB pages"
            )
        return geometry

    # -- capabilities and accounting -----------------------------------------------------------

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            persistent=True,
            supports_delete=True,
            max_value_bytes=_MAX_VALUE_BYTES - HEADER_BYTES,
            zero_copy_reads=True,
        )

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def capacity_blocks(self) -> int:
        return self._geometry.capacity_blocks

    @property
    def usage_bytes(self) -> int:
        return len(self._index) * self._geometry.footprint_bytes

    @property
    def effective_capacity_blocks(self) -> int:
        return min(self._geometry.capacity_blocks, self._allowed_blocks)

    @property
    def is_open(self) -> bool:
        return self._state == "open" and os.getpid() == self._pid

    @property
    def geometry(self) -> LMDBGeometry:
        """Page size, block footprint, capacity in blocks and map size (see module docstring)."""
        return self._geometry

    @property
    def map_size_bytes(self) -> int:
        """The map size the environment is opened with."""
        if self._map_size_override is not None:
            return self._map_size_override
        return self._geometry.map_bytes

    # -- lifecycle -----------------------------------------------------------------------------

    async def open(self) -> list[bytes]:
        if self._state != "closed":
            raise BackendError(f"LMDB backend at {self.path!r} is already {self._state}")
        self._state = "opening"
        self._pid = os.getpid()
        self._jobs = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._writer_loop, name=f"lmdb-writer:{self.path}", daemon=True
        )
        self._writer.start()
        call = _Call(self._open_on_writer)
        self._jobs.put(call)
        try:
            (keys,) = await _wait_uncancellable([call.future])
        except BaseException:
            fut = call.future
            opened = fut.done() and not fut.cancelled() and fut.exception() is None
            await self._stop_writer(close_env=opened)  # opened, but the caller went away
            self._state = "closed"
            raise
        self._readers = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.read_threads, thread_name_prefix="lmdb-read"
        )
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = asyncio.Event()
        self._inflight = 0
        self._state = "open"
        return list(keys)

    async def close(self) -> None:
        if self._state == "closed":
            return
        if os.getpid() != self._pid:
            # A forked child: the environment, the threads and the lock belong to the parent.
            self._env = None
            self._writer = None
            self._readers = None
            self._lock = None
            self._state = "closed"
            return
        if self._state == "opening":
            raise BackendError(f"LMDB backend at {self.path!r} is still opening")
        if self._state == "closing":
            assert self._closed is not None
            await self._closed.wait()
            return
        self._state = "closing"
        assert self._idle is not None and self._closed is not None
        await self._idle.wait()
        if self._readers is not None:
            self._readers.shutdown(wait=False)  # idle: every read has completed
            self._readers = None
        await self._stop_writer(close_env=True)
        self._state = "closed"
        self._closed.set()

    async def _stop_writer(self, *, close_env: bool) -> None:
        if close_env:
            call = _Call(self._close_on_writer)
            self._jobs.put(call)
            await _wait_uncancellable([call.future])
        self._jobs.put(_STOP)
        self._writer = None

    # -- batch operations ----------------------------------------------------------------------

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        self._check_writable()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if len(values) != len(key_list):
            raise ValueError(f"put got {len(key_list)} keys but {len(values)} values")
        views = [
            _byte_view(v, self.block_bytes, "value", i, writable=False)
            for i, v in enumerate(values)
        ]
        if not key_list:
            return []
        with self._operation():
            results: list[Outcome] = await self._submit(_Job("put", key_list, views))
        ok = results.count(Outcome.OK)
        self.stats.puts += len(results)
        self.stats.put_failures += len(results) - ok
        self.stats.bytes_written += ok * self.block_bytes
        return results

    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        self._check_open()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if len(buffers) != len(key_list):
            raise ValueError(f"get got {len(key_list)} keys but {len(buffers)} buffers")
        views = [
            _byte_view(b, self.block_bytes, "buffer", i, writable=True)
            for i, b in enumerate(buffers)
        ]
        stored = [i for i, key in enumerate(key_list) if key in self._index]
        results = [Outcome.MISSING] * len(key_list)
        corrupt: list[bytes] = []
        with self._operation():
            if stored:
                assert self._readers is not None
                lane = functools.partial(self._read_lane, key_list, views, stored)
                outcomes = await run_in_lanes(self._readers, self.read_threads, len(stored), lane)
                if len(stored) == len(key_list):
                    results = outcomes
                else:
                    for i, outcome in zip(stored, outcomes, strict=True):
                        results[i] = outcome
            ok = results.count(Outcome.OK)
            if ok < len(stored) and Outcome.CORRUPT in results:
                corrupt = [key_list[i] for i, r in enumerate(results) if r is Outcome.CORRUPT]
                if self.read_only:
                    self._index.difference_update(corrupt)  # no writer runs: nothing to race
                else:
                    await self._submit(_Job("purge", corrupt, None))
        self.stats.gets += len(results)
        self.stats.hits += ok
        self.stats.bytes_read += ok * self.block_bytes
        if ok < len(results):
            self.stats.misses += results.count(Outcome.MISSING)
            self.stats.corrupt += len(corrupt)
            self.stats.read_failures += results.count(Outcome.FAILED)
        return results

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        return [key in self._index for key in check_keys(keys, max_bytes=MAX_KEY_BYTES)]

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_writable()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if not key_list:
            return []
        with self._operation():
            results: list[bool] = await self._submit(_Job("delete", key_list, None))
        self.stats.deletes += sum(results)
        return results

    # -- event-loop side helpers ---------------------------------------------------------------

    def _check_open(self) -> None:
        if os.getpid() != self._pid:
            raise BackendError(
                f"LMDB backend at {self.path!r} was opened by process {self._pid} and is used in "
                f"process {os.getpid()} (a fork): an LMDB environment must not be used after "
                f"fork(); open a new backend in the child"
            )
        if self._state != "open":
            raise BackendError(f"LMDB backend at {self.path!r} is not open ({self._state})")

    def _check_writable(self) -> None:
        self._check_open()
        if self.read_only:
            raise BackendError(f"LMDB backend at {self.path!r} is open read-only")

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """Counts in-flight operations so that ``close`` can wait for them."""
        assert self._idle is not None
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def _submit(self, job: _Job) -> list[Any]:
        self._jobs.put(job)
        (results,) = await _wait_uncancellable([job.future])
        return results

    # -- read threads ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _read_lane(
        self, keys: Sequence[bytes], views: list[memoryview], stored: list[int]
    ) -> Iterator[LaneStep[Outcome]]:
        """A read thread's share of a get: item ``j`` reads ``keys[stored[j]]`` into its view,
        all in one read transaction (see :func:`tiering.backends.lanes.run_in_lanes`)."""
        env = self._env
        assert env is not None
        with self._gate.reading():
            try:
                txn = self._begin_read(env)
            except lmdb.Error as exc:
                _log.error("LMDB read transaction failed at %s: %s", self.path, exc)
                yield lambda j: Outcome.FAILED
                return
            with txn:

                def step(j: int) -> Outcome:
                    i = stored[j]
                    try:
                        return self._read_one(txn, keys[i], views[i])
                    except lmdb.Error as exc:
                        _log.error(
                            "LMDB read of %s failed at %s: %s", keys[i].hex(), self.path, exc
                        )
                        return Outcome.FAILED

                yield step

    def _begin_read(self, env: lmdb.Environment) -> lmdb.Transaction[memoryview]:
        try:
            return env.begin(db=self._blocks_db, buffers=True)
        except lmdb.ReadersFullError:
            # Slots may be held by dead processes; reclaim them and try once more.
            self._check_readers(env)
            return env.begin(db=self._blocks_db, buffers=True)

    def _read_one(self, txn: lmdb.Transaction[memoryview], key: bytes, view: memoryview) -> Outcome:
        raw = txn.get(key)
        if raw is None:
            return Outcome.MISSING
        problem = None
        if len(raw) != self._geometry.value_bytes:
            problem = f"value is {len(raw)} bytes, expected {self._geometry.value_bytes}"
        else:
            try:
                header = unpack_header(raw)
            except CorruptBlockError as exc:
                problem = str(exc)
            else:
                if header.key != key:
                    problem = f"block holds key {header.key.hex()}"
                elif header.fingerprint != self.fingerprint:
                    problem = "block was written for another layout (fingerprint mismatch)"
                elif header.payload_bytes != self.block_bytes:
                    problem = f"header says {header.payload_bytes} payload bytes"
                elif copy_and_checksum(view, raw[HEADER_BYTES:]) != header.payload_checksum:
                    problem = "payload checksum mismatch"
        if problem is not None:
            _log.warning("corrupt LMDB block %s at %s: %s", key.hex(), self.path, problem)
            return Outcome.CORRUPT
        return Outcome.OK

    # -- the writer thread ----------------------------------------------------------------------

    def _writer_loop(self) -> None:
        carry: object = None  # an item taken while coalescing, to run next
        while True:
            item = carry if carry is not None else self._jobs.get()
            carry = None
            if item is _STOP:
                return
            if isinstance(item, _Call):
                if item.future.set_running_or_notify_cancel():
                    try:
                        item.future.set_result(item.fn())
                    except BaseException as exc:  # handed to the caller
                        item.future.set_exception(exc)
                continue
            assert isinstance(item, _Job)
            group = [item]
            puts = len(item.keys) if item.kind == "put" else 0
            # Coalesce what is already queued, up to about one transaction of values.
            while puts < self._geometry.txn_blocks:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if not isinstance(nxt, _Job):
                    carry = nxt
                    break
                group.append(nxt)
                puts += len(nxt.keys) if nxt.kind == "put" else 0
            running = []
            for job in group:
                if job.future.set_running_or_notify_cancel():
                    running.append(job)
                else:
                    job.values = None  # cancelled before it started: never written
            group = running
            error: BaseException | None = None
            try:
                self._run_group(group)
            except BaseException as exc:  # a bug: fail the batch, keep the writer alive
                _log.exception("LMDB writer failed at %s", self.path)
                error = exc
            for job in group:
                job.values = None  # keep no reference to the caller's buffers
                if error is None:
                    job.future.set_result(job.results)
                else:
                    job.future.set_exception(BackendError(f"LMDB writer failed: {error!r}"))
            if time.monotonic() - self._last_reader_check > _READER_CHECK_INTERVAL_S:
                assert self._env is not None
                with contextlib.suppress(lmdb.Error):
                    self._check_readers(self._env)

    def _run_group(self, jobs: list[_Job]) -> None:
        if self._guard is not None and any(job.kind == "put" for job in jobs):
            self._apply_disk_guard()
        ops: list[_Op] = []
        for job in jobs:
            job.results = [
                Outcome.FAILED if job.kind == "put" else False for _ in range(len(job.keys))
            ]
            ops.extend((job, i) for i in range(len(job.keys)))
        deferred: list[_Op] = []  # deletes, purges and failed puts to make invisible
        map_full = False
        pos = 0
        while pos < len(ops):
            end = self._chunk_end(ops, pos)
            if map_full:
                self._defer(ops[pos:end], Outcome.FULL, deferred)
                pos = end
                continue
            reached, error = self._commit_chunk(ops, pos, end, cleanup=False)
            if error == "full":
                map_full = True
                self._defer(ops[reached:end], Outcome.FULL, deferred)
            elif error == "failed":
                self._defer(ops[reached:end], Outcome.FAILED, deferred)
            pos = end
        if deferred:
            reached, error = self._commit_chunk(deferred, 0, len(deferred), cleanup=True)
            if error is not None:
                _log.error(
                    "LMDB at %s: %d deletes could not be committed (%s)",
                    self.path,
                    len(deferred) - reached,
                    error,
                )

    def _chunk_end(self, ops: list[_Op], pos: int) -> int:
        puts = 0
        end = pos
        while end < len(ops) and puts < self._geometry.txn_blocks:
            puts += ops[end][0].kind == "put"
            end += 1
        return end

    @staticmethod
    def _defer(ops: list[_Op], outcome: Outcome, deferred: list[_Op]) -> None:
        for job, i in ops:
            if job.kind == "put":
                job.results[i] = outcome
            deferred.append((job, i))

    def _commit_chunk(
        self, ops: list[_Op], start: int, end: int, *, cleanup: bool
    ) -> tuple[int, Literal["full", "failed"] | None]:
        """Apply ``ops[start:end]`` in one write transaction; shrink it on MapFullError.

        Returns ``(reached, error)``: ``ops[start:reached]`` are committed; ``error`` says why the
        rest are not (``None`` when ``reached == end``). In ``cleanup`` mode puts become deletes
        (of keys whose put failed) and a full map is grown instead of shrinking the chunk.
        """
        env = self._env
        assert env is not None
        limit = end
        ticked = False
        grown = 0
        while limit > start:
            overlay: dict[bytes, bool] = {}
            try:
                txn = env.begin(db=self._blocks_db, write=True, buffers=True)
                try:
                    self._apply(txn, ops, start, limit, overlay, cleanup=cleanup)
                except BaseException:
                    txn.abort()
                    raise
                try:
                    txn.commit()
                except lmdb.MapFullError:
                    raise _MapFull(limit - 1) from None
            except _MapFull as full:
                self._count("map_full_errors")
                if cleanup:
                    if grown < _GROW_ATTEMPTS and self._grow_map():
                        grown += 1
                        continue
                    return start, "full"
                if not ticked:
                    ticked = True
                    if self._tick():
                        continue
                limit = full.index
                continue
            except lmdb.Error as exc:
                _log.error("LMDB write transaction failed at %s: %s", self.path, exc)
                return start, "failed"
            self._publish(overlay)
            self._count("write_txns")
            return limit, None if limit == end else "full"
        return start, "full"

    def _apply(
        self,
        txn: lmdb.Transaction[memoryview],
        ops: list[_Op],
        start: int,
        end: int,
        overlay: dict[bytes, bool],
        *,
        cleanup: bool,
    ) -> None:
        """Apply ``ops[start:end]`` to ``txn``, recording key presence in ``overlay``."""
        count = len(self._index)
        for n in range(start, end):
            job, i = ops[n]
            key = job.keys[i]
            present = overlay[key] if key in overlay else key in self._index
            try:
                if job.kind == "put" and not cleanup:
                    assert job.values is not None
                    if not present and count >= self.effective_capacity_blocks:
                        job.results[i] = Outcome.FULL
                        continue
                    txn.put(key, self._encode(key, job.values[i]))
                    job.results[i] = Outcome.OK
                    overlay[key] = True
                    count += not present
                elif job.kind == "purge":
                    deleted, still_present = self._purge(txn, key)
                    job.results[i] = deleted
                    if still_present != present:
                        overlay[key] = still_present
                        count += 1 if still_present else -1
                else:  # a delete, or a failed put being made invisible
                    existed = txn.delete(key)
                    if job.kind == "delete":
                        job.results[i] = existed
                    if existed or present:
                        overlay[key] = False
                        count -= 1 if present else 0
            except lmdb.MapFullError:
                raise _MapFull(n) from None

    def _encode(self, key: bytes, value: memoryview) -> memoryview:
        """Header + payload in the writer's scratch buffer (one copy; LMDB copies it once more)."""
        np.copyto(self._scratch_payload, np.frombuffer(value, np.uint8))  # releases the GIL
        # The checksum covers the copy, so what is stored is self-consistent even if the caller
        # breaks the contract and changes its buffer during the put.
        view = memoryview(self._scratch)
        view[:HEADER_BYTES] = _pack_header(key, view[HEADER_BYTES:], self.fingerprint)
        return view

    def _purge(self, txn: lmdb.Transaction[memoryview], key: bytes) -> tuple[bool, bool]:
        """Delete ``key`` if its stored value (read again now) does not verify.

        Returns (deleted, present afterwards). A get saw it corrupt, but a put may have replaced
        it since: only a value that still fails is deleted.
        """
        raw = txn.get(key)
        if raw is None:
            return False, False
        if self._stored_value_ok(key, raw, verify_payload=True):
            return False, True
        return txn.delete(key), False

    def _stored_value_ok(self, key: bytes, raw: memoryview, *, verify_payload: bool) -> bool:
        if len(raw) != self._geometry.value_bytes:
            return False
        try:
            header = unpack_header(raw)
            if verify_payload:
                verify_block(
                    header,
                    raw[HEADER_BYTES:],
                    expected_key=key,
                    expected_fingerprint=self.fingerprint,
                )
        except CorruptBlockError:
            return False
        return (
            header.key == key
            and header.fingerprint == self.fingerprint
            and header.payload_bytes == self.block_bytes
        )

    def _publish(self, overlay: dict[bytes, bool]) -> None:
        """Make a committed transaction's keys visible (or invisible) to get and contains."""
        for key, present in overlay.items():
            if present:
                self._index.add(key)
            else:
                self._index.discard(key)

    def _tick(self) -> bool:
        """Commit a tiny transaction so that pages freed by the last commit become reusable.

        (LMDB reuses the pages a transaction freed only once a later one has committed.)
        """
        env = self._env
        assert env is not None
        self._ticks += 1
        for attempt in range(_GROW_ATTEMPTS + 1):
            try:
                with env.begin(db=self._meta_db, write=True) as txn:
                    txn.put(_TICK_KEY, self._ticks.to_bytes(8, "little"))
                return True
            except lmdb.MapFullError:
                if attempt == _GROW_ATTEMPTS or not self._grow_map():
                    return False
            except lmdb.Error as exc:
                _log.error("LMDB tick transaction failed at %s: %s", self.path, exc)
                return False
        return False

    def _apply_disk_guard(self) -> None:
        """Cap the map (and the capacity the tier sees) at what the disk allows now: the data
        file's allocated bytes plus the guard's headroom (writer thread)."""
        assert self._guard is not None and self._env is not None
        g = self._geometry
        try:
            limit = self._guard.allowed_bytes(allocated_bytes(os.path.join(self.path, _DATA_FILE)))
        except OSError as exc:  # cannot tell: keep the last limits
            _log.warning("LMDB at %s: disk guard cannot read the filesystem: %s", self.path, exc)
            return
        leaf = _NODE_HEADER_BYTES + MAX_KEY_BYTES + _PGNO_BYTES + _NODE_SLOT_BYTES
        tree_bytes = (_FIXED_OVERHEAD_PAGES + 16) * g.page_bytes + 2 * leaf * g.capacity_blocks
        self._allowed_blocks = max(0, (limit - tree_bytes) // g.footprint_bytes)
        want = max(g.page_bytes * _GROW_PAGES, min(self.map_size_bytes, limit))
        want -= want % g.page_bytes
        if abs(self._guard_map_bytes - want) >= _GROW_PAGES * g.page_bytes:  # not every page
            try:
                with self._gate.exclusive():
                    self._env.set_mapsize(want)  # LMDB keeps it >= the pages in use
            except lmdb.Error as exc:
                _log.error("LMDB map resize failed at %s: %s", self.path, exc)
                return
            self._guard_map_bytes = want

    def _grow_map(self) -> bool:
        """Grow the map by a few pages, with no read transaction active (LMDB requires it)."""
        env = self._env
        assert env is not None
        try:
            with self._gate.exclusive():
                env.set_mapsize(env.info()["map_size"] + _GROW_PAGES * self._geometry.page_bytes)
        except lmdb.Error as exc:
            _log.error("LMDB map resize failed at %s: %s", self.path, exc)
            return False
        self._count("map_grows")
        return True

    # -- open, recovery and close (on the writer thread) -----------------------------------------

    def _open_on_writer(self) -> list[bytes]:
        found = self._examine_or_claim()
        if found.state == "absent":  # read-only: nothing was ever stored here
            self._index = set()
            return []
        lock = _DirectoryLock(self.path, read_only=self.read_only)
        env: lmdb.Environment | None = None
        try:
            if not self._check_files():  # read-only, and no data file: nothing stored
                self._index = set()
                self._lock = lock
                return []
            env = self._open_env()
            mismatch = self._stored_layout_mismatch(env, found)
            if mismatch is not None:
                if self.read_only or self.on_layout_mismatch == "refuse":
                    raise mismatch
                self._count("layout_mismatches")
                if self.on_layout_mismatch == "set_aside":
                    env.close()
                    env = None
                    self._set_aside(mismatch)
                    env = self._open_env()
            keys = self._recover(env, wipe=mismatch is not None)
        except lmdb.Error as exc:
            self._env = None
            if env is not None:
                env.close()
            lock.release()
            raise BackendError(f"cannot open LMDB environment at {self.path!r}: {exc}") from exc
        except BaseException:
            self._env = None
            if env is not None:
                env.close()
            lock.release()
            raise
        self._lock = lock
        if not self.read_only:
            write_marker(Path(self.path), self._marker())
        return keys

    @classmethod
    def recognizes_directory(cls, path: Path) -> bool:
        """A directory of an earlier tiering: it holds the lock file only tiering creates."""
        return os.path.isfile(path / _LOCK_FILE) and not os.path.islink(path / _LOCK_FILE)

    def _configured_layout(self) -> LayoutRecord:
        return LayoutRecord(self.block_bytes, self.fingerprint, self.layout_description)

    def _marker(self) -> TierMarker:
        storage = f"lmdb-{'.'.join(map(str, lmdb.version()[:2]))}/tiering-{FORMAT_VERSION}"
        return TierMarker(self.name, storage, self._configured_layout(), created_by())

    def _examine_or_claim(self) -> TierDirectory:
        what = "the LMDB backend's directory"
        directory = Path(self.path)
        if self.read_only:
            found = examine_directory(
                directory, owned_files=self.owned_files, recognizes=self.recognizes_directory
            )
            if found.state == "foreign":
                raise foreign_directory_error(found, what=what)
            check_backend(found, self.name)
            return found
        return claim_directory(
            directory,
            self._marker(),
            owned_files=self.owned_files,
            recognizes=self.recognizes_directory,
            what=what,
        )

    def _check_files(self) -> bool:
        """Check the data file with plain reads before LMDB maps it (a truncated one is a
        SIGBUS); set a damaged one aside. Returns whether there is a data file to open."""
        data = os.path.join(self.path, _DATA_FILE)
        for name in (_DATA_FILE, _LMDB_LOCK_FILE):
            path = os.path.join(self.path, name)
            if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
                # Planted since the directory was examined: not ours, never followed nor removed
                raise UntrustedEntryError(
                    f"refusing {path!r}: it is not a regular file, so tiering did not make it; "
                    "tiering neither follows nor removes it and changed nothing. Move it out of "
                    "the directory, or give the tier another directory",
                    Path(self.path),
                    entries=(name,),
                )
        if not os.path.exists(data):
            return not self.read_only
        try:
            check = check_data_file(data)
        except OSError as exc:
            raise BackendError(f"cannot read {data!r}: {exc}") from exc
        if check.ok:
            return True
        if self.read_only:
            raise DamagedStorageError(
                f"{data!r} is damaged: {check.problem}; LMDB cannot open it safely",
                Path(self.path),
                lost_blocks=check.entries.get(_BLOCKS_DB),
            )
        lost = check.entries.get(_BLOCKS_DB, 0)
        aside = data + _DAMAGED_SUFFIX
        os.replace(data, aside)  # our own file: kept (one copy) for a post-mortem
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, _LMDB_LOCK_FILE))
        self._count("damaged_files")
        self._count("recovery_dropped_blocks", lost)
        _log.error(
            "LMDB at %s: the data file is damaged (%s); it was moved to %s and the tier starts "
            "empty (%s blocks lost)",
            self.path,
            check.problem,
            aside,
            lost if check.entries else "an unknown number of",
        )
        return True

    def _open_env(self) -> lmdb.Environment:
        if self.read_only:
            env = lmdb.open(
                self.path, subdir=True, readonly=True, lock=False, max_dbs=2, readahead=True
            )
        else:
            env = lmdb.open(
                self.path,
                map_size=self.map_size_bytes,
                subdir=True,
                mode=0o600,
                max_dbs=2,
                max_readers=self.max_readers,
                sync=self.sync,
                metasync=self.metasync,
                writemap=self.writemap,
                map_async=self.map_async,
                readahead=True,  # a value spans many pages: let the kernel read them together
                meminit=True,  # never write stale heap bytes into the file
                lock=True,
            )
        try:
            page_bytes = env.stat()["psize"]
            if page_bytes != self._geometry.page_bytes:  # a file made on another machine
                self._geometry = self._derive_geometry(page_bytes)
                if not self.read_only:
                    env.set_mapsize(max(self.map_size_bytes, env.info()["map_size"]))
            if not self.read_only:
                self._check_readers(env)
            create = not self.read_only
            try:
                self._blocks_db = env.open_db(_BLOCKS_DB, create=create)
                self._meta_db = env.open_db(_META_DB, create=create)
            except lmdb.NotFoundError:  # read-only, and nothing was ever stored
                self._blocks_db = self._meta_db = None
            self._env = env
            self._scratch = bytearray(self._geometry.value_bytes)
            self._scratch_payload = np.frombuffer(self._scratch, np.uint8, offset=HEADER_BYTES)
        except BaseException:
            self._env = None
            env.close()
            raise
        return env

    def _stored_layout_mismatch(
        self, env: lmdb.Environment, found: TierDirectory
    ) -> LayoutMismatchError | None:
        """The error to raise if the environment holds blocks of another layout, else None."""
        if self._blocks_db is None or self._meta_db is None:
            return None
        with env.begin() as txn:
            stored = txn.get(_LAYOUT_KEY, db=self._meta_db)
            entries = txn.stat(self._blocks_db)["entries"]
        marker = found.marker.layout if found.marker is not None else None
        if not entries:
            return None
        on_disk: LayoutRecord | None = marker
        if stored is not None and len(stored) == len(self._layout_record()):
            record = LayoutRecord(
                int.from_bytes(stored[2:10], "little"),
                bytes(stored[10:]),
                marker.description if marker is not None else None,
            )
            on_disk = (
                record
                if marker is not None and marker.matches(record)
                else (LayoutRecord(record.block_bytes, record.fingerprint))
            )
            if stored[:2] != self._layout_record()[:2]:  # another block format: not readable
                on_disk = LayoutRecord(record.block_bytes, b"\0" * 16)
        if on_disk is None or on_disk.matches(self._configured_layout()):
            return None
        return LayoutMismatchError(
            Path(self.path), on_disk, self._configured_layout(), what="the LMDB directory"
        )

    def _set_aside(self, mismatch: LayoutMismatchError) -> None:
        target = set_aside(Path(self.path), owned_files=self.owned_files)
        _log.warning(
            "LMDB at %s: blocks of another layout moved to %s (%s)",
            self.path,
            target,
            mismatch.on_disk.difference(mismatch.configured),
        )

    def _layout_record(self) -> bytes:
        return (
            FORMAT_VERSION.to_bytes(2, "little")
            + self.block_bytes.to_bytes(8, "little")
            + self.fingerprint
        )

    def _recover(self, env: lmdb.Environment, *, wipe: bool) -> list[bytes]:
        """Rebuild the index from what is stored, deleting what does not verify (read-only:
        leaving it, and not indexing it). ``wipe``: drop every block first."""
        blocks_db, meta_db = self._blocks_db, self._meta_db
        if blocks_db is None or meta_db is None:
            self._index = set()
            return []
        dropped = 0
        if not self.read_only:
            with env.begin(db=meta_db, write=True) as txn:
                if wipe or self.recover == "wipe":
                    dropped = txn.stat(blocks_db)["entries"]
                    txn.drop(blocks_db, delete=False)
                txn.put(_LAYOUT_KEY, self._layout_record())
        good: dict[bytes, None] = {}  # ordered, and a key a damaged page repeats counts once
        bad: list[bytes] = []
        verify_payload = self.recover == "verify"
        with env.begin(db=blocks_db, buffers=True) as rtxn:
            claimed = rtxn.stat(blocks_db)["entries"]
            for key_view, raw in rtxn.cursor().iternext():
                key = bytes(key_view)
                if self._stored_value_ok(key, raw, verify_payload=verify_payload):
                    good[key] = None
                else:
                    bad.append(key)
            # A damaged page can leave a key that a walk finds but a lookup does not (keys out
            # of order): get() could never serve it.
            unreachable = [key for key in good if rtxn.get(key) is None]
        for key in unreachable:
            del good[key]
        # A damaged leaf page can hide entries from the cursor: they are lost too, and counted.
        unseen = max(0, claimed - len(good) - len(bad))
        kept = list(good)
        surplus = kept[self._geometry.capacity_blocks :]
        del kept[self._geometry.capacity_blocks :]
        doomed = bad + surplus
        self._index = set(kept) | set(doomed)
        if doomed and not self.read_only:
            self._run_group([_Job("delete", doomed, None)])  # grows the map if it must
        self._index = set(kept)
        self._count("recovered_blocks", len(kept))
        self._count("recovery_dropped_blocks", dropped + len(doomed) + unseen)
        if doomed or dropped or unseen:
            _log.warning(
                "LMDB at %s: dropped %d stored blocks at open (%d did not verify, %d over "
                "capacity, %d of another layout or wiped, %d unreachable in a damaged page)",
                self.path,
                dropped + len(doomed) + unseen,
                len(bad),
                len(surplus),
                dropped,
                unseen,
            )
        return kept

    def _close_on_writer(self) -> None:
        env, self._env = self._env, None
        if env is not None:
            env.close()
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
        self._index = set()
