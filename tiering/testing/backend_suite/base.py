"""The base of ``BackendTests``: the class attributes that describe the backend under test, the
hooks a subclass implements (:meth:`BackendTestsBase.make_backend` and the optional ones), and
the helpers every topic mixin uses (keys, payloads, bit-exact checks, usage accounting).
"""

from __future__ import annotations

import hashlib
import inspect
import mmap
import random
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import ClassVar

import pytest

from tiering.backends.base import Outcome, StorageBackend
from tiering.core.keys import make_offload_key
from tiering.testing.embed_tests import EmbedTests

__all__ = ["CORRUPT", "FULL", "MISSING", "OK", "BackendTestsBase"]

OK, MISSING, CORRUPT, FULL = Outcome.OK, Outcome.MISSING, Outcome.CORRUPT, Outcome.FULL


class BackendTestsBase(EmbedTests):
    """What every topic of ``BackendTests`` builds on: the backend's description, the hooks and
    the helpers. The embedder tests (runs and lengths through :class:`tiering.embed.TierStore`)
    come from :class:`~tiering.testing.embed_tests.EmbedTests`."""

    #: Whether the backend keeps its blocks across close/open (enables the restart tests).
    persistent: ClassVar[bool] = True
    #: The payload size most tests use.
    block_bytes: ClassVar[int] = 16 * 1024
    #: The layout fingerprint passed to the backend (16 bytes).
    fingerprint: ClassVar[bytes] = b"tiering-test-fp1"
    #: The room (in blocks) most tests ask for through :meth:`capacity_bytes_for`.
    n_blocks: ClassVar[int] = 48
    #: Shift every caller buffer by this many bytes from a page boundary (0: page-aligned
    #: when ``block_bytes`` is a multiple of 4096); a non-zero value exercises unaligned paths.
    buffer_offset_bytes: ClassVar[int] = 0
    #: The event-loop test moves ``large_blocks`` blocks of ``large_block_bytes`` in one call.
    large_block_bytes: ClassVar[int] = 1 << 20
    large_blocks: ClassVar[int] = 64

    # -- hooks for subclasses --------------------------------------------------------------------

    def make_backend(
        self, path: Path, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes
    ) -> StorageBackend:
        """Return a new, unopened backend storing in ``path`` (a directory that may not exist).

        Two calls with the same arguments must give backends that see the same stored data
        (that is how the restart tests reopen a persistent backend).
        """
        raise NotImplementedError("subclasses of BackendTests implement make_backend()")

    def capacity_bytes_for(self, n_blocks: int, block_bytes: int) -> int:
        """A ``capacity_bytes`` giving room for at least ``n_blocks`` blocks (checked)."""
        return n_blocks * (block_bytes + 8192)

    def corrupt_stored_block(self, backend: StorageBackend, key: bytes) -> None | Awaitable[None]:
        """Damage the stored payload of ``key`` behind the backend's back (it stays open).

        Flip at least one bit of the payload as stored, without using the backend's API, so
        that the next ``get`` must detect it. May be a coroutine function. The default skips
        the corruption tests.
        """
        pytest.skip(f"{type(self).__name__} does not implement corrupt_stored_block()")

    def expected_usage_bytes(self, backend: StorageBackend, n_blocks: int) -> int | None:
        """The exact ``usage_bytes`` with ``n_blocks`` stored, or None to check bounds only."""
        return None

    def make_buffers(self, n: int, block_bytes: int) -> list[memoryview]:
        """``n`` writable caller buffers of ``block_bytes`` (rows of one page-aligned region)."""
        offset = self.buffer_offset_bytes
        region = memoryview(mmap.mmap(-1, max(1, n * block_bytes + offset)))[offset:]
        return [region[i * block_bytes : (i + 1) * block_bytes] for i in range(n)]

    # -- helpers for tests -----------------------------------------------------------------------

    def new_backend(
        self, tmp_path: Path, *, n_blocks: int | None = None, block_bytes: int | None = None
    ) -> StorageBackend:
        """An unopened backend in ``tmp_path / "backend"`` with room for ``n_blocks``."""
        block_bytes = block_bytes or self.block_bytes
        return self.make_backend(
            tmp_path / "backend",
            capacity_bytes=self.capacity_bytes_for(n_blocks or self.n_blocks, block_bytes),
            block_bytes=block_bytes,
            fingerprint=self.fingerprint,
        )

    @staticmethod
    def make_keys(n: int, tag: str = "k") -> list[bytes]:
        """``n`` distinct offload keys (a SHA-256 block hash plus a group index)."""
        return [
            make_offload_key(hashlib.sha256(f"{tag}/{i}".encode()).digest(), i % 3)
            for i in range(n)
        ]

    def make_payloads(self, n: int, seed: int, block_bytes: int | None = None) -> list[memoryview]:
        """``n`` caller buffers filled with seeded random bytes."""
        block_bytes = block_bytes or self.block_bytes
        rng = random.Random(seed)
        buffers = self.make_buffers(n, block_bytes)
        for buffer in buffers:
            buffer[:] = rng.randbytes(block_bytes)
        return buffers

    async def corrupt(self, backend: StorageBackend, key: bytes) -> None:
        result = self.corrupt_stored_block(backend, key)
        if inspect.isawaitable(result):
            await result

    async def put_ok(
        self, backend: StorageBackend, keys: Sequence[bytes], values: Sequence[memoryview]
    ) -> None:
        assert await backend.put(keys, values) == [OK] * len(keys)

    async def assert_stored(
        self, backend: StorageBackend, keys: Sequence[bytes], values: Sequence[memoryview]
    ) -> None:
        """Every key reads back OK and bit-exact (into buffers first filled with garbage)."""
        out = self.make_buffers(len(keys), values[0].nbytes if values else self.block_bytes)
        for buffer in out:
            buffer[:] = b"\xa5" * buffer.nbytes
        assert await backend.get(keys, out) == [OK] * len(keys)
        for i, (got, want) in enumerate(zip(out, values, strict=True)):
            assert got == want, f"key {i} read back different bytes"

    def check_usage(self, backend: StorageBackend, n_stored: int) -> None:
        expected = self.expected_usage_bytes(backend, n_stored)
        if expected is not None:
            assert backend.usage_bytes == expected
        assert 0 <= backend.usage_bytes <= backend.capacity_bytes
        assert (backend.usage_bytes == 0) == (n_stored == 0)
