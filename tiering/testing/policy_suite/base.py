"""The base of ``PolicyTests``: the ``policy_factory`` fixture a subclass overrides, the
``recency_ordered`` switch, and the helpers the topic mixins (and other tests) use: keys that
sort like their numbers, ``fill``, a policy's observable state, single evictions until refused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import pytest

from tiering.policies.base import EvictionPolicy

__all__ = [
    "PolicyFactory",
    "PolicyTestsBase",
    "evict_one_by_one",
    "fill",
    "policy_key",
    "policy_state",
]

#: What the ``policy_factory`` fixture returns: a new policy of the given capacity.
PolicyFactory = Callable[[int], EvictionPolicy]


def policy_key(i: int) -> bytes:
    """The ``i``-th test key (sorts like ``i``)."""
    return b"key-%05d" % i


def fill(policy: EvictionPolicy, count: int) -> list[bytes]:
    """Insert keys ``0..count-1`` in order; return them."""
    keys = [policy_key(i) for i in range(count)]
    for key in keys:
        policy.insert(key)
    return keys


def policy_state(policy: EvictionPolicy) -> dict[str, Any]:
    """Everything observable about a policy, including ARC-style history when it exposes it."""
    state: dict[str, Any] = {"order": list(policy), "len": len(policy)}
    for name in ("target_t1_size", "t1_keys", "t2_keys", "b1_keys", "b2_keys"):
        if hasattr(policy, name):
            state[name] = getattr(policy, name)
    return state


def evict_one_by_one(policy: EvictionPolicy) -> list[bytes]:
    """Evict single victims until the policy refuses; return them in order."""
    victims = []
    while (got := policy.evict(1)) is not None:
        victims += got
    return victims


class PolicyTestsBase:
    """What every topic of ``PolicyTests`` builds on: the fixture, the ``recency_ordered``
    switch, and the policy histories several topics start from."""

    recency_ordered: ClassVar[bool] = True

    @pytest.fixture
    def policy_factory(self) -> PolicyFactory:
        raise NotImplementedError("override the policy_factory fixture")

    def _need_recency(self) -> None:
        if not self.recency_ordered:
            pytest.skip("exact-order test for recency policies")

    def _history(self, policy: EvictionPolicy) -> list[bytes]:
        """A policy with evictions, touches and a pin behind it (ARC: ghosts in B1 and B2).

        Returns the three victims (LRU, ARC: the first three keys filled), then the held keys
        in fill order; the first held one (LRU, ARC: ``keys[3]``) is pinned."""
        keys = fill(policy, 6)
        policy.touch([keys[4], keys[5]])
        victims = policy.evict(3)
        assert victims is not None and len(victims) == 3
        keys = [*victims, *(key for key in keys if key not in victims)]
        policy.set_evictable(keys[3], False)
        return keys
