"""The file backend's directory: claimed and locked on open, its marker written, data of another
layout refused, set aside or wiped, and the slot file opened without following symlinks.

The backend owns a directory (mode 0700) holding ``slots.bin``, ``manifest.json`` and
tiering's marker (:mod:`tiering.backends.ownership`): it claims only an absent or empty
directory, or one that carries the marker, and refuses any other. Two backends cannot open one
directory (``flock``). If the manifest (or, without one, the marker) names another block size,
fingerprint or slot format, the data are another layout's: the open is refused
(``on_layout_mismatch``), or they are set aside or wiped as configured, never emptied silently.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from collections.abc import Callable
from pathlib import Path

from tiering.backends._fileops import FileOps
from tiering.backends.file.manifest import MANIFEST_FORMAT, TMP_PREFIX, TMP_SUFFIX
from tiering.backends.file.slot_format import MANIFEST_NAME, SLOT_FORMAT_VERSION, SLOTS_NAME
from tiering.backends.file.workers import IoWorkers
from tiering.backends.ownership import (
    LayoutMismatchError,
    LayoutRecord,
    MismatchPolicy,
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
from tiering.backends.tier_lock import lock_exclusive
from tiering.errors import BackendError

# One logger for the whole backend, named as before it became a package.
logger = logging.getLogger("tiering.backends.file")

_WHAT = "the file backend's directory"


class SlotDirectory:
    """The directory ``path`` of one backend, and the exclusive ``flock`` held on it while open.

    ``name``, ``owned_files`` and ``recognizes`` are the backend's (see
    :class:`~tiering.backends.base.StorageBackend`); ``layout`` is the configured one;
    ``extra`` is the backend's ``stats.extra``.
    """

    __slots__ = (
        "path",
        "_name",
        "_owned_files",
        "_recognizes",
        "layout",
        "_read_only",
        "_on_layout_mismatch",
        "_ops",
        "_workers",
        "_extra",
        "_dir_fd",
    )

    def __init__(
        self,
        path: Path,
        *,
        name: str,
        owned_files: tuple[str, ...],
        recognizes: Callable[[Path], bool],
        layout: LayoutRecord,
        read_only: bool,
        on_layout_mismatch: MismatchPolicy,
        ops: FileOps,
        workers: IoWorkers,
        extra: dict[str, int],
    ) -> None:
        self.path = path
        self._name = name
        self._owned_files = owned_files
        self._recognizes = recognizes
        self.layout = layout
        self._read_only = read_only
        self._on_layout_mismatch = on_layout_mismatch
        self._ops = ops
        self._workers = workers
        self._extra = extra
        self._dir_fd = -1

    def marker(self) -> TierMarker:
        return TierMarker(
            self._name,
            f"{MANIFEST_FORMAT}/{SLOT_FORMAT_VERSION}",
            self.layout,
            created_by(),
        )

    def write_marker(self) -> None:
        write_marker(self.path, self.marker())

    # -- claiming and locking --------------------------------------------------------------------

    def examine_or_claim(self) -> TierDirectory:
        """Claim the directory (refusing one that is not tiering's); read-only: just look."""
        found = self._examine() if self._read_only else self._claim()
        if found.state == "absent":
            return found
        self._lock()
        st = os.stat(self.path)
        if st.st_mode & 0o022 and not self._read_only:
            raise BackendError(
                f"refusing the directory {str(self.path)!r}: it is group- or world-writable "
                f"(mode {st.st_mode & 0o777:o}); the file backend needs a private directory"
            )
        if not self._read_only:
            self._remove_stale_temps()
        return found

    def _examine(self) -> TierDirectory:
        found = examine_directory(
            self.path, owned_files=self._owned_files, recognizes=self._recognizes
        )
        if found.state == "foreign":
            raise foreign_directory_error(found, what=_WHAT)
        check_backend(found, self._name)
        return found

    def _claim(self) -> TierDirectory:
        return claim_directory(
            self.path,
            self.marker(),
            owned_files=self._owned_files,
            recognizes=self._recognizes,
            what=_WHAT,
        )

    def _remove_stale_temps(self) -> None:
        for name in os.listdir(self.path):
            if name.startswith(TMP_PREFIX) and name.endswith(TMP_SUFFIX):
                with contextlib.suppress(FileNotFoundError):
                    if stat.S_ISREG(os.lstat(self.path / name).st_mode):
                        os.unlink(self.path / name)  # ours: a write cut short
                        self._extra["stale_temp_removed"] += 1

    def _lock(self) -> None:
        """Hold an exclusive ``flock`` on the directory while open: one backend (or inspection)
        at a time decides what happens to its files."""
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            lock_exclusive(fd, self.path, what=_WHAT)
        except BaseException:
            os.close(fd)
            raise
        self._dir_fd = fd

    def release(self) -> None:
        """Let go of the directory's lock."""
        if self._dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._dir_fd)  # releases the directory's flock
            self._dir_fd = -1

    # -- what is stored ----------------------------------------------------------------------

    def slot_file_bytes(self) -> int:
        """The size of the slot file (0 if there is none, or a symlink is in its place)."""
        try:
            st = os.lstat(self.path / SLOTS_NAME)
        except FileNotFoundError:
            return 0
        return st.st_size if stat.S_ISREG(st.st_mode) else 0

    def resolve_mismatch(self, on_disk: LayoutRecord) -> None:
        """Data of another layout: refuse, set it aside or wipe it (``on_layout_mismatch``)."""
        error = LayoutMismatchError(self.path, on_disk, self.layout, what=_WHAT)
        if self._read_only or self._on_layout_mismatch == "refuse":
            raise error
        self._extra["layout_mismatches"] += 1
        if self._on_layout_mismatch == "set_aside":
            target = set_aside(self.path, owned_files=self._owned_files)
            logger.warning(
                "file backend %s: blocks of another layout moved to %s (%s)",
                self.path,
                target,
                on_disk.difference(self.layout),
            )
        else:
            for name in (SLOTS_NAME, MANIFEST_NAME):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path / name)
            logger.warning(
                "file backend %s: blocks of another layout deleted (on_layout_mismatch: wipe; %s)",
                self.path,
                on_disk.difference(self.layout),
            )
        self.write_marker()

    # -- the slot file -----------------------------------------------------------------------

    async def open_slot_file(self, o_direct: bool) -> int:
        """The slot file's descriptor, locked; -1 if read-only and there is no slot file."""
        path = str(self.path / SLOTS_NAME)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        if self._read_only:
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        if o_direct:
            flags |= os.O_DIRECT
        try:
            try:
                fd = await self._workers.call(self._ops.open, path, flags, 0o600)
            except FileNotFoundError:
                if not self._read_only:
                    raise
                return -1
            except OSError as exc:
                if exc.errno != errno.ELOOP:
                    raise
                # A symlink planted where our file belongs since the directory was examined
                raise UntrustedEntryError(
                    f"refusing the slot file {path!r}: it is a symlink, so tiering did not "
                    "make it; tiering neither follows nor removes it and changed nothing. Move "
                    "it out of the directory, or give the tier another directory",
                    self.path,
                    entries=(SLOTS_NAME,),
                ) from exc
        except OSError as exc:
            hint = " (does this file system support O_DIRECT?)" if o_direct else ""
            raise BackendError(f"cannot open the slot file {path!r}: {exc}{hint}") from exc
        try:
            lock_exclusive(fd, self.path, what="the file backend's slot file in")
        except BaseException:
            self._ops.close(fd)
            raise
        return fd
