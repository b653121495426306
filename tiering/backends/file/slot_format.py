"""The slot file's format: the geometry of a slot and what its header area holds.

Layout
    The backend owns a directory (mode 0700) holding ``slots.bin``, ``manifest.json`` and
    tiering's marker (:mod:`tiering.backends.ownership`): it claims only an absent or empty
    directory, or one that carries the marker, and refuses any other.
    ``slots.bin`` is ``capacity_blocks`` slots of ``slot_bytes`` each, preallocated with
    ``posix_fallocate`` so that writes into it cannot run out of space. A slot is a 4096-byte
    *header area* followed by the payload rounded up to 4096 bytes (so every slot, header and
    payload is aligned for ``O_DIRECT``). The header area holds the block header of
    :mod:`tiering.core.block_format` (128 bytes) and, right after it, a 16-byte *stamp*
    (a u64 sequence number and an xxh3-64 of header + sequence number); the rest is zero.
    Keys only ever live in headers: a slot is a number, so a hostile key never reaches the file
    system. ``manifest.json`` records the format version, slot size, block size, layout
    fingerprint and capacity (:mod:`tiering.backends.file.manifest`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from tiering.core.block_format import HEADER_BYTES
from tiering.errors import CorruptBlockError

ALIGN_BYTES = 4096  # O_DIRECT alignment of addresses, lengths and offsets
HEADER_AREA_BYTES = 4096  # the block header + stamp, padded to the alignment
SLOTS_NAME = "slots.bin"
MANIFEST_NAME = "manifest.json"
SLOT_FORMAT_VERSION = 1
STAMP = struct.Struct("<QQ")  # sequence number, xxh3-64(header + sequence number)
STAMP_END = HEADER_BYTES + STAMP.size
_SEQ = struct.Struct("<Q")


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def slot_bytes_for(block_bytes: int) -> int:
    """The bytes one slot of ``block_bytes`` takes in the slot file (header area included)."""
    return HEADER_AREA_BYTES + round_up(block_bytes, ALIGN_BYTES)


@dataclass(frozen=True, slots=True)
class SlotGeometry:
    """Where a block's bytes sit in its slot: the header area, then the payload, then a pad up
    to the next 4096-byte boundary (the next slot's header area)."""

    block_bytes: int
    slot_bytes: int
    payload_area_bytes: int  # the payload and its pad
    pad_bytes: int  # between payload and next slot

    @classmethod
    def for_block(cls, block_bytes: int) -> SlotGeometry:
        slot_bytes = slot_bytes_for(block_bytes)
        payload_area_bytes = slot_bytes - HEADER_AREA_BYTES
        return cls(block_bytes, slot_bytes, payload_area_bytes, payload_area_bytes - block_bytes)


def stamp(header: bytes, seq: int) -> bytes:
    """The stamp that follows ``header`` in a slot written with sequence number ``seq``."""
    return STAMP.pack(seq, xxhash.xxh3_64_intdigest(header + _SEQ.pack(seq)))


def read_stamp(area: memoryview) -> int:
    """The sequence number of a header area whose block header parsed; raises if it is bad."""
    seq, check = STAMP.unpack_from(area, HEADER_BYTES)
    if xxhash.xxh3_64_intdigest(bytes(area[:HEADER_BYTES]) + _SEQ.pack(seq)) != check:
        raise CorruptBlockError("slot stamp checksum mismatch")
    return int(seq)
