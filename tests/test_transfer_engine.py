"""The transfer engine on CPU caches: handle lifecycle, ordering, errors, strategy choice.

The copies run on the engine's worker threads. A gate in front of a strategy (a white-box
substitution of a lane's strategy) holds a copy until the test releases it, so "submit
returned before the copy ended" is an observed fact, not a timing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from tiering.cli.doctor import run_doctor
from tiering.config import parse_config
from tiering.errors import BackendError, ConfigurationError
from tiering.testing.copy_strategy_tests import HybridModel, transfer
from tiering.transfer import (
    COPY_BACKENDS,
    CopyPlan,
    CopyStrategy,
    Direction,
    TransferEngine,
    machine_choice,
)

STORE = transfer([[1, 2], [3], [4], [5]], [[0, 1], [2], [3], [4]])
OTHER_SLOTS = transfer([[6], [7], [], []], [[8], [9], [], []])


class Gated(CopyStrategy):
    """Runs the wrapped strategy once ``release`` is set; records that it started."""

    name = "memmove"

    def __init__(self, inner: CopyStrategy, release: threading.Event | None = None) -> None:
        super().__init__(inner.geometry)
        self.inner = inner
        self.release = release or threading.Event()
        self.started = threading.Event()
        self.timed_out = False

    def copy(self, plan: CopyPlan) -> object:
        self.started.set()
        # The timeout only keeps a broken engine from hanging the suite; it decides nothing.
        self.timed_out = not self.release.wait(timeout=60)
        return self.inner.copy(plan)


class Failing(CopyStrategy):
    name = "memmove"

    def copy(self, plan: CopyPlan) -> object:
        raise RuntimeError("the copy engine caught fire")


def gate(engine: TransferEngine, direction: Direction, **kwargs: object) -> Gated:
    lane = engine._lanes[direction]
    gated = Gated(lane.strategy, **kwargs)  # type: ignore[arg-type]
    lane.strategy = gated
    return gated


def test_submit_returns_before_the_copy_ends_and_poll_never_waits() -> None:
    model = HybridModel(1)
    gated = gate(model.engine, "store")
    before = model.snapshot()
    handle = model.engine.submit_store(STORE)
    assert gated.started.wait(timeout=60)  # the copy is under way on the engine's thread...
    assert not handle.done and handle.error is None
    assert model.engine.poll() == []  # ...and poll() returned without waiting for it
    assert model.engine.in_flight == 1
    assert model.snapshot() == before  # nothing moved yet
    assert handle.bytes == 2 * 1024 + 4096 + 1024 + 224  # known at submission
    gated.release.set()
    assert model.engine.wait(handle) is handle
    assert handle.ok and handle.copy_s is not None and handle.copy_s >= 0
    assert model.snapshot() != before
    assert model.engine.poll() == [] and model.engine.in_flight == 0  # wait() reported it


def test_loads_do_not_queue_behind_stores() -> None:
    model = HybridModel(2)
    model.store(OTHER_SLOTS)
    release = threading.Event()
    gated = gate(model.engine, "store", release=release)
    store = model.engine.submit_store(STORE)
    assert gated.started.wait(timeout=60)
    load = model.engine.submit_load(OTHER_SLOTS)
    model.engine.wait(load)  # finishes while the store is still held
    assert load.ok and not store.done
    release.set()
    model.engine.wait(store)
    assert store.ok and not gated.timed_out


def test_poll_reports_every_finished_handle_once_in_submission_order() -> None:
    model = HybridModel(3)
    gated = gate(model.engine, "store")
    handles = [model.engine.submit_store(STORE, job_id=100 + i) for i in range(3)]
    assert [h.job_id for h in handles] == [100, 101, 102]
    gated.release.set()
    model.engine.wait(handles[2])  # one thread, in order: 0 and 1 have finished too
    assert model.engine.poll() == handles[:2]  # 2 was reported by wait()
    assert all(h.ok for h in handles)
    assert model.engine.poll() == []
    auto = model.engine.submit_load(STORE)
    assert auto.job_id == 0  # ids count from 0 when the caller gives none
    model.engine.wait(auto)


def test_a_failing_copy_is_reported_on_its_handle_and_later_jobs_run() -> None:
    model = HybridModel(4)
    lane = model.engine._lanes["store"]
    working, lane.strategy = lane.strategy, Failing(lane.strategy.geometry)
    failed = model.engine.submit_store(STORE)
    model.engine.wait(failed)
    assert failed.done and not failed.ok
    assert isinstance(failed.error, RuntimeError) and "caught fire" in str(failed.error)
    assert "failed" in repr(failed)
    lane.strategy = working
    ok = model.engine.submit_store(STORE)
    while not (finished := model.engine.poll()):
        pass  # poll() never waits; the copy is a few microseconds of memmove
    assert finished == [ok] and ok.ok


def test_close_waits_for_copies_in_flight_and_refuses_new_jobs() -> None:
    model = HybridModel(5)
    gated = gate(model.engine, "store")
    handle = model.engine.submit_store(STORE)
    closer = threading.Thread(target=model.engine.close)
    closer.start()
    assert gated.started.wait(timeout=60)
    gated.release.set()
    closer.join(timeout=60)
    assert handle.done and handle.ok
    with pytest.raises(BackendError, match=r"the transfer engine is closed"):
        model.engine.submit_load(STORE)
    model.engine.close()  # idempotent


def test_wait_refuses_a_handle_of_another_engine_and_cpu_handles_have_no_event() -> None:
    first, second = HybridModel(6), HybridModel(7)
    handle = first.engine.submit_store(STORE)
    with pytest.raises(BackendError, match=r"was not submitted to this engine"):
        second.engine.wait(handle)
    first.engine.wait(handle)
    with pytest.raises(ConfigurationError, match=r"has no CUDA event to wait on"):
        handle.make_stream_wait()


def test_copy_backend_names_are_checked_and_unusable_ones_say_why() -> None:
    model = HybridModel(8)
    with pytest.raises(ConfigurationError, match=r"copy_backend must be one of 'auto', 'triton'"):
        TransferEngine(model.caches, model.pool, copy_backend="fast")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"'batched_memcpy' needs CUDA KV caches, not cpu"):
        TransferEngine(model.caches, model.pool, copy_backend="batched_memcpy")
    assert set(COPY_BACKENDS) == {"auto", "triton", "batched_memcpy", "staging", "memmove", "torch"}


def test_the_config_key_chooses_the_strategy_and_doctor_reports_it(tmp_path: Path) -> None:
    config = parse_config(
        {"version": 1, "primary": {"capacity": "1MiB", "copy_backend": "staging"}},
        source=str(tmp_path / "t.yaml"),
    )
    assert config.primary.copy_backend == "staging"
    model = HybridModel(9, copy_backend=config.primary.copy_backend)
    assert model.engine.strategy.name == "staging"
    checks = {c.name: c for c in run_doctor(config)}
    choice = machine_choice()
    assert checks["copy backend"].detail == (
        f"staging (primary.copy_backend); auto would pick {choice.name}: {choice.reason}"
    )
    plain = {c.name: c for c in run_doctor(None)}["copy backend"]
    if not torch.cuda.is_available():
        assert plain.verdict == "OK" and plain.detail.startswith("memmove: no CUDA device")
