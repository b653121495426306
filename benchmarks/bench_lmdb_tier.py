"""LMDBBackend against raw py-lmdb, same flags, same batches, in one run.

Raw put: one write transaction per batch, ``txn.put(key, payload)`` straight from the pool row.
Raw get: one read transaction per batch, ``buffers=True``, one ``np.copyto`` into a preallocated
row. The backend puts from and gets into rows of a preallocated torch uint8 pool
(``pool[i].numpy().data``, a memoryview); it adds the block header, its checksum, verification
on read and its threads (gets are measured with 1 and 2 read threads). Ratio = backend GB/s /
raw GB/s (target >= 0.8). A single-thread memcpy between pool rows is printed as the machine's
ceiling. Every figure is the median of ``--reps`` runs, each on fresh environments. Gets run
right after the puts, from the page cache, twice: "get" is the first pass (it also pays the page
faults that map a fresh environment into the process), "get warm" the second (the steady state
of a long-lived tier). For warm gets the table also gives the ratio to raw gets that verify
what they copy as the backend does (xxh3 of the copy, on the same thread, no hand-off), and
the ``async_ceiling``: raw gets each handed to a thread and awaited (raw / that), the best any
get can do that keeps LMDB off the event loop at this call size on this machine.

Usage: python benchmarks/bench_lmdb_tier.py [--quick] [--dir DIR] [--blocks N] [--batch N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import lmdb
import numpy as np
import torch
import xxhash

from tiering.backends.base import Outcome
from tiering.backends.lmdb import LMDBBackend

FINGERPRINT = b"bench-lmdb-tier!"
KiB = 1 << 10
MiB = 1 << 20


def _keys(n: int) -> list[bytes]:
    return [i.to_bytes(32, "big") + (0).to_bytes(4, "big") for i in range(n)]


def _batches(n: int, batch: int) -> list[range]:
    return [range(i, min(i + batch, n)) for i in range(0, n, batch)]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _raw_round(
    path: str,
    keys: list[bytes],
    src: torch.Tensor,
    dst: torch.Tensor,
    batch: int,
    flags: dict[str, bool],
    map_bytes: int,
) -> tuple[float, float, float, float, float]:
    """Raw put, get, warm get, warm get + xxh3 of the copy, and warm gets each handed to a
    thread (one hand-off per call: the least any get that keeps LMDB off the loop can pay)."""
    env = lmdb.open(path, map_size=map_bytes, max_dbs=2, readahead=True, **flags)
    db = env.open_db(b"blocks")
    rows_src = [src[i].numpy().data for i in range(len(keys))]
    rows_dst = [dst[i].numpy() for i in range(len(keys))]

    def put() -> None:
        for rows in _batches(len(keys), batch):
            with env.begin(db=db, write=True) as txn:
                for i in rows:
                    txn.put(keys[i], rows_src[i])

    def get_batch(rows: range, verify: bool = False) -> None:
        with env.begin(db=db, buffers=True) as txn:
            for i in rows:
                value = txn.get(keys[i])
                assert value is not None
                np.copyto(rows_dst[i], np.frombuffer(value, np.uint8))
                if verify:
                    xxhash.xxh3_64_intdigest(rows_dst[i].data)

    def get(verify: bool = False) -> None:
        for rows in _batches(len(keys), batch):
            get_batch(rows, verify)

    async def get_on_thread(pool: ThreadPoolExecutor) -> float:
        loop = asyncio.get_running_loop()
        start = time.perf_counter()
        for rows in _batches(len(keys), batch):
            await loop.run_in_executor(pool, get_batch, rows)
        return time.perf_counter() - start

    async def on_thread() -> float:
        with ThreadPoolExecutor(1) as pool:
            return await get_on_thread(pool)

    try:
        return (
            _timed(put),
            _timed(get),
            _timed(get),
            _timed(lambda: get(verify=True)),
            asyncio.run(on_thread()),
        )
    finally:
        env.close()


def _backend_round(
    path: str,
    keys: list[bytes],
    src: torch.Tensor,
    dst: torch.Tensor,
    batch: int,
    flags: dict[str, bool],
    read_threads: int,
) -> tuple[float, float, float]:
    block_bytes = src.shape[1]
    rows_src = [src[i].numpy().data for i in range(len(keys))]
    rows_dst = [dst[i].numpy().data for i in range(len(keys))]

    async def run() -> tuple[float, float, float]:
        backend = LMDBBackend(
            path=path,
            capacity_bytes=len(keys) * (block_bytes + 2 * 4096),
            block_bytes=block_bytes,
            fingerprint=FINGERPRINT,
            read_threads=read_threads,
            sync=flags["sync"],
        )
        await backend.open()
        try:
            start = time.perf_counter()
            for rows in _batches(len(keys), batch):
                results = await backend.put([keys[i] for i in rows], [rows_src[i] for i in rows])
                assert all(r is Outcome.OK for r in results), results
            put_s = time.perf_counter() - start
            get_s = []
            for _ in range(2):
                start = time.perf_counter()
                for rows in _batches(len(keys), batch):
                    out = [rows_dst[i] for i in rows]
                    results = await backend.get([keys[i] for i in rows], out)
                    assert all(r is Outcome.OK for r in results), results
                get_s.append(time.perf_counter() - start)
        finally:
            await backend.close()
        return put_s, get_s[0], get_s[1]

    return asyncio.run(run())


def _memcpy_gbps(src: torch.Tensor, dst: torch.Tensor) -> float:
    seconds = _timed(lambda: dst.copy_(src))
    return src.numel() / seconds / 1e9


def bench_size(
    workdir: str,
    block_bytes: int,
    n_blocks: int,
    batch: int,
    reps: int,
    flags: dict[str, bool],
    read_threads: Sequence[int],
) -> list[dict[str, object]]:
    keys = _keys(n_blocks)
    gen = torch.Generator().manual_seed(block_bytes)
    src = torch.randint(0, 256, (n_blocks, block_bytes), dtype=torch.uint8, generator=gen)
    dst = torch.empty_like(src).fill_(1)  # touched: no page faults inside the timed copies
    total = n_blocks * block_bytes
    memcpy = statistics.median(_memcpy_gbps(src, dst) for _ in range(3))
    map_bytes = 2 * n_blocks * (block_bytes + 8192) + (64 << 20)
    ops = ("put", "get", "get warm")
    times: dict[str, list[float]] = {f"raw_{op}": [] for op in ops}
    times["raw_verified"] = []
    times["raw_on_thread"] = []
    for t in read_threads:
        times.update({f"be{t}_{op}": [] for op in ops})
    for rep in range(reps):
        # Alternate which side goes first: the first writer of a round pays for the writeback
        # and discard of the previous round's files.
        sides: list[str | int] = ["raw", *read_threads]
        for side in sides if rep % 2 == 0 else sides[::-1]:
            dst.fill_(0)
            path = os.path.join(workdir, f"{side}-{rep}")
            seconds: Sequence[float]
            if isinstance(side, str):
                *seconds, verified_seconds, on_thread_seconds = _raw_round(
                    path, keys, src, dst, batch, flags, map_bytes
                )
                times["raw_verified"].append(verified_seconds)
                times["raw_on_thread"].append(on_thread_seconds)
            else:
                seconds = _backend_round(path, keys, src, dst, batch, flags, side)
            name = "raw" if isinstance(side, str) else f"be{side}"
            for op, op_seconds in zip(ops, seconds, strict=True):
                times[f"{name}_{op}"].append(op_seconds)
            shutil.rmtree(path)
            assert torch.equal(src, dst), f"{side}: get returned different bytes"
    gbps = {op: total / statistics.median(times[f"raw_{op}"]) / 1e9 for op in ops}
    verified_gbps = total / statistics.median(times["raw_verified"]) / 1e9
    on_thread_gbps = total / statistics.median(times["raw_on_thread"]) / 1e9
    rows: list[dict[str, object]] = []
    put_times = [t for n in read_threads for t in times[f"be{n}_put"]]
    cases: list[tuple[str, object, list[float]]] = [("put", "-", put_times)]
    for op in ops[1:]:
        cases += [(op, n, times[f"be{n}_{op}"]) for n in read_threads]
    for op, threads, op_times in cases:
        backend = total / statistics.median(op_times) / 1e9
        raw = gbps[op]
        warm = op == "get warm"
        rows.append(
            {
                "block": f"{block_bytes // KiB} KiB",
                "op": op,
                "read_threads": threads,
                "raw_gbps": round(raw, 3),
                "backend_gbps": round(backend, 3),
                "ratio": round(backend / raw, 3),
                "ratio_to_raw_verified": round(backend / verified_gbps, 3) if warm else "-",
                "async_ceiling": round(on_thread_gbps / gbps[op], 3) if warm else "-",
                "backend_us_per_block": round(statistics.median(op_times) / n_blocks * 1e6, 1),
                "memcpy_gbps": round(memcpy, 2),
            }
        )
    return rows


def _print_table(rows: list[dict[str, object]]) -> None:
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 blocks, 1 rep")
    parser.add_argument("--dir", help="where to create the environments (default: a temp dir)")
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=32, help="blocks per put/get call")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-sync", action="store_true", help="sync=False for both sides")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as engines do after startup: see docs/benchmarks.md
    n_blocks, reps = (200, 1) if args.quick else (args.blocks, args.reps)
    flags = {"sync": not args.no_sync}
    workdir = tempfile.mkdtemp(prefix="bench-lmdb-", dir=args.dir)
    print(
        f"lmdb {lmdb.__version__} (LMDB {'.'.join(map(str, lmdb.version()))}), "
        f"{n_blocks} blocks, batches of {args.batch}, median of {reps}, flags {flags}"
    )
    rows: list[dict[str, object]] = []
    try:
        for block_bytes in (256 * KiB, 2 * MiB):
            rows += bench_size(workdir, block_bytes, n_blocks, args.batch, reps, flags, (1, 2))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _print_table(rows)
    hop_us = _thread_round_trip_us()
    print(
        f"\nOne asyncio -> thread -> asyncio round trip (a no-op run_in_executor) takes "
        f"{hop_us:.0f} us here (median): every get call pays about one, which is "
        f"{hop_us / (args.batch * 256 * KiB / (8 * 1e3)):.0%} of a {args.batch}-block batch "
        "of 256 KiB copied at 8 GB/s."
    )
    return rows


def _thread_round_trip_us(calls: int = 2000) -> float:
    """The median cost of handing a no-op to a thread pool and getting the result back."""

    async def run() -> float:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as pool:
            samples = []
            for _ in range(calls):
                start = time.perf_counter()
                await loop.run_in_executor(pool, int)
                samples.append(time.perf_counter() - start)
        return statistics.median(samples) * 1e6

    return asyncio.run(run())


if __name__ == "__main__":
    main(sys.argv[1:])
