"""An in-memory backend: not persistent, for tests, demos and as the smallest plugin example.

It keeps verified bytes like the disk backends do (header + payload per block), so the whole
contract, checksums included, holds; its "I/O" is a memcpy on the caller's loop. A copy is too
short to need a thread, but a batch of many large blocks is not: a call yields to the loop after
every ``YIELD_EVERY_BYTES`` it copies, so the loop keeps running other tasks (and a cancellation
lands between two whole blocks, never inside one).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from tiering.backends.base import BackendCapabilities, Outcome, StorageBackend
from tiering.core.block_format import HEADER_BYTES, pack_header, unpack_header, verify_block
from tiering.core.keys import check_keys
from tiering.errors import BackendError, CorruptBlockError

__all__ = ["YIELD_EVERY_BYTES", "MemoryBackend"]

#: A put or get yields to the event loop after copying this many bytes.
YIELD_EVERY_BYTES = 1 << 20


class MemoryBackend(StorageBackend):
    """Blocks in a dict, bounded by ``capacity_bytes`` (header included)."""

    name = "memory"

    def __init__(self, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes) -> None:
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint)
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self._capacity_bytes = capacity_bytes
        self._blocks: dict[bytes, bytearray] = {}
        self._open = False

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            persistent=False, supports_delete=True, max_value_bytes=self.block_bytes
        )

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def capacity_blocks(self) -> int:
        return self._capacity_bytes // (HEADER_BYTES + self.block_bytes)

    @property
    def usage_bytes(self) -> int:
        return len(self._blocks) * (HEADER_BYTES + self.block_bytes)

    @property
    def is_open(self) -> bool:
        return self._open

    async def open(self) -> list[bytes]:
        self._open = True
        return []

    async def close(self) -> None:
        self._open = False
        self._blocks.clear()

    def _check(self, keys: Sequence[bytes]) -> list[bytes]:
        if not self._open:
            raise BackendError(f"{self.name} backend is not open")
        return list(check_keys(keys))

    def _check_buffers(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> None:
        if len(buffers) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(buffers)} buffers")
        for i, buf in enumerate(buffers):
            if memoryview(buf).nbytes != self.block_bytes:
                raise ValueError(
                    f"buffer {i} is {memoryview(buf).nbytes} bytes, blocks are {self.block_bytes}"
                )

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        key_list = self._check(keys)
        self._check_buffers(key_list, values)
        outcomes = []
        copied = 0
        for key, value in zip(key_list, values, strict=True):
            if copied >= YIELD_EVERY_BYTES:
                copied = 0
                await asyncio.sleep(0)
            if key not in self._blocks and len(self._blocks) >= self.capacity_blocks:
                outcomes.append(Outcome.FULL)
                continue
            self._blocks[key] = bytearray(pack_header(key, value, self.fingerprint)) + value
            copied += self.block_bytes
            self.stats.puts += 1
            self.stats.bytes_written += self.block_bytes
            outcomes.append(Outcome.OK)
        return outcomes

    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        key_list = self._check(keys)
        self._check_buffers(key_list, buffers)
        outcomes = []
        copied = 0
        for key, buf in zip(key_list, buffers, strict=True):
            if copied >= YIELD_EVERY_BYTES:
                copied = 0
                await asyncio.sleep(0)
            self.stats.gets += 1
            stored = self._blocks.get(key)
            if stored is None:
                self.stats.misses += 1
                outcomes.append(Outcome.MISSING)
                continue
            payload = memoryview(stored)[HEADER_BYTES:]
            try:
                header = unpack_header(stored)
                verify_block(
                    header, payload, expected_key=key, expected_fingerprint=self.fingerprint
                )
            except CorruptBlockError:
                self.stats.corrupt += 1
                del self._blocks[key]
                outcomes.append(Outcome.CORRUPT)
                continue
            memoryview(buf).cast("B")[:] = payload
            copied += self.block_bytes
            self.stats.hits += 1
            self.stats.bytes_read += self.block_bytes
            outcomes.append(Outcome.OK)
        return outcomes

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [k in self._blocks for k in self._check(keys)]

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        out = [self._blocks.pop(k, None) is not None for k in self._check(keys)]
        self.stats.deletes += sum(out)
        return out

    def corrupt(self, key: bytes, offset: int) -> None:
        """Flip one bit of a stored block (header or payload): for tests of verification."""
        self._blocks[key][offset] ^= 0x01
