"""tiering: a tiered store for LLM KV-cache blocks.

A CPU primary tier (LRU or ARC) backed by secondary tiers on local NVMe files, LMDB and Redis,
behind vLLM's scheduler-side offloading protocol and an asyncio interface. See README.md and
docs/architecture.md for the layers: ``core`` -> ``model`` -> ``policies`` -> ``backends`` ->
``managers`` -> ``transfer`` -> ``config`` -> ``embed``/``observability`` ->
``replay``/``integrations`` -> ``cli``/``testing``.

Engines code against :class:`OffloadingManager` (the protocol, in
:mod:`tiering.managers.protocol`) and build a :class:`CPUOffloadingManager` or
:class:`TieringOffloadingManager`. Plugin authors subclass :class:`StorageBackend` or
:class:`EvictionPolicy`; ``tiering.testing`` holds the conformance suites (backends, policies,
managers).

The names below are imported on first use: ``import tiering`` (and with it ``tiering.errors``
or ``tiering.cli``) costs no torch import until a name that needs it is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    **dict.fromkeys(
        ["BackendCapabilities", "BackendStats", "Outcome", "StorageBackend"],
        "tiering.backends.base",
    ),
    **dict.fromkeys(
        [
            "BackendError",
            "ConfigError",
            "ConfigurationError",
            "CorruptBlockError",
            "InvalidArgumentError",
            "InvalidKeyError",
            "LayoutError",
            "ProtocolError",
            "TieringError",
            "UnsafeFileError",
        ],
        "tiering.errors",
    ),
    **dict.fromkeys(["GroupKind", "KVCacheGroup", "KVCacheSpec"], "tiering.core.groups"),
    **dict.fromkeys(
        ["ExtraKeys", "MultiModalItem", "PrefixHasher", "hash_prefix_blocks"],
        "tiering.core.hashing",
    ),
    **dict.fromkeys(
        ["OffloadKey", "get_offload_block_hash", "get_offload_group_idx", "make_offload_key"],
        "tiering.core.keys",
    ),
    **dict.fromkeys(["HybridHit", "KeyState", "find_hybrid_hit"], "tiering.core.lookup"),
    **dict.fromkeys(["StoreJob", "plan_store"], "tiering.core.store_plan"),
    **dict.fromkeys(["EvictionPolicy", "register_policy"], "tiering.policies"),
    **dict.fromkeys(
        [
            "LoadStoreSpec",
            "LookupResult",
            "OffloadingEvent",
            "OffloadingManager",
            "PrepareStoreOutput",
        ],
        "tiering.managers.protocol",
    ),
    "CPUOffloadingManager": "tiering.managers.cpu_manager",
    **dict.fromkeys(["SecondaryTier", "TierJob", "WritePolicy"], "tiering.managers.secondary_tier"),
    "SharedTier": "tiering.managers.shared_tier",
    "TieringOffloadingManager": "tiering.managers.tiering_manager",
    "load_config": "tiering.config",
}

# Literal, for linters and type checkers; test_public_api checks it against _EXPORTS.
__all__ = [
    "BackendCapabilities",
    "BackendError",
    "BackendStats",
    "CPUOffloadingManager",
    "ConfigError",
    "ConfigurationError",
    "CorruptBlockError",
    "EvictionPolicy",
    "ExtraKeys",
    "GroupKind",
    "HybridHit",
    "InvalidArgumentError",
    "InvalidKeyError",
    "KVCacheGroup",
    "KVCacheSpec",
    "KeyState",
    "LayoutError",
    "LoadStoreSpec",
    "LookupResult",
    "MultiModalItem",
    "OffloadKey",
    "OffloadingEvent",
    "OffloadingManager",
    "Outcome",
    "PrefixHasher",
    "PrepareStoreOutput",
    "ProtocolError",
    "SecondaryTier",
    "SharedTier",
    "StorageBackend",
    "StoreJob",
    "TierJob",
    "TieringError",
    "TieringOffloadingManager",
    "UnsafeFileError",
    "WritePolicy",
    "__version__",
    "find_hybrid_hit",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "hash_prefix_blocks",
    "load_config",
    "make_offload_key",
    "plan_store",
    "register_policy",
]

if TYPE_CHECKING:
    from tiering.backends.base import BackendCapabilities, BackendStats, Outcome, StorageBackend
    from tiering.config import load_config
    from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
    from tiering.core.hashing import ExtraKeys, MultiModalItem, PrefixHasher, hash_prefix_blocks
    from tiering.core.keys import (
        OffloadKey,
        get_offload_block_hash,
        get_offload_group_idx,
        make_offload_key,
    )
    from tiering.core.lookup import HybridHit, KeyState, find_hybrid_hit
    from tiering.core.store_plan import StoreJob, plan_store
    from tiering.errors import (
        BackendError,
        ConfigError,
        ConfigurationError,
        CorruptBlockError,
        InvalidArgumentError,
        InvalidKeyError,
        LayoutError,
        ProtocolError,
        TieringError,
        UnsafeFileError,
    )
    from tiering.managers.cpu_manager import CPUOffloadingManager
    from tiering.managers.protocol import (
        LoadStoreSpec,
        LookupResult,
        OffloadingEvent,
        OffloadingManager,
        PrepareStoreOutput,
    )
    from tiering.managers.secondary_tier import SecondaryTier, TierJob, WritePolicy
    from tiering.managers.shared_tier import SharedTier
    from tiering.managers.tiering_manager import TieringOffloadingManager
    from tiering.policies import EvictionPolicy, register_policy


def __getattr__(name: str) -> object:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'tiering' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return __all__
