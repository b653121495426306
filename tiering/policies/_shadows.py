"""Sampled shadow caches that tell which of several eviction rules serves a workload best.

Set dueling (Qureshi et al., ISCA 2007), by key sampling (SHARDS, Waldspurger et al., FAST
2015): each candidate rule runs as a small cache of its own over a fixed sample of the keys, at
the sampled share of the real capacity, and counts the prefix hits it would have served. The
real cache follows the rule whose shadow leads.

- **Sample.** A key is in the sample when ``crc32(key)`` has its low ``bits`` bits clear: the
  same keys every run and every process (Python's ``hash`` of bytes is salted per process, and
  a study must repeat exactly). ``bits`` is the largest (at most :data:`MAX_SAMPLE_BITS`) that
  leaves each shadow :data:`MIN_SHADOW_BLOCKS` blocks; a smaller cache is shadowed whole.
  Shadows of 128 blocks could not tell ARC from hybrid at 2 % of a generated conversation
  trace (seed 2) where the real caches differ by 0.4 points; 512 could.
- **Score: prefix hits, not block hits.** A block is worth loading only with every block
  before it, and a rule can hold more blocks yet serve fewer prefixes (ARC's deep blocks of
  evicted chains, measured on agent loops). A call's sampled keys come in prefix order; a
  shadow scores the leading run of them it holds.
- **Each reference once.** A reference reaches the shadows either in a ``touch`` (the engine
  loaded it) or in an ``insert`` (it was missing and stored); the manager's study driver
  touches a request's missing keys too before storing them, so keys of the last ``touch`` are
  not counted again by the ``insert`` that follows it.
- **Light shadows.** A shadow is not the policy class it stands for but a few ordered dicts
  that take the same victims on the same calls when nothing is pinned or protected
  (:class:`ShadowCache`; tests drive both in lockstep): a shadow never pins, and the pin
  machinery would cost more than the rule. LRU's shadow is one ordered dict
  (:class:`LRUShadow`): no LRU decision reads the lists or the ghosts. A store of keys none of
  which is a ghost (the usual call) goes to T1 in one update and trims the ghosts once.
- **Switching.** The lead must be at least :data:`MIN_LEAD` prefix hits and
  :data:`LEAD_SHARE` of the followed rule's score; ties keep the rule followed. Scores halve
  every :data:`HALF_LIFE_CAPACITIES` shadow capacities of sampled references, so a workload
  that changes is followed within a few cache lifetimes.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from tiering.policies.arc import ghost_hit_target, trim_ghosts

__all__ = ["RULES", "LRUShadow", "ShadowCache", "ShadowDuel"]

#: The rules a shadow can run: hybrid's own, LRU's and ARC's (as :mod:`tiering.policies`).
RULES = ("hybrid", "lru", "arc")
#: Keys sampled at 1 in ``2 ** bits``, ``bits`` at most this.
MAX_SAMPLE_BITS = 5
#: Each shadow holds at least this many blocks (smaller caches are shadowed whole).
MIN_SHADOW_BLOCKS = 512
#: A rule must lead by this share of the followed rule's score ...
LEAD_SHARE = 0.001
#: ... and by at least this many sampled prefix hits.
MIN_LEAD = 32
#: Scores halve after this many shadow capacities of sampled references.
HALF_LIFE_CAPACITIES = 64
# Hybrid's target for new blocks: its start and floor, as shares of the capacity.
HYBRID_INITIAL_SHARE = 0.5
HYBRID_FLOOR_SHARE = 0.2


def sample_bits(capacity: int) -> int:
    """The sampling exponent for a cache of ``capacity`` blocks (see the module docstring)."""
    bits = 0
    while bits < MAX_SAMPLE_BITS and capacity >> (bits + 1) >= MIN_SHADOW_BLOCKS:
        bits += 1
    return bits


class LRUShadow:
    """LRU over one ordered dict, nothing pinned: what :class:`ShadowCache` does under
    ``"lru"`` (whose victim, the older of T1's and T2's heads, is the least recent key of
    both), without the lists and ghosts no LRU decision reads. :meth:`refer` as there."""

    __slots__ = ("_order", "capacity", "rule")

    def __init__(self, capacity: int) -> None:
        self.rule = "lru"
        self.capacity = capacity
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __iter__(self) -> Iterator[bytes]:
        """Held keys, least recent first (the order they would be evicted in)."""
        return iter(self._order)

    def clear(self) -> None:
        self._order.clear()

    def refer(self, keys: Sequence[bytes]) -> int:
        """Apply one call's references; return the leading run of keys held before it."""
        order = self._order
        missing = [key for key in keys if key not in order]
        if len(missing) == len(keys):
            run = 0
        else:
            run = len(keys)
            for i, key in enumerate(keys):
                if key not in order:
                    run = i
                    break
            move = order.move_to_end
            for key in reversed(keys):
                if key in order:
                    move(key)
        if missing:
            missing = missing[-self.capacity :]
            shortfall = len(order) + len(missing) - self.capacity
            pop = order.popitem
            for _ in range(shortfall):
                pop(last=False)
            order.update(dict.fromkeys(missing))
        return run


class ShadowCache:
    """One rule over T1/T2 (stamps from one clock) and ghosts B1/B2, nothing pinned.

    :meth:`refer` is one manager call's references in prefix order: held keys touched
    (``keys[0]`` ends most recent; a T1 key moves to T2), then room made for the missing ones
    (victims by the rule, to their ghost list), then the missing stored (a ghost to T2 and the
    target moved as ARC moves it, other keys to T1), ghosts trimmed as ARC trims them.
    ``"lru"`` evicts the older head of T1 and T2; ``"arc"`` T1's head while ``|T1| > p``,
    else T2's; ``"hybrid"`` T1's head while ``|T1| > p``, else the older head. (The duel runs
    ``"lru"`` as :class:`LRUShadow`, which takes the same victims at less cost.)
    """

    __slots__ = ("_b1", "_b2", "_clock", "_floor", "_t1", "_t2", "capacity", "rule", "target")

    def __init__(self, rule: str, capacity: int) -> None:
        if rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        self.rule = rule
        self.capacity = capacity
        self._t1: OrderedDict[bytes, int] = OrderedDict()
        self._t2: OrderedDict[bytes, int] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()
        self._clock = 0
        hybrid = rule == "hybrid"
        self._floor = HYBRID_FLOOR_SHARE * capacity if hybrid else 0.0
        self.target = HYBRID_INITIAL_SHARE * capacity if hybrid else 0.0

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __iter__(self) -> Iterator[bytes]:
        """Held keys: T1's, then T2's, each least recent first."""
        yield from self._t1
        yield from self._t2

    def clear(self) -> None:
        self.__init__(self.rule, self.capacity)  # type: ignore[misc]

    def refer(self, keys: Sequence[bytes]) -> int:
        """Apply one call's references; return the leading run of keys held before it."""
        t1, t2 = self._t1, self._t2
        missing = [key for key in keys if key not in t1 and key not in t2]
        if len(missing) == len(keys):  # the usual call of a store: nothing held
            run = 0
        else:
            run = len(keys)
            for i, key in enumerate(keys):
                if key not in t1 and key not in t2:
                    run = i
                    break
            clock = self._clock
            for key in reversed(keys):
                if key in t2:
                    t2.move_to_end(key)
                elif key in t1:
                    del t1[key]
                else:
                    continue
                clock += 1
                t2[key] = clock
            self._clock = clock
        if missing:
            self._store(missing[-self.capacity :])
        return run

    def _store(self, missing: list[bytes]) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        capacity = self.capacity
        shortfall = len(t1) + len(t2) + len(missing) - capacity
        if shortfall > 0:
            self._evict(shortfall)
        clock = self._clock
        if b1.keys().isdisjoint(missing) and b2.keys().isdisjoint(missing):
            # All to T1; one trim leaves the ghosts trimming after each key would (sizes only
            # grow, so each bound drops the same oldest ghosts).
            t1.update(zip(missing, range(clock + 1, clock + 1 + len(missing)), strict=True))
            self._clock = clock + len(missing)
            trim_ghosts(b1, b2, len(t1), len(t1) + len(t2), capacity)
            return
        for key in missing:
            clock += 1
            if key in b1 or key in b2:
                from_b1 = key in b1
                self.target = ghost_hit_target(
                    self.target, from_b1, len(b1), len(b2), capacity, self._floor
                )
                del (b1 if from_b1 else b2)[key]
                t2[key] = clock
            else:
                t1[key] = clock
                trim_ghosts(b1, b2, len(t1), len(t1) + len(t2), capacity)
        self._clock = clock

    def _evict(self, count: int) -> None:
        # A victim goes to its list's ghosts: |T1| + |B1| and the total stay, so no trimming.
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        rule, target = self.rule, self.target
        if rule != "lru" and len(t1) > target:  # T1 over its target: its oldest, in one go
            over = len(t1) - math.floor(target) if t2 else len(t1)
            pop = t1.popitem
            for _ in range(min(count, over)):
                b1[pop(last=False)[0]] = None
            count -= min(count, over)
        for _ in range(count):
            if not t2 or (t1 and rule != "lru" and len(t1) > target):
                from_t1 = True
            elif not t1 or rule == "arc":
                from_t1 = False
            else:
                from_t1 = next(iter(t1.values())) <= next(iter(t2.values()))
            if from_t1:
                b1[t1.popitem(last=False)[0]] = None
            else:
                b2[t2.popitem(last=False)[0]] = None


class ShadowDuel:
    """Shadows of ``rules`` (names of :data:`RULES`) for a cache of ``capacity`` blocks;
    :attr:`leader` is the name of the rule the real cache should follow (the first at start).
    """

    __slots__ = (
        "_half",
        "_lead",
        "_mask",
        "_names",
        "_scores",
        "_seen",
        "_shadows",
        "_touched",
        "switches",
    )

    def __init__(self, capacity: int, rules: Sequence[str]) -> None:
        bits = sample_bits(capacity)
        shadow_capacity = max(1, capacity >> bits)
        self._mask = (1 << bits) - 1
        self._names = list(rules)
        self._shadows = [
            LRUShadow(shadow_capacity) if rule == "lru" else ShadowCache(rule, shadow_capacity)
            for rule in rules
        ]
        self._scores = [0.0] * len(rules)
        self._lead = 0
        self._seen = 0
        self._half = HALF_LIFE_CAPACITIES * shadow_capacity
        self._touched: frozenset[bytes] = frozenset()
        #: Changes of :attr:`leader` since the duel was built (:meth:`clear` keeps the count).
        self.switches = 0

    @property
    def leader(self) -> str:
        return self._names[self._lead]

    @property
    def scores(self) -> dict[str, float]:
        """Each rule's sampled prefix hits (halved with age), for tests and debugging."""
        return dict(zip(self._names, self._scores, strict=True))

    def touched(self, keys: Sequence[bytes]) -> None:
        """The engine loaded ``keys`` (prefix order): a reference to each."""
        sampled = self._sample(keys)
        self._touched = frozenset(sampled)
        if sampled:
            self._refer(sampled)

    def stored(self, keys: Sequence[bytes]) -> None:
        """``keys`` (prefix order) were missing and are stored: a reference to each not
        referred to by the last :meth:`touched`."""
        sampled = self._sample(keys)
        touched = self._touched
        if touched:
            sampled = [k for k in sampled if k not in touched]
            self._touched = frozenset()
        if sampled:
            self._refer(sampled)

    def clear(self) -> None:
        """Forget every shadow's keys and the scores; the first rule leads again (not counted
        as a switch)."""
        for shadow in self._shadows:
            shadow.clear()
        self._scores = [0.0] * len(self._scores)
        self._lead = 0
        self._seen = 0
        self._touched = frozenset()

    def _sample(self, keys: Sequence[bytes]) -> list[bytes]:
        mask = self._mask
        if not mask:
            return list(keys)
        crc32 = zlib.crc32
        return [key for key in keys if not crc32(key) & mask]

    def _refer(self, keys: list[bytes]) -> None:
        scores = self._scores
        gained = False
        for i, shadow in enumerate(self._shadows):
            run = shadow.refer(keys)
            if run:
                scores[i] += run
                gained = True
        self._seen += len(keys)
        if self._seen >= self._half:
            self._seen = 0
            self._scores = scores = [s / 2 for s in scores]
        if not gained:
            return  # halving alone never gives another rule the lead
        lead = self._lead
        best = max(range(len(scores)), key=scores.__getitem__)
        if best != lead and scores[best] - scores[lead] >= max(MIN_LEAD, LEAD_SHARE * scores[lead]):
            self._lead = best
            self.switches += 1
