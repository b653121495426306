"""tiering as an LMCache 0.5.6 remote storage plugin, built by LMCache's own CreateConnector
(its dynamic plugin adapter) over a real LocalCPUBackend, on an event loop of its own thread as
LMCache's StorageManager runs it. Chunks, partial ones included, are compared byte for byte,
through a restart.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import CreateConnector
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from tiering.integrations.lmcache import TieringConnector

T = TypeVar("T")
CHUNK = 16
SHAPE = (2, 2, CHUNK, 2, 8)  # layers, K/V, tokens, heads, head dim


class Loop:
    """An event loop on a thread (LMCache's storage-manager loop)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(autouse=True)
def _prometheus_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache's metrics logger sets PROMETHEUS_MULTIPROC_DIR (to /tmp/lmcache_prometheus) when
    it is unset: give it the test's directory, and unset it again afterwards, so that later
    tests (tiering's own exporter) see the environment as it was."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "prometheus"))
    (tmp_path / "prometheus").mkdir()


@pytest.fixture
def loop() -> Iterator[Loop]:
    lp = Loop()
    yield lp
    lp.stop()


def _config(path: Path, **extra: Any) -> LMCacheEngineConfig:
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK,
        local_cpu=True,
        max_local_cpu_size=0.02,
        save_unfull_chunk=True,
        remote_storage_plugins=["tiering"],
        extra_config={
            "remote_storage_plugin.tiering.module_path": "tiering.integrations.lmcache",
            "remote_storage_plugin.tiering.class_name": "TieringConnector",
            "remote_storage_plugin.tiering.tiers": [
                {"name": "nvme", "type": "file", "path": str(path), "capacity": "2MiB"}
            ],
            **extra,
        },
    )


def _metadata(worker_id: int = 0) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name="test/model",
        world_size=2,
        local_world_size=2,
        worker_id=worker_id,
        local_worker_id=worker_id,
        kv_dtype=torch.bfloat16,
        kv_shape=SHAPE,
        chunk_size=CHUNK,
    )


def _connector(
    loop: Loop, config: LMCacheEngineConfig, metadata: LMCacheMetadata
) -> tuple[Any, LocalCPUBackend]:
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    connector = CreateConnector(
        "plugin://tiering", loop.loop, cpu, config, metadata, plugin_name="tiering"
    )
    return connector, cpu


def _key(h: int, worker_id: int = 0) -> CacheEngineKey:
    return CacheEngineKey("test/model", 2, worker_id, h, torch.bfloat16, None)


def _chunk(cpu: LocalCPUBackend, connector: Any, tokens: int, seed: int) -> tuple[Any, bytes]:
    inner = connector._connector
    shapes = [torch.Size([s[0], s[1], tokens, s[3]]) for s in inner.meta_shapes]
    obj = cpu.allocate(shapes, inner.meta_dtypes, inner.meta_fmt)
    assert obj is not None
    gen = torch.Generator().manual_seed(seed)
    view = np.frombuffer(obj.byte_array, dtype=np.uint8)  # byte_array's format is "<B"
    view[:] = torch.randint(0, 256, (len(view),), generator=gen, dtype=torch.uint8).numpy()
    return obj, view.tobytes()


def test_chunks_full_and_partial_round_trip_and_survive_a_restart(
    tmp_path: Path, loop: Loop
) -> None:
    config, metadata = _config(tmp_path), _metadata()
    connector, cpu = _connector(loop, config, metadata)
    assert isinstance(connector._connector, TieringConnector)
    full, full_bytes = _chunk(cpu, connector, CHUNK, 1)
    part, part_bytes = _chunk(cpu, connector, 5, 2)  # a prompt's last, partial chunk
    keys = [_key(0x1234), _key(-77)]
    loop.run(connector.batched_put(keys, [full, part]))
    assert full.get_ref_count() == 0 and part.get_ref_count() == 0  # LMCache dropped them
    assert loop.run(connector.exists(keys[0]))
    assert connector._connector.exists_sync(keys[1])
    assert loop.run(connector.batched_async_contains("l", [keys[0], keys[1], _key(9)])) == 2
    assert loop.run(connector.batched_async_contains("l", [_key(9), keys[0]])) == 0
    got = loop.run(connector.batched_get(keys + [_key(9)]))
    assert got[2] is None
    assert bytes(got[0].byte_array) == full_bytes
    assert bytes(got[1].byte_array) == part_bytes
    assert got[1].meta.shape[2] == 5  # reshaped to its 5 tokens
    assert sorted(loop.run(connector.list())) == sorted(k.to_string() for k in keys)
    for obj in got[:2]:
        obj.ref_count_down()
    loop.run(connector.close())

    # A new process: a new CPU backend and connector over the same directory.
    connector2, _ = _connector(loop, _config(tmp_path), _metadata())
    assert loop.run(connector2.batched_async_contains("l", keys)) == 2
    again = loop.run(connector2.get(keys[1]))
    assert again is not None and bytes(again.byte_array) == part_bytes
    assert sorted(loop.run(connector2.list())) == sorted(k.to_string() for k in keys)
    loop.run(connector2.close())


def test_another_worker_never_reads_a_chunk(tmp_path: Path, loop: Loop) -> None:
    connector, cpu = _connector(loop, _config(tmp_path), _metadata(0))
    obj, _ = _chunk(cpu, connector, CHUNK, 3)
    loop.run(connector.put(_key(5), obj))
    loop.run(connector.close())
    other, _ = _connector(loop, _config(tmp_path), _metadata(1))
    assert not loop.run(other.exists(_key(5, worker_id=1)))
    assert loop.run(other.get(_key(5, worker_id=1))) is None
    loop.run(other.close())


def test_through_lmcache_remote_backend(tmp_path: Path, loop: Loop) -> None:
    """LMCache's RemoteBackend (what StorageManager builds per plugin) drives the connector:
    fire-and-forget puts, blocking gets, contains."""
    config, metadata = _config(tmp_path), _metadata()
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    remote = RemoteBackend(config, metadata, loop.loop, cpu, "cpu", plugin_name="tiering")
    inner = remote.connection._connector
    assert isinstance(inner, TieringConnector)
    obj = cpu.allocate(inner.meta_shapes, inner.meta_dtypes, inner.meta_fmt)
    assert obj is not None
    view = np.frombuffer(obj.byte_array, dtype=np.uint8)
    view[:] = np.arange(len(view)) % 251
    expected = bytes(obj.byte_array)
    future = remote.submit_put_task(_key(42), obj)
    future.result(30)
    assert remote.contains(_key(42))
    got = remote.get_blocking(_key(42))
    assert got is not None and bytes(got.byte_array) == expected
    assert remote.get_blocking(_key(43)) is None
    remote.close()


def test_unknown_plugin_keys_are_named(tmp_path: Path, loop: Loop) -> None:
    config = _config(tmp_path, **{"remote_storage_plugin.tiering.bogus": 1})
    cpu = LocalCPUBackend(config, _metadata(), dst_device="cpu")
    with pytest.raises(Exception, match="bogus"):
        TieringConnector(loop=loop.loop, local_cpu_backend=cpu, config=config)
