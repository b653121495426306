"""Prometheus metrics: a real HTTP scrape of a manager's counters, multi-process mode with real
processes, and docs/metrics.md listing exactly the catalogue."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiering.config import build_manager, parse_config
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigurationError
from tiering.managers.latency import LATENCY_BUCKETS_S, LatencyRecord
from tiering.managers.protocol import HIT
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.observability.metrics import CATALOGUE
from tiering.observability.prometheus import (
    MultiprocessExporter,
    TieringCollector,
    multiprocess_registry,
    start_metrics_server,
)

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).parent / "workers" / "metrics_worker.py"
CONFIG = {
    "version": 1,
    "model": {"shape": "tiny"},  # 4 KiB blocks
    "primary": {"capacity": "8KiB"},  # 2 blocks
    "secondary_tiers": [{"name": "ram", "type": "memory", "capacity": "1MiB"}],
}
Values = dict[tuple[str, frozenset[tuple[str, str]]], float]


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


@pytest.fixture
def manager() -> Iterator[TieringOffloadingManager]:
    manager = build_manager(parse_config(CONFIG, env={}))
    manager.wait_ready()
    yield manager
    manager.shutdown()


def store(manager: TieringOffloadingManager, *indices: int) -> None:
    for i in indices:
        out = manager.prepare_store([key(i)])
        assert out is not None
        manager.complete_store(out.keys_to_store)
        manager.wait_idle()


def parse(text: str) -> Values:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(values: Values, name: str, **labels: str) -> float:
    return values[(name, frozenset(labels.items()))]


def test_a_scrape_over_http_sees_each_tiers_activity(manager: TieringOffloadingManager) -> None:
    store(manager, 0, 1, 2)  # three write-through jobs; key 0 leaves the 2-block CPU tier
    assert manager.lookup(key(0)) is None  # found in "ram": a promotion starts
    manager.wait_idle()
    assert manager.lookup(key(0)) is True
    registry = CollectorRegistry()
    registry.register(TieringCollector(manager, {"engine": "7"}))
    server = start_metrics_server(registry, port=0)
    try:
        with urllib.request.urlopen(server.url) as response:
            values = parse(response.read().decode())
    finally:
        server.close()
    cpu = {"tier": "primary", "medium": "CPU", "engine": "7"}
    ram = {"tier": "ram", "medium": "RAM", "engine": "7"}
    row = 4096
    assert value(values, "tiering_capacity_blocks", **cpu) == 2
    assert value(values, "tiering_used_blocks", **cpu) == 2
    assert value(values, "tiering_block_bytes", **ram) == row
    assert value(values, "tiering_capacity_blocks", **ram) == manager.tiers[0].capacity_blocks
    assert value(values, "tiering_used_blocks", **ram) == 3
    assert value(values, "tiering_store_jobs_total", **ram) == 3
    assert value(values, "tiering_stored_blocks_total", **ram) == 3
    assert value(values, "tiering_written_bytes_total", **ram) == 3 * row
    assert value(values, "tiering_lookup_hits_total", **ram) == 1
    assert value(values, "tiering_promotions_total", **ram) == 1
    assert value(values, "tiering_promoted_blocks_total", **ram) == 1
    assert value(values, "tiering_read_bytes_total", **ram) == row
    assert value(values, "tiering_inflight_jobs", **ram) == 0
    assert value(values, "tiering_failures_total", kind="store", **ram) == 0
    assert value(values, "tiering_backend_operations_total", op="put", **ram) == 3
    assert value(values, "tiering_backend_results_total", result="hit", **ram) == 1
    store_jobs = {"op": "store", **ram}
    assert value(values, "tiering_job_latency_seconds_count", **store_jobs) == 3
    assert value(values, "tiering_job_latency_seconds_bucket", le="+Inf", **store_jobs) == 3
    assert value(values, "tiering_job_latency_seconds_sum", **store_jobs) > 0
    assert value(values, "tiering_job_latency_seconds_count", op="load", **ram) == 1


def scrape(manager: TieringOffloadingManager) -> Values:
    registry = CollectorRegistry()
    registry.register(TieringCollector(manager))
    return parse(generate_latest(registry).decode())


def test_the_primary_tiers_lookups_stores_loads_and_evictions_are_scraped(
    manager: TieringOffloadingManager,
) -> None:
    k0, k1, k5, absent = key(0), key(1), key(5), key(9)
    store(manager, 0, 1)  # the 2-block CPU tier is full
    assert (manager.lookup(k0), manager.lookup_result(k1)) == (True, HIT)  # 2 hits
    assert manager.lookup(absent) is False  # a miss (and no tier has it)
    assert manager.lookup_prefix([k0, k1, absent]) == 2  # 2 hits, 1 miss
    load = manager.prepare_load([k0])
    manager.complete_load([k0])
    out = manager.prepare_store([k5])  # evicts k1 (k0 was used since)
    assert out is not None and out.keys_to_store == [k5] and load.block_ids.size == 1
    assert manager.lookup(k5) is None  # being written: pending
    manager.complete_store([k5])
    manager.wait_idle()
    values = scrape(manager)
    cpu = {"tier": "primary", "medium": "CPU"}
    assert value(values, "tiering_lookups_total", **cpu) == 7
    assert value(values, "tiering_lookup_hits_total", **cpu) == 4
    assert value(values, "tiering_lookup_misses_total", **cpu) == 2  # 7 - 4 - 2: one pending
    assert value(values, "tiering_stored_blocks_total", **cpu) == 3
    assert value(values, "tiering_written_bytes_total", **cpu) == 3 * 4096
    assert value(values, "tiering_loaded_blocks_total", **cpu) == 1
    assert value(values, "tiering_read_bytes_total", **cpu) == 4096
    assert value(values, "tiering_evicted_blocks_total", **cpu) == 1
    assert value(values, "tiering_stores_below_threshold_total", **cpu) == 0
    assert value(values, "tiering_failures_total", kind="store", **cpu) == 0
    primary = manager.metrics()["primary"]
    assert (primary["lookups"], primary["lookup_pending"], primary["loaded_blocks"]) == (7, 1, 1)
    # The secondary tier was asked only about the primary's misses: it held none of them.
    assert value(values, "tiering_lookup_hits_total", tier="ram", medium="RAM") == 0


def test_a_tiers_latencies_take_fixed_memory_and_the_histogram_stays_exact(
    manager: TieringOffloadingManager,
) -> None:
    tier = manager.tiers[0]
    tier.metrics.store_latency_s = LatencyRecord(reservoir_size=4)
    store(manager, *range(10))  # ten write-through jobs
    record = tier.metrics.store_latency_s
    assert record.count == 10 and len(record.samples()) == 4
    values = scrape(manager)
    labels = {"tier": "ram", "medium": "RAM", "op": "store"}
    assert value(values, "tiering_job_latency_seconds_count", **labels) == 10
    assert value(values, "tiering_job_latency_seconds_sum", **labels) == record.total_s
    running = 0
    for bound, count in zip(LATENCY_BUCKETS_S, record.bucket_counts, strict=False):
        running += count
        bucket = value(values, "tiering_job_latency_seconds_bucket", le=repr(bound), **labels)
        assert bucket == running
    assert value(values, "tiering_job_latency_seconds_bucket", le="+Inf", **labels) == 10


def test_latency_samples_are_counted_once_across_scrapes(
    manager: TieringOffloadingManager,
) -> None:
    registry = CollectorRegistry()
    registry.register(TieringCollector(manager))
    labels = {"tier": "ram", "medium": "RAM", "op": "store"}
    store(manager, 0)
    first = parse(generate_latest(registry).decode())
    store(manager, 1, 2)
    second = parse(generate_latest(registry).decode())
    assert value(first, "tiering_job_latency_seconds_count", **labels) == 1
    assert value(second, "tiering_job_latency_seconds_count", **labels) == 3


def test_processes_add_up_in_multiprocess_mode(tmp_path: Path) -> None:
    directory = tmp_path / "prometheus"
    directory.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    records = []  # each process's own store latency record: buckets and total
    for num_blocks in (3, 5):
        done = subprocess.run(
            [sys.executable, str(WORKER), str(num_blocks)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        records.append(json.loads(done.stdout))
    values = parse(generate_latest(multiprocess_registry(str(directory))).decode())
    ram = {"tier": "ram", "medium": "RAM"}
    assert value(values, "tiering_stored_blocks_total", **ram) == 8
    assert value(values, "tiering_job_latency_seconds_count", op="store", **ram) == 8
    # The exported histogram is the sum of the processes' records, bucket by bucket.
    store_jobs = {"op": "store", **ram}
    total_s = sum(r["total_s"] for r in records)
    assert value(values, "tiering_job_latency_seconds_sum", **store_jobs) == pytest.approx(total_s)
    running = 0
    for i, bound in enumerate(LATENCY_BUCKETS_S):
        running += sum(r["bucket_counts"][i] for r in records)
        bucket = value(values, "tiering_job_latency_seconds_bucket", le=repr(bound), **store_jobs)
        assert bucket == running
    assert value(values, "tiering_capacity_blocks", tier="primary", medium="CPU") == 4


def test_multiprocess_mode_needs_the_directory(manager: TieringOffloadingManager) -> None:
    with pytest.raises(ConfigurationError, match="PROMETHEUS_MULTIPROC_DIR"):
        MultiprocessExporter(manager)  # this process imported prometheus_client without it
    with pytest.raises(ConfigurationError, match="PROMETHEUS_MULTIPROC_DIR"):
        multiprocess_registry("/nonexistent/prometheus")


def test_a_port_in_use_is_a_clear_error() -> None:
    first = start_metrics_server(CollectorRegistry(), port=0)
    try:
        with pytest.raises(ConfigurationError, match=rf"127\.0\.0\.1:{first.port}"):
            start_metrics_server(CollectorRegistry(), port=first.port)
    finally:
        first.close()


def test_docs_list_exactly_the_catalogue() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(tiering_[a-z_]+)` \|", text, re.MULTILINE))
    exposed = {s.name + ("_total" if s.kind == "counter" else "") for s in CATALOGUE}
    assert documented == exposed
