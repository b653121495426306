"""tiering: a tiered store for LLM KV-cache blocks.

A CPU primary tier (LRU or ARC) backed by secondary tiers on local NVMe files and LMDB, behind
vLLM's scheduler-side offloading protocol and an asyncio interface. See README.md and
docs/architecture.md.
"""

from tiering.errors import (
    BackendError,
    ConfigError,
    ConfigurationError,
    CorruptBlockError,
    InvalidKeyError,
    LayoutError,
    ProtocolError,
    TierFullError,
    TieringError,
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
from tiering.specs import LoadStoreSpec, OffloadingEvent, PrepareStoreOutput
from tiering.store_plan import StoreJob, plan_store
from tiering.tier import SecondaryTier, WritePolicy
from tiering.tiering_manager import TieringOffloadingManager

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "CPUOffloadingManager",
    "ConfigError",
    "ConfigurationError",
    "CorruptBlockError",
    "ExtraKeys",
    "GroupKind",
    "HybridHit",
    "InvalidKeyError",
    "KVCacheGroup",
    "KVCacheSpec",
    "KeyState",
    "LayoutError",
    "LoadStoreSpec",
    "MultiModalItem",
    "OffloadKey",
    "OffloadingEvent",
    "PrefixHasher",
    "PrepareStoreOutput",
    "ProtocolError",
    "SecondaryTier",
    "StoreJob",
    "TierFullError",
    "TieringError",
    "TieringOffloadingManager",
    "WritePolicy",
    "__version__",
    "find_hybrid_hit",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "hash_prefix_blocks",
    "load_config",
    "make_offload_key",
    "plan_store",
]


def __getattr__(name: str) -> object:
    # The config layer sits above the managers; import it only when asked for.
    if name == "load_config":
        from tiering.config import load_config

        return load_config
    raise AttributeError(f"module 'tiering' has no attribute {name!r}")
