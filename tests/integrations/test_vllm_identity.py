"""The drop-in's layout fingerprint names the checkpoint: the weight files of the model's
directory and the revision, quantization and dtype in the engine's own ModelConfig, read while
vLLM's connector builds the spec. A tier filled under one checkpoint serves nothing to another
engine of the same architecture."""

from __future__ import annotations

import dataclasses
import json
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_dropin import (  # the drop-in's helpers
    CPU_CHUNKS,
    HIT,
    MISS,
    adapter,
    dropin_extra,
    write_yaml,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm_harness import (
    MODEL_DIR,
    EngineDriver,
    ManagerDriver,
    keys_for,
    kv_cache_config,
    offloading_config,
    vllm_config,
)

from tiering.integrations import vllm_plugin
from tiering.integrations.vllm import TieringManager
from tiering.integrations.vllm_identity import model_identity_of
from tiering.integrations.vllm_layout import layout_fingerprint


@pytest.fixture(autouse=True)
def registered() -> None:
    vllm_plugin.register()


@pytest.fixture
def drivers() -> Iterator[list[ManagerDriver]]:
    made: list[ManagerDriver] = []
    yield made
    for driver in made:
        driver.shutdown()


def checkpoint(directory: Path, metadata: dict[str, str]) -> Path:
    """The tiny model's config.json and a one-tensor safetensors file whose header carries
    ``metadata``: same architecture, other weights."""
    directory.mkdir(parents=True)
    shutil.copy(MODEL_DIR / "config.json", directory / "config.json")
    header = json.dumps(
        {"__metadata__": metadata, "w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}
    ).encode()
    (directory / "model.safetensors").write_bytes(
        struct.pack("<Q", len(header)) + header + bytes(8)
    )
    return directory


def with_model(config: Any, directory: Path) -> Any:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, name=str(directory)))


def store_then_restart(
    drivers: list[ManagerDriver], tmp_path: Path, first_dir: Path, second_dir: Path
) -> list[Any]:
    config_path = write_yaml(tmp_path)
    base = offloading_config(dropin_extra(config_path))
    a = keys_for("a", CPU_CHUNKS)
    first = ManagerDriver.create(with_model(base, first_dir))
    drivers.append(first)
    context = first.new_request("r1")
    first.store(context, a)
    first.finish_request(context)
    first.settle()
    drivers.remove(first)
    first.shutdown()
    second = ManagerDriver.create(with_model(base, second_dir))
    drivers.append(second)
    context = second.new_request("r2")
    second.lookup(context, a)
    second.settle()
    return second.lookup(context, a)


def test_another_checkpoint_under_another_path_serves_nothing(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    base = checkpoint(tmp_path / "base", {"step": "0"})
    tuned = checkpoint(tmp_path / "tuned", {"step": "1000"})
    assert store_then_restart(drivers, tmp_path / "t1", base, tuned) == [MISS] * CPU_CHUNKS


def test_the_same_checkpoint_after_a_restart_serves_its_blocks(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    base = checkpoint(tmp_path / "base", {"step": "0"})
    assert store_then_restart(drivers, tmp_path / "t", base, base) == [HIT] * CPU_CHUNKS


def test_weights_replaced_in_place_serve_nothing(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    """One path, new weights (a new revision pulled into the same directory)."""
    config_path = write_yaml(tmp_path / "t")
    model = checkpoint(tmp_path / "model", {"step": "0"})
    base = with_model(offloading_config(dropin_extra(config_path)), model)
    a = keys_for("a", CPU_CHUNKS)
    first = ManagerDriver.create(base)
    drivers.append(first)
    context = first.new_request("r1")
    first.store(context, a)
    first.finish_request(context)
    first.settle()
    drivers.remove(first)
    first.shutdown()
    shutil.rmtree(model)
    checkpoint(model, {"step": "2000"})
    second = ManagerDriver.create(base)
    drivers.append(second)
    assert [len(t) for t in adapter(second).manager.tiers] == [0, 0]
    context = second.new_request("r2")
    assert second.lookup(context, a) == [MISS] * CPU_CHUNKS


def engine_fingerprint(tmp_path: Path, model_dir: Path, **kw: Any) -> tuple[bytes, Any]:
    """Start vLLM's scheduler with its connector (which builds the spec and its manager) and
    return the manager's fingerprint and the spec's model identity."""
    extra = dropin_extra(write_yaml(tmp_path), CPU_CHUNKS)
    engine = EngineDriver(vllm_config(extra, num_gpu_blocks=16, model_dir=model_dir, **kw), 16)
    try:
        manager = engine.connector.scheduler.manager
        assert isinstance(manager, TieringManager)
        return manager.fingerprint, manager.model_identity
    finally:
        engine.shutdown()


def test_the_engine_s_model_config_names_revision_and_weights(tmp_path: Path) -> None:
    base = checkpoint(tmp_path / "base", {"step": "0"})
    tuned = checkpoint(tmp_path / "tuned", {"step": "1000"})
    fp_base, identity = engine_fingerprint(tmp_path / "1", base)
    assert identity["engine_model_config"] is True  # read from vLLM's ModelConfig
    assert identity["model_dtype"] == "float16"
    checkpoint_part = identity["checkpoint"]
    assert isinstance(checkpoint_part, dict) and checkpoint_part["source"] == "checkpoint"
    fp_tuned, _ = engine_fingerprint(tmp_path / "2", tuned)
    fp_revision, identity = engine_fingerprint(tmp_path / "3", base, revision="v2")
    assert identity["revision"] == "v2"
    assert len({fp_base, fp_tuned, fp_revision}) == 3
    again, _ = engine_fingerprint(tmp_path / "4", base)
    assert again == fp_base  # deterministic: a restart of the same engine finds its blocks


def test_a_spec_built_outside_the_connector_keys_on_the_name_and_files(tmp_path: Path) -> None:
    base = checkpoint(tmp_path / "base", {"step": "0"})
    config = build_offloading_config(
        vllm_config({}, model_dir=base), kv_cache_config(16)
    )  # no connector on the stack, no current config: the files still name the weights
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    extra = dropin_extra(write_yaml(tmp_path / "t"), CPU_CHUNKS)
    spec = OffloadingSpecFactory.create_spec(dataclasses.replace(config, extra_config=extra))
    identity = model_identity_of(spec)
    assert identity["engine_model_config"] is False
    part = identity["checkpoint"]
    assert isinstance(part, dict) and part["source"] == "checkpoint"
    assert layout_fingerprint(spec) == layout_fingerprint(spec)
