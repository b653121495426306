"""LatencyRecord: exact count, total and histogram buckets, and percentiles from a bounded
uniform sample, so a long-running engine's job latencies take fixed memory."""

from __future__ import annotations

import random
from bisect import bisect_left

import pytest

from tiering.errors import ConfigurationError
from tiering.managers.latency import LATENCY_BUCKETS_S, RESERVOIR_SIZE, LatencyRecord


def test_every_sample_is_kept_while_there_are_at_most_reservoir_size() -> None:
    record = LatencyRecord(reservoir_size=8)
    values = [0.001 * i for i in range(8)]
    for value in values:
        record.add(value)
    assert record.samples() == values
    assert (record.count, len(record)) == (8, 8)


def test_memory_stays_fixed_and_count_total_and_buckets_stay_exact() -> None:
    generator = random.Random(5)
    values = [generator.lognormvariate(-7, 2) for _ in range(50_000)]  # 1 us to seconds
    values[100:102] = [12.0, 30.0]  # above the largest bound
    record = LatencyRecord(reservoir_size=1000)
    for value in values:
        record.add(value)
    assert record.count == len(values)
    assert record.total_s == pytest.approx(sum(values), rel=1e-12)
    expected = [0] * (len(LATENCY_BUCKETS_S) + 1)
    for value in values:  # Prometheus' rule: a bucket counts values <= its bound
        expected[next((i for i, b in enumerate(LATENCY_BUCKETS_S) if value <= b), -1)] += 1
    assert record.bucket_counts == expected
    assert sum(record.bucket_counts[:-1]) < len(values)  # some above 10 s: the last bucket
    kept = record.samples()
    assert len(kept) == 1000  # not 50,000
    assert set(kept) <= set(values) and len(set(kept)) == 1000
    # A uniform sample: about a thousandth of it from each thousandth of the input order.
    position = {value: i for i, value in enumerate(values)}
    first_half = sum(position[v] < len(values) // 2 for v in kept)
    assert 400 < first_half < 600


def test_a_bound_is_inside_its_bucket() -> None:
    record = LatencyRecord()
    for bound in LATENCY_BUCKETS_S:
        record.add(bound)
    assert record.bucket_counts == [1] * len(LATENCY_BUCKETS_S) + [0]
    assert bisect_left(LATENCY_BUCKETS_S, 11.0) == len(LATENCY_BUCKETS_S)


def test_the_same_samples_keep_the_same_sample() -> None:
    first, second = LatencyRecord(reservoir_size=16), LatencyRecord(reservoir_size=16)
    for i in range(1000):
        first.add(i * 1e-4)
        second.add(i * 1e-4)
    assert first.samples() == second.samples()
    assert RESERVOIR_SIZE >= 1000


def test_reservoir_size_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="reservoir_size must be at least 1, got 0"):
        LatencyRecord(reservoir_size=0)
