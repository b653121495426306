"""Tuning the Triton page kernel's launch constants on a GPU (issue 28): programs, warps, the
bytes a program moves per iteration and the chunk size, per direction and page size; the
matmul slowdown each costs; and where a 256-block submit spends the caller's time.

Not part of ``make bench``: it answers "which constants", and docs/benchmarks.md records the
answer next to the GPU section. Usage: ``python benchmarks/tune_gpu_transfer.py [--quick]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Sequence

import torch
from bench_gpu_transfer import HEADS, LAYERS, Bench, engine_for, transfer_gbps

from tiering.transfer import StrategyOptions, TransferEngine, triton_copy


def tuned(bench: Bench, programs: int, warps: int, chunk_kib: int) -> TransferEngine:
    engine = engine_for(bench, "triton", StrategyOptions(programs, chunk_kib << 10))
    for lane in engine._lanes.values():
        lane.strategy._num_warps = warps  # type: ignore[attr-defined]
    return engine


def sweep(reps: int, quick: bool, programs_list: Sequence[int]) -> None:
    print("| page KiB | programs | warps | iter KiB | chunk KiB | store/limit | load/limit |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    settings = [
        (p, w, it, ch) for p in programs_list for w in (4, 8) for it in (8, 16) for ch in (64,)
    ] + [(132, 8, 16, 256), (264, 8, 16, 256), (264, 4, 8, 16)]
    for heads in (1, 4, 8) if quick else (1, 2, 4, 8, 16):
        bench = Bench(torch.device("cuda"), LAYERS, heads, 2048, 256)
        job = bench.job(256)
        nbytes = 256 * bench.block_bytes
        limit_store = bench.limit_gbps(nbytes, reps, to_host=True)
        limit_load = bench.limit_gbps(nbytes, reps, to_host=False)
        for programs, warps, iter_kib, chunk_kib in settings:
            triton_copy._BLOCK_BYTES = iter_kib << 10
            engine = tuned(bench, programs, warps, chunk_kib)
            store, _ = transfer_gbps(engine, job, True, reps, bench.sync)
            load, _ = transfer_gbps(engine, job, False, reps, bench.sync)
            engine.close()
            print(
                f"| {bench.page_bytes >> 10} | {programs} | {warps} | {iter_kib} | {chunk_kib} | "
                f"{store / limit_store:.2f} | {load / limit_load:.2f} |",
                flush=True,
            )
        bench.close()
        torch.cuda.empty_cache()
    triton_copy._BLOCK_BYTES = 8 << 10


def overlap_as_bench(programs_list: Sequence[int]) -> None:
    """bench_gpu_transfer's own overlap table, with the Triton kernel at other program counts."""
    import bench_gpu_transfer as bench_module

    bench = Bench(torch.device("cuda"), LAYERS, HEADS, 4096, 2048)
    for programs in programs_list:
        bench_module.engine_for = lambda b, name, options=None, p=programs: engine_for(  # type: ignore[misc]
            b, name, StrategyOptions(p)
        )
        rows = bench_module.overlap_table(bench, ["triton"], 1024, 4)
        for r in rows:
            print(
                f"| {programs} | {r['direction']} | {r['matmul_alone_ms']:.1f} | "
                f"{r['matmul_with_transfers_ms']:.1f} | {r['slowdown']:.0%} | "
                f"{r['transfer_gbps']:.1f} |",
                flush=True,
            )
    bench.close()


def overlap(programs_list: Sequence[int]) -> None:
    bench = Bench(torch.device("cuda"), LAYERS, HEADS, 4096, 2048)
    a = torch.randn((8192, 8192), dtype=torch.bfloat16, device="cuda")

    def timed() -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(20):
            torch.mm(a, a)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)

    timed()
    alone = statistics.median(timed() for _ in range(5))
    print()
    print(f"Matmuls alone: {alone:.1f} ms. Slowdown while 4 jobs of 1024 blocks run:")
    print()
    print("| programs | warps | store slowdown | store GB/s | load slowdown | load GB/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    for programs in programs_list:
        for warps in (4, 8):
            engine = tuned(bench, programs, warps, 64)
            cells = []
            for store in (True, False):
                submit = engine.submit_store if store else engine.submit_load
                job = bench.job(1024)
                engine.wait(submit(job))
                torch.cuda.synchronize()
                start = time.perf_counter()
                handles = [submit(job) for _ in range(4)]
                with_ms = timed()
                for h in handles:
                    engine.wait(h)
                gbps = sum(h.bytes for h in handles) / (time.perf_counter() - start) / 1e9
                cells += [f"{with_ms / alone - 1:.0%}", f"{gbps:.1f}"]
            engine.close()
            print(f"| {programs} | {warps} | {' | '.join(cells)} |", flush=True)
    bench.close()


def blocked() -> None:
    bench = Bench(torch.device("cuda"), LAYERS, HEADS, 4096, 512)
    engine = engine_for(bench, "triton")
    job = bench.job(256)
    for _ in range(3):
        engine.wait(engine.submit_store(job))
    profile = cProfile.Profile()
    walls = []
    for _ in range(20):
        torch.cuda.synchronize()
        start = time.perf_counter()
        profile.enable()
        handle = engine.submit_store(job)
        profile.disable()
        walls.append(time.perf_counter() - start)
        engine.wait(handle)
    print()
    print(f"256-block store submit: median {statistics.median(walls) * 1e3:.3f} ms held")
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(12)
    print("```")
    print(text.getvalue().strip())
    print("```")
    engine.close()
    bench.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--programs", type=int, nargs="+", default=[16, 32, 132, 264])
    parser.add_argument("--only", choices=["sweep", "overlap"], default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("Not measured: no CUDA device here.")
        return 0
    print(f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    print()
    if args.only is None:
        blocked()
        overlap((8, 16, 32, 132, 264))
    if args.only in (None, "overlap"):
        print("| programs | direction | matmuls alone ms | with transfers ms | slowdown | GB/s |")
        print("|---:|---|---:|---:|---:|---:|")
        overlap_as_bench(args.programs)
    print()
    if args.only in (None, "sweep"):
        sweep(args.reps, args.quick, args.programs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
