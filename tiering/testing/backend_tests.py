"""``BackendTests``: the conformance suite every :class:`~tiering.backends.base.StorageBackend`
must pass, shipped in the package so that plugin authors can run it on their own backends.

How to use it
-------------
Subclass it in a test module (the class name must start with ``Test`` for pytest to collect it),
implement :meth:`BackendTests.make_backend` and, for the corruption tests,
:meth:`BackendTests.corrupt_stored_block`; set the class attributes that describe your backend::

    from pathlib import Path

    from tiering.testing import BackendTests
    from mypkg import MyBackend


    class TestMyBackend(BackendTests):
        persistent = True  # False skips the restart tests

        def make_backend(self, path: Path, *, capacity_bytes: int, block_bytes: int,
                         fingerprint: bytes) -> MyBackend:
            return MyBackend(path=path, capacity_bytes=capacity_bytes,
                             block_bytes=block_bytes, fingerprint=fingerprint)

        def corrupt_stored_block(self, backend: MyBackend, key: bytes) -> None:
            ...  # flip one payload byte of ``key``'s stored block, *bypassing* the backend API

Requirements: pytest and pytest-asyncio. Every async test carries ``pytest.mark.asyncio``, so
the suite runs under ``asyncio_mode = "strict"`` (and "auto"). Each test builds its own
backend(s) in pytest's ``tmp_path`` with :meth:`BackendTests.new_backend` and closes them, so
no fixtures need overriding. To run the suite with several configurations, subclass once per
configuration (for instance with different ``make_backend`` settings).

What it checks (the contract in :mod:`tiering.backends.base`): bit-exact round trips in
batches of several sizes; one result per key, in order, with mixed hits and misses; missing
keys; put-replaces; delete; contains; capacity (``capacity_blocks`` puts fit, one more is
``FULL`` and disturbs nothing) and ``usage_bytes``; restart recovery (persistent backends);
checksum failures (``CORRUPT``, then ``MISSING``, never ``OK``); concurrent put/get/delete on
one key (every ``OK`` get returns one written payload exactly); cancelled puts and gets
(afterwards ``OK`` with the exact payload or ``MISSING``, never corrupt, and the backend keeps
working); misuse errors raised before any I/O (``ValueError`` for buffer sizes,
``InvalidKeyError`` for keys, ``BackendError`` when not open); idempotent ``close``; hostile
key bytes; and that a large put or get leaves the event loop free (measured in the loop
thread's CPU time, not with a wall clock: another task runs while it is in flight, and between
any two of its turns the loop runs at most half of the call's CPU time; see
:mod:`tiering.testing.loop_use`). The optional operations, whether a backend overrides them or
not: ``exists`` (as ``contains`` on a healthy store) and ``put_if_absent`` (a block already
stored is left as it is and counted in ``stats.extra["put_skipped_present"]``; racing calls
leave one intact value). Through the embedders' facade (:mod:`tiering.testing.embed_tests`):
blocks given as runs of memory and of mixed lengths shorter than the slot round-trip bit-exact
and with their lengths, through a restart; a block too long for the slot or for the caller's
memory is refused or a miss, writing nothing. For a shared backend (``capabilities.shared``):
two instances on one store see each other's writes and deletes at once.

Hooks a subclass may override: :meth:`capacity_bytes_for` (how much ``capacity_bytes`` gives
room for ``n`` blocks; the default adds 8 KiB per block), :meth:`expected_usage_bytes` (exact
``usage_bytes`` for ``n`` stored blocks; the default only checks it is monotone and bounded),
and :meth:`make_buffers` (the caller buffers; the default uses page-aligned rows, shifted by
``buffer_offset_bytes``).
"""

from __future__ import annotations

import asyncio
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
from tiering.errors import BackendError, InvalidKeyError
from tiering.testing.embed_tests import EmbedTests
from tiering.testing.loop_use import measure_loop_use

__all__ = ["BackendTests"]

OK, MISSING, CORRUPT, FULL = Outcome.OK, Outcome.MISSING, Outcome.CORRUPT, Outcome.FULL


class BackendTests(EmbedTests):
    """The shared conformance tests; subclass it and implement :meth:`make_backend`. The
    embedder tests (runs and lengths through :class:`tiering.embed.TierStore`) come from
    :class:`~tiering.testing.embed_tests.EmbedTests`."""

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

    # -- capacity and accounting -----------------------------------------------------------------

    def check_usage(self, backend: StorageBackend, n_stored: int) -> None:
        expected = self.expected_usage_bytes(backend, n_stored)
        if expected is not None:
            assert backend.usage_bytes == expected
        assert 0 <= backend.usage_bytes <= backend.capacity_bytes
        assert (backend.usage_bytes == 0) == (n_stored == 0)

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

    # -- concurrency and cancellation ------------------------------------------------------------

    @pytest.mark.asyncio
    async def test_concurrent_operations_on_one_key(self, tmp_path: Path) -> None:
        (key,) = self.make_keys(1)
        payloads = self.make_payloads(3, seed=19)
        allowed = {bytes(p) for p in payloads}
        rng = random.Random(20)
        async with self.new_backend(tmp_path, n_blocks=16) as backend:
            for _ in range(15):
                ops: list[tuple[str, memoryview | None]] = [("put", p) for p in payloads]
                ops += [("get", None)] * 4 + [("delete", None)]
                rng.shuffle(ops)
                buffers = self.make_buffers(len(ops), self.block_bytes)
                calls: list[Awaitable[list[Outcome] | list[bool]]] = []
                for (op, payload), buffer in zip(ops, buffers, strict=True):
                    if op == "put":
                        assert payload is not None
                        calls.append(backend.put([key], [payload]))
                    elif op == "get":
                        calls.append(backend.get([key], [buffer]))
                    else:
                        calls.append(backend.delete([key]))
                results = await asyncio.gather(*calls)
                for (op, _), result, buffer in zip(ops, results, buffers, strict=True):
                    if op == "put":
                        assert result == [OK]
                    elif op == "get":
                        assert result in ([OK], [MISSING])
                        if result == [OK]:
                            assert bytes(buffer) in allowed
                final = self.make_buffers(1, self.block_bytes)
                outcome = await backend.get([key], final)
                assert outcome in ([OK], [MISSING])
                assert (outcome == [OK]) == (await backend.contains([key]))[0]
                if outcome == [OK]:
                    assert bytes(final[0]) in allowed
            assert backend.stats.corrupt == 0

    @pytest.mark.asyncio
    @pytest.mark.parametrize("yields_before_cancel", [0, 1, 2, 5])
    async def test_cancelled_put_is_absent_or_intact(
        self, tmp_path: Path, yields_before_cancel: int
    ) -> None:
        keys = self.make_keys(20, tag=f"cancel{yields_before_cancel}")
        values = self.make_payloads(20, seed=21)
        old = self.make_payloads(1, seed=22)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys[:1], old)  # keys[0]'s put is a replace
            task = asyncio.ensure_future(backend.put(keys, values))
            for _ in range(yields_before_cancel):
                await asyncio.sleep(0)
            task.cancel()
            try:
                finished = await task
            except asyncio.CancelledError:
                finished = None
            out = self.make_buffers(20, self.block_bytes)
            outcomes = await backend.get(keys, out)
            for i, outcome in enumerate(outcomes):
                if finished is not None and finished[i] == OK:
                    assert outcome == OK and out[i] == values[i]
                elif i == 0:
                    assert outcome == OK and out[0] in (values[0], old[0])
                else:
                    assert outcome in (OK, MISSING)
                    if outcome == OK:
                        assert out[i] == values[i]
            assert backend.stats.corrupt == 0
            # the backend keeps working
            fresh_keys = self.make_keys(2, tag="after-cancel")
            fresh = self.make_payloads(2, seed=23)
            await backend.delete(keys)
            await self.put_ok(backend, fresh_keys, fresh)
            await self.assert_stored(backend, fresh_keys, fresh)

    @pytest.mark.asyncio
    @pytest.mark.parametrize("yields_before_cancel", [0, 1, 3])
    async def test_cancelled_get_leaves_the_backend_working(
        self, tmp_path: Path, yields_before_cancel: int
    ) -> None:
        keys = self.make_keys(20)
        values = self.make_payloads(20, seed=24)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys, values)
            task = asyncio.ensure_future(backend.get(keys, self.make_buffers(20, self.block_bytes)))
            for _ in range(yields_before_cancel):
                await asyncio.sleep(0)
            task.cancel()
            try:
                outcomes = await task
                assert outcomes == [OK] * 20
            except asyncio.CancelledError:
                pass
            await self.assert_stored(backend, keys, values)
            assert backend.stats.corrupt == 0

    @pytest.mark.asyncio
    async def test_cancelled_get_never_writes_after_it_returns(self, tmp_path: Path) -> None:
        """Once a cancelled get has raised, the caller may reuse its buffers at once."""
        n, size = self.large_blocks, self.large_block_bytes
        keys = self.make_keys(n, tag="large")
        values = self.make_payloads(n, seed=29, block_bytes=size)
        async with self.new_backend(tmp_path, n_blocks=n, block_bytes=size) as backend:
            await self.put_ok(backend, keys, values)
            for yields_before_cancel in (1, 2, 4):
                out = self.make_buffers(n, size)
                task = asyncio.ensure_future(backend.get(keys, out))
                for _ in range(yields_before_cancel):
                    await asyncio.sleep(0)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                sentinel = b"\x5a" * size
                for buffer in out:
                    buffer[:] = sentinel
                await asyncio.sleep(0.05)  # time for any straggling I/O to land
                assert all(buffer == sentinel for buffer in out), "a buffer changed after get"
            await self.assert_stored(backend, keys, values)

    @pytest.mark.asyncio
    async def test_close_waits_for_in_flight_operations(self, tmp_path: Path) -> None:
        keys = self.make_keys(20)
        values = self.make_payloads(20, seed=25)
        backend = self.new_backend(tmp_path)
        await backend.open()
        put = asyncio.ensure_future(backend.put(keys, values))
        await asyncio.sleep(0)
        await backend.close()
        assert put.done()
        assert await put == [OK] * 20
        if self.persistent:
            async with self.new_backend(tmp_path) as reopened:
                await self.assert_stored(reopened, keys, values)

    @pytest.mark.asyncio
    async def test_event_loop_is_not_blocked(self, tmp_path: Path) -> None:
        """A large put and a large get leave the event loop free.

        Measured without a wall clock (which a busy machine stretches, whoever blocks; see
        :mod:`tiering.testing.loop_use`): another task runs while each call is in flight, and
        no stretch of the loop thread's CPU time without it is over half of the call's (a
        backend that copies and checksums a batch on the loop spends it all in one stretch).
        """
        n, size = self.large_blocks, self.large_block_bytes
        keys = self.make_keys(n, tag="large")
        values = self.make_payloads(n, seed=26, block_bytes=size)
        out = self.make_buffers(n, size)
        async with self.new_backend(tmp_path, n_blocks=n, block_bytes=size) as backend:
            outcomes, put_use = await measure_loop_use(lambda: backend.put(keys, values))
            assert outcomes == [OK] * n
            put_use.assert_loop_free(f"put of {n} blocks of {size} bytes")
            outcomes, get_use = await measure_loop_use(lambda: backend.get(keys, out))
            assert outcomes == [OK] * n
            get_use.assert_loop_free(f"get of {n} blocks of {size} bytes")
        assert out == values

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
