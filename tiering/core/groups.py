"""KV-cache groups and how their blocks map onto hash blocks and offloaded blocks.

A model's KV cache is split into *groups* of layers that share a block table: full attention,
sliding-window attention (with a window in tokens) and Mamba/state layers. Each group has its own
GPU block size in tokens and its layers' page sizes in bytes. Request tokens are hashed in blocks
of ``hash_block_size`` tokens; an *offloaded block* of a group is ``block_size_factor`` GPU blocks
of that group, and it is keyed by the hash of the last hash block inside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigurationError

__all__ = ["GroupKind", "KVCacheGroup", "KVCacheSpec"]


class GroupKind(StrEnum):
    """What a group's layers need from the prefix to resume a request."""

    FULL_ATTENTION = "full_attention"
    SLIDING_WINDOW = "sliding_window"
    MAMBA = "mamba"


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV-cache group.

    ``block_size`` is the GPU block size in tokens; ``page_size_bytes`` has one entry per layer
    (the bytes one GPU block of that layer takes). ``sliding_window`` is in tokens and required
    for sliding-window groups only.
    """

    kind: GroupKind
    block_size: int
    page_size_bytes: tuple[int, ...]
    sliding_window: int | None = None
    name: str = ""
    layer_names: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GroupKind):
            object.__setattr__(self, "kind", _parse_kind(self.kind, self.name or str(self.kind)))
        label = self.label
        _check_positive_int(self.block_size, f"group {label!r}: block_size (tokens)")
        object.__setattr__(self, "page_size_bytes", tuple(self.page_size_bytes))
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        for i, page in enumerate(self.page_size_bytes):
            _check_positive_int(page, f"group {label!r}: page_size_bytes[{i}]")
        if self.kind is GroupKind.SLIDING_WINDOW:
            if self.sliding_window is None:
                raise ConfigurationError(
                    f"group {label!r} is a sliding-window group but has no sliding_window; "
                    "give the window in tokens"
                )
            _check_positive_int(self.sliding_window, f"group {label!r}: sliding_window (tokens)")
        elif self.sliding_window is not None:
            raise ConfigurationError(
                f"group {label!r} is {self.kind.value} but sets sliding_window="
                f"{self.sliding_window}; only sliding_window groups have a window"
            )
        if self.layer_names and len(self.layer_names) != len(self.page_size_bytes):
            raise ConfigurationError(
                f"group {label!r} names {len(self.layer_names)} layers but gives "
                f"{len(self.page_size_bytes)} page sizes; give one page size per layer"
            )

    @property
    def label(self) -> str:
        return self.name or self.kind.value

    @property
    def gpu_block_bytes(self) -> int:
        """Bytes of one GPU block of this group, summed over its layers (one rank)."""
        return sum(self.page_size_bytes)


@dataclass(frozen=True)
class KVCacheSpec:
    """The groups of a model plus the two numbers that tie them to hashing and offloading.

    Raises :class:`ConfigurationError` if a group's block size is not a multiple of
    ``hash_block_size``, naming the group, both numbers and what to change.
    """

    groups: tuple[KVCacheGroup, ...]
    hash_block_size: int
    block_size_factor: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise ConfigurationError("a KV-cache spec needs at least one group")
        _check_positive_int(self.hash_block_size, "hash_block_size (tokens)")
        _check_positive_int(self.block_size_factor, "block_size_factor")
        sizes = [g.block_size for g in self.groups]
        gcd = math.gcd(*sizes)
        for idx, group in enumerate(self.groups):
            if group.block_size % self.hash_block_size:
                hint = (
                    f"set hash_block_size to a divisor of every group's block size "
                    f"(their GCD is {gcd})"
                )
                if any(g.kind is GroupKind.MAMBA for g in self.groups):
                    hint += (
                        "; for hybrid Mamba models, align the block sizes of all groups "
                        "(in vLLM: enable prefix caching so Mamba uses the attention block size)"
                    )
                raise ConfigurationError(
                    f"group {idx} ({group.label!r}) has block_size={group.block_size} tokens, "
                    f"which hash_block_size={self.hash_block_size} does not divide: {hint}"
                )

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def offloaded_block_size(self, group_idx: int) -> int:
        """Tokens in one offloaded block of group ``group_idx``."""
        return self.groups[group_idx].block_size * self.block_size_factor

    def hash_blocks_per_offloaded_block(self, group_idx: int) -> int:
        return self.offloaded_block_size(group_idx) // self.hash_block_size

    def window_in_offloaded_blocks(self, group_idx: int) -> int | None:
        """Offloaded blocks a group needs before a hit end: None = all (full attention)."""
        group = self.groups[group_idx]
        if group.kind is GroupKind.FULL_ATTENTION:
            return None
        if group.kind is GroupKind.MAMBA:
            return 1  # a Mamba group resumes from the single state at the hit end
        assert group.sliding_window is not None
        return -(-group.sliding_window // self.offloaded_block_size(group_idx))

    def offloaded_block_bytes_per_rank(self, group_idx: int) -> int:
        """Declared bytes of one offloaded block of a group on one rank (from page sizes)."""
        return self.groups[group_idx].gpu_block_bytes * self.block_size_factor

    def offload_keys(self, block_hashes: Sequence[bytes]) -> list[list[OffloadKey]]:
        """Keys of every full offloaded block, per group, from a request's hash-block hashes.

        Offloaded block ``i`` of group ``g`` is keyed by the hash of the last hash block inside
        it, with ``g`` appended; a trailing partial offloaded block gets no key.
        """
        keys: list[list[OffloadKey]] = []
        for group_idx in range(self.num_groups):
            factor = self.hash_blocks_per_offloaded_block(group_idx)
            keys.append(
                [
                    make_offload_key(block_hashes[i], group_idx)
                    for i in range(factor - 1, len(block_hashes), factor)
                ]
            )
        return keys


def _parse_kind(value: object, label: str) -> GroupKind:
    try:
        return GroupKind(str(value))
    except ValueError:
        valid = ", ".join(k.value for k in GroupKind)
        raise ConfigurationError(
            f"group {label!r}: unknown kind {value!r}; valid kinds: {valid}"
        ) from None


def _check_positive_int(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{what} must be a positive int, got {value!r}")
