"""``PolicyTests``, pinned (non-evictable) and protected keys: never evicted, and keeping or
regaining their recency.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import pytest

from tiering.errors import InvalidKeyError
from tiering.testing.policy_suite.base import (
    PolicyFactory,
    PolicyTestsBase,
    evict_one_by_one,
    fill,
    policy_key,
)

__all__ = ["PolicyPinningTests"]


class PolicyPinningTests(PolicyTestsBase):
    """Pinned and protected keys."""

    # -- pinned and protected keys ----------------------------------------------------------

    def test_pinned_keys_never_evicted(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(8)
        keys = fill(policy, 6)
        policy.set_evictable(keys[0], False)
        policy.set_evictable(keys[2], False)
        policy.insert(policy_key(6), evictable=False)
        victims = policy.evict(4)
        assert victims is not None
        if self.recency_ordered:
            assert victims == [keys[1], keys[3], keys[4], keys[5]]
        assert sorted(policy) == [keys[0], keys[2], policy_key(6)]
        assert policy.evict(1) is None
        policy.set_evictable(keys[2], True)
        assert policy.evict(1) == [keys[2]]

    def test_set_evictable_absent_raises_key_error(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        with pytest.raises(KeyError, match="key-00009"):
            policy.set_evictable(policy_key(9), False)
        with pytest.raises(KeyError, match="key-00009"):
            policy.set_evictable(policy_key(9), True)

    def test_set_evictable_is_idempotent(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        a, b = fill(policy, 2)
        policy.set_evictable(a, False)
        policy.set_evictable(a, False)
        policy.set_evictable(b, True)
        assert policy.evict(1) == [b]
        assert policy.evict(1) is None
        policy.set_evictable(a, True)
        policy.set_evictable(a, True)
        assert policy.evict(1) == [a]
        assert len(policy) == 0

    def test_unpinned_keys_keep_their_recency(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(16)
        keys = fill(policy, 8)
        for key in keys[:4]:
            policy.set_evictable(key, False)
        assert policy.evict(2) == [keys[4], keys[5]]  # the pinned keys were skipped
        policy.set_evictable(keys[2], True)
        policy.set_evictable(keys[0], True)
        policy.set_evictable(keys[2], False)  # pinned again: skipped again
        policy.set_evictable(keys[2], True)
        assert list(policy) == [keys[0], keys[1], keys[2], keys[3], keys[6], keys[7]]
        assert policy.evict(3) == [keys[0], keys[2], keys[6]]

    def test_touching_a_pinned_key_moves_it(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(16)
        keys = fill(policy, 4)
        policy.set_evictable(keys[0], False)
        assert policy.evict(1) == [keys[1]]
        policy.touch([keys[0]])
        policy.set_evictable(keys[0], True)
        assert evict_one_by_one(policy) == [keys[2], keys[3], keys[0]]

    def test_key_leaving_and_returning_keeps_its_latest_place(
        self, policy_factory: PolicyFactory
    ) -> None:
        self._need_recency()
        policy = policy_factory(16)
        keys = fill(policy, 6)
        policy.set_evictable(keys[0], False)
        assert policy.evict(1) == [keys[1]]  # keys[0] skipped while pinned
        policy.set_evictable(keys[0], True)
        policy.touch([keys[0]])  # now the most recent: keys[2..5], keys[0]
        for key in (keys[2], keys[3], keys[4], keys[5], keys[0]):
            policy.set_evictable(key, False)
        assert policy.evict(1) is None
        policy.set_evictable(keys[0], True)
        policy.set_evictable(keys[2], True)
        assert policy.evict(1) == [keys[2]]
        assert policy.evict(1) == [keys[0]]

    @pytest.mark.parametrize("as_type", [set, frozenset, list, tuple, dict.fromkeys])
    def test_protected_keys_never_evicted(
        self, policy_factory: PolicyFactory, as_type: Callable[[list[bytes]], Collection[bytes]]
    ) -> None:
        policy = policy_factory(8)
        keys = fill(policy, 6)
        protected = as_type([keys[0], keys[1], policy_key(99)])
        victims = policy.evict(3, protected)
        assert victims is not None
        if self.recency_ordered:
            assert victims == [keys[2], keys[3], keys[4]]
            assert list(policy) == [keys[0], keys[1], keys[5]]  # order kept
        assert keys[0] in policy and keys[1] in policy
        assert policy.evict(2, protected) is None
        assert policy.evict(1, protected) == [keys[5]]
        assert policy.evict(2) == [keys[0], keys[1]]

    def test_protected_rejects_a_single_key(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        with pytest.raises(InvalidKeyError, match="collection of keys"):
            policy.evict(1, policy_key(0))  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError, match="collection of keys"):
            policy_factory(4).evict(0, policy_key(0))  # type: ignore[arg-type]
        assert len(policy) == 2
