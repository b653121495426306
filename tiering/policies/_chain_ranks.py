"""The ranks of :class:`~tiering.policies.chain.ChainPolicy`'s classes, from what it counted:
delays in half-octave bins, and per class the chance of being continued within a horizon at
each knot age, made non-increasing."""

from __future__ import annotations

import functools
import itertools
import math

__all__ = ["BINS", "delay_bin", "rank_knots", "rank_tables"]

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


def rank_tables(
    counts: tuple[list[float], list[float], list[list[float]]],
    classes: int,
    priors: tuple[float, float],
    capacity: int,
    horizon_ticks: int,
) -> list[list[float]]:
    """Per list, its ranks at the knot ages (:func:`rank_knots`), from ``counts``: per list
    (the ``classes`` classes, then the shared list), its requests, those continued, and the
    histogram of their delays. ``priors``: the weight in requests of the pooled estimate each
    list starts from, and the shared list's prior share. The classes start from the classes'
    pooled share, the shared list from its prior share, every list from the classes' pooled
    delays (nothing learned yet: delays of about a ``capacity``)."""
    requests, continued, delays = counts
    prior, shared_prior_share = priors
    all_requests, all_continued = sum(requests[:classes]), sum(continued[:classes])
    pooled_share = all_continued / all_requests if all_requests > 0 else 0.5
    pooled = [sum(per_bin) for per_bin in zip(*delays[:classes], strict=True)]
    pooled_total = sum(pooled)
    if pooled_total > 0:
        prior_bins = [prior * count / pooled_total for count in pooled]
    else:
        prior_bins = [0.0] * BINS
        prior_bins[delay_bin(capacity)] = prior
    tables = []
    for c in range(len(requests)):
        prior_share = pooled_share if c < classes else shared_prior_share
        share = (continued[c] + prior * prior_share) / (requests[c] + prior)
        share = min(max(share, 1e-3), 1 - 1e-3)
        weights = [count + extra for count, extra in zip(delays[c], prior_bins, strict=True)]
        total = sum(weights)
        knots = list(itertools.accumulate((weight / total for weight in weights), initial=0.0))
        tables.append(rank_knots(share, knots, horizon_ticks))
    return tables
