"""`tiering replay`: reproducible numbers, LRU hits checked by an independent computation."""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest

from tiering.cli import main as cli_main
from tiering.config import TieringConfig, parse_config
from tiering.hashing import PrefixHasher
from tiering.replay import ReplayOptions, policy_study, run_replay
from tiering.replay.traces import builtin_trace

TIMING_KEYS = {"wall_s", "load_ms", "store_ms", "store_job_ms", "load_job_ms"}
TIMING_KEYS |= {"write_gbps", "read_gbps"}


def config(tmp_path: Path, shape: str, cpu: str, tiers: list[dict[str, Any]]) -> TieringConfig:
    return parse_config(
        {
            "version": 1,
            "model": {"shape": shape},
            "hashing": {"hash_block_size": 16},
            "primary": {"capacity": cpu, "policy": "lru"},
            "secondary_tiers": tiers,
        },
        source=str(tmp_path / "tiering.yaml"),
        base_dir=tmp_path,
        env={},
    )


def without_timing(report: Any) -> Any:
    if isinstance(report, dict):
        return {k: without_timing(v) for k, v in report.items() if k not in TIMING_KEYS}
    return report


def independent_lru_hit_tokens(capacity: int, requests: list[Any], block: int) -> int:
    """The manager protocol with LRU, written plainly: hit prefix, touch, store the rest."""
    hasher = PrefixHasher(block)
    cache: OrderedDict[bytes, None] = OrderedDict()
    saved = 0
    for request in requests:
        keys = hasher.hash_blocks(request.token_ids, request.extra_keys)
        limit = min(len(keys), (len(request.token_ids) - 1) // block)
        hit = 0
        while hit < limit and keys[hit] in cache:
            hit += 1
        saved += hit * block
        for key in reversed(keys[:hit]):
            cache.move_to_end(key)
        to_store = [k for k in dict.fromkeys(keys[hit:]) if k not in cache]
        shortfall = len(cache) + len(to_store) - capacity
        if len(to_store) > capacity:
            continue
        if shortfall > 0:
            protected = set(keys[hit:])
            victims = [k for k in cache if k not in protected][:shortfall]
            if len(victims) < shortfall:
                continue
            for victim in victims:
                del cache[victim]
        for key in to_store:
            cache[key] = None
    return saved


def test_lru_hits_agree_with_an_independent_computation(tmp_path: Path) -> None:
    cfg = config(tmp_path, "tiny", "400KiB", [])  # 100 blocks of 4 KiB
    options = ReplayOptions(trace="chat", scale="tiny", seed=3, engine_blocks=512, progress=False)
    report = run_replay(cfg, options)
    requests = builtin_trace("chat", scale="tiny", seed=3)
    expected = independent_lru_hit_tokens(100, requests, 16)
    assert report["prefill_tokens_saved"] == expected
    assert 0 < expected < report["prompt_tokens"]
    assert report["verify_failures"] == 0


def test_same_seed_same_numbers_with_file_and_lmdb_tiers(tmp_path: Path) -> None:
    tiers: list[dict[str, Any]] = [
        {"name": "nvme", "type": "file", "capacity": "3MiB", "path": "nvme"},
        {"name": "lmdb", "type": "lmdb", "capacity": "2MiB", "path": "lmdb", "sync": False},
    ]
    reports = []
    for run in range(2):
        cfg = config(tmp_path / f"run{run}", "tiny-hybrid", "1MiB", tiers)
        options = ReplayOptions(
            trace="mixed",
            scale="tiny",
            seed=1,
            engine_blocks=1024,
            max_requests=120,
            progress=False,
        )
        reports.append(run_replay(cfg, options))
    first, second = (without_timing(r) for r in reports)
    first.pop("config"), second.pop("config")
    assert first == second
    tiers_report = reports[0]["tiers"]
    assert tiers_report["NVME"]["blocks_served"] > 0  # promotions really happened
    assert tiers_report["NVME"]["evictions"] > 0 and tiers_report["CPU"]["blocks_served"] > 0
    assert reports[0]["verify_failures"] == 0


def test_policy_study_bounds_policies_by_belady() -> None:
    requests = builtin_trace("chat", scale="tiny", seed=0)
    hasher = PrefixHasher(16)
    keys = [hasher.hash_blocks(r.token_ids, r.extra_keys) for r in requests]
    rows = policy_study(keys, [50, 200], ["lru", "arc"])
    for capacity in (50, 200):
        by_policy = {r["policy"]: r for r in rows if r["capacity_blocks"] == capacity}
        assert set(by_policy) == {"lru", "arc", "belady"}
        for name in ("lru", "arc"):
            assert by_policy[name]["block_hit_ratio"] <= by_policy["belady"]["block_hit_ratio"]


def test_cli_replay_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "tiering.yaml"
    path.write_text(
        "version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 256KiB}\n"
        "secondary_tiers:\n  - {type: file, capacity: 1MiB, path: nvme}\n"
        "replay: {trace: agent, scale: tiny, engine_blocks: 512, max_requests: 40}\n"
    )
    assert cli_main(["replay", "--config", str(path), "--json", "--policy-study"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["requests"] == 40
    assert set(report["tiers"]) == {"CPU", "FILE"}
    assert {row["policy"] for row in report["policy_study"]} == {"lru", "arc", "belady"}


REPLAY_CONFIG = (
    "version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 256KiB}\n"
    "secondary_tiers:\n  - {type: file, capacity: 1MiB, path: nvme}\n"
    "replay: {trace: agent, scale: tiny, engine_blocks: 512, max_requests: 40}\n"
)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--policy-study", "--sizes", "0.1,lots"], "--sizes: 'lots' is not a number"),
        (["--policy-study", "--sizes", "0.1,2"], "--sizes: '2' is not a fraction in (0, 1]"),
        (["--policy-study", "--policies", "lru,lfu"], "--policies: unknown eviction policy 'lfu'"),
        (["--plot", "no/such/dir/plot.png"], "--plot"),
        (["--plot", "plot.txt"], "--plot"),
    ],
    ids=["sizes-text", "sizes-range", "policies", "plot-dir", "plot-suffix"],
)
def test_replay_options_are_checked_before_the_replay_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    """A bad option fails at once, before any tier is built: no report is thrown away."""
    path = tmp_path / "tiering.yaml"
    path.write_text(REPLAY_CONFIG)
    status = cli_main(["replay", "--config", str(path), "--json", *options])
    err = capsys.readouterr().err
    assert status == 2
    assert message in err
    assert not (tmp_path / "nvme").exists()  # the replay never started


def test_plot_without_matplotlib_fails_before_the_replay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    path = tmp_path / "tiering.yaml"
    path.write_text(REPLAY_CONFIG)
    status = cli_main(["replay", "--config", str(path), "--plot", str(tmp_path / "p.png")])
    assert status == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "nvme").exists()
