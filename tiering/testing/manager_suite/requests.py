"""``ManagerTests``, requests, steps and stats: request hooks and contexts; a request's keys
told with a hint; step ends and pending work; ``store_threshold``; ``get_stats`` deltas and
``config_info``.
"""

from __future__ import annotations

import pytest

from tiering.errors import InvalidArgumentError
from tiering.testing.manager_suite.base import HIT, HIT_PENDING, ManagerFactory, ManagerTestsBase, k

__all__ = ["ManagerRequestTests"]


class _Request:
    """A request context as engines pass them: an object with a ``req_id`` (unhashable)."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id


class ManagerRequestTests(ManagerTestsBase):
    """Request contexts, steps, stats."""

    # -- requests, steps, stats -------------------------------------------------------------------

    @pytest.mark.parametrize(
        "context", [None, "req-1", 7, _Request("req-2")], ids=["none", "str", "int", "req_id"]
    )
    def test_request_hooks_and_contexts(self, new_manager: ManagerFactory, context: object) -> None:
        manager = new_manager()
        manager.on_new_request(context)
        self.store(manager, [k(1), k(2)], req_context=context)
        assert manager.lookup_result(k(1), req_context=context) is HIT
        assert manager.lookup(k(2), req_context=context) is True
        assert self.settled_prefix(manager, [k(1), k(2), k(3)], req_context=context) == 2
        manager.touch([k(1)], req_context=context)
        spec = manager.prepare_load([k(1)], req_context=context)
        manager.complete_load([k(1)], req_context=context)
        assert len(spec) == 1
        manager.on_request_finished(context)
        manager.on_schedule_end()
        assert manager.lookup_result(k(1)) is HIT

    def test_a_request_told_with_a_hint_serves_what_it_held(
        self, new_manager: ManagerFactory
    ) -> None:
        manager = new_manager()
        self.store(manager, [k(1), k(2)])
        for hint in (True, False, None):
            manager.note_request([k(1), k(2), k(3)], continues=hint)
        manager.note_request([k(1), k(2)], ended=True, continues=True)
        assert [manager.lookup_result(key) for key in (k(1), k(2))] == [HIT, HIT]
        for bad in ("yes", 1):
            with pytest.raises(InvalidArgumentError, match="continues must be True, False or"):
                manager.note_request([k(1)], continues=bad)  # type: ignore[arg-type]
        assert [manager.lookup_result(key) for key in (k(1), k(2))] == [HIT, HIT]

    def test_unhashable_context_without_req_id_is_rejected(
        self, new_manager: ManagerFactory
    ) -> None:
        manager = new_manager()
        with pytest.raises(InvalidArgumentError, match="req_context"):
            manager.on_new_request({"req": 1})
        with pytest.raises(InvalidArgumentError, match="req_context"):
            manager.on_request_finished(["req"])
        # A store's slots are its request's: one that cannot be named cannot store.
        with pytest.raises(InvalidArgumentError, match="req_context"):
            manager.prepare_store([k(1)], req_context={"req": 1})
        self.assert_miss(manager, k(1))
        out = manager.prepare_store([k(1)])
        assert out is not None and out.keys_to_store == [k(1)]
        with pytest.raises(InvalidArgumentError, match="req_context"):
            manager.complete_store([k(1)], req_context=["req"])
        assert manager.lookup_result(k(1)) is HIT_PENDING

    def test_schedule_end_and_pending_work(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        manager.on_schedule_end()
        self.store(manager, [k(1)])
        self.settle(manager)
        assert manager.has_pending_work() is False
        manager.on_schedule_end()
        assert manager.lookup_result(k(1)) is HIT

    def test_get_stats_are_deltas(self, new_manager: ManagerFactory) -> None:
        manager = new_manager(2)
        manager.get_stats()
        self.store(manager, [k(1), k(2)])
        self.store(manager, [k(3)])
        self.load_exact(manager, [k(3)])
        self.settle(manager)
        stats = manager.get_stats()
        primary = stats[manager.medium]
        assert primary["stored_blocks"] == 3
        assert primary["evicted_blocks"] == 1
        assert primary["loaded_blocks"] == 1
        again = manager.get_stats()
        assert set(again) == set(stats)
        assert all(v == 0 for counters in again.values() for v in counters.values())

    def test_config_info(self, new_manager: ManagerFactory) -> None:
        manager = new_manager(3)
        info = manager.config_info()
        assert info[0]["tier"] == manager.medium and info[0]["medium"] == manager.medium
        assert info[0]["num_blocks"] == 3
        assert manager.config_info() == info
        for entry in info:
            assert all(isinstance(v, str | int | float | bool) for v in entry.values())

    def test_store_threshold_admits_on_the_nth_offer(self, new_manager: ManagerFactory) -> None:
        manager = new_manager(4, store_threshold=2)
        assert manager.store_threshold == 2
        first = manager.prepare_store([k(1), k(2)])
        assert first is not None and first.keys_to_store == []  # not refused: not admitted yet
        self.assert_miss(manager, k(1))
        second = manager.prepare_store([k(1), k(3)])
        assert second is not None and second.keys_to_store == [k(1)]
        manager.complete_store([k(1)])
        assert manager.lookup_result(k(1)) is HIT
        third = manager.prepare_store([k(1), k(2), k(3)])
        assert third is not None and third.keys_to_store == [k(2), k(3)]
        manager.complete_store([k(2), k(3)])
        assert manager.get_stats()[manager.medium]["stores_skipped"] == 3
        always = new_manager(4)
        assert always.store_threshold == 1
        out = always.prepare_store([k(1)])
        assert out is not None and out.keys_to_store == [k(1)]
