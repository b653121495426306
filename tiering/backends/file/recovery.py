"""Recovery: rebuilding the file backend's index from the slot file on open (after a crash too).

Recovery
    ``open`` rebuilds the index by reading every slot's header area (``recover="verify"`` also
    reads and checksums every payload; ``"trust_header"`` checks header, key, fingerprint,
    stamp and that the file holds the whole payload, leaving payload checks to ``get``;
    ``"wipe"`` starts empty). A slot that cannot be read (EIO) is skipped, not zeroed: an I/O
    error is no proof of damage, and a later open may recover it. Every slot that held
    something and is not recovered is counted: rejected (its header, stamp or payload does not
    verify, or it is not zero and has no header), unreadable, missing from a truncated file, or
    past the capacity (a capacity change keeps the entries of the slots that still fit). If
    the manifest (or, without one, the marker) names another block size, fingerprint or slot
    format, the data are another layout's: the open is refused (``on_layout_mismatch``), or
    they are set aside or wiped as configured, never emptied silently. A missing or damaged
    manifest costs a full verification of every slot (``manifest_damaged``), not the data.
    When one key is found in two slots (a crash
    between writing a new slot and invalidating the old one), the copy with the highest
    sequence number that verifies is kept: newer wins, and a torn newer copy (an
    unacknowledged put) falls back to the older, acknowledged one. Losing copies and rejected
    headers are zeroed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tiering.backends.file.buffers import Scratch
from tiering.backends.file.manifest import Manifest
from tiering.backends.file.slot_format import HEADER_AREA_BYTES, read_stamp
from tiering.backends.file.slot_index import Entry, SlotIndex
from tiering.backends.file.slot_io import SlotIO
from tiering.backends.file.workers import IoWorkers
from tiering.core.block_format import HEADER_BYTES, MAGIC, unpack_header, verify_block
from tiering.errors import CorruptBlockError

# One logger for the whole backend, named as before it became a package.
logger = logging.getLogger("tiering.backends.file")

_SCAN_SLOTS_PER_TASK = 256


@dataclass(slots=True)
class Found:
    slot: int
    key: bytes
    seq: int


@dataclass(slots=True)
class ScanResult:
    found: list[Found]
    rejected: list[int]  # slots that held something that did not verify
    read_errors: int
    missing: int = 0  # slots past the end of a truncated file
    over_capacity: int = 0  # used slots past the capacity (dropped)

    @classmethod
    def empty(cls) -> ScanResult:
        return cls([], [], 0)


class SlotScanner:
    """Reads the slot file's slots on the I/O threads and says what each one holds."""

    __slots__ = ("_io", "_capacity_blocks", "_path")

    def __init__(self, io: SlotIO, capacity_blocks: int, path: Path) -> None:
        self._io = io
        self._capacity_blocks = capacity_blocks
        self._path = path

    async def scan(
        self, workers: IoWorkers, size: int, verify: bool, manifest: Manifest
    ) -> ScanResult:
        """Read every slot's header area (and payload, if ``verify``); count every slot that
        held something and is not recovered: rejected, unreadable, missing from a truncated
        file, or past the capacity."""
        slot_bytes = self._io.slot_bytes
        whole_slots = size // slot_bytes + (size % slot_bytes >= HEADER_AREA_BYTES)
        slots = range(min(self._capacity_blocks, whole_slots))
        beyond = range(self._capacity_blocks, whole_slots)
        chunks = [
            slots[i : i + _SCAN_SLOTS_PER_TASK] for i in range(0, len(slots), _SCAN_SLOTS_PER_TASK)
        ]
        chunks += [
            beyond[i : i + _SCAN_SLOTS_PER_TASK]
            for i in range(0, len(beyond), _SCAN_SLOTS_PER_TASK)
        ]
        parts = await workers.run_tasks(
            [(self._scan_slots, (chunk, size, verify)) for chunk in chunks]
        )
        result = ScanResult.empty()
        for part in parts:
            result.found += part.found
            result.rejected += part.rejected
            result.read_errors += part.read_errors
            result.over_capacity += part.over_capacity
        # Slots the file should hold but does not (it was truncated): whatever they held is lost.
        expected = self._capacity_blocks if size else 0
        stored_capacity = manifest.get("capacity_blocks") if isinstance(manifest, dict) else None
        if isinstance(stored_capacity, int):
            expected = min(self._capacity_blocks, stored_capacity)
        result.missing = max(0, expected - len(slots))
        return result

    def _scan_slots(self, slots: range, size: int, verify: bool) -> ScanResult:
        io = self._io
        scratch = io.scratch()
        result = ScanResult.empty()
        area = scratch.area(0)
        for slot in slots:
            offset = slot * io.slot_bytes
            try:
                if io.pread_all([area], offset) < HEADER_AREA_BYTES:
                    result.missing += 1  # the file ends inside this slot's header
                    continue
                if area == io.zero_area:
                    continue  # never written, or invalidated
                if slot >= self._capacity_blocks:
                    result.over_capacity += 1  # dropped: the capacity no longer covers it
                    continue
                if bytes(area[: len(MAGIC)]) != MAGIC:
                    raise CorruptBlockError("no block header (overwritten)")
                result.found.append(self._check_slot(slot, size, verify, scratch))
            except CorruptBlockError as exc:
                logger.info("file backend %s: slot %d rejected: %s", self._path, slot, exc)
                result.rejected.append(slot)
            except OSError as exc:
                logger.warning("file backend %s: slot %d unreadable: %s", self._path, slot, exc)
                result.read_errors += 1
        return result

    def _check_slot(self, slot: int, size: int, verify: bool, scratch: Scratch) -> Found:
        io = self._io
        header = unpack_header(scratch.area(0)[:HEADER_BYTES])
        seq = read_stamp(scratch.area(0))
        if header.fingerprint != io.fingerprint:
            raise CorruptBlockError("block was written for another layout (fingerprint)")
        if header.payload_bytes != io.block_bytes:
            raise CorruptBlockError(f"payload is {header.payload_bytes} bytes")
        offset = slot * io.slot_bytes + HEADER_AREA_BYTES
        if size < offset + io.block_bytes:
            raise CorruptBlockError("payload truncated")
        if verify:
            payload = scratch.payload(0)
            if io.pread_all([payload], offset) < io.block_bytes:
                raise CorruptBlockError("payload truncated")
            verify_block(
                header,
                payload[: io.block_bytes],
                expected_key=header.key,
                expected_fingerprint=io.fingerprint,
            )
        return Found(slot, header.key, seq)


def rebuild_index(
    index: SlotIndex, scan: ScanResult, n_slots: int, extra: dict[str, int], path: Path
) -> list[bytes]:
    """Rebuild ``index`` from ``scan`` (newest copy of each key wins; the losers join
    ``scan.rejected``), count what was lost in ``extra``; return the recovered keys."""
    _count_losses(scan, extra, path)
    best: dict[bytes, Found] = {}
    for found in sorted(scan.found, key=lambda f: (-f.seq, f.slot)):
        if found.key in best:
            scan.rejected.append(found.slot)  # an older (or equal, later) duplicate
            extra["recovery_duplicates"] += 1
        else:
            best[found.key] = found
    entries = {key: Entry(f.slot, f.seq) for key, f in best.items()}
    index.rebuild(entries, n_slots, max((f.seq for f in scan.found), default=0))
    return list(best)


def _count_losses(scan: ScanResult, extra: dict[str, int], path: Path) -> None:
    extra["recovery_rejected"] += len(scan.rejected)
    extra["recovery_read_errors"] += scan.read_errors
    extra["recovery_missing_slots"] += scan.missing
    extra["recovery_over_capacity"] += scan.over_capacity
    lost = len(scan.rejected) + scan.read_errors + scan.missing + scan.over_capacity
    if lost:
        logger.warning(
            "file backend %s: %d slot(s) lost at open: %d did not verify, %d unreadable, "
            "%d missing from a truncated file, %d past the capacity",
            path,
            lost,
            len(scan.rejected),
            scan.read_errors,
            scan.missing,
            scan.over_capacity,
        )
