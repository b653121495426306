"""Environment overrides: ``TIERING_<PATH>`` variables change keys of the loaded file.

The dotted key path upper-cased, with ``__`` between levels and a tier's name in place of its
index (``TIERING_SECONDARY_TIERS__NVME__CAPACITY=100GiB``). Values are read as YAML scalars.
Overrides change existing tiers, they do not add them; the key paths they set are recorded in
the parse's :class:`~tiering.config.context._Context`, so that a bad value names its variable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiering.backends.registry import GENERIC_TIER_KEYS, check_backend_type
from tiering.backends.settings import settings_fields, unknown_key_message
from tiering.config.context import _Context
from tiering.config.schema import (
    _ROOT_KEYS,
    _SCALAR_KEYS,
    _SECTIONS,
    ENV_PREFIX,
    IGNORED_ENV_VARS,
    _env_name,
)
from tiering.config.yaml_lines import _LineMap, _load_yaml
from tiering.errors import ConfigError, ConfigurationError


def _apply_env_overrides(tree: _LineMap, env: Mapping[str, str], ctx: _Context) -> None:
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in IGNORED_ENV_VARS:
            continue
        parts = var[len(ENV_PREFIX) :].split("__")
        value = _load_yaml(env[var], f"{ctx.source}: environment variable {var}")
        if isinstance(value, Mapping | list):
            raise ConfigError(
                f"{ctx.source}: environment variable {var}: give a single value (a YAML "
                f"scalar), got {env[var]!r:.60}"
            )
        path = _apply_override(tree, [p.lower() for p in parts], value, var, ctx)
        ctx.env_origins[path] = var


def _override_error(ctx: _Context, var: str, problem: str) -> ConfigError:
    return ConfigError(f"{ctx.source}: environment variable {var}: {problem}")


def _apply_override(tree: _LineMap, parts: list[str], value: Any, var: str, ctx: _Context) -> str:
    """Set one override in ``tree``; returns the key path it set."""
    top = parts[0]
    if top not in _ROOT_KEYS:
        raise _override_error(ctx, var, unknown_key_message(top, _ROOT_KEYS))
    depth = {"secondary_tiers": 3}.get(top, 1 if top in _SCALAR_KEYS else 2)
    if len(parts) != depth:
        example = {1: top.upper(), 2: f"{top.upper()}__KEY", 3: f"{top.upper()}__NAME__KEY"}
        raise _override_error(
            ctx, var, f"malformed override; the form is {ENV_PREFIX}{example[depth]}"
        )
    if depth == 1:
        tree[top] = value
        return top
    if top == "secondary_tiers":
        return _override_tier(tree, parts[1], parts[2], value, var, ctx)
    valid = [f.key for f in settings_fields(_SECTIONS[top])]
    if parts[1] not in valid:
        raise _override_error(ctx, var, f"{top}: {unknown_key_message(parts[1], valid)}")
    section = tree.get(top)
    if section is None:
        section = tree[top] = _LineMap()
    if isinstance(section, _LineMap):  # otherwise the parser reports the section itself
        section[parts[1]] = value
    return f"{top}.{parts[1]}"


def _override_tier(
    tree: _LineMap, tier_name: str, key: str, value: Any, var: str, ctx: _Context
) -> str:
    tiers = tree.get("secondary_tiers")
    names: list[str | None] = []
    for index, item in enumerate(tiers if isinstance(tiers, list) else []):
        if not isinstance(item, _LineMap):
            continue
        name = _default_tier_name(item)
        names.append(name)
        if name is not None and _env_name(name) == tier_name.upper():
            valid = list(GENERIC_TIER_KEYS)
            try:
                entry = check_backend_type(str(item.get("type")))
            except ConfigurationError:
                entry = None  # a bad type: the parser reports it
            if entry is None:
                valid = [key]  # a plugin's keys are checked when it is imported
            else:
                valid += [f.key for f in entry.settings_fields()]
            if key not in valid:
                raise _override_error(ctx, var, f"tier {name!r}: {unknown_key_message(key, valid)}")
            item[key] = value
            return f"secondary_tiers[{index}].{key}"
    known = ", ".join(_env_name(n) for n in names if n) or "none"
    raise _override_error(
        ctx,
        var,
        f"no tier named {tier_name.upper()!r} (tiers: {known}); overrides change "
        "existing tiers, they do not add them",
    )


def _default_tier_name(item: Mapping[str, Any]) -> str | None:
    """A tier's name: its ``name`` key, else its type lower-cased, or for a ``module:Class``
    type the class name lower-cased (None if neither is usable). Imports nothing."""
    name = item.get("name")
    if name is not None:
        return name if isinstance(name, str) else None
    tier_type = item.get("type")
    if not isinstance(tier_type, str):
        return None
    return tier_type.rpartition(":")[2].rpartition(".")[2].lower()
