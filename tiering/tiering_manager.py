"""The tiering manager: the CPU primary tier composed with secondary tiers.

It speaks the same scheduler-side protocol as :class:`~tiering.manager.CPUOffloadingManager`
(lookup, prepare/complete load and store, touch, events) and adds what tiers need:

- a lookup asks the primary, then each secondary tier in order (from their in-memory indexes);
  a key found only in a secondary tier starts a *promotion* into a primary slot and answers None
  ("retry later"). A key is never promoted twice at once; promotions are batched per request;
- completed stores cascade to each tier by its write policy; a primary block pinned for a tier's
  write is released when *that* tier finishes;
- back-pressure: each tier bounds its jobs in flight; over the bound, stores are shed (and
  counted) while promotions wait their turn;
- a failed or corrupt promotion is a miss, counted, and quarantined, never retried in a loop.

Threads. Every protocol call runs on the caller's thread and never blocks on I/O: jobs run on a
private I/O loop thread (:class:`~tiering.io_loop.IOLoop`), and their results are applied on the
caller's thread at the start of the next call. All metadata is therefore touched by one thread,
so no locks sit on the hot path. Call the manager from one thread (or one event loop) at a time.

Asyncio users drive the same machinery with ``async with``, :meth:`drain` and
:meth:`lookup_async`; blocking helpers (:meth:`wait_idle`, :meth:`reset_cache`,
:meth:`shutdown`) exist for lifecycle and tools, never on the protocol's hot path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Protocol, Self

import cachetools
import torch

from tiering.backends.base import Outcome
from tiering.errors import ConfigurationError, TieringError
from tiering.groups import KVCacheSpec
from tiering.io_loop import IOLoop
from tiering.keys import OffloadKey, check_keys
from tiering.lookup import KeyState, find_hybrid_hit
from tiering.manager import CPUOffloadingManager
from tiering.specs import LoadStoreSpec, OffloadingEvent, PrepareStoreOutput
from tiering.tier import SecondaryTier, TierKeyState, WritePolicy

__all__ = ["Job", "TieringOffloadingManager"]


class _HasRows(Protocol):
    def rows_view(self) -> torch.Tensor: ...


@dataclass(eq=False)  # identity: jobs live in a set
class Job:
    """One batch of I/O between the primary pool and a tier. Await it with ``await job``."""

    kind: str  # "promote", "store", "write_back", "open", "delete"
    tier: str
    tier_index: int
    keys: tuple[bytes, ...]
    future: concurrent.futures.Future[Any]
    started_s: float = field(default_factory=time.perf_counter)

    def done(self) -> bool:
        return self.future.done()

    def __await__(self) -> Any:
        return asyncio.wrap_future(self.future).__await__()


class TieringOffloadingManager:
    """A CPU primary tier plus ordered secondary tiers, behind the manager protocol.

    ``pool`` holds the primary tier's bytes: a ``(num_blocks, row_bytes)`` uint8 tensor, or an
    object with ``rows_view()`` returning one (a :class:`~tiering.pool.CPUBlockPool`). Row ``i``
    is slot ``i`` of ``primary``, every rank's part of one offloaded block, and each tier's
    backend must store blocks of ``row_bytes``. Tiers open on the I/O loop as the manager starts;
    until a tier is open its lookups answer "absent" (call :meth:`wait_ready` to wait).
    """

    def __init__(
        self,
        primary: CPUOffloadingManager,
        secondary_tiers: Sequence[SecondaryTier] = (),
        *,
        pool: torch.Tensor | _HasRows,
        enable_events: bool | None = None,
        lookup_counter_size: int = 65536,
    ) -> None:
        rows = pool if isinstance(pool, torch.Tensor) else pool.rows_view()
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.device.type != "cpu":
            raise ConfigurationError(
                f"pool must be a 2-D uint8 CPU tensor (num_blocks, row_bytes), got "
                f"{tuple(rows.shape)} {rows.dtype} on {rows.device}"
            )
        if rows.shape[0] < primary.num_blocks:
            raise ConfigurationError(
                f"pool has {rows.shape[0]} rows but the primary tier has {primary.num_blocks} "
                "blocks; give a pool with one row per primary block"
            )
        names = [t.name for t in secondary_tiers]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"tier names must be unique, got {names}")
        for tier in secondary_tiers:
            if tier.backend.block_bytes != rows.shape[1]:
                raise ConfigurationError(
                    f"tier {tier.name!r} stores blocks of {tier.backend.block_bytes} bytes but a "
                    f"pool row is {rows.shape[1]} bytes; build the backend with "
                    f"block_bytes={rows.shape[1]}"
                )
        self.primary = primary
        self.tiers: list[SecondaryTier] = list(secondary_tiers)
        self.enable_events = primary.enable_events if enable_events is None else enable_events
        primary.enable_events = True  # the manager forwards (or drops) the primary's events
        self._rows = rows.numpy()
        self.row_bytes = int(rows.shape[1])
        self._io = IOLoop()
        self._finished: queue.SimpleQueue[tuple[Callable[[Any], None], Job]] = queue.SimpleQueue()
        self._jobs: set[Job] = set()
        self._events: list[OffloadingEvent] = []
        self._promoting: dict[bytes, int] = {}  # key -> tier index
        self._batch_request: object = None
        self._batch: dict[int, list[bytes]] = {}  # tier index -> keys, one request at a time
        self._waiting_promotions: dict[int, list[bytes]] = {}
        self._lookup_counts: cachetools.LRUCache[bytes, int] = cachetools.LRUCache(
            lookup_counter_size
        )
        self._dirty: dict[bytes, set[int]] = {}  # write-back tiers that still need a key
        self._draining: dict[int, int] = {}  # primary slot -> write-back jobs still copying it
        self.promotions_without_space = 0
        self._closed = False
        if any(t.write_policy is WritePolicy.WRITE_BACK for t in self.tiers):
            primary.set_eviction_hook(self._on_primary_evict)
        for index, tier in enumerate(self.tiers):
            self._submit("open", index, (), tier.open(), self._opened(index))

    # -- job plumbing ----------------------------------------------------------------------------

    def _submit(
        self,
        kind: str,
        tier_index: int,
        keys: Sequence[bytes],
        coro: Any,
        on_done: Callable[[Any], None],
    ) -> Job:
        future = self._io.submit(coro)
        job = Job(kind, self.tiers[tier_index].name, tier_index, tuple(keys), future)
        self._jobs.add(job)
        if kind in ("promote", "store", "write_back"):
            self.tiers[tier_index].inflight_jobs += 1
        future.add_done_callback(lambda _f: self._finished.put((on_done, job)))
        return job

    def _process_finished(self) -> None:
        """Apply the results of finished jobs, on the caller's thread."""
        finished = self._finished
        while not finished.empty():  # cheap when idle: no exception per protocol call
            on_done, job = finished.get_nowait()
            self._jobs.discard(job)
            if job.kind in ("promote", "store", "write_back"):
                self.tiers[job.tier_index].inflight_jobs -= 1
            try:
                result = job.future.result()
            except BaseException as exc:  # the coroutines never raise; be safe anyway
                result = exc
            on_done(result)
        if self._waiting_promotions:
            # Promotions that waited for a free job slot go now.
            for index in list(self._waiting_promotions):
                if self.tiers[index].has_capacity_for_job:
                    self._start_promotion(index, self._waiting_promotions.pop(index))

    def _begin_call(self, request: object = None) -> None:
        if self._closed:
            raise TieringError("the manager is shut down")
        self._process_finished()
        if self._batch and request is not self._batch_request:
            self._flush_promotions()

    def _check_open(self) -> None:
        if self._closed:
            raise TieringError("the manager is shut down")

    def _row(self, slot: int) -> memoryview:
        return memoryview(self._rows[slot])

    def _pull_primary_events(self) -> None:
        events = self.primary.take_events()
        if self.enable_events:
            self._events.extend(events)

    def _emit(self, tier: SecondaryTier, keys: Sequence[bytes], removed: bool) -> None:
        if self.enable_events and keys:
            self._events.append(
                OffloadingEvent(tuple(OffloadKey(k) for k in keys), tier.medium, removed)
            )

    def _opened(self, index: int) -> Callable[[Any], None]:
        def apply(result: Any) -> None:
            tier = self.tiers[index]
            if isinstance(result, BaseException):
                raise TieringError(f"tier {tier.name!r} failed to open: {result}") from result
            tier.adopt(result)

        return apply

    # -- lookups ---------------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: object = None) -> bool | None:
        """True if ready in the primary, False if in no tier, None to retry later (being written,
        or being promoted from a secondary tier, a promotion this call may start)."""
        self._begin_call(req_context)
        answer = self.primary.lookup(key)
        if answer is not False:
            return answer
        if key in self._promoting:
            return None
        self._count_lookup(key)
        state, index = self._tier_state(key)
        if state is TierKeyState.READY:
            if key in self._batch.get(index, ()):
                self._flush_promotions()  # asked again: stop batching, start it now
                return None
            self._batch_request = req_context
            self._batch.setdefault(index, []).append(key)
            return None
        return None if state is TierKeyState.WRITING else False

    def lookup_prefix(self, keys: Iterable[OffloadKey], req_context: object = None) -> int | None:
        """The number of leading keys ready in the primary; None if the prefix goes on in a
        secondary tier (its keys are being promoted) or in a block being written."""
        self._begin_call(req_context)
        key_list = check_keys(keys)
        count = 0
        for key in key_list:
            if self.primary.lookup(key) is not True:
                break
            count += 1
        promotable: dict[bytes, int] = {}
        pending = False
        for key in key_list[count:]:
            if self._state_for_lookup(key, promotable) is KeyState.ABSENT:
                break
            pending = True
        to_promote: dict[int, list[bytes]] = {}
        for promotable_key, index in promotable.items():
            to_promote.setdefault(index, []).append(promotable_key)
        self._start_promotions(to_promote)
        return None if pending else count

    def lookup_request(
        self,
        spec: KVCacheSpec,
        keys_per_group: Sequence[Sequence[bytes]],
        num_prompt_tokens: int,
        req_context: object = None,
    ) -> int | None:
        """Hybrid lookup across KV-cache groups (see :mod:`tiering.lookup`): the number of
        tokens loadable from the primary, or None while needed blocks are written or promoted.

        Groups may be split across tiers: a block only in a secondary tier counts as pending and
        its promotion starts, so the next call finds it in the primary."""
        self._begin_call(req_context)
        promotable: dict[bytes, int] = {}

        def state_of(key: bytes) -> KeyState:
            return self._state_for_lookup(key, promotable)

        hit = find_hybrid_hit(spec, keys_per_group, state_of, num_prompt_tokens)
        to_promote: dict[int, list[bytes]] = {}
        for key in hit.pending_keys:  # only the blocks this hit needs are promoted
            if key in promotable:
                to_promote.setdefault(promotable[key], []).append(key)
        self._start_promotions(to_promote)
        return hit.answer

    def _state_for_lookup(self, key: bytes, promotable: dict[bytes, int]) -> KeyState:
        """The key's state across tiers; a key a tier could promote is PENDING and noted."""
        answer = self.primary.lookup(OffloadKey(key))
        if answer is True:
            return KeyState.READY
        if answer is None or key in self._promoting:
            return KeyState.PENDING
        self._count_lookup(key)
        state, index = self._tier_state(key)
        if state is TierKeyState.ABSENT:
            return KeyState.ABSENT
        if state is TierKeyState.READY:
            promotable[key] = index
        return KeyState.PENDING

    def locate(self, key: OffloadKey) -> str | None:
        """Where ``key`` is stored and ready, without side effects: "CPU", a tier's medium, or
        None. For reports and tools; the protocol uses :meth:`lookup`."""
        if self.primary.lookup(key) is True:
            return self.primary.medium
        for tier in self.tiers:
            if tier.state(key) is TierKeyState.READY:
                return tier.medium
        return None

    def _tier_state(self, key: bytes) -> tuple[TierKeyState, int]:
        for index, tier in enumerate(self.tiers):
            state = tier.state(key)
            if state is not TierKeyState.ABSENT:
                if state is TierKeyState.READY:
                    tier.metrics.lookup_hits += 1
                return state, index
        return TierKeyState.ABSENT, -1

    def _count_lookup(self, key: bytes) -> None:
        self._lookup_counts[key] = self._lookup_counts.get(key, 0) + 1

    # -- promotions ------------------------------------------------------------------------------

    def _flush_promotions(self) -> None:
        batch, self._batch = self._batch, {}
        self._batch_request = None
        self._start_promotions(batch)

    def _start_promotions(self, by_tier: dict[int, list[bytes]]) -> None:
        for index, keys in by_tier.items():
            keys = [k for k in dict.fromkeys(keys) if k not in self._promoting]
            if not keys:
                continue
            if not self.tiers[index].has_capacity_for_job:
                # Loads wait for a free job slot (stores are shed instead).
                waiting = self._waiting_promotions.setdefault(index, [])
                waiting.extend(k for k in keys if k not in waiting)
                for key in keys:
                    self._promoting[key] = index
                continue
            self._start_promotion(index, keys)

    def _start_promotion(self, index: int, keys: list[bytes]) -> None:
        tier = self.tiers[index]
        for key in keys:
            self._promoting.pop(key, None)
        keys = [k for k in keys if tier.state(k) is TierKeyState.READY and k not in self.primary]
        if not keys:
            return
        out = self.primary.prepare_store([OffloadKey(k) for k in keys])
        self._pull_primary_events()
        if out is None:
            if self._draining:
                # Write-backs are freeing slots: try again when one finishes.
                for key in keys:
                    self._promoting[key] = index
                self._waiting_promotions.setdefault(index, []).extend(keys)
                return
            # No room in the primary now: the lookup answers a miss, not a retry loop.
            self.promotions_without_space += len(keys)
            return
        keys = list(out.keys_to_store)
        slots = out.store_spec.block_ids.tolist()
        tier.pin(keys)
        for key in keys:
            self._promoting[key] = index
        tier.metrics.promotions += 1
        buffers = [self._row(slot) for slot in slots]

        def done(outcomes: Any) -> None:
            if isinstance(outcomes, BaseException):
                outcomes = [Outcome.FAILED] * len(keys)
            ok = [OffloadKey(k) for k, o in zip(keys, outcomes, strict=True) if o is Outcome.OK]
            bad = [
                OffloadKey(k) for k, o in zip(keys, outcomes, strict=True) if o is not Outcome.OK
            ]
            for key in keys:
                self._promoting.pop(key, None)
            if ok:
                self.primary.complete_store(ok, success=True)
                tier.metrics.promoted_blocks += len(ok)
            if bad:
                self.primary.complete_store(bad, success=False)
            self._pull_primary_events()
            self._emit(tier, tier.finish_read(keys, outcomes), removed=True)

        self._submit("promote", index, keys, tier.read(keys, buffers), done)

    # -- loads -----------------------------------------------------------------------------------

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: object = None
    ) -> LoadStoreSpec:
        """Pin primary-ready keys for a load; see :meth:`CPUOffloadingManager.prepare_load`."""
        self._begin_call(req_context)
        return self.primary.prepare_load(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: object = None) -> None:
        self._begin_call(req_context)
        self.primary.complete_load(keys)

    def touch(self, keys: Collection[OffloadKey], req_context: object = None) -> None:
        """Most recent use in every tier; the first key ends most recent."""
        self._begin_call(req_context)
        key_list = check_keys(keys)
        self.primary.touch(key_list)
        for tier in self.tiers:
            tier.touch(key_list)

    # -- stores ----------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: object = None
    ) -> PrepareStoreOutput | None:
        """Reserve primary slots; see :meth:`CPUOffloadingManager.prepare_store`. With a
        write-back tier, evicting dirty blocks starts their write-back and may answer None until
        it is done."""
        self._begin_call(req_context)
        out = self.primary.prepare_store(keys)
        self._pull_primary_events()
        return out

    def complete_store(
        self, keys: Collection[OffloadKey], success: bool = True, req_context: object = None
    ) -> None:
        """Finish a primary store, then cascade the new blocks to the tiers by write policy."""
        self._begin_call(req_context)
        key_list = check_keys(keys)
        fresh = [k for k in key_list if self.primary.lookup(k) is None]
        self.primary.complete_store(key_list, success)
        self._pull_primary_events()
        if not success:
            return
        ready = [k for k in fresh if self.primary.lookup(k) is True]
        if not ready:
            return
        for index, tier in enumerate(self.tiers):
            if not tier.is_open:
                continue
            if tier.write_policy is WritePolicy.WRITE_BACK:
                for key in ready:
                    self._dirty.setdefault(key, set()).add(index)
                continue
            chosen = ready
            if tier.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
                chosen = [
                    k for k in ready if self._lookup_counts.get(k, 0) >= tier.selective_min_lookups
                ]
            if chosen:
                self._write_through(index, chosen)

    def _write_through(self, index: int, keys: list[OffloadKey]) -> None:
        tier = self.tiers[index]
        if not tier.has_capacity_for_job:
            tier.metrics.stores_shed += len(keys)
            return
        reserved = tier.reserve_write(keys)
        if reserved is None:
            tier.metrics.stores_shed += len(keys)
            return
        to_write, victims = reserved
        self._emit(tier, victims, removed=True)
        if not to_write:
            if victims:
                self._submit("delete", index, victims, tier.delete(victims), lambda _r: None)
            return
        # Pinned in the primary until this tier is done, and only for this tier.
        spec = self.primary.prepare_load([OffloadKey(k) for k in to_write])
        buffers = [self._row(slot) for slot in spec.block_ids.tolist()]

        def done(outcomes: Any) -> None:
            self.primary.complete_load([OffloadKey(k) for k in to_write])
            self._finish_tier_write(index, to_write, buffers, outcomes, retry=True)

        tier.metrics.store_jobs += 1
        self._submit("store", index, to_write, tier.write(to_write, buffers, victims), done)

    def _finish_tier_write(
        self,
        index: int,
        keys: Sequence[bytes],
        buffers: Sequence[memoryview],
        outcomes: Any,
        *,
        retry: bool,
        on_settled: Callable[[list[bytes]], None] | None = None,
    ) -> None:
        """Publish a tier write; keys that found the backend full get one retry after the tier's
        policy evicts room for them (LMDB's map can fill before the block count says so)."""
        tier = self.tiers[index]
        if isinstance(outcomes, BaseException):
            outcomes = [Outcome.FAILED] * len(keys)
        full = [k for k, o in zip(keys, outcomes, strict=True) if o is Outcome.FULL]
        settled = [k for k, o in zip(keys, outcomes, strict=True) if o is not Outcome.FULL]
        settled_outcomes = [o for o in outcomes if o is not Outcome.FULL]
        self._emit(tier, tier.finish_write(settled, settled_outcomes), removed=False)
        if on_settled:
            on_settled(settled)
        if not full:
            return
        victims = tier.policy.evict(len(full), protected=set(keys)) if retry else None
        if victims is None:
            tier.finish_write(full, [Outcome.FAILED] * len(full))
            if on_settled:
                on_settled(full)
            return
        tier.metrics.full_retries += 1
        tier.metrics.evictions += len(victims)
        self._emit(tier, victims, removed=True)
        full_buffers = [b for k, b in zip(keys, buffers, strict=True) if k in set(full)]
        pinned = [OffloadKey(k) for k in full if self.primary.lookup(OffloadKey(k)) is True]
        if pinned:
            self.primary.prepare_load(pinned)

        def done(again: Any) -> None:
            if pinned:
                self.primary.complete_load(pinned)
            self._finish_tier_write(
                index, full, full_buffers, again, retry=False, on_settled=on_settled
            )

        self._submit("store", index, full, tier.write(full, full_buffers, victims), done)

    # -- write-back --------------------------------------------------------------------------------

    def _on_primary_evict(self, victims: list[tuple[OffloadKey, int]]) -> set[int]:
        """Start writing dirty victims to their write-back tiers; keep their slots until done."""
        retained: set[int] = set()
        by_tier: dict[int, list[tuple[OffloadKey, int]]] = {}
        for key, slot in victims:
            for index in self._dirty.pop(key, ()):
                by_tier.setdefault(index, []).append((key, slot))
        for index, pairs in by_tier.items():
            tier = self.tiers[index]
            if not tier.has_capacity_for_job:
                tier.metrics.stores_shed += len(pairs)
                continue
            reserved = tier.reserve_write([k for k, _ in pairs])
            if reserved is None:
                tier.metrics.stores_shed += len(pairs)
                continue
            to_write, tier_victims = reserved
            self._emit(tier, tier_victims, removed=True)
            slot_of = dict(pairs)
            slots = [slot_of[OffloadKey(k)] for k in to_write]
            if not to_write:
                continue
            for slot in slots:
                self._draining[slot] = self._draining.get(slot, 0) + 1
                retained.add(slot)
            buffers = [self._row(s) for s in slots]
            slot_by_key = dict(zip(to_write, slots, strict=True))

            def settled(keys: list[bytes], slot_by_key: dict[bytes, int] = slot_by_key) -> None:
                self._release_draining([slot_by_key[k] for k in keys])

            def done(
                outcomes: Any,
                index: int = index,
                to_write: list[bytes] = to_write,
                buffers: list[memoryview] = buffers,
                settled: Callable[[list[bytes]], None] = settled,
            ) -> None:
                self._finish_tier_write(
                    index, to_write, buffers, outcomes, retry=True, on_settled=settled
                )

            tier.metrics.store_jobs += 1
            self._submit(
                "write_back", index, to_write, tier.write(to_write, buffers, tier_victims), done
            )
        return retained

    def _release_draining(self, slots: Sequence[int]) -> None:
        free = []
        for slot in slots:
            left = self._draining[slot] - 1
            if left:
                self._draining[slot] = left
            else:
                del self._draining[slot]
                free.append(slot)
        self.primary.release_slots(free)

    # -- events, metrics, lifecycle ----------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        """Stored and removed events of every medium ("CPU", then each tier's), in order."""
        self._begin_call(self._batch_request)
        self._flush_promotions()
        self._pull_primary_events()
        events, self._events = self._events, []
        return events

    def inflight_jobs(self) -> list[Job]:
        return list(self._jobs)

    def metrics(self) -> dict[str, Any]:
        """Counters per tier and of the primary tier."""
        out: dict[str, Any] = {
            "primary": {
                "blocks": len(self.primary),
                "free_blocks": self.primary.num_free_blocks,
                "promotions_without_space": self.promotions_without_space,
            }
        }
        for tier in self.tiers:
            out[tier.name] = {
                "blocks": len(tier),
                "capacity_blocks": tier.capacity_blocks if tier.is_open else 0,
                "inflight_jobs": tier.inflight_jobs,
                **{k: v for k, v in vars(tier.metrics).items() if not isinstance(v, list)},
                "backend": vars(tier.backend.stats),
            }
        return out

    def wait_idle(self, timeout: float | None = 60.0) -> None:
        """Block until no job is in flight and every result is applied (lifecycle and tools;
        never called by the protocol)."""
        if self._io.in_loop_thread():
            raise TieringError("wait_idle() would deadlock on the I/O loop thread")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._flush_promotions()
        while True:
            self._process_finished()
            if not self._jobs and not self._waiting_promotions:
                return
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"{len(self._jobs)} tiering job(s) still in flight")
            concurrent.futures.wait(
                [j.future for j in self._jobs],
                timeout=remaining,
                return_when=concurrent.futures.FIRST_COMPLETED,
            )
            time.sleep(0)  # let done-callbacks enqueue their results

    def wait_ready(self, timeout: float | None = 60.0) -> None:
        """Block until every tier is open and indexed."""
        self.wait_idle(timeout)

    async def drain(self) -> None:
        """Wait, without blocking the event loop, until all in-flight work is done."""
        self._flush_promotions()
        while True:
            self._process_finished()
            if not self._jobs and not self._waiting_promotions:
                return
            await asyncio.wait(
                [asyncio.wrap_future(j.future) for j in self._jobs],
                return_when=asyncio.FIRST_COMPLETED,
            )
            await asyncio.sleep(0)

    async def lookup_async(self, key: OffloadKey, req_context: object = None) -> bool:
        """Like :meth:`lookup`, but waits out "retry later": True once ready, False if absent."""
        while True:
            answer = self.lookup(key, req_context)
            if answer is not None:
                return answer
            self._flush_promotions()
            await self._wait_any()

    async def lookup_request_async(
        self,
        spec: KVCacheSpec,
        keys_per_group: Sequence[Sequence[bytes]],
        num_prompt_tokens: int,
        req_context: object = None,
    ) -> int:
        """Like :meth:`lookup_request`, but waits for the promotions it starts."""
        while True:
            answer = self.lookup_request(spec, keys_per_group, num_prompt_tokens, req_context)
            if answer is not None:
                return answer
            await self._wait_any()

    async def _wait_any(self) -> None:
        if self._jobs:
            await asyncio.wait(
                [asyncio.wrap_future(j.future) for j in self._jobs],
                return_when=asyncio.FIRST_COMPLETED,
            )
        await asyncio.sleep(0)

    async def __aenter__(self) -> Self:
        await self.drain()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drain in-flight work, close every tier, stop the I/O loop; idempotent."""
        if self._closed:
            return
        await self.drain()
        for tier in self.tiers:
            await asyncio.wrap_future(self._io.submit(tier.close()))
        self._finish_close()

    def reset_cache(self) -> None:
        """Drop every block of every tier (e.g. after a weight update). Drains in-flight jobs
        first, so no late write lands in a reused slot."""
        self._check_open()
        self.wait_idle()
        self.primary.reset_cache()
        self._pull_primary_events()
        self._dirty.clear()
        self._draining.clear()
        self._promoting.clear()
        self._batch.clear()
        self._waiting_promotions.clear()
        for index, tier in enumerate(self.tiers):
            if not tier.is_open:
                continue
            keys = tier.clear()
            self._emit(tier, keys, removed=True)
            if keys:
                self._submit("delete", index, keys, tier.delete(keys), lambda _r: None)
        self.wait_idle()

    def shutdown(self) -> None:
        """Drain in-flight jobs, close every tier and stop the I/O loop; idempotent."""
        if self._closed:
            return
        try:
            self.wait_idle()
        finally:
            for tier in self.tiers:
                try:
                    self._io.submit(tier.close()).result(timeout=60)
                except Exception:  # closing the rest matters more
                    pass
            self._finish_close()

    def _finish_close(self) -> None:
        self._closed = True
        self._io.close()
        self.primary.shutdown()

    def __del__(self) -> None:
        io = getattr(self, "_io", None)
        if io is not None and not getattr(self, "_closed", True):
            io.close(timeout=0)
