"""``tiering wipe``: delete tiering's own files from each tier's directory."""

from __future__ import annotations

import argparse

from tiering.cli.exits import EXIT_OK
from tiering.cli.loading import load_config_file
from tiering.config import wipe_tiers


def cmd_wipe(args: argparse.Namespace) -> int:
    """Delete tiering's own files from each tier's directory (never anyone else's)."""
    config = load_config_file(args.config)
    tiers = list(config.secondary_tiers) if args.tier is None else [config.tier(args.tier)]
    # All or none: every directory is examined before anything is deleted.
    for tier, removal in zip(tiers, wipe_tiers(tiers), strict=True):
        if tier.path is None:
            continue
        what = f"tier {tier.name} ({tier.path})"
        if not removal.removed and not removal.directory_removed:
            print(f"{what}: nothing of tiering's to delete")
            continue
        print(f"{what}: deleted {', '.join(removal.removed) or 'nothing'}")
        if removal.kept:
            print(f"  kept (not tiering's): {', '.join(removal.kept)}")
        elif removal.directory_removed:
            print("  removed the directory (it was left empty)")
    return EXIT_OK
