"""The Redis backend's collaborators that need no server: the value format and the accounting."""

from __future__ import annotations

import pytest

from tiering.backends.base import BackendStats, Outcome
from tiering.backends.redis.faults import Faults
from tiering.backends.redis.ownership import HeldKeys
from tiering.backends.redis.value_format import TAIL_BYTES, BlockFormat
from tiering.core.block_format import HEADER_BYTES
from tiering.errors import CorruptBlockError

FINGERPRINT = bytes(range(16))
KEY = b"\x01" * 16


def make_format(block_bytes: int = 1024) -> BlockFormat:
    return BlockFormat(namespace=b"t:ab:", block_bytes=block_bytes, fingerprint=FINGERPRINT)


def test_names_and_their_keys() -> None:
    fmt = make_format()
    assert fmt.redis_keys(KEY) == (b"t:ab:{" + b"01" * 16 + b"}:h", b"t:ab:{" + b"01" * 16 + b"}:p")
    assert fmt.offload_key(fmt.redis_keys(KEY)[0]) == KEY
    assert fmt.offload_key(fmt.redis_keys(KEY)[1]) is None  # a payload name
    assert fmt.offload_key(b"other:{" + b"01" * 16 + b"}:h") is None
    assert fmt.header_pattern == b"t:ab:*}:h"


def test_a_block_round_trips_through_its_two_strings() -> None:
    fmt = make_format()
    payload = bytes(i % 251 for i in range(1024))
    header = fmt.header_value(KEY, memoryview(payload))
    assert len(header) == HEADER_BYTES + TAIL_BYTES and header[HEADER_BYTES:] == payload[-64:]
    out = bytearray(1024)
    assert fmt.read_into(KEY, memoryview(out), header, payload[:-64]) is Outcome.OK
    assert out == payload
    assert fmt.read_into(KEY, memoryview(out), header, None) is Outcome.MISSING
    with pytest.raises(CorruptBlockError, match="holds key"):
        fmt.read_into(b"\x02" * 16, memoryview(out), header, payload[:-64])
    with pytest.raises(CorruptBlockError, match="checksum"):
        fmt.read_into(KEY, memoryview(out), header, bytes(960))
    with pytest.raises(CorruptBlockError, match="more than 960"):
        fmt.read_into(KEY, memoryview(out), header, payload[:961])


def test_small_blocks_carry_no_tail() -> None:
    fmt = make_format(block_bytes=4 * TAIL_BYTES - 1)
    assert (fmt.tail_bytes, fmt.header_bytes, fmt.split) == (0, HEADER_BYTES, 255)


def test_held_keys_admit_within_the_budget_and_hold_what_was_written() -> None:
    stats = BackendStats()
    held = HeldKeys(Faults(stats), shared=False, capacity_blocks=2)
    held.keys = {b"a" * 8}
    keys = [b"a" * 8, b"b" * 8, b"c" * 8]
    results = [Outcome.FAILED] * 3
    order, reserved = held.admit(keys, [0, 1, 2], results)
    assert (order, reserved, results[2]) == ([0, 1], 1, Outcome.FULL)
    held.start_writing(keys, order)
    held.forget_vanished([b"a" * 8])  # being written: kept
    assert held.keys == {b"a" * 8}
    results[:2] = [Outcome.OK, Outcome.OK]
    held.finish_writing(keys, order, results, reserved)
    assert held.keys == {b"a" * 8, b"b" * 8}
    held.forget_vanished([b"a" * 8])
    assert held.keys == {b"b" * 8} and stats.extra == {"vanished": 1}


def test_shared_held_keys_keep_nothing_and_refuse_nothing() -> None:
    held = HeldKeys(Faults(BackendStats()), shared=True, capacity_blocks=1)
    keys = [b"a" * 8, b"b" * 8]
    results = [Outcome.FAILED] * 2
    assert held.admit(keys, [0, 1], results) == ([0, 1], 0)
    held.finish_writing(keys, [], [Outcome.OK] * 2, 0)
    assert held.keys == set() and results == [Outcome.FAILED] * 2
