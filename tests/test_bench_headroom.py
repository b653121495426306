"""benchmarks/bench_headroom.py: the continuation flags read the future exactly, `chain` told
nothing is `chain` hit for hit, and told the truth it keeps what is continued."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
from bench_modules import load_benchmark

from tiering.policies import make_policy
from tiering.policies.base import EvictionPolicy
from tiering.replay.block_trace import write_mooncake
from tiering.replay.study import prefix_hits, simulate_cpu, study_trace_from_blocks
from tiering.replay.workloads import workload_trace


def load_bench() -> ModuleType:
    return load_benchmark("bench_headroom")


def hits(policy: EvictionPolicy, key_lists: list[list[bytes]]) -> list[int]:
    return prefix_hits(simulate_cpu(policy, key_lists).flags, key_lists)


def test_a_request_is_flagged_when_a_later_one_holds_its_last_block() -> None:
    bench = load_bench()
    key_lists = [[b"a", b"b"], [b"c"], [], [b"a", b"b", b"d"], [b"c", b"e"], [b"b"]]
    # [] is never classed: no flag. Nothing later holds d, e or the last b.
    assert bench.continued_flags(key_lists) == [True, True, False, False, False]


@pytest.mark.parametrize("capacity", [20, 60, 200])
def test_chain_told_that_nothing_is_continued_is_chain_hit_for_hit(capacity: int) -> None:
    bench = load_bench()
    requests = sorted(workload_trace("production", "tiny", 3), key=lambda r: r.arrival_s)
    key_lists = study_trace_from_blocks(requests, 512).key_lists
    flags = [False] * sum(1 for keys in key_lists if keys)
    told = bench.ToldChain(capacity, flags, "first")
    assert hits(told, key_lists) == hits(make_policy("chain", capacity), key_lists)


def test_chain_told_the_truth_keeps_the_requests_that_are_continued() -> None:
    bench = load_bench()
    # Each round a request that a later one continues (p), one that none does (n), and the
    # continuation of the p of two rounds before: 38 continuations of 2 blocks each to hit.
    key_lists: list[list[bytes]] = []
    for i in range(40):
        key_lists += [[b"p%da" % i, b"p%db" % i], [b"n%da" % i, b"n%db" % i]]
        if i >= 2:
            key_lists.append([b"p%da" % (i - 2), b"p%db" % (i - 2), b"q%d" % (i - 2)])
    flags = bench.continued_flags(key_lists)
    chain = sum(hits(make_policy("chain", 16), key_lists))
    for mode in ("first", "all"):
        told = sum(hits(bench.ToldChain(16, flags, mode), key_lists))
        assert chain < told <= 76, mode


def test_a_mode_other_than_first_or_all_is_refused() -> None:
    with pytest.raises(ValueError, match="mode must be one of first, all, got 'some'"):
        load_bench().ToldChain(8, [], "some")


def test_the_quick_run_prints_one_row(capsys: pytest.CaptureFixture[str]) -> None:
    load_bench().main(["--quick"])
    table = capsys.readouterr().out
    assert table.count("\n| documents | 5% |") == 1
    assert "| chain told first | chain told all | belady |" in table


def test_a_block_trace_file_reads_as_the_trace_it_was_written_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_bench()
    requests = workload_trace("documents", "tiny", 0)
    path = tmp_path / "documents.jsonl"
    write_mooncake(requests, path)
    key_lists = study_trace_from_blocks(requests, 512).key_lists
    expected = bench.headroom_rows(str(path), key_lists, [0.05])
    assert len(expected) == 1 and expected[0].startswith(f"| {path} | 5% |")
    bench.main(["--files", str(path), "--fractions", "0.05"])
    table = capsys.readouterr().out
    assert table.startswith("Block-trace files; ")
    assert table.endswith(expected[0] + "\n")
