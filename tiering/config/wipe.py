"""Wiping tiers: deleting tiering's own files from their directories, all or none.

An operator's files stay; a directory that is not tiering's, or holds another backend's tier, is
refused before anything is deleted, and so is a tier a live process holds open (its lock).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from tiering.backends.base import StorageBackend
from tiering.backends.ownership import (
    Removal,
    TierDirectoryError,
    remove_owned_files,
)
from tiering.backends.registry import get_backend
from tiering.backends.tier_lock import hold_directory_locks
from tiering.config.directories import examine_tier_directory
from tiering.config.schema import TierConfig
from tiering.errors import ConfigError, ConfigurationError


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
    plans = [_backend_class(tier) for tier in tiers]
    with contextlib.ExitStack() as locks:
        for tier, cls in zip(tiers, plans, strict=True):
            if cls is not None and tier.path is not None:
                locks.enter_context(hold_directory_locks(tier.path, cls.lock_files, tier=tier.name))
        for tier, cls in zip(tiers, plans, strict=True):
            if cls is not None and tier.path is not None:
                try:
                    examine_tier_directory(tier.path, cls)
                except TierDirectoryError as exc:
                    raise ConfigError(f"tier {tier.name!r}: {exc}") from exc
        return [_remove(tier, cls) for tier, cls in zip(tiers, plans, strict=True)]


def _backend_class(tier: TierConfig) -> type[StorageBackend] | None:
    """The class of the tier's backend, which names its files; None for a tier without a
    directory."""
    if tier.path is None:
        return None
    try:
        return get_backend(tier.type).cls
    except ConfigurationError as exc:
        raise ConfigError(f"tier {tier.name!r}: {exc}") from exc


def _remove(tier: TierConfig, backend_class: type[StorageBackend] | None) -> Removal:
    if backend_class is None or tier.path is None:
        return Removal((), (), False)
    try:
        return remove_owned_files(
            tier.path,
            backend=backend_class.name,
            owned_files=backend_class.owned_files,
            recognizes=backend_class.recognizes_directory,
        )
    except TierDirectoryError as exc:  # changed since it was examined
        raise ConfigError(f"tier {tier.name!r}: {exc}") from exc
