"""Which directories a backend may write into, and which files in them are tiering's own.

``tiering`` never deletes, truncates or renames a file it did not create. A backend's directory
is tiering's only if it was empty (or absent) when the backend first used it, or if it carries
tiering's *marker*, :data:`MARKER_NAME`, written when the directory was claimed. Any other
non-empty directory is refused with a :class:`ForeignDirectoryError` naming it and what is in
it. Inside a claimed directory, tiering touches only the files its backend declares as its own
(``StorageBackend.owned_files``, glob patterns) and the marker; a file an operator put there is
left alone by everything (``tiering replay --fresh``, ``tiering wipe``, a layout change set
aside or wiped, recovery).

The marker is a small JSON document::

    {"marker": "tiering-tier-directory", "marker_version": 1,
     "backend": "file", "storage_format": "tiering-file-backend/1",
     "block_bytes": 2097152, "fingerprint": "<32 hex digits>",
     "layout": {...the layout description, or null...}, "created_by": "tiering 0.1.0"}

It says which backend and storage format made the directory, and which block layout its data
were written for, so that ``tiering config check``, ``tiering doctor`` and ``build_manager``
can report a layout mismatch before any tier opens (the backend's own records, such as the file
backend's manifest, stay authoritative for its data). It is replaced atomically.

A directory made by an earlier version of tiering has no marker: it is adopted if every entry
in it is one of the backend's own files and the backend recognizes them as its own (for
example the file backend's manifest names its format).
"""

from __future__ import annotations

import contextlib
import datetime
import fnmatch
import functools
import importlib.metadata
import json
import os
import secrets
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tiering.errors import BackendError

__all__ = [
    "MARKER_NAME",
    "MISMATCH_POLICIES",
    "DamagedStorageError",
    "ForeignDirectoryError",
    "LayoutMismatchError",
    "MismatchPolicy",
    "TierDirectoryError",
    "TierMarker",
    "TierDirectory",
    "LayoutRecord",
    "UntrustedEntryError",
    "Removal",
    "check_backend",
    "claim_directory",
    "created_by",
    "examine_directory",
    "foreign_directory_error",
    "owns",
    "read_marker",
    "remove_owned_files",
    "set_aside",
    "write_marker",
]

MARKER_NAME = "tiering-tier.json"
_MARKER_KIND = "tiering-tier-directory"
_MARKER_VERSION = 1
_MARKER_MAX_BYTES = 256 * 1024
_TMP_PATTERN = f"{MARKER_NAME}.*.tmp"
_SHOWN_FOREIGN = 5  # foreign entries named in an error

#: What a backend does when its directory holds data of another block layout.
MismatchPolicy = Literal["refuse", "set_aside", "wipe"]
MISMATCH_POLICIES: tuple[MismatchPolicy, ...] = ("refuse", "set_aside", "wipe")


class TierDirectoryError(BackendError):
    """A backend's directory cannot be used as it is; nothing in it was changed."""

    def __init__(self, message: str, directory: Path) -> None:
        super().__init__(message)
        self.directory = directory

    def __str__(self) -> str:  # OSError would format (errno, strerror)
        return str(self.args[0])


class DamagedStorageError(TierDirectoryError):
    """A read-only backend found its files too damaged to read safely (a writable one sets
    them aside instead). ``lost_blocks`` is how many blocks they held, if known."""

    def __init__(self, message: str, directory: Path, *, lost_blocks: int | None = None) -> None:
        super().__init__(message, directory)
        self.lost_blocks = lost_blocks


class ForeignDirectoryError(TierDirectoryError):
    """The directory is not empty and carries no tiering marker: it is not tiering's."""


class UntrustedEntryError(TierDirectoryError):
    """An entry named like one of tiering's files is not a regular file (a symlink, a
    directory, a device): tiering never made it, so it neither follows nor removes it.
    ``entries`` are their names."""

    def __init__(self, message: str, directory: Path, *, entries: tuple[str, ...]) -> None:
        super().__init__(message, directory)
        self.entries = entries


class LayoutMismatchError(TierDirectoryError):
    """The directory holds blocks of another layout than the one configured.

    ``on_disk`` and ``configured`` are :class:`LayoutRecord` s; the message names both and the
    choices (``on_layout_mismatch: set_aside`` or ``wipe``, or another path).
    """

    def __init__(
        self, directory: Path, on_disk: LayoutRecord, configured: LayoutRecord, *, what: str
    ) -> None:
        super().__init__(
            f"{what} {str(directory)!r} holds blocks written for another layout than the "
            f"configured one; {on_disk.difference(configured)}. Nothing was changed. Choose: "
            "point the tier's path at another directory; or set on_layout_mismatch: set_aside "
            f"(the old files move to a sibling folder {directory.name}.mismatch-<time>, "
            "nothing is deleted); or set on_layout_mismatch: wipe (tiering's own files there "
            "are deleted)",
            directory,
        )
        self.on_disk = on_disk
        self.configured = configured


@dataclass(frozen=True)
class LayoutRecord:
    """What a tier's blocks are: their size, layout fingerprint and (if known) description."""

    block_bytes: int
    fingerprint: bytes
    description: Mapping[str, Any] | None = None

    def matches(self, other: LayoutRecord) -> bool:
        return self.block_bytes == other.block_bytes and self.fingerprint == other.fingerprint

    def summary(self) -> str:
        """One line: the description's main fields, or the block size and fingerprint."""
        d = self.description
        if d:
            parts = [f"model {d.get('model') or '?'}", str(d.get("dtype", "?"))]
            parts.append(f"world size {d.get('world_size', '?')}")
            parts.append(f"block_size_factor {d.get('block_size_factor', '?')}")
            parts.append(f"hash {d.get('hash_algorithm', '?')}/{d.get('hash_block_size', '?')}")
            text = ", ".join(parts)
        else:
            text = "layout not described"
        return f"{text} ({self.block_bytes} bytes per block, fingerprint {self.fingerprint.hex()})"

    def difference(self, configured: LayoutRecord) -> str:
        """``on disk: ...; configured: ...``, then the fields that differ, if both are described."""
        text = f"on disk: {self.summary()}; configured: {configured.summary()}"
        mine, theirs = self.description, configured.description
        if mine and theirs:
            changed = [
                f"{key} {mine.get(key)!r} on disk, {theirs.get(key)!r} configured"
                for key in sorted({*mine, *theirs})
                if mine.get(key) != theirs.get(key)
            ]
            if changed:
                text += f" (differs in: {'; '.join(changed)})"
        return text


@dataclass(frozen=True)
class TierMarker:
    """The parsed marker of a claimed directory."""

    backend: str
    storage_format: str
    layout: LayoutRecord
    created_by: str = ""

    def to_json(self) -> str:
        return (
            json.dumps(
                {
                    "marker": _MARKER_KIND,
                    "marker_version": _MARKER_VERSION,
                    "backend": self.backend,
                    "storage_format": self.storage_format,
                    "block_bytes": self.layout.block_bytes,
                    "fingerprint": self.layout.fingerprint.hex(),
                    "layout": None
                    if self.layout.description is None
                    else dict(self.layout.description),
                    "created_by": self.created_by,
                },
                indent=1,
                sort_keys=True,
            )
            + "\n"
        )

    @classmethod
    def from_json(cls, raw: bytes) -> TierMarker | None:
        """The marker in ``raw``, or None if it is not a valid marker (damaged)."""
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("marker") != _MARKER_KIND:
                return None
            layout = data.get("layout")
            block_bytes = data["block_bytes"]
            fingerprint = bytes.fromhex(data["fingerprint"])
            backend, storage_format = data["backend"], data["storage_format"]
        except (ValueError, KeyError, TypeError):
            return None
        if (
            not isinstance(block_bytes, int)
            or not isinstance(backend, str)
            or not isinstance(storage_format, str)
            or (layout is not None and not isinstance(layout, dict))
        ):
            return None
        created_by = data.get("created_by")
        return cls(
            backend,
            storage_format,
            LayoutRecord(block_bytes, fingerprint, layout),
            created_by if isinstance(created_by, str) else "",
        )


@functools.cache
def created_by() -> str:
    """``"tiering <version>"``: who wrote a marker, for people reading it."""
    try:
        return f"tiering {importlib.metadata.version('tiering')}"
    except importlib.metadata.PackageNotFoundError:
        return "tiering"


# -- reading a directory (no changes) ------------------------------------------------------------

DirectoryState = Literal["absent", "empty", "marked", "damaged_marker", "legacy", "foreign"]


@dataclass(frozen=True)
class TierDirectory:
    """What :func:`examine_directory` found; reading it changed nothing."""

    path: Path
    state: DirectoryState
    marker: TierMarker | None = None
    foreign: tuple[str, ...] = ()  # entries that are not the backend's (state "foreign")

    #: tiering's files in it besides the marker (its data), by name
    data_files: tuple[str, ...] = ()

    @property
    def usable(self) -> bool:
        """Whether the backend may claim it (it is tiering's, or empty)."""
        return self.state != "foreign"

    @property
    def holds_data(self) -> bool:
        return bool(self.data_files)


def read_marker(directory: Path) -> TierMarker | None:
    """The directory's marker; None if it has none or it is damaged (see ``examine``)."""
    raw = _read_small(directory / MARKER_NAME)
    return None if raw is None else TierMarker.from_json(raw)


def _read_small(path: Path) -> bytes | None:
    """A small regular file's bytes (a symlink is never followed); None if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError:
        return b""  # a symlink, a FIFO we cannot open...: unreadable, so not a valid marker
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return b""
        return os.read(fd, _MARKER_MAX_BYTES + 1)[: _MARKER_MAX_BYTES + 1]
    finally:
        os.close(fd)


def owns(name: str, owned_files: Sequence[str]) -> bool:
    """Whether ``name`` (an entry of a tier directory) is one of tiering's files there."""
    return name == MARKER_NAME or any(
        fnmatch.fnmatchcase(name, pattern) for pattern in (*owned_files, _TMP_PATTERN)
    )


def examine_directory(
    directory: Path,
    *,
    owned_files: Sequence[str],
    recognizes: Callable[[Path], bool] | None = None,
) -> TierDirectory:
    """What ``directory`` is, for a backend whose files match ``owned_files``; reads only.

    ``recognizes(directory)`` says whether a directory without a marker holds files the backend
    itself wrote (an earlier version of tiering wrote no marker): it is then ``"legacy"``.
    Raises :class:`TierDirectoryError` if the path exists and is not a directory.
    """
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        return TierDirectory(directory, "absent")
    except OSError as exc:
        raise TierDirectoryError(f"cannot inspect {str(directory)!r}: {exc}", directory) from exc
    if not stat.S_ISDIR(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
        raise TierDirectoryError(
            f"{str(directory)!r} is {kind}; a tier needs a directory of its own", directory
        )
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise TierDirectoryError(f"cannot list {str(directory)!r}: {exc}", directory) from exc
    if not names:
        return TierDirectory(directory, "empty")
    data_files = tuple(
        name
        for name in names
        if owns(name, owned_files)
        and name != MARKER_NAME
        and not fnmatch.fnmatch(name, _TMP_PATTERN)
    )
    foreign = tuple(name for name in names if not owns(name, owned_files))
    if MARKER_NAME not in names and (foreign or recognizes is None or not recognizes(directory)):
        return TierDirectory(directory, "foreign", foreign=foreign or tuple(names))
    untrusted = _untrusted_entries(directory, [n for n in names if owns(n, owned_files)])
    if untrusted:
        raise _untrusted_entry_error(directory, untrusted)
    if MARKER_NAME in names:
        marker = read_marker(directory)
        state: DirectoryState = "marked" if marker else "damaged_marker"
        return TierDirectory(directory, state, marker, data_files=data_files)
    return TierDirectory(directory, "legacy", data_files=data_files)


def _untrusted_entries(directory: Path, names: Sequence[str]) -> dict[str, str]:
    """Those of ``names`` that are not regular files, with what each is instead."""
    found: dict[str, str] = {}
    for name in names:
        try:
            mode = os.lstat(directory / name).st_mode
        except FileNotFoundError:
            continue  # gone meanwhile
        except OSError as exc:
            raise TierDirectoryError(
                f"cannot inspect {str(directory / name)!r}: {exc}", directory
            ) from exc
        if stat.S_ISREG(mode):
            continue
        if stat.S_ISLNK(mode):
            found[name] = "a symlink"
        elif stat.S_ISDIR(mode):
            found[name] = "a directory"
        else:
            found[name] = "a special file"
    return found


def _untrusted_entry_error(directory: Path, untrusted: Mapping[str, str]) -> UntrustedEntryError:
    named = [f"{name!r} ({kind})" for name, kind in untrusted.items()]
    shown = ", ".join(named[:_SHOWN_FOREIGN])
    if len(named) > _SHOWN_FOREIGN:
        shown += f" and {len(named) - _SHOWN_FOREIGN} more"
    one = len(named) == 1
    return UntrustedEntryError(
        f"refusing {str(directory)!r}: {shown} {'is' if one else 'are'} named like tiering's "
        f"own file{'' if one else 's'} but {'is' if one else 'are'} not a regular file, so "
        f"tiering did not make {'it' if one else 'them'}; tiering neither follows nor removes "
        f"{'it' if one else 'them'} and changed nothing. Move {'it' if one else 'them'} out of "
        "the directory, or give the tier another directory",
        directory,
        entries=tuple(untrusted),
    )


def check_backend(found: TierDirectory, backend: str) -> None:
    """Raise :class:`TierDirectoryError` if the directory's marker names another backend."""
    if found.marker is not None and found.marker.backend != backend:
        raise TierDirectoryError(
            f"{str(found.path)!r} holds a tier of the {found.marker.backend!r} backend "
            f"({found.marker.storage_format}), not of {backend!r}; nothing was changed. Point "
            "this tier at another directory",
            found.path,
        )


def foreign_directory_error(found: TierDirectory, *, what: str) -> ForeignDirectoryError:
    shown = ", ".join(repr(name) for name in found.foreign[:_SHOWN_FOREIGN])
    more = len(found.foreign) - _SHOWN_FOREIGN
    if more > 0:
        shown += f" and {more} more"
    return ForeignDirectoryError(
        f"refusing {what} {str(found.path)!r}: it is not empty ({shown}) and carries no "
        f"tiering marker ({MARKER_NAME}), so it is not tiering's; tiering never writes into "
        "or deletes from a directory it does not own. Give the tier an empty or new directory",
        found.path,
    )


# -- changing a directory --------------------------------------------------------------------


def claim_directory(
    directory: Path,
    marker: TierMarker,
    *,
    owned_files: Sequence[str],
    recognizes: Callable[[Path], bool] | None = None,
    what: str = "the directory",
) -> TierDirectory:
    """Create ``directory`` (mode 0700) or check that it is tiering's; returns what was found.

    An absent or empty directory gets ``marker``; a legacy one gets it too. A marked directory
    keeps its marker (its layout is the backend's to compare, then :func:`write_marker`).
    Raises :class:`ForeignDirectoryError` (nothing changed) for a directory that is not
    tiering's.
    """
    found = examine_directory(directory, owned_files=owned_files, recognizes=recognizes)
    if found.state == "foreign":
        raise foreign_directory_error(found, what=what)
    check_backend(found, marker.backend)
    if found.state == "absent":
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise TierDirectoryError(
                f"cannot create {what} {str(directory)!r}: {exc}", directory
            ) from exc
        # Another process may have filled it meanwhile: look again.
        found = examine_directory(directory, owned_files=owned_files, recognizes=recognizes)
        if found.state == "foreign":
            raise foreign_directory_error(found, what=what)
    if found.state in ("absent", "empty", "legacy"):
        write_marker(directory, marker)
    return found


def write_marker(directory: Path, marker: TierMarker) -> None:
    """Replace the directory's marker atomically (temp file, fsync, rename, fsync dir)."""
    if read_marker(directory) == marker:
        return
    tmp = directory / f"{MARKER_NAME}.{secrets.token_hex(8)}.tmp"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, 0o600)
        try:
            os.write(fd, marker.to_json().encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, directory / MARKER_NAME)
        _fsync_directory(directory)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise TierDirectoryError(
            f"cannot write {MARKER_NAME} in {str(directory)!r}: {exc}", directory
        ) from exc


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Removal:
    """What :func:`remove_owned_files` did."""

    removed: tuple[str, ...]
    kept: tuple[str, ...]  # entries that are not tiering's: left in place
    directory_removed: bool


def remove_owned_files(
    directory: Path,
    *,
    backend: str,
    owned_files: Sequence[str],
    recognizes: Callable[[Path], bool] | None = None,
) -> Removal:
    """Delete tiering's own files from ``directory`` (the marker last), then the directory
    itself if that left it empty. Entries that are not tiering's are kept.

    A directory that is not tiering's (see :func:`examine_directory`) or whose marker names
    another backend than ``backend`` is not touched: :class:`TierDirectoryError`.
    """
    found = examine_directory(directory, owned_files=owned_files, recognizes=recognizes)
    if found.state == "absent":
        return Removal((), (), False)
    if found.state == "foreign":
        raise foreign_directory_error(found, what="the tier directory")
    check_backend(found, backend)
    names = sorted(os.listdir(directory))
    mine = [n for n in names if owns(n, owned_files) and n != MARKER_NAME]
    kept = tuple(n for n in names if not owns(n, owned_files))
    # With an operator's files left in it, the directory stays tiering's (marked), and empty
    # of data: the tier can use it again.
    marker = [MARKER_NAME] if MARKER_NAME in names and not kept else []
    removed = []
    for name in [*mine, *marker]:
        path = directory / name
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.lstat(path).st_mode):
                # Planted after the look above: not tiering's file after all
                kept += (name,)
                continue
            os.unlink(path)
            removed.append(name)
    directory_removed = False
    if not kept:
        with contextlib.suppress(OSError):  # not empty after all (a file appeared): keep it
            os.rmdir(directory)
            directory_removed = True
    return Removal(tuple(removed), kept, directory_removed)


def set_aside(directory: Path, *, owned_files: Sequence[str]) -> Path:
    """Move tiering's files out of ``directory`` into a new sibling folder, and return it.

    The folder is ``<name>.mismatch-<UTC time>`` (a counter is added if it exists). Nothing is
    deleted or copied: files are renamed, so the sibling must be on the same file system.
    Raises :class:`TierDirectoryError` (nothing moved) if it cannot be.
    """
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    parent = directory.parent
    try:
        if os.stat(parent).st_dev != os.stat(directory).st_dev:
            raise TierDirectoryError(
                f"cannot set {str(directory)!r} aside: it is a mount point, so its files cannot "
                "be moved (renamed) into a sibling folder; move them yourself or set "
                "on_layout_mismatch: wipe",
                directory,
            )
        target = parent / f"{directory.name}.mismatch-{stamp}"
        for attempt in range(1, 1000):
            try:
                os.mkdir(target, 0o700)
                break
            except FileExistsError:
                target = parent / f"{directory.name}.mismatch-{stamp}-{attempt}"
        names = [n for n in sorted(os.listdir(directory)) if owns(n, owned_files)]
        moved: list[str] = []
        try:
            for name in names:
                os.rename(directory / name, target / name)
                moved.append(name)
        except OSError:
            for name in moved:  # put back what moved: the directory stays as it was
                with contextlib.suppress(OSError):
                    os.rename(target / name, directory / name)
            with contextlib.suppress(OSError):
                os.rmdir(target)
            raise
        _fsync_directory(target)
        _fsync_directory(directory)
    except TierDirectoryError:
        raise
    except OSError as exc:
        raise TierDirectoryError(
            f"cannot set the files of {str(directory)!r} aside in {str(parent)!r}: {exc}",
            directory,
        ) from exc
    return target
