"""Where the LRU -> Belady gap lies on the generated traces, by kind of request.

The metadata study (:mod:`tiering.replay.study`) of each policy and Belady's MIN over requests
on a realistic generated trace (:mod:`tiering.replay.workloads`, demo scale) at one CPU size,
its prefix hits split by what each request is, read from the generator's request ids (a
session's kind and number): a conversation's first turn, second turn, later turns; an agent
loop's first step, second, later ones; a document's first ask, an ask again in the same session,
and a first ask of a document another session asked about before (a popular one: its
second-to-last block was first seen in another session). Each cell is points of the trace's
prefix hit ratio (hits of that kind over all the trace's blocks), so a row's distance from
``belady`` is how much of the gap that kind of request holds: what a policy could still win
there.

Usage: python benchmarks/bench_gap_breakdown.py [--traces production,documents] [--seed 0]
[--fraction 0.05] [--policies lru,arc,hybrid,chain]
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Sequence

from tiering.policies import make_policy
from tiering.replay.belady import RequestMIN
from tiering.replay.block_trace import BlockRequest
from tiering.replay.study import prefix_hits, simulate_cpu, study_trace_from_blocks
from tiering.replay.workloads import workload_trace

BLOCK_TOKENS = 512
_SESSION = re.compile(r"([a-z]+)(\d+)-")


def request_kinds(
    requests: Sequence[BlockRequest], key_lists: Sequence[Sequence[bytes]]
) -> list[str]:
    """What each request is (see the module docstring), from its id and its blocks."""
    asked: dict[str, int] = {}
    first_session: dict[bytes, str] = {}
    kinds = []
    for request, keys in zip(requests, key_lists, strict=True):
        found = _SESSION.match(request.request_id)
        if found is None:
            raise ValueError(f"not a generated request id: {request.request_id!r}")
        kind, session = found.group(1), found.group(0)
        nth = asked[session] = asked.get(session, 0) + 1
        if kind == "doc":
            mark = keys[-2] if len(keys) > 1 else keys[-1]
            if nth > 1:
                kinds.append("document, asked again in its session")
            elif first_session.get(mark, session) != session:
                kinds.append("document, first ask, asked before by another session")
            else:
                kinds.append("document, first ask")
        else:
            name = "conversation, turn" if kind == "chat" else "agent loop, step"
            kinds.append(f"{name} {nth}" if nth < 3 else f"{name} 3+")
        for key in keys:
            first_session.setdefault(key, session)
    return kinds


def breakdown(trace: str, seed: int, fraction: float, policies: Sequence[str]) -> str:
    requests = sorted(workload_trace(trace, "demo", seed), key=lambda r: r.arrival_s)
    key_lists = study_trace_from_blocks(requests, BLOCK_TOKENS).key_lists
    kinds = request_kinds(requests, key_lists)
    unique = len({key for keys in key_lists for key in keys})
    capacity = max(1, math.ceil(unique * fraction))
    hits = {p: prefix_hits(simulate_cpu(make_policy(p, capacity), key_lists).flags, key_lists)
            for p in policies}  # fmt: skip
    hits["belady"] = prefix_hits(RequestMIN(key_lists).hit_flags(capacity), key_lists)
    total = sum(map(len, key_lists))
    names = sorted(set(kinds))
    blocks = dict.fromkeys(names, 0)
    per_kind = {p: dict.fromkeys(names, 0) for p in hits}
    for i, keys in enumerate(key_lists):
        blocks[kinds[i]] += len(keys)
        for p, counts in hits.items():
            per_kind[p][kinds[i]] += counts[i]
    columns = [*policies, "belady"]
    lines = [
        f"`{trace}` seed {seed}, {capacity:,} blocks ({fraction:.0%} of {unique:,} unique), "
        "prefix hits in points of the trace's blocks:",
        "",
        "| requests | share of blocks | " + " | ".join(columns) + " | left to the best |",
        "|---|---:|" + "---:|" * (len(columns) + 1),
    ]
    for name in [*names, "all"]:

        def points(p: str, name: str = name) -> float:
            got = sum(per_kind[p].values()) if name == "all" else per_kind[p][name]
            return 100 * got / total

        share = 100 * (total if name == "all" else blocks[name]) / total
        best = max(points(p) for p in policies)
        cells = " | ".join(f"{points(p):.2f}" for p in columns)
        lines.append(f"| {name} | {share:.1f} % | {cells} | {points('belady') - best:.2f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="production,documents")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fraction", type=float, default=0.05)
    parser.add_argument("--policies", default="lru,arc,hybrid,chain")
    parser.add_argument("--quick", action="store_true", help="one trace, two policies")
    args = parser.parse_args(argv)
    traces = ["documents"] if args.quick else args.traces.split(",")
    policies = ["lru", "chain"] if args.quick else args.policies.split(",")
    print("\n\n".join(breakdown(t, args.seed, args.fraction, policies) for t in traces))


if __name__ == "__main__":
    main()
