"""tiering's drop-in for vLLM 0.33 (``TieringSpec``), tested against the real vLLM package.

Everything goes through vLLM's own code: ``OffloadingSpecFactory`` builds the spec from the
``OffloadingConfig`` its connector derives from a ``VllmConfig`` with exactly the documented
``kv_connector_extra_config``; the end-to-end tests run vLLM's ``Scheduler`` with its
``OffloadingConnector``. The GPU worker is played by writing and reading the shared region's
rows (``vllm_harness``). A step's tier I/O is waited for before the step ends (it runs while
the model does), so every scenario gives the same answers on every run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from switching_policy import SwitchingPolicy
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm_harness import (
    BLOCK_SIZE,
    ENGINE_ID_PREFIX,
    EngineDriver,
    EventRecord,
    ManagerDriver,
    chunk_ids,
    gpu_block_bytes,
    keys_for,
    offloading_config,
    payload,
    vllm_config,
)

from tiering.errors import ConfigError
from tiering.integrations import vllm_plugin
from tiering.integrations.vllm import INFO_KEYS, PRIMARY_LABEL, TieringManager, TieringSpec
from tiering.integrations.vllm_layout import layout_fingerprint
from tiering.integrations.vllm_tiers import TieringTierMetrics
from tiering.policies import ChainPolicy, HybridPolicy

HIT, MISS = LookupResult.HIT, LookupResult.MISS
HIT_PENDING = LookupResult.HIT_PENDING
CPU_CHUNKS = 4
SLOT_BYTES = 8192  # the file backend's slot for a 4 KiB chunk: 4 KiB header area + payload
DOCS = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
SWITCHING = "switching_policy:SwitchingPolicy"  # a policy whose rule the test sets


@pytest.fixture(autouse=True, scope="module")
def registered() -> None:
    vllm_plugin.register()


@pytest.fixture(autouse=True)
def no_region_left_behind() -> Iterator[None]:
    """Every engine a test starts releases its CPU region (a file in /dev/shm)."""
    pattern = f"vllm_offload_{ENGINE_ID_PREFIX}*"
    before = set(Path("/dev/shm").glob(pattern))
    yield
    assert set(Path("/dev/shm").glob(pattern)) <= before


def write_yaml(
    root: Path,
    tiers: Sequence[dict[str, Any]] | None = None,
    primary: dict[str, Any] | None = None,
) -> Path:
    """A tiering YAML file in ``root``: by default a file tier then an LMDB tier."""
    if tiers is None:
        tiers = [
            {"name": "nvme", "type": "file", "capacity": 16 * SLOT_BYTES, "path": "./nvme"},
            {"name": "lmdb", "type": "lmdb", "capacity": "1MiB", "path": "./lmdb", "sync": False},
        ]
    data = {
        "version": 1,
        "primary": primary or {"capacity": "4KiB"},
        "secondary_tiers": list(tiers),
    }
    root.mkdir(parents=True, exist_ok=True)
    path = root / "tiering.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def dropin_extra(config: Path, cpu_chunks: int = CPU_CHUNKS, **keys: Any) -> dict[str, Any]:
    """The issue's ``kv_connector_extra_config``, for a CPU tier of ``cpu_chunks`` chunks."""
    return {
        "spec_name": "TieringSpec",
        "spec_module_path": "tiering.integrations.vllm",
        "cpu_bytes_to_use": cpu_chunks * gpu_block_bytes(),
        "tiering_config": str(config),
        "tiering_deterministic_steps": True,  # the tests' scenarios count step boundaries
        **keys,
    }


@pytest.fixture
def drivers() -> Iterator[list[ManagerDriver]]:
    """Drivers to shut down after the test, whatever happens in it."""
    made: list[ManagerDriver] = []
    yield made
    for driver in made:
        driver.shutdown()


def start(drivers: list[ManagerDriver], config: Path, **kw: Any) -> ManagerDriver:
    extra = kw.pop("extra", {})
    driver = ManagerDriver.create(offloading_config(dropin_extra(config, **extra), **kw))
    drivers.append(driver)
    return driver


def adapter(driver: ManagerDriver) -> TieringManager:
    assert isinstance(driver.manager, TieringManager)
    return driver.manager


def counters(driver: ManagerDriver) -> dict[tuple[str, tuple[str, ...]], float]:
    """The counters of ``get_stats`` (gauges left out)."""
    with driver.manager.lock:
        stats = driver.manager.get_stats()
    if stats is None:
        return {}
    types, values = stats.metric_sections()
    return {
        (name, labels): value
        for name, by_label in values.items()
        if types[name] == "counter"
        for labels, value in by_label.items()
    }


def cascade_evict_promote(driver: ManagerDriver) -> dict[str, Any]:
    """Store A, then B (evicting A from the full CPU tier), then bring A back from the tiers.

    Returns everything observable, for comparing runs.
    """
    manager = adapter(driver)
    a, b = keys_for("a", CPU_CHUNKS), keys_for("b", CPU_CHUNKS)
    trace: dict[str, Any] = {}

    r1 = driver.new_request("r1")
    trace["store_a"] = chunk_ids(driver.store(r1, a).store_spec)
    driver.finish_request(r1)
    trace["pending_while_written"] = manager.has_pending_work()
    driver.settle()  # the tiers' writes apply: A's rows are free to evict
    trace["events_after_a"] = driver.take_events()

    r2 = driver.new_request("r2")
    trace["lookup_a_cpu"] = driver.lookup(r2, a)
    out_b = driver.store(r2, b)
    trace["store_b"] = (chunk_ids(out_b.store_spec), list(out_b.evicted_keys))
    driver.finish_request(r2)
    driver.settle()

    r3 = driver.new_request("r3")
    trace["lookup_a_evicted"] = driver.lookup(r3, a)  # promotions start: submitted at step end
    trace["pending_while_promoted"] = manager.has_pending_work()
    trace["lookup_a_read"] = driver.lookup(r3, a)  # read during this step: applied at its end
    trace["lookup_a_promoted"] = driver.lookup(r3, a)
    with driver.manager.lock:
        trace["sources"] = [driver.manager.get_load_source(k, r3) for k in a + b]
    trace["data_a"] = driver.load(r3, a)
    driver.finish_request(r3)
    driver.settle()
    trace["pending_after"] = manager.has_pending_work()
    trace["events_after_promotion"] = driver.take_events()
    trace["counters"] = counters(driver)
    return trace


def test_the_plugin_registers_the_spec() -> None:
    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "tiering"]
    entry.load()()  # what vLLM's load_general_plugins does; a second registration is a no-op
    vllm_plugin.register()
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": "TieringSpec"}) is TieringSpec


def test_store_cascade_evict_and_promote_bit_exact(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    extra = {"spec_module_path": None}  # found by name: registered by the plugin
    driver = start(drivers, write_yaml(tmp_path), extra=extra)
    assert isinstance(driver.spec, TieringSpec)
    assert [(t.name, type(t.backend).__name__) for t in adapter(driver).manager.tiers] == [
        ("nvme", "FileBackend"),
        ("lmdb", "LMDBBackend"),
    ]
    a, b = keys_for("a", CPU_CHUNKS), keys_for("b", CPU_CHUNKS)
    trace = cascade_evict_promote(driver)

    assert trace["store_a"] == [0, 1, 2, 3]
    assert trace["pending_while_written"] is True
    # The CPU tier's store, then each tier's: STORAGE, owned by the tier's name.
    assert trace["events_after_a"] == [
        EventRecord(tuple(a), "CPU", False, None),
        EventRecord(tuple(a), "STORAGE", False, "nvme", removal_expected=True),
        EventRecord(tuple(a), "STORAGE", False, "lmdb", removal_expected=True),
    ]
    assert trace["lookup_a_cpu"] == [HIT] * 4
    # B takes A's rows: the CPU tier evicted all of A, so A's bytes now live only below it.
    # r1 offered A in prefix order: its head is the most recent, evicted last.
    assert trace["store_b"] == ([0, 1, 2, 3], a[::-1])
    # A's promotions reserve their CPU rows at once (evicting B) and are read while the next
    # step runs: HIT_PENDING twice, then HIT.
    assert trace["lookup_a_evicted"] == [HIT_PENDING] * 4
    assert trace["pending_while_promoted"] is True
    assert trace["lookup_a_read"] == [HIT_PENDING] * 4
    assert trace["lookup_a_promoted"] == [HIT] * 4
    assert trace["sources"] == [CacheHitSource.DISK] * 4 + [CacheHitSource.HOST] * 4
    assert trace["data_a"] == [payload(k, gpu_block_bytes()).tobytes() for k in a]
    assert trace["pending_after"] is False
    assert trace["events_after_promotion"] == [
        EventRecord(tuple(a[::-1]), "CPU", True, None),  # B's store evicted A
        EventRecord(tuple(b), "CPU", False, None),
        EventRecord(tuple(b), "STORAGE", False, "nvme", removal_expected=True),
        EventRecord(tuple(b), "STORAGE", False, "lmdb", removal_expected=True),
        *[EventRecord((k,), "CPU", True, None) for k in b[::-1]],  # each promotion's row
        EventRecord(tuple(a), "CPU", False, None),  # A promoted in
    ]
    assert trace["counters"] == {
        ("vllm:kv_offload_tiering_chunk_queries", (PRIMARY_LABEL,)): 16,
        ("vllm:kv_offload_tiering_chunk_hits", (PRIMARY_LABEL,)): 8,
        (TieringTierMetrics.STORED_BLOCKS, (PRIMARY_LABEL,)): 12,
        ("vllm:kv_offload_tiering_write_bytes", (PRIMARY_LABEL,)): 12 * gpu_block_bytes(),
        (TieringTierMetrics.EVICTED_BLOCKS, (PRIMARY_LABEL,)): 8,
        ("vllm:kv_offload_tiering_chunk_hits", ("1:nvme",)): 4,
        ("vllm:kv_offload_tiering_read_bytes", ("1:nvme",)): 4 * gpu_block_bytes(),
        ("vllm:kv_offload_tiering_write_bytes", ("1:nvme",)): 8 * gpu_block_bytes(),
        ("vllm:kv_offload_tiering_write_bytes", ("2:lmdb",)): 8 * gpu_block_bytes(),
        (TieringTierMetrics.STORED_BLOCKS, ("1:nvme",)): 8,
        (TieringTierMetrics.STORED_BLOCKS, ("2:lmdb",)): 8,
        (TieringTierMetrics.READ_BLOCKS, ("1:nvme",)): 4,
    }


def test_the_same_scenario_twice_gives_identical_results(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    first = cascade_evict_promote(start(drivers, write_yaml(tmp_path / "one")))
    second = cascade_evict_promote(start(drivers, write_yaml(tmp_path / "two")))
    assert first == second


def test_hit_pending_while_written_into_the_cpu_tier_and_into_a_tier(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    """A write-back tier writes a block only when the CPU tier evicts it: in between, the block
    is in no tier's index as readable, and its lookup says so (HIT_PENDING)."""
    from gated_backend import GatedMemoryBackend

    GatedMemoryBackend.gate.clear()
    tier = {
        "name": "gated",
        "type": "gated_backend:GatedMemoryBackend",
        "capacity": "1MiB",
        "write_policy": "write_back",
    }
    driver = start(drivers, write_yaml(tmp_path, [tier]))
    manager = driver.manager
    a, b = keys_for("a", CPU_CHUNKS), keys_for("b", CPU_CHUNKS)
    context = driver.new_request("r1")
    try:
        with manager.lock:
            out = manager.prepare_store(a, context)
            assert out is not None
            assert [manager.lookup(k, context) for k in a] == [HIT_PENDING] * 4  # CPU write
        driver.end_step()
        for key, chunk in zip(out.keys_to_store, chunk_ids(out.store_spec), strict=True):
            driver.rows.write(chunk, payload(key, driver.rows.chunk_bytes))
        with manager.lock:
            manager.complete_store(set(a), context)
            # The CPU tier evicts A to take B: A's write-back starts and waits at the gate.
            assert manager.prepare_store(b, context) is None
            assert [manager.lookup(k, context) for k in a] == [HIT_PENDING] * 4  # tier write
        driver.end_step()
    finally:
        GatedMemoryBackend.gate.set()
    driver.settle()
    assert driver.lookup(context, a) == [HIT_PENDING] * 4  # now in the tier: promoted
    driver.settle()
    assert driver.lookup(context, a) == [HIT] * 4
    assert driver.load(context, a) == [payload(k, gpu_block_bytes()).tobytes() for k in a]


def test_reset_drops_every_tier_and_holds_promotions_until_flushed(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    driver = start(drivers, write_yaml(tmp_path))
    manager = driver.manager
    a, b, c = keys_for("a", 2), keys_for("b", 2), keys_for("c", CPU_CHUNKS)
    context = driver.new_request("r1")
    driver.store(context, a)
    driver.settle()
    with manager.lock:
        assert manager.prepare_store(b, context) is not None  # in flight at the reset
    driver.end_step()
    driver.take_events()
    with manager.lock:
        manager.reset_cache()
        assert not manager.has_pending_work()
    # A was announced and goes; B never was, so its removal only undoes metadata.
    assert driver.take_events() == [
        EventRecord(tuple(a), "CPU", True, None),
        EventRecord(tuple(b), "CPU", True, None, metadata_only=True),
        EventRecord(tuple(a), "STORAGE", True, "nvme"),
        EventRecord(tuple(a), "STORAGE", True, "lmdb"),
    ]
    assert [len(t) for t in adapter(driver).manager.tiers] == [0, 0]
    assert driver.lookup(context, a) == [MISS] * 2
    # Until the workers report the jobs of before the reset, nothing is promoted.
    driver.store(context, c)
    driver.settle()
    driver.store(context, a)  # evicts c[0], c[1]: in the tiers only now
    driver.settle()
    assert driver.lookup(context, c[:2]) == [MISS] * 2
    with manager.lock:
        manager.on_reset_flushed()
    assert driver.lookup(context, c[:2]) == [HIT_PENDING] * 2


def test_restart_serves_what_the_tiers_recovered(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    config = write_yaml(tmp_path)
    a = keys_for("a", CPU_CHUNKS)
    first = start(drivers, config)
    context = first.new_request("r1")
    first.store(context, a)
    first.finish_request(context)
    first.settle()
    drivers.remove(first)
    first.shutdown()

    second = start(drivers, config)  # a new engine: new region, empty CPU tier, same tiers
    assert [len(t) for t in adapter(second).manager.tiers] == [CPU_CHUNKS, CPU_CHUNKS]
    context = second.new_request("r2")
    assert second.lookup(context, a) == [HIT_PENDING] * 4
    second.settle()
    assert second.lookup(context, a) == [HIT] * 4
    assert second.load(context, a) == [payload(k, gpu_block_bytes()).tobytes() for k in a]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"model": {"dtype": "bfloat16"}}, id="dtype"),
        pytest.param({"model": {"name": "another-model"}}, id="model"),
        pytest.param({"parallel": {"tp_size": 2, "world_size": 2}}, id="tensor-parallel"),
        pytest.param({"parallel": {"pp_size": 2, "world_size": 2}}, id="pipeline-parallel"),
        pytest.param({"parallel": {"dcp_size": 2}}, id="decode-context-parallel"),
        pytest.param({"parallel": {"pcp_size": 2}}, id="prefill-context-parallel"),
        pytest.param({"parallel": {"rank": 1, "world_size": 2}}, id="rank"),
        pytest.param({"cache": {"tokens_per_hash": 8}}, id="tokens-per-hash"),
    ],
)
def test_restart_with_another_layout_serves_nothing(
    tmp_path: Path, drivers: list[ManagerDriver], change: dict[str, dict[str, Any]]
) -> None:
    config_path = write_yaml(tmp_path)
    a = keys_for("a", CPU_CHUNKS)
    first = start(drivers, config_path)
    context = first.new_request("r1")
    first.store(context, a)
    first.finish_request(context)
    first.settle()
    drivers.remove(first)
    first.shutdown()

    config = offloading_config(dropin_extra(config_path))
    replaced = {
        section: dataclasses.replace(getattr(config, section), **fields)
        for section, fields in change.items()
    }
    second = ManagerDriver.create(dataclasses.replace(config, **replaced))
    drivers.append(second)
    assert [len(t) for t in adapter(second).manager.tiers] == [0, 0]
    context = second.new_request("r2")
    assert second.lookup(context, a) == [MISS] * 4
    second.settle()
    assert second.lookup(context, a) == [MISS] * 4


def test_store_threshold_admits_a_block_on_its_nth_offer(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    config = write_yaml(tmp_path, [], primary={"capacity": "4KiB", "store_threshold": 3})
    assert adapter(start(drivers, config)).store_threshold == 3  # the YAML's
    driver = start(drivers, config, extra={"store_threshold": 2})  # vLLM's key wins
    manager = driver.manager
    a = keys_for("a", 2)
    context = driver.new_request("r1")
    with manager.lock:
        first = manager.prepare_store(a, context)
        second = manager.prepare_store(a, context)
    assert first is not None and first.keys_to_store == []
    assert second is not None and second.keys_to_store == a
    assert counters(driver)[("vllm:kv_offload_stores_skipped", ())] == 2


def test_a_yaml_tier_s_admission_gate_applies_under_the_drop_in(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    nvme = {"name": "nvme", "type": "file", "capacity": 16 * SLOT_BYTES, "path": "./nvme"}
    driver = start(drivers, write_yaml(tmp_path, [{**nvme, "admission_min_count": 2}]))
    (tier,) = adapter(driver).manager.tiers
    hot, cold = keys_for("hot", 1), keys_for("cold", 1)
    r1 = driver.new_request("r1")
    assert driver.lookup(r1, hot) == [MISS]
    assert driver.lookup(r1, hot) == [MISS]  # twice past the CPU tier: admitted
    driver.store(r1, hot + cold)
    driver.finish_request(r1)
    driver.settle()
    assert set(tier.held) == set(hot)
    assert tier.metrics.stores_not_admitted == 1 and tier.metrics.stored_blocks == 1
    reported = counters(driver)  # what vLLM's stat logger gets
    assert reported[(TieringTierMetrics.NOT_ADMITTED_BLOCKS, ("1:nvme",))] == 1
    assert reported[(TieringTierMetrics.STORED_BLOCKS, ("1:nvme",))] == 1


def test_recency_is_each_request_s_accesses_applied_when_it_finishes(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    """vLLM 0.33 never calls touch: a request's loads and store offers are its accesses, applied
    in prefix order (the head most recent) when it finishes."""
    driver = start(drivers, write_yaml(tmp_path, []))
    a, b, c = keys_for("a", 2), keys_for("b", 2), keys_for("c", 3)
    for name, keys in (("r1", a), ("r2", b)):
        context = driver.new_request(name)
        driver.store(context, keys)
        driver.finish_request(context)
    reader = driver.new_request("r3")
    for position, key in enumerate(a, 1):
        reader.set_offload_key_position(key, position * BLOCK_SIZE)
    assert driver.lookup(reader, a) == [HIT, HIT]
    driver.load(reader, a[::-1])  # loaded tail first: the order of the positions counts
    # Until the reader finishes, A is as old as its store: C would evict it first.
    driver.finish_request(reader)
    out = driver.store(driver.new_request("r4"), c)
    assert out.evicted_keys == [b[1], b[0], a[1]]


def test_chain_learns_each_request_when_it_finishes(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    """vLLM's connector gives a request's keys a step at a time: the drop-in tells the policy
    the request whole when it finishes, and chain files a continuation's new blocks then."""
    driver = start(drivers, write_yaml(tmp_path, []), extra={"eviction_policy": "chain"})
    a, b = keys_for("a", 2), keys_for("b", 2)
    first = driver.new_request("r1")
    driver.store(first, a)
    driver.finish_request(first)
    turn = driver.new_request("r2")  # the next turn: a, then b
    for position, key in enumerate([*a, *b], 1):
        turn.set_offload_key_position(key, position * BLOCK_SIZE)
    assert driver.lookup(turn, a) == [HIT, HIT]
    driver.load(turn, a)
    driver.store(turn, b)
    policy = adapter(driver).manager.primary.policy
    assert isinstance(policy, ChainPolicy)
    assert set(b) <= set(policy.list_keys(0))  # stored before the request is known whole
    driver.finish_request(turn)
    assert policy.class_stats[0].continued == 1
    assert set(policy.list_keys(1)) == {*a, *b}
    assert policy.tail_keys == (a[0], *b)  # a[-1] was continued; b's blocks it stored


def test_completions_given_as_sets_apply_in_prefix_order(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    driver = start(drivers, write_yaml(tmp_path))
    manager = driver.manager
    a = keys_for("a", CPU_CHUNKS)
    context = driver.new_request("r1")
    for position, key in enumerate(a, 1):
        context.set_offload_key_position(key, position * BLOCK_SIZE)
    with manager.lock:
        out = manager.prepare_store(a[::-1], context)
        assert out is not None and out.keys_to_store == a[::-1]
    driver.end_step()
    with manager.lock:
        manager.complete_store(set(a), context)  # as vLLM's connector completes a job
    driver.settle()
    events = driver.take_events()
    assert [e.keys for e in events if not e.removed] == [tuple(a)] * 3  # CPU, nvme, lmdb


def test_a_prefix_larger_than_the_cpu_tier_is_served_in_part(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    """Six chunks in the tiers, four CPU rows: the scan (vLLM's full-attention prefix scan)
    stops at the first MISS; once the first four are promoted, the answer is stable: the fifth
    chunk's promotion never evicts the four hits the request is about to load."""
    driver = start(drivers, write_yaml(tmp_path))
    keys = keys_for("a", 6)
    context = driver.new_request("r1")
    for batch in (keys[:3], keys[3:]):
        driver.store(context, batch)
        driver.settle()
    driver.store(context, keys_for("b", CPU_CHUNKS))  # the CPU tier holds none of them now
    driver.settle()

    def scan() -> list[LookupResult]:
        answers = []
        with driver.manager.lock:
            for key in keys:
                answers.append(driver.manager.lookup(key, context))
                if answers[-1] is MISS:
                    break
        driver.end_step()
        driver.drain_tiers()
        return answers

    assert scan() == [HIT_PENDING] * 4 + [MISS]
    assert scan() == [HIT_PENDING] * 4 + [MISS]  # read during this step
    for _ in range(3):
        assert scan() == [HIT] * 4 + [MISS]
    assert counters(driver)[("vllm:kv_offload_tiering_promotion_allocation_failures", ())] == 5


def test_stats_and_config_info_are_vllm_s_and_declared(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    """vLLM's Prometheus side (OffloadPromMetrics) takes every name and label the manager
    reports: each is declared by the spec's class methods, which the API server calls."""
    config = write_yaml(tmp_path)
    driver = start(drivers, config)
    cascade_evict_promote(driver)  # (takes the stats so far)
    a = keys_for("a", CPU_CHUNKS)
    context = driver.new_request("r9")
    assert driver.lookup(context, a) == [HIT] * 4
    with driver.manager.lock:
        stats = driver.manager.get_stats()
        infos = driver.manager.config_info()
    assert stats is not None
    extra = dropin_extra(config)
    declared = TieringSpec.config_info_keys(extra)
    assert {key for info in infos for key in info} == set(declared)
    assert set(INFO_KEYS) <= set(declared)
    assert [info["tier"] for info in infos] == [PRIMARY_LABEL, "1:nvme", "2:lmdb"]
    assert infos[1]["tiering_backend"] == "file" and infos[2]["tiering_backend"] == "lmdb"
    assert {info["tiering_fingerprint"] for info in infos} == {
        layout_fingerprint(driver.spec).hex()
    }
    stats.set_info(infos)

    registry = CollectorRegistry()
    kinds = {
        kind: functools.partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)
    }
    engine = vllm_config(extra)
    prom = OffloadPromMetrics(engine, kinds, ["engine"], {0: ["0"]})
    prom.observe(stats.data)
    sample = registry.get_sample_value
    assert (
        sample("vllm:kv_offload_tiering_chunk_hits_total", {"engine": "0", "tier": "0:primary"})
        == 4
    )
    assert sample("tiering:tier_usage_bytes", {"engine": "0", "tier": "1:nvme"}) == 8 * SLOT_BYTES
    # Every tier's capacity and usage, the CPU tier's included (vLLM has no such gauge).
    row_bytes = adapter(driver).manager.row_bytes
    capacity = {"0:primary": CPU_CHUNKS * row_bytes, "1:nvme": 16 * SLOT_BYTES, "2:lmdb": 2**20}
    for tier, capacity_bytes in capacity.items():
        labels = {"engine": "0", "tier": tier}
        assert sample("tiering:tier_capacity_bytes", labels) == capacity_bytes
    held = len(adapter(driver).manager.primary)
    assert held == CPU_CHUNKS
    assert sample("tiering:tier_usage_bytes", {"engine": "0", "tier": "0:primary"}) == (
        held * row_bytes
    )
    for tier in ("0:primary", "1:nvme", "2:lmdb"):  # every tier's policy is LRU here
        labels = {"engine": "0", "tier": tier, "rule": "lru"}
        assert sample("tiering:tier_eviction_rule", labels) == 1
    info = {"engine": "0", **{k: str(v) for k, v in infos[1].items()}}
    assert sample("vllm:kv_offload_config_info", {**dict.fromkeys(declared, ""), **info}) == 1


def test_shutdown_unmaps_the_region(tmp_path: Path, drivers: list[ManagerDriver]) -> None:
    driver = start(drivers, write_yaml(tmp_path))
    cascade_evict_promote(driver)  # the tiers have read and written the rows
    manager = adapter(driver)
    drivers.remove(driver)
    driver.shutdown()
    assert manager.region.mmap_obj is None  # unmapped: no view of it survived
    assert not Path(manager.region.mmap_path).exists()
    manager.shutdown()  # idempotent


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tiering_config": None}, "needs 'tiering_config'"),
        ({"secondary_tiers": [{"type": "tiering"}]}, "'secondary_tiers' belongs"),
        ({"cache_policy_module_path": "x.y"}, "cache_policy_module_path"),
    ],
)
def test_a_bad_extra_config_is_a_config_error_naming_it(
    tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    config = offloading_config(dropin_extra(write_yaml(tmp_path)) | extra)
    with pytest.raises(ConfigError, match=message):
        OffloadingSpecFactory.create_spec(config)


@pytest.mark.parametrize(
    ("yaml_text", "message"),
    [
        (None, "tiering.yaml"),  # no such file
        ("version: 1\nprimary: {capacity: 4KiB, store_threshold: 0}\n", "store_threshold"),
        (
            "version: 1\nprimary: {capacity: 4KiB}\n"
            "secondary_tiers: [{name: x, type: nosuch, capacity: 1MiB}]\n",
            "nosuch",
        ),
    ],
)
def test_a_bad_tiering_config_fails_the_manager_and_releases_the_region(
    tmp_path: Path, yaml_text: str | None, message: str
) -> None:
    path = tmp_path / "tiering.yaml"
    if yaml_text is not None:
        path.write_text(yaml_text)
    engine_id = f"{ENGINE_ID_PREFIX}bad-{abs(hash(yaml_text))}"
    spec = OffloadingSpecFactory.create_spec(
        offloading_config(dropin_extra(path), engine_id=engine_id)
    )
    with pytest.raises(ConfigError, match=message):
        spec.get_manager()
    assert not Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").exists()


def test_tiering_imports_and_works_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import tiering, tiering.config, tiering.integrations\n"
        "try:\n"
        "    import tiering.integrations.vllm\n"
        "except ImportError as exc:\n"
        "    print('adapter:', type(exc).__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "adapter: ModuleNotFoundError"


# -- vLLM's Scheduler and OffloadingConnector ------------------------------------------------------


def documented(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """The ``--kv-transfer-config`` and YAML of docs/vllm.md's drop-in section, exactly, with
    the sizes and paths of this test (the keys are the documented ones)."""
    text = DOCS.read_text()
    section = text[text.index("## The drop-in: `TieringSpec`") :]
    match = re.search(r"--kv-transfer-config '(\{[^']*\"TieringSpec\"[^']*\})'", section)
    assert match, "docs/vllm.md lost the drop-in's --kv-transfer-config"
    transfer = json.loads(match.group(1))
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block, "docs/vllm.md lost the drop-in's YAML example"
    data = yaml.safe_load(block.group(1))
    capacities = {"file": 16 * SLOT_BYTES, "lmdb": "1MiB"}
    data["primary"]["capacity"] = "16KiB"  # (not used: cpu_bytes_to_use sizes the CPU tier)
    for tier in data["secondary_tiers"]:
        tier["path"] = str(tmp_path / tier["name"])
        tier["capacity"] = capacities[tier["type"]]
    path = tmp_path / "tiering.yaml"
    path.write_text(yaml.safe_dump(data))
    extra = transfer["kv_connector_extra_config"]
    assert set(extra) == {"spec_name", "spec_module_path", "cpu_bytes_to_use", "tiering_config"}
    extra["cpu_bytes_to_use"] = CPU_CHUNKS * gpu_block_bytes()
    extra["tiering_config"] = str(path)
    return transfer, path


@pytest.mark.parametrize("policy", [None, "hybrid"])
def test_the_documented_command_line_gives_cpu_file_and_lmdb_tiering(
    tmp_path: Path, policy: str | None
) -> None:
    """vLLM's Scheduler and OffloadingConnector built from exactly the documented JSON: a
    prompt evicted from the GPU and the CPU tier comes back from the file tier. Again with
    ``eviction_policy: hybrid`` and hybrid in every secondary tier (its shadows fed by
    vLLM's own calls)."""
    transfer, path = documented(tmp_path)
    if policy is not None:
        transfer["kv_connector_extra_config"]["eviction_policy"] = policy
        data = yaml.safe_load(path.read_text())
        for tier in data["secondary_tiers"]:
            tier["policy"] = policy
        path.write_text(yaml.safe_dump(data))
    engine_id = f"{ENGINE_ID_PREFIX}docs-{policy}"
    config = vllm_config(
        {}, num_gpu_blocks=16, transfer=KVTransferConfig(**transfer, engine_id=engine_id)
    )
    engine = EngineDriver(config, 16)
    try:
        manager = engine.manager
        assert isinstance(manager, TieringManager)
        tiers = manager.manager.tiers
        assert [(t.name, type(t.backend).__name__) for t in tiers] == [
            ("nvme", "FileBackend"),
            ("lmdb", "LMDBBackend"),
        ]
        assert manager.policy == (policy or "arc")
        if policy is not None:
            assert all(type(t.policy) is HybridPolicy for t in tiers)
            assert type(manager.manager.primary.policy) is HybridPolicy
        prompt_a = list(range(1, 1 + 4 * BLOCK_SIZE))
        engine.add_request("a", prompt_a)
        engine.run()
        engine.add_request("b", list(range(100, 100 + 4 * BLOCK_SIZE)))  # A leaves the CPU
        engine.run()
        assert engine.scheduler.reset_prefix_cache()  # and the GPU prefix cache
        request = engine.add_request("a-again", prompt_a + [1, 2, 3])
        trace = engine.run()
        # The first steps wait for the promotion; then the 64 prompt tokens are loaded and
        # only the 3 new ones computed.
        assert [s for s in trace if s] == [{"a-again": 3}]
        loaded = engine.loaded_blocks["a-again"]
        assert [(group, index) for group, index, _ in loaded] == [(0, i) for i in range(4)]
        for group, index, data in loaded:
            assert data == engine.block_content(request.block_hashes[index], group).tobytes()
        assert [t.backend.stats.hits for t in tiers] == [4, 0]
    finally:
        engine.shutdown()


def engine_config(
    root: Path, cpu_chunks: int, gpu_blocks: int, sliding_window: int | None = None, **kw: Any
) -> Any:
    extra = dropin_extra(write_yaml(root), cpu_chunks)
    extra["cpu_bytes_to_use"] = cpu_chunks * 4096  # one page per chunk in either layout
    return vllm_config(extra, num_gpu_blocks=gpu_blocks, **kw)


def evict_and_reload(engine: EngineDriver, prompt: list[int], other: list[int]) -> Any:
    """Run ``prompt``, push it out of the CPU tier with ``other`` and out of the GPU prefix
    cache, then ask for it again; returns (trace, request)."""
    engine.add_request("first", prompt)
    engine.run()
    engine.add_request("other", other)
    engine.run()
    assert engine.scheduler.reset_prefix_cache()
    request = engine.add_request("again", prompt)
    return engine.run(), request


def test_a_fully_offloaded_432_token_prompt_hits_432_tokens(tmp_path: Path) -> None:
    """vLLM's connector lets a full-attention hit cover the whole prompt (the engine recomputes
    the last token): all 27 chunks of a 432-token prompt are loaded, not 26 (416 tokens)."""
    config = engine_config(tmp_path, cpu_chunks=32, gpu_blocks=64, max_model_len=512)
    engine = EngineDriver(config, 64)
    try:
        prompt = list(range(1, 433))
        trace, request = evict_and_reload(engine, prompt, list(range(1000, 1000 + 5 * 16)))
        loaded = engine.loaded_blocks["again"]
        assert [(group, index) for group, index, _ in loaded] == [(0, i) for i in range(27)]
        for group, index, data in loaded:
            assert data == engine.block_content(request.block_hashes[index], group).tobytes()
        assert [s for s in trace if s] == [{"again": 1}]  # only the last token is computed
    finally:
        engine.shutdown()


def test_a_sliding_window_hybrid_model_loads_both_groups_bit_exact(tmp_path: Path) -> None:
    """Layer 0 full attention, layer 1 a 32-token (two-chunk) sliding window. The hit leaves a
    token to compute; the full-attention group loads every chunk up to it, the window group the
    two chunks its window needs, from the tiers, bit-exact. A promotion answers HIT_PENDING, so
    vLLM's window scan stops at the window: the window chunks an earlier, shorter request stored
    further left are not promoted (RETRY would restart the scan and promote them too)."""
    config = engine_config(tmp_path, cpu_chunks=16, gpu_blocks=48, sliding_window=32)
    engine = EngineDriver(config, 48, sliding_window=32)
    try:
        prompt = list(range(1, 1 + 6 * BLOCK_SIZE + 5))  # 6 whole blocks and 5 tokens
        engine.add_request("shorter", prompt[: 4 * BLOCK_SIZE + 5])  # its window: chunks 2, 3
        engine.run()
        engine.add_request("first", prompt)
        engine.run()
        for n in range(2):  # the CPU tier's 16 rows go to other prompts
            engine.add_request(f"other-{n}", list(range(500 + 200 * n, 612 + 200 * n)))
            engine.run()
        assert engine.scheduler.reset_prefix_cache()
        request = engine.add_request("again", prompt)
        trace = engine.run()
        loaded = engine.loaded_blocks["again"]
        assert sorted((g, i) for g, i, _ in loaded) == [(0, i) for i in range(6)] + [(1, 4), (1, 5)]
        for group, index, data in loaded:
            assert data == engine.block_content(request.block_hashes[index], group).tobytes()
        assert [s for s in trace if s] == [{"again": 5}]
        tiers = engine.manager.manager.tiers  # type: ignore[attr-defined]
        assert sum(t.metrics.promoted_blocks for t in tiers) == 8
    finally:
        engine.shutdown()


def test_the_same_engine_run_twice_gives_identical_traces(tmp_path: Path) -> None:
    def run(root: Path) -> list[Any]:
        engine = EngineDriver(engine_config(root, cpu_chunks=4, gpu_blocks=16), 16)
        try:
            trace, _ = evict_and_reload(
                engine, list(range(1, 1 + 4 * BLOCK_SIZE)), list(range(200, 200 + 64))
            )
            events = [EventRecord.of(e) for e in engine.manager.take_events()]
            return [trace, sorted(engine.loaded_blocks.items()), events]
        finally:
            engine.shutdown()

    assert run(tmp_path / "one") == run(tmp_path / "two")


def _rule_values(driver: ManagerDriver) -> dict[str, dict[tuple[str, ...], float]]:
    with driver.manager.lock:
        stats = driver.manager.get_stats()
    assert stats is not None
    _, values = stats.metric_sections()
    return {
        name: values.get(name, {})
        for name in (TieringTierMetrics.EVICTION_RULE, TieringTierMetrics.EVICTION_RULE_SWITCHES)
    }


def test_the_rule_each_tier_s_policy_follows_reaches_vllm_s_stats(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    """The CPU tier's policy (a test double whose rule the test sets) and the tiers' (LRU):
    a gauge per rule it may follow, and the switches since the previous stats."""
    config = write_yaml(tmp_path, primary={"capacity": "4KiB", "policy": SWITCHING})
    driver = start(drivers, config)
    policy = adapter(driver).manager.primary.policy
    assert isinstance(policy, SwitchingPolicy)
    rule, switches = TieringTierMetrics.EVICTION_RULE, TieringTierMetrics.EVICTION_RULE_SWITCHES
    first = _rule_values(driver)
    assert first[rule] == {
        (PRIMARY_LABEL, "lru"): 1,
        (PRIMARY_LABEL, "arc"): 0,
        ("1:nvme", "lru"): 1,
        ("2:lmdb", "lru"): 1,
    }
    assert first[switches] == {}  # none yet: no counter sample
    policy.switch_to("arc")
    policy.switch_to("lru")
    policy.switch_to("arc")
    second = _rule_values(driver)
    assert second[rule][(PRIMARY_LABEL, "arc")] == 1 and second[rule][(PRIMARY_LABEL, "lru")] == 0
    assert second[switches] == {(PRIMARY_LABEL,): 3}
    assert _rule_values(driver)[switches] == {}  # a counter reports what is new only
