"""The entry points that read a config: :func:`load_config` (a YAML file) and
:func:`parse_config` (an already-loaded mapping), both returning a checked :class:`TieringConfig`.

Reading is defensive, because a config is input (:mod:`tiering.config.yaml_lines`), and every
problem is a :class:`ConfigError` naming the file, the line, the key path, the bad value and what
is valid. The environment's ``TIERING_*`` overrides (:mod:`tiering.config.env`) apply before the
checks. Checks that need the model (block-sized budgets) run once the sections are read, and
settings that work but are likely mistakes warn with :class:`ConfigWarning`.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiering.backends.settings import format_size, unknown_key_message
from tiering.config.context import _Context
from tiering.config.env import _apply_env_overrides
from tiering.config.parse_sections import (
    _check_policy,
    _parse_replay,
    _parse_section,
    _parse_version,
)
from tiering.config.parse_tiers import _parse_tiers
from tiering.config.schema import _MINIMAL_EXAMPLE, _ROOT_KEYS, ConfigWarning, TieringConfig
from tiering.config.yaml_lines import (
    _copy_tree,
    _key_line,
    _line_of,
    _LineMap,
    _load_yaml,
    _read_text,
)
from tiering.errors import ConfigurationError
from tiering.managers.secondary_tier import WritePolicy


def load_config(
    path: str | os.PathLike[str], *, env: Mapping[str, str] | None = None
) -> TieringConfig:
    """Read and check the YAML config at ``path``; relative paths in it are taken from its
    directory. ``env`` (default ``os.environ``) supplies ``TIERING_*`` overrides.

    Raises :class:`ConfigError` naming the file, line, key path and bad value. Warns with
    :class:`ConfigWarning` about settings that work but are likely mistakes.
    """
    file_path = Path(path)
    source = str(file_path)
    data = _load_yaml(_read_text(file_path, source), source)
    return parse_config(data, source=source, base_dir=file_path.absolute().parent, env=env)


def parse_config(
    data: Mapping[str, Any] | None,
    *,
    source: str = "<config>",
    base_dir: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> TieringConfig:
    """Check a loaded config mapping (see :func:`load_config`); relative paths are taken from
    ``base_dir`` (default: the current directory). ``env`` defaults to ``os.environ``."""
    ctx = _Context(source, Path(base_dir) if base_dir is not None else Path.cwd())
    if data is None:
        raise ctx.error("", f"the config is empty; it needs at least {_MINIMAL_EXAMPLE}")
    if not isinstance(data, Mapping):
        raise ctx.error(
            "",
            f"the top level must be a mapping (keys {', '.join(_ROOT_KEYS)}), got "
            f"{type(data).__name__}: {data!r:.60}",
            _line_of(data),
        )
    tree = _copy_tree(data)
    _apply_env_overrides(tree, os.environ if env is None else env, ctx)
    return _parse_root(tree, ctx)


def _parse_root(data: _LineMap, ctx: _Context) -> TieringConfig:
    for key in data:
        if key not in _ROOT_KEYS:
            raise ctx.error(key, unknown_key_message(key, _ROOT_KEYS), _key_line(data, key))
    version = _parse_version(data, ctx)
    block_size_factor = _parse_block_size_factor(data, ctx)
    if "primary" not in data:
        raise ctx.error("primary", f"missing; give at least {_MINIMAL_EXAMPLE}", data.line)
    primary = _parse_section(ctx, data, "primary")
    _check_policy(ctx, primary.policy, "primary.policy", data.get("primary"))
    model = None if data.get("model") is None else _parse_section(ctx, data, "model")
    hashing = _parse_section(ctx, data, "hashing")
    config = TieringConfig(
        version=version,
        model=model,
        hashing=hashing,
        block_size_factor=block_size_factor,
        primary=primary,
        secondary_tiers=_parse_tiers(ctx, data),
        events=_parse_section(ctx, data, "events"),
        metrics=_parse_section(ctx, data, "metrics"),
        replay=_parse_replay(ctx, data),
        source=ctx.source,
    )
    if model is not None:
        _check_model(ctx, data, config)
    _warn_about_small_tiers(ctx, config)
    return config


def _parse_block_size_factor(data: _LineMap, ctx: _Context) -> int:
    block_size_factor = data.get("block_size_factor", 1)
    if (
        isinstance(block_size_factor, bool)
        or not isinstance(block_size_factor, int)
        or (block_size_factor < 1)
    ):
        raise ctx.error(
            "block_size_factor",
            f"{block_size_factor!r} is not valid: give an integer >= 1 (GPU blocks per "
            "offloaded block)",
            _key_line(data, "block_size_factor"),
        )
    return block_size_factor


def _check_model(ctx: _Context, data: _LineMap, config: TieringConfig) -> None:
    """Checks that need the model: the model shape, hash block size and block-sized budgets."""
    model = data["model"]
    try:
        shape = config.model_shape()
    except ConfigurationError as exc:
        raise ctx.error("model.shape", str(exc), _key_line(model, "shape")) from None
    try:
        config.kv_cache_spec()
    except ConfigurationError as exc:
        raise ctx.error(
            "hashing.hash_block_size", str(exc), _key_line(data.get("hashing"), "hash_block_size")
        ) from None
    block_bytes = config.block_bytes()
    budgets = [("primary.capacity", config.primary.capacity_bytes, data["primary"])]
    budgets += [
        (f"secondary_tiers[{i}].capacity", tier.capacity_bytes, data["secondary_tiers"][i])
        for i, tier in enumerate(config.secondary_tiers)
    ]
    for path, capacity_bytes, section in budgets:
        if capacity_bytes < block_bytes:
            raise ctx.error(
                path,
                f"{format_size(capacity_bytes)} holds no block of model {shape.name!r} "
                f"({format_size(block_bytes)} each); give at least {format_size(block_bytes)}",
                _key_line(section, "capacity"),
            )


def _warn_about_small_tiers(ctx: _Context, config: TieringConfig) -> None:
    stacklevel, frame = 1, sys._getframe()
    while frame.f_back is not None and _in_this_package(frame.f_globals.get("__name__")):
        frame, stacklevel = frame.f_back, stacklevel + 1  # point at the caller of tiering.config
    for index, tier in enumerate(config.secondary_tiers):
        if (
            tier.write_policy is WritePolicy.WRITE_THROUGH
            and tier.capacity_bytes < config.primary.capacity_bytes
        ):
            warnings.warn(
                f"{ctx.source}: secondary_tiers[{index}] ({tier.name!r}): capacity "
                f"{format_size(tier.capacity_bytes)} is smaller than the primary's "
                f"{format_size(config.primary.capacity_bytes)} under write_through, so it "
                "holds mostly blocks the primary holds too and will rarely serve a hit; make "
                "it larger or use write_back",
                ConfigWarning,
                stacklevel=stacklevel,
            )


_PACKAGE = __name__.rpartition(".")[0]  # tiering.config


def _in_this_package(module: object) -> bool:
    return module == _PACKAGE or (isinstance(module, str) and module.startswith(_PACKAGE + "."))
