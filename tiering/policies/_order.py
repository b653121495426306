"""A recency order whose oldest-first victim search skips pinned keys in O(log n) per victim,
with no pause that grows with the number of pinned keys.

Every policy list (LRU's single list, ARC's T1 and T2) is one :class:`RecencyOrder`.

Stamps. Every use of a key (add, touch) gives it a *stamp* from a counter, so the true recency
order is the order of stamps. A key's stamp is kept wherever the key is:

- ``_main``: an ``OrderedDict`` key -> stamp of the evictable keys. A use appends the key at the
  tail with a new stamp, so ``_main`` is in stamp order, except for *released* keys (below);
- ``_parked``: key -> stamp of the keys that may not be evicted (pinned, or being written).
  Pinning a key takes it out of ``_main`` at once, whatever its place, so a victim search never
  meets a pinned key: nothing is skipped, now or later.

Unpinning a key puts it back at the tail of ``_main`` with its stamp. If nothing newer was
appended since the stamp (a store that completes: added, not ready, a moment ago), that is its
place. Otherwise the key is *released*: out of place in ``_main`` (a use moves it as any other
key), and a min-heap of ``(stamp, key)`` holds its true place. A heap entry is valid while
``_main`` maps its key to its stamp (a use, a pin or an eviction since makes it stale; stale
entries are skipped and compacted away).

Why this is exact. Stamps of the keys in their place increase along ``_main``, and a released
key sits behind every key in its place that is older than it. So the oldest evictable key is the
older of the heap's valid top and ``_main``'s head: if the head is released, the heap's top is
at least as old (the head's own entry is there). A victim search (:meth:`take`) takes from
those two; protected keys it meets are held aside and return released, as do the victims of a
search the caller undoes: a search that fails changes nothing a caller can observe.

Cost. Adding, touching and pinning a key are O(1); unpinning is O(1) or one heap push; a victim
is one ``popitem`` (with nothing released) or O(log n) heap work. No call does work that grows
with the number of pinned keys.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence
from operator import itemgetter

__all__ = ["RecencyOrder"]

# Compact the heap once its entries outnumber the valid ones of the last compaction by this
# factor (plus a floor): O(1) amortized per push.
_HEAP_SLACK_FACTOR = 2
_HEAP_SLACK_MIN = 64

_heappop = heapq.heappop
_heappush = heapq.heappush


class RecencyOrder:
    """Keys in recency order with pinning; the oldest evictable keys in O(log n) each.

    Not thread-safe. Callers of :meth:`take` must call :meth:`end_search` once the search (one
    ``evict`` call, possibly several :meth:`take` calls) is over, to commit or undo it.
    """

    __slots__ = (
        "_aside",
        "_clock",
        "_heap",
        "_heap_limit",
        "_last",
        "_main",
        "_parked",
        "_taken_keys",
        "_taken_stamps",
        "size",
    )

    def __init__(self) -> None:
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._parked: dict[bytes, int] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._heap_limit = _HEAP_SLACK_MIN
        self._clock = -1  # the last stamp given (ints: cheaper than itertools.count)
        self._last = -1  # the newest stamp ever appended to _main in its place
        self._aside: list[tuple[int, bytes]] = []
        self._taken_keys: list[bytes] = []
        self._taken_stamps: list[int] = []
        #: Keys held (read-only for callers): those held aside during a search count (ARC
        #: compares |T1| to p between victims), those taken do not.
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: object) -> bool:
        return key in self._main or key in self._parked

    def __iter__(self) -> Iterator[bytes]:
        """Keys from the oldest to the most recent, pinned ones included."""
        if not self._parked and not self._heap:
            yield from self._main  # nothing out of place
            return
        for key, _ in sorted([*self._parked.items(), *self._main.items()], key=itemgetter(1)):
            yield key

    @property
    def evictable_count(self) -> int:
        """How many keys may be evicted (protected ones included)."""
        return self.size - len(self._parked)

    def is_evictable(self, key: bytes) -> bool:
        return key not in self._parked

    # -- adding and using keys ----------------------------------------------------------------

    def add(self, key: bytes, evictable: bool) -> None:
        """Add an absent ``key`` as the most recent."""
        stamp = self._clock = self._clock + 1
        if evictable:
            self._main[key] = stamp
            self._last = stamp
        else:
            self._parked[key] = stamp
        self.size += 1

    def add_new(self, key: bytes, evictable: bool) -> bool:
        """:meth:`add` if ``key`` is absent; return whether it was."""
        if key in self._main or key in self._parked:
            return False
        self.add(key, evictable)
        return True

    def held_of(self, keys: Iterable[bytes]) -> list[bytes]:
        """The ``keys`` this order holds, in their order."""
        main, parked = self._main, self._parked
        return [k for k in keys if k in main or k in parked]

    def add_all(self, keys: Sequence[bytes], evictable: bool) -> bool:
        """:meth:`add` each key in order (the last ends most recent); the keys must be absent.
        Returns False, having added none, if a key is listed twice."""
        target = self._main if evictable else self._parked
        before = len(target)
        stamp = self._clock
        for key in keys:
            stamp += 1
            target[key] = stamp
        if len(target) - before != len(keys):
            for key in keys:
                target.pop(key, None)
            return False
        self._clock = stamp
        self.size += len(keys)
        if evictable and keys:
            self._last = stamp
        return True

    def touch(self, key: bytes) -> bool:
        """Make ``key`` the most recent; return whether it was present."""
        main = self._main
        if key in main:
            main.move_to_end(key)  # a released key's heap entry goes stale with its new stamp
            stamp = main[key] = self._clock = self._clock + 1
            self._last = stamp
            return True
        if key in self._parked:
            self._parked[key] = self._clock = self._clock + 1
            return True
        return False

    def touch_all(self, keys: Sequence[bytes]) -> None:
        """:meth:`touch` each key from the last to the first (``keys[0]`` ends most recent);
        absent keys are ignored."""
        main, parked = self._main, self._parked
        move_to_end = main.move_to_end
        stamp = self._clock
        last = self._last
        for key in reversed(keys):
            if key in main:
                move_to_end(key)
                stamp += 1
                main[key] = last = stamp
            elif key in parked:
                stamp += 1
                parked[key] = stamp
        self._clock = stamp
        self._last = last

    def touch_all_promoting(self, keys: Sequence[bytes], into: RecencyOrder) -> None:
        """ARC's touch, from the last key to the first: an evictable key of this order moves to
        ``into`` as its most recent, a pinned one becomes this order's most recent (preparing a
        block is not a second use), any other key is touched in ``into`` (absent: ignored)."""
        main, parked = self._main, self._parked
        into_main, into_parked = into._main, into._parked
        move_to_end = into_main.move_to_end
        stamp, into_stamp, into_last = self._clock, into._clock, into._last
        moved = 0
        for key in reversed(keys):
            # The lists are disjoint: the likeliest places first.
            if key in into_main:
                move_to_end(key)
            elif key in main:
                del main[key]  # a released key's heap entry goes stale
                moved += 1
            elif key in parked:
                stamp += 1
                parked[key] = stamp
                continue
            elif key in into_parked:
                into_stamp += 1
                into_parked[key] = into_stamp
                continue
            else:
                continue  # absent (or a ghost): ignored
            into_stamp += 1
            into_main[key] = into_last = into_stamp
        self._clock, into._clock, into._last = stamp, into_stamp, into_last
        if moved:
            self.size -= moved
            into.size += moved

    def discard(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present."""
        if self._main.pop(key, None) is None and self._parked.pop(key, None) is None:
            return False
        self.size -= 1
        return True

    # -- pins ---------------------------------------------------------------------------------

    def set_evictable(self, key: bytes, evictable: bool) -> bool:
        """Allow or forbid evicting ``key``; return whether it was present."""
        changed, absent = self.set_evictable_each((key,), evictable)
        return not absent

    def set_evictable_each(
        self, keys: Iterable[bytes], evictable: bool
    ) -> tuple[list[bytes], list[bytes]]:
        """:meth:`set_evictable` for each key this order holds. Returns the keys it changed and
        the keys it does not hold (both in order); calling it again with the changed keys and
        ``not evictable`` undoes it, exactly as far as any caller can observe."""
        main, parked = self._main, self._parked
        changed: list[bytes] = []
        absent: list[bytes] = []
        if evictable:
            heap = self._heap
            last = self._last
            for key in keys:
                stamp = parked.pop(key, None)
                if stamp is None:
                    if key not in main:
                        absent.append(key)
                    continue
                changed.append(key)
                main[key] = stamp
                if stamp > last:  # nothing newer in _main: the tail is its place
                    last = stamp
                else:  # released: the heap keeps its place
                    _heappush(heap, (stamp, key))
            self._last = last
            if len(heap) > self._heap_limit:
                self._compact_heap()
        else:
            for key in keys:
                stamp = main.pop(key, None)  # a released key's heap entry goes stale
                if stamp is None:
                    if key not in parked:
                        absent.append(key)
                    continue
                changed.append(key)
                parked[key] = stamp
        return changed, absent

    # -- victim search ------------------------------------------------------------------------

    def take(self, n: int, protected: Container[bytes]) -> list[bytes]:
        """Remove and return up to ``n`` of the oldest evictable keys not in ``protected``,
        oldest first (fewer if there are no more).

        :meth:`end_search` commits or undoes every removal since the last search ended.
        """
        main, heap = self._main, self._heap
        popitem, get = main.popitem, main.get
        got: list[bytes] = []
        stamps = self._taken_stamps
        aside = self._aside
        while n:
            # The heap's valid top, if any: the oldest released key.
            while heap:
                top_stamp, top_key = heap[0]
                if get(top_key) == top_stamp:
                    break
                _heappop(heap)  # stale: used, pinned or taken since it was pushed
            else:
                top_stamp = -1
            # Victims from the head of _main while it is not newer than the heap's top (all of
            # them when nothing is released: the usual case).
            while n and main:
                key, stamp = popitem(False)
                if 0 <= top_stamp < stamp:
                    main[key] = stamp  # newer than the heap's top: back to the head
                    main.move_to_end(key, False)
                    break
                if key in protected:
                    aside.append((stamp, key))
                    continue
                got.append(key)
                stamps.append(stamp)
                n -= 1
            if not n or top_stamp < 0:
                break  # done, or nothing is left anywhere
            if get(top_key) != top_stamp:
                continue  # the head was the heap's top: taken or set aside above
            _heappop(heap)
            del main[top_key]
            if top_key in protected:
                aside.append((top_stamp, top_key))
                continue
            got.append(top_key)
            stamps.append(top_stamp)
            n -= 1
        if got:
            self.size -= len(got)
            self._taken_keys += got
        return got

    def end_search(self, undo: bool) -> None:
        """End a search: keep the keys :meth:`take` removed, or put them back exactly.

        Either way, the protected keys the search met go back to their places.
        """
        aside = self._aside
        taken = self._taken_keys
        if taken:
            if undo:
                self.size += len(taken)
                aside += zip(self._taken_stamps, taken, strict=True)
            taken.clear()
            self._taken_stamps.clear()
        if aside:
            main, heap = self._main, self._heap
            for stamp, key in aside:  # released: back in _main, the heap keeps their places
                main[key] = stamp
                _heappush(heap, (stamp, key))
            aside.clear()
            if len(heap) > self._heap_limit:
                self._compact_heap()

    def clear(self) -> None:
        self._main.clear()
        self._parked.clear()
        self._heap.clear()
        self._heap_limit = _HEAP_SLACK_MIN
        self._aside.clear()
        self._taken_keys.clear()
        self._taken_stamps.clear()
        self._clock = -1
        self._last = -1
        self.size = 0

    def _compact_heap(self) -> None:
        """Drop stale entries (uses, pins and evictions leave them behind)."""
        get = self._main.get
        self._heap = [(s, k) for s, k in self._heap if get(k) == s]
        heapq.heapify(self._heap)
        self._heap_limit = _HEAP_SLACK_FACTOR * len(self._heap) + _HEAP_SLACK_MIN
