"""A secondary tier's counters (:class:`TierMetrics`), reported by the manager's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiering.managers.latency import LatencyRecord

__all__ = ["TierMetrics"]


@dataclass
class TierMetrics:
    """Counters of one tier (cumulative); job latencies in seconds, one sample per job, in
    fixed memory (:class:`~tiering.managers.latency.LatencyRecord`: exact count, total and
    histogram, sampled percentiles)."""

    lookup_hits: int = 0
    promotions: int = 0
    promoted_blocks: int = 0
    promotion_failures: int = 0
    corrupt_blocks: int = 0
    quarantined: int = 0
    store_jobs: int = 0
    stored_blocks: int = 0
    store_failures: int = 0
    stores_shed: int = 0
    stores_not_admitted: int = 0  # keys a store offered that the admission gate kept out
    full_retries: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    open_failures: int = 0
    timed_out_jobs: int = 0  # jobs past io_timeout_s (their keys counted in the failures too)
    stalls: int = 0  # times the tier stalled (a job timed out while none was stuck)
    load_latency_s: LatencyRecord = field(default_factory=LatencyRecord)
    store_latency_s: LatencyRecord = field(default_factory=LatencyRecord)

    def counters(self) -> dict[str, int]:
        """The integer counters by name (latency samples left out)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, int)}
