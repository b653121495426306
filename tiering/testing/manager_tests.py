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

import hashlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, cast

import numpy as np
import pytest

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import InvalidArgumentError, InvalidKeyError, ProtocolError, TieringError
from tiering.managers.protocol import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
)

__all__ = ["ManagerFactory", "ManagerTests", "manager_key"]

MISS, HIT = LookupResult.MISS, LookupResult.HIT
HIT_PENDING, RETRY = LookupResult.HIT_PENDING, LookupResult.RETRY

#: What the ``new_manager`` fixture returns: ``new_manager(num_blocks, **options)``.
ManagerFactory = Callable[..., OffloadingManager]


def manager_key(i: int, group: int = 0) -> OffloadKey:
    """The ``i``-th test key."""
    return make_offload_key(i.to_bytes(8, "big"), group)


k = manager_key


class _Request:
    """A request context as engines pass them: an object with a ``req_id`` (unhashable)."""

    __hash__ = None  # type: ignore[assignment]

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id


class ManagerTests:
    """The shared conformance tests; subclass it and implement :meth:`make_manager`."""

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

    # -- lookups -----------------------------------------------------------------------------------

    def test_lookup_in_every_state(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        self.assert_miss(manager, k(1))
        assert manager.lookup(k(1)) is False
        out = manager.prepare_store([k(1)])
        assert out is not None and out.keys_to_store == [k(1)]
        assert manager.lookup_result(k(1)) is HIT_PENDING and manager.lookup(k(1)) is None
        manager.complete_store([k(1)])
        assert manager.lookup_result(k(1)) is HIT and manager.lookup(k(1)) is True
        assert manager.lookup_result(k(1), req_context="r") is HIT

    def test_too_short_bytes_key_is_a_miss(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        assert manager.lookup_result(OffloadKey(b"abc")) is MISS

    def test_lookup_prefix(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        self.store(manager, [k(1), k(2)])
        assert manager.prepare_store([k(3)]) is not None
        assert self.settled_prefix(manager, [k(1), k(2), k(4)]) == 2
        assert manager.lookup_prefix([k(1), k(3)]) is None
        assert manager.lookup_prefix([k(4), k(1)]) == 0
        assert manager.lookup_prefix([]) == 0

    @pytest.mark.parametrize(
        ("recomputes", "expected"), [(False, 416), (True, 432)], ids=["default", "engine"]
    )
    def test_lookup_request_alignment(
        self, new_manager: ManagerFactory, recomputes: bool, expected: int
    ) -> None:
        spec = KVCacheSpec((KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (64,)),), hash_block_size=16)
        keys = spec.offload_keys([i.to_bytes(8, "big") for i in range(27)])  # 432 tokens
        manager = new_manager(32)
        self.store(manager, keys[0])
        answer = manager.lookup_request(
            spec, keys, 432, req_context="r", engine_recomputes_last_token=recomputes
        )
        assert answer == expected
        assert manager.lookup_request(spec, keys, 433) == 432  # one token more to compute

    def test_lookup_request_leaves_a_token_for_a_window_group(
        self, new_manager: ManagerFactory
    ) -> None:
        spec = KVCacheSpec(
            (
                KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (64,)),
                KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, (64,), sliding_window=32),
            ),
            hash_block_size=16,
        )
        keys = spec.offload_keys([i.to_bytes(8, "big") for i in range(4)])  # 64 tokens
        manager = new_manager(8)
        self.store(manager, keys[0] + keys[1])
        for recomputes in (False, True):
            answer = manager.lookup_request(spec, keys, 64, engine_recomputes_last_token=recomputes)
            assert answer == 48

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

    # -- misuse -----------------------------------------------------------------------------------

    def _observe(self, manager: OffloadingManager) -> list[object]:
        """What a caller can see of keys 1-3, and the events since the previous call."""
        answers: list[object] = [manager.lookup_result(x) for x in (k(1), k(2), k(3))]
        if self.shared_lower_tier and RETRY in answers:
            self.settle(manager)  # keys in no tier: their existence checks settle first
            answers = [manager.lookup_result(x) for x in (k(1), k(2), k(3))]
        return answers + [manager.take_events()]

    @pytest.mark.parametrize(
        "bad_key", ["key", bytearray(b"key-bytes-1"), 7, None, ["key"]], ids=repr
    )
    def test_bad_keys_raise_invalid_key_error(
        self, new_manager: ManagerFactory, bad_key: object
    ) -> None:
        manager = new_manager()
        self.store(manager, [k(1)])
        assert manager.prepare_store([k(2)]) is not None
        manager.prepare_load([k(1)])
        manager.take_events()
        before = self._observe(manager)
        key = cast(OffloadKey, bad_key)
        for call in (
            lambda: manager.lookup_result(key),
            lambda: manager.lookup(key),
            lambda: manager.lookup_prefix([k(1), key]),
            lambda: manager.prepare_load([k(1), key]),
            lambda: manager.complete_load([k(1), key]),
            lambda: manager.touch([k(1), key]),
            lambda: manager.prepare_store([k(3), key]),
            lambda: manager.complete_store([k(2), key]),
            lambda: manager.complete_store([k(2), key], success=False),
        ):
            with pytest.raises(InvalidKeyError):
                call()
        assert self._observe(manager) == before
        manager.complete_load([k(1)])  # exactly the one pin is left

    @pytest.mark.parametrize("bad_keys", [None, 7, b"a-single-key", "text"], ids=repr)
    def test_a_non_collection_of_keys_is_rejected(
        self, new_manager: ManagerFactory, bad_keys: object
    ) -> None:
        manager = new_manager()
        self.store(manager, [k(1)])
        manager.take_events()
        before = self._observe(manager)
        keys = cast(list[OffloadKey], bad_keys)
        for call in (
            lambda: manager.lookup_prefix(keys),
            lambda: manager.prepare_load(keys),
            lambda: manager.complete_load(keys),
            lambda: manager.touch(keys),
            lambda: manager.prepare_store(keys),
            lambda: manager.complete_store(keys),
        ):
            with pytest.raises(InvalidKeyError, match="keys|key"):
                call()
        assert self._observe(manager) == before

    @pytest.mark.parametrize("bad", ["yes", 1, None, 0.0], ids=repr)
    def test_success_must_be_a_bool(self, new_manager: ManagerFactory, bad: object) -> None:
        manager = new_manager()
        assert manager.prepare_store([k(1)]) is not None
        with pytest.raises(InvalidArgumentError, match="success"):
            manager.complete_store([k(1)], success=cast(bool, bad))
        assert manager.lookup_result(k(1)) is HIT_PENDING

    def test_positional_context_or_success_is_rejected(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        assert manager.prepare_store([k(1)]) is not None
        anything = cast(Any, manager)
        with pytest.raises(InvalidArgumentError, match="success and req_context"):
            anything.complete_store([k(1)], "req-1", True)  # vLLM's order
        assert manager.lookup_result(k(1)) is HIT_PENDING
        for name in ("lookup_prefix", "prepare_load", "complete_load", "touch", "prepare_store"):
            with pytest.raises(InvalidArgumentError, match="req_context"):
                getattr(anything, name)([k(1)], "req-1")
        assert manager.lookup_result(k(1)) is HIT_PENDING

    def test_hybrid_lookup_misuse(self, new_manager: ManagerFactory) -> None:
        spec = KVCacheSpec((KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (64,)),), hash_block_size=16)
        keys = spec.offload_keys([i.to_bytes(8, "big") for i in range(2)])
        manager = new_manager()
        with pytest.raises(InvalidArgumentError, match="num_prompt_tokens"):
            manager.lookup_request(spec, keys, -1)
        with pytest.raises(InvalidArgumentError, match="num_prompt_tokens"):
            manager.lookup_request(spec, keys, cast(int, "32"))
        with pytest.raises(InvalidArgumentError, match="spec"):
            manager.lookup_request(cast(KVCacheSpec, "spec"), keys, 32)
        with pytest.raises(InvalidArgumentError, match="engine_recomputes_last_token"):
            manager.lookup_request(spec, keys, 32, engine_recomputes_last_token=cast(bool, 1))
        with pytest.raises(InvalidKeyError):
            manager.lookup_request(spec, [[k(1), cast(OffloadKey, 3)]], 32)

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
