"""benchmarks/bench_gap_breakdown.py: prefix hits counted from the first block, and each
request named by its session's kind and turn, exactly."""

from __future__ import annotations

from types import ModuleType

import pytest
from bench_modules import load_benchmark

from tiering.replay.block_trace import BlockRequest


def load_bench() -> ModuleType:
    return load_benchmark("bench_gap_breakdown")


def test_prefix_hits_stop_at_each_requests_first_miss() -> None:
    bench = load_bench()
    keys = [[b"a", b"b", b"c"], [b"d"], [b"e", b"f"]]
    assert bench.prefix_hits(bytearray([1, 1, 0, 0, 1, 1]), keys) == [2, 0, 2]
    assert bench.prefix_hits(bytearray([0, 1, 1, 1, 1, 0]), keys) == [0, 1, 1]


def test_each_request_is_named_by_its_sessions_kind_and_turn() -> None:
    bench = load_bench()
    rows = [
        ("chat1-s0-0", (1, 2)),
        ("doc2-s0-1", (1, 10, 11, 12)),  # a document: its mark is block 11
        ("chat1-s0-2", (1, 2, 3)),
        ("doc2-s0-3", (1, 10, 11, 13)),  # asked again in its session
        ("doc3-s0-4", (1, 10, 11, 14)),  # another session asks about it
        ("agent4-s0-5", (20,)),
        ("chat1-s0-6", (1, 2, 3, 4)),
        ("doc5-s0-7", (1, 30, 31)),
    ]
    requests = [BlockRequest(rid, float(i), 512 * len(ids), 1, ids)
                for i, (rid, ids) in enumerate(rows)]  # fmt: skip
    key_lists = [[str(i).encode() for i in ids] for _, ids in rows]
    assert bench.request_kinds(requests, key_lists) == [
        "conversation, turn 1",
        "document, first ask",
        "conversation, turn 2",
        "document, asked again in its session",
        "document, first ask, asked before by another session",
        "agent loop, step 1",
        "conversation, turn 3+",
        "document, first ask",
    ]
    with pytest.raises(ValueError, match="not a generated request id"):
        bench.request_kinds([BlockRequest("r1", 0.0, 512, 1, (1,))], [[b"1"]])


def test_the_quick_run_prints_a_row_per_kind_and_all(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_bench()
    bench.main(["--quick", "--fraction", "0.05"])
    table = capsys.readouterr().out
    assert "| document, first ask |" in table and "| all | 100.0 % |" in table
    assert table.count("\n|") == 2 + 4  # header, rule, three kinds and all
