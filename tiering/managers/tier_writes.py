"""A secondary tier's store jobs: room reserved, the write built, its outcomes published.

Whatever started it (a completed primary store, by write policy; a primary eviction owed by a
write-back tier; an embedder's put), a store job is written once (:meth:`TierWrites.start`,
:meth:`TierWrites.put`): room is reserved in the tier's index, evicting by its policy as
needed, down to the capacity the backend allows now (less when a disk guard shrinks it); the
job deletes the victims from the backend, then writes. When it returns, :meth:`TierWrites.finish`
publishes what the backend acknowledged and forgets what failed; keys that found the backend
FULL get one retry job, once the policy has evicted room for them (LMDB's map can fill before
the block count says so).

The tier hands each call its eviction policy and its metrics (the counts of stores, failures,
evictions, retries and bytes go there); shedding over the job bound is the tier's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tiering.backends.base import Outcome, StorageBackend
from tiering.managers.tier_index import TierIndex
from tiering.managers.tier_io import TierIO
from tiering.managers.tier_jobs import StoreResult, TierJob, job_outcomes
from tiering.managers.tier_stats import TierMetrics
from tiering.policies import EvictionPolicy

__all__ = ["TierWrites"]

OK, FAILED, FULL = Outcome.OK, Outcome.FAILED, Outcome.FULL


class TierWrites:
    """The store jobs of a tier over ``backend``, its ``index`` and its ``io``."""

    __slots__ = ("_backend", "_index", "_io")

    def __init__(self, backend: StorageBackend, index: TierIndex, io: TierIO) -> None:
        self._backend = backend
        self._index = index
        self._io = io

    def start(
        self,
        kind: str,
        policy: EvictionPolicy,
        metrics: TierMetrics,
        keys: Sequence[bytes],
        slots: Mapping[bytes, int],
        req_context: object,
    ) -> TierJob | None:
        """Reserve room for ``keys`` (evicting) and build their write from the primary rows
        (``slots[key]``); None if there is nothing to write, or no room (counted as shed)."""
        reserved = self.reserve(policy, metrics, keys)
        if reserved is None:
            metrics.stores_shed += len(keys)
            return None
        to_write, victims = reserved
        if not to_write:
            return None
        metrics.store_jobs += 1
        return self._io.write_job(
            kind, to_write, [slots[k] for k in to_write], victims, req_context
        )

    def put(
        self,
        policy: EvictionPolicy,
        metrics: TierMetrics,
        keys: Sequence[bytes],
        buffers: Sequence[memoryview],
        req_context: object,
    ) -> TierJob | None:
        """An embedder's put of ``buffers[i]`` under ``keys[i]``: room reserved as for a store;
        keys held already are touched, not rewritten. None if there is nothing to write, or no
        room (counted as shed)."""
        if len(buffers) != len(keys):
            raise ValueError(f"start_put got {len(keys)} keys but {len(buffers)} buffers")
        reserved = self.reserve(policy, metrics, keys)
        if reserved is None:
            metrics.stores_shed += len(keys)
            return None
        to_write, victims = reserved
        policy.touch([k for k in keys if k not in set(to_write)])
        if not to_write:
            return None
        index = {k: i for i, k in enumerate(keys)}
        picked = [index[k] for k in to_write]
        metrics.store_jobs += 1
        return self._io.write_job(
            "put", to_write, picked, victims, req_context, buffers=[buffers[i] for i in picked]
        )

    def reserve(
        self, policy: EvictionPolicy, metrics: TierMetrics, keys: Sequence[bytes]
    ) -> tuple[list[bytes], list[bytes]] | None:
        """Choose the keys to write and evict room for them (:meth:`TierIndex.reserve`); the
        victims are counted."""
        reserved = self._index.reserve(policy, keys, self._backend.effective_capacity_blocks)
        if reserved is not None and reserved[1]:
            metrics.evictions += len(reserved[1])
        return reserved

    def finish(
        self, policy: EvictionPolicy, metrics: TierMetrics, job: TierJob, result: object
    ) -> StoreResult:
        """Publish what the backend acknowledged, forget what failed; keys that found the
        backend FULL get one retry once the policy has evicted room for them."""
        outcomes = job_outcomes(job, result, metrics.store_latency_s)
        metrics.bytes_written += sum(
            b.nbytes for b, o in zip(job.buffers, outcomes, strict=True) if o is OK
        )
        full = [i for i, o in enumerate(outcomes) if o is FULL]
        settled = [i for i, o in enumerate(outcomes) if o is not FULL]
        stored = self.publish(
            policy, metrics, [job.keys[i] for i in settled], [outcomes[i] for i in settled]
        )
        pairs = [(job.keys[i], job.slots[i]) for i in settled]
        if not full:
            return StoreResult(stored, pairs, None)
        full_keys = [job.keys[i] for i in full]
        # Room for them, and down to the capacity the backend allows now (a disk guard may
        # have shrunk it since the job was reserved).
        capacity = self._backend.effective_capacity_blocks
        victims = None
        if not job.retried:
            victims = self._index.make_room(policy, len(full), capacity, set(job.keys))
        if victims is None:
            self.publish(policy, metrics, full_keys, [FAILED] * len(full))
            return StoreResult(stored, pairs + [(job.keys[i], job.slots[i]) for i in full], None)
        metrics.full_retries += 1
        metrics.evictions += len(victims)
        retry = self._io.write_job(
            job.kind,
            full_keys,
            [job.slots[i] for i in full],
            victims,
            job.req_context,
            retried=True,
            buffers=[job.buffers[i] for i in full],
        )
        return StoreResult(stored, pairs, retry)

    def publish(
        self,
        policy: EvictionPolicy,
        metrics: TierMetrics,
        keys: Sequence[bytes],
        outcomes: Sequence[Outcome],
    ) -> list[bytes]:
        """Make the keys whose write succeeded READY; forget the others. Returns the READY."""
        published = self._index.publish(policy, keys, outcomes)
        metrics.store_failures += len(keys) - len(published)
        metrics.stored_blocks += len(published)
        return published
