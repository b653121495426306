"""Lookups across the tiers below the primary, and the counts of lookups in the primary.

A lookup asks the primary, then each secondary tier in order, from their in-memory indexes (no
I/O). The manager answers the primary's part inline (its hottest call); :class:`TierLookups`
answers for a key the primary does not hold: ``MISS`` if no tier holds it, ``HIT_PENDING`` while
a tier writes it, ``RETRY`` while it is promoted. A key found only in a secondary tier starts a
promotion (:mod:`tiering.managers.promotions`); a key no local tier holds and the shared tier
knows nothing of joins its request's batch, to be asked about with the batch's other unknown
keys (:mod:`tiering.managers.shared_checks`). Prefix and hybrid lookups go key by key the same
way and promote only the keys their answer needs.

Two shortcuts keep the hot path lean. When every tier answers from its index alone (no shared
tier, no lookup counting, no tier class with its own ``state()``), a key in no tier's ``held`` set
is absent everywhere: :func:`miss_sets` gives the manager those sets to probe. And a step-driven
manager with one such tier answers through a closure (:func:`one_tier_lookup_result`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Mapping, Sequence

import cachetools

from tiering.core.groups import KVCacheSpec
from tiering.core.keys import OffloadKey
from tiering.core.lookup import KeyState, find_hybrid_hit
from tiering.errors import TieringError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.promotions import Promotions
from tiering.managers.protocol import HIT, HIT_PENDING, MISS, RETRY, LookupResult, request_key
from tiering.managers.secondary_tier import SecondaryTier, TierKeyState
from tiering.policies.admission import FrequencyGate

__all__ = ["LookupCounts", "TierLookups", "miss_sets", "one_tier_lookup_result"]

ABSENT = TierKeyState.ABSENT


class LookupCounts:
    """The keys looked up in the primary, by answer (read by ``metrics()``), and whether a
    lookup must take the guarded path: shared by the lookup methods and the step-driven lookup
    closure (:func:`one_tier_lookup_result`), which holds no reference to the manager."""

    __slots__ = ("guarded", "hits", "misses", "pending")

    def __init__(self, guarded: bool) -> None:
        self.guarded = guarded  # standalone, or shut down: a lookup may run _begin_call
        self.hits = 0  # ready there
        self.pending = 0  # being written there (a store, or a promotion)
        self.misses = 0  # not there


def miss_sets(
    tiers: Sequence[SecondaryTier], *, any_shared: bool, counts_lookups: bool
) -> tuple[set[bytes] | None, tuple[set[bytes], ...] | None]:
    """A lookup's miss test, when every tier answers from its index alone: a key in no tier's
    ``held`` is ABSENT everywhere (one probe per tier, no call). None: ask each tier's state()
    (a shared tier, a tier class with its own state(), lookup counting). With one tier (the
    usual case) its set itself: no loop, no type test. Returns (the one tier's set, every
    tier's sets): at most one is not None."""
    if any_shared or counts_lookups or any(type(t).state is not SecondaryTier.state for t in tiers):
        return None, None
    held = tuple(t.held for t in tiers)
    if len(held) == 1:
        return held[0], None
    return None, held


def one_tier_lookup_result(
    manager: object,
    method: Callable[[object, OffloadKey, object], LookupResult],
    *,
    slots: Mapping[OffloadKey, int],
    not_ready: Collection[OffloadKey],
    held: set[bytes],
    promoting: dict[bytes, int],
    counts: LookupCounts,
) -> Callable[[OffloadKey, object], LookupResult]:
    """``method`` (the manager's ``lookup_result``) for a step-driven manager whose one tier
    answers from its index (what the vLLM adapter builds), as a closure over the primary's and
    the tier's key sets: a hit or a miss loads no attribute of the manager. The engine asks per
    block of every request it schedules; measured with ``benchmarks/bench_vs_vllm.py``'s keys, ns
    per miss, method -> closure: 143 -> 121 at 1e3 blocks, 157 -> 133 at 1e4, 257 -> 241 at 1e5
    (vLLM 0.33's: 149, 158, 267). Any other answer, a key that is not ``bytes`` and a shut-down
    manager take the method."""
    owner = weakref.ref(manager)  # no cycle: a dropped manager still shuts down at once

    def lookup_result(key: OffloadKey, req_context: object = None) -> LookupResult:
        if type(key) is bytes and not counts.guarded:
            if key in slots:
                if key not in not_ready:
                    counts.hits += 1
                    return HIT
            elif key not in held and (not promoting or key not in promoting):
                counts.misses += 1
                return MISS
        live = owner()
        if live is None:
            raise TieringError("the manager is shut down")
        return method(live, key, req_context)

    lookup_result.__doc__ = method.__doc__
    lookup_result.__qualname__ = method.__qualname__
    return lookup_result


class TierLookups:
    """Lookups of keys below ``primary``, in ``tiers`` (see the module docstring).

    ``counts`` are the primary's lookup counts; ``lookup_counts`` counts lookups per key for
    ``write_through_selective`` tiers (``selective``: some tier is one), and ``gates`` are the
    admission gates of the tiers that have one (:mod:`~tiering.managers.tier_admission`):
    each records every key looked up past the primary. ``counts_lookups``: either applies."""

    def __init__(
        self,
        primary: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        promotions: Promotions,
        counts: LookupCounts,
        lookup_counts: cachetools.LRUCache[bytes, int],
        *,
        step_driven: bool,
        counts_lookups: bool,
        selective: bool,
        gates: Sequence[FrequencyGate],
    ) -> None:
        self.primary = primary
        self.tiers = tiers
        self.promotions = promotions
        self.counts = counts
        self.lookup_counts = lookup_counts
        self.step_driven = step_driven
        self.counts_lookups = counts_lookups
        self.selective = selective
        self.gates = tuple(gates)

    def below(self, key: bytes, req_context: object) -> LookupResult:
        """The answer for a key the primary does not hold."""
        promotions = self.promotions
        if key in promotions.promoting:
            return RETRY
        if not self.tiers:
            return MISS
        state, index = self.tier_state(key)
        if state is TierKeyState.READY:
            owner = request_key(req_context)  # checked before anything is counted
            self.tiers[index].count_lookup_hit()
            if self.counts_lookups:
                self.count(key)
            if key in promotions.batched:
                if not self.step_driven:
                    promotions.flush()  # asked again: stop batching, start it now
                return RETRY
            if self.step_driven:
                # Reserve its primary slot now, so the answer is exact: RETRY if the promotion
                # is on its way, MISS if the primary cannot make room for it this step.
                return RETRY if promotions.reserve(key, index, req_context, owner) else MISS
            promotions.batch(key, index, req_context, owner)
            return RETRY
        if self.counts_lookups:
            self.count(key)
        if state is ABSENT:
            return MISS
        if state is TierKeyState.WRITING:
            return HIT_PENDING
        return self._below_unknown(key, req_context)  # UNKNOWN: only a shared tier says it

    def _below_unknown(self, key: bytes, req_context: object) -> LookupResult:
        """A key no local tier holds and the shared tier knows nothing of: it joins the
        request's batch, to be asked about with the batch's other unknown keys: RETRY."""
        promotions = self.promotions
        owner = request_key(req_context)
        if key in promotions.batched:
            if not self.step_driven:
                promotions.flush()  # asked again: stop batching, ask now
            return RETRY
        promotions.batch(key, promotions.shared_index, req_context, owner)
        return RETRY

    def prefix(self, key_list: list[OffloadKey], req_context: object) -> int | None:
        """The number of leading keys ready in the primary; None if the prefix goes on in a
        secondary tier (its keys are being promoted) or in a block being written."""
        count = 0
        lookup = self.primary.lookup
        for key in key_list:
            if lookup(key) is not True:
                break
            count += 1
        self.counts.hits += count  # the first other key is counted just below
        promotable: dict[bytes, int] = {}
        pending = False
        for key in key_list[count:]:
            if self.state_for_lookup(key, promotable) is KeyState.ABSENT:
                break
            pending = True
        self.promotions.promote(promotable, req_context)
        return None if pending else count

    def hybrid(
        self,
        spec: KVCacheSpec,
        keys_per_group: Sequence[Sequence[OffloadKey]],
        num_prompt_tokens: int,
        req_context: object,
        engine_recomputes_last_token: bool,
    ) -> int | None:
        """A hybrid lookup's answer (:func:`~tiering.core.lookup.find_hybrid_hit`); only the
        blocks its hit needs are promoted."""
        promotable: dict[bytes, int] = {}

        def state_of(key: bytes) -> KeyState:
            return self.state_for_lookup(key, promotable)

        hit = find_hybrid_hit(
            spec,
            keys_per_group,
            state_of,
            num_prompt_tokens,
            engine_recomputes_last_token=engine_recomputes_last_token,
        )
        self.promotions.promote(
            {k: promotable[k] for k in hit.pending_keys if k in promotable}, req_context
        )
        return hit.answer

    def state_for_lookup(self, key: bytes, promotable: dict[bytes, int]) -> KeyState:
        """The key's state across tiers; a key a tier could promote is PENDING and noted."""
        answer = self.primary.lookup(OffloadKey(key))
        counts = self.counts
        if answer is True:
            counts.hits += 1
            return KeyState.READY
        if answer is None:
            counts.pending += 1
            return KeyState.PENDING
        counts.misses += 1
        if key in self.promotions.promoting:
            return KeyState.PENDING
        if self.counts_lookups:
            self.count(key)
        state, index = self.tier_state(key)
        if state is TierKeyState.ABSENT:
            return KeyState.ABSENT
        if state is TierKeyState.READY:
            self.tiers[index].count_lookup_hit()
            promotable[key] = index
        elif state is TierKeyState.UNKNOWN:  # a shared tier: asked with the request's batch
            promotable[key] = index
        return KeyState.PENDING

    def locate(self, key: OffloadKey) -> str | None:
        """Where ``key`` is stored and ready, without side effects: the primary's medium, a
        tier's, or None."""
        if self.primary.lookup(key) is True:
            return self.primary.medium
        for tier in self.tiers:
            if tier.state(key) is TierKeyState.READY:
                return tier.medium
        return None

    def tier_state(self, key: bytes) -> tuple[TierKeyState, int]:
        """The first tier that knows ``key``, without side effects."""
        for index, tier in enumerate(self.tiers):
            state = tier.state(key)
            if state is not ABSENT:
                return state, index
        return ABSENT, -1

    def count(self, key: bytes) -> None:
        """Count a lookup of ``key`` past the primary: ``write_through_selective`` tiers store
        keys looked up often enough, and gated tiers keys their gate admits."""
        if self.selective:
            self.lookup_counts[key] = self.lookup_counts.get(key, 0) + 1
        for gate in self.gates:
            gate.record(key)
