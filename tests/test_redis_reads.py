"""How RedisBackend reads, on real servers: never more than a block of a value planted under a
block's name, a block that changed between its two reads is read again (not unlinked), and a
slot moved by a resharding is followed at once (a hit, not a failure)."""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot
from redis.exceptions import MovedError
from redis_helpers import Target, make_redis_backend, raw_client, require_redis

from tiering.backends.base import Outcome
from tiering.backends.redis import RedisBackend
from tiering.backends.redis.nodes import ClientOptions, RedisNodes
from tiering.core.keys import make_offload_key
from tiering.testing.redis_servers import RedisClusterProcesses, RedisServer

pytest_plugins = ["redis_fixtures"]  # the real-server fixtures

OK, MISSING, CORRUPT, FAILED = Outcome.OK, Outcome.MISSING, Outcome.CORRUPT, Outcome.FAILED
BLOCK = 4096
PLANTED_BYTES = 16 << 20  # a whole read of it would be 4096 times a block


@pytest.fixture(params=["standalone", "cluster"])
def target(
    request: pytest.FixtureRequest,
    redis_standalone: RedisServer,
    redis_cluster: RedisClusterProcesses,
) -> Target:
    return redis_standalone if request.param == "standalone" else redis_cluster


def _keys(n: int, tag: str) -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0) for i in range(n)]


def _payloads(n: int, seed: int) -> list[memoryview]:
    rng = random.Random(seed)
    return [memoryview(bytearray(rng.randbytes(BLOCK))) for _ in range(n)]


def _buffers(n: int) -> list[memoryview]:
    return [memoryview(bytearray(BLOCK)) for _ in range(n)]


def _server_of(target: Target, name: bytes) -> RedisServer:
    if isinstance(target, RedisClusterProcesses):
        return target.node_for_slot(key_slot(name))
    return target


def _bytes_sent(server: RedisServer) -> int:
    """What the server has written to all its clients so far (INFO's own reply included)."""
    return int(server.info("stats")["total_net_output_bytes"])


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["payload", "header"])
async def test_a_planted_oversized_value_is_a_miss_and_never_read_whole(
    target: Target, where: str
) -> None:
    keys, values = _keys(3, f"planted-{where}"), _payloads(3, seed=1)
    async with make_redis_backend(target, block_bytes=BLOCK) as backend:
        assert await backend.put(keys, values) == [OK] * 3
        header_name, payload_name = backend.redis_keys(keys[1])
        name = payload_name if where == "payload" else header_name
        client = raw_client(target)
        try:
            client.set(name, random.Random(2).randbytes(PLANTED_BYTES))
        finally:
            client.close()
        server = _server_of(target, name)
        before = _bytes_sent(server)
        out = _buffers(3)
        assert await backend.get(keys, out) == [OK, CORRUPT, OK]
        sent = _bytes_sent(server) - before
        # Both reads of the planted block (the second confirms it) and the other blocks on
        # this server: a few blocks, where one whole read would be PLANTED_BYTES.
        assert sent < 16 * BLOCK, sent
        assert out[0] == values[0] and out[2] == values[2]
        assert backend.stats.corrupt == 1 and backend.stats.hits == 2
        assert await backend.exists(keys) == [True, False, True]  # the planted value went


class _Between:
    """Runs ``action`` once, right after the first get pipeline of ``backend`` that read
    ``name`` answered: a writer that lands between a get's first read of a block and its
    second."""

    def __init__(self, backend: RedisBackend, name: bytes, action: Callable[[], None]) -> None:
        self.action: Callable[[], None] | None = action
        assert backend.nodes is not None
        for node in backend.nodes.masters():
            make = node.client.pipeline

            def pipeline(*args: Any, _make: Any = make, **kwargs: Any) -> Any:
                pipe = _make(*args, **kwargs)
                execute = pipe.execute

                async def execute_then_act(*a: Any, **kw: Any) -> Any:
                    reads = any(c[0][:2] == ("GETRANGE", name) for c in pipe.command_stack)
                    replies = await execute(*a, **kw)  # (empties the command stack)
                    if self.action is not None and reads:
                        action, self.action = self.action, None
                        action()
                    return replies

                pipe.execute = execute_then_act
                return pipe

            node.client.pipeline = pipeline  # type: ignore[method-assign]


@pytest.mark.asyncio
@pytest.mark.parametrize("seen", ["torn", "header-gone", "payload-gone"])
async def test_a_block_rewritten_between_its_two_reads_is_read_again_not_unlinked(
    target: Target, seen: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The first read sees what a read racing a rewrite can see (A's header with B's payload,
    or one string not written yet); the rewrite is whole before the second read: a hit with
    B's bytes, nothing called corrupt, nothing unlinked."""
    keys = _keys(2, f"race-{seen}")
    old, new = _payloads(2, seed=3), _payloads(2, seed=4)
    async with make_redis_backend(target, block_bytes=BLOCK) as backend:
        assert await backend.put(keys, old) == [OK] * 2
        header_name, payload_name = backend.redis_keys(keys[1])
        client = raw_client(target)
        try:
            old_header = client.get(header_name)
            assert await backend.put(keys[1:], new[1:]) == [OK]
            new_header, new_payload = client.get(header_name), client.get(payload_name)
            if seen == "torn":
                client.set(header_name, old_header)
            else:
                client.delete(header_name if seen == "header-gone" else payload_name)

            def rewrite() -> None:
                client.set(header_name, new_header)
                client.set(payload_name, new_payload)

            _Between(backend, header_name, rewrite)
            out = _buffers(2)
            assert await backend.get(keys, out) == [OK, OK]
            assert out[0] == old[0] and out[1] == new[1]
            assert backend.stats.corrupt == 0 and "corrupt" not in caplog.text
            assert client.exists(header_name, payload_name) == 2
        finally:
            client.close()


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    """A cluster of this test's own: its slots are moved."""
    require_redis()
    processes = RedisClusterProcesses(tmp_path / "cluster")
    try:
        processes.start()
        yield processes
    finally:
        processes.stop()


def _other_master(cluster: RedisClusterProcesses, slot: int) -> RedisServer:
    source = cluster.node_for_slot(slot)
    return next(n for n in cluster.nodes if n is not source)


@pytest.mark.asyncio
async def test_a_slot_moved_by_a_resharding_is_followed_at_once(
    own_cluster: RedisClusterProcesses,
) -> None:
    """After a resharding, the first call on a moved key gets MOVED from the old master: it is
    sent again to the new one at once (a hit with the right bytes, written, found), no node is
    marked down, and the slot table is read again before the next call."""
    keys, values = _keys(24, "moved"), _payloads(24, seed=5)
    backend = make_redis_backend(own_cluster, block_bytes=BLOCK, retry_interval_s=0.0)
    async with backend:
        assert backend.nodes is not None
        assert await backend.put(keys, values) == [OK] * 24
        slot = key_slot(backend.redis_keys(keys[0])[0])
        in_slot = [k for k in keys if key_slot(backend.redis_keys(k)[0]) == slot]
        new_master = _other_master(own_cluster, slot)
        assert own_cluster.move_slot(slot, new_master) == 2 * len(in_slot)  # two strings each
        assert backend.nodes.node_for(backend.redis_keys(keys[0])[0]).address != (
            new_master.address
        )  # the backend has not heard of it yet

        out = _buffers(24)
        assert await backend.get(keys, out) == [OK] * 24  # the first read after the move
        assert out == values
        assert backend.stats.extra["redirections"] == len(in_slot)
        assert backend.stats.read_failures == 0 and not backend.degraded
        assert backend.nodes.node_for(backend.redis_keys(keys[0])[0]).address == (
            new_master.address
        )

        # Each kind of call follows a move: EXISTS, UNLINK, MSET and MSETNX.
        for call in ("exists", "delete", "put", "put_if_absent"):
            await backend.nodes.maybe_refresh()  # the table the last move left is read
            slot = key_slot(backend.redis_keys(keys[0])[0])
            before = backend.stats.extra["redirections"]
            own_cluster.move_slot(slot, _other_master(own_cluster, slot))
            if call == "exists":
                assert await backend.exists(keys) == [True] * 24
            elif call == "delete":
                assert await backend.delete(keys[:1]) == [True]
            elif call == "put":
                assert await backend.put(keys, values) == [OK] * 24
            else:
                assert await backend.put_if_absent(keys, values) == [OK] * 24
            assert backend.stats.extra["redirections"] > before, call
        out = _buffers(24)
        assert await backend.get(keys, out) == [OK] * 24 and out == values
        assert backend.stats.read_failures == 0 and backend.stats.put_failures == 0
        assert not backend.degraded


def test_a_moved_reply_naming_no_host_means_the_host_that_replied() -> None:
    """A cluster node that does not know its own address answers ``MOVED <slot> :<port>``."""
    options = ClientOptions(username=None, password=None, db=0, tls=False, tls_ca_file=None,
                            tls_cert_file=None, tls_key_file=None, connect_timeout_s=1.0,
                            timeout_s=1.0, max_connections=4)  # fmt: skip
    nodes = RedisNodes(
        standalone_url=None,
        seeds=[("10.0.0.1", 7000)],
        options=options,
        pipelines_per_node=1,
        retry_interval_s=1.0,
    )
    nodes._install([(0, 9, "10.0.0.1", 7000), (10, 16383, "10.0.0.3", 7003)])
    nodes.follow_moved([MovedError("5 :7001"), MovedError("11 10.0.0.2:7002"),
                        MovedError("12 ?:7004")])  # fmt: skip
    assert [nodes._slots[s].address for s in (4, 5, 11, 12, 13)] == [
        "10.0.0.1:7000", "10.0.0.1:7001", "10.0.0.2:7002", "10.0.0.3:7004", "10.0.0.3:7003"
    ]  # fmt: skip
    asyncio.run(nodes.close())  # (nothing was connected)
