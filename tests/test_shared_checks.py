"""The shared tier's existence checks on their own: which keys are checked, what a check's result
leaves behind, where a key's location is unknown; and, with the promotions collaborator, the
keys a check finds are promoted with their exact bytes. Real tiers, no manager."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from tiering.backends.base import BackendCapabilities
from tiering.backends.memory import MemoryBackend
from tiering.core.block_format import HEADER_BYTES, make_layout_fingerprint
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.event_log import EventLog
from tiering.managers.job_runner import TierJobs
from tiering.managers.promotions import Promotions
from tiering.managers.secondary_tier import SecondaryTier, TierJob, TierKeyState
from tiering.managers.shared_checks import SharedChecks
from tiering.managers.shared_tier import SharedTier

ROW_BYTES = 128
FINGERPRINT = make_layout_fingerprint({"test-shared-checks": ROW_BYTES})
SCRATCH = 7  # the row blocks are written to the stores from (not a primary slot: 4 blocks)
READY, ABSENT, UNKNOWN = TierKeyState.READY, TierKeyState.ABSENT, TierKeyState.UNKNOWN


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def payload(key: bytes) -> np.ndarray:
    return np.frombuffer(bytes((key[7] * 11 + 3 * i) % 256 for i in range(ROW_BYTES)), np.uint8)


class SharedMemory(MemoryBackend):
    """A memory store other nodes share; it cannot tell about the keys in ``unanswerable``
    (their node is down)."""

    unanswerable: frozenset[bytes] = frozenset()

    @property
    def capabilities(self) -> BackendCapabilities:
        return dataclasses.replace(super().capabilities, shared=True)

    async def exists(self, keys: Sequence[bytes]) -> list[bool | None]:
        present = await self.contains(keys)
        unanswerable = self.unanswerable
        return [None if key in unanswerable else p for key, p in zip(keys, present, strict=True)]


def backend_kwargs() -> dict[str, object]:
    return {
        "capacity_bytes": 16 * (HEADER_BYTES + ROW_BYTES),
        "block_bytes": ROW_BYTES,
        "fingerprint": FINGERPRINT,
    }


class Rig:
    """A primary of 4 slots, a local memory tier, then a shared tier; the shared tier's checks
    and the promotions over both."""

    def __init__(self) -> None:
        self.rows = np.zeros((8, ROW_BYTES), np.uint8)
        self.primary = CPUOffloadingManager(4, "lru", enable_events=True)
        self.store = SharedMemory(**backend_kwargs())  # type: ignore[arg-type]
        self.local = SecondaryTier(MemoryBackend(**backend_kwargs()), name="local")  # type: ignore[arg-type]
        self.shared = SharedTier(self.store, name="shared", existence_cache_seconds=3600.0)
        self.tiers: list[SecondaryTier] = [self.local, self.shared]
        self.jobs = TierJobs()
        for tier in self.tiers:
            tier.attach(self.rows)
            self.jobs.submit(tier.start_open(), tier.finish_open)
        self.checks = SharedChecks(self.shared, 1, self.primary, [self.local], {})
        self.promotions = Promotions(
            self.primary,
            self.tiers,
            self.jobs,
            EventLog(self.primary, True),
            {},
            step_driven=False,
            shared_checks=self.checks,
        )
        self.settle()

    def run(self, coro: object) -> object:
        """Run a coroutine on the I/O loop (the backends' home) and return its result."""
        return self.jobs.io.submit(coro).result(30)  # type: ignore[arg-type]

    def settle(self) -> None:
        """Wait for every job in flight and apply the results (the manager's way)."""
        jobs = self.jobs
        while jobs.in_flight:
            jobs.collect(block_until_all=time.monotonic() + 30)
            for on_done, job, result in jobs.take_ready():
                jobs.in_flight.discard(job)
                on_done(job, result)

    def written_by_another_node(self, *keys: OffloadKey) -> None:
        for key in keys:
            self.run(self.store.put([key], [memoryview(payload(key).tobytes())]))

    def put_in_local_tier(self, key: OffloadKey) -> None:
        self.rows[SCRATCH] = payload(key)
        job = self.local.start_store([key], {key: SCRATCH}, lookup_counts={})
        assert job is not None
        self.jobs.submit(job, self._store_done)
        self.settle()
        self.rows[SCRATCH] = 0

    def _store_done(self, job: TierJob, result: object) -> None:
        self.local.finish_store(job, result)

    def store_in_primary(self, key: OffloadKey) -> None:
        out = self.primary.prepare_store([key], req_context="engine")
        assert out is not None and out.keys_to_store == [key]
        self.primary.complete_store([key], req_context="engine")


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig()
    yield made
    made.jobs.close()


def test_unknown_keys_become_one_check_and_count_as_promoted_meanwhile(rig: Rig) -> None:
    rig.written_by_another_node(k(1))
    assert [rig.shared.state(key) for key in (k(1), k(2))] == [UNKNOWN, UNKNOWN]
    present, job = rig.checks.start([k(1), k(2), k(1)], "ctx")
    assert present == []
    assert job is not None
    assert (job.kind, job.keys, job.req_context) == ("check", (k(1), k(2)), "ctx")
    assert rig.checks.promoting == {k(1): 1, k(2): 1}
    metrics = rig.shared.metrics
    assert (metrics.existence_checks, metrics.checked_keys) == (1, 2)
    found = rig.checks.finish(job, rig.run(job.io))
    assert found == [k(1)]
    assert rig.checks.promoting == {}
    assert [rig.shared.state(key) for key in (k(1), k(2))] == [READY, ABSENT]
    assert (metrics.check_hits, metrics.check_absent, metrics.check_unknown) == (1, 1, 0)


def test_known_keys_are_not_asked_about_again(rig: Rig) -> None:
    rig.written_by_another_node(k(1))
    _, job = rig.checks.start([k(1), k(2)], "ctx")
    assert job is not None
    rig.checks.finish(job, rig.run(job.io))
    present, again = rig.checks.start([k(2), k(1), k(3)], "ctx")
    assert present == [k(1)]  # cached present: promoted at once
    assert again is not None and again.keys == (k(3),)  # k(2) is cached absent
    assert rig.checks.promoting == {k(3): 1}
    assert rig.shared.metrics.checked_keys == 3
    assert rig.checks.finish(again, rig.run(again.io)) == []
    assert rig.checks.promoting == {} and rig.shared.state(k(3)) is ABSENT


def test_a_key_the_primary_holds_is_not_checked(rig: Rig) -> None:
    rig.store_in_primary(k(5))
    assert rig.checks.start([k(5)], "ctx") == ([], None)
    assert rig.checks.promoting == {} and rig.shared.metrics.existence_checks == 0


def test_an_unanswered_key_is_quarantined_not_cached(rig: Rig) -> None:
    rig.written_by_another_node(k(1), k(2))
    rig.store.unanswerable = frozenset({k(2)})
    _, job = rig.checks.start([k(1), k(2)], "ctx")
    assert job is not None
    assert rig.checks.finish(job, rig.run(job.io)) == [k(1)]
    assert [rig.shared.state(key) for key in (k(1), k(2))] == [READY, ABSENT]
    assert not rig.shared.is_unknown(k(2))  # quarantined: not asked again meanwhile
    assert rig.checks.start([k(2)], "ctx") == ([], None)
    metrics = rig.shared.metrics
    assert (metrics.check_hits, metrics.check_unknown, metrics.quarantined) == (1, 1, 1)


def test_the_location_is_unknown_only_where_no_tier_knows_the_key(rig: Rig) -> None:
    rig.written_by_another_node(k(1))
    rig.put_in_local_tier(k(3))
    rig.store_in_primary(k(4))
    assert rig.checks.location_unknown(k(1)) is True  # only the store may hold it
    assert rig.checks.location_unknown(k(3)) is False  # the local tier holds it
    assert rig.checks.location_unknown(k(4)) is False  # the primary holds it
    _, job = rig.checks.start([k(1), k(2)], "ctx")
    assert job is not None
    rig.checks.finish(job, rig.run(job.io))
    assert rig.checks.location_unknown(k(1)) is False  # known present
    assert rig.checks.location_unknown(k(2)) is False  # known absent


def test_the_keys_a_check_finds_are_promoted_with_their_bytes(rig: Rig) -> None:
    rig.written_by_another_node(k(1), k(2))
    rig.promotions.start({1: [k(1), k(2), k(3)]}, "ctx")  # the shared tier's index is 1
    (check,) = rig.jobs.in_flight
    assert (check.kind, check.keys) == ("check", (k(1), k(2), k(3)))
    assert rig.promotions.promoting == {k(1): 1, k(2): 1, k(3): 1}
    rig.settle()  # the check's result starts the promotion of what it found; then it lands
    assert rig.promotions.promoting == {}
    for key in (k(1), k(2)):
        slot = rig.primary.slot_of(key)
        assert rig.primary.lookup(key) is True and slot is not None
        assert bytes(rig.rows[slot]) == bytes(payload(key))
    assert rig.primary.lookup(k(3)) is False
    metrics = rig.shared.metrics
    assert (metrics.existence_checks, metrics.check_hits, metrics.promoted_blocks) == (1, 2, 2)
    # Asked again, the cached answers promote nothing twice and check nothing.
    rig.promotions.start({1: [k(1), k(3)]}, "ctx")
    assert rig.jobs.in_flight == set() and metrics.existence_checks == 1
