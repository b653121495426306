"""The ``triton`` strategy: one page-copy kernel launch per job, both directions.

The kernel reads paged KV and writes pinned pool rows directly (or the reverse): a GPU thread
reaches pinned host memory through unified virtual addressing, so each byte crosses PCIe once,
with no staging copy and no per-page driver call. One launch covers every layer, group and
block of a job: the plan's merged runs are cut into chunks of at most ``chunk_bytes``, and a
table of (engine offset, pool offset, length) per chunk goes to the device with the launch.
Measured on an H100 (issue 10), such a kernel holds 0.8-0.95 of the PCIe limit for pages of
4 KiB to 64 KiB, where the batched memcpy API falls to 0.05-0.3 below 16 KiB.

Addresses are one base pointer plus int64 offsets: the base is the canonical tensor with the
lowest address, and every engine and pool address is an offset from it (pool rows are reached
at their host address, which unified addressing makes a device address: always for torch's
pinned memory, and for a registered shared pool where the device reports
``CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``, which is checked). This is what the kernel
measured in issue 10 did with raw addresses, in a form Triton's interpreter also runs. Offsets
count words of the widest of 8, 4, 2 or 1 bytes that divides every address, page, stride and
run of the layout; the kernel is told when all of them are 16-byte aligned so that it can move
16 bytes per access. Both directions are one compiled kernel: the table says which side is the
source. The kernel is persistent: ``max_programs`` programs (default 32, a fraction
of a large GPU's SMs, so compute keeps the rest) take chunks in turn.

On CPU caches the same kernel runs in Triton's interpreter (numpy over the real addresses):
that is how CI, which has no GPU, proves its indexing bit-exact on every layout. It is a test
path, never chosen by ``"auto"``. ``triton`` is an optional import: without it this strategy
is unavailable and nothing else changes.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import math
import threading
from types import ModuleType
from typing import Any

import numpy as np
import torch

from tiering.errors import ConfigurationError
from tiering.transfer.cuda_driver import host_pointer_is_device_pointer
from tiering.transfer.plan import CopyPlan, PoolGeometry
from tiering.transfer.strategy import CopyStrategy

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "DEFAULT_MAX_PROGRAMS",
    "TritonPageCopy",
    "load_kernel",
    "triton_version",
]

DEFAULT_CHUNK_BYTES = 64 << 10
DEFAULT_MAX_PROGRAMS = 32
_BLOCK_BYTES = 8 << 10  # bytes one program moves per loop iteration
_WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_INTERPRETER_LOCK = threading.Lock()  # the interpreter patches triton.language while it runs


@functools.cache
def load_kernel() -> tuple[ModuleType | None, str | None]:
    """The kernel module, or ``None`` and why Triton cannot be imported; imported once.

    Imported on first use, not with this module: Triton is optional, and importing it costs
    ~0.4 s that commands which never copy a block (``tiering config check``) should not pay.
    """
    try:
        return importlib.import_module("tiering.transfer.triton_kernel"), None
    except ImportError as exc:
        return None, f"{type(exc).__name__}: {exc}"


def triton_version() -> str | None:
    """The installed Triton's version (without importing it), or ``None``."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


class TritonPageCopy(CopyStrategy):
    """One persistent Triton kernel per job (CUDA caches and a pinned pool; CPU: interpreter)."""

    name = "triton"

    def __init__(
        self,
        geometry: PoolGeometry,
        *,
        max_programs: int = DEFAULT_MAX_PROGRAMS,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> None:
        kernel, why_not = load_kernel()
        if kernel is None:
            raise ConfigurationError(
                f"copy_backend='triton' needs the triton package ({why_not}); CUDA builds of "
                "torch ship it, or pip install triton"
            )
        for value, what in ((max_programs, "max_programs"), (chunk_bytes, "chunk_bytes")):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{what} must be a positive int, got {value!r}")
        device = geometry.device
        if device.type == "cuda" and not geometry.pool.is_pinned:
            raise ConfigurationError(
                "copy_backend='triton' needs a pinned pool: the kernel reaches pool rows "
                "through unified addressing, which pageable memory does not have"
            )
        if device.type not in ("cuda", "cpu"):
            raise ConfigurationError(f"copy_backend='triton' needs CUDA KV caches, not {device}")
        if (
            device.type == "cuda"
            and geometry.pool.is_shared
            and not host_pointer_is_device_pointer(
                torch.cuda.current_device() if device.index is None else device.index
            )
        ):
            raise ConfigurationError(
                "copy_backend='triton' cannot reach the shared pool: this device does not use "
                "host pointers of registered memory as device pointers"
            )
        super().__init__(geometry)
        self.word_bytes = _word_bytes(geometry)
        self.max_programs = max_programs
        self._chunk_words = max(1, chunk_bytes // self.word_bytes)
        self._align = 16 // self.word_bytes if _divides(16, geometry) else 1
        self._block = min(_BLOCK_BYTES // self.word_bytes, _pow2_at_least(self._longest_words()))
        self._num_warps = 4  # Triton's default; a launch constant the GPU tuning script varies
        addresses = [geometry.tensor_address(t) for t in range(geometry.num_tensors)]
        anchor = int(np.argmin(addresses))
        self._base = _word_pointer(geometry.caches.tensors[anchor].tensor, self.word_bytes)
        base_address = addresses[anchor]
        self._engine_start = np.array(addresses, dtype=np.int64) - base_address
        self._pool_start = geometry.rows_address - base_address
        if device.type == "cuda":
            self._kernel: Any = kernel.copy_chunks
            self._lock: threading.Lock | None = None
            self._compile()
        else:
            self._kernel = kernel.interpreted_copy_chunks()
            self._lock = _INTERPRETER_LOCK

    def _longest_words(self) -> int:
        """Words of the longest run a plan can hold, capped at one chunk."""
        caches = self.geometry.caches
        longest = max(ref.page_bytes for refs in caches.group_refs for ref in refs)
        return min(
            self._chunk_words, max(1, longest * self.geometry.block_size_factor // self.word_bytes)
        )

    def _compile(self) -> None:
        """Compile the kernel now (a launch with no chunk), so that no job waits for it."""
        empty = torch.zeros(3, dtype=torch.int64, device=self.geometry.device)
        with torch.cuda.device(self.geometry.device):
            self._launch(empty, 0)

    def _launch(self, table: torch.Tensor, num_chunks: int) -> None:
        grid = (max(1, min(num_chunks, self.max_programs)),)
        launch = {} if self._lock is not None else {"num_warps": self._num_warps}
        self._kernel[grid](
            self._base, table, num_chunks, BLOCK=self._block, ALIGN=self._align, **launch
        )

    def chunk_table(self, plan: CopyPlan) -> np.ndarray:
        """``(3, num_chunks)`` int64: source and destination word offsets from the base pointer,
        and length in words."""
        runs = plan.runs
        word = self.word_bytes
        engine = (self._engine_start[runs.tensor_idx] + runs.engine_offset) // word
        pool = (self._pool_start + runs.pool_offset) // word
        src, dst = (engine, pool) if plan.to_pool else (pool, engine)
        words = runs.nbytes // word
        chunk = self._chunk_words
        if not (words > chunk).any():  # the common case: one chunk per run
            return np.stack([src, dst, words])
        per_run = -(-words // chunk)
        run = np.repeat(np.arange(len(words)), per_run)
        first_chunk = np.repeat(np.cumsum(per_run) - per_run, per_run)
        skip = (np.arange(len(run)) - first_chunk) * chunk
        table = np.empty((3, len(run)), dtype=np.int64)
        table[0] = src[run] + skip
        table[1] = dst[run] + skip
        table[2] = np.minimum(chunk, words[run] - skip)
        return table

    def copy(self, plan: CopyPlan) -> object:
        if not len(plan.runs):
            return None
        table = self.chunk_table(plan)
        host = torch.from_numpy(table)
        if self._lock is None:
            device_table = host.pin_memory().to(self.geometry.device, non_blocking=True)
            with torch.cuda.device(self.geometry.device):
                self._launch(device_table, table.shape[1])
            return device_table
        with self._lock:
            self._launch(host, table.shape[1])
        return None


def _word_bytes(geometry: PoolGeometry) -> int:
    for word in (8, 4, 2):
        if _divides(word, geometry):
            return word
    return 1


def _divides(word: int, geometry: PoolGeometry) -> bool:
    """Whether ``word`` divides every address, stride, page, offset and length of the layout."""
    values = [geometry.rows_address, geometry.row_bytes, geometry.block_bytes]
    values.append(geometry.rows.untyped_storage().data_ptr())
    for t, canonical in enumerate(geometry.caches.tensors):
        values += [geometry.tensor_address(t), canonical.tensor.untyped_storage().data_ptr()]
    values += geometry.page_bytes.tolist() + geometry.block_stride_bytes.tolist()
    values += geometry.part_offset.tolist()
    for refs in geometry.caches.group_refs:
        values += [v for ref in refs for v in (ref.page_bytes, ref.offset_bytes)]
    return all(int(v) % word == 0 for v in values)


def _word_pointer(tensor: torch.Tensor, word: int) -> torch.Tensor:
    """A one-word tensor of ``word``-byte integers at ``tensor``'s first byte (a base pointer)."""
    storage = tensor.untyped_storage()
    offset = int(tensor.data_ptr()) - int(storage.data_ptr())
    base = torch.empty(0, dtype=_WORD_DTYPES[word], device=tensor.device)
    return base.set_(storage, offset // word, (1,), (1,))


def _pow2_at_least(value: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(1, value))))
