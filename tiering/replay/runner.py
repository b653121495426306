"""``tiering replay``: what tiering buys on a workload, and what it costs.

It replays a trace of requests through a full :class:`TieringOffloadingManager` built from a YAML
config, with the real data path (KV tensors shaped like the configured model, block bytes from
that shape, copies through the CPU pool, tier I/O on real files and LMDB), and reports per tier:
block hit ratio, usable prefix tokens, bytes moved and GB/s, load and store latency percentiles,
evictions, failures, and the prefill tokens saved against no offloading.

Results are reproducible for a seed: by default the replay lets the tiers finish their I/O
after each request (``--overlap`` lets I/O run behind the next requests instead, as in an engine,
at the cost of timing-dependent numbers). ``--policy-study`` compares eviction policies and the
Belady bound on the same trace with a metadata-only simulation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tiering.config import TieringConfig, load_config, wipe_tiers
from tiering.core.hashing import PrefixHasher
from tiering.errors import TieringError
from tiering.policies import available_policies, get_policy_class
from tiering.replay.replay_output import format_report, format_study, plot_study
from tiering.replay.replay_run import ReplayOptions, ReplayStep, load_trace, run_replay
from tiering.replay.study import policy_study
from tiering.replay.workloads import SHAPE_HELP, resolve_shape

__all__ = [
    "ReplayOptions",
    "ReplayStep",
    "configure_parser",
    "format_report",
    "load_trace",
    "policy_study",
    "run_replay",
]


# -- command line ------------------------------------------------------------------------------


def configure_parser(subparsers: Any) -> None:
    """Add the ``replay`` subcommand to the ``tiering`` CLI."""
    parser = subparsers.add_parser(
        "replay",
        help="replay a trace through a tiered store built from a YAML config",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, type=Path, help="the YAML config")
    parser.add_argument(
        "--trace",
        help="built-in trace (chat, rag, agent, mixed; realistic: conversation, toolagent, "
        "documents, production) or a .jsonl file (tiering's format, Mooncake's or "
        "Qwen-Bailian's)",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        help="tokens per hash id of a block trace (default: the format's, 512 for Mooncake, "
        "16 for Qwen-Bailian); a generated trace's block size (default: 512)",
    )
    parser.add_argument("--scale", help="built-in trace scale: tiny, demo, large")
    parser.add_argument("--seed", type=int, help="trace seed")
    parser.add_argument("--shape", metavar="FIELD=VALUE,...", help=SHAPE_HELP)
    parser.add_argument("--max-requests", type=int, help="replay only the first N requests")
    parser.add_argument("--engine-blocks", type=int, help="engine KV-cache blocks to allocate")
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the simulated engine's KV caches live: cpu (default) or cuda[:N]; with "
        "cuda the whole GPU <-> CPU data path runs (copy strategy: primary.copy_backend)",
    )
    parser.add_argument("--no-verify", action="store_true", help="skip checking loaded bytes")
    parser.add_argument(
        "--overlap", action="store_true", help="let tier I/O run behind later requests"
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="first delete tiering's own files from the tier directories (never other files)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--policy-study",
        action="store_true",
        help="also compare policies and the Belady bound on the trace (metadata only)",
    )
    parser.add_argument(
        "--policies",
        help="policies for --policy-study (comma separated; default: every registered policy)",
    )
    parser.add_argument(
        "--sizes",
        default="0.01,0.05,0.1,0.25,0.5",
        help="--policy-study CPU sizes as fractions of the trace's unique blocks",
    )
    parser.add_argument("--plot", type=Path, help="draw hit ratio against CPU size (PNG)")
    parser.set_defaults(func=_main)


def _options(config: TieringConfig, args: argparse.Namespace) -> ReplayOptions:
    settings = config.replay
    options = ReplayOptions(
        trace=settings.trace,
        scale=settings.scale,
        seed=settings.seed,
        engine_blocks=settings.engine_blocks,
        max_requests=settings.max_requests,
        verify=settings.verify,
    )
    overrides: dict[str, Any] = {
        "trace": args.trace,
        "scale": args.scale,
        "seed": args.seed,
        "engine_blocks": args.engine_blocks,
        "max_requests": args.max_requests,
    }
    options = replace(options, **{k: v for k, v in overrides.items() if v is not None})
    return replace(
        options,
        verify=options.verify and not args.no_verify,
        overlap=args.overlap,
        progress=not args.no_progress and not args.json,
        device=args.device,
        block_tokens=args.block_tokens,
        # Checked here, before --fresh deletes anything.
        shape=resolve_shape(args.shape, settings.shape, options.trace),
    )


@dataclass(frozen=True)
class _StudyOptions:
    """``--policy-study`` / ``--plot`` options, checked before the replay starts."""

    fractions: list[float]
    policies: list[str]
    plot: Path | None


def _check_study_options(args: argparse.Namespace) -> _StudyOptions | None:
    """Check ``--sizes``, ``--policies`` and ``--plot`` before any work: a mistake found after
    a long replay would throw its report away. :class:`TieringError` naming the option."""
    if not (args.policy_study or args.plot):
        return None
    fractions = []
    for text in args.sizes.split(","):
        try:
            fraction = float(text)
        except ValueError:
            raise TieringError(
                f"--sizes: {text.strip()!r} is not a number; give fractions of the trace's "
                "unique blocks, comma separated, e.g. 0.01,0.1,0.5"
            ) from None
        if not 0 < fraction <= 1:
            raise TieringError(f"--sizes: {text.strip()!r} is not a fraction in (0, 1]")
        fractions.append(fraction)
    if args.policies is None:
        policies = list(available_policies())
    else:
        policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise TieringError("--policies: give at least one policy name (e.g. lru,arc)")
    for name in policies:
        try:
            get_policy_class(name)
        except TieringError as exc:
            raise TieringError(f"--policies: {exc}") from None
    if args.plot is not None:
        _check_plot_target(args.plot)
    return _StudyOptions(fractions, policies, args.plot)


def _check_plot_target(path: Path) -> None:
    """matplotlib is installed and ``path`` can be written (a PNG file)."""
    try:
        found = importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # ValueError: blocked in sys.modules
        found = False
    if not found:
        raise TieringError("--plot needs matplotlib: pip install 'tiering[plot]' (or matplotlib)")
    if path.suffix.lower() != ".png":
        raise TieringError(f"--plot: {str(path)!r} must name a .png file")
    if path.is_dir():
        raise TieringError(f"--plot: {str(path)!r} is a directory; name a .png file")
    parent = path.absolute().parent
    if not parent.is_dir():
        raise TieringError(f"--plot: the directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise TieringError(f"--plot: {str(path)!r} is not writable by this user")


def _wipe_tiers(config: TieringConfig) -> None:
    """``--fresh``: delete tiering's own files from each tier (never an operator's file)."""
    tiers = list(config.secondary_tiers)
    for tier, removal in zip(tiers, wipe_tiers(tiers), strict=True):
        if removal.kept:
            print(
                f"--fresh: tier {tier.name}: kept {', '.join(removal.kept)} in {tier.path} "
                "(not tiering's files)",
                file=sys.stderr,
            )


def _main(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    options = _options(config, args)
    study_options = _check_study_options(args)
    if args.fresh:
        _wipe_tiers(config)
    report = run_replay(config, options)
    study: list[dict[str, Any]] = []
    if study_options is not None:
        requests = load_trace(
            options.trace,
            options.scale,
            options.seed,
            Path(config.source).parent,
            block_tokens=args.block_tokens,
            shape=options.shape,
        )
        if options.max_requests is not None:
            requests = requests[: options.max_requests]
        hasher = PrefixHasher(config.hashing.hash_block_size, config.hashing.algorithm)
        key_lists = [hasher.hash_blocks(r.token_ids, r.extra_keys) for r in requests]
        unique = len({k for keys in key_lists for k in keys})
        fractions = study_options.fractions
        capacities = sorted({max(1, math.ceil(unique * f)) for f in fractions})
        policies = study_options.policies
        hints = [r.continues for r in requests]
        study = policy_study(
            key_lists, capacities, policies, progress=options.progress, hints=hints
        )
        report["policy_study"] = study
        if args.plot:
            plot_study(study, args.plot)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(format_report(report))
        if study:
            print()
            print(format_study(study))
        if args.plot:
            print(f"\nplot written to {args.plot}")
    return 1 if report["verify_failures"] else 0


def main(argv: list[str] | None = None) -> int:
    """Run ``replay`` alone (``python -m tiering.replay``); the ``tiering`` CLI wraps it."""
    parser = argparse.ArgumentParser(prog="tiering")
    subparsers = parser.add_subparsers(dest="command", required=True)
    configure_parser(subparsers)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except (TieringError, OSError) as exc:
        print(f"tiering replay: error: {exc}", file=sys.stderr)
        return 2
