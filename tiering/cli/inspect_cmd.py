"""``tiering inspect``: read each secondary tier without changing anything, count its blocks
and verify every one.

A tier is opened read-only (payload checks left to the read pass), with the config's layout or,
when the tier holds another one, with the layout on disk; then every stored block is read back
in batches into one page-aligned scratch buffer. Nothing is removed or repaired.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import mmap
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tiering.backends.base import Outcome, StorageBackend
from tiering.backends.ownership import (
    DamagedStorageError,
    LayoutMismatchError,
    TierDirectoryError,
)
from tiering.backends.registry import get_backend
from tiering.cli.exits import EXIT_FINDINGS, EXIT_OK
from tiering.cli.loading import load_config_file
from tiering.cli.output import format_bytes
from tiering.config import BlockLayout, TierConfig, build_backend, layout_for_config
from tiering.errors import BackendError, ConfigError
from tiering.replay.progress import ProgressBar


@dataclass
class TierReport:
    """What ``tiering inspect`` found in one tier."""

    name: str
    type: str
    path: str | None
    capacity_bytes: int
    capacity_blocks: int
    blocks: int = 0  # found (and indexed) when the backend opened
    usage_bytes: int = 0
    verified: int = 0  # read back and verified
    corrupt: int = 0  # failed verification, at open or on read (nothing is removed)
    missing: int = 0  # indexed at open, gone when read
    failed: int = 0  # I/O errors on read
    seconds: float = 0.0
    #: the tier holds blocks of another layout than the config's (they were verified
    #: against the layout on disk): what differs
    layout_mismatch: str | None = None
    #: why the tier could not be read at all (not tiering's, damaged beyond reading, ...)
    problem: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def healthy(self) -> bool:
        return (
            self.corrupt == 0
            and self.failed == 0
            and self.layout_mismatch is None
            and self.problem is None
        )


# Recovery counters of the built-in backends: blocks (or slots holding something) lost at open.
_LOST_AT_OPEN = {
    "recovery_rejected": "did not verify",
    "recovery_dropped_blocks": "did not verify",
    "recovery_missing_slots": "were cut off by a truncated slot file",
    "recovery_over_capacity": "lie past the configured capacity",
    "recovery_read_errors": "could not be read",
}


def _for_inspection(tier: TierConfig) -> TierConfig:
    """``tier`` with payload checks left to the read pass (``recover: trust_header``).

    Verifying at open as well would read every block twice, and a block dropped at open could
    not be told apart from one that was never stored.
    """
    settings = tier.settings
    if getattr(settings, "recover", None) != "verify" or not dataclasses.is_dataclass(settings):
        return tier
    assert not isinstance(settings, type)
    return dataclasses.replace(tier, settings=dataclasses.replace(settings, recover="trust_header"))


async def _open_read_only(
    tier: TierConfig, layout: BlockLayout, report: TierReport
) -> tuple[StorageBackend, list[bytes]] | None:
    """The tier's backend opened read-only, with the config's layout or, if the tier holds
    another one, with the layout on disk (recorded in ``report``); None if it cannot be read."""
    backend = build_backend(
        _for_inspection(tier),
        block_bytes=layout.block_bytes,
        fingerprint=layout.fingerprint,
        layout_description=layout.description,
        read_only=True,
    )
    report.capacity_bytes = backend.capacity_bytes
    report.capacity_blocks = backend.capacity_blocks
    try:
        return backend, await backend.open()
    except LayoutMismatchError as exc:
        report.layout_mismatch = exc.on_disk.difference(exc.configured)
        report.notes.append(
            "the tier holds blocks of another layout than the config's: its blocks are "
            "verified against the layout on disk; a manager with this config refuses to open "
            "it (see on_layout_mismatch in docs/config.md)"
        )
        if exc.on_disk.fingerprint == bytes(16):  # another storage format: not readable here
            return None
        backend = build_backend(
            _for_inspection(tier),
            block_bytes=exc.on_disk.block_bytes,
            fingerprint=exc.on_disk.fingerprint,
            read_only=True,
        )
        return backend, await backend.open()


async def inspect_tier(
    tier: TierConfig,
    *,
    layout: BlockLayout,
    batch_blocks: int,
    progress: Callable[[int, str], ProgressBar],
) -> TierReport:
    """Read ``tier`` without changing anything: open its backend read-only, then read every
    stored block back and verify it, in batches."""
    report = TierReport(
        name=tier.name,
        type=str(tier.type),
        path=None if tier.path is None else str(tier.path),
        capacity_bytes=tier.capacity_bytes,
        capacity_blocks=0,
    )
    if tier.path is None:
        report.notes.append(f"a {tier.type} tier keeps no files: nothing to inspect")
        return report
    if not get_backend(tier.type).accepts("read_only"):
        report.notes.append(
            f"skipped: the {tier.type} backend has no read-only mode, and inspect never writes"
        )
        return report
    if not tier.path.exists():
        sized = build_backend(tier, block_bytes=layout.block_bytes, fingerprint=layout.fingerprint)
        report.capacity_blocks = sized.capacity_blocks  # constructing it does no I/O
        report.notes.append(f"{tier.path} does not exist: nothing stored yet")
        return report
    start_s = time.perf_counter()
    try:
        opened = await _open_read_only(tier, layout, report)
    except DamagedStorageError as exc:
        report.problem = str(exc)
        report.corrupt += exc.lost_blocks or 0
        return report
    except (TierDirectoryError, ConfigError, BackendError) as exc:  # foreign, in use, ...
        report.problem = str(exc)
        return report
    if opened is None:
        return report
    backend, keys = opened
    try:
        report.blocks = len(keys)
        report.usage_bytes = backend.usage_bytes
        for counter, why in _LOST_AT_OPEN.items():
            lost = backend.stats.extra.get(counter, 0)
            if lost:
                report.corrupt += lost
                report.notes.append(f"{lost} stored block(s) or slot(s) {why}")
        if backend.stats.extra.get("manifest_damaged"):
            report.notes.append("the manifest is missing or damaged: every slot was verified")
        block_bytes = backend.block_bytes
        # Page-aligned (O_DIRECT tiers read straight into it), reused by every batch.
        scratch = memoryview(mmap.mmap(-1, batch_blocks * block_bytes))
        buffers = [scratch[i * block_bytes : (i + 1) * block_bytes] for i in range(batch_blocks)]
        with progress(len(keys), f"verifying {tier.name}") as bar:
            for first in range(0, len(keys), batch_blocks):
                batch = keys[first : first + batch_blocks]
                outcomes = await backend.get(batch, buffers[: len(batch)])
                report.verified += outcomes.count(Outcome.OK)
                report.corrupt += outcomes.count(Outcome.CORRUPT)
                report.missing += outcomes.count(Outcome.MISSING)
                report.failed += outcomes.count(Outcome.FAILED)
                bar.update(len(batch))
    finally:
        await backend.close()
    report.seconds = time.perf_counter() - start_s
    return report


def cmd_inspect(args: argparse.Namespace) -> int:
    config = load_config_file(args.config)
    layout = layout_for_config(config)
    block_bytes = layout.block_bytes
    tiers = list(config.secondary_tiers) if args.tier is None else [config.tier(args.tier)]

    def progress(total: int, label: str) -> ProgressBar:
        return ProgressBar(total, label, stream=sys.stderr, enabled=not args.no_progress)

    async def run() -> list[TierReport]:
        return [
            await inspect_tier(
                tier, layout=layout, batch_blocks=args.batch_blocks, progress=progress
            )
            for tier in tiers
        ]

    reports = asyncio.run(run())
    if args.json:
        document = {
            "config": str(args.config),
            "block_bytes": block_bytes,
            "tiers": [dataclasses.asdict(r) | {"healthy": r.healthy} for r in reports],
            "corrupt": sum(r.corrupt for r in reports),
            "failed": sum(r.failed for r in reports),
        }
        sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
    else:
        for r in reports:
            print(
                f"tier {r.name} ({r.type}{', ' + r.path if r.path else ''}): {r.blocks} blocks, "
                f"{format_bytes(r.usage_bytes)} used of {format_bytes(r.capacity_bytes)} "
                f"({r.capacity_blocks} blocks)"
            )
            if r.problem is not None:
                print(f"  not readable: {r.problem}")
            if r.layout_mismatch is not None:
                print(f"  layout mismatch: {r.layout_mismatch}")
            print(
                f"  verified {r.verified}, corrupt {r.corrupt}, missing {r.missing}, "
                f"read errors {r.failed}  [{r.seconds:.2f} s]"
            )
            for note in r.notes:
                print(f"  note: {note}")
        if not reports:
            print("no secondary tiers to inspect")
    return EXIT_OK if all(r.healthy for r in reports) else EXIT_FINDINGS
