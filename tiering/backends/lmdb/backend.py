"""``LMDBBackend``: the event loop's side of the LMDB tier, delegating to its collaborators.

It checks its settings (no I/O), validates each call's keys and buffers, answers ``contains``
and ``usage_bytes`` from its in-memory index of stored keys, and hands the work to the
collaborators it owns: the environment (:mod:`~tiering.backends.lmdb.environment`), the reader
threads (:mod:`~tiering.backends.lmdb.reads`), the writer thread
(:mod:`~tiering.backends.lmdb.writer`, :mod:`~tiering.backends.lmdb.transactions`), and the
opener (:mod:`~tiering.backends.lmdb.opening`, :mod:`~tiering.backends.lmdb.recovery`,
:mod:`~tiering.backends.lmdb.directory`).

Fork safety
    An LMDB environment must not be used after ``fork()``. Every call checks the process id and
    raises :class:`BackendError` in a forked child; ``close`` there forgets the backend without
    touching the environment.

Stats
    ``puts``/``gets`` count keys asked for; ``bytes_written``/``bytes_read`` count payload bytes
    of ``OK`` results. ``extra``: ``write_txns`` (committed write transactions),
    ``map_full_errors``, ``map_grows``, ``stale_readers_cleared``, ``recovered_blocks``,
    ``recovery_dropped_blocks``, ``damaged_files``, ``layout_mismatches``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import mmap
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

from tiering.backends.base import BackendCapabilities, Outcome, StorageBackend
from tiering.backends.disk_guard import DiskGuard
from tiering.backends.in_flight import InFlight
from tiering.backends.lanes import run_in_lanes
from tiering.backends.lmdb.arguments import (
    byte_view,
    check_block_bytes,
    check_directory,
    check_durability,
    check_int,
    check_recovery,
    check_threads,
)
from tiering.backends.lmdb.directory import LMDBDirectory, recognizes_directory
from tiering.backends.lmdb.environment import LMDBEnvironment
from tiering.backends.lmdb.files import DAMAGED_SUFFIX, DATA_FILE, LMDB_LOCK_FILE, LOCK_FILE
from tiering.backends.lmdb.geometry import MAX_VALUE_BYTES, LMDBGeometry, derive_geometry
from tiering.backends.lmdb.opening import Opener
from tiering.backends.lmdb.reads import Reader
from tiering.backends.lmdb.record import RecordFormat
from tiering.backends.lmdb.recovery import Recovery
from tiering.backends.lmdb.threads import Job, wait_uncancellable
from tiering.backends.lmdb.transactions import WriteTransactions
from tiering.backends.lmdb.writer import Writer
from tiering.backends.ownership import LayoutRecord, MismatchPolicy
from tiering.backends.settings import RecoverMode
from tiering.core.block_format import HEADER_BYTES, MAX_KEY_BYTES
from tiering.core.keys import check_keys
from tiering.errors import BackendError

__all__ = ["LMDBBackend"]


class LMDBBackend(StorageBackend):
    """Blocks stored as LMDB values; see :mod:`tiering.backends.lmdb` for layout, threads and
    limits.

    Settings (validated here, no I/O): ``path`` (a directory, created at open),
    ``capacity_bytes``, ``block_bytes``, ``fingerprint``, the durability flags ``sync``,
    ``metasync``, ``writemap``, ``map_async``, ``max_readers`` (LMDB's reader table, shared by
    every process that opens the directory), ``read_threads``, ``recover``, ``max_txn_bytes``
    (values per write transaction) and ``map_size_bytes`` (overrides the derived map size).
    """

    name: ClassVar[str] = "lmdb"
    owned_files: ClassVar[tuple[str, ...]] = (
        DATA_FILE,
        LMDB_LOCK_FILE,
        DATA_FILE + DAMAGED_SUFFIX,
        LOCK_FILE,
    )
    # Writable: the lock file; read-only without one: the directory (DirectoryLock).
    lock_files: ClassVar[tuple[str, ...]] = (LOCK_FILE, ".")

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
        self.path = check_directory(path)
        self._capacity_bytes = check_int("capacity_bytes", capacity_bytes, 1)
        check_block_bytes(block_bytes)
        self.sync, self.metasync, self.writemap, self.map_async = check_durability(
            sync, metasync, writemap, map_async
        )
        self.read_threads, self.max_readers = check_threads(read_threads, max_readers)
        self.recover, self.on_layout_mismatch, self.read_only = check_recovery(
            recover, on_layout_mismatch, read_only
        )
        self.max_txn_bytes = check_int("max_txn_bytes", max_txn_bytes, 1)
        self._environment = self._size_environment(
            map_size_bytes, min_free_bytes, max_fs_used_fraction
        )
        self._build_collaborators()

    # -- construction steps --------------------------------------------------------------------

    def _size_environment(
        self,
        map_size_bytes: int | None,
        min_free_bytes: int | None,
        max_fs_used_fraction: float | None,
    ) -> LMDBEnvironment:
        geometry_for = functools.partial(
            derive_geometry,
            block_bytes=self.block_bytes,
            capacity_bytes=self._capacity_bytes,
            max_txn_bytes=self.max_txn_bytes,
        )
        geometry = geometry_for(mmap.PAGESIZE)
        if map_size_bytes is not None:
            check_int("map_size_bytes", map_size_bytes, 1)
        return LMDBEnvironment(
            self.path,
            geometry=geometry,
            geometry_for=geometry_for,
            map_size_bytes=map_size_bytes,
            guard=DiskGuard.build(self.path, min_free_bytes, max_fs_used_fraction),
            read_only=self.read_only,
            sync=self.sync,
            metasync=self.metasync,
            writemap=self.writemap,
            map_async=self.map_async,
            max_readers=self.max_readers,
            count=self._count,
        )

    def _build_collaborators(self) -> None:
        """The index of stored keys, the collaborators that share it, the event loop's state
        (nothing is open yet)."""
        self._state: Literal["closed", "opening", "open", "closing"] = "closed"
        self._pid = os.getpid()
        self._index: set[bytes] = set()  # keys stored; mutated by the writer thread only
        self._extra_lock = threading.Lock()  # stats.extra is updated from the backend's threads
        record = RecordFormat(block_bytes=self.block_bytes, fingerprint=self.fingerprint)
        transactions = WriteTransactions(self._environment, record, self._index, self._count)
        self._writer = Writer(self._environment, transactions)
        self._reader = Reader(self._environment, record)
        self._opener = self._build_opener(record, transactions)
        self._readers: concurrent.futures.ThreadPoolExecutor | None = None
        self._in_flight: InFlight | None = None
        self._closed: asyncio.Event | None = None

    def _build_opener(self, record: RecordFormat, transactions: WriteTransactions) -> Opener:
        layout = LayoutRecord(self.block_bytes, self.fingerprint, self.layout_description)
        directory = LMDBDirectory(
            self.path,
            name=self.name,
            owned_files=self.owned_files,
            recognizes=self.recognizes_directory,
            layout=layout,
            read_only=self.read_only,
            count=self._count,
        )
        recovery = Recovery(
            self._environment,
            record,
            transactions,
            self._index,
            layout=layout,
            recover=self.recover,
            read_only=self.read_only,
            count=self._count,
        )
        return Opener(
            directory,
            self._environment,
            record,
            recovery,
            self._index,
            on_layout_mismatch=self.on_layout_mismatch,
            count=self._count,
        )

    def _count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to ``stats.extra[name]`` (callable from any of the backend's threads)."""
        with self._extra_lock:
            self.stats.extra[name] = self.stats.extra.get(name, 0) + n

    @classmethod
    def recognizes_directory(cls, path: Path) -> bool:
        """A directory of an earlier tiering: it holds the lock file only tiering creates."""
        return recognizes_directory(path)

    # -- capabilities and accounting -----------------------------------------------------------

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            persistent=True,
            supports_delete=True,
            max_value_bytes=MAX_VALUE_BYTES - HEADER_BYTES,
            zero_copy_reads=True,
        )

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def capacity_blocks(self) -> int:
        return self._environment.geometry.capacity_blocks

    @property
    def usage_bytes(self) -> int:
        return len(self._index) * self._environment.geometry.footprint_bytes

    @property
    def effective_capacity_blocks(self) -> int:
        return self._environment.effective_capacity_blocks

    @property
    def is_open(self) -> bool:
        return self._state == "open" and os.getpid() == self._pid

    @property
    def geometry(self) -> LMDBGeometry:
        """Page size, block footprint, capacity in blocks and map size (see
        :mod:`tiering.backends.lmdb.geometry`)."""
        return self._environment.geometry

    @property
    def map_size_bytes(self) -> int:
        """The map size the environment is opened with."""
        return self._environment.map_size_bytes

    # -- lifecycle -----------------------------------------------------------------------------

    async def open(self) -> list[bytes]:
        if self._state != "closed":
            raise BackendError(f"LMDB backend at {self.path!r} is already {self._state}")
        self._state = "opening"
        self._pid = os.getpid()
        self._writer.start()
        call = self._writer.call(self._opener.open)
        try:
            (keys,) = await wait_uncancellable([call.future])
        except BaseException:
            fut = call.future
            opened = fut.done() and not fut.cancelled() and fut.exception() is None
            # Opened, but the caller went away: close it again.
            await self._writer.stop(self._opener.close if opened else None)
            self._state = "closed"
            raise
        self._readers = concurrent.futures.ThreadPoolExecutor(
            max_workers=self.read_threads, thread_name_prefix="lmdb-read"
        )
        self._in_flight = InFlight()
        self._closed = asyncio.Event()
        self._state = "open"
        return list(keys)

    async def close(self) -> None:
        if self._state == "closed":
            return
        if os.getpid() != self._pid:
            # A forked child: the environment, the threads and the lock belong to the parent.
            self._environment.forget()
            self._writer.forget()
            self._readers = None
            self._opener.forget()
            self._state = "closed"
            return
        if self._state == "opening":
            raise BackendError(f"LMDB backend at {self.path!r} is still opening")
        if self._state == "closing":
            assert self._closed is not None
            await self._closed.wait()
            return
        self._state = "closing"
        assert self._in_flight is not None and self._closed is not None
        await self._in_flight.idle()
        if self._readers is not None:
            self._readers.shutdown(wait=False)  # idle: every read has completed
            self._readers = None
        await self._writer.stop(self._opener.close)
        self._state = "closed"
        self._closed.set()

    # -- batch operations ----------------------------------------------------------------------

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        self._check_writable()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if len(values) != len(key_list):
            raise ValueError(f"put got {len(key_list)} keys but {len(values)} values")
        views = [
            byte_view(v, self.block_bytes, "value", i, writable=False) for i, v in enumerate(values)
        ]
        if not key_list:
            return []
        with self._operation():
            results: list[Outcome] = await self._writer.submit(Job("put", key_list, views))
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
            byte_view(b, self.block_bytes, "buffer", i, writable=True)
            for i, b in enumerate(buffers)
        ]
        stored = [i for i, key in enumerate(key_list) if key in self._index]
        results = [Outcome.MISSING] * len(key_list)
        corrupt: list[bytes] = []
        with self._operation():
            if stored:
                assert self._readers is not None
                lane = functools.partial(self._reader.lane, key_list, views, stored)
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
                    await self._writer.submit(Job("purge", corrupt, None))
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
            results: list[bool] = await self._writer.submit(Job("delete", key_list, None))
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

    def _operation(self) -> contextlib.AbstractContextManager[None]:
        assert self._in_flight is not None  # open
        return self._in_flight.operation()
