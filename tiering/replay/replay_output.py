"""How ``tiering replay`` shows its results: the report as a table with notes and a legend
(:func:`format_report`), the policy study as a table (:func:`format_study`) and as a plot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tiering.errors import TieringError
from tiering.replay.traces import is_trace_file

__all__ = ["LEGEND", "format_report", "format_study", "plot_study"]


def plot_study(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TieringError(
            "--plot needs matplotlib: pip install 'tiering[plot]' (or matplotlib)"
        ) from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        points = [
            (r["capacity_blocks"], r["prefix_hit_ratio"]) for r in rows if r["policy"] == policy
        ]
        ax.plot(*zip(*points, strict=True), marker="o", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("CPU tier size (blocks)")
    ax.set_ylabel("usable prefix hit ratio")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- output ----------------------------------------------------------------------------------


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


LEGEND = """\
legend:
  held        blocks the tier holds at the end
  served      blocks loaded into the engine, by the tier that held them when their request was
              looked up; each block counted once, so the rows add up to the total
  prefix tok  prompt tokens not recomputed, split over the tiers by served blocks
  written     bytes stored in the tier; read: bytes loaded from it
  GB/s        bytes over the time spent in jobs
  load, store latency of one job, p50/p99 in ms: for CPU one copy between the engine and the
              CPU pool (per request), for the other tiers one read or write of a batch of blocks
  evicted     blocks evicted from the tier
  not stored  blocks the tier did not store; the notes say why"""


def _ms_pair(percentiles: dict[str, float]) -> str:
    return f"{percentiles['p50']:.2f}/{percentiles['p99']:.2f}"


def format_report(report: dict[str, Any], *, legend: bool = True) -> str:
    """The report as a table, with notes on what was not stored and on reproducibility."""
    trace = report["trace"]
    # A built-in trace is made from a scale and a seed; a file is what it is.
    made_from = (
        ""
        if is_trace_file(trace)
        else f" ({report['scale']}, seed {report['seed']}"
        + (f", shape {report['shape']}" if report.get("shape") else "")
        + ")"
    )
    lines = [
        f"tiering replay: {report['requests']} requests of trace {trace!r}{made_from}, "
        f"model {report['model']}, "
        f"blocks of {_human_bytes(report['block_bytes'])}, {report['wall_s']:.1f} s",
        f"prefill tokens saved: {report['prefill_tokens_saved']:,} of "
        f"{report['prompt_tokens']:,} ({report['prefill_saved_ratio']:.1%}); "
        f"blocks found in any tier: {report['block_hit_ratio']:.1%}",
    ]
    started = report.get("started_with_data") or {}
    if started:
        held = ", ".join(f"{m} {n:,} blocks" for m, n in started.items())
        lines.append(
            f"note: tiers started with data from an earlier run ({held}); the numbers depend "
            "on it: run with --fresh for numbers that a seed reproduces"
        )
    lines.append("")
    header = (
        f"{'tier':<6} {'capacity':>9} {'held':>8} {'served':>8} {'share':>6} "
        f"{'prefix tok':>11} {'written':>10} {'read':>10} {'wr GB/s':>7} {'rd GB/s':>7} "
        f"{'load ms':>11} {'store ms':>11} {'evicted':>8} {'not stored':>10}"
    )
    rule = "-" * len(header)
    lines += [header, rule]
    notes: list[str] = []
    for medium, t in report["tiers"].items():
        if medium == "CPU":
            written, read = t["bytes_stored"], t["bytes_loaded"]
            wr = rd = evicted = "-"
            not_stored = t["blocks_refused"]
            if t["stores_refused"]:
                notes.append(
                    f"CPU refused {t['stores_refused']:,} stores ({t['blocks_refused']:,} "
                    "blocks): no room could be evicted (every block pinned by a load or being "
                    "written), or a request needed more blocks than the tier holds"
                )
        else:
            written, read = t["bytes_written"], t["bytes_read"]
            wr, rd = f"{t['write_gbps']:.2f}", f"{t['read_gbps']:.2f}"
            evicted = f"{t['evictions']:,}"
            not_stored = t["stores_shed"] + t["store_failures"]
            reasons = []
            if t["stores_shed"]:
                reasons.append(
                    f"{t['stores_shed']:,} blocks shed (max_inflight_jobs jobs already in "
                    "flight, or no room could be evicted)"
                )
            if t["store_failures"]:
                reasons.append(f"{t['store_failures']:,} blocks failed to write")
            if t["promotion_failures"]:
                reasons.append(
                    f"{t['promotion_failures']:,} promotions failed "
                    f"({t['corrupt_blocks']:,} corrupt blocks)"
                )
            if reasons:
                notes.append(f"{medium}: " + "; ".join(reasons))
        lines.append(
            f"{medium:<6} {t['capacity_blocks']:>9,} {t['blocks_held']:>8,} "
            f"{t['blocks_served']:>8,} {t['served_share']:>6.1%} "
            f"{t['usable_prefix_tokens']:>11,} {_human_bytes(written):>10} "
            f"{_human_bytes(read):>10} {wr:>7} {rd:>7} {_ms_pair(t['load_job_ms']):>11} "
            f"{_ms_pair(t['store_job_ms']):>11} {evicted:>8} {not_stored:>10,}"
        )
    if report.get("blocks_loaded_new"):
        new = report["blocks_loaded_new"]
        lines.append(
            f"{'new':<6} {'':>9} {'':>8} {new:>8,} {new / report['blocks_loaded']:>6.1%} "
            f"{report['usable_prefix_tokens_new']:>11,}"
        )
        notes.append("new: blocks another request stored while this one waited for a promotion")
    lines.append(rule)
    lines.append(
        f"{'total':<6} {'':>9} {'':>8} {report['blocks_loaded']:>8,} "
        f"{1.0 if report['blocks_loaded'] else 0.0:>6.1%} {report['prefill_tokens_saved']:>11,}"
    )
    if notes:
        lines += ["", "notes:", *(f"  {note}" for note in notes)]
    if legend:
        lines += ["", LEGEND]
    return "\n".join(lines)


def format_study(rows: list[dict[str, Any]]) -> str:
    header = (
        f"{'policy':<10} {'capacity':>9} {'block hits':>11} {'prefix hits':>12} {'gap closed':>11}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        gap = r.get("lru_belady_gap_closed")
        lines.append(
            f"{r['policy']:<10} {r['capacity_blocks']:>9,} {r['block_hit_ratio']:>11.1%} "
            f"{r['prefix_hit_ratio']:>12.1%} {'-' if gap is None else format(gap, '+.0%'):>11}"
        )
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------
