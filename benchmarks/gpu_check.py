"""The GPU proof in one prepared run (``make gpu-check``): CUDA tests, transfers, load vs prefill.

A GPU machine is lent now and then, for minutes, with no package registry: this script does
everything in one call and writes what it found into ``$OUT`` (or ``--out``):

1. dependencies: the machine's own torch, Triton and transformers; tiering's other dependencies
   from the wheel folder ``make gpu-wheels`` filled here (``.gpu-wheels``, carried with the
   tree), installed with ``--no-index`` into a folder of its own, only if any is missing;
2. the CUDA tests (every copy strategy bit-exact on hybrid and cross-layer layouts, asynchrony,
   the replay's whole data path on CUDA, pinned pools);
3. ``benchmarks/bench_gpu_transfer.py`` (every strategy and direction against one contiguous
   pinned copy in the same run, the page sweep, caller-blocked time, matmul slowdown);
4. ``benchmarks/bench_load_vs_prefill.py`` (a llama-3-8b-shaped transformers Llama: KV stored
   through the transfer engine, the pool and a file tier, loaded back, decoding continued;
   bit-exact logits; time to first token loaded against recomputed);
5. a summary of every target, and ``gpu-check.md``: the section docs/benchmarks.md takes in
   (copy it to ``docs/gpu-check.md``; ``make bench`` includes it).

Each step runs in a process of its own with a time limit; a failed step is reported and the
others still run. Exit status 0 only if every step passed and every target was met or
measured. ``GPU_CHECK_DRY_RUN=1`` (or ``--dry-run``) runs the same steps on CPU with tiny sizes:
``make test`` does, so the script cannot rot where no GPU is.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".gpu-wheels"
#: Modules tiering and its tests import that a CUDA image may lack (the wheels' contents).
NEEDED_MODULES = ("lmdb", "cachetools", "zmq", "msgspec", "pytest_asyncio", "xxhash", "yaml")
CUDA_TESTS = (
    "tests/test_transfer_cuda.py",
    "tests/test_replay_device.py",
    "tests/test_pool.py",
    "tests/test_transfer_engine.py",
)
DRY_TESTS = ("tests/test_transfer_cuda.py",)  # collected and skipped on CPU: the plumbing


@dataclass
class Step:
    name: str
    command: list[str]
    timeout_s: float
    log: str
    returncode: int | None = None
    elapsed_s: float = 0.0
    tail: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def ensure_dependencies(site: Path, env: dict[str, str]) -> str:
    """Install the carried wheels into ``site`` if a needed module is missing; say what."""
    missing = [m for m in NEEDED_MODULES if importlib.util.find_spec(m) is None]
    if not missing:
        return "every dependency was already installed"
    wheels = sorted(WHEELS.glob("*.whl"))
    if not wheels:
        raise SystemExit(
            f"gpu-check: modules {missing} are missing and {WHEELS.name}/ holds no wheels: run "
            "`make gpu-wheels` on a machine with a package registry and carry the folder"
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--disable-pip-version-check",
            "--target",
            str(site),
            *map(str, wheels),
        ],
        check=True,
    )
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(site), env.get("PYTHONPATH", "")])
    return f"installed {len(wheels)} wheels for {', '.join(missing)}"


def run_step(step: Step, env: dict[str, str], out: Path) -> None:
    print(f"== {step.name}: {' '.join(step.command)}", flush=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(
            step.command,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=step.timeout_s,
        )
        step.returncode, text = done.returncode, done.stdout
    except subprocess.TimeoutExpired as exc:
        step.returncode = 124
        raw = exc.stdout or b""
        text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        text += f"\n(stopped after its limit of {step.timeout_s:.0f} s)\n"
    step.elapsed_s = time.perf_counter() - started
    (out / step.log).write_text(text)
    step.tail = text.strip()
    print(text, flush=True)
    print(f"== {step.name}: exit {step.returncode} in {step.elapsed_s:.0f} s", flush=True)


def environment() -> dict[str, str]:
    import torch

    info = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
    }
    for name in ("triton", "transformers"):
        try:
            info[name] = __import__(name).__version__
        except Exception as exc:  # reported, not fatal: the steps say what failed
            info[name] = f"unavailable ({type(exc).__name__})"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = f"{props.name}, {props.total_memory / 2**30:.0f} GiB"
    else:
        info["device"] = "CPU (dry run)"
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [
            smi,
            "--query-gpu=driver_version,pcie.link.gen.max,pcie.link.width.max",
            "--format=csv,noheader",
        ]
        done = subprocess.run(query, capture_output=True, text=True, check=False)
        info["driver, PCIe gen, width"] = done.stdout.strip() or done.stderr.strip()
    # A copied tree's .git can lag its files: GPU_CHECK_COMMIT names the commit that was sent.
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    info["commit"] = os.environ.get("GPU_CHECK_COMMIT") or head or "unknown"
    return info


def steps(dry_run: bool, out: Path) -> list[Step]:
    py = sys.executable
    tests = DRY_TESTS if dry_run else CUDA_TESTS
    transfer_args = (
        ["--device", "cpu", "--quick", "--layers", "2", "--reps", "1", "--blocks", "4"]
        if dry_run
        else []
    )
    e2e_args = ["--tiny", "--device", "cpu", "--reps", "1"] if dry_run else []
    return [
        Step(
            "CUDA tests",
            [py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:asyncio", "-rs", *tests],
            120 if dry_run else 150,
            "cuda-tests.log",
        ),
        Step(
            "transfers",
            [
                py,
                "benchmarks/bench_gpu_transfer.py",
                *transfer_args,
                "--json",
                str(out / "transfers.json"),
            ],
            120 if dry_run else 200,
            "transfers.md",
        ),
        Step(
            "load vs prefill",
            [
                py,
                "benchmarks/bench_load_vs_prefill.py",
                *e2e_args,
                "--json",
                str(out / "load-vs-prefill.json"),
            ],
            120 if dry_run else 120,
            "load-vs-prefill.md",
        ),
    ]


@dataclass(frozen=True)
class Target:
    what: str
    measured: str
    met: bool | None  # None: not measured


def _json(path: Path) -> dict[str, Any] | None:
    try:
        loaded: dict[str, Any] = json.loads(path.read_text())
        return loaded
    except (OSError, ValueError):
        return None


def transfer_targets(data: dict[str, Any] | None, strategy: str) -> list[Target]:
    """The transfer engine's targets (issue 28) for ``strategy`` (what ``auto`` picks)."""
    if data is None:
        return [Target("transfer targets", "no transfer figures", None)]
    rows = [r for r in data.get("transfers", []) if r["strategy"] == strategy]
    big = [r for r in rows if r["blocks"] >= 256]
    targets = []
    if big:
        worst = min(min(r["store_ratio"], r["load_ratio"]) for r in big)
        cells = ", ".join(
            f"{r['blocks']}: {r['store_ratio']:.2f} / {r['load_ratio']:.2f}" for r in big
        )
        targets.append(
            Target(
                f">= 0.9 of one pinned copy, 2 MiB blocks, >= 256 blocks ({strategy}; "
                "store / load)",
                cells,
                worst >= 0.9,
            )
        )
    at_256 = [r for r in rows if r["blocks"] == 256]
    if at_256:
        blocked = max(at_256[0]["store_blocked_ms"], at_256[0]["load_blocked_ms"])
        targets.append(
            Target(
                f"caller blocked <= 0.3 ms for a 256-block submit ({strategy})",
                f"{blocked:.3f} ms",
                blocked <= 0.3,
            )
        )
    batched = {
        r["blocks"]: r for r in data.get("transfers", []) if r["strategy"] == "batched_memcpy"
    }
    pairs = [(r, batched[r["blocks"]]) for r in rows if r["blocks"] in batched]
    if pairs:
        speedups = [
            (r["blocks"], r["store_gbps"] / b["store_gbps"], r["load_gbps"] / b["load_gbps"])
            for r, b in pairs
        ]
        worst_speedup = min(min(s, ld) for _, s, ld in speedups)
        cells = ", ".join(f"{n}: {s:.2f}x / {ld:.2f}x" for n, s, ld in speedups)
        targets.append(
            Target(
                f">= 1.2x cuMemcpyBatchAsync ({strategy}; store / load)",
                cells,
                worst_speedup >= 1.2,
            )
        )
    pages = [r for r in data.get("pages", []) if r["strategy"] == strategy]
    if pages:
        worst = min(min(r["store_ratio"], r["load_ratio"]) for r in pages)
        cells = ", ".join(
            f"{r['page_kib']:g} KiB: {r['store_ratio']:.2f} / {r['load_ratio']:.2f}" for r in pages
        )
        targets.append(
            Target(
                f">= 0.85 of the limit at every page size, 4-64 KiB ({strategy})",
                cells,
                worst >= 0.85,
            )
        )
    return targets + overlap_targets(data, strategy)


def overlap_targets(data: dict[str, Any] | None, strategy: str) -> list[Target]:
    """Matmul slowdown while ``strategy`` moves blocks (``auto``: what engines get)."""
    overlap = [r for r in (data or {}).get("overlap", []) if r["strategy"] == strategy]
    if not overlap:
        return []
    worst = max(r["slowdown"] for r in overlap)
    cells = ", ".join(
        f"{r['direction']} {r['slowdown']:.0%} ({r['transfer_gbps']:.1f} GB/s)" for r in overlap
    )
    what = f"matmul slowdown <= 25 % while transfers run ({strategy})"
    return [Target(what, cells, worst <= 0.25)]


def e2e_targets(data: dict[str, Any] | None) -> list[Target]:
    if data is None:
        return [Target("load vs prefill", "no figures", None)]
    rows = data.get("rows", [])

    def verdict(r: dict[str, Any]) -> str:
        if not r["kv_bit_exact"]:
            return "KV differs"
        if r["logits_bit_exact"]:
            return "yes"
        if not r.get("decode_repeats_bit_exact", True):
            return "KV yes; logits differ as two decodes of one cache do"
        return "logits differ"

    cells = ", ".join(f"{r['tokens']}: {verdict(r)}" for r in rows)
    exact = all(verdict(r).startswith(("yes", "KV yes")) for r in rows)
    targets = [
        Target("loaded KV bit-exact, and decode logits wherever the kernels repeat", cells, exact)
    ]
    largest = max(rows, key=lambda r: r["tokens"], default=None)
    if largest is not None:
        targets.append(
            Target(
                f"loading {largest['tokens']} tokens' KV >= 10x faster than prefilling them",
                f"{largest['prefill_over_load']:.1f}x (prefill {largest['prefill_ms']:.1f} ms, "
                f"load {largest['load_ms']:.2f} ms)",
                largest["prefill_over_load"] >= 10,
            )
        )
    return targets


def tests_summary(step: Step) -> str:
    lines = [
        line
        for line in step.tail.splitlines()
        if " passed" in line or " failed" in line or " skipped" in line or " error" in line
    ]
    return lines[-1].strip("= ") if lines else f"exit {step.returncode}"


def section(
    info: dict[str, str], done: Sequence[Step], targets: Sequence[Target], out: Path
) -> str:
    """The markdown that docs/benchmarks.md takes in as its GPU section."""
    lines = [
        f"Measured by `make gpu-check` on {info['device']} ({info['date']}, commit "
        f"{info['commit']}).",
        "",
        "| | |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in info.items() if k not in ("date", "commit")),
        "",
        "| target | measured | met |",
        "|---|---|---|",
        *(
            f"| {t.what} | {t.measured} | "
            f"{'yes' if t.met else ('not measured' if t.met is None else '**no**')} |"
            for t in targets
        ),
        "",
        "| step | result | seconds |",
        "|---|---|---:|",
        *(
            f"| {s.name} | {tests_summary(s) if s.name == 'CUDA tests' else f'exit {s.returncode}'}"
            f" | {s.elapsed_s:.0f} |"
            for s in done
        ),
    ]
    for step in done[1:]:
        text = (out / step.log).read_text() if (out / step.log).exists() else ""
        # The report goes into the repo: $OUT, not the machine's own path for it.
        command = " ".join(step.command[1:]).replace(str(out), "$OUT")
        lines += ["", f"### {step.name}", "", f"`{command}`", "", text.strip()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or None, help="default: $OUT")
    parser.add_argument(
        "--dry-run", action="store_true", default=os.environ.get("GPU_CHECK_DRY_RUN") == "1"
    )
    args = parser.parse_args(argv)
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory(prefix="gpu-check-site-") as site:
        how = ensure_dependencies(Path(site), env)
        sys.path[:0] = [p for p in env["PYTHONPATH"].split(os.pathsep) if p]
        import torch

        if not args.dry_run and not torch.cuda.is_available():
            print(f"gpu-check: torch {torch.__version__} sees no CUDA device; use --dry-run")
            return 2
        info = environment()
        info["dependencies"] = how
        print(json.dumps(info, indent=1), flush=True)
        done = steps(args.dry_run, out)
        for step in done:
            run_step(step, env, out)
    strategy = "memmove" if args.dry_run else "triton"
    transfers = _json(out / "transfers.json")
    targets = [
        *transfer_targets(transfers, strategy),
        *overlap_targets(transfers, "auto"),
        *e2e_targets(_json(out / "load-vs-prefill.json")),
    ]
    text = section(info, done, targets, out)
    (out / "gpu-check.md").write_text(text)
    print()
    print("Summary:")
    for t in targets:
        verdict = "met" if t.met else ("not measured" if t.met is None else "NOT MET")
        print(f"  [{verdict}] {t.what}: {t.measured}")
    for s in done:
        print(f"  step {s.name}: exit {s.returncode}, {s.elapsed_s:.0f} s")
    print(f"Wrote {out / 'gpu-check.md'}")
    return 0 if all(s.ok for s in done) else 1


if __name__ == "__main__":
    sys.exit(main())
