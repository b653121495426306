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
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from tiering.backends.base import StorageBackend
from tiering.backends.ownership import (
    LayoutMismatchError,
    LayoutRecord,
    Removal,
    TierDirectoryError,
    check_backend,
    examine_directory,
    foreign_directory_error,
    remove_owned_files,
)
from tiering.backends.registry import (
    BUILTIN_BACKENDS,
    GENERIC_TIER_KEYS,
    NAME_PATTERN,
    BackendEntry,
    check_backend_type,
    get_backend,
)
from tiering.backends.settings import (
    SIZE_JSON_SCHEMA,
    NoSettings,
    SettingsProblem,
    field_json_schema,
    format_size,
    parse_settings,
    settings_fields,
    unknown_key_message,
)
from tiering.backends.tier_lock import hold_directory_locks
from tiering.core.block_format import make_layout_fingerprint
from tiering.core.groups import KVCacheSpec
from tiering.core.identity import layout_identity
from tiering.errors import ConfigError, ConfigurationError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.pool import CPUBlockPool
from tiering.managers.secondary_tier import SecondaryTier, WritePolicy
from tiering.managers.shared_tier import SharedTier
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.model.hf_model import cached_model_shape
from tiering.model.identity import ModelIdentity, model_identity, weights_id_problem
from tiering.model.shapes import MODEL_SHAPES, ModelShape, get_model_shape
from tiering.policies import get_policy_class
from tiering.policies.registry import check_policy_name
from tiering.transfer import CopyBackend

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

CONFIG_VERSION = 1
MAX_CONFIG_BYTES = 1 << 20  # a config is a few KB; anything near this is not a config
MAX_NESTING_DEPTH = 32  # a config nests 4 deep; this bounds the YAML composer's recursion
ENV_PREFIX = "TIERING_"
#: ``TIERING_*`` variables that are not overrides (the CLI's own settings).
IGNORED_ENV_VARS = frozenset({"TIERING_CONFIG"})
# The replay section's vocabulary. The replay lab (tiering.replay) builds its traces from these
# names; config reads them here so that checking a config never imports the lab.
BUILTIN_TRACES = ("chat", "rag", "agent", "mixed")
#: Realistic block-level traces (tiering.replay.workloads).
WORKLOAD_TRACES = ("conversation", "toolagent", "documents", "production")
SCALES = ("tiny", "demo", "large")


class ConfigWarning(UserWarning):
    """A config that works but is probably not what was meant (e.g. a useless tier)."""


# -- the frozen objects ------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """What the blocks are: gives the block size in bytes and the layout fingerprint.

    Either ``shape`` (a built-in preset, one rank's geometry) or ``config_json`` (a model's
    Hugging Face config.json, split over ``world_size`` ranks; see :mod:`tiering.model.hf_model`).
    """

    shape: str | None = field(
        default=None, metadata={"doc": "a built-in model shape name (tiering.model.shapes)"}
    )
    config_json: Path | None = field(
        default=None,
        metadata={"doc": "a model's Hugging Face config.json (instead of shape)"},
    )
    name: str | None = field(
        default=None,
        metadata={"doc": "config_json: the model's name in the layout fingerprint"},
    )
    world_size: int = field(
        default=1, metadata={"min": 1, "doc": "ranks (tensor-parallel workers) per block"}
    )
    weights_id: str | None = field(
        default=None,
        metadata={
            "doc": "names the checkpoint's weights in the layout fingerprint (e.g. a commit "
            "hash); default: derived from the weight files beside config_json"
        },
    )

    def __post_init__(self) -> None:
        shapes = ", ".join(sorted(MODEL_SHAPES))
        if self.shape is None and self.config_json is None:
            raise SettingsProblem(
                "shape",
                f"missing; give shape (one of {shapes}) or config_json (a model's config.json)",
            )
        if self.shape is not None and self.config_json is not None:
            raise SettingsProblem("config_json", "give either shape or config_json, not both")
        if self.name is not None and self.config_json is None:
            raise SettingsProblem("name", "only a config_json model takes a name")
        if self.weights_id is not None and (problem := weights_id_problem(self.weights_id)):
            raise SettingsProblem("weights_id", problem)
        if self.config_json is not None:
            try:
                self.model_shape()
            except ConfigurationError as exc:
                raise SettingsProblem("config_json", str(exc)) from None

    def model_shape(self) -> ModelShape:
        if self.config_json is None:
            assert self.shape is not None
            return get_model_shape(self.shape)
        return cached_model_shape(self.config_json, world_size=self.world_size, name=self.name)

    def model_identity(self) -> ModelIdentity:
        """The model's name and what names its weights (:mod:`tiering.model.identity`)."""
        return model_identity(
            self.model_shape().name, config_json=self.config_json, weights_id=self.weights_id
        )


@dataclass(frozen=True)
class HashingConfig:
    hash_block_size: int = field(
        default=16, metadata={"min": 1, "doc": "tokens per hash block; divides the block size"}
    )
    algorithm: Literal["sha256", "xxh3_128"] = field(
        default="sha256", metadata={"doc": "prefix hash algorithm"}
    )


@dataclass(frozen=True)
class PrimaryConfig:
    """The CPU tier."""

    capacity_bytes: int = field(metadata={"key": "capacity", "doc": "byte budget of the CPU pool"})
    policy: str = field(
        default="lru", metadata={"doc": "eviction policy: a registered name or 'module:Class'"}
    )
    store_threshold: int = field(
        default=1,
        metadata={
            "min": 1,
            "doc": "offers to store a block needs before it is stored (vLLM's store_threshold; "
            "1 stores every offer)",
        },
    )
    copy_backend: CopyBackend = field(
        default="auto",
        metadata={"doc": "how workers copy KV blocks to and from the pool (tiering.transfer)"},
    )


@dataclass(frozen=True)
class PluginSettings:
    """The backend keys of a tier whose backend is a plugin, as written in the file.

    Checking a config runs no plugin code, so a plugin's keys wait here until the plugin is
    imported (:func:`resolve_plugins`, which :func:`build_manager` calls) and checked against
    its settings class then. ``key_lines`` are the keys' lines in the file, for messages.
    """

    values: dict[str, Any]
    base_dir: Path
    key_lines: dict[str, int] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class TierConfig:
    """One secondary tier. ``settings`` is an instance of its backend's settings class, or
    :class:`PluginSettings` for a plugin backend not yet imported (see :func:`resolve_plugins`).
    """

    name: str
    type: str
    capacity_bytes: int
    path: Path | None
    policy: str = "lru"
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    selective_min_lookups: int = 2
    max_inflight_jobs: int = 4
    quarantine_seconds: float = 10.0
    io_timeout_s: float = 30.0
    existence_cache_seconds: float | None = None  # shared tiers only (None: SharedTier's default)
    existence_cache_max_keys: int | None = None
    settings: object = field(default_factory=NoSettings)

    @property
    def env_name(self) -> str:
        """The tier's part of override variable names (``TIERING_SECONDARY_TIERS__<this>__...``)."""
        return _env_name(self.name)


@dataclass(frozen=True)
class _TierKeys:
    """The generic keys of a tier (``name``, ``type`` and ``path`` are checked by hand)."""

    capacity_bytes: int = field(
        metadata={"key": "capacity", "doc": "byte budget of the tier's storage"}
    )
    policy: str = field(
        default="lru", metadata={"doc": "eviction policy: a registered name or 'module:Class'"}
    )
    write_policy: Literal["write_through", "write_back", "write_through_selective"] = field(
        default="write_through", metadata={"doc": "when blocks of the primary reach this tier"}
    )
    selective_min_lookups: int = field(
        default=2,
        metadata={"min": 1, "doc": "write_through_selective: lookups a key needs to be written"},
    )
    max_inflight_jobs: int = field(
        default=4, metadata={"min": 1, "doc": "jobs in flight; over it stores are shed"}
    )
    quarantine_seconds: float = field(
        default=10.0, metadata={"min": 0.0, "doc": "how long a failed key counts as absent"}
    )
    io_timeout_s: float = field(
        default=30.0,
        metadata={
            "min": 0.001,
            "max": 86400.0,
            "doc": "deadline of each store/promotion job; past it the job fails, its keys miss "
            "and the tier is stalled until its I/O returns",
        },
    )
    existence_cache_seconds: float | None = field(
        default=None,
        metadata={
            "min": 0.001,
            "doc": "shared tiers: how long an answer of the store is trusted (default 2)",
        },
    )
    existence_cache_max_keys: int | None = field(
        default=None,
        metadata={"min": 1, "doc": "shared tiers: answers cached at most (default 65536)"},
    )


@dataclass(frozen=True)
class EventsConfig:
    enabled: bool = field(default=False, metadata={"doc": "record stored/removed block events"})
    endpoint: str | None = field(
        default=None,
        metadata={
            "doc": "ZMQ endpoint to publish KV events on (tcp://127.0.0.1:5557 binds loopback); "
            "null: none"
        },
    )
    replay_endpoint: str | None = field(
        default=None, metadata={"doc": "ZMQ endpoint serving missed batches to late subscribers"}
    )
    topic: str = field(default="", metadata={"doc": "topic of the published batches"})
    buffer_steps: int = field(
        default=10_000, metadata={"min": 0, "doc": "batches kept for the replay endpoint"}
    )
    hash_format: Literal["int", "bytes"] = field(
        default="int", metadata={"doc": "block hashes as vLLM's 64-bit int or the raw bytes"}
    )

    def __post_init__(self) -> None:
        if self.replay_endpoint is not None and self.endpoint is None:
            raise SettingsProblem("replay_endpoint", "needs an endpoint to publish on")
        if self.endpoint is not None and not self.enabled:
            raise SettingsProblem(
                "endpoint", "publishing events needs them recorded: set enabled: true"
            )


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = field(default=True, metadata={"doc": "collect per-tier counters"})
    port: int | None = field(
        default=None,
        metadata={"min": 0, "max": 65535, "doc": "serve Prometheus metrics on this port (0: any)"},
    )
    address: str = field(
        default="127.0.0.1", metadata={"doc": "address the metrics endpoint listens on"}
    )


@dataclass(frozen=True)
class ReplaySettings:
    """Defaults of ``tiering replay`` (its command-line options override them)."""

    trace: str = field(
        default="mixed", metadata={"doc": "a built-in trace name or a path to a .jsonl file"}
    )
    scale: str = field(default="demo", metadata={"doc": "scale of a built-in trace"})
    seed: int = field(default=0, metadata={"min": 0, "doc": "seed of a built-in trace"})
    engine_blocks: int = field(
        default=1024, metadata={"min": 2, "doc": "engine KV-cache blocks to allocate"}
    )
    max_requests: int | None = field(
        default=None, metadata={"min": 1, "doc": "replay only the first N requests"}
    )
    verify: bool = field(default=True, metadata={"doc": "check every loaded block's bytes"})

    def __post_init__(self) -> None:
        if self.scale not in SCALES:
            raise SettingsProblem(
                "scale", f"{self.scale!r} is not a trace scale; valid: {', '.join(SCALES)}"
            )


@dataclass(frozen=True)
class TieringConfig:
    """A checked configuration. ``source`` names where it came from (the file path)."""

    version: int
    model: ModelConfig | None
    hashing: HashingConfig
    block_size_factor: int
    primary: PrimaryConfig
    secondary_tiers: tuple[TierConfig, ...]
    events: EventsConfig
    metrics: MetricsConfig
    replay: ReplaySettings
    source: str = "<config>"

    def require_model(self) -> ModelConfig:
        if self.model is None:
            raise ConfigError(
                f"{self.source}: model: missing; give model.shape (one of "
                f"{', '.join(sorted(MODEL_SHAPES))}) or model.config_json, or pass block_bytes "
                "and fingerprint"
            )
        return self.model

    def model_shape(self) -> ModelShape:
        return self.require_model().model_shape()

    def kv_cache_spec(self) -> KVCacheSpec:
        """The model's KV-cache groups with this config's hashing and block size factor."""
        return self.model_shape().kv_cache_spec(
            self.hashing.hash_block_size, self.block_size_factor
        )

    def block_bytes_per_rank(self) -> int:
        """Bytes of one offloaded block on one rank (as ``ModelShape.allocate`` lays it out)."""
        shape = self.model_shape()
        return shape.layers_per_position * shape.page_bytes * self.block_size_factor

    def block_bytes(self) -> int:
        """Bytes of one offloaded block over all ranks: one pool row, what every tier stores."""
        return self.block_bytes_per_rank() * self.require_model().world_size

    def layout_description(self) -> dict[str, object]:
        """What a stored block's bytes mean (:func:`tiering.core.identity.layout_identity`)."""
        shape = self.model_shape()
        return layout_identity(
            self.kv_cache_spec(),
            block_bytes=self.block_bytes(),
            dtype=shape.dtype,
            world_size=self.require_model().world_size,
            hash_algorithm=self.hashing.algorithm,
            model=shape.name,
            weights=self.require_model().model_identity().fingerprint_part(),
        )

    def fingerprint(self) -> bytes:
        """The 16-byte layout fingerprint written in (and checked on) every stored block."""
        return make_layout_fingerprint(self.layout_description())

    def num_cpu_blocks(self, block_bytes: int | None = None) -> int:
        """Blocks the primary's capacity holds; :class:`ConfigError` if none."""
        if block_bytes is None:
            block_bytes = self.block_bytes()
        num_blocks = self.primary.capacity_bytes // block_bytes
        if num_blocks < 1:
            raise ConfigError(
                f"{self.source}: primary.capacity: {format_size(self.primary.capacity_bytes)} "
                f"holds no block of {block_bytes} bytes; give at least {format_size(block_bytes)}"
            )
        return num_blocks

    def tier(self, name: str) -> TierConfig:
        for tier in self.secondary_tiers:
            if tier.name == name:
                return tier
        names = ", ".join(t.name for t in self.secondary_tiers) or "none"
        raise ConfigError(f"{self.source}: no tier named {name!r}; tiers: {names}")

    def as_dict(self) -> dict[str, Any]:
        """A JSON-serializable view (sizes in bytes, paths as strings, settings as mappings)."""
        out = _jsonable(self)
        assert isinstance(out, dict)
        return out


def _jsonable(value: object) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    if isinstance(value, WritePolicy):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)  # a plugin's raw value YAML gave another type (a date)


# -- reading YAML --------------------------------------------------------------------------------


class _LineMap(dict[str, Any]):
    """A mapping read from YAML, with the (1-based) line of the mapping and of each key."""

    def __init__(self, line: int | None = None) -> None:
        super().__init__()
        self.line = line
        self.key_lines: dict[str, int] = {}


class _LineList(list[Any]):
    """A sequence read from YAML, with the line of the sequence and of each item."""

    def __init__(self, line: int | None = None) -> None:
        super().__init__()
        self.line = line
        self.item_lines: list[int] = []


def _rejected(problem: str, mark: yaml.Mark | None) -> yaml.MarkedYAMLError:
    return yaml.MarkedYAMLError(problem=problem, problem_mark=mark)


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that also refuses aliases, duplicate keys, non-string keys and deep nesting.

    Aliases are refused outright (not bounded): a config never needs them, and refusing them
    makes the size of the loaded data linear in the file's size ("billion laughs").
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            raise _rejected(
                "YAML aliases (*name) are not allowed in a tiering config; write the value out",
                self.peek_event().start_mark,
            )
        self._depth += 1
        try:
            if self._depth > MAX_NESTING_DEPTH:
                raise _rejected(
                    f"nested deeper than {MAX_NESTING_DEPTH} levels", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_map(loader: yaml.SafeLoader, node: yaml.MappingNode) -> _LineMap:
    data = _LineMap(node.start_mark.line + 1)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str):
            raise _rejected(
                f"keys must be strings, got {type(key).__name__} {key!r}", key_node.start_mark
            )
        if key in data:
            raise _rejected(
                f"duplicate key {key!r} (first on line {data.key_lines[key]})", key_node.start_mark
            )
        data[key] = loader.construct_object(value_node, deep=True)
        data.key_lines[key] = line
    return data


def _construct_seq(loader: yaml.SafeLoader, node: yaml.SequenceNode) -> _LineList:
    data = _LineList(node.start_mark.line + 1)
    for item in node.value:
        data.append(loader.construct_object(item, deep=True))
        data.item_lines.append(item.start_mark.line + 1)
    return data


_StrictLoader.add_constructor("tag:yaml.org,2002:map", _construct_map)
_StrictLoader.add_constructor("tag:yaml.org,2002:seq", _construct_seq)


def _load_yaml(text: str, source: str) -> Any:
    """The one YAML document in ``text``, read with :class:`_StrictLoader`."""
    try:
        # The reader checks the text in the constructor: unprintable characters raise there.
        loader = _StrictLoader(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid config YAML: {exc}") from None
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = " ".join(p for p in (exc.context, exc.problem) if p) or str(exc)
        if "constructor for the tag" in problem:
            problem += "; only plain YAML (mappings, lists, strings, numbers, booleans) is allowed"
        raise ConfigError(f"{where}: invalid config YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid config YAML: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # PyYAML's constructors raise these for some scalars ('!!int x', '2023-02-30').
        raise ConfigError(
            f"{source}: invalid config YAML: {type(exc).__name__}: {exc}; write the value as "
            "a plain number or a quoted string"
        ) from None
    finally:
        loader.dispose()


def _read_text(path: Path, source: str) -> str:
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the config: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{source}: the file is over {format_size(MAX_CONFIG_BYTES)} (the largest config "
            "read); a tiering config is a few KB"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start})") from None


# -- entry points ------------------------------------------------------------------------------


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


_ROOT_KEYS = (
    "version",
    "model",
    "hashing",
    "block_size_factor",
    "primary",
    "secondary_tiers",
    "events",
    "metrics",
    "replay",
)
_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "hashing": HashingConfig,
    "primary": PrimaryConfig,
    "events": EventsConfig,
    "metrics": MetricsConfig,
    "replay": ReplaySettings,
}
_SCALAR_KEYS = ("version", "block_size_factor")
_MINIMAL_EXAMPLE = "'version: 1' and 'primary: {capacity: 4GiB}'"


@dataclass
class _Context:
    source: str
    base_dir: Path
    env_origins: dict[str, str] = field(default_factory=dict)  # key path -> variable

    def error(self, path: str, problem: str, line: int | None = None) -> ConfigError:
        variable = self.env_origins.get(path)
        where = f"{self.source}:{line}" if line and not variable else self.source
        text = f"{where}: {path}: {problem}" if path else f"{where}: {problem}"
        if variable:
            text += f" (set by environment variable {variable})"
        return ConfigError(text)


def _line_of(value: object) -> int | None:
    return getattr(value, "line", None)


def _key_line(mapping: object, key: str | None) -> int | None:
    lines = getattr(mapping, "key_lines", {})
    return lines.get(key, _line_of(mapping)) if key else _line_of(mapping)


def _copy_tree(value: Any) -> Any:
    """A mutable copy (overrides are applied to it), keeping line numbers."""
    if isinstance(value, Mapping):
        out = _LineMap(_line_of(value))
        for key, item in value.items():
            out[key] = _copy_tree(item)
        out.key_lines.update(getattr(value, "key_lines", {}))
        return out
    if isinstance(value, list | tuple):
        items = _LineList(_line_of(value))
        items.extend(_copy_tree(v) for v in value)
        items.item_lines.extend(getattr(value, "item_lines", []))
        return items
    return value


# -- environment overrides ---------------------------------------------------------------------


def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")


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


# -- checking ----------------------------------------------------------------------------------


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


def _parse_root(data: _LineMap, ctx: _Context) -> TieringConfig:
    for key in data:
        if key not in _ROOT_KEYS:
            raise ctx.error(key, unknown_key_message(key, _ROOT_KEYS), _key_line(data, key))
    version = _parse_version(data, ctx)
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
        tiers.append(tier)
    return tuple(tiers)


def _parse_tier(ctx: _Context, item: object, path: str, line: int | None) -> TierConfig:
    if not isinstance(item, Mapping):
        raise ctx.error(
            path, f"a tier must be a mapping (type, capacity, ...), got {item!r:.60}", line
        )
    if "type" not in item:
        raise ctx.error(
            f"{path}.type",
            f"missing; give a backend name ({', '.join(BUILTIN_BACKENDS)}, ...) or 'module:Class'",
            line,
        )
    try:
        entry = check_backend_type(item["type"])  # None: a plugin, imported when it is built
    except ConfigurationError as exc:
        raise ctx.error(f"{path}.type", str(exc), _key_line(item, "type")) from None
    name = _parse_tier_name(ctx, item, path)
    generic = {k: v for k, v in item.items() if k in _TIER_KEYS}
    keys: _TierKeys = _parse_mapping(ctx, _with_lines(item, generic), path, _TierKeys, line)
    _check_policy(ctx, keys.policy, f"{path}.policy", item)
    backend_keys = {k: v for k, v in item.items() if k not in GENERIC_TIER_KEYS}
    settings: object
    if entry is None:
        lines = getattr(item, "key_lines", {})
        settings = PluginSettings(
            dict(backend_keys), ctx.base_dir, {k: lines[k] for k in backend_keys if k in lines}
        )
    else:
        settings = _parse_mapping(
            ctx,
            _with_lines(item, backend_keys),
            path,
            entry.settings_class,
            line,
            other_keys=GENERIC_TIER_KEYS,
        )
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
        settings=settings,
    )


_TIER_KEYS = frozenset(f.key for f in settings_fields(_TierKeys))


def _with_lines(original: Mapping[str, Any], subset: dict[str, Any]) -> _LineMap:
    out = _LineMap(_line_of(original))
    out.update(subset)
    lines = getattr(original, "key_lines", {})
    out.key_lines.update({k: lines[k] for k in subset if k in lines})
    return out


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


def _parse_tier_path(
    ctx: _Context, item: Mapping[str, Any], path: str, entry: BackendEntry | None
) -> Path | None:
    """The tier's directory; for a plugin (``entry`` None) whether it needs one is checked when
    it is imported."""
    line = _key_line(item, "path")
    if entry is not None and not entry.accepts_path:
        if "path" in item:
            raise ctx.error(f"{path}.path", f"the {entry.name!r} backend takes no path", line)
        return None
    raw = item.get("path")
    if raw is None:
        if entry is None:
            return None
        raise ctx.error(
            f"{path}.path",
            f"missing; the {entry.name!r} backend keeps its data in a directory: give one "
            f"(relative paths are taken from {str(ctx.base_dir)!r})",
            _line_of(item),
        )
    if not isinstance(raw, str) or not raw.strip():
        raise ctx.error(f"{path}.path", f"{raw!r} is not valid: give a directory path", line)
    problem = _path_text_problem(raw)
    if problem:
        raise ctx.error(f"{path}.path", f"{raw!r:.200}: {problem}", line)
    try:
        expanded = Path(raw).expanduser()
    except RuntimeError as exc:  # '~user' of an unknown user, or no home directory
        raise ctx.error(f"{path}.path", f"{raw!r}: cannot expand '~': {exc}", line) from None
    directory = Path(os.path.normpath(ctx.base_dir / expanded))
    problem = _path_text_problem(str(directory)) or _directory_problem(directory)
    if problem:
        raise ctx.error(f"{path}.path", f"{raw!r:.200}: {problem}", line)
    return directory


# Linux's limits: a file name of at most NAME_MAX bytes, a path of fewer than PATH_MAX bytes.
_NAME_MAX_BYTES = 255
_PATH_MAX_BYTES = 4096


def _path_text_problem(text: str) -> str | None:
    """Why ``text`` cannot name a file on this system at all (None if it can)."""
    if "\0" in text:
        return "a path cannot contain a NUL character"
    try:
        encoded = os.fsencode(text)
    except UnicodeEncodeError as exc:
        return f"cannot be encoded as a file name ({exc.reason} at character {exc.start})"
    if len(encoded) >= _PATH_MAX_BYTES:
        return f"the path is {len(encoded)} bytes long; the longest is {_PATH_MAX_BYTES - 1}"
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > _NAME_MAX_BYTES:
        return (
            f"a part of the path is {len(longest)} bytes long; a file name has at most "
            f"{_NAME_MAX_BYTES}"
        )
    return None


def _directory_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot be used or created by this user (None if it can)."""
    try:
        if directory.exists():
            if not directory.is_dir():
                return f"{str(directory)!r} exists and is not a directory"
            if not os.access(directory, os.W_OK | os.X_OK):
                return f"directory {str(directory)!r} is not writable by this user"
            return None
        parent = directory
        while not parent.exists():
            if os.path.lexists(parent):
                return f"cannot create {str(directory)!r}: {str(parent)!r} is a broken symlink"
            parent = parent.parent
    except OSError as exc:
        return f"cannot inspect {str(directory)!r}: {exc.strerror or exc}"
    if not parent.is_dir():
        return f"cannot create {str(directory)!r}: {str(parent)!r} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {str(directory)!r}: {str(parent)!r} is not writable by this user"
    return None


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
    while frame.f_back is not None and frame.f_globals.get("__name__") == __name__:
        frame, stacklevel = frame.f_back, stacklevel + 1  # point at the caller of this module
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


# -- JSON schema -------------------------------------------------------------------------------


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


# -- building ----------------------------------------------------------------------------------


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


def build_backend(
    tier: TierConfig,
    *,
    block_bytes: int,
    fingerprint: bytes,
    layout_description: Mapping[str, Any] | None = None,
    read_only: bool = False,
) -> StorageBackend:
    """The tier's backend, constructed but not opened: validates its settings, does no I/O
    (the backend creates its directory when it opens). :class:`ConfigError` if it rejects them.
    A plugin backend is imported here (see :func:`resolve_plugins`). ``read_only`` opens
    nothing for writing (``tiering inspect``); a backend without that mode is a ConfigError."""
    return _create_backend(
        tier,
        block_bytes=block_bytes,
        fingerprint=fingerprint,
        layout_description=layout_description,
        read_only=read_only,
    )


def build_tier(
    tier: TierConfig,
    *,
    block_bytes: int,
    fingerprint: bytes,
    layout_description: Mapping[str, Any] | None = None,
) -> SecondaryTier:
    """A :class:`SecondaryTier` over :func:`build_backend`'s backend (a
    :class:`~tiering.managers.shared_tier.SharedTier` if the backend is shared);
    :class:`ConfigError` if
    the tier's settings cannot work with it."""
    backend = build_backend(
        tier,
        block_bytes=block_bytes,
        fingerprint=fingerprint,
        layout_description=layout_description,
    )
    return _wrap_tier(tier, backend, f"tier {tier.name!r} ({tier.type})")


def wipe_tier(tier: TierConfig) -> Removal:
    """Delete tiering's own files from the tier's directory, then the directory if that left it
    empty; an operator's files stay. Raises :class:`ConfigError` (nothing deleted) if the
    directory is not tiering's, holds another backend's tier, or holds an entry named like
    tiering's that is not a regular file, and :class:`~tiering.backends.tier_lock.TierInUseError`
    (nothing deleted) if a live process holds the tier open. A plugin backend is imported (its
    class says which files are its own)."""
    return wipe_tiers([tier])[0]


def wipe_tiers(tiers: Sequence[TierConfig]) -> list[Removal]:
    """:func:`wipe_tier` for each of ``tiers``, all or none: every tier's lock (the one its
    backend holds while open) is taken and every directory examined first, so a refusal leaves
    every tier as it was; the locks are held until the files are gone."""
    plans: list[type[StorageBackend] | None] = []
    for tier in tiers:
        if tier.path is None:
            plans.append(None)
            continue
        try:
            plans.append(get_backend(tier.type).cls)
        except ConfigurationError as exc:
            raise ConfigError(f"tier {tier.name!r}: {exc}") from exc
    with contextlib.ExitStack() as locks:
        for tier, cls in zip(tiers, plans, strict=True):
            if cls is not None and tier.path is not None:
                locks.enter_context(hold_directory_locks(tier.path, cls.lock_files, tier=tier.name))
        for tier, cls in zip(tiers, plans, strict=True):
            if cls is None or tier.path is None:
                continue
            try:
                found = examine_directory(
                    tier.path, owned_files=cls.owned_files, recognizes=cls.recognizes_directory
                )
                if found.state == "foreign":
                    raise foreign_directory_error(found, what="the tier directory")
                check_backend(found, cls.name)
            except TierDirectoryError as exc:
                raise ConfigError(f"tier {tier.name!r}: {exc}") from exc
        removals = []
        for tier, backend_class in zip(tiers, plans, strict=True):
            if backend_class is None or tier.path is None:
                removals.append(Removal((), (), False))
                continue
            try:
                removals.append(
                    remove_owned_files(
                        tier.path,
                        backend=backend_class.name,
                        owned_files=backend_class.owned_files,
                        recognizes=backend_class.recognizes_directory,
                    )
                )
            except TierDirectoryError as exc:  # changed since it was examined
                raise ConfigError(f"tier {tier.name!r}: {exc}") from exc
    return removals


# -- tier directories, before anything opens ----------------------------------------------------


@dataclass(frozen=True)
class TierDirectoryFinding:
    """Something :func:`check_tier_directories` found in a tier's directory.

    ``severity`` is ``"error"`` (the tier will not open: :func:`build_manager` refuses the
    config), ``"warning"`` (it will open after acting as configured: old data set aside or
    wiped) or ``"note"``.
    """

    tier: str
    path: Path
    severity: Literal["error", "warning", "note"]
    message: str


def check_tier_directories(
    config: TieringConfig, layout: BlockLayout | None = None
) -> list[TierDirectoryFinding]:
    """What each built-in tier will meet in its directory when it opens; changes nothing.

    Reads each directory's listing and tiering marker (:mod:`tiering.backends.ownership`): a
    directory that is not tiering's, one holding another backend's tier, and one holding
    blocks of another layout than ``layout`` (default: the config's model, if it has one) are
    reported, with what the tier's ``on_layout_mismatch`` will do. Plugin tiers are skipped
    (checking a config imports no plugin).
    """
    if layout is None and config.model is not None:
        layout = layout_for_config(config)
    findings = []
    for index, tier in enumerate(config.secondary_tiers):
        if tier.path is None or isinstance(tier.settings, PluginSettings):
            continue
        where = f"{config.source}: secondary_tiers[{index}] ({tier.name!r})"
        for severity, message in _directory_findings(tier, layout):
            findings.append(
                TierDirectoryFinding(tier.name, tier.path, severity, f"{where}: {message}")
            )
    return findings


def _directory_findings(
    tier: TierConfig, layout: BlockLayout | None
) -> list[tuple[Literal["error", "warning", "note"], str]]:
    assert tier.path is not None
    cls = get_backend(tier.type).cls  # a built-in or registered class: no plugin import
    try:
        found = examine_directory(
            tier.path, owned_files=cls.owned_files, recognizes=cls.recognizes_directory
        )
        if found.state == "foreign":
            raise foreign_directory_error(found, what="the tier directory")
        check_backend(found, cls.name)
    except TierDirectoryError as exc:
        return [("error", str(exc))]
    if found.state == "damaged_marker":
        return [
            (
                "note",
                f"the tiering marker in {str(tier.path)!r} is unreadable; the tier "
                "will check its own records when it opens, and rewrite the marker",
            )
        ]
    if (
        found.marker is None
        or not found.holds_data
        or layout is None
        or found.marker.layout.matches(layout.record())
    ):
        return []
    mismatch = LayoutMismatchError(
        tier.path, found.marker.layout, layout.record(), what="the tier directory"
    )
    policy = getattr(tier.settings, "on_layout_mismatch", "refuse")
    if policy == "refuse":
        return [("error", str(mismatch))]
    action = {
        "set_aside": "its files will be moved to a sibling folder when it opens",
        "wipe": "tiering's files there will be deleted when it opens",
    }[policy]
    return [
        (
            "warning",
            f"{str(tier.path)!r} holds blocks of another layout ("
            f"{found.marker.layout.difference(layout.record())}); on_layout_mismatch: {policy}: "
            f"{action}",
        )
    ]


@dataclass(frozen=True)
class BlockLayout:
    """What every tier of a config stores: blocks of ``block_bytes`` under ``fingerprint``."""

    block_bytes: int  # one offloaded block over all ranks (one CPU pool row)
    fingerprint: bytes
    description: Mapping[str, Any] | None = None  # what the fingerprint stands for

    def record(self) -> LayoutRecord:
        return LayoutRecord(self.block_bytes, self.fingerprint, self.description)


def layout_for_config(config: TieringConfig) -> BlockLayout:
    """The block size, layout fingerprint and layout description ``config.model`` gives
    (:class:`ConfigError` if the config has no model)."""
    description = config.layout_description()
    return BlockLayout(config.block_bytes(), make_layout_fingerprint(description), description)


def build_pool(config: TieringConfig, *, block_bytes: int | None = None) -> CPUBlockPool:
    """The primary tier's CPU pool: ``primary.capacity // block_bytes`` rows of ``block_bytes``
    (split over ``model.world_size`` ranks); memory is pinned when CUDA is available."""
    if block_bytes is None:
        block_bytes = config.block_bytes()
    world_size = config.model.world_size if config.model is not None else 1
    if block_bytes % world_size:
        raise ConfigError(
            f"{config.source}: block_bytes={block_bytes} is not a multiple of "
            f"model.world_size={world_size}"
        )
    return CPUBlockPool(
        config.num_cpu_blocks(block_bytes), block_bytes // world_size, world_size=world_size
    )


def build_manager(
    config: TieringConfig,
    *,
    block_bytes: int | None = None,
    fingerprint: bytes | None = None,
    pool: Any = None,
    step_driven: bool = False,
) -> TieringOffloadingManager:
    """A running manager: the CPU primary tier plus every secondary tier, in order.

    ``block_bytes`` (one offloaded block over all ranks: a pool row, what each tier stores) and
    ``fingerprint`` default to the ones ``config.model`` gives. ``pool`` (a
    :class:`CPUBlockPool` or a uint8 tensor of rows) defaults to :func:`build_pool`. Tier
    directories are created here; tiers open in the background (``wait_ready()`` waits until
    each is open or degraded). A tier that fails to open does not raise: it is degraded (it
    holds and takes nothing, the other tiers go on serving), logged once, and reported by
    ``manager.metrics()[tier]["status"]`` and ``["open_error"]``. ``step_driven`` is the
    manager's (an engine adapter sets it; see :class:`TieringOffloadingManager`). Raises
    :class:`ConfigError` before creating anything if a tier cannot be built. The plugins the
    config names are imported here (:func:`resolve_plugins`).
    """
    config = resolve_plugins(config)
    description = None
    if config.model is not None:
        layout = layout_for_config(config)
        if block_bytes in (None, layout.block_bytes) and fingerprint in (None, layout.fingerprint):
            description = layout.description
    if block_bytes is None:
        block_bytes = config.block_bytes()
    if fingerprint is None:
        fingerprint = config.fingerprint()
    num_blocks = config.num_cpu_blocks(block_bytes)
    # Refuse before anything opens: a directory that is not tiering's, or holds another layout.
    errors = [
        f.message
        for f in check_tier_directories(config, BlockLayout(block_bytes, fingerprint, description))
        if f.severity == "error"
    ]
    if errors:
        raise ConfigError("; and ".join(errors))
    backends = [
        _create_backend(
            tier,
            block_bytes=block_bytes,
            fingerprint=fingerprint,
            layout_description=description,
            config=config,
        )
        for tier in config.secondary_tiers
    ]
    tiers = [
        _wrap_tier(t, b, f"{config.source}: secondary_tiers[{i}] ({t.name!r})")
        for i, (t, b) in enumerate(zip(config.secondary_tiers, backends, strict=True))
    ]
    for tier in config.secondary_tiers:
        _make_directory(tier)
    if pool is None:
        pool = build_pool(config, block_bytes=block_bytes)
    primary = CPUOffloadingManager(
        num_blocks,
        config.primary.policy,
        config.events.enabled,
        store_threshold=config.primary.store_threshold,
    )
    return TieringOffloadingManager(
        primary, tiers, pool=pool, enable_events=config.events.enabled, step_driven=step_driven
    )


def _create_backend(
    tier: TierConfig,
    *,
    block_bytes: int,
    fingerprint: bytes,
    layout_description: Mapping[str, Any] | None = None,
    read_only: bool = False,
    config: TieringConfig | None = None,
) -> StorageBackend:
    where = f"tier {tier.name!r} ({tier.type})"
    if config is not None:
        index = config.secondary_tiers.index(tier)
        where = f"{config.source}: secondary_tiers[{index}] ({tier.name!r})"
    tier = _resolve_tier(tier, where)
    try:
        return get_backend(tier.type).create(
            path=tier.path,
            capacity_bytes=tier.capacity_bytes,
            block_bytes=block_bytes,
            fingerprint=fingerprint,
            settings=tier.settings,
            layout_description=layout_description,
            read_only=read_only,
        )
    except (ConfigurationError, ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _wrap_tier(tier: TierConfig, backend: StorageBackend, where: str) -> SecondaryTier:
    """The tier over ``backend``: a :class:`SharedTier` when the backend says its store is
    shared (``capabilities.shared``), which refuses what cannot work there (a policy, since
    the store evicts; write_back); the existence-cache keys only for such a tier."""
    try:
        if backend.capabilities.shared:
            if tier.policy != "lru":
                raise ConfigurationError(
                    f"policy {tier.policy!r}: a shared tier keeps no eviction order (the store "
                    "evicts, e.g. Redis's maxmemory-policy); remove policy"
                )
            cache: dict[str, Any] = {}
            if tier.existence_cache_seconds is not None:
                cache["existence_cache_seconds"] = tier.existence_cache_seconds
            if tier.existence_cache_max_keys is not None:
                cache["existence_cache_max_keys"] = tier.existence_cache_max_keys
            return SharedTier(
                backend,
                name=tier.name,
                write_policy=tier.write_policy,
                selective_min_lookups=tier.selective_min_lookups,
                max_inflight_jobs=tier.max_inflight_jobs,
                quarantine_seconds=tier.quarantine_seconds,
                io_timeout_s=tier.io_timeout_s,
                **cache,
            )
        if tier.existence_cache_seconds is not None or tier.existence_cache_max_keys is not None:
            raise ConfigurationError(
                "existence_cache_seconds and existence_cache_max_keys apply to shared tiers "
                f"only, and the {tier.type!r} backend is not shared here"
            )
        return SecondaryTier(
            backend,
            name=tier.name,
            policy=tier.policy,
            write_policy=tier.write_policy,
            selective_min_lookups=tier.selective_min_lookups,
            max_inflight_jobs=tier.max_inflight_jobs,
            quarantine_seconds=tier.quarantine_seconds,
            io_timeout_s=tier.io_timeout_s,
        )
    except ConfigurationError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _make_directory(tier: TierConfig) -> None:
    if tier.path is None:
        return
    try:
        os.makedirs(tier.path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"tier {tier.name!r}: cannot create directory {str(tier.path)!r}: {exc.strerror or exc}"
        ) from exc
