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

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence

from tiering.policies._checks import (
    check_evict_count,
    check_insert_key,
    check_touch_keys,
    protected_set,
)
from tiering.policies._order import RecencyOrder
from tiering.policies.base import EvictionPolicy

__all__ = ["ARCPolicy"]


class ARCPolicy(EvictionPolicy):
    """Adaptive Replacement Cache over T1/T2 with ghost lists B1/B2 and adaptive target ``p``.

    Victim search skips pinned keys in O(1) amortized time (see :mod:`tiering.policies._order`).
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1 = RecencyOrder()
        self._t2 = RecencyOrder()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._target_t1_size = 0.0

    # -- read-only views (tests, debugging) ---------------------------------------------------

    @property
    def target_t1_size(self) -> float:
        """ARC's adaptive target size ``p`` of T1, in keys, within ``[0, capacity]``."""
        return self._target_t1_size

    @property
    def t1_keys(self) -> tuple[bytes, ...]:
        """Keys used once, oldest first."""
        return tuple(self._t1)

    @property
    def t2_keys(self) -> tuple[bytes, ...]:
        """Keys used at least twice, oldest first."""
        return tuple(self._t2)

    @property
    def b1_keys(self) -> tuple[bytes, ...]:
        """Ghosts of keys evicted from T1, oldest first."""
        return tuple(self._b1)

    @property
    def b2_keys(self) -> tuple[bytes, ...]:
        """Ghosts of keys evicted from T2, oldest first."""
        return tuple(self._b2)

    # -- EvictionPolicy -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t2 or key in self._t1

    def __iter__(self) -> Iterator[bytes]:
        # ``p`` does not change during eviction, so successive ``evict(1)`` calls (with every
        # key evictable) take keys in exactly this order.
        t1, t2 = iter(self._t1), iter(self._t2)
        t1_left, t2_left = len(self._t1), len(self._t2)
        while t1_left and t2_left:
            if t1_left > self._target_t1_size:
                t1_left -= 1
                yield next(t1)
            else:
                t2_left -= 1
                yield next(t2)
        yield from t1
        yield from t2

    def insert(self, key: bytes, evictable: bool = True) -> None:
        check_insert_key(key)
        if key in self:
            raise KeyError(key)
        b1, b2 = self._b1, self._b2
        if key in b1:
            step = max(1.0, len(b2) / len(b1))
            self._target_t1_size = min(self._target_t1_size + step, float(self.capacity))
            del b1[key]
            self._t2.add(key, evictable)
        elif key in b2:
            step = max(1.0, len(b1) / len(b2))
            self._target_t1_size = max(self._target_t1_size - step, 0.0)
            del b2[key]
            self._t2.add(key, evictable)
        else:
            self._t1.add(key, evictable)
            self._trim_ghosts()

    def touch(self, keys: Sequence[bytes]) -> None:
        check_touch_keys(keys)
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            if key in t1:
                if t1.is_evictable(key):
                    t1.discard(key)
                    t2.add(key, True)
                else:
                    t1.touch(key)
            else:
                t2.touch(key)  # absent and ghost keys are ignored: adaptation is at insert

    def set_evictable(self, key: bytes, evictable: bool) -> None:
        if not (self._t1.set_evictable(key, evictable) or self._t2.set_evictable(key, evictable)):
            raise KeyError(key)

    def remove(self, key: bytes) -> None:
        if not self._t1.discard(key):
            self._t2.discard(key)

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        check_evict_count(n)
        guard = protected_set(protected)
        if n == 0:
            return []
        if n > self._t1.evictable_count + self._t2.evictable_count:
            return None  # hopeless: fail before any search
        t1, t2 = self._t1, self._t2
        victims: list[bytes] = []
        to_b1: list[bytes] = []
        to_b2: list[bytes] = []
        found_all = False
        try:
            for _ in range(n):
                # len(t1) already excludes the victims taken so far in this call.
                from_t1 = len(t1) > self._target_t1_size
                key = (t1 if from_t1 else t2).pop_oldest(guard)
                if key is None:  # nothing evictable there: take from the other list
                    from_t1 = not from_t1
                    key = (t1 if from_t1 else t2).pop_oldest(guard)
                    if key is None:
                        break
                victims.append(key)
                (to_b1 if from_t1 else to_b2).append(key)
            else:
                found_all = True
        finally:
            t1.end_search(undo=not found_all)
            t2.end_search(undo=not found_all)
        if not found_all:
            return None
        for ghosts, keys in ((self._b1, to_b1), (self._b2, to_b2)):
            for key in keys:
                ghosts[key] = None
        self._trim_ghosts()
        return victims

    def clear(self) -> None:
        self._t1.clear()
        self._t2.clear()
        self._b1.clear()
        self._b2.clear()
        self._target_t1_size = 0.0

    # -- internals ----------------------------------------------------------------------------

    def _trim_ghosts(self) -> None:
        capacity, b1, b2 = self.capacity, self._b1, self._b2
        t1_size, held = len(self._t1), len(self._t1) + len(self._t2)
        if t1_size + len(b1) <= capacity and held + len(b1) + len(b2) <= 2 * capacity:
            return  # the usual case: nothing to trim
        while b1 and t1_size + len(b1) > capacity:
            b1.popitem(last=False)
        while b2 and held + len(b1) + len(b2) > 2 * capacity:
            b2.popitem(last=False)
        while b1 and held + len(b1) > 2 * capacity:
            b1.popitem(last=False)
