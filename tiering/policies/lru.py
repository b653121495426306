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

    Victim search skips pinned keys in O(1) amortized time (see :mod:`tiering.policies._order`).
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
        check_insert_key(key)
        if key in self._order:
            raise KeyError(key)
        self._order.add(key, evictable)

    def touch(self, keys: Sequence[bytes]) -> None:
        check_touch_keys(keys)
        touch = self._order.touch
        for key in reversed(keys):
            touch(key)

    def set_evictable(self, key: bytes, evictable: bool) -> None:
        if not self._order.set_evictable(key, evictable):
            raise KeyError(key)

    def remove(self, key: bytes) -> None:
        self._order.discard(key)

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        check_evict_count(n)
        guard = protected_set(protected)
        if n == 0:
            return []
        if n > self._order.evictable_count:
            return None  # hopeless: fail before any search
        order = self._order
        victims: list[bytes] = []
        found_all = False
        try:
            for _ in range(n):
                key = order.pop_oldest(guard)
                if key is None:
                    break
                victims.append(key)
            else:
                found_all = True
        finally:
            order.end_search(undo=not found_all)
        return victims if found_all else None

    def clear(self) -> None:
        self._order.clear()
