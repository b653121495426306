"""Eviction policies: the interface, LRU, ARC, hybrid LRU/ARC, chain classes and lookup by name."""

from tiering.policies.arc import ARCPolicy
from tiering.policies.arc_vllm import VLLMARCPolicy
from tiering.policies.base import EvictionPolicy
from tiering.policies.chain import ChainPolicy
from tiering.policies.hybrid import HybridPolicy
from tiering.policies.lru import LRUPolicy
from tiering.policies.registry import (
    available_policies,
    get_policy_class,
    make_policy,
    register_policy,
)

__all__ = [
    "ARCPolicy",
    "ChainPolicy",
    "EvictionPolicy",
    "HybridPolicy",
    "LRUPolicy",
    "VLLMARCPolicy",
    "available_policies",
    "get_policy_class",
    "make_policy",
    "register_policy",
]
