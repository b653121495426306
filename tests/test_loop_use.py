"""The loop probe the conformance suite uses: it tells a call that blocks the event loop from one
that hands its work to threads, and no clock is involved (a busy machine changes neither)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import xxhash

from tiering.backends.memory import MemoryBackend
from tiering.keys import make_offload_key
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
    assert use.ticks > 0 and use.loop_share < 0.5


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
    with pytest.raises(AssertionError, match=r"ran on the event loop's thread"):
        use.assert_loop_free("after a yield")


@pytest.mark.asyncio
async def test_a_backend_that_copies_on_the_loop_is_caught() -> None:
    """MemoryBackend copies on the caller's loop by design: the probe sees it."""
    size, n = 1 << 20, 16
    backend = MemoryBackend(
        capacity_bytes=n * (size + 4096), block_bytes=size, fingerprint=bytes(16)
    )
    await backend.open()
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(n)]
    values = [memoryview(bytes([i]) * size) for i in range(n)]
    _, use = await measure_loop_use(lambda: backend.put(keys, values))
    with pytest.raises(AssertionError):
        use.assert_loop_free("MemoryBackend.put")
    await backend.close()
