"""``BackendTests``, bad input: misuse errors raised before any I/O (``ValueError`` for buffer
sizes, ``InvalidKeyError`` for keys).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tiering.errors import InvalidKeyError
from tiering.testing.backend_suite.base import BackendTestsBase

__all__ = ["BackendBadInputTests"]


class BackendBadInputTests(BackendTestsBase):
    """Misuse raises before any I/O."""

    # -- bad input -------------------------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_wrong_buffer_size_raises_before_any_io(self, tmp_path: Path) -> None:
        keys = self.make_keys(2)
        good = self.make_payloads(1, seed=27)[0]
        short = memoryview(bytearray(self.block_bytes - 1))
        long = memoryview(bytearray(self.block_bytes + 1))
        async with self.new_backend(tmp_path) as backend:
            for bad in (short, long):
                with pytest.raises(ValueError, match=str(self.block_bytes)):
                    await backend.put(keys, [good, bad])
                with pytest.raises(ValueError):
                    await backend.get(keys, [self.make_buffers(1, self.block_bytes)[0], bad])
            assert await backend.contains(keys) == [False, False]
            assert backend.usage_bytes == 0
            with pytest.raises(ValueError):
                await backend.put(keys, [good])  # fewer values than keys
            with pytest.raises(ValueError):
                await backend.get(keys, self.make_buffers(3, self.block_bytes))
            assert await backend.contains(keys) == [False, False]

    @pytest.mark.asyncio
    @pytest.mark.parametrize(
        "bad_key",
        ["a-str-key-of-some-length", bytearray(b"a-bytearray-key"), 12345, None, b"abc"],
        ids=["str", "bytearray", "int", "none", "too-short"],
    )
    async def test_bad_keys_raise_invalid_key_error(self, tmp_path: Path, bad_key: object) -> None:
        good = self.make_keys(1)[0]
        values = self.make_payloads(2, seed=28)
        keys: list[bytes] = [good, bad_key]  # type: ignore[list-item]
        async with self.new_backend(tmp_path) as backend:
            with pytest.raises(InvalidKeyError):
                await backend.put(keys, values)
            with pytest.raises(InvalidKeyError):
                await backend.get(keys, self.make_buffers(2, self.block_bytes))
            with pytest.raises(InvalidKeyError):
                await backend.contains(keys)
            with pytest.raises(InvalidKeyError):
                await backend.delete(keys)
            assert await backend.contains([good]) == [False]
            assert backend.usage_bytes == 0

    @pytest.mark.asyncio
    async def test_a_single_key_instead_of_a_list_is_rejected(self, tmp_path: Path) -> None:
        key = self.make_keys(1)[0]
        async with self.new_backend(tmp_path) as backend:
            with pytest.raises(InvalidKeyError):
                await backend.contains(key)  # type: ignore[arg-type]
            with pytest.raises(InvalidKeyError):
                await backend.delete(key)  # type: ignore[arg-type]
