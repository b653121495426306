"""The engine adapters against raw tier calls: what the facade and each adapter cost per block.

Every row writes then reads ``--blocks`` blocks in calls of ``--batch`` through one file tier
(buffered, ``durability: none``, in a fresh directory) and reports GB/s of payload and the
ratio to the raw row:

- ``raw backend``: ``FileBackend.put``/``get`` of whole slots from and into preallocated rows,
  on an event loop in this thread (no framing, no staging, no index): the floor.
- ``TierStore``: :class:`tiering.embed.TierStore` sync ``put``/``get`` of one buffer per block
  from a caller thread (framing, one staging copy each way, the tier's index and policy).
- ``SGLang page_first`` / ``SGLang layer_first``: ``TieringHiCacheStorage.batch_set_v1`` /
  ``batch_get_v1`` through SGLang 0.5.23's factory, on an MHA host pool (re-stated here, as in
  the tests: SGLang's pool_host does not import on CPU) whose pages are 2 runs (page_first) or
  2 x layers runs (layer_first).
- ``LMCache``: ``TieringConnector.batched_put``/``batched_get`` through LMCache 0.5.6's
  CreateConnector and a LocalCPUBackend (the get allocates from LMCache's CPU buffer), awaited
  on an event loop thread as LMCache's StorageManager runs it.

Gets run right after the puts (page cache warm). Each figure is the median of ``--reps`` runs,
after one unmeasured raw run.

Usage: python benchmarks/bench_engines.py [--quick] [--blocks N] [--batch N] [--reps N]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import logging
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tiering.backends.file import FileBackend
from tiering.core.block_format import make_layout_fingerprint
from tiering.embed import TierStore, framed_layout
from tiering.managers.secondary_tier import SecondaryTier

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 8, 128, 16  # bf16: 2 x 8 x 16 x 8 x 128 x 2 = 512 KiB/page
PAGE_BYTES = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2


def _hashes(n: int) -> list[str]:
    return [hashlib.sha256(str(i).encode()).hexdigest() for i in range(n)]


def _tier_spec(path: Path) -> list[dict[str, Any]]:
    return [{"name": "nvme", "type": "file", "path": str(path), "capacity": "2GiB"}]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_raw(path: Path, blocks: int, batch: int) -> tuple[float, float]:
    fp = make_layout_fingerprint({"bench": "raw"})
    backend = FileBackend(path=path, capacity_bytes=2 << 30, block_bytes=PAGE_BYTES, fingerprint=fp)
    rows = np.random.default_rng(0).integers(0, 256, (blocks, PAGE_BYTES), dtype=np.uint8)
    out = np.ones_like(rows)  # touched: its page faults are not the path's
    keys = [bytes.fromhex(h) for h in _hashes(blocks)]
    loop = asyncio.new_event_loop()
    loop.run_until_complete(backend.open())

    async def put() -> None:
        for s in range(0, blocks, batch):
            await backend.put(keys[s : s + batch], [memoryview(r) for r in rows[s : s + batch]])

    async def get() -> None:
        for s in range(0, blocks, batch):
            await backend.get(keys[s : s + batch], [memoryview(r) for r in out[s : s + batch]])

    put_s = _timed(lambda: loop.run_until_complete(put()))
    get_s = _timed(lambda: loop.run_until_complete(get()))
    assert np.array_equal(rows, out)
    loop.run_until_complete(backend.close())
    loop.close()
    return put_s, get_s


def bench_store(path: Path, blocks: int, batch: int) -> tuple[float, float]:
    description, slot = framed_layout({"bench": "store"}, PAGE_BYTES)
    fp = make_layout_fingerprint(description)
    backend = FileBackend(path=path, capacity_bytes=2 << 30, block_bytes=slot, fingerprint=fp)
    store = TierStore([SecondaryTier(backend, name="nvme")])
    store.open()
    rows = np.random.default_rng(0).integers(0, 256, (blocks, PAGE_BYTES), dtype=np.uint8)
    out = np.ones_like(rows)  # touched: its page faults are not the path's
    keys = [bytes.fromhex(h) for h in _hashes(blocks)]

    def put() -> None:
        for s in range(0, blocks, batch):
            assert all(store.put(keys[s : s + batch], list(rows[s : s + batch])))

    def get() -> None:
        for s in range(0, blocks, batch):
            store.get(keys[s : s + batch], list(out[s : s + batch]))

    put_s, get_s = _timed(put), _timed(get)
    assert np.array_equal(rows, out)
    store.close()
    return put_s, get_s


class _MHAPool:
    """SGLang 0.5.23's MHATokenToKVPoolHost buffer and get_page_buffer_meta (page_first and
    layer_first), re-stated."""

    def __init__(self, layout: str, pages: int) -> None:
        self.layout, self.page_size, self.size = layout, PAGE, pages * PAGE
        shape = (
            (2, self.size, LAYERS, HEADS, HEAD_DIM)
            if layout == "page_first"
            else (2, LAYERS, self.size, HEADS, HEAD_DIM)
        )
        self.kv_buffer = torch.randint(-1000, 1000, shape, dtype=torch.int16).view(torch.bfloat16)
        self.dtype = self.kv_buffer.dtype

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        idx, item, base = indices.tolist(), 2, self.kv_buffer.data_ptr()
        v_off = LAYERS * self.size * HEADS * HEAD_DIM * item
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for i in range(0, len(idx), PAGE):
                for layer in range(LAYERS):
                    k = (
                        base
                        + idx[i] * HEADS * HEAD_DIM * item
                        + layer * self.size * HEADS * HEAD_DIM * item
                    )
                    ptrs += [k, k + v_off]
            return ptrs, [item * PAGE * HEADS * HEAD_DIM] * len(ptrs)
        for i in range(0, len(idx), PAGE):
            k = base + idx[i] * LAYERS * HEADS * HEAD_DIM * item
            ptrs += [k, k + v_off]
        return ptrs, [LAYERS * item * PAGE * HEADS * HEAD_DIM] * len(ptrs)


def bench_sglang(path: Path, blocks: int, batch: int, layout: str) -> tuple[float, float]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {
        "backend_name": "tiering",
        "module_path": "tiering.integrations.sglang",
        "class_name": "TieringHiCacheStorage",
        "interface_v1": 1,
        "tiers": _tier_spec(path),
    }
    config = HiCacheStorageConfig(
        0, 1, 0, 1, 0, 1, False, False, layout == "page_first", "bench", extra_config=extra
    )
    backend = StorageBackendFactory.create_backend("dynamic", config, None)
    pool = _MHAPool(layout, 2 * blocks)
    backend.register_mem_pool_host(pool)
    backend.on_host_pools_registered()
    keys = _hashes(blocks)

    def indices(first_page: int, n: int) -> torch.Tensor:
        return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)

    def put() -> None:
        for s in range(0, blocks, batch):
            assert all(
                backend.batch_set_v1(keys[s : s + batch], indices(s, len(keys[s : s + batch])))
            )

    def get() -> None:  # into the second half of the pool
        for s in range(0, blocks, batch):
            assert all(
                backend.batch_get_v1(
                    keys[s : s + batch], indices(blocks + s, len(keys[s : s + batch]))
                )
            )

    put_s, get_s = _timed(put), _timed(get)
    if layout == "page_first":
        half = blocks * PAGE
        assert torch.equal(
            pool.kv_buffer[:, :half].view(torch.int16), pool.kv_buffer[:, half:].view(torch.int16)
        )
    backend.close()
    return put_s, get_s


def bench_lmcache(path: Path, blocks: int, batch: int) -> tuple[float, float]:
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.connector import CreateConnector
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    chunk = PAGE * 16  # 256 tokens: LMCache's default chunk, 8 MiB with this geometry / 16
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk,
        local_cpu=True,
        max_local_cpu_size=(2 * blocks // 16 + 4) * PAGE_BYTES * 16 / 2**30,
        remote_storage_plugins=["tiering"],
        extra_config={
            "remote_storage_plugin.tiering.module_path": "tiering.integrations.lmcache",
            "remote_storage_plugin.tiering.class_name": "TieringConnector",
            "remote_storage_plugin.tiering.tiers": _tier_spec(path),
        },
    )
    metadata = LMCacheMetadata(
        model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, chunk, HEADS, HEAD_DIM), chunk_size=chunk,
    )  # fmt: skip
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
    connector = CreateConnector(
        "plugin://tiering", loop, cpu, config, metadata, plugin_name="tiering"
    )
    inner = connector._connector
    chunks = max(1, blocks // 16)  # as many bytes as the other rows
    keys = [CacheEngineKey("bench", 1, 0, i, torch.bfloat16, None) for i in range(chunks)]
    per_call = max(1, batch // 16)

    def run(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(600)

    # The chunks to store, allocated and filled before the clock starts (as the GPU copy would).
    objs = [cpu.allocate(inner.meta_shapes, inner.meta_dtypes, inner.meta_fmt) for _ in keys]
    for i, obj in enumerate(objs):
        np.frombuffer(obj.byte_array, dtype=np.uint8)[:] = i % 251

    def put() -> None:
        for s in range(0, chunks, per_call):
            run(connector.batched_put(keys[s : s + per_call], objs[s : s + per_call]))

    def get() -> None:
        for s in range(0, chunks, per_call):
            objs = run(connector.batched_get(keys[s : s + per_call]))
            assert all(o is not None for o in objs)
            for obj in objs:
                obj.ref_count_down()

    put_s, get_s = _timed(put), _timed(get)
    run(connector.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    return put_s * blocks / (chunks * 16), get_s * blocks / (chunks * 16)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 blocks, 1 rep")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.blocks, args.reps = 64, 1
    logging.disable(logging.WARNING)  # LMCache logs every connector it builds
    # LMCache's metrics logger would otherwise pick /tmp/lmcache_prometheus for its files.
    prometheus = tempfile.TemporaryDirectory(prefix="bench-engines-prometheus-")
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", prometheus.name)
    torch.set_num_threads(1)
    gc.freeze()
    rows: list[tuple[str, Callable[[Path], tuple[float, float]]]] = [
        ("raw backend", lambda p: bench_raw(p, args.blocks, args.batch)),
        ("TierStore", lambda p: bench_store(p, args.blocks, args.batch)),
        ("SGLang page_first", lambda p: bench_sglang(p, args.blocks, args.batch, "page_first")),
        ("SGLang layer_first", lambda p: bench_sglang(p, args.blocks, args.batch, "layer_first")),
        ("LMCache", lambda p: bench_lmcache(p, args.blocks, args.batch)),
    ]
    gib = args.blocks * PAGE_BYTES / 2**30
    print(
        f"{args.blocks} blocks of {PAGE_BYTES // 1024} KiB, {args.batch} per call, file tier "
        f"(buffered), median of {args.reps}; GB/s of payload, ratio to the raw backend.\n"
    )
    print("| path | put GB/s | put ratio | get GB/s | get ratio |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
        rows[0][1](Path(tmp) / "warmup")  # first-use costs (imports, page faults) not in row 1
    raw: tuple[float, float] | None = None
    for name, fn in rows:
        puts, gets = [], []
        for _ in range(args.reps):
            with tempfile.TemporaryDirectory(prefix="bench-engines-") as tmp:
                put_s, get_s = fn(Path(tmp) / "tier")
            puts.append(put_s)
            gets.append(get_s)
        put_s, get_s = statistics.median(puts), statistics.median(gets)
        if raw is None:
            raw = (put_s, get_s)
        put_rate, get_rate = gib * 1.073741824 / put_s, gib * 1.073741824 / get_s
        print(
            f"| {name} | {put_rate:.2f} | {raw[0] / put_s:.2f} | {get_rate:.2f} | "
            f"{raw[1] / get_s:.2f} |"
        )


if __name__ == "__main__":
    main()
