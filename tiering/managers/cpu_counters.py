"""The CPU primary tier's counters: cumulative, reported as their growth between two calls of
:meth:`~tiering.managers.cpu_manager.CPUOffloadingManager.get_stats` (vLLM's stats protocol)."""

from __future__ import annotations

from tiering.policies import EvictionPolicy

__all__ = ["CPUCounters"]


class CPUCounters:
    """Cumulative counts, by the names the manager reports them under: of blocks,
    ``stored_blocks``, ``failed_stores`` (blocks whose store failed), ``evicted_blocks``,
    ``loaded_blocks`` (pinned by prepare_load) and ``stores_skipped`` (offers below
    ``store_threshold``); of requests, ``hinted_requests`` (told with a hint, ``continues``
    true or false) and, if the policy follows hints, ``hints_followed`` (those whose hint it
    followed: its :attr:`~tiering.policies.base.EvictionPolicy.hints_followed`)."""

    __slots__ = (
        "_policy",
        "_seen",
        "evicted_blocks",
        "failed_stores",
        "hinted_requests",
        "loaded_blocks",
        "stored_blocks",
        "stores_skipped",
    )

    def __init__(self, policy: EvictionPolicy) -> None:
        self.stored_blocks = 0
        self.failed_stores = 0
        self.evicted_blocks = 0
        self.loaded_blocks = 0
        self.stores_skipped = 0
        self.hinted_requests = 0
        self._policy = policy  # the tier's: it counts the hints it followed
        self._seen: dict[str, int] = {}  # the counters at the previous growth()

    def note_hint(self, continues: bool | None) -> None:
        """A request was told (its hint checked): counted in ``hinted_requests`` if hinted."""
        if continues is not None:
            self.hinted_requests += 1

    def as_dict(self) -> dict[str, int]:
        counts = {
            "stored_blocks": self.stored_blocks,
            "failed_stores": self.failed_stores,
            "evicted_blocks": self.evicted_blocks,
            "loaded_blocks": self.loaded_blocks,
            "stores_skipped": self.stores_skipped,
            "hinted_requests": self.hinted_requests,
        }
        followed = self._policy.hints_followed
        if followed is not None:
            counts["hints_followed"] = followed
        return counts

    def growth(self) -> dict[str, int]:
        """Each counter's growth since the previous call (since construction, the first time)."""
        now = self.as_dict()
        seen, self._seen = self._seen, now
        return {name: value - seen.get(name, 0) for name, value in now.items()}
