"""Tier jobs between their submission and the application of their results: the I/O loop they
run on, their order, their deadlines, and the queue their results come back through.

Every job the tiering manager's collaborators start (a store and its cascade, a write-back, a
promotion, an existence check, a delete) goes through :meth:`TierJobs.submit`: the job gets its
submission number and step (results apply in submission order and, step-driven, only at the
boundary of a later step), a future, and, if its kind has one, a deadline, its tier's
``io_timeout_s`` (:class:`~tiering.managers.deadline.DeadlineWatch`). Its I/O runs on a private I/O
loop thread (:class:`~tiering.managers.io_loop.IOLoop`), so no protocol call blocks on I/O.

Whichever comes first, the job's I/O returning or its deadline passing, *claims* the job (under
one lock) and queues the job's result, or a :class:`~tiering.managers.deadline.JobTimedOut`. When
the I/O of a job whose deadline passed first returns, its result is queued as *late*
(:func:`late_result`): what that means is :mod:`tiering.managers.stalls`. Nothing here applies a
result: the manager does, on its caller's thread (:mod:`tiering.managers.step_results`); a job
stays in :attr:`TierJobs.in_flight` until then.

It keeps no reference to the manager, so a dropped manager is freed at once, except while a job's
I/O runs: the coroutine holds the manager (``owner``) until the I/O returns.
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from tiering.managers.deadline import DeadlineWatch, JobTimedOut
from tiering.managers.io_loop import IOLoop
from tiering.managers.secondary_tier import TierJob

__all__ = ["TIMED_KINDS", "Finished", "OnDone", "TierJobs", "late_result"]

#: The jobs that have a deadline (closing a tier is bounded by shutdown's wait).
TIMED_KINDS = frozenset({"open", "store", "write_back", "promote", "check", "delete", "purge"})

#: What applies a job's result, on the caller's thread.
OnDone = Callable[[TierJob, Any], None]

#: A finished job as the I/O thread queues it: what applies its result, the job, the result.
Finished = tuple[OnDone, TierJob, object]


def late_result(job: TierJob, result: object) -> None:
    """The handler queued with a late result: a marker (the manager applies it with
    :meth:`~tiering.managers.stalls.StalledJobs.late_done`); a module function, so a queued
    result holds no reference to the manager."""
    raise AssertionError("a late result is applied by the manager")  # pragma: no cover


def _seq(item: Finished) -> int:
    return item[1].seq


class TierJobs:
    """The jobs a manager has submitted and not applied yet (see the module docstring).

    ``done`` and ``in_flight`` are mutated in place, never rebound: the manager's hot path keeps
    them. ``epoch`` is the manager's step (``on_schedule_end`` calls so far)."""

    def __init__(self, owner: object = None) -> None:
        self.io = IOLoop()
        self.deadlines = DeadlineWatch()
        self.claim = threading.Lock()  # the I/O thread and the watch race to finish a job
        self.finished: queue.SimpleQueue[Finished] = queue.SimpleQueue()
        self.in_flight: set[TierJob] = set()  # submitted, results not applied yet
        self.done: list[Finished] = []  # finished, not applied yet
        self.results_queued = False  # set by the I/O thread: the queue may hold results
        self.next_seq = 0
        self.epoch = 0  # step-driven: on_schedule_end calls so far
        self.closed = False  # set under the claim: no deadline fires after it
        self._owner = None if owner is None else weakref.ref(owner)

    # -- submission (caller's thread) -------------------------------------------------------------

    def submit(self, job: TierJob, on_done: OnDone) -> None:
        """Number the job, give it its future and deadline, run its I/O on the loop."""
        job.seq = self.next_seq
        job.epoch = self.epoch
        self.next_seq += 1
        self._arm(job, on_done)  # its future, and its deadline
        owner = self._owner() if self._owner is not None else None
        try:
            job.io_future = self.io.submit(self._run(job, on_done, owner))
        except BaseException:
            if job.timer is not None:
                job.timer.cancel()
            raise
        self.in_flight.add(job)

    def _arm(self, job: TierJob, on_done: OnDone) -> None:
        """Give a job being submitted its future and, if it has a deadline, arm it."""
        job.future = concurrent.futures.Future()
        if job.kind in TIMED_KINDS:
            job.timer = self.deadlines.arm(
                job.tier.io_timeout_s, functools.partial(self._deadline_passed, job, on_done)
            )

    async def _run(self, job: TierJob, on_done: OnDone, owner: object) -> None:
        """Run ``job.io`` on the I/O loop and queue its result before the job's future completes
        (so a caller that sees the future done finds the result queued); a result past the
        job's deadline is queued as late. ``owner`` (the manager) lives until the I/O returns."""
        try:
            result: object = await job.io
        except BaseException as exc:  # the tiers return their failures; queue anything else too
            self._queue_result(job, on_done, exc)
            raise
        self._queue_result(job, on_done, result)

    # -- finishing (I/O thread, watch thread) ------------------------------------------------------

    def _queue_result(self, job: TierJob, on_done: OnDone, result: object) -> None:
        """The job's I/O returned (I/O thread): queue its result, or its late result."""
        with self.claim:
            late = job.timed_out
            job.finished = True
            if job.timer is not None:
                job.timer.cancel()  # drops the watch's reference to the job
                job.timer = None
            self.finished.put((late_result if late else on_done, job, result))
            self.results_queued = True  # after the put: the caller clears it before draining
        future = job.future
        if not late and future is not None:
            if isinstance(result, BaseException):  # what awaiting the job raised before
                future.set_exception(result)
            else:
                future.set_result(None)

    def _deadline_passed(self, job: TierJob, on_done: OnDone) -> None:
        """The watch thread: the job is past its deadline, unless its I/O returned first."""
        with self.claim:
            if job.finished or self.closed:
                return
            job.timed_out = True
            job.timer = None
            outcome = JobTimedOut(job.tier.name, job.kind, job.tier.io_timeout_s)
            self.finished.put((on_done, job, outcome))
            self.results_queued = True
        if job.future is not None:
            job.future.set_result(None)  # settled: job.timed_out says how

    # -- collecting (caller's thread) --------------------------------------------------------------

    def collect(self, block_until_all: float | None = None) -> None:
        """Move finished jobs from the I/O thread's queue to ``done``. With ``block_until_all``
        (a deadline, or ``inf``), wait until every job in flight is there."""
        finished, done = self.finished, self.done
        self.results_queued = False  # before draining: a result queued later sets it again
        while not finished.empty():  # cheap when idle: no exception per protocol call
            done.append(finished.get_nowait())
        if block_until_all is None:
            return
        while self.uncollected() > 0:
            remaining = block_until_all - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.uncollected()} tiering job(s) still in flight")
            try:
                done.append(finished.get(timeout=min(remaining, 3600.0)))
            except queue.Empty:
                continue

    def uncollected(self) -> int:
        """Jobs submitted whose result (or timeout) is not in ``done`` yet."""
        return len(self.in_flight) - sum(1 for entry in self.done if entry[0] is not late_result)

    def take_ready(self, before_epoch: int | None = None) -> list[Finished]:
        """The collected results to apply now, in submission order, taken out of ``done``; with
        ``before_epoch``, only those of jobs submitted before that step."""
        done = self.done
        if before_epoch is None:
            ready = done[:]
            done.clear()
        else:
            ready = [d for d in done if d[1].epoch < before_epoch]
            done[:] = [d for d in done if d[1].epoch >= before_epoch]
        ready.sort(key=_seq)
        return ready

    def futures(self) -> list[concurrent.futures.Future[Any]]:
        """The futures of the jobs in flight not settled yet."""
        return [j.future for j in self.in_flight if j.future is not None and not j.future.done()]

    # -- closing ---------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the deadlines (none fires after this) and the I/O loop; forget every job."""
        with self.claim:  # no deadline fires into a closed manager
            self.closed = True
        self.deadlines.close()
        self.io.close()
        self.in_flight.clear()
        self.done.clear()

    def abandon(self, io_open: bool) -> None:
        """The manager was dropped without a shutdown: stop without waiting for anything."""
        if io_open:
            self.io.close(timeout=0)
        self.deadlines.close(wait=False)
