"""``ManagerTests``, loads and stores: their lifecycles, slot numbers and pins; ``None`` from
``prepare_store`` with nothing changed; failed stores; a store completed by another request.
"""

from __future__ import annotations

import pytest

from tiering.errors import ProtocolError
from tiering.testing.manager_suite.base import (
    HIT,
    HIT_PENDING,
    MISS,
    ManagerFactory,
    ManagerTestsBase,
    k,
)

__all__ = ["ManagerLoadStoreTests"]


class ManagerLoadStoreTests(ManagerTestsBase):
    """Load and store lifecycles."""

    # -- loads ------------------------------------------------------------------------------------

    def test_load_gives_the_stored_slots_in_key_order(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        out = manager.prepare_store([k(1), k(2), k(3)])
        assert out is not None
        slots = out.store_spec.block_ids.tolist()
        assert len(set(slots)) == 3 and all(0 <= s < 4 for s in slots)
        assert out.store_spec.medium == manager.medium
        manager.complete_store([k(1), k(2), k(3)])
        spec = manager.prepare_load([k(3), k(1)])
        assert spec.medium == manager.medium
        assert spec.block_ids.tolist() == [slots[2], slots[0]]
        manager.complete_load([k(3), k(1)])

    def test_pins_count_and_protect_from_eviction(self, new_manager: ManagerFactory) -> None:
        manager = new_manager(2)
        self.store(manager, [k(1), k(2)])
        manager.prepare_load([k(1)])
        manager.prepare_load([k(1), k(2)])
        assert manager.prepare_store([k(3)]) is None  # both pinned
        manager.complete_load([k(2)])
        out = manager.prepare_store([k(3)])
        assert out is not None and out.evicted_keys == [k(2)]
        manager.complete_store([k(3)])
        self.settle(manager)
        manager.complete_load([k(1)])
        assert manager.prepare_store([k(4), k(5)]) is None  # k(1) still pinned once
        manager.complete_load([k(1)])
        with pytest.raises(ProtocolError, match="only 0 load"):
            manager.complete_load([k(1)])
        out = manager.prepare_store([k(4), k(5)])
        assert out is not None and sorted(out.evicted_keys) == [k(1), k(3)]

    def test_load_misuse_raises_protocol_error_and_changes_nothing(
        self, new_manager: ManagerFactory
    ) -> None:
        manager = new_manager()
        self.store(manager, [k(1)])
        assert manager.prepare_store([k(2)]) is not None
        with pytest.raises(ProtocolError, match="is not stored"):
            manager.prepare_load([k(1), k(9)])
        with pytest.raises(ProtocolError, match="still being written"):
            manager.prepare_load([k(1), k(2)])
        with pytest.raises(ProtocolError, match="only 0 load"):
            manager.complete_load([k(1)])  # the failed calls pinned nothing
        manager.prepare_load([k(1)])
        with pytest.raises(ProtocolError, match=r"x2 but only 1 load"):
            manager.complete_load([k(1), k(1)])
        manager.complete_load([k(1)])
        assert [manager.lookup_result(x) for x in (k(1), k(2))] == [HIT, HIT_PENDING]

    def test_a_complete_load_short_of_pins_unpins_none_of_its_keys(
        self, new_manager: ManagerFactory
    ) -> None:
        manager = new_manager(2)
        self.store(manager, [k(1), k(2)])
        manager.prepare_load([k(1), k(2)])
        with pytest.raises(ProtocolError, match=r"x2 but only 1 load"):
            manager.complete_load([k(1), k(2), k(2)])  # k(1) and k(2) went to 0 before k(2)
        assert manager.prepare_store([k(3)]) is None  # both still pinned
        manager.complete_load([k(2), k(1)])
        with pytest.raises(ProtocolError, match="only 0 load"):
            manager.complete_load([k(1)])
        out = manager.prepare_store([k(3)])
        assert out is not None and len(out.evicted_keys) == 1

    # -- stores -----------------------------------------------------------------------------------

    def test_prepare_store_filters_present_and_dedupes(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        self.store(manager, [k(1)])
        out = manager.prepare_store([k(1), k(2), k(2), k(3)])
        assert out is not None
        assert out.keys_to_store == [k(2), k(3)] and out.evicted_keys == []
        assert len(out.store_spec) == 2
        empty = manager.prepare_store([k(1), k(2)])
        assert empty is not None and empty.keys_to_store == [] and len(empty.store_spec) == 0

    def test_prepare_store_none_changes_nothing(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        self.store(manager, [k(1), k(2), k(3)])
        manager.prepare_load([k(1), k(2), k(3)])
        manager.take_events()
        assert manager.prepare_store([k(4), k(5)]) is None  # one free slot, the rest pinned
        assert manager.prepare_store([k(i) for i in range(10, 15)]) is None  # over capacity
        assert manager.take_events() == []
        assert manager.lookup_result(k(1)) is HIT
        self.assert_miss(manager, k(4))
        self.assert_miss(manager, k(5))
        out = manager.prepare_store([k(4)])  # the free slot is still free
        assert out is not None and out.evicted_keys == []
        manager.complete_load([k(1), k(2), k(3)])

    def test_keys_of_the_store_call_are_protected(self, new_manager: ManagerFactory) -> None:
        self._need_lru()
        manager = new_manager(2)
        self.store(manager, [k(1), k(2)])
        out = manager.prepare_store([k(1), k(3)])  # k(1) is oldest but part of this call
        assert out is not None and out.evicted_keys == [k(2)]

    def test_failed_store_drops_unready_keys_only(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        self.store(manager, [k(1)])
        assert manager.prepare_store([k(2), k(3)]) is not None
        manager.complete_store([k(1), k(2), k(3)], success=False)
        assert manager.lookup_result(k(1)) is HIT  # already ready: untouched
        self.assert_miss(manager, k(2))
        self.assert_miss(manager, k(3))
        self.settle(manager)
        assert manager.lookup_result(k(2)) is MISS  # never reached any tier
        out = manager.prepare_store([k(4), k(5), k(6)])  # the freed slots are free again
        assert out is not None and out.evicted_keys == []

    def test_complete_store_finishes_only_the_requests_own_keys(
        self, new_manager: ManagerFactory
    ) -> None:
        """Another request that offered the same key, was handed nothing for it and completes
        every key it offered (or fails them) leaves the key to the request writing it."""
        manager = new_manager()
        mine = manager.prepare_store([k(1)], req_context="a")
        assert mine is not None and mine.keys_to_store == [k(1)]
        other = manager.prepare_store([k(1), k(2)], req_context="b")
        assert other is not None and other.keys_to_store == [k(2)]
        self.write_payloads(manager, other)
        manager.complete_store([k(1), k(2)], req_context="b")
        assert manager.lookup_result(k(1)) is HIT_PENDING  # a's, not written yet
        assert manager.lookup_result(k(2)) is HIT
        manager.complete_store([k(1)], success=False, req_context="b")
        assert manager.lookup_result(k(1)) is HIT_PENDING  # b cannot free a's slot either
        self.write_payloads(manager, mine)
        manager.complete_store([k(1)], req_context="a")
        assert manager.lookup_result(k(1)) is HIT
        self.load_exact(manager, [k(1), k(2)])

    def test_complete_store_of_unknown_keys_is_ignored(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        manager.complete_store([k(7)])
        manager.complete_store([k(8)], success=False)
        self.assert_miss(manager, k(7))
