"""How the Redis backend reads blocks into the caller's buffers, and what it does with bad ones.

Each block's two strings are read by bounded ``GETRANGE`` s (:mod:`~tiering.backends.redis.reads`)
and checked (:meth:`BlockFormat.read_into
<tiering.backends.redis.value_format.BlockFormat.read_into>`). A block that does not verify,
or that has one of its two strings gone, is read once more first: one rewritten, evicted or
expired between its two reads looks torn once. Then a corrupt block is ``CORRUPT`` (counted,
logged, unlinked) and a half block is ``MISSING`` (its other string unlinked); a held key that
Redis no longer has is forgotten (``shared: false``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from redis.exceptions import MovedError

from tiering.backends.base import BackendStats, Outcome
from tiering.backends.redis.faults import Faults
from tiering.backends.redis.nodes import RedisNodes
from tiering.backends.redis.ownership import HeldKeys
from tiering.backends.redis.pipelines import AddCommands, Pipelines, ReadReplies
from tiering.backends.redis.value_format import BlockFormat
from tiering.errors import CorruptBlockError

__all__ = ["Gets"]

_log = logging.getLogger("tiering.backends.redis")  # the package's logger, as it always was


class Gets:
    """Reads blocks through ``pipelines`` and accounts for them in ``stats`` and ``held``."""

    __slots__ = ("_faults", "_format", "_held", "_pipelines", "_stats")

    def __init__(
        self,
        *,
        block_format: BlockFormat,
        pipelines: Pipelines,
        held: HeldKeys,
        faults: Faults,
        stats: BackendStats,
    ) -> None:
        self._format = block_format
        self._pipelines = pipelines
        self._held = held
        self._faults = faults
        self._stats = stats

    async def get(
        self, nodes: RedisNodes, keys: Sequence[bytes], views: list[memoryview]
    ) -> list[Outcome]:
        """Read the blocks (checked keys and writable views, at least one) into ``views``; an
        outcome per key."""
        results: list[Outcome] = [Outcome.FAILED] * len(keys)
        redis_keys = self._format.redis_keys
        names = [redis_keys(k) for k in keys]
        corrupt: dict[int, str] = {}  # item -> why it does not verify
        halves: set[int] = set()  # blocks with one string gone
        run = self._pipelines.run
        add = self._chunk(nodes, keys, views, names, results, corrupt, halves)
        await run(nodes, names, range(len(keys)), add, writing=False)
        if corrupt or halves:
            # A block rewritten, evicted or expired between its two reads looks torn once
            # (redis_reads): read it again before calling it corrupt or unlinking half of it.
            again = sorted({*corrupt, *halves})
            corrupt.clear()
            halves.clear()
            for i in again:
                results[i] = Outcome.FAILED
            await run(nodes, names, again, add, writing=False)
        for i, why in corrupt.items():
            _log.warning("corrupt redis block %s: %s", keys[i].hex(), why)
        if corrupt or halves:
            await self._pipelines.small(nodes, "UNLINK", [names[i] for i in (*corrupt, *halves)])
        self._account(keys, results, corrupt)
        return results

    def _account(
        self, keys: Sequence[bytes], results: list[Outcome], corrupt: dict[int, str]
    ) -> None:
        ok = results.count(Outcome.OK)
        stats = self._stats
        stats.gets += len(results)
        stats.hits += ok
        stats.bytes_read += ok * self._format.block_bytes
        if ok < len(results):
            missing = [keys[i] for i, r in enumerate(results) if r is Outcome.MISSING]
            stats.misses += len(missing)
            stats.corrupt += len(corrupt)
            stats.read_failures += results.count(Outcome.FAILED)
            self._held.forget_vanished(missing)
            if corrupt:
                self._held.discard(keys[i] for i in corrupt)  # unlinked

    def _chunk(
        self,
        nodes: RedisNodes,
        keys: Sequence[bytes],
        views: list[memoryview],
        names: list[tuple[bytes, bytes]],
        results: list[Outcome],
        corrupt: dict[int, str],
        halves: set[int],
    ) -> AddCommands:
        """Reads of at most a block per string (see ``redis_reads``)."""
        block_reads = self._format.reads
        read_into = self._format.read_into
        error_outcome = self._faults.error_outcome

        def add(pipe: Any, chunk: list[int]) -> ReadReplies:
            reads = block_reads(names, chunk)
            reads.queue(pipe)

            def read(replies: list[Any]) -> dict[int, MovedError]:
                moved: dict[int, MovedError] = {}
                for i, header, payload in reads.replies(replies):
                    error = header if isinstance(header, BaseException) else payload
                    if isinstance(error, MovedError):  # nothing was read: asked again once
                        moved[i] = error
                        continue
                    if isinstance(error, BaseException):
                        results[i] = error_outcome(error, nodes, writing=False)
                        continue
                    assert not isinstance(header, BaseException)
                    assert not isinstance(payload, BaseException)
                    try:
                        results[i] = read_into(keys[i], views[i], header, payload)
                    except CorruptBlockError as exc:
                        results[i] = Outcome.CORRUPT
                        corrupt[i] = str(exc)
                        continue
                    if results[i] is Outcome.MISSING and (header, payload) != (None, None):
                        halves.add(i)
                return moved

            return read

        return add
