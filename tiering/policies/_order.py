"""A recency order whose oldest-first victim search skips pinned keys in O(log n) per victim,
with no pause that grows with the number of pinned keys.

Every policy list (LRU's single list, ARC's T1 and T2) is one :class:`RecencyOrder`.

Stamps. Every use of a key (add, touch) gives it a *stamp* from a counter, so the true recency
order is the order of stamps. A key's stamp is kept wherever the key is:

- ``_main``: an ``OrderedDict`` key -> stamp of evictable keys, in stamp order (oldest first);
  adding or touching an evictable key appends it here;
- ``_parked``: key -> stamp of the keys that may not be evicted (pinned, or being written).
  Pinning a key takes it out of ``_main`` (or ``_released``) at once, whatever its place, so a
  victim search never meets a pinned key: nothing is skipped, now or later;
- ``_released``: key -> stamp of evictable keys out of ``_main``, indexed by a min-heap of
  ``(stamp, key)`` (entries whose key has moved on since are stale: skipped and compacted away).
  An unpinned key goes back to the tail of ``_main`` if nothing more recent was appended there
  since its stamp (the usual case for a store that completes: it was added, not ready, a moment
  ago), else here.

The oldest evictable key is the older of ``_main``'s head and the heap's top. A victim search
(:meth:`take`) pops from those two; protected keys it meets are held aside and go to
``_released`` when the search ends (:meth:`end_search`), as do the victims of a search the caller
undoes, each with its own stamp: a search that fails changes nothing a caller can observe.

Cost. Adding, touching and pinning a key are O(1); unpinning is O(1) or one heap push; a victim
is one ``popitem`` (no heap) or O(log n) heap work. No call does work proportional to the
number of pinned keys.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence
from itertools import count
from operator import itemgetter

__all__ = ["RecencyOrder"]

# Rebuild the heap once stale entries outnumber live ones by this factor (plus a floor).
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
        "_last",
        "_main",
        "_parked",
        "_released",
        "size",
        "_taken_keys",
        "_taken_stamps",
    )

    def __init__(self) -> None:
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._parked: dict[bytes, int] = {}
        self._released: dict[bytes, int] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._clock = count()
        self._last = -1  # the newest stamp ever appended to _main
        self._aside: list[tuple[int, bytes]] = []
        self._taken_keys: list[bytes] = []
        self._taken_stamps: list[int] = []
        #: Keys held (read-only for callers): those held aside during a search count (ARC
        #: compares |T1| to p between victims), those taken do not.
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: object) -> bool:
        return key in self._main or key in self._parked or key in self._released

    def __iter__(self) -> Iterator[bytes]:
        """Keys from the oldest to the most recent, pinned ones included."""
        departed = [*self._parked.items(), *self._released.items()]
        if not departed:
            yield from self._main
            return
        for key, _ in sorted([*departed, *self._main.items()], key=itemgetter(1)):
            yield key

    @property
    def evictable_count(self) -> int:
        """How many keys may be evicted (protected ones included)."""
        return self.size - len(self._parked)

    def is_evictable(self, key: bytes) -> bool:
        return key not in self._parked

    def add(self, key: bytes, evictable: bool) -> None:
        """Add an absent ``key`` as the most recent."""
        stamp = next(self._clock)
        if evictable:
            self._main[key] = stamp
            self._last = stamp
        else:
            self._parked[key] = stamp
        self.size += 1

    def add_new(self, key: bytes, evictable: bool) -> bool:
        """:meth:`add` if ``key`` is absent; return whether it was."""
        if key in self._main or key in self._parked or key in self._released:
            return False
        stamp = next(self._clock)
        if evictable:
            self._main[key] = stamp
            self._last = stamp
        else:
            self._parked[key] = stamp
        self.size += 1
        return True

    def held_of(self, keys: Iterable[bytes]) -> list[bytes]:
        """The ``keys`` this order holds, in their order."""
        main, parked, released = self._main, self._parked, self._released
        return [k for k in keys if k in main or k in parked or k in released]

    def add_all(self, keys: Sequence[bytes], evictable: bool) -> bool:
        """:meth:`add` each key in order (the last ends most recent); the keys must be absent.
        Returns False, having added none, if a key is listed twice."""
        target = self._main if evictable else self._parked
        before = len(target)
        clock = self._clock
        stamp = -1
        for key in keys:
            stamp = target[key] = next(clock)
        if len(target) - before != len(keys):
            for key in keys:
                target.pop(key, None)
            return False
        self.size += len(keys)
        if evictable and keys:
            self._last = stamp
        return True

    def touch(self, key: bytes) -> bool:
        """Make ``key`` the most recent; return whether it was present."""
        main = self._main
        # Membership first: a KeyError costs more than the probe it would save.
        if key in main:
            main.move_to_end(key)
        elif key in self._parked:
            self._parked[key] = next(self._clock)
            return True
        elif self._released.pop(key, None) is None:
            return False  # absent (a released key's heap entry is now stale)
        stamp = main[key] = next(self._clock)
        self._last = stamp
        return True

    def touch_all(self, keys: Sequence[bytes]) -> None:
        """:meth:`touch` each key from the last to the first (``keys[0]`` ends most recent);
        absent keys are ignored."""
        main, parked, released, clock = self._main, self._parked, self._released, self._clock
        move_to_end = main.move_to_end
        stamp = self._last
        for key in reversed(keys):
            if key in main:
                move_to_end(key)
            elif key in parked:
                parked[key] = next(clock)
                continue
            elif released.pop(key, None) is None:
                continue
            stamp = main[key] = next(clock)
        self._last = stamp

    def touch_all_promoting(self, keys: Sequence[bytes], into: RecencyOrder) -> None:
        """ARC's touch, from the last key to the first: an evictable key of this order moves to
        ``into`` as its most recent, a pinned one becomes this order's most recent (preparing a
        block is not a second use), any other key is touched in ``into`` (absent: ignored)."""
        main, parked, released, clock = self._main, self._parked, self._released, self._clock
        into_main, into_parked, into_released = into._main, into._parked, into._released
        move_to_end, into_clock = into_main.move_to_end, into._clock
        into_last = into._last
        moved = 0
        for key in reversed(keys):
            if key in main:
                del main[key]
            elif key in released:
                del released[key]  # its heap entry is now stale
            elif key in parked:
                parked[key] = next(clock)
                continue
            else:  # not here: a touch in ``into``
                if key in into_main:
                    move_to_end(key)
                elif key in into_parked:
                    into_parked[key] = next(into_clock)
                    continue
                elif into_released.pop(key, None) is None:
                    continue
                into_last = into_main[key] = next(into_clock)
                continue
            moved += 1  # evictable here: promoted
            into_last = into_main[key] = next(into_clock)
        into._last = into_last
        if moved:
            self.size -= moved
            into.size += moved

    def discard(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present."""
        if (
            self._main.pop(key, None) is None
            and self._parked.pop(key, None) is None
            and self._released.pop(key, None) is None
        ):
            return False
        self.size -= 1
        return True

    def set_evictable(self, key: bytes, evictable: bool) -> bool:
        """Allow or forbid evicting ``key``; return whether it was present."""
        if evictable:
            stamp = self._parked.pop(key, None)
            if stamp is None:  # already evictable, or absent
                return key in self._main or key in self._released
            if stamp > self._last:  # nothing newer in _main: its place is the tail
                self._main[key] = stamp
                self._last = stamp
            else:
                self._release(key, stamp)
            return True
        stamp = self._main.pop(key, None)
        if stamp is None:
            stamp = self._released.pop(key, None)  # its heap entry is now stale
            if stamp is None:
                return key in self._parked  # already pinned, or absent
        self._parked[key] = stamp
        return True

    def set_evictable_each(
        self, keys: Iterable[bytes], evictable: bool
    ) -> tuple[list[bytes], list[bytes]]:
        """:meth:`set_evictable` for each key this order holds. Returns the keys it changed and
        the keys it does not hold (both in order); calling it again with the changed keys and
        ``not evictable`` undoes it, exactly as far as any caller can observe."""
        main, parked, released = self._main, self._parked, self._released
        changed: list[bytes] = []
        absent: list[bytes] = []
        if evictable:
            last = self._last
            for key in keys:
                stamp = parked.pop(key, None)
                if stamp is None:
                    if key not in main and key not in released:
                        absent.append(key)
                    continue
                changed.append(key)
                if stamp > last:  # nothing newer in _main: its place is the tail
                    main[key] = stamp
                    last = stamp
                else:
                    self._release(key, stamp)
            self._last = last
        else:
            for key in keys:
                stamp = main.pop(key, None)
                if stamp is None:
                    stamp = released.pop(key, None)  # its heap entry is now stale
                    if stamp is None:
                        if key not in parked:
                            absent.append(key)
                        continue
                changed.append(key)
                parked[key] = stamp
        return changed, absent

    def take(self, n: int, protected: Container[bytes]) -> list[bytes]:
        """Remove and return up to ``n`` of the oldest evictable keys not in ``protected``,
        oldest first (fewer if there are no more).

        :meth:`end_search` commits or undoes every removal since the last search ended.
        """
        main, heap, released = self._main, self._heap, self._released
        popitem = main.popitem
        got: list[bytes] = []
        stamps = self._taken_stamps
        aside = self._aside
        while n:
            # The heap's valid top, if any: the oldest released key.
            while heap:
                top_stamp, top_key = heap[0]
                if released.get(top_key) == top_stamp:
                    break
                _heappop(heap)  # stale: touched, pinned or taken since it was pushed
            else:
                top_stamp = -1
            # Victims from the head of _main while it is older than the heap's top (all of them
            # when nothing is released: the usual case).
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
            _heappop(heap)
            del released[top_key]
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
            for stamp, key in aside:
                self._release(key, stamp)
            aside.clear()

    def clear(self) -> None:
        self._main.clear()
        self._parked.clear()
        self._released.clear()
        self._heap.clear()
        self._aside.clear()
        self._taken_keys.clear()
        self._taken_stamps.clear()
        self._clock = count()
        self._last = -1
        self.size = 0

    def _release(self, key: bytes, stamp: int) -> None:
        self._released[key] = stamp
        heap = self._heap
        _heappush(heap, (stamp, key))
        # Touches and pins leave stale entries behind; rebuilding once they dominate keeps the
        # heap O(live keys) at O(1) amortized cost.
        if len(heap) > _HEAP_SLACK_FACTOR * len(self._released) + _HEAP_SLACK_MIN:
            self._heap = [(s, k) for k, s in self._released.items()]
            heapq.heapify(self._heap)
