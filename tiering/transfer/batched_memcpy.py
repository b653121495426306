"""The ``batched_memcpy`` strategy: one ``cuMemcpyBatchAsync`` per job (CUDA >= 12.8 drivers).

The driver API takes arrays of (destination, source, size) and enqueues all of them on a stream
in one call; the copy engines then move them with no kernel on the SMs. It is what vLLM 0.33's
offloading worker uses. Measured on an H100 (issue 10) it reaches 0.45-0.75 of the PCIe limit
on 32 KiB pages and falls to 0.05-0.3 on pages of 4-16 KiB, and the call itself holds the
caller for 1-47 ms on large jobs: the ``triton`` strategy is preferred where it works.

The function is looked up with ``cuGetProcAddress`` at the 12.8 ABI (whose last argument
before the stream is ``failIdx``) in ``libcuda.so.1`` (:mod:`tiering.transfer.cuda_driver`).
Stores keep stream order for their sources (the engine's compute stream writes the KV they
read); loads let the driver read the pool rows in any order, since nothing writes a row while
a load of it is in flight (the scheduler loads only blocks whose store completed).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tiering.errors import BackendError, ConfigurationError
from tiering.transfer.cuda_driver import driver_library, driver_version
from tiering.transfer.plan import CopyPlan, PoolGeometry
from tiering.transfer.strategy import CopyStrategy

__all__ = ["BatchedMemcpy", "BatchedMemcpyEntry", "find_batched_memcpy"]

_MIN_DRIVER_VERSION = 12080  # cuMemcpyBatchAsync appeared in CUDA 12.8
_SRC_ACCESS_ORDER_STREAM = 1
_SRC_ACCESS_ORDER_ANY = 3


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_BATCH_PROTOTYPE = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr *dsts
    ctypes.c_void_p,  # CUdeviceptr *srcs
    ctypes.c_void_p,  # size_t *sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p,  # CUmemcpyAttributes *attrs
    ctypes.c_void_p,  # size_t *attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.c_void_p,  # size_t *failIdx
    ctypes.c_void_p,  # CUstream
)


@dataclass(frozen=True)
class BatchedMemcpyEntry:
    """The driver's ``cuMemcpyBatchAsync`` (``function``), or ``None`` and ``reason`` why not."""

    function: Callable[..., int] | None
    reason: str


@functools.cache
def find_batched_memcpy() -> BatchedMemcpyEntry:
    """Look the driver function up once; never raises."""
    driver, why_not = driver_library()
    if driver is None:
        return BatchedMemcpyEntry(None, why_not)
    version = driver_version()
    if version is None:
        return BatchedMemcpyEntry(None, "cuDriverGetVersion failed")
    found = f"{version // 1000}.{version % 1000 // 10}"
    if version < _MIN_DRIVER_VERSION:
        return BatchedMemcpyEntry(None, f"the driver supports CUDA {found}; it needs 12.8")
    pointer = ctypes.c_void_p(0)
    status = ctypes.c_int(0)
    lookup = driver.cuGetProcAddress_v2
    lookup.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.POINTER(ctypes.c_int),
    ]
    rc = lookup(
        b"cuMemcpyBatchAsync",
        ctypes.byref(pointer),
        _MIN_DRIVER_VERSION,
        0,
        ctypes.byref(status),
    )
    if rc != 0 or not pointer.value:
        return BatchedMemcpyEntry(
            None, f"cuGetProcAddress(cuMemcpyBatchAsync) failed (CUresult {rc}, status {status})"
        )
    return BatchedMemcpyEntry(
        _BATCH_PROTOTYPE(pointer.value), f"cuMemcpyBatchAsync of the CUDA {found} driver"
    )


class BatchedMemcpy(CopyStrategy):
    """One ``cuMemcpyBatchAsync`` per job on the current stream (CUDA caches, pinned pool)."""

    name = "batched_memcpy"

    def __init__(self, geometry: PoolGeometry) -> None:
        if geometry.device.type != "cuda":
            raise ConfigurationError(
                f"copy_backend='batched_memcpy' needs CUDA KV caches, not {geometry.device}"
            )
        if not geometry.pool.is_pinned:
            raise ConfigurationError("copy_backend='batched_memcpy' needs a pinned pool")
        entry = find_batched_memcpy()
        if entry.function is None:
            raise ConfigurationError(
                f"copy_backend='batched_memcpy' is unavailable: {entry.reason}"
            )
        super().__init__(geometry)
        self._function = entry.function
        self._bases = np.array(
            [geometry.tensor_address(t) for t in range(geometry.num_tensors)], dtype=np.uint64
        )
        self._attributes = {
            to_pool: _MemcpyAttributes(
                _SRC_ACCESS_ORDER_STREAM if to_pool else _SRC_ACCESS_ORDER_ANY
            )
            for to_pool in (True, False)
        }
        self._attribute_index = ctypes.c_size_t(0)

    def copy(self, plan: CopyPlan) -> None:
        runs = plan.runs
        if not len(runs):
            return
        engine = self._bases[runs.tensor_idx] + runs.engine_offset.astype(np.uint64)
        pool = np.uint64(self.geometry.rows_address) + runs.pool_offset.astype(np.uint64)
        dst, src = (pool, engine) if plan.to_pool else (engine, pool)
        dst, src = np.ascontiguousarray(dst), np.ascontiguousarray(src)
        sizes = np.ascontiguousarray(runs.nbytes, dtype=np.uint64)
        failed = ctypes.c_size_t(0)
        stream = torch.cuda.current_stream(self.geometry.device).cuda_stream
        rc = self._function(
            dst.ctypes.data,
            src.ctypes.data,
            sizes.ctypes.data,
            len(sizes),
            ctypes.addressof(self._attributes[plan.to_pool]),
            ctypes.addressof(self._attribute_index),
            1,
            ctypes.addressof(failed),
            stream,
        )
        if rc != 0:
            raise BackendError(
                f"cuMemcpyBatchAsync failed with CUresult {rc} at copy {failed.value} of "
                f"{len(sizes)}"
            )
