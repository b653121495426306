"""How a block is stored in Redis: the names of its two strings and what they hold.

Values
    Two Redis strings per block, written by one ``MSET`` (atomic) and read by a ``GETRANGE``
    of each that stops one byte past the string's size (:mod:`~tiering.backends.redis.reads`:
    a value planted under a block's name is never read whole), named
    ``<key_prefix>:<layout fingerprint, hex>:{<offload key, hex>}:h`` and ``...:p``; the
    ``{...}`` hash tag puts both in one cluster slot. ``h``
    holds the 128-byte :mod:`~tiering.core.block_format` header (the full key, the layout
    fingerprint, the payload checksum) followed by the payload's last ``TAIL_BYTES`` (64); ``p``
    holds the rest of the payload. Every get checks the header (its own checksum, the key, the
    fingerprint, the size) and the payload checksum: a value that is corrupt, truncated, or
    written for another key or layout is ``CORRUPT`` (counted, logged, unlinked), never a hit;
    a block with one of its two strings gone (evicted or expired apart, deleted by hand, or of
    another type) is ``MISSING``, and the other string is unlinked. A block is read again
    before it is called corrupt or half of it is unlinked: one rewritten, evicted or expired
    between its two reads looks torn on the first. The fingerprint in every
    name keeps two models or layouts on one deployment apart; the prefix keeps deployments (or
    tenants) apart; ``cache_salt`` is already inside the offload key.

Why two strings and a tail, measured on Redis 7.0 (docs/benchmarks.md). One string of
header + payload would need a copy of every block on the client first (puts at 0.77x of raw),
and Redis allocates a value of n bytes as n plus about 10, which jemalloc rounds up to its next
size class: a quarter more for the power-of-two payloads engines use (a 2 MiB payload took
2.5 MiB). A hash of a header field and a payload field avoids both, but Redis copies every hash
field it is given (puts at about 0.85x of ``SET``). A string given to ``SET``/``MSET`` is kept
as received, with no copy on the server, and redis-py sends a ``memoryview`` argument as a chunk
of its own, so the payload goes from the caller's pool row into the socket with no copy made
here; 64 bytes short of the power of two, ``p`` fits its size class exactly (a stored 2 MiB
block takes its payload plus under 1 KiB). What copies remain, all inside redis-py and asyncio
on Python 3.11: a put's pipeline is joined into one buffer (``writelines``), and what the
socket does not take at once is copied into the transport's buffer; a get's reply is read from
the socket into asyncio's stream buffer, copied out of it, fed into hiredis, which builds a
``bytes`` for the payload, and this backend copies that into the caller's buffer (redis-py has
no way to read a reply into a given buffer).
"""

from __future__ import annotations

from tiering.backends.base import Outcome
from tiering.backends.redis.reads import BlockReads
from tiering.core.block_format import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    checksum,
    pack_header,
    unpack_header,
)
from tiering.errors import CorruptBlockError

__all__ = ["MAX_BULK_BYTES", "REDIS_OVERHEAD_BYTES", "TAIL_BYTES", "BlockFormat"]

HEADER_SUFFIX = b"}:h"
PAYLOAD_SUFFIX = b"}:p"
#: The payload's last bytes travel in the header string, so that the payload string of a
#: power-of-two block fits jemalloc's size class exactly (see the module docstring).
TAIL_BYTES = 64
#: Redis's default proto-max-bulk-len: the largest value it accepts.
MAX_BULK_BYTES = 512 << 20
#: What Redis keeps per block besides header and payload (two key names, objects and dict
#: entries, allocator rounding of the small ones): ``MEMORY USAGE`` of a stored block's two
#: strings on Redis 7.0, minus the payload and header, rounded up.
REDIS_OVERHEAD_BYTES = 512


class BlockFormat:
    """The two strings of this backend's blocks: their names in namespace ``namespace`` (key
    prefix and layout fingerprint), the header string's value, and the check of a block read."""

    __slots__ = ("block_bytes", "fingerprint", "header_bytes", "namespace", "split", "tail_bytes")

    def __init__(self, *, namespace: bytes, block_bytes: int, fingerprint: bytes) -> None:
        self.namespace = namespace
        self.block_bytes = block_bytes
        self.fingerprint = fingerprint
        self.tail_bytes = TAIL_BYTES if block_bytes >= 4 * TAIL_BYTES else 0
        self.header_bytes = HEADER_BYTES + self.tail_bytes  # the header string's length
        self.split = block_bytes - self.tail_bytes  # the payload string's length

    # -- names ----------------------------------------------------------------------------------

    def redis_keys(self, key: bytes) -> tuple[bytes, bytes]:
        """The Redis key names of offload key ``key``'s block: its header and payload strings."""
        stem = self.namespace + b"{" + key.hex().encode()
        return stem + HEADER_SUFFIX, stem + PAYLOAD_SUFFIX

    @property
    def header_pattern(self) -> bytes:
        """A ``SCAN`` pattern of the header names of this namespace."""
        return self.namespace + b"*" + HEADER_SUFFIX  # prefix and hex are glob-safe

    def offload_key(self, header_name: bytes) -> bytes | None:
        """The offload key a header string's name stands for (None: not one of this
        namespace's block names)."""
        namespace = self.namespace
        start = len(namespace) + 1
        if not (header_name.startswith(namespace) and header_name.endswith(HEADER_SUFFIX)):
            return None
        try:
            key = bytes.fromhex(header_name[start : -len(HEADER_SUFFIX)].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        return key if 4 < len(key) <= MAX_KEY_BYTES else None

    # -- values ---------------------------------------------------------------------------------

    def header_value(self, key: bytes, view: memoryview) -> bytes:
        """The header string of block ``key`` whose payload is ``view``: the header, then the
        payload's tail (the payload string is ``view[:split]``, sent as it is)."""
        return pack_header(key, view, self.fingerprint) + view[self.split :].tobytes()

    def reads(self, names: list[tuple[bytes, bytes]], items: list[int]) -> BlockReads:
        """The reads of blocks ``items`` (see :mod:`~tiering.backends.redis.reads`)."""
        return BlockReads(names, items, header_bytes=self.header_bytes, payload_bytes=self.split)

    def read_into(
        self, key: bytes, view: memoryview, raw_header: bytes | None, payload: bytes | None
    ) -> Outcome:
        """Verify one block's strings (each read up to one byte past its length) and copy its
        payload into ``view``; ``CorruptBlockError`` saying why a block does not verify."""
        if raw_header is None or payload is None:  # absent, or half of it evicted or expired
            return Outcome.MISSING
        header_bytes = self.header_bytes
        split = self.split
        if len(raw_header) != header_bytes or len(payload) != split:
            raise CorruptBlockError(
                f"strings of {_length(raw_header, header_bytes)} and "
                f"{_length(payload, split)} bytes, expected {header_bytes} and {split}"
            )
        header = unpack_header(raw_header)
        if header.key != key:
            raise CorruptBlockError(f"block holds key {header.key.hex()}")
        if header.fingerprint != self.fingerprint:
            raise CorruptBlockError("block was written for another layout")
        if header.payload_bytes != self.block_bytes:
            raise CorruptBlockError(
                f"header says {header.payload_bytes} payload bytes, expected {self.block_bytes}"
            )
        view[:split] = payload
        view[split:] = memoryview(raw_header)[HEADER_BYTES:]
        if checksum(view) != header.payload_checksum:
            raise CorruptBlockError("payload checksum mismatch")
        return Outcome.OK


def _length(value: bytes, expected: int) -> str:
    """A string's length as read: a read stops one byte past the expected length."""
    return f"more than {expected}" if len(value) > expected else str(len(value))
