"""The LMDB backend's collaborators on their own: the disk guard's capacity arithmetic, the
record format, and the checks of settings and buffers. LMDBBackend as a whole is tested in
tests/test_lmdb_backend.py."""

from __future__ import annotations

import asyncio
import threading
import types
from typing import Any, cast

import pytest

from tiering.backends.lmdb.arguments import (
    byte_view,
    check_durability,
    check_recovery,
    check_threads,
)
from tiering.backends.lmdb.geometry import (
    LMDBGeometry,
    blocks_within,
    derive_geometry,
    lmdb_geometry,
)
from tiering.backends.lmdb.record import RecordFormat
from tiering.backends.lmdb.writer import Writer
from tiering.core.block_format import HEADER_BYTES
from tiering.errors import ConfigurationError

FINGERPRINT = b"lmdb-parts-test!"
KEY = b"k" * 36


def _geometry() -> LMDBGeometry:
    return lmdb_geometry(
        block_bytes=4096, capacity_bytes=1 << 20, page_bytes=4096, max_txn_bytes=64 << 20
    )


def test_blocks_within_leaves_room_for_the_tree_and_the_fixed_pages() -> None:
    geometry = _geometry()
    assert (geometry.footprint_bytes, geometry.capacity_blocks) == (8192, 128)
    # 80 fixed pages and 2 x 98-byte leaf nodes per block: 352,768 bytes; the rest in 8 KiB.
    assert blocks_within(geometry, 10 << 20) == 1236
    assert blocks_within(geometry, 352_768 + 8191) == 0
    assert blocks_within(geometry, 352_768 + 8192) == 1
    assert blocks_within(geometry, 100) == 0


def test_derive_geometry_refuses_a_capacity_that_holds_no_block() -> None:
    with pytest.raises(ConfigurationError, match="holds no block"):
        derive_geometry(4096, block_bytes=4096, capacity_bytes=8191, max_txn_bytes=1 << 20)
    assert derive_geometry(
        4096, block_bytes=4096, capacity_bytes=8192, max_txn_bytes=1 << 20
    ) == lmdb_geometry(
        block_bytes=4096, capacity_bytes=8192, page_bytes=4096, max_txn_bytes=1 << 20
    )


def test_a_value_encoded_by_the_record_format_verifies_under_its_key_only() -> None:
    record = RecordFormat(block_bytes=64, fingerprint=FINGERPRINT)
    record.allocate()
    payload = bytes(range(64))
    value = bytes(record.encode(KEY, memoryview(payload)))
    assert len(value) == record.value_bytes == HEADER_BYTES + 64
    assert value[HEADER_BYTES:] == payload
    assert record.verifies(KEY, memoryview(value), verify_payload=True)
    assert not record.verifies(b"x" * 36, memoryview(value), verify_payload=False)
    assert not record.verifies(KEY, memoryview(value[:-1]), verify_payload=False)
    other = RecordFormat(block_bytes=64, fingerprint=b"another-layout!!")
    assert not other.verifies(KEY, memoryview(value), verify_payload=False)


def test_a_damaged_payload_fails_only_the_payload_check() -> None:
    record = RecordFormat(block_bytes=64, fingerprint=FINGERPRINT)
    record.allocate()
    value = bytearray(record.encode(KEY, memoryview(bytes(64))))
    value[-1] ^= 0xFF
    assert record.verifies(KEY, memoryview(value), verify_payload=False)
    assert not record.verifies(KEY, memoryview(value), verify_payload=True)


def test_the_layout_record_is_version_block_bytes_and_fingerprint() -> None:
    record = RecordFormat(block_bytes=0x0102, fingerprint=FINGERPRINT)
    assert record.layout_record() == b"\x01\x00" + b"\x02\x01" + b"\0" * 6 + FINGERPRINT


def test_settings_checks_name_the_bad_setting() -> None:
    assert check_durability(True, False, True, True) == (True, False, True, True)
    with pytest.raises(ConfigurationError, match="map_async=True requires writemap=True"):
        check_durability(True, True, False, True)
    with pytest.raises(ConfigurationError, match="metasync must be a bool"):
        check_durability(True, 1, False, False)
    assert check_threads(2, 2) == (2, 2)
    with pytest.raises(ConfigurationError, match="max_readers=1 is below read_threads=2"):
        check_threads(2, 1)
    assert check_recovery("verify", "wipe", True) == ("verify", "wipe", True)
    with pytest.raises(ConfigurationError, match="recover must be one of"):
        check_recovery("trust", "refuse", False)
    with pytest.raises(ConfigurationError, match="on_layout_mismatch must be one of"):
        check_recovery("verify", "keep", False)


def test_byte_view_flattens_a_buffer_and_refuses_the_wrong_size_or_a_read_only_one() -> None:
    view = byte_view(bytearray(8), 8, "buffer", 0, writable=True)
    assert (view.nbytes, view.format, view.readonly) == (8, "B", False)
    wide = memoryview(bytearray(8)).cast("I")
    assert byte_view(wide, 8, "value", 1, writable=False).format == "B"
    with pytest.raises(ValueError, match="value 3 is 7 bytes; every block is 8 bytes"):
        byte_view(bytes(7), 8, "value", 3, writable=False)
    with pytest.raises(ValueError, match="buffer 2 is read-only"):
        byte_view(bytes(8), 8, "buffer", 2, writable=True)
    with pytest.raises(ValueError, match="buffer 0 must be a buffer"):
        byte_view(object(), 8, "buffer", 0, writable=True)


def test_a_writer_thread_finishing_after_stop_does_not_take_the_next_threads_jobs() -> None:
    """stop() queues STOP behind the item the thread runs; a start() before the thread reads
    again gives the next thread a new queue. The old thread must still find its STOP (else two
    threads would take one queue's jobs, and write transactions from two threads)."""
    environment = cast(Any, types.SimpleNamespace(path="test"))
    writer = Writer(environment, cast(Any, None))
    writer.start()
    old_thread = writer._thread
    assert old_thread is not None
    running, release = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        release.wait()

    held = writer.call(hold)
    running.wait()
    asyncio.run(writer.stop(None))  # STOP queued behind hold()
    writer.start()
    release.set()
    held.future.result()
    old_thread.join(60)  # a liveness bound, not a timing: the thread exits at once when right
    assert not old_thread.is_alive()
    assert (
        writer.call(lambda: threading.current_thread().name).future.result() == "lmdb-writer:test"
    )
    asyncio.run(writer.stop(None))
