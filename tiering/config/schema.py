"""The frozen objects a checked config is: :class:`TieringConfig` and its sections.

Each section is a frozen dataclass whose fields are the YAML keys (``metadata["key"]`` when the
key differs from the field, ``"doc"`` for docs/config.md and the JSON schema, ``"min"`` /
``"max"`` for bounds); :func:`tiering.backends.settings.parse_settings` checks a mapping into
one. The vocabulary of the file's top level (its keys and which are sections) lives here too,
shared by the parser and the environment overrides.

Importing this module imports no torch (``tiering config check`` answers at once): the copy
backends' names are written out here, as the replay section's are.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tiering.backends.settings import NoSettings, SettingsProblem, format_size
from tiering.config.workload_shape import parse_shape
from tiering.core.block_format import make_layout_fingerprint
from tiering.core.groups import KVCacheSpec
from tiering.core.identity import layout_identity
from tiering.errors import ConfigError, ConfigurationError
from tiering.managers.secondary_tier import WritePolicy
from tiering.model.hf_model import cached_model_shape
from tiering.model.identity import ModelIdentity, model_identity, weights_id_problem
from tiering.model.shapes import MODEL_SHAPES, ModelShape, get_model_shape

__all__ = [
    "BUILTIN_TRACES",
    "CONFIG_VERSION",
    "ENV_PREFIX",
    "IGNORED_ENV_VARS",
    "MAX_CONFIG_BYTES",
    "MAX_NESTING_DEPTH",
    "SCALES",
    "WORKLOAD_TRACES",
    "ConfigWarning",
    "CopyBackend",
    "EventsConfig",
    "HashingConfig",
    "MetricsConfig",
    "ModelConfig",
    "PluginSettings",
    "PrimaryConfig",
    "ReplaySettings",
    "TierConfig",
    "TieringConfig",
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
#: ``primary.copy_backend``: a copy strategy or ``"auto"``; the same names as
#: :data:`tiering.transfer.CopyBackend` (a test checks it), written out so that reading a config
#: imports no transfer code (and so no torch).
CopyBackend = Literal["auto", "triton", "batched_memcpy", "staging", "memmove", "torch"]
#: ``primary.store_copy_backend``: ``"same"`` (as ``copy_backend``) or a strategy for stores.
StoreCopyBackend = Literal["same", "triton", "batched_memcpy", "staging", "memmove", "torch"]


class ConfigWarning(UserWarning):
    """A config that works but is probably not what was meant (e.g. a useless tier)."""


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
    store_copy_backend: StoreCopyBackend = field(
        default="same",
        metadata={
            "doc": "another strategy for stores only; batched_memcpy (the GPU's copy engine) "
            "leaves the SMs to the engine's kernels (docs/gpu-check.md)"
        },
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
    admission_min_count: int = 0  # 0: no admission gate
    admission_width: int | None = None  # None: 8 counters per block of capacity
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
    admission_min_count: int = field(
        default=0,
        metadata={
            "min": 0,
            "max": 255,
            "doc": "admission gate: write a block only once it was looked up past the CPU tier "
            "this many times recently (a count-min sketch with aging); 0: no gate. Not with "
            "write_back",
        },
    )
    admission_width: int | None = field(
        default=None,
        metadata={
            "min": 1,
            "doc": "the admission gate's counters per row (rounded up to a power of two; "
            "memory 4 bytes each); default 8 per block of capacity, at least 64",
        },
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
    shape: str | None = field(
        default=None,
        metadata={
            "doc": "shape of a generated trace (conversation, toolagent, documents, production): "
            "FIELD=VALUE,... of continue_beta_a, tenants, catalog_share, catalog_alpha, "
            "think_time_scale (default: the calibrated shape)"
        },
    )
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
        if self.shape is not None:
            try:
                parse_shape(self.shape)
            except ConfigurationError as exc:
                raise SettingsProblem("shape", str(exc), self.shape) from None
            if self.trace not in WORKLOAD_TRACES:
                raise SettingsProblem(
                    "shape",
                    f"applies to the generated traces ({', '.join(WORKLOAD_TRACES)}); "
                    f"replay.trace {self.trace!r} is not one",
                    self.shape,
                )


# The file's top level: its keys, the sections among them (a dataclass each), the scalars.
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


def _env_name(name: str) -> str:
    return name.upper().replace("-", "_")
