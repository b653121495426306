"""The slot file's manifest: ``manifest.json`` records the format version, slot size, block size,
layout fingerprint and capacity; it is replaced atomically (temp file, fsync, rename, fsync dir).

On open it tells which layout the stored blocks were written for (else the directory's marker
does, :mod:`tiering.backends.ownership`), and how many slots the file should hold. A missing or
damaged manifest costs a full verification of every slot, not the data. It is never followed
through a symlink, and never trusted beyond 64 KiB.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import aiofiles
import aiofiles.os

from tiering.backends.file.slot_format import HEADER_AREA_BYTES, MANIFEST_NAME, SLOT_FORMAT_VERSION
from tiering.backends.file.workers import IoWorkers
from tiering.backends.ownership import LayoutRecord, TierDirectory
from tiering.errors import BackendError

# One logger for the whole backend, named as before it became a package.
logger = logging.getLogger("tiering.backends.file")

MANIFEST_FORMAT = "tiering-file-backend"
_MANIFEST_MAX_BYTES = 64 * 1024
TMP_PREFIX = MANIFEST_NAME + "."  # a manifest being written: TMP_PREFIX + random + TMP_SUFFIX
TMP_SUFFIX = ".tmp"

# A parsed manifest; None: there is none; "damaged": there is one, but not one we wrote.
Manifest = dict[str, object] | Literal["damaged"] | None


def nofollow_opener(extra_flags: int) -> Callable[[str, int], int]:
    def opener(path: str, flags: int) -> int:
        return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | extra_flags, 0o600)

    return opener


def has_our_manifest(path: Path) -> bool:
    """A directory of an earlier tiering: its manifest names this backend's format."""
    try:
        with open(path / MANIFEST_NAME, "rb", opener=nofollow_opener(0)) as f:
            manifest = json.loads(f.read(_MANIFEST_MAX_BYTES))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT


def manifest_record(
    *,
    slot_bytes: int,
    block_bytes: int,
    fingerprint: bytes,
    capacity_bytes: int,
    capacity_blocks: int,
) -> dict[str, object]:
    """The manifest of a slot file of this geometry, layout and capacity."""
    return {
        "format": MANIFEST_FORMAT,
        "format_version": SLOT_FORMAT_VERSION,
        "header_area_bytes": HEADER_AREA_BYTES,
        "slot_bytes": slot_bytes,
        "block_bytes": block_bytes,
        "fingerprint": fingerprint.hex(),
        "capacity_bytes": capacity_bytes,
        "capacity_blocks": capacity_blocks,
    }


def stored_layout(manifest: Manifest, found: TierDirectory) -> LayoutRecord | None:
    """The layout the stored blocks were written for, from the manifest, else the marker."""
    marker = found.marker.layout if found.marker is not None else None
    if isinstance(manifest, dict):
        try:
            block_bytes = manifest["block_bytes"]
            fingerprint = bytes.fromhex(str(manifest["fingerprint"]))
        except (KeyError, ValueError):
            return marker
        if not isinstance(block_bytes, int):
            return marker
        described = marker.description if marker is not None else None
        record = LayoutRecord(block_bytes, fingerprint, described)
        if marker is None or not marker.matches(record):
            record = LayoutRecord(block_bytes, fingerprint)
        return record
    return marker


def layout_matches(
    manifest: Manifest,
    on_disk: LayoutRecord,
    configured: LayoutRecord,
    wanted: dict[str, object],
) -> bool:
    """Whether the stored blocks are of the ``configured`` layout, in the slot format of the
    ``wanted`` manifest."""
    if not on_disk.matches(configured):
        return False
    if not isinstance(manifest, dict):
        return True
    layout = ("format", "format_version", "header_area_bytes", "slot_bytes")
    return all(manifest.get(name) == wanted[name] for name in layout)


class ManifestFile:
    """Reads and atomically replaces ``manifest.json`` in ``path``, on the workers' pool."""

    __slots__ = ("_path", "_workers")

    def __init__(self, path: Path, workers: IoWorkers) -> None:
        self._path = path
        self._workers = workers

    async def read(self) -> Manifest:
        """The manifest; None if there is none, "damaged" if it is not one we wrote."""
        try:
            async with aiofiles.open(
                self._path / MANIFEST_NAME,
                "rb",
                opener=nofollow_opener(0),
                executor=self._workers.pool,
            ) as f:
                raw = await f.read(_MANIFEST_MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        except OSError as exc:  # ELOOP: a planted symlink; never followed, never trusted
            logger.warning("file backend %s: unreadable manifest: %s", self._path, exc)
            return "damaged"
        if len(raw) > _MANIFEST_MAX_BYTES:
            return "damaged"
        try:
            manifest = json.loads(raw)
        except ValueError:
            return "damaged"
        if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
            return "damaged"
        return manifest

    async def write(self, wanted: dict[str, object]) -> None:
        """Replace the manifest with ``wanted`` (unless it holds that already)."""
        if await self.read() == wanted:
            return
        text = json.dumps(wanted, indent=1, sort_keys=True) + "\n"
        tmp = self._path / f"{TMP_PREFIX}{secrets.token_hex(8)}{TMP_SUFFIX}"
        pool = self._workers.pool
        try:
            async with aiofiles.open(
                tmp, "w", opener=nofollow_opener(os.O_EXCL), executor=pool
            ) as f:
                await f.write(text)
                await f.flush()
                await self._workers.call(os.fsync, f.fileno())
            await aiofiles.os.replace(tmp, self._path / MANIFEST_NAME, executor=pool)
            await self._workers.call(self._fsync_directory)
        except OSError as exc:
            with contextlib.suppress(OSError):
                await aiofiles.os.unlink(tmp, executor=pool)
            raise BackendError(
                f"cannot write {MANIFEST_NAME} in {str(self._path)!r}: {exc}"
            ) from exc

    def _fsync_directory(self) -> None:
        fd = os.open(self._path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
