"""Tier directories, before anything opens: what each tier will meet there.

:func:`check_tier_directories` reads each directory's listing and tiering marker and changes
nothing; ``tiering config check`` prints its findings and :func:`tiering.config.build_manager`
refuses a config with an error among them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tiering.backends.base import StorageBackend
from tiering.backends.ownership import (
    LayoutMismatchError,
    TierDirectory,
    TierDirectoryError,
    check_backend,
    examine_directory,
    foreign_directory_error,
)
from tiering.backends.registry import get_backend
from tiering.config.block_layout import BlockLayout, layout_for_config
from tiering.config.schema import PluginSettings, TierConfig, TieringConfig


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
        found = examine_tier_directory(tier.path, cls)
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
    return _layout_findings(tier, found, layout)


def _layout_findings(
    tier: TierConfig, found: TierDirectory, layout: BlockLayout | None
) -> list[tuple[Literal["error", "warning", "note"], str]]:
    """A directory holding blocks of another layout than ``layout``: what the tier's
    ``on_layout_mismatch`` will do about it (an error if it refuses)."""
    assert tier.path is not None
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


def examine_tier_directory(path: Path, cls: type[StorageBackend]) -> TierDirectory:
    """What ``path`` holds for a tier of backend ``cls``; reads only. Raises
    :class:`TierDirectoryError` if the directory is not tiering's or holds another backend's
    tier."""
    found = examine_directory(
        path, owned_files=cls.owned_files, recognizes=cls.recognizes_directory
    )
    if found.state == "foreign":
        raise foreign_directory_error(found, what="the tier directory")
    check_backend(found, cls.name)
    return found
