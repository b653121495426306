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
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Hashable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from types import MappingProxyType
from typing import cast

import numpy as np

from tiering.core.keys import OffloadKey, check_key, check_keys
from tiering.errors import ConfigurationError, ProtocolError
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

__all__ = ["CPUOffloadingManager", "EvictionHook"]

#: Called with the ``(key, slot)`` pairs a store evicted and the request context of the call that
#: evicted them; returns the slots that stay allocated until :meth:`release_slots`.
EvictionHook = Callable[[list[tuple[OffloadKey, int]], object], set[int]]

#: The owner of no store (a key no ``prepare_store`` handed out, or one a promotion fills).
_NOBODY: object = object()


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class CPUOffloadingManager(OffloadingManager):
    """Scheduler-side manager of the CPU primary tier.

    ``policy`` is a registered policy name (``"lru"``, ``"arc"``) or an :class:`EvictionPolicy`
    instance with ``capacity == num_blocks``. With ``enable_events`` the manager records stored
    and removed keys for :meth:`take_events`. ``store_threshold`` is the number of offers to
    :meth:`prepare_store` a key needs before it is stored (vLLM's option of that name; 1 = every
    offer), counted for at most ``store_threshold_max_keys`` keys, the least recently offered
    forgotten first.

    Slots are handed out fresh in increasing order first, then reused, most recently freed first
    (recently freed slots are the likeliest to be warm in the CPU caches and TLB).

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
        if isinstance(policy, EvictionPolicy):
            if policy.capacity != num_blocks:
                raise ConfigurationError(
                    f"policy capacity {policy.capacity} differs from num_blocks {num_blocks}"
                )
            self._policy = policy
        else:
            self._policy = make_policy(policy, num_blocks)
        self.num_blocks = num_blocks
        self.enable_events = enable_events
        self._slots: dict[OffloadKey, int] = {}  # every held key
        self._slots_view = MappingProxyType(self._slots)
        self._not_ready: set[OffloadKey] = set()  # being written (by a store or a promotion)
        # Keys prepare_store handed out and no complete_store finished yet, by the request key
        # (request_key) of the call that got them; the other keys not ready are promotions'.
        self._store_owner: dict[OffloadKey, Hashable] = {}
        self._pins: dict[OffloadKey, int] = {}  # ready keys pinned by loads (count > 0)
        self._next_fresh_slot = 0
        self._freed_slots: list[int] = []  # a stack: most recently freed on top
        self._events: list[OffloadingEvent] = []
        self._closed = False
        self._eviction_hook: EvictionHook | None = None
        # Offers per key, least recently offered first; None when every offer is admitted.
        self._offers: OrderedDict[OffloadKey, int] | None = (
            OrderedDict() if store_threshold > 1 else None
        )
        self._offers_max_keys = store_threshold_max_keys
        # Cumulative counters; get_stats() reports their growth since its previous call.
        self._stored_blocks = 0
        self._failed_blocks = 0
        self._evicted_blocks = 0
        self._loaded_blocks = 0
        self._skipped_blocks = 0
        self._stats_seen: dict[str, int] = {}

    # -- introspection ------------------------------------------------------------------------

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self._next_fresh_slot + len(self._freed_slots)

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
        self._pin(key_list, checked=True)
        self._loaded_blocks += len(key_list)
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
        pins = self._pins
        get = pins.get
        unpinned: list[OffloadKey] = []
        # One pass, undone if a key turns out short of pins (a key listed more often than it
        # was loaded): checking first cost two more passes over the keys on every call.
        for done, key in enumerate(key_list):
            left = get(key, 0) - 1
            if left > 0:
                pins[key] = left
            elif not left:
                del pins[key]
                unpinned.append(key)
            else:
                for undone in key_list[:done]:
                    pins[undone] = get(undone, 0) + 1
                self._check_unpins(key_list)  # raises, naming the first key short of pins
        if unpinned:
            self._policy.set_evictable_many(unpinned, True)

    def _check_unpins(self, key_list: list[OffloadKey]) -> None:
        """Raise ProtocolError for the first key listed more often than it is pinned."""
        wanted: dict[OffloadKey, int] = {}
        for key in key_list:
            wanted[key] = wanted.get(key, 0) + 1
        for key, times in wanted.items():
            pinned = self._pins.get(key, 0)
            if pinned < times:
                raise ProtocolError(
                    f"complete_load for key {key.hex()} x{times} but only {pinned} load(s) of it "
                    "were prepared"
                )

    def _pin(self, key_list: list[OffloadKey], *, checked: bool) -> None:
        """Count a load's pin of each key; the policy pins those no load held. ``checked``:
        the caller found every key ready (held and, with no pin, evictable), so the policy
        need not look them up (:meth:`EvictionPolicy.pin_evictable`: one dict probe a key
        less, ~430 ns a key at 1e6 blocks)."""
        pins = self._pins
        get = pins.get
        first: list[OffloadKey] = []  # the keys no load pinned yet, once each
        for key in key_list:
            count = get(key, 0)
            if not count:
                first.append(key)
            pins[key] = count + 1
        if first:
            try:
                if checked:
                    self._policy.pin_evictable(first)
                else:
                    self._policy.set_evictable_many(first, False)
            except BaseException:
                for key in key_list:  # counted above: take the counts back
                    left = pins[key] - 1
                    if left:
                        pins[key] = left
                    else:
                        del pins[key]
                raise

    def touch(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> None:
        """Mark keys as most recently used; the first key ends most recent. Absent keys are
        ignored."""
        if misplaced:
            reject_positional("touch", misplaced, "req_context")
        self._policy.touch(check_keys(keys))

    def touch_checked(self, key_list: list[OffloadKey]) -> None:
        """:meth:`touch` of keys :func:`~tiering.core.keys.check_keys` already checked."""
        self._policy.touch(key_list)

    def refresh(
        self, keys: Collection[OffloadKey], *misplaced: object, req_context: object = None
    ) -> None:
        """Make keys recent without counting a use (:meth:`EvictionPolicy.refresh`: keys the
        request stored, not reused); the first key ends most recent. Absent keys are ignored."""
        if misplaced:
            reject_positional("refresh", misplaced, "req_context")
        self._policy.refresh(check_keys(keys))

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
        if self._offers is not None:
            to_store = self._admitted(key_list, to_store)
        out = self._reserve(key_list, to_store, req_context)
        if out is not None and out.keys_to_store:
            self._store_owner.update(dict.fromkeys(out.keys_to_store, owner))
        return out

    def _admitted(self, key_list: list[OffloadKey], to_store: list[OffloadKey]) -> list[OffloadKey]:
        """Count one offer per key of the call; keep the keys offered often enough."""
        offers = self._offers
        assert offers is not None
        # vLLM's order: the keys already counted are bumped first (most recently offered, and
        # never forgotten for this offer's new keys), then the new keys are appended, each
        # forgetting the least recently offered key not bumped; with none left, it is not
        # counted.
        offered = list(dict.fromkeys(key_list))
        bumped = 0
        move_to_end = offers.move_to_end
        for key in offered:
            count = offers.get(key)
            if count is not None:
                move_to_end(key)
                offers[key] = count + 1
                bumped += 1
        forgettable = len(offers) - bumped
        max_keys = self._offers_max_keys
        for key in offered:
            if key in offers:
                continue
            if len(offers) >= max_keys:
                if not forgettable:
                    continue
                offers.popitem(last=False)
                forgettable -= 1
            offers[key] = 1
        threshold = self.store_threshold
        admitted = [k for k in to_store if offers.get(k, 0) >= threshold]
        self._skipped_blocks += len(to_store) - len(admitted)
        return admitted

    def _reserve(
        self, key_list: list[OffloadKey], to_store: list[OffloadKey], req_context: object
    ) -> PrepareStoreOutput | None:
        if not to_store:
            return PrepareStoreOutput([], LoadStoreSpec(self.medium, np.empty(0, np.int64)), [])
        self._policy.note_misses(to_store)
        needed = len(to_store)
        if needed > self.num_blocks:
            return None
        slots_of = self._slots
        freed_slots = self._freed_slots
        fresh_left = self.num_blocks - self._next_fresh_slot
        evicted: list[OffloadKey] = []
        shortfall = needed - fresh_left - len(freed_slots)
        if shortfall > 0:
            victims = self._policy.evict(shortfall, protected=set(key_list))
            if victims is None:
                return None
            evicted = cast("list[OffloadKey]", victims)
            hook = self._eviction_hook
            if hook is None:
                freed_slots += map(slots_of.pop, evicted)  # in victim order, one C loop
            else:
                freed = [(key, slots_of.pop(key)) for key in evicted]
                retained = hook(freed, req_context)
                freed_slots += [slot for _, slot in freed if slot not in retained]
            self._evicted_blocks += len(evicted)
            if self.enable_events:
                self._events.append(OffloadingEvent(tuple(evicted), self.medium, True))
            if fresh_left + len(freed_slots) < needed:
                # Write-back: some victims keep their slots until a lower tier has them.
                return None
        # Fresh slots in increasing order first, then the most recently freed.
        if fresh_left:
            fresh = min(needed, fresh_left)
            start = self._next_fresh_slot
            slots = list(range(start, start + fresh))
            self._next_fresh_slot = start + fresh
            reused = needed - fresh
            if reused:
                slots += freed_slots[: -reused - 1 : -1]
                del freed_slots[-reused:]
        else:
            slots = freed_slots[: -needed - 1 : -1]
            del freed_slots[-needed:]
        slots_of.update(zip(to_store, slots, strict=True))
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
        owner = request_key(req_context)
        owners = self._store_owner
        get = owners.get
        done = [key for key in key_list if get(key, _NOBODY) == owner]
        if not done:
            return done
        for key in done:
            owners.pop(key, None)  # (a key listed twice is there once)
        return self._finish_writes(done, success)

    def complete_promotion(self, key_list: list[OffloadKey], success: bool) -> list[OffloadKey]:
        """Finish reads from a lower tier into slots :meth:`reserve_for_promotion` reserved: the
        listed keys still promoted become ready, or are dropped and their slots freed. Keys a
        store is writing, and every other key, are left alone. Returns the keys finished."""
        not_ready, owners = self._not_ready, self._store_owner
        done = [key for key in key_list if key in not_ready and key not in owners]
        return self._finish_writes(done, success) if done else done

    def _finish_writes(self, done: list[OffloadKey], success: bool) -> list[OffloadKey]:
        """Make ``done`` (keys being written, each owned by this call) ready, or drop them."""
        not_ready = self._not_ready
        before = len(not_ready)
        not_ready.difference_update(done)
        if before - len(not_ready) != len(done):  # a key listed twice counts once
            done = list(dict.fromkeys(done))
        policy = self._policy
        if success:
            policy.set_evictable_many(done, True)
            self._stored_blocks += len(done)
            if self.enable_events:
                self._events.append(OffloadingEvent(tuple(done), self.medium, False))
        else:
            slots_of = self._slots
            for key in done:
                policy.remove(key)
            self._freed_slots += map(slots_of.pop, done)
            self._failed_blocks += len(done)
        return done

    # -- hooks for a tiering manager -----------------------------------------------------------

    def set_eviction_hook(self, hook: EvictionHook | None) -> None:
        """Call ``hook(victims, req_context)`` with ``(key, slot)`` pairs on eviction; the slots
        it returns stay allocated until :meth:`release_slots` (a write-back tier is still copying
        them). With a hook, a ``prepare_store`` that evicted but got no free slots returns
        None."""
        self._eviction_hook = hook

    def release_slots(self, slots: Iterable[int]) -> None:
        """Free slots that an eviction hook or :meth:`drop_retaining_slots` retained."""
        self._freed_slots += slots

    def drop_retaining_slots(self, keys: Iterable[OffloadKey]) -> list[int]:
        """Drop keys not ready yet (a promotion given up on: its read is past its deadline)
        as a failed store would, but keep their slots allocated, since the read may still
        write into them; returns those slots, for :meth:`release_slots` once the read is over.
        Keys unknown or ready are left alone."""
        not_ready, slots_of, policy = self._not_ready, self._slots, self._policy
        dropped = [k for k in dict.fromkeys(keys) if k in not_ready]
        not_ready.difference_update(dropped)
        for key in dropped:
            policy.remove(key)
        self._failed_blocks += len(dropped)
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
        self._pin(keys, checked=False)  # the caller's word only: the policy checks

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
        return {
            "stored_blocks": self._stored_blocks,
            "failed_stores": self._failed_blocks,
            "evicted_blocks": self._evicted_blocks,
            "loaded_blocks": self._loaded_blocks,
            "stores_skipped": self._skipped_blocks,
        }

    def get_stats(self) -> ManagerStats:
        """``{"CPU": counters}``, each the growth since the previous call: ``stored_blocks``,
        ``failed_stores`` (blocks whose store failed), ``evicted_blocks``, ``loaded_blocks``
        (pinned by prepare_load) and ``stores_skipped`` (offers below ``store_threshold``)."""
        now = self.counters()
        seen, self._stats_seen = self._stats_seen, now
        return {self.medium: {name: value - seen.get(name, 0) for name, value in now.items()}}

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
        self._slots.clear()
        self._not_ready.clear()
        self._store_owner.clear()
        self._pins.clear()
        self._policy.clear()
        self._next_fresh_slot = 0
        self._freed_slots.clear()

    def shutdown(self) -> None:
        """Release everything. The manager holds no resources but memory; idempotent."""
        if not self._closed:
            self._closed = True
            self._slots.clear()
            self._not_ready.clear()
            self._store_owner.clear()
            self._pins.clear()
            self._policy.clear()
