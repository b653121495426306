"""Cost of the eviction policies: victims past pinned keys, and per-operation costs.

1. Eviction with the oldest half of the keys pinned (blocks being read or written), one victim
   per ``evict(1)`` call, for our LRU and ARC and for scan-based baselines written here (what
   vLLM's policies do: walk from the oldest end past pinned entries; its ARC restarts the walk
   for every victim). The anchor is a bare ``OrderedDict.popitem(last=False)`` on as many keys.
2. µs per ``insert`` (filling an empty policy), per single-key ``touch`` (random present keys)
   and per ``evict(1)`` + ``insert`` (a full cache taking new keys), at 1e3 to 1e6 keys. The
   anchors, measured in the same run on the same keys, are the bare ``OrderedDict`` operations
   underneath: ``od[key] = None``, ``od.move_to_end(key)``, ``od.popitem(last=False)`` plus
   ``od[key] = None``.

Usage: python benchmarks/bench_eviction.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from tiering.policies import ARCPolicy, EvictionPolicy, LRUPolicy

RAW = "OrderedDict"


class ScanLRU:
    """The scan-based baseline: one OrderedDict, victims found by walking past pinned keys."""

    def __init__(self) -> None:
        self.ref_count: OrderedDict[bytes, int] = OrderedDict()

    def insert(self, key: bytes, evictable: bool = True) -> None:
        self.ref_count[key] = 0 if evictable else 1

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        victims = []
        for key, ref in self.ref_count.items():
            if ref == 0 and key not in protected:
                victims.append(key)
                if len(victims) == n:
                    break
        else:
            return None
        for key in victims:
            del self.ref_count[key]
        return victims


class ScanARC(ScanLRU):
    """ARC's victim search as vLLM does it, reduced to T1: a fresh walk for each victim."""

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        victims: list[bytes] = []
        for _ in range(n):
            found = next(
                (
                    key
                    for key, ref in self.ref_count.items()
                    if ref == 0 and key not in protected and key not in victims
                ),
                None,
            )
            if found is None:
                return None
            victims.append(found)
        for key in victims:
            del self.ref_count[key]
        return victims


def make_keys(count: int) -> list[bytes]:
    # 32-byte block hash + 4-byte group index, like an offload key.
    return [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(count)]


def bench_pinned(total_keys: int, victims: int) -> list[dict[str, object]]:
    """One ``evict(1)`` call per victim; the first call is reported apart from the rest.

    Our first call moves every pinned key it meets at the head out of the scan (a one-off cost
    per pinned key, charged to the insert or touch that put it there); later calls are O(1).
    A scan pays the walk past the pinned keys on every call.
    """
    keys = make_keys(total_keys)
    pinned = total_keys // 2
    factories: list[tuple[str, Callable[[], EvictionPolicy | ScanLRU]]] = [
        ("lru", lambda: LRUPolicy(total_keys)),
        ("arc", lambda: ARCPolicy(total_keys)),
        ("scan LRU (vLLM-style)", ScanLRU),
        ("scan ARC (vLLM-style)", ScanARC),
    ]
    raw = OrderedDict.fromkeys(keys)
    start = time.perf_counter()
    for _ in range(victims):
        raw.popitem(last=False)
    raw_us = (time.perf_counter() - start) / victims * 1e6

    rows: list[dict[str, object]] = []
    for name, factory in factories:
        policy = factory()
        for i, key in enumerate(keys):
            policy.insert(key, evictable=i >= pinned)
        start = time.perf_counter()
        first = policy.evict(1)
        first_s = time.perf_counter() - start
        for _ in range(victims - 1):
            last = policy.evict(1)
        total_s = time.perf_counter() - start
        assert first == [keys[pinned]] and last == [keys[pinned + victims - 1]]
        steady_us = (total_s - first_s) / (victims - 1) * 1e6
        rows.append(
            {
                "table": "pinned",
                "policy": name,
                "keys": total_keys,
                "pinned": pinned,
                "victims": victims,
                "first_call_ms": first_s * 1e3,
                "steady_us_per_victim": steady_us,
                "mean_us_per_victim": total_s / victims * 1e6,
                "raw_us": raw_us,
                "steady_ratio_to_raw": steady_us / raw_us,
            }
        )
    return rows


def _best_us_per_op(setup: Callable[[], Callable[[], object]], ops: int, repeats: int) -> float:
    """Best of ``repeats`` timings of ``setup()()`` (the setup itself is not timed)."""
    best = float("inf")
    for _ in range(repeats):
        run = setup()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best / ops * 1e6


def bench_ops(count: int, ops: int, repeats: int) -> list[dict[str, object]]:
    keys = make_keys(count)
    fresh = make_keys(count + ops)[count:]
    rng = random.Random(0)
    touched = [keys[rng.randrange(count)] for _ in range(ops)]

    def raw_insert() -> Callable[[], object]:
        od: OrderedDict[bytes, None] = OrderedDict()

        def run() -> None:
            for key in keys:
                od[key] = None

        return run

    def raw_touch() -> Callable[[], object]:
        move = OrderedDict.fromkeys(keys).move_to_end
        return lambda: [move(key) for key in touched]

    def raw_churn() -> Callable[[], object]:
        od = OrderedDict.fromkeys(keys)

        def run() -> None:
            for key in fresh:
                od.popitem(last=False)
                od[key] = None

        return run

    raw = {
        "insert": _best_us_per_op(raw_insert, count, repeats),
        "touch": _best_us_per_op(raw_touch, ops, repeats),
        "evict(1)+insert": _best_us_per_op(raw_churn, ops, repeats),
    }
    rows: list[dict[str, object]] = []
    for cls in (LRUPolicy, ARCPolicy):

        def filled(cls: type[EvictionPolicy] = cls) -> EvictionPolicy:
            policy = cls(count)
            for key in keys:
                policy.insert(key)
            for key in touched[: count // 2]:
                policy.touch([key])  # ARC: about a third of the keys in T2
            return policy

        def insert(cls: type[EvictionPolicy] = cls) -> Callable[[], object]:
            policy = cls(count)

            def run() -> None:
                for key in keys:
                    policy.insert(key)

            return run

        def touch() -> Callable[[], object]:
            policy = filled()

            def run() -> None:
                for key in touched:
                    policy.touch([key])

            return run

        def churn() -> Callable[[], object]:
            policy = filled()

            def run() -> None:
                for key in fresh:
                    policy.evict(1)
                    policy.insert(key)

            return run

        measured = {
            "insert": _best_us_per_op(insert, count, repeats),
            "touch": _best_us_per_op(touch, ops, repeats),
            "evict(1)+insert": _best_us_per_op(churn, ops, repeats),
        }
        for op, us in measured.items():
            rows.append(
                {
                    "table": "ops",
                    "policy": cls.name,
                    "keys": count,
                    "op": op,
                    "us_per_op": us,
                    "raw_us": raw[op],
                    "ratio_to_raw": us / raw[op],
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    args = parser.parse_args(argv)
    pinned_keys, victims = (20_000, 200) if args.quick else (100_000, 1_000)
    sizes = (1_000, 10_000, 100_000) if args.quick else (1_000, 10_000, 100_000, 1_000_000)
    ops, repeats = (20_000, 2) if args.quick else (200_000, 3)

    rows = bench_pinned(pinned_keys, victims)
    print(
        f"Eviction with the oldest half pinned: {pinned_keys:,} keys, {victims:,} victims, "
        f"one evict(1) call each"
    )
    print()
    print(
        "| policy | first call (ms) | µs/victim after it | mean µs/victim "
        "| after-first vs bare popitem |"
    )
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['policy']} | {row['first_call_ms']:.2f} | "
            f"{row['steady_us_per_victim']:.2f} | {row['mean_us_per_victim']:.2f} | "
            f"{row['steady_ratio_to_raw']:.1f}x |"
        )
    print(f"\nbare OrderedDict.popitem(last=False): {rows[0]['raw_us']:.3f} µs")

    op_rows: list[dict[str, object]] = []
    for count in sizes:
        op_rows += bench_ops(count, min(ops, count), repeats)
    print(f"\nPer-operation cost (best of {repeats}; anchors are bare OrderedDict operations)")
    print()
    print("| keys | op | policy | µs/op | bare OrderedDict µs/op | ratio |")
    print("|---:|---|---|---:|---:|---:|")
    for row in op_rows:
        print(
            f"| {row['keys']:,} | {row['op']} | {row['policy']} | {row['us_per_op']:.3f} "
            f"| {row['raw_us']:.3f} | {row['ratio_to_raw']:.1f}x |"
        )
    return rows + op_rows


if __name__ == "__main__":
    main()
