"""benchmarks/run_all.py rewrites docs/benchmarks.md on every `make bench`: the tables are new,
and the hand-written notes of each section (why a target is not met, what was tried) are kept."""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from bench_modules import load_benchmark


def load_run_all() -> ModuleType:
    return load_benchmark("run_all")


def test_a_rewrite_keeps_each_sections_notes_and_replaces_its_tables(tmp_path: Path) -> None:
    run_all = load_run_all()
    report = tmp_path / "benchmarks.md"
    note_a = "<!-- notes -->\nWhy A is not met (run of 2026-11-23).\n\n- a list\n<!-- /notes -->"
    report.write_text(
        f"# Benchmarks\n\n## Section A\n\nabout\n\n| old table |\n\n{note_a}\n\n"
        "## Section B\n\n| old B |\n\n## Gone\n\n<!-- notes -->\norphan\n<!-- /notes -->\n"
    )
    results = [("Section A", "about A", "cmd a", "| new table |", 1.0),
               ("Section B", "about B", "cmd b", "| new B |", 2.0)]  # fmt: skip
    run_all.write_markdown(report, results, False)
    text = report.read_text()
    assert "| old" not in text and "| new table |" in text and "| new B |" in text
    section_a = text[text.index("## Section A") : text.index("## Section B")]
    assert section_a.index("| new table |") < section_a.index(note_a)
    assert "orphan" not in text and text.count("<!-- notes -->") == 1


def test_a_first_report_has_no_notes(tmp_path: Path) -> None:
    run_all = load_run_all()
    report = tmp_path / "benchmarks.md"
    run_all.write_markdown(report, [("A", "about", "cmd", "| t |", 1.0)], True)
    assert "<!-- notes -->" not in report.read_text() and "run_all.py --quick" in report.read_text()


def test_the_gpu_section_takes_in_the_last_gpu_check_run(tmp_path: Path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import run_all

    report = tmp_path / "gpu-check.md"
    assert run_all.gpu_section_without_cuda(report) == run_all._NOT_MEASURED
    report.write_text("# Title\n\nMeasured on an H100.\n\n## The run\n\n| a |\n")
    section = run_all.gpu_section_without_cuda(report)
    assert section.startswith("**The machine that wrote this file has no CUDA device")
    assert section.endswith("Measured on an H100.\n\n### The run\n\n| a |")
    assert "# Title" not in section


def test_sections_written_by_hand_are_kept_at_the_end(tmp_path: Path) -> None:
    run_all = load_run_all()
    report = tmp_path / "benchmarks.md"
    hand = "## Before and after a move (written by hand)\n\n| ratio | 1.00 |\n\n- a note"
    report.write_text(f"# Benchmarks\n\n## A\n\n| old |\n\n{hand}\n\n## B\n\n| old B |\n")
    run_all.write_markdown(report, [("A", "about", "cmd", "| new |", 1.0)], False)
    text = report.read_text()
    assert "| old" not in text and text.count(hand) == 1
    assert text.index("| new |") < text.index(hand) and text.rstrip().endswith("- a note")
