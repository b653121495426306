"""tiering's file, LMDB and plugin tiers below vLLM 0.33's own CPU tier (``secondary_tiers``).

Everything runs through the real vLLM package: its ``OffloadingSpecFactory`` builds its
``TieringOffloadingSpec`` from the ``OffloadingConfig`` its connector derives from a
``VllmConfig``; its ``TieringOffloadingManager`` creates our tiers through its
``SecondaryTierFactory`` (type ``tiering``, registered by our ``vllm.general_plugins`` entry point)
and drives them. The worker is played by writing and reading the CPU tier's shared region rows.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest
from switching_policy import SwitchingPolicy
from vllm.v1.kv_offload.base import LookupResult, Medium
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
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
    tiering_spec_extra,
    vllm_config,
)

from tiering.backends.ownership import LayoutMismatchError
from tiering.errors import BackendError, ConfigError
from tiering.integrations import vllm_plugin
from tiering.integrations.vllm_layout import layout_fingerprint
from tiering.integrations.vllm_tiers import TieringSecondaryTier, TieringTierMetrics

HIT, MISS = LookupResult.HIT, LookupResult.MISS
HIT_PENDING, RETRY = LookupResult.HIT_PENDING, LookupResult.RETRY
CPU_CHUNKS = 4
SLOT_BYTES = 8192  # the file backend's slot for a 4 KiB chunk: 4 KiB header area + payload


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


def file_tier(root: Path, name: str = "nvme", blocks: int = 16, **keys: Any) -> dict[str, Any]:
    return {
        "type": "tiering",
        "backend": "file",
        "name": name,
        "capacity": blocks * SLOT_BYTES,
        "path": str(root / name),
        "enable_kv_events": True,
        **keys,
    }


def lmdb_tier(root: Path, name: str = "lmdb", **keys: Any) -> dict[str, Any]:
    return {
        "type": "tiering",
        "backend": "lmdb",
        "name": name,
        "capacity": "1MiB",
        "path": str(root / name),
        "sync": False,
        "enable_kv_events": True,
        **keys,
    }


def two_tiers(root: Path) -> list[dict[str, Any]]:
    return [file_tier(root), lmdb_tier(root)]


@pytest.fixture
def drivers() -> Iterator[list[ManagerDriver]]:
    """Drivers to shut down after the test, whatever happens in it."""
    made: list[ManagerDriver] = []
    yield made
    for driver in made:
        driver.shutdown()


def start(drivers: list[ManagerDriver], tiers: list[dict[str, Any]], **kw: Any) -> ManagerDriver:
    driver = ManagerDriver.create(offloading_config(tiering_spec_extra(CPU_CHUNKS, tiers), **kw))
    drivers.append(driver)
    return driver


def tier_named(driver: ManagerDriver, name: str) -> TieringSecondaryTier:
    for tier in driver.tiers:
        if isinstance(tier, TieringSecondaryTier) and tier.name == name:
            return tier
    raise AssertionError(f"no tier {name!r}")


def counters(driver: ManagerDriver) -> dict[tuple[str, tuple[str, ...]], float]:
    """The tiers' own counters in the manager's stats (timings left out: they vary)."""
    with driver.manager.lock:
        stats = driver.manager.get_stats()
    assert stats is not None
    types, values = stats.metric_sections()
    return {
        (name, labels): value
        for name, by_label in values.items()
        if name.startswith("tiering:") and types[name] == "counter"
        for labels, value in by_label.items()
    }


def cascade_evict_promote(driver: ManagerDriver) -> dict[str, Any]:
    """Store A, then B (evicting A from the full CPU tier), then bring A back from the tiers.

    Returns everything observable, for comparing runs.
    """
    chunk_bytes = gpu_block_bytes()
    a, b = keys_for("a", CPU_CHUNKS), keys_for("b", CPU_CHUNKS)
    trace: dict[str, Any] = {}

    r1 = driver.new_request("r1")
    trace["store_a"] = chunk_ids(driver.store(r1, a).store_spec)
    driver.finish_request(r1)

    r2 = driver.new_request("r2")
    trace["lookup_a_cpu"] = driver.lookup(r2, a)
    trace["events_after_a"] = driver.take_events()
    out_b = driver.store(r2, b)
    trace["store_b"] = (chunk_ids(out_b.store_spec), sorted(out_b.evicted_keys))
    driver.finish_request(r2)

    r3 = driver.new_request("r3")
    trace["lookup_a_evicted"] = driver.lookup(r3, a)  # promotions start; submitted at step end
    trace["lookup_a_promoted"] = driver.lookup(r3, a)
    trace["data_a"] = driver.load(r3, a)
    driver.finish_request(r3)
    trace["events_after_promotion"] = driver.take_events()
    trace["counters"] = counters(driver)
    assert trace["data_a"] == [payload(k, chunk_bytes).tobytes() for k in a]
    return trace


def test_the_plugin_registers_the_tier_type() -> None:
    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "tiering"]
    assert entry.value == "tiering.integrations.vllm_plugin:register"
    entry.load()()  # what vLLM's load_general_plugins does; a second registration is a no-op
    vllm_plugin.register()
    assert SecondaryTierFactory.get_tier_class({"type": "tiering"}) is TieringSecondaryTier


def test_store_cascade_evict_and_promote_bit_exact(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    driver = start(drivers, two_tiers(tmp_path))
    assert isinstance(driver.manager, TieringOffloadingManager)
    a, b = keys_for("a", CPU_CHUNKS), keys_for("b", CPU_CHUNKS)
    trace = cascade_evict_promote(driver)

    assert trace["store_a"] == [0, 1, 2, 3]
    assert trace["lookup_a_cpu"] == [HIT] * 4
    # The CPU tier's store, then each tier's: STORAGE, owned by the tier's name.
    assert trace["events_after_a"] == [
        EventRecord(tuple(a), "CPU", False, None),
        EventRecord(tuple(a), "STORAGE", False, "nvme", removal_expected=True),
        EventRecord(tuple(a), "STORAGE", False, "lmdb", removal_expected=True),
    ]
    # B takes A's rows: the CPU tier evicted all of A, so A's bytes now live only below it.
    assert trace["store_b"] == ([0, 1, 2, 3], sorted(a))
    # The CPU tier misses A; the first tier holds it: a promotion starts for each chunk.
    assert trace["lookup_a_evicted"] == [HIT_PENDING] * 4
    assert trace["lookup_a_promoted"] == [HIT] * 4
    # (load() asserted A's bytes are back in their rows, bit-exact.)
    cpu_events = [e for e in trace["events_after_promotion"] if e.medium == "CPU"]
    assert [(e.keys, e.removed) for e in cpu_events if e.keys == tuple(b)] == [(tuple(b), False)]
    assert EventRecord(tuple(a), "CPU", False, None) in cpu_events  # promoted in
    assert [e for e in trace["events_after_promotion"] if e.medium == "STORAGE"] == [
        EventRecord(tuple(b), "STORAGE", False, "nvme", removal_expected=True),
        EventRecord(tuple(b), "STORAGE", False, "lmdb", removal_expected=True),
    ]
    assert trace["counters"] == {
        (TieringTierMetrics.STORED_BLOCKS, ("nvme",)): 8,
        (TieringTierMetrics.STORED_BLOCKS, ("lmdb",)): 8,
        (TieringTierMetrics.READ_BLOCKS, ("nvme",)): 4,
    }
    nvme = tier_named(driver, "nvme")
    assert nvme.config_info() == {
        "tiering_name": "nvme",
        "tiering_backend": "file",
        "tiering_capacity_bytes": 16 * SLOT_BYTES,
        "tiering_persistent": True,
        "tiering_fingerprint": layout_fingerprint(driver.spec).hex(),
    }
    with driver.manager.lock:
        infos = driver.manager.config_info()
    assert [i["tier"] for i in infos] == ["0:primary", "1:tiering", "2:tiering"]
    assert infos[1]["tiering_name"] == "nvme" and infos[2]["tiering_name"] == "lmdb"


def test_the_same_scenario_twice_gives_identical_results(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    first = cascade_evict_promote(start(drivers, two_tiers(tmp_path / "one")))
    second = cascade_evict_promote(start(drivers, two_tiers(tmp_path / "two")))
    assert first == second


def test_a_chunk_is_retry_while_its_tier_write_is_in_flight(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    driver = start(drivers, [file_tier(tmp_path)])
    nvme = tier_named(driver, "nvme")
    a = keys_for("a", 2)
    context = driver.new_request("r1")
    with driver.manager.lock:  # a scheduler step
        out = driver.manager.prepare_store(a, context)
        assert out is not None
        # Being written to the CPU tier: vLLM's own HIT_PENDING.
        assert [driver.manager.lookup(k, context) for k in a] == [HIT_PENDING] * 2
    driver.end_step()
    with driver.manager.lock:  # the worker reports the store: it cascades to the tier
        driver.manager.complete_store(out.keys_to_store, context)
    nvme.drain_jobs()
    # The write finished, but the tier publishes it only when the manager collects it.
    assert [nvme.lookup(k, context) for k in a] == [RETRY] * 2
    assert driver.lookup(context, a) == [HIT] * 2  # the poll of this step collects it
    assert [nvme.lookup(k, context) for k in a] == [HIT] * 2


def test_restart_serves_what_the_tiers_recovered(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    a = keys_for("a", CPU_CHUNKS)
    first = start(drivers, two_tiers(tmp_path))
    context = first.new_request("r1")
    first.store(context, a)
    first.finish_request(context)
    first.lookup(first.new_request("r2"), [])  # a step: the manager collects the cascades
    drivers.remove(first)
    first.shutdown()

    # A new engine (new CPU region, empty CPU tier), the same tier directories.
    second = start(drivers, two_tiers(tmp_path))
    assert [len(t.policy) for t in second.tiers] == [CPU_CHUNKS, CPU_CHUNKS]
    context = second.new_request("r3")
    assert second.lookup(context, a) == [HIT_PENDING] * 4
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
    a = keys_for("a", CPU_CHUNKS)
    first = start(drivers, two_tiers(tmp_path))
    context = first.new_request("r1")
    first.store(context, a)
    first.finish_request(context)
    first.lookup(first.new_request("r2"), [])
    drivers.remove(first)
    first.shutdown()

    def changed(tiers: list[dict[str, Any]]) -> Any:
        config = offloading_config(tiering_spec_extra(CPU_CHUNKS, tiers))
        replaced = {
            section: dataclasses.replace(getattr(config, section), **fields)
            for section, fields in change.items()
        }
        return dataclasses.replace(config, **replaced)

    # By default a tier refuses data of another layout: nothing is emptied behind the operator.
    with pytest.raises(LayoutMismatchError, match="holds blocks written for another layout"):
        ManagerDriver.create(changed(two_tiers(tmp_path)))
    # Told to wipe it, the tier starts empty and serves none of the old blocks.
    wipe = [
        file_tier(tmp_path, on_layout_mismatch="wipe"),
        lmdb_tier(tmp_path, on_layout_mismatch="wipe"),
    ]
    second = ManagerDriver.create(changed(wipe))
    drivers.append(second)
    assert [len(t.policy) for t in second.tiers] == [0, 0]
    assert second.lookup(second.new_request("r3"), a) == [MISS] * 4


def test_the_fingerprint_covers_every_input_that_changes_a_rows_bytes() -> None:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    config = offloading_config({"cpu_bytes_to_use": CPU_CHUNKS * gpu_block_bytes()})
    group = config.groups[0]
    variants: dict[str, dict[str, Any]] = {
        "model": {"model": dataclasses.replace(config.model, name="other")},
        "dtype": {"model": dataclasses.replace(config.model, dtype="bfloat16")},
        "tokens_per_block": {"groups": (dataclasses.replace(group, tokens_per_block=32),)},
        "layers": {"groups": (dataclasses.replace(group, layer_names=group.layer_names[:1]),)},
        "window": {"groups": (dataclasses.replace(group, sliding_window_size_in_chunks=4),)},
        "tokens_per_hash": {"cache": dataclasses.replace(config.cache, tokens_per_hash=8)},
        "blocks_per_chunk": {"cache": dataclasses.replace(config.cache, blocks_per_chunk=2)},
        "worker_bytes": {"worker_kv_bytes_per_block": config.worker_kv_bytes_per_block * 2},
        "tp": {"parallel": dataclasses.replace(config.parallel, tp_size=2, world_size=2)},
        "pp": {"parallel": dataclasses.replace(config.parallel, pp_size=2, world_size=2)},
        "pcp": {"parallel": dataclasses.replace(config.parallel, pcp_size=2)},
        "dcp": {"parallel": dataclasses.replace(config.parallel, dcp_size=2)},
        "world_size": {"parallel": dataclasses.replace(config.parallel, world_size=2)},
        "rank": {"parallel": dataclasses.replace(config.parallel, rank=1, world_size=2)},
        "canonical": {"canonical_layout": True},
        "kv_cache_layout": {"kv_cache_layout": "HND"},
    }
    base = layout_fingerprint(OffloadingSpecFactory.create_spec(config))
    seen = {base: "base"}
    for name, fields in variants.items():
        fingerprint = layout_fingerprint(
            OffloadingSpecFactory.create_spec(dataclasses.replace(config, **fields))
        )
        assert fingerprint not in seen, f"{name} gives the fingerprint of {seen.get(fingerprint)}"
        seen[fingerprint] = name
    # Data-parallel replicas share one layout, and the engine id names a region, not a layout.
    same = dataclasses.replace(
        config,
        engine_id="another-engine",
        parallel=dataclasses.replace(config.parallel, data_parallel_index=1, data_parallel_size=2),
    )
    assert layout_fingerprint(OffloadingSpecFactory.create_spec(same)) == base


def test_a_corrupt_block_is_never_served_and_the_next_tier_serves_it(
    tmp_path: Path, drivers: list[ManagerDriver], caplog: pytest.LogCaptureFixture
) -> None:
    a, b = keys_for("a", CPU_CHUNKS), keys_for("b", CPU_CHUNKS)
    driver = start(drivers, two_tiers(tmp_path))
    context = driver.new_request("r1")
    driver.store(context, a)
    driver.lookup(context, [])
    driver.store(context, b)  # evicts A from the CPU tier
    driver.finish_request(context)
    driver.take_events()
    # Flip one payload byte of every slot of the file tier.
    slots = tmp_path / "nvme" / "slots.bin"
    with slots.open("r+b") as f:
        for slot in range(16):
            f.seek(slot * SLOT_BYTES + 4096)
            byte = f.read(1)
            if byte:
                f.seek(slot * SLOT_BYTES + 4096)
                f.write(bytes([byte[0] ^ 0xFF]))

    context = driver.new_request("r2")
    assert driver.lookup(context, a) == [HIT_PENDING] * 4  # from nvme: its index holds A
    # nvme's read found every block corrupt: the promotion failed, nothing was served...
    assert driver.lookup(context, a) == [HIT_PENDING] * 4  # ...and LMDB now promotes it
    assert driver.lookup(context, a) == [HIT] * 4
    assert driver.load(context, a) == [payload(k, gpu_block_bytes()).tobytes() for k in a]
    nvme = tier_named(driver, "nvme")
    assert [nvme.lookup(k, context) for k in a] == [MISS] * 4
    removals = [e for e in driver.take_events() if e.medium == "STORAGE" and e.removed]
    assert removals == [EventRecord(tuple(a), "STORAGE", True, "nvme")]
    found = counters(driver)
    assert found[(TieringTierMetrics.CORRUPT_BLOCKS, ("nvme",))] == 4
    assert found[(TieringTierMetrics.READ_FAILED_BLOCKS, ("nvme",))] == 4
    assert found[(TieringTierMetrics.READ_BLOCKS, ("lmdb",))] == 4
    assert [r.getMessage().count("corrupt block") for r in caplog.records] == [1] * 4
    # The records hold the backend's errors, whose tracebacks reference the region's rows:
    # kept until the report, they would keep vLLM from unmapping the region at shutdown.
    caplog.clear()


def test_a_tier_from_a_yaml_file_and_a_plugin_backend(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    config = tmp_path / "tiering.yaml"
    config.write_text(
        "version: 1\n"
        "primary: {capacity: 4096}\n"  # required by the format; not used under vLLM
        "secondary_tiers:\n"
        f"  - {{name: disk, type: file, capacity: {16 * SLOT_BYTES}, path: ./disk}}\n"
        f"  - {{name: other, type: file, capacity: {16 * SLOT_BYTES}, path: ./other}}\n"
    )
    tiers = [
        {"type": "tiering", "tiering_config": str(config), "tier": "disk"},
        {
            "type": "TieringSecondaryTier",
            "module_path": "tiering.integrations.vllm_tiers",
            "backend": "tiering.backends.memory:MemoryBackend",
            "name": "plugin",
            "capacity": "1MiB",
        },
    ]
    driver = start(drivers, tiers)
    assert [(t.name, t.settings.type) for t in driver.tiers] == [
        ("disk", "file"),
        ("plugin", "tiering.backends.memory:MemoryBackend"),
    ]
    assert (tmp_path / "disk" / "slots.bin").exists()  # relative to the YAML file
    a, b = keys_for("a", CPU_CHUNKS), keys_for("b", CPU_CHUNKS)
    context = driver.new_request("r1")
    driver.store(context, a)
    driver.lookup(context, [])
    driver.store(context, b)
    assert driver.lookup(context, a) == [HIT_PENDING] * 4
    assert driver.lookup(context, a) == [HIT] * 4
    assert driver.load(context, a) == [payload(k, gpu_block_bytes()).tobytes() for k in a]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"name": "x", "capacity": "1MiB"}, "missing 'backend'"),
        ({"backend": "nosuch", "capacity": "1MiB"}, "nosuch"),
        ({"backend": "memory", "capacity": "lots"}, "capacity"),
        ({"backend": "memory", "capacity": "1MiB", "colour": "red"}, "colour"),
        ({"backend": "memory", "capacity": "1MiB", "write_policy": "write_back"}, "write_through"),
        (
            {"backend": "memory", "capacity": "1MiB", "admission_min_count": 2},
            "admission_min_count is not available under vLLM's CPU tier",
        ),
        ({"backend": "memory", "capacity": "1MiB", "locality": "moon"}, "moon"),
        ({"backend": "memory", "capacity": "1MiB", "tier": "x"}, "'tier' names a tier"),
        ({"tiering_config": "t.yaml", "backend": "memory"}, "not both"),
        ({"tiering_config": "/nonexistent/t.yaml"}, "/nonexistent/t.yaml"),
        (
            {
                "backend": "redis",
                "capacity": "1GiB",
                "url": "redis://127.0.0.1:1/0",
                "shared": True,
            },
            "backend is shared",
        ),  # fmt: skip
    ],
)
def test_a_bad_tier_entry_is_a_config_error_naming_it(entry: dict[str, Any], message: str) -> None:
    engine_id = f"{ENGINE_ID_PREFIX}bad-{abs(hash(json.dumps(entry)))}"
    config = offloading_config(
        tiering_spec_extra(CPU_CHUNKS, [{"type": "tiering", **entry}]), engine_id=engine_id
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(config)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        spec.get_manager()
    # vLLM released the CPU region it had created.
    assert not Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").exists()


def test_an_engine_step_loop_loads_a_prompt_back_from_the_tiers(tmp_path: Path) -> None:
    """vLLM's Scheduler and OffloadingConnector: a prompt evicted from GPU and CPU comes back."""
    gpu_blocks = 16
    engine = EngineDriver(
        vllm_config(tiering_spec_extra(CPU_CHUNKS, two_tiers(tmp_path)), num_gpu_blocks=gpu_blocks),
        gpu_blocks,
    )
    try:
        prompt_a = list(range(1, 1 + 4 * BLOCK_SIZE))
        prompt_b = list(range(100, 100 + 4 * BLOCK_SIZE))
        engine.add_request("a", prompt_a)
        engine.run()
        engine.add_request("b", prompt_b)  # its chunks push A's out of the CPU tier
        engine.run()
        assert engine.scheduler.reset_prefix_cache()  # and out of the GPU prefix cache
        request = engine.add_request("a-again", prompt_a + [1, 2, 3])
        trace = engine.run()
        # The first steps wait for the promotion; then the 64 prompt tokens are loaded, and
        # only the 3 new ones computed.
        assert [s for s in trace if s] == [{"a-again": 3}]
        loaded = engine.loaded_blocks["a-again"]
        assert [(group, index) for group, index, _ in loaded] == [(0, 0), (0, 1), (0, 2), (0, 3)]
        for group, index, data in loaded:
            assert data == engine.block_content(request.block_hashes[index], group).tobytes()
        nvme, lmdb = engine.manager.secondary_tiers  # type: ignore[attr-defined]
        assert (nvme.name, nvme.backend.stats.hits, lmdb.backend.stats.hits) == ("nvme", 4, 0)
    finally:
        engine.shutdown()


def test_tiering_imports_and_works_without_vllm() -> None:
    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "import tiering, tiering.config, tiering.cli, tiering.integrations\n"
        "from tiering.config import parse_config\n"
        "parse_config({'version': 1, 'primary': {'capacity': '1MiB'}})\n"
        "try:\n"
        "    import tiering.integrations.vllm_tiers\n"
        "except ImportError as exc:\n"
        "    print('adapter:', type(exc).__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "adapter: ModuleNotFoundError"
    assert Medium.STORAGE.value == "STORAGE"


def test_stores_over_max_inflight_jobs_are_shed_and_reported(
    drivers: list[ManagerDriver],
) -> None:
    from gated_backend import GatedMemoryBackend

    GatedMemoryBackend.gate.clear()
    tier = {
        "type": "tiering",
        "backend": "gated_backend:GatedMemoryBackend",
        "name": "gated",
        "capacity": "1MiB",
        "max_inflight_jobs": 1,
    }
    driver = start(drivers, [tier])
    gated = tier_named(driver, "gated")
    a, b = keys_for("a", 2), keys_for("b", 2)
    first, second = driver.new_request("r1"), driver.new_request("r2")
    for context, keys in ((first, a), (second, b)):
        with driver.manager.lock:
            out = driver.manager.prepare_store(keys, context)
            assert out is not None
    driver.end_step()
    with driver.manager.lock:
        driver.manager.complete_store(a, first)  # cascades: the write waits at the gate
        driver.manager.complete_store(b, second)  # the tier is full of writes: shed
    assert gated.has_pending_work()
    GatedMemoryBackend.gate.set()
    driver.drain_tiers()  # the write finishes while the model runs
    context = driver.new_request("r3")
    assert driver.lookup(context, a + b) == [HIT] * 4  # the step collects both jobs
    assert not gated.has_pending_work()
    assert [gated.lookup(k, context) for k in a + b] == [HIT, HIT, MISS, MISS]
    with driver.manager.lock:
        stats = driver.manager.get_stats()
    assert stats is not None
    _, values = stats.metric_sections()
    assert values[TieringTierMetrics.SHED_BLOCKS] == {("gated",): 2}
    assert values[TieringTierMetrics.STORED_BLOCKS] == {("gated",): 2}
    # vLLM's manager counts the shed store as a failed cascade of this tier.
    assert values["vllm:kv_offload_tiering_cascade_job_failures"] == {("1:tiering",): 1}


def test_a_tier_that_does_not_open_within_its_deadline_fails_the_start_naming_it(
    drivers: list[ManagerDriver],
) -> None:
    """vLLM builds its tiers at engine start and waits for them: a hung open must fail the
    start, not hang it. The open is held until the start has answered, so the tier's deadline
    is what ends it; the start runs on a thread so that a regression fails instead of hanging."""
    from gated_backend import HangingOpenBackend

    HangingOpenBackend.release.clear()
    tier = {
        "type": "tiering",
        "backend": "gated_backend:HangingOpenBackend",
        "name": "hung",
        "capacity": "1MiB",
        "io_timeout_s": 0.2,
    }
    raised: list[BaseException] = []

    def build() -> None:
        try:
            start(drivers, [tier])
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(120)  # a bound on the hang this test is about, not a timing
    answered = not thread.is_alive()
    HangingOpenBackend.release.set()  # let the abandoned open (or a hung start) return
    thread.join(120)
    assert answered, "the start waited for a tier that never opened"
    assert len(raised) == 1 and isinstance(raised[0], BackendError)
    assert re.search(r"tier 'hung': .* did not open within io_timeout_s=0.2 s", str(raised[0]))


def test_a_tier_notes_its_misses_before_evicting_for_them(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    # EvictionPolicy's protocol: note_misses(keys) before the eviction that makes room for
    # them (vLLM's ARC, arc_vllm, moves its target there), as tiering's own tiers call it.
    from recording_policy import RecordingLRU

    RecordingLRU.calls.clear()
    tier = file_tier(tmp_path, blocks=2, policy="recording_policy:RecordingLRU")
    driver = start(drivers, [tier])
    a, b = keys_for("a", 2), keys_for("b", 2)
    for name, keys in (("r1", a), ("r2", b)):
        context = driver.new_request(name)
        driver.store(context, keys)
        driver.finish_request(context)
        driver.drain_tiers()
    noted: set[bytes] = set()
    for kind, call_keys in RecordingLRU.calls:
        if kind == "note_misses":
            noted = set(call_keys)
        elif call_keys:  # an eviction makes room for, an insert writes, keys noted as missed
            assert noted, (kind, call_keys)
            if kind == "insert":
                assert set(call_keys) <= noted
    inserted = {k for kind, call_keys in RecordingLRU.calls if kind == "insert" for k in call_keys}
    assert inserted == {bytes(k) for k in a + b}
    assert any(kind == "evict" and call_keys for kind, call_keys in RecordingLRU.calls)


def test_a_tier_reports_the_rule_its_policy_follows_and_its_switches(
    drivers: list[ManagerDriver],
) -> None:
    tier = {
        "type": "tiering",
        "backend": "memory",
        "name": "ram",
        "capacity": "1MiB",
        "policy": "switching_policy:SwitchingPolicy",  # a test double: the test sets its rule
    }
    driver = start(drivers, [tier])
    policy = tier_named(driver, "ram").policy
    assert isinstance(policy, SwitchingPolicy)
    rule, switches = TieringTierMetrics.EVICTION_RULE, TieringTierMetrics.EVICTION_RULE_SWITCHES

    def reported() -> dict[str, dict[tuple[str, ...], float]]:
        with driver.manager.lock:
            stats = driver.manager.get_stats()
        assert stats is not None
        _, values = stats.metric_sections()
        return {name: values.get(name, {}) for name in (rule, switches)}

    assert reported() == {rule: {("ram", "lru"): 1, ("ram", "arc"): 0}, switches: {}}
    policy.switch_to("arc")
    assert reported() == {rule: {("ram", "lru"): 0, ("ram", "arc"): 1}, switches: {("ram",): 1}}
    assert reported()[switches] == {}
