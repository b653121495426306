"""The drop-in's scheduler-side cost against vLLM 0.33's own manager, per connector step.

vLLM's connector calls its manager on the critical path of every scheduler step. This runs the
calls one request makes in a step, as the connector makes them (under ``manager.lock``), on
tiering's drop-in (``TieringSpec``) and on vLLM's own ``TieringOffloadingSpec`` (CPU tier only,
the limit: what the drop-in replaces), both built by vLLM's ``OffloadingSpecFactory`` over a
real shared region:

- ``on_new_request``; ``lookup`` of a 64-chunk prefix held by the CPU tier (all ``HIT``);
  ``prepare_load`` of it; ``prepare_store`` of 16 new chunks (each evicting one) and
  ``complete_store`` of them as a set; ``on_request_finished``; ``on_schedule_end``; then
  ``complete_load`` of the prefix as a set (after the "model step").

It reports microseconds per request step and per chunk operation (80 per step), and the ratio
vLLM / drop-in (1.0 or more: as fast as vLLM's own manager). Needs the vllm package; one torch
thread; the region is a file in /dev/shm, removed at the end.

Usage: python benchmarks/bench_vllm_dropin.py [--quick] [--chunks N]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

# vLLM's log handler writes to stdout, which run_all puts in docs/benchmarks.md: leave logging
# to Python's defaults (warnings on stderr).
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

PREFIX = 64
NEW = 16


def _config(extra: dict[str, Any], chunks: int, engine_id: str) -> Any:
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    chunk_bytes = 4096
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0",), 0),),
        worker_kv_bytes_per_block=chunk_bytes,
        enable_kv_cache_events=True,
        extra_config={"cpu_bytes_to_use": chunks * chunk_bytes, **extra},
        engine_id=engine_id,
        model=OffloadingModelConfig("bench", "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )


def _keys(start: int, count: int) -> list[Any]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + count)]


def _run(manager: Any, chunks: int, steps: int) -> float:
    """Seconds per request step, in steady state (the CPU tier full)."""
    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext

    end = ScheduleEndContext((), ())
    prefix = _keys(0, PREFIX)
    fresh = iter(range(chunks + PREFIX, 1 << 62, NEW))  # never stored before
    lock = manager.lock
    with lock:  # fill the CPU tier, the prefix last (most recent)
        ctx = ReqContext("fill")
        manager.on_new_request(ctx)
        for start in range(PREFIX, chunks, 1024):
            out = manager.prepare_store(_keys(start, min(1024, chunks - start)), ctx)
            manager.complete_store(set(out.keys_to_store), ctx)
        out = manager.prepare_store(prefix, ctx)
        manager.complete_store(set(out.keys_to_store), ctx)
        manager.on_request_finished(ctx)
        manager.on_schedule_end(end)
        list(manager.take_events())
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for step in range(steps):
            ctx = ReqContext(f"r{step}")
            for i, key in enumerate(prefix, 1):
                ctx.set_offload_key_position(key, 16 * i)
            new = _keys(next(fresh), NEW)
            with lock:
                manager.on_new_request(ctx)
                for key in prefix:
                    manager.lookup(key, ctx)
                manager.prepare_load(prefix, ctx)
                out = manager.prepare_store(new, ctx)
                manager.complete_store(set(out.keys_to_store), ctx)
                manager.on_request_finished(ctx)
                manager.on_schedule_end(end)
            with lock:
                manager.complete_load(set(prefix), ctx)
                list(manager.take_events())
        return (time.perf_counter() - t0) / steps
    finally:
        gc.enable()


def bench(chunks: int, steps: int, reps: int) -> dict[str, float]:
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from tiering.integrations import vllm_plugin

    vllm_plugin.register()
    results: dict[str, list[float]] = {"vllm": [], "tiering": []}
    with tempfile.TemporaryDirectory() as tmp:
        yaml_path = Path(tmp) / "tiering.yaml"
        yaml_path.write_text("version: 1\nprimary: {capacity: 4KiB}\n")
        specs = {
            "vllm": {"spec_name": "TieringOffloadingSpec"},
            "tiering": {"spec_name": "TieringSpec", "tiering_config": str(yaml_path)},
        }
        for rep in range(reps):
            for name, extra in specs.items():
                engine_id = f"bench-dropin-{os.getpid()}-{name}-{rep}"
                spec = OffloadingSpecFactory.create_spec(_config(extra, chunks, engine_id))
                manager = spec.get_manager()
                try:
                    results[name].append(_run(manager, chunks, steps))
                finally:
                    manager.shutdown()
    vllm_s = statistics.median(results["vllm"])
    tiering_s = statistics.median(results["tiering"])
    ops = PREFIX * 3 + NEW * 2  # lookups, loads prepared and completed; stores both ways
    return {
        "chunks": chunks,
        "vllm_us_per_step": round(vllm_s * 1e6, 1),
        "dropin_us_per_step": round(tiering_s * 1e6, 1),
        "vllm_us_per_chunk_op": round(vllm_s * 1e6 / ops, 3),
        "dropin_us_per_chunk_op": round(tiering_s * 1e6 / ops, 3),
        "ratio_vllm_over_dropin": round(vllm_s / tiering_s, 2),
    }


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and repetitions")
    parser.add_argument("--chunks", type=int, default=16384, help="CPU tier size in chunks")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as engines do after startup: see docs/benchmarks.md
    steps, reps = (300, 3) if args.quick else (2000, 5)
    row = bench(args.chunks, steps, reps)
    print(
        f"Per request step: lookup {PREFIX} chunks (hits), load them, store {NEW} (evicting), "
        "finish; median of repetitions."
    )
    print()
    print(
        "| CPU chunks | vLLM us/step | drop-in us/step | vLLM us/chunk op | "
        "drop-in us/chunk op | vLLM / drop-in |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {row['chunks']:,} | {row['vllm_us_per_step']} | {row['dropin_us_per_step']} | "
        f"{row['vllm_us_per_chunk_op']} | {row['dropin_us_per_chunk_op']} | "
        f"{row['ratio_vllm_over_dropin']} |"
    )
    return [row]


if __name__ == "__main__":
    main()
