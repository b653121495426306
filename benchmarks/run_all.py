"""Run every benchmark and write docs/benchmarks.md (``make bench``).

Each benchmark measures its own physical limit in the same run (raw memcpy, raw batched
``pwritev``/``preadv``, raw py-lmdb, raw hashlib, a bare OrderedDict) and reports ratios against
it, so the figures only compare numbers taken minutes apart on the same machine. One torch
thread throughout.

Usage: python benchmarks/run_all.py [--quick] [--out docs/benchmarks.md] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

#: (module, title, what it answers, extra arguments)
BENCHMARKS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    (
        "bench_cpu_copy",
        "CPU pool copies against memcpy",
        "Stores and loads between registered KV tensors and the CPU pool (target: 0.8 of "
        "memcpy or better for blocks of 256 KiB and more).",
        (),
    ),
    (
        "bench_file_tier",
        "File tier against raw pwritev/preadv and one file per block",
        "FileBackend puts and cold gets from and into pool rows, against raw batched "
        "pwritev/preadv on one file and against one file per block (vLLM's file-system tier), "
        "page cache dropped per file before cold reads (targets: durable writes, O_DIRECT cold "
        "reads and buffered writes in both steady states 0.8 or better, buffered cold reads 0.9 "
        "or better).",
        (),
    ),
    (
        "bench_lmdb_tier",
        "LMDB tier against raw py-lmdb",
        "LMDBBackend puts and gets against raw py-lmdb puts and zero-copy gets with the same "
        "flags (target: 0.8 or better).",
        (),
    ),
    (
        "bench_lmdb_tier",
        "LMDB tier against raw py-lmdb, 128 blocks per call",
        "The same with four times bigger calls: every async get pays one thread round trip "
        "and its bookkeeping, which raw synchronous py-lmdb does not; bigger calls spread it.",
        ("--batch", "128"),
    ),
    (
        "bench_redis_tier",
        "Redis tier against raw pipelined redis-py",
        "RedisBackend puts and gets of 256 KiB and 2 MiB blocks on a standalone redis-server and "
        "a 3-master Redis Cluster started by the benchmark, against raw pipelined redis-py with "
        "the same batches (target: 0.8 or better), and the event-loop lag meanwhile (target: "
        "p99 5 ms or less).",
        (),
    ),
    (
        "bench_engines",
        "Engine adapters against raw tier calls",
        "Puts and warm gets of 512 KiB blocks on a file tier through tiering.embed.TierStore, "
        "SGLang 0.5.23's HiCache storage (page_first: 2 runs per page; layer_first: 16) and "
        "LMCache 0.5.6's remote connector, against the file backend's own put/get of the same "
        "slots (what framing, staging copies, the index and each engine's calling convention "
        "cost).",
        (),
    ),
    (
        "bench_policies",
        "Eviction policies against Belady on realistic traces",
        "Prefix hit ratio of every registered policy and Belady's bound on the generated "
        "conversation, tool-agent, document and production traces at 1-20 % of their unique "
        "blocks, and the share of the LRU -> Belady gap each closes (the targets of hybrid and "
        "chain: never 0.2 points under max(LRU, ARC); 25 % of the gap at 5 %).",
        (),
    ),
    (
        "bench_policy_variants",
        "The adaptive policies' floor on traffic shapes no tuning saw",
        "The generator moved one parameter at a time far from its calibrated shape (how much "
        "conversations differ, document popularity and reuse, tenants, think times, mixes), "
        "seeds 0 and 1, 1-20 % of the unique blocks: hybrid and chain against max(LRU, ARC) "
        "(target: never 0.2 points under).",
        (),
    ),
    (
        "bench_gap_breakdown",
        "Where the LRU -> Belady gap lies, by kind of request",
        "Prefix hits at 5 % of the unique blocks of the generated production and documents "
        "traces (seed 0), per policy and Belady's bound, split by what each request is "
        "(a conversation's turn, an agent loop's step, a document's first ask or an ask "
        "again), in points of the trace's blocks: where a policy could still win.",
        (),
    ),
    (
        "bench_headroom",
        "What chain closes when the caller hints which requests continue",
        "The metadata study of chain unhinted and hinted through the public API "
        "(`note_request(keys, continues=...)`), on the generated conversation, documents and "
        "production traces (seed 0) at 1-20 % of the unique blocks: every request hinted with "
        "whether a later request holds its last block; the same with one hint in ten wrong (a "
        "fixed seed); and `true` only for the requests that are continued, the rest unhinted. "
        "Prefix hit ratio and the share of the LRU -> Belady gap closed: what the one bit an "
        "online policy cannot see in these traces is worth, and what a wrong hint costs.",
        (),
    ),
    (
        "bench_metadata",
        "Manager metadata per operation, 1e3 to 1e6 blocks",
        "Microseconds per stored block (eviction included; alone, and in requests that reuse "
        "the previous request's blocks) and per lookup, and their growth (targets: 2 us per "
        "stored block, 0.5 us per lookup, growth 2x or less; a policy's metadata 1.5x LRU's "
        "or less); then per block referenced, replaying the generated conversation and "
        "production traces with every call a connector makes, where a multi-list policy's "
        "lists compete. The managers are measured in turn within each repetition; a ratio "
        "against LRU is the median of the repetitions' ratios.",
        (),
    ),
    (
        "bench_vllm_dropin",
        "vLLM drop-in against vLLM's own manager, per connector step",
        "The calls one request makes in a scheduler step of vLLM 0.33's connector (64 chunk "
        "lookups and loads, 16 evicting stores, request hooks), on tiering's TieringSpec and "
        "on vLLM's own TieringOffloadingSpec, CPU tier only (target: 1.0 or more, as fast as "
        "the manager it replaces).",
        (),
    ),
    (
        "bench_vllm_hits",
        "vLLM drop-in hit ratios against vLLM's own manager",
        "The same request streams (shifting Zipf popularity, scan-polluted, frequency-skewed) "
        "served by vLLM 0.33's CPUOffloadingManager and by tiering's TieringSpec, LRU and ARC, "
        "a 32-chunk CPU tier, 10 seeds (target: the drop-in's hit ratio at least vLLM's in "
        "every seed, within 0.005).",
        (),
    ),
    (
        "bench_vs_vllm",
        "Both managers against vLLM 0.33's own, per operation, 1e3 to 1e6 blocks",
        "CPUOffloadingManager and TieringOffloadingManager (with a file tier) against vLLM "
        "0.33's CPUOffloadingManager from the real vllm package, LRU and ARC, same keys and "
        "calls in one process, order rotated; ratio tiering / vLLM (targets: store with "
        "eviction 0.7 or less; lookup hit and miss, load and touch 1.0 or less; eviction past "
        "a pinned oldest half 100x faster, first call included).",
        (),
    ),
    (
        "bench_eviction",
        "Eviction with pinned heads at 1e5 blocks",
        "Microseconds per victim when the oldest half of 100,000 blocks is pinned, against a "
        "scan past pinned blocks (vLLM's approach).",
        (),
    ),
    (
        "bench_hashing",
        "Prefix hashing against hashlib",
        "Microseconds per hash block against hashlib's SHA-256 (and xxh3) over the same bytes "
        "(target: 1.5x or less for 256-token blocks from an array).",
        (),
    ),
    (
        "bench_event_loop",
        "Event-loop lag while the tiers run at full speed",
        "Heartbeat lag of the caller's loop and the manager's I/O loop (target: p99 5 ms or less).",
        (),
    ),
    (
        "bench_gpu_transfer",
        "GPU <-> pinned CPU transfers against the PCIe limit",
        "Stores and loads of 2 MiB blocks (llama-3-8b KV: 32 layers of FlashAttention K/V pages "
        "of 32 KiB) through the transfer engine with each copy strategy, against one contiguous "
        "pinned copy of the same bytes; the time submit holds the caller; matmul slowdown while "
        "transfers run; pages of 4 to 64 KiB (targets: 0.9 of the limit from 32 blocks, 0.8 at "
        "8, 0.85 at 256 blocks for every page size, caller blocked 0.3 ms or less at 256 blocks, "
        "matmul slowdown 25 % or less).",
        (),
    ),
)
#: Benchmarks that measure a GPU: on a machine without CUDA their section says so.
NEEDS_CUDA = frozenset({"bench_gpu_transfer"})


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, ValueError, IndexError):
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kib / 2**20:.0f} GiB RAM"
    return (
        f"{os.cpu_count()} CPUs ({cpu}){mem}; Python {platform.python_version()}, "
        f"torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}"
    )


_NOT_MEASURED = (
    "**Not measured: the machine that wrote this file has no CUDA device.** No GPU figures "
    "have been measured with this code yet. To produce them, run `make bench` (or the command "
    "above alone) on a machine with an NVIDIA GPU and a CUDA build of torch (which ships "
    "Triton); the section then holds the device name and the tables. The figures that "
    "motivated the transfer engine (issue 10, an H100 over PCIe Gen5) are in "
    "docs/architecture.md."
)


#: The last ``make gpu-check`` run on a GPU machine (benchmarks/gpu_check.py writes it).
GPU_CHECK_REPORT = HERE.parent / "docs" / "gpu-check.md"


def gpu_section_without_cuda(report: Path = GPU_CHECK_REPORT) -> str:
    """What the GPU section says on a machine without CUDA: the last ``make gpu-check`` run,
    taken in whole (headings one level down), or that nothing was measured yet."""
    if not report.exists():
        return _NOT_MEASURED
    lines = report.read_text().strip().splitlines()
    body = [("#" + line if line.startswith("##") else line) for line in lines[1:]]
    lead = (
        "**The machine that wrote this file has no CUDA device: what follows is the last "
        "`make gpu-check` run on a GPU, taken in from [docs/gpu-check.md](gpu-check.md).**"
    )
    return "\n".join([lead, *body]).strip()


def run(names: Sequence[str], quick: bool) -> list[tuple[str, str, str, str, float]]:
    """Each benchmark in a process of its own, exactly the command its section names: one
    benchmark's heap, threads and freed memory must not shape the next one's figures."""
    results = []
    for module_name, title, about, extra in BENCHMARKS:
        if names and module_name not in names:
            continue
        args = [*extra, *(["--quick"] if quick else [])]
        command = " ".join(["python", f"benchmarks/{module_name}.py", *args])
        if module_name in NEEDS_CUDA and not torch.cuda.is_available():
            print(f"== {command}: skipped, no CUDA device", file=sys.stderr, flush=True)
            results.append((title, about, command, gpu_section_without_cuda(), 0.0))
            continue
        print(f"== {command}", file=sys.stderr, flush=True)
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, str(HERE / f"{module_name}.py"), *args],
            cwd=HERE.parent,
            stdout=subprocess.PIPE,
            text=True,
            check=True,
        )
        elapsed = time.perf_counter() - started
        sys.stderr.write(done.stdout)
        results.append((title, about, command, done.stdout.strip(), elapsed))
    return results


NOTES_START, NOTES_END = "<!-- notes -->", "<!-- /notes -->"


def kept_notes(path: Path) -> dict[str, str]:
    """Hand-written notes of each section of an existing report, by section title.

    A note is the text between ``<!-- notes -->`` and ``<!-- /notes -->`` (markers included)
    in a section: why a target is not met, what was tried. Re-running the benchmarks must not
    throw that analysis away; the note says which run it is about, the tables above it are new.
    """
    notes: dict[str, str] = {}
    if not path.exists():
        return notes
    title, inside, lines = "", False, []
    for line in path.read_text().splitlines():
        if not inside and line.startswith("## "):
            title = line[3:].strip()
        elif not inside and line.strip() == NOTES_START:
            inside, lines = True, [line]
        elif inside:
            lines.append(line)
            if line.strip() == NOTES_END:
                inside = False
                notes[title] = "\n".join(lines)
    return notes


HAND_SECTION_SUFFIX = "(written by hand)"


def kept_hand_sections(path: Path) -> list[str]:
    """Whole sections of an existing report whose heading ends with ``(written by hand)``:
    comparisons between runs (before/after a change), which no benchmark writes. Kept at the end
    of the report, in their order."""
    if not path.exists():
        return []
    sections: list[str] = []
    current: list[str] | None = None
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            if current is not None:
                sections.append("\n".join(current).rstrip())
            current = [line] if line.rstrip().endswith(HAND_SECTION_SUFFIX) else None
        elif current is not None:
            current.append(line)
    if current is not None:
        sections.append("\n".join(current).rstrip())
    return sections


def write_markdown(
    path: Path, results: list[tuple[str, str, str, str, float]], quick: bool
) -> None:
    today = datetime.date.today().isoformat()
    notes = kept_notes(path)
    hand_sections = kept_hand_sections(path)
    lines = [
        "# Benchmarks",
        "",
        "Written by `make bench` (`python benchmarks/run_all.py"
        + (" --quick" if quick else "")
        + " --out docs/benchmarks.md`). Every table compares the library with the physical",
        "limit measured in the same run, on the same machine, with one torch thread: only",
        "those ratios mean anything (absolute GB/s on a shared 2-core VM move from run to run).",
        "Each section names the command that reproduces it alone. Each benchmark freezes its",
        "startup heap (`gc.freeze()`) as serving engines do: otherwise a full collection over",
        "torch's objects (~90 ms here) lands in whichever timing it happens to fall into.",
        "A section may end with notes written by hand (why a target is not met, what was",
        "tried): `make bench` keeps them under the new tables, and each names the run it is about.",
        "",
        f"Run on {today}: {_machine()}.",
        "",
    ]
    for title, about, command, output, elapsed in results:
        lines += [f"## {title}", "", about, "", f"Command: `{command}` ({elapsed:.0f} s)", ""]
        lines += [output, ""]
        if title in notes:
            lines += [notes[title], ""]
    for section in hand_sections:
        lines += [section, ""]
    path.write_text("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short runs of every benchmark")
    parser.add_argument("--out", type=Path, default=HERE.parent / "docs" / "benchmarks.md")
    parser.add_argument("--only", nargs="*", default=[], help="benchmark module names")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = run(args.only, args.quick)
    if args.only and args.out.exists():
        print("--only given: not rewriting the whole report", file=sys.stderr)
        return
    write_markdown(args.out, results, args.quick)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
