"""Every copy strategy that runs on CPU, through the conformance suite: bit-exact on every layout.

The ``triton`` strategy runs its real kernel in Triton's interpreter on CPU tensors, so CI (no
GPU) proves the kernel's indexing; it is skipped where Triton is not installed. The CUDA runs of
the same suite are in test_transfer_cuda.py.
"""

from __future__ import annotations

import importlib.util

import pytest

from tiering.testing.copy_strategy_tests import CopyStrategyTests, HybridModel
from tiering.transfer import StrategyOptions

HAS_TRITON = importlib.util.find_spec("triton") is not None


class TestMemmove(CopyStrategyTests):
    copy_backend = "memmove"


class TestMemmoveLoadsTorchStores(CopyStrategyTests):
    """Stores by one strategy, loads by another: every byte still round-trips."""

    copy_backend = "memmove"
    store_copy_backend = "torch"


class TestTorchCopy(CopyStrategyTests):
    copy_backend = "torch"


class TestStaging(CopyStrategyTests):
    copy_backend = "staging"


class TestStagingOneRowAtATime(CopyStrategyTests):
    """A staging buffer of one row: every job goes through it in batches of one slot."""

    copy_backend = "staging"
    options = StrategyOptions(staging_bytes=1)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
class TestTritonKernelInInterpreter(CopyStrategyTests):
    copy_backend = "triton"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
class TestTritonKernelSmallChunks(CopyStrategyTests):
    """Chunks of 64 bytes: every run is cut into many chunks, and 4 programs share them."""

    copy_backend = "triton"
    options = StrategyOptions(triton_max_programs=4, triton_chunk_bytes=64)


def test_auto_picks_memmove_for_cpu_caches() -> None:
    model = HybridModel(0)
    assert model.engine.strategy.name == "memmove"
    assert model.engine.strategy.reason == "CPU KV caches"


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("word", ["i64", "i32", "i16", "i8"])
def test_the_page_kernel_compiles_for_hopper_without_a_gpu(word: str) -> None:
    """The interpreter runs what a compiler refuses (``base: Any`` passed every CPU test and
    failed on an H100's Triton): compile the real kernel to a cubin for sm_90 here."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tiering.transfer.triton_kernel import copy_chunks

    signature = {"base": f"*{word}", "table": "*i64", "num_chunks": "i64"}
    source = ASTSource(
        fn=copy_chunks,
        signature={**signature, "BLOCK": "constexpr", "ALIGN": "constexpr"},
        constexprs={"BLOCK": 1024, "ALIGN": 2},
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"]  # machine code for the H100, built by the wheel's ptxas
    assert ".entry copy_chunks" in compiled.asm["ptx"]
