"""Eviction policies against Belady's bound on the realistic generated traces.

Every registered policy (LRU, ARC, hybrid, plugins) and Belady's MIN run through the metadata
study (:mod:`tiering.replay.study`: requests in order, each looked up, touched and stored as the
manager does) over the four realistic traces of :mod:`tiering.replay.workloads`
(``conversation``, ``toolagent``, ``documents``, ``production``; demo scale: one hour at about
12,000 requests), at CPU sizes of 1, 2, 5, 10 and 20 % of each trace's unique 512-token blocks.

Per trace and size: the prefix hit ratio of each policy (the share of prompt blocks an engine
skips), and for each policy but LRU the share of the LRU -> Belady gap it closes
(``(policy - LRU) / (Belady - LRU)``; Belady's *block* hits bound every policy's; its prefix
hits are the reference). ``ok`` marks the hybrid policy's targets: at every size no more than
0.2 points under max(LRU, ARC), and at the middle size 25 % of the gap closed.

Usage: python benchmarks/bench_policies.py [--quick] [--seeds 0,1] [--traces a,b]
(``--quick``: the tiny scale, a tenth of the requests).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from tiering.policies import available_policies
from tiering.replay.study import capacities_for, run_study, study_trace_from_blocks
from tiering.replay.workloads import WORKLOAD_TRACES, workload_trace

FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2)
TOLERANCE = 0.002  # 0.2 points


def bench_trace(name: str, scale: str, seed: int) -> list[dict[str, object]]:
    trace = study_trace_from_blocks(workload_trace(name, scale, seed), 512)
    policies = list(available_policies())
    rows = run_study(trace, capacities_for(trace.unique_blocks, FRACTIONS), policies)
    out: list[dict[str, object]] = []
    for capacity in dict.fromkeys(int(r["capacity_blocks"]) for r in rows):
        ratios = {
            r["policy"]: float(r["prefix_hit_ratio"])
            for r in rows
            if r["capacity_blocks"] == capacity
        }
        out.append({"trace": name, "seed": seed, "capacity_blocks": capacity, **ratios})
    return out


def _gap(row: dict[str, object], policy: str) -> float | None:
    lru, best = float(row["lru"]), float(row["belady"])  # type: ignore[arg-type]
    if best - lru < 1e-9:
        return None
    return (float(row[policy]) - lru) / (best - lru)  # type: ignore[arg-type]


def print_table(rows: list[dict[str, object]]) -> None:
    policies = [p for p in available_policies()]
    others = [p for p in policies if p != "lru"]
    print(
        "| trace | seed | CPU blocks | size | "
        + " | ".join(policies)
        + " | belady | "
        + " | ".join(f"{p} gap closed" for p in others)
        + " | hybrid ok |"
    )
    print("|---|---:|---:|---:|" + "---:|" * (len(policies) + 1 + len(others)) + "---|")
    by_trace: dict[tuple[object, object], list[dict[str, object]]] = {}
    for row in rows:
        by_trace.setdefault((row["trace"], row["seed"]), []).append(row)
    for series in by_trace.values():
        for i, row in enumerate(series):
            gaps = [_gap(row, p) for p in others]
            verdict = ""
            if "hybrid" in row:
                floor = max(float(row["lru"]), float(row["arc"])) - TOLERANCE  # type: ignore[arg-type]
                ok = float(row["hybrid"]) >= floor  # type: ignore[arg-type]
                if i == len(series) // 2:
                    gap = _gap(row, "hybrid")
                    ok = ok and gap is not None and gap >= 0.25
                verdict = "ok" if ok else "NO"
            print(
                f"| {row['trace']} | {row['seed']} | {row['capacity_blocks']:,} | "
                f"{FRACTIONS[i]:.0%} | "
                + " | ".join(f"{float(row[p]):.3f}" for p in policies)  # type: ignore[arg-type]
                + f" | {float(row['belady']):.3f} | "  # type: ignore[arg-type]
                + " | ".join("-" if g is None else f"{g:+.0%}" for g in gaps)
                + f" | {verdict} |"
            )


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny scale")
    parser.add_argument("--seeds", default="0", help="trace seeds, comma separated")
    parser.add_argument("--traces", default=",".join(WORKLOAD_TRACES))
    args = parser.parse_args(argv)
    scale = "tiny" if args.quick else "demo"
    rows = [
        row
        for name in args.traces.split(",")
        for seed in (int(s) for s in args.seeds.split(","))
        for row in bench_trace(name, scale, seed)
    ]
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
