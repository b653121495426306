"""benchmarks/bench_headroom.py: the continuation flags read the future exactly, the hint sets
are what its columns say, `chain` with no hints is `chain` hit for hit, and hinted the truth it
keeps what is continued."""

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
    # [] has no last block. Nothing later holds d, e or the last b.
    assert bench.continued_flags(key_lists) == [True, True, False, False, False, False]


def test_the_hint_sets_are_the_truth_some_of_it_wrong_and_the_open_ones() -> None:
    flags = [True, False] * 500
    hints = load_bench().hint_sets(flags, 0.1)
    assert hints["hint all"] == flags
    assert hints["hint open only"] == [True, None] * 500
    wrong = sum(h != f for h, f in zip(hints["hint all, some wrong"], flags, strict=True))
    assert 60 <= wrong <= 140  # 1,000 draws at 0.1: the seed's count, about 100
    assert load_bench().hint_sets(flags, 0.1) == hints  # a fixed seed
    assert load_bench().hint_sets(flags, 0.0)["hint all, some wrong"] == flags


@pytest.mark.parametrize("capacity", [20, 60, 200])
def test_chain_with_no_hints_is_chain_hit_for_hit(capacity: int) -> None:
    requests = sorted(workload_trace("production", "tiny", 3), key=lambda r: r.arrival_s)
    key_lists = study_trace_from_blocks(requests, 512).key_lists
    unhinted = [None] * len(key_lists)
    run = simulate_cpu(make_policy("chain", capacity), key_lists, hints=unhinted)
    hinted = prefix_hits(run.flags, key_lists)
    assert hinted == hits(make_policy("chain", capacity), key_lists)


def test_chain_hinted_the_truth_keeps_the_requests_that_are_continued() -> None:
    bench = load_bench()
    # Each round a request that a later one continues (p), one that none does (n), and the
    # continuation of the p of two rounds before: 38 continuations of 2 blocks each to hit.
    key_lists: list[list[bytes]] = []
    for i in range(40):
        key_lists += [[b"p%da" % i, b"p%db" % i], [b"n%da" % i, b"n%db" % i]]
        if i >= 2:
            key_lists.append([b"p%da" % (i - 2), b"p%db" % (i - 2), b"q%d" % (i - 2)])
    chain = sum(hits(make_policy("chain", 16), key_lists))
    for name, given in bench.hint_sets(bench.continued_flags(key_lists), 0.0).items():
        run = simulate_cpu(make_policy("chain", 16), key_lists, hints=given)
        assert chain < sum(prefix_hits(run.flags, key_lists)) <= 76, name


def test_the_quick_run_prints_one_row(capsys: pytest.CaptureFixture[str]) -> None:
    load_bench().main(["--quick"])
    table = capsys.readouterr().out
    assert table.count("\n| documents | 5% |") == 1
    assert "| chain | hint all | hint all, 10% wrong | hint open only | belady |" in table


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
