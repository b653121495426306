"""The tiering manager: promotions, write policies, back-pressure, failures, async driving."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from tiering.backends.base import Outcome
from tiering.backends.file import FileBackend, slot_bytes_for
from tiering.backends.memory import MemoryBackend
from tiering.core.block_format import HEADER_BYTES, make_layout_fingerprint
from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import InvalidKeyError, TieringError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.protocol import LookupResult, OffloadingEvent
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.policies import _order as order_module

ROW_BYTES = 256
RETRY = LookupResult.RETRY
FINGERPRINT = make_layout_fingerprint({"test": ROW_BYTES})


def k(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), group)


def memory_tier(blocks: int, **kwargs: object) -> SecondaryTier:
    backend = MemoryBackend(
        capacity_bytes=blocks * (HEADER_BYTES + ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
    )
    return SecondaryTier(backend, **kwargs)  # type: ignore[arg-type]


class Harness:
    """A manager plus the engine's side of a store: writing known bytes into the slots."""

    def __init__(
        self, primary_blocks: int, tiers: Sequence[SecondaryTier], *, step_driven: bool = False
    ) -> None:
        self.pool = torch.zeros(primary_blocks, ROW_BYTES, dtype=torch.uint8)
        self.manager = TieringOffloadingManager(
            CPUOffloadingManager(primary_blocks, "lru", enable_events=True),
            tiers,
            pool=self.pool,
            step_driven=step_driven,
        )
        self.manager.wait_ready()

    @staticmethod
    def payload(key: bytes) -> torch.Tensor:
        gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "big") * 31 + key[-1])
        return torch.randint(0, 256, (ROW_BYTES,), dtype=torch.uint8, generator=gen)

    def store(self, *keys: OffloadKey) -> list[OffloadKey]:
        out = self.manager.prepare_store(list(keys))
        assert out is not None
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True):
            self.pool[slot] = self.payload(key)
        self.manager.complete_store(list(keys))
        return list(out.evicted_keys)

    def assert_loaded_exact(self, *keys: OffloadKey) -> None:
        spec = self.manager.prepare_load(list(keys))
        for key, slot in zip(keys, spec.block_ids.tolist(), strict=True):
            assert torch.equal(self.pool[slot], self.payload(key)), key
        self.manager.complete_load(list(keys))

    def settle(self) -> None:
        self.manager.wait_idle()


@pytest.fixture
def harness_factory() -> Iterator[type[Harness]]:
    made: list[Harness] = []

    class Tracked(Harness):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    yield Tracked
    for h in made:
        h.manager.shutdown()


def test_write_through_then_promotion_is_bit_exact(harness_factory: type[Harness]) -> None:
    h = harness_factory(2, [memory_tier(8)])
    h.store(k(1), k(2))
    h.settle()
    assert h.manager.tiers[0].state(k(1)).name == "READY"
    assert h.store(k(3), k(4)) == [k(1), k(2)]  # the primary evicts; the tier keeps them
    h.settle()
    assert h.manager.lookup(k(1)) is None  # found below: a promotion starts
    h.settle()
    assert h.manager.lookup(k(1)) is True
    h.assert_loaded_exact(k(1))
    events = h.manager.take_events()
    assert OffloadingEvent((k(1), k(2)), "MEMORY", False, "memory") in events
    assert OffloadingEvent((k(1),), "CPU", False) in events[-2:]


def test_a_key_is_never_promoted_twice_at_once(harness_factory: type[Harness]) -> None:
    h = harness_factory(2, [memory_tier(8)])
    h.store(k(1))
    h.settle()
    h.store(k(2), k(3))
    h.settle()
    assert h.manager.lookup(k(1), req_context="req") is None
    assert h.manager.lookup(k(1), req_context="req") is None  # asked again: starts the batch once
    assert h.manager.lookup(k(1), req_context="other") in (None, True)  # in flight or already done
    h.settle()
    assert h.manager.tiers[0].metrics.promotions == 1
    assert h.manager.tiers[0].metrics.promoted_blocks == 1


def test_promotions_are_batched_per_request(harness_factory: type[Harness]) -> None:
    h = harness_factory(4, [memory_tier(16)])
    h.store(k(1), k(2), k(3))
    h.settle()
    h.store(k(4), k(5), k(6), k(7))  # evicts 1-3 from the primary
    h.settle()
    assert h.manager.lookup_prefix([k(1), k(2), k(3)], req_context="req") is None
    h.settle()
    assert h.manager.tiers[0].metrics.promotions == 1
    assert h.manager.lookup_prefix([k(1), k(2), k(3)], req_context="req") == 3
    h.assert_loaded_exact(k(1), k(2), k(3))


def test_corrupt_promotion_is_a_counted_miss_and_not_retried(
    harness_factory: type[Harness],
) -> None:
    tier = memory_tier(8)
    h = harness_factory(1, [tier])
    h.store(k(1))
    h.settle()
    h.store(k(2))
    h.settle()
    backend = tier.backend
    assert isinstance(backend, MemoryBackend)
    backend.corrupt(k(1), HEADER_BYTES + 7)  # one bit of the payload
    assert h.manager.lookup(k(1)) is None
    h.settle()
    assert h.manager.lookup(k(1)) is False  # a miss, never garbage
    assert tier.metrics.corrupt_blocks == 1 and tier.metrics.promotion_failures == 1
    assert h.manager.lookup(k(1)) is False
    h.settle()
    assert tier.metrics.promotions == 1  # no retry loop
    assert OffloadingEvent((k(1),), "MEMORY", True, "memory") in h.manager.take_events()


class FailingBackend(MemoryBackend):
    """Writes fail with an I/O error, as on a full or broken disk."""

    failing = True

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        if self.failing:
            raise OSError(28, "No space left on device")
        return await super().put(keys, values)


def test_failed_tier_store_never_becomes_visible_and_manager_keeps_serving(
    harness_factory: type[Harness],
) -> None:
    backend = FailingBackend(
        capacity_bytes=8 * (HEADER_BYTES + ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
    )
    tier = SecondaryTier(backend)
    h = harness_factory(2, [tier])
    h.store(k(1))
    h.settle()
    assert tier.state(k(1)).name == "ABSENT" and tier.metrics.store_failures == 1
    h.assert_loaded_exact(k(1))  # the primary copy is fine
    backend.failing = False
    h.store(k(2))
    h.settle()
    assert tier.state(k(2)).name == "READY"


def test_write_back_writes_on_eviction_and_frees_the_slot_after(
    harness_factory: type[Harness],
) -> None:
    tier = memory_tier(8, write_policy="write_back")
    h = harness_factory(2, [tier])
    h.store(k(1), k(2))
    h.settle()
    assert len(tier) == 0  # nothing written yet
    out = h.manager.prepare_store([k(3)])
    # k(1) was evicted and is being written back; its slot is not free until that is done.
    assert out is None or out.evicted_keys == [k(1)]
    h.settle()
    assert tier.state(k(1)).name == "READY"
    h.store(k(3))
    h.settle()
    assert h.manager.lookup(k(1)) is None
    h.settle()
    assert h.manager.lookup(k(1)) is True
    h.assert_loaded_exact(k(1))


def test_selective_write_through_needs_enough_lookups(harness_factory: type[Harness]) -> None:
    tier = memory_tier(8, write_policy="write_through_selective", selective_min_lookups=2)
    h = harness_factory(4, [tier])
    for _ in range(2):
        assert h.manager.lookup(k(1)) is False
    assert h.manager.lookup(k(2)) is False
    h.store(k(1), k(2))
    h.settle()
    assert tier.state(k(1)).name == "READY"
    assert tier.state(k(2)).name == "ABSENT"


class GatedBackend(MemoryBackend):
    """Writes wait until the test opens the gate, so jobs pile up as on a slow disk."""

    gate = threading.Event()

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        while not self.gate.is_set():
            await asyncio.sleep(0.001)
        return await super().put(keys, values)


def test_stores_are_shed_over_the_inflight_bound_and_loads_wait(
    harness_factory: type[Harness],
) -> None:
    backend = GatedBackend(
        capacity_bytes=64 * (HEADER_BYTES + ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
    )
    backend.gate = threading.Event()
    tier = SecondaryTier(backend, max_inflight_jobs=2)
    h = harness_factory(32, [tier])
    for i in range(6):
        h.store(k(i))
    assert tier.inflight_jobs == 2
    assert tier.metrics.stores_shed == 4  # over the bound: shed, not queued
    backend.gate.set()
    h.settle()
    assert tier.metrics.stored_blocks == 2 and len(tier) == 2
    assert [tier.state(k(i)).name for i in range(3)] == ["READY", "READY", "ABSENT"]


def test_hybrid_lookup_with_groups_split_across_tiers(harness_factory: type[Harness]) -> None:
    spec = KVCacheSpec(
        (
            KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (128,)),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, (128,), sliding_window=16),
        ),
        hash_block_size=16,
    )
    h = harness_factory(4, [memory_tier(16)])
    keys = spec.offload_keys([i.to_bytes(8, "big") for i in range(3)])
    h.store(*keys[1])  # the window group's blocks, then pushed down to the tier
    h.settle()
    h.store(*keys[0])  # full attention fills the primary and evicts group 1's oldest
    h.settle()
    in_primary = [h.manager.primary.lookup(key) for key in keys[1]]
    assert in_primary.count(False) >= 1
    answer = h.manager.lookup_request(spec, keys, num_prompt_tokens=49)
    assert answer is None or answer == 48
    h.settle()
    assert h.manager.lookup_request(spec, keys, num_prompt_tokens=49) == 48
    # Only the window block at the hit end was needed from group 1.
    h.assert_loaded_exact(*keys[0], keys[1][2])


def test_reset_cache_drops_every_tier(harness_factory: type[Harness]) -> None:
    tier = memory_tier(8)
    h = harness_factory(2, [tier])
    h.store(k(1))
    h.settle()
    h.manager.take_events()
    h.manager.reset_cache()
    assert h.manager.lookup(k(1)) is False and len(tier) == 0
    events = h.manager.take_events()
    assert OffloadingEvent((k(1),), "CPU", True) in events
    assert OffloadingEvent((k(1),), "MEMORY", True, "memory") in events


@pytest.mark.asyncio
async def test_async_lifecycle_and_lookup() -> None:
    pool = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
    tier = memory_tier(8)
    async with TieringOffloadingManager(CPUOffloadingManager(2), [tier], pool=pool) as manager:
        for batch in ([k(1)], [k(2), k(3)]):
            out = manager.prepare_store(batch)
            assert out is not None
            for key, slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True):
                pool[slot] = Harness.payload(key)
            manager.complete_store(batch)
            await manager.drain()
        assert manager.primary.lookup(k(1)) is False
        assert await manager.lookup_async(k(1)) is True
        slot = int(manager.prepare_load([k(1)]).block_ids[0])
        assert torch.equal(pool[slot], Harness.payload(k(1)))
        manager.complete_load([k(1)])
        assert await manager.lookup_async(k(99)) is False
        jobs = manager.inflight_jobs()
        for job in jobs:
            await job
    assert tier.backend.is_open is False


def test_step_driven_batches_promotions_per_request_until_the_step_ends(
    harness_factory: type[Harness],
) -> None:
    tier = memory_tier(16)
    h = harness_factory(4, [tier], step_driven=True)
    manager = h.manager
    h.store(k(1), k(2), k(3), k(4))
    h.settle()
    h.store(k(5), k(6), k(7), k(8))  # 1-4 now only in the tier
    h.settle()
    assert manager.lookup_result(k(1), req_context="a") is RETRY
    assert manager.lookup_result(k(2), req_context="a") is RETRY
    assert manager.lookup_result(k(3), req_context="b") is RETRY
    assert manager.lookup_result(k(1), req_context="b") is RETRY  # a's batch already has it
    assert manager.lookup_result(k(1), req_context="a") is RETRY  # asked again: still batched
    assert manager.inflight_jobs() == [] and tier.metrics.promotions == 0
    assert manager.has_pending_work()
    manager.on_schedule_end()  # one job per request and tier, with its request's context
    jobs = sorted(
        (str(j.req_context), j.keys) for j in manager.inflight_jobs() if j.kind == "promote"
    )
    assert jobs == [("a", (k(1), k(2))), ("b", (k(3),))]
    for job in manager.inflight_jobs():
        assert job.future is not None
        job.future.result()  # the I/O is done...
    assert manager.lookup_result(k(1), req_context="a") is RETRY  # ...but not applied mid-step
    assert manager.lookup_result(k(4), req_context="a") is RETRY  # a new batch
    manager.on_schedule_end()  # applies the promotions submitted at the previous boundary
    assert manager.lookup_result(k(1), req_context="a") is LookupResult.HIT
    assert manager.lookup_result(k(3), req_context="b") is LookupResult.HIT
    h.assert_loaded_exact(k(1), k(2), k(3))
    h.settle()
    h.assert_loaded_exact(k(4))


def test_standalone_applies_results_at_the_next_call(harness_factory: type[Harness]) -> None:
    h = harness_factory(2, [memory_tier(8)])
    h.store(k(1), k(2))
    h.settle()
    h.store(k(3), k(4))
    h.settle()
    manager = h.manager
    assert manager.lookup_result(k(1), req_context="a") is RETRY
    assert manager.inflight_jobs() == []  # batched for request a
    # A lookup answered at once (a MISS here, or a HIT) applies nothing and submits nothing:
    # promotions evict, and a key a lookup answered HIT must stay there to load.
    assert manager.lookup_result(k(9), req_context="b") is LookupResult.MISS
    assert manager.inflight_jobs() == []
    manager.complete_store([k(9)], req_context="b")  # b's next call: a's batch goes
    assert [job.req_context for job in manager.inflight_jobs()] == ["a"]
    for job in manager.inflight_jobs():
        assert job.future is not None and job.req_context == "a"
        job.future.result()
    assert manager.lookup_result(k(1), req_context="b") is LookupResult.HIT


def test_hit_pending_while_a_tier_write_is_in_flight(harness_factory: type[Harness]) -> None:
    backend = GatedBackend(
        capacity_bytes=8 * (HEADER_BYTES + ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
    )
    backend.gate = threading.Event()
    tier = SecondaryTier(backend, write_policy="write_back")
    h = harness_factory(2, [tier], step_driven=True)
    manager = h.manager
    h.store(k(1), k(2))
    assert manager.prepare_store([k(3)], req_context="evictor") is None  # k(1) written back
    (job,) = manager.inflight_jobs()
    assert job.kind == "write_back" and job.keys == (k(1),) and job.req_context == "evictor"
    assert manager.lookup_result(k(1)) is LookupResult.HIT_PENDING
    assert manager.lookup(k(1)) is None
    backend.gate.set()
    h.settle()
    assert manager.lookup_result(k(1), req_context="r") is RETRY  # in the tier: promotion
    h.settle()
    assert manager.lookup_result(k(1)) is LookupResult.HIT
    h.assert_loaded_exact(k(1))


def test_tier_jobs_carry_the_context_that_started_them(harness_factory: type[Harness]) -> None:
    h = harness_factory(4, [memory_tier(8)])
    out = h.manager.prepare_store([k(1), k(2)], req_context="req-9")
    assert out is not None
    h.manager.complete_store([k(1), k(2)], req_context="req-9")
    (job,) = h.manager.inflight_jobs()
    assert (job.kind, job.keys, job.req_context) == ("store", (k(1), k(2)), "req-9")
    h.settle()


def test_promotions_are_not_store_offers(tmp_path: Path) -> None:
    """A block a tier already holds comes back whatever the primary's store_threshold."""

    def manager(threshold: int) -> tuple[TieringOffloadingManager, torch.Tensor]:
        backend = FileBackend(
            path=tmp_path / "nvme",
            capacity_bytes=8 * slot_bytes_for(ROW_BYTES),
            block_bytes=ROW_BYTES,
            fingerprint=FINGERPRINT,
        )
        pool = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
        m = TieringOffloadingManager(
            CPUOffloadingManager(2, store_threshold=threshold), [SecondaryTier(backend)], pool=pool
        )
        m.wait_ready()
        return m, pool

    first, pool = manager(1)
    out = first.prepare_store([k(1)])
    assert out is not None
    pool[int(out.store_spec.block_ids[0])] = Harness.payload(k(1))
    first.complete_store([k(1)])
    first.shutdown()
    second, pool = manager(3)
    try:
        assert second.lookup_result(k(1)) is RETRY  # recovered from the file tier
        second.wait_idle()
        assert second.lookup_result(k(1)) is LookupResult.HIT
        slot = int(second.prepare_load([k(1)]).block_ids[0])
        assert torch.equal(pool[slot], Harness.payload(k(1)))
        second.complete_load([k(1)])
        out = second.prepare_store([k(2)])
        assert out is not None and out.keys_to_store == []  # new blocks still need 3 offers
    finally:
        second.shutdown()


def test_get_stats_reports_per_tier_deltas(harness_factory: type[Harness]) -> None:
    backend = FailingBackend(
        capacity_bytes=8 * (HEADER_BYTES + ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
    )
    backend.failing = False
    tier = SecondaryTier(backend, name="disk")
    h = harness_factory(2, [tier])
    manager = h.manager
    manager.get_stats()
    h.store(k(1), k(2))
    h.settle()
    backend.failing = True
    h.store(k(3))  # evicts k(1); its tier write fails
    h.settle()
    assert manager.lookup(k(1)) is None
    h.settle()
    stats = manager.get_stats()
    assert stats["disk"]["stored_blocks"] == 2
    assert stats["disk"]["bytes_written"] == 2 * ROW_BYTES
    assert stats["disk"]["store_failures"] == 1
    assert stats["disk"]["lookup_hits"] == 1
    assert stats["disk"]["promoted_blocks"] == 1
    assert stats["disk"]["bytes_read"] == ROW_BYTES
    assert stats["CPU"]["stored_blocks"] == 3 + 1  # three stores and one promotion
    assert all(v == 0 for v in manager.get_stats()["disk"].values())
    assert manager.metrics()["disk"]["stored_blocks"] == 2  # totals stay in metrics()
    info = manager.config_info()
    assert [i["tier"] for i in info] == ["CPU", "disk"]
    assert info[1]["write_policy"] == "write_through" and info[1]["block_bytes"] == ROW_BYTES


def test_step_driven_tiers_open_at_the_first_step_boundary() -> None:
    pool = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
    tier = memory_tier(8)
    manager = TieringOffloadingManager(CPUOffloadingManager(2), [tier], pool=pool, step_driven=True)
    try:
        (job,) = manager.inflight_jobs()
        assert job.kind == "open" and job.future is not None
        job.future.result()
        assert tier.status == "opening"  # done, not applied: no call applies it mid-step
        manager.on_schedule_end()
        assert tier.status == "open" and not manager.has_pending_work()
    finally:
        manager.shutdown()


def _lookup_states(h: Harness) -> list[OffloadKey]:
    """Keys in every state a step-driven lookup answers, in a primary of 4 blocks: 1, 2 and 3
    only in the tier, 4, 5 and 6 ready in the primary, 7 being stored there, 99 and 100 in no
    tier. Asked in this order, 1, 2 and 5 are promoted (evicting 4, 5 and 6), and 3 and 6 find
    no room left this step."""
    h.store(k(1), k(2), k(3), k(4))
    h.settle()
    h.store(k(5), k(6))
    h.settle()
    assert h.manager.prepare_store([k(7)]) is not None
    return [k(i) for i in (4, 7, 1, 1, 2, 99, 5, 3, 6, 100)]


def test_the_step_driven_one_tier_lookup_answers_and_counts_as_the_method(
    harness_factory: type[Harness],
) -> None:
    """A step-driven manager with one indexed tier installs a closure as ``lookup_result`` (the
    engine's hottest call); it gives the method's answers, counts and side effects in every
    state: ready, being stored, promoted (RETRY, then RETRY while promoting), no room, absent."""
    fast = harness_factory(4, [memory_tier(8)], step_driven=True)
    slow = harness_factory(4, [memory_tier(8)], step_driven=True)
    assert "lookup_result" in vars(fast.manager)  # the closure, not the method
    assert fast.manager.lookup_result.__doc__ == TieringOffloadingManager.lookup_result.__doc__
    keys = _lookup_states(fast)
    assert _lookup_states(slow) == keys
    fast_answers = [fast.manager.lookup_result(key, req_context="r") for key in keys]
    slow_answers = [
        TieringOffloadingManager.lookup_result(slow.manager, key, req_context="r") for key in keys
    ]
    hit, pending, miss = LookupResult.HIT, LookupResult.HIT_PENDING, LookupResult.MISS
    assert fast_answers == [hit, pending, RETRY, RETRY, RETRY, miss, RETRY, miss, miss, miss]
    assert slow_answers == fast_answers
    assert fast.manager.metrics()["primary"] == slow.manager.metrics()["primary"]
    counts = fast.manager.metrics()["primary"]
    assert (counts["lookup_hits"], counts["lookup_pending"], counts["lookup_misses"]) == (1, 2, 7)
    assert fast.manager.take_events() == slow.manager.take_events()
    for h in (fast, slow):
        h.manager.on_schedule_end()
        h.settle()
        h.manager.on_schedule_end()
    assert [j.keys for j in fast.manager.inflight_jobs()] == [
        j.keys for j in slow.manager.inflight_jobs()
    ]
    assert fast.manager.lookup_result(k(1)) is hit  # promoted
    fast.assert_loaded_exact(k(1))
    with pytest.raises(InvalidKeyError):
        fast.manager.lookup_result("not bytes")  # type: ignore[arg-type]
    fast.manager.shutdown()
    with pytest.raises(TieringError, match="shut down"):
        fast.manager.lookup_result(k(4))


def test_the_step_driven_lookup_closure_keeps_no_manager_alive() -> None:
    """The closure holds no reference to its manager: a dropped manager is freed at once (its
    I/O thread stops), and the closure then says it is shut down."""
    pool = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
    manager = TieringOffloadingManager(
        CPUOffloadingManager(2), [memory_tier(8)], pool=pool, step_driven=True
    )
    manager.on_schedule_end()
    manager.wait_ready()
    lookup = manager.lookup_result
    assert lookup(k(1)) is LookupResult.MISS
    alive = weakref.ref(manager)
    gc.disable()  # freed by reference counting, not by a collection
    try:
        del manager
        assert alive() is None
    finally:
        gc.enable()
    with pytest.raises(TieringError, match="shut down"):
        lookup(k(1))


def test_a_subclass_lookup_result_is_not_replaced_by_the_closure() -> None:
    class Counting(TieringOffloadingManager):
        calls = 0

        def lookup_result(self, key: OffloadKey, req_context: object = None) -> LookupResult:
            Counting.calls += 1
            return super().lookup_result(key, req_context)

    pool = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
    manager = Counting(CPUOffloadingManager(2), [memory_tier(8)], pool=pool, step_driven=True)
    try:
        assert manager.lookup_result(k(1)) is LookupResult.MISS and Counting.calls == 1
    finally:
        manager.shutdown()


def test_step_driven_lookup_reserves_the_promotion_slot_at_once(
    harness_factory: type[Harness],
) -> None:
    """The answer is exact: RETRY means the primary slot is reserved (its eviction announced
    now); MISS means the primary cannot make room this step."""
    h = harness_factory(2, [memory_tier(8)], step_driven=True)
    manager = h.manager
    h.store(k(1), k(2))
    h.settle()
    h.store(k(3), k(4))  # 1 and 2 now only in the tier
    h.settle()
    manager.take_events()
    manager.protect_for_step([k(3), k(4)], req_context="a")  # a loads 3 and 4 this step
    assert manager.lookup_result(k(1), req_context="a") is LookupResult.MISS
    assert manager.promotions_without_space == 1 and manager.take_events() == []
    assert manager.lookup_result(k(1), req_context="b") is RETRY  # b protected nothing
    assert manager.take_events() == [OffloadingEvent((k(3),), "CPU", True)]  # evicted now
    assert manager.primary.lookup_result(k(1)) is LookupResult.HIT_PENDING  # slot reserved
    manager.on_schedule_end()  # submits b's batch; a's protection ends with the step
    h.settle()
    assert manager.lookup_result(k(1), req_context="a") is LookupResult.HIT
    h.assert_loaded_exact(k(1))


def test_a_request_larger_than_the_primary_is_served_in_part_not_thrashed(
    harness_factory: type[Harness],
) -> None:
    """Four blocks in the tier, two primary slots: the hit stops where the primary is full,
    and once the request protects its hits, the answers no longer change step to step (no
    promotion evicts the blocks an earlier one brought back)."""
    h = harness_factory(2, [memory_tier(8)], step_driven=True)
    manager = h.manager
    keys = [k(1), k(2), k(3), k(4)]
    for pair in (keys[:2], keys[2:], [k(5), k(6)]):
        h.store(*pair)
        h.settle()
    answers = [manager.lookup_result(x, req_context="r") for x in keys]
    assert answers == [RETRY, RETRY, LookupResult.MISS, LookupResult.MISS]
    manager.on_schedule_end()
    h.settle()
    for _ in range(3):  # the engine's scan: protect each hit, stop at the first miss
        answers = []
        for x in keys:
            answer = manager.lookup_result(x, req_context="r")
            answers.append(answer)
            if answer is not LookupResult.HIT:
                break
            manager.protect_for_step([x], req_context="r")
        assert answers == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
        manager.on_schedule_end()
        h.settle()
    h.assert_loaded_exact(k(1), k(2))
    assert manager.tiers[0].metrics.promotions == 1


def test_shutdown_keeps_no_view_of_the_pool(tmp_path: Path) -> None:
    """The pool may be a mapping its owner unmaps after the manager shut down (vLLM's shared
    offload region): no view of it may survive the manager's shutdown."""
    import mmap

    import numpy as np

    region = mmap.mmap(-1, 4 * ROW_BYTES)
    rows = np.frombuffer(region, np.uint8).reshape(4, ROW_BYTES)[:, : ROW_BYTES // 2]
    pool = torch.from_numpy(rows)
    backend = FileBackend(
        path=tmp_path / "nvme",
        capacity_bytes=8 * slot_bytes_for(ROW_BYTES // 2),
        block_bytes=ROW_BYTES // 2,
        fingerprint=FINGERPRINT,
    )
    manager = TieringOffloadingManager(
        CPUOffloadingManager(4), [SecondaryTier(backend)], pool=pool, step_driven=True
    )
    manager.wait_ready()
    out = manager.prepare_store([k(1), k(2)])
    assert out is not None
    manager.complete_store([k(1), k(2)])  # cascades: the tier reads the rows
    manager.wait_idle()
    manager.shutdown()
    del pool, rows
    region.close()  # raises BufferError while anything still exports the mapping
    assert region.closed


def test_a_tiers_held_keys_follow_its_policy_and_answer_misses(
    harness_factory: type[Harness],
) -> None:
    """``SecondaryTier.held`` (what a lookup's miss test probes) is exactly the policy's keys
    through tier evictions, a failed write, a corrupt promotion and a reset."""
    backend = FailingBackend(
        capacity_bytes=4 * (HEADER_BYTES + ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
    )
    backend.failing = False
    tier = SecondaryTier(backend)
    h = harness_factory(2, [tier])
    for i in range(1, 7):  # the tier holds 4: it evicts k(1) and k(2)
        h.store(k(i))
        h.settle()
    assert tier.held == set(tier.policy) == {k(3), k(4), k(5), k(6)}
    assert h.manager.lookup_result(k(1)) is LookupResult.MISS
    assert h.manager.lookup_result(k(3), req_context="a") is RETRY  # only in the tier
    h.settle()
    backend.failing = True
    h.store(k(7))  # the tier evicts k(3) for it, and the write fails
    h.settle()
    assert tier.held == set(tier.policy) == {k(4), k(5), k(6)}
    assert tier.metrics.store_failures == 1
    backend.failing = False
    backend.corrupt(k(4), HEADER_BYTES + 1)
    assert h.manager.lookup(k(4), req_context="b") is None  # promoted, and corrupt: forgotten
    h.settle()
    assert tier.held == set(tier.policy) == {k(5), k(6)}
    assert h.manager.lookup(k(4)) is False
    h.manager.reset_cache()
    assert tier.held == set() and h.manager.lookup(k(5)) is False


def test_the_first_eviction_after_pinning_pops_no_stale_places(
    harness_factory: type[Harness], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write-through holds let keys go after newer keys were stored (released keys); pinning
    the oldest half of them then left one stale heap entry each, and the next store's eviction
    popped them all in one call (8,017 at 50,000 pinned keys: a 30 ms pause). Counted in heap
    pops: that eviction pops none."""
    h = harness_factory(512, [memory_tier(1024)])
    for start in range(0, 512, 64):  # one request each, the tier's writes still in flight
        h.store(*[k(i) for i in range(start, start + 64)])
    h.settle()
    h.manager.prepare_load([k(i) for i in range(256)])  # pin the oldest half
    h.settle()
    pops = 0
    real_heappop = order_module._heappop

    def counting_heappop(heap: list[tuple[int, bytes]]) -> tuple[int, bytes]:
        nonlocal pops
        pops += 1
        return real_heappop(heap)

    monkeypatch.setattr(order_module, "_heappop", counting_heappop)
    assert h.store(k(1000)) == [k(256)]  # the oldest key not pinned
    assert pops == 0
    h.manager.complete_load([k(i) for i in range(256)])


def test_events_switched_off_are_not_built_and_switched_on_report_only_what_follows() -> None:
    """Off, the primary records no event (nothing built to be dropped); switched on, the
    manager reports the stores and evictions that follow, never those made while off."""
    pool = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
    primary = CPUOffloadingManager(2, "lru", enable_events=True)
    manager = TieringOffloadingManager(primary, [], pool=pool, enable_events=False)
    try:
        assert primary.enable_events is False
        out = manager.prepare_store([k(1), k(2)])
        assert out is not None
        manager.complete_store([k(1), k(2)])
        assert primary.take_events() == []
        assert manager.take_events() == []
        out = manager.prepare_store([k(3)])  # evicts k(1) while off
        assert out is not None and list(out.evicted_keys) == [k(1)]
        manager.enable_events = True
        assert primary.enable_events is True
        out = manager.prepare_store([k(4)])  # evicts k(2)
        assert out is not None and list(out.evicted_keys) == [k(2)]
        manager.complete_store([k(3), k(4)])
        assert [(e.keys, e.removed) for e in manager.take_events()] == [
            ((k(2),), True),
            ((k(3), k(4)), False),
        ]
    finally:
        manager.shutdown()
