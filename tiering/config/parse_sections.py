"""Checking the config's sections: each mapping into its frozen dataclass, and the scalars.

A section's keys are checked by :func:`tiering.backends.settings.parse_settings` against its
dataclass; a problem becomes a :class:`ConfigError` at the bad key's line. Policy names are
checked without importing anything (a plugin policy is loaded when a manager is built).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tiering.backends.settings import SettingsProblem, parse_settings, settings_fields
from tiering.config.context import _Context
from tiering.config.schema import (
    _SECTIONS,
    BUILTIN_TRACES,
    CONFIG_VERSION,
    WORKLOAD_TRACES,
    ReplaySettings,
)
from tiering.config.yaml_lines import _key_line, _LineMap
from tiering.errors import ConfigurationError
from tiering.policies.registry import check_policy_name


def _parse_section(ctx: _Context, data: Mapping[str, Any], key: str) -> Any:
    value = data.get(key)
    if value is None:
        value = _LineMap()
    if isinstance(value, _LineMap):
        value.line = _key_line(data, key)  # a missing key is reported at its section's key
    return _parse_mapping(ctx, value, key, _SECTIONS[key], _key_line(data, key))


def _parse_mapping(
    ctx: _Context,
    value: object,
    path: str,
    cls: type,
    line: int | None,
    other_keys: Sequence[str] = (),
) -> Any:
    if not isinstance(value, Mapping):
        keys = ", ".join(f.key for f in settings_fields(cls))
        raise ctx.error(
            path,
            f"must be a mapping (keys {keys}), got {type(value).__name__}: {value!r:.60}",
            line,
        )
    try:
        return parse_settings(cls, value, base_dir=ctx.base_dir, other_keys=other_keys)
    except SettingsProblem as exc:
        key_path = f"{path}.{exc.key}" if exc.key else path
        raise ctx.error(key_path, exc.problem, _key_line(value, exc.key)) from None


def _parse_version(data: _LineMap, ctx: _Context) -> int:
    if "version" not in data:
        raise ctx.error("version", f"missing; add 'version: {CONFIG_VERSION}'", data.line)
    version = data["version"]
    # The integer itself: 1.0, "1" and true compare or convert equal to 1 but are not it.
    if type(version) is not int:
        raise ctx.error(
            "version",
            f"must be the integer {CONFIG_VERSION}, got {type(version).__name__} {version!r}; "
            f"write 'version: {CONFIG_VERSION}'",
            _key_line(data, "version"),
        )
    if version != CONFIG_VERSION:
        raise ctx.error(
            "version",
            f"unsupported config version {version!r}; supported: {CONFIG_VERSION}",
            _key_line(data, "version"),
        )
    return CONFIG_VERSION


def _check_policy(ctx: _Context, name: str, path: str, section: object) -> None:
    try:
        check_policy_name(name)  # imports nothing; a plugin is loaded when a manager is built
    except ConfigurationError as exc:
        raise ctx.error(path, str(exc), _key_line(section, "policy")) from None


def _parse_replay(ctx: _Context, data: _LineMap) -> ReplaySettings:
    replay: ReplaySettings = _parse_section(ctx, data, "replay")
    if replay.trace in BUILTIN_TRACES or replay.trace in WORKLOAD_TRACES:
        return replay
    if not replay.trace.endswith(".jsonl"):
        raise ctx.error(
            "replay.trace",
            f"{replay.trace!r} is neither a built-in trace "
            f"({', '.join(BUILTIN_TRACES + WORKLOAD_TRACES)}) nor a "
            "path to a .jsonl file",
            _key_line(data.get("replay"), "trace"),
        )
    trace_path = Path(replay.trace).expanduser()
    return dataclasses.replace(replay, trace=str(ctx.base_dir / trace_path))
