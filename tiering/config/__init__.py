"""The YAML configuration: a file, checked into frozen objects, built into a manager.

:func:`load_config` reads a YAML file (``docs/config.md`` documents every key) and
:func:`parse_config` checks an already-loaded mapping; both return a :class:`TieringConfig`.
:func:`build_manager` turns one into a running :class:`TieringOffloadingManager`.

Reading is defensive, because a config is input: only plain YAML is read (a
:class:`yaml.SafeLoader` that also refuses aliases, duplicate keys and deep nesting), files
over :data:`MAX_CONFIG_BYTES` are refused, and every problem is a :class:`ConfigError` naming the
file, the line when known, the dotted key path (``secondary_tiers[1].capacity``), the bad value
and what is valid. Parsing has no side effects: tier directories are only checked to be
creatable, and are created by :func:`build_manager`.

Environment variables ``TIERING_<PATH>`` override keys: the dotted path upper-cased, with
``__`` between levels and a tier's name in place of its index
(``TIERING_SECONDARY_TIERS__NVME__CAPACITY=100GiB``). Values are read as YAML scalars.

The package, a module per idea:

* :mod:`~tiering.config.schema`: the frozen objects (:class:`TieringConfig` and its sections);
* :mod:`~tiering.config.yaml_lines`: the strict YAML loader, which keeps every key's line;
* :mod:`~tiering.config.parse` (the entry points), :mod:`~tiering.config.parse_sections`,
  :mod:`~tiering.config.parse_tiers` and :mod:`~tiering.config.tier_paths`: the checks, with
  :mod:`~tiering.config.context` wording their problems;
* :mod:`~tiering.config.env`: the ``TIERING_*`` overrides;
* :mod:`~tiering.config.json_schema`: the config's JSON Schema;
* :mod:`~tiering.config.plugins`: importing the plugins a config names;
* :mod:`~tiering.config.block_layout`, :mod:`~tiering.config.build`,
  :mod:`~tiering.config.directories` and :mod:`~tiering.config.wipe`: a config's block layout,
  its tiers built, their directories examined, wiped;
* :mod:`~tiering.config.runtime`: the CPU pool and the manager.

Only :mod:`~tiering.config.runtime` imports torch, and it is loaded on first use of
:func:`build_pool` or :func:`build_manager`: reading, checking and printing the schema of a
config (``tiering config check``, ``tiering config schema``) import no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tiering.config.block_layout import BlockLayout, layout_for_config
from tiering.config.build import build_backend, build_tier
from tiering.config.directories import TierDirectoryFinding, check_tier_directories
from tiering.config.json_schema import config_json_schema
from tiering.config.parse import load_config, parse_config
from tiering.config.plugins import resolve_plugins
from tiering.config.schema import (
    BUILTIN_TRACES,
    CONFIG_VERSION,
    ENV_PREFIX,
    IGNORED_ENV_VARS,
    MAX_CONFIG_BYTES,
    SCALES,
    WORKLOAD_TRACES,
    ConfigWarning,
    EventsConfig,
    HashingConfig,
    MetricsConfig,
    ModelConfig,
    PluginSettings,
    PrimaryConfig,
    ReplaySettings,
    TierConfig,
    TieringConfig,
)
from tiering.config.schema import MAX_NESTING_DEPTH as MAX_NESTING_DEPTH  # not in __all__
from tiering.config.schema import _TierKeys as _TierKeys  # the tests read its fields
from tiering.config.wipe import wipe_tier, wipe_tiers

if TYPE_CHECKING:
    from tiering.config.runtime import build_manager, build_pool

__all__ = [
    "BUILTIN_TRACES",
    "WORKLOAD_TRACES",
    "CONFIG_VERSION",
    "ENV_PREFIX",
    "IGNORED_ENV_VARS",
    "MAX_CONFIG_BYTES",
    "BlockLayout",
    "ConfigWarning",
    "EventsConfig",
    "HashingConfig",
    "MetricsConfig",
    "ModelConfig",
    "PluginSettings",
    "PrimaryConfig",
    "ReplaySettings",
    "SCALES",
    "TierConfig",
    "TierDirectoryFinding",
    "TieringConfig",
    "build_backend",
    "build_manager",
    "build_pool",
    "build_tier",
    "check_tier_directories",
    "config_json_schema",
    "layout_for_config",
    "load_config",
    "parse_config",
    "resolve_plugins",
    "wipe_tier",
    "wipe_tiers",
]

# The names whose module imports torch: loaded on first use (then kept in this module).
_LAZY = {"build_manager": "tiering.config.runtime", "build_pool": "tiering.config.runtime"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
