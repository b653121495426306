"""The ranks of :class:`~tiering.policies.chain.ChainPolicy`'s classes, from what it counted:
delays in half-octave bins, and per class at each knot age the chance of being continued within
a horizon per tick a block is expected to be held (hit density), made non-increasing."""

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
    """At ``a = 2**(j/2) - 1``, the chance of being continued within ``horizon_ticks``, given
    not by age ``a``, per tick the block is expected to be held: ``q (F(a + H) - F(a)) /
    (1 - q M(a))``, ``M(a)`` the mean of ``F`` over ``[a, a + H]`` (hit density: a block
    likely back soon is worth more than one as likely back only near the horizon); each the
    least of it and those before: a block never ranks above a younger one of its class (so
    classes that learned alike rank by age alone, as LRU)."""
    # F is linear in x = 2 log2(t + 1) within a bin: its integral from the bin's start
    # (at t_b = 2**(b/2) - 1) is exact through X(t) = (t + 1)(x(t) - 2/ln 2), whose
    # derivative is x. ``area[b]``: F's integral from 0 to t_b.
    area = list(
        itertools.accumulate(
            (
                (low - (high - low) * b) * width + (high - low) * x_area
                for b, low, high, width, x_area in zip(
                    range(BINS), knots, knots[1:], _BIN_WIDTHS, _BIN_X_AREAS, strict=False
                )
            ),
            initial=0.0,
        )
    )
    ranks: list[float] = []
    lowest = math.inf
    # share <= 1 - 1e-3 and M <= 1: the divisor is at least 1e-3.
    for j, (b, fraction, into, x_into) in enumerate(_ahead_points(horizon_ticks)):
        if b >= BINS:  # past the last bin, F = 1
            ahead, until = 1.0, area[BINS] + into
        else:
            low, slope = knots[b], knots[b + 1] - knots[b]
            ahead = low + slope * fraction
            until = area[b] + (low - slope * b) * into + slope * x_into
        mean = (until - area[j]) / horizon_ticks
        chance = share * (ahead - knots[j]) / (1.0 - share * mean)
        if chance < lowest:
            lowest = chance
        ranks.append(lowest)
    return ranks


_X_SHIFT = 2 / math.log(2)
_KNOT_AGES = [2 ** (j / 2) - 1 for j in range(BINS + 1)]  # the bins' starts (and the end)


def _x_area(age: float) -> float:
    """``X(t) = (t + 1)(x(t) - 2/ln 2)``: the integral of ``x(t) = 2 log2(t + 1)``."""
    return (age + 1) * (2 * math.log2(age + 1) - _X_SHIFT)


_BIN_WIDTHS = [_KNOT_AGES[b + 1] - _KNOT_AGES[b] for b in range(BINS)]
_BIN_X_AREAS = [_x_area(_KNOT_AGES[b + 1]) - _x_area(_KNOT_AGES[b]) for b in range(BINS)]


@functools.lru_cache(maxsize=16)
def _ahead_points(horizon_ticks: int) -> tuple[tuple[int, float, float, float], ...]:
    """Per knot, the point ``horizon_ticks`` after its age: its bin, the fraction of it (as
    :func:`~tiering.policies._chain_search.rank_at` reads), and its distance from the bin's
    start in ticks and in ``X`` (the horizon changes only when it is measured again, the
    tables every ``_TABLE_REQUESTS``)."""
    points = []
    for age in _KNOT_AGES[:BINS]:
        ahead = age + horizon_ticks
        x = 2 * math.log2(ahead + 1)
        b = int(x)
        start = _KNOT_AGES[min(b, BINS)]
        into = ahead - start
        points.append((b, x - b, into, _x_area(ahead) - _x_area(start)))
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
