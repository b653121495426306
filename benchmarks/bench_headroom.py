"""What `chain` closes of the LRU -> Belady gap when the caller hints which requests continue.

The gap target of issue 26 (25 % of the distance from LRU to Belady at 5 % of the unique
blocks) asks an online policy to tell apart, when a request's blocks are stored, the requests a
later request will continue (a conversation's next turn, a document asked about again) from
those no request will. The requests of a trace do not show it; a client or an orchestrator may
know it (a chat session still open, a one-off call) and say so with the request: the
``continues`` hint of ``note_request`` (``tiering.integrations.vllm_hints`` in vLLM). This
measures what the hint is worth, through the public API: the metadata study
(:mod:`tiering.replay.study`) of ``chain`` unhinted and hinted, on the realistic generated
traces (:mod:`tiering.replay.workloads`, demo scale):

- **hint all**: every request hinted, ``True`` if a later request holds its last block, else
  ``False``;
- **hint all, some wrong**: the same, each hint wrong with probability ``--wrong`` (0.1; drawn
  with a fixed seed);
- **hint open only**: ``True`` for the requests a later one continues, no hint for the others
  (a chat front end that knows its open sessions and nothing of other traffic).

``chain`` learns its statistics from what the requests do, whatever the hints; a hint sets
only the class a request's blocks go to (at least 1 if continued, 0 if not). The figures are
prefix hit ratios and, in brackets, the share of the LRU -> Belady gap closed; Belady is
:class:`~tiering.replay.belady.RequestMIN`'s bound.

Usage: python benchmarks/bench_headroom.py [--traces conversation,documents,production]
[--seed 0] [--fractions 0.01,0.02,0.05,0.1,0.2] [--wrong 0.1] [--quick] [--files a.jsonl,...]

``--files`` reads block-trace files instead (Mooncake's or Qwen-Bailian's JSONL, in the format's
blocks), such as the public Mooncake traces (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence

from tiering.policies import make_policy
from tiering.replay.belady import RequestMIN
from tiering.replay.block_trace import read_block_trace
from tiering.replay.study import prefix_hits, simulate_cpu, study_trace_from_blocks
from tiering.replay.workloads import workload_trace

BLOCK_TOKENS = 512
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2)
#: The share of hints wrong in the "some wrong" column, unless ``--wrong`` says otherwise.
WRONG = 0.1
WRONG_SEED = 1
COLUMNS = ("chain", "hint all", "hint all, some wrong", "hint open only")


def continued_flags(key_lists: Sequence[Sequence[bytes]]) -> list[bool]:
    """Per request, in order: whether a later request holds its last block (a request without
    keys: never)."""
    later: set[bytes] = set()
    flags: list[bool] = []
    for keys in reversed(key_lists):
        flags.append(bool(keys) and keys[-1] in later)
        later.update(keys)
    flags.reverse()
    return flags


def hint_sets(flags: Sequence[bool], wrong: float) -> dict[str, list[bool | None]]:
    """The hints of each column (see the module docstring), one per request."""
    draw = random.Random(WRONG_SEED)
    return {
        "hint all": list(flags),
        "hint all, some wrong": [flag != (draw.random() < wrong) for flag in flags],
        "hint open only": [True if flag else None for flag in flags],
    }


def headroom(trace: str, seed: int, fractions: Sequence[float], wrong: float = WRONG) -> list[str]:
    """Table rows of the generated ``trace``: per size, LRU, chain unhinted and hinted, Belady."""
    # (the study orders the requests by arrival itself)
    key_lists = study_trace_from_blocks(workload_trace(trace, "demo", seed), BLOCK_TOKENS).key_lists
    return headroom_rows(trace, key_lists, fractions, wrong)


def headroom_of_file(path: str, fractions: Sequence[float], wrong: float = WRONG) -> list[str]:
    """Table rows of a block-trace file, in its format's blocks."""
    blocks = read_block_trace(path)
    key_lists = study_trace_from_blocks(blocks.requests, blocks.block_tokens).key_lists
    return headroom_rows(path, key_lists, fractions, wrong)


def headroom_rows(
    trace: str,
    key_lists: Sequence[Sequence[bytes]],
    fractions: Sequence[float],
    wrong: float = WRONG,
) -> list[str]:
    """Table rows of a study's keys: per size, LRU, chain unhinted and hinted, Belady."""
    hints = hint_sets(continued_flags(key_lists), wrong)
    unique = len({key for keys in key_lists for key in keys})
    total = sum(map(len, key_lists))
    bound = RequestMIN(key_lists)
    rows = []
    for fraction in fractions:
        capacity = max(1, math.ceil(unique * fraction))

        def ratio(
            policy: str, given: Sequence[bool | None] | None = None, capacity: int = capacity
        ) -> float:
            run = simulate_cpu(make_policy(policy, capacity), key_lists, hints=given)
            return sum(prefix_hits(run.flags, key_lists)) / total

        ratios = {"lru": ratio("lru"), "chain": ratio("chain")}
        ratios.update({name: ratio("chain", given) for name, given in hints.items()})
        belady = sum(prefix_hits(bound.hit_flags(capacity), key_lists)) / total
        lru = ratios["lru"]

        def cell(value: float, lru: float = lru, gap: float = belady - lru) -> str:
            share = f" ({(value - lru) / gap:+.0%})" if gap > 0 else ""
            return f"{value:.4f}{share}"

        cells = " | ".join(cell(ratios[name]) for name in COLUMNS)
        rows.append(
            f"| {trace} | {fraction:.0%} | {capacity:,} | {lru:.4f} | {cells} | {belady:.4f} |"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="conversation,documents,production")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--wrong", type=float, default=WRONG, help="share of hints wrong")
    parser.add_argument("--quick", action="store_true", help="documents at 5 % only")
    parser.add_argument("--files", help="block-trace files, comma separated (not generated)")
    args = parser.parse_args(argv)
    traces = ["documents"] if args.quick else args.traces.split(",")
    fractions = [0.05] if args.quick else [float(f) for f in args.fractions.split(",")]
    seed = "Block-trace files" if args.files else f"Seed {args.seed}"
    print(f"{seed}; prefix hit ratio (share of the LRU -> Belady gap closed):")
    print()
    names = [name.replace("some", f"{args.wrong:.0%}") for name in COLUMNS]
    print(f"| trace | size | blocks | lru | {' | '.join(names)} | belady |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    if args.files:
        for path in args.files.split(","):
            print("\n".join(headroom_of_file(path, fractions, args.wrong)))
        return
    for trace in traces:
        print("\n".join(headroom(trace, args.seed, fractions, args.wrong)))


if __name__ == "__main__":
    main()
