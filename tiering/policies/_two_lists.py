"""Two recency lists sharing pins: the held keys of ARC-like policies (``arc``, ``hybrid``,
``chain``), with what does not depend on how a policy chooses between the lists.

T1 and T2 are :class:`~tiering.policies._order.RecencyOrder` partners: a pin marks a key of
either without looking up which list holds it, and a victim search in either never meets a
pinned key. What the lists mean (used once / reused; fresh / continued) and how victims are
chosen between them is the subclass's.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering.policies._checks import check_insert_key, check_touch_keys
from tiering.policies._order import RecencyOrder
from tiering.policies.base import EvictionPolicy

__all__ = ["TwoListPolicy", "next_victim_bound", "stamped_keys"]


class TwoListPolicy(EvictionPolicy):
    """Held keys in two :class:`RecencyOrder` lists, T1 and T2, that share their pins."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1 = RecencyOrder()
        self._t2 = RecencyOrder()
        self._t1.share_pins_with(self._t2)  # a pin marks a key of either list, unlooked-for

    # -- read-only views (tests, debugging) ---------------------------------------------------

    @property
    def t1_keys(self) -> tuple[bytes, ...]:
        """T1's keys, oldest first."""
        return tuple(self._t1)

    @property
    def t2_keys(self) -> tuple[bytes, ...]:
        """T2's keys, oldest first."""
        return tuple(self._t2)

    # -- EvictionPolicy -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t2 or key in self._t1

    def insert_many(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        if set(map(type, keys)) - {bytes}:
            for key in keys:
                check_insert_key(key)
        t1, t2 = self._t1, self._t2
        held = set(t1.held_of(keys)) | set(t2.held_of(keys))
        if held or len(set(keys)) != len(keys):
            raise KeyError(_first_held_or_repeated(keys, held))
        self.insert_new(keys, evictable)

    def touch(self, keys: Sequence[bytes]) -> None:
        """A use: a T1 key moves to T2 as its most recent (a pinned one, still being written,
        stays in T1: preparing a block is not a second use), a T2 key becomes T2's most recent;
        ``keys[0]`` ends most recent. Absent keys (ARC's ghosts too) are ignored."""
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys)
        self._t1.touch_all_promoting(keys, self._t2)

    def refresh(self, keys: Sequence[bytes]) -> None:
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys)
        # Each key stays in its list (a refresh is not a use), as that list's most recent.
        self._t1.touch_all(keys)
        self._t2.touch_all(keys)

    def set_evictable(self, key: bytes, evictable: bool) -> None:
        if not (self._t1.set_evictable(key, evictable) or self._t2.set_evictable(key, evictable)):
            raise KeyError(key)

    def set_evictable_many(self, keys: Sequence[bytes], evictable: bool) -> None:
        # The list of the first key first: a call's keys are usually all new (a store made
        # ready) or all reused (a load pinned and let go), so the other list's pass is short.
        # The lists share their pins in place: either one pins a key of both, and lets go any
        # key pinned in place; the second pass meets the other list's parked keys.
        t1, t2 = self._t1, self._t2
        if not keys:
            return
        # Keys let go are pinned in place (either list will do) or parked in their own list;
        # keys pinned are in their list's _main. One probe either way, no call.
        in_t2 = keys[0] in (t2._parked if evictable else t2._main)
        first, second = (t2, t1) if in_t2 else (t1, t2)
        changed, rest = first.set_evictable_each(keys, evictable)
        if not rest:
            return
        changed_second, absent = second.set_evictable_each(rest, evictable)
        if absent:
            # Undo: each changed key is held (in place, parked, or back in its list's _main).
            changed += changed_second
            _, elsewhere = t1.set_evictable_each(changed, not evictable)
            if elsewhere:
                t2.set_evictable_each(elsewhere, not evictable)
            raise KeyError(absent[0])

    def pin_evictable(self, keys: Sequence[bytes]) -> None:
        self._t1.pin_all_in_place(keys)  # shared with T2: no lookup of the key's list

    def remove(self, key: bytes) -> None:
        if not self._t1.discard(key):
            self._t2.discard(key)

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()


def _first_held_or_repeated(keys: Sequence[bytes], held: set[bytes]) -> bytes:
    listed: set[bytes] = set()
    for key in keys:
        if key in held or key in listed:
            return key
        listed.add(key)
    raise AssertionError("no key is held or listed twice")


def next_victim_bound(order: RecencyOrder, pending: tuple[bytes, int] | None, done: bool) -> int:
    """The stamp of ``order``'s next victim if already taken (``pending``), else a lower bound
    of it (its oldest key's stamp); -1 if it has none. For a search that compares two lists'
    next victims and takes a key (making its stamp exact) only from the list that may win."""
    if pending is not None:
        return pending[1]
    return -1 if done else order.oldest_stamp()


def stamped_keys(order: RecencyOrder) -> list[tuple[bytes, int]]:
    """``order``'s keys with their stamps, pinned ones included, in no particular order."""
    entries = [(k, s if s >= 0 else ~s) for k, s in order._main.items()]
    return entries + list(order._parked.items())
