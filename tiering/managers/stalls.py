"""The manager's side of tier-job deadlines: timed-out jobs, stalled tiers, late results.

:class:`JobDeadlines` is mixed into
:class:`~tiering.managers.tiering_manager.TieringOffloadingManager`.
Each store, promotion, existence check and delete the manager submits is armed with its tier's
``io_timeout_s`` (:class:`~tiering.managers.deadline.DeadlineWatch`). Whichever comes first, the
job's
I/O returning or its deadline passing, *claims* the job (under one lock) and queues the job's
result, or a :class:`~tiering.managers.deadline.JobTimedOut`; both are applied on the caller's
thread like
every result (at the next call, or at a step boundary), so the engine's calls never wait.

Opening a tier is the exception: past its deadline the tier only stops being waited for
(``wait_ready`` returns; it answers absent while it opens, as before) and, since an open touches
no primary row, its result applies whenever it comes. Any other timeout counts the job failed,
makes its keys misses (a promotion's keys leave the primary,
its slots stay allocated) and stalls the tier (:meth:`SecondaryTier.time_out`): it answers
every key absent (``locate`` never names it), takes no store, starts no promotion; removal
events announce the keys it stopped serving, a warning is logged once, ``metrics()`` reports
``stalled``. When the I/O returns, its result is *late*: never applied. What the job held is
released then, not before (a store's pinned rows, a promotion's slots, a write-back's draining
slots), so no late write lands in memory that was reused, and a late store's keys are deleted
from the backend. Once every timed-out job of the tier has returned, the tier recovers: stored
events announce its keys again.
"""

from __future__ import annotations

import concurrent.futures
import functools
import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from tiering.managers.deadline import DeadlineWatch, JobTimedOut
from tiering.managers.secondary_tier import SecondaryTier, TierJob

if TYPE_CHECKING:
    from tiering.managers.cpu_manager import CPUOffloadingManager

__all__ = ["TIMED_KINDS", "JobDeadlines", "late_result"]

#: The jobs that have a deadline (closing a tier is bounded by shutdown's wait).
TIMED_KINDS = frozenset({"open", "store", "write_back", "promote", "check", "delete", "purge"})

_OnDone = Callable[[TierJob, Any], None]


class JobDeadlines:
    """Deadlines of a manager's tier jobs (see the module docstring)."""

    # The manager's own state and methods, used here.
    primary: CPUOffloadingManager
    tiers: list[SecondaryTier]
    _finished: queue.SimpleQueue[tuple[_OnDone, TierJob, object]]
    _done: list[tuple[_OnDone, TierJob, object]]
    _jobs: set[TierJob]
    _promoting: dict[bytes, int]
    _results_queued: bool
    _closed: bool

    if TYPE_CHECKING:

        def _emit(self, tier: SecondaryTier, keys: Sequence[bytes], removed: bool) -> None: ...
        def _submit(self, job: TierJob, on_done: _OnDone) -> None: ...
        def _release_draining(self, slots: Sequence[int]) -> None: ...

    def _init_deadlines(self) -> None:
        self._deadlines = DeadlineWatch()
        self._claim = threading.Lock()  # the I/O thread and the watch race to finish a job
        self._stuck_jobs: set[TierJob] = set()  # timed out, I/O not returned
        self._retained: dict[TierJob, list[int]] = {}  # a timed-out promotion's primary slots

    def stalled_jobs(self) -> list[TierJob]:
        """Jobs past their deadline whose I/O has not returned (``job.io_future`` completes
        when it does): for tools and tests."""
        return list(self._stuck_jobs)

    def _settle_new_job(self, job: TierJob, on_done: _OnDone) -> None:
        """Give a job being submitted its future and, if it has a deadline, arm it."""
        job.future = concurrent.futures.Future()
        if job.kind in TIMED_KINDS:
            job.timer = self._deadlines.arm(
                job.tier.io_timeout_s, functools.partial(self._deadline_passed, job, on_done)
            )

    def _queue_result(self, job: TierJob, on_done: _OnDone, result: object) -> None:
        """The job's I/O returned (I/O thread): queue its result, or its late result."""
        with self._claim:
            late = job.timed_out
            job.finished = True
            if job.timer is not None:
                job.timer.cancel()  # drops the watch's reference to the job
                job.timer = None
            self._finished.put((late_result if late else on_done, job, result))
            self._results_queued = True  # after the put: the caller clears it before draining
        future = job.future
        if not late and future is not None:
            if isinstance(result, BaseException):  # what awaiting the job raised before
                future.set_exception(result)
            else:
                future.set_result(None)

    def _deadline_passed(self, job: TierJob, on_done: _OnDone) -> None:
        """The watch thread: the job is past its deadline, unless its I/O returned first."""
        with self._claim:
            if job.finished or self._closed:
                return
            job.timed_out = True
            job.timer = None
            outcome = JobTimedOut(job.tier.name, job.kind, job.tier.io_timeout_s)
            self._finished.put((on_done, job, outcome))
            self._results_queued = True
        if job.future is not None:
            job.future.set_result(None)  # settled: job.timed_out says how

    def _uncollected(self) -> int:
        """Jobs submitted whose result (or timeout) is not in ``_done`` yet."""
        return len(self._jobs) - sum(1 for entry in self._done if entry[0] is not late_result)

    def _apply_timeout(self, job: TierJob, on_done: _OnDone, outcome: JobTimedOut) -> None:
        """Apply a :class:`JobTimedOut` (caller's thread): fail the job, stall its tier."""
        tier = job.tier
        self._stuck_jobs.add(job)
        if job.kind == "open":  # it holds nothing yet: wait_ready stops waiting for it
            tier.note_slow_open(job)
            return
        gone = tier.time_out(job)
        if job.kind == "promote":
            promoting = self._promoting
            for key in job.keys:
                promoting.pop(key, None)
            # Misses now; the slots stay allocated until the read is over (_late_done).
            self._retained[job] = self.primary.drop_retaining_slots(job.keys)  # type: ignore[arg-type]
        elif job.kind == "check":
            on_done(job, outcome)  # nothing known: the keys are quarantined, not promoted
        self._emit(tier, gone, removed=True)

    def _late_done(self, job: TierJob, result: object) -> None:
        """The I/O of a timed-out job returned (caller's thread): release what it held, never
        apply its result; the tier recovers once none of its jobs is late."""
        self._stuck_jobs.discard(job)
        tier = job.tier
        if job.kind == "open":  # an open touches no primary row: it applies, late or not
            tier.finish_open(job, result)
            return
        purge, back = tier.finish_late(job, result)
        if job.kind == "store":
            self.primary.complete_load(list(job.keys))  # type: ignore[arg-type]
        elif job.kind == "write_back":
            self._release_draining(job.slots)
        elif job.kind == "promote":
            self.primary.release_slots(self._retained.pop(job, []))
        if purge is not None:
            self._submit(purge, self._purge_done)
        self._emit(tier, back, removed=False)

    def _purge_done(self, job: TierJob, result: object) -> None:
        job.tier.finish_purge(job)

    def _close_deadlines(self, wait: bool = True) -> None:
        self._deadlines.close(wait=wait)


def late_result(job: TierJob, result: object) -> None:
    """The handler queued with a late result: a marker (the manager applies it with
    :meth:`JobDeadlines._late_done`); a module function, so a queued result holds no
    reference to the manager."""
    raise AssertionError("a late result is applied by the manager")  # pragma: no cover
