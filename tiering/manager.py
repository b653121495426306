"""The CPU primary tier's manager: metadata for the scheduler, in vLLM's protocol.

It runs in an engine's scheduler process and holds metadata only: which key is in which slot of
the CPU pool, which blocks are being written or read, and the eviction order. The bytes live in a
:class:`tiering.pool.CPUBlockPool` that workers copy into and out of. No call blocks or does I/O.

Block states: a block is *not ready* while it is written, then *ready*, and a ready block may be
*pinned* by loads. Only ready, unpinned blocks may be evicted. The state is kept in flat maps
(key -> slot, key -> pin count, the set of keys not ready) rather than one object per block:
a lookup is then a single probe of a dict plus one of a small set.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Final

import numpy as np

from tiering.errors import ProtocolError
from tiering.keys import OffloadKey, check_keys
from tiering.policies import EvictionPolicy, make_policy
from tiering.specs import LoadStoreSpec, OffloadingEvent, PrepareStoreOutput

__all__ = ["CPUOffloadingManager"]


class CPUOffloadingManager:
    """Scheduler-side manager of the CPU primary tier.

    ``policy`` is a registered policy name (``"lru"``, ``"arc"``) or an :class:`EvictionPolicy`
    instance with ``capacity == num_blocks``. With ``enable_events`` the manager records stored
    and removed keys for :meth:`take_events`.

    Slots are handed out fresh in increasing order first, then reused, most recently freed first
    (recently freed slots are the likeliest to be warm in the CPU caches and TLB).
    """

    medium: Final = "CPU"

    def __init__(
        self,
        num_blocks: int,
        policy: str | EvictionPolicy = "lru",
        enable_events: bool = False,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if isinstance(policy, EvictionPolicy):
            if policy.capacity != num_blocks:
                raise ValueError(
                    f"policy capacity {policy.capacity} differs from num_blocks {num_blocks}"
                )
            self._policy = policy
        else:
            self._policy = make_policy(policy, num_blocks)
        self.num_blocks = num_blocks
        self.enable_events = enable_events
        self._slots: dict[OffloadKey, int] = {}  # every held key
        self._not_ready: set[OffloadKey] = set()  # being written
        self._pins: dict[OffloadKey, int] = {}  # ready keys pinned by loads (count > 0)
        self._next_fresh_slot = 0
        self._freed_slots: list[int] = []  # a stack: most recently freed on top
        self._events: list[OffloadingEvent] = []
        self._closed = False
        self._eviction_hook: Callable[[list[tuple[OffloadKey, int]]], set[int]] | None = None

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

    # -- lookups ------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey) -> bool | None:
        """True if stored and ready, False if absent, None while being written (retry later)."""
        if key in self._slots:
            return None if key in self._not_ready else True
        if type(key) is not bytes:
            check_keys([key])
        return False

    def lookup_prefix(self, keys: Iterable[OffloadKey]) -> int | None:
        """The number of leading keys stored and ready; None if the first non-hit is in flight."""
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

    def prepare_load(self, keys: Collection[OffloadKey]) -> LoadStoreSpec:
        """Pin ready ``keys`` until :meth:`complete_load`; ``block_ids[i]`` is ``keys[i]``'s slot.

        Raises ProtocolError, changing nothing, if a key is absent or not ready.
        """
        key_list = check_keys(keys)
        slots = self._slots
        for key in key_list:
            if key not in slots:
                raise ProtocolError(f"cannot load key {key.hex()}: it is not stored")
            if key in self._not_ready:
                raise ProtocolError(f"cannot load key {key.hex()}: it is still being written")
        pins = self._pins
        for key in key_list:
            count = pins.get(key, 0)
            if count == 0:
                self._policy.set_evictable(key, False)
            pins[key] = count + 1
        return LoadStoreSpec(self.medium, np.fromiter((slots[k] for k in key_list), np.int64))

    def complete_load(self, keys: Collection[OffloadKey]) -> None:
        """Unpin keys pinned by :meth:`prepare_load`. Raises ProtocolError, changing nothing, if a
        key was not prepared (as many times as it is listed)."""
        key_list = check_keys(keys)
        wanted: dict[OffloadKey, int] = {}
        for key in key_list:
            wanted[key] = wanted.get(key, 0) + 1
        pins = self._pins
        for key, times in wanted.items():
            pinned = pins.get(key, 0)
            if pinned < times:
                raise ProtocolError(
                    f"complete_load for key {key.hex()} x{times} but only {pinned} load(s) of it "
                    "were prepared"
                )
        for key, times in wanted.items():
            left = pins[key] - times
            if left:
                pins[key] = left
            else:
                del pins[key]
                self._policy.set_evictable(key, True)

    def touch(self, keys: Collection[OffloadKey]) -> None:
        """Mark keys as most recently used; the first key ends most recent. Absent keys are
        ignored."""
        self._policy.touch(check_keys(keys))

    # -- stores -------------------------------------------------------------------------------

    def prepare_store(self, keys: Collection[OffloadKey]) -> PrepareStoreOutput | None:
        """Reserve slots for the absent ``keys``, evicting as needed.

        Returns the keys to write (absent ones, in order, once each), their slots and the evicted
        keys; or None, with nothing changed, if not enough blocks can be evicted. Every key of the
        request is protected from eviction, including those already stored.
        """
        key_list = check_keys(keys)
        slots_of = self._slots
        to_store = [k for k in dict.fromkeys(key_list) if k not in slots_of]
        if not to_store:
            return PrepareStoreOutput([], LoadStoreSpec(self.medium, np.empty(0, np.int64)), [])
        if len(to_store) > self.num_blocks:
            return None
        evicted: list[OffloadKey] = []
        shortfall = len(to_store) - self.num_free_blocks
        if shortfall > 0:
            victims = self._policy.evict(shortfall, protected=set(key_list))
            if victims is None:
                return None
            freed: list[tuple[OffloadKey, int]] = []
            for victim in victims:
                victim_key = OffloadKey(victim)
                freed.append((victim_key, slots_of.pop(victim_key)))
                evicted.append(victim_key)
            retained = self._eviction_hook(freed) if self._eviction_hook else set()
            for _, slot in freed:
                if slot not in retained:
                    self._free_slot(slot)
            self._emit(evicted, removed=True)
            if self.num_free_blocks < len(to_store):
                # Write-back: some victims keep their slots until a lower tier has them.
                return None
        slots = self._allocate_slots(len(to_store))
        slots_of.update(zip(to_store, slots, strict=True))
        self._not_ready.update(to_store)
        insert = self._policy.insert
        for key in to_store:
            insert(key, False)
        spec = LoadStoreSpec(self.medium, np.array(slots, dtype=np.int64))
        return PrepareStoreOutput(to_store, spec, evicted)

    def complete_store(self, keys: Collection[OffloadKey], success: bool = True) -> None:
        """Finish a store: make the written keys ready, or on failure drop those still not
        ready and free their slots. Keys unknown or already ready are left alone."""
        done: list[OffloadKey] = []
        not_ready = self._not_ready
        policy = self._policy
        for key in check_keys(keys):
            if key not in not_ready:  # unknown, or already ready
                continue
            not_ready.remove(key)
            if success:
                policy.set_evictable(key, True)
            else:
                policy.remove(key)
                self._free_slot(self._slots.pop(key))
            done.append(key)
        if success:
            self._emit(done, removed=False)

    def _allocate_slots(self, n: int) -> list[int]:
        """``n`` slots: fresh ones in increasing order, then the most recently freed."""
        fresh = min(n, self.num_blocks - self._next_fresh_slot)
        slots = list(range(self._next_fresh_slot, self._next_fresh_slot + fresh))
        self._next_fresh_slot += fresh
        reused = n - fresh
        if reused:
            freed = self._freed_slots
            slots.extend(reversed(freed[-reused:]))
            del freed[-reused:]
        return slots

    def _free_slot(self, slot: int) -> None:
        self._freed_slots.append(slot)

    # -- hooks for a tiering manager -----------------------------------------------------------

    def set_eviction_hook(
        self, hook: Callable[[list[tuple[OffloadKey, int]]], set[int]] | None
    ) -> None:
        """Call ``hook(victims)`` with ``(key, slot)`` pairs on eviction; the slots it returns
        stay allocated until :meth:`release_slots` (a write-back tier is still copying them).
        With a hook, a ``prepare_store`` that evicted but got no free slots returns None."""
        self._eviction_hook = hook

    def release_slots(self, slots: Iterable[int]) -> None:
        """Free slots that an eviction hook retained."""
        for slot in slots:
            self._free_slot(slot)

    # -- events and lifecycle -----------------------------------------------------------------

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        if self.enable_events and keys:
            self._events.append(OffloadingEvent(tuple(keys), self.medium, removed))

    def take_events(self) -> list[OffloadingEvent]:
        """The stored and removed events since the last call, in order."""
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> None:
        """Drop every block, pinned or in flight included, and all policy history."""
        self._emit(list(self._slots), removed=True)
        self._slots.clear()
        self._not_ready.clear()
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
            self._pins.clear()
            self._policy.clear()
