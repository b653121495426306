"""The tier API for embedders: a thread-safe facade over a stack of secondary tiers.

A serving engine's storage plugin (SGLang's HiCache L3, LMCache's remote connector, see
:mod:`tiering.integrations`) calls it from its own threads or event loop, with its own memory:

- ``exists(keys)``: how many of the leading keys are stored (a prefix count);
- ``put(keys, blocks)``: store each block; ``get(keys, blocks)``: read each into the caller's
  memory and say how long it is (None: a miss).

A block is one buffer (``bytes``-like, a numpy array or a contiguous CPU ``torch.Tensor``) or a
list of *runs*, ``(address or tensor or buffer, length)``, read or written in order: the memory of
one page of an engine's host pool is often several runs (K and V, or one per layer). Blocks may be
shorter than the tiers' slot: their true length is stored and verified (the framing of
:mod:`tiering.core.block_format`). Each call has an async form (``aexists``, ``aput``,
``aget``, for an engine's event loop) and a sync form, callable from any thread; both run the
tiers' I/O on tiering's own :class:`~tiering.managers.io_loop.IOLoop`, never on the caller's loop.

What it keeps right. The tiers' metadata (index, eviction policy, pins, quarantine, metrics) is
touched only under one lock, which is never held across I/O: a put reserves room (evicting by
policy) and publishes what the backend acknowledged; a get pins its keys while they are read and
forgets what is gone or corrupt. Every block read verifies (header, key, layout fingerprint,
checksum, frame) or is a miss.

Caller memory is touched only inside the call: a put gathers the runs into a staging slot
before its I/O starts, a get scatters from its staging slot after its I/O ended. So a call that
times out (``timeout_s``) or is cancelled never writes the caller's memory later; its tier job
still finishes in the background and settles the index. The staging copy is the price of that
guarantee (a memory copy per block, small next to the tier's I/O).

A put writes every tier of the stack (each keeps what it has room for); a get reads each key from
the first tier that holds it; ``exists`` counts a key held by any tier. A shared tier (Redis) is
asked about keys its existence cache does not know.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiering.backends.base import Outcome
from tiering.config import TierConfig, build_tier
from tiering.core.block_format import (
    FRAME_BYTES,
    FRAMING,
    frame_capacity,
    make_layout_fingerprint,
)
from tiering.core.memory_runs import Block, EmbedError, Run, StagingRows, as_runs, gather, scatter
from tiering.errors import CorruptBlockError, InvalidKeyError, TieringError
from tiering.managers.io_loop import IOLoop
from tiering.managers.secondary_tier import IOResult, SecondaryTier, TierJob, TierKeyState
from tiering.managers.shared_tier import SharedTier

__all__ = [
    "Block",
    "EmbedError",
    "EmbedStats",
    "Run",
    "TierStore",
    "as_runs",
    "framed_layout",
]

logger = logging.getLogger(__name__)

_READY, _UNKNOWN = TierKeyState.READY, TierKeyState.UNKNOWN


def framed_layout(layout: Mapping[str, object], max_block_bytes: int) -> tuple[dict[str, Any], int]:
    """The layout description and slot size of framed tiers holding blocks of up to
    ``max_block_bytes``: the framing is part of the description (hence the fingerprint)."""
    slot_bytes = max_block_bytes + FRAME_BYTES
    return {**layout, "block_framing": FRAMING, "max_block_bytes": max_block_bytes}, slot_bytes


@dataclass
class EmbedStats:
    """The facade's counters (cumulative); the tiers keep their own (:meth:`TierStore.stats`)."""

    exists_calls: int = 0
    exists_keys: int = 0
    exists_hits: int = 0
    puts: int = 0
    put_blocks: int = 0
    put_failures: int = 0
    put_bytes: int = 0
    gets: int = 0
    get_hits: int = 0
    get_misses: int = 0
    get_bytes: int = 0
    corrupt: int = 0
    timeouts: int = 0
    extra: dict[str, int] = field(default_factory=dict)


def _check_keys(keys: Sequence[bytes]) -> list[bytes]:
    out = []
    for i, key in enumerate(keys):
        if not isinstance(key, bytes) or not 0 < len(key) <= 80:
            raise InvalidKeyError(f"key {i} must be 1..80 bytes, got {key!r:.60}")
        out.append(key)
    return out


class _Op:
    """The tier jobs of one call: finished (under the store's lock) as each ends, the call's
    result future set once all have."""

    def __init__(self, store: TierStore, finish: Callable[[_Op, TierJob, object], None]) -> None:
        self.store = store
        self.finish = finish
        self.pending = 1  # the call's own token, dropped by seal(): no result before that
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def submit(self, job: TierJob) -> None:
        """Submit ``job`` (lock held; its callback may run at once, on this thread, when the
        backend finishes without suspending: the store's lock is reentrant for that)."""
        self.pending += 1
        future = self.store._io.submit(job.io)
        job.future = future
        self.store._inflight.add(future)
        future.add_done_callback(lambda f: self._ended(job, f))

    def _ended(self, job: TierJob, future: concurrent.futures.Future[Any]) -> None:
        result: object = future.exception() if not future.cancelled() else TieringError("cancelled")
        if result is None:
            result = future.result()
        with self.store._lock:
            self.store._inflight.discard(future)
            try:
                self.finish(self, job, result)
            except Exception:  # never lose the op: settle it, the tier logs its own errors
                logger.exception("finishing a %s job of tier %r failed", job.kind, job.tier.name)
            self._drop()

    def seal(self) -> None:
        """No more jobs from the call (lock held); retries may still follow from finish."""
        self._drop()

    def _drop(self) -> None:
        self.pending -= 1
        if self.pending == 0 and not self.done.done():
            self.done.set_result(None)


class TierStore:
    """A thread-safe facade over ``tiers`` (looked up in order); see the module docstring.

    The tiers are built for framed blocks (:func:`framed_layout`); all have one slot size, and
    ``max_block_bytes`` is the longest block they hold. ``timeout_s`` bounds each sync call's wait
    (and an async call's, see :meth:`aget`): past it the call fails (misses, puts not done) and
    counts a timeout. ``io_loop``: the loop the tiers' I/O runs on (default: the store's own).
    """

    def __init__(
        self,
        tiers: Sequence[SecondaryTier],
        *,
        timeout_s: float = 30.0,
        io_loop: IOLoop | None = None,
    ) -> None:
        if not tiers:
            raise EmbedError("a TierStore needs at least one tier")
        slots = {t.backend.block_bytes for t in tiers}
        if len(slots) != 1:
            raise EmbedError(
                f"the tiers of a TierStore must have one slot size, got {sorted(slots)}"
            )
        self.slot_bytes = slots.pop()
        self.max_block_bytes = frame_capacity(self.slot_bytes)
        if self.max_block_bytes <= 0:
            raise EmbedError(f"a slot of {self.slot_bytes} bytes holds no framed block")
        if not timeout_s > 0:
            raise EmbedError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.tiers = tuple(tiers)
        self.timeout_s = float(timeout_s)
        self._own_loop = io_loop is None
        self._io = io_loop if io_loop is not None else IOLoop("tiering-embed-io")
        # Reentrant: a job's done-callback may run on the submitting thread (see _Op.submit).
        self._lock = threading.RLock()
        self._inflight: set[concurrent.futures.Future[Any]] = set()
        self.stats = EmbedStats()
        self._staging = StagingRows(self.slot_bytes)
        self._open = False
        self._closed = False

    # -- construction from configuration ----------------------------------------------------------

    @classmethod
    def from_tier_configs(
        cls,
        tier_configs: Sequence[TierConfig],
        *,
        max_block_bytes: int,
        layout: Mapping[str, object],
        timeout_s: float = 30.0,
    ) -> TierStore:
        """Build (not open) framed tiers from :class:`~tiering.config.TierConfig` entries, for
        blocks of up to ``max_block_bytes`` whose meaning ``layout`` describes (JSON-able: model,
        ranks, dtype, geometry): it is the tiers' layout fingerprint."""
        if isinstance(max_block_bytes, bool) or not isinstance(max_block_bytes, int):
            raise EmbedError(f"max_block_bytes must be an int, got {max_block_bytes!r:.40}")
        if max_block_bytes <= 0:
            raise EmbedError(f"max_block_bytes must be > 0, got {max_block_bytes}")
        description, slot_bytes = framed_layout(layout, max_block_bytes)
        fingerprint = make_layout_fingerprint(description)
        tiers = [
            build_tier(
                tc, block_bytes=slot_bytes, fingerprint=fingerprint, layout_description=description
            )
            for tc in tier_configs
        ]
        return cls(tiers, timeout_s=timeout_s)

    # -- lifecycle --------------------------------------------------------------------------------

    def open(self) -> None:
        """Open every tier (sync); a tier that fails to open is degraded (logged) and skipped."""
        self._wait(self._io.submit(self.aopen_on_loop()), "open", self.timeout_s * 4)

    async def aopen(self) -> None:
        await asyncio.wrap_future(self._io.submit(self.aopen_on_loop()))

    async def aopen_on_loop(self) -> None:
        """Open the tiers (runs on the store's I/O loop)."""
        if self._closed:
            raise EmbedError("the TierStore is closed")
        if self._open:
            return
        for tier in self.tiers:
            job = tier.start_open()
            try:
                result: object = await job.io
            except Exception as exc:  # the tier reports it: degraded
                result = exc
            with self._lock:
                tier.finish_open(job, result)
        self._open = True

    def close(self) -> None:
        """Wait (bounded) for jobs in flight, close the tiers, stop the loop; idempotent."""
        if self._closed:
            return
        with self._lock:
            self._closed = True
            pending = list(self._inflight)
        concurrent.futures.wait(pending, timeout=self.timeout_s)
        for tier in self.tiers:
            if tier.status in ("open", "reset"):
                try:
                    self._io.submit(tier.start_close().io).result(self.timeout_s)
                except Exception:
                    logger.warning("closing tier %r failed", tier.name, exc_info=True)
            tier.status = "closed"
        if self._own_loop:
            self._io.close()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> TierStore:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if self._closed:
            raise EmbedError("the TierStore is closed")
        if not self._open:
            raise EmbedError("the TierStore is not open; call open() first")

    # -- exists ---------------------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> int:
        """How many of the leading ``keys`` a tier holds (readable now)."""
        return self._wait(self._io.submit(self._exists(list(keys))), "exists", self.timeout_s, 0)

    async def aexists(self, keys: Sequence[bytes]) -> int:
        return await self._await(self._io.submit(self._exists(list(keys))), "exists", 0)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether a tier holds each key (readable now), from the tiers' indexes (and shared
        stores' answers)."""
        fut = self._io.submit(self._contains(_check_keys(keys)))
        return self._wait(fut, "contains", self.timeout_s, [False] * len(keys))

    async def _exists(self, keys: list[bytes]) -> int:
        found = await self._contains(_check_keys(keys), prefix=True)
        count = found.index(False) if False in found else len(found)
        with self._lock:
            self.stats.exists_calls += 1
            self.stats.exists_keys += len(keys)
            self.stats.exists_hits += count
        return count

    async def _contains(self, keys: list[bytes], *, prefix: bool = False) -> list[bool]:
        self._check_usable()
        return await _find_stored(self.tiers, self._lock, keys, prefix=prefix)

    # -- put ------------------------------------------------------------------------------------

    def put(self, keys: Sequence[bytes], blocks: Sequence[Block]) -> list[bool]:
        """Store ``blocks[i]`` under ``keys[i]`` in every tier; True where a tier holds it now.
        Raises :class:`EmbedError` / ``InvalidKeyError`` for bad input, storing nothing."""
        keys, staging, lengths = self._stage_put(keys, blocks)
        op, results = self._start_put(keys, staging)
        self._wait(op.done, "put", self.timeout_s, None)
        return self._put_result(results, op.done.done(), lengths)

    async def aput(self, keys: Sequence[bytes], blocks: Sequence[Block]) -> list[bool]:
        keys, staging, lengths = self._stage_put(keys, blocks)
        op, results = self._start_put(keys, staging)
        await self._await(op.done, "put", None)
        return self._put_result(results, op.done.done(), lengths)

    def _stage_put(
        self, keys: Sequence[bytes], blocks: Sequence[Block]
    ) -> tuple[list[bytes], list[memoryview], list[int]]:
        self._check_usable()
        keys = _check_keys(keys)
        if len(blocks) != len(keys):
            raise EmbedError(f"put got {len(keys)} keys but {len(blocks)} blocks")
        all_runs = [as_runs(b, writable=False, where=f"block {i}") for i, b in enumerate(blocks)]
        lengths = [sum(r.nbytes for r in runs) for runs in all_runs]
        for i, length in enumerate(lengths):
            if length > self.max_block_bytes:
                raise EmbedError(
                    f"block {i} is {length} bytes; these tiers hold blocks of at most "
                    f"{self.max_block_bytes} bytes"
                )
        staging = self._staging.take(len(keys))
        for runs, row in zip(all_runs, staging, strict=True):
            gather(runs, row)
        return keys, staging, lengths

    def _start_put(self, keys: list[bytes], rows: list[memoryview]) -> tuple[_Op, list[bool]]:
        staging = rows
        stored = [False] * len(keys)

        def finish(op: _Op, job: TierJob, result: object) -> None:
            settled = job.tier.finish_store(job, result)
            if settled.retry is not None:  # FULL: the tier evicted room, one retry
                op.submit(settled.retry)
            if isinstance(result, IOResult):
                for slot, outcome in zip(job.slots, result.outcomes, strict=False):
                    if outcome is Outcome.OK:
                        stored[slot] = True

        op = _Op(self, finish)
        with self._lock:
            self._check_usable()
            for tier in self.tiers:
                if not tier.is_open:
                    continue
                # A batch larger than a tier: it keeps the leading blocks (a prefix is what a
                # later lookup can use), rather than refusing them all.
                n = len(keys) if tier.shared else min(len(keys), tier.capacity_blocks)
                job = tier.start_put(keys[:n], staging[:n]) if n else None
                if job is not None:
                    op.submit(job)
            # Keys a tier held already (not rewritten) are stored too.
            for i, key in enumerate(keys):
                if any(t.state(key) is _READY for t in self.tiers):
                    stored[i] = True
            op.seal()
            self.stats.puts += 1
        # The rows go back once every job of the call ended (a call that gave up included).
        op.done.add_done_callback(lambda _: self._staging.give(rows))
        return op, stored

    def _put_result(self, stored: list[bool], finished: bool, lengths: list[int]) -> list[bool]:
        with self._lock:
            if finished:  # a retry job may have stored what the first found FULL
                result = list(stored)
            else:
                result = [False] * len(stored)
            self.stats.put_blocks += sum(result)
            self.stats.put_failures += len(result) - sum(result)
            self.stats.put_bytes += sum(n for n, ok in zip(lengths, result, strict=True) if ok)
        return result

    # -- get ------------------------------------------------------------------------------------

    def get(
        self, keys: Sequence[bytes], blocks: Sequence[Block], *, exact: bool = False
    ) -> list[int | None]:
        """Read each key into ``blocks[i]`` (writable memory of at least the block's length);
        the block's length, or None for a miss (absent, gone, corrupt, too long for the
        memory given, or the call timed out). ``exact``: a block whose length is not the
        memory's whole size is a miss too (nothing of it written)."""
        keys, targets, op, staging, chosen = self._start_get(keys, blocks)
        self._wait(op.done, "get", self.timeout_s, None)
        return self._scatter(keys, targets, op, staging, chosen, exact)

    async def aget(
        self, keys: Sequence[bytes], blocks: Sequence[Block], *, exact: bool = False
    ) -> list[int | None]:
        keys, targets, op, staging, chosen = self._start_get(keys, blocks)
        await self._await(op.done, "get", None)
        return self._scatter(keys, targets, op, staging, chosen, exact)

    def _start_get(
        self, keys: Sequence[bytes], blocks: Sequence[Block]
    ) -> tuple[list[bytes], list[list[memoryview]], _Op, list[memoryview], dict[bytes, int]]:
        self._check_usable()
        keys = _check_keys(keys)
        if len(blocks) != len(keys):
            raise EmbedError(f"get got {len(keys)} keys but {len(blocks)} blocks")
        targets = [as_runs(b, writable=True, where=f"block {i}") for i, b in enumerate(blocks)]
        unique = list(dict.fromkeys(keys))
        staging = self._staging.take(len(unique))
        chosen: dict[bytes, int] = {}  # key -> its staging row, for keys whose read succeeded

        def finish(op: _Op, job: TierJob, result: object) -> None:
            promoted = job.tier.finish_promotion(job, result)
            job.tier.touch(promoted.loaded)  # a read is a use: recency for the tier's policy
            loaded = set(promoted.loaded)
            for key, row in zip(job.keys, job.slots, strict=True):
                if key in loaded:
                    chosen[key] = row

        op = _Op(self, finish)
        with self._lock:
            self._check_usable()
            by_tier: dict[int, list[int]] = {}
            for row, key in enumerate(unique):
                for t, tier in enumerate(self.tiers):
                    state = tier.state(key)
                    if state is _READY or (state is _UNKNOWN and isinstance(tier, SharedTier)):
                        by_tier.setdefault(t, []).append(row)
                        break
            for t, rows in by_tier.items():
                tier = self.tiers[t]
                job = tier.start_promotion(
                    [unique[r] for r in rows], rows, buffers=[staging[r] for r in rows]
                )
                op.submit(job)
            op.seal()
            self.stats.gets += 1
        return keys, targets, op, staging, chosen

    def _scatter(
        self,
        keys: list[bytes],
        targets: list[list[memoryview]],
        op: _Op,
        staging: list[memoryview],
        chosen: dict[bytes, int],
        exact: bool,
    ) -> list[int | None]:
        out: list[int | None] = [None] * len(keys)
        if not op.done.done():  # gave up: the rows go back when the reads end, unscattered
            op.done.add_done_callback(lambda _: self._staging.give(staging))
        else:
            with self._lock:
                rows = dict(chosen)
            for i, (key, runs) in enumerate(zip(keys, targets, strict=True)):
                row = rows.get(key)
                if row is None:
                    continue
                try:
                    length = scatter(staging[row], runs, exact=exact)
                except CorruptBlockError:
                    # Verified by the tier, so only a writer outside this framing gets here.
                    logger.warning("block %s: bad frame; treated as a miss", key.hex())
                    with self._lock:
                        self.stats.corrupt += 1
                    continue
                out[i] = length  # None: the caller's memory does not fit it, nothing written
            self._staging.give(staging)
        hits = [n for n in out if n is not None]
        with self._lock:
            self.stats.get_hits += len(hits)
            self.stats.get_misses += len(out) - len(hits)
            self.stats.get_bytes += sum(hits)
        return out

    # -- maintenance ----------------------------------------------------------------------------

    def keys(self) -> list[bytes]:
        """The keys the tiers' indexes hold readable. A shared tier (Redis) is its own index and
        is not enumerated: its keys are left out."""
        with self._lock:
            seen: dict[bytes, None] = {}
            for tier in self.tiers:
                if tier.is_open and not isinstance(tier, SharedTier):
                    for key in tier.policy:
                        if tier.state(key) is _READY:
                            seen[key] = None
        return list(seen)

    def clear(self) -> None:
        """Forget and delete every block of every tier (a shared tier stops using its store)."""
        self._check_usable()
        with self._lock:
            jobs = [j for t in self.tiers if t.is_open and (j := t.start_clear()) is not None]
        for job in jobs:
            self._wait(self._io.submit(job.io), "clear", self.timeout_s, None)

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Each tier's counters, with its block count."""
        with self._lock:
            return {t.name: {**t.metrics.counters(), "blocks": len(t)} for t in self.tiers}

    # -- waiting ----------------------------------------------------------------------------------

    def _wait(
        self,
        future: concurrent.futures.Future[Any],
        what: str,
        timeout_s: float,
        default: Any = None,
    ) -> Any:
        if self._io.in_loop_thread():
            raise EmbedError(f"{what}: the sync form was called on tiering's own I/O thread")
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            with self._lock:
                self.stats.timeouts += 1
            logger.warning("TierStore.%s timed out after %.1f s", what, timeout_s)
            return default

    async def _await(self, future: concurrent.futures.Future[Any], what: str, default: Any) -> Any:
        try:
            # shield: a timeout must not cancel the tier's job, which settles the index.
            return await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(future)), self.timeout_s
            )
        except TimeoutError:
            with self._lock:
                self.stats.timeouts += 1
            logger.warning("TierStore.a%s timed out after %.1f s", what, self.timeout_s)
            return default


async def _find_stored(
    tiers: Sequence[SecondaryTier], lock: threading.RLock, keys: list[bytes], *, prefix: bool
) -> list[bool]:
    """Whether a tier holds each key, readable now (``prefix``: only up to the first miss).
    Shared tiers are asked about keys their existence cache does not know (one check job per
    tier); the indexes are read under ``lock``, never across the checks' I/O."""
    found = [False] * len(keys)
    with lock:
        asks: dict[int, tuple[SharedTier, list[bytes]]] = {}
        for i, key in enumerate(keys):
            unknown_in: list[SharedTier] = []
            for tier in tiers:
                state = tier.state(key)
                if state is _READY:
                    found[i] = True
                    tier.count_lookup_hit()
                    break
                if state is _UNKNOWN and isinstance(tier, SharedTier):
                    unknown_in.append(tier)
            if found[i]:
                continue
            for tier in unknown_in:
                asks.setdefault(id(tier), (tier, []))[1].append(key)
            if not unknown_in and prefix:
                break  # the prefix ends here: later keys do not matter
        jobs = [j for t, ks in asks.values() if (j := t.start_check(ks)) is not None]
    if not jobs:
        return found
    results = await asyncio.gather(*(j.io for j in jobs), return_exceptions=True)
    with lock:
        for job, result in zip(jobs, results, strict=True):
            assert isinstance(job.tier, SharedTier)
            job.tier.finish_check(job, result)
        for i, key in enumerate(keys):
            if not found[i]:
                holder = next((t for t in tiers if t.state(key) is _READY), None)
                if holder is not None:
                    found[i] = True
                    holder.count_lookup_hit()
    return found
