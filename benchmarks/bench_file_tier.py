"""FileBackend put/get against the raw batched pwritev/preadv limit, in one run, on one disk.

For each block size (256 KiB, 2 MiB) and each mode (buffered, O_DIRECT), each rep runs:

- raw: ``os.pwritev``/``os.preadv`` of 16 contiguous blocks per call, one thread, between a
  preallocated buffer and one preallocated file (the fastest Python path in ``limits.md`` §3);
- ours: ``FileBackend.put``/``get`` of the same blocks from / into rows of a preallocated torch
  uint8 pool (a memoryview of ``pool[i].numpy()``), with the backend's defaults (2 I/O
  threads: a put's chunks go to both, a get reads on one; chunks of at most 16 slots;
  payload checksums written and verified);
- with O_DIRECT also ours from a pool that starts on a 4096-byte boundary (torch's allocator
  aligns to 64 bytes only, so a plain torch pool goes through the bounce buffer).

"write" goes to the page cache (buffered, no fsync) or to the device (O_DIRECT); "durable
write" (buffered only) is raw pwritev + one fdatasync vs ``put`` with ``durability="fsync"``
(one fdatasync after all the put's writes). Reads are cold: fsync + ``posix_fadvise(DONTNEED)``.
Files are preallocated once per case and overwritten in place by every rep (the backend's
keys are deleted first, so its put reuses the same slots); ``os.sync()`` runs before each
timed write; the order of the paths alternates between reps. Figures are medians over
``--reps``; a ratio is the median of per-rep ratios raw time / our time, each pair measured
back to back (target: >= 0.8). The disk is shared and noisy: compare only within one run.

Usage: python benchmarks/bench_file_tier.py [--quick] [--dir DIR] [--reps N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch

from tiering.backends.base import Outcome
from tiering.backends.file import FileBackend, slot_bytes_for

RAW_BATCH_BLOCKS = 16
FINGERPRINT = bytes(range(16))


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _make_pool(n_blocks: int, block_bytes: int, *, aligned: bool) -> torch.Tensor:
    """A zeroed (n_blocks, block_bytes) uint8 pool; ``aligned`` starts it on a page boundary."""
    if not aligned:
        return torch.zeros((n_blocks, block_bytes), dtype=torch.uint8)
    flat = torch.zeros(n_blocks * block_bytes + 4096, dtype=torch.uint8)
    skip = (-flat.data_ptr()) % 4096
    return flat[skip : skip + n_blocks * block_bytes].view(n_blocks, block_bytes)


def _rows(pool: torch.Tensor) -> list[memoryview]:
    return [pool[i].numpy().data for i in range(pool.shape[0])]  # a memoryview per row


class RawFile:
    """One preallocated file, overwritten in place by every rep (like the backend's slots)."""

    def __init__(self, path: Path, n_blocks: int, block_bytes: int, o_direct: bool) -> None:
        self.path, self.block_bytes, self.o_direct = path, block_bytes, o_direct
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.posix_fallocate(fd, 0, n_blocks * block_bytes)
        finally:
            os.close(fd)

    def _pass(self, views: Sequence[memoryview], *, write: bool, durable: bool) -> float:
        fd = os.open(self.path, os.O_RDWR | (os.O_DIRECT if self.o_direct else 0))
        call = os.pwritev if write else os.preadv
        try:
            start = time.perf_counter()
            for i in range(0, len(views), RAW_BATCH_BLOCKS):
                batch = views[i : i + RAW_BATCH_BLOCKS]
                if call(fd, batch, i * self.block_bytes) != len(batch) * self.block_bytes:
                    raise OSError("short transfer in the raw benchmark")
            if durable:
                os.fdatasync(fd)
            elapsed_s = time.perf_counter() - start
            if write:
                os.fdatasync(fd)  # untimed: the next pass starts with no dirty pages
            return elapsed_s
        finally:
            os.close(fd)

    async def write(self, views: Sequence[memoryview], *, durable: bool = False) -> float:
        os.sync()  # as Ours.write: no one's dirty pages pending when the timing starts
        return self._pass(views, write=True, durable=durable)

    async def read(self, views: Sequence[memoryview]) -> float:
        _drop_cache(self.path)
        return self._pass(views, write=False, durable=False)


class Ours:
    """A FileBackend reused by every rep: each write first deletes the previous rep's keys,
    so the put lands in the same slots again (like the raw file's overwrite)."""

    def __init__(self, path: Path, n_blocks: int, block_bytes: int, **options: Any) -> None:
        self.backend = FileBackend(
            path=path,
            capacity_bytes=n_blocks * slot_bytes_for(block_bytes),
            block_bytes=block_bytes,
            fingerprint=FINGERPRINT,
            **options,
        )
        self.keys = [i.to_bytes(28, "big") + b"\0\0\0\0" for i in range(n_blocks)]

    async def write(self, views: Sequence[memoryview]) -> float:
        await self.backend.delete(self.keys)
        os.sync()
        start = time.perf_counter()
        outcomes = await self.backend.put(self.keys, views)
        elapsed_s = time.perf_counter() - start
        if set(outcomes) != {Outcome.OK}:
            raise AssertionError(f"put failed: {set(outcomes)}")
        return elapsed_s

    async def read(self, views: Sequence[memoryview]) -> float:
        _drop_cache(self.backend.slots_path)
        start = time.perf_counter()
        outcomes = await self.backend.get(self.keys, views)
        elapsed_s = time.perf_counter() - start
        if set(outcomes) != {Outcome.OK}:
            raise AssertionError(f"get failed: {set(outcomes)}")
        return elapsed_s


def _o_direct_supported(workdir: Path) -> bool:
    path = workdir / "probe.bin"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwrite(fd, mmap.mmap(-1, 4096), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink()


def _ratio_quartiles(raw_s: list[float], ours_s: list[float]) -> tuple[float, float, float]:
    """Quartiles (q1, median, q3) over reps of raw time / our time (pairs back to back)."""
    ratios = [r / t for r, t in zip(raw_s, ours_s, strict=True)]
    if len(ratios) < 2:
        return ratios[0], ratios[0], ratios[0]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return q1, median, q3


RAW = "raw pwritev/preadv x16"


async def run_case(
    workdir: Path, block_bytes: int, n_blocks: int, reps: int, o_direct: bool
) -> list[dict[str, object]]:
    src = _make_pool(n_blocks, block_bytes, aligned=True)
    src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8))
    pools = {True: src, False: src.clone()}  # clone: a plain torch allocation (64-byte aligned)
    raw = RawFile(workdir / "raw.bin", n_blocks, block_bytes, o_direct)
    # name -> (target, pool is page-aligned)
    targets: dict[str, tuple[RawFile | Ours, bool]] = {
        RAW: (raw, True),
        "FileBackend, torch pool": (
            Ours(workdir / "ours", n_blocks, block_bytes, o_direct=o_direct),
            False,
        ),
    }
    if o_direct:
        aligned = Ours(workdir / "ours-aligned", n_blocks, block_bytes, o_direct=True)
        targets["FileBackend, page-aligned pool"] = (aligned, True)
    durable = (
        None if o_direct else Ours(workdir / "durable", n_blocks, block_bytes, durability="fsync")
    )
    for target, _ in targets.values():
        if isinstance(target, Ours):
            await target.backend.open()
    if durable is not None:
        await durable.backend.open()
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for rep in range(reps):
            order = list(targets.items())
            for name, (target, page_aligned) in order if rep % 2 == 0 else order[::-1]:
                dst = _make_pool(n_blocks, block_bytes, aligned=page_aligned)
                times.setdefault((name, "write"), []).append(
                    await target.write(_rows(pools[page_aligned]))
                )
                times.setdefault((name, "read"), []).append(await target.read(_rows(dst)))
                if not torch.equal(dst, src):
                    raise AssertionError(f"{name} read back different bytes")
            if durable is not None:
                times.setdefault((RAW, "durable"), []).append(
                    await raw.write(_rows(src), durable=True)
                )
                times.setdefault(("FileBackend, torch pool", "durable"), []).append(
                    await durable.write(_rows(pools[False]))
                )
    finally:
        for target, _ in targets.values():
            if isinstance(target, Ours):
                await target.backend.close()
        if durable is not None:
            await durable.backend.close()
    total_bytes = n_blocks * block_bytes
    rows: list[dict[str, object]] = []
    for name in targets:
        row: dict[str, object] = {
            "block_kib": block_bytes // 1024,
            "blocks": n_blocks,
            "mode": "O_DIRECT" if o_direct else "buffered",
            "path": name,
        }
        for kind in ("write", "durable", "read"):
            if (name, kind) in times:
                row[f"{kind}_gbs"] = total_bytes / statistics.median(times[name, kind]) / 1e9
                row[f"{kind}_ratio"] = _ratio_quartiles(times[RAW, kind], times[name, kind])
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, object]]) -> None:
    print(
        "| block | blocks | mode | path | write GB/s (x raw) | durable write GB/s (x raw) "
        "| cold read GB/s (x raw) |"
    )
    print("|---|---|---|---|---|---|---|")

    def cell(row: dict[str, object], kind: str) -> str:
        if f"{kind}_gbs" not in row:
            return "-"
        q1, median, q3 = cast("tuple[float, float, float]", row[f"{kind}_ratio"])
        if row["path"] == RAW:
            return f"{row[f'{kind}_gbs']:.2f}"
        return f"{row[f'{kind}_gbs']:.2f} ({median:.2f}; {q1:.2f}-{q3:.2f})"

    for r in rows:
        print(
            f"| {r['block_kib']} KiB | {r['blocks']} | {r['mode']} | {r['path']} "
            f"| {cell(r, 'write')} | {cell(r, 'durable')} | {cell(r, 'read')} |"
        )


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description="FileBackend vs raw pwritev/preadv")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller runs")
    parser.add_argument("--dir", type=Path, default=None, help="a directory on the disk to test")
    parser.add_argument("--reps", type=int, default=None, help="runs per figure (median)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as engines do after startup: see docs/benchmarks.md
    reps = args.reps or (3 if args.quick else 7)
    # (block bytes, blocks): 250 MiB and 512 MiB per pass; --quick moves 32 MiB and 64 MiB.
    cases = [(256 << 10, 128), (2 << 20, 32)] if args.quick else [(256 << 10, 1000), (2 << 20, 256)]
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_file_tier.") as tmp:
        workdir = Path(tmp)
        modes = [False, True] if _o_direct_supported(workdir) else [False]
        for block_bytes, n_blocks in cases:
            for o_direct in modes:
                rows += asyncio.run(run_case(workdir, block_bytes, n_blocks, reps, o_direct))
                for leftover in workdir.iterdir():  # start the next case on an empty directory
                    shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
    print(
        f"median of {reps} reps; (x raw) = median of per-rep ratios raw time / our time; "
        "then their interquartile range"
    )
    print_table(rows)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
