"""Mooncake traces, realistic generated traces, the policy study, the hybrid policy and the
admission gate."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from tiering.cli import main as cli_main
from tiering.core.hashing import PrefixHasher
from tiering.errors import InvalidKeyError
from tiering.policies import HybridPolicy, available_policies
from tiering.policies.admission import FrequencyGate
from tiering.replay import load_trace
from tiering.replay.block_trace import (
    BlockRequest,
    block_summary,
    is_mooncake_file,
    read_mooncake,
    to_requests,
    write_mooncake,
)
from tiering.replay.study import capacities_for, gap_closed, run_study, study_trace_from_blocks
from tiering.replay.traces import TraceError
from tiering.replay.workloads import workload_trace
from tiering.testing.policy_tests import fill
from tiering.testing.policy_tests import policy_key as k

SAMPLE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"
CONFIG = (
    "version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 256KiB}\n"
    "secondary_tiers:\n  - {type: file, capacity: 1MiB, path: nvme}\n"
)


def test_mooncake_sample_is_read_in_timestamp_order() -> None:
    requests = read_mooncake(SAMPLE)
    assert [r.request_id for r in requests] == [
        "line1",
        "line2",
        "line3",
        "line7",
        "line5",
        "line6",
    ]
    assert requests[3] == BlockRequest("line7", 2.2, 512, 0, (9,))
    assert requests[1].arrival_s == 1.0 and requests[1].output_tokens == 12
    assert is_mooncake_file(SAMPLE)


@pytest.mark.parametrize(
    ("line", "field", "message"),
    [
        ('{"input_length": 5, "hash_ids": [1]}', "timestamp", "missing"),
        ('{"timestamp": -1, "input_length": 5, "hash_ids": [1]}', "timestamp", ">= 0"),
        ('{"timestamp": 0, "input_length": 0, "hash_ids": [1]}', "input_length", "> 0"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": []}', "hash_ids", "non-empty"),
        ('{"timestamp": 0, "input_length": 5, "hash_ids": [1, "x"]}', "hash_ids[1]", "int"),
        (
            '{"timestamp": 0, "input_length": 5, "output_length": 1.5, "hash_ids": [1]}',
            "output_length",
            "int",
        ),
    ],
)
def test_bad_mooncake_lines_name_file_line_and_field(
    tmp_path: Path, line: str, field: str, message: str
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError) as info:
        read_mooncake(path)
    assert (info.value.path, info.value.line, info.value.field) == (str(path), 2, field)
    assert message in info.value.reason


def test_tiering_jsonl_is_not_taken_for_mooncake(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "r1", "tokens": [1, 2, 3]}\n')
    assert not is_mooncake_file(path)
    assert [r.request_id for r in load_trace(str(path), "demo", 0)] == ["r1"]


def test_mooncake_requests_expand_to_tokens_whose_prefix_hashes_match() -> None:
    requests = load_trace(str(SAMPLE), "demo", 0)
    assert [len(r.token_ids) for r in requests] == [1536, 1700, 1024, 512, 600, 2048]
    hasher = PrefixHasher(16)
    first, second, _, _, _, fifth = (hasher.hash_blocks(r.token_ids) for r in requests)
    assert second[:96] == first and fifth[:96] == first  # ids 1, 2, 3: 96 blocks of 16 tokens
    assert fifth[96] != second[96]  # id 8 against id 4
    # A smaller block size changes the tokens per id.
    small = list(to_requests(read_mooncake(SAMPLE), block_tokens=256))
    assert [len(r.token_ids) for r in small] == [1536, 1700, 1024, 512, 600, 2048]
    assert small[0].token_ids[256:512].tolist() == requests[0].token_ids[512:768].tolist()


def test_write_mooncake_round_trips(tmp_path: Path) -> None:
    requests = read_mooncake(SAMPLE)
    path = tmp_path / "copy.jsonl"
    assert write_mooncake(requests, path) == len(requests)
    again = read_mooncake(path)
    assert [(r.arrival_s, r.input_tokens, r.block_ids) for r in again] == [
        (r.arrival_s, r.input_tokens, r.block_ids) for r in requests
    ]


def test_study_of_the_sample_counts_hits_by_hand() -> None:
    trace = study_trace_from_blocks(read_mooncake(SAMPLE), 512)
    # Partial last blocks are dropped: 3 + 3 + 2 + 1 + 1 + 4 references, 7 distinct prefixes.
    assert trace.block_accesses == 14 and trace.unique_blocks == 7
    rows = run_study(trace, [7, 2], ["lru", "hybrid"])
    big = {r["policy"]: r for r in rows if r["capacity_blocks"] == 7}
    for row in big.values():
        assert row["block_hit_ratio"] == row["prefix_hit_ratio"] == 0.5
        assert row["prefill_tokens_saved"] == 1536 + 512 + 1536
    small = {r["policy"]: r for r in rows if r["capacity_blocks"] == 2}
    assert small["lru"]["block_hit_ratio"] <= small["belady"]["block_hit_ratio"]


def test_cli_policy_study_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "tiering.yaml"
    config.write_text(CONFIG)
    status = cli_main(
        ["policy-study", "--config", str(config), "--trace", str(SAMPLE), "--sizes", "1", "--json"]
    )
    assert status == 0
    rows = json.loads(capsys.readouterr().out)["policy_study"]
    assert [r["policy"] for r in rows] == [*available_policies(), "belady"]
    for row in rows:
        assert row["capacity_blocks"] == 7 and row["prefix_hit_ratio"] == 0.5
        (tier,) = row["tiers"].values()  # the config's one file tier (no write-back: belady too)
        assert tier["bytes_written"] == tier["bytes_written_without_admission"] > 0


def test_gap_closed_is_the_share_of_the_lru_to_belady_distance() -> None:
    assert gap_closed(0.3, 0.2, 0.6) == pytest.approx(0.25)
    assert gap_closed(0.1, 0.2, 0.6) == pytest.approx(-0.25)  # under LRU
    assert gap_closed(0.2, 0.2, 0.6) == 0.0
    assert gap_closed(0.5, 0.5, 0.5) is None  # no distance to close


def test_study_rows_carry_the_gap_closed_where_lru_and_belady_ran(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # One block of room: Belady keeps block 1 (used every other request) and never admits 2
    # or 3, 3 hits of 7; every online policy stores each miss and hits nothing.
    requests = [
        BlockRequest(f"r{i}", float(i), 512, 0, (block,))
        for i, block in enumerate([1, 2, 1, 2, 1, 3, 1])
    ]
    trace = study_trace_from_blocks(requests, 512)
    rows = run_study(trace, [1, 3], ["lru", "arc"])
    gaps = {(r["policy"], r["capacity_blocks"]): r["lru_belady_gap_closed"] for r in rows}
    assert gaps == {
        ("lru", 1): 0.0,
        ("arc", 1): 0.0,
        ("belady", 1): 1.0,
        ("lru", 3): None,  # everything fits: LRU is Belady
        ("arc", 3): None,
        ("belady", 3): None,
    }
    assert {r["lru_belady_gap_closed"] for r in run_study(trace, [1], ["arc"])} == {None}
    assert {r["lru_belady_gap_closed"] for r in run_study(trace, [1], ["lru"], belady=False)} == {
        None
    }
    config = tmp_path / "tiering.yaml"
    config.write_text(CONFIG)
    trace_file = tmp_path / "trace.jsonl"
    write_mooncake(requests, trace_file)
    args = ["policy-study", "--config", str(config), "--trace", str(trace_file)]
    assert cli_main([*args, "--policies", "lru", "--sizes", "0.3", "--no-progress"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "gap closed" in lines[1]
    assert lines[3].split()[:5] == ["lru", "1", "0.0%", "0.0%", "+0%"]
    assert lines[4].split()[:5] == ["belady", "1", "42.9%", "42.9%", "+100%"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--sizes", "0.1,2"], "--sizes: '2' is not a fraction in (0, 1]"),
        (["--policies", "lru,lfu"], "--policies: unknown eviction policy 'lfu'"),
        (["--block-tokens", "0"], "--block-tokens must be an int > 0"),
    ],
)
def test_cli_policy_study_rejects_bad_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str], message: str
) -> None:
    config = tmp_path / "tiering.yaml"
    config.write_text(CONFIG)
    args = ["policy-study", "--config", str(config), "--trace", str(SAMPLE), *options]
    assert cli_main(args) == 2
    assert message in capsys.readouterr().err


def test_generated_conversations_carry_the_previous_turn() -> None:
    requests = workload_trace("conversation", "tiny", seed=1)
    assert requests == workload_trace("conversation", "tiny", seed=1)
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert all(r.arrival_s < 360 for r in requests)
    full = {r.request_id: r.block_ids[: r.input_tokens // 512] for r in requests}
    extended = 0
    for request in requests:
        ids = request.block_ids[: request.input_tokens // 512]
        if len(ids) > 4 and any(
            other[:-1] and ids[: len(other)] == other and len(other) < len(ids)
            for other in full.values()
            if len(other) > 4
        ):
            extended += 1
    assert extended > 0
    summary = block_summary(requests)
    assert 0.2 < summary["reuse_ratio"] < 0.8


def test_generated_conversations_that_went_on_are_likelier_to_go_on() -> None:
    # Each conversation draws its own chance of another turn (Beta(0.6, 1.6)): a conversation
    # at its third turn is likelier to have a fourth than a first turn is to have a second. With
    # one chance for all (geometric turns) the two shares are equal.
    requests = workload_trace("conversation", "demo", seed=0)
    turns = Counter(r.request_id.split("-s")[0] for r in requests)
    sessions = len(turns)
    at_least = [sum(1 for n in turns.values() if n >= k) for k in range(5)]
    second = at_least[2] / at_least[1]
    fourth = at_least[4] / at_least[3]
    assert 0.2 < second < 0.35  # 73 % single-turn in the model; the hour's end cuts some
    assert fourth > second + 0.25
    assert 1.6 < len(requests) / sessions < 1.8


def test_arc_is_above_lru_on_generated_conversations_as_on_the_public_trace() -> None:
    # What the continuation chances were set by: on the public Mooncake conversation trace ARC
    # closes 12 % of the LRU -> Belady gap at 4.5 % of the unique blocks (docs/workloads.md).
    trace = study_trace_from_blocks(workload_trace("conversation", "demo", seed=0), 512)
    rows = run_study(trace, capacities_for(trace.unique_blocks, (0.045,)), ["lru", "arc"])
    ratio = {r["policy"]: float(r["prefix_hit_ratio"]) for r in rows}
    share = (ratio["arc"] - ratio["lru"]) / (ratio["belady"] - ratio["lru"])
    assert 0.05 < share < 0.2


@pytest.mark.parametrize("block_tokens", [16, 100])
def test_a_generated_trace_in_smaller_blocks_is_the_same_prompts(block_tokens: int) -> None:
    """Blocks of 16 tokens (the Qwen-Bailian traces, vLLM's GPU blocks) split the same
    prompts, sent at the same times: one id per block, the partial last one a fresh id."""
    coarse = workload_trace("documents", "tiny", seed=2)
    assert workload_trace("documents", "tiny", seed=2, block_tokens=512) == coarse
    fine = workload_trace("documents", "tiny", seed=2, block_tokens=block_tokens)
    assert [(r.arrival_s, r.input_tokens) for r in fine] == [
        (r.arrival_s, r.input_tokens) for r in coarse
    ]
    assert all(len(r.block_ids) == -(-r.input_tokens // block_tokens) for r in fine)
    # A prompt's full blocks are another's where the prompts share those tokens: the 16-token
    # study shares at least the blocks inside the 512-token study's shared prefixes.
    assert block_summary(fine)["reuse_ratio"] >= block_summary(coarse)["reuse_ratio"]


@pytest.mark.parametrize("block_tokens", [0, -16, 1.5, True])
def test_a_generated_trace_block_size_is_checked(block_tokens: object) -> None:
    from tiering.errors import ConfigurationError

    with pytest.raises(
        ConfigurationError, match=f"block_tokens must be an int > 0, got {block_tokens!r}"
    ):
        workload_trace("documents", "tiny", block_tokens=block_tokens)  # type: ignore[arg-type]


def test_cli_policy_study_generates_in_the_given_block_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "tiering.yaml"
    config.write_text(CONFIG)
    args = ["policy-study", "--config", str(config), "--trace", "conversation", "--scale", "tiny"]
    options = ["--policies", "lru", "--sizes", "0.05", "--max-requests", "200", "--json"]
    counts = []
    for block_tokens in ("512", "16"):
        assert cli_main([*args, *options, "--block-tokens", block_tokens]) == 0
        (lru, _) = json.loads(capsys.readouterr().out)["policy_study"]
        counts.append(lru["capacity_blocks"])
    assert counts[1] > 20 * counts[0]  # 32 times the blocks, give or take the partial ones


def test_generated_trace_names_are_checked() -> None:
    from tiering.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="valid names: conversation"):
        workload_trace("convo")


def test_policies_stay_under_belady_on_the_production_trace() -> None:
    trace = study_trace_from_blocks(workload_trace("production", "tiny", seed=0), 512)
    rows = run_study(trace, [100, 1000], ["lru", "arc", "hybrid"])
    for capacity in (100, 1000):
        by = {r["policy"]: r for r in rows if r["capacity_blocks"] == capacity}
        for name in ("lru", "arc", "hybrid"):
            assert by[name]["block_hit_ratio"] <= by["belady"]["block_hit_ratio"]


# -- hybrid ----------------------------------------------------------------------------------


def test_hybrid_takes_new_blocks_first_only_over_their_target() -> None:
    hybrid = HybridPolicy(10)  # p starts at 5
    keys = fill(hybrid, 4)
    hybrid.touch([keys[3]])  # reused: T2
    assert hybrid.t1_keys == tuple(keys[:3]) and hybrid.t2_keys == (keys[3],)
    # |T1| = 3 <= p: the oldest of both lists, as LRU (ARC's rule would take T2's keys[3]).
    assert hybrid.evict(1) == [keys[0]]
    more = [k(10 + i) for i in range(6)]
    hybrid.insert_many(more)  # T1: keys[1], keys[2], more: 8 > 5
    assert hybrid.evict(3) == [keys[1], keys[2], more[0]]  # over target: T1's oldest
    assert hybrid.evict(1) == [keys[3]]  # |T1| = 5: T2's keys[3] is older than more[1]
    assert hybrid.b1_keys == (keys[0], keys[1], keys[2], more[0])
    assert hybrid.b2_keys == (keys[3],)


def test_hybrid_ghosts_adapt_the_target_within_its_floor() -> None:
    hybrid = HybridPolicy(10)
    keys = fill(hybrid, 10)
    assert hybrid.evict(2) == keys[:2]  # T1 over target
    hybrid.insert(keys[0])  # a B1 ghost: reused, to T2; p grows
    assert keys[0] in hybrid.t2_keys and hybrid.target_t1_size == 6.0
    hybrid.touch(keys[2:8])
    for _ in range(8):  # evict T2 keys and bring them back: B2 ghosts shrink p
        (victim,) = hybrid.evict(1) or [b""]
        hybrid.insert(victim)
    assert hybrid.target_t1_size >= 2.0  # the floor: a fifth of the capacity


def test_hybrid_refresh_is_recency_without_a_use() -> None:
    hybrid = HybridPolicy(10)
    keys = fill(hybrid, 4)
    hybrid.touch([keys[3]])  # T2
    hybrid.refresh([keys[0], k(99), keys[3]])  # absent keys ignored; each stays in its list
    assert hybrid.t1_keys == (keys[1], keys[2], keys[0]) and hybrid.t2_keys == (keys[3],)
    assert hybrid.evict(2) == [keys[1], keys[2]]  # |T1| <= p: the oldest of both lists
    with pytest.raises(InvalidKeyError):
        hybrid.refresh(keys[0])  # type: ignore[arg-type]


def test_hybrid_iterates_in_eviction_order() -> None:
    hybrid = HybridPolicy(8)
    keys = fill(hybrid, 8)
    hybrid.touch([keys[5], keys[1]])
    hybrid.evict(2)
    hybrid.insert_many([k(20), k(21)])
    hybrid.touch([k(20), keys[7]])
    expected = list(hybrid)
    taken = []
    while len(hybrid):
        (victim,) = hybrid.evict(1) or []
        taken.append(victim)
    assert taken == expected


# -- admission gate -----------------------------------------------------------------------------


def test_frequency_gate_admits_after_min_count_and_ages() -> None:
    gate = FrequencyGate(16, min_count=2)
    a = k(1)
    assert not gate.admits(a)
    gate.record(a)
    assert not gate.admits(a)
    gate.record(a)
    assert gate.admits(a) and gate.estimate(a) >= 2
    for i in range(10 * gate.width - 2):  # reach the aging period: counters halve
        gate.record(k(1000 + i))
    assert gate.estimate(a) <= gate.estimate(a) and gate._since_aging == 0
    with pytest.raises(ValueError, match="min_count"):
        FrequencyGate(16, min_count=0)


def test_hybrid_serves_the_cpu_tier_and_a_secondary_tier() -> None:
    from tiering.config import build_manager, parse_config

    config = parse_config(
        {
            "version": 1,
            "primary": {"capacity": "4KiB", "policy": "hybrid"},
            "secondary_tiers": [{"type": "memory", "capacity": "64KiB", "policy": "hybrid"}],
        },
        env={},
    )
    manager = build_manager(config, block_bytes=1024, fingerprint=bytes(16))
    try:
        manager.wait_ready()
        assert isinstance(manager.primary.policy, HybridPolicy)
        assert isinstance(manager.tiers[0].policy, HybridPolicy)
    finally:
        manager.shutdown()


def test_admission_gate_keeps_one_hit_blocks_off_a_tier() -> None:
    from tiering.replay.study import StudyTrace, TierModel

    # Request r reads a shared root, then blocks seen once (one-off) or twice.
    keys = [[b"root", b"once-%d" % r] for r in range(40)] + [[b"root", b"twice"]] * 3
    trace = StudyTrace(keys, [1024] * len(keys), 512)
    tier = TierModel("nvme", 100, admission_min_count=2, block_bytes=10)
    (row,) = run_study(trace, [1], ["lru"], tiers=[tier], block_bytes=10, belady=False)
    nvme = row["tiers"]["nvme"]
    # Without the gate every CPU miss is written (root once, 40 one-offs, twice once).
    assert nvme["bytes_written_without_admission"] == (1 + 40 + 1) * 10
    # With it, only blocks looked up twice: the root and "twice" (at their second lookup).
    assert nvme["bytes_written"] == 2 * 10
    assert nvme["served_blocks"] > 0
    assert nvme["bytes_written_per_hit"] < nvme["bytes_written_per_hit_without_admission"]


def test_selective_tier_is_gated_and_compared_with_write_through() -> None:
    from tiering.replay.study import StudyTrace, TierModel

    keys = [[b"root", b"once-%d" % r] for r in range(10)]
    trace = StudyTrace(keys, [1024] * len(keys), 512)
    tier = TierModel("nvme", 100, write_policy="write_through_selective", block_bytes=1)
    (row,) = run_study(trace, [1], ["lru"], tiers=[tier], block_bytes=1, belady=False)
    nvme = row["tiers"]["nvme"]
    assert nvme["bytes_written"] == 1  # the root, at its second lookup
    assert nvme["bytes_written_without_admission"] == 1 + 10
