"""tiering as vLLM 0.33's offloading spec: the drop-in (``"spec_name": "TieringSpec"``).

::

    vllm serve MODEL --kv-transfer-config '{"kv_connector":"OffloadingConnector",
      "kv_role":"kv_both","kv_connector_extra_config":{"spec_name":"TieringSpec",
      "spec_module_path":"tiering.integrations.vllm","cpu_bytes_to_use":N,
      "tiering_config":"path/to/tiering.yaml"}}'

:class:`TieringSpec` subclasses vLLM's own ``TieringOffloadingSpec``. Its worker side is
vLLM's, unchanged: each worker maps the shared offload region
(``/dev/shm/vllm_offload_<engine_id>.mmap``) and its ``CPUOffloadingWorker`` copies GPU blocks
to and from the region's rows. Its scheduler side is :class:`TieringManager`, a vLLM
``OffloadingManager`` backed by tiering's step-driven
:class:`~tiering.managers.tiering_manager.TieringOffloadingManager`: the CPU tier, whose slot ``i``
is
the region's row ``i`` (``cpu_bytes_to_use`` sizes it, as for vLLM's own specs), and below it
the tiers of the YAML file (file, LMDB, plugins), which read and write those rows directly.

How vLLM's calls map onto tiering's (``T.`` is :class:`tiering.managers.protocol.LookupResult`):

==========================  =================================================================
vLLM 0.33                   tiering
==========================  =================================================================
``lookup(key, ctx)``        ``T.HIT`` -> ``HIT``; ``T.MISS`` -> ``MISS``; ``T.HIT_PENDING``
                            (a store in flight into the CPU tier or a tier) -> ``HIT_PENDING``;
                            ``T.RETRY`` (a promotion under way: its CPU slot is reserved at
                            the lookup, the read is submitted at the step's end) ->
                            ``HIT_PENDING``. vLLM's connector counts ``HIT_PENDING`` as a hit
                            that defers the request, and a sliding-window scan stops once its
                            window is found; ``RETRY`` would reset the window's streak and
                            scan (and promote) further left. vLLM's own tiering manager
                            answers ``HIT_PENDING`` after starting a promotion too. Only a
                            shared tier (``tiering.managers.shared_tier``) gives vLLM's ``RETRY``:
                            while
                            it asks its store whether it holds a key, the key's location is
                            unknown (``TieringOffloadingManager.location_unknown``), as with
                            vLLM's own object-store tier. While promotions are held after a
                            reset, a key absent from the CPU tier is a ``MISS``.
hits the request loads      :meth:`TieringOffloadingManager.protect_for_step`: a promotion the
                            request starts later in the step never evicts them; one that finds
                            no room is a ``MISS``, so the hit stops where the CPU tier is full
``prepare_store``/``_load`` the CPU tier's slots as vLLM's ``CPULoadStoreSpec`` (its worker
                            reads ``block_ids``)
``complete_store``          ``success`` by keyword; a ``set`` of keys (vLLM passes one) is put
``complete_load``           in prefix order first, so tier writes are the same on every run
``on_request_finished``     recency: the keys the request loaded or offered to store (new and
                            resident; not lookups), in prefix order, the head most recent, in
                            the CPU tier and every tier: those it reused are touched, those it
                            stored or promoted refreshed (no use: ARC keeps them in T1), as
                            vLLM 0.33's CPU manager does at request finish (it never calls
                            ``touch``)
first call of a step        tier results that exist apply (vLLM's once-per-step poll), unless
                            ``tiering_deterministic_steps``
``on_schedule_end``         the step boundary: tier results apply, promotion batches go out
``get_load_source``         ``DISK`` for a key this request found in a tier, else ``HOST``
``reset_cache``             drains tier I/O, drops the CPU tier and every tier's blocks, then
                            holds promotions until ``on_reset_flushed``
==========================  =================================================================

The layout fingerprint of every stored block (:mod:`tiering.integrations.vllm_layout`) covers
the model and its checkpoint (revision, quantization, model dtype, weight files), dtype, KV-cache
groups, tokens per hash, blocks per chunk, worker bytes per block and
the parallel layout with this rank: a restart with any of them changed serves nothing stale.

Beside it: :mod:`~tiering.integrations.vllm_translate` (vLLM's answers, keys and events as
tiering's and back), :mod:`~tiering.integrations.vllm_metrics` (the metrics and config info),
:mod:`~tiering.integrations.vllm_requests` (a request's accesses and their recency) and
:mod:`~tiering.integrations.vllm_extra` (the ``kv_connector_extra_config`` values, checked).
"""

from __future__ import annotations

import concurrent.futures
import gc
import threading
from collections.abc import Callable, Collection, Iterable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    ConfigInfoMapping,
    LoadStoreSpec,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tiering import CPUOffloadingManager, TieringOffloadingManager
from tiering.config import TieringConfig, build_tier, load_config
from tiering.core.keys import OffloadKey as Key
from tiering.errors import ConfigError
from tiering.integrations.vllm_extra import (
    VLLM_POLICIES,
    check_spec_extra,
    primary_policy,
    primary_store_threshold,
)
from tiering.integrations.vllm_identity import model_identity_of
from tiering.integrations.vllm_layout import chunk_data_bytes, layout_fingerprint
from tiering.integrations.vllm_metrics import INFO_KEYS, PRIMARY_LABEL, DropInMetrics
from tiering.integrations.vllm_requests import RequestAccesses
from tiering.integrations.vllm_tiers import TieringSecondaryTier
from tiering.integrations.vllm_translate import (
    ANSWERS,
    HIT,
    HIT_PENDING,
    MISS,
    RETRY,
    T_HIT,
    T_HIT_PENDING,
    T_RETRY,
    in_prefix_order,
    reset_events,
    tiering_keys,
    vllm_event,
    vllm_keys,
)
from tiering.managers.protocol import LookupResult as TieringLookupResult

__all__ = ["INFO_KEYS", "PRIMARY_LABEL", "VLLM_POLICIES", "TieringManager", "TieringSpec"]


class TieringSpec(TieringOffloadingSpec):
    """vLLM 0.33's offloading spec for tiering; see the module docstring.

    ``kv_connector_extra_config`` keys: ``tiering_config`` (required: the tiering YAML file;
    relative tier paths are taken from its directory), ``cpu_bytes_to_use`` (required: the CPU
    tier's size, as for vLLM's own specs; every worker maps the region, so it comes from the
    command line and the YAML's ``primary.capacity`` is not used), and optionally vLLM's
    ``eviction_policy`` and ``store_threshold`` / ``max_tracker_size`` (which override the
    YAML's ``primary.policy`` and ``primary.store_threshold``; vLLM's ``arc`` is vLLM's ARC
    variant, tiering's ``arc_vllm``), ``block_size`` / ``blocks_per_chunk``. Every value is
    checked first (:func:`~tiering.integrations.vllm_extra.check_spec_extra`): a bad one is a
    :class:`ConfigError` naming the key, the value and what is valid.
    """

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        """vLLM's tiering metrics, tiering's per-tier counters and ``stores_skipped`` (the
        threshold may come from the YAML, which the API server does not read)."""
        check_spec_extra(extra_config)  # vLLM's int() of store_threshold runs next
        metrics = super().build_metric_definitions(extra_config)
        metrics.update(TieringSecondaryTier.build_metric_definitions({}))
        metrics[CPUOffloadingMetrics.STORES_SKIPPED] = OffloadingCounterMetadata(
            documentation="Number of KV offload stores skipped because the reuse threshold "
            "was not reached."
        )
        return metrics

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        keys = dict.fromkeys(super().config_info_keys(extra_config))
        keys.update(dict.fromkeys(INFO_KEYS))
        return tuple(keys)

    def __init__(self, config: OffloadingConfig) -> None:
        extra = config.extra_config
        check_spec_extra(extra)  # every value, before vLLM's constructors convert them
        if extra.get("secondary_tiers"):
            raise ConfigError(
                "TieringSpec: tiers come from the file named by 'tiering_config'; "
                "'secondary_tiers' belongs to vLLM's TieringOffloadingSpec (to put tiering's "
                "tiers under vLLM's own CPU tier, use spec_name 'TieringOffloadingSpec')"
            )
        path = str(extra["tiering_config"])
        if extra.get("cache_policy_module_path"):
            raise ConfigError(
                "TieringSpec: 'cache_policy_module_path' names a vLLM CachePolicy; tiering's "
                "CPU tier takes 'eviction_policy' lru, arc or a tiering policy "
                "('package.module:Class', see tiering's plugins.md)"
            )
        super().__init__(config)
        # Here, while vLLM's connector (holding the engine's ModelConfig) builds the spec.
        model_identity_of(self)
        self._manager: OffloadingManager | None = None
        self.tiering_config_path = Path(path)

    def get_manager(self) -> OffloadingManager:
        """The scheduler's manager (built once): maps the region after the workers did."""
        if self._manager is None:
            settings = load_config(self.tiering_config_path)
            if self.num_chunks <= 0:
                raise ConfigError(
                    f"TieringSpec: cpu_bytes_to_use={self.extra_config.get('cpu_bytes_to_use')!r}"
                    f" holds no chunk of {self.kv_bytes_per_chunk} bytes; give at least that"
                )
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=None,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._scheduler_mmap = region
            try:
                self._manager = TieringManager(self, settings, region)
            except BaseException:
                self._scheduler_mmap = None
                gc.collect()  # views of the region in a failed constructor's frames
                region.cleanup()
                raise
        return self._manager


class TieringManager(OffloadingManager):
    """vLLM 0.33's scheduler-side manager over tiering's step-driven manager.

    ``manager`` is the :class:`TieringOffloadingManager` and ``region`` vLLM's shared offload
    region (public for tools and tests: read-only use). Every
    call runs on the caller's thread; tier I/O runs on the manager's I/O thread and its results
    apply at the first call of the next step, as vLLM's own manager applies them; with
    ``tiering_deterministic_steps`` only at step boundaries (``on_schedule_end``), so the same
    calls give the same answers when each step's I/O is done. ``lock`` is a real lock, as vLLM
    asks of managers that may be entered from more than one thread.
    """

    def __init__(
        self, spec: TieringSpec, config: TieringConfig, region: SharedOffloadRegion
    ) -> None:
        extra = spec.extra_config
        self._lock = threading.Lock()
        self.region = region
        cpu_info = spec.cpu_info.as_config_info()
        chunk_bytes = chunk_data_bytes(spec)
        stride = spec.kv_bytes_per_chunk
        if not 0 < chunk_bytes <= stride:
            raise ConfigError(
                f"TieringSpec: a chunk holds {chunk_bytes} bytes of KV but a row of the CPU "
                f"tier is {stride} bytes; the offloading spec and its region disagree"
            )
        self.fingerprint = layout_fingerprint(spec)
        self.model_identity = model_identity_of(spec)  # what the fingerprint says of the model
        self.policy = primary_policy(extra, config)
        self.store_threshold = primary_store_threshold(extra, config)
        tiers = [
            build_tier(tier, block_bytes=chunk_bytes, fingerprint=self.fingerprint)
            for tier in config.secondary_tiers
        ]
        # Row i of the region is slot i of the CPU tier; a tier stores the row's KV bytes (every
        # worker's slot), not its page padding.
        rows = region.base_tensor.view(torch.uint8).view(spec.num_chunks, stride)[:, :chunk_bytes]
        primary = CPUOffloadingManager(
            spec.num_chunks,
            self.policy,
            store_threshold=self.store_threshold,
            store_threshold_max_keys=int(extra.get("max_tracker_size", 64_000)),
        )
        self.manager = TieringOffloadingManager(
            primary,
            tiers,
            pool=rows,
            enable_events=spec.kv_events_config.enable_kv_cache_events,
            step_driven=True,
        )
        del rows
        self._primary = primary
        # vLLM's timing: tier results apply at the first call of a step (and at its end if
        # none came), as soon as they exist. Deterministic: only at step ends, one step later.
        self.deterministic_steps = extra.get("tiering_deterministic_steps") is True  # checked
        self._polled = self.deterministic_steps  # this step's tier results were applied
        # LRU as vLLM's: a running request's accesses rank its keys at once (see _record).
        self._provisional_recency = self.policy == "lru"
        # vLLM's keys are tiering's keys (both bytes); typed once here for the hot path.
        self._cpu_lookup = cast("Callable[[bytes], TieringLookupResult]", primary.lookup_result)
        self._cpu_resident = cast("Callable[[bytes], bool | None]", primary.lookup)
        self._lookup = cast(
            "Callable[[bytes, ReqContext], TieringLookupResult]", self.manager.lookup_result
        )
        self._metrics = DropInMetrics(
            self.manager,
            primary,
            tiers,
            {t.name: t for t in config.secondary_tiers},
            cpu_info,
            fingerprint=self.fingerprint,
            policy=self.policy,
            store_threshold=self.store_threshold,
        )
        self._requests: dict[str, RequestAccesses] = {}
        self._step_hits: dict[str, list[OffloadKey]] = {}  # HITs not protected yet, by request
        self._pending_events: list[OffloadingEvent] = []
        self._promotions_held = False
        self._cpu_queries = 0
        self._cpu_hits = 0
        self._closed = False
        # The tiers recover their indexes now, before the engine's first step (and a tier that
        # cannot open is degraded, logged, and the others serve).
        self.manager.wait_ready(timeout=None)

    @property
    def lock(self) -> threading.Lock:
        return self._lock

    # -- lookups ----------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if not self._polled:
            self._poll()
        self._cpu_queries += 1
        answer = self._cpu_lookup(key)
        req_id = req_context.req_id
        if answer is T_HIT:
            self._cpu_hits += 1
            hits = self._step_hits.get(req_id)
            if hits is None:
                self._step_hits[req_id] = [key]
            else:
                hits.append(key)
            return HIT
        if self._promotions_held:
            return HIT_PENDING if answer is T_HIT_PENDING else MISS
        hits = self._step_hits.pop(req_id, None)
        if hits:
            self.manager.protect_for_step(tiering_keys(hits), req_context=req_context)
        result = self._lookup(key, req_context)
        if result is T_RETRY:
            if self.manager.location_unknown(cast("Key", key)):  # a shared tier is asking
                return RETRY
            state = self._request(req_context)
            state.promoted.add(key)
            state.inserted.add(key)
            state.accessed[key] = None
        return ANSWERS[result]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        state = self._requests.get(req_context.req_id)
        if state is not None and key in state.promoted:
            return CacheHitSource.DISK
        return CacheHitSource.HOST

    # -- loads and stores --------------------------------------------------------------------

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        if not self._polled:
            self._poll()
        spec = self.manager.prepare_load(tiering_keys(keys), req_context=req_context)
        self._record(req_context, keys, reused=keys)
        return CPULoadStoreSpec(spec.block_ids.tolist())

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.complete_load(
            tiering_keys(in_prefix_order(keys, req_context)), req_context=req_context
        )

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.touch(tiering_keys(keys), req_context=req_context)

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        if not self._polled:
            self._poll()
        key_list = list(keys)
        resident = self._cpu_resident
        reused = [k for k in key_list if resident(k) is True]
        out = self.manager.prepare_store(tiering_keys(key_list), req_context=req_context)
        if out is None:
            self._record(req_context, reused, reused=reused)
            return None
        stored = vllm_keys(out.keys_to_store)
        if stored or reused:
            accessed = {*stored, *reused}
            self._record(
                req_context, [k for k in key_list if k in accessed], reused=reused, stored=stored
            )
        return PrepareStoreOutput(
            keys_to_store=stored,
            store_spec=CPULoadStoreSpec(out.store_spec.block_ids.tolist()),
            evicted_keys=vllm_keys(out.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.manager.complete_store(
            tiering_keys(in_prefix_order(keys, req_context)),
            success=success,
            req_context=req_context,
        )

    # -- requests and steps -------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.manager.on_new_request(req_context)
        self._requests[req_context.req_id] = RequestAccesses()
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.manager.on_request_finished(req_context)
        self._step_hits.pop(req_context.req_id, None)
        state = self._requests.pop(req_context.req_id, None)
        if state is not None:
            state.apply_at_end(self.manager, req_context)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._step_hits.clear()
        if not self._polled:
            self._poll()  # a step with no call: vLLM's catch-all poll
        self.manager.on_schedule_end()
        self._polled = self.deterministic_steps

    def _poll(self) -> None:
        """vLLM's once-per-step poll: apply every tier result that exists now."""
        self._polled = True
        self.manager.apply_finished()

    def has_pending_work(self) -> bool:
        return self.manager.has_pending_work()

    # -- events, metrics, config info -----------------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._pending_events = self._pending_events, []
        events.extend(vllm_event(e) for e in self.manager.take_events())
        return events

    def get_stats(self) -> OffloadingConnectorStats | None:
        queries, hits = self._cpu_queries, self._cpu_hits
        self._cpu_queries = self._cpu_hits = 0
        return self._metrics.stats(queries, hits)

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        """One series per tier, the CPU tier first, each with vLLM's ``tier`` label."""
        return self._metrics.config_info()

    # -- reset and lifecycle -------------------------------------------------------------------

    def reset_cache(self) -> None:
        """Drop the CPU tier and every tier's blocks (vLLM resets its connector after a weight
        update: a block computed under the old weights must never be served), after draining
        the tiers' I/O, so no late write lands in a reused row. Promotions are held until
        :meth:`on_reset_flushed`: a worker may still write a freed row for a job in flight at
        the reset. The removal of a key whose store was never announced is ``metadata_only``."""
        manager = self.manager
        manager.wait_idle(timeout=None)  # the step's promotions land first: they are announced
        primary = self._primary
        unannounced = {bytes(k) for k in primary.slots if primary.lookup(k) is None}
        manager.reset_cache()
        for event in manager.take_events():
            self._pending_events.extend(reset_events(event, unannounced))
        self._promotions_held = bool(manager.tiers)
        self._step_hits.clear()
        for state in self._requests.values():
            state.clear()

    def on_reset_flushed(self) -> None:
        self._promotions_held = False

    def wait_for_tier_io(self, timeout_s: float | None = 60.0) -> None:
        """Block until the tier I/O submitted so far has finished; its results still apply at
        the next step boundary. For tests and tools: in an engine, the model's step is this
        wait. Raises TimeoutError if it takes longer than ``timeout_s``."""
        futures = [job.future for job in self.manager.inflight_jobs() if job.future is not None]
        _, pending = concurrent.futures.wait(futures, timeout=timeout_s)
        if pending:
            raise TimeoutError(f"{len(pending)} tier job(s) still in flight after {timeout_s} s")

    def shutdown(self) -> None:
        """Drain and close the tiers, then unmap the region (nothing keeps a view of it)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.manager.shutdown()
        finally:
            gc.collect()  # views of the rows in garbage cycles would keep the region mapped
            self.region.cleanup()

    # -- helpers --------------------------------------------------------------------------------

    def _request(self, req_context: ReqContext) -> RequestAccesses:
        state = self._requests.get(req_context.req_id)
        if state is None:
            state = self._requests[req_context.req_id] = RequestAccesses()
        return state

    def _record(
        self,
        req_context: ReqContext,
        keys: Iterable[OffloadKey],
        *,
        reused: Iterable[OffloadKey] = (),
        stored: Iterable[OffloadKey] = (),
    ) -> None:
        state = self._request(req_context)
        if state.record(keys, reused=reused, stored=stored) and self._provisional_recency:
            # vLLM's LRU ranks a running request's keys at once by their end tokens (its head
            # the most recent of them, above every older key), not only when it finishes: so
            # does the drop-in's. Without end tokens vLLM ranks nothing before the end.
            ranked = state.ranked(req_context)
            if ranked is not None:
                self._primary.refresh(ranked)
