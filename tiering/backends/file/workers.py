"""The file backend's threads: its own pool, where all blocking I/O runs, and the count of
operations in flight that ``close`` waits for.

Concurrency and cancellation
    The index and the free list live on the event loop; threads only move bytes. A cancelled
    put waits for its in-flight writes (it never reads the caller's buffers after it returns),
    then drops them: each key keeps its earlier state. A cancelled get waits for its in-flight
    reads for the same reason. ``close`` waits for every operation, including background
    header zeroing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

from tiering.backends.file.buffers import Job
from tiering.backends.lanes import run_in_lanes

_T = TypeVar("_T")


async def wait_all(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Wait for the futures without raising their errors (a cancellation still propagates)."""
    if futures:
        await asyncio.wait(futures)


async def wait_through_cancellation(futures: Sequence[asyncio.Future[Any]]) -> None:
    """Wait until every future is done, even if the waiting task is cancelled meanwhile."""
    pending = [f for f in futures if not f.done()]
    while pending:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait(pending)
        pending = [f for f in pending if not f.done()]


class IoWorkers:
    """A pool of ``io_threads`` threads (from :meth:`start` to :meth:`shutdown`) and the
    operations in flight on it; ``on_op_end`` runs each time one ends."""

    __slots__ = ("io_threads", "pool", "_idle", "_active_ops", "_on_op_end")

    def __init__(self, io_threads: int, on_op_end: Callable[[], None]) -> None:
        self.io_threads = io_threads
        self.pool: ThreadPoolExecutor | None = None
        self._idle: asyncio.Event | None = None
        self._active_ops = 0
        self._on_op_end = on_op_end

    def start(self) -> None:
        self.pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="tiering-file")
        self._idle = asyncio.Event()
        self._idle.set()
        self._active_ops = 0

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    async def wait_idle(self) -> None:
        """Until no operation is in flight."""
        assert self._idle is not None
        await self._idle.wait()

    # -- running work on the threads -------------------------------------------------------------

    def submit(self, fn: Callable[..., _T], *args: Any) -> asyncio.Future[_T]:
        """Run ``fn(*args)`` on the pool, not waited for here."""
        assert self.pool is not None
        return asyncio.wrap_future(self.pool.submit(fn, *args))

    async def call(self, fn: Callable[..., _T], *args: Any) -> _T:
        (result,) = await self.run_tasks([(fn, args)])
        return result

    async def run_tasks(self, tasks: list[tuple[Callable[..., _T], tuple[Any, ...]]]) -> list[_T]:
        """Run tasks on the pool; if cancelled, cancel those not started and wait for the rest.

        Waiting matters: a running task may be reading from or writing into caller buffers, or
        using the fd that close() would release.
        """
        assert self.pool is not None
        if not tasks:
            return []
        raw: list[Future[_T]] = [self.pool.submit(fn, *args) for fn, args in tasks]
        futures = [asyncio.wrap_future(f) for f in raw]
        try:
            await asyncio.wait(futures)
        except asyncio.CancelledError:
            for f in raw:
                f.cancel()
            await wait_through_cancellation(futures)
            raise
        return [f.result() for f in futures]

    async def run_jobs(
        self,
        work: Callable[[int, list[Job]], list[BaseException | None]],
        jobs: list[Job],
        step: int,
        max_lanes: int,
    ) -> list[BaseException | None]:
        """Run ``work(index, chunk)`` on chunks of ``step`` jobs; one result per job, in order.

        Up to ``max_lanes`` lanes share the chunks, in order, each taking the next one free
        (:func:`tiering.backends.lanes.run_in_lanes`): one thread hand-off per lane rather than
        per chunk, and one loop wake-up per call. Each hand-off costs the I/O threads the GIL
        while the loop thread wakes up, and per chunk that was ~10% of a put into the page
        cache. If the caller is cancelled, the lanes stop before their next chunk and this
        waits for them.
        """
        assert self.pool is not None
        chunks = [jobs[start : start + step] for start in range(0, len(jobs), step)]

        def run_chunk(index: int) -> list[BaseException | None]:
            return work(index, chunks[index])

        parts = await run_in_lanes(
            self.pool, max_lanes, len(chunks), lambda: contextlib.nullcontext(run_chunk)
        )
        return [error for part in parts for error in part]

    # -- operations in flight --------------------------------------------------------------------

    @contextlib.contextmanager
    def operation(self) -> Iterator[None]:
        self.begin_op()
        try:
            yield
        finally:
            self.end_op()

    def begin_op(self) -> None:
        assert self._idle is not None
        self._active_ops += 1
        self._idle.clear()

    def end_op(self) -> None:
        assert self._idle is not None
        self._active_ops -= 1
        self._on_op_end()
        if self._active_ops == 0:
            self._idle.set()
