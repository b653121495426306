"""The adaptive policies' floor on traffic shapes no tuning saw.

``hybrid`` and ``chain`` were tuned on the four generated traces
(:mod:`tiering.replay.workloads`) at their calibrated shape; held-out production traces judge
them. This benchmark moves one parameter of the generator at a time far from its calibrated
value (how much conversations differ, how popular documents are and how many come from the
catalog, the number of tenants, think times a fifth and five times as long, mixes heavier in
agents or documents) and checks, on every trace the change touches, at 1, 2, 5, 10 and 20 % of
the unique blocks, the issue's first target: each one's prefix hit ratio no more than 0.2
points under max(LRU, ARC). Belady is not run: only the floor is judged here.

Usage: python benchmarks/bench_policy_variants.py [--quick] [--seeds 0,1] [--variants a,b]
[--jobs N]
(``--quick``: the tiny scale, six minutes of traffic, a smoke run: caches of a few hundred
blocks that the shadows watch for minutes only, so its floor counts say little of the policy;
``--jobs``: (policy, size) pairs studied at once in forked processes, by default one per CPU.)
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from tiering.replay.study import capacities_for, run_study, study_trace_from_blocks
from tiering.replay.workloads import WorkloadMix, WorkloadShape, generate, workload_trace

FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2)
TOLERANCE = 0.002  # 0.2 points
POLICIES = ("lru", "arc", "hybrid", "chain")
#: The policies whose floor is judged.
JUDGED = ("hybrid", "chain")
_HOURS = {"demo": 1.0, "tiny": 0.1}
_CONVERSATIONS = ("conversation", "production")
_DOCUMENTS = ("documents", "production")
_ALL = ("conversation", "toolagent", "documents", "production")


@dataclass(frozen=True)
class Variant:
    """One change to the generator and the built-in traces it changes (a mix instead of a
    trace name: ``production``'s sessions in other shares)."""

    name: str
    shape: WorkloadShape = WorkloadShape()
    traces: tuple[str, ...] = _ALL
    mix: WorkloadMix | None = None


VARIANTS = (
    Variant("beta0.3", WorkloadShape(continue_beta_a=0.3), _CONVERSATIONS),
    Variant("beta1.5", WorkloadShape(continue_beta_a=1.5), _CONVERSATIONS),
    Variant("beta4", WorkloadShape(continue_beta_a=4.0), _CONVERSATIONS),
    Variant("zipf0.6", WorkloadShape(catalog_alpha=0.6), _DOCUMENTS),
    Variant("zipf1.2", WorkloadShape(catalog_alpha=1.2), _DOCUMENTS),
    Variant("catalog0.1", WorkloadShape(catalog_share=0.1), _DOCUMENTS),
    Variant("catalog0.8", WorkloadShape(catalog_share=0.8), _DOCUMENTS),
    Variant("tenants3", WorkloadShape(tenants=3)),
    Variant("tenants300", WorkloadShape(tenants=300)),
    Variant("think0.2", WorkloadShape(think_time_scale=0.2)),
    Variant("think5", WorkloadShape(think_time_scale=5.0)),
    Variant(
        "agents30",
        traces=("production",),
        mix=WorkloadMix(conversation=0.4, agent=0.3, document=0.3, bursty=True),
    ),
    Variant(
        "docs70",
        traces=("production",),
        mix=WorkloadMix(conversation=0.25, agent=0.05, document=0.7),
    ),
)


def bench_variant(
    variant: Variant, trace_name: str, scale: str, seed: int, jobs: int
) -> list[dict[str, object]]:
    if variant.mix is not None:
        hours = _HOURS[scale]
        requests = generate(variant.mix, 3_600.0 * hours, seed=seed, shape=variant.shape)
    else:
        requests = workload_trace(trace_name, scale, seed, variant.shape)
    trace = study_trace_from_blocks(requests, 512)
    capacities = capacities_for(trace.unique_blocks, FRACTIONS)
    rows = run_study(trace, capacities, POLICIES, belady=False, jobs=jobs)
    ratios = {(r["capacity_blocks"], r["policy"]): float(r["prefix_hit_ratio"]) for r in rows}
    out = []
    for fraction in FRACTIONS:
        (capacity,) = capacities_for(trace.unique_blocks, (fraction,))
        row: dict[str, object] = {
            "variant": variant.name,
            "trace": trace_name,
            "seed": seed,
            "fraction": fraction,
            "capacity_blocks": capacity,
        }
        row |= {policy: ratios[(capacity, policy)] for policy in POLICIES}
        floor = max(ratios[(capacity, "lru")], ratios[(capacity, "arc")]) - TOLERANCE
        for policy in JUDGED:
            row[f"{policy}_ok"] = ratios[(capacity, policy)] >= floor
        out.append(row)
    return out


def print_table(rows: list[dict[str, object]]) -> None:
    """A row per variant, trace, seed and judged policy; per size its prefix hit ratio and, in
    brackets, its distance in points from max(LRU, ARC) (NO: more than 0.2 under)."""
    print(
        "| variant | trace | seed | policy | "
        + " | ".join(f"{f:.0%}" for f in FRACTIONS)
        + " |\n|---|---|---:|---|"
        + "---:|" * len(FRACTIONS)
    )
    for i in range(0, len(rows), len(FRACTIONS)):
        group = rows[i : i + len(FRACTIONS)]
        head = group[0]
        for policy in JUDGED:
            cells = []
            for row in group:
                ratio = float(row[policy])  # type: ignore[arg-type]
                best = max(float(row["lru"]), float(row["arc"]))  # type: ignore[arg-type]
                verdict = "" if row[f"{policy}_ok"] else " NO"
                cells.append(f"{ratio:.3f} ({(ratio - best) * 100:+.2f}){verdict}")
            print(
                f"| {head['variant']} | {head['trace']} | {head['seed']} | {policy} | "
                + " | ".join(cells)
                + " |"
            )
    print()
    for policy in JUDGED:
        kept = sum(1 for r in rows if r[f"{policy}_ok"])
        print(
            f"{policy} within 0.2 points of max(LRU, ARC) at {kept} of {len(rows)}"
            " (trace, seed and size)"
        )


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny scale")
    parser.add_argument("--seeds", default="0,1", help="trace seeds, comma separated")
    parser.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="pairs at once (default: CPUs)"
    )
    args = parser.parse_args(argv)
    by_name = {v.name: v for v in VARIANTS}
    names = args.variants.split(",")
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown variants {unknown}; valid: {', '.join(by_name)}")
    scale = "tiny" if args.quick else "demo"
    rows = [
        row
        for name in names
        for trace_name in by_name[name].traces
        for seed in (int(s) for s in args.seeds.split(","))
        for row in bench_variant(by_name[name], trace_name, scale, seed, args.jobs)
    ]
    print_table(rows)
    return rows


if __name__ == "__main__":
    main()
