"""The JSON Schema (draft 2020-12) of a config file (``tiering config schema``).

Built from the sections' dataclasses and the built-in backends' settings classes, so it cannot
drift from what the parser accepts; it depends on the built-ins only, not on installed plugins.
"""

from __future__ import annotations

from typing import Any

from tiering.backends.registry import BUILTIN_BACKENDS, NAME_PATTERN, get_backend
from tiering.backends.settings import SIZE_JSON_SCHEMA, field_json_schema, settings_fields
from tiering.config.schema import (
    CONFIG_VERSION,
    SCALES,
    EventsConfig,
    HashingConfig,
    MetricsConfig,
    ModelConfig,
    PrimaryConfig,
    ReplaySettings,
    _TierKeys,
)
from tiering.model.shapes import MODEL_SHAPES


def config_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a config file, with the built-in backends' keys.

    Deterministic: it depends on the built-ins only, not on installed plugins. A tier whose
    ``type`` is not built-in is checked for its generic keys only.
    """
    model = _section_schema(ModelConfig)
    model["properties"]["shape"]["enum"] = sorted(MODEL_SHAPES)
    replay = _section_schema(ReplaySettings)
    replay["properties"]["scale"]["enum"] = list(SCALES)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"tiering configuration (version {CONFIG_VERSION})",
        "type": "object",
        "additionalProperties": False,
        "required": ["version", "primary"],
        "properties": {
            "version": {"const": CONFIG_VERSION},
            "model": model,
            "hashing": _section_schema(HashingConfig),
            "block_size_factor": {"type": "integer", "minimum": 1, "default": 1},
            "primary": _section_schema(PrimaryConfig),
            "secondary_tiers": {
                "type": "array",
                "description": "ordered: looked up in this order",
                "items": {"oneOf": [*map(_builtin_tier_schema, BUILTIN_BACKENDS), _plugin_tier()]},
            },
            "events": _section_schema(EventsConfig),
            "metrics": _section_schema(MetricsConfig),
            "replay": replay,
        },
        "$defs": {"size": SIZE_JSON_SCHEMA},
    }


def _section_schema(cls: type) -> dict[str, Any]:
    fields = settings_fields(cls)
    schema: dict[str, Any] = {
        "type": "object",
        "additionalProperties": False,
        "properties": {f.key: field_json_schema(f) for f in fields},
    }
    required = [f.key for f in fields if f.required]
    if required:
        schema["required"] = required
    return schema


def _generic_tier_properties() -> dict[str, Any]:
    return {
        "name": {"type": "string", "pattern": f"^{NAME_PATTERN}$"},
        "type": {"type": "string"},
        **_section_schema(_TierKeys)["properties"],
    }


def _builtin_tier_schema(name: str) -> dict[str, Any]:
    entry = get_backend(name)
    properties = _generic_tier_properties()
    properties["type"] = {"const": name}
    required = ["type", "capacity"]
    if entry.accepts_path:
        properties["path"] = {"type": "string", "minLength": 1}
        required.append("path")
    properties.update({f.key: field_json_schema(f) for f in entry.settings_fields()})
    return {
        "type": "object",
        "additionalProperties": False,
        "required": required,
        "properties": properties,
    }


def _plugin_tier() -> dict[str, Any]:
    properties = _generic_tier_properties()
    properties["type"] = {"type": "string", "not": {"enum": list(BUILTIN_BACKENDS)}}
    return {
        "type": "object",
        "description": "a plugin backend: its own keys are checked by its settings class",
        "required": ["type", "capacity"],
        "properties": properties,
    }
