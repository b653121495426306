"""Manager metadata cost per operation at 1e3 to 1e6 blocks, and its growth.

The manager runs in an engine's scheduler, on the critical path of every step, so its
bookkeeping must stay small and flat as the CPU tier grows. For each size the manager is filled,
then, in steady state:

- store: ``prepare_store`` of a batch of new keys (each evicting one block) + ``complete_store``,
  in microseconds per stored block, eviction included;
- store with reuse: requests that each continue the one before (the previous request's 16
  blocks noted with the request's 16 new ones and touched, the new ones stored), in
  microseconds per stored block: both of an ARC-like policy's lists in play, as on traffic
  with hits;
- lookup: ``lookup`` of a present key, in microseconds per lookup (random keys);
- the reference, measured in the same run: the same operations on a bare ``OrderedDict``
  (``popitem`` + insert for a store, ``in`` + ``move_to_end`` skipped for a lookup: a dict probe),
  the least any Python LRU can spend.

Then, on traffic: the generated ``conversation`` and ``production`` traces (demo scale, seed 0)
replayed through each CPU manager holding 5 % of the trace's unique blocks, every call a
connector makes for a request in order: ``note_request``, ``lookup_prefix``, the hits loaded
(``prepare_load``, ``touch``, ``complete_load``), the misses stored (``prepare_store``,
``complete_store``); in microseconds per block referenced. The synthetic phases above put every
block of a policy in one list; here a multi-list policy's lists compete, as they do in service.
Each trace is replayed twice: every copy done before the next request, and with the copies in
flight as a connector has them across a step (a request's loads and stores complete after the
next request's stores are made ready: its loaded blocks pinned, its stored blocks not yet
evictable, and let go out of the order they were stamped in).

Keys are made in advance; one torch thread; median of repetitions, the managers measured in
turn within each (ratios against LRU: the median of the repetitions' ratios).

Usage: python benchmarks/bench_metadata.py [--quick] [--sizes 1000,10000,...] [--no-traces]
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch

from tiering.core.keys import OffloadKey, make_offload_key
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.replay.study import capacities_for, study_trace_from_blocks
from tiering.replay.workloads import workload_trace

BATCH = 16
#: The generated traces replayed, and the CPU tier's share of each one's unique blocks.
TRACES = ("conversation", "production")
TRACE_FRACTION = 0.05


def _keys(start: int, count: int) -> list[OffloadKey]:
    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(start, start + count)]


def _fill(manager: CPUOffloadingManager | TieringOffloadingManager, num_blocks: int) -> None:
    keys = _keys(0, num_blocks)
    for i in range(0, num_blocks, 1024):
        batch = keys[i : i + 1024]
        manager.prepare_store(batch)
        manager.complete_store(batch)


def _store_us(
    manager: CPUOffloadingManager | TieringOffloadingManager, start: int, n: int
) -> float:
    batches = [_keys(start + i, BATCH) for i in range(0, n, BATCH)]
    t0 = time.perf_counter()
    for batch in batches:
        manager.prepare_store(batch)
        manager.complete_store(batch)
    return (time.perf_counter() - t0) / (len(batches) * BATCH) * 1e6


def _reuse_store_us(
    manager: CPUOffloadingManager | TieringOffloadingManager, start: int, n: int
) -> float:
    """Requests that each continue the one before: the previous request's 16 blocks reused
    (noted with the request, touched), 16 new ones stored; microseconds per stored block."""
    batches = [_keys(start + i, BATCH) for i in range(0, n + BATCH, BATCH)]
    note, touch = manager.note_request, manager.touch
    prepare, complete = manager.prepare_store, manager.complete_store
    t0 = time.perf_counter()
    for reused, new in zip(batches, batches[1:], strict=False):
        note(reused + new)
        touch(reused)
        prepare(new)
        complete(new)
    return (time.perf_counter() - t0) / ((len(batches) - 1) * BATCH) * 1e6


def _manager(
    kind: str, policy: str, num_blocks: int
) -> CPUOffloadingManager | TieringOffloadingManager:
    if kind == "tiering":
        pool = torch.empty((1, 64), dtype=torch.uint8)  # metadata only: no bytes move
        return TieringOffloadingManager(
            CPUOffloadingManager(num_blocks, policy), [], pool=pool.expand(num_blocks, 64)
        )
    return CPUOffloadingManager(num_blocks, policy)


def _lookup_us(
    manager: CPUOffloadingManager | TieringOffloadingManager, present: list[OffloadKey], n: int
) -> float:
    probe = [OffloadKey(bytes(bytearray(k))) for k in random.Random(0).choices(present, k=n)]
    lookup = manager.lookup
    t0 = time.perf_counter()
    for key in probe:
        lookup(key)
    return (time.perf_counter() - t0) / n * 1e6


def _reference(num_blocks: int, n: int) -> tuple[float, float]:
    order: OrderedDict[bytes, int] = OrderedDict((k, 0) for k in _keys(0, num_blocks))
    fresh = _keys(num_blocks, n)
    t0 = time.perf_counter()
    for key in fresh:
        order.popitem(last=False)
        order[key] = 0
    store = (time.perf_counter() - t0) / n * 1e6
    # Fresh key objects, as the manager's probe gets: their hashes are not cached yet.
    probe = [bytes(bytearray(k)) for k in random.Random(0).choices(list(order), k=n)]
    t0 = time.perf_counter()
    for probe_key in probe:
        _ = probe_key in order
    lookup = (time.perf_counter() - t0) / n * 1e6
    return store, lookup


_MANAGERS = (
    ("cpu", "lru"),
    ("cpu", "arc"),
    ("cpu", "hybrid"),
    ("cpu", "chain"),
    ("tiering", "lru"),
)


def bench_size(num_blocks: int, ops: int, reps: int) -> list[dict[str, object]]:
    """Every manager of ``_MANAGERS`` built and filled first, then measured in turn, rep by rep:
    a slow moment of a busy machine falls on all of them alike, and each ratio against LRU is
    the median of the reps' ratios. The store-with-reuse phase runs on managers of its own,
    filled alike: the store column's state (new blocks only) stays what it was without it."""
    ref_store, ref_lookup = zip(*(_reference(num_blocks, ops) for _ in range(reps)), strict=True)
    plain, reusing = {}, {}
    for pair in _MANAGERS:
        plain[pair] = _manager(*pair, num_blocks)
        _fill(plain[pair], num_blocks)
        reusing[pair] = _manager(*pair, num_blocks)
        _fill(reusing[pair], num_blocks)
    stores: dict[tuple[str, str], list[float]] = {pair: [] for pair in _MANAGERS}
    lookups: dict[tuple[str, str], list[float]] = {pair: [] for pair in _MANAGERS}
    reuses: dict[tuple[str, str], list[float]] = {pair: [] for pair in _MANAGERS}
    next_key = dict.fromkeys(_MANAGERS, num_blocks)
    next_reuse_key = dict.fromkeys(_MANAGERS, num_blocks)
    gc.collect()
    gc.disable()
    try:
        for _ in range(reps):
            for pair in _MANAGERS:
                manager = plain[pair]
                stores[pair].append(_store_us(manager, next_key[pair], ops))
                next_key[pair] += ops
                present = _keys(next_key[pair] - num_blocks, num_blocks)
                lookups[pair].append(_lookup_us(manager, present, ops))
                reuses[pair].append(_reuse_store_us(reusing[pair], next_reuse_key[pair], ops))
                next_reuse_key[pair] += ops + BATCH
    finally:
        gc.enable()
        for manager in (*plain.values(), *reusing.values()):
            if isinstance(manager, TieringOffloadingManager):
                manager.shutdown()
    lru = ("cpu", "lru")

    def against_lru(times: dict[tuple[str, str], list[float]], pair: tuple[str, str]) -> float:
        return round(
            statistics.median(t / ref for t, ref in zip(times[pair], times[lru], strict=True)), 2
        )

    rows: list[dict[str, object]] = []
    for pair in _MANAGERS:
        kind, policy = pair
        rows.append(
            {
                "manager": kind,
                "policy": policy,
                "blocks": num_blocks,
                "store_us_per_block": round(statistics.median(stores[pair]), 3),
                "reuse_store_us_per_block": round(statistics.median(reuses[pair]), 3),
                "store_vs_lru": against_lru(stores, pair),
                "reuse_store_vs_lru": against_lru(reuses, pair),
                "lookup_us": round(statistics.median(lookups[pair]), 3),
                "ordereddict_store_us": round(statistics.median(ref_store), 3),
                "dict_lookup_us": round(statistics.median(ref_lookup), 3),
            }
        )
    del plain, reusing
    gc.collect()
    return rows


def _replay_s(
    manager: CPUOffloadingManager, key_lists: list[list[OffloadKey]], in_flight: bool
) -> float:
    """Seconds to replay ``key_lists`` through ``manager`` as a connector calls it; with
    ``in_flight``, a request's loads and stores complete after the next request's stores are
    made ready."""
    note, lookup_prefix = manager.note_request, manager.lookup_prefix
    prepare_load, touch, complete_load = manager.prepare_load, manager.touch, manager.complete_load
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    loading: list[OffloadKey] = []
    storing: list[OffloadKey] = []
    t0 = time.perf_counter()
    for keys in key_lists:
        note(keys)
        hits = lookup_prefix(keys) or 0  # (None: a block in flight)
        loaded = keys[:hits]
        if hits:
            prepare_load(loaded)
            touch(loaded)
            if not in_flight:
                complete_load(loaded)
        stored: list[OffloadKey] = []
        if hits < len(keys):
            out = prepare_store(keys[hits:])
            if out is not None:
                stored = out.keys_to_store
                if not in_flight:
                    complete_store(stored)
        if in_flight:
            if loading:
                complete_load(loading)
            if storing:
                complete_store(storing)
            loading, storing = loaded, stored
    if loading:
        complete_load(loading)
    if storing:
        complete_store(storing)
    return time.perf_counter() - t0


def bench_trace(name: str, reps: int) -> list[dict[str, object]]:
    """Each CPU manager of ``_MANAGERS`` replaying the generated trace ``name``, in turn within
    each repetition (a fresh manager each time); ratios against LRU as in :func:`bench_size`."""
    trace = study_trace_from_blocks(workload_trace(name, "demo", 0), 512)
    key_lists = [[make_offload_key(key, 0) for key in keys] for keys in trace.key_lists]
    references = sum(map(len, key_lists))
    (capacity,) = capacities_for(trace.unique_blocks, (TRACE_FRACTION,))
    pairs = [pair for pair in _MANAGERS if pair[0] == "cpu"]
    modes = (False, True)  # copies done at once; in flight
    times: dict[tuple[str, str, bool], list[float]] = {
        (*pair, mode): [] for pair in pairs for mode in modes
    }
    for _ in range(reps):
        for mode in modes:
            for pair in pairs:
                manager = _manager(*pair, capacity)
                assert isinstance(manager, CPUOffloadingManager)
                gc.collect()
                gc.disable()
                try:
                    seconds = _replay_s(manager, key_lists, mode)
                finally:
                    gc.enable()
                times[(*pair, mode)].append(seconds / references * 1e6)

    def per_block(kind: str, policy: str, mode: bool) -> tuple[float, float]:
        mine, lru = times[(kind, policy, mode)], times[("cpu", "lru", mode)]
        ratio = statistics.median(t / ref for t, ref in zip(mine, lru, strict=True))
        return round(statistics.median(mine), 3), round(ratio, 2)

    rows: list[dict[str, object]] = []
    for kind, policy in pairs:
        us, vs_lru = per_block(kind, policy, False)
        in_flight_us, in_flight_vs_lru = per_block(kind, policy, True)
        rows.append(
            {
                "trace": name,
                "policy": policy,
                "capacity_blocks": capacity,
                "blocks_referenced": references,
                "us_per_block": us,
                "vs_lru": vs_lru,
                "in_flight_us_per_block": in_flight_us,
                "in_flight_vs_lru": in_flight_vs_lru,
            }
        )
    return rows


def _print_trace_table(rows: list[dict[str, object]]) -> None:
    print(f"Replayed at {TRACE_FRACTION:.0%} of each trace's unique blocks (demo scale, seed 0):")
    print()
    print(
        "| trace | policy | capacity blocks | blocks referenced | us per block | / LRU | "
        "copies in flight: us per block | / LRU |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['trace']} | {r['policy']} | {r['capacity_blocks']:,} | "
            f"{r['blocks_referenced']:,} | {r['us_per_block']} | {r['vs_lru']}x | "
            f"{r['in_flight_us_per_block']} | {r['in_flight_vs_lru']}x |"
        )


def _print_table(rows: list[dict[str, object]]) -> None:
    print(
        "| manager | policy | blocks | store us/block | store with reuse us/block | "
        "store / LRU | with reuse / LRU | lookup us | OrderedDict store us | dict lookup us |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['manager']} | {r['policy']} | {r['blocks']:,} | {r['store_us_per_block']} | "
            f"{r['reuse_store_us_per_block']} | {r['store_vs_lru']}x | "
            f"{r['reuse_store_vs_lru']}x | {r['lookup_us']} | {r['ordereddict_store_us']} | "
            f"{r['dict_lookup_us']} |"
        )
    print()
    print("| manager | policy | store growth 1e3 -> max | lookup growth 1e3 -> max |")
    print("|---|---|---:|---:|")
    for kind, policy in dict.fromkeys((r["manager"], r["policy"]) for r in rows):
        series = [r for r in rows if r["manager"] == kind and r["policy"] == policy]
        first, last = series[0], series[-1]
        store_growth = float(last["store_us_per_block"]) / float(first["store_us_per_block"])  # type: ignore[arg-type]
        lookup_growth = float(last["lookup_us"]) / float(first["lookup_us"])  # type: ignore[arg-type]
        print(f"| {kind} | {policy} | {store_growth:.2f}x | {lookup_growth:.2f}x |")


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 1e5, fewer ops")
    parser.add_argument("--sizes", help="comma-separated block counts")
    parser.add_argument("--no-traces", action="store_true", help="skip the trace replays")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as engines do after startup: see docs/benchmarks.md
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    else:
        sizes = [1_000, 10_000, 100_000] if args.quick else [1_000, 10_000, 100_000, 1_000_000]
    ops = 20_000 if args.quick else 100_000
    reps = 3 if args.quick else 5
    rows = [row for size in sizes for row in bench_size(size, ops, reps)]
    _print_table(rows)
    if not args.no_traces:
        trace_rows = [row for name in TRACES for row in bench_trace(name, reps)]
        print()
        _print_trace_table(trace_rows)
        rows += trace_rows
    return rows


if __name__ == "__main__":
    main()
