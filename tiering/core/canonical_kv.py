"""The canonical KV caches a registration gives: ``uint8`` views ``(num_blocks, page_bytes)``
of an engine's memory (:class:`CanonicalKVCacheTensor`), each group's references into them
(:class:`CanonicalKVCacheRef`), and the whole of one rank (:class:`CanonicalKVCaches`) with the
byte counts a pool and the tiers are sized from. :mod:`tiering.core.layout` builds them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiering.core.groups import KVCacheSpec
from tiering.errors import ConfigurationError, LayoutError

__all__ = ["CanonicalKVCacheRef", "CanonicalKVCacheTensor", "CanonicalKVCaches"]


@dataclass(frozen=True, eq=False)
class CanonicalKVCacheTensor:
    """A ``uint8`` view ``(num_blocks, page_bytes)`` of engine memory; row ``b`` is block ``b``.

    ``page_bytes`` is the block stride in the engine's memory, padding included (the bytes
    really allocated per block), or the run the layers cover when whole strides do not fit in
    the storage. Rows are ``block_stride_bytes`` apart: equal to ``page_bytes`` except where a
    page is a slice of a longer per-block run. ``layer_names`` are the layers that registered
    it (the first stands for all) and ``part`` is ``"K"`` or ``"V"`` for the halves of a K/V
    split, ``""`` otherwise.
    """

    tensor: torch.Tensor
    page_bytes: int
    layer_names: tuple[str, ...]
    part: str = ""

    @property
    def label(self) -> str:
        return f"{self.layer_names[0]}[{self.part}]" if self.part else self.layer_names[0]

    @property
    def block_stride_bytes(self) -> int:
        """Bytes from block ``b`` to block ``b + 1`` in the engine's memory (``>= page_bytes``;
        larger when the layers of a block are one run, each layer's tensor a slice of it)."""
        return int(self.tensor.stride(0))

    @property
    def extent_bytes(self) -> int:
        """Bytes from the first byte of block 0 to the last byte of the last block."""
        return (self.tensor.shape[0] - 1) * self.block_stride_bytes + self.page_bytes


@dataclass(frozen=True)
class CanonicalKVCacheRef:
    """A group's use of one canonical tensor: ``page_bytes`` (un-padded) from byte
    ``offset_bytes`` of each page (non-zero for the layers of a cross-layer layout)."""

    tensor_idx: int
    page_bytes: int
    offset_bytes: int = 0


@dataclass(frozen=True, eq=False)
class CanonicalKVCaches:
    """The canonical tensors of one rank plus, per group, the references its layers make.

    ``group_refs[g]`` lists each canonical tensor group ``g`` uses once, in layer order.
    """

    tensors: tuple[CanonicalKVCacheTensor, ...]
    group_refs: tuple[tuple[CanonicalKVCacheRef, ...], ...]
    num_blocks: int
    spec: KVCacheSpec

    @property
    def device(self) -> torch.device:
        return self.tensors[0].tensor.device

    @property
    def engine_block_bytes(self) -> int:
        """Bytes of one engine block id across all canonical tensors of this rank (padded)."""
        return sum(t.page_bytes for t in self.tensors)

    @property
    def registered_bytes(self) -> int:
        """Bytes of all canonical tensors: ``num_blocks`` pages each."""
        return self.num_blocks * self.engine_block_bytes

    def bytes_per_gpu_block(self, group_idx: int) -> int:
        """Bytes one engine block of group ``group_idx`` really holds on this rank (un-padded)."""
        self._check_group(group_idx)
        return sum(ref.page_bytes for ref in self.group_refs[group_idx])

    def offloaded_block_bytes_per_rank(self, block_size_factor: int | None = None) -> int:
        """Bytes of one offloaded block on one rank.

        ``registered_bytes / num_blocks * block_size_factor``: measured from the tensors really
        registered (padding included), not from declared page sizes. Every group's offloaded
        block fits in it; a group uses the parts of the canonical tensors it references.
        """
        factor = self._factor(block_size_factor)
        return self.registered_bytes // self.num_blocks * factor

    def offloaded_block_bytes(self, world_size: int, block_size_factor: int | None = None) -> int:
        """Bytes of one offloaded block summed over ``world_size`` ranks (one pool row)."""
        _check_positive(world_size, "world_size")
        return self.offloaded_block_bytes_per_rank(block_size_factor) * world_size

    def cpu_num_blocks(
        self, cpu_bytes_budget: int, world_size: int, block_size_factor: int | None = None
    ) -> int:
        """Offloaded blocks a CPU budget holds; the budget is the total over all ranks.

        Raises :class:`ConfigurationError` if the budget cannot hold a single block.
        """
        if isinstance(cpu_bytes_budget, bool) or not isinstance(cpu_bytes_budget, int):
            raise ConfigurationError(f"cpu_bytes_budget must be an int, got {cpu_bytes_budget!r}")
        block_bytes = self.offloaded_block_bytes(world_size, block_size_factor)
        num_blocks = cpu_bytes_budget // block_bytes
        if num_blocks <= 0:
            raise ConfigurationError(
                f"cpu_bytes_budget={cpu_bytes_budget} cannot hold one offloaded block of "
                f"{block_bytes} bytes (world_size={world_size}); give at least {block_bytes}"
            )
        return num_blocks

    def _factor(self, block_size_factor: int | None) -> int:
        if block_size_factor is None:
            return self.spec.block_size_factor
        _check_positive(block_size_factor, "block_size_factor")
        return block_size_factor

    def _check_group(self, group_idx: int) -> None:
        if not 0 <= group_idx < len(self.group_refs):
            raise LayoutError(
                f"group index {group_idx} is out of range; valid: 0..{len(self.group_refs) - 1}"
            )


def _check_positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{what} must be a positive int, got {value!r}")
