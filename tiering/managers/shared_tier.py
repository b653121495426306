"""A shared tier: a secondary tier whose store other engine nodes write and evict too (a Redis
Cluster that every replica of a deployment points at), so the store is its own index.

A :class:`~tiering.managers.secondary_tier.SecondaryTier` owns what it stores: an in-memory index,
an eviction
policy, a byte budget; it evicts by deleting. A shared tier can own none of that: other nodes
write blocks it never hears of, and the store evicts blocks by itself (Redis ``maxmemory``).
So a :class:`SharedTier`

- keeps no index. What it knows is a bounded cache of recent answers, key -> present or absent
  (``existence_cache_seconds``, at most ``existence_cache_max_keys``), learnt from existence
  checks, from its own writes and from its reads. A key the cache says is present is READY
  (promoted like any tier's); a key it knows nothing of is *unknown*: the manager batches the
  unknown keys of a request and the tier asks the store about all of them at once
  (:meth:`start_check`: one ``exists`` call, one round trip per store node), answering "retry
  later" meanwhile; :meth:`finish_check` caches the answers and hands back the keys found, which
  the manager promotes at once. An answer the store could not give (its node failed: ``exists``
  says None) is never cached: the key is quarantined for ``quarantine_seconds`` (lookups answer
  "absent" meanwhile, so a request is not told "retry later" step after step while a node is
  down) and asked about again afterwards.
- writes with ``put_if_absent`` (``write_through`` or ``write_through_selective``; there is no
  ``write_back``: a shared tier exists so that other nodes see a block soon, and a write-back
  would hold the primary's slot on a network write at every eviction). Blocks the cache says are
  present are not sent at all; the store skips those another node wrote meanwhile (atomically,
  for a backend with a set-if-absent), so a block is written once however many nodes store it.
- never deletes and never evicts: no budget, no policy; capacity is the store's. A store that is
  full (``FULL``) fails the write, counted, with no retry (there is no room of ours to make).
- treats a block that vanished (evicted, expired) or does not verify as a miss: the promotion
  fails for that key and the cache learns "absent".
- emits no events: its content changes without this node (other writers, the store's
  eviction), and a manager emits events only for state it owns, as vLLM's do; a router learning
  from events must not think a block in the shared store is this replica's.
- at ``reset_cache`` (which engines run after a weight update) stops reading and writing the
  store for good (status ``reset``, logged once) and deletes nothing: the store may hold
  blocks computed under the old weights, which this node must never serve, and the other
  nodes' blocks are theirs. Restart the node with a fresh ``key_prefix`` (every node that
  changed weights the same) to share again.

Its jobs follow :mod:`tiering.managers.secondary_tier`: the manager pins the primary rows a job
uses, submits it,
and hands its result back; the tier decides and counts (:class:`SharedTierMetrics`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import cachetools

from tiering.backends.base import Outcome, StorageBackend
from tiering.core.block_format import MAX_KEY_BYTES
from tiering.core.keys import GROUP_INDEX_BYTES
from tiering.errors import ConfigurationError
from tiering.managers.protocol import ConfigInfo
from tiering.managers.secondary_tier import (
    PromotionResult,
    SecondaryTier,
    StoreResult,
    TierJob,
    TierKeyState,
    TierMetrics,
    WritePolicy,
)
from tiering.managers.tier_admission import admit

__all__ = ["CheckResult", "SharedTier", "SharedTierMetrics"]

logger = logging.getLogger(__name__)

OK = Outcome.OK
READY, ABSENT, UNKNOWN = TierKeyState.READY, TierKeyState.ABSENT, TierKeyState.UNKNOWN


@dataclass
class SharedTierMetrics(TierMetrics):
    """A shared tier's counters: :class:`~tiering.managers.secondary_tier.TierMetrics` plus its
    existence checks.

    ``lookup_hits`` counts lookups the cache answered "present"; ``cached_misses`` those it
    answered "absent" (or the key was quarantined) without asking the store. ``stored_blocks``
    counts blocks the store acknowledged holding after a write (written, or found there);
    ``bytes_written`` and ``put_skipped_present`` are the backend's own counts of bytes it wrote
    and of blocks its ``put_if_absent`` found present (sent, not written).
    """

    existence_checks: int = 0  # check jobs: one per request (and step) with unknown keys
    checked_keys: int = 0  # keys asked about
    check_hits: int = 0  # keys a check found present (then promoted)
    check_absent: int = 0  # keys a check found absent
    check_unknown: int = 0  # keys a check could not answer (their node failed): quarantined
    cached_misses: int = 0  # lookups answered "absent" from the cache or the quarantine
    writes_skipped_cached: int = 0  # blocks not sent: the cache said the store holds them
    put_skipped_present: int = 0  # blocks sent but not written: the store held them already


@dataclass(frozen=True)
class CheckResult:
    """What a check coroutine returns: per key True (present), False (absent) or None
    (unknown: its node failed), and its duration."""

    present: list[bool | None]
    elapsed_s: float


class SharedTier(SecondaryTier):
    """A tier over a shared backend (``backend.capabilities.shared``); see the module docstring.

    ``write_policy`` is ``write_through`` or ``write_through_selective``. ``quarantine_seconds``
    (> 0) is how long a key whose check or read failed counts as absent;
    ``existence_cache_seconds`` (> 0) how long an answer of the store is trusted; the cache holds
    at most ``existence_cache_max_keys`` answers (the oldest dropped first). An answer must
    outlive the gap between a step's end and the next step's lookups (a few milliseconds in an
    engine), or a lookup would ask again for ever; the default, 2 s, also bounds how long this
    node may take to see a block another node has just written.
    """

    shared: ClassVar[bool] = True

    def __init__(
        self,
        backend: StorageBackend,
        *,
        name: str | None = None,
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        selective_min_lookups: int = 2,
        max_inflight_jobs: int = 4,
        quarantine_seconds: float = 10.0,
        quarantine_max_keys: int = 65536,
        existence_cache_seconds: float = 2.0,
        existence_cache_max_keys: int = 65536,
        io_timeout_s: float = 30.0,
        admission_min_count: int = 0,
        admission_width: int | None = None,
    ) -> None:
        tier_name = name or backend.name
        if not backend.capabilities.shared:
            raise ConfigurationError(
                f"tier {tier_name!r}: the {backend.name!r} backend is not shared "
                "(capabilities.shared is False): run it as a SecondaryTier, which keeps an index"
            )
        super().__init__(
            backend,
            name=name,
            write_policy=write_policy,
            selective_min_lookups=selective_min_lookups,
            max_inflight_jobs=max_inflight_jobs,
            quarantine_seconds=quarantine_seconds,
            quarantine_max_keys=quarantine_max_keys,
            io_timeout_s=io_timeout_s,
            admission_min_count=admission_min_count,
            admission_width=admission_width,
        )
        if self.write_policy is WritePolicy.WRITE_BACK:
            raise ConfigurationError(
                f"tier {self.name!r}: a shared tier cannot be write_back (other nodes would see "
                "a block only once this node evicts it, and every eviction would wait for a "
                "network write); use write_through or write_through_selective"
            )
        if not quarantine_seconds > 0:
            raise ConfigurationError(
                f"tier {self.name!r}: a shared tier needs quarantine_seconds > 0, got "
                f"{quarantine_seconds} (a key whose node is down would otherwise be asked "
                "about, and answered 'retry later', at every step)"
            )
        if not existence_cache_seconds > 0:
            raise ConfigurationError(
                f"tier {self.name!r}: existence_cache_seconds must be > 0, got "
                f"{existence_cache_seconds} (an answer must live until the lookup that asked "
                "for it comes back)"
            )
        if existence_cache_max_keys < 1:
            raise ConfigurationError(
                f"tier {self.name!r}: existence_cache_max_keys must be >= 1, got "
                f"{existence_cache_max_keys}"
            )
        self.existence_cache_seconds = float(existence_cache_seconds)
        self.existence_cache_max_keys = existence_cache_max_keys
        self.metrics: SharedTierMetrics = SharedTierMetrics()
        # key -> present (True) or absent (False); unknown answers are never put here.
        self._known: cachetools.TTLCache[bytes, bool] = cachetools.TTLCache(
            maxsize=existence_cache_max_keys, ttl=existence_cache_seconds, timer=time.monotonic
        )

    # -- lifecycle --------------------------------------------------------------------------------

    def adopt(self, recovered: Sequence[bytes]) -> None:
        """Open: the store is the index, so whatever the backend recovered is not kept (a
        shared backend recovers nothing)."""
        self.status = "open"

    def config_info(self) -> ConfigInfo:
        info = super().config_info()
        info["policy"] = "none"  # the store evicts, by its own policy
        info["shared"] = True
        info["existence_cache_seconds"] = self.existence_cache_seconds
        return info

    # -- what the tier knows (manager thread only) ------------------------------------------------

    def state(self, key: bytes) -> TierKeyState:
        """READY if the cache says the store holds ``key``; UNKNOWN if nothing is known of it
        (the manager then asks the store); ABSENT if the cache says absent or the key is
        quarantined (counted in ``cached_misses``: a lookup answered without asking), or if the
        tier is not open or the key is not one a backend stores. The only side effect is that
        count (``locate``, a tool's call, adds to it too). ABSENT while stalled."""
        if self._stuck_jobs:
            return ABSENT
        answer = self._known.get(key)
        if answer is True:
            return READY
        if answer is None and key not in self._quarantine:
            if self.serving and GROUP_INDEX_BYTES < len(key) <= MAX_KEY_BYTES:
                return UNKNOWN
            return ABSENT
        self.metrics.cached_misses += 1
        return ABSENT

    def is_unknown(self, key: bytes) -> bool:
        """Whether nothing is known of ``key`` (no answer cached, not quarantined): what
        :meth:`state` answers UNKNOWN for, without counting anything."""
        return (
            key not in self._known
            and key not in self._quarantine
            and self.serving
            and GROUP_INDEX_BYTES < len(key) <= MAX_KEY_BYTES
        )

    def partition(self, keys: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """``keys`` (deduplicated, in order) as (cached present, unknown); the others (cached
        absent, quarantined, not storable) are dropped."""
        present: list[bytes] = []
        unknown: list[bytes] = []
        if not self.serving:
            return present, unknown
        known, quarantine = self._known, self._quarantine
        for key in dict.fromkeys(keys):
            answer = known.get(key)
            if answer is True:
                present.append(key)
            elif (
                answer is None
                and key not in quarantine
                and GROUP_INDEX_BYTES < len(key) <= MAX_KEY_BYTES
            ):
                unknown.append(key)
        return present, unknown

    def readable(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys a promotion may read: not known to be absent, not quarantined. (A key whose
        answer expired since its check is read anyway: if it is gone, the read says so.)"""
        if not self.serving:
            return []
        known, quarantine = self._known, self._quarantine
        return [k for k in keys if known.get(k) is not False and k not in quarantine]

    # -- existence checks -------------------------------------------------------------------------

    def start_check(self, keys: Sequence[bytes], *, req_context: object = None) -> TierJob | None:
        """One job asking the store whether it holds ``keys`` (deduplicated; keys no longer
        unknown are left out); None if there is nothing to ask. While it runs the manager
        answers "retry later" for its keys."""
        _, unknown = self.partition(keys)
        if not unknown:
            return None
        self.metrics.existence_checks += 1
        self.metrics.checked_keys += len(unknown)
        return TierJob("check", self, tuple(unknown), self._check(unknown), req_context=req_context)

    def finish_check(self, job: TierJob, result: object) -> list[bytes]:
        """Cache the answers (unknown ones are quarantined, never cached); return the keys the
        store holds, for the manager to promote."""
        answers: list[bool | None]
        if isinstance(result, CheckResult) and len(result.present) == len(job.keys):
            answers = result.present
        else:  # the job itself failed (it should not): nothing is known
            answers = [None] * len(job.keys)
        present: list[bytes] = []
        unknown = 0
        known, quarantine = self._known, self._quarantine
        for key, answer in zip(job.keys, answers, strict=True):
            if answer is None:
                quarantine[key] = True
                unknown += 1
                continue
            known[key] = answer
            if answer:
                present.append(key)
        metrics = self.metrics
        metrics.check_hits += len(present)
        metrics.check_absent += len(job.keys) - len(present) - unknown
        metrics.check_unknown += unknown
        metrics.quarantined += unknown
        return present

    async def _check(self, keys: list[bytes]) -> CheckResult:
        start = time.perf_counter()
        try:
            answers = await self.backend.exists(keys)
            if len(answers) != len(keys):
                answers = [None] * len(keys)  # a backend breaking its contract knows nothing
        except asyncio.CancelledError:
            raise
        except BaseException:  # whatever a backend raises is "unknown", never the I/O thread's
            logger.debug("tier %r: existence check of %d keys failed", self.name, len(keys),
                         exc_info=True)  # fmt: skip
            answers = [None] * len(keys)
        return CheckResult(list(answers), time.perf_counter() - start)

    # -- stores -----------------------------------------------------------------------------------

    def start_store(
        self,
        keys: Sequence[bytes],
        slots: Mapping[bytes, int],
        *,
        lookup_counts: Mapping[bytes, int],
        req_context: object = None,
    ) -> TierJob | None:
        """Write the keys that just became ready in the primary, by write policy, with
        ``put_if_absent``; keys the cache says the store holds are not sent (counted), nor keys
        this tier is writing already, nor keys its admission gate keeps out (counted). None if
        nothing is to be written, or the write is shed over the job bound (counted), or the
        tier is stalled."""
        if not self.serving:
            return None
        if self.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            wanted = self.selective_min_lookups
            keys = [k for k in keys if lookup_counts.get(k, 0) >= wanted]
        known, writing = self._known, self._writing
        send = []
        skipped = 0
        for key in dict.fromkeys(keys):
            if key in writing:
                continue
            if known.get(key) is True:
                skipped += 1
            else:
                send.append(key)
        self.metrics.writes_skipped_cached += skipped
        if send and self.admission is not None:
            send = admit(self.admission, send, (), self.metrics)
        if not send:
            return None
        if not self.has_capacity_for_job:
            self.metrics.stores_shed += len(send)
            return None
        writing.update(send)
        self.metrics.store_jobs += 1
        return self._io.write_job("store", send, [slots[k] for k in send], (), req_context)

    def start_put(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview], *, req_context: object = None
    ) -> TierJob | None:
        """An embedder's put (see :meth:`SecondaryTier.start_put`), with ``put_if_absent``: keys
        the cache says the store holds, or this tier is writing, are not sent."""
        if self.status != "open":
            return None
        if len(buffers) != len(keys):
            raise ValueError(f"start_put got {len(keys)} keys but {len(buffers)} buffers")
        known, writing = self._known, self._writing
        index = {k: i for i, k in enumerate(keys)}
        send = [k for k in index if k not in writing and known.get(k) is not True]
        self.metrics.writes_skipped_cached += len(index) - len(send)
        if not send:
            return None
        writing.update(send)
        self.metrics.store_jobs += 1
        picked = [index[k] for k in send]
        return self._io.write_job(
            "put", send, picked, (), req_context, buffers=[buffers[i] for i in picked]
        )

    async def _put(self, keys: list[bytes], buffers: list[memoryview]) -> list[Outcome]:
        return await self.backend.put_if_absent(keys, buffers)

    def finish_store(self, job: TierJob, result: object) -> StoreResult:
        """The store holds what was acknowledged (the cache learns it); the rest failed, with
        no retry. Every row is released; nothing is announced (see the module docstring)."""
        self.inflight_jobs -= 1
        outcomes = self._outcomes(job, result, self.metrics.store_latency_s)
        known, writing, quarantine = self._known, self._writing, self._quarantine
        stored = 0
        for key, outcome in zip(job.keys, outcomes, strict=True):
            writing.discard(key)
            if outcome is OK:
                known[key] = True
                quarantine.pop(key, None)
                stored += 1
        metrics = self.metrics
        metrics.stored_blocks += stored
        metrics.store_failures += len(job.keys) - stored
        backend_stats = self.backend.stats
        metrics.bytes_written = backend_stats.bytes_written
        metrics.put_skipped_present = backend_stats.extra.get("put_skipped_present", 0)
        return StoreResult([], list(zip(job.keys, job.slots, strict=True)), None)

    # -- promotions -------------------------------------------------------------------------------

    def start_promotion(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        *,
        req_context: object = None,
        buffers: Sequence[memoryview] | None = None,
    ) -> TierJob:
        """Read ``keys`` into the primary slots reserved for them (or into ``buffers``)."""
        self.metrics.promotions += 1
        return self._io.read_job(keys, slots, req_context, buffers)

    def finish_promotion(self, job: TierJob, result: object) -> PromotionResult:
        """Keys read are loaded; a key gone or corrupt in the store is a miss the cache
        remembers as absent; a key whose node failed is quarantined."""
        self.inflight_jobs -= 1
        outcomes = self._outcomes(job, result, self.metrics.load_latency_s)
        loaded: list[bytes] = []
        failed: list[bytes] = []
        metrics = self.metrics
        known = self._known
        for key, buffer, outcome in zip(job.keys, job.buffers, outcomes, strict=True):
            if outcome is OK:
                loaded.append(key)
                metrics.bytes_read += buffer.nbytes
                known[key] = True
                continue
            failed.append(key)
            metrics.promotion_failures += 1
            if outcome is Outcome.CORRUPT:
                metrics.corrupt_blocks += 1
            if outcome in (Outcome.CORRUPT, Outcome.MISSING):
                known[key] = False  # gone (a corrupt block has been unlinked)
            else:
                known.pop(key, None)
                self._quarantine[key] = True
                metrics.quarantined += 1
        metrics.promoted_blocks += len(loaded)
        return PromotionResult(loaded, failed, [])

    # -- deadlines --------------------------------------------------------------------------------

    def _purge_job(self, keys: Sequence[bytes]) -> TierJob | None:
        """A late write to the shared store wrote the block's own bytes (its rows stayed
        pinned), under ``put_if_absent``: it is as good as another node's; a shared tier never
        deletes. Nothing to purge."""
        self._stuck.difference_update(keys)
        return None

    def _ready_keys(self) -> list[bytes]:
        return []  # a shared tier announces nothing (see the module docstring)

    # -- reset ------------------------------------------------------------------------------------

    def start_clear(self) -> TierJob | None:
        """Forget every answer and stop using the store (status ``reset``); delete nothing (see
        the module docstring)."""
        self._known.clear()
        self._quarantine.clear()
        self._writing.clear()
        self._reading.clear()
        if self.status == "open":
            self.status = "reset"
            self.open_error = "reset_cache: the store may hold blocks of the old weights"
            logger.warning(
                "shared tier %r was reset (reset_cache, e.g. after a weight update): it no longer "
                "reads or writes its store, which may hold blocks computed under the old weights "
                "and is other nodes' too (nothing was deleted). Restart with a new key_prefix "
                "to share again",
                self.name,
            )
        return None
