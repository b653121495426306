"""Choosing a copy strategy at run time: ``copy_backend="auto"`` or a name.

``"auto"`` picks the fastest strategy that works for the registered caches and the pool:

* CPU caches: ``memmove``;
* CUDA caches with a pinned pool: ``triton`` if Triton imports and its kernel compiles here,
  else ``batched_memcpy`` if the driver has ``cuMemcpyBatchAsync`` (CUDA >= 12.8), else
  ``staging``;
* CUDA caches with an unpinned pool: ``staging`` (the other two need pinned memory).

A name forces that strategy, and is a :class:`ConfigurationError` (saying why) where it cannot
work. ``torch`` (one ``Tensor.copy_`` per run) is only ever used when named.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiering.errors import ConfigurationError, TieringError
from tiering.transfer.batched_memcpy import BatchedMemcpy, find_batched_memcpy
from tiering.transfer.per_run import MemmoveCopy, TorchCopy
from tiering.transfer.plan import PoolGeometry
from tiering.transfer.staging import DEFAULT_STAGING_BYTES, StagingCopy
from tiering.transfer.strategy import CopyBackend, CopyStrategy, StrategyName
from tiering.transfer.triton_copy import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_PROGRAMS,
    TritonPageCopy,
    triton_version,
)

__all__ = ["COPY_BACKENDS", "StrategyChoice", "StrategyOptions", "make_strategy", "machine_choice"]

#: Every value ``copy_backend`` accepts.
COPY_BACKENDS: tuple[CopyBackend, ...] = (
    "auto",
    "triton",
    "batched_memcpy",
    "staging",
    "memmove",
    "torch",
)


@dataclass(frozen=True)
class StrategyOptions:
    """Tuning of the strategies that have any (defaults are documented in their modules)."""

    staging_bytes: int = DEFAULT_STAGING_BYTES
    triton_max_programs: int = DEFAULT_MAX_PROGRAMS
    triton_chunk_bytes: int = DEFAULT_CHUNK_BYTES


@dataclass(frozen=True)
class StrategyChoice:
    """A strategy name and why it was chosen."""

    name: StrategyName
    reason: str


def make_strategy(
    geometry: PoolGeometry,
    copy_backend: CopyBackend = "auto",
    options: StrategyOptions | None = None,
) -> tuple[CopyStrategy, StrategyChoice]:
    """A strategy for ``geometry`` and why; see the module docstring for ``"auto"``."""
    options = options or StrategyOptions()
    if copy_backend not in COPY_BACKENDS:
        raise ConfigurationError(
            f"copy_backend must be one of {', '.join(map(repr, COPY_BACKENDS))}, "
            f"got {copy_backend!r}"
        )
    device = geometry.device
    if device.type not in ("cpu", "cuda"):
        raise ConfigurationError(
            f"KV caches on {device}: the transfer engine moves blocks of CPU or CUDA caches"
        )
    if copy_backend != "auto":
        return _build(copy_backend, geometry, options), StrategyChoice(copy_backend, "requested")
    if device.type == "cpu":
        return MemmoveCopy(geometry), StrategyChoice("memmove", "CPU KV caches")
    if not geometry.pool.is_pinned:
        reason = "the pool is not pinned (triton and batched_memcpy need pinned rows)"
        return _build("staging", geometry, options), StrategyChoice("staging", reason)
    skipped = []
    for name in ("triton", "batched_memcpy"):
        try:
            strategy = _build(name, geometry, options)
        except TieringError as exc:
            skipped.append(f"{name}: {exc}")
            continue
        return strategy, StrategyChoice(name, _fastest(skipped))
    return _build("staging", geometry, options), StrategyChoice("staging", _fastest(skipped))


def _fastest(skipped: list[str]) -> str:
    return "fastest available" + (f" ({'; '.join(skipped)})" if skipped else "")


def _build(name: StrategyName, geometry: PoolGeometry, options: StrategyOptions) -> CopyStrategy:
    if name == "triton":
        try:
            return TritonPageCopy(
                geometry,
                max_programs=options.triton_max_programs,
                chunk_bytes=options.triton_chunk_bytes,
            )
        except TieringError:
            raise
        except Exception as exc:  # a kernel that cannot compile here (no ptxas, old driver)
            raise ConfigurationError(
                f"copy_backend='triton' cannot compile its kernel here: {type(exc).__name__}: {exc}"
            ) from exc
    if name == "batched_memcpy":
        return BatchedMemcpy(geometry)
    if name == "staging":
        return StagingCopy(geometry, staging_bytes=options.staging_bytes)
    if name == "memmove":
        return MemmoveCopy(geometry)
    return TorchCopy(geometry)


def machine_choice() -> StrategyChoice:
    """What ``"auto"`` gives CUDA KV caches with a pinned pool on this machine, and why.

    For ``tiering doctor``: nothing is allocated and Triton is neither imported nor compiled,
    so a Triton that cannot compile here is only found when an engine starts (which then falls
    back to the next strategy).
    """
    if not torch.cuda.is_available():
        return StrategyChoice(
            "memmove", f"no CUDA device (torch {torch.__version__}): KV caches on CPU use memmove"
        )
    device = torch.cuda.get_device_name()
    version = triton_version()
    if version is not None:
        return StrategyChoice("triton", f"Triton {version} page-copy kernel on {device}")
    batched = find_batched_memcpy()
    if batched.function is not None:
        return StrategyChoice("batched_memcpy", f"{batched.reason} on {device}; no Triton")
    return StrategyChoice(
        "staging", f"no Triton and no batched memcpy ({batched.reason}) on {device}"
    )
