"""The tier's directory: claiming it, its marker, and its files, checked before LMDB maps them.

The directory is claimed as tiering's (:mod:`tiering.backends.ownership`): absent, empty or
marked (a directory of an earlier tiering, with no marker, is recognized by the lock file only
tiering creates). Before ``lmdb.open`` maps the data file,
:func:`tiering.backends.lmdb.check.check_data_file` reads it with plain reads (meta pages,
file size against the last page, every B-tree page and overflow run): LMDB would die of
SIGBUS on a truncated file. A file that fails is moved to ``data.mdb.damaged`` (one copy
kept), its blocks counted in ``recovery_dropped_blocks`` and ``damaged_files``, and the tier
starts empty. A data file or LMDB lock file that is not a regular file was not made by tiering:
it is refused, never followed nor removed.

Never open an LMDB directory from an untrusted source: LMDB trusts its own file format.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

import lmdb

from tiering.backends.lmdb.check import check_data_file
from tiering.backends.lmdb.files import (
    BLOCKS_DB,
    DAMAGED_SUFFIX,
    DATA_FILE,
    LMDB_LOCK_FILE,
    LOCK_FILE,
)
from tiering.backends.lmdb.locks import DirectoryLock
from tiering.backends.lmdb.threads import Count
from tiering.backends.ownership import (
    DamagedStorageError,
    LayoutMismatchError,
    LayoutRecord,
    TierDirectory,
    TierMarker,
    UntrustedEntryError,
    check_backend,
    claim_directory,
    created_by,
    examine_directory,
    foreign_directory_error,
    set_aside,
    write_marker,
)
from tiering.core.block_format import FORMAT_VERSION
from tiering.errors import BackendError

__all__ = ["LMDBDirectory", "recognizes_directory"]

_log = logging.getLogger(__package__)  # the package's logger, as before the split

_WHAT = "the LMDB backend's directory"


def recognizes_directory(path: Path) -> bool:
    """A directory of an earlier tiering: it holds the lock file only tiering creates."""
    return os.path.isfile(path / LOCK_FILE) and not os.path.islink(path / LOCK_FILE)


class LMDBDirectory:
    """One tier's directory, for the backend named ``name`` that owns ``owned_files`` in it."""

    __slots__ = ("_count", "_name", "_owned_files", "_recognizes", "layout", "path", "read_only")

    def __init__(
        self,
        path: str,
        *,
        name: str,
        owned_files: tuple[str, ...],
        recognizes: Callable[[Path], bool],
        layout: LayoutRecord,
        read_only: bool,
        count: Count,
    ) -> None:
        self.path = path
        self._name = name
        self._owned_files = owned_files
        self._recognizes = recognizes
        self.layout = layout  # the configured layout
        self.read_only = read_only
        self._count = count

    def marker(self) -> TierMarker:
        storage = f"lmdb-{'.'.join(map(str, lmdb.version()[:2]))}/tiering-{FORMAT_VERSION}"
        return TierMarker(self._name, storage, self.layout, created_by())

    def examine_or_claim(self) -> TierDirectory:
        """Read-only: what the directory holds (refusing a foreign one); else claim it."""
        directory = Path(self.path)
        if self.read_only:
            found = examine_directory(
                directory, owned_files=self._owned_files, recognizes=self._recognizes
            )
            if found.state == "foreign":
                raise foreign_directory_error(found, what=_WHAT)
            check_backend(found, self._name)
            return found
        return claim_directory(
            directory,
            self.marker(),
            owned_files=self._owned_files,
            recognizes=self._recognizes,
            what=_WHAT,
        )

    def lock(self) -> DirectoryLock:
        return DirectoryLock(self.path, read_only=self.read_only)

    def write_marker(self) -> None:
        write_marker(Path(self.path), self.marker())

    def check_files(self) -> bool:
        """Check the data file with plain reads before LMDB maps it (a truncated one is a
        SIGBUS); set a damaged one aside. Returns whether there is a data file to open."""
        data = os.path.join(self.path, DATA_FILE)
        self._refuse_planted_files()
        if not os.path.exists(data):
            return not self.read_only
        try:
            check = check_data_file(data)
        except OSError as exc:
            raise BackendError(f"cannot read {data!r}: {exc}") from exc
        if check.ok:
            return True
        if self.read_only:
            raise DamagedStorageError(
                f"{data!r} is damaged: {check.problem}; LMDB cannot open it safely",
                Path(self.path),
                lost_blocks=check.entries.get(BLOCKS_DB),
            )
        lost = check.entries.get(BLOCKS_DB, 0)
        aside = data + DAMAGED_SUFFIX
        os.replace(data, aside)  # our own file: kept (one copy) for a post-mortem
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.path, LMDB_LOCK_FILE))
        self._count("damaged_files")
        self._count("recovery_dropped_blocks", lost)
        _log.error(
            "LMDB at %s: the data file is damaged (%s); it was moved to %s and the tier starts "
            "empty (%s blocks lost)",
            self.path,
            check.problem,
            aside,
            lost if check.entries else "an unknown number of",
        )
        return True

    def _refuse_planted_files(self) -> None:
        for name in (DATA_FILE, LMDB_LOCK_FILE):
            path = os.path.join(self.path, name)
            if os.path.islink(path) or (os.path.lexists(path) and not os.path.isfile(path)):
                # Planted since the directory was examined: not ours, never followed nor removed
                raise UntrustedEntryError(
                    f"refusing {path!r}: it is not a regular file, so tiering did not make it; "
                    "tiering neither follows nor removes it and changed nothing. Move it out of "
                    "the directory, or give the tier another directory",
                    Path(self.path),
                    entries=(name,),
                )

    def set_aside(self, mismatch: LayoutMismatchError) -> None:
        """Move the files of another layout aside (``on_layout_mismatch: set_aside``)."""
        target = set_aside(Path(self.path), owned_files=self._owned_files)
        _log.warning(
            "LMDB at %s: blocks of another layout moved to %s (%s)",
            self.path,
            target,
            mismatch.on_disk.difference(mismatch.configured),
        )
