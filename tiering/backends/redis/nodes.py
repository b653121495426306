"""The masters of a Redis deployment, one client each, and which of them holds a key.

A standalone server is one node. A Redis Cluster is read from a seed node's ``CLUSTER SLOTS``:
a table of the 16384 hash slots to their masters, with one ``redis.asyncio.Redis`` client (and
connection pool) per master. The backend groups a call's keys by node and sends each node one
pipeline (or a few, see :mod:`~tiering.backends.redis.pipelines`), so a call costs one round
trip per node, and a node that is down fails only its own keys.

Why not ``redis.asyncio.RedisCluster``: its pipeline fails a whole call when one node is
unreachable, and recovers by closing the client (every connection to every node) and sleeping
between retries inside the call. Here a node that fails is marked down for ``retry_interval_s``
(its keys fail at once, without a connect timeout each), its failure is logged once, and the
slot table is read again (MOVED replies and failovers move slots between masters).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import MovedError, RedisError

__all__ = ["ClientOptions", "RedisNode", "RedisNodes", "parse_seeds"]

_log = logging.getLogger(__name__)

#: Bytes redis-py reads from a socket at once (its default is 64 KiB); bigger reads halve the
#: loop wake-ups of a get of large blocks, measured (docs/benchmarks.md).
SOCKET_READ_BYTES = 256 << 10


@dataclass(frozen=True)
class ClientOptions:
    """What every connection to every node shares (credentials, TLS, timeouts)."""

    username: str | None
    password: str | None
    db: int
    tls: bool
    tls_ca_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None
    connect_timeout_s: float
    timeout_s: float
    max_connections: int

    def pool_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "username": self.username,
            "password": self.password,
            "db": self.db,
            "socket_connect_timeout": self.connect_timeout_s,
            "socket_timeout": self.timeout_s,
            "socket_read_size": SOCKET_READ_BYTES,
            "retry": Retry(NoBackoff(), 0),  # a failure is a result; the tier retries later
            "max_connections": self.max_connections,
            "timeout": self.timeout_s,  # waiting for a free connection
        }
        if self.tls:
            kwargs.update(
                connection_class=aioredis.SSLConnection,
                ssl_ca_certs=self.tls_ca_file,
                ssl_certfile=self.tls_cert_file,
                ssl_keyfile=self.tls_key_file,
                ssl_cert_reqs="required",
            )
        return kwargs


def parse_seeds(text: str) -> list[tuple[str, int]]:
    """``"host:port,host:port"`` as (host, port) pairs; ValueError saying what is wrong."""
    seeds = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        host, sep, port_text = item.rpartition(":")
        host = host.strip("[]")  # [::1]:7000
        if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"{item!r} is not host:port (e.g. 10.0.0.5:6379)")
        seeds.append((host, int(port_text)))
    if not seeds:
        raise ValueError(f"no host:port in {text!r}")
    return seeds


@dataclass(eq=False)
class RedisNode:
    """One master: its client, and whether calls should skip it for now."""

    address: str  # "host:port" or the URL of a standalone server
    client: aioredis.Redis
    reads: asyncio.Semaphore  # get pipelines in flight at once on this node
    writes: asyncio.Semaphore  # put pipelines: apart, so a get never queues behind puts
    down_until: float = 0.0  # monotonic time before which calls fail its keys at once
    failure: str = ""  # the error that marked it down (logged once per episode)
    retired: bool = False  # no longer in the slot table (closed when the backend closes)
    failures: int = 0

    @property
    def is_down(self) -> bool:
        return self.down_until > time.monotonic()


class RedisNodes:
    """The nodes of one deployment; see the module docstring.

    ``standalone_url`` (a URL) or ``seeds`` (cluster seed nodes) names the deployment.
    """

    def __init__(
        self,
        *,
        standalone_url: str | None,
        seeds: Sequence[tuple[str, int]],
        options: ClientOptions,
        pipelines_per_node: int,
        retry_interval_s: float,
    ) -> None:
        self.standalone_url = standalone_url
        self.seeds = list(seeds)
        self.options = options
        self.pipelines_per_node = pipelines_per_node
        self.retry_interval_s = retry_interval_s
        self.cluster = standalone_url is None
        self._by_address: dict[str, RedisNode] = {}
        self._slots: list[RedisNode] = []  # slot -> node (cluster only)
        self._stale = False  # the slot table should be read again
        self._last_refresh = 0.0
        self._refreshing: asyncio.Future[str] | None = None
        self.refreshes = 0

    def _lanes(self) -> tuple[asyncio.Semaphore, asyncio.Semaphore]:
        return asyncio.Semaphore(self.pipelines_per_node), asyncio.Semaphore(
            self.pipelines_per_node
        )

    @property
    def where(self) -> str:
        """The deployment, for messages: a URL or the seed list."""
        if self.standalone_url is not None:
            return self.standalone_url.split("@")[-1]
        return "cluster " + ",".join(f"{h}:{p}" for h, p in self.seeds)

    def masters(self) -> list[RedisNode]:
        """The nodes in use (the slot table's masters, or the one server)."""
        return [n for n in self._by_address.values() if not n.retired]

    def _node(self, host: str, port: int) -> RedisNode:
        address = f"{host}:{port}"
        node = self._by_address.get(address)
        if node is None:
            pool = aioredis.BlockingConnectionPool(
                host=host, port=port, **self.options.pool_kwargs()
            )
            client = aioredis.Redis(connection_pool=pool)
            node = RedisNode(address, client, *self._lanes())
            self._by_address[address] = node
        node.retired = False
        return node

    async def connect(self) -> None:
        """Create the clients and check the deployment; raises ``RedisError`` saying why not.

        A standalone server must answer, and must not be a cluster node (its keys would be
        ``MOVED`` elsewhere: the config should name it in ``cluster_nodes``). A cluster: the
        first seed that answers gives the slot table; the cluster must say
        ``cluster_state:ok``; a master that does not answer is marked down (its keys fail
        until it answers), unless none answers or one rejects the credentials.
        """
        if self.standalone_url is not None:
            kwargs = self.options.pool_kwargs()
            if self.standalone_url.startswith("unix://"):
                for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs"):
                    kwargs.pop(name, None)
            pool = aioredis.BlockingConnectionPool.from_url(self.standalone_url, **kwargs)
            node = RedisNode(
                self.where,
                aioredis.Redis(connection_pool=pool),
                *self._lanes(),
            )
            self._by_address[node.address] = node
            await node.client.ping()
            if str((await node.client.info("cluster")).get("cluster_enabled")) == "1":
                raise RedisError(
                    "the server is a Redis Cluster node: give the cluster's nodes in "
                    "cluster_nodes instead of url"
                )
            return
        info = await self._read_slots(raise_errors=True)
        if "cluster_state:ok" not in info:
            state = next((ln for ln in info.splitlines() if "cluster_state" in ln), "no state")
            raise RedisError(f"the cluster is down ({state.strip()})")
        masters = self.masters()
        answers = await asyncio.gather(*(n.client.ping() for n in masters), return_exceptions=True)
        errors = [a for a in answers if isinstance(a, BaseException)]
        for error in errors:
            if isinstance(error, aioredis.AuthenticationError) or not isinstance(
                error, RedisError | OSError
            ):
                raise error
        if len(errors) == len(masters):
            raise errors[0]
        for node, answer in zip(masters, answers, strict=True):
            if isinstance(answer, BaseException):
                self.mark_down(node, answer)

    async def _read_slots(self, *, raise_errors: bool) -> str:
        """Read ``CLUSTER SLOTS`` (and ``CLUSTER INFO``) from the first node that answers."""
        candidates = [(n.address.rpartition(":")[0], n.address.rpartition(":")[2]) for n in
                      self.masters()]  # fmt: skip
        addresses = [(h, int(p)) for h, p in candidates] + self.seeds
        last_error: BaseException | None = None
        for host, port in dict.fromkeys(addresses):
            node = self._node(host, port)
            try:
                raw = await node.client.execute_command("CLUSTER SLOTS")
                info = await node.client.execute_command("CLUSTER INFO")
            except RedisError as exc:
                last_error = exc
                if isinstance(exc, aioredis.AuthenticationError) and raise_errors:
                    raise
                continue
            self._install(_slot_ranges(raw, default_host=host))
            self._stale = False
            self._last_refresh = time.monotonic()
            self.refreshes += 1
            return _info_text(info)
        if raise_errors:
            raise last_error or RedisError("no seed node answered")
        return ""

    def _install(self, ranges: Sequence[tuple[int, int, str, int]]) -> None:
        if not ranges:
            raise RedisError("CLUSTER SLOTS lists no slots: the cluster has not been created")
        table: list[RedisNode | None] = [None] * REDIS_CLUSTER_HASH_SLOTS
        used: set[str] = set()
        for start, end, host, port in ranges:
            node = self._node(host, port)
            used.add(node.address)
            for slot in range(start, end + 1):
                table[slot] = node
        for node in self._by_address.values():
            node.retired = node.address not in used
        missing = [slot for slot, node in enumerate(table) if node is None]
        if missing:
            # An uncovered slot: route it to any master; its commands fail (CLUSTERDOWN) and
            # are reported FAILED, like a node that is down.
            fallback = next(n for n in self._by_address.values() if not n.retired)
            for slot in missing:
                table[slot] = fallback
        self._slots = [n for n in table if n is not None]

    def node_for(self, name: bytes) -> RedisNode:
        """The node that holds Redis key ``name``."""
        if not self.cluster:
            return next(iter(self._by_address.values()))
        return self._slots[key_slot(name)]

    def group(
        self, names: Sequence[tuple[bytes, ...]], indexes: Iterable[int]
    ) -> dict[RedisNode, list[int]]:
        """``indexes`` grouped by the node that holds each item's names (an item's names share
        a hash tag, so the first one decides), in order."""
        if not self.cluster:
            return {self.node_for(b""): list(indexes)}
        groups: dict[RedisNode, list[int]] = {}
        slots = self._slots
        for i in indexes:
            groups.setdefault(slots[key_slot(names[i][0])], []).append(i)
        return groups

    def follow_moved(self, replies: Iterable[MovedError]) -> None:
        """Point each slot that a ``MOVED`` reply names at the node it names (connecting to it
        if it is new), so that the commands it refused can be sent there at once; the whole
        table is read again before the next call (a resharding moves many slots).

        ``MOVED`` comes from a node of this deployment, after authentication, and names the
        master that serves the slot now: the answer a fresh ``CLUSTER SLOTS`` would give.
        """
        if not self.cluster:
            return
        for reply in replies:
            if not 0 <= reply.slot_id < len(self._slots):
                continue
            # A node that does not know its own address names "" or "?": the host the reply
            # came from is meant, the slot's old master (the commands were sent there).
            host = str(reply.host).strip("?")
            host = host or self._slots[reply.slot_id].address.rpartition(":")[0]
            self._slots[reply.slot_id] = self._node(host, int(reply.port))
        self._stale = True

    def mark_stale(self) -> None:
        """The slot table may be wrong (MOVED, a failover): read it again before the next call."""
        if self.cluster:
            self._stale = True

    async def maybe_refresh(self) -> None:
        """Read the slot table again if it is stale (at most once per ``retry_interval_s``)."""
        if not self._stale or time.monotonic() - self._last_refresh < self.retry_interval_s:
            return
        if self._refreshing is None or self._refreshing.done():
            self._last_refresh = time.monotonic()
            self._refreshing = asyncio.ensure_future(self._read_slots(raise_errors=False))
        await asyncio.shield(self._refreshing)

    def mark_down(self, node: RedisNode, error: BaseException) -> None:
        """``node`` failed a call: skip it for ``retry_interval_s``; log the first failure."""
        first = not node.failure
        node.down_until = time.monotonic() + self.retry_interval_s
        node.failure = f"{type(error).__name__}: {error}"
        node.failures += 1
        self.mark_stale()
        if first:
            _log.warning(
                "redis node %s failed (%s); its keys are misses until it answers again",
                node.address,
                node.failure,
            )

    def mark_up(self, node: RedisNode) -> None:
        """``node`` answered: clear its failure."""
        if node.failure:
            _log.warning("redis node %s answers again", node.address)
            node.failure = ""
            node.down_until = 0.0

    async def close(self) -> None:
        nodes = list(self._by_address.values())
        self._by_address.clear()
        self._slots = []
        if self._refreshing is not None and not self._refreshing.done():
            self._refreshing.cancel()
        for node in nodes:
            await node.client.aclose()
            await node.client.connection_pool.disconnect()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _info_text(value: object) -> str:
    if isinstance(value, dict):
        return "\n".join(f"{k}:{v}" for k, v in value.items())
    return _text(value)


def _slot_ranges(raw: object, *, default_host: str) -> list[tuple[int, int, str, int]]:
    """(first slot, last slot, master host, master port) from ``CLUSTER SLOTS``.

    A node that does not know its own address reports ``""`` or ``"?"``: the address asked
    (``default_host``) is meant.

    redis-py may have parsed the reply into ``{(start, end): {"primary": (host, port)}}``;
    the raw reply is ``[[start, end, [host, port, id, ...], replicas...], ...]``.
    """
    out = []
    if isinstance(raw, dict):
        for (start, end), entry in raw.items():
            host, port = entry["primary"][:2]
            out.append((int(start), int(end), _text(host).strip("?") or default_host, int(port)))
        return out
    if not isinstance(raw, list):
        raise RedisError(f"CLUSTER SLOTS gave {type(raw).__name__}, expected a list")
    for entry in raw:
        start, end, primary = entry[0], entry[1], entry[2]
        host = _text(primary[0]).strip("?") or default_host
        out.append((int(start), int(end), host, int(primary[1])))
    return out
