"""RedisBackend when servers fail: nodes killed or hung mid-run, eviction under maxmemory,
credentials, a cluster that is down, and two processes sharing one cluster. Every server here is
started by the test and torn down with it."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.crc import key_slot
from redis_helpers import make_redis_backend, require_redis

from tiering.backends.base import Outcome
from tiering.backends.redis import RedisBackend
from tiering.core.keys import make_offload_key
from tiering.errors import BackendError
from tiering.testing.redis_servers import RedisClusterProcesses, RedisServer

pytest_plugins = ["redis_fixtures"]  # the real-server fixtures

OK, MISSING, FULL, FAILED = Outcome.OK, Outcome.MISSING, Outcome.FULL, Outcome.FAILED
WORKER = Path(__file__).parent / "workers" / "redis_worker.py"
PASSWORD = "s3cret-for-tests"


def _keys(n: int, tag: str = "k") -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0) for i in range(n)]


def _payloads(n: int, size: int, seed: int) -> list[memoryview]:
    rng = random.Random(seed)
    return [memoryview(bytearray(rng.randbytes(size))) for _ in range(n)]


def _buffers(n: int, size: int) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    """A cluster of this test's own (it will be hurt)."""
    require_redis()
    processes = RedisClusterProcesses(tmp_path / "cluster")
    try:
        processes.start()
        yield processes
    finally:
        processes.stop()


def _node_of(backend: RedisBackend, cluster: RedisClusterProcesses, key: bytes) -> RedisServer:
    return cluster.node_for_slot(key_slot(backend.redis_keys(key)[0]))


async def _true(value: bool) -> bool:
    return value


async def _until(condition: object, timeout_s: float = 30.0) -> None:
    """Wait for ``condition()`` (an event, not a timing: the bound only stops a hang)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():  # type: ignore[operator]
        assert loop.time() < deadline, "the condition did not come true"
        await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_cluster_node_killed_mid_run(
    cluster: RedisClusterProcesses, caplog: pytest.LogCaptureFixture
) -> None:
    size = 16 << 10
    keys, values = _keys(60), _payloads(60, size, seed=1)
    backend = make_redis_backend(
        cluster, block_bytes=size, retry_interval_s=0.2, connect_timeout_s=5.0, timeout_s=5.0
    )
    async with backend:
        assert await backend.put(keys, values) == [OK] * 60
        victim = _node_of(backend, cluster, keys[0])
        on_victim = [_node_of(backend, cluster, k) is victim for k in keys]
        assert 0 < sum(on_victim) < 60
        errors: list[BaseException] = []
        calls_done: list[list[Outcome]] = []
        failed_calls = 0
        stop = asyncio.Event()

        async def traffic() -> None:  # an engine that keeps serving meanwhile
            nonlocal failed_calls
            while not stop.is_set():
                out = _buffers(60, size)
                try:
                    outcomes = await backend.get(keys, out)
                except BaseException as exc:
                    errors.append(exc)
                    return
                calls_done.append(outcomes)
                failed_calls += FAILED in outcomes
                for got, want, outcome in zip(out, values, outcomes, strict=True):
                    assert outcome in (OK, FAILED, MISSING)
                    if outcome is OK:
                        assert got == want
                await asyncio.sleep(0)

        caplog.set_level(logging.WARNING, logger="tiering.backends.redis.nodes")
        running = asyncio.ensure_future(traffic())
        await _until(lambda: _true(len(calls_done) >= 3))  # serving before the kill
        victim.kill()
        await _until(lambda: _true(failed_calls >= 5 or running.done()))  # and after it
        stop.set()
        await running
        assert errors == []
        assert calls_done[0] == [OK] * 60 and failed_calls >= 5
        # while it is down: its keys fail, every other key reads bit-exact; nothing raises
        out = _buffers(60, size)
        outcomes = await backend.get(keys, out)
        for i, outcome in enumerate(outcomes):
            assert outcome is (FAILED if on_victim[i] else OK)
            if outcome is OK:
                assert out[i] == values[i]
        fresh = _payloads(60, size, seed=2)
        written = await backend.put(keys, fresh)
        assert written == [FAILED if v else OK for v in on_victim]
        assert await backend.contains(keys) == [not v for v in on_victim]
        assert await backend.exists(keys) == [None if v else True for v in on_victim]
        assert backend.degraded
        assert backend.stats.extra["node_errors"] >= 1
        failures = [r for r in caplog.records if victim.address in r.getMessage()]
        assert len(failures) == 1, "a node's failure is logged once, not per call"
        # it comes back (empty: it persisted nothing); reads and writes work again
        victim.start()

        async def victim_serves() -> bool:
            return await backend.put(keys[:1], fresh[:1]) == [OK]

        await _until(victim_serves)
        assert await backend.put(keys, fresh) == [OK] * 60
        out = _buffers(60, size)
        assert await backend.get(keys, out) == [OK] * 60
        assert out == fresh
        assert not backend.degraded


@pytest.mark.asyncio
async def test_hung_node_times_out_then_serves_its_old_blocks(
    cluster: RedisClusterProcesses,
) -> None:
    size = 8 << 10
    keys, values = _keys(30), _payloads(30, size, seed=3)
    backend = make_redis_backend(cluster, block_bytes=size, retry_interval_s=0.2, timeout_s=2.0)
    async with backend:
        assert await backend.put(keys, values) == [OK] * 30
        hung = _node_of(backend, cluster, keys[0])
        on_hung = [_node_of(backend, cluster, k) is hung for k in keys]
        hung.pause()
        try:
            out = _buffers(30, size)
            outcomes = await backend.get(keys, out)
            assert outcomes == [FAILED if h else OK for h in on_hung]
            assert [o for o, h in zip(out, on_hung, strict=True) if not h] == [
                v for v, h in zip(values, on_hung, strict=True) if not h
            ]
        finally:
            hung.resume()

        async def all_back() -> bool:
            out = _buffers(30, size)
            return await backend.get(keys, out) == [OK] * 30 and out == values

        await _until(all_back)  # the node kept its data: the old blocks read bit-exact


@pytest.mark.asyncio
async def test_eviction_under_maxmemory_is_misses(tmp_path: Path) -> None:
    require_redis()
    server = RedisServer(tmp_path / "small", maxmemory_bytes=4 << 20)
    server.start()
    try:
        size = 256 << 10
        keys, values = _keys(64), _payloads(64, size, seed=4)
        async with make_redis_backend(server, block_bytes=size, shared=True) as backend:
            for start in range(0, 64, 8):  # 16 MiB into 4 MiB
                outcomes = await backend.put(keys[start : start + 8], values[start : start + 8])
                assert outcomes == [OK] * 8
            out = _buffers(64, size)
            outcomes = await backend.get(keys, out)
            # Redis may evict every block of the flood (its own buffers count against
            # maxmemory too): each is a miss, none an error or corrupt.
            assert set(outcomes) <= {OK, MISSING}
            assert outcomes.count(MISSING) >= 40  # at most 4 MiB of the 16 stayed
            # A block written after the flood is served (reads never evict), bit-exact.
            late = _keys(1, "after-the-flood")
            assert await backend.put(late, values[:1]) == [OK]
            (after,) = _buffers(1, size)
            assert await backend.get(late, [after]) == [OK] and after == values[0]
            for got, want, outcome in zip(out, values, outcomes, strict=True):
                if outcome is OK:
                    assert got == want
            assert backend.stats.corrupt == 0
            stats = await backend.server_stats()
            assert stats.evicted_keys >= 40 and stats.maxmemory_bytes == 4 << 20
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_noeviction_server_that_is_full_answers_full(tmp_path: Path) -> None:
    require_redis()
    server = RedisServer(
        tmp_path / "noevict", maxmemory_bytes=4 << 20, maxmemory_policy="noeviction"
    )
    server.start()
    try:
        size = 256 << 10
        keys, values = _keys(32), _payloads(32, size, seed=5)
        async with make_redis_backend(server, block_bytes=size, shared=True) as backend:
            outcomes = []
            for start in range(0, 32, 4):
                outcomes += await backend.put(keys[start : start + 4], values[start : start + 4])
            assert OK in outcomes and FULL in outcomes
            assert set(outcomes) == {OK, FULL}
            assert backend.stats.extra["oom_rejections"] == outcomes.count(FULL)
            out = _buffers(32, size)
            read = await backend.get(keys, out)
            assert read == [MISSING if o is FULL else OK for o in outcomes]
    finally:
        server.stop()


@pytest.fixture
def password_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis()
    server = RedisServer(tmp_path / "auth", password=PASSWORD)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_wrong_password_is_a_clear_error_at_open(
    password_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERING_TEST_REDIS_PW", "not-the-password")
    backend = make_redis_backend(password_server, password_env="TIERING_TEST_REDIS_PW")
    with pytest.raises(BackendError, match=r"rejected the credentials \(the default user, the "
                       r"password in \$TIERING_TEST_REDIS_PW\)"):  # fmt: skip
        await backend.open()
    assert not backend.is_open
    assert "not-the-password" not in str(backend.settings)  # only the variable's name is kept
    no_password = make_redis_backend(password_server)
    with pytest.raises(BackendError, match="needs credentials, and none are configured"):
        await no_password.open()
    monkeypatch.setenv("TIERING_TEST_REDIS_PW", PASSWORD)
    async with make_redis_backend(password_server, password_env="TIERING_TEST_REDIS_PW") as ok:
        assert await ok.put(_keys(1), _payloads(1, 4096, seed=6)) == [OK]


@pytest.mark.asyncio
async def test_cluster_with_password(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require_redis()
    processes = RedisClusterProcesses(tmp_path / "c", password=PASSWORD)
    processes.start()
    try:
        monkeypatch.setenv("TIERING_TEST_REDIS_PW", PASSWORD)
        keys, values = _keys(12), _payloads(12, 4096, seed=7)
        async with make_redis_backend(processes, password_env="TIERING_TEST_REDIS_PW") as b:
            assert await b.put(keys, values) == [OK] * 12
        monkeypatch.setenv("TIERING_TEST_REDIS_PW", "wrong")
        with pytest.raises(BackendError, match="rejected the credentials"):
            await make_redis_backend(processes, password_env="TIERING_TEST_REDIS_PW").open()
    finally:
        processes.stop()


@pytest.mark.asyncio
async def test_cluster_down_is_a_clear_error_at_open(cluster: RedisClusterProcesses) -> None:
    survivor = cluster.nodes[0]
    for node in cluster.nodes[1:]:
        node.kill()  # two of three masters: no majority, the cluster fails

    async def survivor_says_fail() -> bool:
        raw = survivor.command("CLUSTER", "INFO")
        return isinstance(raw, bytes) and b"cluster_state:fail" in raw

    await _until(survivor_says_fail)
    backend = make_redis_backend(cluster, connect_timeout_s=1.0)
    with pytest.raises(BackendError, match=r"cannot use redis at cluster .*cluster is down"):
        await backend.open()
    survivor.kill()
    with pytest.raises(BackendError, match="cannot use redis at cluster"):
        await make_redis_backend(cluster, connect_timeout_s=1.0).open()


@pytest.mark.asyncio
async def test_open_with_one_master_down_serves_the_others(
    cluster: RedisClusterProcesses,
) -> None:
    keys, values = _keys(30), _payloads(30, 4096, seed=8)
    down = cluster.nodes[1]
    down.kill()
    backend = make_redis_backend(cluster, connect_timeout_s=1.0, retry_interval_s=60.0)
    async with backend:
        assert backend.degraded
        on_down = [_node_of(backend, cluster, k) is down for k in keys]
        assert 0 < sum(on_down) < 30
        expected = [FAILED if d else OK for d in on_down]
        assert await backend.put(keys, values) == expected
        out = _buffers(30, 4096)
        assert await backend.get(keys, out) == expected
        assert [o for o, d in zip(out, on_down, strict=True) if not d] == [
            v for v, d in zip(values, on_down, strict=True) if not d
        ]


@pytest.mark.asyncio
async def test_a_cluster_node_given_as_url_is_a_clear_error(
    redis_cluster: RedisClusterProcesses,
) -> None:
    backend = make_redis_backend(redis_cluster.nodes[0])
    with pytest.raises(BackendError, match="is a Redis Cluster node: give the cluster's nodes"):
        await backend.open()


def _worker(role: str, target: str, prefix: str) -> str:
    run = subprocess.run(
        [sys.executable, str(WORKER), role, "cluster_nodes", target, prefix, "24", "9"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=False,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout.strip()


@pytest.mark.slow
def test_two_processes_share_blocks_through_the_cluster(
    redis_cluster: RedisClusterProcesses,
) -> None:
    """Process A puts; process B (another interpreter, its own backend) reads bit-exact."""
    assert _worker("put", redis_cluster.seeds, "two-proc") == "OK 24"
    assert _worker("get", redis_cluster.seeds, "two-proc") == "OK 24"
    assert _worker("get", redis_cluster.seeds, "two-proc-other").startswith("GET")
