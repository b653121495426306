"""``tiering policy-study``: eviction policies on a trace, metadata only, in seconds.

Every policy of the registry (built-ins and plugins, by default all of them) and Belady's bound
run over the trace's block keys at CPU sizes given as fractions of the trace's unique blocks
(the model is in :mod:`tiering.replay.study`). Per policy and size: prefix-hit and block-hit
ratios, the share of the LRU -> Belady gap in prefix hits closed (with ``lru`` and Belady
studied), prefill tokens saved, bytes stored in the CPU tier, the victim rules an adaptive
policy followed (``hybrid``: the share of requests under each, where it switched), and, for
each secondary tier of the config (its own policy, capacity and write policy), blocks served,
bytes written and bytes written per served block, with and without the tier's admission gate
(its ``admission_min_count``, or ``--admission N`` for every tier).

Traces: a block trace, Mooncake's or Qwen-Bailian's JSONL (``hash_ids`` of ``--block-tokens``
tokens, by default the format's: 512, 16; the study's blocks are those, or groups of them
of ``--study-block-tokens``), tiering's own JSONL or a token-level built-in (hashed with the
config's ``hash_block_size``: the study's blocks are hash blocks), or a realistic built-in
(``conversation``, ``toolagent``, ``documents``, ``production``: generated in blocks of
``--block-tokens``, 512 by default, or groups of them).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tiering.config import WORKLOAD_TRACES, TierConfig, TieringConfig, load_config
from tiering.config.workload_shape import format_shape
from tiering.core.hashing import PrefixHasher
from tiering.errors import TieringError
from tiering.policies import available_policies, get_policy_class
from tiering.replay.block_trace import DEFAULT_BLOCK_TOKENS, block_trace_format, open_block_trace
from tiering.replay.study import (
    StudyTrace,
    TierModel,
    capacities_for,
    ids_per_block,
    run_study,
    study_trace_from_blocks,
)
from tiering.replay.traces import builtin_trace, is_trace_file, read_jsonl
from tiering.replay.workloads import (
    SHAPE_HELP,
    WorkloadShape,
    check_shape_applies,
    resolve_shape,
    workload_trace,
)

__all__ = ["configure_parser", "load_study_trace"]

DEFAULT_SIZES = "0.01,0.02,0.05,0.1,0.2"


def load_study_trace(
    trace: str,
    config: TieringConfig,
    *,
    scale: str = "demo",
    seed: int = 0,
    block_tokens: int | None = None,
    max_requests: int | None = None,
    study_block_tokens: int | None = None,
    shape: WorkloadShape | None = None,
) -> StudyTrace:
    """The study's keys for ``trace`` (see the module docstring); ``study_block_tokens``
    groups a block trace's ids into study blocks of that many tokens; ``shape`` shapes a
    generated trace (by default the calibrated one)."""
    if shape is not None:
        check_shape_applies(trace)
    if trace in WORKLOAD_TRACES:
        tokens = DEFAULT_BLOCK_TOKENS if block_tokens is None else block_tokens
        group = ids_per_block(study_block_tokens, tokens)
        generated = workload_trace(trace, scale, seed, shape, tokens)[:max_requests]
        return study_trace_from_blocks(generated, tokens, group)
    if is_trace_file(trace):
        path = Path(trace)
        if not path.is_file():
            raise TieringError(f"--trace: no such file {trace!r}")
        if block_trace_format(path) is not None:
            tokens, _, requests_read = open_block_trace(path, block_tokens)
            group = ids_per_block(study_block_tokens, tokens)
            return study_trace_from_blocks(requests_read, tokens, group, max_requests=max_requests)
        requests = list(read_jsonl(path))
    else:
        requests = builtin_trace(trace, scale=scale, seed=seed)
    if study_block_tokens is not None:
        raise TieringError(
            f"--study-block-tokens applies to block traces; {trace!r} is a token trace, whose "
            f"study blocks are the config's hash blocks ({config.hashing.hash_block_size} "
            "tokens): leave the option out"
        )
    requests = requests[:max_requests]
    hasher = PrefixHasher(config.hashing.hash_block_size, config.hashing.algorithm)
    hinted = any(r.continues is not None for r in requests)
    return StudyTrace(
        [hasher.hash_blocks(r.token_ids, r.extra_keys) for r in requests],
        [r.num_prompt_tokens for r in requests],
        config.hashing.hash_block_size,
        [r.continues for r in requests] if hinted else None,
    )


def _block_bytes(config: TieringConfig, block_tokens: int) -> int:
    """Bytes of one study block of ``block_tokens`` tokens (0 without a model)."""
    if config.model is None:
        return 0
    tokens_per_offload_block = config.hashing.hash_block_size * config.block_size_factor
    return config.block_bytes() * block_tokens // tokens_per_offload_block


def _tier_models(config: TieringConfig, block_bytes: int, admission: int | None) -> list[TierModel]:
    """The config's tiers in study blocks of ``block_bytes``; each keeps its configured gate
    unless ``admission`` (``--admission``) overrides every tier's ``admission_min_count``."""
    if not block_bytes:
        return []
    return [
        TierModel(
            name=tier.name,
            capacity_blocks=tier.capacity_bytes // block_bytes,
            policy=tier.policy,
            write_policy=str(tier.write_policy.value),
            selective_min_lookups=tier.selective_min_lookups,
            admission_min_count=tier.admission_min_count if admission is None else admission,
            admission_width=_study_width(config, tier, block_bytes) if admission is None else 0,
            block_bytes=block_bytes,
        )
        for tier in config.secondary_tiers
    ]


def _study_width(config: TieringConfig, tier: TierConfig, block_bytes: int) -> int:
    """A configured ``admission_width`` in study blocks: the same counters per byte of tier (a
    study block holds several of the tier's blocks); 0 when none is configured."""
    if tier.admission_width is None:
        return 0
    return max(1, tier.admission_width * config.block_bytes() // block_bytes)


def _parse_fractions(text: str) -> list[float]:
    fractions = []
    for part in text.split(","):
        try:
            fraction = float(part)
        except ValueError:
            raise TieringError(
                f"--sizes: {part.strip()!r} is not a number; give fractions of the trace's "
                "unique blocks, comma separated, e.g. 0.01,0.1,0.5"
            ) from None
        if not 0 < fraction <= 1:
            raise TieringError(f"--sizes: {part.strip()!r} is not a fraction in (0, 1]")
        fractions.append(fraction)
    return fractions


def _parse_policies(text: str | None) -> list[str]:
    if text is None:
        return list(available_policies())
    names = [p.strip() for p in text.split(",") if p.strip() and p.strip() != "belady"]
    if not names and "belady" not in text:
        raise TieringError("--policies: give at least one policy name (e.g. lru,arc)")
    for name in names:
        try:
            get_policy_class(name)
        except TieringError as exc:
            raise TieringError(f"--policies: {exc}") from None
    return names


def format_rows(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'policy':<10} {'capacity':>9} {'block hits':>11} {'prefix hits':>12} "
        f"{'gap closed':>11} {'prefill saved':>14} {'+tiers':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        with_tiers = r.get("prefix_hit_ratio_with_tiers")
        gap = r.get("lru_belady_gap_closed")
        lines.append(
            f"{r['policy']:<10} {r['capacity_blocks']:>9,} {r['block_hit_ratio']:>11.1%} "
            f"{r['prefix_hit_ratio']:>12.1%} {'-' if gap is None else format(gap, '+.0%'):>11} "
            f"{r['prefill_saved_ratio']:>14.1%} "
            f"{'-' if with_tiers is None else format(with_tiers, '.1%'):>8}"
        )
    tier_lines = []
    for r in rows:
        for name, t in r.get("tiers", {}).items():
            per_hit = t["bytes_written_per_hit"]
            without = t["bytes_written_per_hit_without_admission"]
            tier_lines.append(
                f"{r['policy']:<10} {r['capacity_blocks']:>9,} {name:<8} "
                f"{t['served_blocks']:>9,} {t['bytes_written'] / 2**30:>10.1f} "
                f"{'-' if per_hit is None else format(per_hit / 2**20, '.1f'):>12} "
                f"{'-' if without is None else format(without / 2**20, '.1f'):>12}"
            )
    rule_lines = [
        f"{r['policy']:<10} {r['capacity_blocks']:>9,} {r['rule_switches']:>9,}  "
        + ", ".join(f"{rule} {share:.1%}" for rule, share in r["rule_shares"].items())
        for r in rows
        if r.get("rule_switches")
    ]
    if rule_lines:
        head = f"{'policy':<10} {'capacity':>9} {'switches':>9}  rules followed (requests)"
        lines += ["", head, "-" * len(head), *rule_lines]
    if tier_lines:
        head = (
            f"{'policy':<10} {'capacity':>9} {'tier':<8} {'served':>9} {'written GiB':>10} "
            f"{'MiB/hit':>12} {'no admission':>12}"
        )
        lines += ["", head, "-" * len(head), *tier_lines]
    return "\n".join(lines)


def configure_parser(subparsers: Any) -> None:
    """Add the ``policy-study`` subcommand to the ``tiering`` CLI."""
    parser = subparsers.add_parser(
        "policy-study",
        help="compare eviction policies and Belady's bound on a trace (metadata only)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, type=Path, help="the YAML config")
    parser.add_argument(
        "--trace",
        help="a .jsonl file (Mooncake's, Qwen-Bailian's or tiering's format) or a built-in trace "
        f"({', '.join(WORKLOAD_TRACES)}; chat, rag, agent, mixed); default: the config's",
    )
    parser.add_argument(
        "--policies", help="comma separated (default: every registered policy); belady is added"
    )
    parser.add_argument(
        "--sizes", default=DEFAULT_SIZES, help="CPU sizes as fractions of the unique blocks"
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        help="tokens per hash id of a block trace (default: the format's, 512 for Mooncake, "
        "16 for Qwen-Bailian); a generated trace's block size (default: 512)",
    )
    parser.add_argument(
        "--study-block-tokens",
        type=int,
        metavar="N",
        help="study blocks of N tokens, a multiple of a block trace's tokens per id (default: "
        "one id): as an engine that offloads N-token blocks; fewer references to study",
    )
    parser.add_argument("--scale", help="built-in trace scale: tiny, demo, large")
    parser.add_argument("--seed", type=int, help="built-in trace seed")
    parser.add_argument("--shape", metavar="FIELD=VALUE,...", help=SHAPE_HELP)
    parser.add_argument("--max-requests", type=int, help="study only the first N requests")
    parser.add_argument(
        "--admission",
        type=int,
        default=None,
        metavar="N",
        help="admit a block into every secondary tier only once looked up N times "
        "(a count-min sketch with aging), whatever the tiers' admission_min_count; 0: no "
        "gate (default: each tier's admission_min_count)",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="study N (policy, size) pairs at once in forked processes: the same output, "
        "faster on a large trace; each process may come to hold a copy of the trace's keys "
        "(default: 1, this process)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    fractions = _parse_fractions(args.sizes)
    policies = _parse_policies(args.policies)
    if args.block_tokens is not None and args.block_tokens <= 0:
        raise TieringError(f"--block-tokens must be an int > 0, got {args.block_tokens}")
    if args.admission is not None and args.admission < 0:
        raise TieringError(f"--admission must be an int >= 0, got {args.admission}")
    if args.jobs < 1:
        raise TieringError(f"--jobs must be an int >= 1, got {args.jobs}")
    trace_name = args.trace or config.replay.trace
    shape = resolve_shape(args.shape, config.replay.shape, trace_name)
    trace = load_study_trace(
        trace_name,
        config,
        scale=args.scale or config.replay.scale,
        seed=config.replay.seed if args.seed is None else args.seed,
        block_tokens=args.block_tokens,
        max_requests=args.max_requests,
        study_block_tokens=args.study_block_tokens,
        shape=shape,
    )
    if not trace.block_accesses:
        raise TieringError(f"--trace: {trace_name!r} has no full block to study")
    block_bytes = _block_bytes(config, trace.block_tokens)
    rows = run_study(
        trace,
        capacities_for(trace.unique_blocks, fractions),
        policies,
        tiers=_tier_models(config, block_bytes, args.admission),
        block_bytes=block_bytes,
        progress=not (args.no_progress or args.json),
        jobs=args.jobs,
    )
    if args.json:
        print(json.dumps({"policy_study": rows}, indent=2, sort_keys=True))
    else:
        print(
            f"policy study: {len(trace.key_lists):,} requests of {trace_name!r}"
            + ("" if shape is None else f" ({format_shape(shape)})")
            + ", "
            f"{trace.block_accesses:,} block references, {trace.unique_blocks:,} unique blocks "
            f"of {trace.block_tokens} tokens"
        )
        print(format_rows(rows))
    return 0
