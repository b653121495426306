"""``RedisBackend``: the ``redis`` backend's face, its lifecycle and its calls.

It checks each call's arguments, counts the call in flight (so that ``close`` waits for it) and
hands it to its collaborators: :class:`~tiering.backends.redis.puts.Puts` and
:class:`~tiering.backends.redis.gets.Gets` (which send through
:class:`~tiering.backends.redis.pipelines.Pipelines`), the accounting of
:class:`~tiering.backends.redis.ownership.HeldKeys`, the names and values of
:class:`~tiering.backends.redis.value_format.BlockFormat`; the deployment's nodes come from
:mod:`~tiering.backends.redis.connection`. The package docstring
(:mod:`tiering.backends.redis`) says how it all fits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any, ClassVar

from redis.utils import HIREDIS_AVAILABLE

from tiering.backends.base import BackendCapabilities, Outcome, StorageBackend
from tiering.backends.in_flight import InFlight
from tiering.backends.redis.buffers import byte_view
from tiering.backends.redis.connection import make_nodes, open_error, where
from tiering.backends.redis.faults import Faults
from tiering.backends.redis.gets import Gets
from tiering.backends.redis.nodes import RedisNodes
from tiering.backends.redis.ownership import HeldKeys
from tiering.backends.redis.pipelines import Pipelines
from tiering.backends.redis.puts import Puts
from tiering.backends.redis.server_stats import RedisServerStats, ask_masters
from tiering.backends.redis.settings import RedisSettings
from tiering.backends.redis.value_format import (
    MAX_BULK_BYTES,
    REDIS_OVERHEAD_BYTES,
    BlockFormat,
)
from tiering.core.block_format import HEADER_BYTES, MAX_KEY_BYTES
from tiering.core.keys import check_keys
from tiering.errors import BackendError, ConfigurationError

__all__ = ["RedisBackend"]

_log = logging.getLogger("tiering.backends.redis")  # the package's logger, as it always was


class RedisBackend(StorageBackend):
    """Blocks in Redis; see :mod:`tiering.backends.redis`. Keyword options are
    :class:`RedisSettings`."""

    name = "redis"
    settings_class: ClassVar[type] = RedisSettings

    def __init__(
        self, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes, **options: Any
    ) -> None:
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint)
        self.settings = _settings(options)
        self._capacity_bytes = capacity_bytes
        self.footprint_bytes = HEADER_BYTES + block_bytes + REDIS_OVERHEAD_BYTES
        _check_capacity(capacity_bytes, block_bytes, self.footprint_bytes)
        self.shared = self.settings.shared
        self._format = BlockFormat(
            namespace=f"{self.settings.key_prefix}:{fingerprint.hex()}:".encode(),
            block_bytes=block_bytes,
            fingerprint=fingerprint,
        )
        self._make_collaborators()
        self._nodes: RedisNodes | None = None
        self._state = "closed"
        self._in_flight: InFlight | None = None
        self._closed: asyncio.Event | None = None
        self._last_server_stats: RedisServerStats | None = None

    def _make_collaborators(self) -> None:
        """The counters, the accounting, the pipelines, and the puts and gets that use them."""
        s = self.settings
        self._faults = faults = Faults(self.stats)
        self._held = HeldKeys(faults, shared=self.shared, capacity_blocks=self.capacity_blocks)
        pipelines = Pipelines(faults, per_pipeline=max(1, s.pipeline_bytes // self.block_bytes))
        self._pipelines = pipelines
        ttl_ms = None if s.ttl_s is None else max(1, round(s.ttl_s * 1000))
        block_format, held, stats = self._format, self._held, self.stats
        self._puts = Puts(
            block_format=block_format,
            pipelines=pipelines,
            held=held,
            faults=faults,
            stats=stats,
            ttl_ms=ttl_ms,
        )
        self._gets = Gets(
            block_format=block_format, pipelines=pipelines, held=held, faults=faults, stats=stats
        )

    # -- names ----------------------------------------------------------------------------------

    @property
    def namespace(self) -> bytes:
        """The start of every Redis key name this backend uses."""
        return self._format.namespace

    def redis_keys(self, key: bytes) -> tuple[bytes, bytes]:
        """The Redis key names of offload key ``key``'s block: its header and payload strings."""
        return self._format.redis_keys(key)

    # -- capabilities and accounting ------------------------------------------------------------

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            persistent=True,
            supports_delete=True,
            max_value_bytes=MAX_BULK_BYTES - HEADER_BYTES,
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
        return len(self._held.keys) * self.footprint_bytes

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

    # -- lifecycle ------------------------------------------------------------------------------

    async def open(self) -> list[bytes]:
        if self._state != "closed":
            raise BackendError(f"redis backend {where(self.settings)} is already {self._state}")
        nodes = make_nodes(self.settings)
        self._state = "opening"
        try:
            await nodes.connect()
            self._nodes = nodes
            recovered = [] if self.shared else await self._held.recover(nodes, self._format)
        except BaseException as exc:
            self._nodes = None
            await nodes.close()
            self._state = "closed"
            error = open_error(exc, self.settings, nodes)
            if error is not None:
                raise error from exc
            raise
        self._held.keys = set(recovered)
        self._in_flight = InFlight()
        self._closed = asyncio.Event()
        self._state = "open"
        if not HIREDIS_AVAILABLE:
            _log.warning("redis backend: hiredis is not installed; replies are parsed in Python")
        return recovered

    async def close(self) -> None:
        if self._state in ("closed", "opening"):
            return
        if self._state == "closing":
            assert self._closed is not None
            await self._closed.wait()
            return
        self._state = "closing"
        assert self._in_flight is not None and self._closed is not None
        await self._in_flight.idle()
        nodes, self._nodes = self._nodes, None
        if nodes is not None:
            await nodes.close()
        self._held.keys.clear()
        self._state = "closed"
        self._closed.set()

    def _check_open(self) -> RedisNodes:
        if self._state != "open" or self._nodes is None:
            raise BackendError(f"redis backend {where(self.settings)} is not open ({self._state})")
        return self._nodes

    def _operation(self) -> contextlib.AbstractContextManager[None]:
        assert self._in_flight is not None  # open
        return self._in_flight.operation()

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
            byte_view(v, self.block_bytes, "value", i, writable=False) for i, v in enumerate(values)
        ]
        if not key_list:
            return []
        with self._operation():
            return await self._puts.put(nodes, key_list, views, if_absent=if_absent)

    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        nodes = self._check_open()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if len(buffers) != len(key_list):
            raise ValueError(f"get got {len(key_list)} keys but {len(buffers)} buffers")
        views = [
            byte_view(b, self.block_bytes, "buffer", i, writable=True)
            for i, b in enumerate(buffers)
        ]
        if not key_list:
            return []
        with self._operation():
            return await self._gets.get(nodes, key_list, views)

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether Redis holds each key (one ``EXISTS`` pipeline per node; verifies nothing).

        A key whose node failed is reported absent.
        """
        self._check_open()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        present = await self.exists(key_list)
        self._held.forget_vanished(
            [k for k, p in zip(key_list, present, strict=True) if p is False]
        )
        return [p is True for p in present]

    async def exists(self, keys: Sequence[bytes]) -> list[bool | None]:
        """Whether Redis holds each key: True, False, or None where its node failed (unknown,
        not absent: a shared tier should not remember such an answer). One ``EXISTS`` pipeline
        per node; verifies nothing."""
        nodes = self._check_open()
        keys = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if not keys:
            return []
        redis_keys = self._format.redis_keys
        with self._operation():
            replies = await self._pipelines.small(nodes, "EXISTS", [redis_keys(k) for k in keys])
        return [None if r is None else r == 2 for r in replies]  # half a block is no block

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        nodes = self._check_open()
        key_list = check_keys(keys, max_bytes=MAX_KEY_BYTES)
        if not key_list:
            return []
        redis_keys = self._format.redis_keys
        with self._operation():
            names = [redis_keys(k) for k in key_list]
            replies = await self._pipelines.small(nodes, "UNLINK", names)
        self._held.discard(key_list)
        deleted = [bool(r) for r in replies]
        self.stats.deletes += sum(deleted)
        return deleted

    # -- what the servers say -------------------------------------------------------------------

    async def server_stats(self) -> RedisServerStats:
        """Memory, keys and evictions as the masters report them (``INFO``, ``DBSIZE``).

        A node that does not answer counts as 0; the last result is kept in
        ``last_server_stats``.
        """
        nodes = self._check_open()
        with self._operation():
            stats = await ask_masters(nodes)
        self._last_server_stats = stats
        return stats


def _settings(options: dict[str, Any]) -> RedisSettings:
    """The backend's keyword options as :class:`RedisSettings`; ConfigurationError naming the
    valid options if one is unknown."""
    try:
        return RedisSettings(**options)
    except TypeError as exc:
        valid = ", ".join(RedisSettings.__dataclass_fields__)
        raise ConfigurationError(f"redis backend: {exc} (options: {valid})") from None


def _check_capacity(capacity_bytes: int, block_bytes: int, footprint_bytes: int) -> None:
    """ConfigurationError unless ``capacity_bytes`` holds a block and a block fits a value."""
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise ConfigurationError(f"capacity_bytes must be an int, got {capacity_bytes!r}")
    if capacity_bytes // footprint_bytes < 1:
        raise ConfigurationError(
            f"capacity_bytes={capacity_bytes} holds no block: one block of {block_bytes} "
            f"bytes takes about {footprint_bytes} bytes of Redis memory"
        )
    if HEADER_BYTES + block_bytes > MAX_BULK_BYTES:
        raise ConfigurationError(f"blocks of {block_bytes} bytes exceed Redis's 512 MiB")
