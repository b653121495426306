"""How the Redis backend reads blocks: never more than a block, whatever is stored.

A block is two strings (``...:h``, the header and the payload's tail; ``...:p``, the rest of the
payload; see :mod:`tiering.backends.redis.value_format`). A get reads each with

    GETRANGE <h> 0 <header bytes>        GETRANGE <p> 0 <payload bytes>

``GETRANGE``'s end is inclusive, one byte past a block's string: a read returns at most one byte
more than the string should hold, so a value planted under a block's name (or a block written
under the name with another geometry) is seen to be too long from that byte, and is never sent
whole. An ``MGET`` of the two names sent the whole value, whatever its size: a 400 MiB value
planted under a payload name was read whole, stalling the event loop for 1.4 s, before its size
was checked.

What ``MGET`` gave and two reads do not: both strings as of one instant. Wrapping the two reads
in ``MULTI``/``EXEC`` would keep that, but a server under ``maxmemory-policy noeviction`` that is
full refuses every command queued in a transaction (``OOM``), reads included: a full cache would
serve nothing. So the reads are plain, and the backend reads a block again before it calls it
corrupt or unlinks half of it (:mod:`~tiering.backends.redis.gets`): a block rewritten, evicted
or expired between its two reads looks torn once (a checksum that fails, or one string gone),
and whole on the second read. Nothing torn is ever served: the header's checksum covers the payload.

A string that is absent reads as ``b""`` (and one of another type as a ``WRONGTYPE`` error):
both are reported as absent (None), as ``MGET`` reported them. The cost, measured by
``benchmarks/bench_redis_tier.py``, is in docs/benchmarks.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from redis.exceptions import ResponseError

__all__ = ["BlockReads", "Reply"]

#: One string of a block as read: its bytes, None if absent (or of another type), or the error
#: that Redis answered for it.
Reply = bytes | None | BaseException


class BlockReads:
    """The commands that read blocks ``items`` (indexes into ``names``), and their replies.

    ``header_bytes`` and ``payload_bytes`` are the lengths of a valid block's two strings; each
    read returns at most one byte more.
    """

    def __init__(
        self,
        names: Sequence[tuple[bytes, bytes]],
        items: Sequence[int],
        *,
        header_bytes: int,
        payload_bytes: int,
    ) -> None:
        self.names = names
        self.items = items
        self.header_end = header_bytes  # GETRANGE's end is inclusive: at most one byte more
        self.payload_end = payload_bytes

    def queue(self, pipe: Any) -> None:
        """Add the commands to a redis-py pipeline, two per block."""
        names, header_end, payload_end = self.names, self.header_end, self.payload_end
        for i in self.items:
            header_name, payload_name = names[i]
            pipe.execute_command("GETRANGE", header_name, 0, header_end)
            pipe.execute_command("GETRANGE", payload_name, 0, payload_end)

    def replies(self, replies: Sequence[Any]) -> Iterator[tuple[int, Reply, Reply]]:
        """``(item, header, payload)`` per block, from the pipeline's replies in order."""
        for j, i in enumerate(self.items):
            yield i, _string(replies[2 * j]), _string(replies[2 * j + 1])


def _string(value: object) -> Reply:
    if isinstance(value, ResponseError) and str(value).startswith("WRONGTYPE"):
        return None  # a value of another type under a block's name: no block
    if isinstance(value, BaseException):
        return value
    if not isinstance(value, bytes) or not value:
        return None  # GETRANGE of a missing key is ""
    return value
