"""The metrics tiering adds to vLLM's offloading metrics: their names, their declarations, and
the eviction rule's report.

Both integrations use them: a tiering tier under vLLM's own manager
(:mod:`tiering.integrations.vllm_tiers`) and the drop-in (:mod:`tiering.integrations.vllm`,
whose :mod:`~tiering.integrations.vllm_metrics` reports every tier, the CPU tier included). Each
metric is labelled with vLLM's ``tier`` label; ``tiering:tier_eviction_rule`` also with
``rule``.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
)
from vllm.v1.kv_offload.tiering.base import TIER_LABEL

from tiering.policies import EvictionPolicy

__all__ = ["RuleReport", "TieringTierMetrics", "tier_metric_definitions"]


class TieringTierMetrics:
    """Names of the metrics a tier reports, each labelled with the tier's name."""

    STORED_BLOCKS = "tiering:tier_stored_blocks"
    STORE_FAILED_BLOCKS = "tiering:tier_store_failed_blocks"
    SHED_BLOCKS = "tiering:tier_shed_blocks"
    NOT_ADMITTED_BLOCKS = "tiering:tier_not_admitted_blocks"
    READ_BLOCKS = "tiering:tier_read_blocks"
    READ_FAILED_BLOCKS = "tiering:tier_read_failed_blocks"
    CORRUPT_BLOCKS = "tiering:tier_corrupt_blocks"
    EVICTED_BLOCKS = "tiering:tier_evicted_blocks"
    EVICTION_RULE_SWITCHES = "tiering:tier_eviction_rule_switches"
    HINTED_REQUESTS = "tiering:tier_hinted_requests"
    HINTS_FOLLOWED = "tiering:tier_hints_followed"
    USAGE_BYTES = "tiering:tier_usage_bytes"
    CAPACITY_BYTES = "tiering:tier_capacity_bytes"
    EVICTION_RULE = "tiering:tier_eviction_rule"


_COUNTERS = {
    TieringTierMetrics.STORED_BLOCKS: "Blocks written to a tiering tier.",
    TieringTierMetrics.STORE_FAILED_BLOCKS: "Blocks a tiering tier failed to write.",
    TieringTierMetrics.SHED_BLOCKS: "Blocks not written: the tier had max_inflight_jobs stores "
    "in flight, or could not evict room.",
    TieringTierMetrics.NOT_ADMITTED_BLOCKS: "Blocks not written: the tier's admission gate had "
    "not seen them looked up admission_min_count times.",
    TieringTierMetrics.READ_BLOCKS: "Blocks a tiering tier read back into the CPU tier (hits).",
    TieringTierMetrics.READ_FAILED_BLOCKS: "Blocks a tiering tier failed to read back.",
    TieringTierMetrics.CORRUPT_BLOCKS: "Blocks that failed verification on read (dropped).",
    TieringTierMetrics.EVICTED_BLOCKS: "Blocks a tiering tier evicted to make room.",
    TieringTierMetrics.EVICTION_RULE_SWITCHES: "Times the tier's eviction policy changed the "
    "victim rule it follows (hybrid; 0 for a policy of one rule).",
    TieringTierMetrics.HINTED_REQUESTS: "Requests told with a continuation hint "
    "(tiering_continues true or false; the CPU tier of the drop-in only).",
    TieringTierMetrics.HINTS_FOLLOWED: "Hinted requests whose hint the tier's eviction policy "
    "followed (chain, while hints of that value tell continued requests apart; none from a "
    "policy that does not follow hints; the CPU tier of the drop-in only).",
}
_GAUGES = {
    TieringTierMetrics.USAGE_BYTES: "Bytes of storage a tiering tier uses (block headers "
    "included).",
    TieringTierMetrics.CAPACITY_BYTES: "Bytes of storage a tiering tier may use (its capacity).",
}


def tier_metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric of :class:`TieringTierMetrics`, as vLLM's spec declares them."""
    metrics: dict[str, OffloadingMetricMetadata] = {
        name: OffloadingCounterMetadata(documentation=doc, labelnames=(TIER_LABEL,))
        for name, doc in _COUNTERS.items()
    }
    for name, doc in _GAUGES.items():
        metrics[name] = OffloadingGaugeMetadata(documentation=doc, labelnames=(TIER_LABEL,))
    metrics[TieringTierMetrics.EVICTION_RULE] = OffloadingGaugeMetadata(
        documentation="1 for the victim rule the tier's eviction policy follows now, 0 for the "
        "others it may follow (hybrid: hybrid, lru or arc; another policy: its name).",
        labelnames=(TIER_LABEL, "rule"),
    )
    return metrics


class RuleReport:
    """Reports a policy's rule (gauges) and the switches since the previous report (counter)."""

    def __init__(self) -> None:
        self._switches_seen: dict[str, int] = {}

    def report(self, stats: OffloadingConnectorStats, policy: EvictionPolicy, tier: str) -> None:
        followed = policy.rule
        for rule in policy.rules:
            stats.set_gauge(TieringTierMetrics.EVICTION_RULE, int(rule == followed), (tier, rule))
        switches = policy.rule_switches
        new = switches - self._switches_seen.get(tier, 0)
        self._switches_seen[tier] = switches
        if new:
            stats.increase_counter(TieringTierMetrics.EVICTION_RULE_SWITCHES, new, (tier,))
