"""What the file backend accepts: its constructor's arguments and the buffers of a batch call.
Each check raises :class:`~tiering.errors.ConfigurationError` (arguments) or
``ValueError``/``TypeError`` (buffers) naming the first thing wrong."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import get_args

from tiering.backends._fileops import FileOps
from tiering.backends.base import is_block_view
from tiering.backends.ownership import MismatchPolicy
from tiering.backends.settings import Durability, RecoverMode
from tiering.errors import ConfigurationError

_MAX_BLOCK_BYTES = 1 << 30  # one pwritev moves at most ~2 GiB on Linux
_MAX_IO_THREADS = 64
_MAX_BATCH_BLOCKS = 1024


def check_arguments(
    *,
    path: str | os.PathLike[str],
    capacity_bytes: int,
    block_bytes: int,
    slot_bytes: int,
    o_direct: bool,
    durability: Durability,
    recover: RecoverMode,
    io_threads: int,
    batch_blocks: int,
    on_layout_mismatch: MismatchPolicy,
    read_only: bool,
    file_ops: FileOps | None,
) -> None:
    """Check :class:`~tiering.backends.file.FileBackend`'s arguments (``block_bytes`` is
    checked by the base class already; ``slot_bytes`` is a slot of it)."""
    if block_bytes > _MAX_BLOCK_BYTES:
        raise ConfigurationError(
            f"block_bytes must be at most {_MAX_BLOCK_BYTES} for the file backend, "
            f"got {block_bytes}"
        )
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigurationError(f"path must be a non-empty directory path, got {path!r}")
    check_int("capacity_bytes", capacity_bytes, 1, None)
    if capacity_bytes < slot_bytes:
        raise ConfigurationError(
            f"capacity_bytes={capacity_bytes} holds no slot: one block of {block_bytes} "
            f"bytes takes {slot_bytes} bytes (4096-byte header area + payload rounded "
            "up to 4096)"
        )
    check_choice("durability", durability, Durability)
    check_choice("recover", recover, RecoverMode)
    check_choice("on_layout_mismatch", on_layout_mismatch, MismatchPolicy)
    if not isinstance(read_only, bool):
        raise ConfigurationError(f"read_only must be a bool, got {read_only!r}")
    if not isinstance(o_direct, bool):
        raise ConfigurationError(f"o_direct must be a bool, got {o_direct!r}")
    if o_direct and not hasattr(os, "O_DIRECT"):
        raise ConfigurationError("o_direct=True needs O_DIRECT, which this OS does not have")
    check_int("io_threads", io_threads, 1, _MAX_IO_THREADS)
    check_int("batch_blocks", batch_blocks, 1, _MAX_BATCH_BLOCKS)
    if file_ops is not None and not isinstance(file_ops, FileOps):
        raise ConfigurationError(f"file_ops must be a FileOps, got {file_ops!r:.80}")


def check_int(name: str, value: object, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigurationError(f"{name} must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigurationError(f"{name} must be {bounds}, got {value}")


def check_choice(name: str, value: object, choices: object) -> None:
    valid = get_args(choices)
    if value not in valid:
        raise ConfigurationError(
            f"{name} must be one of {', '.join(map(repr, valid))}; got {value!r}"
        )


def check_buffers(
    buffers: Sequence[memoryview], n_keys: int, block_bytes: int, *, writable: bool
) -> list[memoryview]:
    """The buffers as flat byte views of ``block_bytes`` each (writable, for a get)."""
    if isinstance(buffers, (bytes, bytearray, memoryview, str)):
        raise ValueError(
            f"expected a sequence of {n_keys} buffers, got a single {type(buffers).__name__}"
        )
    if len(buffers) != n_keys:
        raise ValueError(f"got {n_keys} keys but {len(buffers)} buffers")
    views = []
    for i, buffer in enumerate(buffers):
        if is_block_view(buffer, block_bytes, writable=writable):
            views.append(buffer)
            continue
        try:
            view = memoryview(buffer)
        except TypeError:
            raise TypeError(
                f"buffer {i} is a {type(buffer).__name__}, not a buffer (use a memoryview)"
            ) from None
        if view.nbytes != block_bytes:
            raise ValueError(
                f"buffer {i} is {view.nbytes} bytes; every block is {block_bytes} bytes"
            )
        if not view.c_contiguous:
            raise ValueError(f"buffer {i} is not C-contiguous")
        if writable and view.readonly:
            raise ValueError(f"buffer {i} is read-only; get() needs writable buffers")
        views.append(view if view.ndim == 1 and view.format == "B" else view.cast("B"))
    return views
