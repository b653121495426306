"""The transfer engine on CUDA caches (skipped without CUDA; CI has no GPU).

Every strategy runs the conformance suite on the GPU (hybrid groups, block_size_factor 2,
first_sub_block, null blocks, two ranks, cross-layer tensors and views, byte-sized pages).
Asynchrony is proved by order, not by timing: the caller's stream (or an engine stream) is
held by ``torch.cuda._sleep`` for seconds, so a copy queued behind it cannot have finished
when ``submit_*`` returns, and data written behind the sleep shows whether the copy waited.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tiering.testing.copy_strategy_tests import CopyStrategyTests, HybridModel, transfer
from tiering.transfer import StrategyOptions
from tiering.transfer.batched_memcpy import find_batched_memcpy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_BATCH = torch.cuda.is_available() and find_batched_memcpy().function is not None
SLEEP_CYCLES = 4_000_000_000  # about 2 s at 2 GHz: far longer than any submit
STRATEGIES = [
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="no triton")),
    pytest.param("batched_memcpy", marks=pytest.mark.skipif(not HAS_BATCH, reason="driver < 12.8")),
    "staging",
    "torch",
]
JOB = transfer([[1, 2], [3], [0, 4], [5]], [[0, 1], [2], [3, 4], [5]])


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
class TestTritonOnCUDA(CopyStrategyTests):
    copy_backend = "triton"
    device = "cuda"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
class TestTritonSmallChunksOnCUDA(CopyStrategyTests):
    copy_backend = "triton"
    device = "cuda"
    options = StrategyOptions(triton_max_programs=3, triton_chunk_bytes=256)


@pytest.mark.skipif(not HAS_BATCH, reason="the driver has no cuMemcpyBatchAsync (CUDA < 12.8)")
class TestBatchedMemcpyOnCUDA(CopyStrategyTests):
    copy_backend = "batched_memcpy"
    device = "cuda"


@pytest.mark.skipif(not (HAS_TRITON and HAS_BATCH), reason="needs triton and cuMemcpyBatchAsync")
class TestTritonLoadsCopyEngineStoresOnCUDA(CopyStrategyTests):
    """The split an operator chooses to keep the SMs free during stores."""

    copy_backend = "triton"
    store_copy_backend = "batched_memcpy"
    device = "cuda"


class TestStagingOnCUDA(CopyStrategyTests):
    copy_backend = "staging"
    device = "cuda"


class TestStagingOneRowOnCUDA(CopyStrategyTests):
    copy_backend = "staging"
    device = "cuda"
    options = StrategyOptions(staging_bytes=1)


class TestTorchCopyOnCUDA(CopyStrategyTests):
    copy_backend = "torch"
    device = "cuda"


def test_auto_picks_a_gpu_strategy_and_says_why() -> None:
    model = HybridModel(0, device="cuda")
    assert model.pool.is_pinned
    expected = "triton" if HAS_TRITON else ("batched_memcpy" if HAS_BATCH else "staging")
    assert model.engine.strategy.name == expected, model.engine.strategy.reason
    assert model.engine.store_strategy == model.engine.strategy


def page_of(model: HybridModel, tensor_idx: int, block: int) -> torch.Tensor:
    return model.caches.tensors[tensor_idx].tensor[block]


@pytest.mark.parametrize("copy_backend", STRATEGIES)
def test_submit_returns_before_the_copy_and_a_store_waits_for_the_callers_stream(
    copy_backend: str,
) -> None:
    model = HybridModel(1, device="cuda", copy_backend=copy_backend)  # type: ignore[arg-type]
    torch.cuda.synchronize()  # test setup only: the engine never synchronizes
    torch.cuda._sleep(SLEEP_CYCLES)
    page_of(model, 0, 1).fill_(0x11)  # the "compute" writes block 1 behind the sleep
    handle = model.engine.submit_store(JOB)
    assert not handle.done
    assert model.engine.poll() == []  # queued behind seconds of sleep: cannot have finished
    model.engine.wait(handle)
    assert handle.ok
    assert bool((model.pool.block_view(0)[:512] == 0x11).all())  # read after the write


@pytest.mark.parametrize("copy_backend", STRATEGIES)
def test_a_load_waits_for_the_callers_stream_before_writing(copy_backend: str) -> None:
    model = HybridModel(2, device="cuda", copy_backend=copy_backend)  # type: ignore[arg-type]
    model.store(JOB)
    stored = model.pool.block_view(0)[:512].clone()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    page_of(model, 0, 1).fill_(0x22)  # still in use by "compute" queued before the load
    handle = model.engine.submit_load(JOB)
    assert not handle.done and model.engine.poll() == []
    model.engine.wait(handle)
    assert torch.equal(page_of(model, 0, 1).cpu(), stored)  # the load landed last


@pytest.mark.parametrize("copy_backend", STRATEGIES)
def test_make_stream_wait_orders_compute_after_a_load_without_a_host_wait(
    copy_backend: str,
) -> None:
    model = HybridModel(3, device="cuda", copy_backend=copy_backend)  # type: ignore[arg-type]
    model.store(JOB)
    stored = model.pool.block_view(0)[:512].clone()
    page_of(model, 0, 1).zero_()
    torch.cuda.synchronize()
    load_stream = model.engine._lanes["load"]._stream  # white box: delay the load itself
    assert load_stream is not None
    with torch.cuda.stream(load_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    handle = model.engine.submit_load(JOB)
    handle.make_stream_wait()  # the current stream waits on the device; the host goes on
    seen = page_of(model, 0, 1).clone()  # "compute" reading the loaded block
    assert not handle.done
    model.engine.wait(handle)
    assert torch.equal(seen.cpu(), stored)


@pytest.mark.parametrize("copy_backend", STRATEGIES)
def test_loads_do_not_queue_behind_stores_on_the_gpu(copy_backend: str) -> None:
    model = HybridModel(4, device="cuda", copy_backend=copy_backend)  # type: ignore[arg-type]
    model.store(JOB)
    # Warm the load path too: a strategy's first load in a process (lazy CUDA module loading)
    # can outlast the sleep below; run alone, [staging] failed that way on an H100.
    model.load(JOB)
    torch.cuda.synchronize()
    store_stream = model.engine._lanes["store"]._stream
    assert store_stream is not None
    with torch.cuda.stream(store_stream):
        torch.cuda._sleep(SLEEP_CYCLES)
    store = model.engine.submit_store(transfer([[6], [], [], []], [[7], [], [], []]))
    load = model.engine.submit_load(JOB)
    model.engine.wait(load)
    assert load.ok and model.engine.poll() == []  # the store is still behind its sleep
    model.engine.wait(store)
    assert store.ok
