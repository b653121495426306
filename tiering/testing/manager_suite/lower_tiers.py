"""``ManagerTests``, steps and lower tiers: the same answers from the same calls on every run for
a step-driven manager; with ``has_lower_tiers``, an evicted block promoted back (``RETRY``,
then ``HIT``) bit-exact; calls after ``shutdown``.
"""

from __future__ import annotations

import pytest

from tiering.errors import TieringError
from tiering.managers.protocol import OffloadingManager
from tiering.testing.manager_suite.base import HIT, MISS, RETRY, ManagerFactory, ManagerTestsBase, k

__all__ = ["ManagerLowerTierTests"]


class ManagerLowerTierTests(ManagerTestsBase):
    """Reproducible steps, promotions from lower tiers, shutdown."""

    # -- steps and lower tiers --------------------------------------------------------------------

    def _scripted_run(self, manager: OffloadingManager) -> list[object]:
        """A few engine steps of stores, evictions, lookups and loads; every answer recorded."""
        answers: list[object] = []
        for step in range(6):
            request = f"req-{step}"
            manager.on_new_request(request)
            keys = [k(10 * step + i) for i in range(3)]
            old = [k(10 * (step - 2) + i) for i in range(3)] if step >= 2 else []
            answers.append([manager.lookup_result(x, req_context=request) for x in old + keys])
            answers.append(manager.lookup_prefix(old, req_context=request))
            out = manager.prepare_store(keys, req_context=request)
            answers.append(None if out is None else (out.keys_to_store, out.evicted_keys))
            if out is not None:
                self.write_payloads(manager, out)
                manager.complete_store(keys, req_context=request)
            hits = [x for x in old if manager.lookup_result(x, req_context=request) is HIT]
            if hits:
                self.load_exact(manager, hits)
            answers.append(hits)
            manager.on_request_finished(request)
            answers.append([(e.keys, e.medium, e.removed, e.owner) for e in manager.take_events()])
            self.settle(manager)
        return answers

    def test_same_calls_give_the_same_answers(self, new_manager: ManagerFactory) -> None:
        if not self.step_driven:
            pytest.skip("answers of a manager that is not step-driven depend on I/O timing")
        first = self._scripted_run(new_manager(8))
        second = self._scripted_run(new_manager(8))
        assert first == second

    def test_evicted_block_is_promoted_back_bit_exact(self, new_manager: ManagerFactory) -> None:
        if not self.has_lower_tiers:
            pytest.skip("the manager has no tier below its primary")
        manager = new_manager(2)
        self.store(manager, [k(1), k(2)])
        assert self.store(manager, [k(3), k(4)]) == [k(1), k(2)]
        assert manager.lookup_result(k(1), req_context="r") is RETRY  # promotion queued
        assert manager.lookup(k(1), req_context="r") is None
        self.settle(manager)
        assert manager.lookup_result(k(1), req_context="r") is HIT
        self.load_exact(manager, [k(1)])
        assert manager.lookup_prefix([k(1), k(2)], req_context="r2") is None  # k(2) comes back
        self.settle(manager)
        assert manager.lookup_prefix([k(1), k(2)], req_context="r2") == 2
        self.load_exact(manager, [k(1), k(2)])
        lower = [e for e in manager.take_events() if e.owner is not None]
        if self.shared_lower_tier:
            assert lower == []  # a shared tier owns no state to announce
            return
        assert lower and all(e.medium != manager.medium for e in lower)
        assert any(not e.removed and k(1) in e.keys for e in lower)

    def test_calls_after_shutdown(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        self.store(manager, [k(1)])
        manager.shutdown()
        try:
            answer = manager.lookup_result(k(1))
        except TieringError:
            return  # a manager that owns threads refuses
        assert answer is MISS  # one that does not answers from an empty state
