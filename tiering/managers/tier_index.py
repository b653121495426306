"""A secondary tier's index: which keys it holds, in which state, in which eviction order.

It lives in memory and is only touched by the manager's thread, so a lookup never touches the
disk. A key is visible (``READY``) only after the backend acknowledged its write; while the
write is in flight it is ``WRITING`` (a lookup answers "being written"). Keys whose read failed
or did not verify are quarantined for a while: lookups treat them as absent, so a bad block is
not promoted over and over. A key a promotion is reading is pinned in the eviction policy until
its last read ends.

:class:`TierIndex` holds the key sets beside the tier's eviction policy (which the tier owns,
from the moment it opens, and hands to each call), and does the per-key work of reserving room,
publishing writes, ending reads and forgetting keys. It counts only what a read's end finds (into
the metrics it is handed); its tier counts the rest.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

import cachetools

from tiering.backends.base import Outcome
from tiering.managers.tier_jobs import PromotionResult
from tiering.managers.tier_stats import TierMetrics
from tiering.policies import EvictionPolicy

__all__ = ["TierIndex", "TierKeyState"]

OK, CORRUPT, MISSING = Outcome.OK, Outcome.CORRUPT, Outcome.MISSING


class TierKeyState(enum.IntEnum):
    ABSENT = 0
    READY = 1
    WRITING = 2
    UNKNOWN = 3  # a shared tier knows nothing of it: the store must be asked (shared_tier)


class TierIndex:
    """The key sets of one tier, beside its eviction policy.

    ``held``: every key the policy holds (READY, WRITING or quarantined), kept with the policy.
    ``writing``: keys being written. ``reading``: keys being read, with the number of reads of
    each. ``quarantine``: keys
    treated as absent for ``quarantine_seconds``. ``stuck``: keys of stores past their deadline
    (absent, kept until purged from the backend).
    """

    __slots__ = ("held", "quarantine", "reading", "stuck", "writing")

    def __init__(self, quarantine_seconds: float, quarantine_max_keys: int) -> None:
        self.held: set[bytes] = set()
        self.writing: set[bytes] = set()
        self.reading: dict[bytes, int] = {}
        self.quarantine: cachetools.TTLCache[bytes, bool] = cachetools.TTLCache(
            maxsize=quarantine_max_keys, ttl=quarantine_seconds, timer=time.monotonic
        )
        self.stuck: set[bytes] = set()  # keys of late stores: absent, kept until purged

    def adopt(self, policy: EvictionPolicy, recovered: Sequence[bytes]) -> None:
        """Index the keys the backend recovered when it opened, in ``policy``."""
        for key in recovered:
            if key not in policy:
                policy.insert(key)
        self.held.clear()
        self.held.update(policy)

    # -- writes -------------------------------------------------------------------------------

    def reserve(
        self, policy: EvictionPolicy, keys: Sequence[bytes], capacity: int
    ) -> tuple[list[bytes], list[bytes]] | None:
        """Choose the keys to write (absent ones) and evict room for them, down to ``capacity``
        blocks.

        Returns ``(keys_to_write, victims)``, the keys marked WRITING and the victims already
        gone from the index (the write job deletes them from the backend first), or None with
        nothing changed if the policy cannot free enough.
        """
        to_write = [k for k in dict.fromkeys(keys) if k not in policy]
        if not to_write:
            return [], []
        policy.note_misses(to_write)
        if len(to_write) > capacity:
            return None
        shortfall = len(policy) + len(to_write) - capacity
        victims: list[bytes] = []
        if shortfall > 0:
            chosen = policy.evict(shortfall, protected=set(keys))
            if chosen is None:
                return None
            victims = chosen
            self.held.difference_update(victims)
        policy.insert_new(to_write, evictable=False)  # absent, once each
        self.held.update(to_write)
        self.writing.update(to_write)
        quarantine = self.quarantine
        if len(quarantine):  # (a TTLCache's pop is a few Python calls: skip it when empty)
            for key in to_write:
                quarantine.pop(key, None)
        return to_write, victims

    def make_room(
        self, policy: EvictionPolicy, needed: int, capacity: int, protected: set[bytes]
    ) -> list[bytes] | None:
        """Evict room for ``needed`` keys whose write found the backend full, and down to
        ``capacity`` if the backend allows fewer blocks now (a disk guard may have shrunk it
        since the write was reserved): at least ``needed`` victims, or None."""
        wanted = max(needed, len(policy) - capacity)
        victims = policy.evict(wanted, protected=protected)
        if victims is None and wanted > needed:
            victims = policy.evict(needed, protected=protected)
        if victims is not None:
            self.held.difference_update(victims)
        return victims

    def publish(
        self, policy: EvictionPolicy, keys: Sequence[bytes], outcomes: Sequence[Outcome]
    ) -> list[bytes]:
        """Make the keys whose write succeeded READY; forget the others. Returns the READY."""
        published = []
        writing, reading, held = self.writing, self.reading, self.held
        for key, outcome in zip(keys, outcomes, strict=True):
            writing.discard(key)
            if outcome is OK:
                policy.set_evictable(key, key not in reading)
                published.append(key)
            else:
                policy.remove(key)
                held.discard(key)
        return published

    # -- reads --------------------------------------------------------------------------------

    def pin_reads(self, policy: EvictionPolicy, keys: Sequence[bytes]) -> None:
        """A promotion reads ``keys`` (READY): each stays pinned until its last read ends."""
        reading = self.reading
        for key in keys:
            count = reading.get(key, 0)
            if count == 0:
                policy.set_evictable(key, False)
            reading[key] = count + 1

    def finish_reads(
        self,
        policy: EvictionPolicy,
        keys: Sequence[bytes],
        buffers: Sequence[memoryview],
        outcomes: Sequence[Outcome],
        metrics: TierMetrics,
    ) -> PromotionResult:
        """A promotion's reads of ``keys`` into ``buffers`` ended with ``outcomes``: unpin the
        keys no read holds; forget keys gone or corrupt in the backend, quarantine the other
        failures (counted in ``metrics``)."""
        loaded: list[bytes] = []
        failed: list[bytes] = []
        removed: list[bytes] = []
        reading = self.reading
        for key, buffer, outcome in zip(keys, buffers, outcomes, strict=True):
            count = reading.pop(key, 1) - 1
            if count:
                reading[key] = count
            if outcome is OK:
                loaded.append(key)
                metrics.bytes_read += buffer.nbytes
                if not count and key in policy:
                    policy.set_evictable(key, True)
                continue
            failed.append(key)
            metrics.promotion_failures += 1
            if outcome is CORRUPT:
                metrics.corrupt_blocks += 1
            if outcome in (CORRUPT, MISSING):
                # The backend no longer holds it: forget it for good.
                if key in policy and not count:
                    policy.remove(key)
                    self.held.discard(key)
                    removed.append(key)
            else:
                self.quarantine[key] = True
                metrics.quarantined += 1
        metrics.promoted_blocks += len(loaded)
        return PromotionResult(loaded, failed, removed)

    def release_reads(self, policy: EvictionPolicy | None, keys: Sequence[bytes]) -> None:
        """The reads of ``keys`` ended without a result (a late promotion's): unpin the keys no
        read holds, unless a write holds them."""
        reading, writing = self.reading, self.writing
        for key in keys:
            count = reading.pop(key, 1) - 1
            if count:
                reading[key] = count
            elif policy is not None and key in policy and key not in writing:
                policy.set_evictable(key, True)

    # -- forgetting ---------------------------------------------------------------------------

    def forget_stuck(self, policy: EvictionPolicy | None, keys: Sequence[bytes]) -> None:
        """Forget the late stores' keys of ``keys`` (deleted from the backend, or not)."""
        stuck, held = self.stuck, self.held
        for key in keys:
            if key in stuck:
                stuck.discard(key)
                if policy is not None and key in policy:
                    policy.remove(key)
                held.discard(key)

    def ready_keys(self, policy: EvictionPolicy | None) -> list[bytes]:
        """The keys a lookup would find READY if the tier were not stalled."""
        if policy is None:
            return []
        writing, quarantine, stuck = self.writing, self.quarantine, self.stuck
        return [k for k in policy if k not in writing and k not in quarantine and k not in stuck]

    def clear(self, policy: EvictionPolicy | None) -> list[bytes]:
        """Forget every key (``policy`` too); returns those the policy held."""
        keys = list(policy) if policy is not None else []
        if policy is not None:
            policy.clear()
        self.held.clear()
        self.writing.clear()
        self.reading.clear()
        self.quarantine.clear()
        self.stuck.clear()  # their late stores are purged from the backend all the same
        return keys
