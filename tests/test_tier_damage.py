"""Damaged files are misses, never crashes: any truncation, extension or overwrite of any tier
file is found before it is mapped or read past its end; the tier serves what verifies, counts
every block (or slot) it lost, and the process lives.

LMDB maps its data file, so a damaged one could kill the process with SIGBUS: those cases run
in a subprocess, where a crash fails the test instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tiering.backends.base import Outcome
from tiering.backends.file import HEADER_AREA_BYTES, MANIFEST_NAME, SLOTS_NAME, FileBackend
from tiering.backends.file import slot_bytes_for as file_slot_bytes
from tiering.backends.lmdb.check import check_data_file
from tiering.backends.ownership import MARKER_NAME
from tiering.core.keys import make_offload_key

OK, MISSING = Outcome.OK, Outcome.MISSING
BLOCK = 8192
FP = b"damage-test-fp!!"
SLOT = file_slot_bytes(BLOCK)
REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(REPO_ROOT / "tiering")


def keys_for(n: int) -> list[bytes]:
    return [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(n)]


def payload(i: int) -> bytes:
    return bytes([(i * 7 + j) % 251 for j in range(256)]) * (BLOCK // 256)


# -- the file tier ---------------------------------------------------------------------------


def file_backend(path: Path, n_slots: int = 8, **options: Any) -> FileBackend:
    return FileBackend(
        path=path, capacity_bytes=n_slots * SLOT, block_bytes=BLOCK, fingerprint=FP, **options
    )


async def _store(path: Path, n: int) -> list[bytes]:
    keys = keys_for(n)
    async with file_backend(path) as backend:
        values = [memoryview(payload(i)) for i in range(n)]
        assert await backend.put(keys, values) == [OK] * n
    return keys


async def _reopen(
    path: Path, keys: list[bytes]
) -> tuple[list[bytes], list[Outcome], dict[str, int]]:
    backend = file_backend(path, recover="trust_header")
    recovered = await backend.open()
    try:
        out = [memoryview(bytearray(BLOCK)) for _ in keys]
        outcomes = await backend.get(keys, out)
        for i, (outcome, data) in enumerate(zip(outcomes, out, strict=True)):
            if outcome is OK:
                assert bytes(data) == payload(i)  # nothing wrong is ever served
    finally:
        await backend.close()
    return sorted(recovered), outcomes, dict(backend.stats.extra)


def _patch(path: Path, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.asyncio
async def test_a_truncated_slot_file_loses_only_what_was_cut_and_counts_it(tmp_path: Path) -> None:
    keys = await _store(tmp_path / "tier", 4)
    # Cut inside slot 1's payload: slot 0 survives, slot 1 is torn, slots 2..7 are gone.
    os.truncate(tmp_path / "tier" / SLOTS_NAME, SLOT + HEADER_AREA_BYTES + 100)
    recovered, outcomes, extra = await _reopen(tmp_path / "tier", keys)
    assert recovered == [keys[0]]
    assert outcomes == [OK, MISSING, MISSING, MISSING]
    assert extra["recovery_rejected"] == 1  # slot 1: its payload was cut
    assert extra["recovery_missing_slots"] == 6  # slots 2..7: past the end of the file
    assert os.path.getsize(tmp_path / "tier" / SLOTS_NAME) == 8 * SLOT  # preallocated again


@pytest.mark.asyncio
async def test_a_slot_file_truncated_inside_a_header_counts_that_slot(tmp_path: Path) -> None:
    keys = await _store(tmp_path / "tier", 3)
    os.truncate(tmp_path / "tier" / SLOTS_NAME, 2 * SLOT + 1000)  # inside slot 2's header area
    recovered, outcomes, extra = await _reopen(tmp_path / "tier", keys)
    assert recovered == sorted(keys[:2]) and outcomes == [OK, OK, MISSING]
    assert extra["recovery_missing_slots"] == 6  # slots 2..7


@pytest.mark.asyncio
async def test_an_extended_slot_file_keeps_every_block_and_counts_the_extra(tmp_path: Path) -> None:
    keys = await _store(tmp_path / "tier", 3)
    with open(tmp_path / "tier" / SLOTS_NAME, "ab") as f:
        f.write(os.urandom(2 * SLOT + 123))  # garbage past the capacity
    recovered, outcomes, extra = await _reopen(tmp_path / "tier", keys)
    assert recovered == sorted(keys) and outcomes == [OK] * 3
    assert extra["recovery_over_capacity"] == 2  # the two whole slots of garbage
    assert os.path.getsize(tmp_path / "tier" / SLOTS_NAME) == 8 * SLOT


@pytest.mark.asyncio
@pytest.mark.parametrize("where", [0, 7, 100, 136], ids=["magic", "version", "key", "stamp"])
async def test_an_overwritten_slot_header_is_counted(tmp_path: Path, where: int) -> None:
    """A header overwritten with anything (its magic gone or not) is a counted loss, not a
    slot silently taken for empty."""
    keys = await _store(tmp_path / "tier", 3)
    _patch(tmp_path / "tier" / SLOTS_NAME, SLOT + where, b"\xa5" * 8)
    recovered, outcomes, extra = await _reopen(tmp_path / "tier", keys)
    assert recovered == sorted([keys[0], keys[2]])
    assert outcomes == [OK, MISSING, OK]
    assert extra["recovery_rejected"] == 1


@pytest.mark.asyncio
async def test_damage_to_a_header_areas_unused_padding_costs_nothing(tmp_path: Path) -> None:
    """Past the header and its stamp the area is padding: the block still verifies in full."""
    keys = await _store(tmp_path / "tier", 3)
    _patch(tmp_path / "tier" / SLOTS_NAME, SLOT + 300, b"\xa5" * 8)
    recovered, outcomes, extra = await _reopen(tmp_path / "tier", keys)
    assert recovered == sorted(keys) and outcomes == [OK] * 3
    assert extra["recovery_rejected"] == 0


@pytest.mark.asyncio
async def test_garbage_in_a_never_used_slot_is_counted_not_served(tmp_path: Path) -> None:
    keys = await _store(tmp_path / "tier", 2)
    _patch(tmp_path / "tier" / SLOTS_NAME, 5 * SLOT, os.urandom(HEADER_AREA_BYTES))
    recovered, outcomes, extra = await _reopen(tmp_path / "tier", keys)
    assert recovered == sorted(keys) and outcomes == [OK, OK]
    assert extra["recovery_rejected"] == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["truncated", "extended", "overwritten", "emptied"])
async def test_a_damaged_manifest_costs_a_verification_not_the_data(
    tmp_path: Path, damage: str
) -> None:
    keys = await _store(tmp_path / "tier", 3)
    manifest = tmp_path / "tier" / MANIFEST_NAME
    text = manifest.read_bytes()
    manifest.write_bytes(
        {
            "truncated": text[: len(text) // 2],
            "extended": text + b"\x00garbage",
            "overwritten": os.urandom(len(text)),
            "emptied": b"",
        }[damage]
    )
    recovered, outcomes, extra = await _reopen(tmp_path / "tier", keys)
    assert recovered == sorted(keys) and outcomes == [OK] * 3
    assert extra["manifest_damaged"] == 1
    assert json.loads(manifest.read_text())["fingerprint"] == FP.hex()  # rewritten


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["truncated", "overwritten", "emptied"])
async def test_a_damaged_marker_is_rewritten(tmp_path: Path, damage: str) -> None:
    keys = await _store(tmp_path / "tier", 2)
    marker = tmp_path / "tier" / MARKER_NAME
    text = marker.read_bytes()
    marker.write_bytes(
        {"truncated": text[:10], "overwritten": os.urandom(len(text)), "emptied": b""}[damage]
    )
    recovered, outcomes, _ = await _reopen(tmp_path / "tier", keys)
    assert recovered == sorted(keys) and outcomes == [OK, OK]
    assert json.loads(marker.read_text())["backend"] == "file"


# -- LMDB, in subprocesses ---------------------------------------------------------------------

LMDB_WORKER = textwrap.dedent(
    """
    import asyncio, json, sys, types
    # The backend without the package's top level, which imports torch (~2 s a case here).
    package = types.ModuleType("tiering")
    package.__path__ = [sys.argv[5]]
    sys.modules["tiering"] = package
    from tiering.backends.lmdb import LMDBBackend
    from tiering.core.keys import make_offload_key

    path, n, block, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    keys = [make_offload_key(i.to_bytes(32, "big"), 0) for i in range(n)]

    def payload(i):
        return bytes([(i * 7 + j) % 251 for j in range(256)]) * (block // 256)

    async def main():
        backend = LMDBBackend(
            path=path, capacity_bytes=64 << 20, block_bytes=block, fingerprint=b"lmdb-damage-fp!!",
            recover="trust_header", sync=False, metasync=False, max_txn_bytes=4 * (block + 4096),
        )
        async with backend:
            if mode == "store":
                # several transactions, with deletes, so that the file has free pages too
                for first in range(0, n, 4):
                    chunk = keys[first:first + 4]
                    values = [memoryview(payload(first + i)) for i in range(len(chunk))]
                    await backend.put(chunk, values)
                await backend.delete(keys[1:2])
                await backend.put(keys[1:2], [memoryview(payload(1))])
                return {}
            out = [memoryview(bytearray(block)) for _ in keys]
            outcomes = await backend.get(keys, out)
            served = [o.value for o in outcomes]
            wrong = [
                i for i, (o, b) in enumerate(zip(outcomes, out))
                if o.value == "ok" and bytes(b) != payload(i)
            ]
            return {"served": served, "wrong": wrong, "extra": backend.stats.extra,
                    "corrupt": backend.stats.corrupt}

    print(json.dumps(asyncio.run(main())))
    """
)


def run_lmdb(path: Path, n: int, block: int, mode: str) -> dict[str, Any]:
    """Run the worker; a crash (SIGBUS, SIGSEGV) fails the test with the signal named."""
    result = subprocess.run(
        [sys.executable, "-c", LMDB_WORKER, str(path), str(n), str(block), mode, PACKAGE],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert result.returncode == 0, (
        f"the worker died (returncode {result.returncode}: a negative one is a signal):\n"
        f"{result.stderr[-3000:]}"
    )
    data: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return data


@pytest.fixture(scope="module")
def lmdb_golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An LMDB tier with 12 values of 12 KiB (overflow pages) and 12 of 1 KiB (in leaves)."""
    root = tmp_path_factory.mktemp("lmdb-golden")
    run_lmdb(root / "big", 12, 12288, "store")
    run_lmdb(root / "small", 12, 1024, "store")
    return root


def _copy(golden: Path, kind: str, tmp_path: Path) -> Path:
    target = tmp_path / kind
    shutil.copytree(golden / kind, target)
    return target


def _pages(path: Path) -> int:
    return os.path.getsize(path / "data.mdb") // 4096


@pytest.mark.parametrize("kind", ["big", "small"])
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.999])
def test_a_truncated_lmdb_data_file_is_set_aside_not_a_crash(
    lmdb_golden: Path, tmp_path: Path, kind: str, fraction: float
) -> None:
    """On main this was a SIGBUS that killed the process when the tier opened."""
    path = _copy(lmdb_golden, kind, tmp_path)
    size = os.path.getsize(path / "data.mdb")
    os.truncate(path / "data.mdb", int(size * fraction) // 4096 * 4096 + 100)
    check = check_data_file(path / "data.mdb")
    assert check.problem is not None and "truncated" in check.problem
    if fraction >= 0.5:  # the database records survive: the loss is counted exactly
        assert check.entries[b"blocks"] == 12
    block = 12288 if kind == "big" else 1024
    result = run_lmdb(path, 12, block, "read")
    assert result["served"] == ["missing"] * 12 and result["wrong"] == []
    assert result["extra"]["damaged_files"] == 1
    assert result["extra"]["recovery_dropped_blocks"] == check.entries.get(b"blocks", 0)
    assert (path / "data.mdb.damaged").exists()  # kept for a post-mortem, in the tier's folder
    # The tier works again: it stores and serves.
    run_lmdb(path, 12, block, "store")
    assert run_lmdb(path, 12, block, "read")["served"] == ["ok"] * 12


@pytest.mark.parametrize("kind", ["big", "small"])
def test_an_extended_lmdb_data_file_serves_everything(
    lmdb_golden: Path, tmp_path: Path, kind: str
) -> None:
    path = _copy(lmdb_golden, kind, tmp_path)
    with open(path / "data.mdb", "ab") as f:
        f.write(os.urandom(3 * 4096 + 17))
    block = 12288 if kind == "big" else 1024
    result = run_lmdb(path, 12, block, "read")
    assert result["served"] == ["ok"] * 12
    assert result["extra"].get("damaged_files", 0) == 0


@pytest.mark.parametrize("page", [0, 1], ids=["meta0", "meta1"])
def test_an_overwritten_meta_page_is_set_aside(
    lmdb_golden: Path, tmp_path: Path, page: int
) -> None:
    path = _copy(lmdb_golden, "big", tmp_path)
    _patch(path / "data.mdb", page * 4096, os.urandom(4096))
    result = run_lmdb(path, 12, 12288, "read")
    assert result["served"] == ["missing"] * 12 and result["wrong"] == []
    assert result["extra"]["damaged_files"] == 1


@pytest.mark.parametrize("kind", ["big", "small"])
@pytest.mark.parametrize("seed", range(4))
def test_overwritten_lmdb_pages_never_crash_or_serve_wrong_bytes(
    lmdb_golden: Path, tmp_path: Path, kind: str, seed: int
) -> None:
    """Random bytes over a random page past the meta pages (tree, overflow or free pages):
    either the plain-read check catches it, or what LMDB then reads is verified."""
    import random

    rng = random.Random(seed * 1000 + (kind == "big"))
    path = _copy(lmdb_golden, kind, tmp_path)
    page = rng.randrange(2, _pages(path))
    for _ in range(rng.randint(1, 4)):
        offset = page * 4096 + rng.randrange(4096)
        _patch(path / "data.mdb", offset, os.urandom(rng.randint(1, 64)))
    block = 12288 if kind == "big" else 1024
    result = run_lmdb(path, 12, block, "read")
    assert result["wrong"] == []
    served, extra = result["served"], result["extra"]
    dropped = extra.get("recovery_dropped_blocks", 0)
    if extra.get("damaged_files"):  # the check refused the file: it was set aside
        assert served == ["missing"] * 12 and dropped in (0, 12)  # 0: its root was lost too
    else:  # every block is served, or counted: dropped at open or corrupt on read
        assert served.count("ok") + dropped + result["corrupt"] == 12, result


@pytest.mark.parametrize("damage", ["truncated", "emptied", "overwritten", "extended"])
def test_a_damaged_lmdb_lock_file_is_harmless(
    lmdb_golden: Path, tmp_path: Path, damage: str
) -> None:
    path = _copy(lmdb_golden, "big", tmp_path)
    lock = path / "lock.mdb"
    size = os.path.getsize(lock)
    if damage == "truncated":
        os.truncate(lock, size // 3)
    elif damage == "emptied":
        os.truncate(lock, 0)
    elif damage == "overwritten":
        lock.write_bytes(os.urandom(size))
    else:
        with open(lock, "ab") as f:
            f.write(os.urandom(5000))
    result = run_lmdb(path, 12, 12288, "read")
    assert result["served"] == ["ok"] * 12


@pytest.mark.parametrize("name", ["data.mdb", "tiering-tier.json"])
def test_a_missing_lmdb_file_is_not_a_crash(lmdb_golden: Path, tmp_path: Path, name: str) -> None:
    path = _copy(lmdb_golden, "big", tmp_path)
    (path / name).unlink()
    result = run_lmdb(path, 12, 12288, "read")
    expected = ["ok"] * 12 if name == "tiering-tier.json" else ["missing"] * 12
    assert result["served"] == expected


def test_the_check_reads_every_tree_page_of_a_real_environment(lmdb_golden: Path) -> None:
    for kind in ("big", "small"):
        check = check_data_file(lmdb_golden / kind / "data.mdb")
        assert check.ok, check.problem
        assert check.entries[b"blocks"] == 12 and b"meta" in check.entries


def test_the_worker_stores_and_serves_an_intact_environment(
    lmdb_golden: Path, tmp_path: Path
) -> None:
    for kind, block in (("big", 12288), ("small", 1024)):
        path = _copy(lmdb_golden, kind, tmp_path)
        assert run_lmdb(path, 12, block, "read")["served"] == ["ok"] * 12
