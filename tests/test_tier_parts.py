"""A secondary tier's collaborators, each on its own: its index, write policy, stall, settings
checks and job outcomes (tiering.managers.tier_*)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tiering.backends.base import Outcome
from tiering.backends.memory import MemoryBackend
from tiering.errors import ConfigurationError
from tiering.managers.latency import LatencyRecord
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tier_deadlines import TierStall
from tiering.managers.tier_index import TierIndex
from tiering.managers.tier_jobs import IOResult, TierJob, job_outcomes
from tiering.managers.tier_settings import check_tier_settings
from tiering.managers.tier_stats import TierMetrics
from tiering.managers.tier_write_policy import WritePolicy, WriteSchedule
from tiering.policies import EvictionPolicy, make_policy

OK, FAILED, MISSING, CORRUPT = Outcome.OK, Outcome.FAILED, Outcome.MISSING, Outcome.CORRUPT


def k(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


def index_of(*ready: int, capacity: int = 4) -> tuple[TierIndex, EvictionPolicy]:
    index = TierIndex(quarantine_seconds=60.0, quarantine_max_keys=16)
    policy = make_policy("lru", capacity)
    index.adopt(policy, [k(i) for i in ready])
    return index, policy


def job(kind: str, *ids: int) -> TierJob:
    async def io() -> None:
        return None

    coro = io()
    coro.close()
    return TierJob(kind, None, tuple(k(i) for i in ids), coro)  # type: ignore[arg-type]


def test_reserve_marks_absent_keys_writing_and_evicts_room() -> None:
    index, policy = index_of(1, 2, 3)
    index.quarantine[k(5)] = True
    assert index.reserve(policy, [k(3), k(4), k(5), k(4)], capacity=4) == (
        [k(4), k(5)],
        [k(1)],  # the oldest, not protected
    )
    assert index.held == {k(2), k(3), k(4), k(5)} == set(policy)
    assert index.writing == {k(4), k(5)}
    assert k(5) not in index.quarantine  # written again: no longer quarantined
    # Nothing absent: nothing to do; more than the capacity: None, nothing changed.
    assert index.reserve(policy, [k(2)], capacity=4) == ([], [])
    assert index.reserve(policy, [k(7), k(8)], capacity=1) is None
    assert index.held == {k(2), k(3), k(4), k(5)}


def test_publish_makes_written_keys_ready_and_forgets_failures() -> None:
    index, policy = index_of(capacity=4)
    index.reserve(policy, [k(1), k(2)], capacity=4)
    assert index.publish(policy, [k(1), k(2)], [OK, FAILED]) == [k(1)]
    assert index.held == {k(1)} == set(policy) and index.writing == set()
    assert policy.evict(1) == [k(1)]  # ready: evictable


def test_make_room_evicts_at_least_the_keys_that_found_the_backend_full() -> None:
    index, policy = index_of(1, 2, 3, 4, capacity=4)
    # The backend allows 2 blocks now: down to it, protected keys kept.
    assert index.make_room(policy, 1, capacity=2, protected={k(1)}) == [k(2), k(3)]
    assert index.held == {k(1), k(4)}
    # Cannot evict what it wants: at least what is needed.
    assert index.make_room(policy, 1, capacity=0, protected={k(1)}) == [k(4)]
    assert index.make_room(policy, 1, capacity=0, protected={k(1)}) is None


def test_reads_pin_until_the_last_ends_and_failures_are_sorted() -> None:
    index, policy = index_of(1, 2, 3, 4)
    index.pin_reads(policy, [k(1), k(1), k(2), k(3), k(4)])
    assert policy.evict(1) is None  # all pinned
    metrics = TierMetrics()
    buffers = [memoryview(bytearray(8))] * 4
    result = index.finish_reads(
        policy, [k(1), k(2), k(3), k(4)], buffers, [OK, CORRUPT, MISSING, FAILED], metrics
    )
    assert (result.loaded, result.failed, result.removed) == (
        [k(1)],
        [k(2), k(3), k(4)],
        [k(2), k(3)],
    )
    assert index.held == {k(1), k(4)} and k(4) in index.quarantine
    assert (metrics.bytes_read, metrics.promotion_failures, metrics.corrupt_blocks) == (8, 3, 1)
    assert (metrics.quarantined, metrics.promoted_blocks) == (1, 1)
    assert index.reading == {k(1): 1} and policy.evict(1, protected={k(4)}) is None
    index.release_reads(policy, [k(1)])
    assert index.reading == {} and policy.evict(1, protected={k(4)}) == [k(1)]


def test_stuck_keys_are_absent_until_forgotten() -> None:
    index, policy = index_of(1, 2)
    index.stuck.add(k(2))
    assert index.ready_keys(policy) == [k(1)]
    index.forget_stuck(policy, [k(1), k(2)])
    assert index.held == {k(1)} == set(policy) and index.stuck == set()
    assert index.clear(policy) == [k(1)] and index.held == set() and len(policy) == 0


def test_the_write_policy_says_what_to_write_now_and_what_is_owed() -> None:
    through = WriteSchedule(WritePolicy.WRITE_THROUGH, 2)
    assert through.to_write_now([k(1)], {}) == [k(1)]
    selective = WriteSchedule(WritePolicy.WRITE_THROUGH_SELECTIVE, 2)
    assert selective.to_write_now([k(1), k(2)], {k(2): 2, k(1): 1}) == [k(2)]
    assert selective.to_write_now([k(1)], {}) is None
    back = WriteSchedule(WritePolicy.WRITE_BACK, 2)
    assert back.to_write_now([k(1), k(2)], {}) is None
    assert back.settle_owed({k(3): 0, k(2): 1}) == [k(2)]
    assert back.owed == {k(1)} and back.settle_owed({k(2): 1}) == []


def test_a_stall_lasts_until_every_timed_out_job_returned(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index, policy = index_of(1)
    index.writing.update([k(2), k(3)])
    stall, metrics = TierStall("disk", 5.0), TierMetrics()
    store, promote = job("store", 2, 3), job("promote", 1)
    with caplog.at_level(logging.WARNING, logger="tiering.managers.secondary_tier"):
        assert stall.time_out(store, index, metrics) is True
        assert stall.time_out(promote, index, metrics) is False  # stalled already
        assert index.writing == set() and index.stuck == {k(2), k(3)}
        assert (metrics.timed_out_jobs, metrics.stalls) == (2, 1)
        assert (metrics.store_failures, metrics.promotion_failures) == (2, 1)
        assert stall.end(store) is False and stall.end(promote) is True
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        "tier 'disk' stalled",
        "tier 'disk' recovered",
    ]


def test_settings_out_of_bounds_name_the_tier() -> None:
    class Backend:
        name = "mem"

        class capabilities:
            shared = False

    backend: Any = Backend()

    def check(write_policy: str = "write_back", io_timeout_s: float = 1) -> WritePolicy:
        return check_tier_settings(
            "t",
            backend,
            shared=False,
            write_policy=write_policy,
            selective_min_lookups=1,
            max_inflight_jobs=1,
            io_timeout_s=io_timeout_s,
        )

    assert check() is WritePolicy.WRITE_BACK
    with pytest.raises(ConfigurationError, match=r"tier 't': io_timeout_s must be"):
        check(io_timeout_s=0)
    with pytest.raises(ConfigurationError, match=r"tier 't': unknown write_policy 'sometimes'"):
        check(write_policy="sometimes")
    Backend.capabilities.shared = True
    with pytest.raises(ConfigurationError, match=r"the 'mem' backend is shared"):
        check()


def test_job_outcomes_record_the_latency_or_fail_every_key() -> None:
    latencies = LatencyRecord()
    a_job = job("store", 1, 2)
    assert job_outcomes(a_job, IOResult([OK, FAILED], 0.5), latencies) == [OK, FAILED]
    assert job_outcomes(a_job, RuntimeError("lost"), latencies) == [FAILED, FAILED]
    assert latencies.count == 1


def test_held_stays_one_set_through_opening_and_clearing() -> None:
    """A manager keeps a reference to each tier's ``held`` (its lookups probe it): the tier
    never swaps the set for another."""
    tier = SecondaryTier(
        MemoryBackend(capacity_bytes=4 * 64, block_bytes=64, fingerprint=b"f" * 16)
    )
    held = tier.held
    tier.adopt([k(1), k(2)])
    assert tier.held is held and held == {k(1), k(2)} == set(tier.policy)
    clear = tier.start_clear()
    assert clear is not None and clear.keys == (k(1), k(2)) and clear.removed == clear.keys
    clear.io.close()
    assert tier.held is held and held == set()
