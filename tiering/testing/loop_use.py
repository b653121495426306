"""Whether a coroutine leaves the event loop free, measured without a clock a busy machine can
stretch.

A wall-clock bound ("the loop never stalls more than 10 ms") fails whenever the machine is busy:
a descheduled thread stalls everything, whoever blocks. :func:`measure_loop_use` measures two
things that load does not change instead:

* ``ticks``: how many times a task beside the call ran while the call was in flight. A call
  that never yields gives 0, however long it takes.
* ``loop_cpu_s`` and ``process_cpu_s``: the CPU time of the event loop's thread, and of the whole
  process, while the call ran (``CLOCK_THREAD_CPUTIME_ID``, ``CLOCK_PROCESS_CPUTIME_ID``). CPU
  time only counts while a thread runs, so waiting for a CPU does not count. A call that moves
  and checksums its bytes on the loop's thread spends its CPU time there; one that hands the
  work to threads of its own leaves the loop a small share of it.

``LoopUse.assert_loop_free`` checks both: at least one tick, and at most ``max_loop_share`` of
the CPU time on the loop. The garbage collector is paused during the call, so that a collection
on the loop thread does not count against the call.
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
_ENOUGH_TICKS = 3  # a few prove the point; more would spend the loop's CPU on the probe


@dataclass(frozen=True)
class LoopUse:
    """What :func:`measure_loop_use` saw while the call was in flight."""

    ticks: int
    loop_cpu_s: float
    process_cpu_s: float

    @property
    def loop_share(self) -> float:
        """The loop thread's share of the process's CPU time during the call."""
        return self.loop_cpu_s / self.process_cpu_s if self.process_cpu_s > 0 else 0.0

    def assert_loop_free(self, what: str, *, max_loop_share: float = 0.5) -> None:
        assert self.ticks > 0, f"{what}: the event loop ran nothing else while the call ran"
        assert self.loop_share <= max_loop_share, (
            f"{what}: {self.loop_cpu_s * 1e3:.1f} ms of the call's "
            f"{self.process_cpu_s * 1e3:.1f} ms of CPU ran on the event loop's thread "
            f"({self.loop_share:.0%}; at most {max_loop_share:.0%}): the work blocks the loop"
        )


async def measure_loop_use(call: Callable[[], Awaitable[_T]]) -> tuple[_T, LoopUse]:
    """Await ``call()`` with a task beside it; return its result and what :class:`LoopUse` saw."""
    in_flight = False
    ticks = 0

    async def beside() -> None:
        nonlocal ticks
        while in_flight and ticks < _ENOUGH_TICKS:
            ticks += 1
            await asyncio.sleep(0)

    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        in_flight = True
        task = asyncio.ensure_future(beside())
        loop_start, process_start = time.thread_time(), time.process_time()
        try:
            result = await call()
        finally:
            loop_cpu_s = time.thread_time() - loop_start
            process_cpu_s = time.process_time() - process_start
            in_flight = False
            await task
    finally:
        if gc_was_enabled:
            gc.enable()
    return result, LoopUse(ticks, loop_cpu_s, process_cpu_s)
