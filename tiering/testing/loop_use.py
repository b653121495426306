"""Whether a coroutine leaves the event loop free, measured without a clock a busy machine can
stretch.

A wall-clock bound ("the loop never stalls more than 10 ms") fails whenever the machine is busy:
a descheduled thread stalls everything, whoever blocks. :func:`measure_loop_use` measures in
CPU time of the event loop's thread instead (``CLOCK_THREAD_CPUTIME_ID``), which only advances
while that thread runs, so waiting for a CPU, a disk or a peer never counts.

A task beside the call yields (``asyncio.sleep(0)``) over and over while the call is in flight,
and notes the loop thread's CPU time at each of its turns. The stretches between two turns (and
from the start of the call to the first, and from the last to the end) are what the loop thread
ran without letting anything else in: the call's own work between two of its awaits.

* ``ticks``: the turns the task had. A call that never yields gives 0, however long it is.
* ``longest_stretch_s`` against ``process_cpu_s``, the CPU time the whole process spent during
  the call (``CLOCK_PROCESS_CPUTIME_ID``: the call's work, wherever it ran): a call that blocks
  the loop (copies and checksums a whole batch on the loop's thread) spends nearly all of it in
  one stretch; one that hands its work to threads leaves only short stretches, and so does an
  asyncio-native backend that yields between its network round trips.

``LoopUse.assert_loop_free`` checks both: at least one tick, and no stretch longer than
``max_stretch_share`` of the call's CPU time. Neither depends on how the machine schedules
threads: a stretch counts only what the loop thread itself ran. The garbage collector is
paused during the call, so that a collection on the loop thread does not count against it.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["LoopUse", "measure_loop_use"]

_T = TypeVar("_T")


@dataclass(frozen=True)
class LoopUse:
    """What :func:`measure_loop_use` saw while the call was in flight (CPU seconds)."""

    ticks: int
    longest_stretch_s: float
    loop_cpu_s: float
    process_cpu_s: float

    @property
    def stretch_share(self) -> float:
        """The longest stretch's share of the process's CPU time during the call."""
        return self.longest_stretch_s / self.process_cpu_s if self.process_cpu_s > 0 else 0.0

    def assert_loop_free(self, what: str, *, max_stretch_share: float = 0.5) -> None:
        assert self.ticks > 0, f"{what}: the event loop ran nothing else while the call ran"
        assert self.stretch_share <= max_stretch_share, (
            f"{what}: the event loop ran {self.longest_stretch_s * 1e3:.1f} ms of CPU without "
            f"letting another task in, {self.stretch_share:.0%} of the call's "
            f"{self.process_cpu_s * 1e3:.1f} ms of CPU (at most {max_stretch_share:.0%}): the "
            "call blocks the loop"
        )


async def measure_loop_use(call: Callable[[], Awaitable[_T]]) -> tuple[_T, LoopUse]:
    """Await ``call()`` with a task beside it; return its result and what :class:`LoopUse` saw."""
    in_flight = False
    turns: list[float] = []  # the loop thread's CPU time at each turn of the task beside

    async def beside() -> None:
        while in_flight:
            turns.append(time.thread_time())
            await asyncio.sleep(0)

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        in_flight = True
        task = asyncio.ensure_future(beside())
        start, process_start = time.thread_time(), time.process_time()
        try:
            result = await call()
        finally:
            end, process_end = time.thread_time(), time.process_time()
            in_flight = False
            await task
    finally:
        if gc_was_enabled:
            gc.enable()
    points = [start, *(t for t in turns if t <= end), end]
    longest = max(b - a for a, b in zip(points, points[1:], strict=False))
    return result, LoopUse(len(points) - 2, longest, end - start, process_end - process_start)
