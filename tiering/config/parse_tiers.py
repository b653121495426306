"""Checking ``secondary_tiers``: each tier's generic keys, name, path and backend keys.

A built-in backend's keys are checked against its settings class now; a plugin backend's wait,
unchecked, in :class:`~tiering.config.schema.PluginSettings` (checking a config runs no plugin
code; :func:`tiering.config.resolve_plugins` checks them). Tier names and paths are unique.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiering.backends.registry import (
    BUILTIN_BACKENDS,
    GENERIC_TIER_KEYS,
    NAME_PATTERN,
    BackendEntry,
    check_backend_type,
)
from tiering.backends.settings import settings_fields
from tiering.config.context import _Context
from tiering.config.env import _default_tier_name
from tiering.config.parse_sections import _check_policy, _parse_mapping
from tiering.config.schema import PluginSettings, TierConfig, _TierKeys
from tiering.config.tier_paths import _parse_tier_path
from tiering.config.yaml_lines import _key_line, _line_of, _LineMap, _with_lines
from tiering.errors import ConfigurationError
from tiering.managers.secondary_tier import WritePolicy


def _parse_tiers(ctx: _Context, data: _LineMap) -> tuple[TierConfig, ...]:
    items = data.get("secondary_tiers")
    if items is None:
        return ()
    if not isinstance(items, list):
        raise ctx.error(
            "secondary_tiers",
            f"must be a list of tiers, got {type(items).__name__}: {items!r:.60}",
            _key_line(data, "secondary_tiers"),
        )
    tiers: list[TierConfig] = []
    names: dict[str, int] = {}
    paths: dict[Path, int] = {}
    for index, item in enumerate(items):
        path = f"secondary_tiers[{index}]"
        lines = getattr(items, "item_lines", [])
        line = lines[index] if index < len(lines) else _line_of(items)
        tier = _parse_tier(ctx, item, path, line)
        _check_unique(ctx, tier, item, index, names, paths)
        tiers.append(tier)
    return tuple(tiers)


def _check_unique(
    ctx: _Context,
    tier: TierConfig,
    item: object,
    index: int,
    names: dict[str, int],
    paths: dict[Path, int],
) -> None:
    """Refuse a tier whose name or directory an earlier tier has (``names`` and ``paths``
    record the first index of each)."""
    path = f"secondary_tiers[{index}]"
    other = names.setdefault(tier.env_name, index)
    if other != index:
        raise ctx.error(
            f"{path}.name",
            f"duplicate tier name {tier.name!r} (also secondary_tiers[{other}]); tier "
            "names must be unique (ignoring case, '-' equals '_'); set 'name' on one",
            _key_line(item, "name"),
        )
    if tier.path is not None:
        other = paths.setdefault(tier.path, index)
        if other != index:
            raise ctx.error(
                f"{path}.path",
                f"{str(tier.path)!r} is also the path of secondary_tiers[{other}]; each "
                "tier needs a directory of its own",
                _key_line(item, "path"),
            )


def _parse_tier(ctx: _Context, item: object, path: str, line: int | None) -> TierConfig:
    if not isinstance(item, Mapping):
        raise ctx.error(
            path, f"a tier must be a mapping (type, capacity, ...), got {item!r:.60}", line
        )
    entry = _parse_tier_type(ctx, item, path, line)
    name = _parse_tier_name(ctx, item, path)
    generic = {k: v for k, v in item.items() if k in _TIER_KEYS}
    keys: _TierKeys = _parse_mapping(ctx, _with_lines(item, generic), path, _TierKeys, line)
    _check_policy(ctx, keys.policy, f"{path}.policy", item)
    _check_admission(ctx, keys, path, item)
    settings = _parse_backend_settings(ctx, item, path, line, entry)
    return TierConfig(
        name=name,
        type=item["type"],
        capacity_bytes=keys.capacity_bytes,
        path=_parse_tier_path(ctx, item, path, entry),
        policy=keys.policy,
        write_policy=WritePolicy(keys.write_policy),
        selective_min_lookups=keys.selective_min_lookups,
        max_inflight_jobs=keys.max_inflight_jobs,
        quarantine_seconds=keys.quarantine_seconds,
        io_timeout_s=keys.io_timeout_s,
        existence_cache_seconds=keys.existence_cache_seconds,
        existence_cache_max_keys=keys.existence_cache_max_keys,
        admission_min_count=keys.admission_min_count,
        admission_width=keys.admission_width,
        settings=settings,
    )


def _check_admission(ctx: _Context, keys: _TierKeys, path: str, item: Mapping[str, Any]) -> None:
    """The admission keys that cannot go together (their ranges are the schema's)."""
    if keys.admission_width is not None and keys.admission_min_count == 0:
        raise ctx.error(
            f"{path}.admission_width",
            f"{keys.admission_width} is set but admission_min_count is 0 (no gate); set "
            "admission_min_count >= 1 or remove admission_width",
            _key_line(item, "admission_width"),
        )
    if keys.admission_min_count and keys.write_policy == WritePolicy.WRITE_BACK:
        raise ctx.error(
            f"{path}.admission_min_count",
            f"{keys.admission_min_count}: admission applies to write_through and "
            "write_through_selective tiers, not write_back (which writes only the blocks the "
            "CPU tier evicts; one not admitted would leave every tier); set it to 0 or change "
            "write_policy",
            _key_line(item, "admission_min_count"),
        )


def _parse_tier_type(
    ctx: _Context, item: Mapping[str, Any], path: str, line: int | None
) -> BackendEntry | None:
    """The tier's backend; None for a plugin (``module:Class``), imported when it is built."""
    if "type" not in item:
        raise ctx.error(
            f"{path}.type",
            f"missing; give a backend name ({', '.join(BUILTIN_BACKENDS)}, ...) or 'module:Class'",
            line,
        )
    try:
        return check_backend_type(item["type"])
    except ConfigurationError as exc:
        raise ctx.error(f"{path}.type", str(exc), _key_line(item, "type")) from None


def _parse_backend_settings(
    ctx: _Context, item: Mapping[str, Any], path: str, line: int | None, entry: BackendEntry | None
) -> object:
    """The tier's backend keys: checked into a built-in backend's settings class, or kept as
    :class:`PluginSettings` for a plugin."""
    backend_keys = {k: v for k, v in item.items() if k not in GENERIC_TIER_KEYS}
    if entry is None:
        lines = getattr(item, "key_lines", {})
        return PluginSettings(
            dict(backend_keys), ctx.base_dir, {k: lines[k] for k in backend_keys if k in lines}
        )
    return _parse_mapping(
        ctx,
        _with_lines(item, backend_keys),
        path,
        entry.settings_class,
        line,
        other_keys=GENERIC_TIER_KEYS,
    )


_TIER_KEYS = frozenset(f.key for f in settings_fields(_TierKeys))


def _parse_tier_name(ctx: _Context, item: Mapping[str, Any], path: str) -> str:
    name = item.get("name")
    if name is None:
        name = _default_tier_name(item)
    if not isinstance(name, str) or not re.fullmatch(NAME_PATTERN, name):
        raise ctx.error(
            f"{path}.name",
            f"{name!r} is not a valid tier name: a letter followed by up to 63 letters, digits, "
            "'_' or '-'",
            _key_line(item, "name"),
        )
    return name
