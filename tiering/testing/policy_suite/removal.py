"""``PolicyTests``, removal: all-or-nothing ``evict`` (a failed one changes nothing), ``remove``
and ``clear``.
"""

from __future__ import annotations

from tiering.policies.base import EvictionPolicy
from tiering.testing.policy_suite.base import (
    PolicyFactory,
    PolicyTestsBase,
    evict_one_by_one,
    fill,
    policy_key,
    policy_state,
)

__all__ = ["PolicyRemovalTests"]


class PolicyRemovalTests(PolicyTestsBase):
    """All-or-nothing eviction, ``remove``, ``clear``."""

    # -- all or nothing ---------------------------------------------------------------------

    def _build_for_failure(self, policy: EvictionPolicy) -> list[bytes]:
        keys = fill(policy, 8)
        policy.touch([keys[5], keys[1]])
        policy.evict(1)
        policy.insert(policy_key(20))
        policy.touch([keys[6]])
        policy.set_evictable(keys[3], False)
        policy.insert(policy_key(21), evictable=False)
        return keys

    def test_failed_evict_changes_nothing(self, policy_factory: PolicyFactory) -> None:
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._build_for_failure(policy)
        self._build_for_failure(twin)
        before = policy_state(policy)
        available = len(policy) - 2  # two pinned keys
        protected = {keys[6], keys[1], policy_key(20)}
        assert policy.evict(available + 1) is None
        assert policy_state(policy) == before
        assert policy.evict(available - 2, protected) is None
        assert policy_state(policy) == before
        # Behaviour afterwards is the twin's, which never saw the failures.
        assert policy.evict(2, protected) == twin.evict(2, protected)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)
        assert policy_state(policy) == policy_state(twin)

    # -- remove and clear -------------------------------------------------------------------

    def test_remove(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(8)
        keys = fill(policy, 4)
        policy.set_evictable(keys[2], False)
        policy.remove(keys[1])
        policy.remove(keys[2])  # a pinned key can be removed
        policy.remove(policy_key(99))  # absent: ignored
        assert sorted(policy) == [keys[0], keys[3]]
        assert keys[1] not in policy and len(policy) == 2
        policy.insert(keys[2])  # removed keys can come back, evictable as asked
        assert sorted(policy.evict(3) or []) == [keys[0], keys[2], keys[3]]

    def test_clear(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        keys = fill(policy, 6)
        policy.set_evictable(keys[0], False)
        policy.evict(2)
        policy.clear()
        assert len(policy) == 0 and list(policy) == []
        assert policy.evict(1) is None
        assert policy_state(policy) == policy_state(policy_factory(4))
        policy.insert(keys[0])  # no longer pinned, no longer present
        assert policy.evict(1) == [keys[0]]
