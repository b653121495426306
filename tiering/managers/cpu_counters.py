"""The CPU primary tier's counters: cumulative, reported as their growth between two calls of
:meth:`~tiering.managers.cpu_manager.CPUOffloadingManager.get_stats` (vLLM's stats protocol)."""

from __future__ import annotations

__all__ = ["CPUCounters"]


class CPUCounters:
    """Cumulative counts of blocks, by the names the manager reports them under:
    ``stored_blocks``, ``failed_stores`` (blocks whose store failed), ``evicted_blocks``,
    ``loaded_blocks`` (pinned by prepare_load) and ``stores_skipped`` (offers below
    ``store_threshold``)."""

    __slots__ = (
        "_seen",
        "evicted_blocks",
        "failed_stores",
        "loaded_blocks",
        "stored_blocks",
        "stores_skipped",
    )

    def __init__(self) -> None:
        self.stored_blocks = 0
        self.failed_stores = 0
        self.evicted_blocks = 0
        self.loaded_blocks = 0
        self.stores_skipped = 0
        self._seen: dict[str, int] = {}  # the counters at the previous growth()

    def as_dict(self) -> dict[str, int]:
        return {
            "stored_blocks": self.stored_blocks,
            "failed_stores": self.failed_stores,
            "evicted_blocks": self.evicted_blocks,
            "loaded_blocks": self.loaded_blocks,
            "stores_skipped": self.stores_skipped,
        }

    def growth(self) -> dict[str, int]:
        """Each counter's growth since the previous call (since construction, the first time)."""
        now = self.as_dict()
        seen, self._seen = self._seen, now
        return {name: value - seen.get(name, 0) for name, value in now.items()}
