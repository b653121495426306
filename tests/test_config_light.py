"""Reading and checking a config imports no torch (``tiering config check`` answers at once).

Each check runs in a fresh interpreter: torch, once imported by any test, stays in
``sys.modules``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

import tiering.config
import tiering.config.runtime
import tiering.config.schema
import tiering.transfer
from tiering.model import kv_tensors
from tiering.model.shapes import DTYPE_BYTES, MODEL_SHAPES

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiering.yaml"
LLAMA_3_8B = {
    "_name_or_path": "meta-llama/Meta-Llama-3-8B",
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}

# What ``tiering config check`` does (tiering/cli): load, lay out, build each tier to count its
# blocks, examine the tier directories, name the model; then the schema of ``config schema``.
CONFIG_CHECK = """
import json, sys
from tiering.config import (
    build_tier, check_tier_directories, config_json_schema, layout_for_config, load_config,
)
config = load_config(sys.argv[1])
layout = layout_for_config(config)
tiers = {
    tier.name: build_tier(
        tier, block_bytes=layout.block_bytes, fingerprint=layout.fingerprint
    ).backend.capacity_blocks
    for tier in config.secondary_tiers
}
findings = check_tier_directories(config, layout)
identity = config.model.model_identity()
schema = config_json_schema()
print(json.dumps({
    "block_bytes": layout.block_bytes,
    "cpu_blocks": config.num_cpu_blocks(layout.block_bytes),
    "tiers": sorted(tiers),
    "tier_blocks_positive": all(n > 0 for n in tiers.values()),
    "findings": len(findings),
    "model": identity.name,
    "schema_title": schema["title"],
    "torch": "torch" in sys.modules,
}))
"""


def _run(code: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def test_importing_tiering_config_imports_no_torch() -> None:
    assert _run("import sys, tiering.config; print('torch' in sys.modules)") == "False"


def test_the_config_check_path_imports_no_torch(tmp_path: Path) -> None:
    config = tmp_path / "tiering.yaml"
    shutil.copy(EXAMPLE, config)  # its tier directories are relative: under tmp_path
    result = json.loads(_run(CONFIG_CHECK, str(config)))
    assert result == {
        "block_bytes": 2 * 1024 * 1024,  # llama-3-8b: 32 layers x 2 x 16 tokens x 8 x 128 x bf16
        "cpu_blocks": 256,  # 512 MiB
        "tiers": ["lmdb", "nvme"],
        "tier_blocks_positive": True,
        "findings": 0,
        "model": "llama-3-8b",
        "schema_title": "tiering configuration (version 1)",
        "torch": False,
    }


def test_a_config_json_model_is_read_without_torch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_8B))
    (tmp_path / "tiering.yaml").write_text(
        "version: 1\nmodel: {config_json: config.json, world_size: 2}\nprimary: {capacity: 64MiB}\n"
    )
    code = (
        "import sys; from tiering.config import load_config\n"
        "config = load_config(sys.argv[1])\n"
        "print(config.block_bytes(), config.block_bytes_per_rank(), 'torch' in sys.modules)"
    )
    # Two ranks of 4 KV heads each: 1 MiB per rank, 2 MiB over both.
    assert _run(code, str(tmp_path / "tiering.yaml")) == "2097152 1048576 False"


def test_building_a_manager_loads_its_module_on_first_use() -> None:
    code = (
        "import sys, tiering.config as c\n"
        "before = 'torch' in sys.modules\n"
        "from tiering.config import build_manager\n"
        "import tiering.config.runtime as r\n"
        "print(before, 'torch' in sys.modules, build_manager is r.build_manager, "
        "c.build_pool is r.build_pool, 'build_pool' in dir(c))"
    )
    assert _run(code) == "False True True True True"


def test_the_lazy_names_are_the_runtime_builders() -> None:
    assert tiering.config.build_manager is tiering.config.runtime.build_manager
    assert tiering.config.build_pool is tiering.config.runtime.build_pool
    with pytest.raises(AttributeError, match="has no attribute 'build_nothing'"):
        tiering.config.build_nothing  # noqa: B018


def test_the_copy_backend_names_are_the_transfer_layers() -> None:
    """The config writes the copy backends' names out (importing tiering.transfer imports
    torch); they must be the names the transfer engine takes."""
    assert typing.get_args(tiering.config.schema.CopyBackend) == typing.get_args(
        tiering.transfer.CopyBackend
    )


@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_the_dtype_sizes_are_torchs(dtype: str) -> None:
    torch_dtype = kv_tensors._TORCH_DTYPES[dtype]
    assert DTYPE_BYTES[dtype] == torch.empty(0, dtype=torch_dtype).element_size()


def test_every_dtype_has_a_size_and_a_torch_dtype() -> None:
    assert (
        sorted(DTYPE_BYTES)
        == sorted(kv_tensors._TORCH_DTYPES)
        == [
            "bfloat16",
            "float16",
            "float32",
        ]
    )
    assert {shape.dtype for shape in MODEL_SHAPES.values()} <= set(DTYPE_BYTES)


def test_allocated_kv_tensors_match_the_shapes_page_bytes() -> None:
    shape = MODEL_SHAPES["tiny-hybrid"]
    spec = shape.kv_cache_spec(16)
    tensors, caches = kv_tensors.allocate_kv_caches(shape, 3, spec)
    assert sorted(tensors) == ["full_attention.0", "full_attention.1"] + [
        "sliding_window.0",
        "sliding_window.1",
    ]
    first = tensors["full_attention.0"]
    assert first.shape == (3, 2, 16, 2, 16) and first.dtype == torch.bfloat16
    assert tensors["sliding_window.0"] is first  # one tensor per layer position
    assert shape.page_bytes == 2 * 16 * 2 * 16 * 2
    assert caches.offloaded_block_bytes_per_rank() == shape.layers_per_position * shape.page_bytes
