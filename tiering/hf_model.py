"""A model's KV-cache geometry from its Hugging Face ``config.json``, read as plain JSON.

:func:`model_shape_from_hf_config` turns the file into a :class:`~tiering.model_shapes.ModelShape`
of one rank, grouped and padded as vLLM 0.33 lays the model's cache out:

- **attention**: ``num_hidden_layers``, ``num_key_value_heads`` (default
  ``num_attention_heads``), ``head_dim`` (default ``hidden_size / num_attention_heads``), the
  dtype (``torch_dtype`` or ``dtype``; bfloat16 when absent). KV heads are split over
  ``world_size`` ranks (at least one per rank, as vLLM replicates them).
- **MLA** (DeepSeek V2/V3, Kimi K2): ``kv_lora_rank`` + ``qk_rope_head_dim`` bytes-per-element
  per token in one latent (``kv_parts=1``), the same on every rank.
- **which layer is what**, first match: ``layer_types`` (``full_attention``/``attention``,
  ``sliding_attention``, ``mamba``/``linear_attention``: Gemma 3, gpt-oss, Qwen3, Granite 4.0-H,
  Qwen3-Next), ``layers_block_type``, ``hybrid_override_pattern`` (Nemotron-H: ``M`` Mamba,
  ``*`` attention, others no cache), ``attn_layer_indices`` (Bamba), ``attn_layer_period`` and
  ``attn_layer_offset`` (Jamba), Falcon-H1 (attention and Mamba in every layer),
  ``full_attention_interval``, ``sliding_window_pattern`` (layer ``i`` is full when
  ``(i + 1) % pattern == 0``; Gemma 2 alternates), else every layer full attention, or sliding
  when ``sliding_window`` is set (and ``use_sliding_window`` is not false).
- **Mamba state** per layer and rank, in the model dtype (vLLM's ``auto`` state dtypes): Mamba-1
  (``mamba_d_state``, ``mamba_d_conv``, ``mamba_expand``: Jamba), Mamba-2 (``mamba_n_heads``,
  ``mamba_d_head``, ``mamba_n_groups``, ``mamba_d_state``, ``mamba_d_conv`` and Nemotron-H's
  ``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``, ``ssm_state_size``, ``conv_kernel``),
  gated delta net (``linear_num_key_heads``, ``linear_num_value_heads``,
  ``linear_key_head_dim``, ``linear_value_head_dim``, ``linear_conv_kernel_dim``: Qwen3-Next).
  As in vLLM, the block size grows (in steps of ``block_size``) until an attention page holds
  a state, and the state is padded to that page.
- **groups**: layers of one kind form groups of equal size (vLLM's rule: the smallest kind's
  count, or the largest's when within 1.5x), ``layers[i::n]`` in group ``i``.

A multimodal model's ``text_config`` is read when present. Not supported (a
:class:`~tiering.errors.ConfigError` says so): attention-free models, chunked local attention
(Llama 4), per-layer head counts, Zamba2's shared blocks, dtypes other than bfloat16, float16
and float32.
"""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiering.errors import ConfigError
from tiering.groups import GroupKind
from tiering.model_shapes import GroupShape, ModelShape

__all__ = [
    "MAX_HF_CONFIG_BYTES",
    "cached_model_shape",
    "model_shape_from_hf_config",
    "read_hf_config",
]

MAX_HF_CONFIG_BYTES = 4 << 20  # config.json files are a few KB; a vision tower's a few 100 KB
_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "half": "float16"}
_LAYER_KINDS: dict[str, GroupKind | None] = {
    "full_attention": GroupKind.FULL_ATTENTION,
    "attention": GroupKind.FULL_ATTENTION,
    "global": GroupKind.FULL_ATTENTION,
    "sliding_attention": GroupKind.SLIDING_WINDOW,
    "local": GroupKind.SLIDING_WINDOW,
    "mamba": GroupKind.MAMBA,
    "mamba2": GroupKind.MAMBA,
    "linear_attention": GroupKind.MAMBA,
    "mlp": None,
    "moe": None,
}
_PATTERN_KINDS: dict[str, GroupKind | None] = {
    "M": GroupKind.MAMBA,
    "*": GroupKind.FULL_ATTENTION,
    "-": None,
    "E": None,
}


class _Fields:
    """The config's fields, with errors that name the file and the field."""

    def __init__(self, data: Mapping[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def error(self, field: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {field}: {problem}")

    def has(self, field: str) -> bool:
        return self.data.get(field) is not None

    def get(self, field: str, default: Any = None) -> Any:
        value = self.data.get(field)
        return default if value is None else value

    def integer(self, field: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.data.get(field, default)
        if value is None:
            raise self.error(field, "missing; it is needed to size the KV cache")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(field, f"{value!r} is not an integer >= {minimum}")
        return value

    def first_int(self, *fields: str, default: int | None = None) -> int:
        for field in fields:
            if self.has(field):
                return self.integer(field)
        if default is None:
            raise self.error(" or ".join(fields), "missing; it is needed to size the state")
        return default


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in ``path``; :class:`ConfigError` naming the file if it is not one."""
    source = str(path)
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_HF_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"{source}: cannot read the model config: {exc.strerror or exc}"
        ) from None
    if len(raw) > MAX_HF_CONFIG_BYTES:
        raise ConfigError(f"{source}: over {MAX_HF_CONFIG_BYTES >> 20} MiB: not a config.json")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"{source}: not a JSON config.json: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a config.json holds a JSON object, got {type(data).__name__}")
    return data


def model_shape_from_hf_config(
    path: str | os.PathLike[str],
    *,
    world_size: int = 1,
    block_size: int = 16,
    name: str | None = None,
) -> ModelShape:
    """The shape of one of ``world_size`` ranks of the model ``path`` describes (see the module
    docstring). ``block_size`` is the engine's block size in tokens (a hybrid Mamba model's
    grows). ``name`` (what the layout fingerprint calls the model) defaults to the config's
    ``_name_or_path``, else its ``model_type``, else the file's directory name.

    Raises :class:`ConfigError` naming the file and the field for a bad or unsupported config.
    """
    top = data = read_hf_config(path)
    source = str(path)
    text = data.get("text_config")
    if isinstance(text, dict):
        data = {**{k: v for k, v in data.items() if k != "text_config"}, **text}
        source += " (text_config)"
    fields = _Fields(data, source)
    kinds = _layer_kinds(fields)
    if not any(k in (GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW) for k in kinds):
        raise fields.error("layers", "no attention layer: attention-free models are not supported")
    dtype = _dtype(fields)
    element_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    if fields.has("kv_lora_rank"):  # MLA: one latent per token, not split over ranks
        num_kv_heads, kv_parts = 1, 1
        head_dim = fields.integer("kv_lora_rank") + fields.integer("qk_rope_head_dim")
    else:
        kv_parts = 2
        num_heads = fields.integer("num_attention_heads")
        num_kv_heads = max(1, fields.integer("num_key_value_heads", num_heads) // world_size)
        head_dim = fields.integer(
            "head_dim",
            fields.integer("hidden_size") // num_heads if fields.has("hidden_size") else None,
        )
    if GroupKind.MAMBA in kinds:
        state_bytes = _mamba_state_elements(fields, world_size) * element_bytes
        token_bytes = kv_parts * num_kv_heads * head_dim * element_bytes
        block_size = block_size * math.ceil(state_bytes / (block_size * token_bytes))
    window = None
    if GroupKind.SLIDING_WINDOW in kinds:
        window = fields.integer("sliding_window")
    groups = _groups(kinds, window)
    if name is None:
        name = str(
            top.get("_name_or_path") or top.get("model_type") or Path(path).resolve().parent.name
        )
    return ModelShape(
        name, groups, num_kv_heads, head_dim, dtype, block_size=block_size, kv_parts=kv_parts
    )


def cached_model_shape(path: Path, *, world_size: int = 1, name: str | None = None) -> ModelShape:
    """:func:`model_shape_from_hf_config`, read again only when the file changes (a config's
    block size and fingerprint ask for the shape many times)."""
    try:
        stat = os.stat(path)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the model config: {exc.strerror or exc}") from None
    return _cached(str(path), stat.st_mtime_ns, stat.st_size, world_size, name)


@functools.lru_cache(maxsize=64)
def _cached(path: str, _mtime_ns: int, _size: int, world_size: int, name: str | None) -> ModelShape:
    return model_shape_from_hf_config(path, world_size=world_size, name=name)


def _dtype(fields: _Fields) -> str:
    field = "torch_dtype" if fields.has("torch_dtype") else "dtype"
    value = fields.get(field, "bfloat16")
    if value not in _DTYPES:
        raise fields.error(
            field, f"{value!r} is not supported; supported: bfloat16, float16, float32"
        )
    return _DTYPES[value]


def _layer_kinds(fields: _Fields) -> list[GroupKind]:
    """Every cache-holding layer's kind, in order (a Falcon-H1 layer counts twice)."""
    for field in ("layer_types", "layers_block_type"):
        if fields.has(field):
            names = fields.get(field)
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise fields.error(field, "must be a list of layer type names")
            unknown = sorted({n for n in names if n not in _LAYER_KINDS})
            if unknown:
                raise fields.error(
                    field,
                    f"layer type(s) {unknown} not supported; supported: {sorted(_LAYER_KINDS)}",
                )
            return [k for n in names if (k := _LAYER_KINDS[n]) is not None]
    if fields.has("hybrid_override_pattern"):
        pattern = fields.get("hybrid_override_pattern")
        unknown = sorted({c for c in str(pattern) if c not in _PATTERN_KINDS})
        if unknown:
            raise fields.error("hybrid_override_pattern", f"unknown layer code(s) {unknown}")
        return [k for c in str(pattern) if (k := _PATTERN_KINDS[c]) is not None]
    num_layers = fields.integer("num_hidden_layers")
    full, mamba = GroupKind.FULL_ATTENTION, GroupKind.MAMBA
    if fields.has("attn_layer_indices"):
        indices = fields.get("attn_layer_indices")
        if not isinstance(indices, list) or not all(
            isinstance(i, int) and 0 <= i < num_layers for i in indices
        ):
            raise fields.error("attn_layer_indices", f"must list layers in [0, {num_layers})")
        return [full if i in indices else mamba for i in range(num_layers)]
    if fields.has("attn_layer_period"):
        period = fields.integer("attn_layer_period")
        offset = fields.integer("attn_layer_offset", 0, minimum=0)
        return [full if i % period == offset else mamba for i in range(num_layers)]
    if fields.get("model_type") == "falcon_h1":
        return [full] * num_layers + [mamba] * num_layers
    if fields.has("full_attention_interval"):
        interval = fields.integer("full_attention_interval")
        return [full if (i + 1) % interval == 0 else mamba for i in range(num_layers)]
    sliding = GroupKind.SLIDING_WINDOW
    pattern = fields.get("sliding_window_pattern")
    if pattern is None and fields.get("model_type") == "gemma2":
        pattern = 2
    if pattern is not None and fields.has("sliding_window"):
        pattern = fields.integer("sliding_window_pattern", pattern)
        return [full if (i + 1) % pattern == 0 else sliding for i in range(num_layers)]
    if fields.has("sliding_window") and fields.get("use_sliding_window", True) is not False:
        return [sliding] * num_layers
    return [full] * num_layers


def _mamba_state_elements(fields: _Fields, world_size: int) -> int:
    """Elements of one Mamba layer's conv and SSM states on one rank (vLLM's shapes)."""
    if fields.has("linear_num_value_heads"):  # gated delta net
        key_heads = fields.integer("linear_num_key_heads")
        value_heads = fields.integer("linear_num_value_heads")
        key_dim = fields.integer("linear_key_head_dim")
        value_dim = fields.integer("linear_value_head_dim")
        kernel = fields.integer("linear_conv_kernel_dim")
        conv_dim = key_dim * key_heads * 2 + value_dim * value_heads
        conv = _split(fields, "linear_num_value_heads", conv_dim, world_size) * (kernel - 1)
        return conv + _split(fields, "linear_num_value_heads", value_heads, world_size) * (
            value_dim * key_dim
        )
    if fields.has("mamba_n_heads") or fields.has("mamba_num_heads"):  # Mamba-2
        heads = fields.first_int("mamba_n_heads", "mamba_num_heads")
        head_dim = fields.first_int("mamba_d_head", "mamba_head_dim")
        state = fields.first_int("mamba_d_state", "ssm_state_size")
        groups = fields.first_int("mamba_n_groups", "n_groups", default=1)
        kernel = fields.first_int("mamba_d_conv", "conv_kernel")
        if fields.has("mamba_d_ssm"):
            intermediate = fields.integer("mamba_d_ssm")
        elif fields.has("mamba_expand") and fields.has("hidden_size"):
            intermediate = fields.integer("mamba_expand") * fields.integer("hidden_size")
        else:
            intermediate = heads * head_dim
        if groups % world_size:
            groups += world_size - groups  # vLLM replicates groups to follow the head shards
        conv_dim = intermediate + 2 * groups * state
        conv = _split(fields, "mamba_n_groups", conv_dim, world_size) * (kernel - 1)
        return conv + _split(fields, "mamba_n_heads", heads, world_size) * head_dim * state
    if fields.has("mamba_d_state"):  # Mamba-1
        intermediate = fields.integer("mamba_expand") * fields.integer("hidden_size")
        per_rank = _split(fields, "mamba_expand", intermediate, world_size)
        return per_rank * (fields.integer("mamba_d_conv") - 1) + per_rank * fields.integer(
            "mamba_d_state"
        )
    raise fields.error(
        "mamba state",
        "the config has Mamba layers but no state size fields this reader knows (Mamba-1: "
        "mamba_d_state; Mamba-2: mamba_n_heads or mamba_num_heads; gated delta net: "
        "linear_num_value_heads)",
    )


def _split(fields: _Fields, field: str, value: int, world_size: int) -> int:
    if value % world_size:
        raise fields.error(field, f"{value} does not split evenly over {world_size} ranks")
    return value // world_size


def _groups(kinds: list[GroupKind], window: int | None) -> tuple[GroupShape, ...]:
    """vLLM's grouping: layers of one kind in groups of one size, ``layers[i::n]`` in group i."""
    counts: dict[GroupKind, int] = {}
    for kind in kinds:
        counts[kind] = counts.get(kind, 0) + 1
    smallest, largest = min(counts.values()), max(counts.values())
    group_size = largest if largest < smallest * 1.5 else smallest
    groups = []
    for kind, count in counts.items():
        num_groups = -(-count // group_size)
        for i in range(num_groups):
            layers = len(range(i, count, num_groups))
            groups.append(
                GroupShape(kind, layers, window if kind is GroupKind.SLIDING_WINDOW else None)
            )
    return tuple(groups)
