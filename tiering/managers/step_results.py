"""When the results of tier jobs apply: on the caller's thread, in submission order.

A finished job only enqueues its result (:mod:`tiering.managers.job_runner`); it is applied on the
caller's thread, so all metadata is touched by one thread and no locks sit on the hot path.
Standalone, results apply at the start of each protocol call; step-driven, only at a step
boundary (``on_schedule_end``: the jobs of earlier steps only), so a given sequence of calls
gives the same answers on every run once each step's I/O is done. Applying a job's result is its
``on_done`` (the collaborator that started it), except for a timeout or a late result
(:mod:`tiering.managers.stalls`); then the promotions waiting for a job slot get their turn.

Waiting works in rounds, each a step boundary with its I/O drained: submit the promotion
batches, wait until every job in flight has finished, apply all their results in submission
order (:meth:`StepResults.wait_idle`, blocking; :meth:`StepResults.drain`, asyncio). So the same
calls give the same state afterwards, however the I/O thread was scheduled.
"""

from __future__ import annotations

import asyncio
import time

from tiering.errors import TieringError
from tiering.managers.deadline import JobTimedOut
from tiering.managers.job_runner import TierJobs, late_result
from tiering.managers.promotions import Promotions
from tiering.managers.stalls import StalledJobs

__all__ = ["StepResults"]


class StepResults:
    """Applies the results of ``jobs`` (see the module docstring)."""

    def __init__(self, jobs: TierJobs, promotions: Promotions, stalls: StalledJobs) -> None:
        self.jobs = jobs
        self.promotions = promotions
        self.stalls = stalls

    def process_finished(self, before_epoch: int | None = None) -> None:
        """Apply the results of finished jobs on the caller's thread, in submission order; with
        ``before_epoch``, only those of jobs submitted before that step."""
        jobs = self.jobs
        jobs.collect()
        if jobs.done:
            in_flight, stalls = jobs.in_flight, self.stalls
            for on_done, job, result in jobs.take_ready(before_epoch):
                in_flight.discard(job)
                if type(result) is JobTimedOut:
                    stalls.apply_timeout(job, on_done, result)
                elif on_done is late_result:
                    stalls.late_done(job, result)
                else:
                    on_done(job, result)
        if self.promotions.waiting:
            self.promotions.start_waiting()

    def step(self) -> None:
        """A step boundary: apply every finished result, submit every promotion batch."""
        self.process_finished()
        self.promotions.flush()

    def idle(self) -> bool:
        """No job in flight, no promotion batch or waiting promotion."""
        return not self.jobs.in_flight and self.promotions.idle()

    def wait_idle(self, timeout: float | None) -> None:
        """Block, in rounds, until :meth:`idle` (``TimeoutError`` after ``timeout`` s)."""
        if self.jobs.io.in_loop_thread():
            raise TieringError("wait_idle() would deadlock on the I/O loop thread")
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        while True:
            self.promotions.flush()
            self.jobs.collect(block_until_all=deadline)
            self.process_finished()
            if self.idle():
                return

    async def drain(self) -> None:
        """Wait, in rounds, until :meth:`idle`, without blocking the event loop."""
        jobs = self.jobs
        while True:
            self.promotions.flush()
            jobs.collect()
            while jobs.uncollected() > 0:
                await self.wait_any()
                jobs.collect()
            self.process_finished()
            if self.idle():
                return

    async def wait_any(self) -> None:
        """Wait until a job in flight finishes (its result is queued by then)."""
        futures = self.jobs.futures()
        if futures:
            await asyncio.wait(
                [asyncio.wrap_future(f) for f in futures], return_when=asyncio.FIRST_COMPLETED
            )
        else:
            await asyncio.sleep(0)
