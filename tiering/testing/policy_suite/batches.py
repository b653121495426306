"""``PolicyTests``, the batch forms: ``insert_many``, ``insert_new``, ``set_evictable_many`` and
``pin_evictable`` equal to their one-key calls, and checking every key before changing
anything.
"""

from __future__ import annotations

import pytest

from tiering.errors import InvalidKeyError
from tiering.testing.policy_suite.base import (
    PolicyFactory,
    PolicyTestsBase,
    evict_one_by_one,
    policy_key,
    policy_state,
)

__all__ = ["PolicyBatchTests"]


class PolicyBatchTests(PolicyTestsBase):
    """Batch calls are their one-key calls."""

    # -- batch forms ------------------------------------------------------------------------

    @pytest.mark.parametrize("evictable", [True, False])
    def test_insert_many_is_insert_one_by_one(
        self, policy_factory: PolicyFactory, evictable: bool
    ) -> None:
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        batch = [keys[0], policy_key(10), keys[1], policy_key(11), keys[2], policy_key(12)]
        policy.insert_many(batch, evictable)
        for key in batch:
            twin.insert(key, evictable)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)
        assert policy_state(policy) == policy_state(twin)

    @pytest.mark.parametrize("evictable", [True, False])
    def test_insert_new_is_insert_many(
        self, policy_factory: PolicyFactory, evictable: bool
    ) -> None:
        """``insert_new`` (keys the caller checked: absent, once each) does what
        ``insert_many`` does with the same keys, ghosts and adaptation included."""
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        batch = [keys[0], policy_key(10), keys[1], policy_key(11), keys[2], policy_key(12)]
        policy.insert_new(batch, evictable)
        twin.insert_many(batch, evictable)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)
        assert policy_state(policy) == policy_state(twin)

    @pytest.mark.parametrize(
        ("batch", "error", "match"),
        [
            # Ints are indexes into _history's keys (4: held; 3: held, pinned).
            ([policy_key(10), 4], KeyError, 4),  # present
            ([policy_key(10), 3], KeyError, 3),  # present, pinned
            ([policy_key(10), policy_key(11), policy_key(10)], KeyError, "key-00010"),  # twice
            ([policy_key(10), "key"], InvalidKeyError, "must be bytes"),
        ],
    )
    def test_insert_many_checks_every_key_before_inserting_any(
        self,
        policy_factory: PolicyFactory,
        batch: list[object],
        error: type[Exception],
        match: str | int,
    ) -> None:
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        listed = [keys[item] if isinstance(item, int) else item for item in batch]
        if isinstance(match, int):
            match = keys[match].decode()
        with pytest.raises(error, match=match):
            policy.insert_many(listed)  # type: ignore[arg-type]
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)

    @pytest.mark.parametrize("evictable", [True, False])
    def test_set_evictable_many_is_set_evictable_one_by_one(
        self, policy_factory: PolicyFactory, evictable: bool
    ) -> None:
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        batch = [key for key in keys if key in policy]  # pinned and evictable ones
        policy.set_evictable_many(batch, evictable)
        for key in batch:
            twin.set_evictable(key, evictable)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)

    def test_pin_evictable_is_set_evictable_many_false(self, policy_factory: PolicyFactory) -> None:
        """The unchecked pin (held, evictable keys, once each), then letting them go, leaves
        the policy as the checked calls do."""
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        batch = [key for key in keys if key in policy and key != keys[3]]  # keys[3] is pinned
        policy.pin_evictable(batch)
        twin.set_evictable_many(batch, False)
        assert policy_state(policy) == policy_state(twin)
        assert policy.evict(1) is None and twin.evict(1) is None  # every held key is pinned
        policy.set_evictable_many(batch[::-1], True)
        twin.set_evictable_many(batch[::-1], True)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)

    @pytest.mark.parametrize("evictable", [True, False])
    def test_set_evictable_many_with_an_absent_key_changes_nothing(
        self, policy_factory: PolicyFactory, evictable: bool
    ) -> None:
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        batch = [key for key in keys if key in policy] + [policy_key(99)]
        with pytest.raises(KeyError, match="key-00099"):
            policy.set_evictable_many(batch, evictable)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)
        assert policy_state(policy) == policy_state(twin)
