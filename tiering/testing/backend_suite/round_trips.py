"""``BackendTests``, round trips and batch semantics: bit-exact round trips in batches of
several sizes, one result per key in order with mixed hits and misses, missing keys,
put-replaces, delete, contains, and hostile key bytes.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tiering.testing.backend_suite.base import MISSING, OK, BackendTestsBase

__all__ = ["BackendRoundTripTests"]


class BackendRoundTripTests(BackendTestsBase):
    """Round trips and the semantics of a batch."""

    # -- round trips and batch semantics ---------------------------------------------------------

    @pytest.mark.asyncio
    @pytest.mark.parametrize("batch_size", [1, 5, 40])
    async def test_round_trip_bit_exact(self, tmp_path: Path, batch_size: int) -> None:
        keys = self.make_keys(batch_size, tag=f"rt{batch_size}")
        values = self.make_payloads(batch_size, seed=batch_size)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys, values)
            await self.assert_stored(backend, keys, values)
            await self.assert_stored(backend, keys[::-1], values[::-1])
            assert backend.stats.hits >= 2 * batch_size

    @pytest.mark.asyncio
    async def test_round_trip_from_bytes_and_bytearray(self, tmp_path: Path) -> None:
        keys = self.make_keys(2)
        rng = random.Random(3)
        raw: list[bytes | bytearray] = [
            rng.randbytes(self.block_bytes),
            bytearray(rng.randbytes(self.block_bytes)),
        ]
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys, [memoryview(v) for v in raw])
            await self.assert_stored(backend, keys, [memoryview(v) for v in raw])

    @pytest.mark.asyncio
    async def test_keeps_no_reference_to_caller_buffers(self, tmp_path: Path) -> None:
        """After put/get return, the caller can release and resize its buffers.

        A common way to fail it, now and then: a ``ThreadPoolExecutor`` keeps its work item (the
        callable and its arguments) for a moment after the result is set, so a callable that
        holds the buffers must drop them on the thread before returning.
        """
        keys = self.make_keys(3)
        rng = random.Random(30)
        sources = [bytearray(rng.randbytes(self.block_bytes)) for _ in keys]
        targets = [bytearray(self.block_bytes) for _ in keys]
        async with self.new_backend(tmp_path) as backend:
            views = [memoryview(b) for b in sources]
            assert await backend.put(keys, views) == [OK] * 3
            for view in views:
                view.release()  # raises BufferError if the backend still exports from it
            views = [memoryview(b) for b in targets]
            absent = self.make_keys(1, "absent")
            assert await backend.get([*keys, *absent], [*views, views[0]]) == [OK] * 3 + [MISSING]
            for view in views:
                view.release()
            for buffer in sources + targets:
                buffer.extend(b"resizable")  # BufferError while any export is alive
            assert [bytes(t[: self.block_bytes]) for t in targets] == [
                bytes(s[: self.block_bytes]) for s in sources
            ]

    @pytest.mark.asyncio
    async def test_empty_batches(self, tmp_path: Path) -> None:
        async with self.new_backend(tmp_path) as backend:
            assert await backend.put([], []) == []
            assert await backend.get([], []) == []
            assert await backend.contains([]) == []
            assert await backend.delete([]) == []

    @pytest.mark.asyncio
    async def test_missing_keys(self, tmp_path: Path) -> None:
        keys = self.make_keys(3)
        async with self.new_backend(tmp_path) as backend:
            assert await backend.get(keys, self.make_buffers(3, self.block_bytes)) == [MISSING] * 3
            assert await backend.contains(keys) == [False] * 3
            assert await backend.delete(keys) == [False] * 3
            assert backend.stats.misses == 3
            assert backend.stats.hits == 0

    @pytest.mark.asyncio
    async def test_get_mixed_hits_and_misses_keeps_order(self, tmp_path: Path) -> None:
        keys = self.make_keys(6)
        values = self.make_payloads(6, seed=6)
        stored = [0, 2, 3]
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, [keys[i] for i in stored], [values[i] for i in stored])
            out = self.make_buffers(6, self.block_bytes)
            outcomes = await backend.get(keys, out)
            assert outcomes == [OK if i in stored else MISSING for i in range(6)]
            for i in stored:
                assert out[i] == values[i]
            assert await backend.contains(keys) == [i in stored for i in range(6)]

    @pytest.mark.asyncio
    async def test_same_key_twice_in_one_get(self, tmp_path: Path) -> None:
        key = self.make_keys(1)
        value = self.make_payloads(1, seed=7)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, key, value)
            await self.assert_stored(backend, key * 2, value * 2)

    @pytest.mark.asyncio
    async def test_put_replaces(self, tmp_path: Path) -> None:
        keys = self.make_keys(2)
        first, second = self.make_payloads(2, seed=8), self.make_payloads(2, seed=9)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys, first)
            await self.put_ok(backend, keys[:1], second[:1])
            await self.assert_stored(backend, keys, [second[0], first[1]])
            self.check_usage(backend, 2)

    @pytest.mark.asyncio
    async def test_same_key_twice_in_one_put_keeps_the_later(self, tmp_path: Path) -> None:
        key = self.make_keys(1)
        values = self.make_payloads(2, seed=10)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, key * 2, values)
            await self.assert_stored(backend, key, values[1:])
            self.check_usage(backend, 1)

    @pytest.mark.asyncio
    async def test_delete(self, tmp_path: Path) -> None:
        keys = self.make_keys(4)
        values = self.make_payloads(4, seed=11)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys, values)
            assert await backend.delete([keys[1], keys[3], keys[1]]) == [True, True, False]
            assert await backend.contains(keys) == [True, False, True, False]
            out = self.make_buffers(4, self.block_bytes)
            assert await backend.get(keys, out) == [OK, MISSING, OK, MISSING]
            await self.assert_stored(backend, [keys[0], keys[2]], [values[0], values[2]])
            self.check_usage(backend, 2)
            await self.put_ok(backend, keys[1:2], values[1:2])  # a deleted key can come back
            await self.assert_stored(backend, keys[1:2], values[1:2])

    @pytest.mark.asyncio
    async def test_hostile_key_bytes_round_trip(self, tmp_path: Path) -> None:
        keys = [
            b"../../etc/passwd\x00\x00\x00\x01",
            b"/abs/path/\x00nul" + b"\x00\x00\x00\x00",
            "\u2215\u2024\u2024".encode() + b"\xff\xfe\x00\x00\x00\x02",
            b"\x00" * 32 + b"\x00\x00\x00\x03",
        ]
        values = self.make_payloads(len(keys), seed=12)
        before = sorted(p.name for p in tmp_path.iterdir())
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys, values)
            await self.assert_stored(backend, keys, values)
        # nothing was created next to the backend's own directory
        assert sorted(p.name for p in tmp_path.iterdir() if p.name != "backend") == before
