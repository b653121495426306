"""The CPU tier's data pool: preallocated rows, optionally in shared memory.

Row layout
----------
The pool is ``num_blocks`` rows; row ``s`` (a *slot*) holds one offloaded block for every rank:
``[rank 0 part | rank 1 part | ...]``, each part ``block_bytes`` long, so a secondary tier moves
a block of all ranks with one contiguous copy. A rank's part concatenates, over that rank's
canonical tensors in registration order, ``block_size_factor`` pages of each tensor: sub-block
``k`` of tensor ``t`` starts at ``part_offset[t] + k * page_bytes[t]``. A slot holds one group's
offloaded block; that group writes only the bytes its layers use (``ref.page_bytes`` from
``ref.offset_bytes`` of each page it references) and leaves the other bytes of the row as they
were. The copies between the pool and the KV caches are the transfer engine's
(:mod:`tiering.transfer`).

Shared memory
-------------
:meth:`CPUBlockPool.create_shared` / :meth:`CPUBlockPool.open_shared` map the pool from a file
(a bare name lives in ``/dev/shm``) that several processes share with ``MAP_SHARED``. The file
starts with a one-page header (magic, version, geometry); rows start after it. The creator
builds the file under a temporary name and links it in place when it is complete, and holds an
exclusive ``flock`` on it for as long as it lives. Joiners wait (bounded) for the file, check
its geometry and join only a pool whose creator still holds the lock: workers never attach to a
pool a crashed scheduler left behind while its successor builds a new one. A new creator
replaces such an orphaned file.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from tiering.errors import BackendError, ConfigurationError, LayoutError, UnsafeFileError

__all__ = ["CPUBlockPool", "PinMode"]

logger = logging.getLogger(__name__)

PinMode = bool | Literal["auto"]

_HEADER_BYTES = 4096  # one page, so rows stay page-aligned
_HEADER = struct.Struct("<8sIIQQ")  # magic, version, world_size, num_blocks, block_bytes
_MAGIC = b"TIERPOOL"
_VERSION = 1
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python 3.11's mmap module lacks the constant
_SHM_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,200}")


class CPUBlockPool:
    """A preallocated pool of ``num_blocks`` rows of ``block_bytes * world_size`` bytes.

    Memory is pinned when ``pin_memory`` is ``True``, or ``"auto"`` and CUDA is available; if
    pinning fails the pool logs a warning and uses plain memory. Pages are touched at creation
    (a first touch costs several times a copy). See the module docstring for the row layout.
    """

    def __init__(
        self,
        num_blocks: int,
        block_bytes: int,
        *,
        world_size: int = 1,
        pin_memory: PinMode = "auto",
    ) -> None:
        self._set_geometry(num_blocks, block_bytes, world_size)
        self._rows, self._pinned = _allocate_rows(num_blocks, self.row_bytes, pin_memory)
        self._shared: _SharedRegion | None = None
        self._closed = False

    @classmethod
    def create_shared(
        cls,
        name_or_path: str | os.PathLike[str],
        num_blocks: int,
        block_bytes: int,
        *,
        world_size: int = 1,
        pin_memory: PinMode = "auto",
    ) -> CPUBlockPool:
        """Create the shared pool file; this pool unlinks it on close.

        Raises :class:`FileExistsError` if a live pool is there. A pool left by a creator
        that exited (a crash) is replaced, with a warning.
        """
        pool = cls.__new__(cls)
        pool._set_geometry(num_blocks, block_bytes, world_size)
        region = _SharedRegion.create(_shm_path(name_or_path), pool._header(), pool._file_bytes)
        pool._attach(region, pin_memory)
        return pool

    @classmethod
    def open_shared(
        cls,
        name_or_path: str | os.PathLike[str],
        num_blocks: int,
        block_bytes: int,
        *,
        world_size: int = 1,
        timeout_s: float = 30.0,
        pin_memory: PinMode = "auto",
    ) -> CPUBlockPool:
        """Join a shared pool, waiting up to ``timeout_s`` for its creator to finish.

        Raises :class:`BackendError` on timeout, :class:`LayoutError` if the file holds a pool
        of another geometry, and :class:`UnsafeFileError` if the file is owned by another user
        or open to group or others (that user could read or change every block): a pool is
        created ``0600`` by its creator, and only processes of the same user join it.
        """
        pool = cls.__new__(cls)
        pool._set_geometry(num_blocks, block_bytes, world_size)
        path = _shm_path(name_or_path)
        region = _SharedRegion.join(path, pool._header(), pool._file_bytes, timeout_s)
        pool._attach(region, pin_memory)
        return pool

    @classmethod
    def open_or_create_shared(
        cls,
        name_or_path: str | os.PathLike[str],
        num_blocks: int,
        block_bytes: int,
        *,
        world_size: int = 1,
        timeout_s: float = 30.0,
        pin_memory: PinMode = "auto",
    ) -> CPUBlockPool:
        """Create the shared pool, or join it if another process created it first."""
        try:
            return cls.create_shared(
                name_or_path, num_blocks, block_bytes, world_size=world_size, pin_memory=pin_memory
            )
        except FileExistsError:
            return cls.open_shared(
                name_or_path,
                num_blocks,
                block_bytes,
                world_size=world_size,
                timeout_s=timeout_s,
                pin_memory=pin_memory,
            )

    def _set_geometry(self, num_blocks: int, block_bytes: int, world_size: int) -> None:
        _check_positive(num_blocks, "num_blocks")
        _check_positive(block_bytes, "block_bytes")
        _check_positive(world_size, "world_size")
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.world_size = world_size
        self.row_bytes = block_bytes * world_size
        self._file_bytes = _HEADER_BYTES + num_blocks * self.row_bytes

    def _header(self) -> bytes:
        return _HEADER.pack(_MAGIC, _VERSION, self.world_size, self.num_blocks, self.block_bytes)

    def _attach(self, region: _SharedRegion, pin_memory: PinMode) -> None:
        self._shared = region
        self._closed = False
        self._rows = region.rows_tensor(self.num_blocks, self.row_bytes)
        self._pinned = region.pin(pin_memory)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.row_bytes

    @property
    def is_pinned(self) -> bool:
        return self._pinned

    @property
    def is_shared(self) -> bool:
        return self._shared is not None

    @property
    def is_creator(self) -> bool:
        """Whether this pool created its memory (always for a private pool)."""
        return self._shared is None or self._shared.is_creator

    @property
    def path(self) -> Path | None:
        """The shared file, or ``None`` for a private pool."""
        return self._shared.path if self._shared is not None else None

    @property
    def closed(self) -> bool:
        return self._closed

    def rows_view(self) -> torch.Tensor:
        """All rows as a ``(num_blocks, row_bytes)`` uint8 tensor aliasing the pool."""
        self._check_open()
        return self._rows

    def rank_view(self, rank: int) -> torch.Tensor:
        """One rank's parts as a ``(num_blocks, block_bytes)`` uint8 view (row stride kept)."""
        self._check_open()
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank!r} is out of range; valid: 0..{self.world_size - 1}")
        start = rank * self.block_bytes
        return self._rows[:, start : start + self.block_bytes]

    def block_view(self, slot: int) -> torch.Tensor:
        """Row ``slot`` (every rank's part) as a ``(row_bytes,)`` uint8 tensor."""
        self._check_range(slot, slot + 1)
        return self._rows[slot]

    def rows_memoryview(self, start: int = 0, stop: int | None = None) -> memoryview:
        """Rows ``[start, stop)`` as one writable, zero-copy byte memoryview (for ``preadv``)."""
        stop = self.num_blocks if stop is None else stop
        self._check_range(start, stop)
        rows: np.ndarray = self._rows[start:stop].view(-1).numpy()
        return memoryview(rows.data)

    def close(self) -> None:
        """Release the memory; idempotent. A shared file is unlinked only by its creator.

        Views handed out earlier keep the memory mapped until they are garbage, so they never
        dangle; the memory is released when the last of them goes. Do not use them after
        ``close``: a shared file may already be unlinked and reused.
        """
        if self._closed:
            return
        self._closed = True
        self._rows = torch.empty((0, self.row_bytes), dtype=torch.uint8)
        if self._shared is not None:
            self._shared.close()

    def __enter__(self) -> CPUBlockPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"shared {str(self.path)!r}" if self._shared is not None else "private"
        return (
            f"CPUBlockPool(num_blocks={self.num_blocks}, block_bytes={self.block_bytes}, "
            f"world_size={self.world_size}, {where}, pinned={self._pinned}, "
            f"closed={self._closed})"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise BackendError(f"{self!r} is closed")

    def _check_range(self, start: int, stop: int) -> None:
        self._check_open()
        for value in (start, stop):
            if isinstance(value, bool) or not isinstance(value, int):
                raise LayoutError(f"slot bounds must be ints, got {value!r}")
        if not 0 <= start < stop <= self.num_blocks:
            raise LayoutError(
                f"slot range [{start}, {stop}) is empty or out of range; valid slots: "
                f"0..{self.num_blocks - 1}"
            )


def _allocate_rows(
    num_blocks: int, row_bytes: int, pin_memory: PinMode
) -> tuple[torch.Tensor, bool]:
    """Touched ``(num_blocks, row_bytes)`` uint8 memory, pinned if wanted and possible."""
    rows = None
    if _want_pinning(pin_memory):
        try:
            rows = torch.empty((num_blocks, row_bytes), dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            logger.warning("pinned host memory unavailable, using plain memory: %s", exc)
    pinned = rows is not None
    if rows is None:
        # An anonymous mapping is page-aligned, so rows of whole pages suit O_DIRECT tiers
        # with no bounce buffer (torch's allocator aligns to 64 bytes only). The tensor keeps
        # the mapping alive; it is released with the last view.
        region = mmap.mmap(-1, num_blocks * row_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        rows = torch.frombuffer(region, dtype=torch.uint8, count=num_blocks * row_bytes)
        rows = rows.view(num_blocks, row_bytes)
    rows.zero_()  # first touch now, not during the first copy
    return rows, pinned


def _want_pinning(pin_memory: PinMode) -> bool:
    if pin_memory == "auto":
        return torch.cuda.is_available()
    if isinstance(pin_memory, bool):
        return pin_memory
    raise ConfigurationError(f"pin_memory must be True, False or 'auto', got {pin_memory!r}")


def _shm_path(name_or_path: str | os.PathLike[str]) -> Path:
    """A bare name becomes a file in ``/dev/shm`` (or the temp dir); a path is used as given."""
    text = os.fspath(name_or_path)
    if os.sep in text or isinstance(name_or_path, os.PathLike):
        return Path(text)
    if not _SHM_NAME.fullmatch(text):
        raise ConfigurationError(
            f"shared pool name {text!r} is invalid: use letters, digits, '.', '_' and '-', "
            "not starting with '.', at most 201 characters; or pass a path"
        )
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / text


class _SharedRegion:
    """A pool file mapped ``MAP_SHARED``: one header page, then the rows."""

    def __init__(self, path: Path, fd: int, is_creator: bool) -> None:
        self.path = path
        self.is_creator = is_creator
        self._fd: int | None = fd
        size = os.fstat(fd).st_size
        self._mmap: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED)
        self._registered_ptr: int | None = None

    @classmethod
    def create(cls, path: Path, header: bytes, file_bytes: int) -> _SharedRegion:
        """Build the pool in a private temp file, then link it at ``path``.

        The creator holds an exclusive ``flock`` on the file for as long as it lives, so a file
        nobody holds was left by a creator that exited: it is replaced (a pool that a live
        creator holds raises ``FileExistsError``). Linking a finished file means nobody ever
        sees it half built.
        """
        temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(temp, flags, 0o600)
        except OSError as exc:
            raise BackendError(f"cannot create the shared pool {str(path)!r}: {exc}") from exc
        region: _SharedRegion | None = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: never contended
            try:
                os.ftruncate(fd, file_bytes)
                region = cls(path, fd, is_creator=False)  # not the creator until linked
            except OSError as exc:
                raise BackendError(f"cannot size the shared pool {str(path)!r}: {exc}") from exc
            assert region._mmap is not None
            if not region._populate():
                # Write one byte per page: allocates every page without a pool-sized buffer.
                pages = torch.frombuffer(region._mmap, dtype=torch.uint8)[:: mmap.PAGESIZE]
                pages.zero_()
                del pages
            # Geometry first, magic last: a joiner that sees the magic sees the whole header.
            region._mmap[len(_MAGIC) : len(header)] = header[len(_MAGIC) :]
            region._mmap[: len(_MAGIC)] = _MAGIC
            _link_in_place(temp, path)
            region.is_creator = True
        except BaseException:
            if region is not None:
                region.close()
            else:
                os.close(fd)
            raise
        finally:
            temp.unlink(missing_ok=True)
        return region

    @classmethod
    def join(cls, path: Path, header: bytes, file_bytes: int, timeout_s: float) -> _SharedRegion:
        """Map the pool at ``path`` once its creator published it; never one whose creator exited.

        The file is reopened on every poll: a creator that replaces a stale pool links a new
        file at the same path.
        """
        deadline = time.monotonic() + timeout_s
        orphaned = False
        while True:
            fd = _open_existing(path)
            if fd is not None:
                try:
                    _check_private(fd, path)
                    if _header_ready(fd, path, header, file_bytes):
                        if _creator_alive(fd):
                            region = cls(path, fd, is_creator=False)
                            fd = None  # owned by the region now
                            region._populate()
                            return region
                        orphaned = True
                finally:
                    if fd is not None:
                        os.close(fd)
            if time.monotonic() >= deadline:
                why = (
                    "; the pool there was left by a creator that exited, and no new creator "
                    "replaced it"
                    if orphaned
                    else " to be created and sized by its creator"
                )
                raise BackendError(
                    f"timed out after {timeout_s} s waiting for the shared pool {str(path)!r}" + why
                )
            time.sleep(0.005)

    def rows_tensor(self, num_blocks: int, row_bytes: int) -> torch.Tensor:
        assert self._mmap is not None
        flat = torch.frombuffer(
            self._mmap, dtype=torch.uint8, count=num_blocks * row_bytes, offset=_HEADER_BYTES
        )
        return flat.view(num_blocks, row_bytes)

    def pin(self, pin_memory: PinMode) -> bool:
        """Register the mapping with CUDA when wanted; a failure only logs a warning."""
        if not _want_pinning(pin_memory) or not torch.cuda.is_available():
            return False
        assert self._mmap is not None
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        try:
            err = torch.cuda.cudart().cudaHostRegister(ptr, len(self._mmap), 0)
        except Exception as exc:  # any CUDA failure leaves a slower but working pool
            logger.warning("cudaHostRegister of %s failed: %s", self.path, exc)
            return False
        if int(err) != 0:
            logger.warning("cudaHostRegister of %s failed with error %s", self.path, err)
            return False
        self._registered_ptr = ptr
        return True

    def close(self) -> None:
        if self._registered_ptr is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered_ptr)
            self._registered_ptr = None
        # Never mmap.close(): tensors from torch.frombuffer do not pin a buffer export, so an
        # explicit unmap would leave any surviving view dangling (a segfault on use). They do
        # hold a reference to the mmap object, which unmaps once the last of them is gone.
        self._mmap = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            if self.is_creator:
                self.path.unlink(missing_ok=True)

    def _populate(self) -> bool:
        """Map every page now (Linux ``MADV_POPULATE_WRITE``); False if unsupported."""
        if self._mmap is None or not sys.platform.startswith("linux"):
            return False
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE)
        except (OSError, ValueError):
            return False
        return True


def _creator_alive(fd: int) -> bool:
    """Whether the pool's creator still holds its exclusive lock on the file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _link_in_place(temp: Path, path: Path) -> None:
    """Link the finished pool at ``path``, replacing a pool whose creator exited.

    Raises ``FileExistsError`` if a live creator holds the pool there.
    """
    for _ in range(3):
        try:
            os.link(temp, path, follow_symlinks=False)
            return
        except FileExistsError:
            if not _remove_if_orphaned(path):
                raise
        except OSError as exc:  # e.g. a file system without hard links
            raise BackendError(
                f"cannot link the shared pool into place at {str(path)!r}: {exc}; put it on a "
                "file system with hard links (/dev/shm, ext4, xfs, tmpfs)"
            ) from exc
    raise FileExistsError(errno.EEXIST, "the shared pool keeps being replaced", str(path))


def _remove_if_orphaned(path: Path) -> bool:
    """Unlink the pool at ``path`` if no creator holds it; False if a live one does."""
    fd = _open_existing(path)
    if fd is None:
        return True  # gone meanwhile
    try:
        # Only a creator ever takes the exclusive lock (on its own file, before linking it), so a
        # shared lock that is granted proves nobody will: the pool is an orphan for good. Probes
        # (joiners, other creators) take shared locks too, which never conflict with this one;
        # an exclusive attempt would fail whenever a joiner happened to be probing.
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live creator holds it
        found, ours = os.stat(path, follow_symlinks=False), os.fstat(fd)
        if (found.st_dev, found.st_ino) == (ours.st_dev, ours.st_ino):
            path.unlink()
            logger.warning("replaced the shared pool %s: its creator had exited", path)
        return True
    except FileNotFoundError:
        return True
    finally:
        os.close(fd)


def _open_existing(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None


def _check_private(fd: int, path: Path) -> None:
    """Refuse a pool file that another user owns or that group or others may open: its owner
    (or anyone, for a 0666 file) could read every block and write into the pool."""
    info = os.fstat(fd)
    uid = os.geteuid()
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != uid or mode & 0o077:
        raise UnsafeFileError(
            f"refusing to join the shared pool {str(path)!r}: it is owned by uid {info.st_uid} "
            f"with mode {mode:04o}; expected a file owned by this process's user (uid {uid}) "
            "with mode 0600 (no access for group or others), as create_shared makes it. "
            "Remove the file or give the pool another name"
        )


def _header_ready(fd: int, path: Path, header: bytes, file_bytes: int) -> bool:
    """True once the creator published the header; LayoutError if it describes another pool."""
    found = os.pread(fd, len(header), 0)
    if found[: len(_MAGIC)] != _MAGIC:
        return False
    size = os.fstat(fd).st_size
    if found != header or size != file_bytes:
        _, version, world_size, num_blocks, block_bytes = _HEADER.unpack(header)
        got = _HEADER.unpack(found) if len(found) == len(header) else (None,) * 5
        raise LayoutError(
            f"shared pool {str(path)!r} holds version={got[1]} world_size={got[2]} "
            f"num_blocks={got[3]} block_bytes={got[4]} ({size} bytes), expected "
            f"version={version} world_size={world_size} num_blocks={num_blocks} "
            f"block_bytes={block_bytes} ({file_bytes} bytes)"
        )
    return True


def _check_positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{what} must be a positive int, got {value!r}")
