"""A secondary tier: one storage backend with its own capacity, eviction policy and index.

The tier's metadata (which keys it holds, which are being written or read, the eviction order)
lives in memory and is only touched by the manager's thread, so a lookup never touches the disk.
Its I/O coroutines (:meth:`SecondaryTier.write` and :meth:`SecondaryTier.read`) run on the
manager's I/O loop and touch only the backend.

A key is visible (``READY``) only after the backend acknowledged its write; while the write is in
flight it is ``WRITING`` (a lookup answers "retry later"). Keys whose read failed or did not
verify are quarantined for a while: lookups treat them as absent, so a bad block is not promoted
over and over.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import cachetools

from tiering.backends.base import Outcome, StorageBackend
from tiering.errors import ConfigurationError
from tiering.policies import EvictionPolicy, make_policy

__all__ = ["SecondaryTier", "TierKeyState", "TierMetrics", "WritePolicy"]


class WritePolicy(enum.StrEnum):
    """When a block written to the primary tier reaches this tier."""

    WRITE_THROUGH = "write_through"  # every completed store cascades
    WRITE_BACK = "write_back"  # written when the primary evicts it
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # only keys looked up often enough


class TierKeyState(enum.IntEnum):
    ABSENT = 0
    READY = 1
    WRITING = 2


@dataclass
class TierMetrics:
    """Counters of one tier; latencies in seconds, one sample per job."""

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
    full_retries: int = 0
    evictions: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    load_latency_s: list[float] = field(default_factory=list)
    store_latency_s: list[float] = field(default_factory=list)


class SecondaryTier:
    """One backend plus the metadata that makes it a tier.

    ``policy`` is a registered policy name or an instance whose capacity is the backend's
    ``capacity_blocks``. ``max_inflight_jobs`` bounds the jobs in flight at once: over it, stores
    are shed (and counted) and promotions wait their turn. ``quarantine_seconds`` is how long a
    key whose promotion failed is treated as absent.
    """

    def __init__(
        self,
        backend: StorageBackend,
        *,
        name: str | None = None,
        policy: str | EvictionPolicy = "lru",
        write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH,
        selective_min_lookups: int = 2,
        max_inflight_jobs: int = 4,
        quarantine_seconds: float = 10.0,
        quarantine_max_keys: int = 65536,
    ) -> None:
        self.backend = backend
        self.name = name or backend.name
        self.medium = self.name.upper()
        try:
            self.write_policy = WritePolicy(write_policy)
        except ValueError:
            valid = ", ".join(p.value for p in WritePolicy)
            raise ConfigurationError(
                f"tier {self.name!r}: unknown write_policy {write_policy!r}; valid: {valid}"
            ) from None
        if selective_min_lookups < 1:
            raise ConfigurationError(
                f"tier {self.name!r}: selective_min_lookups must be >= 1, got "
                f"{selective_min_lookups}"
            )
        if max_inflight_jobs < 1:
            raise ConfigurationError(
                f"tier {self.name!r}: max_inflight_jobs must be >= 1, got {max_inflight_jobs}"
            )
        self.selective_min_lookups = selective_min_lookups
        self.max_inflight_jobs = max_inflight_jobs
        self._policy_spec = policy
        self._policy: EvictionPolicy | None = None
        self._writing: set[bytes] = set()
        self._reading: dict[bytes, int] = {}
        self._quarantine: cachetools.TTLCache[bytes, bool] = cachetools.TTLCache(
            maxsize=quarantine_max_keys, ttl=quarantine_seconds, timer=time.monotonic
        )
        self.inflight_jobs = 0
        self.metrics = TierMetrics()
        self.is_open = False

    # -- lifecycle (the manager awaits open/close on its I/O loop) ------------------------------

    async def open(self) -> list[bytes]:
        """Open the backend; return the keys it recovered (verified)."""
        return await self.backend.open()

    def adopt(self, recovered: Sequence[bytes]) -> None:
        """Build the index from recovered keys (manager thread, after :meth:`open`)."""
        capacity = self.backend.capacity_blocks
        if isinstance(self._policy_spec, EvictionPolicy):
            self._policy = self._policy_spec
        else:
            self._policy = make_policy(self._policy_spec, capacity)
        for key in recovered:
            if key not in self._policy:
                self._policy.insert(key)
        self.is_open = True

    async def close(self) -> None:
        await self.backend.close()

    @property
    def policy(self) -> EvictionPolicy:
        if self._policy is None:
            raise ConfigurationError(f"tier {self.name!r} is not open yet")
        return self._policy

    @property
    def capacity_blocks(self) -> int:
        return self.backend.capacity_blocks

    def __len__(self) -> int:
        return 0 if self._policy is None else len(self._policy)

    # -- metadata (manager thread only) --------------------------------------------------------

    def state(self, key: bytes) -> TierKeyState:
        if self._policy is None or key not in self._policy:
            return TierKeyState.ABSENT
        if key in self._writing:
            return TierKeyState.WRITING
        if key in self._quarantine:
            return TierKeyState.ABSENT
        return TierKeyState.READY

    def touch(self, keys: Sequence[bytes]) -> None:
        if self._policy is not None:
            self._policy.touch(keys)

    @property
    def has_capacity_for_job(self) -> bool:
        return self.inflight_jobs < self.max_inflight_jobs

    def reserve_write(
        self, keys: Sequence[bytes], protected: Collection[bytes] = ()
    ) -> tuple[list[bytes], list[bytes]] | None:
        """Choose the keys to write (absent ones) and evict room for them.

        Returns ``(keys_to_write, victims)``, with the keys marked WRITING and the victims already
        gone from the index (the write job deletes them from the backend first), or None with
        nothing changed if the policy cannot free enough.
        """
        policy = self.policy
        to_write = [k for k in dict.fromkeys(keys) if k not in policy]
        if not to_write:
            return [], []
        if len(to_write) > self.capacity_blocks:
            return None
        shortfall = len(policy) + len(to_write) - self.capacity_blocks
        victims: list[bytes] = []
        if shortfall > 0:
            chosen = policy.evict(shortfall, protected=set(keys) | set(protected))
            if chosen is None:
                return None
            victims = chosen
            self.metrics.evictions += len(victims)
        for key in to_write:
            policy.insert(key, evictable=False)
            self._writing.add(key)
            self._quarantine.pop(key, None)
        return to_write, victims

    def finish_write(self, keys: Sequence[bytes], outcomes: Sequence[Outcome]) -> list[bytes]:
        """Publish the keys whose write succeeded; forget the others. Returns the published."""
        published = []
        for key, outcome in zip(keys, outcomes, strict=True):
            self._writing.discard(key)
            if outcome is Outcome.OK:
                self.policy.set_evictable(key, key not in self._reading)
                published.append(key)
            else:
                self.policy.remove(key)
                self.metrics.store_failures += 1
        self.metrics.stored_blocks += len(published)
        return published

    def pin(self, keys: Sequence[bytes]) -> None:
        """Keep ``keys`` (READY) from eviction while they are read."""
        for key in keys:
            count = self._reading.get(key, 0)
            if count == 0:
                self.policy.set_evictable(key, False)
            self._reading[key] = count + 1

    def finish_read(self, keys: Sequence[bytes], outcomes: Sequence[Outcome]) -> list[bytes]:
        """Unpin after a read; drop keys that are gone or corrupt, quarantine failures.

        Returns the keys removed from the index (for removal events).
        """
        removed = []
        for key, outcome in zip(keys, outcomes, strict=True):
            count = self._reading.pop(key, 1) - 1
            if count:
                self._reading[key] = count
            if outcome is Outcome.OK:
                if not count and key in self.policy:
                    self.policy.set_evictable(key, True)
                continue
            self.metrics.promotion_failures += 1
            if outcome is Outcome.CORRUPT:
                self.metrics.corrupt_blocks += 1
            if outcome in (Outcome.CORRUPT, Outcome.MISSING):
                # The backend no longer holds it: forget it for good.
                if key in self.policy and not count:
                    self.policy.remove(key)
                    removed.append(key)
            else:
                self._quarantine[key] = True
                self.metrics.quarantined += 1
        return removed

    def forget(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.policy.remove(key)
            self._writing.discard(key)

    def clear(self) -> list[bytes]:
        """Forget every key (the manager deletes them from the backend); returns them."""
        keys = list(self.policy) if self._policy is not None else []
        if self._policy is not None:
            self._policy.clear()
        self._writing.clear()
        self._reading.clear()
        self._quarantine.clear()
        return keys

    # -- I/O (I/O loop only) --------------------------------------------------------------------

    async def write(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview], victims: Sequence[bytes]
    ) -> list[Outcome]:
        """Delete ``victims`` from the backend, then write ``keys``; never raises."""
        start = time.perf_counter()
        try:
            if victims:
                await self.backend.delete(list(victims))
            outcomes = await self.backend.put(list(keys), list(buffers)) if keys else []
        except Exception:  # a broken backend fails the job, never the manager
            outcomes = [Outcome.FAILED] * len(keys)
        self.metrics.store_latency_s.append(time.perf_counter() - start)
        self.metrics.bytes_written += sum(
            b.nbytes for b, o in zip(buffers, outcomes, strict=True) if o is Outcome.OK
        )
        return outcomes

    async def read(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        """Read ``keys`` into ``buffers``; never raises."""
        start = time.perf_counter()
        try:
            outcomes = await self.backend.get(list(keys), list(buffers))
        except Exception:
            outcomes = [Outcome.FAILED] * len(keys)
        self.metrics.load_latency_s.append(time.perf_counter() - start)
        self.metrics.bytes_read += sum(
            b.nbytes for b, o in zip(buffers, outcomes, strict=True) if o is Outcome.OK
        )
        return outcomes

    async def delete(self, keys: Sequence[bytes]) -> None:
        try:
            await self.backend.delete(list(keys))
        except Exception:  # best effort: the index has already forgotten them
            pass
