"""A secondary tier's side of job deadlines: its *stall*.

A job past its tier's ``io_timeout_s`` counts as failed: its keys are misses (a store's stay in
the index, *stuck*, until they are purged from the backend), and the tier is *stalled* until
the I/O of every such job has returned: meanwhile it answers every key absent, takes no store
and starts no promotion. :class:`TierStall` keeps the jobs past their deadline, counts the
timeouts into the tier's metrics and logs a stall once, and its end. The manager's side (arming
deadlines, claiming results) is :mod:`tiering.managers.stalls`.
"""

from __future__ import annotations

import logging

from tiering.managers.tier_index import TierIndex
from tiering.managers.tier_jobs import TierJob
from tiering.managers.tier_stats import TierMetrics

__all__ = ["TierStall"]

# The tier's warnings, under the tier's logger (operators filter on it).
logger = logging.getLogger("tiering.managers.secondary_tier")


class TierStall:
    """The jobs of tier ``name`` past their deadline whose I/O has not returned (``jobs``: the
    tier is stalled while it is not empty)."""

    __slots__ = ("_io_timeout_s", "_name", "jobs")

    def __init__(self, name: str, io_timeout_s: float) -> None:
        self._name = name
        self._io_timeout_s = io_timeout_s
        self.jobs: set[TierJob] = set()

    def time_out(self, job: TierJob, index: TierIndex, metrics: TierMetrics) -> bool:
        """``job`` ran past the deadline: count it failed (its keys too), make a store's keys
        stuck, and hold it until :meth:`end`. Returns whether this stalled the tier."""
        metrics.timed_out_jobs += 1
        if job.kind in ("store", "write_back"):
            metrics.store_failures += len(job.keys)
            index.writing.difference_update(job.keys)
            index.stuck.update(job.keys)
        elif job.kind == "promote":
            metrics.promotion_failures += len(job.keys)
        jobs = self.jobs
        jobs.add(job)
        if len(jobs) > 1:
            return False
        metrics.stalls += 1
        logger.warning(
            "tier %r stalled: a %s job of %d blocks ran past io_timeout_s=%gs; its blocks are "
            "misses, and the tier serves and takes nothing until its I/O returns",
            self._name,
            job.kind,
            len(job.keys),
            self._io_timeout_s,
        )
        return True

    def end(self, job: TierJob) -> bool:
        """The I/O of a timed-out ``job`` returned. Returns whether that ended the stall."""
        self.jobs.discard(job)
        if self.jobs:
            return False
        logger.warning("tier %r recovered: its stalled I/O returned", self._name)
        return True

    def note_slow_open(self, metrics: TierMetrics) -> None:
        """Opening the backend took longer than the deadline (counted and logged; no stall)."""
        metrics.timed_out_jobs += 1
        logger.warning(
            "tier %r is still opening after io_timeout_s=%gs (a slow or hung mount, or a large "
            "index to recover); it serves nothing until it is open, the other tiers go on",
            self._name,
            self._io_timeout_s,
        )
