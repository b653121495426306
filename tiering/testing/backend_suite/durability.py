"""``BackendTests``, what a store keeps and how it fails: capacity (``capacity_blocks`` puts
fit, one more is ``FULL`` and disturbs nothing) and ``usage_bytes``; restart recovery
(persistent backends); checksum failures (``CORRUPT``, then ``MISSING``, never ``OK``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiering.testing.backend_suite.base import CORRUPT, FULL, MISSING, OK, BackendTestsBase

__all__ = ["BackendDurabilityTests"]


class BackendDurabilityTests(BackendTestsBase):
    """Capacity and accounting, restart, corruption."""

    # -- capacity and accounting -----------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_capacity_full_and_accounting(self, tmp_path: Path) -> None:
        async with self.new_backend(tmp_path, n_blocks=8) as backend:
            capacity = backend.capacity_blocks
            assert capacity >= 8
            keys = self.make_keys(capacity + 2)
            values = self.make_payloads(capacity + 2, seed=13)
            self.check_usage(backend, 0)
            usages = []
            for start in range(0, capacity, 3):  # several puts, so accounting is incremental
                stop = min(start + 3, capacity)
                await self.put_ok(backend, keys[start:stop], values[start:stop])
                self.check_usage(backend, stop)
                usages.append(backend.usage_bytes)
            assert usages == sorted(usages)
            assert await backend.put(keys[capacity:], values[capacity:]) == [FULL, FULL]
            assert await backend.contains(keys[capacity:]) == [False, False]
            self.check_usage(backend, capacity)
            await self.assert_stored(backend, keys[:capacity], values[:capacity])
            assert await backend.delete(keys[:1]) == [True]
            self.check_usage(backend, capacity - 1)
            await self.put_ok(backend, keys[capacity : capacity + 1], values[capacity:][:1])
            await self.assert_stored(backend, keys[1 : capacity + 1], values[1 : capacity + 1])

    # -- restart ---------------------------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_restart_recovers_bit_exact(self, tmp_path: Path) -> None:
        if not self.persistent:
            pytest.skip("not a persistent backend")
        keys = self.make_keys(10)
        values = self.make_payloads(10, seed=14)
        replaced = self.make_payloads(1, seed=15)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys, values)
            await self.put_ok(backend, keys[:1], replaced)
            assert await backend.delete(keys[8:]) == [True, True]
        reopened = self.new_backend(tmp_path)
        try:
            recovered = await reopened.open()
            assert sorted(recovered) == sorted(keys[:8])
            assert len(recovered) == len(set(recovered))
            await self.assert_stored(reopened, keys[:8], replaced + values[1:8])
            assert await reopened.contains(keys[8:]) == [False, False]
            self.check_usage(reopened, 8)
        finally:
            await reopened.close()

    @pytest.mark.asyncio
    async def test_restart_twice_and_write_after_restart(self, tmp_path: Path) -> None:
        if not self.persistent:
            pytest.skip("not a persistent backend")
        keys = self.make_keys(4)
        values = self.make_payloads(4, seed=16)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys[:2], values[:2])
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys[2:], values[2:])
        backend = self.new_backend(tmp_path)
        try:
            assert sorted(await backend.open()) == sorted(keys)
            await self.assert_stored(backend, keys, values)
        finally:
            await backend.close()

    # -- corruption ------------------------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_corrupt_block_is_corrupt_then_missing(self, tmp_path: Path) -> None:
        keys = self.make_keys(3)
        values = self.make_payloads(3, seed=17)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys, values)
            await self.corrupt(backend, keys[1])
            out = self.make_buffers(3, self.block_bytes)
            assert await backend.get(keys, out) == [OK, CORRUPT, OK]
            assert backend.stats.corrupt == 1
            assert out[0] == values[0] and out[2] == values[2]
            assert await backend.get(keys[1:2], out[1:2]) == [MISSING]
            assert await backend.contains(keys) == [True, False, True]
            self.check_usage(backend, 2)
            await self.put_ok(backend, keys[1:2], values[1:2])
            await self.assert_stored(backend, keys, values)

    @pytest.mark.asyncio
    async def test_corrupt_block_is_never_served_after_restart(self, tmp_path: Path) -> None:
        if not self.persistent:
            pytest.skip("not a persistent backend")
        keys = self.make_keys(3)
        values = self.make_payloads(3, seed=18)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys, values)
            await self.corrupt(backend, keys[0])
        backend = self.new_backend(tmp_path)
        try:
            recovered = await backend.open()
            assert set(keys[1:]) <= set(recovered)
            out = self.make_buffers(3, self.block_bytes)
            first = await backend.get(keys, out)
            assert first[0] in (CORRUPT, MISSING) and first[1:] == [OK, OK]
            assert await backend.get(keys[:1], out[:1]) == [MISSING]
            await self.assert_stored(backend, keys[1:], values[1:])
        finally:
            await backend.close()
