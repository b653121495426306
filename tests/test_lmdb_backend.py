"""LMDBBackend: the shared conformance suite, then what is specific to LMDB.

Everything runs on real LMDB environments in ``tmp_path``; corruption is injected either through
a raw ``lmdb`` environment (backend closed) or by rewriting bytes of ``data.mdb`` in place
(backend open), never through the backend's API.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import lmdb
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tiering.backends.base import Outcome
from tiering.backends.lmdb import LMDBBackend, copy_and_checksum, lmdb_geometry
from tiering.backends.ownership import LayoutMismatchError
from tiering.core.block_format import HEADER_BYTES, MAX_KEY_BYTES, checksum
from tiering.core.keys import make_offload_key
from tiering.errors import BackendError, ConfigurationError, InvalidKeyError
from tiering.testing.backend_tests import BackendTests
from tiering.testing.loop_use import measure_loop_use

OK, MISSING, CORRUPT, FULL = Outcome.OK, Outcome.MISSING, Outcome.CORRUPT, Outcome.FULL
FP = b"lmdb-test-fprint"
BLOCK = 16 * 1024
PAGE = 4096
REPO = Path(__file__).resolve().parents[1]


def flip_stored_payload_bytes(directory: Path, key: bytes) -> int:
    """Flip one payload byte of every copy of ``key``'s block in ``data.mdb``; return the count.

    The header holds the key zero-padded at offset 48, so the block is found by content. Stale
    copies (pages freed by earlier transactions) are flipped too, so the live one surely is.
    """
    data = directory / "data.mdb"
    image = data.read_bytes()
    needle = key.ljust(MAX_KEY_BYTES, b"\0")
    flipped = 0
    with open(data, "r+b") as f:
        pos = image.find(needle)
        while pos != -1:
            header_start = pos - 48
            if image[header_start : header_start + 4] == b"TKVB":
                target = header_start + HEADER_BYTES + 7
                f.seek(target)
                f.write(bytes([image[target] ^ 0x10]))
                flipped += 1
            pos = image.find(needle, pos + 1)
    return flipped


class TestLMDBConformance(BackendTests):
    """The shared suite with the default (fully durable) settings."""

    def make_backend(
        self, path: Path, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes
    ) -> LMDBBackend:
        return LMDBBackend(
            path=path,
            capacity_bytes=capacity_bytes,
            block_bytes=block_bytes,
            fingerprint=fingerprint,
        )

    def corrupt_stored_block(self, backend: LMDBBackend, key: bytes) -> None:  # type: ignore[override]
        assert flip_stored_payload_bytes(Path(backend.path), key) >= 1

    def expected_usage_bytes(self, backend: LMDBBackend, n_blocks: int) -> int:  # type: ignore[override]
        return n_blocks * backend.geometry.footprint_bytes


class TestLMDBConformanceWritemapAsync(TestLMDBConformance):
    """The shared suite again with the fastest, least durable flags and one read thread."""

    buffer_offset_bytes = 3

    def make_backend(
        self, path: Path, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes
    ) -> LMDBBackend:
        return LMDBBackend(
            path=path,
            capacity_bytes=capacity_bytes,
            block_bytes=block_bytes,
            fingerprint=fingerprint,
            sync=False,
            metasync=False,
            writemap=True,
            map_async=True,
            read_threads=1,
        )


# -- helpers ---------------------------------------------------------------------------------


def keys_for(n: int, tag: str = "k") -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}/{i}".encode()).digest(), 0) for i in range(n)]


def payloads(n: int, seed: int, size: int = BLOCK) -> list[memoryview]:
    rng = random.Random(seed)
    return [memoryview(bytearray(rng.randbytes(size))) for _ in range(n)]


def buffers(n: int, size: int = BLOCK) -> list[memoryview]:
    return [memoryview(bytearray(b"\xa5" * size)) for _ in range(n)]


def backend_at(
    path: Path, *, blocks: int = 32, size: int = BLOCK, **settings: object
) -> LMDBBackend:
    footprint = lmdb_geometry(
        block_bytes=size, capacity_bytes=1 << 40, page_bytes=PAGE, max_txn_bytes=64 << 20
    ).footprint_bytes
    return LMDBBackend(
        path=path,
        capacity_bytes=blocks * footprint,
        block_bytes=size,
        fingerprint=settings.pop("fingerprint", FP),  # type: ignore[arg-type]
        **settings,  # type: ignore[arg-type]
    )


async def read_back(backend: LMDBBackend, keys: list[bytes], size: int = BLOCK) -> list[object]:
    """Each key's bytes if OK, else its outcome."""
    out = buffers(len(keys), size)
    outcomes = await backend.get(keys, out)
    return [bytes(b) if o is OK else o for o, b in zip(outcomes, out, strict=True)]


# -- settings and geometry -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"capacity_bytes": 0}, "capacity_bytes must be an int >= 1, got 0"),
        ({"capacity_bytes": True}, "capacity_bytes must be an int >= 1, got True"),
        ({"capacity_bytes": 1000}, "capacity_bytes=1000 holds no block"),
        ({"read_threads": 0}, "read_threads must be an int >= 1, got 0"),
        ({"max_readers": 1, "read_threads": 2}, "max_readers=1 is below read_threads=2"),
        ({"sync": "yes"}, "sync must be a bool, got 'yes'"),
        ({"writemap": 1}, "writemap must be a bool, got 1"),
        ({"map_async": True}, "map_async=True requires writemap=True"),
        ({"recover": "repair"}, r"recover must be one of .*'repair'"),
        ({"max_txn_bytes": 0}, "max_txn_bytes must be an int >= 1, got 0"),
        ({"map_size_bytes": -5}, "map_size_bytes must be an int >= 1, got -5"),
        ({"path": ""}, "path must be a directory path, got ''"),
        ({"block_bytes": 1 << 32}, "over LMDB's largest value"),
    ],
)
def test_bad_settings_raise_configuration_error(
    tmp_path: Path, settings: dict[str, object], message: str
) -> None:
    arguments: dict[str, object] = {
        "path": tmp_path / "db",
        "capacity_bytes": 1 << 20,
        "block_bytes": BLOCK,
        "fingerprint": FP,
    }
    arguments.update(settings)
    with pytest.raises(ConfigurationError, match=message):
        LMDBBackend(**arguments)  # type: ignore[arg-type]
    assert not (tmp_path / "db").exists()  # no I/O in __init__


@pytest.mark.parametrize(
    ("block_bytes", "footprint"),
    [
        (256 << 10, 65 * PAGE),  # 262144 + 128 + 16 bytes -> 65 overflow pages
        (2 << 20, 513 * PAGE),
        (PAGE - HEADER_BYTES - 16, PAGE),  # exactly one overflow page
        (PAGE - HEADER_BYTES - 15, 2 * PAGE),
        (512, 2 * (8 + MAX_KEY_BYTES + 512 + HEADER_BYTES + 2)),  # inline in a leaf
    ],
)
def test_geometry_footprint(block_bytes: int, footprint: int) -> None:
    geometry = lmdb_geometry(
        block_bytes=block_bytes,
        capacity_bytes=10 * footprint + footprint - 1,
        page_bytes=PAGE,
        max_txn_bytes=64 << 20,
    )
    assert geometry.footprint_bytes == footprint
    assert geometry.value_bytes == block_bytes + HEADER_BYTES
    assert geometry.capacity_blocks == 10
    assert geometry.map_bytes > 10 * footprint


@settings(max_examples=25, deadline=None)
@given(size=st.integers(1, 3 << 20), seed=st.integers(0, 2**32))
@example(size=512 << 10, seed=0)
@example(size=(512 << 10) + 1, seed=1)
@example(size=2 << 20, seed=2)
def test_copy_and_checksum_is_a_copy_plus_the_block_checksum(size: int, seed: int) -> None:
    src = memoryview(random.Random(seed).randbytes(size))
    dst = memoryview(bytearray(size))
    assert copy_and_checksum(dst, src) == checksum(src)
    assert dst == src


@pytest.mark.asyncio
@pytest.mark.parametrize("block_bytes", [512, 1900, 2000, PAGE - HEADER_BYTES - 16, 40_000])
async def test_capacity_blocks_fit_in_the_derived_map_under_churn(
    tmp_path: Path, block_bytes: int
) -> None:
    """Fill to capacity_blocks, then replace and delete/insert for many transactions: the map
    sized from the capacity never reports FULL below capacity_blocks (freed pages are reused)."""
    backend = backend_at(tmp_path / "db", blocks=40, size=block_bytes, max_txn_bytes=8 * PAGE)
    rng = random.Random(block_bytes)
    async with backend:
        capacity = backend.capacity_blocks
        keys = keys_for(capacity)
        values = payloads(capacity, seed=1, size=block_bytes)
        for start in range(0, capacity, 7):
            assert await backend.put(keys[start : start + 7], values[start : start + 7]) == [
                OK
            ] * len(keys[start : start + 7])
        assert backend.usage_bytes == capacity * backend.geometry.footprint_bytes
        stored = set(keys)
        spare = keys_for(capacity, tag="spare")
        for round_ in range(60):
            victims = rng.sample(sorted(stored), 3)
            assert await backend.delete(victims) == [True] * 3
            stored -= set(victims)
            newcomers = [k for k in spare if k not in stored][:3]
            replaced = rng.sample(sorted(stored), 2)
            batch = newcomers + replaced
            assert await backend.put(batch, values[: len(batch)]) == [OK] * len(batch), round_
            stored |= set(newcomers)
        assert len(stored) == capacity
        assert await backend.contains(sorted(stored)) == [True] * capacity
        assert "map_full_errors" not in backend.stats.extra


# -- MapFullError ----------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_map_full_reports_full_for_what_did_not_fit(tmp_path: Path) -> None:
    size = 64 << 10
    path = tmp_path / "db"
    # Room for 100 blocks by capacity, but a 1 MiB map: LMDB runs out first.
    backend = backend_at(path, blocks=100, size=size, map_size_bytes=1 << 20)
    keys = keys_for(30)
    values = payloads(30, seed=2, size=size)
    async with backend:
        outcomes = await backend.put(keys, values)
        fitted = outcomes.count(OK)
        assert 1 <= fitted < 30
        assert outcomes == [OK] * fitted + [FULL] * (30 - fitted)
        assert backend.stats.extra["map_full_errors"] >= 1
        assert await backend.contains(keys) == [o is OK for o in outcomes]
        assert await read_back(backend, keys, size) == [bytes(v) for v in values[:fitted]] + [
            MISSING
        ] * (30 - fitted)
        assert backend.usage_bytes == fitted * backend.geometry.footprint_bytes

        # A failed replace leaves the key invisible, never its old value.
        assert await backend.put(keys[fitted:], values[fitted:]) == [FULL] * (30 - fitted)
        assert await backend.put(keys[:1] + keys[fitted:], values[1:2] + values[fitted:]) in (
            [OK] + [FULL] * (30 - fitted),
            [FULL] * (31 - fitted),
        )
        replaced_first = (await backend.contains(keys[:1]))[0]
        assert await read_back(backend, keys[:1], size) == (
            [bytes(values[1])] if replaced_first else [MISSING]
        )

        # Deleting makes room again: the next puts succeed.
        present = [k for k, c in zip(keys, await backend.contains(keys), strict=True) if c]
        assert await backend.delete(present[:3]) == [True] * 3
        newcomers = keys_for(2, tag="after-delete")
        assert await backend.put(newcomers, values[:2]) == [OK, OK]
        assert await read_back(backend, newcomers, size) == [bytes(values[0]), bytes(values[1])]
        survivors = present[3:]

    # Committed data stayed intact through the aborted transactions.
    reopened = backend_at(path, blocks=100, size=size, map_size_bytes=1 << 20)
    assert sorted(await reopened.open()) == sorted(survivors + newcomers)
    try:
        expected = {k: bytes(values[i]) for i, k in enumerate(keys)}
        expected[keys[0]] = bytes(values[1]) if replaced_first else bytes(values[0])
        assert await read_back(reopened, survivors, size) == [expected[k] for k in survivors]
    finally:
        await reopened.close()


@pytest.mark.asyncio
async def test_deletes_make_progress_in_a_full_map(tmp_path: Path) -> None:
    """Deleting needs a few free pages (copy-on-write of the B+tree and the freelist); in a
    map filled to the last page a delete hits MapFullError, so the map grows a little."""
    size = 1500  # small values, in leaf pages: the map fills up to its last page
    backend = backend_at(tmp_path / "db", blocks=2000, size=size, map_size_bytes=1 << 20)
    async with backend:
        keys = keys_for(600)
        value = payloads(1, seed=3, size=size)
        stored = []
        for key in keys:  # one put per transaction, until the map is full
            if await backend.put([key], value) != [OK]:
                break
            stored.append(key)
        assert 0 < len(stored) < 600
        assert await backend.delete(stored[:2]) == [True, True]
        assert backend.stats.extra["map_grows"] >= 1
        for key in stored[2:]:
            assert await backend.delete([key]) == [True]
        assert backend.usage_bytes == 0
        assert await backend.put(keys[:2], value * 2) == [OK, OK]
        assert await read_back(backend, keys[:3], size) == [bytes(value[0])] * 2 + [MISSING]


# -- restart and recovery --------------------------------------------------------------------


@pytest.mark.asyncio
async def test_corrupt_entries_written_through_a_raw_env(tmp_path: Path) -> None:
    path = tmp_path / "db"
    keys = keys_for(6)
    values = payloads(6, seed=5)
    async with backend_at(path) as backend:
        assert await backend.put(keys, values) == [OK] * 6
    env = lmdb.open(str(path), max_dbs=2, map_size=64 << 20)
    blocks = env.open_db(b"blocks")
    with env.begin(db=blocks, write=True) as txn:
        stored = {k: bytes(txn.get(k) or b"") for k in keys}
        txn.put(keys[0], os.urandom(HEADER_BYTES + BLOCK))  # garbage, header included
        payload_flip = bytearray(stored[keys[1]])
        payload_flip[HEADER_BYTES + 100] ^= 0x01
        txn.put(keys[1], bytes(payload_flip))  # header intact, payload bit flipped
        txn.put(keys[2], stored[keys[3]])  # another key's block (misplaced)
        txn.put(keys[4], stored[keys[4]][:-1])  # truncated
    env.close()

    backend = backend_at(path)
    recovered = await backend.open()
    try:
        # Headers are checked at open: garbage, misplaced and truncated entries are dropped.
        assert sorted(recovered) == sorted([keys[1], keys[3], keys[5]])
        assert backend.stats.extra["recovery_dropped_blocks"] == 3
        assert await read_back(backend, keys) == [
            MISSING,
            CORRUPT,
            MISSING,
            bytes(values[3]),
            MISSING,
            bytes(values[5]),
        ]
        assert backend.stats.corrupt == 1
        assert await read_back(backend, keys[1:2]) == [MISSING]
        assert await backend.contains(keys) == [False, False, False, True, False, True]
    finally:
        await backend.close()


@pytest.mark.asyncio
async def test_recover_verify_drops_payload_corruption_at_open(tmp_path: Path) -> None:
    path = tmp_path / "db"
    keys = keys_for(3)
    async with backend_at(path) as backend:
        assert await backend.put(keys, payloads(3, seed=6)) == [OK] * 3
    assert flip_stored_payload_bytes(path, keys[0]) >= 1
    async with backend_at(path, recover="verify") as backend:
        assert await backend.contains(keys) == [False, True, True]
        assert backend.stats.extra["recovery_dropped_blocks"] == 1


@pytest.mark.asyncio
async def test_recover_wipe_starts_empty(tmp_path: Path) -> None:
    path = tmp_path / "db"
    keys = keys_for(3)
    async with backend_at(path) as backend:
        assert await backend.put(keys, payloads(3, seed=7)) == [OK] * 3
    backend = backend_at(path, recover="wipe")
    assert await backend.open() == []
    try:
        assert await backend.contains(keys) == [False] * 3
        assert backend.usage_bytes == 0
    finally:
        await backend.close()
    async with backend_at(path) as backend:  # and the wipe was committed
        assert await backend.contains(keys) == [False] * 3


CHANGED_LAYOUTS = [{"fingerprint": b"another-layout!!"}, {"size": 2 * BLOCK}]


def _files(path: Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path))}


@pytest.mark.asyncio
@pytest.mark.parametrize("changed", CHANGED_LAYOUTS, ids=["fp", "size"])
async def test_another_layout_is_refused_and_nothing_changes(
    tmp_path: Path, changed: dict[str, object]
) -> None:
    path = tmp_path / "db"
    keys = keys_for(4)
    async with backend_at(path) as backend:
        assert await backend.put(keys, payloads(4, seed=8)) == [OK] * 4
    before = {k: v for k, v in _files(path).items() if k != "lock.mdb"}
    other = backend_at(path, **changed)  # type: ignore[arg-type]
    with pytest.raises(LayoutMismatchError, match=r"holds blocks written for another layout") as e:
        await other.open()
    assert f"on disk: layout not described ({BLOCK} bytes per block, fingerprint {FP.hex()})" in (
        str(e.value)
    )
    assert "on_layout_mismatch: set_aside" in str(e.value)
    assert not other.is_open
    assert {k: v for k, v in _files(path).items() if k != "lock.mdb"} == before
    async with backend_at(path) as backend:  # all still there
        assert await backend.contains(keys) == [True] * 4


@pytest.mark.asyncio
@pytest.mark.parametrize("changed", CHANGED_LAYOUTS, ids=["fp", "size"])
async def test_another_layout_wiped_when_asked(tmp_path: Path, changed: dict[str, object]) -> None:
    path = tmp_path / "db"
    keys = keys_for(4)
    async with backend_at(path) as backend:
        assert await backend.put(keys, payloads(4, seed=8)) == [OK] * 4
    (path / "README").write_text("an operator's note")
    other = backend_at(path, on_layout_mismatch="wipe", **changed)  # type: ignore[arg-type]
    assert await other.open() == []
    try:
        size = int(changed.get("size", BLOCK))  # type: ignore[call-overload]
        assert await read_back(other, keys, size) == [MISSING] * 4
        assert other.stats.extra["recovery_dropped_blocks"] == 4
        assert other.stats.extra["layout_mismatches"] == 1
    finally:
        await other.close()
    assert (path / "README").read_text() == "an operator's note"
    async with backend_at(path, on_layout_mismatch="wipe") as backend:  # dropped for good
        assert await backend.contains(keys) == [False] * 4


@pytest.mark.asyncio
async def test_another_layout_set_aside_keeps_the_old_environment(tmp_path: Path) -> None:
    path = tmp_path / "db"
    keys = keys_for(4)
    values = payloads(4, seed=8)
    async with backend_at(path) as backend:
        assert await backend.put(keys, values) == [OK] * 4
    other = backend_at(path, fingerprint=b"another-layout!!", on_layout_mismatch="set_aside")
    async with other:
        assert await other.contains(keys) == [False] * 4
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("db.mismatch-")]
    assert {"data.mdb", "tiering-tier.json"} <= set(os.listdir(aside))
    async with backend_at(aside) as old:  # the old blocks, intact, under their own layout
        assert await read_back(old, keys) == [bytes(v) for v in values]


@pytest.mark.asyncio
async def test_reopen_with_a_smaller_capacity_keeps_capacity_blocks(tmp_path: Path) -> None:
    path = tmp_path / "db"
    keys = keys_for(10)
    values = payloads(10, seed=9)
    async with backend_at(path, blocks=10) as backend:
        assert await backend.put(keys, values) == [OK] * 10
    small = backend_at(path, blocks=4)
    recovered = await small.open()
    try:
        assert len(recovered) == 4 == small.capacity_blocks
        assert small.stats.extra["recovery_dropped_blocks"] == 6
        assert small.usage_bytes == 4 * small.geometry.footprint_bytes
        by_key = dict(zip(keys, values, strict=True))
        assert await read_back(small, recovered) == [bytes(by_key[k]) for k in recovered]
    finally:
        await small.close()


WRITER_SCRIPT = textwrap.dedent(
    """
    import asyncio, hashlib, random, sys
    from tiering.backends.lmdb import LMDBBackend
    from tiering.core.keys import make_offload_key

    path, capacity, block = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

    async def main():
        backend = LMDBBackend(path=path, capacity_bytes=capacity, block_bytes=block,
                              fingerprint=b"lmdb-test-fprint", sync=True)
        await backend.open()
        for i in range(10**6):
            key = make_offload_key(hashlib.sha256(f"k/{i}".encode()).digest(), 0)
            value = random.Random(i).randbytes(block)
            assert await backend.put([key], [memoryview(value)]) == [backend_ok]
            print(i, flush=True)

    from tiering.backends.base import Outcome
    backend_ok = Outcome.OK
    asyncio.run(main())
    """
)


@pytest.mark.asyncio
async def test_sigkill_after_acknowledged_puts_loses_nothing(tmp_path: Path) -> None:
    path = tmp_path / "db"
    capacity = 400 * 8 * PAGE
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER_SCRIPT, str(path), str(capacity), str(6 * PAGE)],
        stdout=subprocess.PIPE,
        cwd=REPO,
        text=True,
    )
    assert proc.stdout is not None
    acknowledged = -1
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= 40:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert acknowledged >= 40

    backend = LMDBBackend(path=path, capacity_bytes=capacity, block_bytes=6 * PAGE, fingerprint=FP)
    recovered = set(await backend.open())
    try:
        keys = keys_for(acknowledged + 3)
        assert set(keys[: acknowledged + 1]) <= recovered  # every acknowledged put survived
        assert recovered <= set(keys)
        got = await read_back(backend, sorted(recovered), 6 * PAGE)
        index = {k: i for i, k in enumerate(keys)}
        assert got == [random.Random(index[k]).randbytes(6 * PAGE) for k in sorted(recovered)]
        assert backend.stats.corrupt == 0
    finally:
        await backend.close()


READER_SCRIPT = textwrap.dedent(
    """
    import sys, time, lmdb
    env = lmdb.open(sys.argv[1], max_dbs=2, map_size=int(sys.argv[2]))
    db = env.open_db(b"blocks")
    txns = [env.begin(db=db) for _ in range(int(sys.argv[3]))]
    for txn in txns:
        txn.get(b"anything")
    print("reading", flush=True)
    time.sleep(60)
    """
)


def start_reader(path: Path, map_size_bytes: int, read_txns: int) -> subprocess.Popen[str]:
    """A process holding ``read_txns`` live read transactions on the environment at ``path``."""
    proc = subprocess.Popen(
        [sys.executable, "-c", READER_SCRIPT, str(path), str(map_size_bytes), str(read_txns)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "reading"
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()


@pytest.mark.asyncio
async def test_stale_reader_of_a_killed_process_is_cleared_at_open(tmp_path: Path) -> None:
    path = tmp_path / "db"
    backend = backend_at(path)
    async with backend:
        assert await backend.put(keys_for(1), payloads(1, seed=10)) == [OK]
    # LMDB resets the reader table when the first process opens the environment, so a stale
    # slot only survives while another process keeps it open: ``holder``.
    holder = start_reader(path, backend.map_size_bytes, 0)
    try:
        kill(start_reader(path, backend.map_size_bytes, 1))
        async with backend_at(path) as reopened:
            assert reopened.stats.extra["stale_readers_cleared"] == 1
            assert await reopened.contains(keys_for(1)) == [True]
    finally:
        kill(holder)


@pytest.mark.asyncio
async def test_a_full_reader_table_fails_reads_then_recovers_when_the_reader_dies(
    tmp_path: Path,
) -> None:
    keys = keys_for(1)
    values = payloads(1, seed=11)
    async with backend_at(tmp_path / "db", max_readers=2, read_threads=1) as backend:
        assert await backend.put(keys, values) == [OK]
        reader = start_reader(tmp_path / "db", backend.map_size_bytes, 2)  # takes both slots
        try:
            assert await backend.get(keys, buffers(1)) == [Outcome.FAILED]  # no hang
            assert backend.stats.read_failures == 1
        finally:
            kill(reader)
        assert await read_back(backend, keys) == [bytes(values[0])]
        assert backend.stats.extra["stale_readers_cleared"] == 2


# -- processes, threads and the event loop ---------------------------------------------------


@pytest.mark.asyncio
async def test_one_directory_serves_one_backend(tmp_path: Path) -> None:
    path = tmp_path / "db"
    first = backend_at(path)
    second = backend_at(path)
    async with first:
        with pytest.raises(BackendError, match="is in use"):
            await second.open()
        assert not second.is_open
        assert await first.put(keys_for(1), payloads(1, seed=11)) == [OK]
    async with second:
        assert await second.contains(keys_for(1)) == [True]


@pytest.mark.asyncio
async def test_a_forked_child_is_refused_and_the_parent_keeps_working(tmp_path: Path) -> None:
    keys = keys_for(2)
    values = payloads(2, seed=12)
    async with backend_at(tmp_path / "db") as backend:
        assert await backend.put(keys, values) == [OK, OK]
        pid = os.fork()
        if pid == 0:  # the child: every call must refuse, close must not touch the env
            code = 0
            try:
                asyncio.run(backend.contains(keys))
                code = 1
            except BackendError as exc:
                code = 0 if "fork" in str(exc) else 2
            code = code or (3 if backend.is_open else 0)
            asyncio.run(backend.close())
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert await read_back(backend, keys) == [bytes(v) for v in values]


@pytest.mark.asyncio
async def test_invalid_keys(tmp_path: Path) -> None:
    async with backend_at(tmp_path / "db") as backend:
        too_long = b"x" * (MAX_KEY_BYTES + 1)
        with pytest.raises(InvalidKeyError, match=f"{MAX_KEY_BYTES + 1} bytes"):
            await backend.put([too_long], payloads(1, seed=13))
        with pytest.raises(InvalidKeyError):
            await backend.get([too_long], buffers(1))
        with pytest.raises(ValueError, match="read-only"):
            await backend.get(keys_for(1), [memoryview(bytes(BLOCK))])


@pytest.mark.asyncio
async def test_no_reference_to_caller_buffers_survives_a_call(tmp_path: Path) -> None:
    """A bytearray with a live buffer export cannot be resized: resizing proves none is left."""
    value = bytearray(random.Random(16).randbytes(BLOCK))
    out = bytearray(BLOCK)
    async with backend_at(tmp_path / "db") as backend:
        assert await backend.put(keys_for(1), [value]) == [OK]  # type: ignore[list-item]
        value.append(0)
        assert await backend.get(keys_for(1), [out]) == [OK]  # type: ignore[list-item]
        out.append(0)
        assert out[:BLOCK] == value[:BLOCK]


@pytest.mark.asyncio
async def test_queued_puts_are_coalesced_into_one_transaction(tmp_path: Path) -> None:
    size = 256 << 10
    backend = backend_at(tmp_path / "db", blocks=80, size=size, max_txn_bytes=16 * 65 * PAGE)
    async with backend:
        big_keys, small_keys = keys_for(48, tag="big"), keys_for(8, tag="small")
        values = payloads(48, seed=14, size=size)
        big = asyncio.ensure_future(backend.put(big_keys, values))
        await asyncio.sleep(0)  # the writer now works on the big put (3 transactions)
        small = [backend.put([k], [v]) for k, v in zip(small_keys, values, strict=False)]
        results = await asyncio.gather(big, *small)
        assert results[0] == [OK] * 48 and results[1:] == [[OK]] * 8
        # 16 blocks per transaction: 3 for the big put, then 1 for the 8 queued meanwhile.
        assert backend.stats.extra["write_txns"] == 4
        assert await read_back(backend, small_keys, size) == [bytes(v) for v in values[:8]]


@pytest.mark.asyncio
async def test_the_loop_stays_free_during_a_multi_transaction_put(tmp_path: Path) -> None:
    """Eight write transactions on the writer thread: the loop runs other tasks meanwhile, in
    no long stretch (measured in the loop thread's CPU time, not a wall clock: see loop_use)."""
    size = 1 << 20
    backend = backend_at(tmp_path / "db", blocks=64, size=size, max_txn_bytes=8 << 20)
    keys = keys_for(64)
    values = payloads(64, seed=15, size=size)
    async with backend:
        outcomes, use = await measure_loop_use(lambda: backend.put(keys, values))
        assert outcomes == [OK] * 64
        assert backend.stats.extra["write_txns"] >= 8
        use.assert_loop_free("a put of 8 transactions")
