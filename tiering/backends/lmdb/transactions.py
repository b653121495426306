"""Write transactions: a coalesced group of puts, deletes and purges applied to LMDB.

A group is cut into transactions of at most ``txn_blocks`` puts (about ``max_txn_bytes`` of
values); a transaction's keys become visible to ``get`` and ``contains`` (the in-memory index)
when it commits. A put of a new key beyond the tier's capacity is ``FULL``. A purge deletes a
key a get found corrupt, unless a put has replaced it since.

``MapFullError``
    A put transaction that hits it is aborted (committed data stays intact). The writer commits a
    tiny transaction (so pages freed by the last commit become reusable) and retries once; if the
    map is still full, the keys that fitted are committed and the rest reported ``FULL``, for the
    owning tier to evict and retry. A put that did not return ``OK`` leaves its key absent (an
    older value of that key is deleted too). A delete that hits it grows the map by a few pages
    (with no read transaction active): deletes must always make progress.
"""

from __future__ import annotations

import logging
from typing import Literal

import lmdb

from tiering.backends.base import Outcome
from tiering.backends.lmdb.environment import GROW_ATTEMPTS, LMDBEnvironment
from tiering.backends.lmdb.files import TICK_KEY
from tiering.backends.lmdb.record import RecordFormat
from tiering.backends.lmdb.threads import Count, Job

__all__ = ["WriteTransactions"]

_log = logging.getLogger(__package__)  # the package's logger, as before the split

_Op = tuple[Job, int]


class _MapFull(Exception):
    """MapFullError while applying op ``index`` of a chunk (or at commit: ``index`` = its end)."""

    def __init__(self, index: int) -> None:
        super().__init__(index)
        self.index = index


class WriteTransactions:
    """Applies groups of jobs to the environment on the writer thread, keeping the index (the
    keys stored, shared with the event loop's ``get`` and ``contains``) in step."""

    __slots__ = ("_count", "_environment", "_index", "_path", "_record", "_ticks")

    def __init__(
        self,
        environment: LMDBEnvironment,
        record: RecordFormat,
        index: set[bytes],
        count: Count,
    ) -> None:
        self._environment = environment
        self._path = environment.path
        self._record = record
        self._index = index  # keys stored; mutated by the writer thread only
        self._count = count
        self._ticks = 0

    def run_group(self, jobs: list[Job]) -> None:
        """Apply ``jobs`` in as few transactions as fit; fill in each job's ``results``."""
        if self._environment.guarded and any(job.kind == "put" for job in jobs):
            self._environment.apply_disk_guard()
        ops: list[_Op] = []
        for job in jobs:
            job.results = [
                Outcome.FAILED if job.kind == "put" else False for _ in range(len(job.keys))
            ]
            ops.extend((job, i) for i in range(len(job.keys)))
        deferred: list[_Op] = []  # deletes, purges and failed puts to make invisible
        map_full = False
        pos = 0
        while pos < len(ops):
            end = self._chunk_end(ops, pos)
            if map_full:
                self._defer(ops[pos:end], Outcome.FULL, deferred)
                pos = end
                continue
            reached, error = self._commit_chunk(ops, pos, end, cleanup=False)
            if error == "full":
                map_full = True
                self._defer(ops[reached:end], Outcome.FULL, deferred)
            elif error == "failed":
                self._defer(ops[reached:end], Outcome.FAILED, deferred)
            pos = end
        if deferred:
            reached, error = self._commit_chunk(deferred, 0, len(deferred), cleanup=True)
            if error is not None:
                _log.error(
                    "LMDB at %s: %d deletes could not be committed (%s)",
                    self._path,
                    len(deferred) - reached,
                    error,
                )

    def _chunk_end(self, ops: list[_Op], pos: int) -> int:
        txn_blocks = self._environment.geometry.txn_blocks
        puts = 0
        end = pos
        while end < len(ops) and puts < txn_blocks:
            puts += ops[end][0].kind == "put"
            end += 1
        return end

    @staticmethod
    def _defer(ops: list[_Op], outcome: Outcome, deferred: list[_Op]) -> None:
        for job, i in ops:
            if job.kind == "put":
                job.results[i] = outcome
            deferred.append((job, i))

    def _commit_chunk(
        self, ops: list[_Op], start: int, end: int, *, cleanup: bool
    ) -> tuple[int, Literal["full", "failed"] | None]:
        """Apply ``ops[start:end]`` in one write transaction; shrink it on MapFullError.

        Returns ``(reached, error)``: ``ops[start:reached]`` are committed; ``error`` says why the
        rest are not (``None`` when ``reached == end``). In ``cleanup`` mode puts become deletes
        (of keys whose put failed) and a full map is grown instead of shrinking the chunk.
        """
        environment = self._environment
        env = environment.env
        assert env is not None
        limit = end
        ticked = False
        grown = 0
        while limit > start:
            overlay: dict[bytes, bool] = {}
            try:
                txn = env.begin(db=environment.blocks_db, write=True, buffers=True)
                try:
                    self._apply(txn, ops, start, limit, overlay, cleanup=cleanup)
                except BaseException:
                    txn.abort()
                    raise
                try:
                    txn.commit()
                except lmdb.MapFullError:
                    raise _MapFull(limit - 1) from None
            except _MapFull as full:
                self._count("map_full_errors")
                if cleanup:
                    if grown < GROW_ATTEMPTS and environment.grow_map():
                        grown += 1
                        continue
                    return start, "full"
                if not ticked:
                    ticked = True
                    if self._tick():
                        continue
                limit = full.index
                continue
            except lmdb.Error as exc:
                _log.error("LMDB write transaction failed at %s: %s", self._path, exc)
                return start, "failed"
            self._publish(overlay)
            self._count("write_txns")
            return limit, None if limit == end else "full"
        return start, "full"

    def _apply(
        self,
        txn: lmdb.Transaction[memoryview],
        ops: list[_Op],
        start: int,
        end: int,
        overlay: dict[bytes, bool],
        *,
        cleanup: bool,
    ) -> None:
        """Apply ``ops[start:end]`` to ``txn``, recording key presence in ``overlay``."""
        index = self._index
        encode = self._record.encode
        capacity = self._environment.effective_capacity_blocks  # changes between groups only
        count = len(index)
        for n in range(start, end):
            job, i = ops[n]
            key = job.keys[i]
            present = overlay[key] if key in overlay else key in index
            try:
                if job.kind == "put" and not cleanup:
                    assert job.values is not None
                    if not present and count >= capacity:
                        job.results[i] = Outcome.FULL
                        continue
                    txn.put(key, encode(key, job.values[i]))
                    job.results[i] = Outcome.OK
                    overlay[key] = True
                    count += not present
                elif job.kind == "purge":
                    deleted, still_present = self._purge(txn, key)
                    job.results[i] = deleted
                    if still_present != present:
                        overlay[key] = still_present
                        count += 1 if still_present else -1
                else:  # a delete, or a failed put being made invisible
                    existed = txn.delete(key)
                    if job.kind == "delete":
                        job.results[i] = existed
                    if existed or present:
                        overlay[key] = False
                        count -= 1 if present else 0
            except lmdb.MapFullError:
                raise _MapFull(n) from None

    def _purge(self, txn: lmdb.Transaction[memoryview], key: bytes) -> tuple[bool, bool]:
        """Delete ``key`` if its stored value (read again now) does not verify.

        Returns (deleted, present afterwards). A get saw it corrupt, but a put may have replaced
        it since: only a value that still fails is deleted.
        """
        raw = txn.get(key)
        if raw is None:
            return False, False
        if self._record.verifies(key, raw, verify_payload=True):
            return False, True
        return txn.delete(key), False

    def _publish(self, overlay: dict[bytes, bool]) -> None:
        """Make a committed transaction's keys visible (or invisible) to get and contains."""
        index = self._index
        for key, present in overlay.items():
            if present:
                index.add(key)
            else:
                index.discard(key)

    def _tick(self) -> bool:
        """Commit a tiny transaction so that pages freed by the last commit become reusable.

        (LMDB reuses the pages a transaction freed only once a later one has committed.)
        """
        environment = self._environment
        env = environment.env
        assert env is not None
        self._ticks += 1
        for attempt in range(GROW_ATTEMPTS + 1):
            try:
                with env.begin(db=environment.meta_db, write=True) as txn:
                    txn.put(TICK_KEY, self._ticks.to_bytes(8, "little"))
                return True
            except lmdb.MapFullError:
                if attempt == GROW_ATTEMPTS or not environment.grow_map():
                    return False
            except lmdb.Error as exc:
                _log.error("LMDB tick transaction failed at %s: %s", self._path, exc)
                return False
        return False
