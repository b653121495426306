"""Caller memory for the embedders' facade (:mod:`tiering.embed`): blocks given as buffers or as
runs of memory, gathered into and scattered from framed staging slots, and a bounded pool of
those slots.

A run is ``(address, length)``, ``(tensor, length)`` or ``(buffer, length)``: an engine's host
pool hands out raw pointers (SGLang's ``get_page_buffer_meta``), others tensors or buffers. The
caller owns that memory and keeps it valid for the duration of the call that received it; the
facade never keeps a view of it past the call.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, TypeAlias

import numpy as np

from tiering.core.block_format import read_frame, write_frame
from tiering.errors import TieringError

__all__ = [
    "Block",
    "EmbedError",
    "Run",
    "StagingRows",
    "as_runs",
    "gather",
    "scatter",
]


class EmbedError(TieringError):
    """A call on a :class:`~tiering.embed.TierStore` was given something it cannot use (a bad
    key, block or run); nothing was stored or read."""


#: One run of a block: (address, length), (tensor, length) or (buffer, length).
Run: TypeAlias = tuple[Any, int]
#: A block: one buffer, or a list of runs.
Block: TypeAlias = Any


def _tensor_view(tensor: Any, length: int, writable: bool, where: str) -> memoryview:
    """A byte view of the first ``length`` bytes of a contiguous CPU torch tensor."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise EmbedError(
            f"{where}: a tensor must be contiguous and on the CPU, got {tensor.device}"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if length > nbytes:
        raise EmbedError(f"{where}: length {length} is over the tensor's {nbytes} bytes")
    return _address_view(tensor.data_ptr(), length)


def _address_view(address: int, length: int) -> memoryview:
    if length == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * length).from_address(address)).cast("B")


def _buffer_view(buf: Any, writable: bool, where: str) -> memoryview:
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # a torch tensor
        return _tensor_view(buf, buf.numel() * buf.element_size(), writable, where)
    try:
        view = memoryview(buf)
    except TypeError:
        raise EmbedError(
            f"{where}: {type(buf).__name__} is not a buffer; give bytes-like memory, a numpy "
            "array, a CPU torch tensor or a list of (address or tensor, length) runs"
        ) from None
    if not view.c_contiguous:
        raise EmbedError(f"{where}: the buffer is not contiguous")
    if writable and view.readonly:
        raise EmbedError(f"{where}: the buffer is read-only; a get needs writable memory")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def as_runs(block: Block, *, writable: bool, where: str = "block") -> list[memoryview]:
    """The byte views of ``block``: one buffer, or a list of (address/tensor/buffer, length)
    runs. Raises :class:`EmbedError` for anything else."""
    if not isinstance(block, list | tuple):
        return [_buffer_view(block, writable, where)]
    runs: list[memoryview] = []
    for i, run in enumerate(block):
        at = f"{where} run {i}"
        if not isinstance(run, tuple | list) or len(run) != 2:
            raise EmbedError(
                f"{at}: a run is (address or tensor or buffer, length), got {run!r:.60}"
            )
        target, length = run
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            raise EmbedError(f"{at}: length must be an int >= 0, got {length!r:.40}")
        if isinstance(target, int) and not isinstance(target, bool):
            if target <= 0:
                raise EmbedError(f"{at}: address {target} is not a valid pointer")
            runs.append(_address_view(target, length))
        elif hasattr(target, "data_ptr") and hasattr(target, "element_size"):
            runs.append(_tensor_view(target, length, writable, at))
        else:
            view = _buffer_view(target, writable, at)
            if length > view.nbytes:
                raise EmbedError(f"{at}: length {length} is over the buffer's {view.nbytes} bytes")
            runs.append(view[:length])
    return runs


def gather(runs: list[memoryview], slot: memoryview) -> int:
    """Copy ``runs`` in order to the start of ``slot`` and frame it; the block's length."""
    at = 0
    for run in runs:
        slot[at : at + run.nbytes] = run
        at += run.nbytes
    write_frame(slot, at)
    return at


def scatter(slot: memoryview, runs: list[memoryview], *, exact: bool) -> int | None:
    """Copy the framed block in ``slot`` into ``runs``, in order; its length, or None (writing
    nothing) if the runs cannot hold it, or, with ``exact``, are not exactly its size. Raises
    :class:`~tiering.errors.CorruptBlockError` for a bad frame."""
    length = read_frame(slot)
    room = sum(r.nbytes for r in runs)
    if length > room or (exact and length != room):
        return None
    at = 0
    for run in runs:
        take = min(run.nbytes, length - at)
        if take <= 0:
            break
        run[:take] = slot[at : at + take]
        at += take
    return length


class StagingRows:
    """Reusable staging slots of ``slot_bytes``: fresh memory costs a page fault per 4 KiB on
    first touch, more than the copy itself, so released rows are kept, up to ``keep_bytes``.
    Thread-safe; a row is handed to one call at a time."""

    def __init__(self, slot_bytes: int, keep_bytes: int = 64 << 20) -> None:
        self.slot_bytes = slot_bytes
        self._keep = max(2, keep_bytes // slot_bytes)
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self, n: int) -> list[memoryview]:
        """``n`` writable byte views of ``slot_bytes`` each."""
        with self._lock:
            reused = [self._free.pop() for _ in range(min(n, len(self._free)))]
        fresh = [np.empty(self.slot_bytes, dtype=np.uint8).data for _ in range(n - len(reused))]
        return reused + fresh

    def give(self, rows: list[memoryview]) -> None:
        with self._lock:
            room = self._keep - len(self._free)
            if room > 0:
                self._free.extend(rows[:room])
