"""The tiering manager's counters: totals (``metrics()``) and deltas (``get_stats()``).

The primary reports as ``"primary"`` in the totals (its medium, ``"CPU"``, in the deltas): its
size, its own counters (:meth:`~tiering.managers.cpu_manager.CPUOffloadingManager.counters`),
the keys lookups found in it by answer, and the promotions that found no room in it. Each
tier reports by name: its :class:`~tiering.managers.secondary_tier.TierMetrics` counters and,
in the totals, its state, usage and its backend's stats. The totals name, for the primary and
each open tier but a shared one (its store evicts), the victim rule its eviction policy follows
(``eviction_rule``, of ``eviction_rules``) and how often that changed
(``eviction_rule_switches``: ``hybrid``'s duel). The requests told with a hint
(``hinted_requests``) are the primary's: this manager tells its policy, and counts them here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.promotions import Promotions
from tiering.managers.protocol import ManagerStats
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tier_lookups import LookupCounts
from tiering.policies import EvictionPolicy

__all__ = ["TieringStats"]


class TieringStats:
    """Counters of ``primary`` and its ``tiers`` (see the module docstring)."""

    def __init__(
        self,
        primary: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        promotions: Promotions,
        lookups: LookupCounts,
    ) -> None:
        self.primary = primary
        self.tiers = tiers
        self.promotions = promotions
        self.lookups = lookups
        self.hinted_requests = 0  # requests this manager told the primary's policy, hinted
        self._seen: ManagerStats = {}  # the counters at the previous deltas()

    def note_hint(self, continues: bool | None) -> None:
        """A request was told (its hint checked): counted in ``hinted_requests`` if hinted."""
        if continues is not None:
            self.hinted_requests += 1

    def counters(self) -> ManagerStats:
        """Every integer counter (totals), per medium: the primary's, then each tier's."""
        out = {self.primary.medium: self._primary_counters()}
        for tier in self.tiers:
            out[tier.name] = tier.metrics.counters()
        return out

    def deltas(self) -> ManagerStats:
        """:meth:`counters` minus what they were at the previous call."""
        now = self.counters()
        seen, self._seen = self._seen, now
        return {
            tier: {
                name: value - seen.get(tier, {}).get(name, 0) for name, value in counters.items()
            }
            for tier, counters in now.items()
        }

    def metrics(self) -> dict[str, Any]:
        """The totals, the primary's and each tier's state and usage."""
        counts = self.lookups
        hits, pending, misses = counts.hits, counts.pending, counts.misses
        out: dict[str, Any] = {
            "primary": {
                "blocks": len(self.primary),
                "free_blocks": self.primary.num_free_blocks,
                "promotions_without_space": self.promotions.without_space,
                "lookups": hits + pending + misses,
                "lookup_hits": hits,
                "lookup_pending": pending,
                "lookup_misses": misses,
                **self._primary_counters(),
                **_eviction_rule_fields(self.primary.policy),
            }
        }
        for tier in self.tiers:
            out[tier.name] = {
                "status": "stalled" if tier.stalled else tier.status,
                "stalled": tier.stalled,
                "open_error": tier.open_error,
                "blocks": len(tier),
                "capacity_blocks": tier.capacity_blocks if tier.is_open else 0,
                "effective_capacity_blocks": (
                    tier.backend.effective_capacity_blocks if tier.is_open else 0
                ),
                "inflight_jobs": tier.inflight_jobs,
                **tier.metrics.counters(),
                "backend": vars(tier.backend.stats),
            }
            policy = tier.eviction_policy
            if policy is not None:
                out[tier.name].update(_eviction_rule_fields(policy))
        return out

    def _primary_counters(self) -> dict[str, int]:
        """The primary's own counters and those this manager counts for it."""
        counters = self.primary.counters()
        counters["promotions_without_space"] = self.promotions.without_space
        counters["hinted_requests"] += self.hinted_requests
        return counters


def _eviction_rule_fields(policy: EvictionPolicy) -> dict[str, Any]:
    """The rule ``policy`` follows now, the rules it may follow and its switches (for
    ``tiering_eviction_rule`` and ``tiering_eviction_rule_switches``)."""
    return {
        "eviction_rule": policy.rule,
        "eviction_rules": list(policy.rules),
        "eviction_rule_switches": policy.rule_switches,
    }
