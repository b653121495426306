"""The ranks of :class:`~tiering.policies.chain.ChainPolicy`'s classes, from what it counted:
delays in half-octave bins, and per class the chance of being continued within a horizon at
each knot age, made non-increasing."""

from __future__ import annotations

import functools
import math

__all__ = ["BINS", "delay_bin", "rank_knots"]

BINS = 64  # half-octaves: delays up to 2**32 ticks


def delay_bin(delay_ticks: int) -> int:
    """The histogram bin of a delay: half-octaves of ``delay_ticks + 1``."""
    return min(BINS - 1, int(2 * math.log2(delay_ticks + 1)))


def rank_knots(share: float, knots: list[float], horizon_ticks: int) -> list[float]:
    """P(continued within ``horizon_ticks`` | not by age ``a``) at ``a = 2**(j/2) - 1``, each
    the least of it and those before: a block never ranks above a younger one of its class
    (so classes that learned alike rank by age alone, as LRU)."""
    ranks: list[float] = []
    lowest = 1.0
    points = _ahead_points(horizon_ticks)
    # share <= 1 - 1e-3 and reached <= 1: the divisor is at least 1e-3.
    for reached, (b, fraction) in zip(knots[:-1], points, strict=True):  # F at the knot
        ahead = 1.0 if b >= BINS else knots[b] + (knots[b + 1] - knots[b]) * fraction
        chance = share * (ahead - reached) / (1.0 - share * reached)
        if chance < lowest:
            lowest = chance
        ranks.append(lowest)
    return ranks


_KNOT_AGES = [2 ** (j / 2) - 1 for j in range(BINS)]


@functools.lru_cache(maxsize=16)
def _ahead_points(horizon_ticks: int) -> tuple[tuple[int, float], ...]:
    """Per knot, where F is read at the knot's age plus ``horizon_ticks``: the bin and the
    fraction of it, as :func:`~tiering.policies._chain_search.rank_at` reads (the horizon
    changes only when it is measured again, the tables every ``_TABLE_REQUESTS``)."""
    points = []
    for age in _KNOT_AGES:
        x = 2 * math.log2(age + horizon_ticks + 1)
        points.append((int(x), x - int(x)))
    return tuple(points)
