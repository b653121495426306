"""The report of a replay: per tier, blocks found and served, usable prefix tokens, bytes
moved and GB/s, job latency percentiles, evictions and failures; overall, the prefill tokens
saved against no offloading. Built from the per-request results and the manager's metrics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tiering.config import TieringConfig
from tiering.config.workload_shape import format_shape
from tiering.replay.sim_engine import RequestResult

if TYPE_CHECKING:
    from tiering.replay.replay_run import ReplayOptions

__all__ = ["build_report"]


def _percentiles_ms(samples: Sequence[float]) -> dict[str, float]:
    if not samples:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    values = np.asarray(samples) * 1e3
    return {f"p{q}": round(float(np.percentile(values, q)), 3) for q in (50, 90, 99)}


def _gbps(num_bytes: int, seconds: float) -> float:
    return round(num_bytes / seconds / 1e9, 3) if seconds > 0 else 0.0


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


def build_report(
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
        "shape": None if options.shape is None else format_shape(options.shape),
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
