"""tiering as SGLang 0.5.23's HiCache L3 storage, loaded by SGLang's own StorageBackendFactory.

The host pools are re-stated in ``sglang_pools`` (SGLang's pool_host package needs torchvision,
absent on a CPU machine); everything else is SGLang's: the factory, the config, the v2 types.
Bytes are compared page by page, through a restart.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from engines.sglang_pools import MambaHostPool, MHAHostPool, MLASplitHostPool
from tiering.errors import ConfigError
from tiering.integrations.sglang import TieringHiCacheStorage
from tiering.testing.redis_servers import RedisServer

pytest_plugins = ["redis_fixtures"]  # the real-server fixtures (tests/redis_fixtures.py)

PAGE = 4


def _config(
    path: Path, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False, **extra: Any
) -> HiCacheStorageConfig:
    extra_config = {
        "backend_name": "tiering",
        "module_path": "tiering.integrations.sglang",
        "class_name": "TieringHiCacheStorage",
        "interface_v1": 1,
        "tiers": [{"name": "nvme", "type": "file", "path": str(path), "capacity": "4MiB"}],
        **extra,
    }
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="test/model",
        extra_config=extra_config,
    )


def _backend(config: HiCacheStorageConfig, pools: dict[str, Any]) -> TieringHiCacheStorage:
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    assert isinstance(backend, TieringHiCacheStorage)
    for name, pool in pools.items():
        if name == "kv":
            backend.register_mem_pool_host(pool)
        else:
            backend.register_mem_host_pool_v2(pool, PoolName(name))
    backend.on_host_pools_registered()
    return backend


def _fill(pool: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name in (
        "kv_buffer",
        "k_buffer",
        "v_buffer",
        "index_k_buffer",
        "index_k_scale_buffer",
        "buffer",
    ):
        t = getattr(pool, name, None)
        if t is not None:
            t.view(torch.uint8).copy_(
                torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen, dtype=torch.uint8)
            )


def _zero(pool: Any) -> None:
    for name in (
        "kv_buffer",
        "k_buffer",
        "v_buffer",
        "index_k_buffer",
        "index_k_scale_buffer",
        "buffer",
    ):
        t = getattr(pool, name, None)
        if t is not None:
            t.zero_()


def _indices(pages: list[int], page_size: int = PAGE) -> torch.Tensor:
    return torch.tensor(
        [p * page_size + t for p in pages for t in range(page_size)], dtype=torch.int64
    )


def _hashes(n: int, salt: str = "") -> list[str]:
    import hashlib

    return [hashlib.sha256(f"{salt}{i}".encode()).hexdigest() for i in range(n)]


POOLS: dict[str, Callable[[], MHAHostPool | MLASplitHostPool]] = {
    "page_first": lambda: MHAHostPool("page_first", page_size=PAGE),
    "page_first_direct": lambda: MHAHostPool("page_first_direct", page_size=PAGE),
    "page_head": lambda: MHAHostPool("page_head", page_size=PAGE),
    "layer_first": lambda: MHAHostPool("layer_first", page_size=PAGE),
    "page_first_kv_split": lambda: MLASplitHostPool(page_size=PAGE),
}


@pytest.mark.parametrize("layout", sorted(POOLS))
def test_pages_round_trip_in_place_and_through_a_restart(tmp_path: Path, layout: str) -> None:
    mla = layout == "page_first_kv_split"
    config = _config(tmp_path / "l3", mla=mla)
    pool = POOLS[layout]()
    _fill(pool, 1)
    written = [page * PAGE for page in (0, 2, 5)]
    expected = [pool.page_bytes(i) for i in written]
    keys = _hashes(3)
    backend = _backend(config, {"kv": pool})
    assert backend.batch_set_v1(keys, _indices([0, 2, 5])) == [True, True, True]
    assert backend.batch_exists(keys) == 3
    assert backend.batch_exists([keys[0], keys[1], _hashes(1, "x")[0], keys[2]]) == 2
    _zero(pool)
    assert backend.batch_get_v1(keys, _indices([7, 8, 9])) == [True, True, True]
    assert [pool.page_bytes(p * PAGE) for p in (7, 8, 9)] == expected
    backend.close()

    # A new process: a fresh pool, the same directory.
    pool2 = POOLS[layout]()
    backend2 = _backend(config, {"kv": pool2})
    assert backend2.batch_exists(keys) == 3
    assert backend2.batch_get_v1(keys[::-1], _indices([1, 3, 4])) == [True, True, True]
    assert [pool2.page_bytes(p * PAGE) for p in (4, 3, 1)] == expected
    # A page never stored is a miss and leaves its slot as it was.
    before = pool2.page_bytes(10 * PAGE)
    assert backend2.batch_get_v1(_hashes(1, "absent"), _indices([10])) == [False]
    assert pool2.page_bytes(10 * PAGE) == before
    stats = backend2.get_stats()
    assert stats["kv"]["store"]["get_hits"] == 3
    backend2.close()


def test_another_rank_or_layout_never_reads_a_page(tmp_path: Path) -> None:
    pool = MHAHostPool("page_first", page_size=PAGE)
    _fill(pool, 2)
    keys = _hashes(2)
    rank0 = _backend(_config(tmp_path, tp_rank=0, tp_size=2), {"kv": pool})
    assert rank0.batch_set_v1(keys, _indices([0, 1])) == [True, True]
    rank0.close()
    other = MHAHostPool("page_first", page_size=PAGE)
    rank1 = _backend(_config(tmp_path, tp_rank=1, tp_size=2), {"kv": other})
    assert rank1.batch_exists(keys) == 0
    assert rank1.batch_get_v1(keys, _indices([0, 1])) == [False, False]
    rank1.close()
    # The same rank with another host layout: its directory is refused (a clean miss).
    direct = MHAHostPool("page_first_direct", page_size=PAGE)
    again = _backend(_config(tmp_path, tp_rank=0, tp_size=2), {"kv": direct})
    assert again.batch_exists(keys) == 0
    assert again.batch_get_v1(keys, _indices([0, 1])) == [False, False]
    assert not direct.kv_buffer.any()
    again.close()


def test_v0_flat_pages(tmp_path: Path) -> None:
    pool = MHAHostPool("page_first", page_size=PAGE)
    backend = _backend(_config(tmp_path), {"kv": pool})
    page = torch.randn(pool.get_dummy_flat_data_page().numel()).to(torch.bfloat16)
    [key] = _hashes(1)
    assert backend.set(key, page) is True
    assert backend.exists(key)
    got = backend.get(key)
    assert got is not None and torch.equal(got.view(torch.int16), page.view(torch.int16))
    got_both = backend.batch_get([key, _hashes(1, "no")[0]])
    assert isinstance(got_both, list) and got_both[1] is None
    backend.close()


def test_mla_followers_do_not_write(tmp_path: Path) -> None:
    pool = MLASplitHostPool(page_size=PAGE)
    _fill(pool, 3)
    follower = _backend(_config(tmp_path, tp_rank=1, tp_size=2, mla=True), {"kv": pool})
    keys = _hashes(2)
    assert follower.batch_set_v1(keys, _indices([0, 1])) == [True, True]
    assert follower.batch_exists(keys) == 0
    follower.close()


def test_v2_hybrid_pools_and_hit_policies(tmp_path: Path) -> None:
    kv, mamba = MHAHostPool("page_first", page_size=PAGE), MambaHostPool()
    _fill(kv, 4)
    _fill(mamba, 5)
    backend = _backend(_config(tmp_path), {"kv": kv, "mamba": mamba})
    keys = _hashes(4)
    # KV for 4 pages, the Mamba state only at the end of pages 2 and 4 (prefix lengths 2, 4).
    set_result = backend.batch_set_v2(
        [
            PoolTransfer(name=PoolName.KV, host_indices=_indices([0, 1, 2, 3]), keys=keys),
            PoolTransfer(
                name=PoolName.MAMBA, host_indices=torch.tensor([3, 7]), keys=[keys[1], keys[3]]
            ),
        ]
    )
    assert set_result == {"kv": [True] * 4, "mamba": [True, True]}
    result = backend.batch_exists_v2(
        keys,
        [
            PoolTransfer(
                name=PoolName.MAMBA, keys=[keys[3]], hit_policy=PoolHitPolicy.TRAILING_PAGES
            )
        ],
    )
    assert result.kv_hit_pages == 4
    assert result.restorable_prefix_pages == [2, 4]
    assert result.extra_pool_hit_pages == {"kv": 4, "mamba": 4}
    all_pages = backend.batch_exists_v2(
        keys, [PoolTransfer(name=PoolName.MAMBA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
    )
    assert all_pages.kv_hit_pages == 0  # page 1 has no state: no usable prefix
    expected = [mamba.page_bytes(3), mamba.page_bytes(7)]
    _zero(mamba)
    got = backend.batch_get_v2(
        [
            PoolTransfer(
                name=PoolName.MAMBA, host_indices=torch.tensor([0, 1]), keys=[keys[1], keys[3]]
            )
        ]
    )
    assert got == {"mamba": [True, True]}
    assert [mamba.page_bytes(0), mamba.page_bytes(1)] == expected
    backend.close()


def test_bad_extra_config_is_refused_by_name(tmp_path: Path) -> None:
    config = _config(tmp_path)
    assert config.extra_config is not None
    del config.extra_config["tiers"]
    with pytest.raises(ConfigError, match="'tiers'"):
        StorageBackendFactory.create_backend("dynamic", config, None)
    config = _config(tmp_path, bogus=1)
    with pytest.raises(ConfigError, match="bogus"):
        StorageBackendFactory.create_backend("dynamic", config, None)


def test_calls_after_close_are_misses_not_exceptions(tmp_path: Path) -> None:
    """SGLang's controller threads may still call while a detach closes the backend."""
    pool = MHAHostPool("page_first", page_size=PAGE)
    backend = _backend(_config(tmp_path), {"kv": pool})
    keys = _hashes(2)
    assert backend.batch_set_v1(keys, _indices([0, 1])) == [True, True]
    backend.close()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys, _indices([2, 3])) == [False, False]
    assert backend.batch_set_v1(keys, _indices([2, 3])) == [False, False]
    assert backend.get(keys[0], pool.get_dummy_flat_data_page()) is None
    assert backend.set(keys[0], pool.get_dummy_flat_data_page()) is False


def test_ranks_sharing_one_redis_store_never_read_each_others_pages(
    tmp_path: Path, redis_standalone: RedisServer
) -> None:
    """One Redis holds every rank's pages under the same page hashes: kept apart (the Redis
    backend namespaces by layout fingerprint, the adapter's keys carry it too, and the header's
    fingerprint is verified on read), each rank reads back its own bytes."""
    redis_tier = [
        {"name": "redis", "type": "redis", "url": redis_standalone.url, "capacity": "64MiB"}
    ]
    keys = _hashes(2)
    pools = [MHAHostPool("page_first", page_size=PAGE) for _ in range(2)]
    _fill(pools[0], 7)
    _fill(pools[1], 8)
    ranks = [
        _backend(_config(tmp_path, tp_rank=r, tp_size=2, tiers=redis_tier), {"kv": pools[r]})
        for r in range(2)
    ]
    expected = [[p.page_bytes(i * PAGE) for i in (0, 1)] for p in pools]
    assert ranks[0].batch_set_v1(keys, _indices([0, 1])) == [True, True]
    assert ranks[1].batch_exists(keys) == 0
    assert ranks[1].batch_set_v1(keys, _indices([0, 1])) == [True, True]
    for rank, pool, want in zip(ranks, pools, expected, strict=True):
        _zero(pool)
        assert rank.batch_get_v1(keys, _indices([4, 5])) == [True, True]
        assert [pool.page_bytes(p * PAGE) for p in (4, 5)] == want
        rank.close()
