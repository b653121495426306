"""``BackendTests``, properties and lifecycle: what a backend reports before and after
``open``, use before open and after close, and an idempotent ``close``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tiering.errors import BackendError
from tiering.testing.backend_suite.base import BackendTestsBase

__all__ = ["BackendLifecycleTests"]


class BackendLifecycleTests(BackendTestsBase):
    """Properties, open, close."""

    # -- properties and lifecycle ----------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_properties(self, tmp_path: Path) -> None:
        backend = self.new_backend(tmp_path)
        assert not backend.is_open
        assert backend.block_bytes == self.block_bytes
        assert backend.fingerprint == self.fingerprint
        assert backend.capabilities.persistent == self.persistent
        assert backend.capabilities.max_value_bytes >= self.block_bytes
        assert backend.capacity_blocks >= self.n_blocks
        assert backend.capacity_bytes == self.capacity_bytes_for(self.n_blocks, self.block_bytes)
        async with backend:
            assert backend.is_open
            assert backend.usage_bytes == 0
        assert not backend.is_open

    @pytest.mark.asyncio
    async def test_open_fresh_recovers_nothing(self, tmp_path: Path) -> None:
        backend = self.new_backend(tmp_path)
        try:
            assert await backend.open() == []
        finally:
            await backend.close()

    @pytest.mark.asyncio
    async def test_use_before_open_and_after_close_raises(self, tmp_path: Path) -> None:
        backend = self.new_backend(tmp_path)
        keys, values = self.make_keys(1), self.make_payloads(1, seed=1)
        for _ in range(2):
            with pytest.raises(BackendError):
                await backend.put(keys, values)
            with pytest.raises(BackendError):
                await backend.get(keys, self.make_buffers(1, self.block_bytes))
            with pytest.raises(BackendError):
                await backend.contains(keys)
            with pytest.raises(BackendError):
                await backend.delete(keys)
            await backend.open()
            await backend.close()

    @pytest.mark.asyncio
    async def test_close_is_idempotent(self, tmp_path: Path) -> None:
        never_opened = self.new_backend(tmp_path / "a")
        await never_opened.close()
        await never_opened.close()
        backend = self.new_backend(tmp_path / "b")
        await backend.open()
        await self.put_ok(backend, self.make_keys(2), self.make_payloads(2, seed=2))
        await backend.close()
        await backend.close()
        await asyncio.gather(backend.close(), backend.close())
        assert not backend.is_open
