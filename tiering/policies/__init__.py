"""Eviction policies for the primary tier: the interface, LRU, ARC, SLRU and lookup by name."""

from tiering.policies.arc import ARCPolicy
from tiering.policies.base import EvictionPolicy
from tiering.policies.lru import LRUPolicy
from tiering.policies.registry import (
    available_policies,
    get_policy_class,
    make_policy,
    register_policy,
)
from tiering.policies.slru import SLRUPolicy

__all__ = [
    "ARCPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "SLRUPolicy",
    "available_policies",
    "get_policy_class",
    "make_policy",
    "register_policy",
]
