"""A model's config.json comes from a hub: any bytes give a geometry or a ConfigError naming the
file and the field, and the reader refuses oversized requests before it walks them (layers,
lists, state sizes are bounded), so no file costs more than reading it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiering.errors import ConfigError
from tiering.model.hf_families import MAX_LAYERS
from tiering.model.hf_model import MAX_BLOCK_BYTES, MAX_BLOCK_TOKENS, model_shape_from_hf_config

LLAMA = {
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
}
JAMBA = {
    **LLAMA,
    "model_type": "jamba",
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}
BAMBA = {
    **LLAMA,
    "model_type": "bamba",
    "attn_layer_indices": [9, 18, 27],
    "mamba_n_heads": 128,
    "mamba_d_head": 64,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
}
GEMMA_3: dict[str, Any] = {
    "model_type": "gemma3",
    "text_config": {
        "model_type": "gemma3_text",
        "hidden_size": 3840,
        "num_attention_heads": 16,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "sliding_window": 1024,
    },
}
QWEN3_NEXT = {
    "model_type": "qwen3_next",
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "num_hidden_layers": 48,
}


def _write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "config.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"text_config": ' * 50_000 + "{}" + "}" * 50_000, "nested too deeply"),
        ({**LLAMA, "num_hidden_layers": 1e30}, "num_hidden_layers"),
        ({**LLAMA, "num_hidden_layers": 10**30}, "num_hidden_layers"),
        # 191 bytes asking for 30 million layers: refused before a list of them is built
        ({**LLAMA, "num_hidden_layers": 30_000_000}, "num_hidden_layers"),
        ({**JAMBA, "mamba_d_state": 10**30}, "mamba_d_state"),
        ({**JAMBA, "mamba_d_state": 1 << 20, "mamba_expand": 1 << 20}, "mamba state"),
        (
            {
                **LLAMA,
                "num_key_value_heads": 1 << 20,
                "num_attention_heads": 1 << 20,
                "head_dim": 8192,
            },
            "num_hidden_layers",
        ),
        # 500,000 indices: measured against the layer count before one is looked at
        ({**BAMBA, "attn_layer_indices": list(range(500_000))}, "attn_layer_indices"),
        ({**BAMBA, "attn_layer_indices": [1.5]}, "attn_layer_indices"),
        ({**BAMBA, "attn_layer_indices": [True]}, "attn_layer_indices"),
        ({**LLAMA, "torch_dtype": ["float16"]}, "torch_dtype"),
        ({**LLAMA, "torch_dtype": {"a": 1}}, "torch_dtype"),
        ({**LLAMA, "model_type": ["llama"]}, "model_type"),
        ({**LLAMA, "model_type": "x" * 100_000}, "model_type"),
        ({**GEMMA_3, "text_config": 5}, "text_config"),
        ({"model_type": "gemma3", "text_config": {**LLAMA, "model_type": 7}}, "model_type"),
        ({**QWEN3_NEXT, "layer_types": ["full_attention"] * 200_000}, "layer_types"),
        ({**QWEN3_NEXT, "layer_types": ["full_attention"] * 47}, "layer_types"),
        ({**QWEN3_NEXT, "layer_types": [["full_attention"]] * 48}, "layer_types"),
        ({**QWEN3_NEXT, "full_attention_interval": 0}, "full_attention_interval"),
        ({**QWEN3_NEXT, "linear_num_value_heads": 10**20}, "linear_num_value_heads"),
        ({**GEMMA_3["text_config"], "sliding_window": "1024"}, "sliding_window"),
        ({**LLAMA, "model_type": "gemma3_text", "use_bidirectional_attention": True}, "bidir"),
        ({**LLAMA, "hidden_size": 16}, "hidden_size"),
        ({**LLAMA, "num_key_value_heads": 64}, "num_key_value_heads"),
        (
            {"model_type": "nemotron_h", "hybrid_override_pattern": "M*" * 1_000_000},
            "hybrid_override_pattern",
        ),
        ({**LLAMA, "_name_or_path": "x" * 5000}, "_name_or_path"),
        ({**LLAMA, "num_hidden_layers": "9" * 5000}, "num_hidden_layers"),
        ("{" + '"a": 1, ' * 10 + '"num_hidden_layers": ' + "9" * 5000 + "}", "not a JSON"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 40 else None,
)
def test_hostile_files_give_a_config_error_naming_the_field(
    tmp_path: Path, data: Any, field: str
) -> None:
    path = _write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        model_shape_from_hf_config(path)
    message = str(info.value)
    assert message.startswith(str(path)), message
    assert field in message, message
    assert len(message) < 2000  # a value is quoted only when it is short


def test_the_cli_exits_2_on_a_deeply_nested_config_json(tmp_path: Path) -> None:
    """Not a RecursionError (exit 3): a one-line error naming the file."""
    (tmp_path / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    yaml = tmp_path / "tiering.yaml"
    yaml.write_text("version: 1\nmodel: {config_json: config.json}\nprimary: {capacity: 1GiB}\n")
    result = subprocess.run(
        [sys.executable, "-m", "tiering.cli", "config", "check", str(yaml)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "config.json: not a config.json: JSON nested too deeply" in result.stderr
    assert "Traceback" not in result.stderr


# -- any JSON value in any field -----------------------------------------------------------------

FIELDS = sorted(
    {
        *LLAMA,
        *JAMBA,
        *BAMBA,
        *QWEN3_NEXT,
        "head_dim",
        "torch_dtype",
        "dtype",
        "sliding_window",
        "sliding_window_pattern",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "layers_block_type",
        "full_attention_interval",
        "hybrid_override_pattern",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "mamba_n_heads",
        "mamba_num_heads",
        "mamba_d_head",
        "mamba_head_dim",
        "mamba_n_groups",
        "n_groups",
        "ssm_state_size",
        "conv_kernel",
        "mamba_d_ssm",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_conv_kernel_dim",
        "text_config",
        "_name_or_path",
        "use_bidirectional_attention",
    }
)
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.sampled_from([0, 1, 2, 3, 4, 16, 64, 128, 256, 4096, MAX_LAYERS, MAX_LAYERS + 1])
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(
        ["auto", "bfloat16", "float16", "mamba", "full_attention", "llama", "gemma3_text"]
    )
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
BASES = {"llama": LLAMA, "jamba": JAMBA, "bamba": BAMBA, "gemma3": GEMMA_3, "next": QWEN3_NEXT}


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    base=st.sampled_from(sorted(BASES)),
    edits=st.lists(st.tuples(st.sampled_from(FIELDS), JSON), min_size=1, max_size=3),
    nested=st.booleans(),
)
def test_any_json_value_in_any_field_gives_a_config_error_or_a_valid_geometry(
    tmp_path_factory: pytest.TempPathFactory,
    base: str,
    edits: list[tuple[str, Any]],
    nested: bool,
) -> None:
    data = json.loads(json.dumps(BASES[base]))
    target = data["text_config"] if nested and "text_config" in data else data
    for field, value in edits:
        target[field] = value
    path = tmp_path_factory.mktemp("hf") / "config.json"
    path.write_text(json.dumps(data))
    try:
        shape = model_shape_from_hf_config(path)
    except ConfigError as exc:
        assert str(exc).startswith(str(path)), exc
        return
    assert shape.groups and all(g.num_layers >= 1 for g in shape.groups)
    assert 1 <= shape.num_kv_heads and 1 <= shape.head_dim and shape.kv_parts in (1, 2)
    assert 1 <= shape.block_size <= MAX_BLOCK_TOKENS
    assert shape.layers_per_position * shape.page_bytes <= MAX_BLOCK_BYTES
    assert isinstance(shape.name, str)


def test_kv_heads_that_do_not_split_over_the_ranks_are_refused(tmp_path: Path) -> None:
    path = _write(tmp_path, {**LLAMA, "num_key_value_heads": 6, "num_attention_heads": 12})
    assert model_shape_from_hf_config(path, world_size=2).num_kv_heads == 3
    assert model_shape_from_hf_config(path, world_size=12).num_kv_heads == 1  # replicated
    message = r"num_key_value_heads: 6 KV heads cannot be split over 4 ranks"
    with pytest.raises(ConfigError, match=message):
        model_shape_from_hf_config(path, world_size=4)
