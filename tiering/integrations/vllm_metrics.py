"""What the drop-in reports to vLLM: its metrics and its config info.

Per tier, the CPU tier first (labelled :data:`PRIMARY_LABEL`, as vLLM's own manager labels it),
every other tier ``"{i}:{name}"``: tiering's counters (deltas of
:meth:`TieringOffloadingManager.get_stats`) under vLLM's metric names, usage and capacity
gauges, the victim rule each tier's eviction policy follows and its switches
(:class:`~tiering.integrations.vllm_metric_names.RuleReport`), and one
``vllm:kv_offload_config_info`` series with the labels :data:`INFO_KEYS`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import ConfigInfoMapping
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics
from vllm.v1.kv_offload.tiering.base import TIER_LABEL, TieringOffloadingMetrics

from tiering import CPUOffloadingManager, SecondaryTier, TieringOffloadingManager
from tiering.config import TierConfig
from tiering.integrations.vllm_metric_names import RuleReport, TieringTierMetrics

__all__ = ["INFO_KEYS", "PRIMARY_LABEL", "DropInMetrics"]

#: The ``tier`` label of the CPU tier in metrics and config info (vLLM's own manager's too).
PRIMARY_LABEL: Final = "0:primary"
#: Label names the drop-in adds to ``vllm:kv_offload_config_info``.
INFO_KEYS: Final = (
    "tiering_name",
    "tiering_backend",
    "tiering_capacity_bytes",
    "tiering_persistent",
    "tiering_fingerprint",
    "tiering_policy",
    "tiering_store_threshold",
)

# tiering's per-tier counters (deltas of TieringOffloadingManager.get_stats) -> vLLM metric names.
_TIER_COUNTERS: Final = {
    "lookup_hits": TieringOffloadingMetrics.CHUNK_HITS,
    "bytes_read": TieringOffloadingMetrics.READ_BYTES,
    "bytes_written": TieringOffloadingMetrics.WRITE_BYTES,
    "stored_blocks": TieringTierMetrics.STORED_BLOCKS,
    "store_failures": TieringTierMetrics.STORE_FAILED_BLOCKS,
    "stores_shed": TieringTierMetrics.SHED_BLOCKS,
    "stores_not_admitted": TieringTierMetrics.NOT_ADMITTED_BLOCKS,
    "promoted_blocks": TieringTierMetrics.READ_BLOCKS,
    "promotion_failures": TieringTierMetrics.READ_FAILED_BLOCKS,
    "corrupt_blocks": TieringTierMetrics.CORRUPT_BLOCKS,
    "evictions": TieringTierMetrics.EVICTED_BLOCKS,
}
_CPU_COUNTERS: Final = {
    "stored_blocks": TieringTierMetrics.STORED_BLOCKS,
    "evicted_blocks": TieringTierMetrics.EVICTED_BLOCKS,
    "hinted_requests": TieringTierMetrics.HINTED_REQUESTS,
    "hints_followed": TieringTierMetrics.HINTS_FOLLOWED,
}


class DropInMetrics:
    """The metrics and config info of one drop-in manager (``TieringManager`` owns one).

    ``tiers`` are the tiers below the CPU tier in their order (it numbers their labels),
    ``tier_settings`` their YAML entries by name, ``cpu_info`` vLLM's config info of the CPU
    tier; the rest is what the config info reports.
    """

    def __init__(
        self,
        manager: TieringOffloadingManager,
        primary: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        tier_settings: Mapping[str, TierConfig],
        cpu_info: ConfigInfoMapping,
        *,
        fingerprint: bytes,
        policy: str,
        store_threshold: int,
    ) -> None:
        self.manager = manager
        self.primary = primary
        self.labels = {tier.name: f"{i}:{tier.name}" for i, tier in enumerate(tiers, 1)}
        self.tier_settings = tier_settings
        self.cpu_info = cpu_info
        self.fingerprint = fingerprint
        self.policy = policy
        self.store_threshold = store_threshold
        self._rules = RuleReport()

    def stats(self, queries: int, hits: int) -> OffloadingConnectorStats | None:
        """The stats since the last call, with the CPU tier's ``queries`` and ``hits`` (the
        lookups vLLM made of it), or None when nothing happened."""
        stats = OffloadingConnectorStats()
        primary = (PRIMARY_LABEL,)
        _count(stats, TieringOffloadingMetrics.CHUNK_QUERIES, queries, primary)
        _count(stats, TieringOffloadingMetrics.CHUNK_HITS, hits, primary)
        deltas = self.manager.get_stats()
        cpu = deltas.get(self.primary.medium, {})
        for name, metric in _CPU_COUNTERS.items():
            _count(stats, metric, cpu.get(name, 0), primary)
        row_bytes = self.manager.row_bytes
        _count(
            stats,
            TieringOffloadingMetrics.WRITE_BYTES,
            cpu.get("stored_blocks", 0) * row_bytes,
            primary,
        )
        cpu_tier = self.primary
        stats.set_gauge(TieringTierMetrics.USAGE_BYTES, len(cpu_tier) * row_bytes, primary)
        stats.set_gauge(TieringTierMetrics.CAPACITY_BYTES, cpu_tier.num_blocks * row_bytes, primary)
        self._rules.report(stats, cpu_tier.policy, PRIMARY_LABEL)
        _count(stats, CPUOffloadingMetrics.STORES_SKIPPED, cpu.get("stores_skipped", 0), ())
        _count(
            stats,
            TieringOffloadingMetrics.PROMOTION_ALLOCATION_FAILURES,
            cpu.get("promotions_without_space", 0),
            (),
        )
        for tier in self.manager.tiers:
            label = (self.labels[tier.name],)
            counters = deltas.get(tier.name, {})
            for name, metric in _TIER_COUNTERS.items():
                _count(stats, metric, counters.get(name, 0), label)
            stats.set_gauge(TieringTierMetrics.USAGE_BYTES, tier.backend.usage_bytes, label)
            stats.set_gauge(TieringTierMetrics.CAPACITY_BYTES, tier.backend.capacity_bytes, label)
            policy = tier.eviction_policy
            if policy is not None:
                self._rules.report(stats, policy, label[0])
        return None if stats.is_empty() else stats

    def config_info(self) -> list[ConfigInfoMapping]:
        """One series per tier, the CPU tier first, each with vLLM's ``tier`` label."""
        primary: dict[str, str | int | float | bool] = dict(self.cpu_info)
        primary.update(
            {
                TIER_LABEL: PRIMARY_LABEL,
                "tiering_name": self.primary.medium,
                "tiering_backend": "cpu",
                "tiering_capacity_bytes": self.primary.num_blocks * self.manager.row_bytes,
                "tiering_persistent": False,
                "tiering_fingerprint": self.fingerprint.hex(),
                "tiering_policy": self.policy,
                "tiering_store_threshold": self.store_threshold,
            }
        )
        infos: list[ConfigInfoMapping] = [primary]
        for tier in self.manager.tiers:
            infos.append(
                {
                    TIER_LABEL: self.labels[tier.name],
                    "tiering_name": tier.name,
                    "tiering_backend": self.tier_settings[tier.name].type,
                    "tiering_capacity_bytes": tier.backend.capacity_bytes,
                    "tiering_persistent": tier.backend.capabilities.persistent,
                    "tiering_fingerprint": self.fingerprint.hex(),
                    "tiering_policy": str(tier.config_info()["policy"]),
                }
            )
        return infos


def _count(stats: OffloadingConnectorStats, name: str, value: int, labels: tuple[str, ...]) -> None:
    if value:
        stats.increase_counter(name, value, labels)
