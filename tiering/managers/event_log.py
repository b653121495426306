"""The tiering manager's event log: blocks stored and removed in every medium, in order.

The primary's events ("CPU") are pulled from it whenever a call may have changed it; a tier's
are emitted as its jobs start (the keys it evicted to make room) and finish (the keys it
stored, or forgot). ``take_events`` hands them all out at once. While events are off nothing is
recorded, in the primary either (the manager switches both together).
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering.core.keys import OffloadKey
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.protocol import OffloadingEvent
from tiering.managers.secondary_tier import SecondaryTier

__all__ = ["EventLog"]


class EventLog:
    """Events not taken yet (see the module docstring); ``enabled`` says whether to record."""

    __slots__ = ("enabled", "events", "primary")

    def __init__(self, primary: CPUOffloadingManager, enabled: bool) -> None:
        self.primary = primary
        self.enabled = enabled
        self.events: list[OffloadingEvent] = []

    def pull_primary(self) -> None:
        """Append the primary's events recorded since the last pull."""
        if self.enabled:
            self.events += self.primary.take_events()

    def emit(self, tier: SecondaryTier, keys: Sequence[bytes], removed: bool) -> None:
        """Append one event for ``keys`` stored in (or removed from) ``tier``."""
        if self.enabled and keys:
            self.events.append(
                OffloadingEvent(
                    tuple(OffloadKey(k) for k in keys), tier.medium, removed, owner=tier.name
                )
            )

    def take(self) -> list[OffloadingEvent]:
        """Every event recorded so far, oldest first; the log is empty afterwards."""
        events, self.events = self.events, []
        return events
