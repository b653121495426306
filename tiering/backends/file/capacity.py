"""How many slots the file backend has: the configured capacity, what the disk guard
(:mod:`tiering.backends.disk_guard`) allows now, and what is reserved on disk.

The slot file is preallocated with ``posix_fallocate`` so that writes into it cannot run out of
space; with a disk guard, no more than the disk allows is reserved (the rest stays sparse).
ENOSPC is reported as ``FAILED``, not ``FULL``: the file is preallocated, so running out of
disk means the file system itself is full (a sparse or copy-on-write file), which evicting
blocks from this tier would not fix; ``FULL`` means "no free slot", which eviction does.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path

from tiering.backends.disk_guard import DiskGuard, allocated_bytes
from tiering.backends.file.slot_format import SLOTS_NAME
from tiering.backends.file.slot_io import SlotIO
from tiering.errors import BackendError

# One logger for the whole backend, named as before it became a package.
logger = logging.getLogger("tiering.backends.file")


class SlotCapacity:
    """``capacity_blocks`` slots of ``io.slot_bytes`` in the slot file of ``path``; ``guard``
    (or None) bounds how many of them the tier may use now."""

    __slots__ = ("capacity_bytes", "capacity_blocks", "allowed_blocks", "guard", "_path", "_io")

    def __init__(
        self, path: Path, capacity_bytes: int, guard: DiskGuard | None, io: SlotIO
    ) -> None:
        self.capacity_bytes = capacity_bytes
        self.capacity_blocks = capacity_bytes // io.slot_bytes
        self.allowed_blocks = self.capacity_blocks
        self.guard = guard
        self._path = path
        self._io = io

    @property
    def effective_blocks(self) -> int:
        return min(self.capacity_blocks, self.allowed_blocks)

    def refresh(self) -> int:
        """Sample the disk guard (an I/O thread): the slots the tier may use now."""
        assert self.guard is not None
        fd = self._io.fd
        try:
            occupied = allocated_bytes(fd) if fd >= 0 else 0
            allowed = self.guard.allowed_blocks(occupied, block_bytes=self._io.slot_bytes)
        except OSError as exc:  # cannot tell: keep the last answer
            logger.warning("file backend %s: disk guard cannot read the filesystem: %s",
                           self._path, exc)  # fmt: skip
            return self.allowed_blocks
        self.allowed_blocks = min(self.capacity_blocks, allowed)
        return self.allowed_blocks

    def preallocate(self, size: int) -> None:
        """Size the slot file (now ``size`` bytes) to the capacity and reserve it on disk."""
        io = self._io
        total = self.capacity_blocks * io.slot_bytes
        reserve = total
        if self.guard is not None:  # reserve no more than the disk allows: the rest is sparse
            reserve = min(total, self.refresh() * io.slot_bytes)
        try:
            if size != total:
                io.ops.ftruncate(io.fd, total)
            if reserve:
                io.ops.fallocate(io.fd, 0, reserve)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENODEV, errno.ESPIPE):
                return  # no fallocate here: the file stays sparse; ENOSPC becomes FAILED
            raise BackendError(
                f"cannot preallocate {total} bytes for {str(self._path / SLOTS_NAME)!r}: {exc}"
            ) from exc
