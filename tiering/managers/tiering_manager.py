"""The tiering manager: the CPU primary tier composed with secondary tiers.

It implements :class:`tiering.managers.protocol.OffloadingManager` (whose docstring is the
contract) over
a :class:`~tiering.managers.cpu_manager.CPUOffloadingManager` and adds what tiers need:

- a lookup asks the primary, then each secondary tier in order (from their in-memory indexes);
  a key found only in a secondary tier starts a *promotion* into a primary slot and answers
  ``RETRY``. A key is never promoted twice at once; promotions are batched per request;
- completed stores cascade to each tier by its write policy; a primary block held for a tier's
  write is released when *that* tier finishes;
- back-pressure: each tier bounds its jobs in flight; over the bound, stores are shed (and
  counted) while promotions wait their turn;
- a failed or corrupt promotion is a miss, counted, and quarantined, never retried in a loop.

The tiers own their jobs (:mod:`tiering.managers.secondary_tier`): a tier decides what to write or
read, reserves
room, counts, and builds the I/O; this manager only holds the primary rows a job uses, submits
the job, emits its events, and hands its result back to the tier.

A shared tier (:mod:`tiering.managers.shared_tier`, at most one, the last) has no index: a key that
no
local tier holds, and that the shared tier knows nothing of (``TierKeyState.UNKNOWN``), joins its
request's batch like a promotion and answers ``RETRY``; the batch's unknown keys become one
existence check of the shared tier, and the keys it finds are promoted when its result applies.
Without a shared tier none of this runs: no tier answers UNKNOWN, and an absent key takes the
same branches as before.

Threads. Every protocol call runs on the caller's thread and never blocks on I/O: jobs run on a
private I/O loop thread (:class:`~tiering.managers.io_loop.IOLoop`); a finished job only enqueues
its
result, which is applied on the caller's thread. All metadata is therefore touched by one
thread, so no locks sit on the hot path. Call the manager from one thread (or one event loop)
at a time.

When results apply. Standalone (``step_driven=False``, the default): at the start of each
protocol call, and a request's promotion batch is submitted when another request calls, when one
of its keys is asked for again, or at :meth:`take_events`, :meth:`on_schedule_end`,
:meth:`drain`, :meth:`wait_idle`. Step-driven (``step_driven=True``, what an engine adapter
sets): only at :meth:`on_schedule_end`, :meth:`drain`, :meth:`wait_idle` (and
:meth:`reset_cache`, :meth:`shutdown`), where every request's promotion batch of the step is
submitted too. Between two step boundaries nothing the I/O thread does changes an answer, so a
given sequence of calls gives the same answers on every run once each step's I/O is done. A
step-driven :meth:`lookup_result` reserves the promotion's primary slot at once (as vLLM's own
tiering manager does), so its answer is exact: ``RETRY`` when the promotion is on its way,
``MISS`` when the primary cannot make room this step without evicting a key the request
protected (:meth:`protect_for_step`).

Asyncio users drive the same machinery with ``async with``, :meth:`drain` and
:meth:`lookup_async`; blocking helpers (:meth:`wait_idle`, :meth:`reset_cache`,
:meth:`shutdown`) exist for lifecycle and tools, never on the protocol's hot path.
"""

from __future__ import annotations

import asyncio
import queue
import time
import weakref
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, Self, cast

import cachetools
import numpy as np
import torch

from tiering.core.groups import KVCacheSpec
from tiering.core.keys import OffloadKey, check_key, check_keys
from tiering.core.lookup import KeyState, check_hybrid_args, find_hybrid_hit
from tiering.errors import ConfigurationError, TieringError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.deadline import JobTimedOut
from tiering.managers.io_loop import IOLoop
from tiering.managers.protocol import (
    AS_BOOL,
    HIT,
    HIT_PENDING,
    MISS,
    RETRY,
    ConfigInfo,
    LoadStoreSpec,
    LookupResult,
    ManagerStats,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    check_success,
    reject_positional,
    request_key,
)
from tiering.managers.secondary_tier import SecondaryTier, TierJob, TierKeyState, WritePolicy
from tiering.managers.shared_tier import SharedTier
from tiering.managers.stalls import JobDeadlines, late_result

__all__ = ["TieringOffloadingManager"]

ABSENT = TierKeyState.ABSENT


class _HasRows(Protocol):
    def rows_view(self) -> torch.Tensor: ...


#: A finished job as the I/O thread queues it: what applies its result, the job, the result.
_Finished = tuple[Callable[[TierJob, Any], None], TierJob, object]


@dataclass
class _PromotionBatch:
    """Keys one request found in secondary tiers, per tier index, not submitted yet.

    ``slots`` holds the primary slot of each key reserved when it was looked up (step-driven
    single-key lookups); the other keys get theirs when the batch is submitted."""

    req_context: object
    by_tier: dict[int, list[bytes]] = field(default_factory=dict)
    slots: dict[bytes, int] = field(default_factory=dict)


class _LookupCounts:
    """The keys looked up in the primary, by answer (read by ``metrics()``), and whether a
    lookup must take the guarded path: shared by the lookup methods and the step-driven lookup
    closure (:meth:`TieringOffloadingManager._one_tier_lookup_result`), which holds no reference
    to the manager."""

    __slots__ = ("guarded", "hits", "misses", "pending")

    def __init__(self, guarded: bool) -> None:
        self.guarded = guarded  # standalone, or shut down: a lookup may run _begin_call
        self.hits = 0  # ready there
        self.pending = 0  # being written there (a store, or a promotion)
        self.misses = 0  # not there


#: A promotion waiting for a job slot of its tier: the context, the keys and, if reserved, their
#: primary slots.
_Waiting = tuple[object, list[bytes], list[int] | None]


class TieringOffloadingManager(JobDeadlines, OffloadingManager):
    """A CPU primary tier plus ordered secondary tiers, behind the manager protocol.

    ``pool`` holds the primary tier's bytes: a ``(num_blocks, row_bytes)`` uint8 tensor, or an
    object with ``rows_view()`` returning one (a :class:`~tiering.managers.pool.CPUBlockPool`). Row
    ``i``
    is slot ``i`` of ``primary``, every rank's part of one offloaded block, and each tier's
    backend must store blocks of ``row_bytes``. Tiers open on the I/O loop as the manager starts;
    until a tier is open its lookups answer "absent" (call :meth:`wait_ready` to wait); a tier
    that fails to open is degraded and the others go on serving. ``store_threshold`` is the
    primary's (``CPUOffloadingManager(..., store_threshold=N)``); promotions are not offers.
    ``step_driven`` chooses when background results apply (see the module docstring). Every
    tier job has a deadline, its tier's ``io_timeout_s`` (:mod:`tiering.managers.stalls`).
    """

    def __init__(
        self,
        primary: CPUOffloadingManager,
        secondary_tiers: Sequence[SecondaryTier] = (),
        *,
        pool: torch.Tensor | _HasRows,
        enable_events: bool | None = None,
        lookup_counter_size: int = 65536,
        step_driven: bool = False,
    ) -> None:
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
        names = [t.name for t in secondary_tiers]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"tier names must be unique, got {names}")
        for tier in secondary_tiers:
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
        self.primary = primary
        self.tiers: list[SecondaryTier] = list(secondary_tiers)
        self.step_driven = step_driven
        self.enable_events = primary.enable_events if enable_events is None else enable_events
        self._rows = rows.numpy()
        self.row_bytes = int(rows.shape[1])
        for tier in self.tiers:
            tier.attach(self._rows)
        self._io = IOLoop()
        self._init_deadlines()
        self._finished: queue.SimpleQueue[_Finished] = queue.SimpleQueue()
        self._jobs: set[TierJob] = set()  # submitted, results not applied yet
        self._done: list[_Finished] = []  # finished, not applied yet
        self._results_queued = False  # set by the I/O thread: the queue may hold results
        self._next_seq = 0
        self._epoch = 0  # step-driven: on_schedule_end calls so far
        self._events: list[OffloadingEvent] = []
        self._promoting: dict[bytes, int] = {}  # key -> tier index: waiting or in flight
        self._batches: dict[Hashable, _PromotionBatch] = {}  # by request key, not submitted
        self._batched: dict[bytes, Hashable] = {}  # key -> the request whose batch holds it
        self._waiting: dict[int, list[_Waiting]] = {}  # for a job slot
        # Keys a request counts on in this step (protect_for_step): promotions never evict them.
        self._step_protected: dict[Hashable, set[bytes]] = {}
        self._counts_lookups = any(
            t.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE for t in self.tiers
        )
        self._lookup_counts: cachetools.LRUCache[bytes, int] = cachetools.LRUCache(
            lookup_counter_size
        )
        self._draining: dict[int, int] = {}  # primary slot -> write-back jobs still copying it
        self.promotions_without_space = 0
        # Keys looked up in the primary, by answer, and whether a lookup may have to run
        # _begin_call: standalone, or shut down (step_driven is fixed at construction).
        self._lookups = _LookupCounts(guarded=not step_driven)
        self._stats_seen: ManagerStats = {}
        self._closed = False
        self._write_back_tiers = [t for t in self.tiers if t.write_policy is WritePolicy.WRITE_BACK]
        shared = [i for i, t in enumerate(self.tiers) if isinstance(t, SharedTier)]
        if len(shared) > 1:
            raise ConfigurationError(
                f"at most one shared tier, got {[self.tiers[i].name for i in shared]}"
            )
        if shared and shared[0] != len(self.tiers) - 1:
            raise ConfigurationError(
                f"the shared tier {self.tiers[shared[0]].name!r} must be the last tier: a "
                "lookup asks it only once every local tier has missed"
            )
        self._shared_index = shared[0] if shared else -1
        self._primary_slots, self._primary_not_ready = primary.lookup_state()
        # A lookup's miss test, when every tier answers from its index alone: a key in no
        # tier's ``held`` is ABSENT everywhere (one probe per tier, no call). None: ask each
        # tier's state() (a shared tier, a tier class with its own state(), lookup counting).
        # With one tier (the usual case) its set itself: no loop, no type test.
        self._one_tier_held: set[bytes] | None = None
        self._tiers_held: tuple[set[bytes], ...] | None = None
        if (
            not shared
            and not self._counts_lookups
            and all(type(t).state is SecondaryTier.state for t in self.tiers)
        ):
            held = tuple(t.held for t in self.tiers)
            if len(held) == 1:
                self._one_tier_held = held[0]
            else:
                self._tiers_held = held
        self._shared: SharedTier | None = (
            cast(SharedTier, self.tiers[shared[0]]) if shared else None
        )
        if self._write_back_tiers:
            primary.set_eviction_hook(self._on_primary_evict)
        if (
            step_driven
            and self._one_tier_held is not None
            and type(self).lookup_result is TieringOffloadingManager.lookup_result
        ):
            self.lookup_result = self._one_tier_lookup_result()  # type: ignore[method-assign,assignment]
        self._epoch = -1  # the tiers open before the first step: its boundary applies them
        for tier in self.tiers:
            self._submit(tier.start_open(), tier.finish_open)
        self._epoch = 0

    @property
    def store_threshold(self) -> int:  # type: ignore[override]
        return self.primary.store_threshold

    # -- job plumbing ----------------------------------------------------------------------------

    def _submit(self, job: TierJob, on_done: Callable[[TierJob, Any], None]) -> None:
        job.seq = self._next_seq
        job.epoch = self._epoch
        self._next_seq += 1
        self._settle_new_job(job, on_done)  # its future, and its deadline
        try:
            job.io_future = self._io.submit(self._run_job(job, on_done))
        except BaseException:
            if job.timer is not None:
                job.timer.cancel()
            raise
        self._jobs.add(job)

    async def _run_job(self, job: TierJob, on_done: Callable[[TierJob, Any], None]) -> None:
        """Run ``job.io`` on the I/O loop and queue its result before the job's future completes
        (so a caller that sees the future done finds the result queued); a result past the
        job's deadline is queued as late (:mod:`tiering.managers.stalls`)."""
        try:
            result: object = await job.io
        except BaseException as exc:  # the tiers return their failures; queue anything else too
            self._queue_result(job, on_done, exc)
            raise
        self._queue_result(job, on_done, result)

    def _collect(self, block_until_all: float | None = None) -> None:
        """Move finished jobs from the I/O thread's queue to ``_done``. With
        ``block_until_all`` (a deadline, or ``inf``), wait until every job in flight is there."""
        finished, done = self._finished, self._done
        self._results_queued = False  # before draining: a result queued later sets it again
        while not finished.empty():  # cheap when idle: no exception per protocol call
            done.append(finished.get_nowait())
        if block_until_all is None:
            return
        while self._uncollected() > 0:
            remaining = block_until_all - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self._uncollected()} tiering job(s) still in flight")
            try:
                done.append(finished.get(timeout=min(remaining, 3600.0)))
            except queue.Empty:
                continue

    def _process_finished(self, before_epoch: int | None = None) -> None:
        """Apply the results of finished jobs on the caller's thread, in submission order; with
        ``before_epoch``, only those of jobs submitted before that step."""
        self._collect()
        if self._done:
            if before_epoch is None:
                ready, self._done = self._done, []
            else:
                ready = [d for d in self._done if d[1].epoch < before_epoch]
                self._done = [d for d in self._done if d[1].epoch >= before_epoch]
            ready.sort(key=lambda item: item[1].seq)
            for on_done, job, result in ready:
                self._jobs.discard(job)
                if type(result) is JobTimedOut:
                    self._apply_timeout(job, on_done, result)
                elif on_done is late_result:
                    self._late_done(job, result)
                else:
                    on_done(job, result)
        if self._waiting:
            self._start_waiting_promotions()

    def _begin_call(self, req_context: object) -> None:
        """Standalone mode: apply finished results, and submit the promotion batch of another
        request. Step-driven mode: nothing (results apply at step boundaries)."""
        if self._closed:
            raise TieringError("the manager is shut down")
        if self.step_driven:
            return
        other_request = request_key(req_context) not in self._batches if self._batches else False
        if self._results_queued or self._done or self._waiting:
            self._process_finished()
        if other_request:
            self._flush_promotions()

    def _begin_lookup(self, key: bytes, req_context: object) -> None:
        """:meth:`_begin_call` for a lookup, which applies nothing when it can answer without
        I/O results: a key ready in the primary (HIT) or in no tier and not promoted (MISS).
        Applying results may start promotions that evict; skipping it here keeps every key a
        lookup answered HIT in the primary until a call that may evict (see
        :meth:`prepare_load`), however the I/O thread was scheduled."""
        if not self._closed:
            if key in self._primary_slots:
                if key not in self._primary_not_ready:
                    return  # HIT
            elif not self._promoting or key not in self._promoting:
                held = self._one_tier_held
                if held is not None and key not in held:
                    return  # MISS
                tiers_held = self._tiers_held
                if tiers_held is not None and not any(key in keys for keys in tiers_held):
                    return  # MISS
                if self._tier_state(key)[0] is ABSENT:
                    return  # MISS (quarantined, or no tier is open)
        self._begin_call(req_context)

    def _check_open(self) -> None:
        if self._closed:
            raise TieringError("the manager is shut down")

    @property
    def enable_events(self) -> bool:
        """Whether :meth:`take_events` reports stored and removed blocks (settable)."""
        return self._enable_events

    @enable_events.setter
    def enable_events(self, enabled: bool) -> None:
        # The primary records its events only when they are forwarded: a store or eviction
        # then builds no event that would be dropped.
        self._enable_events = self.primary.enable_events = enabled

    def _pull_primary_events(self) -> None:
        if self._enable_events:
            self._events += self.primary.take_events()

    def _emit(self, tier: SecondaryTier, keys: Sequence[bytes], removed: bool) -> None:
        if self._enable_events and keys:
            self._events.append(
                OffloadingEvent(
                    tuple(OffloadKey(k) for k in keys), tier.medium, removed, owner=tier.name
                )
            )

    # -- lookups ---------------------------------------------------------------------------------

    def lookup_result(self, key: OffloadKey, req_context: object = None) -> LookupResult:
        """HIT if ready in the primary; HIT_PENDING while written (into the primary, or into a
        tier below it); RETRY while promoted from a secondary tier (a promotion this call may
        start or queue); MISS if in no tier."""
        if type(key) is not bytes:
            check_key(key)
        counts = self._lookups
        if counts.guarded and (
            self._closed
            or not self.step_driven
            and (self._batches or self._results_queued or self._done or self._waiting)
        ):
            self._begin_lookup(key, req_context)
        # The primary's lookup_result, inline (the engine's hottest call): the key is bytes.
        if key in self._primary_slots:
            if key not in self._primary_not_ready:
                counts.hits += 1
                return HIT
            counts.pending += 1
            return RETRY if key in self._promoting else HIT_PENDING
        # _lookup_below's miss, inline (hot path): in no tier's index, not being promoted.
        held = self._one_tier_held
        if held is not None:
            if key not in held and (not self._promoting or key not in self._promoting):
                counts.misses += 1
                return MISS
        elif (
            self._tiers_held is not None
            and not any(key in tier_keys for tier_keys in self._tiers_held)
            and (not self._promoting or key not in self._promoting)
        ):
            counts.misses += 1
            return MISS
        answer = self._lookup_below(key, req_context)
        counts.misses += 1  # after: a bad req_context raises, counting nothing
        return answer

    def lookup(self, key: OffloadKey, req_context: object = None) -> bool | None:
        """:meth:`lookup_result` as True (HIT), False (MISS) or None (ask again later)."""
        if type(key) is not bytes:
            check_key(key)
        counts = self._lookups
        if counts.guarded and (
            self._closed
            or not self.step_driven
            and (self._batches or self._results_queued or self._done or self._waiting)
        ):
            self._begin_lookup(key, req_context)  # (_begin_call's test, inline: hot path)
        if key in self._primary_slots:  # the primary's lookup, inline: the key is bytes
            if key not in self._primary_not_ready:
                counts.hits += 1
                return True
            counts.pending += 1
            return None
        # _lookup_below's miss, inline (hot path): in no tier's index, not being promoted.
        held = self._one_tier_held
        if held is not None:
            if key not in held and (not self._promoting or key not in self._promoting):
                counts.misses += 1
                return False
        elif (
            self._tiers_held is not None
            and not any(key in tier_keys for tier_keys in self._tiers_held)
            and (not self._promoting or key not in self._promoting)
        ):
            counts.misses += 1
            return False
        below = AS_BOOL[self._lookup_below(key, req_context)]
        counts.misses += 1  # after: a bad req_context raises, counting nothing
        return below

    def _one_tier_lookup_result(self) -> Callable[[OffloadKey, object], LookupResult]:
        """:meth:`lookup_result` for a step-driven manager whose one tier answers from its index
        (what the vLLM adapter builds), as a closure over the primary's and the tier's key
        sets: a hit or a miss loads no attribute of the manager. The engine asks per block of
        every request it schedules; measured with ``benchmarks/bench_vs_vllm.py``'s keys, ns per
        miss, method -> closure: 143 -> 121 at 1e3 blocks, 157 -> 133 at 1e4, 257 -> 241 at
        1e5 (vLLM 0.33's: 149, 158, 267). Any other answer, a key that is not ``bytes`` and a
        shut-down manager take the method."""
        slots, not_ready = self._primary_slots, self._primary_not_ready
        held, promoting, counts = self._one_tier_held, self._promoting, self._lookups
        assert held is not None
        owner = weakref.ref(self)  # no cycle: a dropped manager still shuts down at once
        method = TieringOffloadingManager.lookup_result

        def lookup_result(key: OffloadKey, req_context: object = None) -> LookupResult:
            if type(key) is bytes and not counts.guarded:
                if key in slots:
                    if key not in not_ready:
                        counts.hits += 1
                        return HIT
                elif key not in held and (not promoting or key not in promoting):
                    counts.misses += 1
                    return MISS
            manager = owner()
            if manager is None:
                raise TieringError("the manager is shut down")
            return method(manager, key, req_context)

        lookup_result.__doc__ = method.__doc__
        lookup_result.__qualname__ = method.__qualname__
        return lookup_result

    @property
    def primary_lookup_hits(self) -> int:
        """Keys lookups found ready in the primary."""
        return self._lookups.hits

    @property
    def primary_lookup_pending(self) -> int:
        """Keys lookups found being written into the primary (a store, or a promotion)."""
        return self._lookups.pending

    @property
    def primary_lookup_misses(self) -> int:
        """Keys lookups did not find in the primary."""
        return self._lookups.misses

    def _lookup_below(self, key: bytes, req_context: object) -> LookupResult:
        """The answer for a key the primary does not hold."""
        if key in self._promoting:
            return RETRY
        if not self.tiers:
            return MISS
        state, index = self._tier_state(key)
        if state is TierKeyState.READY:
            owner = request_key(req_context)  # checked before anything is counted
            self.tiers[index].count_lookup_hit()
            if self._counts_lookups:
                self._count_lookup(key)
            if key in self._batched:
                if not self.step_driven:
                    self._flush_promotions()  # asked again: stop batching, start it now
                return RETRY
            if self.step_driven:
                # Reserve its primary slot now, so the answer is exact: RETRY if the promotion
                # is on its way, MISS if the primary cannot make room for it this step.
                return RETRY if self._reserve_promotion(key, index, req_context, owner) else MISS
            self._batch_promotion(key, index, req_context, owner)
            return RETRY
        if self._counts_lookups:
            self._count_lookup(key)
        if state is ABSENT:
            return MISS
        if state is TierKeyState.WRITING:
            return HIT_PENDING
        return self._lookup_shared(key, req_context)  # UNKNOWN: only a shared tier says it

    def lookup_prefix(
        self, keys: Iterable[OffloadKey], *misplaced: object, req_context: object = None
    ) -> int | None:
        """The number of leading keys ready in the primary; None if the prefix goes on in a
        secondary tier (its keys are being promoted) or in a block being written."""
        if misplaced:
            reject_positional("lookup_prefix", misplaced, "req_context")
        key_list = check_keys(keys)
        if self.tiers:
            request_key(req_context)
        self._begin_call(req_context)
        count = 0
        lookup = self.primary.lookup
        for key in key_list:
            if lookup(key) is not True:
                break
            count += 1
        self._lookups.hits += count  # the first other key is counted just below
        promotable: dict[bytes, int] = {}
        pending = False
        for key in key_list[count:]:
            if self._state_for_lookup(key, promotable) is KeyState.ABSENT:
                break
            pending = True
        self._promote(promotable, req_context)
        return None if pending else count

    def lookup_request(
        self,
        spec: KVCacheSpec,
        keys_per_group: Sequence[Sequence[OffloadKey]],
        num_prompt_tokens: int,
        *misplaced: object,
        req_context: object = None,
        engine_recomputes_last_token: bool = False,
    ) -> int | None:
        """Hybrid lookup across KV-cache groups (see :mod:`tiering.core.lookup`): the number of
        tokens loadable from the primary, or None while needed blocks are written or promoted.

        Groups may be split across tiers: a block only in a secondary tier counts as pending and
        its promotion starts, so a later call finds it in the primary. With
        ``engine_recomputes_last_token`` a full-attention-only hit may cover the whole prompt."""
        if misplaced:
            reject_positional("lookup_request", misplaced, "req_context")
        check_hybrid_args(spec, keys_per_group, num_prompt_tokens, engine_recomputes_last_token)
        for group_keys in keys_per_group:
            check_keys(group_keys)
        if self.tiers:
            request_key(req_context)
        self._begin_call(req_context)
        promotable: dict[bytes, int] = {}

        def state_of(key: bytes) -> KeyState:
            return self._state_for_lookup(key, promotable)

        hit = find_hybrid_hit(
            spec,
            keys_per_group,
            state_of,
            num_prompt_tokens,
            engine_recomputes_last_token=engine_recomputes_last_token,
        )
        # Only the blocks this hit needs are promoted.
        self._promote({k: promotable[k] for k in hit.pending_keys if k in promotable}, req_context)
        return hit.answer

    def _state_for_lookup(self, key: bytes, promotable: dict[bytes, int]) -> KeyState:
        """The key's state across tiers; a key a tier could promote is PENDING and noted."""
        answer = self.primary.lookup(OffloadKey(key))
        counts = self._lookups
        if answer is True:
            counts.hits += 1
            return KeyState.READY
        if answer is None:
            counts.pending += 1
            return KeyState.PENDING
        counts.misses += 1
        if key in self._promoting:
            return KeyState.PENDING
        if self._counts_lookups:
            self._count_lookup(key)
        state, index = self._tier_state(key)
        if state is TierKeyState.ABSENT:
            return KeyState.ABSENT
        if state is TierKeyState.READY:
            self.tiers[index].count_lookup_hit()
            promotable[key] = index
        elif state is TierKeyState.UNKNOWN:  # a shared tier: asked with the request's batch
            promotable[key] = index
        return KeyState.PENDING

    def locate(self, key: OffloadKey) -> str | None:
        """Where ``key`` is stored and ready, without side effects: "CPU", a tier's medium, or
        None. A tier that is still opening or is degraded holds nothing. For reports and tools;
        the protocol uses :meth:`lookup_result`."""
        if self.primary.lookup(key) is True:
            return self.primary.medium
        for tier in self.tiers:
            if tier.state(key) is TierKeyState.READY:
                return tier.medium
        return None

    def _tier_state(self, key: bytes) -> tuple[TierKeyState, int]:
        """The first tier that knows ``key``, without side effects."""
        for index, tier in enumerate(self.tiers):
            state = tier.state(key)
            if state is not ABSENT:
                return state, index
        return ABSENT, -1

    def _count_lookup(self, key: bytes) -> None:
        self._lookup_counts[key] = self._lookup_counts.get(key, 0) + 1

    # -- promotions ------------------------------------------------------------------------------

    def _batch_promotion(
        self, key: bytes, index: int, req_context: object, owner: Hashable
    ) -> _PromotionBatch:
        batch = self._batches.get(owner)
        if batch is None:
            batch = self._batches[owner] = _PromotionBatch(req_context)
        batch.by_tier.setdefault(index, []).append(key)
        self._batched[key] = owner
        return batch

    def _reserve_promotion(
        self, key: bytes, index: int, req_context: object, owner: Hashable
    ) -> bool:
        """Step-driven lookup of a key only tier ``index`` holds: reserve its primary slot now
        (evicting, but never a key the request protected for the step) and batch it; False,
        counted, if the primary cannot make room."""
        out = self.primary.reserve_for_promotion(
            [OffloadKey(key)], req_context, protected=self._step_protected.get(owner, ())
        )
        self._pull_primary_events()
        if out is None or not out.keys_to_store:
            self.promotions_without_space += 1
            return False
        batch = self._batch_promotion(key, index, req_context, owner)
        batch.slots[key] = int(out.store_spec.block_ids[0])
        self._promoting[key] = index
        return True

    def protect_for_step(self, keys: Iterable[OffloadKey], *, req_context: object = None) -> None:
        """Keys ``req_context``'s request counts on in this step (e.g. lookup hits it is about
        to load): until the next :meth:`on_schedule_end` (or reset), no promotion started for
        that request evicts them from the primary to make room. A promotion that cannot get a
        slot otherwise is a ``MISS`` (step-driven) or counted in ``promotions_without_space``."""
        self._check_open()
        key_list = check_keys(keys)
        owner = request_key(req_context)
        self._step_protected.setdefault(owner, set()).update(key_list)

    def _promote(self, promotable: dict[bytes, int], req_context: object) -> None:
        """Promote keys a prefix or hybrid lookup needs: now (standalone) or with the request's
        batch at the step's end (step-driven)."""
        if not promotable:
            return
        if not self.step_driven:
            by_tier: dict[int, list[bytes]] = {}
            for key, index in promotable.items():
                by_tier.setdefault(index, []).append(key)
            self._start_promotions(by_tier, req_context)
            return
        owner = request_key(req_context)
        for key, index in promotable.items():
            if key not in self._batched:
                self._batch_promotion(key, index, req_context, owner)

    def _flush_promotions(self) -> None:
        """Submit every request's promotion batch, one job per request and tier."""
        if not self._batches:
            return
        batches, self._batches = self._batches, {}
        self._batched.clear()
        for batch in batches.values():
            if not batch.slots:
                self._start_promotions(batch.by_tier, batch.req_context)
                continue
            unreserved: dict[int, list[bytes]] = {}
            for index, keys in batch.by_tier.items():
                reserved = [k for k in keys if k in batch.slots]
                if reserved:
                    slots = [batch.slots[k] for k in reserved]
                    self._start_reserved_promotion(index, reserved, slots, batch.req_context)
                rest = [k for k in keys if k not in batch.slots]
                if rest:
                    unreserved[index] = rest
            if unreserved:
                self._start_promotions(unreserved, batch.req_context)

    def _start_promotions(self, by_tier: dict[int, list[bytes]], req_context: object) -> None:
        for index, keys in by_tier.items():
            keys = [k for k in dict.fromkeys(keys) if k not in self._promoting]
            if index == self._shared_index:
                keys = self._check_shared(keys, req_context)
            if not keys:
                continue
            if self.tiers[index].stalled:
                continue  # it serves nothing until its I/O returns: the keys are misses
            if not self.tiers[index].has_capacity_for_job:
                self._wait_for_job_slot(index, keys, req_context)  # loads wait; stores are shed
                continue
            self._start_promotion(index, keys, req_context)

    # -- the shared tier ---------------------------------------------------------------------------

    def location_unknown(self, key: OffloadKey) -> bool:
        """Whether a ``RETRY`` for ``key`` waits for the shared tier's existence check (no tier
        knows where the key is: it may turn out absent) rather than for a promotion. For an
        adapter whose engine tells the two apart (vLLM's ``RETRY`` / ``HIT_PENDING``). No side
        effects."""
        shared = self._shared
        if shared is None or self.primary.lookup(key) is not False:
            return False
        for tier in self.tiers[:-1]:  # the shared tier is the last
            if tier.state(key) is not ABSENT:
                return False
        return shared.is_unknown(key)

    def _lookup_shared(self, key: bytes, req_context: object) -> LookupResult:
        """A key no local tier holds and the shared tier knows nothing of: it joins the
        request's batch, to be asked about with the batch's other unknown keys: RETRY."""
        owner = request_key(req_context)
        if key in self._batched:
            if not self.step_driven:
                self._flush_promotions()  # asked again: stop batching, ask now
            return RETRY
        self._batch_promotion(key, self._shared_index, req_context, owner)
        return RETRY

    def _check_shared(self, keys: list[bytes], req_context: object) -> list[bytes]:
        """Submit one existence check for the keys the shared tier knows nothing of (RETRY
        while it runs); return the keys it knows are present, to promote now."""
        shared = cast(SharedTier, self._shared)
        present, unknown = shared.partition(keys)
        primary = self.primary
        unknown = [k for k in unknown if k not in primary]
        if unknown:
            job = shared.start_check(unknown, req_context=req_context)
            if job is not None:
                for key in job.keys:
                    self._promoting[key] = self._shared_index
                self._submit(job, self._check_done)
        return present

    def _check_done(self, job: TierJob, result: object) -> None:
        """Promote the keys an existence check found (the tier cached every answer)."""
        shared = cast(SharedTier, self._shared)
        present = shared.finish_check(job, result)
        promoting = self._promoting
        for key in job.keys:
            promoting.pop(key, None)
        keys = [k for k in present if k not in promoting]
        if not keys:
            return
        if shared.has_capacity_for_job:
            self._start_promotion(self._shared_index, keys, job.req_context)
        else:
            self._wait_for_job_slot(self._shared_index, keys, job.req_context)

    def _wait_for_job_slot(self, index: int, keys: list[bytes], req_context: object) -> None:
        if self.tiers[index].stalled:
            return  # no slot frees up while stalled: the keys are misses
        self._waiting.setdefault(index, []).append((req_context, keys, None))
        for key in keys:
            self._promoting[key] = index

    def _start_waiting_promotions(self) -> None:
        for index in list(self._waiting):
            tier = self.tiers[index]
            if tier.stalled:  # it serves nothing until its I/O returns: give the keys up
                for _context, keys, slots in self._waiting.pop(index):
                    for key in keys:
                        self._promoting.pop(key, None)
                    if slots is not None:  # reserved, never read into: free them
                        self.primary.complete_store(cast("list[OffloadKey]", keys), success=False)
                continue
            if not tier.has_capacity_for_job:
                continue
            entries = self._waiting.pop(index)  # a promotion may queue itself again meanwhile
            for n, (req_context, keys, slots) in enumerate(entries):
                if not tier.has_capacity_for_job:
                    self._waiting[index] = entries[n:] + self._waiting.get(index, [])
                    break
                if slots is None:
                    self._start_promotion(index, keys, req_context)
                else:
                    self._start_reserved_promotion(index, keys, slots, req_context)

    def _start_promotion(self, index: int, keys: list[bytes], req_context: object) -> None:
        tier = self.tiers[index]
        for key in keys:
            self._promoting.pop(key, None)
        primary = self.primary
        keys = [k for k in tier.readable(keys) if k not in primary]
        if not keys:
            return
        protected = self._step_protected.get(request_key(req_context), ())
        out = primary.reserve_for_promotion(
            cast("list[OffloadKey]", keys), req_context, protected=protected
        )
        self._pull_primary_events()
        if out is None:
            if self._draining:
                # Write-backs are freeing slots: try again when one finishes.
                self._wait_for_job_slot(index, keys, req_context)
                return
            # No room in the primary now: counted; a later lookup asks again.
            self.promotions_without_space += len(keys)
            return
        job = tier.start_promotion(
            out.keys_to_store, out.store_spec.block_ids.tolist(), req_context=req_context
        )
        for key in job.keys:
            self._promoting[key] = index
        self._submit(job, self._promotion_done)

    def _start_reserved_promotion(
        self, index: int, keys: list[bytes], slots: list[int], req_context: object
    ) -> None:
        """Read keys into the primary slots reserved for them at lookup. A key the tier no
        longer holds (evicted by a store since) gives its slot back."""
        tier = self.tiers[index]
        readable = set(tier.readable(keys))
        if len(readable) < len(keys):
            gone = [k for k in keys if k not in readable]
            for key in gone:
                self._promoting.pop(key, None)
            self.primary.complete_promotion(cast("list[OffloadKey]", gone), False)
            pairs = [(k, s) for k, s in zip(keys, slots, strict=True) if k in readable]
            keys, slots = [k for k, _ in pairs], [s for _, s in pairs]
            if not keys:
                return
        if not tier.has_capacity_for_job:
            self._waiting.setdefault(index, []).append((req_context, keys, slots))
            return
        job = tier.start_promotion(keys, slots, req_context=req_context)
        self._submit(job, self._promotion_done)

    def _promotion_done(self, job: TierJob, result: object) -> None:
        outcome = job.tier.finish_promotion(job, result)
        for key in job.keys:
            self._promoting.pop(key, None)
        if outcome.loaded:
            self.primary.complete_promotion(cast("list[OffloadKey]", outcome.loaded), True)
        if outcome.failed:
            self.primary.complete_promotion(cast("list[OffloadKey]", outcome.failed), False)
        self._pull_primary_events()
        self._emit(job.tier, outcome.removed, removed=True)

    # -- loads -----------------------------------------------------------------------------------

    def prepare_load(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> LoadStoreSpec:
        """Pin primary-ready keys for a load; see :meth:`CPUOffloadingManager.prepare_load`.

        It applies no I/O results, even standalone: applying them may start promotions, which
        evict, and every key a lookup answered HIT must still be there to pin."""
        if misplaced:
            reject_positional("prepare_load", misplaced, "req_context")
        key_list = check_keys(keys)
        self._check_open()
        return self.primary.prepare_load_checked(key_list)

    def complete_load(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> None:
        if misplaced:
            reject_positional("complete_load", misplaced, "req_context")
        key_list = check_keys(keys)
        self._begin_call(req_context)
        self.primary.complete_load_checked(key_list)

    def touch(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> None:
        """Most recent use in every tier; the first key ends most recent. It applies no I/O
        results (that could evict a key a lookup just answered HIT: see :meth:`prepare_load`)."""
        if misplaced:
            reject_positional("touch", misplaced, "req_context")
        key_list = check_keys(keys)
        self._check_open()
        self.primary.touch_checked(key_list)
        for tier in self.tiers:
            tier.touch(key_list, req_context=req_context)

    def refresh(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> None:
        """Recency without a use in every tier (keys the request stored, not reused: ARC keeps
        them in T1); the first key ends most recent."""
        if misplaced:
            reject_positional("refresh", misplaced, "req_context")
        key_list = check_keys(keys)
        self._begin_call(req_context)
        self.primary.policy.refresh(key_list)
        for tier in self.tiers:
            tier.refresh(key_list, req_context=req_context)

    # -- stores ----------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> PrepareStoreOutput | None:
        """Reserve primary slots; see :meth:`CPUOffloadingManager.prepare_store`. With a
        write-back tier, evicting dirty blocks starts their write-back and may answer None until
        it is done."""
        if misplaced:
            reject_positional("prepare_store", misplaced, "req_context")
        key_list = check_keys(keys)
        request_key(req_context)  # checked before anything changes (the store is the request's)
        self._begin_call(req_context)
        out = self.primary.prepare_store_checked(key_list, req_context)
        self._pull_primary_events()
        return out

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        *misplaced: object,
        success: bool = True,
        req_context: object = None,
    ) -> None:
        """Finish a primary store (only the keys ``prepare_store`` handed to this request: see
        :meth:`CPUOffloadingManager.complete_store`), then cascade the keys it made ready to the
        tiers by write policy."""
        if misplaced:
            reject_positional("complete_store", misplaced, "success and req_context")
        if success is not True and success is not False:
            check_success(success)
        key_list = check_keys(keys)
        request_key(req_context)  # checked before anything changes
        self._begin_call(req_context)
        primary = self.primary
        ready = primary.complete_store_checked(key_list, success, req_context)
        self._pull_primary_events()
        if not success or not ready or not self.tiers:
            return
        slots = cast("Mapping[bytes, int]", primary.slots)
        for tier in self.tiers:
            job = tier.start_store(
                ready, slots, lookup_counts=self._lookup_counts, req_context=req_context
            )
            if job is not None:
                self._run_store_job(job)

    def _run_store_job(self, job: TierJob) -> None:
        """Emit what the tier evicted for the job, hold the primary rows it reads, submit it."""
        self._emit(job.tier, job.removed, removed=True)
        if not job.retried:  # a retry keeps the hold of the job it retries
            if job.kind == "store":
                self.primary.pin(cast("list[OffloadKey]", list(job.keys)))
            else:  # write-back: the evicted slots stay allocated until the write is done
                draining = self._draining
                for slot in job.slots:
                    draining[slot] = draining.get(slot, 0) + 1
        self._submit(job, self._store_done)

    def _store_done(self, job: TierJob, result: object) -> None:
        outcome = job.tier.finish_store(job, result)
        self._emit(job.tier, outcome.stored, removed=False)
        if outcome.settled:
            if job.kind == "store":
                self.primary.complete_load(
                    cast("list[OffloadKey]", [k for k, _ in outcome.settled])
                )
            else:
                self._release_draining([slot for _, slot in outcome.settled])
        if outcome.retry is not None:
            self._run_store_job(outcome.retry)

    # -- write-back --------------------------------------------------------------------------------

    def _on_primary_evict(
        self, victims: list[tuple[OffloadKey, int]], req_context: object
    ) -> set[int]:
        """Start writing dirty victims to their write-back tiers; keep their slots until done."""
        slots: dict[bytes, int] = dict(victims)
        retained: set[int] = set()
        for tier in self._write_back_tiers:
            job = tier.start_write_back(slots, req_context=req_context)
            if job is not None:
                retained.update(job.slots)
                self._run_store_job(job)
        return retained

    def _release_draining(self, slots: Sequence[int]) -> None:
        free = []
        for slot in slots:
            left = self._draining[slot] - 1
            if left:
                self._draining[slot] = left
            else:
                del self._draining[slot]
                free.append(slot)
        self.primary.release_slots(free)

    # -- steps, requests, events, metrics ----------------------------------------------------------

    def on_schedule_end(self) -> None:
        """End of a scheduler step: apply the results of finished tier I/O, then submit every
        request's promotion batch (one job per request and tier)."""
        self._check_open()
        self._process_finished(before_epoch=self._epoch if self.step_driven else None)
        self._flush_promotions()
        self._step_protected.clear()
        self._epoch += 1

    def apply_finished(self) -> None:
        """Apply now the results of every tier job finished so far, whichever step started it.
        A step-driven caller that wants results as soon as they exist (vLLM's own manager polls
        its tiers at the first call of each step) calls it; its answers then depend on when
        the I/O finished, not only on the calls made."""
        self._check_open()
        if self._results_queued or self._done or self._waiting:
            self._process_finished()

    def has_pending_work(self) -> bool:
        return bool(self._jobs or self._batches or self._waiting)

    def take_events(self) -> list[OffloadingEvent]:
        """Stored and removed events of every medium ("CPU", then each tier's), in order."""
        if not self.step_driven and not self._closed:
            self._process_finished()
            self._flush_promotions()
        self._pull_primary_events()
        events, self._events = self._events, []
        return events

    def inflight_jobs(self) -> list[TierJob]:
        return list(self._jobs)

    def _counters(self) -> ManagerStats:
        primary = self.primary.counters()
        primary["promotions_without_space"] = self.promotions_without_space
        out = {self.primary.medium: primary}
        for tier in self.tiers:
            out[tier.name] = tier.metrics.counters()
        return out

    def get_stats(self) -> ManagerStats:
        """Counters per tier since the previous call (deltas): ``"CPU"`` as
        :meth:`CPUOffloadingManager.get_stats` plus ``promotions_without_space``; each tier by
        name with its :class:`~tiering.managers.secondary_tier.TierMetrics` counters
        (``lookup_hits``,
        ``promoted_blocks``, ``bytes_read``, ``stored_blocks``, ``bytes_written``,
        ``store_failures``, ``promotion_failures``, ``corrupt_blocks``, ``stores_shed``,
        ``open_failures``, ...). :meth:`metrics` has the totals."""
        now = self._counters()
        seen, self._stats_seen = self._stats_seen, now
        return {
            tier: {
                name: value - seen.get(tier, {}).get(name, 0) for name, value in counters.items()
            }
            for tier, counters in now.items()
        }

    def config_info(self) -> list[ConfigInfo]:
        return self.primary.config_info() + [tier.config_info() for tier in self.tiers]

    def metrics(self) -> dict[str, Any]:
        """Counters (totals) per tier and of the primary tier.

        ``"primary"``: ``blocks``, ``free_blocks``, ``promotions_without_space``, the keys
        looked up in it by any lookup call (``lookups``, the sum of ``lookup_hits``: ready
        there, ``lookup_pending``: being written there, ``lookup_misses``: not there) and the
        primary's own counters (:meth:`CPUOffloadingManager.counters`: ``stored_blocks``,
        ``failed_stores``, ``evicted_blocks``, ``loaded_blocks``, ``stores_skipped``). Each
        tier by name: its state, usage, :class:`~tiering.managers.secondary_tier.TierMetrics`
        counters and its
        backend's stats."""
        counts = self._lookups
        hits, pending, misses = counts.hits, counts.pending, counts.misses
        out: dict[str, Any] = {
            "primary": {
                "blocks": len(self.primary),
                "free_blocks": self.primary.num_free_blocks,
                "promotions_without_space": self.promotions_without_space,
                "lookups": hits + pending + misses,
                "lookup_hits": hits,
                "lookup_pending": pending,
                "lookup_misses": misses,
                **self.primary.counters(),
            }
        }
        for tier in self.tiers:
            out[tier.name] = {
                "status": "stalled" if tier.stalled else tier.status,
                "stalled": tier.stalled,
                "open_error": tier.open_error,
                "blocks": len(tier),
                "capacity_blocks": tier.capacity_blocks if tier.is_open else 0,
                "effective_capacity_blocks": (
                    tier.backend.effective_capacity_blocks if tier.is_open else 0
                ),
                "inflight_jobs": tier.inflight_jobs,
                **tier.metrics.counters(),
                "backend": vars(tier.backend.stats),
            }
        return out

    # -- waiting and lifecycle --------------------------------------------------------------------

    def wait_idle(self, timeout: float | None = 60.0) -> None:
        """Block until every promotion batch is submitted, no job is in flight and every result
        is applied (lifecycle, tools and tests; never called by the protocol).

        It works in rounds, each a step boundary with its I/O drained: submit the batches, wait
        until every job in flight has finished, apply all their results in submission order. So
        the same calls give the same state afterwards, however the I/O thread was scheduled."""
        if self._io.in_loop_thread():
            raise TieringError("wait_idle() would deadlock on the I/O loop thread")
        deadline = float("inf") if timeout is None else time.monotonic() + timeout
        while True:
            self._flush_promotions()
            self._collect(block_until_all=deadline)
            self._process_finished()
            if not self._jobs and not self._waiting and not self._batches:
                return

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
        while True:
            self._flush_promotions()
            self._collect()
            while self._uncollected() > 0:
                await self._wait_any()
                self._collect()
            self._process_finished()
            if not self._jobs and not self._waiting and not self._batches:
                return

    def _step(self) -> None:
        self._process_finished()
        self._flush_promotions()

    async def lookup_async(self, key: OffloadKey, *, req_context: object = None) -> bool:
        """Like :meth:`lookup`, but waits out "ask again later": True once ready, False if
        absent. Each wait is a step boundary (results apply, batches are submitted)."""
        while True:
            answer = self.lookup(key, req_context=req_context)
            if answer is not None:
                return answer
            self._step()
            await self._wait_any()
            self._step()

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
            self._step()
            await self._wait_any()
            self._step()

    async def _wait_any(self) -> None:
        """Wait until a job in flight finishes (its result is queued by then)."""
        futures = [j.future for j in self._jobs if j.future is not None and not j.future.done()]
        if futures:
            await asyncio.wait(
                [asyncio.wrap_future(f) for f in futures], return_when=asyncio.FIRST_COMPLETED
            )
        else:
            await asyncio.sleep(0)

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
        self._pull_primary_events()
        self._draining.clear()
        self._promoting.clear()
        self._batches.clear()
        self._batched.clear()
        self._waiting.clear()
        self._step_protected.clear()
        for tier in self.tiers:
            job = tier.start_clear()
            if job is not None:
                self._emit(tier, job.removed, removed=True)
                self._submit(job, _ignore_result)
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
        with self._claim:  # no deadline fires into a closed manager
            self._closed = True
        self._close_deadlines()
        self._lookups.guarded = True
        self._io.close()
        self.primary.shutdown()
        # Keep no view of the pool: its owner may unmap it next (vLLM's shared offload region
        # refuses to unmap while any buffer still exports it).
        self._jobs.clear()
        self._done.clear()
        self._waiting.clear()
        self._batches.clear()
        self._rows = np.empty((0, self.row_bytes), np.uint8)
        for tier in self.tiers:
            tier.detach()

    def __del__(self) -> None:
        lookups = getattr(self, "_lookups", None)
        if lookups is not None:  # a lookup closure still held sends its callers to the method
            lookups.guarded = True
        io = getattr(self, "_io", None)
        if io is not None and not getattr(self, "_closed", True):
            io.close(timeout=0)
        if getattr(self, "_deadlines", None) is not None:
            self._close_deadlines(wait=False)


def _ignore_result(job: TierJob, result: object) -> None:
    """Deletes after a reset are best effort: the index has already forgotten the keys."""
