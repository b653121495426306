"""The LMDB backend's two locks: the directory lock (one backend, or inspection, at a time) and
the reader gate (read transactions run side by side; a map resize waits until none is active,
as LMDB requires)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from tiering.backends.lmdb.files import LOCK_FILE
from tiering.backends.tier_lock import lock_exclusive

__all__ = ["DirectoryLock", "ReaderGate"]


class DirectoryLock:
    """An exclusive ``flock`` on a file in the directory: one backend (or inspection) at a
    time. Read-only, the file is not created: if there is none, no backend ever wrote here and
    the directory itself is locked."""

    def __init__(self, directory: str, *, read_only: bool = False) -> None:
        path = os.path.join(directory, LOCK_FILE)
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


class ReaderGate:
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
