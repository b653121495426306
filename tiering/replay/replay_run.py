"""One replay (:func:`run_replay`): load the trace, allocate KV tensors shaped like the
configured model, build the CPU pool and the :class:`TieringOffloadingManager` from the config,
run every request through the simulated engine (letting the tiers finish their I/O after each
one, unless ``overlap``), and collect the report (:mod:`tiering.replay.replay_report`).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tiering.config import TieringConfig, build_manager, build_pool, layout_for_config
from tiering.core.groups import KVCacheSpec
from tiering.core.hashing import PrefixHasher
from tiering.errors import ConfigError
from tiering.model.kv_tensors import allocate_kv_caches
from tiering.observability.service import Observability
from tiering.replay.block_trace import (
    DEFAULT_BLOCK_TOKENS,
    block_trace_format,
    read_block_trace,
    to_requests,
)
from tiering.replay.progress import ProgressBar
from tiering.replay.replay_report import build_report
from tiering.replay.sim_engine import RequestResult, SimulatedEngine, engine_blocks_needed
from tiering.replay.traces import Request, builtin_trace, is_trace_file, read_jsonl
from tiering.replay.workloads import (
    WORKLOAD_TRACES,
    WorkloadShape,
    check_shape_applies,
    workload_trace,
)
from tiering.transfer import TransferEngine

__all__ = ["ReplayOptions", "ReplayStep", "load_trace", "run_replay"]


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
    block_tokens: int | None = None  # tokens per hash id of a block trace (None: the format's)
    shape: WorkloadShape | None = None  # a generated trace's shape (None: the calibrated one)


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
    block_tokens: int | None = None,
    shape: WorkloadShape | None = None,
) -> list[Request]:
    """A built-in trace by name (token-level or realistic), or a JSONL file (relative paths
    from ``base_dir``): tiering's own format or a block trace, Mooncake's or Qwen-Bailian's
    (detected by its ``hash_ids``; ids of ``block_tokens`` tokens, by default the format's,
    expanded to tokens by :func:`~tiering.replay.block_trace.to_requests`). ``shape`` shapes
    a generated trace (realistic names only; by default the calibrated shape), generated in
    blocks of ``block_tokens`` (by default 512)."""
    if shape is not None:
        check_shape_applies(trace)
    if trace in WORKLOAD_TRACES:
        tokens = DEFAULT_BLOCK_TOKENS if block_tokens is None else block_tokens
        return list(to_requests(workload_trace(trace, scale, seed, shape, tokens), tokens))
    if is_trace_file(trace):
        path = Path(trace)
        if not path.is_absolute() and base_dir is not None:
            path = base_dir / path
        if path.is_file() and block_trace_format(path) is not None:
            blocks = read_block_trace(path, block_tokens)
            return list(to_requests(blocks.requests, blocks.block_tokens))
        return list(read_jsonl(path))
    return builtin_trace(trace, scale=scale, seed=seed)


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
        options.trace,
        options.scale,
        options.seed,
        base_dir,
        block_tokens=options.block_tokens,
        shape=options.shape,
    )
    if options.max_requests is not None:
        requests = requests[: options.max_requests]
    _check_engine_blocks(requests, spec, options.engine_blocks)

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
        store_backend = config.primary.store_copy_backend
        transfers = TransferEngine(
            caches,
            pool,
            copy_backend=config.primary.copy_backend,
            store_copy_backend=None if store_backend == "same" else store_backend,
        )
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
        report = build_report(
            config, options, shape.name, block_bytes, cpu_blocks, manager, results
        )
        for tier in manager.tiers:
            report["tiers"][tier.medium]["blocks_at_start"] = at_start[tier.medium]
        report["started_with_data"] = {m: n for m, n in at_start.items() if n}
        report.update(observed_report)
        report["wall_s"] = round(wall_s, 3)
        report["verify_failures"] = engine.verify_failures
        report["device"] = str(device)
        report["copy_strategy"] = transfers.strategy.name
        report["store_copy_strategy"] = transfers.store_strategy.name
        return report
    finally:
        if transfers is not None:
            transfers.close()
        manager.shutdown()
        pool.close()
        del kv_tensors


def _check_engine_blocks(requests: list[Request], spec: KVCacheSpec, engine_blocks: int) -> None:
    """Before anything is allocated or written: the engine must hold the longest prompt."""
    if not requests:
        return
    longest = max(requests, key=lambda r: len(r.token_ids))
    needed = engine_blocks_needed(spec, len(longest.token_ids)) + 1  # block 0 is the null block
    if needed > engine_blocks:
        raise ConfigError(
            f"request {longest.request_id!r} has {len(longest.token_ids):,} prompt tokens: "
            f"the simulated engine must hold {needed:,} blocks at once (the null block "
            f"included) and engine_blocks is {engine_blocks:,}; rerun with --engine-blocks "
            f"{needed} or more (or replay.engine_blocks in the config), or replay fewer "
            "requests (--max-requests)"
        )


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
