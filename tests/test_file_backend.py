"""FileBackend-specific behaviour: settings, on-disk layout, crash recovery, damaged files,
faults (through the FileOps seam and real ones), planted files and symlinks.

The shared contract is checked by tests/test_backend_conformance.py.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiering.backends._fileops import FaultyFileOps, FileOps
from tiering.backends.base import Outcome
from tiering.backends.file import (
    HEADER_AREA_BYTES,
    MANIFEST_NAME,
    SLOTS_NAME,
    FileBackend,
    slot_bytes_for,
)
from tiering.backends.ownership import MARKER_NAME, LayoutMismatchError, UntrustedEntryError
from tiering.core.block_format import HEADER_BYTES
from tiering.core.keys import make_offload_key
from tiering.errors import BackendError, ConfigurationError, InvalidKeyError

OK, MISSING, CORRUPT, FULL, FAILED = (
    Outcome.OK,
    Outcome.MISSING,
    Outcome.CORRUPT,
    Outcome.FULL,
    Outcome.FAILED,
)
FP = b"file-backend-fp!"
BLOCK = 8192
SLOT = slot_bytes_for(BLOCK)
STAMP_END = HEADER_BYTES + 16


def make_keys(n: int, tag: str = "k") -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}/{i}".encode()).digest(), 0) for i in range(n)]


def payload(i: int, version: int = 0, size: int = BLOCK) -> bytes:
    return hashlib.shake_256(f"{i}/{version}".encode()).digest(size)


def views(payloads: Sequence[bytes]) -> list[memoryview]:
    return [memoryview(bytearray(p)) for p in payloads]


# Waits for something a correct backend does at once: only a hang (a bug) reaches this bound,
# which no load does; no test measures time against it.
HANG_GUARD_S = 300


async def until(condition: Callable[[], bool]) -> None:
    """Poll until ``condition()`` holds (bound it with ``asyncio.wait_for``)."""
    while not condition():
        await asyncio.sleep(0.01)


def new_backend(path: Path, n_slots: int = 8, **options: Any) -> FileBackend:
    options.setdefault("block_bytes", BLOCK)
    options.setdefault("fingerprint", FP)
    capacity = n_slots * slot_bytes_for(options["block_bytes"])
    return FileBackend(path=path, capacity_bytes=capacity, **options)


async def read(backend: FileBackend, keys: Sequence[bytes]) -> tuple[list[Outcome], list[bytes]]:
    out = [memoryview(bytearray(backend.block_bytes)) for _ in keys]
    outcomes = await backend.get(keys, out)
    return outcomes, [bytes(o) if r == OK else b"" for o, r in zip(out, outcomes, strict=True)]


async def store(path: Path, n: int, n_slots: int = 8, **options: Any) -> list[bytes]:
    """Store payload(i) under make_keys(n)[i] (slots 0..n-1 of a fresh backend), then close."""
    keys = make_keys(n)
    async with new_backend(path, n_slots, **options) as backend:
        assert await backend.put(keys, views([payload(i) for i in range(n)])) == [OK] * n
    return keys


async def reopen_and_read(
    path: Path, keys: Sequence[bytes], **options: Any
) -> tuple[list[bytes], list[Outcome], list[bytes], FileBackend]:
    backend = new_backend(path, **options)
    recovered = await backend.open()
    try:
        outcomes, data = await read(backend, keys)
    finally:
        await backend.close()
    return recovered, outcomes, data, backend


def patch_file(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def read_file(path: Path, offset: int, size: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, size, offset)
    finally:
        os.close(fd)


# -- settings and layout -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("durability", "always", "durability must be one of 'none', 'fsync'; got 'always'"),
        ("recover", "maybe", "recover must be one of 'verify', 'trust_header', 'wipe'"),
        ("io_threads", 0, r"io_threads must be in \[1, 64\], got 0"),
        ("io_threads", 2.0, "io_threads must be an int, got 2.0"),
        ("batch_blocks", 0, r"batch_blocks must be in \[1, 1024\], got 0"),
        ("batch_blocks", True, "batch_blocks must be an int, got True"),
        ("o_direct", "yes", "o_direct must be a bool, got 'yes'"),
        ("capacity_bytes", SLOT - 1, f"capacity_bytes={SLOT - 1} holds no slot.*{SLOT} bytes"),
        ("capacity_bytes", "big", "capacity_bytes must be an int, got 'big'"),
        ("path", "", "path must be a non-empty directory path"),
        ("file_ops", object(), "file_ops must be a FileOps"),
        ("block_bytes", (1 << 30) + 1, "block_bytes must be at most"),
    ],
)
def test_bad_settings_raise_configuration_error(
    tmp_path: Path, option: str, value: object, message: str
) -> None:
    settings_ = {
        "path": tmp_path / "b",
        "capacity_bytes": 4 * SLOT,
        "block_bytes": BLOCK,
        "fingerprint": FP,
        option: value,
    }
    with pytest.raises(ConfigurationError, match=message):
        FileBackend(**settings_)  # type: ignore[arg-type]
    assert not (tmp_path / "b").exists()  # no I/O in __init__


def test_slot_geometry() -> None:
    assert slot_bytes_for(4096) == 8192
    assert slot_bytes_for(4097) == 4096 + 8192
    assert slot_bytes_for(256 * 1024) == 4096 + 256 * 1024
    backend = FileBackend(path="x", capacity_bytes=10 * SLOT - 1, block_bytes=BLOCK, fingerprint=FP)
    assert backend.capacity_blocks == 9
    assert backend.capacity_bytes == 10 * SLOT - 1


@pytest.mark.asyncio
async def test_directory_layout_and_manifest(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "tier"
    async with new_backend(path, n_slots=5) as backend:
        await backend.put(make_keys(2), views([payload(0), payload(1)]))
        assert sorted(os.listdir(path)) == [MANIFEST_NAME, SLOTS_NAME, MARKER_NAME]
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        slots = os.stat(path / SLOTS_NAME)
        assert stat.S_IMODE(slots.st_mode) == 0o600
        assert slots.st_size == 5 * SLOT
        assert slots.st_blocks * 512 >= 5 * SLOT  # preallocated, not sparse
        assert backend.usage_bytes == 2 * SLOT
    manifest = json.loads((path / MANIFEST_NAME).read_text())
    assert manifest == {
        "format": "tiering-file-backend",
        "format_version": 1,
        "header_area_bytes": HEADER_AREA_BYTES,
        "slot_bytes": SLOT,
        "block_bytes": BLOCK,
        "fingerprint": FP.hex(),
        "capacity_bytes": 5 * SLOT,
        "capacity_blocks": 5,
    }
    marker = json.loads((path / MARKER_NAME).read_text())
    assert marker == {
        "marker": "tiering-tier-directory",
        "marker_version": 1,
        "backend": "file",
        "storage_format": "tiering-file-backend/1",
        "block_bytes": BLOCK,
        "fingerprint": FP.hex(),
        "layout": None,
        "created_by": marker["created_by"],
    }
    assert marker["created_by"].startswith("tiering")


@pytest.mark.asyncio
async def test_key_and_buffer_checks(tmp_path: Path) -> None:
    async with new_backend(tmp_path) as backend:
        longest = b"k" * 80
        assert await backend.put([longest], views([payload(0)])) == [OK]
        with pytest.raises(InvalidKeyError, match="at most 80 bytes"):
            await backend.put([b"k" * 81], views([payload(0)]))
        with pytest.raises(ValueError, match="read-only"):
            await backend.get([longest], [memoryview(payload(0))])
        with pytest.raises(TypeError, match="not a buffer"):
            await backend.put([longest], [12345])  # type: ignore[list-item]
        strided = memoryview(bytearray(2 * BLOCK))[::2]
        with pytest.raises(ValueError, match="not C-contiguous"):
            await backend.get([longest], [strided])
        with pytest.raises(ValueError, match="single bytes"):
            await backend.put([longest], payload(0))  # type: ignore[arg-type]
        # any contiguous buffer of the right size works, whatever its item format
        as_words = memoryview(bytearray(payload(1))).cast("I")
        assert await backend.put([longest], [as_words]) == [OK]
        _, data = await read(backend, [longest])
        assert data == [payload(1)]
        assert backend.stats.puts == 2


@pytest.mark.asyncio
async def test_stats(tmp_path: Path) -> None:
    keys = make_keys(3)
    async with new_backend(tmp_path, n_slots=2) as backend:
        assert await backend.put(keys, views([payload(i) for i in range(3)])) == [OK, OK, FULL]
        await read(backend, keys)
        await backend.delete(keys[:1])
        s = backend.stats
        assert (s.puts, s.put_failures, s.extra["put_full"]) == (3, 0, 1)
        assert (s.gets, s.hits, s.misses, s.corrupt, s.deletes) == (3, 2, 1, 0, 1)
        assert (s.bytes_written, s.bytes_read) == (2 * BLOCK, 2 * BLOCK)


@pytest.mark.asyncio
async def test_two_backends_cannot_share_a_directory(tmp_path: Path) -> None:
    async with new_backend(tmp_path / "b"):
        second = new_backend(tmp_path / "b")
        with pytest.raises(BackendError, match="is in use"):
            await second.open()
        assert not second.is_open
    async with new_backend(tmp_path / "b"):  # free again once the first is closed
        pass


@pytest.mark.asyncio
async def test_open_twice_raises(tmp_path: Path) -> None:
    async with new_backend(tmp_path) as backend:
        with pytest.raises(BackendError, match="already open"):
            await backend.open()


@pytest.mark.asyncio
async def test_group_writable_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "shared"
    path.mkdir()
    path.chmod(0o770)
    with pytest.raises(BackendError, match="group- or world-writable"):
        await new_backend(path).open()
    assert not (path / SLOTS_NAME).exists()


@pytest.mark.asyncio
async def test_short_transfers_are_completed(tmp_path: Path) -> None:
    class ShortOps(FileOps):
        """Moves at most 3000 bytes per call, as a kernel may under signals or pressure."""

        def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
            data = b"".join(bytes(b) for b in buffers)[:3000]
            return os.pwrite(fd, data, offset)

        def preadv(self, fd: int, buffers: Any, offset: int) -> int:
            first = next(b for b in buffers if len(b))
            return os.preadv(fd, [first[:3000]], offset)

    keys = make_keys(3)
    async with new_backend(tmp_path, file_ops=ShortOps()) as backend:
        assert await backend.put(keys, views([payload(i) for i in range(3)])) == [OK] * 3
        assert await read(backend, keys) == ([OK] * 3, [payload(i) for i in range(3)])
    recovered, outcomes, data, _ = await reopen_and_read(tmp_path, keys, file_ops=ShortOps())
    assert sorted(recovered) == sorted(keys) and data == [payload(i) for i in range(3)]


# -- crash recovery ------------------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import asyncio, hashlib, random, sys
    from tiering.backends.file import FileBackend, slot_bytes_for

    path, block, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)

    def key(i):
        return hashlib.sha256(b"%d" % i).digest() + b"\\0\\0\\0\\0"

    def payload(i, version):
        return hashlib.shake_256(b"%d/%d" % (i, version)).digest(block)

    async def main():
        backend = FileBackend(path=path, capacity_bytes=48 * slot_bytes_for(block),
                              block_bytes=block, fingerprint=b"file-backend-fp!",
                              durability="fsync", io_threads=2, batch_blocks=2)
        await backend.open()
        version = seed * 1_000_000
        while True:
            ids = rng.sample(range(16), 4)
            if rng.random() < 0.2:
                print("start del", *ids, flush=True)
                await backend.delete([key(i) for i in ids])
                print("done del", *ids, flush=True)
                continue
            version += 1
            print("start put", version, *ids, flush=True)
            res = await backend.put([key(i) for i in ids],
                                    [memoryview(payload(i, version)) for i in ids])
            assert all(r.value == "ok" for r in res), res
            print("done put", version, *ids, flush=True)

    asyncio.run(main())
    """
)


def _child_key(i: int) -> bytes:
    return hashlib.sha256(b"%d" % i).digest() + b"\0\0\0\0"


def _run_child_until_killed(path: Path, seed: int, acks: int) -> list[list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(BLOCK), str(seed)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    log: list[list[str]] = []
    try:
        for line in proc.stdout:
            log.append(line.split())
            if sum(entry[0] == "done" for entry in log) >= acks:
                break
        os.kill(proc.pid, signal.SIGKILL)  # mid-flight: the next op has already started
        log += [line.split() for line in proc.stdout]  # whatever was printed before death
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert sum(entry[0] == "done" for entry in log) >= acks
    return log


def _allowed_states(log: list[list[str]], state: dict[int, set[int | None]]) -> None:
    """Fold the child's log into, per key, the set of states a recovery may show.

    A state is a payload version or None (absent). A completed op fixes the state; an op that
    started but never completed (the one the kill interrupted) may or may not have landed.
    """
    for entry in log:
        phase, op, args = entry[0], entry[1], [int(a) for a in entry[2:]]
        version, ids = (args[0], args[1:]) if op == "put" else (None, args)
        for i in ids:
            if phase == "done":
                state[i] = {version}
            else:
                state[i] = state.get(i, {None}) | {version}


@pytest.mark.slow
@pytest.mark.asyncio
async def test_sigkill_keeps_every_acknowledged_write(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    state: dict[int, set[int | None]] = {}
    for round_, acks in enumerate([7, 23, 12], start=1):
        log = _run_child_until_killed(path, seed=round_, acks=acks)
        _allowed_states(log, state)
        backend = new_backend(path, n_slots=48, durability="fsync")
        recovered = set(await backend.open())
        try:
            keys = [_child_key(i) for i in range(16)]
            outcomes, data = await read(backend, keys)
        finally:
            await backend.close()
        assert recovered == {k for k, r in zip(keys, outcomes, strict=True) if r == OK}
        assert MISSING in outcomes or len(recovered) == 16
        assert set(outcomes) <= {OK, MISSING}
        for i, (outcome, got) in enumerate(zip(outcomes, data, strict=True)):
            allowed = state.get(i, {None})
            if outcome == OK:
                assert any(v is not None and got == payload(i, v) for v in allowed), i
                state[i] = {next(v for v in allowed if v is not None and got == payload(i, v))}
            else:
                assert None in allowed, f"key {i}: acknowledged data lost"
                state[i] = {None}
        # Only the put the kill interrupted can be torn (a page at a time, at any point of its
        # pwritev): its slots may be rejected, and are counted; an acknowledged one never is.
        interrupted = log[-1] if log and log[-1][0] == "start" and log[-1][1] == "put" else []
        assert backend.stats.extra["recovery_rejected"] <= max(0, len(interrupted) - 3)


@pytest.mark.asyncio
async def test_duplicate_slots_keep_the_newest_that_verifies(tmp_path: Path) -> None:
    """A crash between writing a replacement and zeroing the old slot leaves two copies."""
    (key,) = make_keys(1)
    async with new_backend(tmp_path) as backend:
        await backend.put([key], views([payload(0, 1)]))  # slot 0
        old_slot = read_file(backend.slots_path, 0, SLOT)
        await backend.put([key], views([payload(0, 2)]))  # slot 1; slot 0 is zeroed
    assert read_file(tmp_path / SLOTS_NAME, 0, 4) == b"\0" * 4
    patch_file(tmp_path / SLOTS_NAME, 0, old_slot)  # as if the zeroing never reached the disk
    recovered, outcomes, data, backend = await reopen_and_read(tmp_path, [key])
    assert (recovered, outcomes, data) == ([key], [OK], [payload(0, 2)])
    assert backend.stats.extra["recovery_duplicates"] == 1
    assert read_file(tmp_path / SLOTS_NAME, 0, 4) == b"\0" * 4  # the loser was zeroed

    # Now the newer copy is torn (its put was never acknowledged): the older one is served.
    patch_file(tmp_path / SLOTS_NAME, 0, old_slot)
    patch_file(tmp_path / SLOTS_NAME, SLOT + HEADER_AREA_BYTES + 7, b"\xff\xff")
    recovered, outcomes, data, backend = await reopen_and_read(tmp_path, [key])
    assert (recovered, outcomes, data) == ([key], [OK], [payload(0, 1)])
    assert backend.stats.extra["recovery_rejected"] == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("recover", ["verify", "trust_header"])
@pytest.mark.parametrize(
    ("cut_at", "survivors"),
    [
        (0, 0),
        (2 * SLOT + 50, 2),  # inside slot 2's header
        (2 * SLOT + HEADER_BYTES + 5, 2),  # inside slot 2's stamp
        (SLOT + HEADER_AREA_BYTES + 100, 1),  # inside slot 1's payload
        (4 * SLOT - 1, 3),  # the last byte of slot 3
        (4 * SLOT, 4),  # a whole number of slots: nothing lost
    ],
)
async def test_truncated_slot_file(
    tmp_path: Path, recover: str, cut_at: int, survivors: int
) -> None:
    keys = await store(tmp_path, 4)
    os.truncate(tmp_path / SLOTS_NAME, cut_at)
    recovered, outcomes, data, _ = await reopen_and_read(tmp_path, keys, recover=recover)
    assert sorted(recovered) == sorted(keys[:survivors])
    assert outcomes == [OK] * survivors + [MISSING] * (4 - survivors)
    assert data[:survivors] == [payload(i) for i in range(survivors)]
    assert os.stat(tmp_path / SLOTS_NAME).st_size == 8 * SLOT  # restored to full size
    async with new_backend(tmp_path, recover=recover) as backend:  # and usable again
        assert await backend.put(keys[survivors:], views([payload(9)] * (4 - survivors))) == [
            OK
        ] * (4 - survivors)


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three stored blocks in slots 0..2, built once; each example works on a copy."""
    path = tmp_path_factory.mktemp("golden") / "tier"
    asyncio.run(store(path, 3))
    return path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    slot=st.integers(0, 2),
    region=st.sampled_from(["header", "stamp", "padding", "payload"]),
    position=st.integers(0, 1 << 20),
    bit=st.integers(0, 7),
    recover=st.sampled_from(["verify", "trust_header"]),
)
def test_bit_flips_are_misses_and_spare_the_others(
    golden: Path, slot: int, region: str, position: int, bit: int, recover: str
) -> None:
    start, stop = {
        "header": (0, HEADER_BYTES),
        "stamp": (HEADER_BYTES, STAMP_END),
        "padding": (STAMP_END, HEADER_AREA_BYTES),
        "payload": (HEADER_AREA_BYTES, HEADER_AREA_BYTES + BLOCK),
    }[region]
    offset = slot * SLOT + start + position % (stop - start)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tier"
        shutil.copytree(golden, path)
        byte = read_file(path / SLOTS_NAME, offset, 1)[0]
        patch_file(path / SLOTS_NAME, offset, bytes([byte ^ (1 << bit)]))
        keys = make_keys(3)
        recovered, outcomes, data, backend = asyncio.run(
            reopen_and_read(path, keys, recover=recover)
        )
    others = [i for i in range(3) if i != slot]
    assert [outcomes[i] for i in others] == [OK, OK]
    assert [data[i] for i in others] == [payload(i) for i in others]
    if region == "padding":  # unused bytes: the entry is intact
        assert (outcomes[slot], data[slot]) == (OK, payload(slot))
    elif region == "payload" and recover == "trust_header":
        assert keys[slot] in recovered  # the header is fine; get() catches the payload
        assert outcomes[slot] == CORRUPT and backend.stats.corrupt == 1
    else:
        assert keys[slot] not in recovered and outcomes[slot] == MISSING


@pytest.mark.asyncio
async def test_swapped_slots(tmp_path: Path) -> None:
    keys = await store(tmp_path, 2)
    slots_file = tmp_path / SLOTS_NAME
    first, second = read_file(slots_file, 0, SLOT), read_file(slots_file, SLOT, SLOT)

    # Swapped while the backend is open: each slot names another key than the index expects.
    async with new_backend(tmp_path) as backend:
        patch_file(slots_file, 0, second)
        patch_file(slots_file, SLOT, first)
        assert await read(backend, keys) == ([CORRUPT, CORRUPT], [b"", b""])
        assert await backend.contains(keys) == [False, False]

    # Swapped while closed: recovery indexes each slot by the key in its header.
    shutil.rmtree(tmp_path)
    keys = await store(tmp_path, 2)
    patch_file(slots_file, 0, second)
    patch_file(slots_file, SLOT, first)
    recovered, outcomes, data, _ = await reopen_and_read(tmp_path, keys)
    assert sorted(recovered) == sorted(keys)
    assert (outcomes, data) == ([OK, OK], [payload(0), payload(1)])

    # One key's block copied over another's: the overwritten key is gone, never misread.
    patch_file(slots_file, 0, second)
    patch_file(slots_file, SLOT, second)
    recovered, outcomes, data, _ = await reopen_and_read(tmp_path, keys)
    assert recovered == [keys[1]]  # both copies name keys[1]; one is kept
    assert (outcomes, data) == ([MISSING, OK], [b"", payload(1)])


@pytest.mark.asyncio
async def test_a_stale_copy_of_the_same_key_is_caught_by_the_stamp(tmp_path: Path) -> None:
    """A lost write (the device returns an older block of the same key) is not served."""
    (key,) = make_keys(1)
    async with new_backend(tmp_path) as backend:
        await backend.put([key], views([payload(0, 1)]))  # slot 0
        stale = read_file(backend.slots_path, 0, SLOT)
        await backend.put([key], views([payload(0, 2)]))  # slot 1
        patch_file(backend.slots_path, SLOT, stale)  # header, key and checksum all valid
        assert await read(backend, [key]) == ([CORRUPT], [b""])


@pytest.mark.asyncio
@pytest.mark.parametrize("change", ["manifest deleted", "manifest garbage"])
async def test_a_damaged_manifest_is_rebuilt_from_slots_that_verify(
    tmp_path: Path, change: str
) -> None:
    """The directory is ours (its marker names our layout): every slot verifies itself, so a
    lost or damaged manifest costs a full verification, not the data."""
    path = tmp_path / "tier"
    keys = await store(path, 3)
    if change == "manifest deleted":
        (path / MANIFEST_NAME).unlink()
    else:
        (path / MANIFEST_NAME).write_bytes(b"\x00{not json")
    patch_file(path / SLOTS_NAME, SLOT + HEADER_AREA_BYTES, b"\xff")  # keys[1]'s payload
    backend = new_backend(path, recover="trust_header")
    assert sorted(await backend.open()) == sorted([keys[0], keys[2]])  # verified in full
    assert backend.stats.extra["manifest_damaged"] == 1
    assert backend.stats.extra["recovery_rejected"] == 1
    assert await read(backend, keys) == ([OK, MISSING, OK], [payload(0), b"", payload(2)])
    await backend.close()
    assert json.loads((path / MANIFEST_NAME).read_text())["fingerprint"] == FP.hex()


@pytest.mark.asyncio
@pytest.mark.parametrize("change", ["fingerprint", "block_bytes"])
async def test_another_layout_is_refused_and_nothing_changes(tmp_path: Path, change: str) -> None:
    path = tmp_path / "tier"
    keys = await store(path, 3)
    before = {name: (path / name).read_bytes() for name in os.listdir(path)}
    options: dict[str, Any] = (
        {"fingerprint": b"another-layout!!"}
        if change == "fingerprint"
        else {"block_bytes": 2 * BLOCK}
    )
    backend = new_backend(path, **options)
    with pytest.raises(LayoutMismatchError) as caught:
        await backend.open()
    message = str(caught.value)
    assert f"{str(path)!r} holds blocks written for another layout" in message
    assert f"on disk: layout not described ({BLOCK} bytes per block, fingerprint {FP.hex()})" in (
        message
    )
    configured = options.get("fingerprint", FP).hex()
    assert f"configured: layout not described ({options.get('block_bytes', BLOCK)} bytes per " in (
        message
    )
    assert configured in message
    assert "on_layout_mismatch: set_aside" in message and "on_layout_mismatch: wipe" in message
    assert not backend.is_open
    assert {name: (path / name).read_bytes() for name in os.listdir(path)} == before
    recovered, outcomes, data, _ = await reopen_and_read(path, keys)  # still all there
    assert sorted(recovered) == sorted(keys) and outcomes == [OK] * 3


@pytest.mark.asyncio
async def test_another_layout_set_aside_moves_the_files_to_a_sibling(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    keys = await store(path, 3)
    (path / "notes.txt").write_text("an operator's file")
    backend = new_backend(path, fingerprint=b"another-layout!!", on_layout_mismatch="set_aside")
    assert await backend.open() == []
    assert backend.stats.extra["layout_mismatches"] == 1
    await backend.close()
    (aside,) = [p for p in tmp_path.iterdir() if p.name.startswith("tier.mismatch-")]
    assert sorted(os.listdir(aside)) == sorted([MANIFEST_NAME, SLOTS_NAME, MARKER_NAME])
    assert (path / "notes.txt").read_text() == "an operator's file"  # not ours: stays
    recovered, outcomes, data, _ = await reopen_and_read(aside, keys)  # the old blocks, intact
    assert sorted(recovered) == sorted(keys)
    assert data == [payload(i) for i in range(3)]
    recovered, outcomes, _, _ = await reopen_and_read(path, keys, fingerprint=b"another-layout!!")
    assert recovered == [] and outcomes == [MISSING] * 3


@pytest.mark.asyncio
async def test_another_layout_wipe_deletes_only_tierings_files(tmp_path: Path) -> None:
    path = tmp_path / "tier"
    keys = await store(path, 3)
    (path / "notes.txt").write_text("an operator's file")
    backend = new_backend(path, block_bytes=2 * BLOCK, on_layout_mismatch="wipe")
    assert await backend.open() == []
    await backend.close()
    assert (path / "notes.txt").read_text() == "an operator's file"
    assert json.loads((path / MARKER_NAME).read_text())["block_bytes"] == 2 * BLOCK
    recovered, outcomes, _, _ = await reopen_and_read(path, keys, block_bytes=2 * BLOCK)
    assert recovered == [] and outcomes == [MISSING] * 3


@pytest.mark.asyncio
async def test_capacity_change_keeps_what_fits(tmp_path: Path) -> None:
    keys = await store(tmp_path, 4, n_slots=8)
    recovered, outcomes, _, _ = await reopen_and_read(tmp_path, keys, n_slots=16)
    assert sorted(recovered) == sorted(keys) and outcomes == [OK] * 4
    assert os.stat(tmp_path / SLOTS_NAME).st_size == 16 * SLOT
    recovered, outcomes, data, _ = await reopen_and_read(tmp_path, keys, n_slots=2)
    assert sorted(recovered) == sorted(keys[:2]) and outcomes == [OK, OK, MISSING, MISSING]
    assert os.stat(tmp_path / SLOTS_NAME).st_size == 2 * SLOT


@pytest.mark.asyncio
async def test_recover_wipe_starts_empty(tmp_path: Path) -> None:
    keys = await store(tmp_path, 3)
    recovered, outcomes, _, backend = await reopen_and_read(tmp_path, keys, recover="wipe")
    assert recovered == [] and outcomes == [MISSING] * 3
    assert backend.stats.extra["layout_mismatches"] == 0


@pytest.mark.asyncio
async def test_deleted_and_failed_keys_stay_gone_after_restart(tmp_path: Path) -> None:
    keys = make_keys(4)
    ops = FaultyFileOps({"fdatasync": {2: errno.EIO}})
    options: dict[str, Any] = {"durability": "fsync", "batch_blocks": 2, "io_threads": 1}
    async with new_backend(tmp_path, file_ops=ops, **options) as backend:
        # keys 2 and 3 are written in full, but their put's fdatasync fails: they must not come
        # back (a put syncs once, after all its writes)
        assert await backend.put(keys[:2], views([payload(i) for i in range(2)])) == [OK, OK]
        outcomes = await backend.put(keys[2:], views([payload(i) for i in range(2, 4)]))
        assert outcomes == [FAILED, FAILED]
        assert await backend.delete(keys[:1]) == [True]
    recovered, outcomes, _, _ = await reopen_and_read(tmp_path, keys)
    assert recovered == [keys[1]]


@pytest.mark.asyncio
@pytest.mark.parametrize("recover", ["verify", "trust_header"])
async def test_a_block_of_another_layout_is_not_recovered(tmp_path: Path, recover: str) -> None:
    ours = await store(tmp_path / "ours", 1)
    await store(tmp_path / "theirs", 2, fingerprint=b"another-layout!!")
    # slot 1 of ours gets a perfectly valid block of another layout (same key, too)
    theirs_slot = read_file(tmp_path / "theirs" / SLOTS_NAME, 0, SLOT)
    patch_file(tmp_path / "ours" / SLOTS_NAME, SLOT, theirs_slot)
    recovered, outcomes, data, backend = await reopen_and_read(
        tmp_path / "ours", ours, recover=recover
    )
    assert (recovered, outcomes, data) == (ours, [OK], [payload(0)])
    assert backend.stats.extra["recovery_rejected"] == 1
    assert backend.stats.extra["recovery_duplicates"] == 0


class GatedOps(FileOps):
    """Holds the next call of one operation inside the I/O thread until ``open_gate()``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed: str | None = None
        self.entered = threading.Event()
        self.gate = threading.Event()

    def arm(self, operation: str) -> None:
        self.armed = operation
        self.entered.clear()
        self.gate.clear()

    async def wait_entered(self) -> None:
        assert await asyncio.to_thread(self.entered.wait, HANG_GUARD_S)

    def open_gate(self) -> None:
        self.gate.set()

    def _maybe_hold(self, operation: str) -> None:
        with self.lock:
            hold = self.armed == operation
            if hold:
                self.armed = None
        if hold:
            self.entered.set()
            assert self.gate.wait(HANG_GUARD_S)

    def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
        self._maybe_hold("pwritev")
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Any, offset: int) -> int:
        self._maybe_hold("preadv")
        return super().preadv(fd, buffers, offset)


def _key_in_slot(slots_file: Path, slot: int) -> bytes:
    from tiering.core.block_format import unpack_header

    return unpack_header(read_file(slots_file, slot * SLOT, HEADER_BYTES)).key


@pytest.mark.asyncio
async def test_a_slot_being_read_is_not_reused(tmp_path: Path) -> None:
    k1, k2, k3 = make_keys(3)
    ops = GatedOps()
    async with new_backend(tmp_path, file_ops=ops, io_threads=2) as backend:
        await backend.put([k1], views([payload(1)]))  # slot 0
        ops.arm("preadv")
        out = memoryview(bytearray(BLOCK))
        reading = asyncio.ensure_future(backend.get([k1], [out]))
        await ops.wait_entered()
        # While the read is held: delete k1 and store k2. Slot 0 must not be reused yet.
        assert await backend.delete([k1]) == [True]
        assert await backend.put([k2], views([payload(2)])) == [OK]
        assert _key_in_slot(backend.slots_path, 1) == k2
        ops.open_gate()
        assert await reading == [OK] and bytes(out) == payload(1)
        assert backend.stats.corrupt == 0
        # the read is over: slot 0 was zeroed and is the next one handed out
        assert await backend.put([k3], views([payload(3)])) == [OK]
        assert _key_in_slot(backend.slots_path, 0) == k3
        assert await read(backend, [k1, k2, k3]) == (
            [MISSING, OK, OK],
            [b"", payload(2), payload(3)],
        )


@pytest.mark.asyncio
async def test_corruption_found_after_a_concurrent_replace_keeps_the_new_value(
    tmp_path: Path,
) -> None:
    (key,) = make_keys(1)
    ops = GatedOps()
    async with new_backend(tmp_path, file_ops=ops, io_threads=2) as backend:
        await backend.put([key], views([payload(1)]))  # slot 0
        patch_file(backend.slots_path, HEADER_AREA_BYTES + 3, b"\x00\x01")
        ops.arm("preadv")
        reading = asyncio.ensure_future(backend.get([key], [memoryview(bytearray(BLOCK))]))
        await ops.wait_entered()
        assert await backend.put([key], views([payload(2)])) == [OK]  # slot 1
        ops.open_gate()
        assert await reading == [CORRUPT]  # what it read was damaged...
        assert await read(backend, [key]) == ([OK], [payload(2)])  # ...the new value is fine


class CountingGatedOps(GatedOps):
    def __init__(self) -> None:
        super().__init__()
        self.writes_done = 0

    def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
        done = super().pwritev(fd, buffers, offset)
        with self.lock:
            self.writes_done += 1
        return done


@pytest.mark.asyncio
async def test_a_held_write_does_not_hold_the_rest_of_its_put(tmp_path: Path) -> None:
    """A put's chunks go to every I/O thread from one queue: while one thread is stuck in a
    write, the other takes every remaining chunk."""
    keys = make_keys(5)
    ops = CountingGatedOps()
    async with new_backend(tmp_path, file_ops=ops, io_threads=2, batch_blocks=1) as backend:
        ops.arm("pwritev")
        putting = asyncio.ensure_future(backend.put(keys, views([payload(i) for i in range(5)])))
        await ops.wait_entered()
        await asyncio.wait_for(until(lambda: ops.writes_done == 4), HANG_GUARD_S)
        assert ops.writes_done == 4 and not putting.done()
        ops.open_gate()
        assert await putting == [OK] * 5
        assert await read(backend, keys) == ([OK] * 5, [payload(i) for i in range(5)])


@pytest.mark.asyncio
async def test_concurrent_puts_of_one_key_keep_the_later_started(tmp_path: Path) -> None:
    """Two puts of one key that finish out of order: memory and disk agree on the winner."""
    (key,) = make_keys(1)
    ops = GatedOps()
    async with new_backend(tmp_path, file_ops=ops, io_threads=2) as backend:
        ops.arm("pwritev")
        first = asyncio.ensure_future(backend.put([key], views([payload(1)])))
        await ops.wait_entered()
        assert await backend.put([key], views([payload(2)])) == [OK]
        ops.open_gate()
        assert await first == [OK]
        assert await read(backend, [key]) == ([OK], [payload(2)])
        assert backend.usage_bytes == SLOT
    recovered, outcomes, data, _ = await reopen_and_read(tmp_path, [key])
    assert (recovered, outcomes, data) == ([key], [OK], [payload(2)])


# -- faults --------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("failing_call", [3, 4, 5])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
async def test_write_error_fails_exactly_that_key(
    tmp_path: Path, failing_call: int, code: int
) -> None:
    ops = FaultyFileOps({"pwritev": {failing_call: code}})
    earlier, batch, later = make_keys(2, "earlier"), make_keys(3, "batch"), make_keys(2, "later")
    # batch_blocks=1: one pwritev per slot, so call N is exactly one key's write
    async with new_backend(tmp_path, file_ops=ops, io_threads=1, batch_blocks=1) as backend:
        assert await backend.put(earlier, views([payload(0), payload(1)])) == [OK, OK]
        outcomes = await backend.put(batch, views([payload(i + 10) for i in range(3)]))
        failed = failing_call - 3
        assert outcomes == [FAILED if i == failed else OK for i in range(3)]
        assert ops.fired == [("pwritev", failing_call, code)]
        assert await backend.contains(batch) == [i != failed for i in range(3)]
        got, data = await read(backend, earlier + batch)
        assert got == [OK, OK] + [MISSING if i == failed else OK for i in range(3)]
        assert data[:2] == [payload(0), payload(1)]
        assert await backend.put(later, views([payload(20), payload(21)])) == [OK, OK]
        assert await read(backend, later) == ([OK, OK], [payload(20), payload(21)])
        assert backend.stats.put_failures == 1
        assert backend.usage_bytes == 6 * SLOT


@pytest.mark.asyncio
async def test_fsync_error_fails_the_keys_it_covers_and_is_not_retried(tmp_path: Path) -> None:
    ops = FaultyFileOps({"fdatasync": {2: errno.EIO}})
    keys = make_keys(4)
    options: dict[str, Any] = {
        "file_ops": ops,
        "durability": "fsync",
        "io_threads": 1,
        "batch_blocks": 2,
    }
    async with new_backend(tmp_path, **options) as backend:
        # Two puts, each ending with one fdatasync; the second one fails.
        assert await backend.put(keys[:2], views([payload(0), payload(1)])) == [OK, OK]
        outcomes = await backend.put(keys[2:], views([payload(2), payload(3)]))
        assert outcomes == [FAILED, FAILED]
        assert ops.fired == [("fdatasync", 2, errno.EIO)]
        assert await backend.contains(keys) == [True, True, False, False]
        assert backend.stats.extra["fsync_failures"] == 1
        assert await backend.put(keys[2:], views([payload(2), payload(3)])) == [OK, OK]
        assert await read(backend, keys) == ([OK] * 4, [payload(i) for i in range(4)])


class OverlappingFsyncOps(FileOps):
    """Two fdatasyncs at once: the first waits until the second has failed, then succeeds."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.arrived = 0
        self.second_failed = threading.Event()

    def fdatasync(self, fd: int) -> None:
        with self.lock:
            self.arrived += 1
            mine = self.arrived
        if mine == 1:
            assert self.second_failed.wait(timeout=HANG_GUARD_S)
            os.fdatasync(fd)
        elif mine == 2:
            self.second_failed.set()
            raise OSError(errno.EIO, "injected EIO")
        else:
            os.fdatasync(fd)


class OrderRecordingOps(FileOps):
    """Records the order of pwritev and fdatasync calls (from every I/O thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[str] = []

    def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
        done = super().pwritev(fd, buffers, offset)
        with self.lock:
            self.calls.append("pwritev")
        return done

    def fdatasync(self, fd: int) -> None:
        with self.lock:
            self.calls.append("fdatasync")
        super().fdatasync(fd)


@pytest.mark.asyncio
async def test_a_durable_put_syncs_once_after_all_its_writes(tmp_path: Path) -> None:
    ops = OrderRecordingOps()
    durable: dict[str, Any] = {"durability": "fsync", "io_threads": 3, "batch_blocks": 1}
    async with new_backend(tmp_path, file_ops=ops, **durable) as backend:
        ops.calls.clear()
        assert await backend.put(make_keys(6), views([payload(i) for i in range(6)])) == [OK] * 6
        assert ops.calls == ["pwritev"] * 6 + ["fdatasync"]
        ops.calls.clear()
        # nothing written, nothing to sync
        assert await backend.put([], []) == []
        assert ops.calls == []


class WritebackRecordingOps(FileOps):
    """Records pwritev, start_writeback (with their byte ranges) and fdatasync, in order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[str, int, int]] = []

    def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
        done = super().pwritev(fd, buffers, offset)
        with self.lock:
            self.calls.append(("pwritev", offset, done))
        return done

    def start_writeback(self, fd: int, offset: int, length: int) -> None:
        with self.lock:
            self.calls.append(("start_writeback", offset, length))
        super().start_writeback(fd, offset, length)

    def fdatasync(self, fd: int) -> None:
        with self.lock:
            self.calls.append(("fdatasync", 0, 0))
        super().fdatasync(fd)


@pytest.mark.asyncio
async def test_a_durable_put_starts_the_writeback_of_each_run_it_wrote(tmp_path: Path) -> None:
    """Each run's writeback starts as soon as it is written (the device works while the next
    runs are copied); the put is still acknowledged only after its one fdatasync."""
    ops = WritebackRecordingOps()
    durable: dict[str, Any] = {"durability": "fsync", "io_threads": 2, "batch_blocks": 2}
    async with new_backend(tmp_path, file_ops=ops, **durable) as backend:
        ops.calls.clear()
        assert await backend.put(make_keys(6), views([payload(i) for i in range(6)])) == [OK] * 6
        writes = sorted((offset, done) for name, offset, done in ops.calls if name == "pwritev")
        hints = sorted((offset, n) for name, offset, n in ops.calls if name == "start_writeback")
        assert writes == hints == [(0, 2 * SLOT), (2 * SLOT, 2 * SLOT), (4 * SLOT, 2 * SLOT)]
        for name, offset, _ in ops.calls:  # each hint comes after its own write
            if name == "start_writeback":
                assert ops.calls.index(("pwritev", offset, 2 * SLOT)) < ops.calls.index(
                    (name, offset, 2 * SLOT)
                )
        assert ops.calls[-1] == ("fdatasync", 0, 0)
    ops = WritebackRecordingOps()
    async with new_backend(tmp_path / "fast", file_ops=ops) as backend:
        assert await backend.put(make_keys(6), views([payload(i) for i in range(6)])) == [OK] * 6
        assert [name for name, _, _ in ops.calls] == ["pwritev"]  # no extra I/O without fsync


class ReadOrderOps(FileOps):
    """Records where each preadv starts and how many ran at once; once armed, the first one
    waits a little for another to start beside it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.offsets: list[int] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.another_started = threading.Event()
        self.armed = False

    def preadv(self, fd: int, buffers: Any, offset: int) -> int:
        with self.lock:
            self.offsets.append(offset)
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            first = self.armed and len(self.offsets) == 1
            if self.in_flight > 1:
                self.another_started.set()
        try:
            if first:
                # With reads in order no other preadv starts meanwhile: this wait runs out
                # (a busy machine can only make it miss a bug, never fail a correct backend).
                self.another_started.wait(0.5)
            return super().preadv(fd, buffers, offset)
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.mark.asyncio
async def test_a_buffered_get_reads_its_chunks_in_file_order_on_every_lane(
    tmp_path: Path,
) -> None:
    """With two I/O threads, a buffered get's reads still reach the kernel one after the
    other, in slot order: one sequential stream, which the kernel's readahead follows."""
    ops = ReadOrderOps()
    keys = make_keys(8)
    options: dict[str, Any] = {"file_ops": ops, "io_threads": 2, "batch_blocks": 1}
    async with new_backend(tmp_path, **options) as backend:
        assert await backend.put(keys, views([payload(i) for i in range(8)])) == [OK] * 8
        ops.armed = True
        ops.most_in_flight = 0
        assert await read(backend, keys[::-1]) == ([OK] * 8, [payload(i) for i in range(8)][::-1])
    assert ops.offsets == [slot * SLOT for slot in range(8)]
    assert ops.most_in_flight == 1


@pytest.mark.asyncio
async def test_a_buffered_get_reads_neighbouring_slots_in_runs_of_at_most_1_mib(
    tmp_path: Path,
) -> None:
    """Each run is checksummed right after its preadv, so runs stay small enough to be in
    the CPU cache then: 1 MiB, or one slot when a slot is bigger. Every byte still arrives."""
    block_bytes = 256 * 1024
    slot_bytes = slot_bytes_for(block_bytes)
    run_slots = (1 << 20) // slot_bytes  # 3
    ops = ReadOrderOps()
    keys = make_keys(8)
    blocks = [bytes([i]) * block_bytes for i in range(8)]
    options: dict[str, Any] = {"file_ops": ops, "block_bytes": block_bytes, "batch_blocks": 8}
    async with new_backend(tmp_path, **options) as backend:
        assert await backend.put(keys, views(blocks)) == [OK] * 8
        assert await read(backend, keys) == ([OK] * 8, blocks)
    assert ops.offsets == [slot * slot_bytes for slot in range(0, 8, run_slots)]


BIG_BLOCK = 3 * (1 << 19)  # 1.5 MiB: a buffered get reads it in a 1 MiB part and a 0.5 MiB one


def big_payload(i: int) -> bytes:
    return (bytes([i]) * 7 + bytes(range(256))) * (BIG_BLOCK // 263) + bytes(BIG_BLOCK % 263)


@pytest.mark.asyncio
async def test_a_buffered_get_reads_a_slot_over_1_mib_in_parts_checksummed_as_they_arrive(
    tmp_path: Path,
) -> None:
    """Parts of 1 MiB, the header area with the first; every byte arrives, and a payload
    damaged in any part is CORRUPT (its checksum spans the parts)."""
    slot_bytes = slot_bytes_for(BIG_BLOCK)
    ops = ReadOrderOps()
    keys = make_keys(3)
    blocks = [big_payload(i) for i in range(3)]
    options: dict[str, Any] = {"file_ops": ops, "block_bytes": BIG_BLOCK}
    async with new_backend(tmp_path, n_slots=3, **options) as backend:
        assert await backend.put(keys, views(blocks)) == [OK] * 3
        ops.offsets.clear()
        assert await read(backend, keys) == ([OK] * 3, blocks)
        assert ops.offsets == [
            offset
            for slot in range(3)
            for offset in (slot * slot_bytes, slot * slot_bytes + HEADER_AREA_BYTES + (1 << 20))
        ]
        # one byte changed in the second part of slot 1, one in the first part of slot 2
        patch_file(backend.slots_path, slot_bytes + HEADER_AREA_BYTES + (1 << 20) + 5, b"\x00")
        patch_file(backend.slots_path, 2 * slot_bytes + HEADER_AREA_BYTES + 5, b"\xff")
        outcomes, data = await read(backend, keys)
        assert outcomes == [OK, CORRUPT, CORRUPT]
        assert data[0] == blocks[0]
        assert await backend.contains(keys) == [True, False, False]


@pytest.mark.asyncio
async def test_a_read_error_in_a_later_part_fails_only_that_slot(tmp_path: Path) -> None:
    keys = make_keys(2)
    blocks = [big_payload(i) for i in range(2)]
    ops = FaultyFileOps()
    options: dict[str, Any] = {"file_ops": ops, "block_bytes": BIG_BLOCK}
    async with new_backend(tmp_path, n_slots=2, **options) as backend:
        assert await backend.put(keys, views(blocks)) == [OK] * 2
        ops.fail_on["preadv"] = {ops.calls["preadv"] + 2: errno.EIO}  # slot 0's second part
        assert await read(backend, keys) == ([FAILED, OK], [b"", blocks[1]])
        assert await backend.contains(keys) == [False, True]  # dropped, as any read error


@pytest.mark.asyncio
async def test_a_slot_file_cut_inside_a_later_part_is_corrupt_not_short(tmp_path: Path) -> None:
    keys = make_keys(1)
    block = big_payload(0)
    async with new_backend(tmp_path, n_slots=1, block_bytes=BIG_BLOCK) as backend:
        assert await backend.put(keys, views([block])) == [OK]
        os.truncate(backend.slots_path, HEADER_AREA_BYTES + (1 << 20) + 100)
        assert await read(backend, keys) == ([CORRUPT], [b""])
        assert await backend.contains(keys) == [False]


@pytest.mark.asyncio
async def test_fsync_error_also_fails_a_put_whose_fsync_succeeded_meanwhile(
    tmp_path: Path,
) -> None:
    """One fd is shared: a failed fsync may have dropped pages that another put wrote, and
    that put's own fsync can then succeed. Its keys must fail too (never trust a retry)."""
    keys = make_keys(2)
    ops = OverlappingFsyncOps()
    options: dict[str, Any] = {
        "file_ops": ops,
        "durability": "fsync",
        "io_threads": 2,
        "batch_blocks": 1,
    }
    async with new_backend(tmp_path, **options) as backend:
        outcomes = await asyncio.gather(
            backend.put(keys[:1], views([payload(0)])), backend.put(keys[1:], views([payload(1)]))
        )
        assert outcomes == [[FAILED], [FAILED]]
        assert await backend.contains(keys) == [False, False]
        assert backend.stats.extra["fsync_failures"] == 1
        assert await backend.put(keys, views([payload(0), payload(1)])) == [OK, OK]


class BadRegionOps(FileOps):
    """A bad spot on the device: any read or write touching it fails with EIO."""

    def __init__(self) -> None:
        self.bad: tuple[int, int] | None = None  # [start, stop) in file bytes
        self.failures = 0

    def _check(self, buffers: Any, offset: int) -> None:
        stop = offset + sum(memoryview(b).nbytes for b in buffers)
        if self.bad is not None and offset < self.bad[1] and self.bad[0] < stop:
            self.failures += 1
            raise OSError(errno.EIO, "injected EIO: bad region")

    def pwritev(self, fd: int, buffers: Any, offset: int) -> int:
        self._check(buffers, offset)
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Any, offset: int) -> int:
        self._check(buffers, offset)
        return super().preadv(fd, buffers, offset)


@pytest.mark.asyncio
async def test_a_failed_multi_slot_write_fails_only_the_bad_slot(tmp_path: Path) -> None:
    ops = BadRegionOps()
    keys = make_keys(6)
    async with new_backend(tmp_path, file_ops=ops) as backend:
        ops.bad = (2 * SLOT + HEADER_AREA_BYTES + 10, 2 * SLOT + HEADER_AREA_BYTES + 11)
        outcomes = await backend.put(keys, views([payload(i) for i in range(6)]))
        assert outcomes == [OK, OK, FAILED, OK, OK, OK]  # slots 0..5 in one pwritev, then 1 by 1
        assert ops.failures == 2  # the whole run, then slot 2 alone
        ops.bad = None
        assert await read(backend, keys) == (
            [OK, OK, MISSING, OK, OK, OK],
            [payload(i) if i != 2 else b"" for i in range(6)],
        )


@pytest.mark.asyncio
async def test_read_error_is_failed_and_drops_only_that_key(tmp_path: Path) -> None:
    keys = await store(tmp_path, 3)
    ops = BadRegionOps()
    async with new_backend(tmp_path, file_ops=ops) as backend:
        ops.bad = (SLOT + HEADER_AREA_BYTES, SLOT + HEADER_AREA_BYTES + 1)  # in slot 1
        outcomes, data = await read(backend, keys)
        assert outcomes == [OK, FAILED, OK]
        assert data[0] == payload(0) and data[2] == payload(2)
        assert backend.stats.read_failures == 1
        assert await backend.contains(keys) == [True, False, True]
        assert ops.failures == 2  # the run of three slots, then slot 1 alone


@pytest.mark.asyncio
async def test_read_error_during_recovery_skips_only_that_slot(tmp_path: Path) -> None:
    keys = await store(tmp_path, 3)
    ops = FaultyFileOps({"preadv": {2: errno.EIO}})  # verify: slot 0 header (1), payload (2)
    recovered, outcomes, data, backend = await reopen_and_read(tmp_path, keys, file_ops=ops)
    assert sorted(recovered) == sorted(keys[1:])
    assert backend.stats.extra["recovery_read_errors"] == 1
    assert outcomes == [MISSING, OK, OK] and data[1:] == [payload(1), payload(2)]
    # An I/O error is not proof of damage: the slot was left alone, a clean open finds it.
    recovered, outcomes, data, _ = await reopen_and_read(tmp_path, keys)
    assert sorted(recovered) == sorted(keys) and data == [payload(i) for i in range(3)]


class DevFullOps(FileOps):
    """Opens /dev/full in place of the slot file: every write fails with a real ENOSPC."""

    def open(self, path: str, flags: int, mode: int) -> int:
        if path.endswith(SLOTS_NAME):
            return os.open("/dev/full", os.O_RDWR | os.O_CLOEXEC)
        return super().open(path, flags, mode)

    def ftruncate(self, fd: int, length: int) -> None:
        pass  # a character device has no size

    def fallocate(self, fd: int, offset: int, length: int) -> None:
        pass


@pytest.mark.asyncio
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
async def test_dev_full_gives_failed_and_the_backend_keeps_serving(tmp_path: Path) -> None:
    keys = make_keys(3)
    async with new_backend(tmp_path, file_ops=DevFullOps()) as backend:
        assert await backend.put(keys, views([payload(i) for i in range(3)])) == [FAILED] * 3
        assert await backend.contains(keys) == [False] * 3
        assert await read(backend, keys) == ([MISSING] * 3, [b""] * 3)
        assert backend.stats.put_failures == 3
        assert backend.usage_bytes == 0
        assert await backend.put(keys[:1], views([payload(0)])) == [FAILED]


EFBIG_CHILD = textwrap.dedent(
    """
    import asyncio, hashlib, json, resource, signal, sys
    from tiering.backends.file import FileBackend, slot_bytes_for

    path, block = sys.argv[1], int(sys.argv[2])
    slot = slot_bytes_for(block)
    keys = [hashlib.sha256(b"%d" % i).digest() + b"\\0\\0\\0\\0" for i in range(5)]
    data = [hashlib.shake_256(b"%d" % i).digest(block) for i in range(5)]

    async def main():
        backend = FileBackend(path=path, capacity_bytes=8 * slot, block_bytes=block,
                              fingerprint=b"file-backend-fp!", io_threads=1)
        await backend.open()
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (3 * slot, resource.RLIM_INFINITY))
        log = {}
        log["first"] = [(await backend.put([k], [memoryview(v)]))[0].value
                        for k, v in zip(keys, data)]
        log["contains"] = await backend.contains(keys)
        out = [memoryview(bytearray(block)) for _ in keys]
        log["get"] = [r.value for r in await backend.get(keys, out)]
        log["exact"] = [bytes(o) == v for o, v in zip(out, data)]
        log["delete"] = await backend.delete(keys[:1])
        log["again"] = [r.value for r in await backend.put(keys[3:4], [memoryview(data[3])])]
        await backend.close()
        print(json.dumps(log))

    asyncio.run(main())
    """
)


@pytest.mark.slow
def test_real_efbig_from_rlimit_fsize(tmp_path: Path) -> None:
    """RLIMIT_FSIZE makes the kernel fail writes past an offset with EFBIG (no privileges)."""
    result = subprocess.run(
        [sys.executable, "-c", EFBIG_CHILD, str(tmp_path / "tier"), str(BLOCK)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    log = json.loads(result.stdout.strip().splitlines()[-1])
    assert log["first"] == ["ok", "ok", "ok", "failed", "failed"]  # slots 3, 4 lie past it
    assert log["contains"] == [True, True, True, False, False]
    assert log["get"] == ["ok", "ok", "ok", "missing", "missing"]
    assert log["exact"][:3] == [True, True, True]
    assert log["delete"] == [True]
    assert log["again"] == ["ok"]  # slot 0 is free again and below the limit


# -- cancellation --------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_cancelled_puts_release_their_slots(tmp_path: Path) -> None:
    keys = make_keys(8)
    async with new_backend(tmp_path, n_slots=8) as backend:
        for yields in (1, 2, 3):
            task = asyncio.ensure_future(backend.put(keys, views([payload(9)] * 8)))
            for _ in range(yields):
                await asyncio.sleep(0)
            task.cancel()
            try:
                assert await task == [OK] * 8  # it finished before the cancel landed
                assert await backend.delete(keys) == [True] * 8
            except asyncio.CancelledError:
                pass
            assert await backend.contains(keys) == [False] * 8
            assert backend.usage_bytes == 0
    recovered, _, _, backend = await reopen_and_read(tmp_path, keys)
    assert recovered == []
    async with new_backend(tmp_path, n_slots=8) as backend:  # every slot is free again
        assert await backend.put(keys, views([payload(i) for i in range(8)])) == [OK] * 8


# -- planted files -------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_planted_symlinks_are_refused_and_neither_followed_nor_removed(
    tmp_path: Path,
) -> None:
    """A symlink where tiering keeps a file is not tiering's: the tier refuses to open, naming
    each; a symlink with any other name is the operator's and is left alone too. Once the
    operator moves the links away, stale temp files (regular files of ours) are removed."""
    path = tmp_path / "tier"
    async with new_backend(path):
        pass  # the directory is ours (marked); then someone plants links in it
    (path / SLOTS_NAME).unlink()
    (path / MANIFEST_NAME).unlink()
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious" * 1000)
    (path / SLOTS_NAME).symlink_to(victim)
    (path / f"{MANIFEST_NAME}.0123.tmp").symlink_to(victim)  # looks like our stale temp file
    (path / f"{MANIFEST_NAME}.4567.tmp").write_text("stale")
    (path / "foreign.bin").symlink_to("/etc/passwd")
    before = sorted(os.listdir(path))
    with pytest.raises(UntrustedEntryError) as caught:
        await new_backend(path).open()
    assert caught.value.entries == (f"{MANIFEST_NAME}.0123.tmp", SLOTS_NAME)
    assert sorted(os.listdir(path)) == before
    assert (path / SLOTS_NAME).is_symlink() and victim.read_bytes() == b"precious" * 1000
    (path / SLOTS_NAME).rename(tmp_path / "link-a")
    (path / f"{MANIFEST_NAME}.0123.tmp").rename(tmp_path / "link-b")
    keys = make_keys(2)
    async with new_backend(path) as backend:
        assert backend.stats.extra["stale_temp_removed"] == 1
        assert await backend.put(keys, views([payload(0), payload(1)])) == [OK, OK]
        assert await read(backend, keys) == ([OK, OK], [payload(0), payload(1)])
    assert victim.read_bytes() == b"precious" * 1000
    assert sorted(os.listdir(path)) == sorted(
        [MANIFEST_NAME, SLOTS_NAME, MARKER_NAME, "foreign.bin"]
    )
    assert (path / "foreign.bin").is_symlink()


# -- O_DIRECT ------------------------------------------------------------------------------------


def _o_direct_supported(path: Path) -> bool:
    try:
        fd = os.open(path / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    (path / "probe").unlink()
    return True


@pytest.mark.asyncio
async def test_o_direct_bounces_only_unaligned_buffers(tmp_path: Path) -> None:
    if not _o_direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    import mmap

    keys = make_keys(4)
    region = memoryview(mmap.mmap(-1, 5 * BLOCK))
    aligned = [region[i * BLOCK : (i + 1) * BLOCK] for i in range(4)]
    unaligned = [region[i * BLOCK + 8 : (i + 1) * BLOCK + 8] for i in range(4)]
    for i, view in enumerate(aligned):
        view[:] = payload(i)
    async with new_backend(tmp_path, o_direct=True) as backend:
        assert await backend.put(keys, aligned) == [OK] * 4
        assert backend.stats.extra["o_direct_bounces"] == 0
        assert await backend.get(keys, unaligned) == [OK] * 4
        assert [bytes(v) for v in unaligned] == [payload(i) for i in range(4)]
        assert backend.stats.extra["o_direct_bounces"] == 4
    recovered, outcomes, data, _ = await reopen_and_read(tmp_path, keys, o_direct=True)
    assert data == [payload(i) for i in range(4)]


@pytest.mark.asyncio
async def test_o_direct_bounces_a_run_of_unaligned_slots_with_one_call(tmp_path: Path) -> None:
    """Neighbouring slots with unaligned buffers share one pwritev/preadv through the bounce
    area (one call per slot kept the device at ~0.6x of raw O_DIRECT reads)."""
    if not _o_direct_supported(tmp_path):
        pytest.skip("no O_DIRECT on this file system")
    ops = FaultyFileOps()  # counts calls, fails none
    keys = make_keys(6)
    region = bytearray(6 * BLOCK + 8)
    unaligned = [memoryview(region)[i * BLOCK + 8 : (i + 1) * BLOCK + 8] for i in range(6)]
    for i, view in enumerate(unaligned):
        view[:] = payload(i)
    options: dict[str, Any] = {"o_direct": True, "file_ops": ops, "io_threads": 1}
    async with new_backend(tmp_path, **options) as backend:
        writes = ops.calls["pwritev"]
        assert await backend.put(keys, unaligned) == [OK] * 6
        assert ops.calls["pwritev"] - writes == 1
        out = [memoryview(bytearray(BLOCK + 8))[8:] for _ in range(6)]
        reads = ops.calls["preadv"]
        assert await backend.get(keys, out) == [OK] * 6
        assert ops.calls["preadv"] - reads == 1
        assert [bytes(v) for v in out] == [payload(i) for i in range(6)]
        assert backend.stats.extra["o_direct_bounces"] == 12
        # a slot that does not verify spoils only itself, bounced or not
        patch_file(backend.slots_path, 3 * SLOT + HEADER_AREA_BYTES + 5, b"\xff")
        outcomes = await backend.get(keys, out)
        assert outcomes == [OK, OK, OK, CORRUPT, OK, OK]
    _, outcomes, data, _ = await reopen_and_read(tmp_path, keys, o_direct=True)
    assert outcomes == [OK, OK, OK, MISSING, OK, OK]


def test_random_payloads_survive_many_replaces(tmp_path: Path) -> None:
    """A seeded random mix of puts, replaces and deletes matches a dict model, across reopens."""
    rng = random.Random(5)
    keys = make_keys(12)
    model: dict[bytes, bytes] = {}

    async def session(n_ops: int) -> None:
        async with new_backend(tmp_path, n_slots=16, batch_blocks=3) as backend:
            assert sorted(await backend.contains(list(model))) == [True] * len(model)
            for step in range(n_ops):
                chosen = rng.sample(keys, rng.randint(1, 4))
                if rng.random() < 0.25:
                    await backend.delete(chosen)
                    for key in chosen:
                        model.pop(key, None)
                    continue
                values = [rng.randbytes(BLOCK) for _ in chosen]
                outcomes = await backend.put(chosen, views(values))
                for key, value, outcome in zip(chosen, values, outcomes, strict=True):
                    assert outcome in (OK, FULL)
                    if outcome == OK:
                        model[key] = value
                if step % 5 == 0:
                    got, data = await read(backend, list(model))
                    assert got == [OK] * len(model) and data == list(model.values())
            assert backend.usage_bytes == len(model) * SLOT

    for _ in range(3):
        asyncio.run(session(40))
