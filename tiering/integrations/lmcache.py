"""tiering as an LMCache 0.5.6 remote storage plugin (``docs/lmcache.md``).

LMCache loads it by module path from its config::

    local_cpu: true
    max_local_cpu_size: 5                # GB: LMCache's CPU buffer, which a connector reads into
    remote_storage_plugins: ["tiering"]
    extra_config:
      remote_storage_plugin.tiering.module_path: tiering.integrations.lmcache
      remote_storage_plugin.tiering.class_name: TieringConnector
      remote_storage_plugin.tiering.tiers:
        - {name: nvme, type: file, path: /mnt/lmcache, capacity: 200GiB}

``TieringConnector`` is a ``RemoteConnector``: LMCache wraps it in its ``DynamicConnectorAdapter``
and a ``RemoteBackend`` and calls its coroutines on its storage-manager event loop. Each call
runs its tier I/O on tiering's own loop (:class:`~tiering.embed.TierStore`) and only awaits it
there, so LMCache's loop is never blocked; ``exists_sync`` and ``batched_contains`` wait on the
caller's thread, bounded by ``timeout_s``.

A chunk is one framed block of up to ``full_chunk_size_bytes``: a partial last chunk
(``save_unfull_chunk``, blending, PD) is stored with its true length and read back reshaped to
its token count. The tiers' layout fingerprint covers the model, world size, worker, chunk size,
KV shapes, dtypes and format, so a chunk of another layout is never a hit. Keys are the chunk
hash (32 bytes), 8 bytes naming the key's identity (model, world size, worker, dtype, tags), and 8
of the fingerprint. ``list()`` names the keys the tiers hold whose identity this process knows
(its own metadata's, and any key seen since it started).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from tiering.embed import TierStore
from tiering.errors import ConfigError, TieringError
from tiering.integrations.engine_config import scoped_tier_configs, tier_configs_from_extra

__all__ = ["TieringConnector", "chunk_layout"]

logger = logging.getLogger(__name__)

_HASH_BYTES = 32
_PLUGIN_TYPE = "tiering"


def chunk_layout(connector: RemoteConnector, metadata: Any) -> dict[str, object]:
    """What a stored chunk means: the tiers' layout description."""
    return {
        "engine": "lmcache",
        "model": str(metadata.model_name),
        "world_size": int(metadata.world_size),
        "worker_id": int(metadata.worker_id),
        "chunk_size": int(metadata.chunk_size),
        "use_mla": bool(metadata.use_mla),
        "shapes": [list(s) for s in connector.meta_shapes],
        "dtypes": [str(d) for d in connector.meta_dtypes],
        "fmt": str(connector.meta_fmt),
        "full_chunk_bytes": int(connector.full_chunk_size_bytes),
    }


def _identity(key: CacheEngineKey) -> str:
    """The key without its chunk hash."""
    return f"{key.model_name}@{key.world_size}@{key.worker_id}@{key.dtype}@{key.tags!r}"


class TieringConnector(RemoteConnector):
    """LMCache ``RemoteConnector`` over tiering's tiers; built by LMCache's dynamic connector
    adapter as ``cls(loop=, local_cpu_backend=, config=)``."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any, config: Any
    ) -> None:
        super().__init__(local_cpu_backend.config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        metadata = local_cpu_backend.metadata
        extra = dict(getattr(config, "extra_config", None) or {})
        names = [str(n) for n in getattr(config, "remote_storage_plugins", None) or []]
        name = next((n for n in names if n.split(".", 1)[0] == _PLUGIN_TYPE), _PLUGIN_TYPE)
        prefix = f"remote_storage_plugin.{name}."
        own = {k[len(prefix) :]: v for k, v in extra.items() if k.startswith(prefix)}
        own.pop("module_path", None)
        own.pop("class_name", None)
        where = f"LMCache remote storage plugin {name!r} (extra_config {prefix}*)"
        timeout_s = float(own.pop("timeout_s", 30.0))
        unknown = sorted(set(own) - {"tiers", "tiering_config"})
        if unknown:
            raise ConfigError(
                f"{where}: unknown keys {[prefix + k for k in unknown]}; tiering reads "
                f"{prefix}tiers or {prefix}tiering_config, and {prefix}timeout_s"
            )
        layout = chunk_layout(self, metadata)
        scope = f"{name}-{metadata.model_name}-w{metadata.worker_id}of{metadata.world_size}"
        tiers = scoped_tier_configs(tier_configs_from_extra(own, where), scope)
        self.store = TierStore.from_tier_configs(
            tiers,
            max_block_bytes=self.full_chunk_size_bytes,
            layout=layout,
            timeout_s=timeout_s,
        )
        self.store.open()
        self._suffix = self.store.tiers[0].backend.fingerprint[:8]
        default = CacheEngineKey(
            str(metadata.model_name),
            int(metadata.world_size),
            int(metadata.worker_id),
            0,
            metadata.kv_dtype,
            None,
        )
        # identity digest -> a key of that identity, to name stored chunks in list()
        self._identities: dict[bytes, CacheEngineKey] = {self._id_digest(default): default}

    # -- keys -------------------------------------------------------------------------------------

    @staticmethod
    def _id_digest(key: CacheEngineKey) -> bytes:
        return hashlib.sha256(_identity(key).encode()).digest()[:8]

    def _key(self, key: CacheEngineKey) -> bytes:
        digest = self._id_digest(key)
        if digest not in self._identities:
            self._identities[digest] = key
        try:
            raw = key.chunk_hash.to_bytes(_HASH_BYTES, "big", signed=True)
        except OverflowError:  # a hash over 255 bits: digested (not listed)
            raw = hashlib.sha256(key.to_string().encode()).digest()
        return raw + digest + self._suffix

    def _name(self, stored: bytes) -> str | None:
        if len(stored) != _HASH_BYTES + 16 or stored[-8:] != self._suffix:
            return None
        template = self._identities.get(stored[_HASH_BYTES : _HASH_BYTES + 8])
        if template is None:
            return None
        chunk_hash = int.from_bytes(stored[:_HASH_BYTES], "big", signed=True)
        named = CacheEngineKey(
            template.model_name,
            template.world_size,
            template.worker_id,
            chunk_hash,
            template.dtype,
            template.request_configs,
        )
        return str(named.to_string()) if self._key(named) == stored else None

    # -- existence ------------------------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self.batched_async_contains("", [key]) == 1

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self.batched_contains([key]) == 1

    async def batched_async_contains(
        self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False
    ) -> int:
        """How many leading chunks are stored. ``pin`` is not supported: a chunk counted here
        may be evicted before its read (the read is then a miss, never wrong bytes)."""
        try:
            return await self.store.aexists([self._key(k) for k in keys])
        except TieringError:  # closed under the caller: nothing is found
            logger.debug("tiering connector: contains failed", exc_info=True)
            return 0

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        try:
            return self.store.exists([self._key(k) for k in keys])
        except TieringError:
            logger.debug("tiering connector: contains failed", exc_info=True)
            return 0

    # -- get ------------------------------------------------------------------------------------

    def support_batched_get(self) -> bool:
        return True

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Read each chunk into a buffer of LMCache's CPU backend (None: a miss, or no room)."""
        objs: list[MemoryObj | None] = [
            self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
            for _ in keys
        ]
        wanted = [i for i, obj in enumerate(objs) if obj is not None]
        if len(wanted) < len(keys):
            logger.debug(
                "LMCache's CPU buffer is full: %d chunk reads skipped", len(keys) - len(wanted)
            )
        lengths: Sequence[int | None] = []
        if wanted:
            try:
                lengths = await self.store.aget(
                    [self._key(keys[i]) for i in wanted],
                    [objs[i].byte_array for i in wanted],  # type: ignore[union-attr]
                )
            except BaseException:
                for i in wanted:
                    objs[i].ref_count_down()  # type: ignore[union-attr]
                raise
        out: list[MemoryObj | None] = [None] * len(keys)
        for i, length in zip(wanted, lengths, strict=True):
            obj = objs[i]
            assert obj is not None
            if length is None:
                obj.ref_count_down()
                continue
            try:
                out[i] = self.reshape_partial_chunk(obj, length)
            except ValueError:  # not a whole number of tokens: not a chunk of this layout
                logger.warning("chunk %s: %d bytes is not a chunk; a miss", keys[i], length)
                obj.ref_count_down()
        return out

    # -- put ------------------------------------------------------------------------------------

    def support_batched_put(self) -> bool:
        return True

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await self.batched_put([key], [memory_obj])

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        """Store each chunk (a partial one with its length). The caller (LMCache's
        instrumented connector) drops the objects' references afterwards; raises if a chunk
        was not stored, which LMCache counts as a failed put."""
        stored = await self.store.aput(
            [self._key(k) for k in keys], [obj.byte_array for obj in memory_objs]
        )
        failed = [k for k, ok in zip(keys, stored, strict=True) if not ok]
        if failed:
            raise TieringError(
                f"{len(failed)} of {len(keys)} chunks were not stored (tiers full or failing)"
            )

    # -- the rest ---------------------------------------------------------------------------------

    async def list(self) -> list[str]:
        """The stored chunks' key strings (see the module docstring for which are named)."""
        names = (self._name(k) for k in self.store.keys())
        return [n for n in names if n is not None]

    async def close(self) -> None:
        await asyncio.to_thread(self.store.close)

    def get_stats(self) -> dict[str, Any]:
        return {"store": vars(self.store.stats).copy(), "tiers": self.store.tier_stats()}

    def __repr__(self) -> str:
        return f"<TieringConnector tiers={[t.name for t in self.store.tiers]}>"
