"""benchmarks/bench_gpu_transfer.py keeps running where CI can run it: its CPU smoke mode goes
through every table with the CPU strategies (the GPU figures need a GPU; see docs/benchmarks.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gpu_transfer.py"


def test_the_cpu_smoke_run_prints_every_table() -> None:
    args = ["--device", "cpu", "--quick", "--layers", "2", "--reps", "1", "--blocks", "4"]
    done = subprocess.run(
        [sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("Device: CPU; torch")
    for header in ("| blocks | strategy |", "| strategy | direction |", "| page | strategy |"):
        assert header in out
    assert out.count("| 4 | memmove |") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_says_nothing_was_measured() -> None:
    done = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0
    assert done.stdout.startswith("Not measured: no CUDA device here")
