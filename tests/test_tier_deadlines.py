"""Liveness: every tier job has a deadline (``io_timeout_s``). A job past it fails, its keys are
misses, the engine's calls never wait, the tier is reported stalled (metrics, events, locate, one
warning) and recovers when the I/O returns; a late result never applies, and nothing it writes
late lands in memory or under a key that was reused.

Tested against a backend whose calls block on a ``threading.Event`` (in a thread, or on the I/O
loop itself), a file tier whose I/O thread is held (the file backend's ``FileOps`` seam) and a
``SIGSTOP``ped redis-server. No test measures time: each configures a short deadline and waits
for the outcome (``wait_idle`` returns once a job has finished or timed out; a late job's
``io_future`` completes when its I/O returns).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from tiering.backends._fileops import FileOps
from tiering.backends.base import BackendCapabilities, Outcome
from tiering.backends.file import FileBackend, slot_bytes_for
from tiering.backends.memory import MemoryBackend
from tiering.config import load_config
from tiering.core.block_format import make_layout_fingerprint
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigError, ConfigurationError, TieringError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.deadline import DeadlineWatch
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.shared_tier import SharedTier
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.observability.metrics import read_samples

pytest_plugins = ["redis_fixtures"]

ROW_BYTES = 4096
FINGERPRINT = make_layout_fingerprint({"deadlines": ROW_BYTES})
DEADLINE_S = 0.2  # while the I/O is held: short, so the tests are quick
WAIT_S = 120.0  # the deadline otherwise, and how long a test waits for an outcome
# A job that should finish in time gets WAIT_S (a busy machine never stalls it); only jobs
# submitted while the test holds the I/O get DEADLINE_S. Nothing measures how long anything took.


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def row(i: int) -> torch.Tensor:
    """Block ``i``'s bytes: distinct per block and per byte."""
    return (torch.arange(ROW_BYTES, dtype=torch.int64) * 7 + i * 131).remainder(256).to(torch.uint8)


class BlockingBackend(MemoryBackend):
    """A memory backend whose ``ops`` wait for ``gate`` while it is clear: in a thread, as a
    hung syscall would, or (``block_loop``) on the I/O loop's own thread."""

    def __init__(self, capacity_blocks: int, *, block_loop: bool = False) -> None:
        super().__init__(
            capacity_bytes=capacity_blocks * (ROW_BYTES + 256),
            block_bytes=ROW_BYTES,
            fingerprint=FINGERPRINT,
        )
        self.gate = threading.Event()
        self.gate.set()
        self.ops: set[str] = set()
        self.block_loop = block_loop

    async def _hold(self, op: str) -> None:
        if op in self.ops and not self.gate.is_set():
            if self.block_loop:
                self.gate.wait()  # a misbehaving plugin: the whole I/O loop stops
            else:
                await asyncio.get_running_loop().run_in_executor(None, self.gate.wait)

    async def open(self) -> list[bytes]:
        await self._hold("open")
        return await super().open()

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        await self._hold("put")
        return await super().put(keys, values)

    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        await self._hold("get")
        return await super().get(keys, buffers)

    def holds(self, key: bytes) -> bool:
        return key in self._blocks


class Rig:
    """A manager over a small primary and one tier, with helpers that store and load blocks."""

    def __init__(self, tier: SecondaryTier, primary_blocks: int, step_driven: bool = False):
        tier.io_timeout_s = WAIT_S  # read at each job's submission; hold() shortens it
        self.tier = tier
        self.pool = torch.zeros(primary_blocks, ROW_BYTES, dtype=torch.uint8)
        self.manager = TieringOffloadingManager(
            CPUOffloadingManager(primary_blocks, enable_events=True),
            [tier],
            pool=self.pool,
            step_driven=step_driven,
        )
        self.manager.wait_ready()
        assert tier.is_open, tier.open_error

    def store(self, *ids: int, wait: bool = True) -> None:
        """Store blocks; ``wait``: until their tier writes are done (or timed out)."""
        keys = [k(i) for i in ids]
        out = self.manager.prepare_store(keys)
        assert out is not None
        for slot, i in zip(out.store_spec.block_ids.tolist(), ids, strict=True):
            self.pool[slot] = row(i)
        self.manager.complete_store(keys)
        if wait:
            self.manager.wait_idle(timeout=WAIT_S)

    def load(self, i: int) -> torch.Tensor:
        """Block ``i``'s bytes as the engine would load them (a hit, promoted if need be)."""
        manager = self.manager
        if manager.lookup(k(i)) is None:
            manager.wait_idle()
        assert manager.lookup(k(i)) is True
        slot = int(manager.prepare_load([k(i)]).block_ids[0])
        data = self.pool[slot].clone()
        manager.complete_load([k(i)])
        return data

    def events(self, removed: bool) -> set[bytes]:
        medium = self.tier.medium
        return {
            key
            for e in self.manager.take_events()
            if e.medium == medium and e.removed is removed
            for key in e.keys
        }

    def hold(self, gate: threading.Event) -> None:
        """Hold the tier's I/O (clear ``gate``); jobs submitted from now on get DEADLINE_S."""
        self.tier.io_timeout_s = DEADLINE_S
        gate.clear()

    def release(self, gate: threading.Event) -> None:
        """Let the held I/O return; wait until every timed-out job's I/O has returned, then
        apply what follows (jobs submitted from now on get WAIT_S again)."""
        self.tier.io_timeout_s = WAIT_S
        gate.set()
        self.release_late_jobs()

    def release_late_jobs(self) -> None:
        """Wait until every timed-out job's I/O has returned, then apply what follows."""
        for job in self.manager.stalled_jobs():
            assert job.io_future is not None
            job.io_future.result(timeout=WAIT_S)
        self.manager.wait_idle(timeout=WAIT_S)


@pytest.fixture
def blocking() -> Iterator[BlockingBackend]:
    backend = BlockingBackend(32)
    try:
        yield backend
    finally:
        backend.gate.set()  # never leave a thread blocked


def test_a_store_past_its_deadline_stalls_the_tier_until_its_io_returns(
    blocking: BlockingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    tier = SecondaryTier(blocking, name="slow")
    rig = Rig(tier, primary_blocks=3)
    manager = rig.manager
    try:
        rig.store(1, 2, 3)
        rig.store(4, 5)  # 1 and 2 now only in the tier
        manager.wait_idle()
        assert manager.locate(k(1)) == "SLOW"
        rig.events(removed=False)
        blocking.ops, stored_before = {"put"}, tier.metrics.stored_blocks
        rig.hold(blocking.gate)
        with caplog.at_level(logging.WARNING, logger="tiering.managers.secondary_tier"):
            rig.store(6, wait=False)  # its write to the tier hangs
            manager.wait_idle(timeout=WAIT_S)  # returns once the deadline has passed
        # Failed, counted, reported once; the tier serves nothing meanwhile.
        assert tier.stalled
        counters = manager.metrics()["slow"]
        assert counters["status"] == "stalled" and counters["stalled"] is True
        assert counters["timed_out_jobs"] == 1 and counters["stalls"] == 1
        assert counters["store_failures"] == 1
        samples = {(s.name, s.labels[0]): s.value for s in read_samples(manager)}
        assert samples[("tiering_stalled", "slow")] == 1
        assert samples[("tiering_timed_out_jobs", "slow")] == 1
        assert [r for r in caplog.records if "stalled" in r.getMessage()] != []
        assert rig.events(removed=True) == {k(1), k(2), k(3), k(4), k(5)}
        assert manager.lookup(k(1)) is False  # a miss, not "retry later"
        assert manager.locate(k(1)) is None
        # Stores while stalled are shed, and the engine's calls answer at once.
        rig.store(7, 8)
        rig.store(9)  # evicts 7, then 8: block 6 stays, pinned for its hung write
        assert manager.primary.lookup(k(6)) is True
        assert manager.primary.lookup(k(7)) is False
        assert tier.metrics.stores_shed == 3
        assert len([r for r in caplog.records if "stalled" in r.getMessage()]) == 1
        # The I/O returns: the late write is never published and is purged; the tier recovers.
        rig.release(blocking.gate)
        assert not tier.stalled and manager.metrics()["slow"]["status"] == "open"
        assert tier.metrics.stored_blocks == stored_before
        assert not blocking.holds(k(6)) and k(6) not in tier.held
        assert rig.events(removed=False) == {k(1), k(2), k(3), k(4), k(5)}
        assert torch.equal(rig.load(1), row(1))
        rig.store(10, 11)  # 6 was unpinned: it can be evicted now
        assert manager.primary.lookup(k(6)) is False
    finally:
        blocking.gate.set()
        manager.shutdown()


@pytest.mark.parametrize("step_driven", [False, True], ids=["standalone", "step_driven"])
def test_a_late_promotion_never_serves_and_never_lands_in_a_reused_slot(
    blocking: BlockingBackend, step_driven: bool
) -> None:
    tier = SecondaryTier(blocking, name="slow")
    rig = Rig(tier, primary_blocks=2, step_driven=step_driven)
    manager = rig.manager
    try:
        rig.store(1)
        rig.store(2, 3)  # 1 only in the tier now
        manager.wait_idle()
        blocking.ops = {"get"}
        rig.hold(blocking.gate)
        assert manager.lookup(k(1)) is None  # its promotion starts (and hangs)
        manager.on_schedule_end()
        manager.wait_idle(timeout=WAIT_S)
        assert tier.stalled and tier.metrics.promotion_failures == 1
        assert manager.lookup(k(1)) is False and manager.primary.lookup(k(1)) is False
        # The slot the read is filling is kept out of use: the primary has no free slot, and
        # a store takes the other one.
        assert manager.primary.num_free_blocks == 0 and len(manager.primary) == 1
        rig.store(4)
        assert manager.primary.num_free_blocks == 0
        # The read lands in its own slot; block 4 keeps its bytes; 1 was never made ready.
        rig.release(blocking.gate)
        assert not tier.stalled
        assert manager.primary.lookup(k(1)) is False
        assert manager.primary.num_free_blocks == 1  # the slot came back
        assert torch.equal(rig.load(4), row(4))
        assert torch.equal(rig.load(1), row(1))  # promoted afresh, bit-exact
    finally:
        blocking.gate.set()
        manager.shutdown()


def test_a_backend_that_blocks_the_io_loop_itself_is_still_caught() -> None:
    """The deadline is watched by a thread of its own: a plugin that blocks the I/O loop's
    thread (against the backend contract) is noticed all the same, and the engine's calls go
    on answering from the primary."""
    backend = BlockingBackend(32, block_loop=True)
    tier = SecondaryTier(backend, name="stuck")
    rig = Rig(tier, primary_blocks=4)
    manager = rig.manager
    try:
        rig.store(1)
        manager.wait_idle()
        backend.ops = {"put", "get"}
        rig.hold(backend.gate)
        rig.store(2)
        assert tier.stalled
        assert torch.equal(rig.load(2), row(2))  # from the primary
        assert manager.lookup(k(3)) is False
        rig.release(backend.gate)
        assert not tier.stalled
        assert tier.state(k(1)).name == "READY" and tier.state(k(2)).name == "ABSENT"
    finally:
        backend.gate.set()
        manager.shutdown()


def test_reset_cache_refuses_while_a_tier_is_stalled(blocking: BlockingBackend) -> None:
    tier = SecondaryTier(blocking, name="slow")
    rig = Rig(tier, primary_blocks=2)
    manager = rig.manager
    try:
        blocking.ops = {"put"}
        rig.hold(blocking.gate)
        rig.store(1)
        with pytest.raises(TieringError, match="stalled"):
            manager.reset_cache()
        assert manager.primary.lookup(k(1)) is True  # nothing was reset
        rig.release(blocking.gate)
        manager.reset_cache()
        assert manager.primary.lookup(k(1)) is False
    finally:
        blocking.gate.set()
        manager.shutdown()


def test_a_tier_that_cannot_finish_opening_is_not_waited_for_and_joins_when_it_opens(
    blocking: BlockingBackend,
) -> None:
    """A hung mount at start-up: ``wait_ready`` (which the vLLM adapter calls without a
    timeout) returns once the open is past its deadline; the tier answers absent meanwhile,
    and serves once its open finishes (an open touches no primary row: it applies late)."""
    blocking.ops = {"open"}
    blocking.gate.clear()
    tier = SecondaryTier(blocking, name="slow", io_timeout_s=DEADLINE_S)
    pool = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
    manager = TieringOffloadingManager(CPUOffloadingManager(2), [tier], pool=pool)
    try:
        manager.wait_ready(timeout=None)
        assert tier.status == "opening" and tier.metrics.timed_out_jobs == 1
        assert manager.lookup(k(1)) is False
        out = manager.prepare_store([k(1)])
        assert out is not None
        manager.complete_store([k(1)])  # not written to a tier that is not open
        assert tier.metrics.store_jobs == 0
        tier.io_timeout_s = WAIT_S
        blocking.gate.set()
        for job in manager.stalled_jobs():
            assert job.io_future is not None
            job.io_future.result(timeout=WAIT_S)
        manager.wait_idle(timeout=WAIT_S)
        assert tier.is_open and not tier.stalled
        out = manager.prepare_store([k(2)])
        assert out is not None
        manager.complete_store([k(2)])
        manager.wait_idle(timeout=WAIT_S)
        assert tier.state(k(2)).name == "READY"
    finally:
        blocking.gate.set()
        manager.shutdown()


# -- a file tier whose I/O thread is held ---------------------------------------------------------


class HeldFileOps(FileOps):
    """The file backend's syscalls, held on ``gate`` while it is clear (a hung mount)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()

    def pwritev(
        self, fd: int, buffers: Sequence[memoryview | bytes | bytearray], offset: int
    ) -> int:
        self.gate.wait()
        return super().pwritev(fd, buffers, offset)

    def preadv(self, fd: int, buffers: Sequence[memoryview | bytearray], offset: int) -> int:
        self.gate.wait()
        return super().preadv(fd, buffers, offset)


def test_a_file_tier_whose_io_thread_is_held_stalls_and_recovers(tmp_path: Path) -> None:
    ops = HeldFileOps()

    def backend() -> FileBackend:
        return FileBackend(
            path=tmp_path / "nvme",
            capacity_bytes=16 * slot_bytes_for(ROW_BYTES),
            block_bytes=ROW_BYTES,
            fingerprint=FINGERPRINT,
            file_ops=ops,
        )

    tier = SecondaryTier(backend(), name="nvme")
    rig = Rig(tier, primary_blocks=2)
    manager = rig.manager
    try:
        rig.store(1, 2)
        rig.store(3)  # 1 only in the tier
        manager.wait_idle()
        rig.hold(ops.gate)
        rig.store(4, wait=False)  # evicts 2; the write of 4 hangs in the backend's thread
        assert manager.lookup(k(1)) is None or tier.stalled
        manager.wait_idle(timeout=WAIT_S)
        assert tier.stalled and manager.lookup(k(1)) is False
        assert manager.lookup(k(2)) is False
        rig.release(ops.gate)
        assert not tier.stalled
        assert tier.state(k(4)).name == "ABSENT"  # the late write: purged, not published
        assert torch.equal(rig.load(1), row(1))
        assert torch.equal(rig.load(2), row(2))
    finally:
        ops.gate.set()
        manager.shutdown()
    # What the backend holds after a restart: the blocks acknowledged in time, not the late one.
    reopened = backend()
    recovered = asyncio.run(_open_and_close(reopened))
    assert set(recovered) == {k(1), k(2), k(3)}


async def _open_and_close(backend: FileBackend) -> list[bytes]:
    try:
        return await backend.open()
    finally:
        await backend.close()


# -- a SIGSTOPped redis-server ---------------------------------------------------------------


def test_a_stopped_redis_server_stalls_its_tier_until_it_continues(tmp_path: Path) -> None:
    from redis_helpers import make_redis_backend, require_redis

    from tiering.testing.redis_servers import RedisServer

    require_redis()
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        backend = make_redis_backend(server, block_bytes=ROW_BYTES, timeout_s=WAIT_S)
        tier = SecondaryTier(backend, name="redis")
        rig = Rig(tier, primary_blocks=2)
        manager = rig.manager
        try:
            rig.store(1)
            rig.store(2, 3)
            manager.wait_idle()
            tier.io_timeout_s = DEADLINE_S
            server.pause()  # SIGSTOP
            try:
                assert manager.lookup(k(1)) is None  # its promotion hangs on the socket
                manager.wait_idle(timeout=WAIT_S)
                assert tier.stalled and manager.lookup(k(1)) is False
                rig.store(4)  # shed while stalled; the engine's calls answer at once
                assert tier.metrics.stores_shed == 1
            finally:
                tier.io_timeout_s = WAIT_S
                server.resume()  # SIGCONT
            rig.release_late_jobs()
            assert not tier.stalled
            assert torch.equal(rig.load(1), row(1))
            rig.store(5)
            manager.wait_idle()
            assert tier.state(k(5)).name == "READY"
        finally:
            server.resume()
            manager.shutdown()
    finally:
        server.stop()


# -- a shared tier's existence check ---------------------------------------------------------------


class SharedBlocking(BlockingBackend):
    """A shared store whose existence checks hang while ``gate`` is clear."""

    @property
    def capabilities(self) -> BackendCapabilities:
        return dataclasses.replace(super().capabilities, shared=True)

    async def exists(self, keys: Sequence[bytes]) -> list[bool | None]:
        await self._hold("exists")
        return await super().exists(keys)


def test_a_hung_existence_check_of_a_shared_tier_is_a_miss_then_recovers() -> None:
    backend = SharedBlocking(32)
    tier = SharedTier(backend, name="shared")
    rig = Rig(tier, primary_blocks=2)
    manager = rig.manager
    try:
        rig.store(1)
        rig.store(2, 3)
        manager.wait_idle()
        backend.ops = {"exists"}
        rig.hold(backend.gate)
        assert manager.lookup(k(9)) is None  # nothing known of it: the store is asked
        manager.wait_idle(timeout=WAIT_S)
        assert tier.stalled and tier.metrics.timed_out_jobs == 1
        assert manager.lookup(k(9)) is False and manager.lookup(k(1)) is False
        rig.release(backend.gate)
        assert not tier.stalled
        assert torch.equal(rig.load(1), row(1))
    finally:
        backend.gate.set()
        manager.shutdown()


# -- configuration and the watch ---------------------------------------------------------------


def test_io_timeout_s_is_configured_per_tier_and_checked(tmp_path: Path) -> None:
    text = """\
version: 1
model:
  shape: tiny
primary:
  capacity: 64KiB
secondary_tiers:
  - name: nvme
    type: file
    path: ./nvme
    capacity: 1MiB
    io_timeout_s: {value}
  - name: mem
    type: memory
    capacity: 1MiB
"""
    path = tmp_path / "tiering.yaml"
    path.write_text(text.format(value="2.5"))
    config = load_config(path)
    assert config.tier("nvme").io_timeout_s == 2.5
    assert config.tier("mem").io_timeout_s == 30.0  # the default
    for bad in ("0", "-1", "abc", "1e9"):
        path.write_text(text.format(value=bad))
        with pytest.raises(ConfigError, match="io_timeout_s"):
            load_config(path)
    with pytest.raises(ConfigurationError, match="io_timeout_s"):
        SecondaryTier(BlockingBackend(4), io_timeout_s=0)


def test_the_watch_fires_due_deadlines_in_order_and_never_a_cancelled_one() -> None:
    watch = DeadlineWatch()
    fired: list[str] = []
    done = threading.Event()
    try:
        cancelled = watch.arm(0.01, lambda: fired.append("cancelled"))
        cancelled.cancel()

        def second() -> None:
            fired.append("second")
            done.set()

        watch.arm(0.05, second)
        watch.arm(0.02, lambda: fired.append("first"))
        assert done.wait(WAIT_S)
        assert fired == ["first", "second"]
    finally:
        watch.close()
    after_close = watch.arm(0.0, lambda: fired.append("after close"))
    assert after_close.callback is None and fired == ["first", "second"]
