"""A secondary tier: one storage backend with its own capacity, eviction policy and index, and the
jobs that move blocks between it and the primary tier's rows.

The tier's metadata (which keys it holds, which are being written or read, the eviction order)
lives in memory and is only touched by the manager's thread, so a lookup never touches the disk:
its index (:mod:`~tiering.managers.tier_index`, which tells the key states). Its I/O coroutines
(:mod:`~tiering.managers.tier_io`) run on the manager's I/O loop and touch only the backend and
the rows they were given.

Jobs. The tier starts and finishes its own jobs (:mod:`~tiering.managers.tier_jobs`).
``start_store`` (a completed primary store, by write policy:
:mod:`~tiering.managers.tier_write_policy`), ``start_write_back`` (a primary eviction) and
``start_promotion`` decide what to move: over the job bound a store is shed and counted; room is
reserved in the index, evicting as needed; the I/O coroutine is built over the primary rows.
Each returns a :class:`TierJob` that says what the manager must do: hold the primary rows it
reads (``keys``/``slots``), emit removal events (``removed``) and submit ``io``. The manager
hands the job's result back to ``finish_store`` or ``finish_promotion``, which publish or forget
keys, count metrics (:mod:`~tiering.managers.tier_stats`), quarantine, and say what to emit and
release; a write that found the backend FULL gets one retry job, after the tier's policy evicts
room (LMDB's map can fill before the block count says so). One store job is written once
(``_start_write``), whatever started it.

A tier that fails to open is *degraded*: counted, logged once, reported by ``status`` and the
manager's metrics; it then holds nothing and takes nothing, and the other tiers go on serving.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import ClassVar

import numpy as np

from tiering.backends.base import Outcome, StorageBackend
from tiering.errors import ConfigurationError
from tiering.managers.protocol import ConfigInfo
from tiering.managers.tier_admission import admission_gate, admit
from tiering.managers.tier_deadlines import TierStall
from tiering.managers.tier_index import TierIndex, TierKeyState
from tiering.managers.tier_io import TierIO
from tiering.managers.tier_jobs import (
    IOResult,
    PromotionResult,
    StoreResult,
    TierJob,
    job_outcomes,
)
from tiering.managers.tier_settings import check_tier_settings
from tiering.managers.tier_stats import TierMetrics
from tiering.managers.tier_write_policy import WritePolicy, WriteSchedule
from tiering.managers.tier_writes import TierWrites
from tiering.policies import EvictionPolicy, make_policy
from tiering.policies.admission import FrequencyGate

__all__ = [
    "IOResult",
    "PromotionResult",
    "SecondaryTier",
    "StoreResult",
    "TierJob",
    "TierKeyState",
    "TierMetrics",
    "WritePolicy",
]

logger = logging.getLogger(__name__)


class SecondaryTier:
    """One backend plus the metadata that makes it a tier.

    ``policy`` is a registered policy name or an instance whose capacity is the backend's
    ``capacity_blocks``. ``max_inflight_jobs`` bounds the jobs in flight at once: over it, stores
    are shed (and counted) and promotions wait their turn. ``quarantine_seconds`` is how long a
    key whose promotion failed is treated as absent. ``io_timeout_s`` is the deadline of each
    job (see *Deadlines* below). ``admission_min_count`` >= 1 gates its stores
    (:mod:`~tiering.managers.tier_admission`; ``admission_width`` sizes the gate).

    Deadlines. A job past ``io_timeout_s`` counts as failed (:meth:`time_out`): its keys are
    misses, and the tier is *stalled* until every such job's I/O has returned
    (:meth:`finish_late`; :mod:`~tiering.managers.tier_deadlines`). What a late job touched stays
    held until it returns: the primary rows a store reads stay pinned, the slots a promotion
    fills stay allocated, its keys stay in the index (absent to lookups, never evicted), so no
    late write lands in memory or under a key that was reused. A late result never applies: a
    late store's keys are deleted from the backend (a ``purge`` job) before the index forgets
    them.
    """

    #: Whether the backend's store is shared with other engine nodes
    # (:mod:`tiering.managers.shared_tier`).
    shared: ClassVar[bool] = False

    def __init__(
        self,
        backend: StorageBackend,
        *,
        name: str | None = None,
        policy: str | EvictionPolicy = "lru",
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        selective_min_lookups: int = 2,
        max_inflight_jobs: int = 4,
        quarantine_seconds: float = 10.0,
        quarantine_max_keys: int = 65536,
        io_timeout_s: float = 30.0,
        admission_min_count: int = 0,
        admission_width: int | None = None,
    ) -> None:
        self.backend = backend
        self.name = name or backend.name
        self.medium = self.name.upper()
        self.write_policy = check_tier_settings(
            self.name,
            backend,
            shared=self.shared,
            write_policy=write_policy,
            selective_min_lookups=selective_min_lookups,
            max_inflight_jobs=max_inflight_jobs,
            io_timeout_s=io_timeout_s,
        )
        self.selective_min_lookups = selective_min_lookups
        #: The admission gate the manager records lookups in (None: every store is written).
        self.admission: FrequencyGate | None = admission_gate(
            self.name,
            backend.capacity_blocks,
            self.write_policy,
            admission_min_count,
            admission_width,
        )
        self.max_inflight_jobs = max_inflight_jobs
        self.io_timeout_s = float(io_timeout_s)
        self._stall = TierStall(self.name, self.io_timeout_s)
        self._stuck_jobs = self._stall.jobs  # past their deadline, I/O not returned: stalled
        self._policy_spec = policy
        self._policy: EvictionPolicy | None = None
        self._index = TierIndex(quarantine_seconds, quarantine_max_keys)
        self._view_index()
        self._schedule = WriteSchedule(self.write_policy, selective_min_lookups)
        self._io = TierIO(self, self._put)  # the jobs, their I/O, those in flight
        self._writes = TierWrites(backend, self._index, self._io)
        self.metrics = TierMetrics()
        self.status = "opening"  # then "open", or "degraded" if opening failed
        self.open_error: str | None = None

    def _view_index(self) -> None:
        """Name the index's key sets here: the per-key paths (and a shared tier) read them
        without a hop through the index."""
        index = self._index
        #: Every key the index holds (READY, WRITING or quarantined), kept with the policy: a
        #: manager's lookup tests a miss against it in one probe (read-only for callers).
        self.held = index.held
        self._writing = index.writing
        self._reading = index.reading
        self._quarantine = index.quarantine
        self._stuck = index.stuck  # keys of late stores: absent, kept until purged

    # -- lifecycle --------------------------------------------------------------------------------

    def attach(self, rows: np.ndarray) -> None:
        """Give the tier the primary tier's rows (``(num_blocks, row_bytes)`` uint8) its jobs
        move blocks between; a tier serves one manager."""
        self._io.attach(rows)

    def detach(self) -> None:
        """Drop the primary tier's rows (the manager shut down): the tier keeps no view of
        memory its owner may unmap."""
        self._io.detach()

    def start_open(self) -> TierJob:
        """The job that opens the backend; :meth:`finish_open` takes its result."""
        return TierJob("open", self, (), self.backend.open())

    def finish_open(self, job: TierJob, result: object) -> None:
        """Build the index from the recovered keys, or mark the tier degraded."""
        if isinstance(result, BaseException):
            self._degrade(result)
            return
        try:
            self.adopt(result)  # type: ignore[arg-type]
        except Exception as exc:  # a policy that cannot be built, a bad key list
            self._degrade(exc)

    def adopt(self, recovered: Sequence[bytes]) -> None:
        """Build the index from recovered keys (manager thread, after opening)."""
        capacity = self.backend.capacity_blocks
        if isinstance(self._policy_spec, EvictionPolicy):
            policy = self._policy_spec
        else:
            policy = make_policy(self._policy_spec, capacity)
        self._index.adopt(policy, recovered)
        self._policy = policy
        self.status = "open"

    def _degrade(self, exc: BaseException) -> None:
        self.status = "degraded"
        self.open_error = f"{type(exc).__name__}: {exc}"
        self.metrics.open_failures += 1
        logger.warning(
            "tier %r failed to open and is degraded (it holds and takes nothing; the other "
            "tiers go on serving): %s",
            self.name,
            self.open_error,
        )

    def start_close(self) -> TierJob:
        return TierJob("close", self, (), self._io.close())

    @property
    def is_open(self) -> bool:
        return self.status == "open"

    @property
    def policy(self) -> EvictionPolicy:
        if self._policy is None:
            raise ConfigurationError(f"tier {self.name!r} is not open ({self.status})")
        return self._policy

    @property
    def eviction_policy(self) -> EvictionPolicy | None:
        """The tier's policy, or None where it has none: not open, or a shared tier (its store
        evicts). For readers (metrics); :attr:`policy` is for the tier's own use."""
        return self._policy

    @property
    def capacity_blocks(self) -> int:
        return self.backend.capacity_blocks

    def __len__(self) -> int:
        return 0 if self._policy is None else len(self._policy)

    def config_info(self) -> ConfigInfo:
        """Static facts of the tier (labels of an info metric)."""
        policy = self._policy_spec
        return {
            "tier": self.name,
            "medium": self.medium,
            "backend": self.backend.name,
            "write_policy": self.write_policy.value,
            "policy": policy if isinstance(policy, str) else policy.name,
            "capacity_blocks": self.backend.capacity_blocks,
            "block_bytes": self.backend.block_bytes,
            "max_inflight_jobs": self.max_inflight_jobs,
            "io_timeout_s": self.io_timeout_s,
            "admission_min_count": 0 if self.admission is None else self.admission.min_count,
        }

    # -- metadata (manager thread only) -----------------------------------------------------------

    def state(self, key: bytes) -> TierKeyState:
        """The key's state, without side effects (ABSENT for every key while stalled)."""
        if self._stuck_jobs or self._policy is None or key not in self._policy:
            return TierKeyState.ABSENT
        if key in self._writing:
            return TierKeyState.WRITING
        if key in self._quarantine or (self._stuck and key in self._stuck):
            return TierKeyState.ABSENT
        return TierKeyState.READY

    def count_lookup_hit(self) -> None:
        """A lookup that missed the primary found a key READY here."""
        self.metrics.lookup_hits += 1

    def readable(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys a promotion could read now (READY)."""
        return [k for k in keys if self.state(k) is TierKeyState.READY]

    def touch(self, keys: Sequence[bytes], *, req_context: object = None) -> None:
        """A use of ``keys`` by the request of ``req_context`` (``keys[0]`` ends most
        recent)."""
        if self._policy is not None:
            self._policy.touch(keys)

    def refresh(self, keys: Sequence[bytes], *, req_context: object = None) -> None:
        """Recency without a use (:meth:`EvictionPolicy.refresh`): the request of
        ``req_context`` stored ``keys``, it did not reuse them."""
        if self._policy is not None:
            self._policy.refresh(keys)

    @property
    def inflight_jobs(self) -> int:
        """Store and promotion jobs in flight."""
        return self._io.inflight

    @inflight_jobs.setter
    def inflight_jobs(self, count: int) -> None:
        self._io.inflight = count

    @property
    def has_capacity_for_job(self) -> bool:
        return self._io.inflight < self.max_inflight_jobs

    @property
    def stalled(self) -> bool:
        """Whether a job ran past ``io_timeout_s`` and its I/O has not returned yet."""
        return bool(self._stuck_jobs)

    @property
    def serving(self) -> bool:
        """Open and not stalled: the tier answers lookups and takes jobs."""
        return self.status == "open" and not self._stuck_jobs

    # -- stores -----------------------------------------------------------------------------------

    def start_store(
        self,
        keys: Sequence[bytes],
        slots: Mapping[bytes, int],
        *,
        lookup_counts: Mapping[bytes, int],
        req_context: object = None,
    ) -> TierJob | None:
        """Take keys that just became ready in the primary (``slots[key]`` is the row of
        each), by write policy.

        Write-through writes them now; selective write-through those looked up at least
        ``selective_min_lookups`` times (``lookup_counts``); write-back only notes them, to write
        when the primary evicts them (:meth:`start_write_back`). A gated tier then writes only
        the keys its gate admits (:func:`~tiering.managers.tier_admission.admit`). Returns the
        job to run, or None (nothing to write now, or shed over the job bound or for want of
        room: counted).
        """
        if self._policy is None:
            return None
        to_write = self._schedule.to_write_now(keys, lookup_counts)
        if to_write is None:
            return None
        if self.admission is not None:
            to_write = admit(self.admission, to_write, self.held, self.metrics)
            if not to_write:
                return None
        return self._start_write("store", to_write, slots, req_context)

    def start_put(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview], *, req_context: object = None
    ) -> TierJob | None:
        """Write caller-owned ``buffers[i]`` under ``keys[i]`` (an embedder's put, see
        :mod:`tiering.embed`): room is reserved as for a store, evicting by policy, whatever the
        write policy, and it is never shed over the job bound (its caller waits for it). Keys
        the tier holds already are touched, not rewritten. None if there is nothing to write,
        or no room (counted as shed). The buffers must stay valid until the job is finished."""
        if self._policy is None:
            return None
        return self._writes.put(self._policy, self.metrics, keys, buffers, req_context)

    def start_write_back(
        self, slots: Mapping[bytes, int], *, req_context: object = None
    ) -> TierJob | None:
        """Write the keys the primary is evicting (``slots[key]``: the row each still has) that
        this tier still owes; None if it owes none or the write is shed (counted)."""
        owed = self._schedule.settle_owed(slots)
        if not owed:
            return None
        return self._start_write("write_back", owed, slots, req_context)

    def _start_write(
        self, kind: str, keys: Sequence[bytes], slots: Mapping[bytes, int], req_context: object
    ) -> TierJob | None:
        """The one store job: shed over the bound (or while stalled), else reserve room
        (evicting) and build the write (:class:`~tiering.managers.tier_writes.TierWrites`)."""
        if not self.has_capacity_for_job or self._stuck_jobs:
            self.metrics.stores_shed += len(keys)
            return None
        return self._writes.start(kind, self.policy, self.metrics, keys, slots, req_context)

    def finish_store(self, job: TierJob, result: object) -> StoreResult:
        """Publish what the backend acknowledged, forget what failed; keys that found the
        backend FULL get one retry once the policy has evicted room for them."""
        self._io.inflight -= 1
        return self._writes.finish(self.policy, self.metrics, job, result)

    # -- promotions -------------------------------------------------------------------------------

    def start_promotion(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        *,
        req_context: object = None,
        buffers: Sequence[memoryview] | None = None,
    ) -> TierJob:
        """Read READY ``keys`` into the primary slots reserved for them (or into ``buffers``, an
        embedder's memory); they stay pinned here until :meth:`finish_promotion`."""
        self._index.pin_reads(self.policy, keys)
        self.metrics.promotions += 1
        return self._io.read_job(keys, slots, req_context, buffers)

    def finish_promotion(self, job: TierJob, result: object) -> PromotionResult:
        """Unpin after the read; drop keys that are gone or corrupt, quarantine other failures."""
        self._io.inflight -= 1
        outcomes = self._outcomes(job, result, self.metrics.load_latency_s)
        return self._index.finish_reads(self.policy, job.keys, job.buffers, outcomes, self.metrics)

    # -- deadlines (see the class docstring) ------------------------------------------------------

    def time_out(self, job: TierJob) -> list[bytes]:
        """``job`` ran past ``io_timeout_s``: count it failed, make its keys misses, and stall
        the tier. Returns the keys the tier stops serving if this stalled it (for removal
        events), else an empty list. What the job touched stays held until :meth:`finish_late`.
        """
        return self._ready_keys() if self._stall.time_out(job, self._index, self.metrics) else []

    def note_slow_open(self, job: TierJob) -> None:
        """Opening the backend (recovering its index) took longer than ``io_timeout_s``: the
        manager stops waiting for it; the tier answers absent until it is open (its late
        result is applied by :meth:`finish_open`)."""
        self._stall.note_slow_open(self.metrics)

    def finish_late(self, job: TierJob, result: object) -> tuple[TierJob | None, list[bytes]]:
        """The I/O of a timed-out ``job`` returned: release what it held, never apply its
        result. Returns a job that deletes a late store's keys from the backend (submit it;
        :meth:`finish_purge` takes its result) or None, and the keys the tier serves again if
        this ended the stall (for stored events), else an empty list."""
        purge = None
        if job.kind in ("store", "write_back", "promote"):
            self._io.inflight -= 1
        if job.kind in ("store", "write_back"):
            purge = self._purge_job(job.keys)
        elif job.kind == "promote":
            self._index.release_reads(self._policy, job.keys)
        return purge, (self._ready_keys() if self._stall.end(job) else [])

    def _purge_job(self, keys: Sequence[bytes]) -> TierJob | None:
        """The job deleting a late store's keys from the backend (whatever the store did)."""
        return self._io.delete_job("purge", keys)

    def finish_purge(self, job: TierJob) -> None:
        """A late store's keys are deleted from the backend (or the delete failed, which leaves
        blocks the index does not name; never served): forget them."""
        self._index.forget_stuck(self._policy, job.keys)

    def _ready_keys(self) -> list[bytes]:
        """The keys a lookup would find READY if the tier were not stalled."""
        return self._index.ready_keys(self._policy)

    # -- reset --------------------------------------------------------------------------------

    def start_clear(self) -> TierJob | None:
        """Forget every key; the job deletes them from the backend (None if there are none)."""
        keys = self._index.clear(self._policy)
        self._schedule.owed.clear()
        if not keys:
            return None
        return self._io.delete_job("delete", keys, removed=keys)

    # -- helpers ----------------------------------------------------------------------------------

    _outcomes = staticmethod(job_outcomes)

    async def _put(self, keys: list[bytes], buffers: list[memoryview]) -> list[Outcome]:
        """The backend call that writes a store job's blocks (I/O loop)."""
        return await self.backend.put(keys, buffers)
