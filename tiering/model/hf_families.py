"""The model families :mod:`tiering.model.hf_model` reads, and what each one's ``transformers``
config
class assumes for a field its ``config.json`` leaves out.

A Hugging Face ``config.json`` holds only what differs from its config class's defaults: Gemma 3's
public files give neither ``head_dim`` nor a sliding-window pattern, and the model has head_dim
256 and every sixth layer full because ``Gemma3TextConfig`` says so. So the geometry is read
through the family's rules (the defaults and the way the class derives its layer types, as of
``transformers`` 5.20), never through a generic guess: a ``model_type`` without a family here
is a :class:`~tiering.errors.ConfigError`. ``tests/test_hf_transformers.py`` checks every family
against the real config classes.

Reading is bounded: numbers have upper bounds and lists are measured before they are walked, so
that any ``config.json`` gives a geometry or a ``ConfigError`` naming the file and the field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from tiering.errors import ConfigError

__all__ = [
    "FAMILIES",
    "MAX_DIM",
    "MAX_LAYERS",
    "ConfigFields",
    "Family",
    "resolve_fields",
]

MAX_LAYERS = 4096  # the largest public models have ~130 layers
MAX_DIM = 1 << 20  # heads, head sizes, hidden sizes, state sizes: public models stay under 2**17
MAX_WINDOW = 1 << 40  # a sliding window in tokens (some configs say 2**31 for "none")


class ConfigFields:
    """A config's fields, with errors that name the file and the field, and bounds on numbers."""

    def __init__(self, data: Mapping[str, Any], source: str) -> None:
        self.data = data
        self.source = source

    def error(self, name: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {name}: {problem}")

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = self.data.get(name)
        return default if value is None else value

    def integer(
        self, name: str, default: int | None = None, *, minimum: int = 1, maximum: int = MAX_DIM
    ) -> int:
        value = self.data.get(name)
        if value is None:
            value = default
        if value is None:
            raise self.error(name, "missing; it is needed to size the KV cache")
        if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
            shown = repr(value) if len(repr(value)) <= 60 else f"a {type(value).__name__}"
            raise self.error(name, f"{shown} is not an integer in [{minimum}, {maximum}]")
        return value

    def first_int(self, *names: str, default: int | None = None) -> int:
        for name in names:
            if self.has(name):
                return self.integer(name)
        if default is None:
            raise self.error(" or ".join(names), "missing; it is needed to size the state")
        return default

    def flag(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(name, f"{_short(value)} is not true or false")
        return value

    def name_list(self, name: str, num_layers: int | None) -> list[str]:
        """A list of layer type names, measured before it is walked."""
        value = self.data.get(name)
        if not isinstance(value, list) or len(value) > MAX_LAYERS:
            raise self.error(name, f"must be a list of at most {MAX_LAYERS} layer type names")
        if num_layers is not None and len(value) != num_layers:
            raise self.error(
                name, f"lists {len(value)} layers but num_hidden_layers is {num_layers}"
            )
        if not all(isinstance(n, str) for n in value):
            raise self.error(name, "must be a list of layer type names (strings)")
        return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else f"a {type(value).__name__}"


# -- how each family names its layers ------------------------------------------------------------

Layers = Callable[[ConfigFields], list[str]]


def _num_layers(fields: ConfigFields) -> int:
    return fields.integer("num_hidden_layers", maximum=MAX_LAYERS)


def _all_full(fields: ConfigFields) -> list[str]:
    return ["full_attention"] * _num_layers(fields)


def _window_everywhere(fields: ConfigFields) -> list[str]:
    """No layer types in the class: every layer slides when ``sliding_window`` is set."""
    kind = "sliding_attention" if fields.has("sliding_window") else "full_attention"
    return [kind] * _num_layers(fields)


def _qwen(fields: ConfigFields) -> list[str]:
    """Qwen 2/3: layers from ``max_window_layers`` on slide, if ``use_sliding_window``."""
    n = _num_layers(fields)
    if fields.has("layer_types"):
        return fields.name_list("layer_types", n)
    sliding = fields.flag("use_sliding_window", False) and fields.has("sliding_window")
    first = fields.integer("max_window_layers", minimum=0, maximum=MAX_LAYERS) if sliding else n
    return ["sliding_attention" if sliding and i >= first else "full_attention" for i in range(n)]


def _qwen3_moe(fields: ConfigFields) -> list[str]:
    """Qwen3-MoE keeps no layer types: every layer slides if ``use_sliding_window``."""
    sliding = fields.flag("use_sliding_window", False) and fields.has("sliding_window")
    return ["sliding_attention" if sliding else "full_attention"] * _num_layers(fields)


def _every_nth_full(pattern_field: str | None, default: int, other: str) -> Layers:
    """Layer ``i`` is full when ``(i + 1) % n == 0`` (``n`` from ``pattern_field``), else
    ``other``; an explicit ``layer_types`` wins."""

    def layers(fields: ConfigFields) -> list[str]:
        n = _num_layers(fields)
        if fields.has("layer_types"):
            return fields.name_list("layer_types", n)
        every = default
        if pattern_field is not None:
            every = fields.integer(pattern_field, default, maximum=MAX_LAYERS)
        return [other if (i + 1) % every else "full_attention" for i in range(n)]

    return layers


def _jamba(fields: ConfigFields) -> list[str]:
    period = fields.integer("attn_layer_period", maximum=MAX_LAYERS)
    offset = fields.integer("attn_layer_offset", minimum=0, maximum=MAX_LAYERS)
    return [
        "full_attention" if i % period == offset else "mamba" for i in range(_num_layers(fields))
    ]


def _bamba(fields: ConfigFields) -> list[str]:
    n = _num_layers(fields)
    indices = fields.get("attn_layer_indices", [])
    if not isinstance(indices, list) or len(indices) > n:
        raise fields.error("attn_layer_indices", f"must list at most {n} layers in [0, {n})")
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in indices):
        raise fields.error("attn_layer_indices", f"must list layers in [0, {n})")
    attention = set(indices)
    return ["full_attention" if i in attention else "mamba" for i in range(n)]


def _granite_hybrid(fields: ConfigFields) -> list[str]:
    n = _num_layers(fields)
    for name in ("layer_types", "layers_block_type"):
        if fields.has(name):
            return fields.name_list(name, n)
    return ["mamba"] * n


_PATTERN_KINDS = {"M": "mamba", "*": "full_attention", "-": "mlp", "E": "moe"}


def _nemotron_h(fields: ConfigFields) -> list[str]:
    n = (
        fields.integer("num_hidden_layers", maximum=MAX_LAYERS)
        if fields.has("num_hidden_layers")
        else None
    )
    if fields.has("hybrid_override_pattern"):
        pattern = fields.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or len(pattern) > MAX_LAYERS:
            raise fields.error("hybrid_override_pattern", "must be a string of layer codes")
        unknown = sorted(set(pattern) - set(_PATTERN_KINDS))
        if unknown:
            raise fields.error(
                "hybrid_override_pattern",
                f"unknown layer code(s) {unknown}; known: {sorted(_PATTERN_KINDS)}",
            )
        if n is not None and len(pattern) != n:
            raise fields.error(
                "hybrid_override_pattern",
                f"has {len(pattern)} layers but num_hidden_layers is {n}",
            )
        return [_PATTERN_KINDS[c] for c in pattern]
    if fields.has("layers_block_type"):
        return fields.name_list("layers_block_type", n)
    raise fields.error("hybrid_override_pattern", "missing; it says which layer is what")


def _falcon_h1(fields: ConfigFields) -> list[str]:
    """Attention and a Mamba-2 mixer side by side in every layer: both hold state."""
    n = _num_layers(fields)
    return ["full_attention"] * n + ["mamba"] * n


@dataclass(frozen=True)
class Family:
    """One ``transformers`` config class: its defaults for the fields the geometry reads, how
    it derives ``head_dim`` and which layer is what."""

    name: str
    defaults: Mapping[str, Any]
    layers: Layers
    #: "field": ``head_dim`` (its default in ``defaults``); "hidden": ``head_dim`` if set, else
    #: ``hidden_size // num_attention_heads``; "hidden_only": always the latter; "mla": latent.
    head_dim: str = "hidden"
    #: Fields the family's class rejects or that change the geometry in ways not read here.
    unsupported: Mapping[str, str] = field(default_factory=dict)


def _family(name: str, defaults: Mapping[str, Any], layers: Layers, **kw: Any) -> Family:
    return Family(name, defaults, layers, **kw)


_QWEN_WINDOW = {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 28}
_BIDIRECTIONAL = {"use_bidirectional_attention": "bidirectional (embedding) models"}

#: model_type -> family. Defaults as in transformers 5.20's config classes.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        _family(
            "llama",
            {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096},
            _all_full,
        ),
        _family(
            "mistral",
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "sliding_window": 4096,
            },
            _window_everywhere,
        ),
        _family(
            "mixtral",
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
            },
            _window_everywhere,
        ),
        _family(
            "phi3",
            {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 3072},
            _window_everywhere,
        ),
        _family(
            "qwen2",
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 32,
                "hidden_size": 4096,
                **_QWEN_WINDOW,
            },
            _qwen,
        ),
        _family(
            "qwen3",
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 32,
                "hidden_size": 4096,
                "head_dim": 128,
                **_QWEN_WINDOW,
            },
            _qwen,
            head_dim="field",
        ),
        _family(
            "qwen3_moe",
            {
                "num_hidden_layers": 24,
                "num_attention_heads": 32,
                "num_key_value_heads": 4,
                "hidden_size": 2048,
                "sliding_window": 4096,
                "use_sliding_window": False,
            },
            _qwen3_moe,
        ),
        _family(
            "qwen3_next",
            {
                "num_hidden_layers": 48,
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "hidden_size": 2048,
                "head_dim": 256,
                "linear_num_key_heads": 16,
                "linear_num_value_heads": 32,
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_conv_kernel_dim": 4,
            },
            _every_nth_full("full_attention_interval", 4, "linear_attention"),
            head_dim="field",
        ),
        _family(
            "gemma2",
            {
                "num_hidden_layers": 26,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "hidden_size": 2304,
                "head_dim": 256,
                "sliding_window": 4096,
            },
            _every_nth_full(None, 2, "sliding_attention"),
            head_dim="field",
            unsupported=_BIDIRECTIONAL,
        ),
        _family(
            "gemma3_text",
            {
                "num_hidden_layers": 26,
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "hidden_size": 2304,
                "head_dim": 256,
                "sliding_window": 4096,
            },
            _every_nth_full("sliding_window_pattern", 6, "sliding_attention"),
            head_dim="field",
            unsupported=_BIDIRECTIONAL,
        ),
        _family(
            "cohere2",
            {
                "num_hidden_layers": 40,
                "num_attention_heads": 64,
                "hidden_size": 8192,
                "sliding_window": 4096,
            },
            _every_nth_full("sliding_window_pattern", 4, "sliding_attention"),
            head_dim="hidden_only",
        ),
        _family(
            "gpt_oss",
            {
                "num_hidden_layers": 36,
                "num_attention_heads": 64,
                "num_key_value_heads": 8,
                "hidden_size": 2880,
                "head_dim": 64,
                "sliding_window": 128,
            },
            _every_nth_full(None, 2, "sliding_attention"),
            head_dim="field",
        ),
        _family(
            "deepseek_v2",
            {"num_hidden_layers": 32, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
            _all_full,
            head_dim="mla",
        ),
        _family(
            "deepseek_v3",
            {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64},
            _all_full,
            head_dim="mla",
        ),
        _family(
            "jamba",
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "attn_layer_period": 8,
                "attn_layer_offset": 4,
                "mamba_d_state": 16,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
            },
            _jamba,
        ),
        _family(
            "bamba",
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "mamba_d_state": 256,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_n_heads": 128,
                "mamba_d_head": "auto",
                "mamba_n_groups": 1,
            },
            _bamba,
        ),
        _family(
            "granitemoehybrid",
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "hidden_size": 4096,
                "mamba_d_state": 256,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_n_heads": 128,
                "mamba_d_head": "auto",
                "mamba_n_groups": 1,
            },
            _granite_hybrid,
        ),
        _family(
            "nemotron_h",
            {
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "head_dim": 128,
                "mamba_num_heads": 128,
                "mamba_head_dim": 64,
                "n_groups": 8,
                "ssm_state_size": 128,
                "conv_kernel": 4,
            },
            _nemotron_h,
            head_dim="field",
        ),
        _family(
            "falcon_h1",
            {
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "hidden_size": 4096,
                "mamba_d_state": 256,
                "mamba_d_conv": 4,
                "mamba_expand": 2,
                "mamba_n_heads": 128,
                "mamba_d_head": "auto",
                "mamba_n_groups": 1,
                "mamba_d_ssm": 1024,
            },
            _falcon_h1,
        ),
    )
}
#: Other model types read as one of the families (their config classes are the family's).
ALIASES = {"kimi_k2": "deepseek_v3"}
#: Multimodal wrappers: the family of a ``text_config`` that names no ``model_type``.
WRAPPERS = {"gemma3": "gemma3_text"}


def resolve_fields(top: Mapping[str, Any], source: str) -> tuple[Family, ConfigFields]:
    """The family of the config ``top`` (read from ``source``), and its fields with the family's
    defaults filled in for absent keys (a multimodal model's ``text_config`` read instead, with
    the top level's dtype kept)."""
    outer = ConfigFields(top, source)
    data: Mapping[str, Any] = top
    model_type = top.get("model_type")
    if "text_config" in top:
        text = top["text_config"]
        if not isinstance(text, dict):
            raise outer.error("text_config", f"{_short(text)} is not a JSON object")
        source += " (text_config)"
        if not isinstance(model_type, str):
            raise outer.error("model_type", "missing; it names the model's family")
        inner_type = text.get("model_type", WRAPPERS.get(model_type))
        if inner_type is None:
            raise outer.error(
                "text_config.model_type",
                f"missing, and {model_type!r} is not a multimodal model this reader knows "
                f"(known: {sorted(WRAPPERS)})",
            )
        outer_dtype = {k: top[k] for k in ("torch_dtype", "dtype") if k in top}
        data, model_type = {**outer_dtype, **text}, inner_type
    fields = ConfigFields(data, source)
    if not isinstance(model_type, str):
        raise fields.error(
            "model_type",
            f"{'missing' if model_type is None else _short(model_type)}; it names the model's "
            f"family; supported: {', '.join(sorted([*FAMILIES, *ALIASES]))}",
        )
    family = FAMILIES.get(ALIASES.get(model_type, model_type))
    if family is None:
        raise fields.error(
            "model_type",
            f"{model_type[:60]!r} is not a family this reader knows the defaults of; supported: "
            f"{', '.join(sorted([*FAMILIES, *ALIASES]))}",
        )
    for name, why in family.unsupported.items():
        if fields.get(name) not in (None, False):
            raise fields.error(name, f"not supported: {why}")
    return family, ConfigFields({**family.defaults, **data}, source)
