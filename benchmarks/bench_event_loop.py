"""Event-loop lag while the tiers run at full speed.

An asyncio program drives a TieringOffloadingManager (CPU + file + LMDB tiers, write-through)
as fast as the tiers take it: stores that cascade to both tiers (pausing 1 ms, like an engine
step, only while every tier's job slots are full), and lookups of evicted blocks that promote
them back (``lookup_async``). Two heartbeat tasks sleep 1 ms in a loop and record how late they
wake: one on the program's own loop (the engine's), one on the manager's private I/O loop. Lag
p99 must stay under 5 ms: disk and LMDB I/O never run on either loop.

Usage: python benchmarks/bench_event_loop.py [--quick] [--dir DIR] [--block-kib N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from tiering.config import build_manager, build_pool, parse_config
from tiering.core.keys import make_offload_key

TICK_S = 0.001


async def _heartbeat(lags: list[float], stop: asyncio.Event) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        await asyncio.sleep(TICK_S)
        lags.append(time.perf_counter() - start - TICK_S)


def _percentiles(lags: list[float]) -> dict[str, float]:
    values = np.asarray(lags) * 1e3
    return {
        "p50_ms": round(float(np.percentile(values, 50)), 3),
        "p99_ms": round(float(np.percentile(values, 99)), 3),
        "max_ms": round(float(values.max()), 3),
        "samples": len(lags),
    }


async def _drive(directory: Path, block_kib: int, seconds: float) -> dict[str, object]:
    config = parse_config(
        {
            "version": 1,
            "model": {"shape": "tiny"},
            "primary": {"capacity": "64MiB", "policy": "lru"},
            "secondary_tiers": [
                {"name": "nvme", "type": "file", "capacity": "512MiB", "path": "nvme"},
                {"name": "lmdb", "type": "lmdb", "capacity": "512MiB", "path": "lmdb"},
            ],
        },
        source=str(directory / "bench.yaml"),
        base_dir=directory,
        env={},
    )
    block_bytes = block_kib << 10
    pool = build_pool(config, block_bytes=block_bytes)
    manager = build_manager(config, block_bytes=block_bytes, fingerprint=b"\0" * 16, pool=pool)
    stop = asyncio.Event()
    own_lags: list[float] = []
    io_lags: list[float] = []
    io_stop = asyncio.Event()
    beat = asyncio.create_task(_heartbeat(own_lags, stop))
    io_beat = manager._io.submit(_heartbeat(io_lags, io_stop))  # the manager's own loop
    stored = promoted = 0
    try:
        async with manager:
            deadline = time.perf_counter() + seconds
            i = 0
            while time.perf_counter() < deadline:
                keys = [make_offload_key(n.to_bytes(8, "big"), 0) for n in range(i, i + 8)]
                i += 8
                out = manager.prepare_store(keys)
                if out is not None:
                    manager.complete_store(keys)
                    stored += len(keys)
                # An old block: evicted from the CPU tier by now, so it comes back from a tier.
                if i > 4096:
                    old = make_offload_key((i - 4096).to_bytes(8, "big"), 0)
                    if await manager.lookup_async(old):
                        promoted += 1
                # An engine step: when every tier already has its job slots full, more stores
                # would only be shed, so the driver paces itself instead of spinning the GIL.
                if all(t.inflight_jobs >= t.max_inflight_jobs for t in manager.tiers):
                    await asyncio.sleep(0.001)
                else:
                    await asyncio.sleep(0)
            await manager.drain()
            metrics = manager.metrics()
            manager._io.loop.call_soon_threadsafe(io_stop.set)
            await asyncio.wrap_future(io_beat)
    finally:
        stop.set()
        await beat
    return {
        "block_kib": block_kib,
        "seconds": seconds,
        "blocks_stored": stored,
        "blocks_promoted": promoted,
        "file_bytes_written": metrics["nvme"]["bytes_written"],
        "lmdb_bytes_written": metrics["lmdb"]["bytes_written"],
        "engine_loop": _percentiles(own_lags),
        "io_loop": _percentiles(io_lags),
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 s instead of 15 s")
    parser.add_argument("--dir", type=Path, help="where the tiers live (default: a temp dir)")
    parser.add_argument("--block-kib", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as engines do after startup: see docs/benchmarks.md
    seconds = 3.0 if args.quick else 15.0
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        row = asyncio.run(_drive(Path(tmp), args.block_kib, seconds))
    engine, io = row["engine_loop"], row["io_loop"]
    assert isinstance(engine, dict) and isinstance(io, dict)
    print("| loop | p50 lag ms | p99 lag ms | max lag ms | samples |")
    print("|---|---:|---:|---:|---:|")
    for name, lag in (("engine (caller's) loop", engine), ("manager I/O loop", io)):
        print(
            f"| {name} | {lag['p50_ms']} | {lag['p99_ms']} | {lag['max_ms']} | {lag['samples']} |"
        )
    written = int(row["file_bytes_written"]) + int(row["lmdb_bytes_written"])  # type: ignore[call-overload]
    print(
        f"\nwhile storing {row['blocks_stored']} blocks of {args.block_kib} KiB "
        f"({written / seconds / 1e9:.2f} GB/s to the tiers) and promoting "
        f"{row['blocks_promoted']} in {seconds:.0f} s"
    )
    return [row]


if __name__ == "__main__":
    main()
