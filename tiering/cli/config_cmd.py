"""``tiering config check`` and ``tiering config schema``: a config validated and summarized
(each tier, what it holds, what its directory holds), and the config's JSON Schema.

Checking a config builds each tier's settings for the model's block size but opens nothing and
runs no plugin code; this module imports the config layer only (no manager, no copy engine).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass

from tiering.cli.checks import FAIL, OK, WARN, Check, checks_document
from tiering.cli.config_checks import directory_checks, model_identity_checks
from tiering.cli.exits import EXIT_ERROR, EXIT_OK
from tiering.cli.loading import load_config_file
from tiering.cli.output import format_bytes, print_json
from tiering.config import (
    BlockLayout,
    PluginSettings,
    TieringConfig,
    build_tier,
    check_tier_directories,
    config_json_schema,
    layout_for_config,
)
from tiering.errors import ConfigError, TieringError


@dataclass(frozen=True)
class _TierRow:
    """One tier in ``config check``'s summary."""

    name: str
    type: str
    capacity_bytes: int
    capacity_blocks: int | None  # None: depends on the model (none given) or a plugin
    policy: str
    write_policy: str | None  # None for the primary tier
    path: str | None
    note: str = ""

    def text(self) -> tuple[str, str, str, str, str]:
        blocks = self.note if self.capacity_blocks is None else f"{self.capacity_blocks} blocks"
        rest = f"policy {self.policy}"
        if self.write_policy is not None:
            rest += f", {self.write_policy}"
        if self.path is not None:
            rest += f", path {self.path}"
        return self.name, self.type, format_bytes(self.capacity_bytes), blocks, rest


def _tier_rows(config: TieringConfig, layout: BlockLayout | None) -> list[_TierRow]:
    """The primary and each secondary tier; raises :class:`ConfigError` if a tier holds no block."""
    primary = config.primary
    rows = [
        _TierRow(
            "primary",
            "cpu",
            int(primary.capacity_bytes),
            None if layout is None else config.num_cpu_blocks(layout.block_bytes),
            str(primary.policy),
            None,
            None,
        )
    ]
    for tier in config.secondary_tiers:
        blocks: int | None = None
        note = ""
        if isinstance(tier.settings, PluginSettings):
            note = "(plugin, imported when built)"  # checking a config runs no plugin code
        elif layout is not None:
            # Constructing the tier validates its settings (and a shared tier's) for this block
            # size; no I/O.
            backend = build_tier(
                tier, block_bytes=layout.block_bytes, fingerprint=layout.fingerprint
            ).backend
            if backend.capacity_blocks == 0:
                raise ConfigError(
                    f"{config.source}: tier {tier.name!r}: capacity "
                    f"{format_bytes(tier.capacity_bytes)} holds no block of "
                    f"{format_bytes(layout.block_bytes)} once the {tier.type} backend's "
                    "per-block overhead is counted; make it larger"
                )
            blocks = backend.capacity_blocks
        rows.append(
            _TierRow(
                tier.name,
                str(tier.type),
                int(tier.capacity_bytes),
                blocks,
                str(tier.policy),
                tier.write_policy.value,
                None if tier.path is None else str(tier.path),
                note,
            )
        )
    return rows


def cmd_config_check(args: argparse.Namespace) -> int:
    config_warnings: list[str] = []
    try:
        config = load_config_file(args.file, config_warnings)
        layout = None if config.model is None else layout_for_config(config)
        rows = _tier_rows(config, layout)
    except (TieringError, OSError) as exc:
        if args.json:  # the document, then the usual one-line error on stderr (exit 2)
            checks = [Check("config", FAIL, str(exc))]
            document = checks_document("config check", args.file, checks, EXIT_ERROR)
            print_json(document | {"model": None, "tiers": []})
        raise
    checks = [Check("config", WARN, warning) for warning in config_warnings]
    checks = checks or [Check("config", OK, "valid")]
    checks += model_identity_checks(config)
    # What each tier will meet in its directory: refused now, not when the engine starts.
    findings = check_tier_directories(config, layout)
    checks += directory_checks(config, findings)
    status = EXIT_ERROR if any(c.verdict == FAIL for c in checks) else EXIT_OK
    if args.json:
        model = None
        if config.model is not None and layout is not None:
            identity = config.model.model_identity()
            model = {
                "shape": config.model.shape,
                "config_json": None
                if config.model.config_json is None
                else str(config.model.config_json),
                "name": identity.name,
                "identity": {"source": identity.source, "weights": identity.weights},
                "world_size": config.model.world_size,
                "block_size_factor": config.block_size_factor,
                "block_bytes": layout.block_bytes,
            }
        tiers = [dataclasses.asdict(row) for row in rows]
        for tier in tiers:
            del tier["note"]
        document = checks_document("config check", args.file, checks, status)
        print_json(document | {"model": model, "tiers": tiers})
        return status
    errors = sum(c.verdict == FAIL for c in checks)
    # The headline is the verdict: a config whose tier directories are refused is not OK.
    print(f"{args.file}: OK" if not errors else f"{args.file}: {errors} error(s), on stderr")
    if config.model is None or layout is None:
        print("model: none (the blocks each tier holds depend on model.shape)")
    else:
        identity = config.model.model_identity()
        print(
            f"model: {identity.name}, world size {config.model.world_size}, "
            f"block_size_factor {config.block_size_factor}: one block is "
            f"{format_bytes(layout.block_bytes)} ({layout.block_bytes} bytes)"
        )
        warning = " (WARN)" if identity.architecture_only else ""
        print(f"model identity{warning}: {identity.describe()}")
    texts = [row.text() for row in rows]
    widths = [max(len(text[i]) for text in texts) for i in range(4)]
    for name, kind, capacity, blocks, rest in texts:
        print(
            f"  {name:<{widths[0]}}  {kind:<{widths[1]}}  {capacity:>{widths[2]}}  "
            f"{blocks:>{widths[3]}}  {rest}"
        )
    for finding in findings:
        print(f"{finding.severity}: {finding.message}", file=sys.stderr)
    return status


def cmd_config_schema(args: argparse.Namespace) -> int:
    sys.stdout.write(json.dumps(config_json_schema(), indent=2, sort_keys=True) + "\n")
    return EXIT_OK
