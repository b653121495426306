"""``tiering doctor``: what this machine supports, one check a line (OK / WARN / FAIL).

Python, torch, CUDA, pinned memory, LMDB, xxhash, the CPUs, /dev/shm and the GPU <-> CPU copy
strategy; with a config, also O_DIRECT and free space on each tier's path, the model's
identity, and whether each tier's directory is tiering's and holds the configured layout.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

from tiering.cli.checks import FAIL, OK, WARN, Check, checks_document
from tiering.cli.config_checks import directory_checks, model_identity_checks
from tiering.cli.exits import EXIT_ERROR, EXIT_FINDINGS, EXIT_OK
from tiering.cli.loading import load_config_file
from tiering.cli.output import format_bytes, print_json
from tiering.config import TieringConfig, check_tier_directories
from tiering.errors import TieringError
from tiering.transfer import machine_choice

_PROBE_BYTES = 4096


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
        checks += model_identity_checks(config)
        checks += _tier_checks(config)
        checks += directory_checks(config, check_tier_directories(config))
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    try:
        config = None if args.config is None else load_config_file(args.config)
    except (TieringError, OSError) as exc:
        if args.json:  # the document, then the usual one-line error on stderr (exit 2)
            checks = [Check("config", FAIL, str(exc))]
            print_json(checks_document("doctor", args.config, checks, EXIT_ERROR))
        raise
    checks = run_doctor(config)
    failed = sum(c.verdict == FAIL for c in checks)
    warned = sum(c.verdict == WARN for c in checks)
    status = EXIT_FINDINGS if failed else EXIT_OK
    if args.json:
        print_json(checks_document("doctor", args.config, checks, status))
        return status
    width = max(len(c.name) for c in checks)
    for c in checks:
        print(f"{c.verdict:<5} {c.name:<{width}}  {c.detail}")
    print(f"{len(checks)} checks: {failed} FAIL, {warned} WARN")
    return status
