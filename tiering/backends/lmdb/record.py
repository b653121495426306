"""The record format: what one stored value is, how the writer builds it, and how it is checked.

A block is stored as one LMDB value: the ``block_format`` header (its own checksum, the key it
belongs to, the layout fingerprint, the payload size and the payload checksum) followed by the
payload, ``HEADER_BYTES + block_bytes`` in all. The writer builds a value in its scratch buffer
(payload copied in, header packed over the copy) and hands it to ``txn.put``: py-lmdb has no
``MDB_RESERVE``, and the extra in-cache copy costs less than the measurement noise of LMDB's own
write path (puts run at parity with raw py-lmdb puts of the bare payload;
``benchmarks/bench_lmdb_tier.py``). A get checks the header first, then copies the payload once,
straight from the map into the caller's buffer, computing its checksum over that buffer as it
is filled (:func:`copy_and_checksum`; both steps release the GIL).

The ``meta`` database records the layout the blocks were written for: the block format version
(2 bytes), ``block_bytes`` (8) and the fingerprint (16), little-endian
(:meth:`RecordFormat.layout_record`).
"""

from __future__ import annotations

from typing import Final

import numpy as np
import xxhash

from tiering.core.block_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    checksum,
    unpack_header,
    verify_block,
)
from tiering.core.block_format import pack_header as _pack_header
from tiering.errors import CorruptBlockError

__all__ = ["RecordFormat", "copy_and_checksum"]

_FUSED_CHUNK_BYTES: Final = 512 << 10  # a chunk the read path copies, then hashes from L2


def copy_and_checksum(dst: memoryview, src: memoryview) -> int:
    """Copy ``src`` into ``dst`` and return ``block_format.checksum`` of the copy.

    Copies and hashes ``_FUSED_CHUNK_BYTES`` at a time, so that the hash reads each chunk from
    the CPU cache the copy just wrote it to instead of from memory (xxh3 streamed in chunks gives
    the one-shot digest). Both steps release the GIL.
    """
    dst_array = np.frombuffer(dst, np.uint8)
    src_array = np.frombuffer(src, np.uint8)
    size = dst.nbytes
    if size <= _FUSED_CHUNK_BYTES:
        np.copyto(dst_array, src_array)
        return checksum(dst)
    state = xxhash.xxh3_64()
    for start in range(0, size, _FUSED_CHUNK_BYTES):
        stop = start + _FUSED_CHUNK_BYTES
        np.copyto(dst_array[start:stop], src_array[start:stop])
        state.update(dst[start:stop])
    return state.intdigest()


class RecordFormat:
    """The values of one tier (its block size and layout fingerprint): built in the writer's
    scratch buffer, checked against the key they are stored under."""

    __slots__ = ("_scratch", "_scratch_payload", "block_bytes", "fingerprint", "value_bytes")

    def __init__(self, *, block_bytes: int, fingerprint: bytes) -> None:
        self.block_bytes = block_bytes
        self.fingerprint = fingerprint
        self.value_bytes = HEADER_BYTES + block_bytes
        # The writer's value buffer (header + payload), and a numpy view of its payload part.
        self._scratch = bytearray()
        self._scratch_payload = np.empty(0, np.uint8)

    def allocate(self) -> None:
        """Allocate the writer's scratch buffer (at open, on the writer thread)."""
        self._scratch = bytearray(self.value_bytes)
        self._scratch_payload = np.frombuffer(self._scratch, np.uint8, offset=HEADER_BYTES)

    def encode(self, key: bytes, value: memoryview) -> memoryview:
        """Header + payload in the writer's scratch buffer (one copy; LMDB copies it once more)."""
        np.copyto(self._scratch_payload, np.frombuffer(value, np.uint8))  # releases the GIL
        # The checksum covers the copy, so what is stored is self-consistent even if the caller
        # breaks the contract and changes its buffer during the put.
        view = memoryview(self._scratch)
        view[:HEADER_BYTES] = _pack_header(key, view[HEADER_BYTES:], self.fingerprint)
        return view

    def verifies(self, key: bytes, raw: memoryview, *, verify_payload: bool) -> bool:
        """Whether ``raw``, stored under ``key``, is a value of this tier (its header checks
        out; with ``verify_payload``, its payload checksum too)."""
        if len(raw) != self.value_bytes:
            return False
        try:
            header = unpack_header(raw)
            if verify_payload:
                verify_block(
                    header,
                    raw[HEADER_BYTES:],
                    expected_key=key,
                    expected_fingerprint=self.fingerprint,
                )
        except CorruptBlockError:
            return False
        return (
            header.key == key
            and header.fingerprint == self.fingerprint
            and header.payload_bytes == self.block_bytes
        )

    def layout_record(self) -> bytes:
        """The ``meta`` database's record of the layout these values are written for."""
        return (
            FORMAT_VERSION.to_bytes(2, "little")
            + self.block_bytes.to_bytes(8, "little")
            + self.fingerprint
        )
