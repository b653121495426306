"""The storage-backend interface that every secondary tier stands on.

A backend stores fixed-size blocks under offload keys (``bytes``). It is async and batch-first:
every operation takes a list of keys and returns one result per key, in order. It knows nothing
of eviction: the tier that owns it keeps the index and the policy, and tells it what to delete.

Contract (``tiering.testing.BackendTests`` checks it for every backend, plugins included):

Threads and blocking
    Coroutines are called from one event loop. A backend never blocks that loop: blocking I/O
    (``pwritev``, LMDB transactions, fsync) runs on threads the backend owns. Properties are
    cheap and never do I/O.
Buffers
    ``put`` reads from caller-owned buffers and keeps no reference to them once it returns.
    ``get`` writes into caller-owned writable buffers of exactly ``block_bytes``; the content of a
    buffer whose result is not ``OK`` is unspecified (the caller must not use it). Buffers are
    usually rows of the CPU pool, so a backend should move bytes straight between them and its
    storage, with no extra copy.
Visibility
    A key becomes visible to ``get``/``contains`` only once ``put`` has returned ``OK`` for it, and
    is never visible after a put that did not return ``OK``. A put cancelled while in flight
    leaves each of its keys either absent or stored intact, never corrupt. Putting a key that is
    present replaces it.
Verification
    ``get`` returns ``OK`` only for a block whose header, key, layout fingerprint and checksum
    verify. A block that does not verify is reported ``CORRUPT``, counted, and deleted; it is
    never returned as a hit.
Errors
    Per-key failures are results (``FULL``, ``FAILED``, ``CORRUPT``, ``MISSING``), never
    exceptions. Methods raise only for misuse (``BackendError`` when not open,
    ``InvalidKeyError`` for bad keys, ``ValueError`` for a buffer of the wrong size), before any
    I/O and with no state changed.
Lifecycle
    ``open`` prepares storage and, for a persistent backend, rebuilds the index from what is
    stored, keeping only entries that verify; it returns the recovered keys. ``close`` waits for
    in-flight operations and releases everything; it is idempotent. ``async with`` does both.
Files
    A backend that keeps files in a directory (a ``path``) writes only into a directory that is
    empty or absent when it first opens it, or that carries tiering's marker
    (:mod:`tiering.backends.ownership`), and creates only files matching its ``owned_files``
    patterns there: those are all that ``tiering wipe`` and ``replay --fresh`` delete.
    Damaged files are never a crash: what does not verify is a miss, and is counted.
Shared stores (``capabilities.shared``)
    A shared backend's store is written and evicted by others too (other engine nodes, the
    store's own eviction), so it is its own index: ``open`` enumerates nothing and returns no
    keys, ``contains`` asks the store (one batched round trip), and a key it reported may be
    gone by the next ``get`` (``MISSING``). Its capacity is the store's: ``put`` is ``FULL``
    only when the store refuses for lack of room. Such a backend is run by a
    :class:`~tiering.managers.shared_tier.SharedTier`, which never deletes and never evicts.
Optional methods (defaults here; a shared backend should override both)
    ``exists`` answers like ``contains`` but may say "unknown" (None) for a key whose part of
    the store did not answer, which a shared tier must not remember as "absent". The default
    is ``contains`` (never None). ``put_if_absent`` writes only the blocks the store does not
    hold: a block already stored is ``OK``, left as it is and counted in
    ``stats.extra["put_skipped_present"]``. The default is ``contains`` then ``put`` of the
    absent ones: correct, but two writers racing on one key may both write it (the later
    write replaces an identical block). A backend whose store has an atomic set-if-absent
    (Redis ``MSETNX``, S3 ``If-None-Match: *``, Memcached ``add``) overrides it, so that
    every block is written once however many engine nodes store it at the same time.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Self, TypeGuard

__all__ = [
    "BackendCapabilities",
    "BackendStats",
    "Outcome",
    "StorageBackend",
    "is_block_view",
]


class Outcome(enum.Enum):
    """The result of one key of a batch operation."""

    OK = "ok"
    MISSING = "missing"  # get: the key is not stored
    CORRUPT = "corrupt"  # get: stored but did not verify; it has been deleted
    FULL = "full"  # put: no room; the tier should evict and retry
    FAILED = "failed"  # an I/O error; the key is not visible


@dataclass(frozen=True)
class BackendCapabilities:
    """What a backend can do; tiers and the config checker read these."""

    persistent: bool  # survives a restart of the process
    supports_delete: bool
    max_value_bytes: int  # the largest block (payload) it accepts
    zero_copy_reads: bool = False  # get() moves bytes into the caller's buffer with no staging copy
    shared: bool = False  # others write and evict the store too: it is its own index (see above)


@dataclass
class BackendStats:
    """Counters a backend keeps; tiers aggregate them into metrics."""

    puts: int = 0
    put_failures: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    read_failures: int = 0
    deletes: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class StorageBackend(ABC):
    """An async, batch-first store of fixed-size blocks. See the module docstring for the contract.

    Concrete backends take their settings in ``__init__`` (no I/O there) and always receive
    ``block_bytes`` (the payload size of every block) and ``fingerprint`` (16 bytes naming the
    layout the blocks belong to; see ``block_format.make_layout_fingerprint``). A backend may
    also accept ``layout_description`` (what the fingerprint stands for, see
    :func:`tiering.core.identity.layout_identity`), to name layouts in its messages and marker.
    """

    #: The name the backend is registered under ("file", "lmdb", ...).
    name: ClassVar[str]
    #: Glob patterns of the files the backend creates in its directory (``path``): all that
    #: tiering ever deletes there (see :mod:`tiering.backends.ownership`).
    owned_files: ClassVar[tuple[str, ...]] = ()
    #: What the backend holds an exclusive ``flock`` on while open, relative to its directory
    #: (``"."``: the directory itself). ``tiering wipe``, ``replay --fresh`` and recovery take
    #: these first and refuse a tier a live process holds
    #: (:mod:`tiering.backends.tier_lock`). A backend that keeps files must hold one.
    lock_files: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def recognizes_directory(cls, path: Path) -> bool:
        """Whether ``path`` (no tiering marker, only files matching ``owned_files``) holds
        files this backend wrote (an earlier version of tiering wrote no marker). Reads only."""
        return False

    def __init__(
        self,
        *,
        block_bytes: int,
        fingerprint: bytes,
        layout_description: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0:
            raise ValueError(f"block_bytes must be a positive int, got {block_bytes!r}")
        if not isinstance(fingerprint, bytes) or len(fingerprint) != 16:
            raise ValueError(f"fingerprint must be 16 bytes, got {fingerprint!r:.60}")
        if layout_description is not None and not isinstance(layout_description, Mapping):
            raise ValueError(
                f"layout_description must be a mapping, got {layout_description!r:.60}"
            )
        self.block_bytes = block_bytes
        self.fingerprint = fingerprint
        self.layout_description = layout_description
        self.stats = BackendStats()

    # -- capabilities and accounting (cheap, no I/O) -------------------------------------------

    @property
    @abstractmethod
    def capabilities(self) -> BackendCapabilities:
        """What this backend can do."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """The configured capacity, in bytes of storage (headers included)."""

    @property
    @abstractmethod
    def capacity_blocks(self) -> int:
        """How many blocks of ``block_bytes`` fit; the owning tier's policy capacity."""

    @property
    def effective_capacity_blocks(self) -> int:
        """How many blocks it may hold now (<= ``capacity_blocks``): less when a disk guard
        (``min_free_bytes``, :mod:`tiering.backends.disk_guard`) sees the filesystem fill. The
        owning tier evicts down to it before writing. Cheap: the last sample, no I/O."""
        return self.capacity_blocks

    @property
    @abstractmethod
    def usage_bytes(self) -> int:
        """Bytes of storage used by stored blocks (headers included)."""

    @property
    @abstractmethod
    def is_open(self) -> bool:
        """Whether ``open`` has completed and ``close`` has not been called."""

    # -- lifecycle ------------------------------------------------------------------------------

    @abstractmethod
    async def open(self) -> list[bytes]:
        """Prepare storage; return the keys recovered from a previous run (verified)."""

    @abstractmethod
    async def close(self) -> None:
        """Wait for in-flight operations, then release everything. Idempotent."""

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- batch operations -----------------------------------------------------------------------

    @abstractmethod
    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        """Store ``values[i]`` under ``keys[i]``; ``OK``, ``FULL`` or ``FAILED`` per key."""

    @abstractmethod
    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        """Read ``keys[i]`` into ``buffers[i]``; ``OK``, ``MISSING``, ``CORRUPT`` or ``FAILED``."""

    @abstractmethod
    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (from the backend's index; verifies nothing)."""

    @abstractmethod
    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Delete each key; True if it was stored."""

    # -- optional operations (the pieces of a shared tier; see the module docstring) -------------

    async def exists(self, keys: Sequence[bytes]) -> list[bool | None]:
        """Whether the store holds each key: True, False, or None where it cannot tell (the
        node holding the key did not answer). Verifies nothing. The default is :meth:`contains`
        (never None)."""
        present: list[bool | None] = list(await self.contains(keys))
        return present

    async def put_if_absent(
        self, keys: Sequence[bytes], values: Sequence[memoryview]
    ) -> list[Outcome]:
        """Store ``values[i]`` under ``keys[i]`` unless the store holds ``keys[i]`` already:
        then it is ``OK``, not rewritten, and counted in ``stats.extra["put_skipped_present"]``.
        ``OK``, ``FULL`` or ``FAILED`` per key, like :meth:`put`, and the same errors for misuse.

        The default asks :meth:`contains`, then :meth:`put` of the absent keys: not atomic, so
        two writers racing on one key may both write it. Override it with the store's own
        set-if-absent where there is one.
        """
        if len(values) != len(keys):
            raise ValueError(f"put_if_absent got {len(keys)} keys but {len(values)} values")
        for i, value in enumerate(values):
            try:
                nbytes = memoryview(value).nbytes
            except TypeError:
                kind = type(value).__name__
                raise ValueError(f"value {i} must be a buffer, got {kind}") from None
            if nbytes != self.block_bytes:
                raise ValueError(
                    f"value {i} is {nbytes} bytes; every block is {self.block_bytes} bytes"
                )
        present = await self.contains(keys)
        absent = [i for i, p in enumerate(present) if not p]
        results = [Outcome.OK] * len(present)
        if absent:
            written = await self.put([keys[i] for i in absent], [values[i] for i in absent])
            for i, outcome in zip(absent, written, strict=True):
                results[i] = outcome
        skipped = len(present) - len(absent)
        if skipped:
            extra = self.stats.extra
            extra["put_skipped_present"] = extra.get("put_skipped_present", 0) + skipped
        return results


def is_block_view(buf: object, nbytes: int, *, writable: bool) -> TypeGuard[memoryview]:
    """Whether ``buf`` is already what a backend moves bytes through: a flat, C-contiguous,
    unsigned-byte ``memoryview`` of exactly ``nbytes`` (writable if ``writable``).

    The common case (a pool row's view), checked in one go so that a backend's per-buffer
    validation costs almost nothing; anything else goes through the backend's full checks.
    """
    return (
        type(buf) is memoryview
        and buf.nbytes == nbytes
        and buf.format == "B"
        and buf.ndim == 1
        and buf.c_contiguous
        and not (writable and buf.readonly)
    )
