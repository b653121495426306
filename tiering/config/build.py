"""Building a tier from its config: its backend, and the :class:`SecondaryTier` over it.

A backend is constructed but not opened (no I/O; it creates its directory when it opens); a
shared backend gets a :class:`~tiering.managers.shared_tier.SharedTier`. Every refusal is a
:class:`ConfigError` naming the tier. Imports no torch (``tiering config check`` builds each
tier to count its blocks).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from tiering.backends.base import StorageBackend
from tiering.backends.registry import get_backend
from tiering.config.plugins import _resolve_tier
from tiering.config.schema import TierConfig, TieringConfig
from tiering.errors import ConfigError, ConfigurationError
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.shared_tier import SharedTier


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
            return _shared_tier(tier, backend)
        return _private_tier(tier, backend)
    except ConfigurationError as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _shared_tier(tier: TierConfig, backend: StorageBackend) -> SharedTier:
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
        admission_min_count=tier.admission_min_count,
        admission_width=tier.admission_width,
        **cache,
    )


def _private_tier(tier: TierConfig, backend: StorageBackend) -> SecondaryTier:
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
        admission_min_count=tier.admission_min_count,
        admission_width=tier.admission_width,
    )


def _make_directory(tier: TierConfig) -> None:
    if tier.path is None:
        return
    try:
        os.makedirs(tier.path, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"tier {tier.name!r}: cannot create directory {str(tier.path)!r}: {exc.strerror or exc}"
        ) from exc
