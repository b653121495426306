"""Segmented LRU with a ghost list, for KV-cache prefix traffic (``"slru"``).

Why. On production-shaped traffic (:mod:`tiering.replay.workloads`) a KV cache sees three kinds
of blocks: roots every request of a tenant shares (system and tool prompts), conversation and
agent contexts that come back after a think time, and long one-off documents that never
return. LRU gives a one-off document's blocks the same lifetime as a conversation's; ARC
protects blocks used twice but adapts its target so that, on this traffic, recent
conversations are evicted before stale reused blocks (it trails LRU at every size above 1 %
of the unique blocks). This policy keeps LRU's behaviour where LRU is near the optimum (large
caches) and filters one-off blocks where LRU is far from it (small caches).

Decisions:

- **Probation and protected.** A new key enters *probation*; a touch (a reuse: a load of a
  held block) moves it to *protected* (most recent there). Pinned keys touched stay where they
  are (preparing a block is not a second use).
- **Victims.** From probation's least recent end while probation holds more than
  ``PROBATION_SHARE`` of the capacity (60 %), else from protected's; a list with nothing
  evictable gives way to the other. A one-off document thus leaves before any reused root
  or context, while a new conversation turn has most of the cache's lifetime to come back.
- **Ghosts.** A key evicted from probation is remembered (key only, at most ``capacity`` of
  them, oldest dropped first). A key inserted again while remembered goes straight to
  protected: it was reused, only later than probation could wait.
- **Prefix order.** The manager touches a request's blocks with the first most recent and
  inserts them in prefix order: within a request, deeper blocks are evicted before the
  blocks they depend on, in both lists.
- Evicted protected keys leave no ghost: they had their chance.

The share is fixed, not adapted: adapting it with ghost hits (ARC) chases the last burst and,
on this traffic, loses to a fixed share. 60 % was chosen on the generated traces (sweep of
0.3-0.75 in ``benchmarks/bench_policies.py``'s notes, docs/benchmarks.md).

Implementation: ARC's machinery (two :class:`~tiering.policies._order.RecencyOrder` lists
sharing pins; O(1) amortized per key, a victim search never meets a pinned key) with a fixed
target and a single ghost list.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering.policies._checks import check_insert_key
from tiering.policies.arc import ARCPolicy

__all__ = ["SLRUPolicy"]


class SLRUPolicy(ARCPolicy):
    """Segmented LRU: probation (60 % share) and protected, with probation ghosts.

    See the module docstring for each decision. ``t1_keys`` are probation's keys, ``t2_keys``
    protected's, ``b1_keys`` the ghosts (``b2_keys`` is always empty).
    """

    name = "slru"

    #: Probation's share of the capacity: victims come from probation while it holds more.
    PROBATION_SHARE = 0.6

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._target_t1_size = self.PROBATION_SHARE * capacity

    def insert(self, key: bytes, evictable: bool = True) -> None:
        if type(key) is not bytes:
            check_insert_key(key)
        if key in self._b1:  # a ghost (never held): back from probation, reused
            del self._b1[key]
            self._t2.add(key, evictable)
            return
        if key in self._t2 or not self._t1.add_new(key, evictable):
            raise KeyError(key)
        self._trim_ghosts()

    def insert_new(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        ghosts = self._b1
        to_t1: list[bytes] = []
        to_t2: list[bytes] = []
        for key in keys:
            if key in ghosts:
                del ghosts[key]
                to_t2.append(key)
            else:
                to_t1.append(key)
        if not (self._t1.add_all(to_t1, evictable) and self._t2.add_all(to_t2, evictable)):
            raise KeyError("insert_new: a key was held already or listed twice")
        self._trim_ghosts()

    def clear(self) -> None:
        super().clear()
        self._target_t1_size = self.PROBATION_SHARE * self.capacity

    def _trim_ghosts(self) -> None:
        b1 = self._b1
        if self._b2:
            self._b2.clear()  # protected victims leave no ghost
        excess = len(b1) - self.capacity
        for _ in range(max(0, excess)):
            b1.popitem(last=False)
