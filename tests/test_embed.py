"""tiering.embed.TierStore: the embedders' facade over real tiers (file, LMDB, memory).

Checked here, beyond the backend conformance (tiering.testing.embed_tests): the tier's policy
and index stay right (exact evictions, recency from gets), damaged blocks are misses and
forgotten, bad input changes nothing, many threads and foreign event loops at once, and a call
that gives up (its timeout) never touches the caller's memory afterwards.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from tiering.backends.base import Outcome
from tiering.backends.file import FileBackend
from tiering.backends.memory import MemoryBackend
from tiering.config import parse_config
from tiering.core.block_format import (
    FRAME_BYTES,
    HEADER_BYTES,
    make_layout_fingerprint,
    read_frame,
    write_frame,
)
from tiering.embed import EmbedError, TierStore, framed_layout
from tiering.errors import CorruptBlockError, InvalidKeyError
from tiering.managers.secondary_tier import SecondaryTier

MAX_BLOCK = 4000
DESCRIPTION, SLOT = framed_layout({"model": "test"}, MAX_BLOCK)
FP = make_layout_fingerprint(DESCRIPTION)


def keys_for(n: int, tag: str = "k") -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest() for i in range(n)]


def payload(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, n, dtype=np.uint8).tobytes()


def memory_tier(blocks: int, policy: str = "lru") -> SecondaryTier:
    backend = MemoryBackend(
        capacity_bytes=blocks * (SLOT + HEADER_BYTES), block_bytes=SLOT, fingerprint=FP
    )
    return SecondaryTier(backend, name="mem", policy=policy)


def file_tier(path: Path, blocks: int = 32) -> SecondaryTier:
    backend = FileBackend(
        path=path, capacity_bytes=blocks * (SLOT + 8192), block_bytes=SLOT, fingerprint=FP
    )
    return SecondaryTier(backend, name="file")


@pytest.fixture
def mem_store() -> Iterator[TierStore]:
    store = TierStore([memory_tier(4)])
    store.open()
    yield store
    store.close()


def test_frames_verify_their_length() -> None:
    slot = memoryview(bytearray(b"\xff" * 64))
    write_frame(slot, 10)
    assert read_frame(slot) == 10
    assert bytes(slot[10:48]) == bytes(38), "the gap is zeroed"
    with pytest.raises(ValueError, match="does not fit"):
        write_frame(slot, 49)
    bad = bytearray(slot)
    bad[-1] = 1  # a length over the slot
    with pytest.raises(CorruptBlockError, match="over the slot"):
        read_frame(bad)
    bad = bytearray(slot)
    bad[-16] ^= 1
    with pytest.raises(CorruptBlockError, match="magic"):
        read_frame(bad)
    bad = bytearray(slot)
    bad[-12] = 2
    with pytest.raises(CorruptBlockError, match="version"):
        read_frame(bad)


def test_the_tier_policy_evicts_exactly_and_gets_count_as_use(mem_store: TierStore) -> None:
    keys = keys_for(6)
    assert mem_store.put(keys[:4], [payload(i, 100) for i in range(4)]) == [True] * 4
    out = bytearray(MAX_BLOCK)
    assert mem_store.get([keys[0]], [out]) == [100]  # keys[0] is now the most recent
    assert mem_store.put(keys[4:6], [payload(i, 100) for i in (4, 5)]) == [True, True]
    assert mem_store.contains(keys) == [True, False, False, True, True, True]
    [tier] = mem_store.tiers
    assert tier.metrics.evictions == 2
    assert sorted(mem_store.keys()) == sorted([keys[0], *keys[3:]])


def test_a_put_of_a_stored_key_is_ok_and_not_rewritten(mem_store: TierStore) -> None:
    [key] = keys_for(1)
    assert mem_store.put([key], [b"first"]) == [True]
    assert mem_store.put([key], [b"second"]) == [True]
    out = bytearray(10)
    assert mem_store.get([key], [out]) == [5] and out[:5] == b"first"
    assert mem_store.tiers[0].metrics.stored_blocks == 1


def test_bad_input_is_refused_by_name_and_stores_nothing(mem_store: TierStore) -> None:
    keys = keys_for(2)
    with pytest.raises(InvalidKeyError, match="key 1"):
        mem_store.put([keys[0], b""], [b"a", b"b"])
    with pytest.raises(EmbedError, match="2 keys but 1 blocks"):
        mem_store.put(keys, [b"a"])
    with pytest.raises(EmbedError, match="block 1 run 0: length must be"):
        mem_store.put(keys, [b"a", [(b"b", -1)]])
    with pytest.raises(EmbedError, match="not a buffer"):
        mem_store.put(keys, [b"a", 3.5])
    with pytest.raises(EmbedError, match="read-only"):
        mem_store.get(keys[:1], [b"immutable"])
    with pytest.raises(EmbedError, match="over the buffer"):
        mem_store.put(keys[:1], [[(b"abc", 4)]])
    assert mem_store.exists(keys) == 0
    assert mem_store.stats.puts == 0


def test_tensors_and_addresses_as_runs(mem_store: TierStore) -> None:
    [key] = keys_for(1)
    k, v = torch.randn(4, 8, dtype=torch.bfloat16), torch.randn(4, 8, dtype=torch.bfloat16)
    assert mem_store.put([key], [[(k, k.numel() * 2), (v.data_ptr(), v.numel() * 2)]]) == [True]
    k2, v2 = torch.zeros_like(k), torch.zeros_like(v)
    assert mem_store.get([key], [[(k2.data_ptr(), 64), (v2, 64)]], exact=True) == [128]
    assert torch.equal(k.view(torch.int16), k2.view(torch.int16))
    assert torch.equal(v.view(torch.int16), v2.view(torch.int16))
    with pytest.raises(EmbedError, match="contiguous"):
        mem_store.get([key], [k2.t()])


def test_a_damaged_block_is_a_miss_and_forgotten(tmp_path: Path) -> None:
    keys = keys_for(2)
    store = TierStore([file_tier(tmp_path / "f")])
    store.open()
    assert store.put(keys, [payload(0, 300), payload(1, 300)]) == [True, True]
    store.close()
    slots = tmp_path / "f" / "slots.bin"
    data = bytearray(slots.read_bytes())
    at = data.find(payload(0, 300)[:64])
    assert at > 0
    data[at + 5] ^= 0x40
    slots.write_bytes(bytes(data))
    store = TierStore([file_tier(tmp_path / "f")])
    store.open()
    out = [bytearray(b"\x11" * MAX_BLOCK) for _ in keys]
    got = store.get(keys, out)
    assert got[1] == 300 and bytes(out[1][:300]) == payload(1, 300)
    if got[0] is not None:  # a verifying reopen may have dropped it already: never a hit
        raise AssertionError("a damaged block was served")
    assert store.exists(keys[:1]) == 0
    store.close()


def test_a_stack_reads_the_first_tier_holding_a_key(tmp_path: Path) -> None:
    fast, slow = memory_tier(2), file_tier(tmp_path / "f")
    store = TierStore([fast, slow])
    store.open()
    keys = keys_for(4)
    assert store.put(keys, [payload(i, 50) for i in range(4)]) == [True] * 4
    assert len(fast) == 2 and len(slow) == 4  # the small tier kept what it had room for
    outs = [bytearray(MAX_BLOCK) for _ in keys]
    assert store.get(keys, outs) == [50] * 4
    assert [bytes(o[:50]) for o in outs] == [payload(i, 50) for i in range(4)]
    assert fast.metrics.promoted_blocks + slow.metrics.promoted_blocks == 4
    store.close()


def test_many_threads_and_foreign_event_loops_at_once(tmp_path: Path) -> None:
    store = TierStore([file_tier(tmp_path / "f", blocks=64)])
    store.open()
    errors: list[str] = []

    def worker(t: int) -> None:
        try:
            work(t)
        except Exception as exc:  # a thread's exception would vanish: record it
            errors.append(f"thread {t}: {exc!r}")

    def work(t: int) -> None:
        keys = keys_for(8, tag=f"t{t}")
        shared = keys_for(2, tag="shared")
        datas = [payload(t * 100 + i, 10 + 37 * i) for i in range(8)]
        for _ in range(3):
            if store.put(keys, datas) != [True] * 8:
                errors.append(f"thread {t}: put failed")
            store.put(shared, [payload(10**6, 64), payload(10**6 + 1, 64)])
            outs = [bytearray(MAX_BLOCK) for _ in keys]
            lengths = store.get(keys, outs)
            for i, (n, o) in enumerate(zip(lengths, outs, strict=True)):
                if n != len(datas[i]) or bytes(o[:n]) != datas[i]:
                    errors.append(f"thread {t}: key {i} read {n} wrong bytes")
            got = [bytearray(64), bytearray(64)]
            for n, o, want in zip(
                store.get(shared, got),
                got,
                (payload(10**6, 64), payload(10**6 + 1, 64)),
                strict=True,
            ):
                if n is not None and bytes(o) != want:
                    errors.append(f"thread {t}: shared key read wrong bytes")

    async def async_worker(t: int) -> None:
        try:
            await async_work(t)
        except Exception as exc:
            errors.append(f"async worker {t}: {exc!r}")

    async def async_work(t: int) -> None:
        keys = keys_for(4, tag=f"a{t}")
        datas = [payload(t * 1000 + i, 99) for i in range(4)]
        assert await store.aput(keys, datas) == [True] * 4
        assert await store.aexists(keys) == 4
        outs = [bytearray(99) for _ in keys]
        assert await store.aget(keys, outs, exact=True) == [99] * 4
        if [bytes(o) for o in outs] != datas:
            errors.append(f"async worker {t}: wrong bytes")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    threads += [threading.Thread(target=asyncio.run, args=(async_worker(t),)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors[:5]
    assert store.stats.timeouts == 0
    store.close()


class _Gated(MemoryBackend):
    """Reads and writes wait for the test to open the gate."""

    def __init__(self, gate: threading.Event, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.gate = gate

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        await asyncio.get_running_loop().run_in_executor(None, self.gate.wait)
        return await super().put(keys, values)

    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        await asyncio.get_running_loop().run_in_executor(None, self.gate.wait)
        return await super().get(keys, buffers)


def test_a_call_that_gave_up_never_touches_the_callers_memory() -> None:
    gate = threading.Event()
    backend = _Gated(gate, capacity_bytes=8 * SLOT, block_bytes=SLOT, fingerprint=FP)
    store = TierStore([SecondaryTier(backend, name="gated")], timeout_s=0.2)
    store.open()
    [key] = keys_for(1)
    assert store.put([key], [b"payload"]) == [False]  # the write is held: the call gives up
    assert store.stats.timeouts == 1
    gate.set()  # the write lands in the background and settles the index
    for _ in range(200):
        if store.exists([key]) == 1:
            break
        threading.Event().wait(0.01)
    assert store.exists([key]) == 1
    gate.clear()
    out = bytearray(b"\x77" * 16)
    assert store.get([key], [out]) == [None]  # the read is held: a miss
    gate.set()
    store.close()  # waits for the read to finish
    assert out == b"\x77" * 16, "a get that gave up wrote the caller's memory later"


def test_built_from_tier_configs_with_framed_fingerprint(tmp_path: Path) -> None:
    config = parse_config(
        {
            "version": 1,
            "primary": {"capacity": "1MiB"},
            "secondary_tiers": [
                {"name": "disk", "type": "lmdb", "path": str(tmp_path / "l"), "capacity": "4MiB"}
            ],
        }
    )
    store = TierStore.from_tier_configs(
        config.secondary_tiers, max_block_bytes=1000, layout={"m": 1}
    )
    assert store.max_block_bytes == 1000 and store.slot_bytes == 1000 + FRAME_BYTES
    store.open()
    [key] = keys_for(1)
    assert store.put([key], [b"x" * 1000]) == [True]
    store.close()
    # Another layout over the same directory is refused cleanly: the tier degrades, no hits.
    other = TierStore.from_tier_configs(
        config.secondary_tiers, max_block_bytes=1000, layout={"m": 2}
    )
    other.open()
    assert other.tiers[0].status == "degraded"
    assert other.exists([key]) == 0 and other.put([key], [b"y"]) == [False]
    other.close()
    with pytest.raises(EmbedError, match="max_block_bytes must be > 0"):
        TierStore.from_tier_configs(config.secondary_tiers, max_block_bytes=0, layout={})
