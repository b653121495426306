"""The on-disk form of one stored block: a fixed-size header, then the payload.

Every secondary tier writes this header before the payload and verifies it on every read, so a
block that is torn, truncated, bit-flipped, misplaced (another key's bytes) or written for another
model layout is a miss, never a hit.

Header, version 1, little-endian, ``HEADER_BYTES`` long::

    offset size field
    0      4    magic b"TKVB"
    4      2    format version (1)
    6      2    key length in bytes (1..MAX_KEY_BYTES)
    8      8    payload length in bytes
    16     16   layout fingerprint (see make_layout_fingerprint)
    32     8    xxh3-64 of the payload
    40     8    xxh3-64 of bytes 0..40 and of the key field (the header's own checksum)
    48     80   key, zero padded to MAX_KEY_BYTES

xxh3 is not a cryptographic MAC: it detects corruption, not forgery. Keys themselves are
SHA-256 chained hashes (see ``tiering.core.hashing``), and the header repeats the full key, so a
block
read for key A that holds key B's bytes is rejected.

Variable-length blocks (framing ``FRAMING``). A tier's blocks all occupy ``block_bytes`` (its
slot). An embedder (:mod:`tiering.embed`) stores blocks *up to* ``block_bytes - FRAME_BYTES``
long: the payload, zeros, then a 16-byte frame trailer at the slot's end::

    offset from the slot's end   size field
    -16                          4    magic b"TKVF"
    -12                          2    framing version (1)
    -10                          2    reserved, zero
    -8                           8    the block's true length in bytes

The trailer is inside the payload the header's checksum covers, so the length is verified with
the bytes: a read returns the true length or the block is corrupt. Whether a tier's blocks are
framed is part of its layout description (``"block_framing": FRAMING``), hence of its
fingerprint: a tier written without framing (the vLLM pool's rows) and a framed one never read
each other's blocks (the backend refuses the other layout's directory, or the block's
fingerprint does not verify). Header version 1 is unchanged, so every existing tier stays
readable by what wrote it.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from typing import NamedTuple

import xxhash

from tiering.errors import CorruptBlockError, InvalidKeyError

__all__ = [
    "FORMAT_VERSION",
    "FRAME_BYTES",
    "FRAMING",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_KEY_BYTES",
    "BlockHeader",
    "checksum",
    "checksum_in_parts",
    "frame_capacity",
    "read_frame",
    "write_frame",
    "make_layout_fingerprint",
    "pack_header",
    "unpack_header",
    "verify_block",
]

MAGIC = b"TKVB"
FORMAT_VERSION = 1
MAX_KEY_BYTES = 80
FINGERPRINT_BYTES = 16
# magic, version, key length, payload length, fingerprint, payload checksum
_FIXED = struct.Struct("<4sHHQ16sQ")
_HEADER_CHECKSUM = struct.Struct("<Q")
_KEY_OFFSET = _FIXED.size + _HEADER_CHECKSUM.size
HEADER_BYTES = _KEY_OFFSET + MAX_KEY_BYTES  # 128
_PARSE = struct.Struct(_FIXED.format + "Q")  # _FIXED, then the header checksum

FRAMING = "tkvf-1"  # the layout description's "block_framing" for framed tiers
_FRAME_MAGIC = b"TKVF"
_FRAME_VERSION = 1
_FRAME = struct.Struct("<4sHHQ")  # magic, framing version, reserved, true length
FRAME_BYTES = _FRAME.size  # 16


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The payload checksum: xxh3-64 (runs at memory speed, releases no data)."""
    return xxhash.xxh3_64_intdigest(data)


def checksum_in_parts() -> xxhash.xxh3_64:
    """A running :func:`checksum`: ``update`` it with consecutive parts of a payload, in
    order; ``intdigest()`` then equals ``checksum`` of the whole (a reader can checksum each
    part as it arrives, while it is still in the CPU cache)."""
    return xxhash.xxh3_64()


def make_layout_fingerprint(description: Mapping[str, object]) -> bytes:
    """A 16-byte digest of what a block's bytes mean: block bytes, groups, dtypes, world size...

    ``description`` must be JSON-serializable; keys are sorted so that equal descriptions give
    equal fingerprints in every process.
    """
    encoded = json.dumps(description, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(b"tiering-layout-v1\0" + encoded).digest()[:FINGERPRINT_BYTES]


class BlockHeader(NamedTuple):
    """A parsed header (a tuple: read once per block read, so it must be cheap to build)."""

    key: bytes
    payload_bytes: int
    fingerprint: bytes
    payload_checksum: int


def pack_header(key: bytes, payload: bytes | bytearray | memoryview, fingerprint: bytes) -> bytes:
    """The header for ``payload`` stored under ``key``; raises InvalidKeyError for a bad key."""
    if not 0 < len(key) <= MAX_KEY_BYTES:
        raise InvalidKeyError(
            f"a stored key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)} bytes: {key!r:.60}"
        )
    if len(fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
    fixed = _FIXED.pack(
        MAGIC, FORMAT_VERSION, len(key), memoryview(payload).nbytes, fingerprint, checksum(payload)
    )
    padded_key = key.ljust(MAX_KEY_BYTES, b"\0")
    own = xxhash.xxh3_64_intdigest(fixed + padded_key)
    return fixed + _HEADER_CHECKSUM.pack(own) + padded_key


def unpack_header(raw: bytes | bytearray | memoryview) -> BlockHeader:
    """Parse and self-check a header; raises CorruptBlockError saying what is wrong."""
    raw = bytes(raw[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        raise CorruptBlockError(f"header truncated: {len(raw)} of {HEADER_BYTES} bytes")
    magic, version, key_len, payload_len, fingerprint, payload_sum, own = _PARSE.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"format version {version}, this build reads {FORMAT_VERSION}")
    if not 0 < key_len <= MAX_KEY_BYTES:
        raise CorruptBlockError(f"key length {key_len} out of range 1..{MAX_KEY_BYTES}")
    if xxhash.xxh3_64_intdigest(raw[: _FIXED.size] + raw[_KEY_OFFSET:]) != own:
        raise CorruptBlockError("header checksum mismatch")
    key = raw[_KEY_OFFSET : _KEY_OFFSET + key_len]
    return BlockHeader(key, payload_len, fingerprint, payload_sum)


def verify_block(
    header: BlockHeader,
    payload: bytes | bytearray | memoryview,
    *,
    expected_key: bytes,
    expected_fingerprint: bytes,
    payload_checksum: int | None = None,
) -> None:
    """Raise CorruptBlockError unless ``payload`` is ``expected_key``'s block for this layout.

    ``payload_checksum``: the payload's :func:`checksum`, if the caller computed it already
    (:func:`checksum_in_parts`); otherwise it is computed here."""
    if header.key != expected_key:
        raise CorruptBlockError(
            f"block holds key {header.key.hex()}, expected {expected_key.hex()}"
        )
    if header.fingerprint != expected_fingerprint:
        raise CorruptBlockError("block was written for another layout (fingerprint mismatch)")
    size = memoryview(payload).nbytes
    if header.payload_bytes != size:
        raise CorruptBlockError(f"payload is {header.payload_bytes} bytes, expected {size}")
    if payload_checksum is None:
        payload_checksum = checksum(payload)
    if payload_checksum != header.payload_checksum:
        raise CorruptBlockError("payload checksum mismatch")


def frame_capacity(slot_bytes: int) -> int:
    """The longest block a framed slot of ``slot_bytes`` holds."""
    return slot_bytes - FRAME_BYTES


def write_frame(slot: memoryview, length: int) -> None:
    """Frame the first ``length`` bytes of ``slot`` (a writable, flat byte view of the whole
    slot): zero what lies between them and the trailer, then write the trailer."""
    capacity = frame_capacity(slot.nbytes)
    if not 0 <= length <= capacity:
        raise ValueError(f"a block of {length} bytes does not fit a slot of {capacity} bytes")
    slot[length:capacity] = bytes(capacity - length)
    _FRAME.pack_into(slot, capacity, _FRAME_MAGIC, _FRAME_VERSION, 0, length)


def read_frame(slot: bytes | bytearray | memoryview) -> int:
    """The true length of the framed block in ``slot`` (a verified payload); raises
    CorruptBlockError if the trailer is not a valid frame."""
    view = memoryview(slot)
    capacity = frame_capacity(view.nbytes)
    if capacity < 0:
        raise CorruptBlockError(f"a slot of {view.nbytes} bytes holds no frame")
    magic, version, reserved, length = _FRAME.unpack_from(view, capacity)
    if magic != _FRAME_MAGIC:
        raise CorruptBlockError(f"bad frame magic {magic!r}, expected {_FRAME_MAGIC!r}")
    if version != _FRAME_VERSION or reserved:
        raise CorruptBlockError(f"framing version {version}, this build reads {_FRAME_VERSION}")
    if length > capacity:
        raise CorruptBlockError(f"framed length {length} is over the slot's {capacity} bytes")
    return int(length)
