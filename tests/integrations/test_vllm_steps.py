"""Step probe: how many scheduler step ends a tier result takes, drop-in against vLLM 0.33.

The same scenario on vLLM's own ``TieringOffloadingSpec`` (its CPU tier over tiering's file tier)
and on tiering's drop-in (``TieringSpec``, CPU tier over the same file tier): a chunk stored,
written through to the tier, evicted from the CPU tier, looked up again. Counted: the step ends
after the lookup that started its promotion until a lookup answers ``HIT``, and the step ends
after a store until the cascade released its CPU rows (the chunks are evictable again). The
tiers' I/O finishes between steps (``drain_tiers``: the model step), so the counts are exact.
With ``tiering_deterministic_steps`` the drop-in applies results one or two step ends later.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_vllm_dropin import dropin_extra, write_yaml
from test_vllm_tiers import file_tier
from vllm.v1.kv_offload.base import LookupResult, ScheduleEndContext
from vllm_harness import ManagerDriver, keys_for, offloading_config, tiering_spec_extra

from tiering.integrations import vllm_plugin

CPU_CHUNKS = 4
SLOT_BYTES = 8192  # the file backend's slot for a 4 KiB chunk


@pytest.fixture(autouse=True)
def registered() -> None:
    vllm_plugin.register()


@pytest.fixture
def drivers() -> Iterator[list[ManagerDriver]]:
    made: list[ManagerDriver] = []
    yield made
    for driver in made:
        driver.shutdown()


def _vllm_driver(root: Path) -> ManagerDriver:
    tier = file_tier(root, blocks=16)
    return ManagerDriver.create(offloading_config(tiering_spec_extra(CPU_CHUNKS, [tier])))


def _dropin_driver(root: Path, **extra: Any) -> ManagerDriver:
    tiers = [{"name": "nvme", "type": "file", "capacity": 16 * SLOT_BYTES, "path": "./nvme"}]
    config = write_yaml(root, tiers)
    keys = dropin_extra(config, CPU_CHUNKS, **{"tiering_deterministic_steps": False, **extra})
    return ManagerDriver.create(offloading_config(keys))


def _step_ends_until_hit(driver: ManagerDriver) -> int:
    """Store a chunk, push it out of the CPU tier, look it up: step ends until a HIT."""
    context = driver.new_request("probe")
    (target,) = keys_for("target", 1)
    driver.store(context, [target])
    driver.settle()  # written through to the tier, its CPU row released
    driver.store(context, keys_for("filler", CPU_CHUNKS))  # evicts it from the CPU tier
    driver.settle()
    assert driver.lookup(context, [target]) == [LookupResult.HIT_PENDING]  # ends the step
    ends = 1
    while True:
        with driver.manager.lock:
            answer = driver.manager.lookup(target, context)
            driver.manager.on_schedule_end(ScheduleEndContext((), ()))
        driver.drain_tiers()
        if answer is LookupResult.HIT:
            return ends
        ends += 1
        assert ends < 6, f"no HIT after {ends} step ends: {answer}"


def _step_ends_until_rows_free(driver: ManagerDriver) -> int:
    """Fill the CPU tier; step ends until the cascade released its rows (a store evicts)."""
    context = driver.new_request("rows")
    driver.store(context, keys_for("full", CPU_CHUNKS))  # ends the step, tier I/O drained
    ends = 1
    newcomer = keys_for("newcomer", 1)
    while True:
        with driver.manager.lock:
            out = driver.manager.prepare_store(newcomer, context)
            driver.manager.on_schedule_end(ScheduleEndContext((), ()))
        driver.drain_tiers()
        if out is not None:
            return ends
        ends += 1
        assert ends < 6, f"rows still held after {ends} step ends"


def test_a_promoted_chunk_is_hit_after_as_few_step_ends_as_with_vllm(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    theirs = _vllm_driver(tmp_path / "vllm")
    ours = _dropin_driver(tmp_path / "dropin")
    slow = _dropin_driver(tmp_path / "slow", tiering_deterministic_steps=True)
    drivers += [theirs, ours, slow]
    expected = _step_ends_until_hit(theirs)
    assert expected == 1
    assert _step_ends_until_hit(ours) == expected
    assert _step_ends_until_hit(slow) == expected + 1  # determinism's cost: one step end


def test_cascaded_rows_are_released_as_early_as_with_vllm(
    tmp_path: Path, drivers: list[ManagerDriver]
) -> None:
    theirs = _vllm_driver(tmp_path / "vllm")
    ours = _dropin_driver(tmp_path / "dropin")
    slow = _dropin_driver(tmp_path / "slow", tiering_deterministic_steps=True)
    drivers += [theirs, ours, slow]
    expected = _step_ends_until_rows_free(theirs)
    assert _step_ends_until_rows_free(ours) == expected
    # Deterministic: the cascade, submitted at the store's completion (after its step ended),
    # applies at the end of the step after the next.
    assert _step_ends_until_rows_free(slow) == expected + 2
