"""A recency order whose oldest-first victim search skips pinned keys in O(log n) per victim,
with no pause that grows with the number of pinned keys.

Every policy list (LRU's single list, ARC's T1 and T2) is one :class:`RecencyOrder`.

This module holds the pins and the victim search; the keys, their stamps and the places of keys
released out of order are held by its base, :class:`~tiering.policies._stamped_order.StampedOrder`
(``_main``, ``_parked``, ``_rel``, ``_heap``: see that module).

Pins in place. Pinning an evictable key only marks it (``_pinned_in_place``, a dict): a load is
pinned and let go within a step or two, usually before any victim search reaches its place, and
letting a marked key go is one dict deletion that leaves it where it was. Marked keys stay few:
once more than ``_PINNED_IN_PLACE_MAX`` are, the pinning call parks them all (O(1) amortized per
pin), and a victim search that meets a marked key parks it and every other marked key at once.
So a search parks at most that many pinned keys, whatever the number pinned, and no key is
parked twice for one pin.

Partners. ARC's two lists (chain's three) share one ``_pinned_in_place`` dict
(:meth:`share_pins_with`): a caller that knows a key is held and evictable in one of them pins
it with one dict insertion (:meth:`pin_all_in_place`), without looking up which list holds it.
Each list's victim search and touches meet only its own keys, so a shared mark means the same
as a list's own; parking moves each marked key out of whichever list holds it.

Unpinning a parked key puts it back at the tail of ``_main`` with its stamp, or *releases* it:
its true place is then kept in ``_rel`` or ``_heap`` (see
:mod:`~tiering.policies._stamped_order`).

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
from collections.abc import Container, Iterable

from tiering.policies._stamped_order import StampedOrder

__all__ = ["RecencyOrder"]

# Keys pinned while evictable stay where they are (marked) until more than this many are: then
# the pinning call moves them all out of the victim search. A search that meets one moves them
# all (at most this many), and a load that is pinned and let go in between costs two dict
# operations and keeps its place.
_PINNED_IN_PLACE_MAX = 256

_heappop = heapq.heappop
_heappush = heapq.heappush


class RecencyOrder(StampedOrder):
    """Keys in recency order with pinning; the oldest evictable keys in O(log n) each.

    Not thread-safe. Callers of :meth:`take` must call :meth:`end_search` once the search (one
    ``evict`` call, possibly several :meth:`take` calls) is over, to commit or undo it.
    """

    __slots__ = ("_aside", "_partners", "_taken_keys", "_taken_stamps")

    def __init__(self) -> None:
        super().__init__()
        self._partners: tuple[RecencyOrder, ...] = ()  # the orders sharing _pinned_in_place
        self._aside: list[tuple[int, bytes]] = []
        self._taken_keys: list[bytes] = []
        self._taken_stamps: list[int] = []

    def share_pins_with(self, partner: RecencyOrder) -> None:
        """Share this order's keys pinned in place with ``partner`` (both empty; ``partner``
        unpartnered): one mark pins a key of any order of the group (ARC's T1 and T2; called
        again for each further order, chain's four lists)."""
        if self.size or partner.size or partner._partners or partner is self:
            raise ValueError("share_pins_with: both orders must be empty, the partner unpartnered")
        group = (self, *self._partners, partner)
        for order in group:
            order._pinned_in_place = self._pinned_in_place
            order._partners = tuple(other for other in group if other is not order)

    @property
    def evictable_count(self) -> int:
        """How many keys may be evicted (protected ones included); with partners, in all the
        orders together (the keys pinned in place are counted once, in none)."""
        count = self.size - len(self._parked) - len(self._pinned_in_place)
        for partner in self._partners:
            count += partner.size - len(partner._parked)
        return count

    def is_evictable(self, key: bytes) -> bool:
        return key not in self._parked and key not in self._pinned_in_place

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

    def take_one(self, protected: Container[bytes]) -> tuple[bytes, int] | None:
        """:meth:`take` of one key, with its stamp (``None`` if no key is left)."""
        main = self._main
        if not self._heap and not self._rel and not self._pinned_in_place:
            # Nothing released or pinned in place: _main's head is the oldest key (a victim
            # search per key of a policy that compares lists, as chain's: kept lean).
            while main:
                key, stamp = main.popitem(False)
                if key in protected:
                    self._aside.append((stamp, key))
                    continue
                self.size -= 1
                self._taken_keys.append(key)
                self._taken_stamps.append(stamp)
                return key, stamp
            return None
        got = self.take(1, protected)
        return (got[0], self._taken_stamps[-1]) if got else None

    def put_back_last(self) -> None:
        """Return the key the last :meth:`take` of this search took, as if not taken: it is
        back in its place when the search ends (kept or undone), its stamp unchanged."""
        key, stamp = self._taken_keys.pop(), self._taken_stamps.pop()
        self.size += 1
        self._aside.append((stamp, key))

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
        super().clear()
        self._aside.clear()
        self._taken_keys.clear()
        self._taken_stamps.clear()

    def _park_pinned_in_place(self) -> int:
        """Move every key pinned in place out of ``_main`` into ``_parked``: O(keys), at most
        ``_PINNED_IN_PLACE_MAX``. Returns how many valid heap entries went stale; the caller
        takes them off ``_released`` (no compaction here: :meth:`take` holds the heap). The
        partners' marked keys (pins are shared) go to their own ``_parked``."""
        stale, elsewhere = self._park_keys(self._pinned_in_place)
        self._pinned_in_place.clear()
        for partner in self._partners:
            if not elsewhere:
                break
            partner_stale, elsewhere = partner._park_keys(elsewhere)
            if partner_stale:  # a partner holds no search: it settles them at once
                partner._released -= partner_stale
                partner._compact_if_stale()
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
