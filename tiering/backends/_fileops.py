"""The system calls the file backend makes on its slot file, behind one small seam.

``FileBackend`` never calls ``os.pwritev`` and friends directly: it calls a :class:`FileOps`.
Production uses the plain one; fault tests pass :class:`FaultyFileOps` (or their own subclass)
to fail chosen calls with a chosen errno, deterministically and without privileges (the SQLite
I/O-error-VFS approach). Every method but ``close`` runs on one of the backend's I/O threads,
never on the event loop.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from tiering.errors import ConfigurationError

__all__ = ["FaultyFileOps", "FileOps", "OpName"]

OpName = Literal["open", "pwritev", "preadv", "fdatasync", "ftruncate", "fallocate"]
_OP_NAMES: tuple[OpName, ...] = ("open", "pwritev", "preadv", "fdatasync", "ftruncate", "fallocate")

Buffers = Sequence[memoryview | bytes | bytearray]

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, no wait


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or None where there is none; ``os`` lacks it."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


_sync_file_range = _load_sync_file_range()


class FileOps:
    """Thin wrappers over ``os``; subclass and override one method to inject a fault."""

    def open(self, path: str, flags: int, mode: int) -> int:
        return os.open(path, flags, mode)

    def close(self, fd: int) -> None:
        os.close(fd)

    def pwritev(self, fd: int, buffers: Buffers, offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        os.fdatasync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        os.ftruncate(fd, length)

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        """Ask the kernel to start writing a range's dirty pages to the device now, without
        waiting (``sync_file_range(SYNC_FILE_RANGE_WRITE)``; nothing where libc lacks it).

        A hint that makes a later ``fdatasync`` shorter, never a substitute for it: it
        promises nothing about durability, so its errors are left for that ``fdatasync``
        to report. ctypes releases the GIL for the call.
        """
        if _sync_file_range is not None:
            _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        """Reserve blocks so that later writes cannot hit ENOSPC (``posix_fallocate``)."""
        os.posix_fallocate(fd, offset, length)

    def size(self, fd: int) -> int:
        return os.fstat(fd).st_size


class FaultyFileOps(FileOps):
    """Fails chosen calls: ``{"pwritev": {2: errno.ENOSPC}}`` fails the 2nd ``pwritev`` call.

    Calls are counted per operation name from 1, over the life of the object (so a test can
    sweep N = 1, 2, 3... and rerun until no fault fires). ``fail_always`` fails every call of
    an operation. Counting is thread-safe; ``calls`` and ``fired`` let tests see what happened.
    """

    def __init__(
        self,
        fail_on: Mapping[OpName, Mapping[int, int]] | None = None,
        *,
        fail_always: Mapping[OpName, int] | None = None,
    ) -> None:
        for name in [*(fail_on or {}), *(fail_always or {})]:
            if name not in _OP_NAMES:
                raise ConfigurationError(
                    f"unknown file operation {name!r}; valid: {', '.join(_OP_NAMES)}"
                )
        self.fail_on = {name: dict(calls) for name, calls in (fail_on or {}).items()}
        self.fail_always = dict(fail_always or {})
        self.calls: dict[str, int] = dict.fromkeys(_OP_NAMES, 0)
        self.fired: list[tuple[str, int, int]] = []  # (operation, call number, errno)
        self._lock = threading.Lock()

    def _maybe_fail(self, name: OpName) -> None:
        with self._lock:
            self.calls[name] += 1
            number = self.calls[name]
            code = self.fail_on.get(name, {}).get(number, self.fail_always.get(name))
            if code is None:
                return
            self.fired.append((name, number, code))
        raise OSError(code, f"injected {errno.errorcode.get(code, code)} on {name} #{number}")

    def open(self, path: str, flags: int, mode: int) -> int:
        self._maybe_fail("open")
        return super().open(path, flags, mode)

    def pwritev(self, fd: int, buffers: Buffers, offset: int) -> int:
        self._maybe_fail("pwritev")
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self._maybe_fail("preadv")
        return super().preadv(fd, buffers, offset)

    def fdatasync(self, fd: int) -> None:
        self._maybe_fail("fdatasync")
        super().fdatasync(fd)

    def ftruncate(self, fd: int, length: int) -> None:
        self._maybe_fail("ftruncate")
        super().ftruncate(fd, length)

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        self._maybe_fail("fallocate")
        super().fallocate(fd, offset, length)
