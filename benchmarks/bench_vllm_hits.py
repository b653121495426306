"""Hit ratios of tiering's drop-in and vLLM 0.33's own CPU manager on the same request streams.

Each request is served as vLLM's connector serves it (``tiering.testing.vllm_lockstep.
hit_ratio``: look up its chunks until the first miss, load the hits, store the rest, finish),
one request per scheduler step, a 32-chunk CPU tier, by vLLM's own ``CPUOffloadingManager``
(``lru``, ``arc``) and by tiering's ``TieringSpec`` with vLLM's ``eviction_policy`` of the same
name. Workloads (60 prompts over 6 shared system prefixes of 2 to 4 chunks, each with a body of
2 to 6 chunks; 600 requests a seed; 10 seeds):

- ``shifting``: prompts drawn by Zipf 0.9 popularity, the popular set reshuffled half way;
- ``scan``: the same, every 4th request a one-off prompt of 12 to 24 new chunks (a scan);
- ``skewed``: Zipf 1.2 popularity that never changes, every 10th request a one-off prompt.

Target: the drop-in's hit ratio >= vLLM's for every policy, workload and seed, within 0.005.
The hit ratio is the share of looked-up chunks that were ``HIT``.

Usage: python benchmarks/bench_vllm_hits.py [--quick] [--seeds N]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
from collections.abc import Sequence

os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # vLLM's log lines would land in the report

CPU_CHUNKS = 32
PROMPTS = 60
REQUESTS = 600
TOLERANCE = 0.005
POLICIES = ("lru", "arc")


def _prompts(rng: random.Random) -> list[list[bytes]]:
    from tiering.testing.vllm_lockstep import chunk_key

    prefixes = [
        [chunk_key(1_000_000 + 100 * g + i) for i in range(rng.randint(2, 4))] for g in range(6)
    ]
    return [
        prefixes[p % 6] + [chunk_key(1000 * p + i) for i in range(rng.randint(2, 6))]
        for p in range(PROMPTS)
    ]


def _zipf_weights(count: int, exponent: float) -> list[float]:
    return [1.0 / (rank**exponent) for rank in range(1, count + 1)]


def workload(name: str, seed: int, requests: int = REQUESTS) -> list[list[bytes]]:
    """The request stream of workload ``name`` for ``seed`` (lists of chunk keys)."""
    from tiering.testing.vllm_lockstep import chunk_key

    rng = random.Random(f"{name}-{seed}")
    prompts = _prompts(rng)
    exponent = 1.2 if name == "skewed" else 0.9
    weights = _zipf_weights(PROMPTS, exponent)
    order = list(range(PROMPTS))
    rng.shuffle(order)
    fresh = iter(range(10_000_000, 1 << 60))
    stream: list[list[bytes]] = []
    for n in range(requests):
        if name == "shifting" and n == requests // 2:
            rng.shuffle(order)  # the popular set changes
        if (name == "scan" and n % 4 == 3) or (name == "skewed" and n % 10 == 9):
            length = rng.randint(12, 24) if name == "scan" else rng.randint(4, 10)
            stream.append([chunk_key(next(fresh)) for _ in range(length)])
            continue
        rank = rng.choices(range(PROMPTS), weights)[0]
        stream.append(prompts[order[rank]])
    return stream


def measure(seeds: int, requests: int) -> list[dict[str, object]]:
    from tiering.testing.vllm_lockstep import dropin_manager, hit_ratio, vllm_manager

    rows: list[dict[str, object]] = []
    for name in ("shifting", "scan", "skewed"):
        for policy in POLICIES:
            ours: list[float] = []
            theirs: list[float] = []
            for seed in range(seeds):
                stream = workload(name, seed, requests)
                theirs.append(hit_ratio(vllm_manager(CPU_CHUNKS, policy), stream))
                manager = dropin_manager(CPU_CHUNKS, policy)
                try:
                    ours.append(hit_ratio(manager, stream))
                finally:
                    manager.shutdown()
            gaps = [a - b for a, b in zip(ours, theirs, strict=True)]
            rows.append(
                {
                    "workload": name,
                    "policy": policy,
                    "vllm": statistics.mean(theirs),
                    "dropin": statistics.mean(ours),
                    "worst_gap": min(gaps),
                    "seeds_met": sum(gap >= -TOLERANCE for gap in gaps),
                    "seeds": seeds,
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 seeds of 300 requests")
    parser.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args(argv)
    seeds, requests = (3, REQUESTS // 2) if args.quick else (args.seeds, REQUESTS)
    rows = measure(seeds, requests)
    print(
        f"CPU tier of {CPU_CHUNKS} chunks, {requests} requests a seed, {seeds} seeds; hit "
        "ratio: looked-up chunks that were HIT (mean over seeds). Worst gap: the lowest "
        "per-seed drop-in minus vLLM."
    )
    print()
    print("| workload | policy | vLLM 0.33 | drop-in | worst gap | seeds within 0.005 |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['workload']} | {row['policy']} | {row['vllm']:.4f} | "
            f"{row['dropin']:.4f} | {row['worst_gap']:+.4f} | "
            f"{row['seeds_met']} of {row['seeds']} |"
        )
    return rows


if __name__ == "__main__":
    main()
