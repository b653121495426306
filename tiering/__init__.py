"""tiering: a tiered store for LLM KV-cache blocks.

A CPU primary tier (LRU or ARC) backed by secondary tiers on local NVMe files and LMDB, behind
vLLM's scheduler-side offloading protocol and an asyncio interface. See README.md and
docs/architecture.md.

Engines code against :class:`OffloadingManager` (the protocol, in :mod:`tiering.protocol`) and
build a :class:`CPUOffloadingManager` or :class:`TieringOffloadingManager`. Plugin authors
subclass :class:`StorageBackend` or :class:`EvictionPolicy`; ``tiering.testing`` holds the
conformance suites (backends, policies, managers).
"""

from tiering.backends.base import BackendCapabilities, BackendStats, Outcome, StorageBackend
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
from tiering.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.hashing import ExtraKeys, MultiModalItem, PrefixHasher, hash_prefix_blocks
from tiering.keys import (
    OffloadKey,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from tiering.lookup import HybridHit, KeyState, find_hybrid_hit
from tiering.manager import CPUOffloadingManager
from tiering.policies import EvictionPolicy, register_policy
from tiering.protocol import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)
from tiering.shared_tier import SharedTier
from tiering.store_plan import StoreJob, plan_store
from tiering.tier import SecondaryTier, TierJob, WritePolicy
from tiering.tiering_manager import TieringOffloadingManager

__version__ = "0.1.0"

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


def __getattr__(name: str) -> object:
    # The config layer sits above the managers; import it only when asked for.
    if name == "load_config":
        from tiering.config import load_config

        return load_config
    raise AttributeError(f"module 'tiering' has no attribute {name!r}")
