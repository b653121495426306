"""The LMDB environment: opened with the durability flags, its reader table, and its map's size.

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

    ``read_only`` opens the environment without a lock file write or any change.

Map size
    The map is opened at the size :mod:`tiering.backends.lmdb.geometry` derives (or
    ``map_size_bytes``); a data file made on a machine of another page size re-derives the
    geometry at open. A delete that hits ``MapFullError`` grows the map by a few pages (with no
    read transaction active, as LMDB requires: :class:`~tiering.backends.lmdb.locks.ReaderGate`):
    deletes must always make progress. The disk guard (:mod:`tiering.backends.disk_guard`) caps
    the map, and the capacity the tier sees, at what the disk allows, so that LMDB answers
    ``MapFullError`` (``FULL``: the tier evicts) before ENOSPC.

Reader slots
    Reader slots left by dead processes (which pin old pages and can fill the table) are
    reclaimed with ``reader_check()`` at open, every 30 s by the writer, and when a read finds
    the table full (a read that still finds it full is ``FAILED``, not a hang).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Final

import lmdb

from tiering.backends.disk_guard import DiskGuard, allocated_bytes
from tiering.backends.lmdb.files import BLOCKS_DB, DATA_FILE, META_DB
from tiering.backends.lmdb.geometry import LMDBGeometry, blocks_within
from tiering.backends.lmdb.locks import ReaderGate
from tiering.backends.lmdb.threads import Count

__all__ = ["GROW_ATTEMPTS", "READER_CHECK_INTERVAL_S", "LMDBEnvironment"]

_log = logging.getLogger(__package__)  # the package's logger, as before the split

_GROW_PAGES: Final = 64  # how much a delete that hits MapFullError grows the map
GROW_ATTEMPTS: Final = 4
READER_CHECK_INTERVAL_S: Final = 30.0  # the writer reclaims stale reader slots this often


class LMDBEnvironment:
    """The tier's LMDB environment (``env``, once open) with its ``blocks`` and ``meta``
    databases, the page geometry it was opened with, the gate between readers and map resizes,
    and the map's size (derived, grown, capped by the disk guard)."""

    __slots__ = (
        "_count",
        "_geometry_for",
        "_guard",
        "_guard_map_bytes",
        "_map_async",
        "_map_size_override",
        "_max_readers",
        "_metasync",
        "_sync",
        "_writemap",
        "allowed_blocks",
        "blocks_db",
        "env",
        "gate",
        "geometry",
        "last_reader_check",
        "meta_db",
        "path",
        "read_only",
    )

    def __init__(
        self,
        path: str,
        *,
        geometry: LMDBGeometry,
        geometry_for: Callable[[int], LMDBGeometry],
        map_size_bytes: int | None,
        guard: DiskGuard | None,
        read_only: bool,
        sync: bool,
        metasync: bool,
        writemap: bool,
        map_async: bool,
        max_readers: int,
        count: Count,
    ) -> None:
        self.path = path
        self.read_only = read_only
        self.geometry = geometry
        self._geometry_for = geometry_for  # page size -> geometry (a file of another machine)
        self._map_size_override = map_size_bytes
        self._sync = sync
        self._metasync = metasync
        self._writemap = writemap
        self._map_async = map_async
        self._max_readers = max_readers
        self._count = count
        self.env: lmdb.Environment | None = None
        self.blocks_db: lmdb._Database | None = None
        self.meta_db: lmdb._Database | None = None
        self.gate = ReaderGate()
        self.last_reader_check = 0.0
        # The disk guard (tiering.backends.disk_guard): the map is capped at what the disk
        # allows, so LMDB answers MapFullError (FULL: the tier evicts) before ENOSPC.
        self._guard = guard
        self.allowed_blocks = geometry.capacity_blocks
        self._guard_map_bytes = 0  # the map size the guard last asked for

    @property
    def map_size_bytes(self) -> int:
        """The map size the environment is opened with."""
        if self._map_size_override is not None:
            return self._map_size_override
        return self.geometry.map_bytes

    @property
    def effective_capacity_blocks(self) -> int:
        return min(self.geometry.capacity_blocks, self.allowed_blocks)

    @property
    def guarded(self) -> bool:
        """Whether a disk guard caps the map."""
        return self._guard is not None

    # -- open and close ----------------------------------------------------------------------

    def open(self) -> lmdb.Environment:
        """Open the environment and its two databases (on the writer thread)."""
        env = self._open_lmdb()
        try:
            self._adopt_page_size(env)
            if not self.read_only:
                self.check_readers(env)
            create = not self.read_only
            try:
                self.blocks_db = env.open_db(BLOCKS_DB, create=create)
                self.meta_db = env.open_db(META_DB, create=create)
            except lmdb.NotFoundError:  # read-only, and nothing was ever stored
                self.blocks_db = self.meta_db = None
            self.env = env
        except BaseException:
            self.env = None
            env.close()
            raise
        return env

    def _open_lmdb(self) -> lmdb.Environment:
        if self.read_only:
            return lmdb.open(
                self.path, subdir=True, readonly=True, lock=False, max_dbs=2, readahead=True
            )
        return lmdb.open(
            self.path,
            map_size=self.map_size_bytes,
            subdir=True,
            mode=0o600,
            max_dbs=2,
            max_readers=self._max_readers,
            sync=self._sync,
            metasync=self._metasync,
            writemap=self._writemap,
            map_async=self._map_async,
            readahead=True,  # a value spans many pages: let the kernel read them together
            meminit=True,  # never write stale heap bytes into the file
            lock=True,
        )

    def _adopt_page_size(self, env: lmdb.Environment) -> None:
        page_bytes = env.stat()["psize"]
        if page_bytes != self.geometry.page_bytes:  # a file made on another machine
            self.geometry = self._geometry_for(page_bytes)
            if not self.read_only:
                env.set_mapsize(max(self.map_size_bytes, env.info()["map_size"]))

    def close(self) -> None:
        env, self.env = self.env, None
        if env is not None:
            env.close()

    def forget(self) -> None:
        """Drop the environment without touching it (a forked child: it is the parent's)."""
        self.env = None

    # -- readers -------------------------------------------------------------------------------

    def check_readers(self, env: lmdb.Environment) -> None:
        """Free reader slots left by dead processes (they pin old pages and fill the table)."""
        self.last_reader_check = time.monotonic()
        self._count("stale_readers_cleared", env.reader_check())

    def begin_read(self, env: lmdb.Environment) -> lmdb.Transaction[memoryview]:
        try:
            return env.begin(db=self.blocks_db, buffers=True)
        except lmdb.ReadersFullError:
            # Slots may be held by dead processes; reclaim them and try once more.
            self.check_readers(env)
            return env.begin(db=self.blocks_db, buffers=True)

    # -- the map's size (writer thread) --------------------------------------------------------

    def apply_disk_guard(self) -> None:
        """Cap the map (and the capacity the tier sees) at what the disk allows now: the data
        file's allocated bytes plus the guard's headroom (writer thread)."""
        assert self._guard is not None and self.env is not None
        g = self.geometry
        try:
            limit = self._guard.allowed_bytes(allocated_bytes(os.path.join(self.path, DATA_FILE)))
        except OSError as exc:  # cannot tell: keep the last limits
            _log.warning("LMDB at %s: disk guard cannot read the filesystem: %s", self.path, exc)
            return
        self.allowed_blocks = blocks_within(g, limit)
        want = max(g.page_bytes * _GROW_PAGES, min(self.map_size_bytes, limit))
        want -= want % g.page_bytes
        if abs(self._guard_map_bytes - want) >= _GROW_PAGES * g.page_bytes:  # not every page
            try:
                with self.gate.exclusive():
                    self.env.set_mapsize(want)  # LMDB keeps it >= the pages in use
            except lmdb.Error as exc:
                _log.error("LMDB map resize failed at %s: %s", self.path, exc)
                return
            self._guard_map_bytes = want

    def grow_map(self) -> bool:
        """Grow the map by a few pages, with no read transaction active (LMDB requires it)."""
        env = self.env
        assert env is not None
        try:
            with self.gate.exclusive():
                env.set_mapsize(env.info()["map_size"] + _GROW_PAGES * self.geometry.page_bytes)
        except lmdb.Error as exc:
            _log.error("LMDB map resize failed at %s: %s", self.path, exc)
            return False
        self._count("map_grows")
        return True
