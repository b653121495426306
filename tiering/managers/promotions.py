"""Promotions: copying keys found only in a secondary tier into primary slots.

A lookup that finds a key only in a secondary tier starts a *promotion* and answers ``RETRY``.
A key is never promoted twice at once (:attr:`Promotions.promoting`, key -> tier index, holds
every key waiting for or in a promotion). Promotions are batched per request
(:class:`PromotionBatch`): a request's keys of one tier become one job when the batch is
submitted (:meth:`Promotions.flush`), at a step boundary, or, standalone, when another request
calls or a batched key is asked for again. A prefix or hybrid lookup standalone starts its
promotions at once (:meth:`Promotions.promote`).

A promotion reserves its keys' primary slots (evicting, but never a key the request protected
for the step: :meth:`Promotions.protect`) and reads into them; a step-driven single-key lookup
reserves the slot at lookup (:meth:`Promotions.reserve`), so its answer is exact: ``RETRY`` when
the promotion is on its way, ``MISS`` when the primary cannot make room. A promotion that finds no
room is counted (:attr:`Promotions.without_space`) unless write-backs are freeing slots: then,
like a promotion over its tier's job bound, it waits for its turn (:attr:`Promotions.waiting`);
stores over the bound are shed instead. A failed or corrupt promotion is a miss, counted and
quarantined by its tier, never retried in a loop.

The keys a request's batch holds for the shared tier go through its existence check first
(:mod:`tiering.managers.shared_checks`).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from tiering.core.keys import OffloadKey
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.event_log import EventLog
from tiering.managers.job_runner import TierJobs
from tiering.managers.protocol import request_key
from tiering.managers.secondary_tier import SecondaryTier, TierJob
from tiering.managers.shared_checks import SharedChecks

__all__ = ["PromotionBatch", "Promotions", "Waiting"]


@dataclass
class PromotionBatch:
    """Keys one request found in secondary tiers, per tier index, not submitted yet.

    ``slots`` holds the primary slot of each key reserved when it was looked up (step-driven
    single-key lookups); the other keys get theirs when the batch is submitted."""

    req_context: object
    by_tier: dict[int, list[bytes]] = field(default_factory=dict)
    slots: dict[bytes, int] = field(default_factory=dict)


#: A promotion waiting for a job slot of its tier: the context, the keys and, if reserved, their
#: primary slots.
Waiting = tuple[object, list[bytes], list[int] | None]


class Promotions:
    """The promotions into one primary from its ``tiers`` (see the module docstring).

    ``draining`` is the write-back cascade's table of slots being freed; ``shared_checks`` the
    shared tier's existence checks, if there is a shared tier (their ``promoting`` table is
    this one). ``promoting``, ``batches`` and
    ``waiting`` are mutated in place, never rebound: the manager's hot path keeps them."""

    def __init__(
        self,
        primary: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        jobs: TierJobs,
        events: EventLog,
        draining: Mapping[int, int],
        *,
        step_driven: bool,
        shared_checks: SharedChecks | None = None,
    ) -> None:
        self.primary = primary
        self.tiers = tiers
        self.jobs = jobs
        self.events = events
        self.draining = draining
        self.step_driven = step_driven
        # Key -> tier index, waiting for a job slot or in flight (shared with the checks).
        self.promoting: dict[bytes, int] = {} if shared_checks is None else shared_checks.promoting
        self.shared_checks = shared_checks
        self.shared_index = -1 if shared_checks is None else shared_checks.index
        self.batches: dict[Hashable, PromotionBatch] = {}  # by request key, not submitted
        self.batched: dict[bytes, Hashable] = {}  # key -> the request whose batch holds it
        self.waiting: dict[int, list[Waiting]] = {}  # for a job slot
        # Keys a request counts on in this step (protect): promotions never evict them.
        self.step_protected: dict[Hashable, set[bytes]] = {}
        self.without_space = 0  # keys that found no room in the primary

    def idle(self) -> bool:
        """No batch is waiting to be submitted and no promotion for a job slot."""
        return not self.batches and not self.waiting

    def clear(self) -> None:
        """Forget every promotion not submitted and every protection (a reset)."""
        self.promoting.clear()
        self.batches.clear()
        self.batched.clear()
        self.waiting.clear()
        self.step_protected.clear()

    # -- batching --------------------------------------------------------------------------------

    def batch(self, key: bytes, index: int, req_context: object, owner: Hashable) -> PromotionBatch:
        """Add ``key`` of tier ``index`` to the batch of request ``owner``."""
        batch = self.batches.get(owner)
        if batch is None:
            batch = self.batches[owner] = PromotionBatch(req_context)
        batch.by_tier.setdefault(index, []).append(key)
        self.batched[key] = owner
        return batch

    def reserve(self, key: bytes, index: int, req_context: object, owner: Hashable) -> bool:
        """Step-driven lookup of a key only tier ``index`` holds: reserve its primary slot now
        (evicting, but never a key the request protected for the step) and batch it; False,
        counted, if the primary cannot make room."""
        out = self.primary.reserve_for_promotion(
            [OffloadKey(key)], req_context, protected=self.step_protected.get(owner, ())
        )
        self.events.pull_primary()
        if out is None or not out.keys_to_store:
            self.without_space += 1
            return False
        batch = self.batch(key, index, req_context, owner)
        batch.slots[key] = int(out.store_spec.block_ids[0])
        self.promoting[key] = index
        return True

    def protect(self, owner: Hashable, keys: Iterable[bytes]) -> None:
        """Until the next step, no promotion of request ``owner`` evicts ``keys``."""
        self.step_protected.setdefault(owner, set()).update(keys)

    def promote(self, promotable: dict[bytes, int], req_context: object) -> None:
        """Promote keys a prefix or hybrid lookup needs (key -> tier index): now (standalone)
        or with the request's batch at the step's end (step-driven)."""
        if not promotable:
            return
        if not self.step_driven:
            by_tier: dict[int, list[bytes]] = {}
            for key, index in promotable.items():
                by_tier.setdefault(index, []).append(key)
            self.start(by_tier, req_context)
            return
        owner = request_key(req_context)
        for key, index in promotable.items():
            if key not in self.batched:
                self.batch(key, index, req_context, owner)

    def flush(self) -> None:
        """Submit every request's promotion batch, one job per request and tier."""
        if not self.batches:
            return
        batches = list(self.batches.values())
        self.batches.clear()
        self.batched.clear()
        for batch in batches:
            if not batch.slots:
                self.start(batch.by_tier, batch.req_context)
                continue
            unreserved: dict[int, list[bytes]] = {}
            for index, keys in batch.by_tier.items():
                reserved = [k for k in keys if k in batch.slots]
                if reserved:
                    slots = [batch.slots[k] for k in reserved]
                    self.start_reserved(index, reserved, slots, batch.req_context)
                rest = [k for k in keys if k not in batch.slots]
                if rest:
                    unreserved[index] = rest
            if unreserved:
                self.start(unreserved, batch.req_context)

    # -- starting --------------------------------------------------------------------------------

    def start(self, by_tier: dict[int, list[bytes]], req_context: object) -> None:
        """Start promoting keys per tier index, those not being promoted yet: now, or when a job
        slot of their tier frees up; the shared tier's unknown keys are checked first."""
        for index, keys in by_tier.items():
            keys = [k for k in dict.fromkeys(keys) if k not in self.promoting]
            if index == self.shared_index:
                keys = self._check_shared(keys, req_context)
            if not keys:
                continue
            if self.tiers[index].stalled:
                continue  # it serves nothing until its I/O returns: the keys are misses
            if not self.tiers[index].has_capacity_for_job:
                self.wait_for_job_slot(index, keys, req_context)  # loads wait; stores are shed
                continue
            self.start_one(index, keys, req_context)

    def wait_for_job_slot(self, index: int, keys: list[bytes], req_context: object) -> None:
        """Queue the promotion of ``keys`` until tier ``index`` has room for a job."""
        if self.tiers[index].stalled:
            return  # no slot frees up while stalled: the keys are misses
        self.waiting.setdefault(index, []).append((req_context, keys, None))
        for key in keys:
            self.promoting[key] = index

    def start_waiting(self) -> None:
        """Start the waiting promotions whose tier has room now; give up a stalled tier's."""
        for index in list(self.waiting):
            tier = self.tiers[index]
            if tier.stalled:  # it serves nothing until its I/O returns: give the keys up
                for _context, keys, slots in self.waiting.pop(index):
                    for key in keys:
                        self.promoting.pop(key, None)
                    if slots is not None:  # reserved, never read into: free them
                        self.primary.complete_store(cast("list[OffloadKey]", keys), success=False)
                continue
            if not tier.has_capacity_for_job:
                continue
            entries = self.waiting.pop(index)  # a promotion may queue itself again meanwhile
            for n, (req_context, keys, slots) in enumerate(entries):
                if not tier.has_capacity_for_job:
                    self.waiting[index] = entries[n:] + self.waiting.get(index, [])
                    break
                if slots is None:
                    self.start_one(index, keys, req_context)
                else:
                    self.start_reserved(index, keys, slots, req_context)

    def start_one(self, index: int, keys: list[bytes], req_context: object) -> None:
        """One promotion job of tier ``index``: reserve primary slots for the keys it can read
        (none for a key the primary holds), submit the read."""
        tier = self.tiers[index]
        for key in keys:
            self.promoting.pop(key, None)
        primary = self.primary
        keys = [k for k in tier.readable(keys) if k not in primary]
        if not keys:
            return
        protected = self.step_protected.get(request_key(req_context), ())
        out = primary.reserve_for_promotion(
            cast("list[OffloadKey]", keys), req_context, protected=protected
        )
        self.events.pull_primary()
        if out is None:
            if self.draining:
                # Write-backs are freeing slots: try again when one finishes.
                self.wait_for_job_slot(index, keys, req_context)
                return
            # No room in the primary now: counted; a later lookup asks again.
            self.without_space += len(keys)
            return
        job = tier.start_promotion(
            out.keys_to_store, out.store_spec.block_ids.tolist(), req_context=req_context
        )
        for key in job.keys:
            self.promoting[key] = index
        self.jobs.submit(job, self.done)

    def start_reserved(
        self, index: int, keys: list[bytes], slots: list[int], req_context: object
    ) -> None:
        """Read keys into the primary slots reserved for them at lookup. A key the tier no
        longer holds (evicted by a store since) gives its slot back."""
        tier = self.tiers[index]
        readable = set(tier.readable(keys))
        if len(readable) < len(keys):
            gone = [k for k in keys if k not in readable]
            for key in gone:
                self.promoting.pop(key, None)
            self.primary.complete_promotion(cast("list[OffloadKey]", gone), False)
            pairs = [(k, s) for k, s in zip(keys, slots, strict=True) if k in readable]
            keys, slots = [k for k, _ in pairs], [s for _, s in pairs]
            if not keys:
                return
        if not tier.has_capacity_for_job:
            self.waiting.setdefault(index, []).append((req_context, keys, slots))
            return
        job = tier.start_promotion(keys, slots, req_context=req_context)
        self.jobs.submit(job, self.done)

    # -- results ---------------------------------------------------------------------------------

    def done(self, job: TierJob, result: object) -> None:
        """Apply a promotion's result: loaded keys are ready in the primary, failed ones leave
        it; keys the tier forgot (gone or corrupt) are announced removed."""
        outcome = job.tier.finish_promotion(job, result)
        for key in job.keys:
            self.promoting.pop(key, None)
        if outcome.loaded:
            self.primary.complete_promotion(cast("list[OffloadKey]", outcome.loaded), True)
        if outcome.failed:
            self.primary.complete_promotion(cast("list[OffloadKey]", outcome.failed), False)
        self.events.pull_primary()
        self.events.emit(job.tier, outcome.removed, removed=True)

    # -- the shared tier ---------------------------------------------------------------------------

    def _check_shared(self, keys: list[bytes], req_context: object) -> list[bytes]:
        """Submit one existence check for the keys the shared tier knows nothing of (RETRY
        while it runs); return the keys it knows are present, to promote now."""
        present, job = cast(SharedChecks, self.shared_checks).start(keys, req_context)
        if job is not None:
            self.jobs.submit(job, self.check_done)
        return present

    def check_done(self, job: TierJob, result: object) -> None:
        """Promote the keys an existence check found (the tier cached every answer)."""
        checks = cast(SharedChecks, self.shared_checks)
        keys = checks.finish(job, result)
        if not keys:
            return
        if checks.tier.has_capacity_for_job:
            self.start_one(checks.index, keys, job.req_context)
        else:
            self.wait_for_job_slot(checks.index, keys, job.req_context)
