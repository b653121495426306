"""``PolicyTests``, removal: all-or-nothing ``evict`` (a failed one changes nothing, misses noted
for it included), ``remove`` and ``clear``.
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

    def test_misses_noted_for_a_store_that_is_dropped_change_no_held_key(
        self, policy_factory: PolicyFactory
    ) -> None:
        # A manager notes a store's misses before the eviction for them; when that eviction
        # fails (every held key pinned) the store is dropped and nothing is inserted.
        policy = policy_factory(6)
        keys = fill(policy, 6)
        policy.touch([keys[2]])
        assert policy.evict(2) is not None  # ghosts, for a policy that keeps them
        held = sorted(policy)
        missed = [*(k for k in keys if k not in policy), policy_key(50)]
        policy.set_evictable_many(held, False)
        policy.note_misses(missed)
        assert policy.evict(1) is None
        assert sorted(policy) == held and len(policy) == len(held)
        assert not any(key in policy for key in missed)
        # Noted again, the store goes through later, evicting only held keys.
        policy.set_evictable_many(held, True)
        policy.note_misses(missed[:2])
        victims = policy.evict(2)
        assert victims is not None and set(victims) <= set(held)
        policy.insert_new(missed[:2])
        assert set(missed[:2]) <= set(policy) and len(policy) == len(held)

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
