"""The CPU tier's data pool, and batched copies between it and the registered KV caches.

Row layout
----------
The pool is ``num_blocks`` rows; row ``s`` (a *slot*) holds one offloaded block for every rank:
``[rank 0 part | rank 1 part | ...]``, each part ``block_bytes`` long, so a secondary tier moves
a block of all ranks with one contiguous copy. A rank's part concatenates, over that rank's
canonical tensors in registration order, ``block_size_factor`` pages of each tensor: sub-block
``k`` of tensor ``t`` starts at ``part_offset[t] + k * page_bytes[t]``. A slot holds one group's
offloaded block; that group writes only the tensors its layers reference (the first
``ref.page_bytes`` of each page) and leaves the other bytes of the row as they were.

Copies
------
A :class:`PoolTransfer` names engine block ids per group (flat, with per-group counts, as a store
plan gives them) and pool slots; :class:`KVBlockCopier` validates all of it before the first byte
moves, then copies every (block, tensor) page. Pages adjacent on both sides are merged into one
copy. On CPU each copy is one ``memmove`` of raw addresses: measured here, per-page ``memmove``
runs at ~100% of a contiguous memcpy from 256 KiB pages up, where per-page ``Tensor.copy_`` reaches
~80% (5 us fixed cost each) and ``index_copy_`` on uint8 ~10%. Other devices (CUDA) use
``Tensor.copy_``, non-blocking when the pool is pinned, and synchronize before returning.

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
import struct
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from tiering.errors import BackendError, ConfigurationError, LayoutError
from tiering.groups import GroupKind
from tiering.layout import CanonicalKVCaches

__all__ = [
    "NULL_BLOCK_ID",
    "CPUBlockPool",
    "CopyBackend",
    "KVBlockCopier",
    "PinMode",
    "PoolTransfer",
    "TransferResult",
]

logger = logging.getLogger(__name__)

PinMode = bool | Literal["auto"]
CopyBackend = Literal["auto", "memmove", "torch"]

#: Engine block id meaning "no block" (outside a sliding window, Mamba padding).
NULL_BLOCK_ID = 0
_SKIPS_NULL_BLOCKS = (GroupKind.SLIDING_WINDOW, GroupKind.MAMBA)

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

        Raises :class:`BackendError` on timeout and :class:`LayoutError` if the file holds a pool
        of another geometry.
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
        # Another process probing (a joiner, a second creator) holds the lock for
        # microseconds; a live creator holds it for good.
        for attempt in range(3):
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if attempt == 2:
                    return False
                time.sleep(0.005)
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
    """What a copy really moved: null blocks skipped are not counted as copied."""

    engine_blocks_copied: int
    null_blocks_skipped: int
    bytes_copied: int
    engine_blocks_per_group: tuple[int, ...]


@dataclass(frozen=True)
class _GroupPages:
    """Per reference of one group: canonical tensor, its page, bytes used, offset in a slot."""

    tensor_idx: np.ndarray
    page_bytes: np.ndarray
    used_bytes: np.ndarray
    part_offset: np.ndarray
    skips_null: bool


@dataclass(frozen=True)
class _CopyPlan:
    """Validated, merged copies: per run, tensor index, offsets on both sides and length."""

    tensor_idx: np.ndarray
    engine_offset: np.ndarray
    pool_offset: np.ndarray
    nbytes: np.ndarray
    result: TransferResult


class KVBlockCopier:
    """Copies blocks of one rank's registered KV caches into and out of a :class:`CPUBlockPool`.

    The pool's ``block_bytes`` must equal the caches' offloaded block bytes per rank; this rank
    writes only its part of each row. Null block ids (``null_block_id``) are skipped in
    sliding-window and Mamba groups; in full-attention groups every id is a real block.
    ``copy_backend="auto"`` uses ``memmove`` for CPU caches and ``Tensor.copy_`` otherwise.
    """

    def __init__(
        self,
        caches: CanonicalKVCaches,
        pool: CPUBlockPool,
        *,
        rank: int = 0,
        block_size_factor: int | None = None,
        null_block_id: int = NULL_BLOCK_ID,
        copy_backend: CopyBackend = "auto",
    ) -> None:
        factor = caches.spec.block_size_factor if block_size_factor is None else block_size_factor
        _check_positive(factor, "block_size_factor")
        needed = caches.offloaded_block_bytes_per_rank(factor)
        if pool.block_bytes != needed:
            raise LayoutError(
                f"the pool's block_bytes={pool.block_bytes} but the registered KV caches need "
                f"{needed} bytes per rank for one offloaded block (block_size_factor={factor})"
            )
        self._caches = caches
        self._pool = pool
        self._factor = factor
        self._null_block_id = null_block_id
        self._rows = pool.rank_view(rank)  # validates rank; also keeps a shared mapping alive
        self._flat_tensors = [t.tensor.view(-1) for t in caches.tensors]
        self._use_memmove = _pick_backend(copy_backend, caches.device)
        self._groups = self._group_pages(caches, factor)

    @property
    def block_size_factor(self) -> int:
        return self._factor

    def store(self, job: PoolTransfer) -> TransferResult:
        """Copy engine blocks into pool slots; validates the whole job before copying."""
        plan = self._plan(job, to_pool=True)
        self._copy(plan, to_pool=True)
        return plan.result

    def load(self, job: PoolTransfer) -> TransferResult:
        """Copy pool slots into engine blocks; validates the whole job before copying."""
        plan = self._plan(job, to_pool=False)
        self._copy(plan, to_pool=False)
        return plan.result

    @staticmethod
    def _group_pages(caches: CanonicalKVCaches, factor: int) -> list[_GroupPages]:
        part_offsets = np.cumsum([0] + [t.page_bytes * factor for t in caches.tensors])
        groups = []
        for group, refs in zip(caches.spec.groups, caches.group_refs, strict=True):
            idx = np.array([r.tensor_idx for r in refs], dtype=np.int64)
            pages = np.array([caches.tensors[i].page_bytes for i in idx], dtype=np.int64)
            used = np.array([r.page_bytes for r in refs], dtype=np.int64)
            skips = group.kind in _SKIPS_NULL_BLOCKS
            groups.append(_GroupPages(idx, pages, used, part_offsets[idx], skips))
        return groups

    def _plan(self, job: PoolTransfer, to_pool: bool) -> _CopyPlan:
        if self._pool.closed:
            raise BackendError(f"{self._pool!r} is closed")
        group_slots = self._check_shape(job)
        runs: list[_Runs] = []
        copied, skipped = [], 0
        id_start = slot_start = 0
        for g, pages in enumerate(self._groups):
            size, num_slots = job.group_sizes[g], group_slots[g]
            ids = job.engine_block_ids[id_start : id_start + size]
            slots = job.slots[slot_start : slot_start + num_slots]
            id_start, slot_start = id_start + size, slot_start + num_slots
            positions = job.first_sub_block[g] + np.arange(size, dtype=np.int64)
            keep = ids != self._null_block_id if pages.skips_null else np.ones(size, dtype=bool)
            ids, positions = ids[keep], positions[keep]
            self._check_range(ids, self._caches.num_blocks, f"group {g}: engine block id")
            self._check_range(slots, self._pool.num_blocks, f"group {g}: slot")
            copied.append(len(ids))
            skipped += size - len(ids)
            block_slots = slots[positions // self._factor]
            runs.append(
                _Runs.for_group(
                    g, pages, ids, block_slots, positions, self._factor, self._pool.row_bytes
                )
            )
        merged = _Runs.concatenate(runs)
        merged.check_no_double_write(to_pool)
        nbytes = int(merged.nbytes.sum())
        result = TransferResult(sum(copied), skipped, nbytes, tuple(copied))
        return _CopyPlan(*merged.merge_adjacent(), result)

    def _check_shape(self, job: PoolTransfer) -> tuple[int, ...]:
        num_groups = len(self._groups)
        if len(job.group_sizes) != num_groups:
            raise LayoutError(
                f"the transfer lists {len(job.group_sizes)} groups; the caches have {num_groups}"
            )
        for g, first in enumerate(job.first_sub_block):
            if first >= self._factor:
                raise LayoutError(
                    f"group {g}: first_sub_block={first} is out of range; valid: "
                    f"0..{self._factor - 1} (block_size_factor={self._factor})"
                )
        expected = job.slots_per_group(self._factor)
        if sum(expected) != len(job.slots):
            raise LayoutError(
                f"the transfer lists {len(job.slots)} slots; its engine blocks need "
                f"{sum(expected)} (per group: {expected})"
            )
        return expected

    @staticmethod
    def _check_range(values: np.ndarray, limit: int, what: str) -> None:
        bad = (values < 0) | (values >= limit)
        if bad.any():
            value = int(values[np.argmax(bad)])
            raise LayoutError(f"{what} {value} is out of range; valid: 0..{limit - 1}")

    def _copy(self, plan: _CopyPlan, to_pool: bool) -> None:
        if self._use_memmove:
            self._copy_memmove(plan, to_pool)
        else:
            self._copy_tensors(plan, to_pool)

    def _copy_memmove(self, plan: _CopyPlan, to_pool: bool) -> None:
        # Raw addresses are safe here: every offset was range-checked by _plan, and the
        # tensors (and a shared mapping) are kept alive by self.
        bases = np.array([t.data_ptr() for t in self._flat_tensors], dtype=np.int64)
        engine = (bases[plan.tensor_idx] + plan.engine_offset).tolist()
        pool = (self._rows.data_ptr() + plan.pool_offset).tolist()
        dst, src = (pool, engine) if to_pool else (engine, pool)
        move = ctypes.memmove
        for d, s, n in zip(dst, src, plan.nbytes.tolist(), strict=True):
            move(d, s, n)

    def _copy_tensors(self, plan: _CopyPlan, to_pool: bool) -> None:
        pool = self._pool.rows_view().view(-1)
        rank_offset = self._rows.data_ptr() - pool.data_ptr()
        non_blocking = self._pool.is_pinned
        for t, e, p, n in zip(
            plan.tensor_idx.tolist(),
            plan.engine_offset.tolist(),
            plan.pool_offset.tolist(),
            plan.nbytes.tolist(),
            strict=True,
        ):
            engine = self._flat_tensors[t][e : e + n]
            pooled = pool[rank_offset + p : rank_offset + p + n]
            dst, src = (pooled, engine) if to_pool else (engine, pooled)
            dst.copy_(src, non_blocking=non_blocking)
        if self._caches.device.type == "cuda":
            torch.cuda.synchronize(self._caches.device)  # the copy is complete on return


@dataclass(frozen=True)
class _Runs:
    """One entry per (reference, engine block): where the page is on both sides, and whose."""

    tensor_idx: np.ndarray
    engine_offset: np.ndarray
    pool_offset: np.ndarray
    nbytes: np.ndarray
    group: np.ndarray
    block_id: np.ndarray
    slot: np.ndarray

    @classmethod
    def for_group(
        cls,
        group_idx: int,
        pages: _GroupPages,
        ids: np.ndarray,
        slots: np.ndarray,
        positions: np.ndarray,
        factor: int,
        row_bytes: int,
    ) -> _Runs:
        """Entries ordered reference-major, so consecutive blocks of one tensor can merge."""
        num_refs = len(pages.tensor_idx)
        sub_offset = (positions % factor)[None, :] * pages.page_bytes[:, None]
        pool_offset = slots[None, :] * row_bytes + pages.part_offset[:, None] + sub_offset
        return cls(
            tensor_idx=np.repeat(pages.tensor_idx, len(ids)),
            engine_offset=(pages.page_bytes[:, None] * ids[None, :]).reshape(-1),
            pool_offset=pool_offset.reshape(-1),
            nbytes=np.repeat(pages.used_bytes, len(ids)),
            group=np.full(num_refs * len(ids), group_idx, dtype=np.int64),
            block_id=np.tile(ids, num_refs),
            slot=np.tile(slots, num_refs),
        )

    @classmethod
    def concatenate(cls, parts: Sequence[_Runs]) -> _Runs:
        names = [f.name for f in fields(cls)]
        return cls(*(np.concatenate([getattr(p, name) for p in parts]) for name in names))

    def check_no_double_write(self, to_pool: bool) -> None:
        """Raise if two entries would write the same bytes (a racy, lossy transfer)."""
        if len(self.nbytes) < 2:
            return
        # Canonical tensors never overlap (registration checks it): (tensor, offset) orders them.
        space = np.zeros_like(self.tensor_idx) if to_pool else self.tensor_idx
        start = self.pool_offset if to_pool else self.engine_offset
        order = np.lexsort((start, space))
        same_space = space[order][1:] == space[order][:-1]
        ends = start[order][:-1] + self.nbytes[order][:-1]
        overlaps = same_space & (start[order][1:] < ends)
        if not overlaps.any():
            return
        i = int(np.argmax(overlaps))
        a, b = int(order[i]), int(order[i + 1])
        if to_pool:
            what = f"slot {int(self.slot[b])}"
            sources = f"engine blocks {int(self.block_id[a])} and {int(self.block_id[b])}"
        else:
            what = f"engine block id {int(self.block_id[b])}"
            sources = f"slots {int(self.slot[a])} and {int(self.slot[b])}"
        raise LayoutError(
            f"the transfer writes {what} twice, from {sources} (groups {int(self.group[a])} "
            f"and {int(self.group[b])}); list each destination once"
        )

    def merge_adjacent(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Merge entries that continue each other on both sides into one longer copy."""
        t, e, p, n = self.tensor_idx, self.engine_offset, self.pool_offset, self.nbytes
        if len(n) < 2:
            return t, e, p, n
        continues = (t[1:] == t[:-1]) & (e[1:] == e[:-1] + n[:-1]) & (p[1:] == p[:-1] + n[:-1])
        starts = np.flatnonzero(np.concatenate(([True], ~continues)))
        return t[starts], e[starts], p[starts], np.add.reduceat(n, starts)


def _pick_backend(copy_backend: CopyBackend, device: torch.device) -> bool:
    """True for ``memmove`` (CPU caches only), False for ``Tensor.copy_``."""
    if copy_backend not in ("auto", "memmove", "torch"):
        raise ConfigurationError(
            f"copy_backend must be 'auto', 'memmove' or 'torch', got {copy_backend!r}"
        )
    if copy_backend == "memmove" and device.type != "cpu":
        raise ConfigurationError(f"copy_backend='memmove' needs CPU KV caches, not {device}")
    return copy_backend == "memmove" or (copy_backend == "auto" and device.type == "cpu")


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
