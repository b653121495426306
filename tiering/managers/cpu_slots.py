"""The slots of the CPU primary tier's pool, and the room a store makes in it.

:class:`SlotAllocator` hands slots out fresh in increasing order first, then reuses freed ones,
most recently freed first (recently freed slots are the likeliest to be warm in the CPU caches
and TLB). When a store needs more slots than are free, it evicts keys by the eviction policy;
an *eviction hook* (a tiering manager's write-back) may keep some victims' slots allocated until
they are released (:meth:`SlotAllocator.free`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

from tiering.core.keys import OffloadKey
from tiering.policies import EvictionPolicy

__all__ = ["EvictionHook", "SlotAllocator"]

#: Called with the ``(key, slot)`` pairs a store evicted and the request context of the call that
#: evicted them; returns the slots that stay allocated until :meth:`release_slots
#: <tiering.managers.cpu_manager.CPUOffloadingManager.release_slots>`.
EvictionHook = Callable[[list[tuple[OffloadKey, int]], object], set[int]]


class SlotAllocator:
    """``num_blocks`` slots; ``slots_of`` is the owner's live map key -> slot, from which
    evicted keys are dropped, and ``policy`` its eviction policy."""

    __slots__ = ("_next_fresh", "_policy", "_slots_of", "freed", "hook", "num_blocks")

    def __init__(
        self, num_blocks: int, slots_of: dict[OffloadKey, int], policy: EvictionPolicy
    ) -> None:
        self.num_blocks = num_blocks
        self._slots_of = slots_of
        self._policy = policy
        self._next_fresh = 0
        self.freed: list[int] = []  # a stack: most recently freed on top
        self.hook: EvictionHook | None = None

    @property
    def num_free(self) -> int:
        return self.num_blocks - self._next_fresh + len(self.freed)

    def allocate(
        self, needed: int, protected: list[OffloadKey], req_context: object
    ) -> tuple[list[int] | None, list[OffloadKey]]:
        """``needed`` slots (at most ``num_blocks``), evicting keys not in ``protected`` as
        needed. Returns the slots (None if too few could be freed) and the keys evicted (gone
        from ``slots_of`` and the policy, even when the slots are None: a hook kept theirs)."""
        freed_slots = self.freed
        fresh_left = self.num_blocks - self._next_fresh
        evicted: list[OffloadKey] = []
        shortfall = needed - fresh_left - len(freed_slots)
        if shortfall > 0:
            victims = self._policy.evict(shortfall, protected=set(protected))
            if victims is None:
                return None, evicted
            evicted = cast("list[OffloadKey]", victims)
            slots_of = self._slots_of
            hook = self.hook
            if hook is None:
                freed_slots += map(slots_of.pop, evicted)  # in victim order, one C loop
            else:
                freed = [(key, slots_of.pop(key)) for key in evicted]
                retained = hook(freed, req_context)
                freed_slots += [slot for _, slot in freed if slot not in retained]
            if fresh_left + len(freed_slots) < needed:
                # Write-back: some victims keep their slots until a lower tier has them.
                return None, evicted
        # Fresh slots in increasing order first, then the most recently freed.
        if fresh_left:
            fresh = min(needed, fresh_left)
            start = self._next_fresh
            slots = list(range(start, start + fresh))
            self._next_fresh = start + fresh
            reused = needed - fresh
            if reused:
                slots += freed_slots[: -reused - 1 : -1]
                del freed_slots[-reused:]
        else:
            slots = freed_slots[: -needed - 1 : -1]
            del freed_slots[-needed:]
        return slots, evicted

    def free(self, slots: Iterable[int]) -> None:
        """Return slots to the pool (the last one ends on top of the stack)."""
        self.freed += slots

    def clear(self) -> None:
        """Every slot free, fresh again."""
        self._next_fresh = 0
        self.freed.clear()
