"""Every ``kv_connector_extra_config`` value tiering's vLLM integration reads is checked: a bad
one is a ConfigError naming the key, the value and what is valid, raised through vLLM's own
``OffloadingSpecFactory`` before anything is built; values vLLM's own parsing accepts pass."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm_harness import (
    ENGINE_ID_PREFIX,
    ManagerDriver,
    gpu_block_bytes,
    offloading_config,
    tiering_spec_extra,
)

from tiering.errors import ConfigError
from tiering.integrations import vllm_plugin
from tiering.integrations.vllm import TieringManager, TieringSpec
from tiering.integrations.vllm_extra import SPEC_KEYS, TIER_ENTRY_KEYS

CPU_CHUNKS = 4


@pytest.fixture(autouse=True, scope="module")
def registered() -> None:
    vllm_plugin.register()


@pytest.fixture(autouse=True)
def no_region_left_behind() -> Iterator[None]:
    pattern = f"vllm_offload_{ENGINE_ID_PREFIX}*"
    before = set(Path("/dev/shm").glob(pattern))
    yield
    assert set(Path("/dev/shm").glob(pattern)) <= before


def yaml_file(root: Path) -> Path:
    path = root / "tiering.yaml"
    path.write_text(yaml.safe_dump({"version": 1, "primary": {"capacity": "4KiB"}}))
    return path


def dropin(root: Path, **keys: Any) -> dict[str, Any]:
    return {
        "spec_name": "TieringSpec",
        "spec_module_path": "tiering.integrations.vllm",
        "cpu_bytes_to_use": CPU_CHUNKS * gpu_block_bytes(),
        "tiering_config": str(yaml_file(root)),
        **keys,
    }


NAN = float("nan")
BAD_SPEC_VALUES = [
    ("tiering_config", ""),
    ("tiering_config", 5),
    ("cpu_bytes_to_use", "abc"),
    ("cpu_bytes_to_use", 0),
    ("cpu_bytes_to_use", 1.5),
    ("cpu_bytes_to_use", True),
    ("eviction_policy", "lfu"),
    ("eviction_policy", 5),
    ("store_threshold", "abc"),
    ("store_threshold", -1),
    ("store_threshold", 2.5),
    ("store_threshold", None),
    ("max_tracker_size", "abc"),
    ("max_tracker_size", 0),
    ("max_tracker_size", None),
    ("max_tracker_size", [1]),
    ("tiering_deterministic_steps", "true"),
    ("tiering_deterministic_steps", 1),
    ("offload_prompt_only", "false"),
    ("offload_prompt_only", 0),
    ("self_describing_kv_events", "yes"),
    ("canonical_layout", 1),
    ("tier_poll_interval_s", "abc"),
    ("tier_poll_interval_s", NAN),
    ("tier_poll_interval_s", True),
    ("sync_load_budget_bytes", "lots"),
    ("sync_load_budget_bytes", -1),
    ("backpressure", "high"),
]


def test_every_spec_key_has_a_bad_value_tested() -> None:
    assert {key for key, _ in BAD_SPEC_VALUES} == set(SPEC_KEYS)


@pytest.mark.parametrize(("key", "value"), BAD_SPEC_VALUES)
def test_a_bad_spec_value_is_a_config_error_naming_key_value_and_what_is_valid(
    tmp_path: Path, key: str, value: object
) -> None:
    extra = dropin(tmp_path, **{key: value})
    with pytest.raises(ConfigError) as caught:
        OffloadingSpecFactory.create_spec(offloading_config(extra))
    message = str(caught.value)
    given = "null" if value is None else repr(value)
    assert f"TieringSpec: kv_connector_extra_config: {key!r} is {given}" in message
    assert f"valid: {SPEC_KEYS[key].valid}" in message
    # The API server builds the metric definitions from the same keys, before any spec.
    with pytest.raises(ConfigError, match=re.escape(f"{key!r} is {given}")):
        TieringSpec.build_metric_definitions(extra)


@pytest.mark.parametrize("key", ["tiering_config", "cpu_bytes_to_use"])
def test_a_required_key_missing_is_a_config_error_naming_it(tmp_path: Path, key: str) -> None:
    extra = dropin(tmp_path)
    del extra[key]
    with pytest.raises(ConfigError, match=rf"needs {key!r}: {re.escape(SPEC_KEYS[key].valid)}"):
        OffloadingSpecFactory.create_spec(offloading_config(extra))


def test_values_vllm_accepts_still_work_as_vllm_reads_them(tmp_path: Path) -> None:
    extra = dropin(
        tmp_path,
        cpu_bytes_to_use=str(CPU_CHUNKS * gpu_block_bytes()),  # vLLM's int() takes a string
        store_threshold=3.0,  # a JSON number written with a fraction
        max_tracker_size=" 128 ",
        eviction_policy=None,  # null: the YAML's policy
        offload_prompt_only=False,
        tier_poll_interval_s="0.5",
        backpressure=None,
    )
    driver = ManagerDriver.create(offloading_config(extra))
    try:
        manager = driver.manager
        assert isinstance(driver.spec, TieringSpec) and driver.spec.num_chunks == CPU_CHUNKS
        assert isinstance(manager, TieringManager)
        assert manager.store_threshold == 3 and manager.policy == "lru"
        admission = manager.manager.primary._admission
        assert admission is not None and admission.max_keys == 128
    finally:
        driver.shutdown()


def test_a_key_close_to_a_known_one_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    extra = dropin(tmp_path, max_traker_size=128, block_size=16)
    with caplog.at_level(logging.WARNING, logger="tiering.integrations.vllm_extra"):
        OffloadingSpecFactory.create_spec(offloading_config(extra))
    assert "unknown key 'max_traker_size'; did you mean 'max_tracker_size'?" in caplog.text
    assert "block_size" not in caplog.text  # vLLM's own key


BAD_TIER_VALUES = [
    ("tiering_config", 5),
    ("tier", ""),
    ("backend", 7),
    ("enable_kv_events", "yes"),
    ("enable_kv_events", None),
    ("locality", 5),
]


def test_every_tier_entry_key_has_a_bad_value_tested() -> None:
    assert {key for key, _ in BAD_TIER_VALUES} == set(TIER_ENTRY_KEYS)


@pytest.mark.parametrize(("key", "value"), BAD_TIER_VALUES)
def test_a_bad_tier_entry_value_is_a_config_error_naming_key_value_and_what_is_valid(
    key: str, value: object
) -> None:
    entry = {"type": "tiering", "backend": "memory", "capacity": "1MiB", key: value}
    engine_id = f"{ENGINE_ID_PREFIX}bad-entry-{abs(hash(json.dumps(entry)))}"
    spec = OffloadingSpecFactory.create_spec(
        offloading_config(tiering_spec_extra(CPU_CHUNKS, [entry]), engine_id=engine_id)
    )
    given = "null" if value is None else repr(value)
    expected = (
        f"vLLM secondary tier 'tiering': {key!r} is {given}"
        f" ({type(value).__name__}); valid: {TIER_ENTRY_KEYS[key].valid}"
        if value is not None
        else f"vLLM secondary tier 'tiering': {key!r} is null; valid: "
    )
    with pytest.raises(ConfigError, match=re.escape(expected)):
        spec.get_manager()
    assert not Path(f"/dev/shm/vllm_offload_{engine_id}.mmap").exists()
