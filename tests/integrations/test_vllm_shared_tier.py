"""The vLLM drop-in (``TieringSpec``) with a shared Redis tier, through vLLM's own manager
class: two engines' managers share one real ``redis-server``. Engine A stores a prompt's
chunks; engine B's lookups answer "retry later" while B asks the store and promotes what it
found, then HIT, and B's worker reads the chunks bit-exact."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from vllm.v1.kv_offload.base import LookupResult
from vllm_harness import ENGINE_ID_PREFIX, ManagerDriver, gpu_block_bytes, keys_for, payload
from vllm_harness import offloading_config as make_offloading_config

from tiering.integrations import vllm_plugin
from tiering.integrations.vllm import TieringManager
from tiering.managers.shared_tier import SharedTier
from tiering.testing.redis_servers import RedisServer, find_redis_cli, find_redis_server

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
HIT_PENDING = LookupResult.HIT_PENDING
CPU_CHUNKS = 8


@pytest.fixture(autouse=True, scope="module")
def registered() -> None:
    vllm_plugin.register()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    if find_redis_server() is None or find_redis_cli() is None:
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    started = RedisServer(tmp_path / "redis")
    started.start()
    try:
        yield started
    finally:
        started.stop()


def _engine(
    tmp_path: Path, server: RedisServer, name: str, drivers: list[ManagerDriver]
) -> ManagerDriver:
    config = tmp_path / name / "tiering.yaml"
    config.parent.mkdir(parents=True)
    config.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "primary": {"capacity": "4KiB"},
                "secondary_tiers": [
                    {"name": "shared", "type": "redis", "capacity": "64MiB", "shared": True,
                     "url": server.url, "key_prefix": "dropin", "existence_cache_seconds": 3600}
                ],
            }
        )
    )  # fmt: skip
    extra = {
        "spec_name": "TieringSpec",
        "spec_module_path": "tiering.integrations.vllm",
        "cpu_bytes_to_use": CPU_CHUNKS * gpu_block_bytes(),
        "tiering_config": str(config),
        "tiering_deterministic_steps": True,  # the steps below are counted
    }
    tag = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:8]
    engine_id = f"{ENGINE_ID_PREFIX}shared-{name}-{tag}"
    driver = ManagerDriver.create(make_offloading_config(extra, engine_id=engine_id))
    drivers.append(driver)
    assert isinstance(driver.manager, TieringManager)
    (tier,) = driver.manager.manager.tiers
    assert isinstance(tier, SharedTier)
    driver.manager.manager.wait_ready()
    assert tier.is_open, tier.open_error
    return driver


def adapter_tiers(driver: ManagerDriver) -> list[SharedTier]:
    assert isinstance(driver.manager, TieringManager)
    return [t for t in driver.manager.manager.tiers if isinstance(t, SharedTier)]


@pytest.fixture
def drivers() -> Iterator[list[ManagerDriver]]:
    made: list[ManagerDriver] = []
    yield made
    for driver in made:
        driver.shutdown()


def test_engine_b_loads_what_engine_a_stored(
    tmp_path: Path, server: RedisServer, drivers: list[ManagerDriver]
) -> None:
    a = _engine(tmp_path, server, "a", drivers)
    b = _engine(tmp_path, server, "b", drivers)
    prompt = keys_for("shared-prompt", 4)
    writer = a.new_request("w")
    a.store(writer, prompt)
    a.finish_request(writer)
    a.settle()  # A's write-through to Redis is done

    reader = b.new_request("r")
    # vLLM's RETRY while B asks the store (location unknown), its HIT_PENDING while B promotes
    assert b.lookup(reader, prompt) == [RETRY] * 4  # this step's end sends the check
    assert b.lookup(reader, prompt) == [RETRY] * 4  # its result applies at this step's end
    assert b.lookup(reader, prompt) == [HIT_PENDING] * 4  # promoted: applies at the end
    assert b.lookup(reader, prompt) == [HIT] * 4
    data = b.load(reader, prompt)
    assert data == [payload(k, b.rows.chunk_bytes).tobytes() for k in prompt]
    b.finish_request(reader)

    other = b.new_request("o")  # nobody stored these: asked once, then a miss
    unknown = keys_for("nobody", 2)
    assert b.lookup(other, unknown) == [RETRY] * 2
    assert b.lookup(other, unknown) == [RETRY] * 2
    assert b.lookup(other, unknown) == [MISS] * 2
    assert b.lookup(other, unknown) == [MISS] * 2  # cached: not asked again
    (tier,) = adapter_tiers(b)
    assert tier.metrics.existence_checks == 2 and tier.metrics.checked_keys == 6
    b.finish_request(other)
