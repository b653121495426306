"""``PolicyTests``, container behaviour: ``len``, ``in``, iteration, insert order, ``KeyError``
on a duplicate insert with no state changed, typed errors for bad keys and counts, the rule
followed (``rule`` one of ``rules``, ``rule_switches`` a counter).
"""

from __future__ import annotations

import pytest

from tiering.errors import InvalidKeyError
from tiering.testing.policy_suite.base import (
    PolicyFactory,
    PolicyTestsBase,
    evict_one_by_one,
    fill,
    policy_key,
    policy_state,
)

__all__ = ["PolicyContainerTests"]


class PolicyContainerTests(PolicyTestsBase):
    """A policy as a container of keys, and its errors."""

    # -- basic container behaviour --------------------------------------------------------

    def test_empty(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        assert len(policy) == 0
        assert list(policy) == []
        assert policy_key(0) not in policy
        assert policy.evict(1) is None
        assert policy.evict(0) == []

    def test_insert_contains_len_iter(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(8)
        keys = fill(policy, 5)
        assert len(policy) == 5
        assert sorted(policy) == keys
        assert all(key in policy for key in keys)
        assert policy_key(99) not in policy
        assert "not bytes" not in policy

    def test_insert_order_is_eviction_order(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(8)
        keys = fill(policy, 5)
        assert list(policy) == keys
        assert evict_one_by_one(policy) == keys

    def test_may_hold_more_than_capacity(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(2)
        keys = fill(policy, 5)
        assert sorted(policy) == keys  # only evict() removes keys

    def test_duplicate_insert_raises_key_error_and_changes_nothing(
        self, policy_factory: PolicyFactory
    ) -> None:
        policy = policy_factory(4)
        fill(policy, 3)
        before = policy_state(policy)
        with pytest.raises(KeyError, match="key-00001"):
            policy.insert(policy_key(1))
        with pytest.raises(KeyError, match="key-00001"):
            policy.insert(policy_key(1), evictable=False)
        assert policy_state(policy) == before
        assert policy.evict(3) is not None  # policy_key(1) stayed evictable

    @pytest.mark.parametrize("bad_key", ["key", bytearray(b"key"), 7, None, memoryview(b"k")])
    def test_insert_rejects_non_bytes_key(
        self, policy_factory: PolicyFactory, bad_key: object
    ) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        before = policy_state(policy)
        with pytest.raises(InvalidKeyError, match="must be bytes"):
            policy.insert(bad_key)  # type: ignore[arg-type]
        assert policy_state(policy) == before

    def test_touch_rejects_a_single_key(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        before = policy_state(policy)
        with pytest.raises(InvalidKeyError, match="sequence of keys"):
            policy.touch(policy_key(0))  # type: ignore[arg-type]
        assert policy_state(policy) == before

    @pytest.mark.parametrize("bad_n", [-1, 1.0, True, "1"])
    def test_evict_rejects_bad_count(self, policy_factory: PolicyFactory, bad_n: object) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        with pytest.raises(ValueError, match="number of victims"):
            policy.evict(bad_n)  # type: ignore[arg-type]
        assert len(policy) == 2

    def test_negative_capacity_rejected(self, policy_factory: PolicyFactory) -> None:
        with pytest.raises(ValueError, match="capacity"):
            policy_factory(-1)

    # -- the rule followed (read by metrics) ----------------------------------------------------

    def test_rule_is_one_of_rules_and_switches_only_grow(
        self, policy_factory: PolicyFactory
    ) -> None:
        policy = policy_factory(4)
        seen = [policy.rule_switches]
        for round_ in range(40):  # a scan with keys used twice among it: adaptive rules move
            key = policy_key(round_)
            if len(policy) >= 4:
                assert policy.evict(1) is not None
            policy.insert(key)
            policy.touch([key] if round_ % 3 else [])
            rules = policy.rules
            assert isinstance(rules, tuple) and rules and all(isinstance(r, str) for r in rules)
            assert policy.rule in rules, (policy.rule, rules)
            switches = policy.rule_switches
            assert type(switches) is int and switches >= seen[-1]
            seen.append(switches)
        policy.clear()
        assert policy.rule in policy.rules
        assert policy.rule_switches == seen[-1]  # a counter: clear() keeps it
