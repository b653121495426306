"""A model shape's KV tensors, allocated as an engine would (for the replay tool and tests).

:class:`~tiering.model.shapes.ModelShape` is geometry only and imports no torch;
:func:`allocate_kv_caches` turns one into zeroed tensors, one
``(num_blocks, kv_parts, block_size, num_kv_heads, head_dim)`` tensor per layer position (in a
hybrid model the layers at one position of each group share it), registered as
:class:`~tiering.core.layout.CanonicalKVCaches`.
"""

from __future__ import annotations

import torch

from tiering.core.groups import KVCacheSpec
from tiering.core.layout import CanonicalKVCaches, register_kv_caches
from tiering.model.shapes import ModelShape

__all__ = ["allocate_kv_caches", "torch_dtype"]

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def torch_dtype(shape: ModelShape) -> torch.dtype:
    """The torch dtype of ``shape``'s KV elements."""
    return _TORCH_DTYPES[shape.dtype]


def allocate_kv_caches(
    shape: ModelShape, num_blocks: int, spec: KVCacheSpec, device: torch.device | str = "cpu"
) -> tuple[dict[str, torch.Tensor], CanonicalKVCaches]:
    """Allocate zeroed KV tensors of ``shape`` for ``num_blocks`` engine blocks on ``device``
    and register them."""
    positions = shape.layers_per_position
    tensors = [
        torch.zeros(
            (num_blocks, shape.kv_parts, shape.block_size, shape.num_kv_heads, shape.head_dim),
            dtype=torch_dtype(shape),
            device=device,
        )
        for _ in range(positions)
    ]
    kv_caches: dict[str, torch.Tensor] = {}
    shared: list[list[str]] = [[] for _ in range(positions)]
    for g, group_name in zip(shape.groups, shape.group_names(), strict=True):
        for i in range(g.num_layers):
            name = f"{group_name}.{i}"
            kv_caches[name] = tensors[i]
            shared[i].append(name)
    caches = register_kv_caches(
        kv_caches,
        spec,
        num_blocks,
        shared_by=[names for names in shared if len(names) > 1],
        kv_layout="blocks_first",
    )
    return kv_caches, caches
