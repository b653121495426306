"""``PolicyTests``: the conformance suite for :class:`~tiering.policies.base.EvictionPolicy`
implementations, shipped in the package so that plugin authors can run it on their own policies.

How to use it
-------------
Subclass it in a test module (the class name must start with ``Test``) and override the
``policy_factory`` fixture, which returns a callable ``capacity -> policy``::

    import pytest

    from tiering.testing import PolicyTests
    from tiering.testing.policy_tests import PolicyFactory
    from mypkg import MyPolicy


    class TestMyPolicy(PolicyTests):
        recency_ordered = False  # True only if victims come out in LRU order

        @pytest.fixture
        def policy_factory(self) -> PolicyFactory:
            return MyPolicy

What it checks (the contract in :mod:`tiering.policies.base`): container behaviour (``len``,
``in``, iteration), ``KeyError`` on a duplicate insert with no state changed, the batch forms
(``insert_many``, ``set_evictable_many``) equal to their one-key calls and checking every key
before changing anything, typed errors for bad keys and counts, ``touch`` and ``refresh``
order (a refresh is not a use), pinned (non-evictable) and protected keys never evicted,
all-or-nothing ``evict``, ``remove`` and ``clear``, the rule followed (``rule``, one of ``rules``;
``rule_switches`` only grows), and that evicting past thousands of pinned
keys is not a scan. Requires pytest.
"""

from __future__ import annotations

from tiering.testing.policy_suite.base import (
    PolicyFactory,
    PolicyTestsBase,
    evict_one_by_one,
    fill,
    policy_key,
    policy_state,
)
from tiering.testing.policy_suite.batches import PolicyBatchTests
from tiering.testing.policy_suite.container import PolicyContainerTests
from tiering.testing.policy_suite.cost import PolicyCostTests, python_steps  # noqa: F401 (re-exported)
from tiering.testing.policy_suite.pinning import PolicyPinningTests
from tiering.testing.policy_suite.recency import PolicyRecencyTests
from tiering.testing.policy_suite.removal import PolicyRemovalTests

__all__ = ["PolicyFactory", "PolicyTests", "evict_one_by_one", "fill", "policy_key", "policy_state"]


# The topics are listed last first: pytest collects a class's bases before the class itself, in
# reverse method resolution order, so this runs them in the order of the topics (container,
# batches, recency, pinning, removal, cost).
class PolicyTests(
    PolicyCostTests,
    PolicyRemovalTests,
    PolicyPinningTests,
    PolicyRecencyTests,
    PolicyBatchTests,
    PolicyContainerTests,
    PolicyTestsBase,
):
    """Conformance suite for :class:`EvictionPolicy` implementations (see the module docstring).

    Subclass it and override the ``policy_factory`` fixture (``capacity -> policy``). Tests of
    exact victim order assume a recency policy (LRU-like until keys are touched twice); a policy
    that orders keys otherwise sets ``recency_ordered = False`` to skip them.
    """
