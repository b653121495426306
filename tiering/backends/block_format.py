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
SHA-256 chained hashes (see ``tiering.hashing``), and the header repeats the full key, so a block
read for key A that holds key B's bytes is rejected.
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
    "HEADER_BYTES",
    "MAGIC",
    "MAX_KEY_BYTES",
    "BlockHeader",
    "checksum",
    "checksum_in_parts",
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
