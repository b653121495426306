"""The Redis backend (``type: redis``): blocks in a Redis server or a Redis Cluster (or Valkey).

Needs the ``redis`` package with its ``hiredis`` parser (``pip install 'tiering[redis]'``);
``import tiering`` works without it, and the registry imports this module only when a tier
asks for ``type: redis``.

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
    store that others fill): :meth:`RedisBackend.server_stats` reports what Redis holds (used
    memory, keys (two per block), evictions, summed over the masters). ``contains`` and
    :meth:`RedisBackend.exists` ask the store (one ``EXISTS`` pipeline per node; ``exists``
    tells "unknown, its node failed" from "absent"), and :meth:`RedisBackend.put_if_absent`
    writes only the blocks the store does not hold, atomically per block (``MSETNX``), so two
    nodes never both write one: the pieces a shared tier is built from.

Failures
    At open, wrong credentials, an unreachable server and a cluster that says it is down raise
    :class:`~tiering.errors.BackendError` saying which and where (a password variable that is
    not set raises :class:`~tiering.errors.ConfigurationError`). At run time a node that fails
    (refused, reset, timed out, TLS or auth failure) fails only its own keys (``FAILED``; a
    get's ``FAILED`` is a miss to the tier), is logged once, counted, and skipped for
    ``retry_interval_s`` before it is tried again; nothing raises into the engine. A ``MOVED``
    reply (a slot resharded, or a failover) points the slot at the master it names and the
    keys concerned are sent there once more, in the same call; the slot table is read again
    before the next call. ``ASK`` (a slot in mid-migration), ``TRYAGAIN`` and ``CLUSTERDOWN``
    fail the keys concerned (``FAILED``) and have the slot table read again.

Stats
    ``puts``/``gets`` count keys; ``bytes_written``/``bytes_read`` payload bytes of ``OK``
    results. ``extra``: ``node_errors`` (pipelines a node failed), ``node_down_keys`` (keys failed
    at once because their node was down), ``redirections`` (keys answered ``MOVED``, ``ASK``, ...),
    ``oom_rejections``, ``vanished``
    (held keys that Redis no longer had), ``recovered_blocks``, ``recovered_over_capacity``,
    ``put_skipped_present``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import urllib.parse
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

try:
    from redis.exceptions import (
        AskError,
        AuthenticationError,
        ClusterDownError,
        MovedError,
        OutOfMemoryError,
        RedisError,
        TryAgainError,
    )
    from redis.utils import HIREDIS_AVAILABLE
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the installation
    raise ModuleNotFoundError(
        "the redis backend needs the redis package: pip install 'tiering[redis]'", name="redis"
    ) from exc

from tiering.backends.base import BackendCapabilities, Outcome, StorageBackend, is_block_view
from tiering.backends.redis.nodes import ClientOptions, RedisNode, RedisNodes, parse_seeds
from tiering.backends.redis.reads import BlockReads
from tiering.core.block_format import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    checksum,
    pack_header,
    unpack_header,
)
from tiering.core.keys import check_keys
from tiering.errors import BackendError, ConfigurationError, CorruptBlockError

__all__ = ["RedisBackend", "RedisServerStats", "RedisSettings"]

_log = logging.getLogger(__name__)

_HEADER_SUFFIX = b"}:h"
_PAYLOAD_SUFFIX = b"}:p"
#: The payload's last bytes travel in the header string, so that the payload string of a
#: power-of-two block fits jemalloc's size class exactly (see the module docstring).
TAIL_BYTES = 64
#: Redis's default proto-max-bulk-len: the largest value it accepts.
_MAX_BULK_BYTES = 512 << 20
#: What Redis keeps per block besides header and payload (two key names, objects and dict
#: entries, allocator rounding of the small ones): ``MEMORY USAGE`` of a stored block's two
#: strings on Redis 7.0, minus the payload and header, rounded up.
REDIS_OVERHEAD_BYTES = 512
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:/-]{1,64}")
_MOVED = (MovedError, AskError, TryAgainError, ClusterDownError)

#: Takes a pipeline's replies (in order), records the outcomes, and returns the items that
#: Redis redirected with ``MOVED`` (their outcomes are left as they were), with the reply.
_ReadReplies = Callable[[list[Any]], dict[int, MovedError]]
#: ``add(pipeline, indexes)`` queues the commands for items ``indexes`` on a redis-py pipeline
#: and returns the function that reads the pipeline's replies.
_AddCommands = Callable[[Any, list[int]], _ReadReplies]


@dataclass(frozen=True)
class RedisSettings:
    """Settings of the ``redis`` backend (:class:`RedisBackend`); see docs/config.md."""

    url: str | None = field(
        default=None,
        metadata={"doc": "a standalone server: redis://host:port/db, rediss:// (TLS), unix://"},
    )
    cluster_nodes: str | None = field(
        default=None, metadata={"doc": "a Redis Cluster: seed nodes as 'host:port,host:port'"}
    )
    db: int = field(default=0, metadata={"min": 0, "doc": "database number (standalone only)"})
    username: str | None = field(default=None, metadata={"doc": "ACL user name"})
    password_env: str | None = field(
        default=None,
        metadata={"doc": "name of the environment variable that holds the password"},
    )
    tls: bool = field(default=False, metadata={"doc": "connect with TLS (implied by rediss://)"})
    tls_ca_file: Path | None = field(
        default=None, metadata={"doc": "CA bundle that signs the servers' certificates"}
    )
    tls_cert_file: Path | None = field(
        default=None, metadata={"doc": "client certificate (mutual TLS)"}
    )
    tls_key_file: Path | None = field(default=None, metadata={"doc": "client certificate's key"})
    connect_timeout_s: float = field(
        default=5.0, metadata={"min": 0.001, "doc": "seconds to connect to a node"}
    )
    timeout_s: float = field(
        default=10.0, metadata={"min": 0.001, "doc": "seconds for one pipeline to be answered"}
    )
    key_prefix: str = field(
        default="tiering", metadata={"doc": "first part of every Redis key name"}
    )
    ttl_s: float | None = field(
        default=None, metadata={"min": 0.001, "doc": "expire blocks this long after a put"}
    )
    shared: bool = field(
        default=False,
        metadata={"doc": "many nodes share the namespace: keep no index, enforce no budget"},
    )
    pipeline_bytes: int = field(
        default=2 << 20, metadata={"doc": "values per pipeline (bigger calls are cut)"}
    )
    pipelines_per_node: int = field(
        default=2,
        metadata={"min": 1, "max": 64, "doc": "get pipelines in flight per node (as many puts)"},
    )
    retry_interval_s: float = field(
        default=1.0, metadata={"min": 0.0, "doc": "seconds a failed node is skipped"}
    )

    def __post_init__(self) -> None:
        if (self.url is None) == (self.cluster_nodes is None):
            raise ConfigurationError(
                "give exactly one of url (a standalone server) and cluster_nodes (seed nodes "
                "of a Redis Cluster)"
            )
        if self.url is not None:
            parts = urllib.parse.urlsplit(self.url)
            if parts.scheme not in ("redis", "rediss", "unix"):
                raise ConfigurationError(
                    f"url {self.url!r}: the scheme must be redis://, rediss:// or unix://"
                )
            if parts.password:
                raise ConfigurationError(
                    "url contains a password: put the password in an environment variable "
                    "and name the variable in password_env"
                )
        if self.cluster_nodes is not None:
            try:
                parse_seeds(self.cluster_nodes)
            except ValueError as exc:
                raise ConfigurationError(f"cluster_nodes: {exc}") from None
            if self.db != 0:
                raise ConfigurationError(f"db: a Redis Cluster has only database 0, got {self.db}")
        if not _PREFIX_RE.fullmatch(self.key_prefix):
            raise ConfigurationError(
                f"key_prefix {self.key_prefix!r}: use 1 to 64 of A-Z a-z 0-9 _ . : / - "
                "(no braces: a hash tag would put every block in one cluster slot)"
            )
        if self.password_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*",
                                                              self.password_env):  # fmt: skip
            raise ConfigurationError(
                f"password_env {self.password_env!r} is not an environment variable name "
                "(give the variable's name, never the password itself)"
            )
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigurationError("give tls_cert_file and tls_key_file together (mutual TLS)")
        files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if not self.uses_tls and any(f is not None for f in files):
            raise ConfigurationError(
                "TLS files are given but TLS is off: set tls: true (or use a rediss:// url)"
            )
        if self.pipeline_bytes < 1:
            raise ConfigurationError(f"pipeline_bytes must be > 0, got {self.pipeline_bytes}")

    @property
    def uses_tls(self) -> bool:
        return self.tls or (self.url is not None and self.url.startswith("rediss://"))


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


async def _all_or_none(jobs: Sequence[Coroutine[Any, Any, None]]) -> None:
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


def _length(value: bytes, expected: int) -> str:
    """A string's length as read: a read stops one byte past the expected length."""
    return f"more than {expected}" if len(value) > expected else str(len(value))


def _byte_view(buf: object, nbytes: int, kind: str, index: int, *, writable: bool) -> memoryview:
    """``buf`` as a flat uint8 memoryview of exactly ``nbytes``, or ValueError naming it."""
    if is_block_view(buf, nbytes, writable=writable):
        return buf
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{kind} {index} must be a buffer, got {type(buf).__name__}") from None
    if view.nbytes != nbytes:
        raise ValueError(f"{kind} {index} is {view.nbytes} bytes; every block is {nbytes} bytes")
    if writable and view.readonly:
        raise ValueError(f"{kind} {index} is read-only; get() writes into its buffers")
    if not view.c_contiguous:
        raise ValueError(f"{kind} {index} is not C-contiguous")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view


class RedisBackend(StorageBackend):
    """Blocks in Redis; see the module docstring. Keyword options are :class:`RedisSettings`."""

    name = "redis"
    settings_class: ClassVar[type] = RedisSettings

    def __init__(
        self, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes, **options: Any
    ) -> None:
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint)
        try:
            self.settings = RedisSettings(**options)
        except TypeError as exc:
            valid = ", ".join(RedisSettings.__dataclass_fields__)
            raise ConfigurationError(f"redis backend: {exc} (options: {valid})") from None
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ConfigurationError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
        self._capacity_bytes = capacity_bytes
        self.footprint_bytes = HEADER_BYTES + block_bytes + REDIS_OVERHEAD_BYTES
        self._tail_bytes = TAIL_BYTES if block_bytes >= 4 * TAIL_BYTES else 0
        if capacity_bytes // self.footprint_bytes < 1:
            raise ConfigurationError(
                f"capacity_bytes={capacity_bytes} holds no block: one block of {block_bytes} "
                f"bytes takes about {self.footprint_bytes} bytes of Redis memory"
            )
        if HEADER_BYTES + block_bytes > _MAX_BULK_BYTES:
            raise ConfigurationError(f"blocks of {block_bytes} bytes exceed Redis's 512 MiB")
        self.shared = self.settings.shared
        self._namespace = f"{self.settings.key_prefix}:{fingerprint.hex()}:".encode()
        self._ttl_ms = None if self.settings.ttl_s is None else max(
            1, round(self.settings.ttl_s * 1000)
        )  # fmt: skip
        self._nodes: RedisNodes | None = None
        self._state = "closed"
        self._held: set[bytes] = set()  # shared=False: the keys this backend holds
        self._reserved = 0  # shared=False: room taken by puts in flight
        self._writing: dict[bytes, int] = {}  # puts in flight per key
        self._inflight = 0
        self._idle: asyncio.Event | None = None
        self._closed: asyncio.Event | None = None
        self._last_server_stats: RedisServerStats | None = None

    # -- names ----------------------------------------------------------------------------------

    @property
    def namespace(self) -> bytes:
        """The start of every Redis key name this backend uses."""
        return self._namespace

    def redis_keys(self, key: bytes) -> tuple[bytes, bytes]:
        """The Redis key names of offload key ``key``'s block: its header and payload strings."""
        stem = self._namespace + b"{" + key.hex().encode()
        return stem + _HEADER_SUFFIX, stem + _PAYLOAD_SUFFIX

    def _offload_key(self, header_name: bytes) -> bytes | None:
        start = len(self._namespace) + 1
        if not (header_name.startswith(self._namespace) and header_name.endswith(_HEADER_SUFFIX)):
            return None
        try:
            key = bytes.fromhex(header_name[start : -len(_HEADER_SUFFIX)].decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            return None
        return key if 4 < len(key) <= MAX_KEY_BYTES else None

    # -- capabilities and accounting ------------------------------------------------------------

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            persistent=True,
            supports_delete=True,
            max_value_bytes=_MAX_BULK_BYTES - HEADER_BYTES,
            shared=self.shared,
        )

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def capacity_blocks(self) -> int:
        return self._capacity_bytes // self.footprint_bytes

    @property
    def usage_bytes(self) -> int:
        """shared=False: the keys held times ``footprint_bytes``. shared=True: 0, as this
        backend accounts for nothing in a store that others fill (see :meth:`server_stats`)."""
        return len(self._held) * self.footprint_bytes

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    @property
    def last_server_stats(self) -> RedisServerStats | None:
        """What :meth:`server_stats` last returned (None before its first call)."""
        return self._last_server_stats

    @property
    def nodes(self) -> RedisNodes | None:
        """The deployment's masters and their clients while open (for operators and tests)."""
        return self._nodes

    @property
    def degraded(self) -> bool:
        """Whether some node failed its last call and is being skipped."""
        return self._nodes is not None and any(n.is_down for n in self._nodes.masters())

    @property
    def parser(self) -> str:
        """The reply parser redis-py uses: ``"hiredis"`` (C) or ``"python"``."""
        return "hiredis" if HIREDIS_AVAILABLE else "python"

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            self.stats.extra[name] = self.stats.extra.get(name, 0) + n

    # -- lifecycle ------------------------------------------------------------------------------

    async def open(self) -> list[bytes]:
        if self._state != "closed":
            raise BackendError(f"redis backend {self._where()} is already {self._state}")
        s = self.settings
        password = None
        if s.password_env is not None:
            password = os.environ.get(s.password_env)
            if not password:
                raise ConfigurationError(
                    f"password_env names {s.password_env!r}, which is not set (or empty) in "
                    "this process's environment"
                )
        nodes = RedisNodes(
            standalone_url=s.url,
            seeds=parse_seeds(s.cluster_nodes) if s.cluster_nodes is not None else [],
            options=ClientOptions(
                username=s.username,
                password=password,
                db=s.db,
                tls=s.uses_tls,
                tls_ca_file=None if s.tls_ca_file is None else str(s.tls_ca_file),
                tls_cert_file=None if s.tls_cert_file is None else str(s.tls_cert_file),
                tls_key_file=None if s.tls_key_file is None else str(s.tls_key_file),
                connect_timeout_s=s.connect_timeout_s,
                timeout_s=s.timeout_s,
                max_connections=2 * s.pipelines_per_node + 32,
            ),
            pipelines_per_node=s.pipelines_per_node,
            retry_interval_s=s.retry_interval_s,
        )
        self._state = "opening"
        try:
            await nodes.connect()
            self._nodes = nodes
            recovered = [] if self.shared else await self._recover()
        except BaseException as exc:
            self._nodes = None
            await nodes.close()
            self._state = "closed"
            if isinstance(exc, AuthenticationError) and s.password_env is None:
                raise BackendError(
                    f"redis at {nodes.where} needs credentials, and none are configured (name "
                    f"the environment variable that holds the password in password_env): {exc}"
                ) from exc
            if isinstance(exc, AuthenticationError):
                who = f"user {s.username!r}" if s.username else "the default user"
                raise BackendError(
                    f"redis at {nodes.where} rejected the credentials ({who}, the password in "
                    f"${s.password_env}): {exc}"
                ) from exc
            if isinstance(exc, RedisError | OSError):
                raise BackendError(
                    f"cannot use redis at {nodes.where}: {type(exc).__name__}: {exc}"
                ) from exc
            raise
        self._held = set(recovered)
        self._idle = asyncio.Event()
        self._idle.set()
        self._closed = asyncio.Event()
        self._state = "open"
        if not HIREDIS_AVAILABLE:
            _log.warning("redis backend: hiredis is not installed; replies are parsed in Python")
        return recovered

    async def _recover(self) -> list[bytes]:
        """The keys of this namespace on every master that answers (``SCAN``), up to
        ``capacity_blocks``."""
        assert self._nodes is not None
        pattern = self._namespace + b"*" + _HEADER_SUFFIX  # prefix and hex are glob-safe

        nodes = self._nodes

        async def scan(node: RedisNode) -> list[bytes]:
            found: list[bytes] = []
            if node.is_down:
                return found
            try:
                async for name in node.client.scan_iter(match=pattern, count=1000):
                    key = self._offload_key(name)
                    if key is not None:
                        found.append(key)
            except (RedisError, OSError) as exc:  # a master that is down: recover the others
                nodes.mark_down(node, exc)
            return found

        per_node = await asyncio.gather(*(scan(n) for n in nodes.masters()))
        keys = list(dict.fromkeys(k for found in per_node for k in found))
        kept = keys[: self.capacity_blocks]
        self._count("recovered_blocks", len(kept))
        self._count("recovered_over_capacity", len(keys) - len(kept))
        return kept

    async def close(self) -> None:
        if self._state in ("closed", "opening"):
            return
        if self._state == "closing":
            assert self._closed is not None
            await self._closed.wait()
            return
        self._state = "closing"
        assert self._idle is not None and self._closed is not None
        await self._idle.wait()
        nodes, self._nodes = self._nodes, None
        if nodes is not None:
            await nodes.close()
        self._held.clear()
        self._state = "closed"
        self._closed.set()

    def _where(self) -> str:
        s = self.settings
        return (s.url or "").split("@")[-1] or f"cluster {s.cluster_nodes}"

    def _check_open(self) -> RedisNodes:
        if self._state != "open" or self._nodes is None:
            raise BackendError(f"redis backend {self._where()} is not open ({self._state})")
        return self._nodes

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """Counts in-flight operations so that ``close`` can wait for them."""
        assert self._idle is not None
        self._inflight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    # -- batch operations -----------------------------------------------------------------------

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        return await self._checked_put(keys, values, if_absent=False)

    async def put_if_absent(
        self, keys: Sequence[bytes], values: Sequence[memoryview]
    ) -> list[Outcome]:
        """Write only the blocks the store does not hold, atomically per block (``MSETNX`` of
        its two strings): a block that is there already is ``OK``, not rewritten, and counted
        in ``stats.extra["put_skipped_present"]``. One round trip per node, like ``put``."""
        return await self._checked_put(keys, values, if_absent=True)

    async def _checked_put(
        self, keys: Sequence[bytes], values: Sequence[memoryview], *, if_absent: bool
    ) -> list[Outcome]:
        nodes = self._check_open()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if len(values) != len(key_list):
            raise ValueError(f"put got {len(key_list)} keys but {len(values)} values")
        views = [
            _byte_view(v, self.block_bytes, "value", i, writable=False)
            for i, v in enumerate(values)
        ]
        if not key_list:
            return []
        skipped: set[int] = set()
        with self._operation():
            results = await self._put(nodes, key_list, views, skipped if if_absent else None)
        ok = results.count(Outcome.OK)
        self.stats.puts += len(results)
        self.stats.put_failures += len(results) - ok
        self.stats.bytes_written += (ok - len(skipped)) * self.block_bytes
        self._count("put_skipped_present", len(skipped))
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
        order = sorted(last.values())
        results: list[Outcome] = [Outcome.FAILED] * len(keys)
        new: list[bytes] = []
        if not self.shared:
            new = [keys[i] for i in order if keys[i] not in self._held]
            room = max(0, self.capacity_blocks - len(self._held) - self._reserved)
            if len(new) > room:
                refused = set(new[room:])
                new = new[:room]
                for i in order:
                    if keys[i] in refused:
                        results[i] = Outcome.FULL
                order = [i for i in order if keys[i] not in refused]
            self._reserved += len(new)
        names = [self.redis_keys(key) for key in keys]
        for i in order:
            self._writing[keys[i]] = self._writing.get(keys[i], 0) + 1
        try:
            add = self._put_chunk(keys, views, names, results, skipped)
            await self._run(nodes, names, order, add, writing=True)
        finally:
            for i in order:
                count = self._writing.pop(keys[i]) - 1
                if count:
                    self._writing[keys[i]] = count
            if not self.shared:
                self._reserved -= len(new)
                self._held.update(keys[i] for i in order if results[i] is Outcome.OK)
        if len(last) < len(keys):  # earlier copies of a key share its outcome
            results = [results[last[key]] for key in keys]
            if skipped:
                skipped.update(j for j, key in enumerate(keys) if last[key] in skipped)
        return results

    def _put_chunk(
        self,
        keys: Sequence[bytes],
        views: list[memoryview],
        names: list[tuple[bytes, bytes]],
        results: list[Outcome],
        skipped: set[int] | None,
    ) -> _AddCommands:
        """The function that adds a chunk's commands to a pipeline (see ``_AddCommands``)."""
        ttl_ms = self._ttl_ms
        command = "MSET" if skipped is None else "MSETNX"
        fingerprint = self.fingerprint
        split = self.block_bytes - self._tail_bytes

        def add(pipe: Any, chunk: list[int]) -> _ReadReplies:
            for i in chunk:
                view = views[i]
                header = pack_header(keys[i], view, fingerprint) + view[split:].tobytes()
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
                        results[i] = self._error_outcome(reply, writing=True)
                        continue
                    results[i] = Outcome.OK
                    if skipped is not None and reply == 0:  # MSETNX: a string was there
                        skipped.add(i)
                return moved

            return read

        return add

    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        nodes = self._check_open()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if len(buffers) != len(key_list):
            raise ValueError(f"get got {len(key_list)} keys but {len(buffers)} buffers")
        views = [
            _byte_view(b, self.block_bytes, "buffer", i, writable=True)
            for i, b in enumerate(buffers)
        ]
        if not key_list:
            return []
        results: list[Outcome] = [Outcome.FAILED] * len(key_list)
        names = [self.redis_keys(k) for k in key_list]
        corrupt: dict[int, str] = {}  # item -> why it does not verify
        halves: set[int] = set()  # blocks with one string gone
        with self._operation():
            add = self._get_chunk(key_list, views, names, results, corrupt, halves)
            await self._run(nodes, names, range(len(key_list)), add, writing=False)
            if corrupt or halves:
                # A block rewritten, evicted or expired between its two reads looks torn once
                # (redis_reads): read it again before calling it corrupt or unlinking half of it.
                again = sorted({*corrupt, *halves})
                corrupt.clear()
                halves.clear()
                for i in again:
                    results[i] = Outcome.FAILED
                await self._run(nodes, names, again, add, writing=False)
            for i, why in corrupt.items():
                _log.warning("corrupt redis block %s: %s", key_list[i].hex(), why)
            if corrupt or halves:
                await self._small(nodes, "UNLINK", [names[i] for i in (*corrupt, *halves)])
        ok = results.count(Outcome.OK)
        self.stats.gets += len(results)
        self.stats.hits += ok
        self.stats.bytes_read += ok * self.block_bytes
        if ok < len(results):
            missing = [key_list[i] for i, r in enumerate(results) if r is Outcome.MISSING]
            self.stats.misses += len(missing)
            self.stats.corrupt += len(corrupt)
            self.stats.read_failures += results.count(Outcome.FAILED)
            self._forget_vanished(missing)
            if corrupt and not self.shared:
                self._held.difference_update(key_list[i] for i in corrupt)  # unlinked
        return results

    def _get_chunk(
        self,
        keys: Sequence[bytes],
        views: list[memoryview],
        names: list[tuple[bytes, bytes]],
        results: list[Outcome],
        corrupt: dict[int, str],
        halves: set[int],
    ) -> _AddCommands:
        """Reads of at most a block per string (see ``redis_reads``)."""
        header_bytes = HEADER_BYTES + self._tail_bytes
        payload_bytes = self.block_bytes - self._tail_bytes

        def add(pipe: Any, chunk: list[int]) -> _ReadReplies:
            reads = BlockReads(names, chunk, header_bytes=header_bytes, payload_bytes=payload_bytes)
            reads.queue(pipe)

            def read(replies: list[Any]) -> dict[int, MovedError]:
                moved: dict[int, MovedError] = {}
                for i, header, payload in reads.replies(replies):
                    error = header if isinstance(header, BaseException) else payload
                    if isinstance(error, MovedError):  # nothing was read: asked again once
                        moved[i] = error
                        continue
                    if isinstance(error, BaseException):
                        results[i] = self._error_outcome(error, writing=False)
                        continue
                    assert not isinstance(header, BaseException)
                    assert not isinstance(payload, BaseException)
                    try:
                        results[i] = self._read_reply(keys[i], views[i], header, payload)
                    except CorruptBlockError as exc:
                        results[i] = Outcome.CORRUPT
                        corrupt[i] = str(exc)
                        continue
                    if results[i] is Outcome.MISSING and (header, payload) != (None, None):
                        halves.add(i)
                return moved

            return read

        return add

    def _read_reply(
        self, key: bytes, view: memoryview, raw_header: bytes | None, payload: bytes | None
    ) -> Outcome:
        """Verify one block's strings (each read up to one byte past its length) and copy its
        payload into ``view``; ``CorruptBlockError`` saying why a block does not verify."""
        if raw_header is None or payload is None:  # absent, or half of it evicted or expired
            return Outcome.MISSING
        tail = self._tail_bytes
        split = self.block_bytes - tail
        if len(raw_header) != HEADER_BYTES + tail or len(payload) != split:
            raise CorruptBlockError(
                f"strings of {_length(raw_header, HEADER_BYTES + tail)} and "
                f"{_length(payload, split)} bytes, expected {HEADER_BYTES + tail} and {split}"
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

    def _error_outcome(self, error: BaseException, *, writing: bool) -> Outcome:
        """The outcome of one command that Redis answered with an error."""
        if writing and isinstance(error, OutOfMemoryError):
            self._count("oom_rejections")
            return Outcome.FULL
        if isinstance(error, _MOVED):
            self._count("redirections")
            if self._nodes is not None:
                self._nodes.mark_stale()
        else:
            _log.warning("redis command failed: %s: %s", type(error).__name__, error)
        return Outcome.FAILED

    def _forget_vanished(self, keys: Sequence[bytes]) -> None:
        """shared=False: drop keys Redis no longer holds from the held set (not while written)."""
        if self.shared:
            return
        gone = [k for k in keys if k in self._held and k not in self._writing]
        self._held.difference_update(gone)
        self._count("vanished", len(gone))

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether Redis holds each key (one ``EXISTS`` pipeline per node; verifies nothing).

        A key whose node failed is reported absent.
        """
        self._check_open()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        present = await self.exists(key_list)
        self._forget_vanished([k for k, p in zip(key_list, present, strict=True) if p is False])
        return [p is True for p in present]

    async def exists(self, keys: Sequence[bytes]) -> list[bool | None]:
        """Whether Redis holds each key: True, False, or None where its node failed (unknown,
        not absent: a shared tier should not remember such an answer). One ``EXISTS`` pipeline
        per node; verifies nothing."""
        nodes = self._check_open()
        keys = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if not keys:
            return []
        with self._operation():
            replies = await self._small(nodes, "EXISTS", [self.redis_keys(k) for k in keys])
        return [None if r is None else r == 2 for r in replies]  # half a block is no block

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        nodes = self._check_open()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if not key_list:
            return []
        with self._operation():
            replies = await self._small(nodes, "UNLINK", [self.redis_keys(k) for k in key_list])
        if not self.shared:
            self._held.difference_update(key_list)
        deleted = [bool(r) for r in replies]
        self.stats.deletes += sum(deleted)
        return deleted

    # -- pipelines ------------------------------------------------------------------------------

    async def _run(
        self,
        nodes: RedisNodes,
        names: list[tuple[bytes, bytes]],
        indexes: Sequence[int] | range,
        add: _AddCommands,
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
            self._count("redirections", len(moved))
            nodes.follow_moved(moved.values())
            again = await self._send(nodes, names, sorted(moved), add, writing=writing)
            if again:  # moved twice in one call: they stay FAILED
                self._count("redirections", len(again))

    async def _send(
        self,
        nodes: RedisNodes,
        names: list[tuple[bytes, bytes]],
        indexes: Sequence[int] | range,
        add: _AddCommands,
        *,
        writing: bool,
    ) -> dict[int, MovedError]:
        """One pass of :meth:`_run`; returns the items answered ``MOVED``."""
        per_pipeline = max(1, self.settings.pipeline_bytes // self.block_bytes)
        moved: dict[int, MovedError] = {}
        jobs: list[Coroutine[Any, Any, None]] = []
        for node, items in nodes.group(names, indexes).items():
            if node.is_down:
                self._count("node_down_keys", len(items))
                continue
            for start in range(0, len(items), per_pipeline):
                chunk = items[start : start + per_pipeline]
                jobs.append(self._pipeline(nodes, node, chunk, add, moved, writing=writing))
        await _all_or_none(jobs)
        return moved

    async def _pipeline(
        self,
        nodes: RedisNodes,
        node: RedisNode,
        chunk: list[int],
        add: _AddCommands,
        moved: dict[int, MovedError],
        *,
        writing: bool,
    ) -> None:
        async with node.writes if writing else node.reads:
            if node.is_down:  # it failed while this pipeline waited for its turn
                self._count("node_down_keys", len(chunk))
                return
            pipe = node.client.pipeline(transaction=False)
            read = add(pipe, chunk)
            try:
                replies = await pipe.execute(raise_on_error=False)
            except (RedisError, OSError) as exc:
                self._count("node_errors")
                nodes.mark_down(node, exc)
                return
        nodes.mark_up(node)
        moved.update(read(replies))

    async def _small(
        self, nodes: RedisNodes, command: str, names: Sequence[tuple[bytes, bytes]]
    ) -> list[Any]:
        """``command header_name payload_name`` per block, one pipeline per node; None where a
        node failed. Blocks answered ``MOVED`` are sent once more, as in :meth:`_run`."""
        await nodes.maybe_refresh()
        replies: list[Any] = [None] * len(names)
        moved: dict[int, MovedError] = {}

        async def one(node: RedisNode, items: list[int]) -> None:
            if node.is_down:
                self._count("node_down_keys", len(items))
                return
            pipe = node.client.pipeline(transaction=False)
            for i in items:
                pipe.execute_command(command, *names[i])
            try:
                answers = await pipe.execute(raise_on_error=False)
            except (RedisError, OSError) as exc:
                self._count("node_errors")
                nodes.mark_down(node, exc)
                return
            nodes.mark_up(node)
            for i, answer in zip(items, answers, strict=True):
                if isinstance(answer, MovedError) and retry:
                    moved[i] = answer
                elif isinstance(answer, BaseException):
                    self._error_outcome(answer, writing=False)
                else:
                    replies[i] = answer

        retry = True
        groups = nodes.group(names, range(len(names)))
        await _all_or_none([one(node, items) for node, items in groups.items()])
        if moved:
            self._count("redirections", len(moved))
            nodes.follow_moved(moved.values())
            retry = False
            groups = nodes.group(names, sorted(moved))
            await _all_or_none([one(node, items) for node, items in groups.items()])
        return replies

    # -- what the servers say -------------------------------------------------------------------

    async def server_stats(self) -> RedisServerStats:
        """Memory, keys and evictions as the masters report them (``INFO``, ``DBSIZE``).

        A node that does not answer counts as 0; the last result is kept in
        ``last_server_stats``.
        """
        nodes = self._check_open()
        masters = nodes.masters()

        async def ask(node: RedisNode) -> tuple[dict[str, Any], int] | None:
            try:
                info = await node.client.info("all")
                keys = await node.client.dbsize()
            except (RedisError, OSError):
                return None
            return info, int(keys)

        with self._operation():
            answers = await asyncio.gather(*(ask(n) for n in masters))
        got = [a for a in answers if a is not None]
        stats = RedisServerStats(
            nodes=len(masters),
            nodes_answering=len(got),
            used_memory_bytes=sum(int(i.get("used_memory", 0)) for i, _ in got),
            maxmemory_bytes=sum(int(i.get("maxmemory", 0)) for i, _ in got),
            keys=sum(k for _, k in got),
            evicted_keys=sum(int(i.get("evicted_keys", 0)) for i, _ in got),
            expired_keys=sum(int(i.get("expired_keys", 0)) for i, _ in got),
            eviction_policies=tuple(sorted({str(i.get("maxmemory_policy", "?")) for i, _ in got})),
        )
        self._last_server_stats = stats
        return stats
