"""tiering's managers against vLLM 0.33's own scheduler-side managers, side by side in one process.

The denominators are the managers of the real ``vllm`` package (the one the vLLM drop-in
installs): ``vllm.v1.kv_offload.cpu.manager.CPUOffloadingManager`` with its ``"lru"`` and
``"arc"`` cache policies. Against each, with the same policy:

- ``cpu``: :class:`tiering.managers.cpu_manager.CPUOffloadingManager`;
- ``tiering``: :class:`tiering.managers.tiering_manager.TieringOffloadingManager` over that
  primary, with
  one secondary tier configured: a :class:`~tiering.backends.file.FileBackend` in a temporary
  directory (write-through, the same policy, capacity the primary's block count up to
  ``TIER_MAX_BLOCKS``), step-driven as the vLLM adapter runs it.

Every manager gets the same keys (32-byte hashes + 4-byte group index, as vLLM's
``make_offload_key`` builds them), its own copies of them (a ``bytes`` caches its hash: a key
object shared by two managers would hand the second a free hash), and the same calls. vLLM's
calls take a ``ReqContext`` per request with every key's token position set, as its connector
does (``update_offload_keys``); tiering's calls get the same object as ``req_context``.

Phases, each timed per manager in every repetition; ratio = tiering / vLLM (below 1: tiering is
faster), per repetition, then the median and the spread (min-max) over repetitions:

- ``lookup hit`` / ``lookup miss``: one key per call, present / absent keys in random order.
  vLLM 0.33's ``lookup(key, req_context)`` answers a ``LookupResult``; so does tiering's
  ``lookup_result(key, req_context)``, which is what it is compared with.
- ``store``: ``prepare_store`` + ``complete_store`` of 16 new keys per request into a full
  manager, so every stored block evicts one; per stored block.
- ``load``: ``prepare_load`` + ``complete_load`` of 16 present keys per request; per block.
- ``touch``: ``touch`` of 16 present keys per request; per key. vLLM 0.33's connector no longer
  calls ``touch`` (recency comes from ``on_request_finished``), but the manager still has it with
  the semantics tiering's has (the first key ends most recent): like is compared with like.
- ``pinned``: a fresh manager of ``--pinned-blocks`` blocks whose oldest half is pinned by
  ``prepare_load``; then 1,600 one-key stores, each evicting one block; the mean per victim,
  first call included, and the first call alone. Reported as vLLM / tiering (how many times
  faster tiering is).

The tiering manager runs ``on_schedule_end()`` after every 8 requests' calls of a phase (a
scheduler step), and every manager's timed loops run with the cyclic garbage collector paused
(collected between phases, untimed): vLLM's ctypes ``ChunkStatus`` objects are tracked by the
collector and tiering's flat maps are not, and a collection landing in one timing says nothing
about the operation. The order of the managers rotates between repetitions.

Usage: python benchmarks/bench_vs_vllm.py [--quick] [--sizes 1000,...] [--reps N]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch

from tiering.backends.file import FileBackend, slot_bytes_for
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tiering_manager import TieringOffloadingManager

# vLLM's log handler writes to stdout, which run_all puts in docs/benchmarks.md: leave logging
# to Python's defaults (warnings on stderr).
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

try:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VllmCPUManager
except ImportError as exc:  # pragma: no cover - depends on the venv
    VLLM_IMPORT_ERROR: ImportError | None = exc
else:
    VLLM_IMPORT_ERROR = None

BATCH = 16  # keys per request's call, as bench_metadata.py
STEP_REQUESTS = 8  # requests per scheduler step (the tiering manager's on_schedule_end)
TIER_MAX_BLOCKS = 1 << 17  # a 1 GiB slot file at most (8 KiB slots for 64-byte blocks)
ROW_BYTES = 64  # metadata only: the pool is one row seen num_blocks times
PINNED_VICTIMS = 1600
FINGERPRINT = bytes(range(16))
MANAGERS = ("vllm", "cpu", "tiering")
PHASES = ("lookup hit", "lookup miss", "store", "load", "touch")


def make_keys(start: int, count: int) -> list[bytes]:
    """Offload keys as vLLM builds them: a 32-byte block hash + the group index (4 bytes)."""
    return [i.to_bytes(32, "big") + b"\0\0\0\0" for i in range(start, start + count)]


def copies(keys: Sequence[bytes]) -> list[bytes]:
    """New ``bytes`` objects with the same value (their hashes not computed yet)."""
    return [bytes(bytearray(k)) for k in keys]


def request_contexts(batches: Sequence[Sequence[bytes]], first_id: int) -> list[Any]:
    """One vLLM ``ReqContext`` per request, each key's end-token position set (16 tokens a
    block), as vLLM's connector records them."""
    contexts = []
    for n, batch in enumerate(batches):
        ctx = ReqContext(req_id=f"req-{first_id + n}")
        for j, key in enumerate(batch):
            ctx.set_offload_key_position(cast(Any, key), (j + 1) * 16)
        contexts.append(ctx)
    return contexts


@dataclass
class Subject:
    """One manager under test and how to call it."""

    name: str
    manager: Any
    lookup: Callable[..., Any]
    step: Callable[[], None]
    close: Callable[[], None] = lambda: None
    workdir: Path | None = None


def _no_step() -> None:
    return


def make_subject(name: str, policy: str, num_blocks: int, workdir: Path) -> Subject:
    if name == "vllm":
        vllm_manager = VllmCPUManager(num_blocks, cache_policy=policy)
        return Subject(name, vllm_manager, vllm_manager.lookup, _no_step)
    if name == "cpu":
        cpu = CPUOffloadingManager(num_blocks, policy)
        return Subject(name, cpu, cpu.lookup_result, _no_step)
    tier_blocks = min(num_blocks, TIER_MAX_BLOCKS)
    tier_dir = Path(tempfile.mkdtemp(prefix=f"tier-{policy}-", dir=workdir))
    backend = FileBackend(
        path=tier_dir / "file",
        capacity_bytes=tier_blocks * slot_bytes_for(ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
        recover="wipe",
    )
    pool = torch.zeros((1, ROW_BYTES), dtype=torch.uint8).expand(num_blocks, ROW_BYTES)
    tiering = TieringOffloadingManager(
        CPUOffloadingManager(num_blocks, policy),
        [SecondaryTier(backend, name="file", policy=policy)],
        pool=pool,
        step_driven=True,
    )
    tiering.wait_ready()

    def close() -> None:
        tiering.shutdown()
        shutil.rmtree(tier_dir, ignore_errors=True)

    return Subject(name, tiering, tiering.lookup_result, tiering.on_schedule_end, close, tier_dir)


def settle(subject: Subject) -> None:
    """Untimed: let the tiering manager's I/O finish and apply (a step boundary)."""
    if isinstance(subject.manager, TieringOffloadingManager):
        subject.manager.on_schedule_end()
        subject.manager.wait_idle()


# -- the timed calls (each returns seconds) -----------------------------------------------------


def time_lookups(subject: Subject, keys: Sequence[bytes], ctx: Any) -> float:
    lookup = subject.lookup
    start = time.perf_counter()
    for key in keys:
        lookup(key, ctx)
    return time.perf_counter() - start


def time_stores(subject: Subject, batches: Sequence[list[bytes]], contexts: Sequence[Any]) -> float:
    manager, step = subject.manager, subject.step
    prepare, complete = manager.prepare_store, manager.complete_store
    tiering_api = subject.name != "vllm"
    start = time.perf_counter()
    for n, (batch, ctx) in enumerate(zip(batches, contexts, strict=True)):
        if tiering_api:
            out = prepare(batch, req_context=ctx)
            complete(out.keys_to_store, req_context=ctx)
        else:
            out = prepare(batch, ctx)
            complete(out.keys_to_store, ctx)
        if n % STEP_REQUESTS == STEP_REQUESTS - 1:
            step()
    return time.perf_counter() - start


def time_loads(subject: Subject, batches: Sequence[list[bytes]], contexts: Sequence[Any]) -> float:
    manager, step = subject.manager, subject.step
    prepare, complete = manager.prepare_load, manager.complete_load
    tiering_api = subject.name != "vllm"
    start = time.perf_counter()
    for n, (batch, ctx) in enumerate(zip(batches, contexts, strict=True)):
        if tiering_api:
            prepare(batch, req_context=ctx)
            complete(batch, req_context=ctx)
        else:
            prepare(batch, ctx)
            complete(batch, ctx)
        if n % STEP_REQUESTS == STEP_REQUESTS - 1:
            step()
    return time.perf_counter() - start


def time_touches(
    subject: Subject, batches: Sequence[list[bytes]], contexts: Sequence[Any]
) -> float:
    manager, step = subject.manager, subject.step
    touch = manager.touch
    tiering_api = subject.name != "vllm"
    start = time.perf_counter()
    for n, (batch, ctx) in enumerate(zip(batches, contexts, strict=True)):
        if tiering_api:
            touch(batch, req_context=ctx)
        else:
            touch(batch, ctx)
        if n % STEP_REQUESTS == STEP_REQUESTS - 1:
            step()
    return time.perf_counter() - start


def fill(subject: Subject, keys: Sequence[bytes]) -> None:
    """Untimed: store ``keys`` in batches of 1024, one request each."""
    batches = [list(keys[i : i + 1024]) for i in range(0, len(keys), 1024)]
    contexts = request_contexts(batches, 10**9)
    time_stores(subject, batches, contexts)
    settle(subject)


def _timed(run: Callable[[], float]) -> float:
    gc.collect()
    gc.disable()
    try:
        return run()
    finally:
        gc.enable()


# -- one size, one policy -------------------------------------------------------------------------


@dataclass
class Results:
    """Seconds per operation, per (manager, phase), one entry per repetition."""

    per_op_s: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, manager: str, phase: str, seconds: float, ops: int) -> None:
        self.per_op_s.setdefault((manager, phase), []).append(seconds / ops)


def bench_steady(policy: str, num_blocks: int, ops: int, reps: int, workdir: Path) -> Results:
    """The five steady-state phases, repetitions interleaved, manager order rotated."""
    rng = random.Random(num_blocks)
    subjects = [make_subject(name, policy, num_blocks, workdir) for name in MANAGERS]
    results = Results()
    try:
        initial = make_keys(0, num_blocks)
        for subject in subjects:
            fill(subject, copies(initial))
        del initial
        gc.collect()
        next_key = num_blocks
        batches_per_phase = max(1, ops // BATCH)
        for rep in range(reps):
            order = subjects[rep % len(subjects) :] + subjects[: rep % len(subjects)]
            # Stores: new keys, each evicting one block.
            store_keys = make_keys(next_key, batches_per_phase * BATCH)
            next_key += len(store_keys)
            store_batches = [store_keys[i : i + BATCH] for i in range(0, len(store_keys), BATCH)]
            absent = make_keys(10**12 + rep * ops, ops)
            for subject in order:
                contexts = request_contexts(store_batches, rep * 10**6)
                mine = [copies(b) for b in store_batches]
                seconds = _timed(partial(time_stores, subject, mine, contexts))
                results.add(subject.name, "store", seconds, len(store_keys))
                settle(subject)
            # Keys to hit: drawn from what tiering's CPU manager holds, kept if every manager
            # holds them too (the managers run the same policy on the same calls, so nearly
            # all are; ARC keeps its T2 and turns T1 over, so "the newest keys" would not do).
            cpu_manager = next(s for s in subjects if s.name == "cpu").manager
            candidates = rng.choices(list(cpu_manager.slots), k=ops)
            present = [
                k for k in candidates if all(s.lookup(k, None).name == "HIT" for s in subjects)
            ]
            access_batches = [present[i : i + BATCH] for i in range(0, len(present), BATCH)]
            access_batches = [list(dict.fromkeys(b)) for b in access_batches]
            for subject in order:
                ctx = request_contexts([[]], 0)[0]
                probe = copies(present)
                seconds = _timed(partial(time_lookups, subject, probe, ctx))
                results.add(subject.name, "lookup hit", seconds, len(probe))
            for subject in order:
                ctx = request_contexts([[]], 0)[0]
                probe = copies(absent)
                seconds = _timed(partial(time_lookups, subject, probe, ctx))
                results.add(subject.name, "lookup miss", seconds, len(probe))
                settle(subject)
            for subject in order:
                mine = [copies(b) for b in access_batches]
                contexts = request_contexts(mine, rep * 10**6 + 5 * 10**5)
                seconds = _timed(partial(time_loads, subject, mine, contexts))
                results.add(subject.name, "load", seconds, sum(map(len, mine)))
                settle(subject)
            for subject in order:
                mine = [copies(b) for b in access_batches]
                contexts = request_contexts(mine, rep * 10**6 + 7 * 10**5)
                seconds = _timed(partial(time_touches, subject, mine, contexts))
                results.add(subject.name, "touch", seconds, sum(map(len, mine)))
                settle(subject)
    finally:
        for subject in subjects:
            subject.close()
    return results


def bench_pinned(policy: str, num_blocks: int, reps: int, workdir: Path) -> Results:
    """Eviction past a pinned oldest half: fresh managers each repetition, 1-key stores."""
    results = Results()
    for rep in range(reps):
        names = MANAGERS[rep % len(MANAGERS) :] + MANAGERS[: rep % len(MANAGERS)]
        for name in names:
            subject = make_subject(name, policy, num_blocks, workdir)
            try:
                fill(subject, make_keys(0, num_blocks))
                pinned = make_keys(0, num_blocks // 2)
                pin_batches = [pinned[i : i + 1024] for i in range(0, len(pinned), 1024)]
                for batch, ctx in zip(
                    pin_batches, request_contexts(pin_batches, 2 * 10**9), strict=True
                ):
                    if name == "vllm":
                        subject.manager.prepare_load(batch, ctx)
                    else:
                        subject.manager.prepare_load(batch, req_context=ctx)
                settle(subject)
                stores = [[k] for k in make_keys(num_blocks, PINNED_VICTIMS)]
                contexts = request_contexts(stores, 3 * 10**9)
                first = stores[:1], contexts[:1]
                rest = stores[1:], contexts[1:]

                gc.collect()
                gc.disable()
                try:
                    t_first = time_stores(subject, *first)
                    t_rest = time_stores(subject, *rest)
                finally:
                    gc.enable()
                results.add(name, "pinned first call", t_first, 1)
                results.add(name, "pinned", t_first + t_rest, PINNED_VICTIMS)
            finally:
                subject.close()
    return results


# -- report ---------------------------------------------------------------------------------------


def _ratios(results: Results, mine: str, phase: str, *, invert: bool = False) -> list[float]:
    ours = results.per_op_s[mine, phase]
    theirs = results.per_op_s["vllm", phase]
    return [(t / o if invert else o / t) for o, t in zip(ours, theirs, strict=True)]


def _cell(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.2f} ({min(values):.2f}-{max(values):.2f})"


def report(
    steady: dict[tuple[str, int], Results], pinned: dict[tuple[str, int], Results], reps: int
) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    print(
        f"Ratio tiering / vLLM 0.33 per operation (below 1: tiering faster): median of {reps} "
        "repetitions (min-max); vLLM's time per operation in microseconds"
    )
    print()
    print("| policy | blocks | phase | vLLM µs/op | cpu / vLLM | tiering+file / vLLM |")
    print("|---|---:|---|---:|---:|---:|")
    for (policy, blocks), res in steady.items():
        for phase in PHASES:
            vllm_us = statistics.median(res.per_op_s["vllm", phase]) * 1e6
            cpu = _ratios(res, "cpu", phase)
            tiering = _ratios(res, "tiering", phase)
            print(
                f"| {policy} | {blocks:,} | {phase} | {vllm_us:.3f} | {_cell(cpu)} "
                f"| {_cell(tiering)} |"
            )
            rows.append(
                {
                    "policy": policy,
                    "blocks": blocks,
                    "phase": phase,
                    "vllm_us": vllm_us,
                    "cpu_ratio": statistics.median(cpu),
                    "tiering_ratio": statistics.median(tiering),
                    "cpu_max": max(cpu),
                    "tiering_max": max(tiering),
                }
            )
    if pinned:
        print()
        print(
            f"Eviction past a pinned oldest half: {PINNED_VICTIMS:,} one-key stores, each "
            "evicting one block; mean µs per victim, first call included; "
            "speed-up = vLLM time / tiering time (median, min-max)"
        )
        print()
        print(
            "| policy | blocks | vLLM µs/victim | vLLM first call ms | cpu first call ms "
            "| tiering first call ms | cpu speed-up | tiering speed-up |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for (policy, blocks), res in pinned.items():
            first = {
                m: statistics.median(res.per_op_s[m, "pinned first call"]) * 1e3 for m in MANAGERS
            }
            cpu = _ratios(res, "cpu", "pinned", invert=True)
            tiering = _ratios(res, "tiering", "pinned", invert=True)
            vllm_us = statistics.median(res.per_op_s["vllm", "pinned"]) * 1e6
            print(
                f"| {policy} | {blocks:,} | {vllm_us:.2f} | {first['vllm']:.2f} "
                f"| {first['cpu']:.2f} | {first['tiering']:.2f} | {_cell(cpu)} "
                f"| {_cell(tiering)} |"
            )
            rows.append(
                {
                    "policy": policy,
                    "blocks": blocks,
                    "phase": "pinned",
                    "vllm_us": vllm_us,
                    "cpu_speedup": statistics.median(cpu),
                    "tiering_speedup": statistics.median(tiering),
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="sizes up to 1e5, fewer ops")
    parser.add_argument("--sizes", help="comma-separated block counts")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--ops", type=int, default=None, help="operations per phase")
    parser.add_argument("--policies", default="lru,arc")
    parser.add_argument("--pinned-blocks", type=int, default=None)
    parser.add_argument("--no-pinned", action="store_true")
    parser.add_argument("--dir", type=Path, default=None, help="where the file tiers live")
    args = parser.parse_args(argv)
    if VLLM_IMPORT_ERROR is not None:
        print(
            f"vLLM is not importable ({VLLM_IMPORT_ERROR}); `make install` puts vLLM 0.33 in "
            "the venv",
            file=sys.stderr,
        )
        raise SystemExit(2)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as engines do after startup: see docs/benchmarks.md
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    else:
        sizes = [1_000, 10_000, 100_000] if args.quick else [1_000, 10_000, 100_000, 1_000_000]
    ops = args.ops or (8_000 if args.quick else 40_000)
    reps = args.reps or (3 if args.quick else 5)
    pinned_blocks = args.pinned_blocks or (20_000 if args.quick else 100_000)
    policies = args.policies.split(",")
    steady: dict[tuple[str, int], Results] = {}
    pinned: dict[tuple[str, int], Results] = {}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_vs_vllm.") as tmp:
        workdir = Path(tmp)
        for size in sizes:
            for policy in policies:
                steady[policy, size] = bench_steady(policy, size, ops, reps, workdir)
        if not args.no_pinned:
            for policy in policies:
                pinned[policy, pinned_blocks] = bench_pinned(
                    policy, pinned_blocks, max(1, reps - 2), workdir
                )
    return report(steady, pinned, reps)


if __name__ == "__main__":
    main()
    # Importing vLLM loads Triton, whose bindings print pages of "leaked instance" warnings at
    # interpreter exit; the figures are out, so leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
