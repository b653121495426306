"""The checks a config's own content gives, shared by ``config check`` and ``doctor``: what
names the model's weights, and what each tier will meet in its directory."""

from __future__ import annotations

from collections.abc import Sequence

from tiering.cli.checks import FAIL, OK, WARN, Check
from tiering.config import PluginSettings, TierDirectoryFinding, TieringConfig
from tiering.errors import TieringError


def directory_checks(
    config: TieringConfig, findings: Sequence[TierDirectoryFinding]
) -> list[Check]:
    """Whether each tier's directory is tiering's and holds the configured layout: the
    findings of :func:`check_tier_directories` (which reads only), as checks; an OK check for
    a tier with a directory and no finding."""
    verdicts = {"error": FAIL, "warning": WARN, "note": OK}
    found: dict[str, list[TierDirectoryFinding]] = {}
    for finding in findings:
        found.setdefault(finding.tier, []).append(finding)
    checks = []
    for tier in config.secondary_tiers:
        if tier.path is None or isinstance(tier.settings, PluginSettings):
            continue
        name = f"tier {tier.name} directory"
        of_tier = found.get(tier.name, [])
        if not of_tier:
            checks.append(Check(name, OK, f"{tier.path}: usable by this config", tier.name))
        for finding in of_tier:
            checks.append(Check(name, verdicts[finding.severity], finding.message, tier.name))
    return checks


def model_identity_checks(config: TieringConfig) -> list[Check]:
    """What names the model's weights in the layout fingerprint: WARN when nothing does."""
    if config.model is None:
        return []
    try:
        identity = config.model.model_identity()
    except TieringError as exc:  # an unreadable weight file beside config.json
        return [Check("model identity", FAIL, str(exc))]
    verdict = WARN if identity.architecture_only else OK
    return [Check("model identity", verdict, identity.describe())]
