"""Building the running parts: the primary tier's CPU pool and the manager over every tier.

This is the one module of :mod:`tiering.config` that imports torch (through the pool and the
manager); :mod:`tiering.config` loads it on first use of :func:`build_pool` or
:func:`build_manager`, so that reading and checking a config stays light.
"""

from __future__ import annotations

from typing import Any

from tiering.config.block_layout import BlockLayout, layout_for_config
from tiering.config.build import _create_backend, _make_directory, _wrap_tier
from tiering.config.directories import check_tier_directories
from tiering.config.plugins import resolve_plugins
from tiering.config.schema import TieringConfig
from tiering.errors import ConfigError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.pool import CPUBlockPool
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tiering_manager import TieringOffloadingManager


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
    layout = _layout_to_build(config, block_bytes, fingerprint)
    num_blocks = config.num_cpu_blocks(layout.block_bytes)
    _refuse_unusable_directories(config, layout)
    tiers = _build_tiers(config, layout)
    for tier in config.secondary_tiers:
        _make_directory(tier)
    if pool is None:
        pool = build_pool(config, block_bytes=layout.block_bytes)
    primary = CPUOffloadingManager(
        num_blocks,
        config.primary.policy,
        config.events.enabled,
        store_threshold=config.primary.store_threshold,
    )
    return TieringOffloadingManager(
        primary, tiers, pool=pool, enable_events=config.events.enabled, step_driven=step_driven
    )


def _layout_to_build(
    config: TieringConfig, block_bytes: int | None, fingerprint: bytes | None
) -> BlockLayout:
    """The layout the tiers are built for: ``block_bytes`` and ``fingerprint`` default to the
    model's; the model's description goes with them only when both are the model's."""
    description = None
    if config.model is not None:
        layout = layout_for_config(config)
        if block_bytes in (None, layout.block_bytes) and fingerprint in (None, layout.fingerprint):
            description = layout.description
    if block_bytes is None:
        block_bytes = config.block_bytes()
    if fingerprint is None:
        fingerprint = config.fingerprint()
    return BlockLayout(block_bytes, fingerprint, description)


def _refuse_unusable_directories(config: TieringConfig, layout: BlockLayout) -> None:
    """Refuse before anything opens: a directory that is not tiering's, or holds another
    layout."""
    errors = [f.message for f in check_tier_directories(config, layout) if f.severity == "error"]
    if errors:
        raise ConfigError("; and ".join(errors))


def _build_tiers(config: TieringConfig, layout: BlockLayout) -> list[SecondaryTier]:
    """Every secondary tier, in order: all backends are constructed before any is wrapped."""
    backends = [
        _create_backend(
            tier,
            block_bytes=layout.block_bytes,
            fingerprint=layout.fingerprint,
            layout_description=layout.description,
            config=config,
        )
        for tier in config.secondary_tiers
    ]
    return [
        _wrap_tier(t, b, f"{config.source}: secondary_tiers[{i}] ({t.name!r})")
        for i, (t, b) in enumerate(zip(config.secondary_tiers, backends, strict=True))
    ]
