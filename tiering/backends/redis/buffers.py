"""The caller's buffers as the Redis backend uses them: flat byte views of exactly one block."""

from __future__ import annotations

from tiering.backends.base import is_block_view

__all__ = ["byte_view"]


def byte_view(buf: object, nbytes: int, kind: str, index: int, *, writable: bool) -> memoryview:
    """``buf`` as a flat uint8 memoryview of exactly ``nbytes``, or ValueError naming it."""
    if is_block_view(buf, nbytes, writable=writable):
        return buf
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{kind} {index} must be a buffer, got {type(buf).__name__}") from None
    if view.nbytes != nbytes:
        raise ValueError(f"{kind} {index} is {view.nbytes} bytes; every block is {nbytes} bytes")
    if writable and view.readonly:
        raise ValueError(f"{kind} {index} is read-only; get() writes into its buffers")
    if not view.c_contiguous:
        raise ValueError(f"{kind} {index} is not C-contiguous")
    return view.cast("B") if view.ndim != 1 or view.format != "B" else view
