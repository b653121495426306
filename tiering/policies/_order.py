"""A recency order whose oldest-first victim search skips pinned keys in O(1) amortized time.

Every policy list (LRU's single list, ARC's T1 and T2) is one :class:`RecencyOrder`.

Layout. ``_main`` is an ``OrderedDict`` in recency order (oldest first). A key leaves ``_main``
only from its head, and then receives a *departure stamp* from a counter:

- a pinned (non-evictable) key met at the head by a victim search goes to ``_parked``;
- a parked key that becomes evictable again goes to ``_released``, a dict indexed by a min-heap
  of ``(stamp, key)`` (stale heap entries are skipped and compacted away);
- a protected key met during one search is held aside and goes to ``_released`` when the
  search ends; a victim taken by a search that the caller abandons goes back to ``_released``.

Why this is exact. A key departs only from the head of ``_main``, so (1) every departed key is
older than every key still in ``_main``, and (2) departure stamps increase with recency among
departed keys: a key departing later was behind the earlier one in ``_main``, or re-entered
``_main`` at its tail after it. Touching a departed key sends it back to the tail of ``_main``.
Hence the true recency order is: departed keys by stamp, then ``_main`` in order. Released
keys are exactly the evictable departed ones, so the oldest evictable unprotected key is the
released key with the smallest stamp, or, when none is left, the first evictable unprotected
key of ``_main``. Parking moves nothing in that order, so a search that fails changes nothing a
caller can observe.

Cost. A key is parked at most once per stay in ``_main``, a heap entry is pushed once per
release, and protected keys cost O(log n) each per search, so a victim costs O(1) amortized
plus O(log n) heap work, whatever the number of pinned keys.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterator
from itertools import count
from operator import itemgetter

__all__ = ["RecencyOrder"]

# Rebuild the heap once stale entries outnumber live ones by this factor (plus a floor).
_HEAP_SLACK_FACTOR = 2
_HEAP_SLACK_MIN = 64


class RecencyOrder:
    """Keys in recency order with pinning, O(1) amortized oldest-evictable search.

    Not thread-safe. Callers of :meth:`pop_oldest` must call :meth:`end_search` once the
    search (one ``evict`` call, possibly many victims) is over, to commit or undo it.
    """

    __slots__ = (
        "_aside",
        "_clock",
        "_heap",
        "_main",
        "_parked",
        "_pinned",
        "_released",
        "_size",
        "_taken",
    )

    def __init__(self) -> None:
        self._main: OrderedDict[bytes, None] = OrderedDict()
        self._parked: dict[bytes, int] = {}
        self._released: dict[bytes, int] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._pinned: set[bytes] = set()
        self._aside: list[tuple[int, bytes]] = []
        self._taken: list[tuple[int, bytes]] = []
        self._clock = count()
        # Keys held by the list; those held aside during a search count (ARC compares |T1|
        # to p between victims).
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: object) -> bool:
        return key in self._main or key in self._parked or key in self._released

    def __iter__(self) -> Iterator[bytes]:
        """Keys from the oldest to the most recent, pinned ones included."""
        departed = sorted([*self._parked.items(), *self._released.items()], key=itemgetter(1))
        for key, _ in departed:
            yield key
        yield from self._main

    @property
    def evictable_count(self) -> int:
        """How many keys may be evicted (protected ones included)."""
        return self._size - len(self._pinned)

    def is_evictable(self, key: bytes) -> bool:
        return key not in self._pinned

    def add(self, key: bytes, evictable: bool) -> None:
        """Add an absent ``key`` as the most recent."""
        self._main[key] = None
        self._size += 1
        if not evictable:
            self._pinned.add(key)

    def touch(self, key: bytes) -> bool:
        """Make ``key`` the most recent; return whether it was present."""
        main = self._main
        try:
            main.move_to_end(key)
        except KeyError:
            if key in self._parked:
                del self._parked[key]
            elif key in self._released:
                del self._released[key]  # its heap entry is now stale
            else:
                return False
            main[key] = None
        return True

    def discard(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present."""
        if key in self._main:
            del self._main[key]
        elif key in self._parked:
            del self._parked[key]
        elif key in self._released:
            del self._released[key]
        else:
            return False
        self._size -= 1
        self._pinned.discard(key)
        return True

    def set_evictable(self, key: bytes, evictable: bool) -> bool:
        """Allow or forbid evicting ``key``; return whether it was present."""
        pinned = self._pinned
        if evictable:
            if key not in pinned:  # already evictable, or absent
                return key in self
            pinned.remove(key)
            stamp = self._parked.pop(key, None)
            if stamp is not None:
                self._release(key, stamp)
            return True
        if key in pinned:
            return True
        if key not in self:
            return False
        pinned.add(key)
        stamp = self._released.pop(key, None)
        if stamp is not None:
            self._parked[key] = stamp
        return True

    def pop_oldest(self, protected: Container[bytes]) -> bytes | None:
        """Remove and return the oldest evictable key not in ``protected``, or ``None``.

        :meth:`end_search` commits or undoes every removal since the last search ended.
        """
        heap, released = self._heap, self._released
        while heap:
            stamp, key = heapq.heappop(heap)
            if released.get(key) != stamp:
                continue  # stale: touched, re-pinned or already taken since it was pushed
            del released[key]
            if key in protected:
                self._aside.append((stamp, key))
                continue
            self._size -= 1
            self._taken.append((stamp, key))
            return key
        main, pinned = self._main, self._pinned
        while main:
            key, _ = main.popitem(last=False)
            stamp = next(self._clock)
            if key in pinned:
                self._parked[key] = stamp
            elif key in protected:
                self._aside.append((stamp, key))
            else:
                self._size -= 1
                self._taken.append((stamp, key))
                return key
        return None

    def end_search(self, undo: bool) -> None:
        """End a search: keep the keys :meth:`pop_oldest` removed, or put them back exactly.

        Either way, the protected keys the search met go back to their places.
        """
        if undo:
            self._size += len(self._taken)
            self._aside += self._taken
        self._taken.clear()
        for stamp, key in self._aside:
            self._release(key, stamp)
        self._aside.clear()

    def clear(self) -> None:
        self._main.clear()
        self._parked.clear()
        self._released.clear()
        self._heap.clear()
        self._pinned.clear()
        self._aside.clear()
        self._taken.clear()
        self._clock = count()
        self._size = 0

    def _release(self, key: bytes, stamp: int) -> None:
        self._released[key] = stamp
        heapq.heappush(self._heap, (stamp, key))
        # Touches and re-pins leave stale entries behind; rebuilding once they dominate keeps
        # the heap O(live keys) at O(1) amortized cost.
        if len(self._heap) > _HEAP_SLACK_FACTOR * len(self._released) + _HEAP_SLACK_MIN:
            self._heap = [(s, k) for k, s in self._released.items()]
            heapq.heapify(self._heap)
