"""``PolicyTests``, recency: ``touch`` and ``refresh`` order (a refresh is not a use), absent
keys ignored, a single key instead of a sequence rejected; a request's notes with a hint keep
what is held and evictable (``hints_followed``, if the policy counts them, a counter), and a
bad hint changes nothing.
"""

from __future__ import annotations

import pytest

from tiering.errors import InvalidArgumentError, InvalidKeyError
from tiering.policies.base import takes_hints
from tiering.testing.policy_suite.base import (
    PolicyFactory,
    PolicyTestsBase,
    evict_one_by_one,
    fill,
    policy_key,
    policy_state,
)

__all__ = ["PolicyRecencyTests"]


class PolicyRecencyTests(PolicyTestsBase):
    """``touch`` and ``refresh``."""

    # -- touch ------------------------------------------------------------------------------

    def test_touch_first_key_ends_most_recent(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(8)
        a, b, c = fill(policy, 3)
        policy.touch([a, b, c])
        assert evict_one_by_one(policy) == [c, b, a]

    def test_touch_order_exact(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(8)
        keys = fill(policy, 6)
        policy.touch([keys[1], policy_key(77), keys[3], keys[0]])  # an absent key is ignored
        expected = [keys[2], keys[4], keys[5], keys[0], keys[3], keys[1]]
        assert list(policy) == expected
        assert policy.evict(6) == expected

    def test_touch_absent_keys_is_a_no_op(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        fill(policy, 3)
        before = policy_state(policy)
        policy.touch([policy_key(50), policy_key(51)])
        policy.touch([])
        assert policy_state(policy) == before

    # -- refresh (recency without a use) -----------------------------------------------------

    def test_refresh_order_exact(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(8)
        keys = fill(policy, 6)
        policy.refresh([keys[1], policy_key(77), keys[3], keys[0]])  # an absent key is ignored
        expected = [keys[2], keys[4], keys[5], keys[0], keys[3], keys[1]]
        assert list(policy) == expected
        assert policy.evict(6) == expected

    def test_refresh_is_not_a_use(self, policy_factory: PolicyFactory) -> None:
        """Refreshing keys never used since their insert leaves a recency policy as if they had
        been inserted last, in refresh order (``keys[0]`` last): no use is counted."""
        self._need_recency()
        policy, twin = policy_factory(6), policy_factory(6)
        keys = fill(policy, 6)
        policy.refresh([keys[1], keys[4]])
        for i in (0, 2, 3, 5, 4, 1):
            twin.insert(keys[i])
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)

    def test_refresh_after_history_is_not_a_use(self, policy_factory: PolicyFactory) -> None:
        """The same with ghosts and a pin behind it: new keys refreshed, then evicted, come out
        as keys inserted in that order would."""
        self._need_recency()
        policy, twin = policy_factory(6), policy_factory(6)
        self._history(policy)
        self._history(twin)
        new = [policy_key(10), policy_key(11), policy_key(12)]
        policy.insert_many(new)
        policy.refresh([new[0], new[1]])
        twin.insert_many([new[2], new[1], new[0]])
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)

    def test_refresh_absent_keys_is_a_no_op(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        keys = fill(policy, 4)
        policy.touch([keys[3]])
        policy.evict(2)  # ghosts, for a policy that keeps them
        before = policy_state(policy)
        policy.refresh([keys[0], keys[1], policy_key(50)])
        policy.refresh([])
        assert policy_state(policy) == before

    def test_refresh_rejects_a_single_key(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        before = policy_state(policy)
        with pytest.raises(InvalidKeyError, match="sequence of keys"):
            policy.refresh(policy_key(0))  # type: ignore[arg-type]
        assert policy_state(policy) == before

    # -- requests, with a hint ----------------------------------------------------------------

    def test_a_hinted_request_keeps_what_is_held_and_evictable(
        self, policy_factory: PolicyFactory
    ) -> None:
        policy = policy_factory(8)
        if not takes_hints(policy):
            pytest.skip("the policy takes no hints (a manager keeps them from it)")
        fill(policy, 6)
        policy.set_evictable(policy_key(1), False)
        held = sorted(policy)
        followed = policy.hints_followed
        request = [policy_key(i) for i in (0, 1, 2, 40, 41)]  # held, pinned, held, absent
        policy.note_request(request, continues=True)
        policy.note_request([policy_key(3), policy_key(42)], continues=False)
        policy.note_finished_request(request, continues=False)
        policy.note_request([policy_key(4)], continues=None)
        assert sorted(policy) == held
        victims = policy.evict(5)
        assert victims is not None and policy_key(1) not in victims
        assert policy.evict(1) is None  # the pinned key stays
        # The hints followed: none (a policy that follows no hints), or a counter that counted
        # at most the three hinted requests and that clear() keeps.
        counted = policy.hints_followed
        if followed is None:
            assert counted is None
        else:
            assert type(counted) is int and followed <= counted <= followed + 3
            policy.clear()
            assert policy.hints_followed == counted

    @pytest.mark.parametrize("hint", ["yes", 1, 0.0])
    def test_a_hint_other_than_a_bool_or_none_is_refused(
        self, policy_factory: PolicyFactory, hint: object
    ) -> None:
        policy = policy_factory(4)
        if not takes_hints(policy):
            pytest.skip("the policy takes no hints (a manager keeps them from it)")
        fill(policy, 3)
        before = (policy_state(policy), policy.hints_followed)
        with pytest.raises(InvalidArgumentError, match="continues must be True, False or None"):
            policy.note_request([policy_key(0), policy_key(9)], continues=hint)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="continues must be True, False or None"):
            policy.note_finished_request([policy_key(0)], continues=hint)  # type: ignore[arg-type]
        assert (policy_state(policy), policy.hints_followed) == before
