"""The ``tiering`` command line: check a config, print its schema, inspect tiers, check the machine.

Subcommands (each sets ``func(args) -> int``, the exit status)::

    tiering config check FILE        validate a YAML config; summary of tiers and capacities
    tiering config schema            the config's JSON Schema
    tiering inspect --config FILE    read each secondary tier, count and verify every block
    tiering doctor [--config FILE]   what this machine supports (OK / WARN / FAIL per check)
    tiering wipe --config FILE       delete tiering's own files from each tier's directory
    tiering replay ...               (added by :mod:`tiering.replay` when it is installed)
    tiering policy-study ...         (likewise)
    tiering --version

Errors are reported at this boundary: a bad config or any :class:`~tiering.errors.TieringError`
or ``OSError`` prints its message (never a traceback) and exits 2; anything unexpected prints a
one-line summary and exits 3 (``--debug`` re-raises it instead). :data:`EXIT_CODES` lists every
exit status (``tiering --help`` prints it; docs/cli.md too). ``--log-level`` sends the
``tiering`` loggers' records at that level and above to stderr while the command runs.
``doctor --json`` and ``config check --json`` print one JSON object (:func:`checks_document`,
documented in docs/cli.md) instead of text, with the same exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import importlib.metadata
import json
import logging
import mmap
import os
import platform
import shutil
import sys
import tempfile
import textwrap
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiering.backends.base import Outcome, StorageBackend
from tiering.backends.ownership import (
    DamagedStorageError,
    LayoutMismatchError,
    TierDirectoryError,
)
from tiering.backends.registry import get_backend
from tiering.config import (
    BlockLayout,
    ConfigWarning,
    PluginSettings,
    TierConfig,
    TierDirectoryFinding,
    TieringConfig,
    build_backend,
    build_tier,
    check_tier_directories,
    config_json_schema,
    layout_for_config,
    load_config,
    wipe_tiers,
)
from tiering.errors import BackendError, ConfigError, TieringError
from tiering.replay.progress import ProgressBar
from tiering.transfer import machine_choice

__all__ = ["EXIT_CODES", "LOG_LEVELS", "build_parser", "checks_document", "format_bytes", "main"]

EXIT_OK = 0
EXIT_FINDINGS = 1  # inspect found bad blocks, or doctor found a FAIL
EXIT_ERROR = 2  # bad config, bad arguments, or an I/O error
EXIT_UNEXPECTED = 3  # a bug: an exception that is not a TieringError or OSError
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)

#: Every exit status of ``tiering``, and what it means (printed by ``tiering --help``).
EXIT_CODES: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success: nothing wrong found"),
    (
        EXIT_FINDINGS,
        "findings: doctor found a FAIL; inspect found corrupt or unreadable blocks, or a tier "
        "holding another layout or not readable; replay loaded bytes that did not verify",
    ),
    (
        EXIT_ERROR,
        "error: bad arguments, a bad or missing config, an I/O error, or (config check) a "
        "tier directory that would be refused when it opens",
    ),
    (EXIT_UNEXPECTED, "unexpected error: a bug (--debug shows the traceback)"),
    (EXIT_INTERRUPTED, "interrupted (Ctrl-C)"),
)

#: ``--log-level`` values, quietest last.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` in binary units, three significant digits: ``"1.5 GiB"``, ``"512 B"``."""
    value = float(num_bytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{num_bytes} B"
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


# -- config check and schema ---------------------------------------------------------------------


def _load(path: str, warnings_out: list[str] | None = None) -> TieringConfig:
    """Load a config; its :class:`ConfigWarning` s go to stderr as one line each (and, as
    text, to ``warnings_out`` if given)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        config = load_config(path)
    for warning in caught:
        if issubclass(warning.category, ConfigWarning):
            print(f"warning: {warning.message}", file=sys.stderr)
            if warnings_out is not None:
                warnings_out.append(str(warning.message))
        else:  # not ours: let the normal machinery show it
            warnings.warn_explicit(
                warning.message, warning.category, warning.filename, warning.lineno
            )
    return config


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
        config = _load(args.file, config_warnings)
        layout = None if config.model is None else layout_for_config(config)
        rows = _tier_rows(config, layout)
    except (TieringError, OSError) as exc:
        if args.json:  # the document, then the usual one-line error on stderr (exit 2)
            checks = [Check("config", FAIL, str(exc))]
            document = checks_document("config check", args.file, checks, EXIT_ERROR)
            _print_json(document | {"model": None, "tiers": []})
        raise
    checks = [Check("config", WARN, warning) for warning in config_warnings]
    checks = checks or [Check("config", OK, "valid")]
    checks += _model_identity_checks(config)
    # What each tier will meet in its directory: refused now, not when the engine starts.
    findings = check_tier_directories(config, layout)
    checks += _directory_checks(config, findings)
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
        _print_json(document | {"model": model, "tiers": tiers})
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


# -- inspect -------------------------------------------------------------------------------------


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
    config = _load(args.config)
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


# -- doctor --------------------------------------------------------------------------------------

OK, WARN, FAIL = "OK", "WARN", "FAIL"
VERDICTS = (OK, WARN, FAIL)
_PROBE_BYTES = 4096


@dataclass(frozen=True)
class Check:
    """One line of ``tiering doctor``: a verdict (OK / WARN / FAIL) and why."""

    name: str
    verdict: str
    detail: str
    tier: str | None = None  # the secondary tier it is about, if any


def _existing_ancestor(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (a tier's directory may not exist yet)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def probe_o_direct(directory: Path) -> tuple[bool, str]:
    """Whether ``directory``'s file system takes an ``O_DIRECT`` 4096-byte write and read."""
    if not hasattr(os, "O_DIRECT"):
        return False, "this OS has no O_DIRECT"
    try:
        fd, name = tempfile.mkstemp(prefix=".tiering-o-direct-", dir=directory)
    except OSError as exc:
        return False, f"cannot create a file in {directory}: {exc.strerror}"
    os.close(fd)
    written = mmap.mmap(-1, _PROBE_BYTES)  # page-aligned, as O_DIRECT requires
    read_back = mmap.mmap(-1, _PROBE_BYTES)
    try:
        try:
            fd = os.open(name, os.O_RDWR | os.O_DIRECT)
        except OSError as exc:
            return False, f"the file system refuses O_DIRECT ({exc.strerror})"
        try:
            written.write(os.urandom(_PROBE_BYTES))
            if os.pwrite(fd, written, 0) != _PROBE_BYTES:
                return False, "a 4096-byte O_DIRECT write was short"
            if os.preadv(fd, [read_back], 0) != _PROBE_BYTES or read_back[:] != written[:]:
                return False, "a 4096-byte O_DIRECT read did not return what was written"
        except OSError as exc:
            return False, f"an aligned 4096-byte O_DIRECT write/read failed ({exc.strerror})"
        finally:
            os.close(fd)
    finally:
        written.close()
        read_back.close()
        os.unlink(name)
    return True, "an aligned 4096-byte write and read round-trip"


def _allocated_bytes(path: Path) -> int:
    """Bytes of disk already allocated under ``path`` (a tier's own files count as room)."""
    if not path.exists():
        return 0
    paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.lstat().st_blocks * 512 for p in paths)


def _python_checks() -> list[Check]:
    checks = []
    # No version verdict: this code does not even import on Python < 3.11.
    python = f"{platform.python_implementation()} {platform.python_version()}"
    checks.append(Check("python", OK, f"{python} at {sys.executable}"))
    try:
        import torch
    except ImportError as exc:
        checks.append(Check("torch", FAIL, f"cannot import torch: {exc}"))
        return checks
    checks.append(Check("torch", OK, f"{torch.__version__}"))
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        checks.append(Check("cuda", OK, f"{torch.cuda.device_count()} device(s): {names}"))
    else:
        checks.append(
            Check("cuda", WARN, "no CUDA device: CPU tiers work; GPU <-> CPU copies need CUDA")
        )
    try:
        torch.empty(1, pin_memory=True)
    except Exception as exc:  # torch raises RuntimeError with any of several messages
        reason = str(exc).split(";")[0].strip() or type(exc).__name__
        checks.append(
            Check(
                "pinned memory",
                WARN,
                f"not available ({reason[:100]}); the CPU pool is pageable memory, so "
                "GPU copies cannot overlap compute",
            )
        )
    else:
        checks.append(Check("pinned memory", OK, "torch.empty(1, pin_memory=True) works"))
    return checks


def _library_checks() -> list[Check]:
    checks = []
    try:
        import lmdb
    except ImportError as exc:
        checks.append(Check("lmdb", FAIL, f"cannot import lmdb ({exc}); lmdb tiers cannot open"))
    else:
        library = ".".join(str(part) for part in lmdb.version())
        checks.append(Check("lmdb", OK, f"py-lmdb {lmdb.__version__}, LMDB {library}"))
    try:
        import xxhash
    except ImportError as exc:
        checks.append(Check("xxhash", FAIL, f"cannot import xxhash ({exc}); blocks cannot verify"))
    else:
        checks.append(Check("xxhash", OK, f"{xxhash.VERSION} (xxh3 block checksums)"))
    cpus = os.cpu_count() or 1
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cpus
    detail = f"{usable} usable of {cpus}"
    if usable < 2:
        checks.append(
            Check("cpus", WARN, f"{detail}: tier I/O threads will compete with the engine")
        )
    else:
        checks.append(Check("cpus", OK, detail))
    return checks


def _shm_check(primary_bytes: int | None) -> Check:
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return Check("/dev/shm", WARN, "missing: a pool shared between processes needs a file")
    usage = shutil.disk_usage(shm)
    detail = f"{format_bytes(usage.total)} total, {format_bytes(usage.free)} free"
    if primary_bytes is not None and usage.free < primary_bytes:
        return Check(
            "/dev/shm",
            WARN,
            f"{detail}: a shared primary pool of {format_bytes(primary_bytes)} would not fit",
        )
    return Check("/dev/shm", OK, detail)


def _tier_checks(config: TieringConfig) -> list[Check]:
    checks = []
    needed_by_device: dict[int, int] = {}  # tiers on one file system share its free space
    for tier in config.secondary_tiers:
        if tier.path is None:
            checks.append(
                Check(f"tier {tier.name}", OK, f"{tier.type}: no files to check", tier.name)
            )
            continue
        path = Path(tier.path)
        directory = _existing_ancestor(path)
        wants_o_direct = getattr(tier.settings, "o_direct", False) is True
        works, why = probe_o_direct(directory)
        if works:
            checks.append(Check(f"tier {tier.name} O_DIRECT", OK, f"{directory}: {why}", tier.name))
        else:
            verdict = FAIL if wants_o_direct else WARN
            consequence = (
                "the tier sets o_direct: true and cannot open"
                if wants_o_direct
                else "the page cache will be used"
            )
            checks.append(
                Check(
                    f"tier {tier.name} O_DIRECT",
                    verdict,
                    f"{directory}: {why}; {consequence}",
                    tier.name,
                )
            )
        device = directory.stat().st_dev
        needed = max(0, tier.capacity_bytes - _allocated_bytes(path))
        needed_by_device[device] = needed_by_device.get(device, 0) + needed
        free = shutil.disk_usage(directory).free
        detail = (
            f"{directory}: {format_bytes(free)} free; capacity {format_bytes(tier.capacity_bytes)}"
            f" needs {format_bytes(needed)} more"
        )
        if needed_by_device[device] > free:
            if needed_by_device[device] > needed:
                detail += " (counting earlier tiers on the same file system)"
            checks.append(Check(f"tier {tier.name} space", FAIL, detail, tier.name))
        else:
            checks.append(Check(f"tier {tier.name} space", OK, detail, tier.name))
    return checks


def _directory_checks(
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


def _copy_backend_check(config: TieringConfig | None) -> Check:
    """Which GPU <-> CPU copy strategy CUDA KV caches get here (tiering.transfer), and why."""
    choice = machine_choice()
    detail = f"{choice.name}: {choice.reason}"
    if config is not None and config.primary.copy_backend != "auto":
        detail = f"{config.primary.copy_backend} (primary.copy_backend); auto would pick {detail}"
    fast = choice.name in ("triton", "memmove")
    return Check("copy backend", OK if fast else WARN, detail)


def run_doctor(config: TieringConfig | None) -> list[Check]:
    """Every check, in the order printed."""
    checks = _python_checks() + _library_checks() + [_copy_backend_check(config)]
    primary_bytes = None if config is None else int(config.primary.capacity_bytes)
    checks.append(_shm_check(primary_bytes))
    if config is None:
        directory = Path(tempfile.gettempdir())
        works, why = probe_o_direct(directory)
        checks.append(Check("O_DIRECT (temp dir)", OK if works else WARN, f"{directory}: {why}"))
    else:
        checks += _model_identity_checks(config)
        checks += _tier_checks(config)
        checks += _directory_checks(config, check_tier_directories(config))
    return checks


def _model_identity_checks(config: TieringConfig) -> list[Check]:
    """What names the model's weights in the layout fingerprint: WARN when nothing does."""
    if config.model is None:
        return []
    try:
        identity = config.model.model_identity()
    except TieringError as exc:  # an unreadable weight file beside config.json
        return [Check("model identity", FAIL, str(exc))]
    verdict = WARN if identity.architecture_only else OK
    return [Check("model identity", verdict, identity.describe())]


def checks_document(
    command: str, config: str | None, checks: Sequence[Check], exit_code: int
) -> dict[str, Any]:
    """The JSON object ``doctor --json`` and ``config check --json`` print (docs/cli.md)::

        {"json_version": 1, "command": "doctor", "config": "tiering.yaml" | null,
         "exit_code": 0, "counts": {"OK": 9, "WARN": 2, "FAIL": 0},
         "checks": [{"name": "torch", "status": "OK", "message": "2.13.0", "tier": null}, ...]}

    ``status`` is ``OK``, ``WARN`` or ``FAIL``; ``tier`` names the secondary tier a check is
    about (null otherwise). ``config check`` adds ``model`` and ``tiers``.
    """
    return {
        "json_version": 1,
        "command": command,
        "config": None if config is None else str(config),
        "exit_code": exit_code,
        "counts": {verdict: sum(c.verdict == verdict for c in checks) for verdict in VERDICTS},
        "checks": [
            {"name": c.name, "status": c.verdict, "message": c.detail, "tier": c.tier}
            for c in checks
        ],
    }


def _print_json(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")


def cmd_doctor(args: argparse.Namespace) -> int:
    try:
        config = None if args.config is None else _load(args.config)
    except (TieringError, OSError) as exc:
        if args.json:  # the document, then the usual one-line error on stderr (exit 2)
            checks = [Check("config", FAIL, str(exc))]
            _print_json(checks_document("doctor", args.config, checks, EXIT_ERROR))
        raise
    checks = run_doctor(config)
    failed = sum(c.verdict == FAIL for c in checks)
    warned = sum(c.verdict == WARN for c in checks)
    status = EXIT_FINDINGS if failed else EXIT_OK
    if args.json:
        _print_json(checks_document("doctor", args.config, checks, status))
        return status
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.verdict:<5} {c.name:<{width}}  {c.detail}")
    print(f"{len(checks)} checks: {failed} FAIL, {warned} WARN")
    return status


# -- wipe ----------------------------------------------------------------------------------------


def cmd_wipe(args: argparse.Namespace) -> int:
    """Delete tiering's own files from each tier's directory (never anyone else's)."""
    config = _load(args.config)
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


# -- the parser ----------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _add_replay(subparsers: Any) -> None:
    """Let :mod:`tiering.replay` add its subcommand, if that module exists."""
    try:
        replay_mod = importlib.import_module("tiering.replay")
    except ModuleNotFoundError as exc:
        if exc.name == "tiering.replay":
            return  # not written yet / not installed
        error: Exception = exc
    except Exception as exc:  # a broken replay module must not break the other subcommands
        error = exc
    else:
        for name in ("configure_parser", "configure_study_parser"):  # replay, policy-study
            configure = getattr(replay_mod, name, None)
            if callable(configure):
                configure(subparsers)
        return
    message = f"replay is unavailable: {type(error).__name__}: {error}"

    def unavailable(args: argparse.Namespace) -> int:
        print(f"tiering: {message}", file=sys.stderr)
        return EXIT_ERROR

    stub = subparsers.add_parser("replay", help="(unavailable) " + message)
    stub.add_argument("rest", nargs=argparse.REMAINDER)
    stub.set_defaults(func=unavailable)


def _version() -> str:
    try:
        return importlib.metadata.version("tiering")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _log_level(text: str) -> int:
    """A ``--log-level`` value (any case) as a :mod:`logging` level."""
    name = text.strip().lower()
    if name not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"invalid level {text!r}: give one of {', '.join(LOG_LEVELS)}"
        )
    return int(getattr(logging, name.upper()))


def _exit_codes_epilog() -> str:
    lines = ["exit status:"]
    for code, meaning in EXIT_CODES:
        lines += textwrap.wrap(
            meaning, width=88, initial_indent=f"  {code:<5}", subsequent_indent=" " * 7
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tiering",
        description="Tiered KV-cache store: configs, tiers and this machine.",
        epilog=_exit_codes_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an unexpected error"
    )
    parser.add_argument(
        "--log-level",
        type=_log_level,
        default=logging.WARNING,
        metavar="LEVEL",
        help=f"log records of tiering at this level and above to stderr: {', '.join(LOG_LEVELS)} "
        "(default warning)",
    )
    parser.add_argument("--version", action="version", version=f"tiering {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    config = commands.add_parser("config", help="check a config file or print its schema")
    config_commands = config.add_subparsers(dest="config_command", metavar="ACTION")
    check = config_commands.add_parser(
        "check", help="validate a YAML config and summarize its tiers"
    )
    check.add_argument("file", metavar="FILE", help="the YAML config")
    check.add_argument(
        "--json", action="store_true", help="print one JSON object (docs/cli.md), not text"
    )
    check.set_defaults(func=cmd_config_check)
    schema = config_commands.add_parser("schema", help="print the config's JSON Schema")
    schema.set_defaults(func=cmd_config_schema)
    config.set_defaults(func=lambda _args: _usage(config))

    inspect = commands.add_parser(
        "inspect",
        help="count and verify the blocks of each secondary tier (changes nothing)",
        description=(
            "Read each secondary tier of the config without changing anything: report its "
            "blocks, bytes used and capacity, then read every block back and verify it. A "
            "block that fails verification is reported, not removed. A tier written for "
            "another block layout (model, block size) is reported, and its blocks verified "
            "against the layout on disk. A tier that a running engine has open is reported "
            "as in use. Exits 1 if any block was corrupt or unreadable, or a tier holds "
            "another layout or could not be read."
        ),
    )
    inspect.add_argument("--config", required=True, metavar="FILE", help="the YAML config")
    inspect.add_argument("--tier", metavar="NAME", help="only this tier")
    inspect.add_argument("--json", action="store_true", help="print a JSON report")
    inspect.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    inspect.add_argument(
        "--batch-blocks",
        type=_positive_int,
        default=64,
        metavar="N",
        help="blocks read per batch (default 64)",
    )
    inspect.set_defaults(func=cmd_inspect)

    doctor = commands.add_parser(
        "doctor",
        help="check what this machine supports (OK / WARN / FAIL)",
        description=(
            "Check Python, torch, CUDA, pinned memory, LMDB, xxhash, CPUs and /dev/shm; with "
            "--config, also O_DIRECT and free space on each tier's path, and whether each "
            "tier's directory is tiering's and holds the configured layout. Exits 1 on a FAIL."
        ),
    )
    doctor.add_argument("--config", metavar="FILE", help="also check this config's tier paths")
    doctor.add_argument(
        "--json", action="store_true", help="print one JSON object (docs/cli.md), not text"
    )
    doctor.set_defaults(func=cmd_doctor)

    wipe = commands.add_parser(
        "wipe",
        help="delete tiering's own files from each tier's directory",
        description=(
            "Delete the files tiering created in each secondary tier's directory (the "
            "directory's tiering marker says it is tiering's), then the directory if that "
            "left it empty. Files tiering did not create are kept and listed. A directory "
            "that is not tiering's is refused, untouched."
        ),
    )
    wipe.add_argument("--config", required=True, metavar="FILE", help="the YAML config")
    wipe.add_argument("--tier", metavar="NAME", help="only this tier")
    wipe.set_defaults(func=cmd_wipe)

    _add_replay(commands)
    parser.set_defaults(func=lambda _args: _usage(parser))
    return parser


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return EXIT_ERROR


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on --help and on bad arguments
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    with _logging_to_stderr(args.log_level):
        return _run(args)


@contextlib.contextmanager
def _logging_to_stderr(level: int) -> Iterator[None]:
    """Send the ``tiering`` loggers' records at ``level`` and above to stderr while a command
    runs, then put the logger back as it was (``main`` may run many times in one process)."""
    logger = logging.getLogger("tiering")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("tiering: %(levelname)s: %(name)s: %(message)s"))
    saved = (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False  # the command's stderr is the one place its records go
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


def _run(args: argparse.Namespace) -> int:
    try:
        status: int = args.func(args)
        return status
    except KeyboardInterrupt:
        print("tiering: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (TieringError, OSError) as exc:
        if args.debug:
            raise
        print(f"tiering: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except Exception as exc:
        if args.debug:
            raise
        print(
            f"tiering: unexpected {type(exc).__name__}: {exc} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return EXIT_UNEXPECTED


if __name__ == "__main__":
    raise SystemExit(main())
