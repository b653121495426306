"""CPU tier copy speed: TransferEngine stores/loads against a plain memcpy of the same bytes.

For each block size, a blocks-first KV tensor of ``2 N`` blocks and a pool of ``2 N`` slots;
each op moves ``N`` blocks between random engine blocks and random pool slots, submitted to a
:class:`TransferEngine` (strategy ``memmove``, on its worker thread) and waited for. Reference
rows, measured in the same run and interleaved with the engine per repetition: ``dst.copy_(src)`` of
the same bytes contiguously (the physical limit) and ``index_copy_`` of uint8 rows (the naive
scatter). GB/s = 1e9 payload bytes per second, median over repetitions, one torch thread.

Usage: python benchmarks/bench_cpu_copy.py [--quick] [--moved-mib N] [--reps N]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.layout import register_kv_caches
from tiering.managers.pool import CPUBlockPool
from tiering.transfer import PoolTransfer, TransferEngine

BLOCK_SIZES_BYTES = (16 << 10, 256 << 10, 2 << 20)


def _gbps(nbytes: int, seconds: Sequence[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_block_size(block_bytes: int, moved_bytes: int, reps: int) -> dict[str, object]:
    num_moved = max(1, moved_bytes // block_bytes)
    num_blocks = 2 * num_moved
    group = KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (block_bytes,), layer_names=("layer",))
    spec = KVCacheSpec((group,), hash_block_size=16)
    engine = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8)
    caches = register_kv_caches({"layer": engine}, spec, num_blocks)
    pool = CPUBlockPool(num_blocks, caches.offloaded_block_bytes_per_rank())
    transfers = TransferEngine(caches, pool)
    job = PoolTransfer(
        torch.randperm(num_blocks)[:num_moved].numpy(),
        (num_moved,),
        torch.randperm(num_blocks)[:num_moved].numpy(),
    )
    nbytes = num_moved * block_bytes
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    staging = torch.ones(num_moved, block_bytes, dtype=torch.uint8)
    slot_index = torch.from_numpy(job.slots)
    rows = pool.rows_view()
    ops: dict[str, Callable[[], object]] = {
        "memcpy": lambda: dst.copy_(src),
        "store": lambda: transfers.wait(transfers.submit_store(job)),
        "load": lambda: transfers.wait(transfers.submit_load(job)),
        "index_copy_u8": lambda: rows.index_copy_(0, slot_index, staging),
    }
    times: dict[str, list[float]] = {name: [] for name in ops}
    for fn in ops.values():
        fn()  # warm up: page faults, allocator
    for _ in range(reps):
        for name, fn in ops.items():
            times[name].append(_time(fn))
    transfers.close()
    pool.close()
    gbps = {name: _gbps(nbytes, seconds) for name, seconds in times.items()}
    return {
        "block_kib": block_bytes >> 10,
        "blocks_per_op": num_moved,
        "moved_mib": nbytes >> 20,
        "memcpy_gbps": gbps["memcpy"],
        "store_gbps": gbps["store"],
        "load_gbps": gbps["load"],
        "index_copy_u8_gbps": gbps["index_copy_u8"],
        "store_ratio": gbps["store"] / gbps["memcpy"],
        "load_ratio": gbps["load"] / gbps["memcpy"],
    }


def _print_table(rows: list[dict[str, object]]) -> None:
    print(
        "| block | blocks/op | memcpy GB/s | store GB/s | load GB/s | store/memcpy | "
        "load/memcpy | index_copy_ u8 GB/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['block_kib']} KiB | {row['blocks_per_op']} | {row['memcpy_gbps']:.2f} | "
            f"{row['store_gbps']:.2f} | {row['load_gbps']:.2f} | {row['store_ratio']:.0%} | "
            f"{row['load_ratio']:.0%} | {row['index_copy_u8_gbps']:.2f} |"
        )


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 MiB per op, 3 repetitions")
    parser.add_argument("--moved-mib", type=int, default=None, help="MiB moved per op")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per op")
    args = parser.parse_args(argv)
    moved_mib = args.moved_mib or (32 if args.quick else 256)
    reps = args.reps or (3 if args.quick else 7)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as engines do after startup: see docs/benchmarks.md
    rows = [bench_block_size(size, moved_mib << 20, reps) for size in BLOCK_SIZES_BYTES]
    _print_table(rows)
    return rows


if __name__ == "__main__":
    main()
