"""Checking what callers hand the LMDB backend: its settings (no I/O; ``ConfigurationError``
names the bad one) and the block buffers of ``put`` and ``get`` (flat, C-contiguous bytes of
exactly one block)."""

from __future__ import annotations

import os
from typing import Any, Final, cast

from tiering.backends.base import is_block_view
from tiering.backends.lmdb.geometry import MAX_VALUE_BYTES
from tiering.backends.ownership import MismatchPolicy
from tiering.backends.settings import RecoverMode
from tiering.core.block_format import HEADER_BYTES
from tiering.errors import ConfigurationError

__all__ = [
    "byte_view",
    "check_block_bytes",
    "check_bool",
    "check_directory",
    "check_durability",
    "check_int",
    "check_recovery",
    "check_threads",
]

_RECOVER_MODES: Final = ("verify", "trust_header", "wipe")


def check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be a bool, got {value!r}")
    return value


def check_directory(path: object) -> str:
    """``path`` as an absolute directory path."""
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise ConfigurationError(f"path must be a directory path, got {path!r}")
    return os.path.abspath(os.fspath(path))


def check_block_bytes(block_bytes: int) -> None:
    if block_bytes > MAX_VALUE_BYTES - HEADER_BYTES:
        raise ConfigurationError(
            f"block_bytes={block_bytes} is over LMDB's largest value "
            f"({MAX_VALUE_BYTES - HEADER_BYTES} bytes of payload)"
        )


def check_durability(
    sync: object, metasync: object, writemap: object, map_async: object
) -> tuple[bool, bool, bool, bool]:
    """``sync``, ``metasync``, ``writemap``, ``map_async`` (which requires ``writemap``)."""
    flags = (
        check_bool("sync", sync),
        check_bool("metasync", metasync),
        check_bool("writemap", writemap),
        check_bool("map_async", map_async),
    )
    if map_async and not writemap:
        raise ConfigurationError("map_async=True requires writemap=True (LMDB ignores it)")
    return flags


def check_threads(read_threads: object, max_readers: object) -> tuple[int, int]:
    """``read_threads`` and ``max_readers``: each read thread holds a reader slot."""
    threads = check_int("read_threads", read_threads, 1)
    readers = check_int("max_readers", max_readers, 1)
    if readers < threads:
        raise ConfigurationError(
            f"max_readers={readers} is below read_threads={threads}: "
            f"each read thread holds a reader slot"
        )
    return threads, readers


def check_recovery(
    recover: object, on_layout_mismatch: object, read_only: object
) -> tuple[RecoverMode, MismatchPolicy, bool]:
    """``recover``, ``on_layout_mismatch`` and ``read_only``."""
    if recover not in _RECOVER_MODES:
        raise ConfigurationError(f"recover must be one of {_RECOVER_MODES}, got {recover!r}")
    if on_layout_mismatch not in ("refuse", "set_aside", "wipe"):
        raise ConfigurationError(
            "on_layout_mismatch must be one of 'refuse', 'set_aside', 'wipe'; "
            f"got {on_layout_mismatch!r}"
        )
    return (
        cast(RecoverMode, recover),
        cast(MismatchPolicy, on_layout_mismatch),
        check_bool("read_only", read_only),
    )


def byte_view(buf: object, nbytes: int, kind: str, index: int, *, writable: bool) -> memoryview:
    """``buf`` as a flat, C-contiguous uint8 memoryview of exactly ``nbytes``, or ValueError.

    ``kind`` and ``index`` name the buffer in the error (``"value", 3`` -> "value 3").
    """
    if is_block_view(buf, nbytes, writable=writable):
        return buf
    what = f"{kind} {index}"
    try:
        view = buf if isinstance(buf, memoryview) else memoryview(cast(Any, buf))
    except TypeError:
        raise ValueError(
            f"{what} must be a buffer (memoryview), got {type(buf).__name__}"
        ) from None
    if view.nbytes != nbytes:
        raise ValueError(f"{what} is {view.nbytes} bytes; every block is {nbytes} bytes")
    if writable and view.readonly:
        raise ValueError(f"{what} is read-only; get() writes into the buffers it is given")
    if not view.c_contiguous:
        raise ValueError(f"{what} is not C-contiguous")
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view
