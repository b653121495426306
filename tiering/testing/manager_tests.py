"""``ManagerTests``: the conformance suite every
:class:`~tiering.managers.protocol.OffloadingManager`
must pass, shipped in the package so that engine-adapter and remote-tier authors can run it on
their own managers.

How to use it
-------------
Subclass it in a test module (the class name must start with ``Test``) and implement
:meth:`ManagerTests.make_manager`; set the class attributes that describe your manager::

    import numpy as np
    import torch

    from tiering import CPUOffloadingManager, SecondaryTier, TieringOffloadingManager
    from tiering.testing import ManagerTests


    class TestMyManager(ManagerTests):
        has_lower_tiers = True  # evicted blocks live on below the primary and come back

        def make_manager(self, num_blocks, *, store_threshold=1, enable_events=True):
            pool = torch.zeros(num_blocks, 4096, dtype=torch.uint8)
            manager = TieringOffloadingManager(
                CPUOffloadingManager(num_blocks, store_threshold=store_threshold),
                [SecondaryTier(make_my_backend(block_bytes=4096))],
                pool=pool, enable_events=enable_events, step_driven=True,
            )
            self.remember_rows(manager, pool.numpy())  # enables the bit-exact checks
            return manager

        def settle(self, manager):
            manager.wait_idle()  # a step boundary with the step's I/O done

Requirements: pytest. Each test builds its managers with the ``new_manager`` fixture, which shuts
them down afterwards, so no fixture needs overriding.

What it checks (the contract in :class:`tiering.managers.protocol.OffloadingManager`): lookup
answers in
every block state and ``lookup`` agreeing with ``lookup_result``; prefix lookups; hybrid lookups
and the ``engine_recomputes_last_token`` alignment; load and store lifecycles, slot numbers and
pins; ``None`` from ``prepare_store`` with nothing changed; failed stores; exact LRU eviction
order and ``touch``; events (order, media, owners, and none when disabled); ``reset_cache``;
request hooks and contexts; ``store_threshold``; ``get_stats`` deltas and ``config_info``;
misuse errors (typed, naming the argument, nothing changed); the same answers from the same
calls on every run for a step-driven manager; ``shutdown`` idempotent. With
``has_lower_tiers``: an evicted block is promoted back (``RETRY``, then ``HIT``) bit-exact.
With ``shared_lower_tier`` (the lowest tier is shared with other managers: a
:class:`~tiering.managers.shared_tier.SharedTier`): a key no tier holds answers ``RETRY`` until the
shared tier's existence check has settled, then ``MISS``; the shared tier emits no events.
"""

from __future__ import annotations

from tiering.testing.manager_suite.base import ManagerFactory, ManagerTestsBase, manager_key
from tiering.testing.manager_suite.eviction_and_events import ManagerEvictionEventTests
from tiering.testing.manager_suite.loads_and_stores import ManagerLoadStoreTests
from tiering.testing.manager_suite.lookups import ManagerLookupTests
from tiering.testing.manager_suite.lower_tiers import ManagerLowerTierTests
from tiering.testing.manager_suite.misuse import ManagerMisuseTests
from tiering.testing.manager_suite.requests import ManagerRequestTests

__all__ = ["ManagerFactory", "ManagerTests", "manager_key"]


# The topics are listed last first: pytest collects a class's bases before the class itself, in
# reverse method resolution order, so this runs them in the order of the topics (lookups, loads
# and stores, eviction and events, requests, misuse, lower tiers).
class ManagerTests(
    ManagerLowerTierTests,
    ManagerMisuseTests,
    ManagerRequestTests,
    ManagerEvictionEventTests,
    ManagerLoadStoreTests,
    ManagerLookupTests,
    ManagerTestsBase,
):
    """The shared conformance tests; subclass it and implement :meth:`make_manager`."""
