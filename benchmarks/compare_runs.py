"""Compare two reports written by ``run_all.py`` (the same benchmarks, two trees or two runs).

Usage: python benchmarks/compare_runs.py BEFORE.md AFTER.md [--column-pattern RE] [--group-by COL]

For every table of every section both reports have, rows are matched on their text columns
(policy, size, phase, ...) and each ratio column (a header with ``/``, ``x raw``, ``ratio``,
``speed-up`` or ``%``) is compared: after / before per row. Prints one line per section and
column: rows matched, the median and range of after / before. Absolute columns (GB/s, µs) are
skipped: only the ratios each benchmark measured against its own limit in the same run mean
anything across runs.
"""

from __future__ import annotations

import argparse
import re
import statistics
from collections.abc import Sequence
from pathlib import Path

RATIO_HEADER = re.compile(r"/|^x |ratio|speed-up|%|gap closed| vs ", re.IGNORECASE)
SIZE_HEADER = re.compile(r"block|keys|size|chunks|threads|seed|requests", re.IGNORECASE)
VERDICT_HEADER = re.compile(r"\bmet\b|\bok\b|target", re.IGNORECASE)
NUMBER = re.compile(r"^\**\s*([-+]?\d[\d,]*\.?\d*)\s*%?")

Table = tuple[list[str], list[list[str]]]


def sections(text: str) -> dict[str, list[Table]]:
    """``{section title: [(header, rows), ...]}`` of a report's markdown tables."""
    found: dict[str, list[Table]] = {}
    title = ""
    header: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("## "):
            title, header = line[3:].strip(), None
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if header is None:
                header = cells
                found.setdefault(title, []).append((cells, []))
            elif not all(set(c) <= set("-: ") for c in cells):
                found[title][-1][1].append(cells)
        else:
            header = None
    return found


def number(cell: str) -> float | None:
    match = NUMBER.match(cell)
    return float(match.group(1).replace(",", "")) if match else None


def _key(header: list[str], row: list[str]) -> tuple[str, ...]:
    """The row's identity: its text cells and its sizes (blocks, keys, threads, ...), not its
    measurements or verdicts."""
    return tuple(
        cell
        for name, cell in zip(header, row, strict=False)
        if not VERDICT_HEADER.search(name) and (number(cell) is None or _is_size(name))
    )


def _is_size(name: str) -> bool:
    return bool(SIZE_HEADER.search(name)) and not _is_ratio(name) and not _measured(name)


def _is_ratio(name: str) -> bool:
    return bool(RATIO_HEADER.search(name)) and not _measured(name)


def _measured(name: str) -> bool:
    return bool(re.search(r"GB/s|gbps|µs|\bus\b|_us_|\bms\b|\bs\b|ceiling", name, re.IGNORECASE))


def compare(
    before: str, after: str, pattern: str = "", group_by: str = ""
) -> list[tuple[str, str, int, float, float, float]]:
    """``(section, column, rows, median, low, high)`` of after / before for every ratio column
    (``column [value]`` per value of the ``group_by`` column, when a table has it)."""
    old, new = sections(before), sections(after)
    out = []
    for title, tables in new.items():
        for (header, rows), (old_header, old_rows) in zip(tables, old.get(title, []), strict=False):
            if header != old_header:
                continue
            by_key = {_key(old_header, r): r for r in old_rows}
            # Each row with its match in the old table, paired once for every column.
            pairs = [(row, by_key.get(_key(header, row))) for row in rows]
            group = header.index(group_by) if group_by in header else None
            for index, name in enumerate(header):
                if not _is_ratio(name) or not re.search(pattern, name):
                    continue
                quotients: dict[str, list[float]] = {}
                for row, previous in pairs:
                    if previous is None or index >= len(row) or index >= len(previous):
                        continue
                    a, b = number(row[index]), number(previous[index])
                    if a is not None and b:
                        label = name if group is None else f"{name} [{row[group]}]"
                        quotients.setdefault(label, []).append(a / b)
                for label, values in quotients.items():
                    out.append(
                        (
                            title,
                            label,
                            len(values),
                            statistics.median(values),
                            min(values),
                            max(values),
                        )
                    )
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--column-pattern", default="", help="compare only these columns")
    parser.add_argument("--group-by", default="", help="one line per value of this column")
    args = parser.parse_args(argv)
    rows = compare(
        args.before.read_text(), args.after.read_text(), args.column_pattern, args.group_by
    )
    print("| section | ratio column | rows | after / before, median | min-max |")
    print("|---|---|---:|---:|---|")
    for title, name, count, median, low, high in rows:
        print(f"| {title} | {name} | {count} | {median:.2f} | {low:.2f}-{high:.2f} |")


if __name__ == "__main__":
    main()
