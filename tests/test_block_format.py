"""The on-disk block header: round trips, and every kind of damage is caught with its reason."""

from __future__ import annotations

import re
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.core.block_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    MAX_KEY_BYTES,
    BlockHeader,
    checksum,
    checksum_in_parts,
    make_layout_fingerprint,
    pack_header,
    unpack_header,
    verify_block,
)
from tiering.errors import CorruptBlockError, InvalidKeyError

FINGERPRINT = b"layout-16-bytes!"
KEY = bytes(range(32)) + b"\0\0\0\1"
PAYLOAD = bytes(range(256)) * 17


def test_round_trip_and_verification() -> None:
    header_bytes = pack_header(KEY, PAYLOAD, FINGERPRINT)
    assert len(header_bytes) == HEADER_BYTES == 128
    assert header_bytes[:4] == MAGIC
    header = unpack_header(header_bytes)
    assert header == BlockHeader(KEY, len(PAYLOAD), FINGERPRINT, checksum(PAYLOAD))
    verify_block(header, PAYLOAD, expected_key=KEY, expected_fingerprint=FINGERPRINT)


@settings(max_examples=200, deadline=None)
@given(
    key=st.binary(min_size=1, max_size=MAX_KEY_BYTES),
    payload=st.binary(max_size=4096),
    fingerprint=st.binary(min_size=16, max_size=16),
)
def test_every_header_round_trips(key: bytes, payload: bytes, fingerprint: bytes) -> None:
    header = unpack_header(memoryview(pack_header(key, payload, fingerprint) + b"payload after"))
    assert header == BlockHeader(key, len(payload), fingerprint, checksum(payload))
    verify_block(header, payload, expected_key=key, expected_fingerprint=fingerprint)


@settings(max_examples=300, deadline=None)
@given(bit=st.integers(min_value=0, max_value=HEADER_BYTES * 8 - 1))
def test_any_bit_flip_in_the_header_is_caught(bit: int) -> None:
    """Every field, the key's zero padding included, is covered by the header's checksum."""
    damaged = bytearray(pack_header(KEY, PAYLOAD, FINGERPRINT))
    damaged[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptBlockError):
        header = unpack_header(damaged)
        verify_block(header, PAYLOAD, expected_key=KEY, expected_fingerprint=FINGERPRINT)


@settings(max_examples=100, deadline=None)
@given(bit=st.integers(min_value=0, max_value=len(PAYLOAD) * 8 - 1))
def test_any_bit_flip_in_the_payload_is_caught(bit: int) -> None:
    header = unpack_header(pack_header(KEY, PAYLOAD, FINGERPRINT))
    damaged = bytearray(PAYLOAD)
    damaged[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptBlockError, match="^payload checksum mismatch$"):
        verify_block(header, damaged, expected_key=KEY, expected_fingerprint=FINGERPRINT)


def _reseal(raw: bytearray) -> bytes:
    """Recompute the header checksum over a deliberately edited header."""
    own = xxhash.xxh3_64_intdigest(bytes(raw[:40]) + bytes(raw[48:]))
    raw[40:48] = struct.pack("<Q", own)
    return bytes(raw)


@pytest.mark.parametrize(
    ("offset", "value", "message"),
    [
        (0, b"XKVB", "bad magic b'XKVB', expected b'TKVB'"),
        (4, struct.pack("<H", 2), f"format version 2, this build reads {FORMAT_VERSION}"),
        (6, struct.pack("<H", 0), f"key length 0 out of range 1..{MAX_KEY_BYTES}"),
        (6, struct.pack("<H", 81), f"key length 81 out of range 1..{MAX_KEY_BYTES}"),
        (40, b"\0" * 8, "header checksum mismatch"),
    ],
)
def test_each_header_defect_is_named(offset: int, value: bytes, message: str) -> None:
    raw = bytearray(pack_header(KEY, PAYLOAD, FINGERPRINT))
    raw[offset : offset + len(value)] = value
    edited = bytes(raw) if offset == 40 else _reseal(raw)
    with pytest.raises(CorruptBlockError, match=f"^{re.escape(message)}$"):
        unpack_header(edited)


def test_a_truncated_header_is_named() -> None:
    with pytest.raises(CorruptBlockError, match=r"^header truncated: 127 of 128 bytes$"):
        unpack_header(pack_header(KEY, PAYLOAD, FINGERPRINT)[:127])


def test_another_keys_block_another_layout_or_size_is_rejected() -> None:
    header = unpack_header(pack_header(KEY, PAYLOAD, FINGERPRINT))
    other_key = b"\xff" * 36
    with pytest.raises(
        CorruptBlockError, match=f"^block holds key {KEY.hex()}, expected {other_key.hex()}$"
    ):
        verify_block(header, PAYLOAD, expected_key=other_key, expected_fingerprint=FINGERPRINT)
    with pytest.raises(CorruptBlockError, match=r"another layout \(fingerprint mismatch\)"):
        verify_block(header, PAYLOAD, expected_key=KEY, expected_fingerprint=b"x" * 16)
    with pytest.raises(CorruptBlockError, match=f"^payload is {len(PAYLOAD)} bytes, expected 8$"):
        verify_block(header, PAYLOAD[:8], expected_key=KEY, expected_fingerprint=FINGERPRINT)


@pytest.mark.parametrize("key", [b"", b"k" * (MAX_KEY_BYTES + 1)])
def test_keys_that_do_not_fit_are_refused_when_packing(key: bytes) -> None:
    with pytest.raises(InvalidKeyError, match=f"1..{MAX_KEY_BYTES} bytes, got {len(key)} bytes"):
        pack_header(key, PAYLOAD, FINGERPRINT)


def test_a_fingerprint_of_another_size_is_refused() -> None:
    with pytest.raises(ValueError, match="fingerprint must be 16 bytes, got 3"):
        pack_header(KEY, PAYLOAD, b"abc")


def test_layout_fingerprints_are_stable_and_order_free() -> None:
    first = make_layout_fingerprint({"block_bytes": 4096, "dtype": "bfloat16", "groups": [1, 2]})
    again = make_layout_fingerprint({"groups": [1, 2], "dtype": "bfloat16", "block_bytes": 4096})
    other = make_layout_fingerprint({"groups": [1, 2], "dtype": "float16", "block_bytes": 4096})
    assert first == again != other and len(first) == 16


@pytest.mark.parametrize("cuts", [[], [0], [1], [100, 4096], [1 << 20], [5, 6, 7, 8]])
def test_a_checksum_in_parts_is_the_checksum_of_the_whole(cuts: list[int]) -> None:
    payload = bytes(range(256)) * 5000
    running = checksum_in_parts()
    for start, stop in zip([0, *cuts], [*cuts, len(payload)], strict=True):
        running.update(memoryview(payload)[start:stop])
    assert running.intdigest() == checksum(payload)


def test_verify_block_compares_a_checksum_given_instead_of_computing_it() -> None:
    payload = b"\x01" * 64
    header = unpack_header(pack_header(b"key-1", payload, b"f" * 16))
    verify_block(header, payload, expected_key=b"key-1", expected_fingerprint=b"f" * 16)
    with pytest.raises(CorruptBlockError, match="checksum"):
        verify_block(
            header,
            payload,
            expected_key=b"key-1",
            expected_fingerprint=b"f" * 16,
            payload_checksum=checksum(payload) ^ 1,
        )
