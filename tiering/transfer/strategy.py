"""The copy-strategy seam: how the bytes of a validated :class:`CopyPlan` move.

A strategy is built once per transfer direction for one rank's :class:`PoolGeometry` and then
executes plans. The transfer engine (:mod:`tiering.transfer.engine`) calls :meth:`copy` with
the direction's CUDA stream current (CUDA caches) or on the direction's worker thread (CPU
caches). The conformance suite is :class:`tiering.testing.copy_strategy_tests.CopyStrategyTests`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

import torch

from tiering.transfer.plan import CopyPlan, PoolGeometry

__all__ = [
    "STRATEGY_NAMES",
    "CopyBackend",
    "CopyStrategy",
    "Direction",
    "StrategyName",
    "flat_byte_view",
]

#: Stores copy engine blocks into the pool, loads copy pool rows into engine blocks.
Direction = Literal["store", "load"]

#: The strategies, fastest first where several apply.
StrategyName = Literal["triton", "batched_memcpy", "staging", "memmove", "torch"]
#: What a caller may ask for: a strategy, or ``"auto"`` (see :mod:`tiering.transfer.select`).
CopyBackend = Literal["auto", "triton", "batched_memcpy", "staging", "memmove", "torch"]
STRATEGY_NAMES: tuple[StrategyName, ...] = (
    "triton",
    "batched_memcpy",
    "staging",
    "memmove",
    "torch",
)


class CopyStrategy(ABC):
    """Executes copy plans between one rank's KV caches and its part of the pool rows.

    Contract:

    * :meth:`copy` moves exactly the bytes of ``plan``'s entries, in the plan's direction, bit
      for bit, and no other byte of either side (a pool row's bytes that the plan does not
      name keep their value).
    * Plans are already validated (:class:`~tiering.transfer.plan.TransferPlanner`); a
      strategy does not check them again.
    * On CUDA caches, :meth:`copy` only enqueues work on the current stream and returns; it
      never waits on the host for the device (no ``synchronize``, no blocking copy). It may
      return an object that must stay alive until that work has run (the engine keeps it until
      the transfer's event completes). On CPU caches it copies before returning.
    * One strategy instance serves one direction at a time: the engine never calls
      :meth:`copy` of one instance from two threads or streams at once, so a strategy may keep
      scratch buffers.
    """

    name: ClassVar[StrategyName]

    def __init__(self, geometry: PoolGeometry) -> None:
        self.geometry = geometry

    @abstractmethod
    def copy(self, plan: CopyPlan) -> object:
        """Copy (CPU) or enqueue the copy of (CUDA) every entry of ``plan``; see the contract."""


def flat_byte_view(tensor: torch.Tensor, nbytes: int) -> torch.Tensor:
    """A 1-D ``uint8`` view of ``nbytes`` bytes of ``tensor``'s storage from its first byte."""
    storage = tensor.untyped_storage()
    offset = int(tensor.storage_offset()) * tensor.element_size()
    base = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return base.set_(storage, offset, (nbytes,), (1,))
