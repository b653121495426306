"""The tiers an engine plugin (SGLang, LMCache) stores into, from the engine's own config.

An engine passes its plugin a flat mapping (SGLang's ``--hicache-storage-backend-extra-config``,
LMCache's ``extra_config``). tiering reads two keys of it:

``tiers``
    a list of tiers, each written as an entry of a tiering config's ``secondary_tiers``
    (``docs/config.md``): ``name``, ``type``, ``capacity``, ``path``, ``policy``, backend keys...
``tiering_config``
    or the path of a tiering YAML config whose ``secondary_tiers`` are used (its other
    sections do not apply to a plugin).

Each engine process (a TP/PP/CP rank, an LMCache worker) stores blocks of its own layout: a
directory-backed tier gets one subdirectory per layout (``scope``), so that ranks never share a
directory (a tier directory holds one layout; another layout's directory is refused at open).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tiering.config import TierConfig, load_config, parse_config
from tiering.errors import ConfigError

__all__ = ["scoped_tier_configs", "tier_configs_from_extra"]

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def tier_configs_from_extra(extra: Mapping[str, Any], where: str) -> tuple[TierConfig, ...]:
    """The tiers named by ``extra`` (``tiers`` or ``tiering_config``, see the module
    docstring); :class:`ConfigError` naming ``where`` and the bad key otherwise."""
    has_tiers, has_file = "tiers" in extra, "tiering_config" in extra
    if has_tiers == has_file:
        raise ConfigError(
            f"{where}: give exactly one of 'tiers' (a list of secondary_tiers entries) or "
            f"'tiering_config' (a tiering YAML path); got {sorted(extra)}"
        )
    if has_file:
        config = load_config(str(extra["tiering_config"]))
    else:
        tiers = extra["tiers"]
        if not isinstance(tiers, Sequence) or isinstance(tiers, str | bytes) or not tiers:
            raise ConfigError(f"{where}: 'tiers' must be a non-empty list, got {tiers!r:.80}")
        tree = {"version": 1, "primary": {"capacity": "1MiB"}, "secondary_tiers": list(tiers)}
        config = parse_config(tree, source=f"{where} tiers")
    if not config.secondary_tiers:
        raise ConfigError(f"{where}: the tiering config names no secondary_tiers")
    return config.secondary_tiers


def scoped_tier_configs(tiers: Sequence[TierConfig], scope: str) -> tuple[TierConfig, ...]:
    """``tiers`` with each directory moved to its ``scope`` subdirectory (one per rank/pool)."""
    safe = _SAFE.sub("-", scope).strip("-") or "default"
    return tuple(
        dataclasses.replace(t, path=t.path / safe) if t.path is not None else t for t in tiers
    )
