"""The bounds of a secondary tier's settings (what its write policy means:
:mod:`~tiering.managers.tier_write_policy`).

:func:`check_tier_settings` is the constructor's check of
:class:`~tiering.managers.secondary_tier.SecondaryTier`: every setting out of bounds raises
:class:`~tiering.errors.ConfigurationError` naming the tier.
"""

from __future__ import annotations

from tiering.backends.base import StorageBackend
from tiering.errors import ConfigurationError
from tiering.managers.tier_write_policy import WritePolicy

__all__ = ["check_tier_settings"]


def check_tier_settings(
    name: str,
    backend: StorageBackend,
    *,
    shared: bool,
    write_policy: WritePolicy | str,
    selective_min_lookups: int,
    max_inflight_jobs: int,
    io_timeout_s: float,
) -> WritePolicy:
    """Check the settings of tier ``name`` (``shared``: the tier runs a shared backend); return
    its write policy."""
    if backend.capabilities.shared and not shared:
        raise ConfigurationError(
            f"tier {name!r}: the {backend.name!r} backend is shared (others write and "
            "evict its store), and this tier evicts by deleting: it would delete other "
            "nodes' blocks. Run it as a tiering.managers.shared_tier.SharedTier "
            "(build_manager does)"
        )
    try:
        policy = WritePolicy(write_policy)
    except ValueError:
        valid = ", ".join(p.value for p in WritePolicy)
        raise ConfigurationError(
            f"tier {name!r}: unknown write_policy {write_policy!r}; valid: {valid}"
        ) from None
    if selective_min_lookups < 1:
        raise ConfigurationError(
            f"tier {name!r}: selective_min_lookups must be >= 1, got {selective_min_lookups}"
        )
    if max_inflight_jobs < 1:
        raise ConfigurationError(
            f"tier {name!r}: max_inflight_jobs must be >= 1, got {max_inflight_jobs}"
        )
    if not (isinstance(io_timeout_s, int | float) and 0 < io_timeout_s <= 86400):
        raise ConfigurationError(
            f"tier {name!r}: io_timeout_s must be a number of seconds in (0, 86400], "
            f"got {io_timeout_s!r}"
        )
    return policy
