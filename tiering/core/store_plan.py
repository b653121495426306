"""Store planning: which offloaded blocks of a request to store, and from which GPU blocks.

The engine gives, per group, the request's GPU block ids in order. Sliding-window groups hold the
null block id ``0`` outside the window (the GPU freed those blocks); Mamba groups may pad with it.
An offloaded block whose last GPU block is null is not stored; within a stored offloaded block,
null sub-blocks are skipped. The per-group counts are the numbers of GPU ids really listed, so
``sum(group_sizes) == len(src_block_ids)`` always holds (vLLM once counted ``block_size_factor``
per offloaded block and copied past the listed ids).

Planning is two steps because the manager decides in between which keys it wants:
:func:`plan_store` lists the candidate keys; :meth:`StoreCandidates.build_job` then builds the
copy job for the keys the manager accepted.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from tiering.core.groups import KVCacheSpec
from tiering.core.keys import OffloadKey, get_offload_group_idx
from tiering.errors import ConfigurationError, InvalidKeyError

__all__ = ["NULL_BLOCK_ID", "StoreCandidates", "StoreJob", "plan_store"]

#: The GPU block id an engine uses for "no block" (outside a sliding window, Mamba padding).
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class StoreJob:
    """A copy job from GPU blocks into offloaded blocks, in the order of ``keys``.

    ``src_block_ids`` lists GPU block ids grouped by KV-cache group; ``group_sizes[g]`` of them
    belong to group ``g``, and ``block_indices[g]`` is the index (in GPU blocks, within the
    request) of group ``g``'s first listed block, so a copier can tell how far into the first
    offloaded block the listed ids start.
    """

    keys: tuple[OffloadKey, ...]
    src_block_ids: np.ndarray
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]

    def __post_init__(self) -> None:
        if sum(self.group_sizes) != len(self.src_block_ids):
            raise AssertionError("group_sizes must add up to the number of source block ids")


@dataclass(frozen=True)
class StoreCandidates:
    """Keys worth storing, with what is needed to build the copy job for any subset of them."""

    keys: tuple[OffloadKey, ...]
    spec: KVCacheSpec
    # For each candidate key: its group and the GPU (index, id) pairs it is copied from.
    sources: dict[bytes, tuple[int, tuple[tuple[int, int], ...]]]
    next_block_idx: tuple[int, ...]

    def build_job(self, keys_to_store: Collection[bytes]) -> StoreJob:
        """The copy job for the accepted keys (a subset of ``self.keys``), in candidate order."""
        accepted = set(keys_to_store)
        unknown = accepted.difference(self.sources)
        if unknown:
            raise InvalidKeyError(
                f"{len(unknown)} key(s) to store were not candidates of this plan, e.g. "
                f"{next(iter(unknown)).hex()}"
            )
        keys: list[OffloadKey] = []
        ids: list[int] = []
        sizes = [0] * self.spec.num_groups
        first_index = [0] * self.spec.num_groups
        for key in self.keys:
            if key not in accepted:
                continue
            group_idx, pairs = self.sources[key]
            keys.append(key)
            for gpu_index, gpu_id in pairs:
                if sizes[group_idx] == 0:
                    first_index[group_idx] = gpu_index
                sizes[group_idx] += 1
                ids.append(gpu_id)
        return StoreJob(
            keys=tuple(keys),
            src_block_ids=np.asarray(ids, dtype=np.int64),
            group_sizes=tuple(sizes),
            block_indices=tuple(first_index),
        )


def plan_store(
    spec: KVCacheSpec,
    keys_per_group: Sequence[Sequence[OffloadKey]],
    gpu_block_ids_per_group: Sequence[Sequence[int]],
    first_block_idx_per_group: Sequence[int] | None = None,
) -> StoreCandidates:
    """List the offloaded blocks of a request that can be stored.

    ``keys_per_group[g][i]`` is the key of offloaded block ``i`` of group ``g``;
    ``gpu_block_ids_per_group[g]`` the request's GPU block ids of that group;
    ``first_block_idx_per_group[g]`` the first offloaded block not stored yet (default 0).
    Only offloaded blocks that are full (have a key) and whose GPU blocks are all allocated are
    candidates. ``next_block_idx`` in the result is where the next call should start.
    """
    num_groups = spec.num_groups
    if len(keys_per_group) != num_groups or len(gpu_block_ids_per_group) != num_groups:
        raise ConfigurationError(
            f"expected keys and GPU block ids for {num_groups} groups, got "
            f"{len(keys_per_group)} and {len(gpu_block_ids_per_group)}"
        )
    starts = list(first_block_idx_per_group or [0] * num_groups)
    factor = spec.block_size_factor
    keys: list[OffloadKey] = []
    sources: dict[bytes, tuple[int, tuple[tuple[int, int], ...]]] = {}
    next_idx: list[int] = []
    for g in range(num_groups):
        group_keys = keys_per_group[g]
        gpu_ids = gpu_block_ids_per_group[g]
        num_full = min(len(group_keys), len(gpu_ids) // factor)
        for i in range(starts[g], num_full):
            key = group_keys[i]
            if get_offload_group_idx(key) != g:
                raise InvalidKeyError(
                    f"key {i} of group {g} carries group index {get_offload_group_idx(key)}"
                )
            first = i * factor
            # Null blocks precede real ones inside a window, so the last sub-block decides.
            if gpu_ids[first + factor - 1] == NULL_BLOCK_ID:
                continue
            pairs = tuple(
                (first + j, int(gpu_ids[first + j]))
                for j in range(factor)
                if gpu_ids[first + j] != NULL_BLOCK_ID
            )
            keys.append(key)
            sources[key] = (g, pairs)
        next_idx.append(max(starts[g], num_full))
    return StoreCandidates(tuple(keys), spec, sources, tuple(next_idx))
