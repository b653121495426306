"""Adaptive Replacement Cache (Megiddo and Modha, FAST 2003), adapted to pinned keys.

T1 holds keys used once, T2 keys used at least twice; B1 and B2 are their ghost lists (keys
only). The target size of T1, ``p``, grows on a B1 ghost hit and shrinks on a B2 ghost hit.

Differences from the paper, all forced by the ``EvictionPolicy`` call sequence (the tier calls
``evict`` to make room, then ``insert``):

- Adaptation to a ghost hit happens at :meth:`ARCPolicy.insert` of that key, i.e. after the
  eviction that made room for it; the paper adapts first, then replaces.
- Tie rule: :meth:`ARCPolicy.evict` takes from T1 when ``|T1| > p``, else from T2. The paper
  also takes from T1 when ``|T1| == p`` and the incoming key is in B2; ``evict`` does not know
  the incoming key, so a tie goes to T2.
- A list with no evictable key does not fail the eviction: the victim comes from the other list.
- Touching a key of T1 that is not evictable (still being written) keeps it in T1 at the MRU
  end: preparing a block is not a second use.

The ghost lists are trimmed from their oldest end so that ``|T1| + |B1| <= capacity`` and
``|T1| + |T2| + |B1| + |B2| <= 2 * capacity``, as far as trimming ghosts allows.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from typing import ClassVar

from tiering.policies._checks import (
    check_evict_count,
    check_insert_key,
    protected_set,
)
from tiering.policies._two_lists import TwoListPolicy

__all__ = ["ARCPolicy"]


class ARCPolicy(TwoListPolicy):
    """Adaptive Replacement Cache over T1/T2 with ghost lists B1/B2 and adaptive target ``p``.

    A victim search never meets a pinned key: O(log n) per victim at most (see
    :mod:`tiering.policies._order`).
    """

    name = "arc"

    #: ``p`` starts at this share of the capacity and never goes below ``_FLOOR_SHARE`` of it
    #: (ARC: 0 and 0; a subclass may change them).
    _INITIAL_SHARE: ClassVar[float] = 0.0
    _FLOOR_SHARE: ClassVar[float] = 0.0

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._target_floor = self._FLOOR_SHARE * capacity
        self._target_t1_size = self._INITIAL_SHARE * capacity

    # -- read-only views (tests, debugging) ---------------------------------------------------

    @property
    def target_t1_size(self) -> float:
        """ARC's adaptive target size ``p`` of T1, in keys, within ``[0, capacity]``."""
        return self._target_t1_size

    @property
    def b1_keys(self) -> tuple[bytes, ...]:
        """Ghosts of keys evicted from T1, oldest first."""
        return tuple(self._b1)

    @property
    def b2_keys(self) -> tuple[bytes, ...]:
        """Ghosts of keys evicted from T2, oldest first."""
        return tuple(self._b2)

    # -- EvictionPolicy -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[bytes]:
        # ``p`` does not change during eviction, so successive ``evict(1)`` calls (with every
        # key evictable) take keys in exactly this order.
        t1, t2 = iter(self._t1), iter(self._t2)
        t1_left, t2_left = len(self._t1), len(self._t2)
        target = self._arc_target()
        while t1_left and t2_left:
            if t1_left > target:
                t1_left -= 1
                yield next(t1)
            else:
                t2_left -= 1
                yield next(t2)
        yield from t1
        yield from t2

    def insert(self, key: bytes, evictable: bool = True) -> None:
        if type(key) is not bytes:
            check_insert_key(key)
        b1, b2 = self._b1, self._b2
        # Ghosts and held keys are disjoint: a ghost hit needs no presence check.
        if key in b1 or key in b2:
            from_b1 = key in b1
            self._target_t1_size = ghost_hit_target(
                self._target_t1_size, from_b1, len(b1), len(b2), self.capacity, self._target_floor
            )
            del (b1 if from_b1 else b2)[key]
            self._t2.add(key, evictable)
        else:
            if key in self._t2 or not self._t1.add_new(key, evictable):
                raise KeyError(key)
            self._trim_ghosts()

    def insert_new(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        t1, t2 = self._t1, self._t2
        # insert() key by key, with the lists' sizes kept here: ghost hits go to T2, other keys
        # to T1, each trimming the ghosts as it would (a trim can drop a later key's ghost).
        b1, b2 = self._b1, self._b2
        capacity = self.capacity
        t1_size, t2_size = t1.size, t2.size
        b1_size, b2_size = len(b1), len(b2)  # kept here: a len() call per test adds up
        p = self._target_t1_size
        to_t1: list[bytes] = []
        to_t2: list[bytes] = []
        for key in keys:
            if key in b1:
                p = ghost_hit_target(p, True, b1_size, b2_size, capacity, self._target_floor)
                del b1[key]
                b1_size -= 1
                to_t2.append(key)
                t2_size += 1
            elif key in b2:
                p = ghost_hit_target(p, False, b1_size, b2_size, capacity, self._target_floor)
                del b2[key]
                b2_size -= 1
                to_t2.append(key)
                t2_size += 1
            else:
                to_t1.append(key)
                t1_size += 1
                held_size = t1_size + t2_size
                if t1_size + b1_size > capacity or held_size + b1_size + b2_size > 2 * capacity:
                    while b1_size and t1_size + b1_size > capacity:
                        b1.popitem(last=False)
                        b1_size -= 1
                    while b2_size and held_size + b1_size + b2_size > 2 * capacity:
                        b2.popitem(last=False)
                        b2_size -= 1
                    while b1_size and held_size + b1_size > 2 * capacity:
                        b1.popitem(last=False)
                        b1_size -= 1
        self._target_t1_size = p
        if not (t1.add_all(to_t1, evictable) and t2.add_all(to_t2, evictable)):
            raise KeyError("insert_new: a key was held already or listed twice")

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        if type(n) is not int or n < 0:
            check_evict_count(n)
        guard = protected if type(protected) is set else protected_set(protected)
        if n == 0:
            return []
        t1, t2 = self._t1, self._t2
        if n > t1.evictable_count:  # of T1 and T2 together (partners)
            return None  # hopeless: fail before any search
        # One victim at a time: from T1 while |T1| > p (|T1| shrinks with each T1 victim; p
        # does not change), else from T2; a list with nothing evictable left gives way to the
        # other. Taken in runs, that is: T1 until |T1| <= p, then T2, then T1 again.
        t1_size = t1.size
        p = self._arc_target()
        from_t1 = min(n, t1_size - math.floor(p)) if t1_size > p else 0
        try:
            to_b1 = t1.take(from_t1, guard) if from_t1 else []
            to_b2 = t2.take(n - len(to_b1), guard) if n > len(to_b1) else []
            short = n - len(to_b1) - len(to_b2)
            more_b1 = t1.take(short, guard) if short else []
        except BaseException:
            t1.end_search(undo=True)
            t2.end_search(undo=True)
            raise
        found_all = len(more_b1) == short
        t1.end_search(undo=not found_all)
        t2.end_search(undo=not found_all)
        if not found_all:
            return None
        b1 = self._b1
        for key in to_b1:
            b1[key] = None
        for key in more_b1:
            b1[key] = None
        b2 = self._b2
        for key in to_b2:
            b2[key] = None
        self._trim_ghosts()
        return to_b1 + to_b2 + more_b1

    def clear(self) -> None:
        super().clear()
        self._b1.clear()
        self._b2.clear()
        self._target_t1_size = self._INITIAL_SHARE * self.capacity

    # -- internals ----------------------------------------------------------------------------

    def _arc_target(self) -> float:
        # The ``p`` that ARC's victim rule compares |T1| with (a subclass may keep another).
        return self._target_t1_size

    def _trim_ghosts(self) -> None:
        t1_size = self._t1.size
        trim_ghosts(self._b1, self._b2, t1_size, t1_size + self._t2.size, self.capacity)


def ghost_hit_target(
    target: float, from_b1: bool, b1_size: int, b2_size: int, capacity: int, floor: float
) -> float:
    """ARC's target for T1 after a ghost hit: a B1 hit (new blocks left too early) raises it
    by ``max(1, |B2| / |B1|)`` up to ``capacity``, a B2 hit lowers it by ``max(1, |B1| / |B2|)``
    down to ``floor``. Sizes are the ghost lists' before the hit key leaves its list."""
    if from_b1:
        return min(target + max(1.0, b2_size / b1_size), float(capacity))
    return max(target - max(1.0, b1_size / b2_size), floor)


def trim_ghosts(
    b1: OrderedDict[bytes, None],
    b2: OrderedDict[bytes, None],
    t1_size: int,
    held_size: int,
    capacity: int,
) -> None:
    """Drop the oldest ghosts until ``|T1| + |B1| <= capacity`` and all four lists hold at most
    ``2 * capacity`` keys, as far as dropping ghosts allows (ARC's bounds)."""
    if t1_size + len(b1) <= capacity and held_size + len(b1) + len(b2) <= 2 * capacity:
        return  # the usual case: nothing to trim
    while b1 and t1_size + len(b1) > capacity:
        b1.popitem(last=False)
    while b2 and held_size + len(b1) + len(b2) > 2 * capacity:
        b2.popitem(last=False)
    while b1 and held_size + len(b1) > 2 * capacity:
        b1.popitem(last=False)
