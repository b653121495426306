"""Hybrid LRU/ARC for KV-cache prefix traffic (``"hybrid"``): LRU unless a flood of new blocks
threatens reused ones.

Why. Production traffic (:mod:`tiering.replay.workloads`) mixes blocks that come back soon
(tenants' system and tool prompts, agent loops), blocks that come back after a think time
(conversations; documents many users ask about) and floods of blocks that never come back
(one-off long documents). LRU gives a flood the whole cache; ARC shields reused blocks but
treats recency within its two lists strictly by list: once its target for new blocks is met it
evicts reused blocks however recent they are and however stale the new ones, and on
conversation-heavy traffic it trails LRU at 10-20 % of the unique blocks.

Decisions (T1: blocks not reused since they were stored; T2: reused blocks; B1, B2: their
ghosts, keys only, trimmed as ARC trims them):

- **Reuse.** A touch (a load of a held block) moves a T1 block to T2; a pinned block touched
  stays (preparing a block is not a use). A block stored again while a ghost goes to T2: it
  was reused, only later than the cache kept it.
- **A target for new blocks, adapted as ARC adapts it.** ``p`` grows when a B1 ghost comes
  back (new blocks were evicted too early) and shrinks when a B2 ghost does. It starts at half
  the capacity (ARC: 0, which evicts reused blocks first until new ones prove themselves) and
  never goes below a fifth (``_FLOOR_SHARE``): below that, agent loops whose next step reuses
  the blocks the last one stored lose them (measured: 0.8 points at 1-2 % of the unique
  blocks).
- **Victims.** While T1 holds more than ``p`` blocks, T1's least recent (a flood leaves
  first, as in ARC). Otherwise the least recent evictable, unprotected block of T1 and T2
  together, as LRU would take: the two lists share one clock, so their stamps compare (a
  block taken from one list and found newer than the other's is put back in its place). This
  is where it departs from
  ARC, and why it matches LRU where LRU is near the optimum (caches of 10-20 % of the unique
  blocks).
- **Prefix order.** The manager touches a request's blocks with the first most recent; its
  new blocks are inserted in prefix order (the deepest most recent), and an engine's adapter
  ranks them again at the request's end (:meth:`refresh`, the first most recent), so that
  deeper blocks leave before the blocks they depend on. (The study, which does not re-rank,
  reads the same prefix hit ratios within 0.1 points as with the re-ranking, at 1-20 % of the
  generated conversation and production traces: requests' blocks mostly leave together.)

- **Which rule, measured as it runs.** No one rule wins everywhere: on the generated traces
  ARC beats this rule by up to 0.45 points at 1-2 % of the unique blocks (conversations,
  documents), LRU by up to 0.4 on agent loops at 1 %. Sampled shadow caches
  (:mod:`tiering.policies._shadows`) run this rule, LRU and ARC over one key in up to 32,
  each scored by the prefix hits it would serve, and the victims follow the rule whose shadow
  leads (:attr:`HybridPolicy.rule`): ``"hybrid"`` as above, ``"lru"`` the least recent of T1
  and T2 together, ``"arc"`` ARC's rule with ARC's own target (kept beside ``p``, from 0 and
  without a floor, adapted by the same ghost hits). All three share the lists, so a switch
  moves nothing. It starts as ``"hybrid"``.

Cost: ARC's machinery (:class:`~tiering.policies._order.RecencyOrder` lists sharing pins: O(1)
amortized per key, a victim search never meets a pinned key). A victim taken while T1 is
within its target costs two head peeks and a one-key search (two searches and a put-back where
a pinned or protected head was passed over): O(1) amortized (stale heap
entries a peek drops were made by earlier calls, as in a search). The shadows add a CRC-32
per key and, for the sampled keys, three ordered-dict caches' work.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from operator import itemgetter
from typing import ClassVar

from tiering.policies._checks import (
    check_evict_count,
    check_insert_key,
    check_touch_keys,
    protected_set,
)
from tiering.policies._shadows import RULES, ShadowDuel
from tiering.policies._two_lists import next_victim_bound as _bound
from tiering.policies._two_lists import stamped_keys as _stamped
from tiering.policies.arc import ARCPolicy, ghost_hit_target

__all__ = ["HybridPolicy"]


class HybridPolicy(ARCPolicy):
    """ARC's lists and adaptation with LRU's victim while new blocks are within their target.

    See the module docstring for each decision. ``t1_keys``, ``t2_keys``, ``b1_keys`` and
    ``b2_keys`` are as in :class:`ARCPolicy`.
    """

    name = "hybrid"

    _INITIAL_SHARE: ClassVar[float] = 0.5
    _FLOOR_SHARE: ClassVar[float] = 0.2
    #: False: ``_FIRST_RULE`` alone, no shadows (tests hold it to one rule so).
    _FOLLOWS_SHADOWS: ClassVar[bool] = True
    #: The rule followed until a shadow of another leads.
    _FIRST_RULE: ClassVar[str] = "hybrid"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._arc_only_target = 0.0  # ARC's own p: from 0, no floor
        self._shadows: ShadowDuel | None = None
        if self._FIRST_RULE not in RULES:
            raise ValueError(f"_FIRST_RULE must be one of {RULES}, got {self._FIRST_RULE!r}")
        if self._FOLLOWS_SHADOWS and capacity > 0:
            first = self._FIRST_RULE
            self._shadows = ShadowDuel(capacity, [first, *(r for r in RULES if r != first)])

    @property
    def rule(self) -> str:
        """The victim rule followed now: ``"hybrid"``, ``"lru"`` or ``"arc"``."""
        return self._FIRST_RULE if self._shadows is None else self._shadows.leader

    @property
    def rules(self) -> tuple[str, ...]:
        return RULES if self._shadows is not None else (self._FIRST_RULE,)

    @property
    def rule_switches(self) -> int:
        """Changes of :attr:`rule` since the policy was built (the duel's, kept through
        :meth:`clear`, which goes back to the first rule without counting it)."""
        return 0 if self._shadows is None else self._shadows.switches

    def __iter__(self) -> Iterator[bytes]:
        # The order successive evict(1) calls take keys in, with every key evictable.
        rule = self.rule
        if rule == "arc":
            yield from super().__iter__()
            return
        t1 = sorted(_stamped(self._t1), key=itemgetter(1))
        t2 = sorted(_stamped(self._t2), key=itemgetter(1))
        i = j = 0
        p = math.inf if rule == "lru" else self._target_t1_size
        while i < len(t1) or j < len(t2):
            if i < len(t1) and (len(t1) - i > p or j == len(t2) or t1[i][1] <= t2[j][1]):
                yield t1[i][0]
                i += 1
            else:
                yield t2[j][0]
                j += 1

    def insert(self, key: bytes, evictable: bool = True) -> None:
        self._insert_one(key, evictable)
        if self._shadows is not None:
            self._shadows.stored((key,))

    def _insert_one(self, key: bytes, evictable: bool) -> None:
        if type(key) is not bytes:
            check_insert_key(key)
        b1, b2 = self._b1, self._b2
        if key in b1 or key in b2:  # ARC's own target moves as ARC would move it
            self._arc_only_target = ghost_hit_target(
                self._arc_only_target, key in b1, len(b1), len(b2), self.capacity, 0.0
            )
        self._t1.sync_clock(self._t2)
        super().insert(key, evictable)

    def insert_new(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        b1, b2 = self._b1, self._b2
        if not (b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys)):
            for key in keys:  # ghosts go to T2: one clock for both lists, key by key
                self._insert_one(key, evictable)
        else:
            t1 = self._t1
            t1.sync_clock(self._t2)
            if not t1.add_all(keys, evictable):  # no ghost: all to T1, as ARC would
                raise KeyError("insert_new: a key was held already or listed twice")
            self._trim_ghosts()  # once: the same ghosts as trimming after each key
        if self._shadows is not None:
            self._shadows.stored(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._t1.sync_clock(self._t2)
        super().touch(keys)
        if self._shadows is not None:
            self._shadows.touched(keys)

    def refresh(self, keys: Sequence[bytes]) -> None:
        """Make ``keys`` recent without counting a use (a request's own new blocks): each
        stays in its list, as its most recent, ``keys[0]`` last. Absent keys are ignored."""
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys)
        t1, t2 = self._t1, self._t2
        t1.sync_clock(t2)
        t1.touch_all(keys)
        t2.sync_clock(t1)
        t2.touch_all(keys)

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        if type(n) is not int or n < 0:
            check_evict_count(n)
        guard = protected if type(protected) is set else protected_set(protected)
        if n == 0:
            return []
        rule = self.rule
        if rule == "arc":
            return super().evict(n, guard)
        t1, t2 = self._t1, self._t2
        if n > t1.evictable_count:  # of T1 and T2 together (partners)
            return None  # hopeless: fail before any search
        p = math.inf if rule == "lru" else self._target_t1_size
        to_b1: list[bytes] = []
        to_b2: list[bytes] = []
        taken: list[bytes] = []  # in the order taken, which is the order returned
        try:
            if t1.size > p:  # over target: T1's oldest, as ARC
                to_b1 += t1.take(min(n, t1.size - math.floor(p)), guard)
                taken += to_b1
            left = n - len(to_b1)
            # The older of the two lists' first evictable, unprotected keys, one at a time.
            # A list's oldest stamp is a lower bound of its first such key's: a key is taken
            # (its stamp then exact) only from the list that may hold the older one, and a key
            # taken but not chosen is put back in its place.
            orders, victims = (t1, t2), (to_b1, to_b2)
            pending: list[tuple[bytes, int] | None] = [None, None]  # per list: taken, not chosen
            done = [False, False]  # per list: nothing evictable left
            while left:
                s1 = _bound(t1, pending[0], done[0])
                s2 = _bound(t2, pending[1], done[1])
                if s1 < 0 and s2 < 0:
                    break
                side = 0 if s2 < 0 or 0 <= s1 <= s2 else 1
                candidate = pending[side]
                if candidate is None:
                    candidate = orders[side].take_one(guard)
                    if candidate is None:
                        done[side] = True
                    pending[side] = candidate
                    continue  # its stamp is exact now: compare again
                victims[side].append(candidate[0])
                taken.append(candidate[0])
                pending[side] = None
                left -= 1
            for order, held_back in zip(orders, pending, strict=True):
                if held_back is not None:
                    order.put_back_last()
        except BaseException:
            t1.end_search(undo=True)
            t2.end_search(undo=True)
            raise
        found_all = left == 0
        t1.end_search(undo=not found_all)
        t2.end_search(undo=not found_all)
        if not found_all:
            return None
        b1, b2 = self._b1, self._b2
        for key in to_b1:
            b1[key] = None
        for key in to_b2:
            b2[key] = None
        self._trim_ghosts()
        return taken

    def clear(self) -> None:
        super().clear()
        self._arc_only_target = 0.0
        if self._shadows is not None:
            self._shadows.clear()

    def _arc_target(self) -> float:
        return self._arc_only_target
