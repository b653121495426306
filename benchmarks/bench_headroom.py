"""What `chain` would close of the LRU -> Belady gap if it knew which requests are continued.

The gap target of issue 26 (25 % of the distance from LRU to Belady at 5 % of the unique
blocks) asks an online policy to tell apart, when a request's blocks are stored, the requests a
later request will continue (a conversation's next turn, a document asked about again) from
those no request will. This measures what that one bit is worth: the metadata study
(:mod:`tiering.replay.study`) of ``chain`` as it is, and of ``chain`` *told* the bit, on the
realistic generated traces (:mod:`tiering.replay.workloads`, demo scale):

- **told first**: a request that continues nothing (class 0 for ``chain``) goes to class 1 if a
  later request holds its last block; every other request is classed as ``chain`` classes it.
- **told all**: every request goes to class 2 if a later request holds its last block, else to
  class 0.

Each told policy learns its classes' statistics online as ``chain`` does; only the class a
request's blocks go to comes from the future. Told nothing (every flag false), *told first* is
``chain``, hit for hit (tested). The figures are prefix hit ratios and, in brackets, the share of
the LRU -> Belady gap closed; Belady is :class:`~tiering.replay.belady.RequestMIN`'s bound.

Usage: python benchmarks/bench_headroom.py [--traces conversation,documents,production]
[--seed 0] [--fractions 0.01,0.02,0.05,0.1,0.2] [--quick] [--files a.jsonl,b.jsonl]

``--files`` reads block-trace files instead (Mooncake's or Qwen-Bailian's JSONL, in the format's
blocks), such as the public Mooncake traces (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from tiering.policies import make_policy
from tiering.policies.chain import ChainPolicy
from tiering.replay.belady import RequestMIN
from tiering.replay.block_trace import read_block_trace
from tiering.replay.study import prefix_hits, simulate_cpu, study_trace_from_blocks
from tiering.replay.workloads import workload_trace

BLOCK_TOKENS = 512
FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2)
MODES = ("first", "all")


def continued_flags(key_lists: Sequence[Sequence[bytes]]) -> list[bool]:
    """Per request with keys, in order (a request without keys is never classed): whether a
    later request holds its last block."""
    later: set[bytes] = set()
    flags: list[bool] = []
    for keys in reversed(key_lists):
        if keys:
            flags.append(keys[-1] in later)
            later.update(keys)
    flags.reverse()
    return flags


class ToldChain(ChainPolicy):
    """``chain`` told, per request, whether a later request continues it (see the module
    docstring): ``flags`` has one entry per request with keys, in the order they are noted."""

    name = "chain-told"

    def __init__(self, capacity: int, flags: Sequence[bool], mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        super().__init__(capacity)
        self._flags = flags
        self._mode = mode
        self._noted = 0

    def _classify(self, keys: Sequence[bytes], now: int) -> tuple[int, bytes | None]:
        learned_class, found = super()._classify(keys, now)
        told = self._flags[self._noted]
        self._noted += 1
        if self._mode == "all":
            request_class = 2 if told else 0
        else:
            request_class = learned_class if found is not None else int(told)
        # The request is counted in the class its blocks go to.
        self._requests[learned_class] -= 1
        self._requests[request_class] += 1
        return request_class, found


def headroom(trace: str, seed: int, fractions: Sequence[float]) -> list[str]:
    """Table rows of the generated ``trace``: per size, LRU, chain, chain told, Belady."""
    # (the study orders the requests by arrival itself)
    key_lists = study_trace_from_blocks(workload_trace(trace, "demo", seed), BLOCK_TOKENS).key_lists
    return headroom_rows(trace, key_lists, fractions)


def headroom_of_file(path: str, fractions: Sequence[float]) -> list[str]:
    """Table rows of a block-trace file, in its format's blocks."""
    blocks = read_block_trace(path)
    key_lists = study_trace_from_blocks(blocks.requests, blocks.block_tokens).key_lists
    return headroom_rows(path, key_lists, fractions)


def headroom_rows(
    trace: str, key_lists: Sequence[Sequence[bytes]], fractions: Sequence[float]
) -> list[str]:
    """Table rows of a study's keys: per size, LRU, chain, chain told, Belady."""
    flags = continued_flags(key_lists)
    unique = len({key for keys in key_lists for key in keys})
    total = sum(map(len, key_lists))
    bound = RequestMIN(key_lists)
    rows = []
    for fraction in fractions:
        capacity = max(1, math.ceil(unique * fraction))
        policies = {
            "lru": make_policy("lru", capacity),
            "chain": make_policy("chain", capacity),
            **{f"told {mode}": ToldChain(capacity, flags, mode) for mode in MODES},
        }
        ratios = {
            name: sum(prefix_hits(simulate_cpu(policy, key_lists).flags, key_lists)) / total
            for name, policy in policies.items()
        }
        belady = sum(prefix_hits(bound.hit_flags(capacity), key_lists)) / total
        lru = ratios["lru"]

        def cell(ratio: float, lru: float = lru, gap: float = belady - lru) -> str:
            share = f" ({(ratio - lru) / gap:+.0%})" if gap > 0 else ""
            return f"{ratio:.4f}{share}"

        cells = " | ".join(cell(ratios[name]) for name in ("chain", "told first", "told all"))
        rows.append(
            f"| {trace} | {fraction:.0%} | {capacity:,} | {lru:.4f} | {cells} | {belady:.4f} |"
        )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", default="conversation,documents,production")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    parser.add_argument("--quick", action="store_true", help="documents at 5 % only")
    parser.add_argument("--files", help="block-trace files, comma separated (not generated)")
    args = parser.parse_args(argv)
    traces = ["documents"] if args.quick else args.traces.split(",")
    fractions = [0.05] if args.quick else [float(f) for f in args.fractions.split(",")]
    seed = "Block-trace files" if args.files else f"Seed {args.seed}"
    print(f"{seed}; prefix hit ratio (share of the LRU -> Belady gap closed):")
    print()
    print("| trace | size | blocks | lru | chain | chain told first | chain told all | belady |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    if args.files:
        for path in args.files.split(","):
            print("\n".join(headroom_of_file(path, fractions)))
        return
    for trace in traces:
        print("\n".join(headroom(trace, args.seed, fractions)))


if __name__ == "__main__":
    main()
