"""WorkloadShape: generated traffic of other shapes than the calibrated one."""

from __future__ import annotations

import hashlib
import json
import runpy
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from tiering.cli import main as cli_main
from tiering.config import load_config
from tiering.config.workload_shape import format_shape
from tiering.errors import ConfigError, ConfigurationError
from tiering.replay import runner
from tiering.replay.block_trace import BlockRequest, block_summary
from tiering.replay.replay_run import load_trace
from tiering.replay.study import capacities_for, run_study, study_trace_from_blocks
from tiering.replay.workloads import (
    WorkloadMix,
    WorkloadShape,
    generate,
    parse_shape,
    workload_trace,
)

# The calibrated traces, as generated before WorkloadShape existed: studies and the docs'
# figures repeat only while these stay the same.
CALIBRATED_SHA256 = {
    "conversation": "ce77a6f1c801427e",
    "toolagent": "86efb3c26cd5c3e5",
    "documents": "6d5bcd7b5fcaa587",
    "production": "c7f7cb99a1e52061",
}


def _digest(requests: list[BlockRequest]) -> str:
    """The digest of the requests' repr as it was when the digests above were taken (before
    ``continues``, which a generated request never has)."""
    assert all(request.continues is None for request in requests)
    legacy = ", ".join(
        f"BlockRequest(request_id={r.request_id!r}, arrival_s={r.arrival_s!r}, "
        f"input_tokens={r.input_tokens!r}, output_tokens={r.output_tokens!r}, "
        f"block_ids={r.block_ids!r})"
        for r in requests
    )
    return hashlib.sha256(f"[{legacy}]".encode()).hexdigest()[:16]


def _sessions(requests: list[BlockRequest]) -> dict[str, list[BlockRequest]]:
    by_session: dict[str, list[BlockRequest]] = defaultdict(list)
    for request in requests:  # request ids name their session: "chat17-s0-42"
        by_session[request.request_id.split("-s")[0]].append(request)
    return by_session


@pytest.mark.parametrize("name", sorted(CALIBRATED_SHA256))
def test_the_default_shape_is_the_calibrated_trace(name: str) -> None:
    assert _digest(workload_trace(name, "tiny", 0)) == CALIBRATED_SHA256[name]
    assert _digest(workload_trace(name, "tiny", 0, WorkloadShape())) == CALIBRATED_SHA256[name]


def test_tenants_are_the_system_prompts_sessions_share() -> None:
    def shared_roots(tenants: int) -> int:
        shape = WorkloadShape(tenants=tenants)
        sessions_of: dict[int, set[str]] = defaultdict(set)
        for name, turns in _sessions(workload_trace("conversation", "tiny", 0, shape)).items():
            sessions_of[turns[0].block_ids[0]].add(name)
        return sum(1 for names in sessions_of.values() if len(names) > 1)

    # A system prompt under one block (300-511 tokens) roots nothing: fewer shared roots than
    # tenants, never more.
    assert shared_roots(1) == 1
    assert shared_roots(3) == 3
    assert 3 < shared_roots(24) <= 24
    assert shared_roots(300) > 24


def test_think_time_scale_stretches_the_gaps_between_a_sessions_requests() -> None:
    def median_gap_s(scale: float) -> float:
        requests = workload_trace("conversation", "demo", 0, WorkloadShape(think_time_scale=scale))
        gaps = [
            later.arrival_s - earlier.arrival_s
            for turns in _sessions(requests).values()
            for earlier, later in zip(turns, turns[1:], strict=False)
        ]
        return statistics.median(gaps)

    calibrated = median_gap_s(1.0)
    assert 40 < calibrated < 90  # think times of median 60 s, plus the model's answer
    assert 4 < median_gap_s(5.0) / calibrated < 6
    assert 0.15 < median_gap_s(0.2) / calibrated < 0.25


def test_conversations_differ_more_with_a_smaller_beta() -> None:
    def single_turn_share(beta_a: float) -> float:
        shape = WorkloadShape(continue_beta_a=beta_a)
        turns = Counter(
            len(t) for t in _sessions(workload_trace("conversation", "demo", 0, shape)).values()
        )
        return turns[1] / sum(turns.values())

    # Beta(a, a + 1): the same 2 turns on average, single turns likelier as a falls.
    assert single_turn_share(0.3) > single_turn_share(0.6) + 0.05
    assert single_turn_share(0.6) > single_turn_share(4.0) + 0.1


def test_the_catalog_share_sets_how_often_documents_are_reused() -> None:
    documents = WorkloadMix(conversation=0.0, document=1.0)

    def reuse(share: float) -> float:
        shape = WorkloadShape(catalog_share=share)
        return float(block_summary(generate(documents, 360.0, seed=0, shape=shape))["reuse_ratio"])

    assert reuse(0.0) < reuse(0.4) < reuse(1.0)


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("continue_beta_a", 0.0, "a finite number > 0"),
        ("continue_beta_a", float("nan"), "a finite number > 0"),
        ("continue_beta_a", float("inf"), "a finite number > 0"),
        ("tenants", 0, "an int >= 1"),
        ("tenants", 2.0, "an int >= 1"),
        ("tenants", True, "an int >= 1"),
        ("catalog_share", 1.5, "a number in \\[0, 1\\]"),
        ("catalog_share", "0.5", "a number in \\[0, 1\\]"),
        ("catalog_alpha", -1.0, "a finite number >= 0"),
        ("think_time_scale", 0.0, "a finite number > 0"),
        ("think_time_scale", float("inf"), "a finite number > 0"),
        ("think_time_scale", False, "a finite number > 0"),
    ],
)
def test_bad_shapes_name_the_field_the_value_and_what_is_valid(
    field: str, value: float, valid: str
) -> None:
    with pytest.raises(ConfigurationError, match=f"WorkloadShape.{field} must be {valid}, got"):
        WorkloadShape(**{field: value})  # type: ignore[arg-type]


def test_bench_policy_variants_judges_the_floor_on_each_changed_trace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = runpy.run_path(
        str(Path(__file__).parents[1] / "benchmarks" / "bench_policy_variants.py")
    )
    rows = bench["main"](
        ["--quick", "--seeds", "0", "--variants", "tenants3,docs70", "--jobs", "1"]
    )
    # tenants3 changes all four traces, docs70 the production mix alone; 5 sizes each.
    assert [(r["variant"], r["trace"]) for r in rows[::5]] == [
        ("tenants3", "conversation"),
        ("tenants3", "toolagent"),
        ("tenants3", "documents"),
        ("tenants3", "production"),
        ("docs70", "production"),
    ]
    for row in rows:
        floor = max(float(row["lru"]), float(row["arc"])) - 0.002
        assert row["hybrid_ok"] == (float(row["hybrid"]) >= floor)
        assert row["chain_ok"] == (float(row["chain"]) >= floor)
    out = capsys.readouterr().out
    for policy in ("hybrid", "chain"):
        kept = sum(1 for r in rows if r[f"{policy}_ok"])
        assert f"{policy} within 0.2 points of max(LRU, ARC) at {kept} of 25" in out
    with pytest.raises(SystemExit):
        bench["main"](["--variants", "tenants3,nope"])


# -- --shape on the command line ----------------------------------------------------------------

CONFIG = (
    "version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 256KiB}\n"
    "secondary_tiers:\n  - {type: file, capacity: 1MiB, path: nvme}\n"
)


def test_parse_shape_reads_fields_and_keeps_the_rest_calibrated() -> None:
    assert parse_shape("think_time_scale=5, tenants=3") == WorkloadShape(
        think_time_scale=5.0, tenants=3
    )
    assert parse_shape("catalog_share=0") == WorkloadShape(catalog_share=0.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tenants", "'tenants' is not FIELD=VALUE with a field of continue_beta_a, tenants"),
        ("speed=2", "'speed=2' is not FIELD=VALUE"),
        ("", "'' is not FIELD=VALUE"),
        ("tenants=3,tenants=4", "tenants is given twice"),
        ("tenants=three", "tenants must be an int, got 'three'"),
        ("tenants=2.5", "tenants must be an int, got '2.5'"),
        ("think_time_scale=slow", "think_time_scale must be a number, got 'slow'"),
        ("tenants=0", "WorkloadShape.tenants must be an int >= 1, got 0"),
    ],
)
def test_parse_shape_names_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as caught:
        parse_shape(text)
    assert message in str(caught.value)


def _study_args(tmp_path: Path, *extra: str) -> list[str]:
    config = tmp_path / "tiering.yaml"
    if not config.exists():  # a test may have written its own
        config.write_text(CONFIG)
    args = ["policy-study", "--config", str(config), "--trace", "conversation"]
    return [*args, "--scale", "tiny", "--policies", "lru", "--sizes", "0.05", *extra]


def _study_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> list[dict[str, Any]]:
    assert cli_main(_study_args(tmp_path, "--json", *extra)) == 0
    return json.loads(capsys.readouterr().out)["policy_study"]


def test_policy_study_shape_studies_the_shaped_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shaped = _study_json(tmp_path, capsys, "--shape", "tenants=1,think_time_scale=5")
    calibrated = _study_json(tmp_path, capsys)
    trace = study_trace_from_blocks(
        workload_trace("conversation", "tiny", 0, WorkloadShape(tenants=1, think_time_scale=5)),
        512,
    )
    expected = run_study(trace, capacities_for(trace.unique_blocks, (0.05,)), ["lru"])
    for rows in (shaped, expected):
        assert [(r["policy"], r["capacity_blocks"]) for r in rows] == [
            (r["policy"], r["capacity_blocks"]) for r in expected
        ]
    assert [r["prefix_hit_ratio"] for r in shaped] == [r["prefix_hit_ratio"] for r in expected]
    assert [r["prefix_hit_ratio"] for r in shaped] != [r["prefix_hit_ratio"] for r in calibrated]


@pytest.mark.parametrize("command", ["policy-study", "replay"])
def test_shape_of_a_trace_that_is_not_generated_is_refused_before_any_work(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    command: str,
) -> None:
    config = tmp_path / "tiering.yaml"
    config.write_text(CONFIG)
    wiped: list[object] = []
    monkeypatch.setattr(runner, "_wipe_tiers", wiped.append)
    args = [command, "--config", str(config), "--trace", "chat", "--shape", "tenants=3"]
    assert cli_main([*args, *(["--fresh"] if command == "replay" else [])]) == 2
    assert "--shape applies to the generated traces (conversation" in capsys.readouterr().err
    assert wiped == []  # replay --fresh deleted nothing


@pytest.mark.parametrize("where", ["option", "config"])
def test_replay_replays_the_shaped_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    config = tmp_path / "tiering.yaml"
    args = ["replay", "--config", str(config), "--scale", "tiny", "--max-requests", "4"]
    args += ["--engine-blocks", "8192", "--json", "--no-progress"]
    if where == "option":
        config.write_text(CONFIG)
        args += ["--trace", "conversation", "--shape", "tenants=1"]
    else:
        config.write_text(CONFIG + 'replay: {trace: conversation, shape: "tenants=1"}\n')
    assert cli_main(args) == 0
    report = json.loads(capsys.readouterr().out)
    shaped = load_trace("conversation", "tiny", 0, shape=WorkloadShape(tenants=1))[:4]
    calibrated = load_trace("conversation", "tiny", 0)[:4]
    assert report["requests"] == 4 and report["shape"] == "tenants=1"
    assert report["prompt_tokens"] == sum(r.num_prompt_tokens for r in shaped)
    assert report["prompt_tokens"] != sum(r.num_prompt_tokens for r in calibrated)


def test_policy_study_text_names_the_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = _study_args(tmp_path, "--no-progress", "--shape", "tenants=1, think_time_scale=5")
    assert cli_main(args) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("policy study: ")
    assert "'conversation' (tenants=1,think_time_scale=5.0)," in first


# -- replay.shape in the config -----------------------------------------------------------------


def test_format_shape_round_trips_through_parse_shape() -> None:
    shape = WorkloadShape(tenants=3, think_time_scale=0.5)
    assert format_shape(shape) == "tenants=3,think_time_scale=0.5"
    assert parse_shape(format_shape(shape)) == shape
    assert format_shape(WorkloadShape()) == ""


def test_the_configs_shape_is_the_default_for_a_generated_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shaped_config = (
        CONFIG + 'replay: {trace: conversation, shape: "tenants=1, think_time_scale=5"}\n'
    )
    (tmp_path / "shaped").mkdir()
    (tmp_path / "shaped" / "tiering.yaml").write_text(shaped_config)
    assert load_config(tmp_path / "shaped" / "tiering.yaml").replay.shape == (
        "tenants=1, think_time_scale=5"
    )
    from_config = _study_json(tmp_path / "shaped", capsys)
    from_option = _study_json(tmp_path, capsys, "--shape", "tenants=1,think_time_scale=5")
    assert from_config == from_option
    # --shape overrides the config's shape; another --trace leaves it unused.
    args = _study_args(tmp_path / "shaped", "--json", "--shape", "tenants=2")
    assert cli_main(args) == 0
    assert json.loads(capsys.readouterr().out)["policy_study"] != from_config
    chat = _study_args(tmp_path / "shaped", "--json", "--max-requests", "5")
    chat[chat.index("conversation")] = "chat"
    assert cli_main(chat) == 0


@pytest.mark.parametrize(
    ("replay", "message"),
    [
        ('{trace: production, shape: "tenants=0"}', "replay.shape: WorkloadShape.tenants must be"),
        ('{trace: production, shape: "speed=2"}', "replay.shape: 'speed=2' is not FIELD=VALUE"),
        ('{trace: chat, shape: "tenants=3"}', "replay.shape: applies to the generated traces"),
    ],
)
def test_a_bad_config_shape_is_a_config_error_at_its_line(
    tmp_path: Path, replay: str, message: str
) -> None:
    path = tmp_path / "tiering.yaml"
    path.write_text(CONFIG + f"replay: {replay}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert message in str(caught.value)
    assert ":6" in str(caught.value)  # the replay key's line
