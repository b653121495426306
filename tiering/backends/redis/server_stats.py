"""What the masters of a Redis deployment report about themselves (``INFO``, ``DBSIZE``).

With ``shared: true`` the backend accounts for nothing in a store that others fill; this is
how an operator (or the tier) sees what Redis holds: used memory, keys (two per block),
evictions, summed over the masters.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from tiering.backends.redis.nodes import RedisNode, RedisNodes

__all__ = ["RedisServerStats", "ask_masters"]


@dataclass(frozen=True)
class RedisServerStats:
    """What the masters report about themselves, summed over them (see ``server_stats``)."""

    nodes: int  # masters in use
    nodes_answering: int  # of which answered
    used_memory_bytes: int
    maxmemory_bytes: int  # 0: a node without a limit
    keys: int  # keys in the database (every namespace, not only this backend's)
    evicted_keys: int  # since the servers started
    expired_keys: int
    eviction_policies: tuple[str, ...]  # the distinct maxmemory-policy values


async def ask_masters(nodes: RedisNodes) -> RedisServerStats:
    """Memory, keys and evictions as the masters report them; a node that does not answer
    counts as 0."""
    masters = nodes.masters()

    async def ask(node: RedisNode) -> tuple[dict[str, Any], int] | None:
        try:
            info = await node.client.info("all")
            keys = await node.client.dbsize()
        except (RedisError, OSError):
            return None
        return info, int(keys)

    answers = await asyncio.gather(*(ask(n) for n in masters))
    got = [a for a in answers if a is not None]
    return RedisServerStats(
        nodes=len(masters),
        nodes_answering=len(got),
        used_memory_bytes=sum(int(i.get("used_memory", 0)) for i, _ in got),
        maxmemory_bytes=sum(int(i.get("maxmemory", 0)) for i, _ in got),
        keys=sum(k for _, k in got),
        evicted_keys=sum(int(i.get("evicted_keys", 0)) for i, _ in got),
        expired_keys=sum(int(i.get("expired_keys", 0)) for i, _ in got),
        eviction_policies=tuple(sorted({str(i.get("maxmemory_policy", "?")) for i, _ in got})),
    )
