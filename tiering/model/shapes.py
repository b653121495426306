"""KV-cache shapes of real models, for the replay tool and the benchmarks.

A shape names the model's KV-cache groups and builds KV tensors laid out as an engine would
allocate them: one ``(num_blocks, kv_parts, block_size, num_kv_heads, head_dim)`` tensor per
layer position (``kv_parts`` is 2, K and V, or 1 for a latent cache such as DeepSeek's MLA); in a
hybrid model, the layers at one position of each group share that tensor (vLLM's hybrid
allocator gives every group the same page size, so one block id names the same bytes in each
group's tensors; a Mamba layer's state is padded to that page).

A shape describes one rank. The built-in shapes (:data:`MODEL_SHAPES`) are named presets;
:mod:`tiering.model.hf_model` builds the shape of a real model from its Hugging Face
``config.json``.

A shape is pure geometry and imports no torch (checking a config needs its bytes per block,
not tensors); :mod:`tiering.model.kv_tensors` allocates a shape's KV tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.errors import ConfigurationError

__all__ = ["DTYPE_BYTES", "MODEL_SHAPES", "GroupShape", "ModelShape", "get_model_shape"]

#: Bytes of one element of each KV dtype a shape may name (torch's ``element_size()``).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class GroupShape:
    kind: GroupKind
    num_layers: int
    sliding_window: int | None = None


@dataclass(frozen=True)
class ModelShape:
    """Attention geometry of a model; every group shares ``num_kv_heads`` and ``head_dim``."""

    name: str
    groups: tuple[GroupShape, ...]
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    block_size: int = 16
    kv_parts: int = 2  # 2: K and V; 1: one latent vector per token (MLA)

    @property
    def layers_per_position(self) -> int:
        """Layer positions: a hybrid model's groups have the same number of layers each."""
        return max(g.num_layers for g in self.groups)

    @property
    def page_bytes(self) -> int:
        """Bytes one layer spends on one block (K and V)."""
        element_bytes = DTYPE_BYTES[self.dtype]
        return self.kv_parts * self.block_size * self.num_kv_heads * self.head_dim * element_bytes

    def group_names(self) -> list[str]:
        """A name per group: its kind, numbered from the second group of a kind on."""
        seen: dict[GroupKind, int] = {}
        names = []
        for g in self.groups:
            n = seen.get(g.kind, 0)
            seen[g.kind] = n + 1
            names.append(g.kind.value if n == 0 else f"{g.kind.value}{n}")
        return names

    def kv_cache_spec(self, hash_block_size: int, block_size_factor: int = 1) -> KVCacheSpec:
        groups = tuple(
            KVCacheGroup(
                g.kind,
                self.block_size,
                (self.page_bytes,) * g.num_layers,
                sliding_window=g.sliding_window,
                name=name,
                layer_names=tuple(f"{name}.{i}" for i in range(g.num_layers)),
            )
            for g, name in zip(self.groups, self.group_names(), strict=True)
        )
        return KVCacheSpec(groups, hash_block_size, block_size_factor)


MODEL_SHAPES: dict[str, ModelShape] = {
    shape.name: shape
    for shape in (
        # Llama-3-8B: 32 layers, 8 KV heads of 128, bf16: 64 KiB per layer and 16-token block.
        ModelShape("llama-3-8b", (GroupShape(GroupKind.FULL_ATTENTION, 32),), 8, 128),
        # A hybrid of full attention and a 1024-token sliding window (gpt-oss style), 12 + 12.
        ModelShape(
            "hybrid-swa",
            (
                GroupShape(GroupKind.FULL_ATTENTION, 12),
                GroupShape(GroupKind.SLIDING_WINDOW, 12, sliding_window=1024),
            ),
            8,
            64,
        ),
        # Small shapes for tests and quick runs.
        ModelShape("tiny", (GroupShape(GroupKind.FULL_ATTENTION, 2),), 2, 16),
        ModelShape(
            "tiny-hybrid",
            (
                GroupShape(GroupKind.FULL_ATTENTION, 2),
                GroupShape(GroupKind.SLIDING_WINDOW, 2, sliding_window=64),
            ),
            2,
            16,
        ),
    )
}


def get_model_shape(name: str) -> ModelShape:
    try:
        return MODEL_SHAPES[name]
    except KeyError:
        raise ConfigurationError(
            f"unknown model shape {name!r}; known shapes: {', '.join(sorted(MODEL_SHAPES))}"
        ) from None
