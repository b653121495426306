"""GPU <-> pinned CPU block transfers: every copy strategy against the PCIe limit, same run.

Geometry (issue 10): llama-3-8b's KV cache, 32 layers of FlashAttention ``(2, num_blocks, 16,
8, 128)`` bf16: 32 KiB per K or V page, 2 MiB per offloaded block (64 pages). Each job moves
N random engine blocks to (store) or from (load) N random slots of a pinned ``CPUBlockPool``
through a :class:`TransferEngine` with one strategy.

Tables (GB/s = 1e9 bytes per second, median over repetitions):

* transfers: per block count (8 / 32 / 256 / 1024) the limit, one contiguous pinned copy of
  the same bytes (device to host for stores, host to device for loads), then per strategy
  store and load GB/s from ``submit_*`` to the handle's completion, their ratio to the limit,
  and the time ``submit_*`` held the caller (ms);
* overlap: bf16 matmuls on the default stream alone, then while stores (and then loads) of
  1024 blocks run on the engine's stream: matmul slowdown and the transfer GB/s meanwhile;
  ``auto`` (what an engine gets by default: per direction, see tiering.transfer.select) is
  measured here and in the transfers table besides the strategies named;
* pages: 256 blocks for pages of 4 to 64 KiB (1 to 16 KV heads), store and load per strategy
  against the limit;
* triton programs: the Triton kernel's ``max_programs`` at 256 blocks.

Targets (issue 10), as ratios to the limit: >= 0.9 from 32 blocks, >= 0.8 at 8 blocks, >= 0.85
at 256 blocks for every page size, caller blocked <= 0.3 ms at 256 blocks, >= 1.2x
batched_memcpy at 32 blocks, matmul slowdown <= 25 %.

Without CUDA it prints that nothing was measured and exits 0. ``--device cpu`` runs the same
code on CPU caches with a small geometry (a smoke test of the benchmark, not a measurement).

Usage: python benchmarks/bench_gpu_transfer.py [--quick] [--blocks 8 32 256 1024]
       [--num-blocks 4096] [--strategies triton batched_memcpy staging torch] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.layout import register_kv_caches
from tiering.managers.pool import CPUBlockPool
from tiering.transfer import PoolTransfer, StrategyOptions, TransferEngine
from tiering.transfer.batched_memcpy import find_batched_memcpy
from tiering.transfer.triton_copy import load_kernel

LAYERS, BLOCK_TOKENS, HEADS, HEAD_DIM = 32, 16, 8, 128
GPU_STRATEGIES = ("triton", "batched_memcpy", "staging", "torch")
CPU_STRATEGIES = ("memmove", "staging", "torch")


class Bench:
    """One geometry: engine KV tensors, a pinned pool and the contiguous buffers of the limit."""

    def __init__(
        self, device: torch.device, layers: int, heads: int, num_blocks: int, pool_slots: int
    ) -> None:
        self.device = device
        self.num_blocks = num_blocks
        names = [f"layer.{i}" for i in range(layers)]
        shape = (2, num_blocks, BLOCK_TOKENS, heads, HEAD_DIM)
        self.kv = {n: torch.empty(shape, dtype=torch.bfloat16, device=device) for n in names}
        for tensor in self.kv.values():
            tensor.view(torch.int16).random_()
        page = 2 * BLOCK_TOKENS * heads * HEAD_DIM * 2
        group = KVCacheGroup(
            GroupKind.FULL_ATTENTION, BLOCK_TOKENS, (page,) * layers, layer_names=tuple(names)
        )
        spec = KVCacheSpec((group,), BLOCK_TOKENS)
        self.caches = register_kv_caches(self.kv, spec, num_blocks)
        self.block_bytes = self.caches.offloaded_block_bytes_per_rank()
        self.page_bytes = page // 2
        self.pool = CPUBlockPool(pool_slots, self.block_bytes, pin_memory=device.type == "cuda")
        self.device_flat = torch.empty(
            pool_slots * self.block_bytes, dtype=torch.uint8, device=device
        )
        self.rng = np.random.default_rng(0)

    def job(self, n: int) -> PoolTransfer:
        ids = self.rng.choice(np.arange(1, self.num_blocks), size=n, replace=False)
        slots = self.rng.choice(np.arange(self.pool.num_blocks), size=n, replace=False)
        return PoolTransfer(ids.astype(np.int64), (n,), slots.astype(np.int64))

    def limit_gbps(self, nbytes: int, reps: int, to_host: bool) -> float:
        """One contiguous copy of ``nbytes`` between the device and the pinned pool rows."""
        host = self.pool.rows_view().view(-1)[:nbytes]
        dev = self.device_flat[:nbytes]

        def copy() -> None:
            dst, src = (host, dev) if to_host else (dev, host)
            dst.copy_(src, non_blocking=True)

        return nbytes / median_s(copy, reps, self.sync) / 1e9

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        self.pool.close()


def median_s(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def transfer_gbps(
    engine: TransferEngine, job: PoolTransfer, store: bool, reps: int, sync: Callable[[], None]
) -> tuple[float, float]:
    """Median GB/s from submit to completion, and median ms that submit held the caller."""
    submit = engine.submit_store if store else engine.submit_load
    engine.wait(submit(job))  # warm-up
    walls, blocked = [], []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        handle = submit(job)
        submitted = time.perf_counter()
        engine.wait(handle)
        done = time.perf_counter()
        if handle.error is not None:
            raise handle.error
        walls.append(done - start)
        blocked.append(submitted - start)
    return handle.bytes / statistics.median(walls) / 1e9, statistics.median(blocked) * 1e3


def available(strategies: Sequence[str], device: torch.device) -> list[str]:
    out = []
    for name in strategies:
        if name == "triton" and load_kernel()[0] is None:
            print(f"(triton unavailable: {load_kernel()[1]})", file=sys.stderr)
            continue
        if name == "batched_memcpy" and find_batched_memcpy().function is None:
            print(f"(batched_memcpy unavailable: {find_batched_memcpy().reason})", file=sys.stderr)
            continue
        if name == "memmove" and device.type != "cpu":
            continue
        out.append(name)
    return out


def engine_for(
    bench: Bench, strategy: str, options: StrategyOptions | None = None
) -> TransferEngine:
    return TransferEngine(bench.caches, bench.pool, copy_backend=strategy, options=options)  # type: ignore[arg-type]


def transfers_table(
    bench: Bench, strategies: Sequence[str], blocks: Sequence[int], reps: int
) -> list[dict[str, Any]]:
    rows = []
    engines = {name: engine_for(bench, name) for name in strategies}
    for n in blocks:
        job = bench.job(n)
        nbytes = n * bench.block_bytes
        limit_store = bench.limit_gbps(nbytes, reps, to_host=True)
        limit_load = bench.limit_gbps(nbytes, reps, to_host=False)
        for name, engine in engines.items():
            store, store_ms = transfer_gbps(engine, job, True, reps, bench.sync)
            load, load_ms = transfer_gbps(engine, job, False, reps, bench.sync)
            rows.append(
                {
                    "blocks": n,
                    "strategy": name,
                    "limit_store_gbps": limit_store,
                    "limit_load_gbps": limit_load,
                    "store_gbps": store,
                    "load_gbps": load,
                    "store_ratio": store / limit_store,
                    "load_ratio": load / limit_load,
                    "store_blocked_ms": store_ms,
                    "load_blocked_ms": load_ms,
                }
            )
    for engine in engines.values():
        engine.close()
    return rows


def print_transfers(rows: list[dict[str, Any]], block_bytes: int) -> None:
    print(f"Blocks of {block_bytes >> 10} KiB; GB/s, ratio to the limit, caller blocked (ms).")
    print()
    print(
        "| blocks | strategy | limit store / load | store | load | store/limit | load/limit "
        "| blocked store / load ms |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['blocks']} | {r['strategy']} | {r['limit_store_gbps']:.1f} / "
            f"{r['limit_load_gbps']:.1f} | {r['store_gbps']:.1f} | {r['load_gbps']:.1f} | "
            f"{r['store_ratio']:.2f} | {r['load_ratio']:.2f} | {r['store_blocked_ms']:.3f} / "
            f"{r['load_blocked_ms']:.3f} |"
        )
    by = {(r["blocks"], r["strategy"]): r for r in rows}
    for n in sorted({r["blocks"] for r in rows}):
        triton, batch = by.get((n, "triton")), by.get((n, "batched_memcpy"))
        if triton and batch:
            print()
            print(
                f"triton / batched_memcpy at {n} blocks: store "
                f"{triton['store_gbps'] / batch['store_gbps']:.2f}x, load "
                f"{triton['load_gbps'] / batch['load_gbps']:.2f}x"
            )


def overlap_table(
    bench: Bench, strategies: Sequence[str], n: int, jobs: int
) -> list[dict[str, Any]]:
    """Matmul time on the default stream alone and while transfers run on the engine's."""
    size = 8192 if bench.device.type == "cuda" else 256
    a = torch.randn((size, size), dtype=torch.bfloat16, device=bench.device)
    matmuls = 20

    def compute() -> None:
        for _ in range(matmuls):
            torch.mm(a, a)

    def timed_compute() -> float:
        """Seconds the matmuls take on the default stream (CUDA events; no device sync)."""
        if bench.device.type != "cuda":
            start = time.perf_counter()
            compute()
            return time.perf_counter() - start
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record()
        compute()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3

    compute()
    bench.sync()
    alone_s = statistics.median(timed_compute() for _ in range(3))
    rows = []
    for name in strategies:
        engine = engine_for(bench, name)
        job = bench.job(n)
        for store in (True, False):
            submit = engine.submit_store if store else engine.submit_load
            engine.wait(submit(job))
            bench.sync()
            start = time.perf_counter()
            handles = [submit(job) for _ in range(jobs)]  # queued before the matmuls
            compute_s = timed_compute()
            compute_done = time.perf_counter() - start
            for handle in handles:
                engine.wait(handle)
            transfer_s = time.perf_counter() - start
            nbytes = sum(h.bytes for h in handles)
            rows.append(
                {
                    "strategy": name,
                    "direction": "store" if store else "load",
                    "matmul_alone_ms": alone_s * 1e3,
                    "matmul_with_transfers_ms": compute_s * 1e3,
                    "slowdown": compute_s / alone_s - 1,
                    "transfer_gbps": nbytes / transfer_s / 1e9,
                    "transfer_covers_matmuls": transfer_s >= compute_done,
                }
            )
        engine.close()
    return rows


def print_overlap(rows: list[dict[str, Any]], n: int, jobs: int, block_bytes: int) -> None:
    print()
    print(
        f"Overlap: 20 bf16 matmuls on the default stream, alone and while {jobs} jobs of {n} "
        f"blocks ({jobs * n * block_bytes / 2**30:.1f} GiB) run on the engine's stream."
    )
    print()
    print(
        "| strategy | direction | matmuls alone ms | with transfers ms | slowdown | transfer GB/s |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        covered = "" if r["transfer_covers_matmuls"] else " (transfers ended first)"
        print(
            f"| {r['strategy']} | {r['direction']} | {r['matmul_alone_ms']:.1f} | "
            f"{r['matmul_with_transfers_ms']:.1f} | {r['slowdown']:.0%}{covered} | "
            f"{r['transfer_gbps']:.1f} |"
        )


def pages_table(
    device: torch.device,
    strategies: Sequence[str],
    layers: int,
    heads_list: Sequence[int],
    n: int,
    num_blocks: int,
    reps: int,
) -> list[dict[str, Any]]:
    rows = []
    for heads in heads_list:
        bench = Bench(device, layers, heads, num_blocks, n)
        job = bench.job(n)
        nbytes = n * bench.block_bytes
        limit_store = bench.limit_gbps(nbytes, reps, to_host=True)
        limit_load = bench.limit_gbps(nbytes, reps, to_host=False)
        for name in strategies:
            engine = engine_for(bench, name)
            store, _ = transfer_gbps(engine, job, True, reps, bench.sync)
            load, _ = transfer_gbps(engine, job, False, reps, bench.sync)
            engine.close()
            rows.append(
                {
                    "page_kib": bench.page_bytes / 1024,
                    "strategy": name,
                    "limit_store_gbps": limit_store,
                    "limit_load_gbps": limit_load,
                    "store_ratio": store / limit_store,
                    "load_ratio": load / limit_load,
                    "store_gbps": store,
                    "load_gbps": load,
                }
            )
        bench.close()
        del bench
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def print_pages(rows: list[dict[str, Any]], n: int) -> None:
    print()
    print(f"Page sizes: {n} blocks, K and V pages of every layer; GB/s and ratio to the limit.")
    print()
    print("| page | strategy | limit store / load | store | load | store/limit | load/limit |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['page_kib']:g} KiB | {r['strategy']} | {r['limit_store_gbps']:.1f} / "
            f"{r['limit_load_gbps']:.1f} | {r['store_gbps']:.1f} | {r['load_gbps']:.1f} | "
            f"{r['store_ratio']:.2f} | {r['load_ratio']:.2f} |"
        )


def programs_table(
    bench: Bench, n: int, reps: int, programs: Sequence[int]
) -> list[dict[str, Any]]:
    job = bench.job(n)
    nbytes = n * bench.block_bytes
    limit = bench.limit_gbps(nbytes, reps, to_host=True)
    rows = []
    for count in programs:
        engine = engine_for(bench, "triton", StrategyOptions(triton_max_programs=count))
        store, blocked = transfer_gbps(engine, job, True, reps, bench.sync)
        load, _ = transfer_gbps(engine, job, False, reps, bench.sync)
        engine.close()
        rows.append(
            {
                "programs": count,
                "store_ratio": store / limit,
                "load_gbps": load,
                "store_gbps": store,
            }
        )
    print()
    print(f"Triton kernel programs ({n} blocks; store limit {limit:.1f} GB/s):")
    print()
    print("| programs | store GB/s | store/limit | load GB/s |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['programs']} | {r['store_gbps']:.1f} | {r['store_ratio']:.2f} | "
            f"{r['load_gbps']:.1f} |"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and sizes")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--blocks", type=int, nargs="+", default=None)
    parser.add_argument("--num-blocks", type=int, default=None, help="engine blocks allocated")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--strategies", nargs="+", default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--json", default=None, help="also write every row to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            f"Not measured: no CUDA device here (torch {torch.__version__}). Run "
            "`python benchmarks/bench_gpu_transfer.py` on a machine with an NVIDIA GPU."
        )
        return 0
    on_gpu = device.type == "cuda"
    reps = args.reps or (3 if args.quick else 7)
    gpu_blocks = [32, 256] if args.quick else [8, 32, 256, 1024]
    blocks = args.blocks or (gpu_blocks if on_gpu else [8, 16])
    num_blocks = args.num_blocks or (4096 if on_gpu else 64)
    default = GPU_STRATEGIES if on_gpu else CPU_STRATEGIES
    strategies = available(args.strategies or default, device)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    name = torch.cuda.get_device_name(device) if on_gpu else "CPU"
    print(f"Device: {name}; torch {torch.__version__}; strategies: {', '.join(strategies)}.")
    print()
    out: dict[str, Any] = {"device": name}
    bench = Bench(device, args.layers, HEADS, num_blocks, 2 * max(blocks))
    # The default, auto, chooses per direction: measured as an engine gets it.
    with_auto = ["auto", *strategies] if "auto" not in strategies else strategies
    strategies = [s for s in strategies if s != "auto"]
    out["transfers"] = transfers_table(bench, with_auto, blocks, reps)
    print_transfers(out["transfers"], bench.block_bytes)
    overlap_blocks = max(blocks)
    jobs = 4 if on_gpu else 1
    out["overlap"] = overlap_table(bench, with_auto, overlap_blocks, jobs)
    print_overlap(out["overlap"], overlap_blocks, jobs, bench.block_bytes)
    if on_gpu and "triton" in strategies:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        counts = sorted({8, 16, 32, 64, sms, 2 * sms})
        out["programs"] = programs_table(bench, 256, reps, counts)
    bench.close()
    del bench
    gc.collect()
    heads_list = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16)
    page_blocks = 256 if on_gpu else 8
    out["pages"] = pages_table(
        device, strategies, args.layers, heads_list, page_blocks, 2048 if on_gpu else 32, reps
    )
    print_pages(out["pages"], page_blocks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
