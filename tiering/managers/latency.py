"""Job latencies in fixed memory, however long the engine runs.

A tier times each of its jobs (one batch of blocks read or written). A long-running engine runs
millions of them, so a :class:`LatencyRecord` keeps, in memory that does not grow:

- the exact count and total of every sample (a mean, and bytes over seconds, stay exact);
- the exact count per bucket of :data:`LATENCY_BUCKETS_S` (what a Prometheus histogram exposes);
- a uniform random sample of at most ``reservoir_size`` values (Vitter's algorithm R), for
  percentiles: every sample while there are at most that many, so a short run's percentiles are
  exact; past that, each sample seen so far is in it with the same probability. The random
  generator is seeded, so the same run keeps the same sample.

Written by one thread (the manager's, which applies job results); another thread may read it
(a Prometheus scrape): each attribute read is atomic under the GIL, and a reader can at most see
a count one sample ahead of the total.
"""

from __future__ import annotations

import random
from array import array
from bisect import bisect_left

from tiering.errors import ConfigurationError

__all__ = ["LATENCY_BUCKETS_S", "RESERVOIR_SIZE", "LatencyRecord"]

#: Bucket upper bounds (inclusive), in seconds: 50 us to 10 s (a promotion or store job).
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
#: Samples kept for percentiles: 32 KiB per record; the p99 of 4096 uniform samples is
#: typically (two standard errors) within 0.3 percentile points of the true p99.
RESERVOIR_SIZE = 4096


class LatencyRecord:
    """Latencies of one kind of job, in seconds: count, total, histogram, sampled percentiles."""

    __slots__ = ("bucket_counts", "count", "reservoir_size", "total_s", "_random", "_reservoir")

    def __init__(self, reservoir_size: int = RESERVOIR_SIZE, *, seed: int = 0) -> None:
        if reservoir_size < 1:
            raise ConfigurationError(f"reservoir_size must be at least 1, got {reservoir_size}")
        self.reservoir_size = reservoir_size
        self.count = 0
        self.total_s = 0.0
        #: samples per bucket of :data:`LATENCY_BUCKETS_S` (not cumulative); the last entry
        #: counts those above the largest bound
        self.bucket_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self._reservoir = array("d")
        self._random = random.Random(seed)

    def add(self, seconds: float) -> None:
        """Record one sample."""
        self.bucket_counts[bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
        self.total_s += seconds
        self.count += 1
        if len(self._reservoir) < self.reservoir_size:
            self._reservoir.append(seconds)
        else:
            slot = self._random.randrange(self.count)
            if slot < self.reservoir_size:
                self._reservoir[slot] = seconds

    def samples(self) -> list[float]:
        """The kept samples (all of them while :attr:`count` <= :attr:`reservoir_size`), in no
        particular order: for percentiles."""
        return self._reservoir.tolist()

    def __len__(self) -> int:
        return self.count

    def __repr__(self) -> str:
        return f"LatencyRecord(count={self.count}, total_s={self.total_s:.6f})"
