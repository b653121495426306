"""InFlight: what a backend's close waits for."""

from __future__ import annotations

import asyncio

import pytest

from tiering.backends.in_flight import InFlight


@pytest.mark.asyncio
async def test_idle_waits_for_every_operation_to_leave() -> None:
    in_flight = InFlight()
    assert await _idle_at_once(in_flight)  # none in flight
    release = asyncio.Event()

    async def operation() -> None:
        with in_flight.operation():
            await release.wait()

    tasks = [asyncio.create_task(operation()) for _ in range(2)]
    await asyncio.sleep(0)
    assert in_flight.count == 2
    waiter = asyncio.create_task(in_flight.idle())
    await asyncio.sleep(0)
    assert not waiter.done()
    release.set()
    await asyncio.gather(*tasks)
    await waiter
    assert in_flight.count == 0


@pytest.mark.asyncio
async def test_an_operation_that_raises_still_leaves() -> None:
    in_flight = InFlight()
    with pytest.raises(RuntimeError), in_flight.operation():
        assert in_flight.count == 1
        raise RuntimeError("the operation failed")
    assert in_flight.count == 0
    assert await _idle_at_once(in_flight)


async def _idle_at_once(in_flight: InFlight) -> bool:
    # Whether idle() returns within one turn of the loop (no clock involved).
    waiter = asyncio.create_task(in_flight.idle())
    await asyncio.sleep(0)
    done = waiter.done()
    waiter.cancel()
    return done
