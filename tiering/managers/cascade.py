"""Stores cascading from the primary tier to the secondary tiers, and write-backs.

A completed primary store cascades to each tier by its write policy (``write_through``: every
block made ready; ``write_through_selective``: the blocks looked up often enough; ``write_back``:
none yet). The tier decides what to write, reserves room and builds the job
(:meth:`~tiering.managers.secondary_tier.SecondaryTier.start_store`); the cascade emits what the
tier evicted for it, pins the primary rows the job reads and submits it. A primary block held for
a tier's write is released when *that* tier finishes: each tier's job holds its own pin.

A write-back tier is written when the primary evicts a dirty block (:meth:`StoreCascade.
on_primary_evict`, the primary's eviction hook): the evicted slots stay allocated (*draining*)
until every write-back job copying them is done. A write that found the backend full gets one
retry job from its tier (room made); the retry keeps the hold of the job it retries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

import cachetools

from tiering.core.keys import OffloadKey
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.event_log import EventLog
from tiering.managers.job_runner import TierJobs
from tiering.managers.secondary_tier import SecondaryTier, TierJob, WritePolicy

__all__ = ["StoreCascade"]


class StoreCascade:
    """Store and write-back jobs of the tiers below one primary (see the module docstring)."""

    def __init__(
        self,
        primary: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        jobs: TierJobs,
        events: EventLog,
        lookup_counts: cachetools.LRUCache[bytes, int],
    ) -> None:
        self.primary = primary
        self.tiers = tiers
        self.jobs = jobs
        self.events = events
        self.lookup_counts = lookup_counts  # what write_through_selective tiers go by
        self.write_back_tiers = [t for t in tiers if t.write_policy is WritePolicy.WRITE_BACK]
        self.draining: dict[int, int] = {}  # primary slot -> write-back jobs still copying it
        if self.write_back_tiers:
            primary.set_eviction_hook(self.on_primary_evict)

    def store(self, ready: list[OffloadKey], req_context: object) -> None:
        """Cascade the keys a primary store made ready to every tier, by its write policy."""
        slots = cast("Mapping[bytes, int]", self.primary.slots)
        lookup_counts = self.lookup_counts
        for tier in self.tiers:
            job = tier.start_store(
                ready, slots, lookup_counts=lookup_counts, req_context=req_context
            )
            if job is not None:
                self.run_job(job)

    def run_job(self, job: TierJob) -> None:
        """Emit what the tier evicted for the job, hold the primary rows it reads, submit it."""
        self.events.emit(job.tier, job.removed, removed=True)
        if not job.retried:  # a retry keeps the hold of the job it retries
            if job.kind == "store":
                self.primary.pin(cast("list[OffloadKey]", list(job.keys)))
            else:  # write-back: the evicted slots stay allocated until the write is done
                draining = self.draining
                for slot in job.slots:
                    draining[slot] = draining.get(slot, 0) + 1
        self.jobs.submit(job, self.store_done)

    def store_done(self, job: TierJob, result: object) -> None:
        """Apply a store or write-back job's result: publish, release the rows it held, retry."""
        outcome = job.tier.finish_store(job, result)
        self.events.emit(job.tier, outcome.stored, removed=False)
        if outcome.settled:
            if job.kind == "store":
                self.primary.complete_load(
                    cast("list[OffloadKey]", [k for k, _ in outcome.settled])
                )
            else:
                self.release_draining([slot for _, slot in outcome.settled])
        if outcome.retry is not None:
            self.run_job(outcome.retry)

    # -- write-back --------------------------------------------------------------------------------

    def on_primary_evict(
        self, victims: list[tuple[OffloadKey, int]], req_context: object
    ) -> set[int]:
        """Start writing dirty victims to their write-back tiers; keep their slots until done."""
        slots: dict[bytes, int] = dict(victims)
        retained: set[int] = set()
        for tier in self.write_back_tiers:
            job = tier.start_write_back(slots, req_context=req_context)
            if job is not None:
                retained.update(job.slots)
                self.run_job(job)
        return retained

    def release_draining(self, slots: Sequence[int]) -> None:
        """Write-back jobs are done with ``slots``: free those no other job still copies."""
        free = []
        for slot in slots:
            left = self.draining[slot] - 1
            if left:
                self.draining[slot] = left
            else:
                del self.draining[slot]
                free.append(slot)
        self.primary.release_slots(free)
