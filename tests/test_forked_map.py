"""map_forked: the pieces of a computation in forked processes, and the policy study through it
(the same rows, in the same order, as in one process)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import tiering.replay.forked_map as forked_map
from tiering.cli import main as cli_main
from tiering.errors import TieringError
from tiering.policies.lru import LRUPolicy
from tiering.replay.block_trace import BlockRequest, write_mooncake
from tiering.replay.forked_map import can_fork, map_forked
from tiering.replay.study import TierModel, run_study, study_trace_from_blocks
from tiering.replay.workloads import workload_trace

needs_fork = pytest.mark.skipif(not can_fork(), reason="no fork on this platform")


def _square_and_pid(i: int) -> tuple[int, int]:
    return i * i, os.getpid()


@needs_fork
def test_pieces_run_in_other_processes_and_every_result_comes_back_once() -> None:
    with map_forked(_square_and_pid, 12, 3) as results:
        got = list(results)
    assert sorted(i for i, _ in got) == list(range(12))
    assert {i: square for i, (square, _) in got} == {i: i * i for i in range(12)}
    pids = {pid for _, (_, pid) in got}
    assert os.getpid() not in pids and 1 <= len(pids) <= 3
    assert forked_map._task is None  # released for the next map


def test_one_job_runs_the_pieces_here_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    with map_forked(_square_and_pid, 4, 1) as results:
        assert list(results) == [(i, (i * i, os.getpid())) for i in range(4)]
    monkeypatch.setattr(forked_map, "can_fork", lambda: False)  # e.g. Windows
    with map_forked(_square_and_pid, 4, 8) as results:
        assert list(results) == [(i, (i * i, os.getpid())) for i in range(4)]


def _fails_at_five(i: int) -> int:
    if i == 5:
        raise ValueError(f"piece {i} is bad")
    return i


@needs_fork
def test_a_piece_that_raises_raises_here_and_the_map_ends() -> None:
    with pytest.raises(ValueError, match="piece 5 is bad"):
        with map_forked(_fails_at_five, 8, 2) as results:
            for _ in results:
                pass
    assert forked_map._task is None
    with map_forked(_square_and_pid, 2, 2) as results:  # a later map works
        assert sorted(i for i, _ in results) == [0, 1]


@needs_fork
def test_maps_do_not_nest_and_jobs_must_be_positive() -> None:
    with pytest.raises(ValueError, match="jobs must be >= 1, got 0"):
        with map_forked(_square_and_pid, 2, 0):
            pass
    with map_forked(_square_and_pid, 2, 2) as results:
        with pytest.raises(RuntimeError, match="not reentrant"):
            with map_forked(_square_and_pid, 2, 2):
                pass
        assert len(list(results)) == 2


@needs_fork
def test_the_study_in_forked_processes_gives_the_rows_of_one_process() -> None:
    trace = study_trace_from_blocks(workload_trace("production", "tiny", 0), 512)
    capacities = [max(1, trace.unique_blocks // d) for d in (50, 10, 3)]
    # A write-back tier reads the CPU's victims: the richest row there is.
    tiers = [
        TierModel("nvme", 40, policy="arc", admission_min_count=2, block_bytes=1),
        TierModel("lmdb", 20, write_policy="write_back", block_bytes=1),
    ]
    args = (trace, capacities, ["lru", "arc", "hybrid"])
    one = run_study(*args, tiers=tiers, block_bytes=1)
    assert run_study(*args, tiers=tiers, block_bytes=1, jobs=3) == one
    assert len(one) == 12 and any(r["tiers"]["lmdb"]["served_blocks"] for r in one)


_PARENT_PID = os.getpid()


class DiesInAChild(LRUPolicy):
    """An LRU whose construction in a worker process ends that process, as the kernel's
    out-of-memory killer would."""

    def __init__(self, capacity: int) -> None:
        if os.getpid() != _PARENT_PID:
            os._exit(1)
        super().__init__(capacity)


@needs_fork
def test_a_study_worker_that_dies_is_a_clear_error() -> None:
    trace = study_trace_from_blocks(workload_trace("production", "tiny", 0), 512)
    with pytest.raises(TieringError, match=r"a study process of 2 jobs ended abruptly .*fewer"):
        run_study(trace, [10, 20], ["lru", f"{__name__}:DiesInAChild"], jobs=2)
    assert forked_map._task is None
    assert run_study(trace, [10], [f"{__name__}:DiesInAChild"], belady=False)  # here it lives


@needs_fork
def test_policy_study_jobs_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tiering.yaml"
    config.write_text(
        "version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 1MiB}\n"
        "secondary_tiers:\n  - {type: file, capacity: 4MiB, path: nvme}\n"
    )
    trace = tmp_path / "trace.jsonl"
    write_mooncake(
        [BlockRequest(f"r{i}", i, 2048, 0, (i % 3, 10 + i % 5, 20 + i)) for i in range(40)],
        trace,
    )
    base = ["policy-study", "--config", str(config), "--trace", str(trace), "--json"]
    outputs = []
    for jobs in ("1", "2"):
        assert cli_main([*base, "--jobs", jobs]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1] and len(outputs[0]["policy_study"]) > 5
    assert cli_main([*base, "--jobs", "0"]) == 2
    assert "--jobs must be an int >= 1, got 0" in capsys.readouterr().err
