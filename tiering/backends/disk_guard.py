"""A disk tier's guard against a filesystem that other programs fill.

A file or LMDB tier shares its filesystem with whatever else runs there. Without a guard, when
other data fills the disk the tier's next write that needs new space fails with ``ENOSPC``. With
``min_free_bytes`` (keep at least that much free) and/or ``max_fs_used_fraction`` (keep the
filesystem's use at or below that fraction), the tier's *effective capacity* follows the disk:

    allowed_bytes = the bytes the tier's files occupy now + headroom
    headroom      = min(free - min_free_bytes, max_fs_used_fraction x size - used)

(``free`` is what an unprivileged writer may use, ``f_bavail``). The headroom may be negative:
other data took the disk past the mark, and the tier shrinks below what it holds. The backend
turns ``allowed_bytes`` into blocks (:meth:`DiskGuard.allowed_blocks`), refuses a put past it
with ``FULL`` and reports it as ``effective_capacity_blocks``, which the owning tier's eviction
uses: a tier over it evicts before it writes, so its writes reuse the space its evicted blocks
held instead of asking the filesystem for more. The guard samples the filesystem on the
backend's own threads (``statvfs`` of a hung mount must not stall the engine), once per write;
the last sample is what the tier reads.

What "occupied" means differs: LMDB reuses the pages of deleted values inside ``data.mdb``, so
its file's allocated size is space the tier can write into again; the file backend writes into
fixed slots of ``slots.bin``, preallocated with ``fallocate`` where the filesystem can, so a
preallocated slot file needs no new space (the guard then limits only how much the backend
preallocates when it opens: a disk already too full for the whole capacity gives a smaller
tier, not a refusal).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tiering.errors import ConfigurationError

__all__ = ["STATVFS", "DiskGuard", "DiskSample", "allocated_bytes"]

Statvfs = Callable[[str | Path], os.statvfs_result]

#: How guards read the filesystem (a seam for tests on a machine that cannot mount a small
#: filesystem: they set it to a fake; a guard built with ``statvfs=`` uses that instead).
STATVFS: Statvfs = os.statvfs


@dataclass(frozen=True)
class DiskSample:
    """One reading of the filesystem, for metrics and messages."""

    size_bytes: int
    free_bytes: int  # what an unprivileged writer may still use (f_bavail)
    used_bytes: int
    headroom_bytes: int  # how much more the tier may take (negative: it must give some back)


class DiskGuard:
    """The effective capacity of a tier whose files live in ``path`` (see the module docstring).
    ``statvfs`` is a seam for tests (a filesystem that cannot be mounted)."""

    def __init__(
        self,
        path: str | Path,
        *,
        min_free_bytes: int | None = None,
        max_fs_used_fraction: float | None = None,
        statvfs: Statvfs | None = None,
    ) -> None:
        if min_free_bytes is not None and (
            isinstance(min_free_bytes, bool) or not isinstance(min_free_bytes, int)
            or min_free_bytes < 0
        ):  # fmt: skip
            raise ConfigurationError(
                f"min_free_bytes must be a size >= 0 bytes or None, got {min_free_bytes!r}"
            )
        if max_fs_used_fraction is not None and not (
            isinstance(max_fs_used_fraction, int | float) and 0 < max_fs_used_fraction <= 1
        ):
            raise ConfigurationError(
                "max_fs_used_fraction must be a fraction in (0, 1] of the filesystem's size, "
                f"or None, got {max_fs_used_fraction!r}"
            )
        self.path = path
        self.min_free_bytes = min_free_bytes
        self.max_fs_used_fraction = max_fs_used_fraction
        self._statvfs = statvfs
        self.last: DiskSample | None = None

    @classmethod
    def build(
        cls,
        path: str | Path,
        min_free_bytes: int | None,
        max_fs_used_fraction: float | None,
        statvfs: Statvfs | None = None,
    ) -> DiskGuard | None:
        """A guard if either limit is set, else None (no guard: no cost)."""
        if min_free_bytes is None and max_fs_used_fraction is None:
            return None
        return cls(
            path,
            min_free_bytes=min_free_bytes,
            max_fs_used_fraction=max_fs_used_fraction,
            statvfs=statvfs,
        )

    def sample(self) -> DiskSample:
        """Read the filesystem now (a syscall: call it on an I/O thread)."""
        st = (self._statvfs or STATVFS)(self.path)
        size = st.f_blocks * st.f_frsize
        free = st.f_bavail * st.f_frsize
        used = size - st.f_bfree * st.f_frsize
        headroom: int | None = None
        if self.min_free_bytes is not None:
            headroom = free - self.min_free_bytes
        if self.max_fs_used_fraction is not None:
            by_use = int(size * self.max_fs_used_fraction) - used
            headroom = by_use if headroom is None else min(headroom, by_use)
        assert headroom is not None
        self.last = DiskSample(size, free, used, headroom)
        return self.last

    def allowed_bytes(self, occupied_bytes: int) -> int:
        """The bytes the tier's files may occupy: what they occupy now plus the headroom."""
        return max(0, occupied_bytes + self.sample().headroom_bytes)

    def allowed_blocks(
        self, occupied_bytes: int, *, block_bytes: int, overhead_bytes: int = 0
    ) -> int:
        """How many blocks of ``block_bytes`` (each one's footprint on disk) the tier may hold,
        ``overhead_bytes`` of its files set aside for other things (LMDB's tree and
        copy-on-write slack)."""
        return max(0, (self.allowed_bytes(occupied_bytes) - overhead_bytes) // block_bytes)


def allocated_bytes(fd_or_path: int | str | Path) -> int:
    """The bytes a file occupies on its filesystem (``st_blocks``: a sparse file's holes and
    unallocated tail do not count); 0 if it does not exist."""
    try:
        st = os.fstat(fd_or_path) if isinstance(fd_or_path, int) else os.stat(fd_or_path)
    except FileNotFoundError:
        return 0
    return st.st_blocks * 512
