"""Resolving the plugins a config names: importing its policies and plugin backends.

Reading a config runs no plugin code; :func:`resolve_plugins` (which
:func:`tiering.config.build_manager` calls) imports them and checks each plugin tier's keys
against its backend's settings class.
"""

from __future__ import annotations

import dataclasses

from tiering.backends.registry import GENERIC_TIER_KEYS, get_backend
from tiering.backends.settings import SettingsProblem, parse_settings
from tiering.config.schema import PluginSettings, TierConfig, TieringConfig
from tiering.errors import ConfigError, ConfigurationError
from tiering.policies import get_policy_class


def resolve_plugins(config: TieringConfig) -> TieringConfig:
    """``config`` with the plugins it names imported and checked.

    Every policy is loaded, and every plugin tier's keys are checked against its backend's
    settings class (the result replaces its :class:`PluginSettings`). This runs the plugins'
    module code, which reading a config never does; :func:`build_manager` calls it. Raises
    :class:`ConfigError` naming the file and the key.
    """
    _load_policy(config.primary.policy, f"{config.source}: primary.policy")
    tiers = tuple(
        _resolve_tier(tier, f"{config.source}: secondary_tiers[{index}]")
        for index, tier in enumerate(config.secondary_tiers)
    )
    return dataclasses.replace(config, secondary_tiers=tiers)


def _load_policy(name: str, where: str) -> None:
    try:
        get_policy_class(name)
    except ConfigurationError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def _resolve_tier(tier: TierConfig, where: str) -> TierConfig:
    """``tier`` with its policy loaded and, for a plugin backend, its settings checked."""
    _load_policy(tier.policy, f"{where}.policy")
    raw = tier.settings
    if not isinstance(raw, PluginSettings):
        return tier
    try:
        entry = get_backend(tier.type)
    except ConfigurationError as exc:
        raise ConfigError(f"{where}.type: {exc}") from None
    if entry.accepts_path and tier.path is None:
        raise ConfigError(
            f"{where}.path: missing; the {entry.name!r} backend keeps its data in a directory: "
            "give one"
        )
    if not entry.accepts_path and tier.path is not None:
        raise ConfigError(f"{where}.path: the {entry.name!r} backend takes no path")
    try:
        settings = parse_settings(
            entry.settings_class, raw.values, base_dir=raw.base_dir, other_keys=GENERIC_TIER_KEYS
        )
    except SettingsProblem as exc:
        key = f".{exc.key}" if exc.key else ""
        line = raw.key_lines.get(exc.key or "")
        source, _, rest = where.partition(": ")
        located = f"{source}:{line}: {rest}" if line and rest else where
        raise ConfigError(f"{located}{key}: {exc.problem}") from None
    return dataclasses.replace(tier, settings=settings)
