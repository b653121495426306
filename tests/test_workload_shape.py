"""WorkloadShape: generated traffic of other shapes than the calibrated one."""

from __future__ import annotations

import hashlib
import runpy
import statistics
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from tiering.errors import ConfigurationError
from tiering.replay.block_trace import BlockRequest, block_summary
from tiering.replay.workloads import WorkloadMix, WorkloadShape, generate, workload_trace

# The calibrated traces, as generated before WorkloadShape existed: studies and the docs'
# figures repeat only while these stay the same.
CALIBRATED_SHA256 = {
    "conversation": "ce77a6f1c801427e",
    "toolagent": "86efb3c26cd5c3e5",
    "documents": "6d5bcd7b5fcaa587",
    "production": "c7f7cb99a1e52061",
}


def _digest(requests: list[BlockRequest]) -> str:
    return hashlib.sha256(repr(requests).encode()).hexdigest()[:16]


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
        ("continue_beta_a", 0.0, "> 0"),
        ("continue_beta_a", float("nan"), "> 0"),
        ("tenants", 0, "an int >= 1"),
        ("tenants", 2.0, "an int >= 1"),
        ("catalog_share", 1.5, "in \\[0, 1\\]"),
        ("catalog_alpha", -1.0, ">= 0"),
        ("think_time_scale", 0.0, "> 0"),
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
        assert row["floor_ok"] == (float(row["hybrid"]) >= floor)
    kept = sum(1 for r in rows if r["floor_ok"])
    assert f"hybrid within 0.2 points of max(LRU, ARC) at {kept} of 25" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench["main"](["--variants", "tenants3,nope"])
