"""The promotions collaborator on its own: batching per request, reserving primary slots, the job
bound, never twice at once, failures; driven directly over real tiers (no manager)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tiering.backends.file import FileBackend, slot_bytes_for
from tiering.backends.memory import MemoryBackend
from tiering.core.block_format import HEADER_BYTES, make_layout_fingerprint
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.event_log import EventLog
from tiering.managers.job_runner import TierJobs
from tiering.managers.promotions import PromotionBatch, Promotions
from tiering.managers.protocol import OffloadingEvent
from tiering.managers.secondary_tier import SecondaryTier, TierJob, TierKeyState

ROW_BYTES = 128
FINGERPRINT = make_layout_fingerprint({"test-promotions": ROW_BYTES})
SCRATCH = 7  # the row the tiers' stores are written from (never a primary slot: 4 blocks)


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def payload(key: bytes) -> np.ndarray:
    return np.frombuffer(bytes((key[7] * 7 + i) % 256 for i in range(ROW_BYTES)), np.uint8)


class Rig:
    """A primary of ``blocks`` slots, one tier, and a promotions collaborator over them; results
    are applied by :meth:`settle` the way the manager does (submission order)."""

    def __init__(self, tier: SecondaryTier, *, blocks: int = 4, step_driven: bool = False) -> None:
        self.rows = np.zeros((8, ROW_BYTES), np.uint8)
        self.primary = CPUOffloadingManager(blocks, "lru", enable_events=True)
        self.tier = tier
        tier.attach(self.rows)
        self.jobs = TierJobs()
        self.events = EventLog(self.primary, True)
        self.draining: dict[int, int] = {}
        self.promotions = Promotions(
            self.primary, [tier], self.jobs, self.events, self.draining, step_driven=step_driven
        )
        self.jobs.submit(tier.start_open(), tier.finish_open)
        self.settle()

    def settle(self) -> None:
        """Wait for every job in flight and apply the results, until none is left."""
        jobs = self.jobs
        while jobs.in_flight:
            jobs.collect(block_until_all=time.monotonic() + 30)
            for on_done, job, result in jobs.take_ready():
                jobs.in_flight.discard(job)
                on_done(job, result)
            if self.promotions.waiting:
                self.promotions.start_waiting()

    def put_in_tier(self, *keys: OffloadKey) -> None:
        """Write each key's payload to the tier (from a scratch row), as a cascade would."""
        for key in keys:
            self.rows[SCRATCH] = payload(key)
            job = self.tier.start_store([key], {key: SCRATCH}, lookup_counts={})
            assert job is not None
            self.jobs.submit(job, self._store_done)
            self.settle()
        self.rows[SCRATCH] = 0
        assert [self.tier.state(key) for key in keys] == [TierKeyState.READY] * len(keys)

    def _store_done(self, job: TierJob, result: object) -> None:
        self.tier.finish_store(job, result)

    def assert_promoted_exact(self, *keys: OffloadKey) -> None:
        for key in keys:
            assert self.primary.lookup(key) is True, key
            slot = self.primary.slot_of(key)
            assert slot is not None
            assert bytes(self.rows[slot]) == bytes(payload(key)), key

    def close(self) -> None:
        self.jobs.close()


def memory_tier(blocks: int = 8, **kwargs: object) -> SecondaryTier:
    backend = MemoryBackend(
        capacity_bytes=blocks * (HEADER_BYTES + ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
    )
    return SecondaryTier(backend, name="mem", **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.close()


def test_a_request_batch_becomes_one_job_per_tier_and_reads_the_exact_bytes(
    rigs: list[Rig], tmp_path: Path
) -> None:
    backend = FileBackend(
        path=tmp_path / "nvme",
        capacity_bytes=8 * slot_bytes_for(ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
    )
    rig = Rig(SecondaryTier(backend, name="nvme"))
    rigs.append(rig)
    rig.put_in_tier(k(1), k(2), k(3))
    promotions = rig.promotions
    promotions.batch(k(1), 0, "ctx-a", "a")
    promotions.batch(k(2), 0, "ctx-a", "a")
    promotions.batch(k(3), 0, "ctx-b", "b")
    assert promotions.batches == {
        "a": PromotionBatch("ctx-a", {0: [k(1), k(2)]}),
        "b": PromotionBatch("ctx-b", {0: [k(3)]}),
    }
    assert promotions.batched == {k(1): "a", k(2): "a", k(3): "b"}
    assert rig.jobs.in_flight == set()  # nothing submitted while batched
    promotions.flush()
    assert promotions.batches == {} and promotions.batched == {}
    jobs = sorted(rig.jobs.in_flight, key=lambda job: job.seq)
    assert [(j.kind, j.keys, j.req_context) for j in jobs] == [
        ("promote", (k(1), k(2)), "ctx-a"),
        ("promote", (k(3),), "ctx-b"),
    ]
    assert promotions.promoting == {k(1): 0, k(2): 0, k(3): 0}
    assert [rig.primary.lookup(key) for key in (k(1), k(2), k(3))] == [None] * 3  # being read
    rig.settle()
    assert promotions.promoting == {}
    rig.assert_promoted_exact(k(1), k(2), k(3))
    assert rig.tier.metrics.promoted_blocks == 3 and rig.tier.metrics.promotions == 2
    assert rig.tier.metrics.bytes_read == 3 * ROW_BYTES
    assert promotions.idle()


def test_a_key_is_never_promoted_twice_at_once(rigs: list[Rig]) -> None:
    rig = Rig(memory_tier())
    rigs.append(rig)
    rig.put_in_tier(k(1), k(2))
    rig.promotions.start({0: [k(1), k(1), k(2)]}, "ctx")
    rig.promotions.start({0: [k(2), k(1)]}, "ctx")  # both in flight already: no second job
    assert [j.keys for j in rig.jobs.in_flight] == [(k(1), k(2))]
    assert rig.promotions.promoting == {k(1): 0, k(2): 0}
    rig.settle()
    rig.assert_promoted_exact(k(1), k(2))
    assert rig.tier.metrics.promotions == 1


def test_promote_starts_at_once_standalone_and_joins_the_batch_step_driven(
    rigs: list[Rig],
) -> None:
    standalone = Rig(memory_tier())
    stepped = Rig(memory_tier(), step_driven=True)
    rigs += [standalone, stepped]
    for rig in (standalone, stepped):
        rig.put_in_tier(k(1), k(2))
        rig.promotions.promote({k(1): 0, k(2): 0}, "ctx")
    assert [j.keys for j in standalone.jobs.in_flight] == [(k(1), k(2))]
    assert standalone.promotions.batches == {}
    assert stepped.jobs.in_flight == set()
    assert stepped.promotions.batches == {"ctx": PromotionBatch("ctx", {0: [k(1), k(2)]})}
    stepped.promotions.flush()
    for rig in (standalone, stepped):
        rig.settle()
        rig.assert_promoted_exact(k(1), k(2))


def test_a_step_driven_reservation_takes_the_slot_at_lookup(rigs: list[Rig]) -> None:
    rig = Rig(memory_tier(), step_driven=True)
    rigs.append(rig)
    rig.put_in_tier(k(1))
    promotions = rig.promotions
    assert promotions.reserve(k(1), 0, "ctx", "ctx") is True
    slot = rig.primary.slot_of(k(1))
    assert slot is not None and rig.primary.lookup(k(1)) is None  # reserved, being written
    assert promotions.batches == {"ctx": PromotionBatch("ctx", {0: [k(1)]}, {k(1): slot})}
    assert promotions.promoting == {k(1): 0}
    promotions.flush()
    (job,) = rig.jobs.in_flight
    assert (job.kind, job.keys, job.slots) == ("promote", (k(1),), (slot,))
    rig.settle()
    rig.assert_promoted_exact(k(1))
    assert rig.primary.slot_of(k(1)) == slot and promotions.promoting == {}


def test_no_room_without_evicting_a_protected_key_is_counted_and_refused(
    rigs: list[Rig],
) -> None:
    rig = Rig(memory_tier(), blocks=1, step_driven=True)
    rigs.append(rig)
    rig.put_in_tier(k(1))
    out = rig.primary.prepare_store([k(9)], req_context="ctx")
    assert out is not None
    rig.primary.complete_store([k(9)], req_context="ctx")
    rig.promotions.protect("ctx", [k(9)])
    assert rig.promotions.reserve(k(1), 0, "ctx", "ctx") is False
    assert rig.promotions.without_space == 1
    assert rig.promotions.batches == {} and rig.promotions.promoting == {}
    assert rig.primary.lookup(k(9)) is True and rig.primary.lookup(k(1)) is False
    # Another request protects nothing: its promotion evicts k(9).
    assert rig.promotions.reserve(k(1), 0, "other", "other") is True
    rig.promotions.flush()
    rig.settle()
    rig.assert_promoted_exact(k(1))
    assert rig.primary.lookup(k(9)) is False


def test_over_the_job_bound_a_promotion_waits_for_its_turn(rigs: list[Rig]) -> None:
    rig = Rig(memory_tier(max_inflight_jobs=1))
    rigs.append(rig)
    rig.put_in_tier(k(1), k(2))
    promotions = rig.promotions
    promotions.start({0: [k(1)]}, "ctx-1")
    promotions.start({0: [k(2)]}, "ctx-2")
    assert [j.keys for j in rig.jobs.in_flight] == [(k(1),)]
    assert promotions.waiting == {0: [("ctx-2", [k(2)], None)]}
    assert promotions.promoting == {k(1): 0, k(2): 0}
    assert not promotions.idle()
    rig.settle()  # the first job's result frees the slot: the waiting one starts, then lands
    assert promotions.waiting == {} and promotions.promoting == {}
    rig.assert_promoted_exact(k(1), k(2))
    assert rig.tier.metrics.promotions == 2


def test_a_block_gone_from_the_backend_is_a_miss_forgotten_and_announced(
    rigs: list[Rig],
) -> None:
    tier = memory_tier()
    rig = Rig(tier)
    rigs.append(rig)
    rig.put_in_tier(k(1), k(2))
    assert rig.jobs.io.submit(tier.backend.delete([k(1)])).result(30) == [True]
    rig.events.take()
    rig.promotions.start({0: [k(1), k(2)]}, "ctx")
    rig.settle()
    rig.assert_promoted_exact(k(2))
    assert rig.primary.lookup(k(1)) is False and rig.primary.slot_of(k(1)) is None
    assert tier.state(k(1)) is TierKeyState.ABSENT and k(1) not in tier.held
    assert (tier.metrics.promotion_failures, tier.metrics.promoted_blocks) == (1, 1)
    assert rig.events.take() == [
        OffloadingEvent((k(2),), "CPU", False),
        OffloadingEvent((k(1),), "MEM", True, owner="mem"),
    ]
    assert rig.promotions.promoting == {}


def test_a_key_the_tier_lost_gives_its_reserved_slot_back(rigs: list[Rig]) -> None:
    rig = Rig(memory_tier(), step_driven=True)
    rigs.append(rig)
    rig.put_in_tier(k(1), k(2))
    assert rig.promotions.reserve(k(1), 0, "ctx", "ctx")
    assert rig.promotions.reserve(k(2), 0, "ctx", "ctx")
    free = rig.primary.num_free_blocks
    clear = rig.tier.start_clear()  # the tier forgets both keys before the batch is submitted
    assert isinstance(clear, TierJob)
    rig.jobs.submit(clear, lambda job, result: None)
    rig.settle()
    rig.promotions.flush()
    assert rig.jobs.in_flight == set()  # nothing left to read
    assert rig.primary.num_free_blocks == free + 2
    assert [rig.primary.lookup(key) for key in (k(1), k(2))] == [False, False]
    assert rig.promotions.promoting == {}


def test_clear_forgets_every_promotion_not_submitted(rigs: list[Rig]) -> None:
    rig = Rig(memory_tier(max_inflight_jobs=1), step_driven=True)
    rigs.append(rig)
    rig.put_in_tier(k(1), k(2))
    promotions = rig.promotions
    promotions.batch(k(1), 0, "ctx", "ctx")
    promotions.wait_for_job_slot(0, [k(2)], "ctx")
    promotions.protect("ctx", [k(3)])
    assert not promotions.idle()
    promotions.clear()
    assert (promotions.batches, promotions.batched, promotions.waiting) == ({}, {}, {})
    assert (promotions.promoting, promotions.step_protected) == ({}, {})
    assert promotions.idle()
