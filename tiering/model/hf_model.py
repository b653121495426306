"""A model's KV-cache geometry from its Hugging Face ``config.json``, read as plain JSON.

:func:`model_shape_from_hf_config` turns the file into a :class:`~tiering.model.shapes.ModelShape`
of one rank, grouped and padded as vLLM 0.33 lays the model's cache out. The file is read
through its family (``model_type``, :mod:`tiering.model.hf_families`): a field it leaves out takes
the default of the family's ``transformers`` config class, and the layer kinds follow that
class's rule; a ``model_type`` with no family here is refused, never guessed.

- **attention**: ``num_hidden_layers``, ``num_key_value_heads`` (default
  ``num_attention_heads``), ``head_dim`` (the family's default, or ``hidden_size /
  num_attention_heads`` where the class derives it so), the dtype (``torch_dtype`` or ``dtype``;
  bfloat16 when absent). KV heads are split over ``world_size`` ranks (at least one per rank,
  as vLLM replicates them).
- **MLA** (DeepSeek V2/V3, Kimi K2): ``kv_lora_rank`` + ``qk_rope_head_dim`` bytes-per-element
  per token in one latent (``kv_parts=1``), the same on every rank.
- **which layer is what**: the family's rule (``layer_types`` where its class reads them,
  ``sliding_window_pattern``, ``max_window_layers``, ``full_attention_interval``,
  ``attn_layer_period``/``attn_layer_offset``, ``attn_layer_indices``,
  ``hybrid_override_pattern``; see :data:`tiering.model.hf_families.FAMILIES`).
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

A multimodal model's ``text_config`` is read when present. Any file gives a shape or a
:class:`~tiering.errors.ConfigError` naming the file and the field: numbers are bounded (layers,
dimensions, a block's bytes and tokens), lists are measured before they are walked, and JSON
nested past the interpreter's recursion limit is refused. Not supported: attention-free models,
chunked local attention (Llama 4), per-layer head counts, Zamba2's shared blocks, dtypes other
than bfloat16, float16 and float32.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiering.core.groups import GroupKind
from tiering.errors import ConfigError
from tiering.model.hf_families import (
    MAX_WINDOW,
    ConfigFields,
    Family,
    resolve_fields,
)
from tiering.model.shapes import DTYPE_BYTES, GroupShape, ModelShape

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
#: Bytes of one block on one rank: more is a config asking for the impossible (a 405B model's
#: 16-token block is ~8 MiB; a Mamba state padded into one, a few MiB).
MAX_BLOCK_BYTES = 1 << 34
MAX_BLOCK_TOKENS = 1 << 20


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
    except RecursionError:  # the C decoder stops at the interpreter's recursion limit
        raise ConfigError(f"{source}: not a config.json: JSON nested too deeply") from None
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
    top = read_hf_config(path)
    family, fields = resolve_fields(top, str(path))
    kinds = _layer_kinds(family, fields)
    if not any(k in (GroupKind.FULL_ATTENTION, GroupKind.SLIDING_WINDOW) for k in kinds):
        raise fields.error("layers", "no attention layer: attention-free models are not supported")
    dtype = _dtype(fields)
    element_bytes = DTYPE_BYTES[dtype]
    num_kv_heads, head_dim, kv_parts = _attention(family, fields, world_size)
    token_bytes = kv_parts * num_kv_heads * head_dim * element_bytes
    if GroupKind.MAMBA in kinds:
        state_bytes = _mamba_state_elements(fields, world_size) * element_bytes
        block_size = block_size * -(-state_bytes // (block_size * token_bytes))
        if block_size > MAX_BLOCK_TOKENS:
            raise fields.error(
                "mamba state",
                f"{state_bytes} bytes per layer need {block_size}-token blocks (at most "
                f"{MAX_BLOCK_TOKENS}): not a real model",
            )
    window = None
    if GroupKind.SLIDING_WINDOW in kinds:
        window = fields.integer("sliding_window", maximum=MAX_WINDOW)
    groups = _groups(kinds, window)
    block_bytes = max(g.num_layers for g in groups) * block_size * token_bytes
    if block_bytes > MAX_BLOCK_BYTES:
        raise fields.error(
            "num_hidden_layers",
            f"the layers, heads and head_dim ask for {block_bytes} bytes per block and rank "
            f"(at most {MAX_BLOCK_BYTES}): not a real model",
        )
    if name is None:
        name = _default_name(top, path)
    return ModelShape(
        name, groups, num_kv_heads, head_dim, dtype, block_size=block_size, kv_parts=kv_parts
    )


def _default_name(top: Mapping[str, Any], path: str | os.PathLike[str]) -> str:
    for key in ("_name_or_path", "model_type"):
        value = top.get(key)
        if isinstance(value, str) and value:
            if len(value) > 1024:
                raise ConfigError(f"{path}: {key}: over 1024 characters: not a model name")
            return value
    return Path(path).resolve().parent.name


def _attention(family: Family, fields: ConfigFields, world_size: int) -> tuple[int, int, int]:
    """KV heads on one rank, head size and parts per token (2: K and V; 1: an MLA latent)."""
    if family.head_dim == "mla":  # one latent per token, not split over ranks
        rank = fields.integer("kv_lora_rank") + fields.integer("qk_rope_head_dim")
        return 1, rank, 1
    num_heads = fields.integer("num_attention_heads")
    num_kv_heads = fields.integer("num_key_value_heads", num_heads)
    if num_kv_heads > num_heads:
        raise fields.error(
            "num_key_value_heads", f"{num_kv_heads} is more than the {num_heads} attention heads"
        )
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise fields.error(
            "num_key_value_heads",
            f"{num_kv_heads} KV heads cannot be split over {world_size} ranks (vLLM needs the "
            "heads to divide evenly over the ranks, or the ranks over the heads)",
        )
    if family.head_dim == "field" or (family.head_dim == "hidden" and fields.has("head_dim")):
        head_dim = fields.integer("head_dim")
    else:
        head_dim = fields.integer("hidden_size") // num_heads
        if head_dim < 1:
            raise fields.error("hidden_size", f"smaller than num_attention_heads ({num_heads})")
    return max(1, num_kv_heads // world_size), head_dim, 2


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


def _dtype(fields: ConfigFields) -> str:
    field = "torch_dtype" if fields.has("torch_dtype") else "dtype"
    value = fields.get(field, "bfloat16")
    if not isinstance(value, str) or value not in _DTYPES:
        shown = repr(value) if isinstance(value, str) and len(value) <= 60 else "that"
        if not isinstance(value, str):
            shown = f"a {type(value).__name__}"
        raise fields.error(
            field, f"{shown} is not supported; supported: bfloat16, float16, float32"
        )
    return _DTYPES[value]


def _layer_kinds(family: Family, fields: ConfigFields) -> list[GroupKind]:
    """Every cache-holding layer's kind, in order (a Falcon-H1 layer counts twice)."""
    names = family.layers(fields)
    unknown = sorted(set(names) - set(_LAYER_KINDS))
    if unknown:
        raise fields.error(
            "layer_types",
            f"layer type(s) {unknown[:8]} not supported; supported: {sorted(_LAYER_KINDS)}",
        )
    return [k for n in names if (k := _LAYER_KINDS[n]) is not None]


def _mamba_state_elements(fields: ConfigFields, world_size: int) -> int:
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
        if fields.get("mamba_d_head") == "auto":  # the config class's rule for "auto"
            if fields.has("mamba_d_ssm"):
                inner = fields.integer("mamba_d_ssm")
            else:
                inner = fields.integer("mamba_expand") * fields.integer("hidden_size")
            head_dim = inner // heads
            if head_dim < 1:
                raise fields.error("mamba_d_head", "auto gives 0: mamba_n_heads is too large")
        else:
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


def _split(fields: ConfigFields, field: str, value: int, world_size: int) -> int:
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
