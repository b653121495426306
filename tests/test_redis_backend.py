"""RedisBackend on real servers: the conformance suite (standalone, cluster, shared mode), then
what only Redis has: namespaces, verification of foreign values, TTL, the shared-tier pieces."""

from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path
from typing import Any, ClassVar

import pytest
from redis_helpers import Target, make_redis_backend, prefix_for, raw_client, target_options

from tiering.backends.base import Outcome, StorageBackend
from tiering.backends.redis import TAIL_BYTES, RedisBackend, RedisSettings
from tiering.core.block_format import pack_header
from tiering.core.hashing import ExtraKeys, PrefixHasher
from tiering.core.keys import make_offload_key
from tiering.errors import BackendError, ConfigurationError
from tiering.testing import BackendTests
from tiering.testing.redis_servers import RedisClusterProcesses, RedisServer, free_port

pytest_plugins = ["redis_fixtures"]  # the real-server fixtures

OK, MISSING, CORRUPT, FULL, FAILED = (
    Outcome.OK,
    Outcome.MISSING,
    Outcome.CORRUPT,
    Outcome.FULL,
    Outcome.FAILED,
)


class RedisSuite(BackendTests):
    """BackendTests against a Redis deployment; subclasses pick the target and options."""

    options: ClassVar[dict[str, Any]] = {}
    target: Target

    def make_backend(
        self, path: Path, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes
    ) -> StorageBackend:
        return RedisBackend(
            capacity_bytes=capacity_bytes,
            block_bytes=block_bytes,
            fingerprint=fingerprint,
            key_prefix=prefix_for(path),
            **target_options(self.target),
            **self.options,
        )

    def expected_usage_bytes(self, backend: StorageBackend, n_blocks: int) -> int | None:
        assert isinstance(backend, RedisBackend)
        return n_blocks * backend.footprint_bytes

    def corrupt_stored_block(self, backend: StorageBackend, key: bytes) -> None:
        """Flip one payload byte with a client of our own (the backend never sees it)."""
        assert isinstance(backend, RedisBackend)
        _, payload_name = backend.redis_keys(key)
        client = raw_client(self.target)
        try:
            payload = bytearray(client.get(payload_name))
            payload[len(payload) // 2] ^= 0x10
            client.set(payload_name, bytes(payload))
        finally:
            client.close()


class TestRedisStandalone(RedisSuite):
    @pytest.fixture(autouse=True)
    def _target(self, redis_standalone: RedisServer) -> None:
        self.target = redis_standalone


class TestRedisCluster(RedisSuite):
    @pytest.fixture(autouse=True)
    def _target(self, redis_cluster: RedisClusterProcesses) -> None:
        self.target = redis_cluster


class TestRedisClusterSmallPipelines(RedisSuite):
    """Pipelines of one block: every call is cut into many pipelines per node."""

    options: ClassVar[dict[str, Any]] = {"pipeline_bytes": 1, "pipelines_per_node": 3}

    @pytest.fixture(autouse=True)
    def _target(self, redis_cluster: RedisClusterProcesses) -> None:
        self.target = redis_cluster


class TestRedisShared(RedisSuite):
    """shared: true. The store is the index: open recovers nothing, capacity is Redis's, and
    usage_bytes is 0 (what Redis holds is server_stats()); those tests are replaced below."""

    options: ClassVar[dict[str, Any]] = {"shared": True}
    persistent = False  # open() recovers no keys (the restart tests assume it does)

    @pytest.fixture(autouse=True)
    def _target(self, redis_cluster: RedisClusterProcesses) -> None:
        self.target = redis_cluster

    def expected_usage_bytes(self, backend: StorageBackend, n_blocks: int) -> int | None:
        return None

    def check_usage(self, backend: StorageBackend, n_stored: int) -> None:
        assert backend.usage_bytes == 0

    @pytest.mark.asyncio
    async def test_properties(self, tmp_path: Path) -> None:
        backend = self.new_backend(tmp_path)
        assert backend.capabilities.shared and backend.capabilities.persistent
        async with backend:
            assert isinstance(backend, RedisBackend)
            stats = await backend.server_stats()
            assert stats.nodes == stats.nodes_answering == 3
            assert stats.used_memory_bytes > 0 and backend.last_server_stats == stats
            assert backend.usage_bytes == 0

    @pytest.mark.asyncio
    async def test_capacity_full_and_accounting(self, tmp_path: Path) -> None:
        """No budget of its own: puts past capacity_blocks are stored."""
        async with self.new_backend(tmp_path, n_blocks=8) as backend:
            n = backend.capacity_blocks + 3
            keys, values = self.make_keys(n), self.make_payloads(n, seed=13)
            await self.put_ok(backend, keys, values)
            await self.assert_stored(backend, keys, values)

    @pytest.mark.asyncio
    async def test_reopen_recovers_no_keys_but_reads_everything(self, tmp_path: Path) -> None:
        keys, values = self.make_keys(10), self.make_payloads(10, seed=14)
        async with self.new_backend(tmp_path) as backend:
            await self.put_ok(backend, keys, values)
        reopened = self.new_backend(tmp_path)
        try:
            assert await reopened.open() == []
            assert await reopened.contains(keys) == [True] * 10
            await self.assert_stored(reopened, keys, values)
        finally:
            await reopened.close()


# -- what only Redis has -----------------------------------------------------------------------


@pytest.fixture(params=["standalone", "cluster"])
def target(
    request: pytest.FixtureRequest,
    redis_standalone: RedisServer,
    redis_cluster: RedisClusterProcesses,
) -> Target:
    return redis_standalone if request.param == "standalone" else redis_cluster


def _keys(n: int, tag: str = "k") -> list[bytes]:
    return [make_offload_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0) for i in range(n)]


def _payloads(n: int, size: int, seed: int) -> list[memoryview]:
    rng = random.Random(seed)
    return [memoryview(bytearray(rng.randbytes(size))) for _ in range(n)]


def _buffers(n: int, size: int) -> list[memoryview]:
    return [memoryview(bytearray(size)) for _ in range(n)]


@pytest.mark.asyncio
async def test_hiredis_parses_the_replies(target: Target) -> None:
    async with make_redis_backend(target) as backend:
        assert backend.parser == "hiredis"


@pytest.mark.asyncio
async def test_key_names_carry_prefix_and_fingerprint(target: Target) -> None:
    keys, values = _keys(3), _payloads(3, 4096, seed=1)
    async with make_redis_backend(target, key_prefix="mdl-a") as backend:
        await backend.put(keys, values)
        stem = b"mdl-a:" + backend.fingerprint.hex().encode() + b":{"
        expected = {stem + k.hex().encode() + suffix for k in keys for suffix in (b"}:h", b"}:p")}
        client = raw_client(target)
        try:
            assert {bytes(n) for n in client.scan_iter(match="mdl-a:*")} == expected
            header_name, payload_name = backend.redis_keys(keys[0])
            assert client.type(header_name) == client.type(payload_name) == b"string"
            header = pack_header(keys[0], values[0], backend.fingerprint)
            assert client.get(header_name) == header + bytes(values[0][-TAIL_BYTES:])
            assert client.get(payload_name) == bytes(values[0][:-TAIL_BYTES])
        finally:
            client.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("block_bytes", [256 << 10, 2 << 20])
async def test_a_block_takes_its_payload_plus_a_little(
    redis_standalone: RedisServer, block_bytes: int
) -> None:
    """Redis's MEMORY USAGE of a stored power-of-two block stays within footprint_bytes (one
    value of header + payload would be rounded up to the next jemalloc class: +25%)."""
    keys, values = _keys(1), _payloads(1, block_bytes, seed=15)
    async with make_redis_backend(redis_standalone, block_bytes=block_bytes) as backend:
        assert await backend.put(keys, values) == [OK]
        used = 0
        for name in backend.redis_keys(keys[0]):
            answer = redis_standalone.command("MEMORY", "USAGE", name)
            assert isinstance(answer, int)
            used += answer
        assert block_bytes < used <= backend.footprint_bytes < block_bytes + 1024


@pytest.mark.asyncio
async def test_two_layouts_and_two_prefixes_never_read_each_other(target: Target) -> None:
    """Same offload keys, different fingerprint or prefix: separate blocks, no hit across."""
    keys = _keys(4)
    a_values, b_values, c_values = (_payloads(4, 4096, seed=s) for s in (2, 3, 4))
    layout_a = make_redis_backend(target, fingerprint=b"layout-A-0000000")
    layout_b = make_redis_backend(target, fingerprint=b"layout-B-0000000")
    other_prefix = make_redis_backend(target, fingerprint=b"layout-A-0000000", key_prefix="x")
    async with layout_a, layout_b, other_prefix:
        assert await layout_a.put(keys, a_values) == [OK] * 4
        out = _buffers(4, 4096)
        assert await layout_b.get(keys, out) == [MISSING] * 4
        assert await other_prefix.get(keys, out) == [MISSING] * 4
        assert await layout_b.put(keys, b_values) == [OK] * 4
        assert await other_prefix.put(keys, c_values) == [OK] * 4
        for backend, values in ((layout_a, a_values), (layout_b, b_values),
                                (other_prefix, c_values)):  # fmt: skip
            assert await backend.get(keys, out) == [OK] * 4
            assert out == values


@pytest.mark.asyncio
async def test_salted_keys_do_not_hit_across_nodes(target: Target) -> None:
    """Two engine nodes (two backends) hash the same tokens with different cache salts."""
    tokens = list(range(64))
    hasher = PrefixHasher(16)
    salted = [make_offload_key(h, 0) for h in hasher.hash_blocks(tokens, ExtraKeys(cache_salt="a"))]
    other = [make_offload_key(h, 0) for h in hasher.hash_blocks(tokens, ExtraKeys(cache_salt="b"))]
    plain = [make_offload_key(h, 0) for h in hasher.hash_blocks(tokens)]
    assert not set(salted) & set(other) and not set(salted) & set(plain)
    values = _payloads(len(salted), 4096, seed=5)
    async with make_redis_backend(target) as node_a, make_redis_backend(target) as node_b:
        assert await node_a.put(salted, values) == [OK] * len(salted)
        out = _buffers(len(salted), 4096)
        assert await node_b.get(other, out) == [MISSING] * len(other)
        assert await node_b.get(plain, out) == [MISSING] * len(plain)
        assert await node_b.get(salted, out) == [OK] * len(salted)  # the same salt does hit
        assert out == values


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "damage",
    ["garbage-header", "zero-header", "truncated-payload", "truncated-tail", "other-key",
     "other-layout", "flipped-bit", "flipped-tail-bit"],
)  # fmt: skip
async def test_foreign_values_are_counted_corrupt_misses(target: Target, damage: str) -> None:
    keys, values = _keys(3, tag=damage), _payloads(3, 4096, seed=6)
    async with make_redis_backend(target) as backend:
        assert await backend.put(keys, values) == [OK] * 3
        header_name, payload_name = backend.redis_keys(keys[1])
        client = raw_client(target)
        try:
            header, payload = client.get(header_name), client.get(payload_name)
            if damage == "garbage-header":  # another client's value under our name
                client.set(header_name, b"garbage from another client")
            elif damage == "zero-header":
                client.set(header_name, bytes(len(header)))
            elif damage == "truncated-payload":
                client.set(payload_name, payload[:-1])
            elif damage == "truncated-tail":
                client.set(header_name, header[:-1])
            elif damage == "other-key":  # key 0's whole block stored under key 1's names
                other_header, other_payload = backend.redis_keys(keys[0])
                client.set(header_name, client.get(other_header))
                client.set(payload_name, client.get(other_payload))
            elif damage == "other-layout":
                foreign = pack_header(keys[1], values[1], b"another-layout!!")
                client.set(header_name, foreign + bytes(values[1][-TAIL_BYTES:]))
            elif damage == "flipped-tail-bit":
                client.set(header_name, header[:-1] + bytes([header[-1] ^ 0x80]))
            else:
                client.set(payload_name, payload[:100] + bytes([payload[100] ^ 1]) + payload[101:])
        finally:
            client.close()
        out = _buffers(3, 4096)
        assert await backend.get(keys, out) == [OK, CORRUPT, OK]
        assert out[0] == values[0] and out[2] == values[2]
        assert backend.stats.corrupt == 1
        assert await backend.contains(keys) == [True, False, True]  # unlinked
        assert await backend.get(keys[1:2], out[1:2]) == [MISSING]


@pytest.mark.asyncio
@pytest.mark.parametrize("damage", ["payload-gone", "header-gone", "payload-of-another-type"])
async def test_half_a_block_is_a_miss_and_the_other_half_goes(target: Target, damage: str) -> None:
    """Evicted or expired apart, deleted by hand, or replaced by another type: a miss (not a
    corrupt block: nothing false was read), and the string left behind is unlinked."""
    keys, values = _keys(2, tag=damage), _payloads(2, 4096, seed=9)
    async with make_redis_backend(target) as backend:
        assert await backend.put(keys, values) == [OK] * 2
        header_name, payload_name = backend.redis_keys(keys[1])
        client = raw_client(target)
        try:
            if damage == "header-gone":
                client.delete(header_name)
            else:
                client.delete(payload_name)
            if damage == "payload-of-another-type":
                client.hset(payload_name, "field", "a hash where a block string was")
            out = _buffers(2, 4096)
            assert await backend.get(keys, out) == [OK, MISSING]
            assert out[0] == values[0]
            assert backend.stats.corrupt == 0
            assert client.exists(header_name, payload_name) == 0
        finally:
            client.close()
        assert await backend.put(keys[1:], values[1:]) == [OK]  # the key can come back
        out = _buffers(2, 4096)
        assert await backend.get(keys, out) == [OK, OK] and out == values


@pytest.mark.asyncio
async def test_ttl_expires_blocks_into_misses(target: Target) -> None:
    keys, values = _keys(2), _payloads(2, 4096, seed=7)
    async with make_redis_backend(target, ttl_s=60.0) as backend:
        assert await backend.put(keys, values) == [OK, OK]
        client = raw_client(target)
        try:
            names = backend.redis_keys(keys[0])
            for name in names:
                assert 0 < client.pttl(name) <= 60_000
                client.pexpire(name, 1)  # make it expire now
            while client.exists(*names):
                await asyncio.sleep(0.01)
        finally:
            client.close()
        out = _buffers(2, 4096)
        assert await backend.get(keys, out) == [MISSING, OK]
        assert out[1] == values[1]


@pytest.mark.asyncio
async def test_held_keys_that_vanish_are_dropped(target: Target) -> None:
    """shared=False: a key Redis evicted (here: deleted by hand) leaves the held set at the
    miss, so usage and room follow what Redis holds."""
    keys, values = _keys(3), _payloads(3, 4096, seed=8)
    async with make_redis_backend(target) as backend:
        assert await backend.put(keys, values) == [OK] * 3
        assert backend.usage_bytes == 3 * backend.footprint_bytes
        client = raw_client(target)
        try:
            client.delete(*backend.redis_keys(keys[0]), *backend.redis_keys(keys[1]))
        finally:
            client.close()
        assert await backend.get(keys[:1], _buffers(1, 4096)) == [MISSING]
        assert await backend.contains(keys) == [False, False, True]
        assert backend.usage_bytes == 1 * backend.footprint_bytes
        assert backend.stats.extra["vanished"] == 2


@pytest.mark.asyncio
async def test_open_recovers_the_namespace_up_to_capacity(target: Target) -> None:
    keys, values = _keys(6), _payloads(6, 4096, seed=9)
    async with make_redis_backend(target, key_prefix="recover") as backend:
        assert await backend.put(keys, values) == [OK] * 6
        footprint = backend.footprint_bytes
    async with make_redis_backend(target, key_prefix="recover-other") as other:
        await other.put(_keys(2, "other"), values[:2])  # another namespace: not recovered
    small = make_redis_backend(target, key_prefix="recover", capacity_bytes=4 * footprint)
    try:
        recovered = await small.open()
        assert len(recovered) == 4 and set(recovered) <= set(keys)
        assert small.stats.extra["recovered_over_capacity"] == 2
        assert small.usage_bytes == 4 * footprint
    finally:
        await small.close()
    async with make_redis_backend(target, key_prefix="recover") as full:
        assert sorted(await full.contains(keys)) == [True] * 6


@pytest.mark.asyncio
async def test_put_if_absent_writes_only_what_the_store_lacks(target: Target) -> None:
    keys = _keys(4)
    first, second = _payloads(4, 4096, seed=10), _payloads(4, 4096, seed=11)
    async with (
        make_redis_backend(target, shared=True) as node_a,
        make_redis_backend(target, shared=True) as node_b,
    ):
        assert await node_a.put(keys[:2], first[:2]) == [OK, OK]
        assert await node_b.put_if_absent(keys, second) == [OK] * 4
        assert node_b.stats.extra["put_skipped_present"] == 2
        assert node_b.stats.bytes_written == 2 * 4096
        out = _buffers(4, 4096)
        assert await node_a.get(keys, out) == [OK] * 4
        assert out == first[:2] + second[2:]
        with pytest.raises(ValueError, match="value 0 is 4095 bytes"):  # even for a present key
            await node_b.put_if_absent(keys[:1], [memoryview(bytearray(4095))])


@pytest.mark.asyncio
async def test_racing_put_if_absent_writes_each_block_once(target: Target) -> None:
    """Two nodes put the same 16 blocks at once: each block is written by exactly one of them
    (MSETNX of both strings), whole, and the other counts it as already there."""
    keys = _keys(16, tag="race")
    va, vb = _payloads(16, 4096, seed=17), _payloads(16, 4096, seed=18)
    async with (
        make_redis_backend(target, shared=True) as node_a,
        make_redis_backend(target, shared=True) as node_b,
    ):
        ra, rb = await asyncio.gather(
            node_a.put_if_absent(keys, va), node_b.put_if_absent(keys, vb)
        )
        assert ra == rb == [OK] * 16
        skipped_a = node_a.stats.extra.get("put_skipped_present", 0)
        skipped_b = node_b.stats.extra.get("put_skipped_present", 0)
        assert skipped_a + skipped_b == 16
        assert node_a.stats.bytes_written + node_b.stats.bytes_written == 16 * 4096
        out = _buffers(16, 4096)
        assert await node_a.get(keys, out) == [OK] * 16
        assert sum(o == a for o, a in zip(out, va, strict=True)) == 16 - skipped_a
        assert sum(o == b for o, b in zip(out, vb, strict=True)) == 16 - skipped_b


@pytest.mark.asyncio
async def test_shared_mode_contains_sees_other_writers(target: Target) -> None:
    keys, values = _keys(5), _payloads(5, 4096, seed=12)
    async with (
        make_redis_backend(target, shared=True) as node_a,
        make_redis_backend(target, shared=True) as node_b,
    ):
        assert await node_b.contains(keys) == [False] * 5
        assert await node_a.put(keys[1:4], values[1:4]) == [OK] * 3
        assert await node_b.contains(keys) == [False, True, True, True, False]


@pytest.mark.asyncio
async def test_server_stats(target: Target) -> None:
    async with make_redis_backend(target) as backend:
        before = await backend.server_stats()
        assert await backend.put(_keys(8), _payloads(8, 4096, seed=13)) == [OK] * 8
        after = await backend.server_stats()
        assert after.keys == before.keys + 2 * 8  # two strings per block
        assert (
            after.nodes
            == after.nodes_answering
            == (3 if isinstance(target, RedisClusterProcesses) else 1)
        )
        assert after.eviction_policies == ("allkeys-lru",)


@pytest.mark.asyncio
@pytest.mark.parametrize("operation", ["put", "get", "contains", "delete"])
async def test_one_pipeline_per_node_per_call(
    target: Target, operation: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call of up to pipeline_bytes per node is one pipeline (one round trip) per node."""
    keys, values = _keys(24), _payloads(24, 4096, seed=14)
    async with make_redis_backend(target) as backend:
        assert await backend.put(keys, values) == [OK] * 24
        assert backend.nodes is not None
        masters = backend.nodes.masters()
        touched = {backend.nodes.node_for(backend.redis_keys(k)[0]).address for k in keys}
        assert len(touched) == len(masters)  # 24 keys land on every node
        pipelines: list[str] = []
        for node in masters:
            make_pipeline = node.client.pipeline

            def counting(*args: Any, _make: Any = make_pipeline, _at: str = node.address,
                         **kwargs: Any) -> Any:  # fmt: skip
                pipelines.append(_at)
                return _make(*args, **kwargs)

            monkeypatch.setattr(node.client, "pipeline", counting)
        if operation == "put":
            assert await backend.put(keys, values) == [OK] * 24
        elif operation == "get":
            assert await backend.get(keys, _buffers(24, 4096)) == [OK] * 24
        elif operation == "contains":
            assert await backend.contains(keys) == [True] * 24
        else:
            assert await backend.delete(keys) == [True] * 24
        assert sorted(pipelines) == sorted(n.address for n in masters)


@pytest.mark.asyncio
async def test_gets_do_not_queue_behind_puts(target: Target) -> None:
    """Every put lane of every node is taken: puts wait, a get still completes."""
    keys, values = _keys(8), _payloads(8, 4096, seed=16)
    async with make_redis_backend(target, pipelines_per_node=1) as backend:
        assert await backend.put(keys, values) == [OK] * 8
        assert backend.nodes is not None
        masters = backend.nodes.masters()
        for node in masters:
            await node.writes.acquire()
        try:
            waiting_put = asyncio.ensure_future(backend.put(keys, values))
            out = _buffers(8, 4096)
            get = backend.get(keys, out)
            assert await asyncio.wait_for(get, timeout=60) == [OK] * 8  # a bound, not a timing
            assert out == values
            assert not waiting_put.done()
        finally:
            for node in masters:
                node.writes.release()
        assert await waiting_put == [OK] * 8


# -- settings ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "exactly one of url"),
        ({"url": "redis://a:1", "cluster_nodes": "a:1"}, "exactly one of url"),
        ({"url": "http://a:1"}, "scheme"),
        ({"url": "redis://user:hunter2@a:1/0"}, "password_env"),
        ({"cluster_nodes": "a:1,b"}, "not host:port"),
        ({"cluster_nodes": "a:1", "db": 2}, "only database 0"),
        ({"url": "redis://a:1", "key_prefix": "{tag}"}, "hash tag"),
        ({"url": "redis://a:1", "password_env": "hunter2 secret"}, "never the password"),
        ({"url": "redis://a:1", "tls_cert_file": Path("c.pem")}, "together"),
        ({"url": "redis://a:1", "tls_ca_file": Path("ca.pem")}, "TLS is off"),
    ],
)
def test_bad_settings_are_clear_errors(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        RedisSettings(**options)


def test_unknown_option_names_the_valid_ones() -> None:
    with pytest.raises(ConfigurationError, match="key_prefix"):
        RedisBackend(capacity_bytes=1 << 30, block_bytes=4096, fingerprint=b"f" * 16, urll="x")


@pytest.mark.asyncio
async def test_password_env_that_is_not_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TIERING_TEST_REDIS_PASSWORD", raising=False)
    backend = RedisBackend(
        capacity_bytes=1 << 30,
        block_bytes=4096,
        fingerprint=b"f" * 16,
        url="redis://127.0.0.1:1/0",
        password_env="TIERING_TEST_REDIS_PASSWORD",
    )
    with pytest.raises(ConfigurationError, match="TIERING_TEST_REDIS_PASSWORD"):
        await backend.open()
    assert not backend.is_open


@pytest.mark.asyncio
async def test_unreachable_server_is_a_clear_error_at_open() -> None:
    port = free_port()
    backend = RedisBackend(
        capacity_bytes=1 << 30,
        block_bytes=4096,
        fingerprint=b"f" * 16,
        url=f"redis://127.0.0.1:{port}/0",
        connect_timeout_s=2.0,
    )
    with pytest.raises(BackendError, match=f"cannot use redis at redis://127.0.0.1:{port}/0: Conn"):
        await backend.open()
    assert not backend.is_open
    await backend.close()
