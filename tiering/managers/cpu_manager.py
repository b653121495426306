"""The CPU primary tier's manager: metadata for the scheduler, in vLLM's protocol.

It runs in an engine's scheduler process and holds metadata only: which key is in which slot of
the CPU pool, which blocks are being written or read, and the eviction order. The bytes live in a
:class:`tiering.managers.pool.CPUBlockPool` that workers copy into and out of. No call blocks or
does I/O.

It implements :class:`tiering.managers.protocol.OffloadingManager`, whose docstring is the contract.

Block states: a block is *not ready* while it is written, then *ready*, and a ready block may be
*pinned* by loads. Only ready, unpinned blocks may be evicted. A block is written either by a
store (``prepare_store`` handed its slot to one request, whose ``complete_store`` alone finishes
it) or by a tiering manager's promotion (``reserve_for_promotion``, finished by
``complete_promotion`` alone): a store never completes or frees a slot a read is filling. The
state is kept in flat maps (key -> slot, key -> pin count, the set of keys not ready, key -> the
request a store handed it to) rather than one object per block:
a lookup is then a single probe of a dict plus one of a small set. Argument checks sit where they
cost nothing when the types are right (a failed dict probe, one C pass over a batch).

Its collaborators, each a module: the pool's slots and the room a store makes by evicting
(:mod:`~tiering.managers.cpu_slots`), the keys being written and who finishes them
(:mod:`~tiering.managers.cpu_writes`), the loads' pin counts (:mod:`~tiering.managers.cpu_pins`),
``store_threshold``'s offer counts (:mod:`~tiering.managers.cpu_admission`) and the counters
(:mod:`~tiering.managers.cpu_counters`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from types import MappingProxyType

import numpy as np

from tiering.core.keys import OffloadKey, check_key, check_keys
from tiering.errors import ConfigurationError, ProtocolError
from tiering.managers.cpu_admission import StoreAdmission
from tiering.managers.cpu_counters import CPUCounters
from tiering.managers.cpu_pins import LoadPins
from tiering.managers.cpu_slots import EvictionHook, SlotAllocator
from tiering.managers.cpu_writes import PendingWrites
from tiering.managers.protocol import (
    HIT,
    HIT_PENDING,
    MISS,
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
from tiering.policies import EvictionPolicy, make_policy
from tiering.policies.base import tell_request

__all__ = ["CPUOffloadingManager", "EvictionHook"]


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _policy_for(policy: str | EvictionPolicy, num_blocks: int) -> EvictionPolicy:
    """The policy named ``policy`` over ``num_blocks``, or the instance given (of that
    capacity)."""
    if not isinstance(policy, EvictionPolicy):
        return make_policy(policy, num_blocks)
    if policy.capacity != num_blocks:
        raise ConfigurationError(
            f"policy capacity {policy.capacity} differs from num_blocks {num_blocks}"
        )
    return policy


class CPUOffloadingManager(OffloadingManager):
    """Scheduler-side manager of the CPU primary tier.

    ``policy`` is a registered policy name (``"lru"``, ``"arc"``) or an :class:`EvictionPolicy`
    instance with ``capacity == num_blocks``. With ``enable_events`` the manager records stored
    and removed keys for :meth:`take_events`. ``store_threshold`` is the number of offers to
    :meth:`prepare_store` a key needs before it is stored (vLLM's option of that name; 1 = every
    offer), counted for at most ``store_threshold_max_keys`` keys, the least recently offered
    forgotten first.

    Slots are handed out fresh in increasing order first, then reused, most recently freed first
    (:class:`~tiering.managers.cpu_slots.SlotAllocator`).

    It does no I/O, so it is step-driven by nature: :meth:`on_schedule_end` has nothing to do.
    """

    def __init__(
        self,
        num_blocks: int,
        policy: str | EvictionPolicy = "lru",
        enable_events: bool = False,
        *,
        store_threshold: int = 1,
        store_threshold_max_keys: int = 65536,
    ) -> None:
        _check_count("num_blocks", num_blocks, 0)
        self.store_threshold = _check_count("store_threshold", store_threshold, 1)
        _check_count("store_threshold_max_keys", store_threshold_max_keys, 1)
        self._policy = _policy_for(policy, num_blocks)
        self.num_blocks = num_blocks
        self.enable_events = enable_events
        self._slots: dict[OffloadKey, int] = {}  # every held key
        self._slots_view = MappingProxyType(self._slots)
        self._writes = PendingWrites()
        self._not_ready = self._writes.not_ready  # being written (read by every lookup)
        self._load_pins = LoadPins(self._policy)
        self._slot_alloc = SlotAllocator(num_blocks, self._slots, self._policy)
        self._events: list[OffloadingEvent] = []
        self._closed = False
        self._admission = (  # None when every offer is admitted
            StoreAdmission(store_threshold, store_threshold_max_keys)
            if store_threshold > 1
            else None
        )
        self._counts = CPUCounters(self._policy)  # get_stats() reports their growth

    # -- introspection ------------------------------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def num_free_blocks(self) -> int:
        return self._slot_alloc.num_free

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def slot_of(self, key: OffloadKey) -> int | None:
        return self._slots.get(key)

    @property
    def slots(self) -> Mapping[OffloadKey, int]:
        """Every held key's slot (a read-only live view)."""
        return self._slots_view

    def lookup_state(self) -> tuple[Mapping[OffloadKey, int], AbstractSet[OffloadKey]]:
        """What :meth:`lookup_result` reads, live, read-only for the caller: key -> slot of every
        held key, and the keys being written. A key in the first and not the second is a HIT.
        For a tiering manager, whose lookup tests them inline (the engine's hottest call)."""
        return self._slots, self._not_ready

    # -- lookups ------------------------------------------------------------------------------

    def lookup_result(self, key: OffloadKey, req_context: object = None) -> LookupResult:
        """HIT if stored and ready, HIT_PENDING while being written, MISS if absent."""
        try:
            if key in self._slots:
                return HIT_PENDING if key in self._not_ready else HIT
        except TypeError:  # unhashable: not a key
            check_key(key)
            raise
        if type(key) is not bytes:
            check_key(key)
        return MISS

    def lookup(self, key: OffloadKey, req_context: object = None) -> bool | None:
        """True if stored and ready, False if absent, None while being written (retry later)."""
        # lookup_result() as a bool, written out: this is the engine's hottest call.
        try:
            if key in self._slots:
                return None if key in self._not_ready else True
        except TypeError:
            check_key(key)
            raise
        if type(key) is not bytes:
            check_key(key)
        return False

    def lookup_prefix(
        self, keys: Iterable[OffloadKey], *misplaced: object, req_context: object = None
    ) -> int | None:
        """The number of leading keys stored and ready; None if the first non-hit is in flight."""
        if misplaced:
            reject_positional("lookup_prefix", misplaced, "req_context")
        count = 0
        slots, not_ready = self._slots, self._not_ready
        for key in check_keys(keys):
            if key not in slots:
                return count
            if key in not_ready:
                return None
            count += 1
        return count

    # -- loads --------------------------------------------------------------------------------

    def prepare_load(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> LoadStoreSpec:
        """Pin ready ``keys`` until :meth:`complete_load`; ``block_ids[i]`` is ``keys[i]``'s slot.

        Raises ProtocolError, changing nothing, if a key is absent or not ready.
        """
        if misplaced:
            reject_positional("prepare_load", misplaced, "req_context")
        return self.prepare_load_checked(check_keys(keys))

    def prepare_load_checked(self, key_list: list[OffloadKey]) -> LoadStoreSpec:
        """:meth:`prepare_load` of keys :func:`~tiering.core.keys.check_keys` already checked (a
        tiering manager's call: one check per call)."""
        slots = self._slots
        not_ready = self._not_ready
        try:
            block_ids = [slots[key] for key in key_list]
        except KeyError:
            block_ids = []
        if len(block_ids) != len(key_list) or (not_ready and not not_ready.isdisjoint(key_list)):
            for key in key_list:  # the first key that cannot load, named in order
                if key not in slots:
                    raise ProtocolError(f"cannot load key {key.hex()}: it is not stored")
                if key in not_ready:
                    raise ProtocolError(f"cannot load key {key.hex()}: it is still being written")
        self._load_pins.pin(key_list, checked=True)
        self._counts.loaded_blocks += len(key_list)
        return LoadStoreSpec(self.medium, np.array(block_ids, dtype=np.int64))

    def complete_load(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> None:
        """Unpin keys pinned by :meth:`prepare_load`. Raises ProtocolError, changing nothing, if a
        key was not prepared (as many times as it is listed)."""
        if misplaced:
            reject_positional("complete_load", misplaced, "req_context")
        self.complete_load_checked(check_keys(keys))

    def complete_load_checked(self, key_list: list[OffloadKey]) -> None:
        """:meth:`complete_load` of keys :func:`~tiering.core.keys.check_keys` already checked."""
        self._load_pins.unpin(key_list)

    def touch(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> None:
        """A use of each key, the first ending most recent; absent keys are ignored."""
        if misplaced:
            reject_positional("touch", misplaced, "req_context")
        self._policy.touch(check_keys(keys))

    def touch_checked(self, key_list: list[OffloadKey]) -> None:
        """:meth:`touch` of keys :func:`~tiering.core.keys.check_keys` already checked."""
        self._policy.touch(key_list)

    def refresh(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> None:
        """Recency without a use (:meth:`EvictionPolicy.refresh`), the first key most recent."""
        if misplaced:
            reject_positional("refresh", misplaced, "req_context")
        self._policy.refresh(check_keys(keys))

    def note_request(
        self,
        keys: Collection[OffloadKey],
        *misplaced: object,
        req_context: object = None,
        ended: bool = False,
        continues: bool | None = None,
    ) -> None:
        if misplaced:
            reject_positional("note_request", misplaced, "req_context")
        tell_request(self._policy, check_keys(keys), ended=ended, continues=continues)
        self._counts.note_hint(continues)  # told: a bad hint raised, counting nothing

    # -- stores -------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> PrepareStoreOutput | None:
        """Reserve slots for the absent ``keys`` that ``store_threshold`` admits, evicting as
        needed.

        Returns the keys to write (absent, admitted ones, in order, once each), their slots and
        the evicted keys; or None, with nothing changed but the offer counts, if not enough
        blocks can be evicted. Every key of the request is protected from eviction, including
        those already stored.
        """
        if misplaced:
            reject_positional("prepare_store", misplaced, "req_context")
        return self.prepare_store_checked(check_keys(keys), req_context)

    def prepare_store_checked(
        self, key_list: list[OffloadKey], req_context: object = None
    ) -> PrepareStoreOutput | None:
        """:meth:`prepare_store` of keys :func:`~tiering.core.keys.check_keys` already checked."""
        owner = request_key(req_context)  # before anything is counted
        slots_of = self._slots
        to_store = [k for k in dict.fromkeys(key_list) if k not in slots_of]
        if self._admission is not None:
            admitted = self._admission.admitted(key_list, to_store)
            self._counts.stores_skipped += len(to_store) - len(admitted)
            to_store = admitted
        out = self._reserve(key_list, to_store, req_context)
        if out is not None and out.keys_to_store:
            self._writes.hand_to(out.keys_to_store, owner)
        return out

    def _reserve(
        self, key_list: list[OffloadKey], to_store: list[OffloadKey], req_context: object
    ) -> PrepareStoreOutput | None:
        if not to_store:
            return PrepareStoreOutput([], LoadStoreSpec(self.medium, np.empty(0, np.int64)), [])
        self._policy.note_misses(to_store)
        if len(to_store) > self.num_blocks:
            return None
        slots, evicted = self._slot_alloc.allocate(len(to_store), key_list, req_context)
        if evicted:
            self._counts.evicted_blocks += len(evicted)
            if self.enable_events:
                self._events.append(OffloadingEvent(tuple(evicted), self.medium, True))
        if slots is None:
            return None
        self._slots.update(zip(to_store, slots, strict=True))
        self._not_ready.update(to_store)
        self._policy.insert_new(to_store, False)  # absent (not in _slots), once each
        return PrepareStoreOutput(
            to_store, LoadStoreSpec(self.medium, np.array(slots, dtype=np.int64)), evicted
        )

    def complete_store(
        self,
        keys: Collection[OffloadKey],
        *misplaced: object,
        success: bool = True,
        req_context: object = None,
    ) -> None:
        """Finish a store: of the listed keys, those ``prepare_store`` handed to this request
        (``req_context``) and not completed yet become ready (``success``), or are dropped and
        their slots freed. Every other key (unknown, ready, another request's, or being
        promoted) is left alone."""
        if misplaced:
            reject_positional("complete_store", misplaced, "success and req_context")
        if success is not True and success is not False:
            check_success(success)
        self.complete_store_checked(check_keys(keys), success, req_context)

    def complete_store_checked(
        self, key_list: list[OffloadKey], success: bool, req_context: object = None
    ) -> list[OffloadKey]:
        """:meth:`complete_store` of keys :func:`~tiering.core.keys.check_keys` already checked;
        returns the keys it finished, in order, once each."""
        done = self._writes.claim_stores(key_list, request_key(req_context))
        return self._finish_writes(done, success) if done else done

    def complete_promotion(self, key_list: list[OffloadKey], success: bool) -> list[OffloadKey]:
        """Finish reads from a lower tier into slots :meth:`reserve_for_promotion` reserved: the
        listed keys still promoted become ready, or are dropped and their slots freed. Keys a
        store is writing, and every other key, are left alone. Returns the keys finished."""
        done = self._writes.claim_promotions(key_list)
        return self._finish_writes(done, success) if done else done

    def _finish_writes(self, done: list[OffloadKey], success: bool) -> list[OffloadKey]:
        """Make ``done`` (keys written, each claimed by this call once) ready, or drop them."""
        policy = self._policy
        if success:
            policy.set_evictable_many(done, True)
            self._counts.stored_blocks += len(done)
            if self.enable_events:
                self._events.append(OffloadingEvent(tuple(done), self.medium, False))
        else:
            slots_of = self._slots
            for key in done:
                policy.remove(key)
            self._slot_alloc.free(map(slots_of.pop, done))
            self._counts.failed_stores += len(done)
        return done

    # -- hooks for a tiering manager -----------------------------------------------------------

    def set_eviction_hook(self, hook: EvictionHook | None) -> None:
        """Call ``hook(victims, req_context)`` with ``(key, slot)`` pairs on eviction; the slots
        it returns stay allocated until :meth:`release_slots` (a write-back tier is still copying
        them). With a hook, a ``prepare_store`` that evicted but got no free slots returns
        None."""
        self._slot_alloc.hook = hook

    def release_slots(self, slots: Iterable[int]) -> None:
        """Free slots that an eviction hook or :meth:`drop_retaining_slots` retained."""
        self._slot_alloc.free(slots)

    def drop_retaining_slots(self, keys: Iterable[OffloadKey]) -> list[int]:
        """Drop keys not ready yet (a promotion given up on: its read is past its deadline)
        as a failed store would, but keep their slots allocated, since the read may still
        write into them; returns those slots, for :meth:`release_slots` once the read is over.
        Keys unknown or ready are left alone."""
        slots_of, policy = self._slots, self._policy
        dropped = self._writes.drop(keys)
        for key in dropped:
            policy.remove(key)
        self._counts.failed_stores += len(dropped)
        return [slots_of.pop(k) for k in dropped]

    def reserve_for_promotion(
        self,
        keys: list[OffloadKey],
        req_context: object = None,
        *,
        protected: Collection[bytes] = (),
    ) -> PrepareStoreOutput | None:
        """:meth:`prepare_store` for blocks read back from a lower tier: no admission count
        (a promotion is not an offer) and no argument checks (the keys are the tier's own).
        ``protected`` keys are not evicted to make room (nor are ``keys``). The keys it hands
        out are finished by :meth:`complete_promotion` only, never by a store's
        :meth:`complete_store`."""
        slots_of = self._slots
        to_store = [k for k in dict.fromkeys(keys) if k not in slots_of]
        if protected:
            return self._reserve([*keys, *map(OffloadKey, protected)], to_store, req_context)
        return self._reserve(keys, to_store, req_context)

    def pin(self, keys: list[OffloadKey]) -> None:
        """Pin ready keys that a lower tier is copying from (:meth:`prepare_load` without the
        checks and the load count); :meth:`complete_load` unpins them."""
        self._load_pins.pin(keys, checked=False)  # the caller's word only: the policy checks

    # -- events, stats and lifecycle ----------------------------------------------------------

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if self.enable_events and keys:
            self._events.append(OffloadingEvent(tuple(keys), self.medium, removed))

    def take_events(self) -> list[OffloadingEvent]:
        """The stored and removed events since the last call, in order."""
        events, self._events = self._events, []
        return events

    def counters(self) -> dict[str, int]:
        """Cumulative counters (:meth:`get_stats` reports their growth)."""
        return self._counts.as_dict()

    def get_stats(self) -> ManagerStats:
        """``{"CPU": counters}``, each the growth since the previous call of one of
        :meth:`counters` (:class:`~tiering.managers.cpu_counters.CPUCounters` names them)."""
        return {self.medium: self._counts.growth()}

    def config_info(self) -> list[ConfigInfo]:
        return [
            {
                "tier": self.medium,
                "medium": self.medium,
                "num_blocks": self.num_blocks,
                "policy": getattr(self._policy, "name", type(self._policy).__name__),
                "store_threshold": self.store_threshold,
            }
        ]

    def reset_cache(self) -> None:
        """Drop every block, pinned or in flight included, and all policy history. Offer counts
        (``store_threshold``) survive: they measure how often a prefix comes back, which a
        reset (a weight update) does not change."""
        self._emit(list(self._slots), removed=True)
        self._drop_all()
        self._slot_alloc.clear()

    def shutdown(self) -> None:
        """Release everything. The manager holds no resources but memory; idempotent."""
        if not self._closed:
            self._closed = True
            self._drop_all()

    def _drop_all(self) -> None:
        """Forget every block, its pins and its write, and the policy's history."""
        self._slots.clear()
        self._writes.clear()
        self._load_pins.clear()
        self._policy.clear()
