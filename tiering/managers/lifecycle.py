"""What a tiering manager is besides its protocol answers: its parts, its lifecycle, its reports.

:class:`TieringLifecycle` is the base of
:class:`~tiering.managers.tiering_manager.TieringOffloadingManager`, which adds the protocol's
lookups, loads, stores and steps. Here:

- construction: the parts are checked to fit together (the pool's rows, the tiers' names and
  block sizes, at most one shared tier, the last), the tiers are attached to the primary's rows,
  the collaborators are built and wired (none refers to the manager, so a dropped manager is
  freed at once), and each tier starts opening on the I/O loop;
- waiting, for lifecycle, tools and tests, never on the protocol's hot path: :meth:`wait_idle`
  and :meth:`wait_ready` block; asyncio users drive the same machinery with ``async with``,
  :meth:`drain`, :meth:`lookup_async` and :meth:`lookup_request_async`;
- :meth:`reset_cache`, :meth:`shutdown` and :meth:`aclose`;
- reports: :meth:`get_stats` (deltas), :meth:`metrics` (totals), :meth:`config_info`, the jobs
  in flight and the stalled ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Protocol, Self, cast

import cachetools
import numpy as np
import torch

from tiering.core.groups import KVCacheSpec
from tiering.core.keys import OffloadKey
from tiering.errors import ConfigurationError, TieringError
from tiering.managers.cascade import StoreCascade
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.event_log import EventLog
from tiering.managers.job_runner import TierJobs
from tiering.managers.promotions import Promotions
from tiering.managers.protocol import ConfigInfo, ManagerStats, OffloadingManager
from tiering.managers.secondary_tier import SecondaryTier, TierJob, WritePolicy
from tiering.managers.shared_checks import SharedChecks
from tiering.managers.shared_tier import SharedTier
from tiering.managers.stalls import StalledJobs
from tiering.managers.step_results import StepResults
from tiering.managers.tier_lookups import LookupCounts, TierLookups
from tiering.managers.tiering_stats import TieringStats

__all__ = ["PoolRows", "TieringLifecycle"]


class PoolRows(Protocol):
    """A pool that gives its rows (a :class:`~tiering.managers.pool.CPUBlockPool`)."""

    def rows_view(self) -> torch.Tensor: ...


class TieringLifecycle(OffloadingManager):
    """The parts, lifecycle and reports of a tiering manager (see the module docstring); the
    arguments are :class:`~tiering.managers.tiering_manager.TieringOffloadingManager`'s."""

    def __init__(
        self,
        primary: CPUOffloadingManager,
        secondary_tiers: Sequence[SecondaryTier] = (),
        *,
        pool: torch.Tensor | PoolRows,
        enable_events: bool | None = None,
        lookup_counter_size: int = 65536,
        step_driven: bool = False,
    ) -> None:
        rows = _checked_rows(primary, secondary_tiers, pool, step_driven)
        shared_index = _shared_tier_index(secondary_tiers)
        self.primary = primary
        self.tiers: list[SecondaryTier] = list(secondary_tiers)
        self.step_driven = step_driven
        self._closed = False
        self._rows = rows.numpy()
        self.row_bytes = int(rows.shape[1])
        for tier in self.tiers:
            tier.attach(self._rows)
        self._events = EventLog(primary, primary.enable_events)
        self.enable_events = primary.enable_events if enable_events is None else enable_events
        self._build_collaborators(lookup_counter_size, shared_index)
        self._open_tiers()

    def _build_collaborators(self, lookup_counter_size: int, shared_index: int) -> None:
        """The manager's parts: jobs, the store cascade, promotions and shared-tier checks,
        lookups below the primary, timeouts, results, counters (none refers to the manager)."""
        primary, tiers, step_driven = self.primary, self.tiers, self.step_driven
        self._tier_jobs = jobs = TierJobs(owner=self)
        self._io = jobs.io
        selective = any(t.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE for t in tiers)
        gates = [t.admission for t in tiers if t.admission is not None]
        # Lookups past the primary are counted only when a tier goes by them: otherwise the
        # hot path keeps its shortcuts (tier_lookups.miss_sets).
        self._counts_lookups = selective or bool(gates)
        self._lookup_counts: cachetools.LRUCache[bytes, int] = cachetools.LRUCache(
            lookup_counter_size
        )
        self._cascade = StoreCascade(primary, tiers, jobs, self._events, self._lookup_counts)
        self._shared_checks = None
        if shared_index >= 0:
            shared = cast(SharedTier, tiers[shared_index])
            self._shared_checks = SharedChecks(
                shared, shared_index, primary, tiers[:shared_index], {}
            )
        self._promotions = promotions = Promotions(
            primary,
            tiers,
            jobs,
            self._events,
            self._cascade.draining,
            step_driven=step_driven,
            shared_checks=self._shared_checks,
        )
        # Keys looked up in the primary, by answer, and whether a lookup may have to run
        # _begin_call: standalone, or shut down (step_driven is fixed at construction).
        self._lookups = LookupCounts(guarded=not step_driven)
        self._tier_lookups = TierLookups(
            primary,
            tiers,
            promotions,
            self._lookups,
            self._lookup_counts,
            step_driven=step_driven,
            counts_lookups=self._counts_lookups,
            selective=selective,
            gates=gates,
        )
        self._stalls = StalledJobs(
            primary, jobs, self._events, promotions.promoting, self._cascade.release_draining
        )
        self._results = StepResults(jobs, promotions, self._stalls)
        self._stats = TieringStats(primary, tiers, promotions, self._lookups)

    def _open_tiers(self) -> None:
        jobs = self._tier_jobs
        jobs.epoch = -1  # the tiers open before the first step: its boundary applies them
        for tier in self.tiers:
            jobs.submit(tier.start_open(), tier.finish_open)
        jobs.epoch = 0

    @property
    def store_threshold(self) -> int:  # type: ignore[override]
        return self.primary.store_threshold

    @property
    def enable_events(self) -> bool:
        """Whether :meth:`take_events` reports stored and removed blocks (settable)."""
        return self._events.enabled

    @enable_events.setter
    def enable_events(self, enabled: bool) -> None:
        # The primary records its events only when they are forwarded: a store or eviction
        # then builds no event that would be dropped.
        self._events.enabled = self.primary.enable_events = enabled

    @property
    def promotions_without_space(self) -> int:
        """Keys whose promotion found no room in the primary (counted, not retried)."""
        return self._promotions.without_space

    @promotions_without_space.setter
    def promotions_without_space(self, value: int) -> None:
        self._promotions.without_space = value

    def _check_open(self) -> None:
        if self._closed:
            raise TieringError("the manager is shut down")

    def has_pending_work(self) -> bool:
        return bool(self._tier_jobs.in_flight) or not self._promotions.idle()

    def inflight_jobs(self) -> list[TierJob]:
        return list(self._tier_jobs.in_flight)

    def stalled_jobs(self) -> list[TierJob]:
        """Jobs past their deadline whose I/O has not returned (``job.io_future`` completes
        when it does): for tools and tests."""
        return list(self._stalls.stuck)

    def get_stats(self) -> ManagerStats:
        """Counters per tier since the previous call (deltas): ``"CPU"`` as
        :meth:`CPUOffloadingManager.get_stats` plus ``promotions_without_space`` (its
        ``hinted_requests``: the requests this manager told with a hint); each tier by name
        with its :class:`~tiering.managers.secondary_tier.TierMetrics` counters
        (``lookup_hits``, ``promoted_blocks``, ``bytes_read``, ``stored_blocks``,
        ``bytes_written``, ``store_failures``, ``promotion_failures``, ``corrupt_blocks``,
        ``stores_shed``, ``open_failures``, ...). :meth:`metrics` has the totals."""
        return self._stats.deltas()

    def config_info(self) -> list[ConfigInfo]:
        return self.primary.config_info() + [tier.config_info() for tier in self.tiers]

    def metrics(self) -> dict[str, Any]:
        """Counters (totals) per tier and of the primary tier.

        ``"primary"``: ``blocks``, ``free_blocks``, ``promotions_without_space``, the keys
        looked up in it by any lookup call (``lookups``, the sum of ``lookup_hits``: ready
        there, ``lookup_pending``: being written there, ``lookup_misses``: not there) and the
        primary's own counters (:meth:`CPUOffloadingManager.counters`: ``stored_blocks``,
        ``failed_stores``, ``evicted_blocks``, ``loaded_blocks``, ``stores_skipped``,
        ``hinted_requests``, the requests told with a hint, and ``hints_followed`` where the
        policy follows hints, those it followed the hint of). Each tier by name: its state,
        usage, :class:`~tiering.managers.secondary_tier.TierMetrics` counters and its
        backend's stats. The primary and each open tier (not a shared one: its store evicts)
        also name the victim rule their eviction policy follows now (``eviction_rule``, one
        of ``eviction_rules``) and how often it changed
        (``eviction_rule_switches``; only ``hybrid`` switches)."""
        return self._stats.metrics()

    # -- waiting and lifecycle --------------------------------------------------------------------

    def wait_idle(self, timeout: float | None = 60.0) -> None:
        """Block until every promotion batch is submitted, no job is in flight and every result
        is applied (lifecycle, tools and tests; never called by the protocol).

        It works in rounds, each a step boundary with its I/O drained: submit the batches, wait
        until every job in flight has finished, apply all their results in submission order. So
        the same calls give the same state afterwards, however the I/O thread was scheduled."""
        self._results.wait_idle(timeout)

    def wait_ready(self, timeout: float | None = 60.0) -> None:
        """Block until every tier is open and indexed, or degraded, or still opening past its
        ``io_timeout_s`` (it then comes online when its open finishes; meanwhile it answers
        absent). A tier that fails to open does not raise here (see the class docstring;
        ``metrics()[name]["status"]`` and ``["open_error"]`` say which and why). Raises
        ``TimeoutError`` after ``timeout`` s."""
        self.wait_idle(timeout)

    async def drain(self) -> None:
        """Wait, without blocking the event loop, until all in-flight work is done and applied
        (in rounds, as :meth:`wait_idle`)."""
        await self._results.drain()

    async def lookup_async(self, key: OffloadKey, *, req_context: object = None) -> bool:
        """Like :meth:`lookup`, but waits out "ask again later": True once ready, False if
        absent. Each wait is a step boundary (results apply, batches are submitted)."""
        results = self._results
        while True:
            answer = self.lookup(key, req_context=req_context)
            if answer is not None:
                return answer
            results.step()
            await results.wait_any()
            results.step()

    async def lookup_request_async(
        self,
        spec: KVCacheSpec,
        keys_per_group: Sequence[Sequence[OffloadKey]],
        num_prompt_tokens: int,
        *,
        req_context: object = None,
        engine_recomputes_last_token: bool = False,
    ) -> int:
        """Like :meth:`lookup_request`, but waits for the promotions it starts."""
        results = self._results
        while True:
            answer = self.lookup_request(
                spec,
                keys_per_group,
                num_prompt_tokens,
                req_context=req_context,
                engine_recomputes_last_token=engine_recomputes_last_token,
            )
            if answer is not None:
                return answer
            results.step()
            await results.wait_any()
            results.step()

    async def __aenter__(self) -> Self:
        await self.drain()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drain in-flight work, close every tier, stop the I/O loop; idempotent."""
        if self._closed:
            return
        await self.drain()
        for tier in self.tiers:
            if tier.stalled:
                continue  # its close would wait for the stalled I/O
            try:
                await asyncio.wrap_future(self._io.submit(tier.start_close().io))
            except Exception:  # closing the rest matters more
                pass
        self._finish_close()

    def reset_cache(self) -> None:
        """Drop every block of every tier (e.g. after a weight update). Drains in-flight jobs
        first, so no late write lands in a reused slot."""
        self._check_open()
        self.wait_idle()
        stalled = [t.name for t in self.tiers if t.stalled]
        if stalled:
            raise TieringError(
                f"reset_cache: tier(s) {stalled} are stalled (I/O past io_timeout_s still in "
                "flight, reading or filling primary rows); resetting would let it land in "
                "reused memory. Nothing was reset: call it again once they recover"
            )
        self.primary.reset_cache()
        self._events.pull_primary()
        self._cascade.draining.clear()
        self._promotions.clear()
        for tier in self.tiers:
            job = tier.start_clear()
            if job is not None:
                self._events.emit(tier, job.removed, removed=True)
                self._tier_jobs.submit(job, _ignore_result)
        self.wait_idle()

    def shutdown(self) -> None:
        """Drain in-flight jobs, close every tier, stop the I/O loop and drop every view of the
        pool (its owner may unmap it next); idempotent."""
        if self._closed:
            return
        try:
            self.wait_idle()
        finally:
            for tier in self.tiers:
                if tier.stalled:
                    continue  # its close would wait for the stalled I/O
                try:
                    self._io.submit(tier.start_close().io).result(timeout=60)
                except Exception:  # closing the rest matters more
                    pass
            self._finish_close()

    def _finish_close(self) -> None:
        self._closed = True
        self._tier_jobs.close()  # no deadline fires into a closed manager
        self._lookups.guarded = True
        self.primary.shutdown()
        # Keep no view of the pool: its owner may unmap it next (vLLM's shared offload region
        # refuses to unmap while any buffer still exports it).
        self._promotions.waiting.clear()
        self._promotions.batches.clear()
        self._rows = np.empty((0, self.row_bytes), np.uint8)
        for tier in self.tiers:
            tier.detach()

    def __del__(self) -> None:
        lookups = getattr(self, "_lookups", None)
        if lookups is not None:  # a lookup closure still held sends its callers to the method
            lookups.guarded = True
        jobs = getattr(self, "_tier_jobs", None)
        if jobs is not None:
            jobs.abandon(io_open=not getattr(self, "_closed", True))


def _checked_rows(
    primary: CPUOffloadingManager,
    tiers: Sequence[SecondaryTier],
    pool: torch.Tensor | PoolRows,
    step_driven: object,
) -> torch.Tensor:
    """The pool's rows, once the manager's parts are checked to fit together."""
    if not isinstance(primary, CPUOffloadingManager):
        raise ConfigurationError(
            f"primary must be a CPUOffloadingManager, got {type(primary).__name__}"
        )
    rows = pool if isinstance(pool, torch.Tensor) else pool.rows_view()
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.device.type != "cpu":
        raise ConfigurationError(
            f"pool must be a 2-D uint8 CPU tensor (num_blocks, row_bytes), got "
            f"{tuple(rows.shape)} {rows.dtype} on {rows.device}"
        )
    if rows.shape[0] < primary.num_blocks:
        raise ConfigurationError(
            f"pool has {rows.shape[0]} rows but the primary tier has {primary.num_blocks} "
            "blocks; give a pool with one row per primary block"
        )
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise ConfigurationError(f"tier names must be unique, got {names}")
    for tier in tiers:
        if tier.medium == primary.medium:
            raise ConfigurationError(
                f"tier name {tier.name!r} would report as the primary's medium "
                f"{primary.medium!r}; name the tier otherwise"
            )
        if tier.backend.block_bytes != rows.shape[1]:
            raise ConfigurationError(
                f"tier {tier.name!r} stores blocks of {tier.backend.block_bytes} bytes but a "
                f"pool row is {rows.shape[1]} bytes; build the backend with "
                f"block_bytes={rows.shape[1]}"
            )
    if type(step_driven) is not bool:
        raise ConfigurationError(f"step_driven must be a bool, got {step_driven!r}")
    return rows


def _shared_tier_index(tiers: Sequence[SecondaryTier]) -> int:
    """The index of the shared tier (at most one, the last), or -1."""
    shared = [i for i, t in enumerate(tiers) if isinstance(t, SharedTier)]
    if len(shared) > 1:
        raise ConfigurationError(f"at most one shared tier, got {[tiers[i].name for i in shared]}")
    if shared and shared[0] != len(tiers) - 1:
        raise ConfigurationError(
            f"the shared tier {tiers[shared[0]].name!r} must be the last tier: a "
            "lookup asks it only once every local tier has missed"
        )
    return shared[0] if shared else -1


def _ignore_result(job: TierJob, result: object) -> None:
    """Deletes after a reset are best effort: the index has already forgotten the keys."""
