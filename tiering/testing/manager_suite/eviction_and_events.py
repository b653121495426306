"""``ManagerTests``, eviction, events and reset: exact LRU eviction order and ``touch``; events
(order, media, owners, and none when disabled); ``reset_cache``; ``shutdown`` idempotent.
"""

from __future__ import annotations

import pytest

from tiering.errors import ProtocolError
from tiering.managers.protocol import OffloadingEvent
from tiering.testing.manager_suite.base import HIT_PENDING, ManagerFactory, ManagerTestsBase, k

__all__ = ["ManagerEvictionEventTests"]


class ManagerEvictionEventTests(ManagerTestsBase):
    """Eviction, events, reset and shutdown."""

    # -- eviction ---------------------------------------------------------------------------------

    def test_lru_eviction_order_and_touch(self, new_manager: ManagerFactory) -> None:
        self._need_lru()
        manager = new_manager(3)
        self.store(manager, [k(1), k(2), k(3)])
        manager.touch([k(1), k(2)])  # order now 3, 2, 1 (1 most recent)
        assert self.store(manager, [k(4)]) == [k(3)]
        assert self.store(manager, [k(5), k(6)]) == [k(2), k(1)]
        for key in (k(1), k(2), k(3)):
            assert manager.lookup_result(key) in self.evicted_answer()

    def test_blocks_being_written_are_not_evicted(self, new_manager: ManagerFactory) -> None:
        manager = new_manager(2)
        self.store(manager, [k(1)])
        assert manager.prepare_store([k(2)]) is not None  # in flight
        out = manager.prepare_store([k(3)])
        assert out is not None and out.evicted_keys == [k(1)]
        assert manager.prepare_store([k(4)]) is None  # both in flight
        assert manager.lookup_result(k(2)) is HIT_PENDING

    # -- events -----------------------------------------------------------------------------------

    def test_events_in_order(self, new_manager: ManagerFactory) -> None:
        manager = new_manager(1)
        self.store(manager, [k(1)])
        self.store(manager, [k(2)])
        assert self.primary_events(manager) == [
            OffloadingEvent((k(1),), manager.medium, False),
            OffloadingEvent((k(1),), manager.medium, True),
            OffloadingEvent((k(2),), manager.medium, False),
        ]
        assert manager.take_events() == []

    def test_failed_store_emits_no_stored_event(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        assert manager.prepare_store([k(1)]) is not None
        manager.complete_store([k(1)], success=False)
        self.settle(manager)
        assert manager.take_events() == []

    def test_no_events_when_disabled(self, new_manager: ManagerFactory) -> None:
        manager = new_manager(1, enable_events=False)
        self.store(manager, [k(1)])
        self.store(manager, [k(2)])
        self.settle(manager)
        assert manager.take_events() == []

    # -- reset and lifecycle ----------------------------------------------------------------------

    def test_reset_cache_drops_everything(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        self.store(manager, [k(1), k(2)])
        manager.prepare_load([k(1)])
        assert manager.prepare_store([k(3)]) is not None
        self.settle(manager)
        manager.take_events()
        manager.reset_cache()
        for key in (k(1), k(2), k(3)):
            self.assert_miss(manager, key)
        removed = [e for e in self.primary_events(manager) if e.removed]
        assert sorted(key for e in removed for key in e.keys) == [k(1), k(2), k(3)]
        with pytest.raises(ProtocolError):
            manager.complete_load([k(1)])  # the pin went with the block
        out = manager.prepare_store([k(4), k(5), k(6), k(7)])  # every slot is free again
        assert out is not None and out.evicted_keys == []

    def test_shutdown_is_idempotent(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        self.store(manager, [k(1)])
        manager.shutdown()
        manager.shutdown()
