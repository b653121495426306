"""What the file backend's ``open`` does, step by step: claim (or, read-only, examine) the
directory, read the manifest, settle blocks of another layout, open the slot file, scan it (or
wipe it, ``recover="wipe"``), preallocate it, rebuild the index (:mod:`~tiering.backends.file.
recovery`), zero what did not verify, then write the manifest and the marker."""

from __future__ import annotations

import logging
from pathlib import Path

from tiering.backends.file.capacity import SlotCapacity
from tiering.backends.file.directory import SlotDirectory
from tiering.backends.file.manifest import (
    Manifest,
    ManifestFile,
    layout_matches,
    manifest_record,
    stored_layout,
)
from tiering.backends.file.recovery import ScanResult, SlotScanner, rebuild_index
from tiering.backends.file.slot_format import MANIFEST_NAME
from tiering.backends.file.slot_index import SlotIndex
from tiering.backends.file.slot_io import SlotIO
from tiering.backends.file.workers import IoWorkers
from tiering.backends.ownership import TierDirectory
from tiering.backends.settings import RecoverMode

# One logger for the whole backend, named as before it became a package.
logger = logging.getLogger("tiering.backends.file")


class StorageOpener:
    """Opens one backend's storage into its ``io`` (the slot file's fd) and ``index``.

    ``extra`` is the backend's ``stats.extra``.
    """

    def __init__(
        self,
        directory: SlotDirectory,
        io: SlotIO,
        capacity: SlotCapacity,
        index: SlotIndex,
        workers: IoWorkers,
        *,
        recover: RecoverMode,
        read_only: bool,
        extra: dict[str, int],
    ) -> None:
        self._directory = directory
        self._manifest = ManifestFile(directory.path, workers)
        self._scanner = SlotScanner(io, capacity.capacity_blocks, directory.path)
        self._io = io
        self._capacity = capacity
        self._index = index
        self._workers = workers
        self._layout = directory.layout
        # The manifest this backend writes: its slot format, layout and capacity.
        self._wanted = manifest_record(
            slot_bytes=io.slot_bytes,
            block_bytes=io.block_bytes,
            fingerprint=io.fingerprint,
            capacity_bytes=capacity.capacity_bytes,
            capacity_blocks=capacity.capacity_blocks,
        )
        self._recover = recover
        self._read_only = read_only
        self._extra = extra
        self._path: Path = directory.path

    async def open(self, o_direct: bool) -> list[bytes]:
        """Open the storage; return the recovered keys."""
        found = await self._workers.call(self._directory.examine_or_claim)
        if found.state == "absent":  # read-only: nothing was ever stored here
            return self._rebuild_index(ScanResult.empty())
        manifest, verify = await self._examine_stored_blocks(found)
        self._io.fd = await self._directory.open_slot_file(o_direct)
        if self._io.fd < 0:  # read-only, no slot file
            return self._rebuild_index(ScanResult.empty())
        scan = await self._scan_or_wipe(verify, manifest)
        recovered = self._rebuild_index(scan)
        if scan.rejected and not self._read_only:
            await self._zero_rejected(scan.rejected)
        if not self._read_only:
            await self._manifest.write(self._wanted)
            await self._workers.call(self._directory.write_marker)
        return recovered

    async def _examine_stored_blocks(self, found: TierDirectory) -> tuple[Manifest, bool]:
        """The manifest, and whether every slot must be verified; blocks of another layout
        are refused, set aside or wiped first."""
        manifest = await self._manifest.read()
        on_disk = stored_layout(manifest, found)
        data_bytes = await self._workers.call(self._directory.slot_file_bytes)
        if (
            data_bytes
            and on_disk is not None
            and not layout_matches(manifest, on_disk, self._layout, self._wanted)
        ):
            await self._workers.call(self._directory.resolve_mismatch, on_disk)
            manifest, data_bytes = None, 0
        verify = self._recover == "verify"
        if data_bytes and not isinstance(manifest, dict):
            # The manifest is gone or unreadable but the directory is ours: every slot still
            # verifies itself (header, fingerprint, payload checksum), so check each in full.
            self._extra["manifest_damaged"] += 1
            logger.warning(
                "file backend %s: %s is missing or damaged; verifying every slot",
                self._path,
                MANIFEST_NAME,
            )
            verify = True
        return manifest, verify

    async def _scan_or_wipe(self, verify: bool, manifest: Manifest) -> ScanResult:
        """Scan the open slot file (or empty it: ``recover="wipe"``), then preallocate it."""
        call, ops, fd = self._workers.call, self._io.ops, self._io.fd
        size = await call(ops.size, fd)
        scan = ScanResult.empty()
        if self._recover == "wipe":
            if size > 0 and not self._read_only:
                await call(ops.ftruncate, fd, 0)
                await call(ops.fdatasync, fd)
                size = 0
        else:
            scan = await self._scanner.scan(self._workers, size, verify, manifest)
        if not self._read_only:
            await call(self._capacity.preallocate, size)
        return scan

    def _rebuild_index(self, scan: ScanResult) -> list[bytes]:
        n_slots = self._capacity.capacity_blocks
        return rebuild_index(self._index, scan, n_slots, self._extra, self._path)

    async def _zero_rejected(self, rejected: list[int]) -> None:
        """Zero rejected and losing copies so that no later open considers them again."""
        try:
            await self._workers.call(self._io.invalidate_slots, rejected, True)
        except OSError as exc:
            logger.warning("file backend %s: invalidation failed: %s", self._path, exc)
            self._extra["invalidate_failures"] += 1
