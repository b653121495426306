"""How the Redis backend writes blocks: one ``MSET`` (or ``MSETNX``) of a block's two strings.

The payload string is the caller's buffer itself, sent with no copy (see
:mod:`~tiering.backends.redis.value_format`); with ``ttl_s`` both strings get a ``PEXPIRE``.
``put_if_absent`` writes with ``MSETNX``: a block that is there already is ``OK``, not
rewritten, and counted in ``stats.extra["put_skipped_present"]``. A key given twice in one
call is written once, with its later value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import MovedError

from tiering.backends.base import BackendStats, Outcome
from tiering.backends.redis.faults import Faults
from tiering.backends.redis.nodes import RedisNodes
from tiering.backends.redis.ownership import HeldKeys
from tiering.backends.redis.pipelines import AddCommands, Pipelines, ReadReplies
from tiering.backends.redis.value_format import BlockFormat

__all__ = ["Puts"]


class Puts:
    """Writes blocks through ``pipelines`` and accounts for them in ``stats`` and ``held``."""

    __slots__ = ("_faults", "_format", "_held", "_pipelines", "_stats", "_ttl_ms")

    def __init__(
        self,
        *,
        block_format: BlockFormat,
        pipelines: Pipelines,
        held: HeldKeys,
        faults: Faults,
        stats: BackendStats,
        ttl_ms: int | None,
    ) -> None:
        self._format = block_format
        self._pipelines = pipelines
        self._held = held
        self._faults = faults
        self._stats = stats
        self._ttl_ms = ttl_ms

    async def put(
        self,
        nodes: RedisNodes,
        keys: Sequence[bytes],
        views: list[memoryview],
        *,
        if_absent: bool,
    ) -> list[Outcome]:
        """Write the blocks (checked keys and views, at least one); an outcome per key."""
        skipped: set[int] = set()
        results = await self._put(nodes, keys, views, skipped if if_absent else None)
        ok = results.count(Outcome.OK)
        stats = self._stats
        stats.puts += len(results)
        stats.put_failures += len(results) - ok
        stats.bytes_written += (ok - len(skipped)) * self._format.block_bytes
        self._faults.count("put_skipped_present", len(skipped))
        return results

    async def _put(
        self,
        nodes: RedisNodes,
        keys: Sequence[bytes],
        views: list[memoryview],
        skipped: set[int] | None,
    ) -> list[Outcome]:
        """Write the blocks (``MSETNX`` if ``skipped`` is given, which then collects the indexes
        of blocks that were there already); an outcome per key."""
        last = {key: i for i, key in enumerate(keys)}  # a key twice: the later value wins
        results: list[Outcome] = [Outcome.FAILED] * len(keys)
        held = self._held
        order, reserved = held.admit(keys, sorted(last.values()), results)
        redis_keys = self._format.redis_keys
        names = [redis_keys(key) for key in keys]
        held.start_writing(keys, order)
        try:
            add = self._chunk(nodes, keys, views, names, results, skipped)
            await self._pipelines.run(nodes, names, order, add, writing=True)
        finally:
            held.finish_writing(keys, order, results, reserved)
        if len(last) < len(keys):  # earlier copies of a key share its outcome
            results = [results[last[key]] for key in keys]
            if skipped:
                skipped.update(j for j, key in enumerate(keys) if last[key] in skipped)
        return results

    def _chunk(
        self,
        nodes: RedisNodes,
        keys: Sequence[bytes],
        views: list[memoryview],
        names: list[tuple[bytes, bytes]],
        results: list[Outcome],
        skipped: set[int] | None,
    ) -> AddCommands:
        """The function that adds a chunk's commands to a pipeline (see ``AddCommands``)."""
        ttl_ms = self._ttl_ms
        command = "MSET" if skipped is None else "MSETNX"
        header_value = self._format.header_value
        split = self._format.split
        error_outcome = self._faults.error_outcome

        def add(pipe: Any, chunk: list[int]) -> ReadReplies:
            for i in chunk:
                view = views[i]
                header = header_value(keys[i], view)
                header_name, payload_name = names[i]
                pipe.execute_command(command, header_name, header, payload_name, view[:split])
                if ttl_ms is not None:
                    pipe.execute_command("PEXPIRE", header_name, ttl_ms)
                    pipe.execute_command("PEXPIRE", payload_name, ttl_ms)
            step = 1 if ttl_ms is None else 3

            def read(replies: list[Any]) -> dict[int, MovedError]:
                moved: dict[int, MovedError] = {}
                for j, i in enumerate(chunk):
                    reply = replies[j * step]
                    if isinstance(reply, MovedError):  # not written: sent again once
                        moved[i] = reply
                        continue
                    if isinstance(reply, BaseException):
                        results[i] = error_outcome(reply, nodes, writing=True)
                        continue
                    results[i] = Outcome.OK
                    if skipped is not None and reply == 0:  # MSETNX: a string was there
                        skipped.add(i)
                return moved

            return read

        return add
