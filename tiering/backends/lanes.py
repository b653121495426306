"""One backend call's items, worked through by a few threads that share them: ``run_in_lanes``.

A backend call (a get of 32 blocks, a put cut into chunks) is ``n_items`` pieces of blocking
work. ``run_in_lanes`` hands them to up to ``lanes`` threads of an executor. Each lane takes
the next item nobody has taken yet, so a lane that starts late (its thread had to be woken
first) or loses its core for a while simply does fewer; splitting the items up front made the
call wait for the slowest share. The lane that leaves last wakes the event loop, once, for the
whole call: on a VM, every thread wake-up costs tens of microseconds, a large share of a call of
a few megabytes.

A lane may need state for the items it runs (LMDB: one read transaction per thread), so the
caller gives ``open_lane``, a context-manager factory: a lane enters it before its first item,
gets the function that runs one item (``step(index) -> result``), and leaves it after its last.
The call completes only when every lane that took an item has left its context, so nothing a
lane opened outlives the call.

Cancellation: if the awaiting task is cancelled, no lane takes another item, and the task waits
for the items already running (they may write into the caller's buffers) before
``CancelledError`` propagates. An exception from ``open_lane`` or ``step`` stops the other
lanes before their next item and is re-raised on the event loop; a backend reports the
expected failures of single blocks (an I/O error) as results instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

__all__ = ["LaneStep", "run_in_lanes"]

_R = TypeVar("_R")

LaneStep = Callable[[int], _R]
"""Runs item ``index`` on a lane's thread and returns its result."""


async def run_in_lanes(
    executor: Executor,
    lanes: int,
    n_items: int,
    open_lane: Callable[[], AbstractContextManager[LaneStep[_R]]],
) -> list[_R]:
    """Run items ``0 .. n_items - 1`` on up to ``lanes`` threads of ``executor``; results in order.

    ``open_lane`` is called on a lane's thread and must not block on the event loop. The
    executor must have at least ``lanes`` threads for the lanes to run side by side.
    """
    if n_items <= 0:
        return []
    batch = _Batch(asyncio.get_running_loop(), n_items, open_lane)
    for _ in range(min(lanes, n_items)):
        executor.submit(batch.run_lane)
    return await batch.wait()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _Batch(Generic[_R]):
    """The shared state of one ``run_in_lanes`` call; see the module docstring."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        n_items: int,
        open_lane: Callable[[], AbstractContextManager[LaneStep[_R]]],
    ) -> None:
        self._loop = loop
        self._open_lane: Callable[[], AbstractContextManager[LaneStep[_R]]] | None = open_lane
        self._results: list[_R | None] = [None] * n_items
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._next = 0  # the next item to take
        self._limit = n_items  # no item at or above this is taken (lowered to stop the lanes)
        self._active = 0  # lanes inside their context
        self._waiter: asyncio.Future[None] = loop.create_future()

    def run_lane(self) -> None:
        """One lane, on an executor thread: take items until none is left."""
        with self._lock:
            if self._next >= self._limit:
                return  # woke up after the others had taken everything
            self._active += 1
        try:
            self._run_items()
        except BaseException as exc:
            self._errors.append(exc)
        finally:
            self._leave()

    def _run_items(self) -> None:
        # A frame of its own: what the lane used (the caller's buffers) is released when it
        # returns, before _leave lets the caller resume.
        open_lane = self._open_lane  # set: this lane is active, so nobody has cleared it
        assert open_lane is not None
        with open_lane() as step:
            del open_lane
            while (index := self._take()) is not None:
                self._results[index] = step(index)

    def _take(self) -> int | None:
        with self._lock:
            if self._next >= self._limit:
                return None
            index = self._next
            self._next += 1
            return index

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1
            if self._errors:
                self._limit = self._next
            if self._active or self._next < self._limit:
                return
            # Last one out: drop what holds the caller's buffers before the caller resumes (an
            # executor keeps a finished work item, and so this batch, alive a little longer).
            self._open_lane = None
            waiter = self._waiter
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
            self._loop.call_soon_threadsafe(_resolve, waiter)

    async def wait(self) -> list[_R]:
        try:
            await self._waiter
        except asyncio.CancelledError:
            with self._lock:
                self._limit = self._next
                running = self._active > 0
                if running:
                    self._waiter = self._loop.create_future()
                else:
                    self._open_lane = None  # lanes still queued will find nothing to do
                waiter = self._waiter
            while running and not waiter.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.shield(waiter)
            raise
        if self._errors:
            raise self._errors[0]
        return self._results  # type: ignore[return-value]  # every item ran
