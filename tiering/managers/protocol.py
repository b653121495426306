"""The manager protocol: the seam between a serving engine's scheduler and ``tiering``.

A *manager* runs in the engine's scheduler and answers, for offload keys, where a block is and
whether it can be loaded; it hands out the slots of the CPU primary tier that workers copy into
(stores) and out of (loads). It holds metadata only; the bytes live in a pool the workers map.
:class:`OffloadingManager` states the contract every manager keeps, and ``tiering.testing``'s
``ManagerTests`` checks it for any implementation. The shape follows vLLM 0.33's scheduler-side
``OffloadingManager`` (lookup answers, request hooks, ``on_schedule_end``, events with an owner)
so that an adapter is a thin translation, but nothing here imports vLLM.

The data types it exchanges are here too: :class:`LookupResult`, :class:`LoadStoreSpec`,
:class:`PrepareStoreOutput` and :class:`OffloadingEvent`.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Collection, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Final, NoReturn

import numpy as np

from tiering.core.groups import KVCacheSpec
from tiering.core.keys import OffloadKey, check_keys
from tiering.core.lookup import KeyState, check_hybrid_args, find_hybrid_hit
from tiering.errors import InvalidArgumentError

__all__ = [
    "ConfigInfo",
    "LoadStoreSpec",
    "LookupResult",
    "ManagerStats",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "check_success",
    "key_state",
    "reject_positional",
    "request_key",
]


class LookupResult(enum.Enum):
    """The exact answer of a lookup for one key.

    - ``HIT``: stored in the primary tier and ready: :meth:`OffloadingManager.prepare_load` may
      pin it now.
    - ``MISS``: in no tier (or in none that can serve it).
    - ``HIT_PENDING``: being written (a store in flight, into the primary or into a secondary
      tier); it becomes a hit when the write completes, or a miss if the write fails.
    - ``RETRY``: worth asking again soon: a promotion from a secondary tier into the primary is
      under way, or was just started (or queued) by this call.
    """

    MISS = 0
    HIT = 1
    HIT_PENDING = 2
    RETRY = 3


MISS: Final = LookupResult.MISS
HIT: Final = LookupResult.HIT
HIT_PENDING: Final = LookupResult.HIT_PENDING
RETRY: Final = LookupResult.RETRY

#: ``lookup``'s boolean form of each answer: True = hit, False = miss, None = ask again later.
AS_BOOL: Final[dict[LookupResult, bool | None]] = {
    HIT: True,
    MISS: False,
    HIT_PENDING: None,
    RETRY: None,
}

_KEY_STATES: Final[dict[LookupResult, KeyState]] = {
    HIT: KeyState.READY,
    MISS: KeyState.ABSENT,
    HIT_PENDING: KeyState.PENDING,
    RETRY: KeyState.PENDING,
}


def key_state(result: LookupResult) -> KeyState:
    """The :class:`~tiering.core.lookup.KeyState` a hybrid lookup counts for a lookup answer."""
    return _KEY_STATES[result]


@dataclass(frozen=True)
class LoadStoreSpec:
    """Where blocks live on one medium: ``block_ids[i]`` is the slot of the i-th key."""

    medium: str
    block_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided: the keys to write, their slots, and what was evicted."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True)
class OffloadingEvent:
    """Keys stored on (``removed=False``) or removed from (``removed=True``) one medium.

    ``medium`` is ``"CPU"`` for the primary tier and a secondary tier's medium (its name in
    upper case) otherwise. ``owner`` is None for the primary tier and the secondary tier's name
    for its events, so an adapter can report them as owned storage (vLLM's ``STORAGE`` medium
    with an ownership). A stored event means the keys became loadable (primary) or were
    acknowledged by the tier's backend (secondary); a removed event means they are gone from
    that medium's index (evicted, failed verification, or reset).
    """

    keys: tuple[OffloadKey, ...]
    medium: str
    removed: bool
    owner: str | None = None


#: Counters of one tier since the previous :meth:`OffloadingManager.get_stats` call.
ManagerStats = dict[str, dict[str, int]]
#: Static facts of one tier (labels of an info metric); they never change after construction.
ConfigInfo = dict[str, str | int | float | bool]


def request_key(req_context: object) -> Hashable:
    """The key per-request state is kept under: ``req_context.req_id`` if the context has that
    attribute, else the context itself, which must then be hashable.

    Raises :class:`InvalidArgumentError` naming ``req_context`` when neither is hashable.
    """
    key = getattr(req_context, "req_id", req_context)
    try:
        hash(key)
    except TypeError:
        raise InvalidArgumentError(
            "req_context must be hashable or carry a hashable req_id (per-request state is "
            f"keyed by it), got {type(req_context).__name__}: {req_context!r:.80}"
        ) from None
    return key


def check_success(success: object) -> None:
    """Raise :class:`InvalidArgumentError` unless ``success`` is a bool."""
    if success is not True and success is not False:
        raise InvalidArgumentError(
            f"success must be a bool, got {type(success).__name__}: {success!r:.80}"
        )


def reject_positional(call: str, misplaced: tuple[object, ...], keywords: str) -> NoReturn:
    """Raise for arguments given by position where the protocol takes keywords only.

    vLLM orders ``complete_store(keys, req_context, success)``; ``tiering`` takes both by keyword,
    so a positional call from code written for vLLM fails loudly rather than passing a context
    as ``success``.
    """
    raise InvalidArgumentError(
        f"{call}() takes {keywords} as keyword arguments only; got {len(misplaced)} more "
        f"positional argument(s): {misplaced!r:.80}"
    )


class OffloadingManager(ABC):
    """The scheduler-side manager of offloaded KV blocks; every engine adapter codes against it.

    Calls and blocking
        Every call returns without waiting for I/O, a lock held by another thread, or a GPU
        copy: none blocks. Work that needs I/O (a secondary tier's read or write) is started in
        the background and its result is applied later (see *Steps*). The blocking helpers some
        implementations add for lifecycle and tools (``wait_idle``) are outside the protocol.
        A manager is not thread-safe: call it from one thread (or one event loop) at a time.
    Answers that say "retry later"
        :meth:`lookup_result` answers ``HIT_PENDING`` or ``RETRY`` (:meth:`lookup` answers None);
        :meth:`lookup_prefix` and :meth:`lookup_request` answer None. Ask again at a later step.
    Block states and pins
        A key the manager holds is *being written* (from :meth:`prepare_store` until
        :meth:`complete_store`, or while the manager reads it back from a lower tier: a
        *promotion*) or *ready*. A ready key may be *pinned* by :meth:`prepare_load`; pins
        count, and each :meth:`complete_load` takes one away. A key being written or pinned is
        never evicted, and neither is any key of the :meth:`prepare_store` call that is
        evicting. The slot numbers a manager hands out stay the caller's to fill (store) or
        read (load) until the matching ``complete_*`` call.
    Which keys each call acts on
        :meth:`prepare_store` hands a slot to the calling request (``req_context``, see
        *Requests*) for each key it returns in ``keys_to_store``, and only then.
        :meth:`complete_store` acts only on those: the listed keys that a :meth:`prepare_store`
        of the *same request* handed out and no :meth:`complete_store` finished yet. Any other
        listed key (already ready, unknown, handed to another request, or being promoted) is
        left alone, so a request may list every key it offered, a subset or a superset. A
        failed store frees only its own slots, never one a promotion is filling. Two stores of
        one request in flight at once share its keys: complete each with no key the other is
        still copying. :meth:`prepare_load` pins exactly the listed keys;
        :meth:`complete_load` unpins exactly them.
    A HIT stays loadable
        A key a lookup answered ``HIT`` (True) can be pinned by :meth:`prepare_load` until a
        call that may evict: :meth:`prepare_store`, :meth:`complete_store`,
        :meth:`complete_load`, :meth:`lookup_prefix`, :meth:`lookup_request`, a lookup that
        answers ``RETRY`` or ``HIT_PENDING`` (it may start promotions, which make room),
        :meth:`take_events`, :meth:`on_schedule_end`, :meth:`reset_cache`. Lookups answered
        at once (``HIT``; ``MISS``, unless step driven), :meth:`touch` and
        :meth:`prepare_load` itself evict nothing and apply no background result, however
        background I/O was scheduled. (A step-driven lookup that finds a key only in a lower
        tier reserves its promotion's slot at once, evicting; a ``MISS`` there may have
        evicted for a write-back tier.)
    Ownership
        A manager owns its metadata; the caller owns the slots' bytes while a store or load it
        prepared is open. A secondary tier owns its own index and I/O; the primary tier's bytes
        are read or written by a tier only while the manager holds them for it.
    Requests
        ``req_context`` is opaque: any object the engine uses for a request. Where a manager
        keeps per-request state (promotion batches, the slots a store handed out), it keys it
        by ``req_context.req_id`` if the context has one, else by the context itself
        (:func:`request_key`); a context that gives no hashable key is rejected there
        (InvalidArgumentError, before anything is counted), and accepted where no state is
        kept. ``None`` is one anonymous request. The request hooks (:meth:`on_new_request`,
        :meth:`on_request_finished`) are optional for callers.
    Steps
        An engine that calls :meth:`on_schedule_end` at the end of each scheduler step gets
        deterministic answers if its manager is *step driven*: results of background I/O and
        promotion batches apply only at step boundaries, so the same sequence of calls gives
        the same answers on every run. A manager with no background I/O is trivially so.
    Events
        With events enabled, :meth:`take_events` returns what changed since the last call, in
        order: keys stored on (now loadable from) or removed from a medium (see
        :class:`OffloadingEvent`).
    Store admission
        ``store_threshold`` (>= 1): a key is stored only once it has been offered to
        :meth:`prepare_store` that many times (counted in a bounded table, oldest forgotten
        first). 1 stores every key at its first offer.
    Errors
        Every call checks its arguments before touching state. A key that is not ``bytes`` (or
        an unhashable one) raises :class:`~tiering.errors.InvalidKeyError`; any other bad
        argument, and a keyword-only argument passed by position (every ``req_context`` and
        ``success`` but a lookup's ``req_context``), raises
        :class:`~tiering.errors.InvalidArgumentError`; both name the argument. Breaking the
        block lifecycle (loading a key that is not ready, completing a load that was not
        prepared) raises :class:`~tiering.errors.ProtocolError`. A call that raises changes
        nothing. A manager that owns threads raises :class:`~tiering.errors.TieringError` for
        protocol calls after :meth:`shutdown`.
    """

    #: The primary tier's medium in events and load/store specs.
    medium: str = "CPU"
    #: Offers a key needs before it is stored (see *Store admission*); 1 = always.
    store_threshold: int = 1

    # -- lookups ----------------------------------------------------------------------------------

    @abstractmethod
    def lookup_result(self, key: OffloadKey, req_context: object = None) -> LookupResult:
        """The exact state of ``key`` (see :class:`LookupResult`).

        A key found only in a secondary tier starts (or queues) its promotion into the primary
        and answers ``RETRY``. Raises InvalidKeyError for a key that is not ``bytes``; a
        ``bytes`` key too short to be an offload key is never stored, so it is a ``MISS``.

        ``req_context`` may be given by position here (vLLM's order, and nothing else can be
        mistaken for it): a keyword-only argument with a default costs every call ~14 ns in
        CPython 3.11, a sixth of the CPU tier's whole lookup.
        """

    def lookup(self, key: OffloadKey, req_context: object = None) -> bool | None:
        """:meth:`lookup_result` as a bool: True for ``HIT``, False for ``MISS``, None for
        ``HIT_PENDING`` or ``RETRY`` (ask again later). Same effects and errors."""
        return AS_BOOL[self.lookup_result(key, req_context=req_context)]

    @abstractmethod
    def lookup_prefix(
        self, keys: Iterable[OffloadKey], *misplaced: object, req_context: object = None
    ) -> int | None:
        """The number of leading ``keys`` ready in the primary, or None if the prefix goes on in
        a block being written or promoted (promotions it needs are started). InvalidKeyError for
        bad keys, before anything is counted or started."""

    def lookup_request(
        self,
        spec: KVCacheSpec,
        keys_per_group: Sequence[Sequence[OffloadKey]],
        num_prompt_tokens: int,
        *misplaced: object,
        req_context: object = None,
        engine_recomputes_last_token: bool = False,
    ) -> int | None:
        """Hybrid lookup across KV-cache groups (:func:`tiering.core.lookup.find_hybrid_hit`): the
        number of prompt tokens loadable from the primary, or None while blocks the hit needs
        are written or promoted. With ``engine_recomputes_last_token`` a full-attention-only hit
        may cover the whole prompt (vLLM's rule); by default the last token is left to compute.

        Raises InvalidArgumentError for a bad ``spec``, ``num_prompt_tokens`` or flag,
        InvalidKeyError for bad keys, ConfigurationError if ``keys_per_group`` does not match
        the spec's groups; nothing is looked up then.
        """
        if misplaced:
            reject_positional("lookup_request", misplaced, "req_context")
        check_hybrid_args(spec, keys_per_group, num_prompt_tokens, engine_recomputes_last_token)
        for group_keys in keys_per_group:
            check_keys(group_keys)
        from_result = _KEY_STATES

        def state_of(key: bytes) -> KeyState:
            return from_result[self.lookup_result(OffloadKey(key), req_context=req_context)]

        hit = find_hybrid_hit(
            spec,
            keys_per_group,
            state_of,
            num_prompt_tokens,
            engine_recomputes_last_token=engine_recomputes_last_token,
        )
        return hit.answer

    # -- loads ------------------------------------------------------------------------------------

    @abstractmethod
    def prepare_load(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> LoadStoreSpec:
        """Pin ready ``keys`` until :meth:`complete_load`; ``block_ids[i]`` is ``keys[i]``'s
        slot. Raises ProtocolError, changing nothing, if a key is absent or not ready."""

    @abstractmethod
    def complete_load(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> None:
        """Take away one pin per listed key. Raises ProtocolError, changing nothing, if a key
        was not prepared as many times as it is listed."""

    @abstractmethod
    def touch(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> None:
        """Mark keys as most recently used in every tier; the first key ends most recent.
        Absent keys are ignored."""

    def note_request(
        self,
        keys: Collection[OffloadKey],
        *misplaced: object,
        req_context: object = None,
        ended: bool = False,
        continues: bool | None = None,
    ) -> None:
        """A request's keys, in prefix order, once, before its touches and stores (or, with
        ``ended``, once it has ended, for a caller that knows a request whole only then): for
        a primary policy that learns from requests (:meth:`EvictionPolicy.note_request`,
        :meth:`EvictionPolicy.note_finished_request`). Optional: a manager that is never told
        works as before. ``continues`` is the caller's hint, if it has one: ``True`` if it
        expects a later request to continue this one (an open chat session), ``False`` if it
        expects none to (a one-off call); anything else raises InvalidArgumentError, changing
        nothing. A hint only ranks blocks (``chain`` uses it). The default checks the hint
        and does nothing."""
        if continues is not None and type(continues) is not bool:
            raise InvalidArgumentError(
                f"continues must be True, False or None (not known), got {continues!r:.80}"
            )

    # -- stores -----------------------------------------------------------------------------------

    @abstractmethod
    def prepare_store(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> PrepareStoreOutput | None:
        """Reserve primary slots for the absent, admitted ``keys``, evicting as needed.

        Returns the keys to write (absent ones admitted by ``store_threshold``, in order, once
        each), their slots and the evicted keys; or None, with nothing changed but the offer
        counts, if not enough blocks can be evicted now (retry at a later step). Every key of
        the call is protected from eviction, including those already stored. The slots are the
        calling request's: only its :meth:`complete_store` finishes them (see *Which keys each
        call acts on*). InvalidArgumentError for a ``req_context`` that gives no hashable key.

        One exception: behind a write-back tier, evicting blocks the tier has not written yet
        starts their write-back, and the call answers None until their slots are free; those
        blocks are gone from the primary already (removed events say so).
        """

    @abstractmethod
    def complete_store(
        self,
        keys: Collection[OffloadKey],
        *misplaced: object,
        success: bool = True,
        req_context: object = None,
    ) -> None:
        """Finish a store: of the listed keys, those a :meth:`prepare_store` of this request
        (``req_context``) handed out and not completed yet become ready (``success``), or are
        dropped and their slots freed (not ``success``). Every other key (unknown, ready,
        another request's, being promoted) is left alone. Raises InvalidArgumentError if
        ``success`` is not a bool, or for a ``req_context`` that gives no hashable key
        (:func:`request_key`)."""

    # -- events, requests, steps, lifecycle --------------------------------------------------------

    @abstractmethod
    def take_events(self) -> list[OffloadingEvent]:
        """The events since the last call, in order (empty unless events are enabled)."""

    def on_new_request(self, req_context: object) -> None:
        """A request was first seen by the scheduler (optional for callers)."""
        request_key(req_context)

    def on_request_finished(self, req_context: object) -> None:
        """A request finished: no further prepare_* calls come for it, though completions of
        transfers it started may (optional for callers)."""
        request_key(req_context)

    def on_schedule_end(self) -> None:
        """The end of a scheduler step: the last call of the step. A step-driven manager applies
        the results of finished background I/O and submits the step's promotion batches here."""
        return

    def has_pending_work(self) -> bool:
        """Whether background work is queued, in flight, or finished but not yet applied (an
        engine keeps stepping while this is True)."""
        return False

    def get_stats(self) -> ManagerStats:
        """Counters per tier *since the previous call* (deltas, not totals), keyed by tier:
        ``"CPU"`` for the primary, then each secondary tier's name."""
        return {}

    def config_info(self) -> list[ConfigInfo]:
        """Static facts, one mapping per tier, primary first (for an info metric)."""
        return [{"tier": self.medium, "medium": self.medium}]

    @abstractmethod
    def reset_cache(self) -> None:
        """Drop every block of every tier, pinned and in flight included, and the policies'
        history; background I/O is drained first, so no late write lands in a reused slot."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release every resource (threads, open tiers, views of the primary tier's memory);
        idempotent."""
