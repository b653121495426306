"""The geometry tiering reads from a config.json equals what the model's own ``transformers``
config class implies: layers of each kind, KV heads, head_dim, the sliding window, the MLA
latent and the Mamba state, for each family tiering claims, built from public config values
(written here: no hub download) and from the class defaults alone."""

from __future__ import annotations

import json
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tiering.core.groups import GroupKind
from tiering.errors import ConfigError
from tiering.model.hf_families import ALIASES, FAMILIES
from tiering.model.hf_model import model_shape_from_hf_config

transformers = pytest.importorskip("transformers")
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

FULL, SLIDING, MAMBA = GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW, GroupKind.MAMBA

# Public config.json values (the fields that matter for the KV cache, and a few that do not).
PUBLIC: dict[str, dict[str, Any]] = {
    "llama-3-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "rope_theta": 500000.0,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "max_window_layers": 28,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2-window": {  # use_sliding_window on: layers from max_window_layers on slide
        "model_type": "qwen2",
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "num_hidden_layers": 24,
        "num_key_value_heads": 2,
        "max_window_layers": 20,
        "sliding_window": 4096,
        "use_sliding_window": True,
    },
    "qwen3-8b": {
        "model_type": "qwen3",
        "hidden_size": 4096,
        "head_dim": 128,
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "max_window_layers": 36,
        "sliding_window": None,
        "use_sliding_window": False,
        "torch_dtype": "bfloat16",
    },
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "head_dim": 128,
        "num_attention_heads": 32,
        "num_hidden_layers": 48,
        "num_key_value_heads": 4,
        "max_window_layers": 48,
        "sliding_window": None,
        "use_sliding_window": False,
    },
    "qwen3-next-80b-a3b": {
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "head_dim": 256,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "num_hidden_layers": 48,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "torch_dtype": "bfloat16",
    },
    "gemma-2-9b": {
        "model_type": "gemma2",
        "hidden_size": 3584,
        "head_dim": 256,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "num_hidden_layers": 42,
        "sliding_window": 4096,
        "torch_dtype": "float32",
    },
    "gemma-3-12b": {  # the public file: no head_dim, no sliding_window_pattern
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 3840,
            "intermediate_size": 15360,
            "model_type": "gemma3_text",
            "num_attention_heads": 16,
            "num_hidden_layers": 48,
            "num_key_value_heads": 8,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
    },
    "gemma-3-4b": {  # the text config leaves out its heads too
        "model_type": "gemma3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 2560,
            "model_type": "gemma3_text",
            "num_hidden_layers": 34,
            "sliding_window": 1024,
        },
    },
    "gemma-3-1b": {
        "model_type": "gemma3_text",
        "head_dim": 256,
        "hidden_size": 1152,
        "num_attention_heads": 4,
        "num_hidden_layers": 26,
        "num_key_value_heads": 1,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16",
    },
    "mistral-7b-v0.1": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "torch_dtype": "bfloat16",
    },
    "mistral-7b-v0.3": {
        "model_type": "mistral",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
    },
    "mistral-nemo": {
        "model_type": "mistral",
        "hidden_size": 5120,
        "head_dim": 128,
        "num_attention_heads": 32,
        "num_hidden_layers": 40,
        "num_key_value_heads": 8,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
    },
    "mixtral-8x7b": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "sliding_window": None,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v3": {
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_attention_heads": 128,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "torch_dtype": "bfloat16",
    },
    "deepseek-v2-lite": {
        "model_type": "deepseek_v2",
        "hidden_size": 2048,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_attention_heads": 16,
        "num_hidden_layers": 27,
        "num_key_value_heads": 16,
        "torch_dtype": "bfloat16",
    },
    "jamba-v0.1": {
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
    },
    "gpt-oss-20b": {
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "head_dim": 64,
        "num_attention_heads": 64,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12,
        "torch_dtype": "bfloat16",
    },
    "phi-3-mini-4k": {
        "model_type": "phi3",
        "hidden_size": 3072,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "sliding_window": 2047,
        "torch_dtype": "bfloat16",
    },
    "phi-3-medium-128k": {
        "model_type": "phi3",
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_hidden_layers": 40,
        "num_key_value_heads": 10,
        "sliding_window": 131072,
        "torch_dtype": "bfloat16",
    },
    "command-r7b": {
        "model_type": "cohere2",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "sliding_window_pattern": 4,
        "torch_dtype": "bfloat16",
    },
    "bamba-9b": {
        "model_type": "bamba",
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 32,
        "attn_layer_indices": [9, 18, 27],
        "mamba_n_heads": 128,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "mamba_n_groups": 1,
        "torch_dtype": "bfloat16",
    },
    "granite-4.0-h": {
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
    },
    "nemotron-h-8b": {
        "model_type": "nemotron_h",
        "hidden_size": 4096,
        "head_dim": 128,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-" * 4 + "M-M-M-M-M-M-M-M-",
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "n_groups": 8,
        "ssm_state_size": 128,
        "conv_kernel": 4,
        "torch_dtype": "bfloat16",
    },
    "falcon-h1-1.5b": {
        "model_type": "falcon_h1",
        "hidden_size": 2048,
        "head_dim": 128,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "num_hidden_layers": 24,
        "mamba_d_ssm": 3072,
        "mamba_n_heads": 48,
        "mamba_d_head": 64,
        "mamba_d_state": 256,
        "mamba_d_conv": 4,
        "mamba_n_groups": 1,
        "mamba_expand": 2,
        "torch_dtype": "bfloat16",
    },
}
assert len(PUBLIC["nemotron-h-8b"]["hybrid_override_pattern"]) == 52

_KIND = {
    "full_attention": FULL,
    "attention": FULL,
    "sliding_attention": SLIDING,
    "mamba": MAMBA,
    "linear_attention": MAMBA,
}


def _config_class(data: dict[str, Any]) -> Any:
    """The ``transformers`` config object the model itself would be built from."""
    model_type = data["model_type"]
    kwargs = {k: v for k, v in data.items() if k not in ("model_type", "torch_dtype")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CONFIG_MAPPING[ALIASES.get(model_type, model_type)](**kwargs)


def _expected(data: dict[str, Any]) -> dict[str, Any]:
    """Layers of each kind, KV heads, head_dim, window and Mamba state size, from the class."""
    config = _config_class(data)
    text = getattr(config, "text_config", None) or config
    n = text.num_hidden_layers
    model_type = text.model_type
    if model_type == "falcon_h1":
        names = ["full_attention"] * n + ["mamba"] * n
    elif model_type in ("jamba", "nemotron_h", "bamba"):
        names = list(text.layers_block_type)
    elif getattr(text, "layer_types", None) is not None:
        names = list(text.layer_types)
    else:  # the class keeps no layer types: the window, if any, applies to every layer
        window = getattr(text, "sliding_window", None)
        names = ["sliding_attention" if window else "full_attention"] * n
    kinds = Counter(_KIND[name] for name in names if name in _KIND)
    if model_type.startswith("deepseek"):
        kv_heads, head_dim, kv_parts = 1, text.kv_lora_rank + text.qk_rope_head_dim, 1
    else:
        kv_heads = text.num_key_value_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_parts = 2
    token_bytes = kv_parts * kv_heads * head_dim * 2
    block_size = 16
    if kinds[MAMBA]:
        state_bytes = _mamba_state_elements(text) * 2
        block_size = 16 * -(-state_bytes // (16 * token_bytes))
    return {
        "kinds": dict(kinds),
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "kv_parts": kv_parts,
        "sliding_window": text.sliding_window if kinds[SLIDING] else None,
        "block_size": block_size,
    }


def _mamba_state_elements(text: Any) -> int:
    """One Mamba layer's conv + SSM state (vLLM's shapes, one rank) from the class's fields."""
    if text.model_type == "qwen3_next":
        key = text.linear_key_head_dim * text.linear_num_key_heads
        conv_dim = 2 * key + text.linear_value_head_dim * text.linear_num_value_heads
        ssm = text.linear_num_value_heads * text.linear_value_head_dim * text.linear_key_head_dim
        return conv_dim * (text.linear_conv_kernel_dim - 1) + ssm
    if text.model_type == "jamba":
        inner = text.mamba_expand * text.hidden_size
        return inner * (text.mamba_d_conv - 1) + inner * text.mamba_d_state
    if text.model_type == "nemotron_h":
        heads, head_dim, groups = text.mamba_num_heads, text.mamba_head_dim, text.n_groups
        state, kernel, inner = text.ssm_state_size, text.conv_kernel, heads * head_dim
    else:
        heads, head_dim, groups = text.mamba_n_heads, text.mamba_d_head, text.mamba_n_groups
        state, kernel = text.mamba_d_state, text.mamba_d_conv
        inner = getattr(text, "mamba_d_ssm", None) or text.mamba_expand * text.hidden_size
    return (inner + 2 * groups * state) * (kernel - 1) + heads * head_dim * state


def _derived(tmp_path: Path, data: dict[str, Any]) -> dict[str, Any]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    shape = model_shape_from_hf_config(path)
    kinds: Counter[GroupKind] = Counter()
    for group in shape.groups:
        kinds[group.kind] += group.num_layers
    windows = {g.sliding_window for g in shape.groups if g.kind is SLIDING}
    assert len(windows) <= 1
    return {
        "kinds": dict(kinds),
        "num_kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "kv_parts": shape.kv_parts,
        "sliding_window": windows.pop() if windows else None,
        "block_size": shape.block_size,
    }


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_public_configs_match_their_config_class(tmp_path: Path, name: str) -> None:
    data = PUBLIC[name]
    assert _derived(tmp_path, data) == _expected(data)


def test_every_claimed_family_has_a_public_config_here() -> None:
    tested = {data["model_type"] for data in PUBLIC.values()}
    tested |= {
        data["text_config"]["model_type"] for data in PUBLIC.values() if "text_config" in data
    }
    assert set(FAMILIES) <= tested


# Families whose class defaults alone describe no model tiering can hold (attention-free, or
# a layer list that needs the pattern field): the reader refuses them.
_REFUSED_BARE = {"granitemoehybrid", "nemotron_h", "bamba"}


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_class_defaults_alone(tmp_path: Path, model_type: str) -> None:
    """A config.json that gives nothing but its model_type: every field is the class's default."""
    data = {"model_type": model_type}
    if model_type in _REFUSED_BARE:
        with pytest.raises(ConfigError, match=r"config\.json: "):
            _derived(tmp_path, data)
        return
    assert _derived(tmp_path, data) == _expected(data)


def test_gemma_3_12b_bytes_per_block(tmp_path: Path) -> None:
    """The issue's numbers: head_dim 256 (not 3840 / 16 = 240), 40 sliding + 8 full layers in
    groups of 8: 8 layers * 2 * 16 tokens * 8 heads * 256 * 2 bytes = 1 MiB per block."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PUBLIC["gemma-3-12b"]))
    shape = model_shape_from_hf_config(path)
    assert shape.head_dim == 256
    assert shape.layers_per_position * shape.page_bytes == 1_048_576
    assert [g.kind for g in shape.groups].count(SLIDING) == 5
