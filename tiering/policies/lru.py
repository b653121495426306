"""Least-recently-used eviction."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

from tiering.policies._checks import (
    check_evict_count,
    check_insert_key,
    check_touch_keys,
    protected_set,
)
from tiering.policies._order import RecencyOrder
from tiering.policies.base import EvictionPolicy

__all__ = ["LRUPolicy"]


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently used evictable key not protected by the caller.

    A victim search never meets a pinned key: O(log n) per victim at most (see
    :mod:`tiering.policies._order`).
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order = RecencyOrder()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._order)

    def insert(self, key: bytes, evictable: bool = True) -> None:
        if type(key) is not bytes:
            check_insert_key(key)
        if not self._order.add_new(key, evictable):
            raise KeyError(key)

    def insert_many(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        if set(map(type, keys)) - {bytes}:
            for key in keys:
                check_insert_key(key)
        order = self._order
        held = order.held_of(keys)
        if held:
            raise KeyError(held[0])
        if not order.add_all(keys, evictable):
            raise KeyError(_first_repeated(keys))

    def insert_new(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        if not self._order.add_all(keys, evictable):  # the caller's guarantee, not met
            raise KeyError("insert_new: a key was held already or listed twice")

    def touch(self, keys: Sequence[bytes]) -> None:
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys)
        self._order.touch_all(keys)

    def refresh(self, keys: Sequence[bytes]) -> None:
        self.touch(keys)  # LRU counts no uses: a refresh is a touch

    def set_evictable(self, key: bytes, evictable: bool) -> None:
        if not self._order.set_evictable(key, evictable):
            raise KeyError(key)

    def set_evictable_many(self, keys: Sequence[bytes], evictable: bool) -> None:
        order = self._order
        changed, absent = order.set_evictable_each(keys, evictable)
        if absent:
            order.set_evictable_each(changed, not evictable)
            raise KeyError(absent[0])

    def pin_evictable(self, keys: Sequence[bytes]) -> None:
        self._order.pin_all_in_place(keys)

    def remove(self, key: bytes) -> None:
        self._order.discard(key)

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        if type(n) is not int or n < 0:
            check_evict_count(n)
        guard = protected if type(protected) is set else protected_set(protected)
        if n == 0:
            return []
        order = self._order
        if n > order.evictable_count:
            return None  # hopeless: fail before any search
        try:
            victims = order.take(n, guard)
        except BaseException:
            order.end_search(undo=True)
            raise
        found_all = len(victims) == n
        order.end_search(undo=not found_all)
        return victims if found_all else None

    def clear(self) -> None:
        self._order.clear()


def _first_repeated(keys: Sequence[bytes]) -> bytes:
    listed: set[bytes] = set()
    for key in keys:
        if key in listed:
            return key
        listed.add(key)
    raise AssertionError("no key is listed twice")
