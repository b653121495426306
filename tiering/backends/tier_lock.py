"""The lock a backend holds on its directory while open, for everything else that touches it.

A file or LMDB backend holds an exclusive ``flock`` while it is open (the file backend on its
directory, the LMDB backend on its ``tiering-lmdb.lock``). ``tiering wipe``, ``replay --fresh``
and a backend's own recovery (setting aside or wiping data of another layout) take the same lock
first, without waiting: a tier a live process holds is refused with :class:`TierInUseError`,
which names the directory and, where the OS tells it (``/proc/locks``), the process that holds
it. Nothing is deleted from a directory whose lock could not be taken.

``flock`` locks belong to an open file description, so a second open in the same process is
refused too, and a lock is released by the kernel when its holder exits, however it exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from tiering.backends.ownership import TierDirectoryError

__all__ = ["TierInUseError", "flock_holders", "hold_directory_locks", "lock_exclusive"]

_PROC_LOCKS = "/proc/locks"


class TierInUseError(TierDirectoryError):
    """A live process (this one or another) holds the tier's directory lock: nothing in the
    directory was changed. ``holders`` are the pids the OS reports for the lock (empty where
    it does not say); ``tier`` is the tier's name when the caller knows it."""

    def __init__(
        self,
        message: str,
        directory: Path,
        *,
        holders: tuple[int, ...] = (),
        tier: str | None = None,
    ) -> None:
        super().__init__(message, directory)
        self.holders = holders
        self.tier = tier


def flock_holders(fd: int, proc_locks: str = _PROC_LOCKS) -> tuple[int, ...]:
    """The pids holding a ``flock`` on the file open at ``fd``, from ``/proc/locks`` (Linux);
    empty where the OS does not say (another OS, a pid outside this pid namespace)."""
    st = os.fstat(fd)
    # /proc/locks writes the device as "%02x:%02x" of major and minor, then the inode.
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids: list[int] = []
    try:
        with open(proc_locks, encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return ()
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; blocked waiters carry "->".
        if len(fields) < 6 or fields[1] == "->" or fields[1] != "FLOCK":
            continue
        if fields[5] != wanted:
            continue
        with contextlib.suppress(ValueError):
            pid = int(fields[4])
            if pid > 0 and pid not in pids:
                pids.append(pid)
    return tuple(pids)


def describe_holders(holders: Sequence[int]) -> str:
    """``"process 1234"`` / ``"processes 12, 34"`` / ``"another process or this one"``."""
    if not holders:
        return "a live process (the OS does not say which)"
    if len(holders) == 1:
        return f"process {holders[0]}" + (" (this one)" if holders[0] == os.getpid() else "")
    return "processes " + ", ".join(map(str, holders))


def lock_exclusive(fd: int, directory: Path, *, what: str, tier: str | None = None) -> None:
    """Take an exclusive ``flock`` on ``fd`` without waiting; :class:`TierInUseError` (the fd
    left open, for the caller to close) naming ``what`` and the holder if it is taken."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holders = flock_holders(fd)
        named = f"tier {tier!r} at " if tier else ""
        raise TierInUseError(
            f"{named}{what} {str(directory)!r} is in use: {describe_holders(holders)} holds its "
            "lock; nothing was changed. Stop that process first (one directory serves one "
            "backend at a time)",
            directory,
            holders=holders,
            tier=tier,
        ) from None


@contextlib.contextmanager
def hold_directory_locks(
    directory: Path, lock_files: Sequence[str], *, tier: str | None = None
) -> Iterator[None]:
    """Hold the exclusive locks an open backend holds on ``directory``: the directory itself
    (``"."`` in ``lock_files``) and/or files in it, each taken only if it exists (a backend
    that never opened created none). Raises :class:`TierInUseError` (nothing held) if any is
    taken; releases them all on exit."""
    fds: list[int] = []
    try:
        for name in lock_files:
            path = directory if name == "." else directory / name
            flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
            if name == ".":
                flags |= os.O_DIRECTORY
            try:
                fd = os.open(path, flags)
            except (FileNotFoundError, NotADirectoryError):
                continue
            except OSError as exc:  # a symlink (ELOOP) is not tiering's: examining refuses it
                raise TierDirectoryError(
                    f"cannot open {str(path)!r} to take its lock: {exc}", directory
                ) from exc
            fds.append(fd)
            lock_exclusive(fd, directory, what="the directory", tier=tier)
        yield
    finally:
        for fd in fds:
            os.close(fd)  # closing the last descriptor of it releases the flock
