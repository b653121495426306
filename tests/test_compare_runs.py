"""benchmarks/compare_runs.py: ratio columns of two run_all reports, row by row."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from compare_runs import compare, sections

BEFORE = """## Copies

| block | phase | memcpy GB/s | store/memcpy | x raw, median (q1-q3) |
|---|---|---:|---:|---|
| 16 KiB | store | 19.38 | 42% | 0.80 (0.7-0.9) |
| 256 KiB | store | 19.62 | 95% | 1.00 (0.9-1.1) |
| 256 KiB | load | 19.62 | 50% | 2.00 |

## Only before

| a | b/c |
|---|---|
| x | 1.0 |
"""

AFTER = """## Copies

| block | phase | memcpy GB/s | store/memcpy | x raw, median (q1-q3) |
|---|---|---:|---:|---|
| 256 KiB | store | 10.00 | 76% | **1.10** (0.9-1.2) |
| 16 KiB | store | 30.00 | 42% | 0.40 |
| 256 KiB | load | 1.00 | 60% | 2.00 |
| 2 MiB | load | 1.00 | 60% | 2.00 |
"""


def test_sections_reads_every_table_with_its_rows() -> None:
    found = sections(BEFORE)
    assert list(found) == ["Copies", "Only before"]
    header, rows = found["Copies"][0]
    assert header[3] == "store/memcpy"
    assert [row[0] for row in rows] == ["16 KiB", "256 KiB", "256 KiB"]


def test_ratio_columns_are_compared_row_by_row_and_absolute_ones_skipped() -> None:
    rows = compare(BEFORE, AFTER)
    by_column = {name: (count, median, low, high) for _, name, count, median, low, high in rows}
    assert set(by_column) == {"store/memcpy", "x raw, median (q1-q3)"}
    # 16 KiB store 42 -> 42, 256 KiB store 95 -> 76, load 50 -> 60; the 2 MiB row is new.
    assert by_column["store/memcpy"] == (3, 1.0, pytest.approx(0.8), pytest.approx(1.2))
    assert by_column["x raw, median (q1-q3)"] == (3, 1.0, pytest.approx(0.5), pytest.approx(1.1))


def test_group_by_gives_a_line_per_value() -> None:
    rows = compare(BEFORE, AFTER, pattern="memcpy", group_by="phase")
    assert [(name, count, round(median, 3)) for _, name, count, median, _, _ in rows] == [
        ("store/memcpy [store]", 2, 0.9),
        ("store/memcpy [load]", 1, 1.2),
    ]
