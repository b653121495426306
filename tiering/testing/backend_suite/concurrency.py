"""``BackendTests``, concurrency and cancellation: concurrent put/get/delete on one key (every
``OK`` get returns one written payload exactly); cancelled puts and gets (afterwards ``OK``
with the exact payload or ``MISSING``, never corrupt, and the backend keeps working);
``close`` waiting for in-flight operations; and that a large put or get leaves the event
loop free (measured in the loop thread's CPU time, see :mod:`tiering.testing.loop_use`).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable
from pathlib import Path

import pytest

from tiering.backends.base import Outcome
from tiering.testing.backend_suite.base import MISSING, OK, BackendTestsBase
from tiering.testing.loop_use import measure_loop_use

__all__ = ["BackendConcurrencyTests"]


class BackendConcurrencyTests(BackendTestsBase):
    """Concurrent and cancelled operations, and the event loop."""

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
