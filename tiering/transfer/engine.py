"""The transfer engine: one object per rank that moves blocks between its KV caches and the pool.

``submit_store(job)`` and ``submit_load(job)`` validate the whole job on the calling thread
(a bad job is a typed error and nothing is submitted), start its copy and return a
:class:`TransferHandle` at once. ``poll()`` returns the handles that finished since the last
call and never waits; ``wait(handle)`` blocks until one has finished (for tests and shutdown).
Every finished handle is reported exactly once, by ``poll()`` or by ``wait()``. One thread
drives an engine (submits, polls, waits); the engine's own threads only run copies.

Where copies run
----------------
* CUDA caches: stores and loads each have a dedicated CUDA stream, so loads never queue behind
  stores. Submitting makes the direction's stream wait (on the device) for the caller's current
  stream: a store's copies start only after the compute already queued there has written its
  blocks, and a load's copies only after the compute queued there is done with the blocks it
  overwrites. Completion is a CUDA event recorded after the copies; ``poll()`` queries events.
  Submit never waits on the host and the engine never calls ``torch.cuda.synchronize()``.
  A load's copies are enqueued on the calling thread (a request waits for them: nothing may
  come between). A store's are enqueued on the store lane's thread, after an event recorded
  on the caller's stream at submit, so the caller is held only for validating and planning
  the job: enqueueing 256 blocks costs 1-2 ms with the Triton kernel and 14 ms with
  ``cuMemcpyBatchAsync`` on an H100 (docs/gpu-check.md), none of which a store should take
  from the engine's step.
* CPU caches: stores and loads each have one worker thread, in submission order; the copy
  (``memmove``, which releases the GIL) runs there, so the caller is not held for the length
  of a copy. Handles behave the same way on both.

Within a direction, jobs complete in submission order. Between directions there is no order:
the scheduler never stores and loads the same block or slot at once.

How an engine uses a load
-------------------------
A loaded block must not be read before its load has completed. Either schedule the request
only once ``poll()`` has reported the load's handle (what vLLM's scheduler does with
``complete_load``), or, on CUDA, call ``handle.make_stream_wait()`` before queueing the
compute that reads the blocks: the compute stream then waits for the load's event on the
device, and the host never waits. The blocks a store reads must stay untouched (not freed, not
reused) until its handle finishes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tiering.core.layout import CanonicalKVCaches
from tiering.errors import BackendError, ConfigurationError
from tiering.managers.pool import CPUBlockPool
from tiering.transfer.plan import (
    NULL_BLOCK_ID,
    CopyPlan,
    PoolGeometry,
    PoolTransfer,
    TransferPlanner,
    TransferResult,
)
from tiering.transfer.select import StrategyChoice, StrategyOptions, make_strategy
from tiering.transfer.strategy import CopyBackend, CopyStrategy, Direction

__all__ = ["Direction", "TransferEngine", "TransferHandle"]

logger = logging.getLogger(__name__)


class TransferHandle:
    """One submitted job: what it moves, and (once finished) how it went.

    ``result`` is known at submission (blocks really copied, null blocks skipped, bytes).
    ``done`` turns true when the engine has seen the copy finish (in ``poll`` or ``wait``);
    ``error`` is then ``None``, or the exception the copy raised. ``copy_s`` is the time the
    copy took on its stream or thread.
    """

    def __init__(
        self,
        job_id: int,
        direction: Direction,
        result: TransferResult,
        *,
        start: torch.cuda.Event | None = None,
        end: torch.cuda.Event | None = None,
        device: torch.device | None = None,
        future: Future[float] | None = None,
        keepalive: object = None,
        error: BaseException | None = None,
        enqueued: Future[tuple[object, BaseException | None]] | None = None,
    ) -> None:
        self.job_id = job_id
        self.direction: Direction = direction
        self.result = result
        self.done = False
        self.error = error
        self.copy_s: float | None = None
        self._start = start
        self._end = end
        self._device = device
        self._future = future
        self._keepalive = keepalive  # tables and buffers the queued copies still read
        self._enqueued = enqueued  # a CUDA store being enqueued on its lane's thread
        self._reported = False

    @property
    def bytes(self) -> int:
        return self.result.bytes_copied

    @property
    def engine_blocks_copied(self) -> int:
        return self.result.engine_blocks_copied

    @property
    def ok(self) -> bool:
        """Finished without an error."""
        return self.done and self.error is None

    def make_stream_wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make ``stream`` (default: the current stream) wait on the device until this transfer
        has finished; returns at once. CUDA transfers only."""
        if self._end is None:
            raise ConfigurationError(
                f"job {self.job_id} copies CPU caches on a thread: it has no CUDA event to wait "
                "on; use the engine's poll() or wait()"
            )
        # A store enqueued on its lane's thread: its event means something once recorded (an
        # event never recorded is complete at once). Loads are enqueued at submit.
        self._take_enqueued(block=True)
        (stream or torch.cuda.current_stream(self._device)).wait_event(self._end)

    def _take_enqueued(self, block: bool) -> bool:
        """Whether the copies are enqueued (taking the lane thread's outcome once)."""
        enqueued = self._enqueued
        if enqueued is None:
            return True
        if not block and not enqueued.done():
            return False
        try:
            self._keepalive, error = enqueued.result()
        except Exception as exc:  # the thread could not even record the events
            self._keepalive, error = None, exc
        self.error = self.error or error
        self._enqueued = None
        return True

    def _query(self) -> bool:
        """Whether the copy has finished; records the outcome once. Never waits."""
        if self.done:
            return True
        if not self._take_enqueued(block=False):
            return False
        try:
            if self._future is not None:
                if not self._future.done():
                    return False
            elif self._end is not None and not self._end.query():
                return False
        except Exception as exc:  # a CUDA error surfaces here, at the event
            self._finish(exc)
            return True
        self._finish(None)
        return True

    def _wait(self) -> None:
        if self.done:
            return
        self._take_enqueued(block=True)
        try:
            if self._future is not None:
                self._future.exception()
            elif self._end is not None:
                self._end.synchronize()
        except Exception as exc:
            self._finish(exc)
            return
        self._finish(None)

    def _finish(self, error: BaseException | None) -> None:
        if self._future is not None:
            error = error or self._future.exception()
            if error is None:
                self.copy_s = self._future.result()
        elif self._start is not None and self._end is not None and error is None:
            try:
                self.copy_s = self._start.elapsed_time(self._end) / 1e3
            except RuntimeError as exc:
                error = exc
        self.error = self.error or error
        self.done = True
        self._keepalive = None

    def __repr__(self) -> str:
        state = "running" if not self.done else ("failed" if self.error else "done")
        return (
            f"TransferHandle(job_id={self.job_id}, {self.direction}, "
            f"{self.result.engine_blocks_copied} blocks, {self.bytes} bytes, {state})"
        )


class _Lane:
    """One direction's queue of handles, and where its copies run."""

    def __init__(self, direction: Direction, strategy: CopyStrategy) -> None:
        self.direction: Direction = direction
        self.strategy = strategy
        self.handles: deque[TransferHandle] = deque()
        device = strategy.geometry.device
        self._device = device
        self._stream: torch.cuda.Stream | None = None
        self._executor: ThreadPoolExecutor | None = None
        if device.type == "cuda":
            self._stream = torch.cuda.Stream(device)
        if device.type != "cuda" or direction == "store":  # see the module docstring
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"tiering-{direction}")

    def submit(self, job_id: int, plan: CopyPlan) -> TransferHandle:
        if self._stream is None:
            assert self._executor is not None
            future = self._executor.submit(_timed_copy, self.strategy, plan)
            handle = TransferHandle(job_id, self.direction, plan.result, future=future)
            self.handles.append(handle)
            return handle
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        caller = torch.cuda.current_stream(self._device)
        keepalive: object = None
        error: BaseException | None = None
        enqueued = None
        if self._executor is None:
            self._stream.wait_stream(caller)
            keepalive, error = self._enqueue(plan, start, end)
        else:
            ready = torch.cuda.Event()
            ready.record(caller)  # what the caller queued before submitting comes first
            enqueued = self._executor.submit(self._enqueue, plan, start, end, ready)
        handle = TransferHandle(
            job_id,
            self.direction,
            plan.result,
            start=start,
            end=end,
            device=self._device,
            keepalive=keepalive,
            error=error,
            enqueued=enqueued,
        )
        self.handles.append(handle)
        return handle

    def _enqueue(
        self,
        plan: CopyPlan,
        start: torch.cuda.Event,
        end: torch.cuda.Event,
        ready: torch.cuda.Event | None = None,
    ) -> tuple[object, BaseException | None]:
        """Queue the copies on the lane's stream between ``start`` and ``end``: what the
        strategy keeps alive, and the error it raised (the events still order the stream)."""
        stream = self._stream
        assert stream is not None
        keepalive: object = None
        error: BaseException | None = None
        with torch.cuda.device(self._device), torch.cuda.stream(stream):
            if ready is not None:
                stream.wait_event(ready)
            start.record(stream)
            try:
                keepalive = self.strategy.copy(plan)
            except Exception as exc:
                error = exc
            end.record(stream)
        return keepalive, error

    def finished(self) -> list[TransferHandle]:
        """Handles finished since the last call, in order; never waits."""
        out = []
        while self.handles and self.handles[0]._query():
            handle = self.handles.popleft()
            if not handle._reported:
                handle._reported = True
                out.append(handle)
        return out

    def prune(self) -> None:
        """Drop finished handles already reported by ``wait()`` from the front of the queue."""
        while self.handles and self.handles[0].done and self.handles[0]._reported:
            self.handles.popleft()

    def drain(self) -> None:
        """Wait for every handle in flight (errors stay on the handles)."""
        for handle in self.handles:
            handle._wait()

    def close(self) -> None:
        self.drain()
        for handle in self.handles:
            if handle.error is not None and not handle._reported:
                logger.warning("%r was never collected and failed: %s", handle, handle.error)
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _timed_copy(strategy: CopyStrategy, plan: CopyPlan) -> float:
    start = time.perf_counter()
    strategy.copy(plan)
    return time.perf_counter() - start


class TransferEngine:
    """Moves blocks of one rank's registered KV caches into and out of a :class:`CPUBlockPool`.

    The pool's ``block_bytes`` must equal the caches' offloaded block bytes per rank; this rank
    writes only its part of each row. Null block ids (``null_block_id``) are skipped in
    sliding-window and Mamba groups. ``copy_backend`` picks the copy strategy (``"auto"``: the
    fastest that works here; see :mod:`tiering.transfer.select`); ``store_copy_backend``, when
    given, picks another one for stores: ``"batched_memcpy"`` (the GPU's copy engine) leaves
    the SMs to the engine's kernels, at the price of store bandwidth and of a longer enqueue
    on the store lane's thread (H100 figures in docs/gpu-check.md). ``strategy`` (loads) and
    ``store_strategy`` say which were chosen and why. See the module docstring for streams,
    threads and completion.
    """

    def __init__(
        self,
        caches: CanonicalKVCaches,
        pool: CPUBlockPool,
        *,
        rank: int = 0,
        block_size_factor: int | None = None,
        null_block_id: int = NULL_BLOCK_ID,
        copy_backend: CopyBackend = "auto",
        options: StrategyOptions | None = None,
        store_copy_backend: CopyBackend | None = None,
    ) -> None:
        geometry = PoolGeometry.of(caches, pool, rank, block_size_factor)
        self._planner = TransferPlanner(geometry, null_block_id=null_block_id)
        load, load_choice = make_strategy(geometry, copy_backend, options)
        if store_copy_backend is None or store_copy_backend == copy_backend:
            store, _ = make_strategy(geometry, load_choice.name, options)
            store_choice = load_choice
        else:
            store, store_choice = make_strategy(geometry, store_copy_backend, options)
        #: The copy strategy of loads (and of stores unless ``store_copy_backend`` names
        #: another) and why it was chosen.
        self.strategy: StrategyChoice = load_choice
        #: The stores' copy strategy and why.
        self.store_strategy: StrategyChoice = store_choice
        self._lanes: dict[Direction, _Lane] = {
            "store": _Lane("store", store),
            "load": _Lane("load", load),
        }
        self._job_ids = itertools.count()
        self._closed = False

    @property
    def geometry(self) -> PoolGeometry:
        return self._planner.geometry

    @property
    def block_size_factor(self) -> int:
        return self.geometry.block_size_factor

    @property
    def in_flight(self) -> int:
        """Submitted handles not yet reported by ``poll()`` or ``wait()``."""
        return sum(1 for lane in self._lanes.values() for h in lane.handles if not h._reported)

    def submit_store(self, job: PoolTransfer, *, job_id: int | None = None) -> TransferHandle:
        """Start copying engine blocks into pool slots; returns at once.

        Validates the whole job first: :class:`LayoutError` (or :class:`BackendError` for a
        closed pool or engine) and nothing submitted if it is bad.
        """
        return self._submit("store", job, job_id)

    def submit_load(self, job: PoolTransfer, *, job_id: int | None = None) -> TransferHandle:
        """Start copying pool slots into engine blocks; returns at once (see submit_store)."""
        return self._submit("load", job, job_id)

    def _submit(
        self, direction: Direction, job: PoolTransfer, job_id: int | None
    ) -> TransferHandle:
        if self._closed:
            raise BackendError("the transfer engine is closed")
        plan = self._planner.plan(job, to_pool=direction == "store")
        return self._lanes[direction].submit(
            next(self._job_ids) if job_id is None else job_id, plan
        )

    def poll(self) -> list[TransferHandle]:
        """Handles that finished since the last call (stores, then loads); never waits."""
        return self._lanes["store"].finished() + self._lanes["load"].finished()

    def wait(self, handle: TransferHandle) -> TransferHandle:
        """Block until ``handle`` has finished; it is then not reported by ``poll()``."""
        lane = self._lanes[handle.direction]
        if not any(h is handle for h in lane.handles) and not handle.done:
            raise BackendError(f"{handle!r} was not submitted to this engine")
        handle._wait()
        handle._reported = True
        lane.prune()
        return handle

    def close(self) -> None:
        """Wait for every copy in flight and stop the engine's threads; idempotent. A failed copy
        that neither poll() nor wait() reported is logged."""
        if self._closed:
            return
        self._closed = True
        for lane in self._lanes.values():
            lane.close()

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"TransferEngine({self.geometry.device}, strategy={self.strategy.name!r}, "
            f"store_strategy={self.store_strategy.name!r}, "
            f"in_flight={self.in_flight}, closed={self._closed})"
        )
