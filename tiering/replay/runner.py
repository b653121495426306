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
import contextlib
import gc
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiering.config import (
    TieringConfig,
    build_manager,
    build_pool,
    layout_for_config,
    load_config,
    wipe_tiers,
)
from tiering.core.hashing import PrefixHasher
from tiering.errors import ConfigError, TieringError
from tiering.model.kv_tensors import allocate_kv_caches
from tiering.observability.service import Observability
from tiering.policies import get_policy_class
from tiering.replay.block_trace import (
    DEFAULT_BLOCK_TOKENS,
    is_mooncake_file,
    read_mooncake,
    to_requests,
)
from tiering.replay.progress import ProgressBar
from tiering.replay.sim_engine import RequestResult, SimulatedEngine
from tiering.replay.study import policy_study
from tiering.replay.traces import Request, builtin_trace, read_jsonl
from tiering.replay.workloads import WORKLOAD_TRACES, workload_trace
from tiering.transfer import TransferEngine

__all__ = [
    "ReplayOptions",
    "ReplayStep",
    "configure_parser",
    "format_report",
    "load_trace",
    "policy_study",
    "run_replay",
]


@dataclass(frozen=True)
class ReplayOptions:
    trace: str = "mixed"
    scale: str = "demo"
    seed: int = 0
    engine_blocks: int = 1024
    max_requests: int | None = None
    verify: bool = True
    overlap: bool = False
    progress: bool = True
    device: str = "cpu"  # where the simulated engine's KV caches live: "cpu" or "cuda[:N]"
    block_tokens: int = DEFAULT_BLOCK_TOKENS  # tokens per hash id of a Mooncake trace


@dataclass(frozen=True)
class ReplayStep:
    """What :func:`run_replay`'s ``on_request`` callback gets after each request."""

    index: int  # from 0
    total: int
    result: RequestResult
    observability: Observability  # the metrics endpoint and event publisher, when configured


def load_trace(
    trace: str,
    scale: str,
    seed: int,
    base_dir: Path | None = None,
    *,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> list[Request]:
    """A built-in trace by name (token-level or realistic), or a JSONL file (relative paths
    from ``base_dir``): tiering's own format or Mooncake's (detected by its ``hash_ids``; ids
    of ``block_tokens`` tokens, expanded to tokens by
    :func:`~tiering.replay.block_trace.to_requests`)."""
    if trace in WORKLOAD_TRACES:
        return list(to_requests(workload_trace(trace, scale, seed)))
    if trace.endswith(".jsonl") or "/" in trace:
        path = Path(trace)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if path.is_file() and is_mooncake_file(path):
            return list(to_requests(read_mooncake(path), block_tokens))
        return list(read_jsonl(path))
    return builtin_trace(trace, scale=scale, seed=seed)


def _percentiles_ms(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    values = np.asarray(samples) * 1e3
    return {f"p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 90, 99)}


def _gbps(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / seconds / 1e9, 3) if seconds > 0 else 0.0


@contextlib.contextmanager
def _startup_heap_frozen() -> Iterator[None]:
    """Keep the startup heap out of the garbage collector while the replay runs.

    Serving engines do this once startup is over (vLLM freezes its heap): a full collection
    over torch's objects takes ~90 ms here and holds the GIL, so it stalls the manager's I/O
    thread too. Unfrozen afterwards, for callers that replay in-process.
    """
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def run_replay(
    config: TieringConfig,
    options: ReplayOptions,
    *,
    on_request: Callable[[ReplayStep], None] | None = None,
) -> dict[str, Any]:
    """Replay the trace through a manager built from ``config``; return the report.

    The config's ``metrics.port`` and ``events.endpoint`` serve the replay's metrics and publish
    its KV events while it runs. ``on_request`` is called after each request.
    """
    torch.set_num_threads(1)
    if config.model is None:
        raise ConfigError(
            f"{config.source}: model: a replay needs a model (model.shape or model.config_json)"
        )
    shape = config.model_shape()
    spec = shape.kv_cache_spec(config.hashing.hash_block_size, config.block_size_factor)
    base_dir = Path(config.source).parent if config.source else None
    requests = load_trace(
        options.trace, options.scale, options.seed, base_dir, block_tokens=options.block_tokens
    )
    if options.max_requests is not None:
        requests = requests[: options.max_requests]

    device = _kv_device(options.device)
    kv_tensors, caches = allocate_kv_caches(shape, options.engine_blocks, spec, device)
    # The bytes come from the tensors really allocated; they must agree with what the tiers
    # were configured (and fingerprinted) for.
    world_size = config.model.world_size
    block_bytes = caches.offloaded_block_bytes(world_size)
    layout = layout_for_config(config)
    if block_bytes != layout.block_bytes:
        raise ConfigError(
            f"{config.source}: model: the allocated KV tensors give {block_bytes} bytes per "
            f"offloaded block but the config computes {layout.block_bytes}"
        )
    fingerprint = layout.fingerprint
    pool = build_pool(config, block_bytes=block_bytes)
    cpu_blocks = pool.num_blocks
    manager = build_manager(config, block_bytes=block_bytes, fingerprint=fingerprint, pool=pool)
    results: list[RequestResult] = []
    started = time.perf_counter()
    transfers: TransferEngine | None = None
    try:
        manager.wait_ready()
        transfers = TransferEngine(caches, pool, copy_backend=config.primary.copy_backend)
        # What the tiers recovered from an earlier run: the numbers depend on it.
        at_start = {tier.medium: len(tier) for tier in manager.tiers}
        engine = SimulatedEngine(
            manager,
            spec,
            caches,
            transfers,
            PrefixHasher(config.hashing.hash_block_size, config.hashing.algorithm),
            verify=options.verify,
        )
        with (
            Observability(config, manager) as observed,
            _startup_heap_frozen(),
            ProgressBar(len(requests), "replay", enabled=options.progress) as bar,
        ):
            for index, request in enumerate(requests):
                results.append(engine.run(request))
                if not options.overlap:
                    manager.wait_idle()
                observed.step()
                if on_request is not None:
                    on_request(ReplayStep(index, len(requests), results[-1], observed))
                bar.update()
            manager.wait_idle()
            observed.step()
            publisher = observed.publisher
            observed_report = {
                "metrics_url": observed.metrics_url,
                "kv_events_endpoint": publisher.endpoint if publisher else None,
            }
        wall_s = time.perf_counter() - started
        report = _report(config, options, shape.name, block_bytes, cpu_blocks, manager, results)
        for tier in manager.tiers:
            report["tiers"][tier.medium]["blocks_at_start"] = at_start[tier.medium]
        report["started_with_data"] = {m: n for m, n in at_start.items() if n}
        report.update(observed_report)
        report["wall_s"] = round(wall_s, 3)
        report["verify_failures"] = engine.verify_failures
        report["device"] = str(device)
        report["copy_strategy"] = transfers.strategy.name
        return report
    finally:
        if transfers is not None:
            transfers.close()
        manager.shutdown()
        pool.close()
        del kv_tensors


def _kv_device(name: str) -> torch.device:
    """The device for the simulated engine's KV caches; a clear error if it does not exist."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device; use cpu or cuda[:N]") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ConfigError(f"--device {name!r}: the replay puts KV caches on cpu or cuda[:N]")
    if not torch.cuda.is_available():
        raise ConfigError(
            f"--device {name!r} needs CUDA, but torch {torch.__version__} sees no CUDA device"
        )
    index = 0 if device.index is None else device.index
    if index >= torch.cuda.device_count():
        raise ConfigError(
            f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def _split_exactly(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights``, in integers that add up to ``total``
    (largest remainders first)."""
    weight_sum = sum(weights)
    if not weight_sum:
        return [0] * len(weights)
    exact = [total * w / weight_sum for w in weights]
    parts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: parts[i] - exact[i])
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return parts


def _report(
    config: TieringConfig,
    options: ReplayOptions,
    model: str,
    block_bytes: int,
    cpu_blocks: int,
    manager: Any,
    results: list[RequestResult],
) -> dict[str, Any]:
    prompt_tokens = sum(r.prompt_tokens for r in results)
    hit_tokens = sum(r.hit_tokens for r in results)
    looked_up = sum(r.blocks_looked_up for r in results)
    loaded = sum(r.blocks_loaded for r in results)
    metrics = manager.metrics()
    media = ["CPU", *[t.medium for t in manager.tiers]]
    served = [sum(r.blocks_loaded_from.get(m, 0) for r in results) for m in media]
    # Blocks written by another request while this one waited: loaded, but from no tier.
    served_new = loaded - sum(served)
    prefix_tokens = _split_exactly(hit_tokens, [*served, served_new])
    tiers: dict[str, Any] = {}
    for i, medium in enumerate(media):
        found = sum(r.blocks_found.get(medium, 0) for r in results)
        tiers[medium] = {
            "blocks_found": found,
            "block_hit_ratio": round(found / looked_up, 4) if looked_up else 0.0,
            "blocks_served": served[i],
            "served_share": round(served[i] / loaded, 4) if loaded else 0.0,
            "usable_prefix_tokens": prefix_tokens[i],
        }
    tiers["CPU"].update(
        {
            "capacity_blocks": cpu_blocks,
            "blocks_held": metrics["primary"]["blocks"],
            "bytes_loaded": sum(r.bytes_loaded for r in results),
            "bytes_stored": sum(r.bytes_stored for r in results),
            "load_ms": _percentiles_ms([r.load_s for r in results if r.blocks_loaded]),
            "store_ms": _percentiles_ms([r.store_s for r in results if r.blocks_stored]),
            "load_job_ms": _percentiles_ms([r.load_copy_s for r in results if r.blocks_loaded]),
            "store_job_ms": _percentiles_ms([r.store_copy_s for r in results if r.blocks_stored]),
            "stores_refused": sum(r.store_refused for r in results),
            "blocks_refused": sum(r.blocks_refused for r in results),
        }
    )
    for tier in manager.tiers:
        m = tier.metrics
        tiers[tier.medium].update(
            {
                "capacity_blocks": tier.capacity_blocks,
                "blocks_held": len(tier),
                "bytes_written": m.bytes_written,
                "bytes_read": m.bytes_read,
                "write_gbps": _gbps(m.bytes_written, m.store_latency_s.total_s),
                "read_gbps": _gbps(m.bytes_read, m.load_latency_s.total_s),
                "store_job_ms": _percentiles_ms(m.store_latency_s.samples()),
                "load_job_ms": _percentiles_ms(m.load_latency_s.samples()),
                "evictions": m.evictions,
                "promoted_blocks": m.promoted_blocks,
                "store_failures": m.store_failures,
                "promotion_failures": m.promotion_failures,
                "corrupt_blocks": m.corrupt_blocks,
                "stores_shed": m.stores_shed,
            }
        )
    return {
        "config": config.source,
        "model": model,
        "block_bytes": block_bytes,
        "trace": options.trace,
        "scale": options.scale,
        "seed": options.seed,
        "requests": len(results),
        "prompt_tokens": prompt_tokens,
        "prefill_tokens_saved": hit_tokens,
        "prefill_saved_ratio": round(hit_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        "blocks_looked_up": looked_up,
        "blocks_loaded": loaded,
        "blocks_loaded_new": served_new,
        "usable_prefix_tokens_new": prefix_tokens[-1],
        "block_hit_ratio": round(sum(t["blocks_found"] for t in tiers.values()) / looked_up, 4)
        if looked_up
        else 0.0,
        "lookup_retries": sum(r.lookup_retries for r in results),
        "promotions_without_space": metrics["primary"]["promotions_without_space"],
        "tiers": tiers,
    }


# -- policy study ------------------------------------------------------------------------------


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TieringError(
            "--plot needs matplotlib: pip install 'tiering[plot]' (or matplotlib)"
        ) from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        points = [
            (r["capacity_blocks"], r["prefix_hit_ratio"]) for r in rows if r["policy"] == policy
        ]
        ax.plot(*zip(*points, strict=True), marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("CPU tier size (blocks)")
    ax.set_ylabel("usable prefix hit ratio")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- output ----------------------------------------------------------------------------------


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


LEGEND = """\
legend:
  held        blocks the tier holds at the end
  served      blocks loaded into the engine, by the tier that held them when their request was
              looked up; each block counted once, so the rows add up to the total
  prefix tok  prompt tokens not recomputed, split over the tiers by served blocks
  written     bytes stored in the tier; read: bytes loaded from it
  GB/s        bytes over the time spent in jobs
  load, store latency of one job, p50/p99 in ms: for CPU one copy between the engine and the
              CPU pool (per request), for the other tiers one read or write of a batch of blocks
  evicted     blocks evicted from the tier
  not stored  blocks the tier did not store; the notes say why"""


def _ms_pair(percentiles: dict[str, float]) -> str:
    return f"{percentiles['p50']:.2f}/{percentiles['p99']:.2f}"


def format_report(report: dict[str, Any], *, legend: bool = True) -> str:
    """The report as a table, with notes on what was not stored and on reproducibility."""
    lines = [
        f"tiering replay: {report['requests']} requests of trace {report['trace']!r} "
        f"({report['scale']}, seed {report['seed']}), model {report['model']}, "
        f"blocks of {_human_bytes(report['block_bytes'])}, {report['wall_s']:.1f} s",
        f"prefill tokens saved: {report['prefill_tokens_saved']:,} of "
        f"{report['prompt_tokens']:,} ({report['prefill_saved_ratio']:.1%}); "
        f"blocks found in any tier: {report['block_hit_ratio']:.1%}",
    ]
    started = report.get("started_with_data") or {}
    if started:
        held = ", ".join(f"{m} {n:,} blocks" for m, n in started.items())
        lines.append(
            f"note: tiers started with data from an earlier run ({held}); the numbers depend "
            "on it: run with --fresh for numbers that a seed reproduces"
        )
    lines.append("")
    header = (
        f"{'tier':<6} {'capacity':>9} {'held':>8} {'served':>8} {'share':>6} "
        f"{'prefix tok':>11} {'written':>10} {'read':>10} {'wr GB/s':>7} {'rd GB/s':>7} "
        f"{'load ms':>11} {'store ms':>11} {'evicted':>8} {'not stored':>10}"
    )
    rule = "-" * len(header)
    lines += [header, rule]
    notes: list[str] = []
    for medium, t in report["tiers"].items():
        if medium == "CPU":
            written, read = t["bytes_stored"], t["bytes_loaded"]
            wr = rd = evicted = "-"
            not_stored = t["blocks_refused"]
            if t["stores_refused"]:
                notes.append(
                    f"CPU refused {t['stores_refused']:,} stores ({t['blocks_refused']:,} "
                    "blocks): no room could be evicted (every block pinned by a load or being "
                    "written), or a request needed more blocks than the tier holds"
                )
        else:
            written, read = t["bytes_written"], t["bytes_read"]
            wr, rd = f"{t['write_gbps']:.2f}", f"{t['read_gbps']:.2f}"
            evicted = f"{t['evictions']:,}"
            not_stored = t["stores_shed"] + t["store_failures"]
            reasons = []
            if t["stores_shed"]:
                reasons.append(
                    f"{t['stores_shed']:,} blocks shed (max_inflight_jobs jobs already in "
                    "flight, or no room could be evicted)"
                )
            if t["store_failures"]:
                reasons.append(f"{t['store_failures']:,} blocks failed to write")
            if t["promotion_failures"]:
                reasons.append(
                    f"{t['promotion_failures']:,} promotions failed "
                    f"({t['corrupt_blocks']:,} corrupt blocks)"
                )
            if reasons:
                notes.append(f"{medium}: " + "; ".join(reasons))
        lines.append(
            f"{medium:<6} {t['capacity_blocks']:>9,} {t['blocks_held']:>8,} "
            f"{t['blocks_served']:>8,} {t['served_share']:>6.1%} "
            f"{t['usable_prefix_tokens']:>11,} {_human_bytes(written):>10} "
            f"{_human_bytes(read):>10} {wr:>7} {rd:>7} {_ms_pair(t['load_job_ms']):>11} "
            f"{_ms_pair(t['store_job_ms']):>11} {evicted:>8} {not_stored:>10,}"
        )
    if report.get("blocks_loaded_new"):
        new = report["blocks_loaded_new"]
        lines.append(
            f"{'new':<6} {'':>9} {'':>8} {new:>8,} {new / report['blocks_loaded']:>6.1%} "
            f"{report['usable_prefix_tokens_new']:>11,}"
        )
        notes.append("new: blocks another request stored while this one waited for a promotion")
    lines.append(rule)
    lines.append(
        f"{'total':<6} {'':>9} {'':>8} {report['blocks_loaded']:>8,} "
        f"{1.0 if report['blocks_loaded'] else 0.0:>6.1%} {report['prefill_tokens_saved']:>11,}"
    )
    if notes:
        lines += ["", "notes:", *(f"  {note}" for note in notes)]
    if legend:
        lines += ["", LEGEND]
    return "\n".join(lines)


def format_study(rows: list[dict[str, Any]]) -> str:
    header = f"{'policy':<10} {'capacity':>9} {'block hits':>11} {'prefix hits':>12}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['policy']:<10} {r['capacity_blocks']:>9} {r['block_hit_ratio']:>11.1%} "
            f"{r['prefix_hit_ratio']:>12.1%}"
        )
    return "\n".join(lines)


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
        "documents, production) or a .jsonl file (tiering's format or Mooncake's)",
    )
    parser.add_argument(
        "--block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help="tokens per hash id of a Mooncake trace (default 512)",
    )
    parser.add_argument("--scale", help="built-in trace scale: tiny, demo, large")
    parser.add_argument("--seed", type=int, help="trace seed")
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
        "--policies", default="lru,arc", help="policies for --policy-study (comma separated)"
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
        )
        if options.max_requests is not None:
            requests = requests[: options.max_requests]
        hasher = PrefixHasher(config.hashing.hash_block_size, config.hashing.algorithm)
        key_lists = [hasher.hash_blocks(r.token_ids, r.extra_keys) for r in requests]
        unique = len({k for keys in key_lists for k in keys})
        fractions = study_options.fractions
        capacities = sorted({max(1, math.ceil(unique * f)) for f in fractions})
        policies = study_options.policies
        study = policy_study(key_lists, capacities, policies, progress=options.progress)
        report["policy_study"] = study
        if args.plot:
            _plot(study, args.plot)
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
