"""The manager's side of tier-job deadlines: timed-out jobs, stalled tiers, late results.

Each store, promotion, existence check and delete the manager submits is armed with its tier's
``io_timeout_s`` (:class:`~tiering.managers.deadline.DeadlineWatch`). Whichever comes first, the
job's I/O returning or its deadline passing, *claims* the job (under one lock) and queues the
job's result, or a :class:`~tiering.managers.deadline.JobTimedOut`
(:mod:`tiering.managers.job_runner`); both are applied on the caller's thread like every result
(at the next call, or at a step boundary), so the engine's calls never wait.
:class:`StalledJobs` applies the timeouts and the late results.

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

from collections.abc import Callable, Sequence

from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.deadline import JobTimedOut
from tiering.managers.event_log import EventLog
from tiering.managers.job_runner import TIMED_KINDS, OnDone, TierJobs, late_result
from tiering.managers.secondary_tier import TierJob

__all__ = ["TIMED_KINDS", "StalledJobs", "late_result"]


class StalledJobs:
    """Jobs past their deadline, and what they hold until their I/O returns (see the module
    docstring). ``promoting`` is the promotions' table of keys being promoted;
    ``release_draining`` frees the primary slots a write-back no longer copies."""

    def __init__(
        self,
        primary: CPUOffloadingManager,
        jobs: TierJobs,
        events: EventLog,
        promoting: dict[bytes, int],
        release_draining: Callable[[Sequence[int]], None],
    ) -> None:
        self.primary = primary
        self.jobs = jobs
        self.events = events
        self.promoting = promoting
        self.release_draining = release_draining
        self.stuck: set[TierJob] = set()  # timed out, I/O not returned
        self.retained: dict[TierJob, list[int]] = {}  # a timed-out promotion's primary slots

    def apply_timeout(self, job: TierJob, on_done: OnDone, outcome: JobTimedOut) -> None:
        """Apply a :class:`JobTimedOut` (caller's thread): fail the job, stall its tier."""
        tier = job.tier
        self.stuck.add(job)
        if job.kind == "open":  # it holds nothing yet: wait_ready stops waiting for it
            tier.note_slow_open(job)
            return
        gone = tier.time_out(job)
        if job.kind == "promote":
            promoting = self.promoting
            for key in job.keys:
                promoting.pop(key, None)
            # Misses now; the slots stay allocated until the read is over (late_done).
            self.retained[job] = self.primary.drop_retaining_slots(job.keys)  # type: ignore[arg-type]
        elif job.kind == "check":
            on_done(job, outcome)  # nothing known: the keys are quarantined, not promoted
        self.events.emit(tier, gone, removed=True)

    def late_done(self, job: TierJob, result: object) -> None:
        """The I/O of a timed-out job returned (caller's thread): release what it held, never
        apply its result; the tier recovers once none of its jobs is late."""
        self.stuck.discard(job)
        tier = job.tier
        if job.kind == "open":  # an open touches no primary row: it applies, late or not
            tier.finish_open(job, result)
            return
        purge, back = tier.finish_late(job, result)
        if job.kind == "store":
            self.primary.complete_load(list(job.keys))  # type: ignore[arg-type]
        elif job.kind == "write_back":
            self.release_draining(job.slots)
        elif job.kind == "promote":
            self.primary.release_slots(self.retained.pop(job, []))
        if purge is not None:
            self.jobs.submit(purge, _purge_done)
        self.events.emit(tier, back, removed=False)


def _purge_done(job: TierJob, result: object) -> None:
    """A late store's keys were deleted from the backend (or the delete failed): the tier
    forgets them."""
    job.tier.finish_purge(job)
