"""When a block written to the primary tier reaches a secondary tier: its write policy.

``write_through`` writes every block the primary stores; ``write_through_selective`` only the
blocks looked up at least ``selective_min_lookups`` times; ``write_back`` writes a block only
when the primary evicts it, so the tier *owes* the blocks stored since (kept until written or
forgotten). :class:`WriteSchedule` answers, for one tier, what a store writes now and what an
eviction owes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

__all__ = ["WritePolicy", "WriteSchedule"]


class WritePolicy(enum.StrEnum):
    """When a block written to the primary tier reaches this tier."""

    WRITE_THROUGH = "write_through"  # every completed store cascades
    WRITE_BACK = "write_back"  # written when the primary evicts it
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # only keys looked up often enough


class WriteSchedule:
    """What tier's ``policy`` writes, and when (``min_lookups``: of a selective one)."""

    __slots__ = ("_min_lookups", "_policy", "owed")

    def __init__(self, policy: WritePolicy, min_lookups: int) -> None:
        self._policy = policy
        self._min_lookups = min_lookups
        self.owed: set[bytes] = set()  # write-back: in the primary, not written here yet

    def to_write_now(
        self, keys: Sequence[bytes], lookup_counts: Mapping[bytes, int]
    ) -> Sequence[bytes] | None:
        """Of ``keys``, just stored in the primary, those to write now (None: none), by the
        write policy: write-back owes them all instead."""
        if self._policy is WritePolicy.WRITE_BACK:
            self.owed.update(keys)
            return None
        if self._policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            wanted = self._min_lookups
            keys = [k for k in keys if lookup_counts.get(k, 0) >= wanted]
            if not keys:
                return None
        return keys

    def settle_owed(self, evicted: Mapping[bytes, int]) -> list[bytes]:
        """The owed keys among those the primary is evicting, no longer owed (being written)."""
        owed = self.owed
        if not owed:
            return []
        due = [k for k in evicted if k in owed]
        owed.difference_update(due)
        return due
