"""Sampled shadow caches that tell which of several eviction rules serves a workload best.

Set dueling (Qureshi et al., ISCA 2007), by key sampling (SHARDS, Waldspurger et al., FAST
2015): each candidate rule runs as a small cache of its own over a fixed sample of the keys, at
the sampled share of the real capacity, and counts the prefix hits it would have served. The
real cache follows the rule whose shadow leads.

- **Sample.** A key is in the sample when ``crc32(key)`` has its low ``bits`` bits clear: the
  same keys every run and every process (Python's ``hash`` of bytes is salted per process, and
  a study must repeat exactly). ``bits`` is the largest (at most :data:`MAX_SAMPLE_BITS`) that
  leaves each shadow :data:`MIN_SHADOW_BLOCKS` blocks; a smaller cache is shadowed whole.
- **Score: prefix hits, not block hits.** A block is worth loading only with every block
  before it, and a rule can hold more blocks yet serve fewer prefixes (ARC's deep blocks of
  evicted chains, measured on agent loops). A call's sampled keys come in prefix order; a
  shadow scores the leading run of them it holds.
- **Each reference once.** A reference reaches the shadows either in a ``touch`` (the engine
  loaded it) or in an ``insert`` (it was missing and stored); the manager's study driver
  touches a request's missing keys too before storing them, so keys of the last ``touch`` are
  not counted again by the ``insert`` that follows it.
- **Switching.** The lead must be at least :data:`MIN_LEAD` prefix hits and
  :data:`LEAD_SHARE` of the followed rule's score; ties keep the rule followed. Scores halve
  every :data:`HALF_LIFE_CAPACITIES` shadow capacities of sampled references, so a workload
  that changes is followed within a few cache lifetimes.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

from tiering.policies.base import EvictionPolicy

__all__ = ["ShadowDuel"]

#: Keys sampled at 1 in ``2 ** bits``, ``bits`` at most this.
MAX_SAMPLE_BITS = 3
#: Each shadow holds at least this many blocks (smaller caches are shadowed whole).
MIN_SHADOW_BLOCKS = 512
#: A rule must lead by this share of the followed rule's score ...
LEAD_SHARE = 0.001
#: ... and by at least this many sampled prefix hits.
MIN_LEAD = 32
#: Scores halve after this many shadow capacities of sampled references.
HALF_LIFE_CAPACITIES = 64


def sample_bits(capacity: int) -> int:
    """The sampling exponent for a cache of ``capacity`` blocks (see the module docstring)."""
    bits = 0
    while bits < MAX_SAMPLE_BITS and capacity >> (bits + 1) >= MIN_SHADOW_BLOCKS:
        bits += 1
    return bits


class ShadowDuel:
    """Shadows of ``rules`` (name -> policy class) for a cache of ``capacity`` blocks;
    :attr:`leader` is the name of the rule the real cache should follow (the first at start).
    """

    __slots__ = ("_lead", "_mask", "_names", "_scores", "_seen", "_shadows", "_touched", "_half")

    def __init__(
        self, capacity: int, rules: Sequence[tuple[str, Callable[[int], EvictionPolicy]]]
    ) -> None:
        bits = sample_bits(capacity)
        shadow_capacity = max(1, capacity >> bits)
        self._mask = (1 << bits) - 1
        self._names = [name for name, _ in rules]
        self._shadows = [make(shadow_capacity) for _, make in rules]
        self._scores = [0.0] * len(rules)
        self._lead = 0
        self._seen = 0
        self._half = HALF_LIFE_CAPACITIES * shadow_capacity
        self._touched: frozenset[bytes] = frozenset()

    @property
    def leader(self) -> str:
        return self._names[self._lead]

    @property
    def scores(self) -> dict[str, float]:
        """Each rule's sampled prefix hits (halved with age), for tests and debugging."""
        return dict(zip(self._names, self._scores, strict=True))

    def touched(self, keys: Sequence[bytes]) -> None:
        """The engine loaded ``keys`` (prefix order): a reference to each."""
        mask = self._mask
        sampled = [k for k in keys if not zlib.crc32(k) & mask]
        self._touched = frozenset(sampled)
        if sampled:
            self._refer(sampled)

    def stored(self, keys: Sequence[bytes]) -> None:
        """``keys`` (prefix order) were missing and are stored: a reference to each not
        referred to by the last :meth:`touched`."""
        mask, touched = self._mask, self._touched
        sampled = [k for k in keys if not zlib.crc32(k) & mask and k not in touched]
        self._touched = frozenset()
        if sampled:
            self._refer(sampled)

    def clear(self) -> None:
        for shadow in self._shadows:
            shadow.clear()
        self._scores = [0.0] * len(self._scores)
        self._lead = 0
        self._seen = 0
        self._touched = frozenset()

    def _refer(self, keys: list[bytes]) -> None:
        scores = self._scores
        for i, shadow in enumerate(self._shadows):
            run = 0
            for key in keys:
                if key not in shadow:
                    break
                run += 1
            scores[i] += run
            held = [k for k in keys if k in shadow] if run < len(keys) else keys
            if held:
                shadow.touch(held)
            if run < len(keys):
                missing = [k for k in keys if k not in shadow][-shadow.capacity :]
                shortfall = len(shadow) + len(missing) - shadow.capacity
                if shortfall > 0:
                    shadow.evict(shortfall)
                shadow.insert_new(missing)
        self._seen += len(keys)
        if self._seen >= self._half:
            self._seen = 0
            self._scores = scores = [s / 2 for s in scores]
        lead = self._lead
        best = max(range(len(scores)), key=scores.__getitem__)
        if best != lead and scores[best] - scores[lead] >= max(MIN_LEAD, LEAD_SHARE * scores[lead]):
            self._lead = best
