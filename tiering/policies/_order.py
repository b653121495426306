"""A recency order whose oldest-first victim search skips pinned keys in O(log n) per victim,
with no pause that grows with the number of pinned keys.

Every policy list (LRU's single list, ARC's T1 and T2) is one :class:`RecencyOrder`.

Stamps. Every use of a key (add, touch) gives it a *stamp* from a counter, so the true recency
order is the order of stamps. A key's stamp is kept wherever the key is:

- ``_main``: an ``OrderedDict`` key -> stamp of the evictable keys and of the keys *pinned in
  place* (below). A use appends the key at the tail with a new stamp, so ``_main`` is in stamp
  order, except for *released* keys (below);
- ``_parked``: key -> stamp of the other keys that may not be evicted (being written, or pinned
  and parked). A victim search never meets a parked key.

Pins in place. Pinning an evictable key only marks it (``_pinned_in_place``, a dict): a load is
pinned and let go within a step or two, usually before any victim search reaches its place, and
letting a marked key go is one dict deletion that leaves it where it was. Marked keys stay few:
once more than ``_PINNED_IN_PLACE_MAX`` are, the pinning call parks them all (O(1) amortized per
pin), and a victim search that meets a marked key parks it and every other marked key at once.
So a search parks at most that many pinned keys, whatever the number pinned, and no key is
parked twice for one pin.

Partners. ARC's two lists share one ``_pinned_in_place`` dict (:meth:`share_pins_with`): a
caller that knows a key is held and evictable in one of them pins it with one dict insertion
(:meth:`pin_all_in_place`), without looking up which list holds it. Each list's victim search
and touches meet only its own keys, so a shared mark means the same as a list's own; parking
moves each marked key out of whichever list holds it.

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

Why this is exact. Stamps of the keys in their place increase along ``_main``, and a released
key sits behind every key in its place that is older than it. So the oldest evictable key is the
oldest of ``_rel``'s head, the heap's valid top and ``_main``'s head: if the head is released,
one of the other two is at least as old (the head's own place is there). A victim search
(:meth:`take`) takes from those three; protected keys it meets are held aside and return
released (to the heap), as do the victims of a search the caller undoes: a search that fails
changes nothing a caller can observe.

Cost. Adding, touching and pinning a key are O(1) amortized; unpinning is O(1) (a key pinned
in place: one dict deletion) or one heap push; a victim is one ``popitem`` (with nothing
released), O(1) from ``_rel`` or O(log n) heap work. Keys released out of order and then pinned
or used leave stale heap entries that a victim search may meet (bounded as above); a search
parks at most ``_PINNED_IN_PLACE_MAX`` keys pinned in place. No call does work that grows with
the number of pinned keys.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence
from operator import itemgetter

__all__ = ["RecencyOrder"]

# Compact the heap once its stale entries outnumber _STALE_FACTOR times the valid ones by more
# than _STALE_SLACK: a compaction visits (1 + 1/_STALE_FACTOR) entries per stale one it drops
# (each visit a dict probe), and small heaps are not worth compacting.
_STALE_FACTOR = 3
_STALE_SLACK = 64

# Keys pinned while evictable stay where they are (marked) until more than this many are: then
# the pinning call moves them all out of the victim search. A search that meets one moves them
# all (at most this many), and a load that is pinned and let go in between costs two dict
# operations and keeps its place.
_PINNED_IN_PLACE_MAX = 256

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
        "_partner",
        "_pinned_in_place",
        "_rel",
        "_rel_last",
        "_released",
        "_taken_keys",
        "_taken_stamps",
        "size",
    )

    def __init__(self) -> None:
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._parked: dict[bytes, int] = {}
        self._pinned_in_place: dict[bytes, None] = {}
        self._partner: RecencyOrder | None = None  # the order sharing _pinned_in_place
        self._heap: list[tuple[int, bytes]] = []
        self._rel: OrderedDict[bytes, int] = OrderedDict()
        self._rel_last = -1  # _rel's appends are newer than this (its newest stamp ever)
        self._released = 0  # keys with a valid heap entry (one each)
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
        if not self._parked and not self._heap and not self._rel:
            yield from self._main  # nothing out of place
            return
        entries = [*self._parked.items()]
        entries += [(k, s if s >= 0 else ~s) for k, s in self._main.items()]
        for key, _ in sorted(entries, key=itemgetter(1)):
            yield key

    def share_pins_with(self, partner: RecencyOrder) -> None:
        """Share this order's keys pinned in place with ``partner`` (both empty): one mark
        pins a key of either (ARC's T1 and T2)."""
        if self.size or partner.size or self._partner or partner._partner:
            raise ValueError("share_pins_with: both orders must be empty and unpartnered")
        partner._pinned_in_place = self._pinned_in_place
        self._partner, partner._partner = partner, self

    @property
    def evictable_count(self) -> int:
        """How many keys may be evicted (protected ones included); with a partner, in the two
        orders together (the keys pinned in place are counted once, in neither)."""
        count = self.size - len(self._parked) - len(self._pinned_in_place)
        partner = self._partner
        if partner is not None:
            count += partner.size - len(partner._parked)
        return count

    def is_evictable(self, key: bytes) -> bool:
        return key not in self._parked and key not in self._pinned_in_place

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

    def touch_all_promoting(self, keys: Sequence[bytes], into: RecencyOrder) -> None:
        """ARC's touch, from the last key to the first: an evictable key of this order moves to
        ``into`` as its most recent, a pinned one becomes this order's most recent (preparing a
        block is not a second use), any other key is touched in ``into`` (absent: ignored)."""
        main, parked, in_place = self._main, self._parked, self._pinned_in_place
        into_main, into_parked = into._main, into._parked
        move_to_end = into_main.move_to_end
        stamp, last, into_stamp, into_last = self._clock, self._last, into._clock, into._last
        moved = 0
        into_released = into._released
        released = self._released
        into_any_released = into_released or into._rel  # else no key's mark needs reading
        for key in reversed(keys):
            # The lists are disjoint: the likeliest places first.
            if key in into_main:
                move_to_end(key)
                if into_any_released and into_main[key] < 0 and into._rel.pop(key, None) is None:
                    into_released -= 1  # released: its heap entry goes stale
            elif key in main:
                if in_place and key in in_place:  # pinned: stays, as the most recent
                    main.move_to_end(key)
                    if main[key] < 0 and self._rel.pop(key, None) is None:
                        released -= 1  # released: its heap entry goes stale
                    stamp += 1
                    main[key] = last = stamp
                    continue
                if main.pop(key) < 0 and self._rel.pop(key, None) is None:
                    released -= 1  # released: its heap entry goes stale
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
        self._clock, self._last, into._clock, into._last = stamp, last, into_stamp, into_last
        if moved:
            self.size -= moved
            into.size += moved
        if released != self._released:
            self._released = released
            self._compact_if_stale()
        if into_released != into._released:
            into._released = into_released
            into._compact_if_stale()

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
        ``not evictable`` undoes it, exactly as far as any caller can observe.

        With a partner (shared pins), letting keys go also lets go the partner's keys pinned in
        place (changed here); the undo reports those absent, for the partner to pin again."""
        main, parked, in_place = self._main, self._parked, self._pinned_in_place
        changed: list[bytes] = []
        absent: list[bytes] = []
        if evictable:
            heap, rel = self._heap, self._rel
            last, rel_last = self._last, self._rel_last
            pushed = len(heap)
            for key in keys:
                if key in in_place:  # pinned where it stood: nothing moved
                    del in_place[key]
                    changed.append(key)
                    continue
                stamp = parked.pop(key, None)
                if stamp is None:
                    if key not in main:
                        absent.append(key)
                    continue
                changed.append(key)
                if stamp > last:  # nothing newer in _main: the tail is its place
                    main[key] = last = stamp
                    continue
                main[key] = ~stamp  # released
                if stamp > rel_last:  # in order: _rel keeps its place
                    rel[key] = rel_last = stamp
                else:
                    _heappush(heap, (stamp, key))
            self._released += len(heap) - pushed
            self._last, self._rel_last = last, rel_last
        else:
            for key in keys:
                if key in main:
                    if key not in in_place:
                        in_place[key] = None
                        changed.append(key)
                elif key not in parked:
                    absent.append(key)  # (or the partner's: the caller asks it next)
            self._park_if_many_in_place()
        return changed, absent

    def pin_all_in_place(self, keys: Iterable[bytes]) -> None:
        """Forbid evicting ``keys``, which the caller guarantees are evictable in this order or
        its partner and listed once: each is marked where it stands (no lookup of its place)."""
        in_place = self._pinned_in_place
        for key in keys:
            in_place[key] = None
        self._park_if_many_in_place()

    def _park_if_many_in_place(self) -> None:
        if len(self._pinned_in_place) > _PINNED_IN_PLACE_MAX:
            stale = self._park_pinned_in_place()
            if stale:
                self._released -= stale
                self._compact_if_stale()

    def oldest_stamp(self) -> int:
        """The stamp of the oldest key a victim search meets first (``-1`` if none): to
        compare two orders whose stamps come from one clock (``sync_clock``)."""
        heap, get = self._heap, self._main.get
        while heap and (get(heap[0][1]) != ~heap[0][0] or heap[0][1] in self._rel):
            _heappop(heap)  # stale, as take() would drop it
        stamps = [heap[0][0]] if heap else []
        if self._rel:
            stamps.append(next(iter(self._rel.values())))
        if self._main:
            value = next(iter(self._main.values()))
            stamps.append(value if value >= 0 else ~value)
        return min(stamps) if stamps else -1

    def sync_clock(self, other: RecencyOrder) -> None:
        """Advance both orders' clocks to the later one: stamps given afterwards compare."""
        clock = max(self._clock, other._clock)
        self._clock = other._clock = clock

    # -- victim search ------------------------------------------------------------------------

    def take(self, n: int, protected: Container[bytes]) -> list[bytes]:
        """Remove and return up to ``n`` of the oldest evictable keys not in ``protected``,
        oldest first (fewer if there are no more).

        :meth:`end_search` commits or undoes every removal since the last search ended.
        """
        main, heap, rel = self._main, self._heap, self._rel
        parked, in_place = self._parked, self._pinned_in_place
        popitem, get = main.popitem, main.get
        got: list[bytes] = []
        stamps = self._taken_stamps
        aside = self._aside
        released = self._released
        while n:
            # The oldest released key, if any: _rel's head or the heap's valid top.
            while heap:
                top_stamp, top_key = heap[0]
                if get(top_key) == ~top_stamp and top_key not in rel:
                    break
                _heappop(heap)  # stale: used, pinned or taken since it was pushed
            else:
                top_stamp = -1
            from_heap = top_stamp >= 0
            if rel:
                rel_key, rel_stamp = next(iter(rel.items()))
                if not from_heap or rel_stamp < top_stamp:
                    top_key, top_stamp, from_heap = rel_key, rel_stamp, False
            # Victims from the head of _main while it is not newer than that key (all of them
            # when nothing is released: the usual case).
            while n and main:
                key, value = popitem(False)
                stamp = value if value >= 0 else ~value
                if 0 <= top_stamp < stamp:
                    main[key] = value  # newer than the oldest released key: back to the head
                    main.move_to_end(key, False)
                    break
                if value < 0 and rel.pop(key, None) is None:
                    released -= 1  # released: its heap entry goes stale
                if in_place and key in in_place:  # pinned where it stood: park it, and the
                    del in_place[key]  # others pinned in place (near the oldest end too)
                    parked[key] = stamp
                    released -= self._park_pinned_in_place()
                    continue
                if key in protected:
                    aside.append((stamp, key))
                    continue
                got.append(key)
                stamps.append(stamp)
                n -= 1
            if not n or top_stamp < 0:
                break  # done, or nothing is left anywhere
            if get(top_key) != ~top_stamp:
                continue  # it was _main's head: taken or set aside above
            del main[top_key]
            if from_heap:
                _heappop(heap)
                released -= 1
            else:
                del rel[top_key]
            if in_place and top_key in in_place:  # pinned where it stood: as above
                del in_place[top_key]
                parked[top_key] = top_stamp
                released -= self._park_pinned_in_place()
                continue
            if top_key in protected:
                aside.append((top_stamp, top_key))
                continue
            got.append(top_key)
            stamps.append(top_stamp)
            n -= 1
        if got:
            self.size -= len(got)
            self._taken_keys += got
        if released != self._released:  # released keys taken from _main's head
            self._released = released
            self._compact_if_stale()
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
                main[key] = ~stamp
                _heappush(heap, (stamp, key))
            self._released += len(aside)
            aside.clear()

    def clear(self) -> None:
        self._main.clear()
        self._parked.clear()
        self._pinned_in_place.clear()
        self._heap.clear()
        self._rel.clear()
        self._rel_last = -1
        self._released = 0
        self._aside.clear()
        self._taken_keys.clear()
        self._taken_stamps.clear()
        self._clock = -1
        self._last = -1
        self.size = 0

    @property
    def stale_heap_entries(self) -> int:
        """Heap entries no longer valid (for tests: at most 3x the valid ones plus a slack)."""
        return len(self._heap) - self._released

    def _park_pinned_in_place(self) -> int:
        """Move every key pinned in place out of ``_main`` into ``_parked``: O(keys), at most
        ``_PINNED_IN_PLACE_MAX``. Returns how many valid heap entries went stale; the caller
        takes them off ``_released`` (no compaction here: :meth:`take` holds the heap). The
        partner's marked keys (pins are shared) go to the partner's ``_parked``."""
        stale, elsewhere = self._park_keys(self._pinned_in_place)
        self._pinned_in_place.clear()
        if elsewhere:
            assert self._partner is not None
            partner_stale, _ = self._partner._park_keys(elsewhere)
            if partner_stale:  # the partner holds no search: it settles them at once
                self._partner._released -= partner_stale
                self._partner._compact_if_stale()
        return stale

    def _park_keys(self, keys: Iterable[bytes]) -> tuple[int, list[bytes]]:
        """Move ``keys`` of ``_main`` into ``_parked``. Returns how many valid heap entries went
        stale, and the keys ``_main`` does not hold (the partner's; or, from a caller of
        :meth:`pin_all_in_place` that broke its word, neither's: dropped by the partner)."""
        main, parked, rel_pop = self._main, self._parked, self._rel.pop
        stale = 0
        elsewhere: list[bytes] = []
        for key in keys:
            stamp = main.pop(key, None)
            if stamp is None:
                elsewhere.append(key)
                continue
            if stamp < 0:  # released: its place goes
                stamp = ~stamp
                if rel_pop(key, None) is None:  # its heap entry goes stale
                    stale += 1
            parked[key] = stamp
        return stale, elsewhere

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
