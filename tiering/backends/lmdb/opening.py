"""Opening and closing the tier, on the writer thread.

Open: claim (or, read-only, examine) the directory; take the directory lock (a second backend,
in this process or another, must not open it: the in-memory index must be the only writer's
view); check the data file with plain reads before LMDB maps it; open the environment; compare
the stored layout with the configured one (refuse, set the files aside, or wipe, as
``on_layout_mismatch`` says); rebuild the index; write the directory's marker. Close: close the
environment, release the lock, forget the index.
"""

from __future__ import annotations

import lmdb

from tiering.backends.lmdb.directory import LMDBDirectory
from tiering.backends.lmdb.environment import LMDBEnvironment
from tiering.backends.lmdb.locks import DirectoryLock
from tiering.backends.lmdb.record import RecordFormat
from tiering.backends.lmdb.recovery import Recovery
from tiering.backends.lmdb.threads import Count
from tiering.backends.ownership import MismatchPolicy
from tiering.errors import BackendError

__all__ = ["Opener"]


class Opener:
    """Opens the tier's environment (returning the keys stored) and closes it."""

    __slots__ = (
        "_count",
        "_directory",
        "_environment",
        "_index",
        "_lock",
        "_on_layout_mismatch",
        "_record",
        "_recovery",
    )

    def __init__(
        self,
        directory: LMDBDirectory,
        environment: LMDBEnvironment,
        record: RecordFormat,
        recovery: Recovery,
        index: set[bytes],
        *,
        on_layout_mismatch: MismatchPolicy,
        count: Count,
    ) -> None:
        self._directory = directory
        self._environment = environment
        self._record = record
        self._recovery = recovery
        self._index = index
        self._on_layout_mismatch = on_layout_mismatch
        self._count = count
        self._lock: DirectoryLock | None = None

    def open(self) -> list[bytes]:
        directory = self._directory
        found = directory.examine_or_claim()
        if found.state == "absent":  # read-only: nothing was ever stored here
            self._index.clear()
            return []
        lock = directory.lock()
        env: lmdb.Environment | None = None
        try:
            if not directory.check_files():  # read-only, and no data file: nothing stored
                self._index.clear()
                self._lock = lock
                return []
            env = self._open_env()
            mismatch = self._recovery.layout_mismatch(env, found)
            if mismatch is not None:
                if directory.read_only or self._on_layout_mismatch == "refuse":
                    raise mismatch
                self._count("layout_mismatches")
                if self._on_layout_mismatch == "set_aside":
                    env.close()
                    env = None
                    directory.set_aside(mismatch)
                    env = self._open_env()
            keys = self._recovery.rebuild_index(env, wipe=mismatch is not None)
        except lmdb.Error as exc:
            self._abandon(env, lock)
            raise BackendError(
                f"cannot open LMDB environment at {self._directory.path!r}: {exc}"
            ) from exc
        except BaseException:
            self._abandon(env, lock)
            raise
        self._lock = lock
        if not directory.read_only:
            directory.write_marker()
        return keys

    def _open_env(self) -> lmdb.Environment:
        """The environment, open, with the writer's scratch buffer allocated."""
        env = self._environment.open()
        try:
            self._record.allocate()
        except BaseException:
            self._environment.close()
            raise
        return env

    def _abandon(self, env: lmdb.Environment | None, lock: DirectoryLock) -> None:
        """A failed open: close what it opened, release the lock."""
        self._environment.forget()
        if env is not None:
            env.close()
        lock.release()

    def close(self) -> None:
        self._environment.close()
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()
        self._index.clear()

    def forget(self) -> None:
        """Drop the lock without releasing it (a forked child: it is the parent's)."""
        self._lock = None
