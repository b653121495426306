"""Deadlines of tier jobs: a watch thread that notices a job past its deadline.

No tier I/O may wait forever (a hung NFS or FUSE mount, a stopped server, a plugin that blocks).
Every store, promotion, existence check and delete a manager submits is *armed* here with its
tier's ``io_timeout_s``; if the job has not finished by then, the watch calls back (on its own
thread), and the manager queues a :class:`JobTimedOut` result for the job, which is applied on
the caller's thread like any result: the job counts as failed, its keys are misses, and the tier
is *stalled* until the job's I/O really returns.

The watch runs on a thread of its own, not on the I/O loop, so it notices a job even when a
misbehaving backend blocks the loop itself. A finished job disarms its entry, which drops the
callback (and with it every reference to the job's buffers) at once.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["DeadlineWatch", "JobTimedOut", "Timer"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobTimedOut:
    """The result queued for a job whose deadline passed before its I/O returned."""

    tier: str
    kind: str
    timeout_s: float


class Timer:
    """One armed deadline; :meth:`cancel` drops its callback."""

    __slots__ = ("callback", "deadline_s")

    def __init__(self, deadline_s: float, callback: Callable[[], None]) -> None:
        self.deadline_s = deadline_s
        self.callback: Callable[[], None] | None = callback

    def cancel(self) -> None:
        self.callback = None


class DeadlineWatch:
    """Calls each armed callback once its deadline (``time.monotonic()`` seconds) has passed,
    unless it was cancelled; one daemon thread, started at the first :meth:`arm`."""

    def __init__(self, name: str = "tiering-deadlines") -> None:
        self._name = name
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Timer]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def arm(self, timeout_s: float, callback: Callable[[], None]) -> Timer:
        """Call ``callback`` (on the watch thread) ``timeout_s`` from now unless cancelled."""
        timer = Timer(time.monotonic() + timeout_s, callback)
        with self._cond:
            if self._closed:
                timer.cancel()
                return timer
            heap = self._heap
            if len(heap) > 1024 and len(heap) > 2 * self._live():
                # Mostly cancelled entries (jobs that finished in time): drop them.
                heap[:] = [e for e in heap if e[2].callback is not None]
                heapq.heapify(heap)
            heapq.heappush(heap, (timer.deadline_s, next(self._order), timer))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            elif heap[0][2] is timer:
                self._cond.notify()  # an earlier deadline than the one the thread waits for
        return timer

    def _live(self) -> int:
        return sum(1 for e in self._heap if e[2].callback is not None)

    def _run(self) -> None:
        heap = self._heap
        while True:
            with self._cond:
                while not self._closed:
                    while heap and heap[0][2].callback is None:
                        heapq.heappop(heap)
                    if not heap:
                        self._cond.wait()
                        continue
                    wait_s = heap[0][0] - time.monotonic()
                    if wait_s <= 0:
                        break
                    self._cond.wait(wait_s)
                if self._closed:
                    return
                timer = heapq.heappop(heap)[2]
                callback, timer.callback = timer.callback, None
            if callback is not None:
                try:
                    callback()
                except Exception:  # the watch must outlive any callback
                    logger.exception("a tiering deadline callback failed")

    def close(self, wait: bool = True) -> None:
        """Stop the thread (``wait``: and join it); armed deadlines never fire. Idempotent."""
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
        thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
