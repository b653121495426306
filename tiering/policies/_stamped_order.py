"""Keys in recency order by *stamps*, the places of keys put back out of order kept aside: the
structure under :class:`~tiering.policies._order.RecencyOrder`, which adds pins and the victim
search (its module docstring tells how a search uses what is kept here).

Stamps. Every use of a key (add, touch) gives it a *stamp* from a counter, so the true recency
order is the order of stamps. A key's stamp is kept wherever the key is:

- ``_main``: an ``OrderedDict`` key -> stamp of the evictable keys and of the keys *pinned in
  place* (below). A use appends the key at the tail with a new stamp, so ``_main`` is in stamp
  order, except for *released* keys (below);
- ``_parked``: key -> stamp of the other keys that may not be evicted (being written, or pinned
  and parked). A victim search never meets a parked key.

Keys pinned in place (``_pinned_in_place``, see :mod:`tiering.policies._order`) stay in ``_main``
with their stamps; dropping a key drops its mark too.

Unpinning a parked key puts it back at the tail of ``_main`` with its stamp. If nothing newer was
appended since the stamp (a store that completes: added, not ready, a moment ago), that is its
place. Otherwise the key is *released*: out of place in ``_main`` (a use moves it as any other
key), and its true place is kept elsewhere. ``_main`` maps a released key to ``~stamp``
(negative), so that every call that takes a released key out of ``_main`` (a use, a pin, a
discard, an eviction) sees it in the value it reads and drops that place too:

- ``_rel``: an ``OrderedDict`` key -> stamp of the keys released in increasing stamp order (a
  write-through hold lets keys go in the order they were stored: the usual case). It stays in
  stamp order, and a key leaves it at once (O(1)) when it leaves ``_main``;
- ``_heap``: a min-heap of ``(stamp, key)`` of the other released keys. An entry is valid while
  ``_main`` maps its key to ``~stamp`` and the key is not in ``_rel`` (a key pinned and let go
  again at the same stamp may go to ``_rel`` while its old entry is still in the heap); the
  others are stale, left for a victim search to pop.

Stale entries. ``_released`` counts the keys with a valid heap entry (exactly one each), so the
heap holds ``len(_heap) - _released`` stale ones (a duplicate of a valid entry counts as stale).
A call that makes entries stale compacts the heap once they outnumber three times the valid
ones by more than a slack: the compaction costs O(entries), about 4/3 of the stale entries made
since the last one, so each call pays O(1) amortized for the entries it made stale, and no
victim search pops more stale entries than three times the valid ones in the heap (plus the
slack), however many keys were pinned.

Cost. Adding, touching and dropping a key are O(1) amortized (a released key's place goes with
it: O(1) from ``_rel``, or a heap entry counted stale).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from operator import itemgetter

__all__ = ["StampedOrder"]

# Compact the heap once its stale entries outnumber _STALE_FACTOR times the valid ones by more
# than _STALE_SLACK: a compaction visits (1 + 1/_STALE_FACTOR) entries per stale one it drops
# (each visit a dict probe), and small heaps are not worth compacting.
_STALE_FACTOR = 3
_STALE_SLACK = 64


class StampedOrder:
    """Keys in recency order (stamps), evictable or parked, with released keys' places.

    Not thread-safe. :class:`~tiering.policies._order.RecencyOrder` is the order the policies
    use: this class holds its keys and their places, and the calls that add, use and drop keys.
    """

    __slots__ = (
        "_clock",
        "_heap",
        "_last",
        "_main",
        "_parked",
        "_pinned_in_place",
        "_rel",
        "_rel_last",
        "_released",
        "size",
    )

    def __init__(self) -> None:
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._parked: dict[bytes, int] = {}
        self._pinned_in_place: dict[bytes, None] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._rel: OrderedDict[bytes, int] = OrderedDict()
        self._rel_last = -1  # _rel's appends are newer than this (its newest stamp ever)
        self._released = 0  # keys with a valid heap entry (one each)
        self._clock = -1  # the last stamp given (ints: cheaper than itertools.count)
        self._last = -1  # the newest stamp ever appended to _main in its place
        #: Keys held (read-only for callers): those held aside during a search count (ARC
        #: compares |T1| to p between victims), those taken do not.
        self.size = 0

    def __len__(self) -> int:
        return self.size

    def __contains__(self, key: object) -> bool:
        return key in self._main or key in self._parked

    def __iter__(self) -> Iterator[bytes]:
        """Keys from the oldest to the most recent, pinned ones included."""
        if not self._parked and not self._heap and not self._rel:
            yield from self._main  # nothing out of place
            return
        entries = [*self._parked.items()]
        entries += [(k, s if s >= 0 else ~s) for k, s in self._main.items()]
        for key, _ in sorted(entries, key=itemgetter(1)):
            yield key

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
            main.move_to_end(key)
            was = main[key]
            stamp = main[key] = self._clock = self._clock + 1
            self._last = stamp
            if was < 0:  # released: its place goes
                self._drop_place(key)
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
        rel_pop = self._rel.pop
        stamp = self._clock
        last = self._last
        released = self._released
        any_released = released or self._rel  # else no key's mark needs reading
        for key in reversed(keys):
            if key in main:
                move_to_end(key)
                if any_released and main[key] < 0 and rel_pop(key, None) is None:
                    released -= 1  # released: its heap entry goes stale
                stamp += 1
                main[key] = last = stamp
            elif key in parked:
                stamp += 1
                parked[key] = stamp
        self._clock = stamp
        self._last = last
        if released != self._released:
            self._released = released
            self._compact_if_stale()

    def touch_all_promoting(self, keys: Sequence[bytes], into: StampedOrder) -> None:
        """ARC's touch: :meth:`gather_all` of ``keys`` into ``into`` from this order."""
        into.gather_all(keys, (self,))

    def gather_all(self, keys: Sequence[bytes], sources: Sequence[StampedOrder]) -> None:
        """A use that moves keys up into this order, from the last key to the first: a key of
        this order becomes its most recent; an evictable key of a ``sources`` order moves here
        as the most recent, a pinned one becomes its own order's most recent (preparing a block
        is not a second use); any other key is ignored. One clock for every order in this
        call: the keys keep the call's order, for a policy that compares the orders' stamps."""
        main, parked = self._main, self._parked
        move_to_end = main.move_to_end
        stamp = max(self._clock, *(source._clock for source in sources))
        last = self._last
        released = self._released
        any_released = released or self._rel  # else no key's mark needs reading
        moved = 0
        for key in reversed(keys):
            # The orders are disjoint: the likeliest places first.
            if key in main:
                move_to_end(key)
                if any_released and main[key] < 0 and self._rel.pop(key, None) is None:
                    released -= 1  # released: its heap entry goes stale
            elif key in parked:
                stamp += 1
                parked[key] = stamp
                continue
            else:
                for source in sources:
                    source_main = source._main
                    if key in source_main:
                        in_place = source._pinned_in_place
                        if in_place and key in in_place:  # pinned: stays, as the most recent
                            source_main.move_to_end(key)
                            was = source_main[key]
                            stamp += 1
                            source_main[key] = source._last = stamp
                            if was < 0:  # released: its place goes (after its new stamp)
                                source._drop_place(key)
                            break
                        if source_main.pop(key) < 0:
                            source._drop_place(key)
                        source.size -= 1
                        moved += 1
                        stamp += 1
                        main[key] = last = stamp
                        break
                    if key in source._parked:
                        stamp += 1
                        source._parked[key] = stamp
                        break
                continue
            stamp += 1
            main[key] = last = stamp
        self._clock, self._last = stamp, last
        for source in sources:
            source._clock = stamp
        self.size += moved
        if released != self._released:
            self._released = released
            self._compact_if_stale()

    def discard(self, key: bytes) -> bool:
        """Remove ``key``; return whether it was present."""
        stamp = self._main.pop(key, None)
        if stamp is None:
            if self._parked.pop(key, None) is None:
                return False
        else:
            if self._pinned_in_place:
                self._pinned_in_place.pop(key, None)
            if stamp < 0:  # released: its place goes
                self._drop_place(key)
        self.size -= 1
        return True

    def clear(self) -> None:
        self._main.clear()
        self._parked.clear()
        self._pinned_in_place.clear()
        self._heap.clear()
        self._rel.clear()
        self._rel_last = -1
        self._released = 0
        self._clock = -1
        self._last = -1
        self.size = 0

    @property
    def stale_heap_entries(self) -> int:
        """Heap entries no longer valid (for tests: at most 3x the valid ones plus a slack)."""
        return len(self._heap) - self._released

    def _drop_place(self, key: bytes) -> None:
        """A released ``key`` left ``_main``: drop its place in ``_rel``, or count its heap
        entry stale."""
        if self._rel.pop(key, None) is None:
            self._released -= 1
            self._compact_if_stale()

    def _compact_if_stale(self) -> None:
        """Compact the heap if its stale entries outnumber the valid ones (times the factor) by
        more than the slack: the calls that made them stale pay for it, O(1) amortized each."""
        if len(self._heap) - self._released > _STALE_FACTOR * self._released + _STALE_SLACK:
            self._compact_heap()

    def _compact_heap(self) -> None:
        """Keep one entry per released key (stale ones and duplicates go): O(entries)."""
        get, rel = self._main.get, self._rel
        heap = [e for e in self._heap if get(e[1]) == ~e[0] and e[1] not in rel]
        if len(heap) != self._released:
            # Duplicates: a key pinned and released again at the same stamp has two entries,
            # both valid. A dict keeps one per key (rare enough to pay a second pass for).
            heap = list({entry[1]: entry for entry in heap}.values())
        heapq.heapify(heap)
        self._heap = heap
