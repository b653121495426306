"""Cost of prefix hashing per block, against the raw hash over the same bytes.

For 16- and 256-token blocks, times ``PrefixHasher.hash_blocks`` (sha256 and xxh3_128) on a
request held as a numpy int64 array, a torch int64 tensor and a Python list, plus the
incremental case of one new block per call (a growing list). The baseline, measured in the same
run, is a Python loop of ``hashlib.sha256(parent + token_bytes).digest()`` (or
``xxhash.xxh3_128_digest``) over bytes prepared in advance: the hash alone, with no encoding.
Target: sha256 from an array costs at most 1.5x that baseline.

Usage: python benchmarks/bench_hashing.py [--quick] [--blocks N]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import sys
import timeit
from collections.abc import Callable, Sequence

import numpy as np
import torch

from tiering.core.hashing import PrefixHasher, available_algorithms

BLOCK_SIZES_TOKENS = (16, 256)
TARGET_RATIO = 1.5
RAW = "raw hash of prepared bytes"


def _raw_hash_fn(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm == "sha256":
        return lambda data: hashlib.sha256(data).digest()
    import xxhash

    digest: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
    return digest


def _best_us_per_block(
    cases: Sequence[tuple[str, Callable[[], object]]], blocks: int, repeats: int
) -> dict[str, float]:
    """Best-of-``repeats`` µs per block of each case, the cases interleaved in every round.

    Interleaving exposes every case (and the raw baseline) to the same background load, and the
    minimum discards runs slowed by other processes on this shared 2-core machine.
    """
    numbers = {}
    for name, fn in cases:
        number, _ = timeit.Timer(fn).autorange()  # runs of ~0.2 s; ~20 ms below
        numbers[name] = max(1, number // 10)
    best = {name: float("inf") for name, _ in cases}
    for _ in range(repeats):
        for name, fn in cases:
            seconds = timeit.timeit(fn, number=numbers[name]) / numbers[name]
            best[name] = min(best[name], seconds / blocks * 1e6)
    return best


def _bench_one(
    block_tokens: int, algorithm: str, num_blocks: int, repeats: int
) -> list[dict[str, object]]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, size=num_blocks * block_tokens, dtype=np.int64)
    as_list = ids.tolist()
    as_tensor = torch.from_numpy(ids.copy())
    hasher = PrefixHasher(block_tokens, algorithm)

    raw_hash = _raw_hash_fn(algorithm)
    token_bytes = ids.astype("<u4").tobytes()
    block_bytes = 4 * block_tokens
    parent = bytes(hasher.digest_size)
    messages = [
        parent + token_bytes[i * block_bytes : (i + 1) * block_bytes] for i in range(num_blocks)
    ]

    def raw() -> None:
        for message in messages:
            raw_hash(message)

    def incremental_list() -> None:
        # The request grows by one block per step, as during decoding; each call hashes it.
        request: list[int] = []
        digests: list[bytes] = []
        for start in range(0, len(as_list), block_tokens):
            request += as_list[start : start + block_tokens]
            parent = digests[-1] if digests else None
            digests += hasher.hash_blocks(request, parent=parent, start_token=start)

    cases: Sequence[tuple[str, Callable[[], object]]] = (
        (RAW, raw),
        ("numpy int64", lambda: hasher.hash_blocks(ids)),
        ("torch int64", lambda: hasher.hash_blocks(as_tensor)),
        ("list", lambda: hasher.hash_blocks(as_list)),
        ("list, 1 block/call", incremental_list),
    )
    best = _best_us_per_block(cases, num_blocks, repeats)
    return [
        {
            "block_tokens": block_tokens,
            "algorithm": algorithm,
            "source": source,
            "us_per_block": us,
            "raw_us_per_block": best[RAW],
            "ratio_to_raw": us / best[RAW],
        }
        for source, us in best.items()
    ]


def main(argv: Sequence[str] | None = None) -> list[dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks and repeats")
    parser.add_argument("--blocks", type=int, default=None, help="blocks per request")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()  # as engines do after startup: see docs/benchmarks.md
    num_blocks = args.blocks or (64 if args.quick else 256)
    repeats = 3 if args.quick else 9

    rows: list[dict[str, object]] = []
    for algorithm in available_algorithms():
        for block_tokens in BLOCK_SIZES_TOKENS:
            rows += _bench_one(block_tokens, algorithm, num_blocks, repeats)

    print(f"Prefix hashing, {num_blocks} blocks per request, best of {repeats} interleaved runs")
    print()
    print("| algorithm | block (tokens) | source | µs/block | raw µs/block | ratio to raw |")
    print("|---|---:|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['algorithm']} | {row['block_tokens']} | {row['source']} "
            f"| {row['us_per_block']:.3f} | {row['raw_us_per_block']:.3f} "
            f"| {row['ratio_to_raw']:.2f}x |"
        )
    for row in rows:
        if (row["algorithm"], row["block_tokens"], row["source"]) == ("sha256", 256, "numpy int64"):
            ratio = row["ratio_to_raw"]
            assert isinstance(ratio, float)
            verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
            print(
                f"\nsha256 from an array, 256-token blocks: {ratio:.2f}x raw "
                f"({verdict} the {TARGET_RATIO}x target)"
            )
    if "xxh3_128" not in available_algorithms():
        print("\nxxh3_128 skipped: install xxhash (pip install 'tiering[fast]')")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
