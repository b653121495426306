"""The tiering manager: the CPU primary tier composed with secondary tiers.

It implements :class:`tiering.managers.protocol.OffloadingManager` (whose docstring is the
contract) over a :class:`~tiering.managers.cpu_manager.CPUOffloadingManager` and adds what tiers
need:

- a lookup asks the primary, then each secondary tier in order (from their in-memory indexes:
  :mod:`tiering.managers.tier_lookups`); a key found only in a secondary tier starts a
  *promotion* into a primary slot and answers ``RETRY``. A key is never promoted twice at once;
  promotions are batched per request (:mod:`tiering.managers.promotions`);
- completed stores cascade to each tier by its write policy; a primary block held for a tier's
  write is released when *that* tier finishes (:mod:`tiering.managers.cascade`);
- back-pressure: each tier bounds its jobs in flight; over the bound, stores are shed (and
  counted) while promotions wait their turn;
- a failed or corrupt promotion is a miss, counted, and quarantined, never retried in a loop.

The tiers own their jobs (:mod:`tiering.managers.secondary_tier`): a tier decides what to write
or read, reserves room, counts, and builds the I/O; the manager's collaborators only hold the
primary rows a job uses, submit the job (:mod:`tiering.managers.job_runner`), emit its events
(:mod:`tiering.managers.event_log`), and hand its result back to the tier. The manager keeps the
protocol calls and their hot paths; its base class (:mod:`tiering.managers.lifecycle`) builds
and wires the collaborators, and holds what is not the protocol: waiting, asyncio, reset,
shutdown and the reports.

A shared tier (:mod:`tiering.managers.shared_tier`, at most one, the last) has no index: a key
that no local tier holds, and that the shared tier knows nothing of (``TierKeyState.UNKNOWN``),
joins its request's batch like a promotion and answers ``RETRY``; the batch's unknown keys become
one existence check of the shared tier, and the keys it finds are promoted when its result
applies (:mod:`tiering.managers.shared_checks`). Without a shared tier none of this runs: no tier
answers UNKNOWN, and an absent key takes the same branches as before.

Threads. Every protocol call runs on the caller's thread and never blocks on I/O: jobs run on a
private I/O loop thread (:class:`~tiering.managers.io_loop.IOLoop`); a finished job only enqueues
its result, which is applied on the caller's thread (:mod:`tiering.managers.step_results`). All
metadata is therefore touched by one thread, so no locks sit on the hot path. Call the manager
from one thread (or one event loop) at a time.

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

from collections.abc import Collection, Iterable, Sequence

import torch

from tiering.core.groups import KVCacheSpec
from tiering.core.keys import OffloadKey, check_key, check_keys
from tiering.core.lookup import check_hybrid_args
from tiering.errors import TieringError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.lifecycle import PoolRows, TieringLifecycle
from tiering.managers.protocol import (
    AS_BOOL,
    HIT,
    HIT_PENDING,
    MISS,
    RETRY,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    PrepareStoreOutput,
    check_success,
    reject_positional,
    request_key,
)
from tiering.managers.secondary_tier import SecondaryTier, TierKeyState
from tiering.managers.tier_lookups import miss_sets, one_tier_lookup_result
from tiering.policies.base import tell_request

__all__ = ["TieringOffloadingManager"]

ABSENT = TierKeyState.ABSENT


class TieringOffloadingManager(TieringLifecycle):
    """A CPU primary tier plus ordered secondary tiers, behind the manager protocol.

    ``pool`` holds the primary tier's bytes: a ``(num_blocks, row_bytes)`` uint8 tensor, or an
    object with ``rows_view()`` returning one (a :class:`~tiering.managers.pool.CPUBlockPool`).
    Row ``i`` is slot ``i`` of ``primary``, every rank's part of one offloaded block, and each
    tier's backend must store blocks of ``row_bytes``. Tiers open on the I/O loop as the manager
    starts; until a tier is open its lookups answer "absent" (call :meth:`wait_ready` to wait); a
    tier that fails to open is degraded and the others go on serving. ``store_threshold`` is the
    primary's (``CPUOffloadingManager(..., store_threshold=N)``); promotions are not offers.
    ``step_driven`` chooses when background results apply (see the module docstring). Every
    tier job has a deadline, its tier's ``io_timeout_s`` (:mod:`tiering.managers.stalls`).
    """

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
        super().__init__(
            primary,
            secondary_tiers,
            pool=pool,
            enable_events=enable_events,
            lookup_counter_size=lookup_counter_size,
            step_driven=step_driven,
        )
        self._keep_hot_path_state()

    def _keep_hot_path_state(self) -> None:
        """What the lookups read per key, held here: the collaborators' tables (the same
        objects, never rebound), the primary's key sets, the tiers' miss sets; and, if it
        applies, the step-driven lookup closure."""
        promotions = self._promotions
        self._promoting = promotions.promoting  # key -> tier index: waiting or in flight
        self._batches = promotions.batches  # by request key, not submitted
        self._waiting = promotions.waiting  # for a job slot
        self._done = self._tier_jobs.done  # finished, not applied yet
        self._primary_slots, self._primary_not_ready = self.primary.lookup_state()
        self._one_tier_held, self._tiers_held = miss_sets(
            self.tiers,
            any_shared=self._shared_checks is not None,
            counts_lookups=self._counts_lookups,
        )
        if (
            self.step_driven
            and self._one_tier_held is not None
            and type(self).lookup_result is TieringOffloadingManager.lookup_result
        ):
            self.lookup_result = one_tier_lookup_result(  # type: ignore[method-assign,assignment]
                self,
                TieringOffloadingManager.lookup_result,  # type: ignore[arg-type]
                slots=self._primary_slots,
                not_ready=self._primary_not_ready,
                held=self._one_tier_held,
                promoting=self._promoting,
                counts=self._lookups,
            )

    # -- when results apply ------------------------------------------------------------------------

    def _begin_call(self, req_context: object) -> None:
        """Standalone mode: apply finished results, and submit the promotion batch of another
        request. Step-driven mode: nothing (results apply at step boundaries)."""
        if self._closed:
            raise TieringError("the manager is shut down")
        if self.step_driven:
            return
        other_request = request_key(req_context) not in self._batches if self._batches else False
        if self._tier_jobs.results_queued or self._done or self._waiting:
            self._results.process_finished()
        if other_request:
            self._promotions.flush()

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
                if self._tier_lookups.tier_state(key)[0] is ABSENT:
                    return  # MISS (quarantined, or no tier is open)
        self._begin_call(req_context)

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
            and (self._batches or self._tier_jobs.results_queued or self._done or self._waiting)
        ):
            self._begin_lookup(key, req_context)
        # The primary's lookup_result, inline (the engine's hottest call): the key is bytes.
        if key in self._primary_slots:
            if key not in self._primary_not_ready:
                counts.hits += 1
                return HIT
            counts.pending += 1
            return RETRY if key in self._promoting else HIT_PENDING
        # The miss below, inline (hot path): in no tier's index, not being promoted.
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
        answer = self._tier_lookups.below(key, req_context)
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
            and (self._batches or self._tier_jobs.results_queued or self._done or self._waiting)
        ):
            self._begin_lookup(key, req_context)  # (_begin_call's test, inline: hot path)
        if key in self._primary_slots:  # the primary's lookup, inline: the key is bytes
            if key not in self._primary_not_ready:
                counts.hits += 1
                return True
            counts.pending += 1
            return None
        # The miss below, inline (hot path): in no tier's index, not being promoted.
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
        below = AS_BOOL[self._tier_lookups.below(key, req_context)]
        counts.misses += 1  # after: a bad req_context raises, counting nothing
        return below

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
        return self._tier_lookups.prefix(key_list, req_context)

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
        return self._tier_lookups.hybrid(
            spec, keys_per_group, num_prompt_tokens, req_context, engine_recomputes_last_token
        )

    def locate(self, key: OffloadKey) -> str | None:
        """Where ``key`` is stored and ready, without side effects: "CPU", a tier's medium, or
        None. A tier that is still opening or is degraded holds nothing. For reports and tools;
        the protocol uses :meth:`lookup_result`."""
        return self._tier_lookups.locate(key)

    def location_unknown(self, key: OffloadKey) -> bool:
        """Whether a ``RETRY`` for ``key`` waits for the shared tier's existence check (no tier
        knows where the key is: it may turn out absent) rather than for a promotion. For an
        adapter whose engine tells the two apart (vLLM's ``RETRY`` / ``HIT_PENDING``). No side
        effects."""
        checks = self._shared_checks
        return checks is not None and checks.location_unknown(key)

    def protect_for_step(self, keys: Iterable[OffloadKey], *, req_context: object = None) -> None:
        """Keys ``req_context``'s request counts on in this step (e.g. lookup hits it is about
        to load): until the next :meth:`on_schedule_end` (or reset), no promotion started for
        that request evicts them from the primary to make room. A promotion that cannot get a
        slot otherwise is a ``MISS`` (step-driven) or counted in ``promotions_without_space``."""
        self._check_open()
        key_list = check_keys(keys)
        owner = request_key(req_context)
        self._promotions.protect(owner, key_list)

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

    def note_request(
        self,
        keys: Collection[OffloadKey],
        *misplaced: object,
        req_context: object = None,
        ended: bool = False,
        continues: bool | None = None,
    ) -> None:
        """Tell the primary tier's policy a request's keys, before its stores or (``ended``)
        once it has ended, with the caller's hint (``continues``) if it has one (a secondary
        tier sees only the primary's misses, not requests)."""
        if misplaced:
            reject_positional("note_request", misplaced, "req_context")
        key_list = check_keys(keys)
        self._check_open()
        # the primary's policy: its keys checked once, here
        tell_request(self.primary.policy, key_list, ended=ended, continues=continues)
        self._stats.note_hint(continues)  # told: a bad hint raised, counting nothing

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
        self._events.pull_primary()
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
        ready = self.primary.complete_store_checked(key_list, success, req_context)
        self._events.pull_primary()
        if not success or not ready or not self.tiers:
            return
        self._cascade.store(ready, req_context)

    # -- steps, requests, events, metrics ----------------------------------------------------------

    def on_schedule_end(self) -> None:
        """End of a scheduler step: apply the results of finished tier I/O, then submit every
        request's promotion batch (one job per request and tier)."""
        self._check_open()
        jobs = self._tier_jobs
        self._results.process_finished(before_epoch=jobs.epoch if self.step_driven else None)
        self._promotions.flush()
        self._promotions.step_protected.clear()
        jobs.epoch += 1

    def apply_finished(self) -> None:
        """Apply now the results of every tier job finished so far, whichever step started it.
        A step-driven caller that wants results as soon as they exist (vLLM's own manager polls
        its tiers at the first call of each step) calls it; its answers then depend on when
        the I/O finished, not only on the calls made."""
        self._check_open()
        if self._tier_jobs.results_queued or self._done or self._waiting:
            self._results.process_finished()

    def take_events(self) -> list[OffloadingEvent]:
        """Stored and removed events of every medium ("CPU", then each tier's), in order."""
        if not self.step_driven and not self._closed:
            self._results.step()
        self._events.pull_primary()
        return self._events.take()
