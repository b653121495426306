"""run_in_lanes: items shared by a few threads, one loop wake-up, cancellation and errors."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

import pytest

from tiering.backends.lanes import LaneStep, run_in_lanes

# Waits for something that happens at once: only a hang (a bug) reaches this bound.
HANG_GUARD_S = 300


class _Recorder:
    """open_lane for the tests: records which lane ran which item and when lanes leave."""

    def __init__(self, block_on: dict[int, threading.Event] | None = None) -> None:
        self.block_on = block_on or {}
        self.lock = threading.Lock()
        self.items_by_lane: list[list[int]] = []
        self.open_lanes = 0
        self.started = {index: threading.Event() for index in self.block_on}

    @contextlib.contextmanager
    def open_lane(self) -> Iterator[LaneStep[int]]:
        with self.lock:
            mine: list[int] = []
            self.items_by_lane.append(mine)
            self.open_lanes += 1

        def step(index: int) -> int:
            mine.append(index)
            if index in self.block_on:
                self.started[index].set()
                assert self.block_on[index].wait(HANG_GUARD_S)
            return index * 10

        try:
            yield step
        finally:
            with self.lock:
                self.open_lanes -= 1


@pytest.fixture
def executor() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:
        yield pool


@pytest.mark.asyncio
@pytest.mark.parametrize("lanes", [1, 2, 4])
@pytest.mark.parametrize("n_items", [0, 1, 3, 50])
async def test_every_item_runs_once_and_results_keep_their_order(
    executor: ThreadPoolExecutor, lanes: int, n_items: int
) -> None:
    recorder = _Recorder()
    results = await run_in_lanes(executor, lanes, n_items, recorder.open_lane)
    assert results == [i * 10 for i in range(n_items)]
    ran = sorted(i for items in recorder.items_by_lane for i in items)
    assert ran == list(range(n_items))
    assert recorder.open_lanes == 0  # every lane left its context before the call returned
    assert len(recorder.items_by_lane) <= min(lanes, n_items)


@pytest.mark.asyncio
async def test_a_lane_that_finds_nothing_left_opens_nothing(executor: ThreadPoolExecutor) -> None:
    recorder = _Recorder()
    assert await run_in_lanes(executor, 4, 1, recorder.open_lane) == [0]
    assert recorder.items_by_lane == [[0]]


async def _start_with_item_0_held(
    executor: ThreadPoolExecutor, lanes: int, n_items: int
) -> tuple[asyncio.Future[list[int]], _Recorder, threading.Event]:
    """A call whose item 0 has started and waits for the returned event."""
    release = threading.Event()
    recorder = _Recorder(block_on={0: release})
    call = asyncio.ensure_future(run_in_lanes(executor, lanes, n_items, recorder.open_lane))
    assert await asyncio.to_thread(recorder.started[0].wait, HANG_GUARD_S)
    return call, recorder, release


@pytest.mark.asyncio
async def test_a_held_lane_takes_one_item_while_the_other_does_the_rest(
    executor: ThreadPoolExecutor,
) -> None:
    call, recorder, release = await _start_with_item_0_held(executor, 2, 20)

    # The other lane works through items 1..19 while item 0 is held.
    async def other_lane_done() -> None:
        while sum(map(len, recorder.items_by_lane)) < 20:
            await asyncio.sleep(0.005)

    await asyncio.wait_for(other_lane_done(), HANG_GUARD_S)
    assert not call.done()  # the held item is not finished
    release.set()
    assert await call == [i * 10 for i in range(20)]
    assert sorted(map(sorted, recorder.items_by_lane)) == [[0], list(range(1, 20))]


@pytest.mark.asyncio
async def test_cancel_waits_for_the_running_item_and_starts_no_other(
    executor: ThreadPoolExecutor,
) -> None:
    call, recorder, release = await _start_with_item_0_held(executor, 1, 5)
    call.cancel()
    await asyncio.sleep(0.05)
    assert not call.done()  # item 0 may still write into the caller's buffers
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert recorder.items_by_lane == [[0]]
    assert recorder.open_lanes == 0


@pytest.mark.asyncio
async def test_cancel_before_any_lane_starts_returns_at_once() -> None:
    with ThreadPoolExecutor(1) as executor:
        busy = threading.Event()
        executor.submit(busy.wait, HANG_GUARD_S)  # the only thread is taken: the lane stays queued
        recorder = _Recorder()
        call = asyncio.ensure_future(run_in_lanes(executor, 1, 3, recorder.open_lane))
        await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        busy.set()
    assert recorder.items_by_lane == []  # the queued lane found nothing to do


@pytest.mark.asyncio
async def test_an_error_stops_the_other_lanes_and_is_raised(
    executor: ThreadPoolExecutor,
) -> None:
    ran: list[int] = []

    @contextlib.contextmanager
    def open_lane() -> Iterator[LaneStep[int]]:
        def step(index: int) -> int:
            ran.append(index)
            if index == 2:
                raise KeyError("item 2")
            return index

        yield step

    with pytest.raises(KeyError, match="item 2"):
        await run_in_lanes(executor, 1, 10, open_lane)
    assert ran == [0, 1, 2]


@pytest.mark.asyncio
async def test_an_error_opening_a_lane_is_raised(executor: ThreadPoolExecutor) -> None:
    @contextlib.contextmanager
    def open_lane() -> Iterator[LaneStep[int]]:
        raise OSError(5, "no transaction")
        yield lambda index: index

    with pytest.raises(OSError, match="no transaction"):
        await run_in_lanes(executor, 2, 4, open_lane)


class _HoldingExecutor(Executor):
    """Runs the first submitted call on a thread and holds the rest until ``run_held``."""

    def __init__(self) -> None:
        self.held: list[Callable[[], object]] = []
        self.threads: list[threading.Thread] = []

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        if self.threads:
            self.held.append(fn)
        else:
            self.threads.append(threading.Thread(target=fn))
            self.threads[0].start()
        return Future()

    def run_held(self) -> None:
        for fn in self.held:
            fn()
        self.held.clear()
        self.threads[0].join()


@pytest.mark.asyncio
async def test_a_queued_lane_keeps_no_reference_to_what_the_call_used() -> None:
    """An executor may keep a lane's work item after the call returns; it must not keep the
    caller's buffers alive (nor touch them later)."""

    class Buffer:
        pass

    buffer = Buffer()
    alive = weakref.ref(buffer)
    touched: list[int] = []

    def open_lane(buffer: Buffer = buffer) -> contextlib.nullcontext[LaneStep[int]]:
        def step(index: int) -> int:
            touched.append(index)
            assert buffer is not None
            return index

        return contextlib.nullcontext(step)

    executor = _HoldingExecutor()
    assert await run_in_lanes(executor, 3, 8, open_lane) == list(range(8))
    assert len(executor.held) == 2  # two lanes still queued
    del buffer, open_lane
    gc.collect()
    assert alive() is None
    executor.run_held()
    assert touched == list(range(8))  # the late lanes found nothing to do
