"""A secondary tier: one storage backend with its own capacity, eviction policy and index, and the
jobs that move blocks between it and the primary tier's rows.

The tier's metadata (which keys it holds, which are being written or read, the eviction order)
lives in memory and is only touched by the manager's thread, so a lookup never touches the disk.
Its I/O coroutines run on the manager's I/O loop and touch only the backend and the rows they
were given.

A key is visible (``READY``) only after the backend acknowledged its write; while the write is in
flight it is ``WRITING`` (a lookup answers "being written"). Keys whose read failed or did not
verify are quarantined for a while: lookups treat them as absent, so a bad block is not promoted
over and over.

Jobs. The tier starts and finishes its own jobs. ``start_store`` (a completed primary store, by
write policy), ``start_write_back`` (a primary eviction) and ``start_promotion`` decide what to
move: over the job bound a store is shed and counted; room is reserved in the index, evicting as
needed; the I/O coroutine is built over the primary rows. Each returns a :class:`TierJob` that
says what the manager must do: hold the primary rows it reads (``keys``/``slots``), emit removal
events (``removed``) and submit ``io``. The manager hands the job's result back to
``finish_store`` or ``finish_promotion``, which publish or forget keys, count metrics, quarantine,
and say what to emit and release; a write that found the backend FULL gets one retry job, after
the tier's policy evicts room (LMDB's map can fill before the block count says so). One store job
is written once (``_start_write``), whatever started it.

A tier that fails to open is *degraded*: counted, logged once, reported by ``status`` and the
manager's metrics; it then holds nothing and takes nothing, and the other tiers go on serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import time
from collections.abc import Collection, Coroutine, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import cachetools
import numpy as np

from tiering.backends.base import Outcome, StorageBackend
from tiering.errors import ConfigurationError, TieringError
from tiering.managers.deadline import Timer
from tiering.managers.latency import LatencyRecord
from tiering.managers.protocol import ConfigInfo
from tiering.policies import EvictionPolicy, make_policy

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

OK, FAILED, FULL = Outcome.OK, Outcome.FAILED, Outcome.FULL


class WritePolicy(enum.StrEnum):
    """When a block written to the primary tier reaches this tier."""

    WRITE_THROUGH = "write_through"  # every completed store cascades
    WRITE_BACK = "write_back"  # written when the primary evicts it
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # only keys looked up often enough


class TierKeyState(enum.IntEnum):
    ABSENT = 0
    READY = 1
    WRITING = 2
    UNKNOWN = 3  # a shared tier knows nothing of it: the store must be asked (shared_tier)


@dataclass
class TierMetrics:
    """Counters of one tier (cumulative); job latencies in seconds, one sample per job, in
    fixed memory (:class:`~tiering.managers.latency.LatencyRecord`: exact count, total and
    histogram,
    sampled percentiles)."""

    lookup_hits: int = 0
    promotions: int = 0
    promoted_blocks: int = 0
    promotion_failures: int = 0
    corrupt_blocks: int = 0
    quarantined: int = 0
    store_jobs: int = 0
    stored_blocks: int = 0
    store_failures: int = 0
    stores_shed: int = 0
    full_retries: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    open_failures: int = 0
    timed_out_jobs: int = 0  # jobs past io_timeout_s (their keys counted in the failures too)
    stalls: int = 0  # times the tier stalled (a job timed out while none was stuck)
    load_latency_s: LatencyRecord = field(default_factory=LatencyRecord)
    store_latency_s: LatencyRecord = field(default_factory=LatencyRecord)

    def counters(self) -> dict[str, int]:
        """The integer counters by name (latency samples left out)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}


@dataclass(frozen=True)
class IOResult:
    """What a tier's read or write coroutine returns: one outcome per key, and its duration."""

    outcomes: list[Outcome]
    elapsed_s: float


@dataclass(eq=False)  # identity: jobs live in a set
class TierJob:
    """One batch of I/O between the primary tier's rows and one tier.

    The manager holds the primary rows of ``keys`` (at ``slots``) while the job runs, emits
    ``removed`` (keys the tier forgot to make room) when it submits ``io``, and hands ``io``'s
    result back to the tier. ``req_context`` is the context of the call that started the job.
    Await a submitted job with ``await job``.
    """

    kind: str  # "store", "write_back", "promote", "check", "open", "delete", "close"
    tier: SecondaryTier
    keys: tuple[bytes, ...]
    io: Coroutine[Any, Any, Any]
    slots: tuple[int, ...] = ()
    buffers: tuple[memoryview, ...] = ()
    removed: tuple[bytes, ...] = ()
    req_context: object = None
    retried: bool = False  # a FULL retry: holds the rows of the job it retries, never retries
    future: concurrent.futures.Future[Any] | None = None  # set by the manager on submission
    seq: int = 0  # submission order (set by the manager): results apply in this order
    epoch: int = 0  # the manager's step when submitted (set by the manager)
    started_s: float = field(default_factory=time.perf_counter)
    # Deadlines (tiering.managers.deadline; set by the manager): ``future`` settles when the I/O
    # returns
    # or the deadline passes, whichever is first; ``io_future`` only when the I/O returns.
    io_future: concurrent.futures.Future[Any] | None = None
    timer: Timer | None = None
    finished: bool = False  # the I/O returned (set under the manager's claim lock)
    timed_out: bool = False  # the deadline passed first: the result, when it comes, is late

    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def __await__(self) -> Generator[Any, None, Any]:
        if self.future is None:
            raise TieringError(f"{self.kind} job of tier {self.tier.name!r} was never submitted")
        return asyncio.wrap_future(self.future).__await__()


@dataclass(frozen=True)
class StoreResult:
    """What finishing a store job asks of the manager.

    ``stored``: keys the backend acknowledged (stored events). ``settled``: ``(key, slot)`` of the
    keys whose primary rows the job no longer needs. ``retry``: a job for the keys that found the
    backend full, room made (submit it; it keeps their rows held), or None.
    """

    stored: list[bytes]
    settled: list[tuple[bytes, int]]
    retry: TierJob | None


@dataclass(frozen=True)
class PromotionResult:
    """What finishing a promotion asks of the manager: ``loaded`` keys are in their primary slots
    (complete the primary store), ``failed`` ones are not (drop them), ``removed`` ones the tier
    forgot (gone or corrupt in the backend: removal events)."""

    loaded: list[bytes]
    failed: list[bytes]
    removed: list[bytes]


class SecondaryTier:
    """One backend plus the metadata that makes it a tier.

    ``policy`` is a registered policy name or an instance whose capacity is the backend's
    ``capacity_blocks``. ``max_inflight_jobs`` bounds the jobs in flight at once: over it, stores
    are shed (and counted) and promotions wait their turn. ``quarantine_seconds`` is how long a
    key whose promotion failed is treated as absent. ``io_timeout_s`` is the deadline of each
    job (see *Deadlines* below).

    Deadlines. A job past ``io_timeout_s`` counts as failed (:meth:`time_out`): its keys are
    misses, and the tier is *stalled* until every such job's I/O has returned
    (:meth:`finish_late`): meanwhile it answers every key absent, takes no store (shed) and
    starts no promotion. What a late job touched stays held until it returns: the primary rows
    a store reads stay pinned, the slots a promotion fills stay allocated, its keys stay in the
    index (absent to lookups, never evicted), so no late write lands in memory or under a key
    that was reused. A late result never applies: a late store's keys are deleted from the
    backend (a ``purge`` job) before the index forgets them.
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
    ) -> None:
        self.backend = backend
        self.name = name or backend.name
        self.medium = self.name.upper()
        if backend.capabilities.shared and not self.shared:
            raise ConfigurationError(
                f"tier {self.name!r}: the {backend.name!r} backend is shared (others write and "
                "evict its store), and this tier evicts by deleting: it would delete other "
                "nodes' blocks. Run it as a tiering.managers.shared_tier.SharedTier "
                "(build_manager does)"
            )
        try:
            self.write_policy = WritePolicy(write_policy)
        except ValueError:
            valid = ", ".join(p.value for p in WritePolicy)
            raise ConfigurationError(
                f"tier {self.name!r}: unknown write_policy {write_policy!r}; valid: {valid}"
            ) from None
        if selective_min_lookups < 1:
            raise ConfigurationError(
                f"tier {self.name!r}: selective_min_lookups must be >= 1, got "
                f"{selective_min_lookups}"
            )
        if max_inflight_jobs < 1:
            raise ConfigurationError(
                f"tier {self.name!r}: max_inflight_jobs must be >= 1, got {max_inflight_jobs}"
            )
        if not (isinstance(io_timeout_s, int | float) and 0 < io_timeout_s <= 86400):
            raise ConfigurationError(
                f"tier {self.name!r}: io_timeout_s must be a number of seconds in (0, 86400], "
                f"got {io_timeout_s!r}"
            )
        self.selective_min_lookups = selective_min_lookups
        self.max_inflight_jobs = max_inflight_jobs
        self.io_timeout_s = float(io_timeout_s)
        self._stuck_jobs = 0  # jobs past their deadline whose I/O has not returned
        self._stuck: set[bytes] = set()  # keys of late stores: absent, kept until purged
        self._policy_spec = policy
        self._policy: EvictionPolicy | None = None
        #: Every key the index holds (READY, WRITING or quarantined), kept with the policy: a
        #: manager's lookup tests a miss against it in one probe (read-only for callers).
        self.held: set[bytes] = set()
        self._writing: set[bytes] = set()
        self._reading: dict[bytes, int] = {}
        self._dirty: set[bytes] = set()  # write-back: in the primary, not written here yet
        self._quarantine: cachetools.TTLCache[bytes, bool] = cachetools.TTLCache(
            maxsize=quarantine_max_keys, ttl=quarantine_seconds, timer=time.monotonic
        )
        self._rows: np.ndarray | None = None
        self.inflight_jobs = 0
        self.metrics = TierMetrics()
        self.status = "opening"  # then "open", or "degraded" if opening failed
        self.open_error: str | None = None

    # -- lifecycle --------------------------------------------------------------------------------

    def attach(self, rows: np.ndarray) -> None:
        """Give the tier the primary tier's rows (``(num_blocks, row_bytes)`` uint8) its jobs
        move blocks between; a tier serves one manager."""
        if self._rows is not None and self._rows is not rows:
            raise ConfigurationError(f"tier {self.name!r} already serves another manager")
        self._rows = rows

    def detach(self) -> None:
        """Drop the primary tier's rows (the manager shut down): the tier keeps no view of
        memory its owner may unmap."""
        self._rows = None

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
        for key in recovered:
            if key not in policy:
                policy.insert(key)
        self.held.clear()
        self.held.update(policy)
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
        return TierJob("close", self, (), self._close())

    @property
    def is_open(self) -> bool:
        return self.status == "open"

    @property
    def policy(self) -> EvictionPolicy:
        if self._policy is None:
            raise ConfigurationError(f"tier {self.name!r} is not open ({self.status})")
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
    def has_capacity_for_job(self) -> bool:
        return self.inflight_jobs < self.max_inflight_jobs

    @property
    def stalled(self) -> bool:
        """Whether a job ran past ``io_timeout_s`` and its I/O has not returned yet."""
        return self._stuck_jobs > 0

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
        when the primary evicts them (:meth:`start_write_back`). Returns the job to run, or None
        (nothing to write now, or shed over the job bound or for want of room: counted).
        """
        if self._policy is None:
            return None
        if self.write_policy is WritePolicy.WRITE_BACK:
            self._dirty.update(keys)
            return None
        if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            wanted = self.selective_min_lookups
            keys = [k for k in keys if lookup_counts.get(k, 0) >= wanted]
            if not keys:
                return None
        return self._start_write("store", keys, slots, req_context)

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
        if len(buffers) != len(keys):
            raise ValueError(f"start_put got {len(keys)} keys but {len(buffers)} buffers")
        reserved = self._reserve(keys)
        if reserved is None:
            self.metrics.stores_shed += len(keys)
            return None
        to_write, victims = reserved
        self._policy.touch([k for k in keys if k not in set(to_write)])
        if not to_write:
            return None
        index = {k: i for i, k in enumerate(keys)}
        picked = [index[k] for k in to_write]
        self.metrics.store_jobs += 1
        return self._write_job(
            "put", to_write, picked, victims, req_context, buffers=[buffers[i] for i in picked]
        )

    def start_write_back(
        self, slots: Mapping[bytes, int], *, req_context: object = None
    ) -> TierJob | None:
        """Write the keys the primary is evicting (``slots[key]``: the row each still has) that
        this tier still owes; None if it owes none or the write is shed (counted)."""
        if not self._dirty:
            return None
        owed = [k for k in slots if k in self._dirty]
        if not owed:
            return None
        self._dirty.difference_update(owed)
        return self._start_write("write_back", owed, slots, req_context)

    def _start_write(
        self, kind: str, keys: Sequence[bytes], slots: Mapping[bytes, int], req_context: object
    ) -> TierJob | None:
        """The one store job: shed over the bound, reserve room (evicting), build the write."""
        if not self.has_capacity_for_job or self._stuck_jobs:
            self.metrics.stores_shed += len(keys)
            return None
        reserved = self._reserve(keys)
        if reserved is None:
            self.metrics.stores_shed += len(keys)
            return None
        to_write, victims = reserved
        if not to_write:
            return None
        self.metrics.store_jobs += 1
        return self._write_job(kind, to_write, [slots[k] for k in to_write], victims, req_context)

    def _write_job(
        self,
        kind: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        victims: Sequence[bytes],
        req_context: object,
        *,
        retried: bool = False,
        buffers: Sequence[memoryview] | None = None,
    ) -> TierJob:
        """``buffers``: the memory to write (default: the primary rows at ``slots``)."""
        buffers = tuple(self._row(s) for s in slots) if buffers is None else tuple(buffers)
        self.inflight_jobs += 1
        return TierJob(
            kind,
            self,
            tuple(keys),
            self._write(keys, buffers, victims),
            slots=tuple(slots),
            buffers=buffers,
            removed=tuple(victims),
            req_context=req_context,
            retried=retried,
        )

    def _reserve(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]] | None:
        """Choose the keys to write (absent ones) and evict room for them.

        Returns ``(keys_to_write, victims)``, the keys marked WRITING and the victims already
        gone from the index (the write job deletes them from the backend first), or None with
        nothing changed if the policy cannot free enough.
        """
        policy = self.policy
        to_write = [k for k in dict.fromkeys(keys) if k not in policy]
        if not to_write:
            return [], []
        policy.note_misses(to_write)
        capacity = self.backend.effective_capacity_blocks  # less when a disk guard shrinks it
        if len(to_write) > capacity:
            return None
        shortfall = len(policy) + len(to_write) - capacity
        victims: list[bytes] = []
        if shortfall > 0:
            chosen = policy.evict(shortfall, protected=set(keys))
            if chosen is None:
                return None
            victims = chosen
            self.metrics.evictions += len(victims)
            self.held.difference_update(victims)
        policy.insert_new(to_write, evictable=False)  # absent, once each
        self.held.update(to_write)
        self._writing.update(to_write)
        quarantine = self._quarantine
        if len(quarantine):  # (a TTLCache's pop is a few Python calls: skip it when empty)
            for key in to_write:
                quarantine.pop(key, None)
        return to_write, victims

    def finish_store(self, job: TierJob, result: object) -> StoreResult:
        """Publish what the backend acknowledged, forget what failed; keys that found the
        backend FULL get one retry once the policy has evicted room for them."""
        self.inflight_jobs -= 1
        outcomes = self._outcomes(job, result, self.metrics.store_latency_s)
        self.metrics.bytes_written += sum(
            b.nbytes for b, o in zip(job.buffers, outcomes, strict=True) if o is OK
        )
        full = [i for i, o in enumerate(outcomes) if o is FULL]
        settled = [i for i, o in enumerate(outcomes) if o is not FULL]
        stored = self._publish([job.keys[i] for i in settled], [outcomes[i] for i in settled])
        pairs = [(job.keys[i], job.slots[i]) for i in settled]
        if not full:
            return StoreResult(stored, pairs, None)
        full_keys = [job.keys[i] for i in full]
        # Room for them, and down to the capacity the backend allows now (a disk guard may
        # have shrunk it since the job was reserved).
        wanted = max(len(full), len(self.policy) - self.backend.effective_capacity_blocks)
        victims = None
        if not job.retried:
            protected = set(job.keys)
            victims = self.policy.evict(wanted, protected=protected)
            if victims is None and wanted > len(full):
                victims = self.policy.evict(len(full), protected=protected)
        if victims is None:
            self._publish(full_keys, [FAILED] * len(full))
            return StoreResult(stored, pairs + [(job.keys[i], job.slots[i]) for i in full], None)
        self.metrics.full_retries += 1
        self.metrics.evictions += len(victims)
        self.held.difference_update(victims)
        retry = self._write_job(
            job.kind,
            full_keys,
            [job.slots[i] for i in full],
            victims,
            job.req_context,
            retried=True,
            buffers=[job.buffers[i] for i in full],
        )
        return StoreResult(stored, pairs, retry)

    def _publish(self, keys: Sequence[bytes], outcomes: Sequence[Outcome]) -> list[bytes]:
        """Make the keys whose write succeeded READY; forget the others. Returns the READY."""
        published = []
        policy = self.policy
        for key, outcome in zip(keys, outcomes, strict=True):
            self._writing.discard(key)
            if outcome is OK:
                policy.set_evictable(key, key not in self._reading)
                published.append(key)
            else:
                policy.remove(key)
                self.held.discard(key)
                self.metrics.store_failures += 1
        self.metrics.stored_blocks += len(published)
        return published

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
        for key in keys:
            count = self._reading.get(key, 0)
            if count == 0:
                self.policy.set_evictable(key, False)
            self._reading[key] = count + 1
        self.metrics.promotions += 1
        self.inflight_jobs += 1
        buffers = tuple(self._row(s) for s in slots) if buffers is None else tuple(buffers)
        return TierJob(
            "promote",
            self,
            tuple(keys),
            self._read(keys, buffers),
            slots=tuple(slots),
            buffers=buffers,
            req_context=req_context,
        )

    def finish_promotion(self, job: TierJob, result: object) -> PromotionResult:
        """Unpin after the read; drop keys that are gone or corrupt, quarantine other failures."""
        self.inflight_jobs -= 1
        outcomes = self._outcomes(job, result, self.metrics.load_latency_s)
        loaded: list[bytes] = []
        failed: list[bytes] = []
        removed: list[bytes] = []
        metrics = self.metrics
        policy = self.policy
        for key, buffer, outcome in zip(job.keys, job.buffers, outcomes, strict=True):
            count = self._reading.pop(key, 1) - 1
            if count:
                self._reading[key] = count
            if outcome is OK:
                loaded.append(key)
                metrics.bytes_read += buffer.nbytes
                if not count and key in policy:
                    policy.set_evictable(key, True)
                continue
            failed.append(key)
            metrics.promotion_failures += 1
            if outcome is Outcome.CORRUPT:
                metrics.corrupt_blocks += 1
            if outcome in (Outcome.CORRUPT, Outcome.MISSING):
                # The backend no longer holds it: forget it for good.
                if key in policy and not count:
                    policy.remove(key)
                    self.held.discard(key)
                    removed.append(key)
            else:
                self._quarantine[key] = True
                metrics.quarantined += 1
        metrics.promoted_blocks += len(loaded)
        return PromotionResult(loaded, failed, removed)

    # -- deadlines (see the class docstring) ------------------------------------------------------

    def time_out(self, job: TierJob) -> list[bytes]:
        """``job`` ran past ``io_timeout_s``: count it failed, make its keys misses, and stall
        the tier. Returns the keys the tier stops serving if this stalled it (for removal
        events), else an empty list. What the job touched stays held until :meth:`finish_late`.
        """
        metrics = self.metrics
        metrics.timed_out_jobs += 1
        if job.kind in ("store", "write_back"):
            metrics.store_failures += len(job.keys)
            self._writing.difference_update(job.keys)
            self._stuck.update(job.keys)
        elif job.kind == "promote":
            metrics.promotion_failures += len(job.keys)
        self._stuck_jobs += 1
        if self._stuck_jobs > 1:
            return []
        metrics.stalls += 1
        logger.warning(
            "tier %r stalled: a %s job of %d blocks ran past io_timeout_s=%gs; its blocks are "
            "misses, and the tier serves and takes nothing until its I/O returns",
            self.name,
            job.kind,
            len(job.keys),
            self.io_timeout_s,
        )
        return self._ready_keys()

    def note_slow_open(self, job: TierJob) -> None:
        """Opening the backend (recovering its index) took longer than ``io_timeout_s``: the
        manager stops waiting for it; the tier answers absent until it is open (its late
        result is applied by :meth:`finish_open`)."""
        self.metrics.timed_out_jobs += 1
        logger.warning(
            "tier %r is still opening after io_timeout_s=%gs (a slow or hung mount, or a large "
            "index to recover); it serves nothing until it is open, the other tiers go on",
            self.name,
            self.io_timeout_s,
        )

    def finish_late(self, job: TierJob, result: object) -> tuple[TierJob | None, list[bytes]]:
        """The I/O of a timed-out ``job`` returned: release what it held, never apply its
        result. Returns a job that deletes a late store's keys from the backend (submit it;
        :meth:`finish_purge` takes its result) or None, and the keys the tier serves again if
        this ended the stall (for stored events), else an empty list."""
        purge = None
        if job.kind in ("store", "write_back", "promote"):
            self.inflight_jobs -= 1
        if job.kind in ("store", "write_back"):
            purge = self._purge_job(job.keys)
        elif job.kind == "promote":
            policy = self._policy
            for key in job.keys:
                count = self._reading.pop(key, 1) - 1
                if count:
                    self._reading[key] = count
                elif policy is not None and key in policy and key not in self._writing:
                    policy.set_evictable(key, True)
        self._stuck_jobs -= 1
        if self._stuck_jobs:
            return purge, []
        logger.warning("tier %r recovered: its stalled I/O returned", self.name)
        return purge, self._ready_keys()

    def _purge_job(self, keys: Sequence[bytes]) -> TierJob | None:
        """The job deleting a late store's keys from the backend (whatever the store did)."""
        return TierJob("purge", self, tuple(keys), self._delete(keys))

    def finish_purge(self, job: TierJob) -> None:
        """A late store's keys are deleted from the backend (or the delete failed, which leaves
        blocks the index does not name; never served): forget them."""
        policy = self._policy
        for key in job.keys:
            if key in self._stuck:
                self._stuck.discard(key)
                if policy is not None and key in policy:
                    policy.remove(key)
                self.held.discard(key)

    def _ready_keys(self) -> list[bytes]:
        """The keys a lookup would find READY if the tier were not stalled."""
        if self._policy is None:
            return []
        writing, quarantine, stuck = self._writing, self._quarantine, self._stuck
        return [
            k for k in self._policy if k not in writing and k not in quarantine and k not in stuck
        ]

    # -- reset --------------------------------------------------------------------------------

    def start_clear(self) -> TierJob | None:
        """Forget every key; the job deletes them from the backend (None if there are none)."""
        keys = list(self._policy) if self._policy is not None else []
        if self._policy is not None:
            self._policy.clear()
        self.held.clear()
        self._writing.clear()
        self._reading.clear()
        self._dirty.clear()
        self._quarantine.clear()
        self._stuck.clear()  # their late stores are purged from the backend all the same
        if not keys:
            return None
        return TierJob("delete", self, tuple(keys), self._delete(keys), removed=tuple(keys))

    # -- helpers ----------------------------------------------------------------------------------

    def _row(self, slot: int) -> memoryview:
        if self._rows is None:
            raise TieringError(f"tier {self.name!r} is not attached to a manager's rows")
        return memoryview(self._rows[slot])

    @staticmethod
    def _outcomes(job: TierJob, result: object, latencies: LatencyRecord) -> list[Outcome]:
        if isinstance(result, IOResult):
            latencies.add(result.elapsed_s)
            return result.outcomes
        return [FAILED] * len(job.keys)  # the job itself failed (it should not, but be safe)

    # -- I/O (I/O loop only; every failure becomes an outcome, nothing escapes) -------------------

    async def _write(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview], victims: Collection[bytes]
    ) -> IOResult:
        """Delete ``victims`` from the backend, then write ``keys``."""
        start = time.perf_counter()
        try:
            if victims:
                await self.backend.delete(list(victims))
            outcomes = await self._put(list(keys), list(buffers))
            if len(outcomes) != len(keys):
                outcomes = [FAILED] * len(keys)  # a backend breaking its contract fails the job
        except asyncio.CancelledError:
            raise
        except BaseException:  # whatever a backend raises fails the job, never the I/O thread
            logger.debug("tier %r: write of %d blocks failed", self.name, len(keys), exc_info=True)
            outcomes = [FAILED] * len(keys)
        return IOResult(outcomes, time.perf_counter() - start)

    async def _put(self, keys: list[bytes], buffers: list[memoryview]) -> list[Outcome]:
        """The backend call that writes a store job's blocks."""
        return await self.backend.put(keys, buffers)

    async def _read(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> IOResult:
        """Read ``keys`` into ``buffers``."""
        start = time.perf_counter()
        try:
            outcomes = await self.backend.get(list(keys), list(buffers))
            if len(outcomes) != len(keys):
                outcomes = [FAILED] * len(keys)
        except asyncio.CancelledError:
            raise
        except BaseException:
            logger.debug("tier %r: read of %d blocks failed", self.name, len(keys), exc_info=True)
            outcomes = [FAILED] * len(keys)
        return IOResult(outcomes, time.perf_counter() - start)

    async def _delete(self, keys: Sequence[bytes]) -> None:
        try:
            await self.backend.delete(list(keys))
        except asyncio.CancelledError:
            raise
        except BaseException:  # best effort: the index has already forgotten them
            logger.debug("tier %r: delete failed", self.name, exc_info=True)

    async def _close(self) -> None:
        await self.backend.close()
