"""The base of ``ManagerTests``: the class attributes that describe the manager under test, the
hooks a subclass implements (``make_manager``, ``settle``, ``remember_rows``), the
``new_manager`` fixture, and the plumbing every topic mixin uses (whole stores, exact loads,
settled answers).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from tiering.core.keys import OffloadKey, make_offload_key
from tiering.managers.protocol import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)

__all__ = [
    "HIT",
    "HIT_PENDING",
    "MISS",
    "RETRY",
    "ManagerFactory",
    "ManagerTestsBase",
    "k",
    "manager_key",
]

MISS, HIT = LookupResult.MISS, LookupResult.HIT
HIT_PENDING, RETRY = LookupResult.HIT_PENDING, LookupResult.RETRY

#: What the ``new_manager`` fixture returns: ``new_manager(num_blocks, **options)``.
ManagerFactory = Callable[..., OffloadingManager]


def manager_key(i: int, group: int = 0) -> OffloadKey:
    """The ``i``-th test key."""
    return make_offload_key(i.to_bytes(8, "big"), group)


k = manager_key


class ManagerTestsBase:
    """What every topic of ``ManagerTests`` builds on: the manager's description, the hooks, the
    ``new_manager`` fixture and the plumbing."""

    #: Victims come out in LRU order (set False for other policies: exact-order tests skip).
    lru_order: ClassVar[bool] = True
    #: Blocks evicted from the primary live on in a lower tier and are promoted back.
    has_lower_tiers: ClassVar[bool] = False
    #: Background results apply only at step boundaries, so answers are reproducible.
    step_driven: ClassVar[bool] = True
    #: The lowest tier is shared with other managers (its store is its own index): a key no
    #: tier holds answers RETRY until an existence check settles; it emits no events.
    shared_lower_tier: ClassVar[bool] = False

    # -- hooks for subclasses --------------------------------------------------------------------

    def make_manager(
        self, num_blocks: int, *, store_threshold: int = 1, enable_events: bool = True
    ) -> OffloadingManager:
        """A new manager whose primary tier has ``num_blocks`` slots and an LRU-ordered policy
        (or set ``lru_order = False``)."""
        raise NotImplementedError("subclasses of ManagerTests implement make_manager()")

    def settle(self, manager: OffloadingManager) -> None:
        """End the step and wait until its background work is done and applied. The default
        suits managers with no background work; others override it (e.g. ``wait_idle()``)."""
        manager.on_schedule_end()
        if manager.has_pending_work():
            pytest.fail(
                f"{type(manager).__name__} has background work: override settle() to wait for it"
            )

    def remember_rows(self, manager: OffloadingManager, rows: np.ndarray) -> None:
        """Record the primary tier's rows (``(num_blocks, row_bytes)`` uint8) of ``manager``;
        the suite then writes known bytes on every store and checks them on loads."""
        self._rows()[id(manager)] = rows

    # -- plumbing ----------------------------------------------------------------------------------

    def _rows(self) -> dict[int, np.ndarray]:
        rows: dict[int, np.ndarray] | None = getattr(self, "_manager_rows", None)
        if rows is None:
            rows = {}
            self._manager_rows = rows
        return rows

    @pytest.fixture
    def new_manager(self) -> Iterator[ManagerFactory]:
        made: list[OffloadingManager] = []

        def make(num_blocks: int = 4, **options: Any) -> OffloadingManager:
            manager = self.make_manager(num_blocks, **options)
            made.append(manager)
            return manager

        yield make
        for manager in made:
            manager.shutdown()
            self._rows().pop(id(manager), None)

    @staticmethod
    def payload(key: bytes, row_bytes: int) -> np.ndarray:
        """The bytes the suite stores under ``key``."""
        digest = hashlib.sha256(key).digest()
        return np.frombuffer((digest * (row_bytes // len(digest) + 1))[:row_bytes], np.uint8)

    def store(
        self, manager: OffloadingManager, keys: Sequence[OffloadKey], req_context: object = None
    ) -> list[OffloadKey]:
        """A whole store (prepare, write the payloads, complete) and the end of its step
        (:meth:`settle`); returns the evicted keys."""
        out = manager.prepare_store(list(keys), req_context=req_context)
        assert out is not None, f"no room to store {len(keys)} keys"
        self.write_payloads(manager, out)
        manager.complete_store(list(keys), req_context=req_context)
        self.settle(manager)
        return list(out.evicted_keys)

    def write_payloads(self, manager: OffloadingManager, out: PrepareStoreOutput) -> None:
        """Play the worker of a store: write each key's payload into its slot (rows known)."""
        rows = self._rows().get(id(manager))
        if rows is not None:
            for key, slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True):
                rows[slot] = self.payload(key, rows.shape[1])

    def load_exact(self, manager: OffloadingManager, keys: Sequence[OffloadKey]) -> None:
        """Load ``keys`` (prepare/complete) and check their bytes when rows are known."""
        spec = manager.prepare_load(list(keys))
        rows = self._rows().get(id(manager))
        if rows is not None:
            for key, slot in zip(keys, spec.block_ids.tolist(), strict=True):
                assert np.array_equal(rows[slot], self.payload(key, rows.shape[1])), key.hex()
        manager.complete_load(list(keys))

    @staticmethod
    def primary_events(manager: OffloadingManager) -> list[OffloadingEvent]:
        return [e for e in manager.take_events() if e.owner is None]

    def assert_miss(
        self, manager: OffloadingManager, key: OffloadKey, req_context: object = None
    ) -> None:
        """``key`` is in no tier: ``MISS`` (with a shared lower tier, once the existence check
        its first lookup starts has settled)."""
        answer = manager.lookup_result(key, req_context)
        if self.shared_lower_tier and answer is RETRY:
            self.settle(manager)
            answer = manager.lookup_result(key, req_context)
        assert answer is MISS, f"{key.hex()}: {answer}"

    def settled_prefix(
        self, manager: OffloadingManager, keys: Sequence[OffloadKey], req_context: object = None
    ) -> int | None:
        """``lookup_prefix``; with a shared lower tier, asked again after the step settles if
        the first answer waits for existence checks."""
        answer = manager.lookup_prefix(list(keys), req_context=req_context)
        if self.shared_lower_tier and answer is None:
            self.settle(manager)
            answer = manager.lookup_prefix(list(keys), req_context=req_context)
        return answer

    def _need_lru(self) -> None:
        if not self.lru_order:
            pytest.skip("exact-order test for LRU-ordered managers")

    def evicted_answer(self) -> set[LookupResult]:
        """What a lookup of a key evicted from the primary may answer."""
        return {MISS, RETRY} if self.has_lower_tiers else {MISS}
