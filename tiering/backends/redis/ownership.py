"""Which blocks this node holds in Redis, and its budget: the accounting of ``shared: false``.

Capacity and the two modes (``shared``)
    Redis owns its memory: ``maxmemory`` and an eviction policy (``allkeys-lru`` is the one to
    use for a cache) decide what stays, and a block that vanished (evicted, expired, flushed)
    is a miss, never an error. A put that Redis refuses for memory (``OOM``, under
    ``noeviction``) is ``FULL``.

    ``shared: false`` (default): this node owns its namespace (prefix + fingerprint). The
    backend keeps the set of keys it holds, rebuilt at open by a ``SCAN`` of the namespace on
    every master (payloads are checked on read), and ``capacity_bytes`` is this node's budget:
    a put that would hold more than ``capacity_blocks`` keys is ``FULL``, so the owning tier
    evicts (deletes) as with any tier. ``usage_bytes`` counts the keys held.

    ``shared: true``: many engine nodes read and write one namespace; the store is the index.
    No set of keys is kept and open enumerates nothing (it returns no keys); puts are never
    ``FULL`` for lack of budget; ``usage_bytes`` is 0 (this backend accounts for nothing in a
    store that others fill): :meth:`RedisBackend.server_stats
    <tiering.backends.redis.RedisBackend.server_stats>` reports what Redis holds (used
    memory, keys (two per block), evictions, summed over the masters). ``contains`` and
    :meth:`RedisBackend.exists <tiering.backends.redis.RedisBackend.exists>` ask the store
    (one ``EXISTS`` pipeline per node; ``exists`` tells "unknown, its node failed" from
    "absent"), and :meth:`RedisBackend.put_if_absent
    <tiering.backends.redis.RedisBackend.put_if_absent>` writes only the blocks the store
    does not hold, atomically per block (``MSETNX``), so two nodes never both write one: the
    pieces a shared tier is built from.

Counters in ``stats.extra``: ``vanished`` (held keys that Redis no longer had),
``recovered_blocks``, ``recovered_over_capacity``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence

from redis.exceptions import RedisError

from tiering.backends.base import Outcome
from tiering.backends.redis.faults import Faults
from tiering.backends.redis.nodes import RedisNode, RedisNodes
from tiering.backends.redis.value_format import BlockFormat

__all__ = ["HeldKeys"]


class HeldKeys:
    """The keys this backend holds (``shared: false``; empty when shared), the room that puts
    in flight reserved, and the puts in flight per key (in both modes)."""

    __slots__ = ("_faults", "_reserved", "_writing", "capacity_blocks", "keys", "shared")

    def __init__(self, faults: Faults, *, shared: bool, capacity_blocks: int) -> None:
        self._faults = faults
        self.shared = shared
        self.capacity_blocks = capacity_blocks
        self.keys: set[bytes] = set()  # shared=False: the keys this backend holds
        self._reserved = 0  # shared=False: room taken by puts in flight
        self._writing: dict[bytes, int] = {}  # puts in flight per key

    # -- puts -----------------------------------------------------------------------------------

    def admit(
        self, keys: Sequence[bytes], order: list[int], results: list[Outcome]
    ) -> tuple[list[int], int]:
        """shared=False: reserve room for the keys of items ``order`` that are not held yet;
        those over the budget get ``FULL`` in ``results``. Returns the items to write and the
        room reserved (give it back with :meth:`finish_writing`)."""
        if self.shared:
            return order, 0
        held = self.keys
        new = [keys[i] for i in order if keys[i] not in held]
        room = max(0, self.capacity_blocks - len(held) - self._reserved)
        if len(new) > room:
            refused = set(new[room:])
            new = new[:room]
            for i in order:
                if keys[i] in refused:
                    results[i] = Outcome.FULL
            order = [i for i in order if keys[i] not in refused]
        self._reserved += len(new)
        return order, len(new)

    def start_writing(self, keys: Sequence[bytes], order: list[int]) -> None:
        writing = self._writing
        for i in order:
            writing[keys[i]] = writing.get(keys[i], 0) + 1

    def finish_writing(
        self, keys: Sequence[bytes], order: list[int], results: list[Outcome], reserved: int
    ) -> None:
        """The puts of items ``order`` are over: the keys written ``OK`` are held."""
        writing = self._writing
        for i in order:
            count = writing.pop(keys[i]) - 1
            if count:
                writing[keys[i]] = count
        if not self.shared:
            self._reserved -= reserved
            self.keys.update(keys[i] for i in order if results[i] is Outcome.OK)

    # -- keys that are gone ---------------------------------------------------------------------

    def forget_vanished(self, keys: Sequence[bytes]) -> None:
        """shared=False: drop keys Redis no longer holds from the held set (not while written)."""
        if self.shared:
            return
        held, writing = self.keys, self._writing
        gone = [k for k in keys if k in held and k not in writing]
        held.difference_update(gone)
        self._faults.count("vanished", len(gone))

    def discard(self, keys: Iterable[bytes]) -> None:
        """shared=False: keys deleted (or unlinked) are no longer held."""
        if not self.shared:
            self.keys.difference_update(keys)

    # -- open -----------------------------------------------------------------------------------

    async def recover(self, nodes: RedisNodes, block_format: BlockFormat) -> list[bytes]:
        """The keys of this namespace on every master that answers (``SCAN``), up to
        ``capacity_blocks``."""
        pattern = block_format.header_pattern
        offload_key = block_format.offload_key

        async def scan(node: RedisNode) -> list[bytes]:
            found: list[bytes] = []
            if node.is_down:
                return found
            try:
                async for name in node.client.scan_iter(match=pattern, count=1000):
                    key = offload_key(name)
                    if key is not None:
                        found.append(key)
            except (RedisError, OSError) as exc:  # a master that is down: recover the others
                nodes.mark_down(node, exc)
            return found

        per_node = await asyncio.gather(*(scan(n) for n in nodes.masters()))
        keys = list(dict.fromkeys(k for found in per_node for k in found))
        kept = keys[: self.capacity_blocks]
        self._faults.count("recovered_blocks", len(kept))
        self._faults.count("recovered_over_capacity", len(keys) - len(kept))
        return kept
