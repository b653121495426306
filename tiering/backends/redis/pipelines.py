"""How the Redis backend sends a call's commands: grouped by node, in bounded pipelines.

Batching
    A call groups its keys by the master that holds them (:mod:`tiering.backends.redis.nodes`)
    and sends each master pipelines of at most ``pipeline_bytes`` of values, at most
    ``pipelines_per_node`` gets and as many puts at a time per master (over all calls; apart, so
    that a get, on a request's critical path, never queues behind puts). A call of up to
    ``pipeline_bytes`` per node is one round trip per node. Bigger calls are cut because
    asyncio (3.11) copies a pipeline's whole buffer on the event loop, more than once, in one
    callback: one 64 MiB pipeline of puts ran at 0.5 GB/s with 110 ms loop stalls, 4 MiB
    pipelines at about 3 GB/s with about 1 ms. 2 MiB (the default) moved as many bytes per
    second as 4 MiB here and halved the longest callbacks (p99 0.7-1.0 ms of CPU against
    1.3-1.9 ms for puts, on this project's shared 2-core machine; docs/benchmarks.md).
    ``contains`` and ``delete`` send one pipeline per node (``EXISTS`` / ``UNLINK`` per block).

A node that fails a pipeline fails only its own keys and is marked down
(:meth:`RedisNodes.mark_down <tiering.backends.redis.nodes.RedisNodes.mark_down>`); keys
answered ``MOVED`` are sent once more to the node the reply names (see
:mod:`~tiering.backends.redis.faults`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from redis.exceptions import MovedError, RedisError

from tiering.backends.redis.faults import Faults
from tiering.backends.redis.nodes import RedisNode, RedisNodes

__all__ = ["AddCommands", "Pipelines", "ReadReplies", "all_or_none"]

#: Takes a pipeline's replies (in order), records the outcomes, and returns the items that
#: Redis redirected with ``MOVED`` (their outcomes are left as they were), with the reply.
ReadReplies = Callable[[list[Any]], dict[int, MovedError]]
#: ``add(pipeline, indexes)`` queues the commands for items ``indexes`` on a redis-py pipeline
#: and returns the function that reads the pipeline's replies.
AddCommands = Callable[[Any, list[int]], ReadReplies]


async def all_or_none(jobs: Sequence[Coroutine[Any, Any, None]]) -> None:
    """Run ``jobs`` side by side, starting one per turn of the event loop (a job's first step
    sends a pipeline, a millisecond of copying: started together, they would stall the loop for
    all of them at once). If one fails or the caller is cancelled, the others are cancelled and
    waited for before the error propagates: no job of a call (a get writing into the caller's
    buffers) outlives the call."""
    if len(jobs) == 1:
        await jobs[0]
        return
    tasks: list[asyncio.Future[None]] = []
    try:
        for job in jobs:
            if tasks:
                await asyncio.sleep(0)
            tasks.append(asyncio.ensure_future(job))
        await asyncio.gather(*tasks)
    except BaseException:
        for job in jobs[len(tasks) :]:
            job.close()  # never started
        for task in tasks:
            task.cancel()
        while pending := [t for t in tasks if not t.done()]:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait(pending)
        raise


class Pipelines:
    """Sends commands to the nodes that hold their keys; see the module docstring.

    ``per_pipeline`` is how many blocks' values one pipeline carries (``pipeline_bytes`` over
    the block size, at least 1).
    """

    __slots__ = ("_faults", "per_pipeline")

    def __init__(self, faults: Faults, *, per_pipeline: int) -> None:
        self._faults = faults
        self.per_pipeline = per_pipeline

    async def run(
        self,
        nodes: RedisNodes,
        names: list[tuple[bytes, bytes]],
        indexes: Sequence[int] | range,
        add: AddCommands,
        *,
        writing: bool,
    ) -> None:
        """Send the commands ``add`` makes for ``indexes``: per node, in pipelines of at most
        ``pipeline_bytes`` of values, ``pipelines_per_node`` at a time. Items of a node that
        fails keep the outcome they had (callers start from ``FAILED``). Items that a node
        answered ``MOVED`` for (a slot moved, e.g. by a resharding) are sent once more to the
        node the reply names, and the slot table is read again before the next call."""
        await nodes.maybe_refresh()
        moved = await self._send(nodes, names, indexes, add, writing=writing)
        if moved:
            self._faults.count("redirections", len(moved))
            nodes.follow_moved(moved.values())
            again = await self._send(nodes, names, sorted(moved), add, writing=writing)
            if again:  # moved twice in one call: they stay FAILED
                self._faults.count("redirections", len(again))

    async def _send(
        self,
        nodes: RedisNodes,
        names: list[tuple[bytes, bytes]],
        indexes: Sequence[int] | range,
        add: AddCommands,
        *,
        writing: bool,
    ) -> dict[int, MovedError]:
        """One pass of :meth:`run`; returns the items answered ``MOVED``."""
        per_pipeline = self.per_pipeline
        moved: dict[int, MovedError] = {}
        jobs: list[Coroutine[Any, Any, None]] = []
        for node, items in nodes.group(names, indexes).items():
            if node.is_down:
                self._faults.count("node_down_keys", len(items))
                continue
            for start in range(0, len(items), per_pipeline):
                chunk = items[start : start + per_pipeline]
                jobs.append(self._pipeline(nodes, node, chunk, add, moved, writing=writing))
        await all_or_none(jobs)
        return moved

    async def _pipeline(
        self,
        nodes: RedisNodes,
        node: RedisNode,
        chunk: list[int],
        add: AddCommands,
        moved: dict[int, MovedError],
        *,
        writing: bool,
    ) -> None:
        async with node.writes if writing else node.reads:
            if node.is_down:  # it failed while this pipeline waited for its turn
                self._faults.count("node_down_keys", len(chunk))
                return
            pipe = node.client.pipeline(transaction=False)
            read = add(pipe, chunk)
            try:
                replies = await pipe.execute(raise_on_error=False)
            except (RedisError, OSError) as exc:
                self._faults.count("node_errors")
                nodes.mark_down(node, exc)
                return
        nodes.mark_up(node)
        moved.update(read(replies))

    async def small(
        self, nodes: RedisNodes, command: str, names: Sequence[tuple[bytes, bytes]]
    ) -> list[Any]:
        """``command header_name payload_name`` per block, one pipeline per node; None where a
        node failed. Blocks answered ``MOVED`` are sent once more, as in :meth:`run`."""
        await nodes.maybe_refresh()
        faults = self._faults
        replies: list[Any] = [None] * len(names)
        moved: dict[int, MovedError] = {}

        async def one(node: RedisNode, items: list[int]) -> None:
            if node.is_down:
                faults.count("node_down_keys", len(items))
                return
            pipe = node.client.pipeline(transaction=False)
            for i in items:
                pipe.execute_command(command, *names[i])
            try:
                answers = await pipe.execute(raise_on_error=False)
            except (RedisError, OSError) as exc:
                faults.count("node_errors")
                nodes.mark_down(node, exc)
                return
            nodes.mark_up(node)
            for i, answer in zip(items, answers, strict=True):
                if isinstance(answer, MovedError) and retry:
                    moved[i] = answer
                elif isinstance(answer, BaseException):
                    faults.error_outcome(answer, nodes, writing=False)
                else:
                    replies[i] = answer

        retry = True
        groups = nodes.group(names, range(len(names)))
        await all_or_none([one(node, items) for node, items in groups.items()])
        if moved:
            faults.count("redirections", len(moved))
            nodes.follow_moved(moved.values())
            retry = False
            groups = nodes.group(names, sorted(moved))
            await all_or_none([one(node, items) for node, items in groups.items()])
        return replies
