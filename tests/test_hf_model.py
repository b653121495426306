"""Model geometry from a Hugging Face config.json: real files written by the tests, sizes checked
against hand computations of vLLM's layout, a replay run from one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tiering.config import parse_config
from tiering.core.groups import GroupKind
from tiering.errors import ConfigError
from tiering.model.hf_model import model_shape_from_hf_config
from tiering.model.shapes import MODEL_SHAPES, GroupShape
from tiering.replay import ReplayOptions, run_replay

FULL, SLIDING, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA

LLAMA_3_8B = {
    "_name_or_path": "meta-llama/Meta-Llama-3-8B",
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
}
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_hidden_layers": 24,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "torch_dtype": "bfloat16",
}
GEMMA_3_27B = {  # a multimodal config: the text model is nested
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "head_dim": 128,
        "hidden_size": 5376,
        "num_attention_heads": 32,
        "num_hidden_layers": 62,
        "num_key_value_heads": 16,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    },
}
JAMBA_MINI = {
    "model_type": "jamba",
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "torch_dtype": "bfloat16",
}
GRANITE_4_H = {  # Mamba-2 layers named in layer_types
    "model_type": "granitemoehybrid",
    "hidden_size": 1536,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "num_hidden_layers": 8,
    "layer_types": ["mamba", "mamba", "mamba", "attention"] * 2,
    "mamba_n_heads": 48,
    "mamba_d_head": 64,
    "mamba_n_groups": 1,
    "mamba_d_state": 128,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "num_hidden_layers": 61,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "torch_dtype": "bfloat16",
}


def write(tmp_path: Path, data: Any, name: str = "config.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_a_plain_model_matches_its_preset(tmp_path: Path) -> None:
    shape = model_shape_from_hf_config(write(tmp_path, LLAMA_3_8B))
    preset = MODEL_SHAPES["llama-3-8b"]
    assert shape.name == "meta-llama/Meta-Llama-3-8B"
    assert (shape.groups, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.block_size) == (
        preset.groups,
        preset.num_kv_heads,
        preset.head_dim,
        preset.dtype,
        preset.block_size,
    )
    assert shape.page_bytes == 64 * 1024
    halves = model_shape_from_hf_config(tmp_path / "config.json", world_size=2)
    assert halves.num_kv_heads == 4  # the KV heads are split over the ranks


def test_sliding_window_hybrids_are_grouped_as_vllm_does(tmp_path: Path) -> None:
    gpt_oss = model_shape_from_hf_config(write(tmp_path, GPT_OSS_20B))
    assert gpt_oss.groups == (GroupShape(SLIDING, 12, 128), GroupShape(FULL, 12))
    assert (gpt_oss.num_kv_heads, gpt_oss.head_dim) == (8, 64)
    # Gemma 3: every 6th layer is full: 10 full, 52 sliding, so groups of 10 layers; the
    # sliding layers spread over 6 groups as layers[i::6] (9, 9, 9, 9, 8, 8).
    gemma = model_shape_from_hf_config(write(tmp_path, GEMMA_3_27B, "gemma.json"))
    assert gemma.groups == (
        *(GroupShape(SLIDING, n, 1024) for n in (9, 9, 9, 9, 8, 8)),
        GroupShape(FULL, 10),
    )
    assert gemma.layers_per_position == 10
    # 12 sliding and 13 full layers: within 1.5x, so one group per kind, of 13 (vLLM pads).
    layer_types = ["sliding_attention", "full_attention"] * 12 + ["full_attention"]
    uneven = {**GPT_OSS_20B, "layer_types": layer_types, "num_hidden_layers": 25}
    shape = model_shape_from_hf_config(write(tmp_path, uneven, "uneven.json"))
    assert shape.groups == (GroupShape(SLIDING, 12, 128), GroupShape(FULL, 13))
    assert gemma.name == "gemma3"
    spec = gemma.kv_cache_spec(16)
    assert len({g.name for g in spec.groups}) == 7  # every group named apart


def test_a_mamba1_hybrid_pads_its_state_into_a_larger_attention_block(tmp_path: Path) -> None:
    shape = model_shape_from_hf_config(write(tmp_path, JAMBA_MINI))
    # Mamba-1 state: (d_conv - 1) * 8192 + 8192 * d_state = 155648 bf16 = 311296 bytes; an
    # attention token is 2 * 8 * 128 * 2 = 4096 bytes, so 16-token steps reach 80 tokens.
    assert shape.block_size == 80
    assert shape.page_bytes == 80 * 4096 >= 311296
    # Layers 0-3 are Mamba, 4 attention, ...: 28 Mamba and 4 attention layers, groups of 4.
    assert shape.groups == (GroupShape(MAMBA, 4),) * 7 + (GroupShape(FULL, 4),)


def test_a_mamba2_hybrid_state_over_two_ranks(tmp_path: Path) -> None:
    shape = model_shape_from_hf_config(write(tmp_path, GRANITE_4_H), world_size=2)
    # Mamba-2 on one of 2 ranks: n_groups 1 -> 2 (replicated with the heads), conv dim
    # 3072 + 2 * 2 * 128 = 3584, halved: 1792 * 3 + 24 heads * 64 * 128 = 201984 bf16 elements
    # = 403968 bytes; an attention token on a rank: 2 * 2 heads * 128 dim * 2 = 1024 bytes.
    assert shape.num_kv_heads == 2 and shape.head_dim == 128
    assert shape.block_size == 16 * -(-403968 // (16 * 1024)) == 400
    assert shape.groups == (GroupShape(MAMBA, 2),) * 3 + (GroupShape(FULL, 2),)


def test_mla_keeps_one_latent_per_token(tmp_path: Path) -> None:
    shape = model_shape_from_hf_config(write(tmp_path, DEEPSEEK_V3), world_size=8)
    assert (shape.num_kv_heads, shape.head_dim, shape.kv_parts) == (1, 576, 1)
    assert shape.page_bytes == 16 * 576 * 2
    assert shape.groups == (GroupShape(FULL, 61),)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{not json", r"config\.json: not a JSON config\.json"),
        ("[1, 2]", r"config\.json: a config\.json holds a JSON object, got list"),
        ({"num_attention_heads": 8}, r"config\.json: model_type: missing"),
        ({**LLAMA_3_8B, "num_hidden_layers": None}, r"config\.json: num_hidden_layers: missing"),
        ({**LLAMA_3_8B, "model_type": "llama4"}, r"model_type: 'llama4' is not a family"),
        ({**LLAMA_3_8B, "num_key_value_heads": "8"}, r"num_key_value_heads: '8' is not an integer"),
        ({**LLAMA_3_8B, "torch_dtype": "float8_e4m3fn"}, r"torch_dtype: 'float8_e4m3fn' is not"),
        (
            {**GPT_OSS_20B, "layer_types": ["chunked_attention"] * 24},
            r"layer_types: layer type\(s\) \['chunked_attention'\] not supported",
        ),
        ({**JAMBA_MINI, "mamba_d_state": None}, r"mamba state: the config has Mamba layers"),
        (
            {**GPT_OSS_20B, "layer_types": ["mamba"] * 24, "mamba_d_state": 16},
            r"layers: no attention layer",
        ),
    ],
)
def test_bad_or_unsupported_files_name_the_file_and_field(
    tmp_path: Path, data: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        model_shape_from_hf_config(write(tmp_path, data))


def test_the_yaml_points_at_a_config_json(tmp_path: Path) -> None:
    write(tmp_path, JAMBA_MINI)

    def config(model: dict[str, Any]) -> Any:
        return parse_config(
            {"version": 1, "model": model, "primary": {"capacity": "1GiB"}},
            source=str(tmp_path / "tiering.yaml"),
            base_dir=tmp_path,
            env={},
        )

    cfg = config({"config_json": "config.json", "name": "jamba-mini", "world_size": 2})
    shape = cfg.model_shape()
    assert shape.name == "jamba-mini"
    assert cfg.block_bytes() == 2 * shape.layers_per_position * shape.page_bytes
    other = config({"config_json": "config.json", "name": "jamba-mini-ft", "world_size": 2})
    assert other.fingerprint() != cfg.fingerprint()  # the name keeps fine-tunes apart
    with pytest.raises(ConfigError, match=r"tiering\.yaml: model\.config_json: .*nope\.json"):
        config({"config_json": "nope.json"})
    with pytest.raises(ConfigError, match=r"model\.config_json: give either shape or config_json"):
        config({"config_json": "config.json", "shape": "tiny"})
    with pytest.raises(ConfigError, match=r"model\.shape: missing; give shape"):
        config({"world_size": 1})
    write(tmp_path, {**JAMBA_MINI, "num_hidden_layers": -1}, "bad.json")
    with pytest.raises(ConfigError, match=r"model\.config_json: .*bad\.json: num_hidden_layers"):
        config({"config_json": "bad.json"})


@pytest.mark.parametrize(
    "model",
    [
        {  # a small Jamba: 2 attention and 2 Mamba-1 layers
            "model_type": "jamba",
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_hidden_layers": 4,
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "torch_dtype": "bfloat16",
        },
        {  # a small gpt-oss: sliding and full attention
            "model_type": "gpt_oss",
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_hidden_layers": 4,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "torch_dtype": "float16",
        },
    ],
    ids=["mamba-hybrid", "sliding-window-hybrid"],
)
def test_a_replay_runs_from_a_config_json(tmp_path: Path, model: dict[str, Any]) -> None:
    write(tmp_path, model)
    cfg = parse_config(
        {
            "version": 1,
            "model": {"config_json": "config.json", "name": "small"},
            "primary": {"capacity": "2MiB"},
            "secondary_tiers": [{"name": "nvme", "type": "file", "capacity": "8MiB", "path": "d"}],
        },
        source=str(tmp_path / "tiering.yaml"),
        base_dir=tmp_path,
        env={},
    )
    options = ReplayOptions(
        trace="chat", scale="tiny", seed=2, engine_blocks=2048, max_requests=60, progress=False
    )
    report = run_replay(cfg, options)
    assert report["model"] == "small"
    assert report["block_bytes"] == cfg.block_bytes()
    assert report["verify_failures"] == 0
    assert report["prefill_tokens_saved"] > 0
