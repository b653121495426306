"""The loop probe the conformance suite uses: it tells a call that blocks the event loop from one
that hands its work to threads or works in short steps between awaits, and no wall clock is
involved (a busy machine changes neither)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import xxhash

from tiering.testing.loop_use import measure_loop_use

WORK_BYTES = 16 << 20


def cpu_work(src: np.ndarray, dst: np.ndarray) -> int:
    """What a backend does with a block: copy it and checksum the copy."""
    np.copyto(dst, src)
    return xxhash.xxh3_64_intdigest(dst.data)


@pytest.fixture
def buffers() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.integers(0, 256, WORK_BYTES, dtype=np.uint8), np.empty(WORK_BYTES, np.uint8)


@pytest.mark.asyncio
async def test_work_handed_to_a_thread_leaves_the_loop_free(
    buffers: tuple[np.ndarray, np.ndarray],
) -> None:
    async def call() -> int:
        return await asyncio.to_thread(cpu_work, *buffers)

    _, use = await measure_loop_use(call)
    use.assert_loop_free("to_thread")
    assert use.ticks > 0 and use.stretch_share < 0.5


@pytest.mark.asyncio
async def test_work_on_the_loop_is_caught(buffers: tuple[np.ndarray, np.ndarray]) -> None:
    async def call() -> int:
        return cpu_work(*buffers)

    _, use = await measure_loop_use(call)
    assert use.ticks == 0
    with pytest.raises(AssertionError, match="ran nothing else"):
        use.assert_loop_free("on the loop")


@pytest.mark.asyncio
async def test_work_on_the_loop_after_a_yield_is_caught(
    buffers: tuple[np.ndarray, np.ndarray],
) -> None:
    """Yielding once does not hide the work that follows on the loop."""

    async def call() -> int:
        await asyncio.sleep(0)
        return cpu_work(*buffers)

    _, use = await measure_loop_use(call)
    assert use.ticks > 0
    with pytest.raises(AssertionError, match=r"without letting another task in"):
        use.assert_loop_free("after a yield")


@pytest.mark.asyncio
async def test_work_on_the_loop_in_short_steps_between_awaits_is_fine(
    buffers: tuple[np.ndarray, np.ndarray],
) -> None:
    """An asyncio-native backend works on the loop's thread, in steps between its awaits (one
    network round trip each): the loop runs other tasks between the steps."""
    src, dst = buffers
    step = WORK_BYTES // 64

    async def call() -> None:
        for start in range(0, WORK_BYTES, step):
            cpu_work(src[start : start + step], dst[start : start + step])
            await asyncio.sleep(0)  # as a reply from a server would

    _, use = await measure_loop_use(call)
    use.assert_loop_free("short steps")
