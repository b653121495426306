"""The data types of the manager protocol (vLLM's scheduler-side vocabulary)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiering.keys import OffloadKey

__all__ = ["LoadStoreSpec", "OffloadingEvent", "PrepareStoreOutput"]


@dataclass(frozen=True)
class LoadStoreSpec:
    """Where blocks live on one medium: ``block_ids[i]`` is the slot of the i-th key."""

    medium: str
    block_ids: np.ndarray

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(frozen=True)
class PrepareStoreOutput:
    """What ``prepare_store`` decided: the keys to write, their slots, and what was evicted."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


@dataclass(frozen=True)
class OffloadingEvent:
    """Keys stored on (``removed=False``) or removed from (``removed=True``) a medium."""

    keys: tuple[OffloadKey, ...]
    medium: str
    removed: bool
