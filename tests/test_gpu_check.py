"""`make gpu-check` cannot rot where no GPU is: its dry run (GPU_CHECK_DRY_RUN=1) goes through
every step on CPU with tiny sizes, and its target verdicts are checked on known figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402


@pytest.mark.slow
def test_the_dry_run_goes_through_every_step_and_writes_the_section(tmp_path: Path) -> None:
    env = dict(os.environ, GPU_CHECK_DRY_RUN="1", OUT=str(tmp_path), GPU_CHECK_COMMIT="abc1234")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    section = (tmp_path / "gpu-check.md").read_text()
    assert section.startswith("Measured by `make gpu-check` on CPU (dry run)")
    assert "commit abc1234" in section
    # The section goes into the repo: no path of the machine that ran it.
    assert str(tmp_path) not in section
    assert "--json $OUT/transfers.json`" in section
    for step in ("CUDA tests", "transfers", "load vs prefill"):
        assert f"| {step} |" in section
    rows = json.loads((tmp_path / "load-vs-prefill.json").read_text())["rows"]
    assert [r["tokens"] for r in rows] == [32, 64]
    assert all(r["kv_bit_exact"] and r["logits_bit_exact"] for r in rows)
    transfers = json.loads((tmp_path / "transfers.json").read_text())
    expected = {"auto", "memmove", "staging", "torch"}  # auto: the default, as engines get it
    assert {r["strategy"] for r in transfers["transfers"]} == expected
    assert {r["strategy"] for r in transfers["pages"]} == expected - {"auto"}
    assert "| loaded KV bit-exact, and decode logits wherever the kernels repeat | 32: yes, " in (
        section
    )


def row(blocks: int, strategy: str, store: float, load: float, blocked_ms: float) -> dict[str, Any]:
    return {
        "blocks": blocks,
        "strategy": strategy,
        "store_ratio": store,
        "load_ratio": load,
        "store_gbps": 50 * store,
        "load_gbps": 50 * load,
        "store_blocked_ms": blocked_ms,
        "load_blocked_ms": blocked_ms,
    }


def test_transfer_verdicts_follow_the_issue_targets() -> None:
    data = {
        "transfers": [
            row(256, "triton", 0.92, 0.95, 0.2),
            row(1024, "triton", 0.89, 0.95, 0.9),
            row(256, "batched_memcpy", 0.5, 0.5, 5.0),
            row(1024, "batched_memcpy", 0.8, 0.5, 5.0),
        ],
        "pages": [
            {"page_kib": 4, "strategy": "triton", "store_ratio": 0.86, "load_ratio": 0.9},
            {"page_kib": 64, "strategy": "triton", "store_ratio": 0.84, "load_ratio": 0.9},
        ],
        "overlap": [
            {"strategy": "triton", "direction": "store", "slowdown": 0.25, "transfer_gbps": 50},
            {"strategy": "triton", "direction": "load", "slowdown": 0.1, "transfer_gbps": 48},
            {"strategy": "auto", "direction": "store", "slowdown": 0.3, "transfer_gbps": 30},
        ],
    }
    verdicts = {t.what.split(" (")[0]: (t.measured, t.met) for t in
                gpu_check.transfer_targets(data, "triton")}  # fmt: skip
    assert verdicts[">= 0.9 of one pinned copy, 2 MiB blocks, >= 256 blocks"] == (
        "256: 0.92 / 0.95, 1024: 0.89 / 0.95",
        False,
    )
    assert verdicts["caller blocked <= 0.3 ms for a 256-block submit"] == ("0.200 ms", True)
    assert verdicts[">= 1.2x cuMemcpyBatchAsync"] == (
        "256: 1.84x / 1.90x, 1024: 1.11x / 1.90x",
        False,
    )
    assert verdicts[">= 0.85 of the limit at every page size, 4-64 KiB"][1] is False
    assert verdicts["matmul slowdown <= 25 % while transfers run"] == (
        "store 25% (50.0 GB/s), load 10% (48.0 GB/s)",
        True,
    )
    assert gpu_check.transfer_targets(None, "triton")[0].met is None
    # The default (auto) is judged on its own rows; no rows, no verdict.
    [auto] = gpu_check.overlap_targets(data, "auto")
    assert (auto.what, auto.measured, auto.met) == (
        "matmul slowdown <= 25 % while transfers run (auto)",
        "store 30% (30.0 GB/s)",
        False,
    )
    assert gpu_check.overlap_targets(data, "staging") == []
    assert gpu_check.overlap_targets(None, "auto") == []


def test_logits_that_differ_only_where_the_kernels_do_not_repeat_are_explained() -> None:
    def e2e(kv: bool, logits: bool, repeats: bool) -> dict[str, Any]:
        return {
            "tokens": 4096,
            "kv_bit_exact": kv,
            "logits_bit_exact": logits,
            "decode_repeats_bit_exact": repeats,
            "prefill_over_load": 12.0,
            "prefill_ms": 120.0,
            "load_ms": 10.0,
        }

    def exact(r: dict[str, Any]) -> bool | None:
        return gpu_check.e2e_targets({"rows": [r]})[0].met

    assert exact(e2e(True, True, True)) is True
    assert exact(e2e(True, False, False)) is True  # two decodes of one cache differ as well
    assert exact(e2e(True, False, True)) is False
    assert exact(e2e(False, True, True)) is False
    assert gpu_check.e2e_targets({"rows": [e2e(True, True, True)]})[1].met is True
