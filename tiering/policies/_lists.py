"""Recency lists sharing pins: the held keys of the policies that keep several lists (``arc``,
``hybrid``: two; ``chain``: three), with what does not depend on how a policy moves keys between
them or chooses its victims.

The lists are :class:`~tiering.policies._order.RecencyOrder` partners: a pin marks a key of any
of them without looking up which list holds it, and a victim search in one never meets a pinned
key. What the lists mean and how victims are chosen among them is the subclass's.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering.policies._checks import check_insert_key, check_touch_keys
from tiering.policies._order import RecencyOrder
from tiering.policies.base import EvictionPolicy

__all__ = ["ListsPolicy"]


class ListsPolicy(EvictionPolicy):
    """Held keys in ``count`` :class:`RecencyOrder` lists that share their pins; the lists are
    disjoint. ``insert_many`` checks and calls ``insert_new``; a refresh keeps each key in its
    list. Subclasses define ``touch``, ``insert_new`` and ``evict``."""

    def __init__(self, capacity: int, count: int) -> None:
        super().__init__(capacity)
        self._lists = tuple(RecencyOrder() for _ in range(count))
        for order in self._lists[1:]:
            self._lists[0].share_pins_with(order)  # a pin marks a key of any, unlooked-for

    def list_keys(self, index: int) -> tuple[bytes, ...]:
        """The keys of list ``index``, oldest first (tests, debugging)."""
        return tuple(self._lists[index])

    def __len__(self) -> int:
        return sum(order.size for order in self._lists)

    def __contains__(self, key: object) -> bool:
        return any(key in order for order in self._lists)

    def insert_many(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        if set(map(type, keys)) - {bytes}:
            for key in keys:
                check_insert_key(key)
        held: set[bytes] = set()
        for order in self._lists:
            held.update(order.held_of(keys))
        if held or len(set(keys)) != len(keys):
            raise KeyError(_first_held_or_repeated(keys, held))
        self.insert_new(keys, evictable)

    def refresh(self, keys: Sequence[bytes]) -> None:
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys)
        # Each key stays in its list (a refresh is not a use), as that list's most recent.
        for order in self._lists:
            order.touch_all(keys)

    def set_evictable(self, key: bytes, evictable: bool) -> None:
        if not any(order.set_evictable(key, evictable) for order in self._lists):
            raise KeyError(key)

    def set_evictable_many(self, keys: Sequence[bytes], evictable: bool) -> None:
        # The list of the first key first: a call's keys are usually all new (a store made
        # ready) or all reused (a load pinned and let go), so the other lists' passes are
        # short. The lists share their pins in place: any one pins a key of all, and lets go
        # any key pinned in place; a later pass meets the other lists' parked keys.
        if not keys:
            return
        first = keys[0]
        # Keys let go are pinned in place (any list will do: a load's, the usual case) or
        # parked in their own list; keys pinned are in their list's _main. One probe each.
        head = self._lists[0]
        if not (evictable and first in head._pinned_in_place):
            head = next(
                (o for o in self._lists if first in (o._parked if evictable else o._main)), head
            )
        changed, rest = head.set_evictable_each(keys, evictable)
        if not rest:
            return  # all of the first key's list, or pinned in place: the usual case
        for order in self._lists:
            if order is not head:
                changed_here, rest = order.set_evictable_each(rest, evictable)
                changed += changed_here
                if not rest:
                    return
        # Undo: each changed key is held (in place, parked, or back in its list's _main).
        undo: Sequence[bytes] = changed
        for order in self._lists:
            _, undo = order.set_evictable_each(undo, not evictable)
            if not undo:
                break
        raise KeyError(rest[0])

    def pin_evictable(self, keys: Sequence[bytes]) -> None:
        self._lists[0].pin_all_in_place(keys)  # shared by every list: no lookup of the key's

    def remove(self, key: bytes) -> None:
        for order in self._lists:
            if order.discard(key):
                return

    def clear(self) -> None:
        for order in self._lists:
            order.clear()


def _first_held_or_repeated(keys: Sequence[bytes], held: set[bytes]) -> bytes:
    listed: set[bytes] = set()
    for key in keys:
        if key in held or key in listed:
            return key
        listed.add(key)
    raise AssertionError("no key is held or listed twice")
