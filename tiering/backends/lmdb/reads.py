"""The read path: a get's blocks, read by up to ``read_threads`` threads.

The threads share a get's blocks, each taking the next block not yet taken, in one read
transaction per thread (:func:`tiering.backends.lanes.run_in_lanes`; the thread that finishes
last wakes the event loop, once per get), with ``buffers=True``: the header is checked first,
then the payload is copied once, straight from the map into the caller's buffer, and its
checksum computed over that buffer as it is filled (see
:func:`~tiering.backends.lmdb.record.copy_and_checksum`; both steps release the GIL). A block
that fails a check is ``CORRUPT``; an LMDB error is ``FAILED``.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import lmdb

from tiering.backends.base import Outcome
from tiering.backends.lanes import LaneStep
from tiering.backends.lmdb.environment import LMDBEnvironment
from tiering.backends.lmdb.record import RecordFormat, copy_and_checksum
from tiering.core.block_format import HEADER_BYTES, unpack_header
from tiering.errors import CorruptBlockError

__all__ = ["Reader"]

_log = logging.getLogger(__package__)  # the package's logger, as before the split


class Reader:
    """Reads blocks of one tier into callers' buffers, verifying each on the way."""

    __slots__ = ("_block_bytes", "_environment", "_fingerprint", "_path", "_value_bytes")

    def __init__(self, environment: LMDBEnvironment, record: RecordFormat) -> None:
        self._environment = environment
        self._path = environment.path
        self._value_bytes = record.value_bytes
        self._block_bytes = record.block_bytes
        self._fingerprint = record.fingerprint

    @contextlib.contextmanager
    def lane(
        self, keys: Sequence[bytes], views: list[memoryview], stored: list[int]
    ) -> Iterator[LaneStep[Outcome]]:
        """A read thread's share of a get: item ``j`` reads ``keys[stored[j]]`` into its view,
        all in one read transaction (see :func:`tiering.backends.lanes.run_in_lanes`)."""
        environment = self._environment
        env = environment.env
        assert env is not None
        with environment.gate.reading():
            try:
                txn = environment.begin_read(env)
            except lmdb.Error as exc:
                _log.error("LMDB read transaction failed at %s: %s", self._path, exc)
                yield lambda j: Outcome.FAILED
                return
            with txn:

                def step(j: int) -> Outcome:
                    i = stored[j]
                    try:
                        return self._read_one(txn, keys[i], views[i])
                    except lmdb.Error as exc:
                        _log.error(
                            "LMDB read of %s failed at %s: %s", keys[i].hex(), self._path, exc
                        )
                        return Outcome.FAILED

                yield step

    def _read_one(self, txn: lmdb.Transaction[memoryview], key: bytes, view: memoryview) -> Outcome:
        raw = txn.get(key)
        if raw is None:
            return Outcome.MISSING
        problem = None
        if len(raw) != self._value_bytes:
            problem = f"value is {len(raw)} bytes, expected {self._value_bytes}"
        else:
            try:
                header = unpack_header(raw)
            except CorruptBlockError as exc:
                problem = str(exc)
            else:
                if header.key != key:
                    problem = f"block holds key {header.key.hex()}"
                elif header.fingerprint != self._fingerprint:
                    problem = "block was written for another layout (fingerprint mismatch)"
                elif header.payload_bytes != self._block_bytes:
                    problem = f"header says {header.payload_bytes} payload bytes"
                elif copy_and_checksum(view, raw[HEADER_BYTES:]) != header.payload_checksum:
                    problem = "payload checksum mismatch"
        if problem is not None:
            _log.warning("corrupt LMDB block %s at %s: %s", key.hex(), self._path, problem)
            return Outcome.CORRUPT
        return Outcome.OK
