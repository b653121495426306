"""``BackendTests``, the optional operations and shared stores: ``exists`` (as ``contains`` on
a healthy store) and ``put_if_absent`` (a block already stored is left as it is and counted
in ``stats.extra["put_skipped_present"]``; racing calls leave one intact value), whether a
backend overrides them or not; and, for a shared backend (``capabilities.shared``), two
instances on one store seeing each other's writes and deletes at once.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tiering.errors import BackendError, InvalidKeyError
from tiering.testing.backend_suite.base import MISSING, OK, BackendTestsBase

__all__ = ["BackendOptionalOpsTests"]


class BackendOptionalOpsTests(BackendTestsBase):
    """``exists``, ``put_if_absent`` and shared stores."""

    # -- optional operations and shared stores ---------------------------------------------------
    # ``exists`` and ``put_if_absent`` have defaults in StorageBackend; these tests hold for the
    # defaults and for a backend's own. The shared-store test runs for a backend whose
    # ``capabilities.shared`` is True: two instances on one store (``make_backend`` with the same
    # arguments twice) see each other's writes without reopening.

    @pytest.mark.asyncio
    async def test_exists_answers_like_contains(self, tmp_path: Path) -> None:
        keys = self.make_keys(4, tag="exists")
        async with self.new_backend(tmp_path) as backend:
            assert await backend.exists([]) == []
            await self.put_ok(backend, keys[:2], self.make_payloads(2, seed=40))
            assert await backend.exists(keys) == [True, True, False, False]
            assert await backend.delete(keys[:1]) == [True]
            assert await backend.exists(keys) == [False, True, False, False]
            with pytest.raises(InvalidKeyError):
                await backend.exists([keys[0], b"abc"])

    @pytest.mark.asyncio
    async def test_put_if_absent_writes_only_what_is_absent(self, tmp_path: Path) -> None:
        keys = self.make_keys(4, tag="if-absent")
        first, second = self.make_payloads(2, seed=41), self.make_payloads(4, seed=42)
        async with self.new_backend(tmp_path) as backend:
            assert await backend.put_if_absent([], []) == []
            await self.put_ok(backend, keys[:2], first)
            skipped = backend.stats.extra.get("put_skipped_present", 0)
            assert await backend.put_if_absent(keys, second) == [OK] * 4
            await self.assert_stored(backend, keys, [first[0], first[1], second[2], second[3]])
            assert backend.stats.extra.get("put_skipped_present", 0) - skipped == 2
            self.check_usage(backend, 4)
            assert await backend.put_if_absent(keys[2:], first) == [OK] * 2  # all there
            await self.assert_stored(backend, keys[2:], second[2:])

    @pytest.mark.asyncio
    async def test_put_if_absent_misuse_raises_before_any_io(self, tmp_path: Path) -> None:
        keys = self.make_keys(2, tag="if-absent-misuse")
        values = self.make_payloads(2, seed=43)
        backend = self.new_backend(tmp_path)
        with pytest.raises(BackendError):
            await backend.put_if_absent(keys, values)  # not open
        async with backend:
            with pytest.raises(ValueError):
                await backend.put_if_absent(keys, values[:1])
            with pytest.raises(ValueError, match=str(self.block_bytes)):
                await backend.put_if_absent(keys, [values[0], memoryview(bytearray(3))])
            with pytest.raises(InvalidKeyError):
                await backend.put_if_absent([keys[0], b"abc"], values)
            assert await backend.contains(keys) == [False, False]

    @pytest.mark.asyncio
    async def test_racing_put_if_absent_leaves_one_intact_value(self, tmp_path: Path) -> None:
        (key,) = self.make_keys(1, tag="if-absent-race")
        payloads = self.make_payloads(4, seed=44)
        async with self.new_backend(tmp_path) as backend:
            results = await asyncio.gather(*(backend.put_if_absent([key], [p]) for p in payloads))
            assert results == [[OK]] * 4
            out = self.make_buffers(1, self.block_bytes)
            assert await backend.get([key], out) == [OK]
            assert bytes(out[0]) in {bytes(p) for p in payloads}

    @pytest.mark.asyncio
    async def test_a_shared_store_is_its_own_index(self, tmp_path: Path) -> None:
        """Two instances on one shared store: neither recovers anything at open, and each sees
        what the other writes and deletes at once (no reopening)."""
        if not self.new_backend(tmp_path).capabilities.shared:
            pytest.skip("the backend is not shared (capabilities.shared is False)")
        keys = self.make_keys(3, tag="shared")
        values = self.make_payloads(3, seed=45)
        async with self.new_backend(tmp_path) as one, self.new_backend(tmp_path) as two:
            await self.put_ok(backend=one, keys=keys[:2], values=values[:2])
            assert await two.contains(keys) == [True, True, False]
            assert await two.exists(keys) == [True, True, False]
            await self.assert_stored(two, keys[:2], values[:2])
            assert await two.put_if_absent(keys, values) == [OK] * 3  # writes only keys[2]
            await self.assert_stored(one, keys, values)
            assert await two.delete(keys[:1]) == [True]
            out = self.make_buffers(1, self.block_bytes)
            assert await one.get(keys[:1], out) == [MISSING]
