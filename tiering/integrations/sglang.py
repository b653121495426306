"""tiering as SGLang's HiCache L3 storage (SGLang 0.5.23, ``docs/sglang.md``).

SGLang loads it with its own ``dynamic`` factory::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tiering",
        "module_path": "tiering.integrations.sglang", "class_name": "TieringHiCacheStorage",
        "interface_v1": 1, "tiers": [{"name": "nvme", "type": "file", "path": "/mnt/kv",
        "capacity": "200GiB"}]}'

Each host pool SGLang registers (the KV pool, and a hybrid model's Mamba/SWA/... pools through
the v2 API) gets its own :class:`~tiering.embed.TierStore`, opened once the pools are known
(``on_host_pools_registered``): its blocks are one page of that pool, the concatenation of the
page's memory runs as the pool's ``get_page_buffer_meta`` gives them. So every host layout is
read and written in place, through runs: ``page_first`` / ``page_first_direct`` / ``page_head``
(K and V, 2 runs), ``layer_first`` (2 per layer; 1 per layer for MLA), MLA ``page_first_kv_split``
(2 to 4 runs of different sizes).

Keys are SGLang's page hashes (64 hex chars, 32 bytes) followed by 8 bytes of the pool's layout
fingerprint, which covers the model, the TP/PP/attention-CP/DCP ranks (TP left out for MLA, whose
KV is replicated), the pool, its host layout, dtype and run sizes: a block of another rank or
layout is never a hit, and blocks that a shared store (Redis) holds for several ranks do not
collide. Directory tiers get one subdirectory per rank and pool.

Calls come from SGLang's controller threads, concurrently; the stores are thread-safe and run
their I/O on tiering's own loop, each call bounded by ``timeout_s`` (extra-config key, default
30 s).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from tiering.embed import Run, TierStore
from tiering.errors import ConfigError, TieringError
from tiering.integrations.engine_config import scoped_tier_configs, tier_configs_from_extra

__all__ = ["TieringHiCacheStorage", "page_runs", "pool_layout"]

logger = logging.getLogger(__name__)

_KV = str(PoolName.KV)
_PLUGIN_KEYS = ("backend_name", "module_path", "class_name", "interface_v1")


def page_runs(pool: Any, host_indices: torch.Tensor, pages: int) -> list[list[Run]]:
    """Each page's memory runs ``(address, bytes)`` in ``pool`` at ``host_indices`` (token slots,
    ``pool.page_size`` per page), from the pool's own ``get_page_buffer_meta``."""
    if pages == 0:
        return []
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    if len(ptrs) != len(sizes) or len(ptrs) % pages:
        raise ValueError(f"the host pool gave {len(ptrs)} runs for {pages} pages")
    per_page = len(ptrs) // pages
    return [
        [(int(ptrs[p * per_page + r]), int(sizes[p * per_page + r])) for r in range(per_page)]
        for p in range(pages)
    ]


def pool_layout(config: HiCacheStorageConfig, pool: Any, name: str) -> dict[str, object]:
    """What one page of ``pool`` means on this rank: the tiers' layout description."""
    page_size = int(pool.page_size)
    one_page = torch.arange(page_size, dtype=torch.int64)
    _, sizes = pool.get_page_buffer_meta(one_page)
    ranks: dict[str, object] = {
        "pp": [config.pp_rank, config.pp_size],
        "attn_cp": [config.attn_cp_rank, config.attn_cp_size],
        "dcp": [config.dcp_rank, config.dcp_size],
    }
    if not config.is_mla_model:  # MLA's KV is replicated across TP ranks: one copy serves all
        ranks["tp"] = [config.tp_rank, config.tp_size]
    return {
        "engine": "sglang",
        "model": config.model_name or "",
        "pool": name,
        "pool_class": type(pool).__name__,
        "host_layout": str(getattr(pool, "layout", "")),
        "dtype": str(getattr(pool, "dtype", "")),
        "page_size": page_size,
        "run_bytes": [int(s) for s in sizes],
        "is_mla": bool(config.is_mla_model),
        "ranks": ranks,
    }


def _rank_scope(config: HiCacheStorageConfig, name: str) -> str:
    parts = [name, f"pp{config.pp_rank}of{config.pp_size}"]
    if not config.is_mla_model:
        parts.append(f"tp{config.tp_rank}of{config.tp_size}")
    if config.attn_cp_size > 1:
        parts.append(f"cp{config.attn_cp_rank}of{config.attn_cp_size}")
    if config.dcp_size > 1:
        parts.append(f"dcp{config.dcp_rank}of{config.dcp_size}")
    return "-".join(parts)


class _PoolStore:
    """One host pool and the store of its pages."""

    def __init__(self, name: str, pool: Any, store: TierStore, suffix: bytes) -> None:
        self.name = name
        self.pool = pool
        self.store = store
        self.suffix = suffix
        self.page_bytes = store.max_block_bytes
        self.page_size = int(pool.page_size)

    def key(self, page_hash: str) -> bytes:
        try:
            raw = bytes.fromhex(page_hash) if len(page_hash) == 64 else b""
        except ValueError:
            raw = b""
        if not raw:  # not SGLang's hex SHA-256: digest it (same key for the same string)
            raw = hashlib.sha256(page_hash.encode()).digest()
        return raw + self.suffix

    def keys(self, page_hashes: Sequence[str]) -> list[bytes]:
        return [self.key(h) for h in page_hashes]

    def runs(self, host_indices: torch.Tensor, pages: int) -> list[list[Run]]:
        expected = pages * self.page_size
        if host_indices is None or host_indices.numel() != expected:
            got = 0 if host_indices is None else host_indices.numel()
            raise ValueError(
                f"pool {self.name!r}: {pages} pages need {expected} indices, got {got}"
            )
        return page_runs(self.pool, host_indices, pages)

    def read(self, page_hashes: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        if not page_hashes:
            return []
        try:
            blocks = self.runs(host_indices, len(page_hashes))
            lengths = self.store.get(self.keys(page_hashes), blocks, exact=True)
        except (TieringError, ValueError):  # never an exception into SGLang's threads: misses
            logger.exception("tiering HiCache storage: reading pool %r failed", self.name)
            return [False] * len(page_hashes)
        return [n == self.page_bytes for n in lengths]

    def write(self, page_hashes: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        if not page_hashes:
            return []
        try:
            blocks = self.runs(host_indices, len(page_hashes))
            return self.store.put(self.keys(page_hashes), blocks)
        except (TieringError, ValueError):
            logger.exception("tiering HiCache storage: writing pool %r failed", self.name)
            return [False] * len(page_hashes)

    def exists(self, page_hashes: Sequence[str]) -> int:
        try:
            return self.store.exists(self.keys(page_hashes))
        except TieringError:  # closed under the caller (a detach): nothing is found
            logger.debug("tiering HiCache storage: exists on pool %r failed", self.name)
            return 0


class TieringHiCacheStorage(HiCacheStorage):
    """HiCache L3 storage over tiering's tiers; built by SGLang's ``StorageBackendFactory``
    as ``cls(storage_config, kwargs)`` (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        self.storage_config = storage_config
        extra = dict(storage_config.extra_config or {})
        where = "hicache storage 'tiering' (--hicache-storage-backend-extra-config)"
        own = {k: v for k, v in extra.items() if k not in _PLUGIN_KEYS}
        self.timeout_s = float(own.pop("timeout_s", 30.0))
        if not self.timeout_s > 0:
            raise ConfigError(f"{where}: timeout_s must be > 0, got {self.timeout_s}")
        self._tier_configs = tier_configs_from_extra(own, where)
        unknown = sorted(set(own) - {"tiers", "tiering_config"})
        if unknown:
            raise ConfigError(
                f"{where}: unknown keys {unknown}; tiering reads 'tiers' or 'tiering_config', "
                "and 'timeout_s'"
            )
        self._host_pools: dict[str, Any] = {}
        self._stores: dict[str, _PoolStore] = {}
        self._opening = threading.Lock()  # controller threads may race to open a pool
        self._closed = False

    # -- pools ----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._host_pools[_KV] = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        self._host_pools[name] = host_pool
        if self._stores and name not in self._stores:  # a sidecar registered after the burst
            self._store(name)

    def on_host_pools_registered(self) -> None:
        """Open one store per registered pool (raising fails SGLang's attach)."""
        for name in self._host_pools:
            self._store(name)

    def _open_pool(self, name: str) -> _PoolStore:
        pool = self._host_pools.get(name)
        if pool is None:
            raise ConfigError(
                f"no host pool {name!r} is registered (have {sorted(self._host_pools)})"
            )
        layout = pool_layout(self.storage_config, pool, name)
        run_bytes: list[int] = layout["run_bytes"]  # type: ignore[assignment]
        page_bytes = sum(run_bytes)
        tiers = scoped_tier_configs(self._tier_configs, _rank_scope(self.storage_config, name))
        store = TierStore.from_tier_configs(
            tiers, max_block_bytes=page_bytes, layout=layout, timeout_s=self.timeout_s
        )
        store.open()
        suffix = store.tiers[0].backend.fingerprint[:8]
        opened = _PoolStore(name, pool, store, suffix)
        self._stores[name] = opened
        logger.info(
            "tiering HiCache storage: pool %r (%s, %d-byte pages, %d runs) over tiers %s",
            name,
            layout["host_layout"],
            page_bytes,
            len(run_bytes),
            [t.name for t in store.tiers],
        )
        return opened

    def _store(self, name: str = _KV) -> _PoolStore:
        store = self._stores.get(name)
        if store is not None:
            return store
        with self._opening:  # used before on_host_pools_registered (v0 callers), or a sidecar
            store = self._stores.get(name)
            if store is None:
                if self._closed:
                    raise ConfigError("the tiering HiCache storage is closed")
                store = self._open_pool(name)
        return store

    # -- v1: zero-copy pages of the host pool ---------------------------------------------------

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading pages are stored."""
        if not keys or self._closed:
            return 0
        return self._store().exists(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if self._closed:
            return [False] * len(keys)
        return self._store().read(keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        if self._closed:
            return [False] * len(keys)
        if not self.storage_config.is_storage_writer:  # another rank writes this replica
            return [True] * len(keys)
        return self._store().write(keys, host_indices)

    # -- v0: flat page tensors ------------------------------------------------------------------

    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        if self._closed:
            return None
        kv = self._store()
        if target_location is None:
            target_location = kv.pool.get_dummy_flat_data_page()
        try:
            [length] = kv.store.get([kv.key(key)], [target_location], exact=True)
        except TieringError:
            logger.exception("tiering HiCache storage: get failed")
            return None
        return target_location if length is not None else None

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> list[torch.Tensor | None] | int:
        if self._closed:
            return [None] * len(keys)
        kv = self._store()
        if target_locations is None:
            target_locations = [kv.pool.get_dummy_flat_data_page() for _ in keys]
        try:
            lengths = kv.store.get(kv.keys(keys), list(target_locations), exact=True)
        except TieringError:
            logger.exception("tiering HiCache storage: batch_get failed")
            return [None] * len(keys)
        return [
            t if n is not None else None for t, n in zip(target_locations, lengths, strict=True)
        ]

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], None if value is None else [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if values is None or len(values) != len(keys) or self._closed:
            return False
        if not self.storage_config.is_storage_writer:
            return True
        kv = self._store()
        try:
            return all(kv.store.put(kv.keys(keys), [v.contiguous() for v in values]))
        except TieringError:
            logger.exception("tiering HiCache storage: batch_set failed")
            return False

    # -- v2: hybrid models, one store per pool --------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable KV prefix under every pool's hit policy (as SGLang's own file backend
        folds them), the pages each pool has, and the restorable prefix lengths."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {_KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            pool = self._store(name)
            present = pool.store.contains(pool.keys(keys[:kv_pages])) if kv_pages else []
            policy = transfer.hit_policy
            if policy == PoolHitPolicy.ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                allowed = set(range(1, boundary + 1))
            elif policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                allowed = {
                    n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing) : n])
                }
                boundary = max(allowed, default=0)
            elif policy == PoolHitPolicy.BLOCK_GROUPS:
                # Its own verdict, never gating the KV hit: pages of its leading complete groups.
                group = max(1, transfer.group_pages or 1)
                boundary = 0
                while boundary + group <= kv_pages and all(present[boundary : boundary + group]):
                    boundary += group
                if boundary:
                    hits[name] = boundary
                continue
            else:
                raise ValueError(f"pool {name!r}: unsupported hit policy {policy!r}")
            if boundary:
                hits[name] = boundary
            restorable = [p for p in restorable if p in allowed]
        final_pages = restorable[-1] if restorable else 0
        return PoolTransferResult(final_pages, hits, restorable)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, write=False)

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return self._batch_v2(transfers, write=True)

    def _batch_v2(self, transfers: list[PoolTransfer], *, write: bool) -> dict[str, list[bool]]:
        results: dict[str, list[bool]] = {}
        for transfer in transfers:
            name = str(transfer.name)
            keys = transfer.keys or []
            try:
                pool = self._store(name)
                if write and not self.storage_config.is_storage_writer:
                    results[name] = [True] * len(keys)
                elif write:
                    results[name] = pool.write(keys, transfer.host_indices)
                else:
                    results[name] = pool.read(keys, transfer.host_indices)
            except (TieringError, ValueError):
                logger.exception("tiering HiCache storage: pool %r transfer refused", name)
                results[name] = [False] * len(keys)
        return results

    # -- maintenance ----------------------------------------------------------------------------

    def clear(self) -> None:
        for pool in self._stores.values():
            pool.store.clear()

    def get_stats(self) -> dict[str, Any]:
        """Per pool: the store's counters and each tier's."""
        return {
            name: {"store": vars(p.store.stats).copy(), "tiers": p.store.tier_stats()}
            for name, p in self._stores.items()
        }

    def close(self) -> None:
        """Close every store (SGLang calls it on detach or a failed attach)."""
        with self._opening:
            self._closed = True
            stores, self._stores = self._stores, {}
        for pool in stores.values():
            pool.store.close()
