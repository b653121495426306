"""tiering's storage backends as secondary tiers of vLLM 0.33's own tiering offloading spec.

For operators who keep vLLM's CPU tier (``spec_name: "TieringOffloadingSpec"``): each entry of
its ``secondary_tiers`` list may be one of tiering's backends (``file``, ``lmdb``, a plugin's, or
``package.module:Class``), with the verification, restart and events they have in tiering::

    "secondary_tiers": [
      {"type": "tiering", "tiering_config": "/etc/tiering.yaml", "tier": "nvme"},
      {"type": "tiering", "backend": "lmdb", "name": "lmdb", "capacity": "16GiB",
       "path": "/var/cache/kv-lmdb", "sync": false}
    ]

The ``tiering`` type is registered by tiering's ``vllm.general_plugins`` entry point
(:mod:`tiering.integrations.vllm_plugin`); without it, write ``"type": "TieringSecondaryTier",
"module_path": "tiering.integrations.vllm_tiers"``. A tier is either one tier of a tiering YAML
file (``tiering_config`` and, if the file has more than one, ``tier``; its ``primary`` and
``model`` sections are not used: vLLM owns the CPU tier and the layout) or given inline with the
keys of a YAML tier, ``backend`` standing for ``type``. Relative paths are taken from the YAML
file's directory, or from the engine's working directory for inline keys. ``enable_kv_events``
(with vLLM's KV events on) makes the tier publish its stores and removals as ``STORAGE`` events
owned by the tier's name; ``locality`` (``LOCAL``/``REMOTE``) is passed on in them.

What the tier does
    It stores whole rows of vLLM's CPU tier (every worker's slot of a chunk; padding excluded)
    as blocks of its backend, under the fingerprint of :mod:`tiering.integrations.vllm_layout`:
    a block written under another model, dtype, chunking or parallel layout is never served,
    and a restart serves what the backend recovered, verified. Its index (which keys it holds,
    which are being written or read, the eviction order of its ``policy``) lives in memory and
    is touched only by the caller's thread (vLLM calls every method under its manager's lock);
    the backend's I/O runs on an event loop of the tier's own, so no call blocks on disk except
    the constructor (which opens the backend and recovers its index), :meth:`drain_jobs` and
    :meth:`shutdown`. A job's result is taken at the first :meth:`get_finished_jobs` after its
    I/O finished; vLLM's manager calls it at most once per scheduler step.

Lookups answer ``HIT`` for a key written and acknowledged, ``RETRY`` while its write is in
flight, ``MISS`` otherwise (absent, or quarantined for ``quarantine_seconds`` after a read that
failed with an I/O error). A read that finds a block corrupt or gone drops the key (a removal
event); the failed keys of a promotion are reported, the others kept. While ``max_inflight_jobs``
store jobs are still writing, further stores are shed and reported failed (vLLM's manager keeps
a store's CPU rows pinned until it completes, so an unbounded queue would stall the CPU tier);
promotions always run.
vLLM cascades every block stored in its CPU tier to every tier, so ``write_policy`` can only be
``write_through``, and a tier takes no admission gate (``admission_min_count``: tiering's own
manager, e.g. its drop-in, records the lookups a gate needs).
"""

from __future__ import annotations

import concurrent.futures
import gc
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import cachetools
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from tiering.backends.base import Outcome, StorageBackend
from tiering.config import TierConfig, build_backend, load_config, parse_config
from tiering.errors import BackendError, ConfigError, ProtocolError
from tiering.integrations.vllm_extra import check_tier_entry
from tiering.integrations.vllm_layout import chunk_data_bytes, layout_fingerprint
from tiering.integrations.vllm_metric_names import (
    RuleReport,
    TieringTierMetrics,
    tier_metric_definitions,
)
from tiering.managers.io_loop import IOLoop
from tiering.policies import EvictionPolicy, make_policy

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["TieringSecondaryTier", "TieringTierMetrics"]


_INFO_KEYS = (
    "tiering_name",
    "tiering_backend",
    "tiering_capacity_bytes",
    "tiering_persistent",
    "tiering_fingerprint",
)


@dataclass
class _Job:
    """One store or load of the tier, from submission to :meth:`get_finished_jobs`."""

    job_id: int
    is_store: bool
    keys: list[bytes]  # the keys the backend moves (a store skips the ones present)
    failed_keys: list[bytes]  # keys of the job that failed before any I/O
    future: concurrent.futures.Future[tuple[list[Outcome], float]]


class TieringSecondaryTier(SecondaryTierManager):
    """One of tiering's storage backends as a vLLM secondary tier; see the module docstring."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        tiering_config: str | None = None,
        tier: str | None = None,
        backend: str | None = None,
        enable_kv_events: bool = False,
        locality: str | None = None,
        **tier_keys: Any,
    ) -> None:
        check_tier_entry(
            tier_type,
            {
                "tiering_config": tiering_config,
                "tier": tier,
                "backend": backend,
                "enable_kv_events": enable_kv_events,
                "locality": locality,
            },
        )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        settings = _tier_settings(tier_type, tiering_config, tier, backend, tier_keys)
        self.name = settings.name
        self.settings = settings
        self.locality = _parse_locality(locality, self.name)
        self._chunk_bytes = chunk_data_bytes(offloading_spec)
        assert primary_kv_view.strides is not None and primary_kv_view.shape is not None
        row_bytes = primary_kv_view.strides[0]
        if not 0 < self._chunk_bytes <= row_bytes:
            raise ConfigError(
                f"tier {self.name!r}: a chunk holds {self._chunk_bytes} bytes of KV but a row of "
                f"the CPU tier is {row_bytes} bytes; the offloading spec and its region disagree"
            )
        self._row_bytes = row_bytes
        # One flat byte view of the whole region: a row's slots are a slice of it, no copy.
        self._region = primary_kv_view.cast("B")
        self.fingerprint = layout_fingerprint(offloading_spec)
        self.backend: StorageBackend = build_backend(
            settings, block_bytes=self._chunk_bytes, fingerprint=self.fingerprint
        )
        if self.backend.capabilities.shared:
            raise ConfigError(
                f"tier {self.name!r}: the {self.backend.name!r} backend is shared (other engine "
                "nodes write and evict its store) and this tier evicts by deleting: it would "
                "delete their blocks. A shared store is a shared tier of tiering's own manager "
                "(docs/distributed.md)"
            )
        self._events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self._events = []
        self._writing: set[bytes] = set()
        self._reading: dict[bytes, int] = {}
        self._quarantine: cachetools.TTLCache[bytes, bool] = cachetools.TTLCache(
            maxsize=65536, ttl=settings.quarantine_seconds, timer=time.monotonic
        )
        self._jobs: dict[int, _Job] = {}
        self._stats = OffloadingConnectorStats()
        self._label = (self.name,)
        self._rule_report = RuleReport()
        self._closed = False
        self._io = IOLoop(name=f"tiering-tier-{self.name}")
        try:
            # At engine start, before the first step: recover the index the backend verified.
            # Bounded: a hung mount or a stopped server fails the start, naming the tier, rather
            # than hang it (vLLM waits for its tiers here; there is no "join later").
            opening = self._io.submit(self.backend.open())
            try:
                recovered = opening.result(timeout=settings.io_timeout_s)
            except concurrent.futures.TimeoutError:
                opening.cancel()  # the open stops waiting; its blocked thread is abandoned
                raise BackendError(
                    f"tier {self.name!r}: its {self.backend.name!r} backend did not open within "
                    f"io_timeout_s={settings.io_timeout_s:g} s (a hung mount or a stopped "
                    "server?); raise io_timeout_s in the tier's entry if opening is slow"
                ) from None
            self._policy: EvictionPolicy = make_policy(
                settings.policy, self.backend.capacity_blocks
            )
        except BaseException:
            self._io.close()
            raise
        for key in recovered:
            if key not in self._policy:
                self._policy.insert(key)

    # -- what vLLM's manager asks ---------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if key not in self._policy or key in self._quarantine:
            return LookupResult.MISS
        if key in self._writing:
            return LookupResult.RETRY
        return LookupResult.HIT

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._policy.touch(list(keys))

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys, rows = self._job_rows(job_metadata)
        present = [key for key in keys if key in self._policy]
        # Storing a block again means a request produced it again: a use.
        self._policy.touch(present)
        to_write = [key for key in dict.fromkeys(keys) if key not in self._policy]
        if not to_write:
            self._start(job_metadata.job_id, True, [], [], [], [])
            return
        if self._stores_in_flight() >= self.settings.max_inflight_jobs:
            self._stats.increase_counter(TieringTierMetrics.SHED_BLOCKS, len(to_write), self._label)
            self._start(job_metadata.job_id, True, [], to_write, [], [])
            return
        self._policy.note_misses(to_write)  # the protocol: before the eviction for them
        victims = self._evict_for(len(to_write), protected=keys)
        if victims is None:
            self._stats.increase_counter(TieringTierMetrics.SHED_BLOCKS, len(to_write), self._label)
            self._start(job_metadata.job_id, True, [], to_write, [], [])
            return
        for key in to_write:
            self._policy.insert(key, evictable=False)
            self._writing.add(key)
        row_of = dict(zip(keys, rows, strict=True))
        self._start(job_metadata.job_id, True, to_write, [], [row_of[k] for k in to_write], victims)

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys, rows = self._job_rows(job_metadata)
        context = job_metadata.req_context
        readable = [k for k in keys if self.lookup(OffloadKey(k), context) is LookupResult.HIT]
        readable_set = set(readable)
        missing = [k for k in keys if k not in readable_set]
        for key in readable:
            count = self._reading.get(key, 0)
            if count == 0:
                self._policy.set_evictable(key, False)
            self._reading[key] = count + 1
        # A promotion serves a request: the blocks it reads are the tier's most valuable.
        self._policy.touch(readable)
        row_of = dict(zip(keys, rows, strict=True))
        self._start(
            job_metadata.job_id, False, readable, missing, [row_of[k] for k in readable], []
        )

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for job_id, job in list(self._jobs.items()):  # in submission order
            if job.future.done():
                del self._jobs[job_id]
                results.append(self._finish_store(job) if job.is_store else self._finish_load(job))
        return results

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        concurrent.futures.wait([job.future for job in self._jobs.values()])

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self._events:
            events, self._events = self._events, []
            yield from events

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats, self._stats = self._stats, OffloadingConnectorStats()
        stats.set_gauge(TieringTierMetrics.USAGE_BYTES, self.backend.usage_bytes, self._label)
        stats.set_gauge(TieringTierMetrics.CAPACITY_BYTES, self.backend.capacity_bytes, self._label)
        self._rule_report.report(stats, self._policy, self.name)
        return stats

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return tier_metric_definitions()

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return _INFO_KEYS

    def config_info(self) -> ConfigInfoMapping:
        return {
            "tiering_name": self.name,
            "tiering_backend": self.settings.type,
            "tiering_capacity_bytes": self.backend.capacity_bytes,
            "tiering_persistent": self.backend.capabilities.persistent,
            "tiering_fingerprint": self.fingerprint.hex(),
        }

    def shutdown(self) -> None:
        """Wait for the I/O in flight, close the backend and the tier's loop. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.drain_jobs()
        try:
            self._io.submit(self.backend.close()).result()
        finally:
            self._io.close()
            self._jobs.clear()
            # vLLM unmaps the region after its tiers shut down; a row view still alive would
            # keep it mapped. Views can outlive a job in garbage cycles (the traceback of a
            # backend's per-key error references its frames), hence the collection.
            self._region.release()
            gc.collect()

    # -- internals --------------------------------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy:
        """The tier's eviction order (read-only use: tests and diagnostics)."""
        return self._policy

    def _job_rows(self, job: TransferJob) -> tuple[list[bytes], list[memoryview]]:
        keys: list[bytes] = list(job.keys)
        chunk_ids = [int(c) for c in job.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise ProtocolError(
                f"tier {self.name!r}: job {job.job_id} has {len(keys)} keys but "
                f"{len(chunk_ids)} chunk ids; each key needs the row it moves through"
            )
        rows = [self._row(c) for c in chunk_ids]
        return keys, rows

    def _row(self, chunk_id: int) -> memoryview:
        start = chunk_id * self._row_bytes
        return self._region[start : start + self._chunk_bytes]

    def _stores_in_flight(self) -> int:
        """Store jobs whose writes the backend has not finished (the tier's I/O queue depth)."""
        return sum(1 for j in self._jobs.values() if j.is_store and j.keys and not j.future.done())

    def _evict_for(self, count: int, protected: Sequence[bytes]) -> list[bytes] | None:
        """Make room for ``count`` new keys; the victims, already gone from the index."""
        capacity = self.backend.capacity_blocks
        if count > capacity:
            return None
        shortfall = len(self._policy) + count - capacity
        if shortfall <= 0:
            return []
        victims = self._policy.evict(shortfall, protected=set(protected))
        if victims is None:
            return None
        for key in victims:
            self._quarantine.pop(key, None)
        self._stats.increase_counter(TieringTierMetrics.EVICTED_BLOCKS, len(victims), self._label)
        self._emit(victims, removed=True)
        return victims

    def _start(
        self,
        job_id: int,
        is_store: bool,
        keys: list[bytes],
        failed_keys: list[bytes],
        rows: list[memoryview],
        victims: list[bytes],
    ) -> None:
        if job_id in self._jobs:
            raise ProtocolError(f"tier {self.name!r}: job {job_id} was submitted twice")
        coro = self._write(keys, rows, victims) if is_store else self._read(keys, rows)
        self._jobs[job_id] = _Job(job_id, is_store, keys, failed_keys, self._io.submit(coro))

    async def _write(
        self, keys: list[bytes], rows: list[memoryview], victims: list[bytes]
    ) -> tuple[list[Outcome], float]:
        start = time.perf_counter()
        try:
            if victims:
                await self.backend.delete(victims)
            outcomes = await self.backend.put(keys, rows) if keys else []
        except Exception:  # a broken backend fails the job, never the engine
            outcomes = [Outcome.FAILED] * len(keys)
        return outcomes, time.perf_counter() - start

    async def _read(self, keys: list[bytes], rows: list[memoryview]) -> tuple[list[Outcome], float]:
        start = time.perf_counter()
        try:
            outcomes = await self.backend.get(keys, rows) if keys else []
        except Exception:
            outcomes = [Outcome.FAILED] * len(keys)
        return outcomes, time.perf_counter() - start

    def _finish_store(self, job: _Job) -> JobResult:
        outcomes, elapsed_s = job.future.result()
        published = []
        for key, outcome in zip(job.keys, outcomes, strict=True):
            self._writing.discard(key)
            if outcome is Outcome.OK:
                self._policy.set_evictable(key, key not in self._reading)
                published.append(key)
            else:
                self._policy.remove(key)
        failed = len(job.keys) - len(published)
        if published:
            self._stats.increase_counter(
                TieringTierMetrics.STORED_BLOCKS, len(published), self._label
            )
            self._emit(published, removed=False)
        if failed:
            self._stats.increase_counter(
                TieringTierMetrics.STORE_FAILED_BLOCKS, failed, self._label
            )
        return JobResult(
            job_id=job.job_id,
            success=not failed and not job.failed_keys,
            transfer_time=elapsed_s if job.keys else None,
            transfer_bytes=len(published) * self._chunk_bytes if job.keys else None,
        )

    def _finish_load(self, job: _Job) -> JobResult:
        outcomes, elapsed_s = job.future.result()
        loaded: list[bytes] = []
        dropped: list[bytes] = []
        for key, outcome in zip(job.keys, outcomes, strict=True):
            count = self._reading.pop(key, 1) - 1
            if count:
                self._reading[key] = count
            if outcome is Outcome.OK:
                loaded.append(key)
                if not count and key in self._policy:
                    self._policy.set_evictable(key, True)
            elif outcome in (Outcome.CORRUPT, Outcome.MISSING):
                # The backend no longer holds it (a corrupt block is deleted on read).
                if outcome is Outcome.CORRUPT:
                    self._stats.increase_counter(TieringTierMetrics.CORRUPT_BLOCKS, 1, self._label)
                if key in self._policy:
                    self._policy.remove(key)
                    dropped.append(key)
            else:
                self._quarantine[key] = True
                if not count and key in self._policy:
                    self._policy.set_evictable(key, True)
        if dropped:
            self._emit(dropped, removed=True)
        failed = len(job.keys) - len(loaded) + len(job.failed_keys)
        if loaded:
            self._stats.increase_counter(TieringTierMetrics.READ_BLOCKS, len(loaded), self._label)
        if failed:
            self._stats.increase_counter(TieringTierMetrics.READ_FAILED_BLOCKS, failed, self._label)
        return JobResult(
            job_id=job.job_id,
            success=not failed,
            successful_keys=[OffloadKey(k) for k in loaded] if failed and loaded else None,
            transfer_time=elapsed_s if job.keys else None,
            transfer_bytes=len(loaded) * self._chunk_bytes if job.keys else None,
        )

    def _emit(self, keys: list[bytes], *, removed: bool) -> None:
        if self._events is None or not keys:
            return
        self._events.append(
            OffloadingEvent(
                keys=[OffloadKey(k) for k in keys],
                medium=Medium.STORAGE,
                removed=removed,
                locality=self.locality,
                ownership=self.name,
                # Stored keys are announced again when they go: consumers keep their metadata.
                removal_expected=not removed,
            )
        )


def _tier_settings(
    tier_type: str,
    tiering_config: str | None,
    tier: str | None,
    backend: str | None,
    tier_keys: Mapping[str, Any],
) -> TierConfig:
    """The tier's settings, from a tiering YAML file or from the entry's own keys."""
    where = f"vLLM secondary tier {tier_type!r}"
    if tiering_config is not None:
        if backend is not None or tier_keys:
            extra = sorted([*tier_keys, *(["backend"] if backend is not None else [])])
            raise ConfigError(
                f"{where}: give either 'tiering_config' (and 'tier') or the tier's keys inline, "
                f"not both; also given: {', '.join(extra)}"
            )
        config = load_config(tiering_config)
        if tier is not None:
            settings = config.tier(tier)
        elif len(config.secondary_tiers) == 1:
            settings = config.secondary_tiers[0]
        else:
            names = ", ".join(t.name for t in config.secondary_tiers) or "none"
            raise ConfigError(
                f"{where}: {tiering_config} has {len(config.secondary_tiers)} tiers; say which "
                f"with 'tier' (one of: {names})"
            )
    else:
        if tier is not None:
            raise ConfigError(
                f"{where}: 'tier' names a tier of a tiering YAML file; give 'tiering_config' "
                "too, or the tier's keys inline with 'backend'"
            )
        if backend is None:
            raise ConfigError(
                f"{where}: missing 'backend' (file, lmdb, a plugin's name or "
                "'package.module:Class'), or 'tiering_config' naming a tiering YAML file"
            )
        # The entry's keys are a YAML tier's; checking them as a one-tier config gives the same
        # checks and errors (vLLM's CPU tier stands in for the primary, which is not used).
        entry = {**tier_keys, "type": backend}
        data = {"version": 1, "primary": {"capacity": 1}, "secondary_tiers": [entry]}
        settings = parse_config(data, source=where).secondary_tiers[0]
    if settings.write_policy != "write_through":
        raise ConfigError(
            f"{where}: tier {settings.name!r}: write_policy {str(settings.write_policy)!r} is "
            "not available under vLLM's CPU tier, which writes every block it stores to every "
            "tier; use 'write_through'"
        )
    if settings.admission_min_count:
        raise ConfigError(
            f"{where}: tier {settings.name!r}: admission_min_count is not available under "
            "vLLM's CPU tier (its lookups do not reach the tier's gate); run the tier under "
            "tiering's drop-in manager (spec_name TieringSpec), or set admission_min_count to 0"
        )
    return settings


def _parse_locality(value: str | None, name: str) -> Locality | None:
    if value is None:
        return None
    try:
        return Locality(str(value).upper())
    except ValueError:
        valid = ", ".join(loc.value for loc in Locality)
        raise ConfigError(f"tier {name!r}: locality {value!r} is not one of {valid}") from None
