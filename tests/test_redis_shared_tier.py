"""A shared Redis tier in a TieringOffloadingManager, on real servers: the manager conformance
suite (standalone and step-driven), and what a shared tier does that others do not."""

from __future__ import annotations

import hashlib
import itertools
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from redis.crc import key_slot
from redis_helpers import Target, prefix_for, raw_client, require_redis, target_options

from tiering.backends.memory import MemoryBackend
from tiering.backends.redis import RedisBackend
from tiering.cli import main as cli_main
from tiering.config import build_manager, build_tier, load_config
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigError, ConfigurationError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.protocol import LookupResult, OffloadingManager
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.shared_tier import SharedTier
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.observability.metrics import CATALOGUE, read_samples
from tiering.testing import ManagerTests
from tiering.testing.redis_servers import RedisClusterProcesses, RedisServer

pytest_plugins = ["redis_fixtures"]  # the real-server fixtures

ROW_BYTES = 512
FINGERPRINT = b"shared-tier-fp01"
MISS, HIT, RETRY = LookupResult.MISS, LookupResult.HIT, LookupResult.RETRY
HANG_S = 120.0  # a hang guard only
_made = itertools.count()


class SharedRedisSuite(ManagerTests):
    """ManagerTests for a manager whose only lower tier is a shared Redis Cluster tier; each
    manager gets a namespace of its own (the same calls must meet the same store)."""

    has_lower_tiers = True
    shared_lower_tier = True
    step_driven = False
    cluster: RedisClusterProcesses
    folder: Path
    options: ClassVar[dict[str, object]] = {}

    @pytest.fixture(autouse=True)
    def _cluster(self, redis_cluster: RedisClusterProcesses, tmp_path: Path) -> None:
        self.cluster = redis_cluster
        self.folder = tmp_path

    def make_manager(
        self, num_blocks: int, *, store_threshold: int = 1, enable_events: bool = True
    ) -> OffloadingManager:
        backend = RedisBackend(
            capacity_bytes=64 << 20,
            block_bytes=ROW_BYTES,
            fingerprint=FINGERPRINT,
            key_prefix=f"{prefix_for(self.folder)}-{next(_made)}",
            shared=True,
            **target_options(self.cluster),
        )
        # Answers never expire within a test: a step that outlasted them would ask again.
        tier = SharedTier(backend, name="redis", existence_cache_seconds=3600.0)
        pool = torch.zeros(num_blocks, ROW_BYTES, dtype=torch.uint8)
        manager = TieringOffloadingManager(
            CPUOffloadingManager(num_blocks, "lru", store_threshold=store_threshold),
            [tier],
            pool=pool,
            enable_events=enable_events,
            step_driven=self.step_driven,
        )
        manager.wait_ready()
        self.remember_rows(manager, pool.numpy())
        return manager

    def settle(self, manager: OffloadingManager) -> None:
        assert isinstance(manager, TieringOffloadingManager)
        manager.on_schedule_end()
        manager.wait_idle()


class TestSharedRedisTier(SharedRedisSuite):
    pass


class TestSharedRedisTierStepDriven(SharedRedisSuite):
    step_driven = True


# -- what a shared tier does that other tiers do not --------------------------------------------

BLOCK = 16 << 10


def _key(i: int, tag: str = "k") -> OffloadKey:
    return make_offload_key(hashlib.sha256(f"{tag}{i}".encode()).digest(), 0)


def _payload(key: bytes, row_bytes: int = BLOCK) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
    return np.frombuffer(random.Random(seed).randbytes(row_bytes), np.uint8)


class Node:
    """One engine node in this process: a CPU tier of ``num_blocks`` and a shared Redis tier."""

    def __init__(
        self,
        target: Target,
        prefix: str,
        *,
        num_blocks: int = 64,
        step_driven: bool = False,
        backend_options: dict[str, Any] | None = None,
        **tier_options: Any,
    ) -> None:
        self.backend = RedisBackend(
            capacity_bytes=1 << 30,
            block_bytes=BLOCK,
            fingerprint=FINGERPRINT,
            key_prefix=prefix,
            shared=True,
            **target_options(target),
            **(backend_options or {}),
        )
        tier_options.setdefault("existence_cache_seconds", 3600.0)
        self.tier = SharedTier(self.backend, name="redis", **tier_options)
        self.pool = torch.zeros(num_blocks, BLOCK, dtype=torch.uint8)
        self.rows = self.pool.numpy()
        self.manager = TieringOffloadingManager(
            CPUOffloadingManager(num_blocks), [self.tier], pool=self.pool, step_driven=step_driven
        )
        self.manager.wait_ready()
        assert self.tier.is_open, self.tier.open_error

    def store(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """A whole store (prepare, write the payloads, complete), then the step's end."""
        out = self.manager.prepare_store(list(keys))
        assert out is not None
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True):
            self.rows[slot] = _payload(key)
        self.manager.complete_store(list(keys))
        self.settle()
        return list(out.keys_to_store)

    def lookup(self, keys: Sequence[OffloadKey], req: object = "r") -> list[LookupResult]:
        return [self.manager.lookup_result(k, req) for k in keys]

    def settle(self) -> None:
        self.manager.on_schedule_end()
        self.manager.wait_idle()

    def load_exact(self, keys: Sequence[OffloadKey]) -> None:
        spec = self.manager.prepare_load(list(keys))
        for key, slot in zip(keys, spec.block_ids.tolist(), strict=True):
            assert np.array_equal(self.rows[slot], _payload(key)), key.hex()
        self.manager.complete_load(list(keys))

    def stats(self) -> dict[str, int]:
        return self.manager.get_stats()["redis"]

    def close(self) -> None:
        self.manager.shutdown()


@pytest.fixture
def make_node(tmp_path: Path) -> Iterator[Any]:
    made: list[Node] = []

    def make(target: Target, **options: Any) -> Node:
        node = Node(target, prefix_for(tmp_path), **options)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()


def test_the_tier_classes_refuse_the_wrong_backend() -> None:
    shared = RedisBackend(capacity_bytes=1 << 30, block_bytes=BLOCK, fingerprint=FINGERPRINT,
                          url="redis://127.0.0.1:1/0", shared=True)  # fmt: skip
    owned = RedisBackend(capacity_bytes=1 << 30, block_bytes=BLOCK, fingerprint=FINGERPRINT,
                         url="redis://127.0.0.1:1/0")  # fmt: skip
    with pytest.raises(ConfigurationError, match="would delete other nodes' blocks"):
        SecondaryTier(shared)
    with pytest.raises(ConfigurationError, match="is not shared"):
        SharedTier(owned)
    with pytest.raises(ConfigurationError, match="cannot be write_back"):
        SharedTier(shared, write_policy="write_back")
    with pytest.raises(ConfigurationError, match="quarantine_seconds > 0"):
        SharedTier(shared, quarantine_seconds=0)
    with pytest.raises(ConfigurationError, match="existence_cache_seconds must be > 0"):
        SharedTier(shared, existence_cache_seconds=0)
    with pytest.raises(ConfigurationError, match="at most one shared tier"):
        TieringOffloadingManager(
            CPUOffloadingManager(4),
            [SharedTier(shared, name="one"), SharedTier(shared, name="two")],
            pool=torch.zeros(4, BLOCK, dtype=torch.uint8),
        )


def _redis_yaml(tmp_path: Path, extra: str = "", tier_type: str = "redis") -> Path:
    """A config file with one tier: a shared redis tier (no server behind it: nothing here
    opens it), or a memory tier; ``extra`` adds YAML lines to the tier."""
    if tier_type == "redis":
        tier = "type: redis\n    capacity: 1GiB\n    url: redis://127.0.0.1:1/0\n    shared: true"
    else:
        tier = "type: memory\n    capacity: 1MiB"
    path = tmp_path / "tiering.yaml"
    path.write_text(
        "version: 1\nprimary:\n  capacity: 1MiB\nsecondary_tiers:\n"
        f"  - name: shared\n    {tier}{extra}\n"
    )
    return path


def test_config_builds_a_shared_tier(tmp_path: Path) -> None:
    path = _redis_yaml(
        tmp_path, "\n    existence_cache_seconds: 0.5\n    existence_cache_max_keys: 9"
    )
    (tier_config,) = load_config(path).secondary_tiers
    tier = build_tier(tier_config, block_bytes=BLOCK, fingerprint=FINGERPRINT)
    assert isinstance(tier, SharedTier)
    assert tier.existence_cache_seconds == 0.5 and tier.existence_cache_max_keys == 9
    info = tier.config_info()
    assert info["shared"] is True and info["policy"] == "none"
    default = build_tier(
        load_config(_redis_yaml(tmp_path)).secondary_tiers[0], block_bytes=BLOCK,
        fingerprint=FINGERPRINT,
    )  # fmt: skip
    assert isinstance(default, SharedTier) and default.existence_cache_seconds == 2.0


@pytest.mark.parametrize(
    ("extra", "tier_type", "message"),
    [
        ("\n    policy: arc", "redis", "a shared tier keeps no eviction order"),
        ("\n    write_policy: write_back", "redis", "cannot be write_back"),
        ("\n    quarantine_seconds: 0", "redis", "quarantine_seconds > 0"),
        ("\n    existence_cache_seconds: 1", "memory", "apply to shared tiers only"),
    ],
)
def test_config_refuses_what_a_shared_tier_cannot_do(
    tmp_path: Path, extra: str, tier_type: str, message: str
) -> None:
    config = load_config(_redis_yaml(tmp_path, extra, tier_type))
    with pytest.raises(ConfigError, match=message) as info:
        build_manager(config, block_bytes=BLOCK, fingerprint=FINGERPRINT)
    assert str(info.value).startswith(f"{tmp_path / 'tiering.yaml'}: secondary_tiers[0]")
    with pytest.raises(ConfigError, match=message):
        build_tier(config.secondary_tiers[0], block_bytes=BLOCK, fingerprint=FINGERPRINT)


def test_config_check_refuses_them_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _redis_yaml(tmp_path, "\n    write_policy: write_back")
    text = path.read_text().replace("version: 1\n", "version: 1\nmodel:\n  shape: tiny\n")
    path.write_text(text)
    assert cli_main(["config", "check", str(path)]) != 0
    assert "cannot be write_back" in capsys.readouterr().err


@pytest.mark.parametrize("step_driven", [False, True], ids=["standalone", "step_driven"])
def test_one_existence_check_per_request(
    redis_standalone: RedisServer, make_node: Any, step_driven: bool
) -> None:
    node = make_node(redis_standalone, step_driven=step_driven)
    manager = node.manager
    first, second = [_key(i) for i in range(10)], [_key(i) for i in range(10, 15)]
    assert node.lookup(first, "r1") == [RETRY] * 10
    assert [j.kind for j in manager.inflight_jobs()] == []  # batched, not asked yet
    if step_driven:
        assert node.lookup(first, "r1") == [RETRY] * 10  # asked again in the step: one batch
    assert node.lookup(second, "r2") == [RETRY] * 5  # standalone: r2's call submits r1's batch
    if step_driven:
        assert manager.inflight_jobs() == []  # nothing leaves the step before its end
        manager.on_schedule_end()
        checks = sorted(len(j.keys) for j in manager.inflight_jobs() if j.kind == "check")
        assert checks == [5, 10]
    manager.on_schedule_end()
    manager.wait_idle()
    assert node.lookup(first + second) == [MISS] * 15  # cached: no more checks
    stats = node.stats()
    assert stats["existence_checks"] == 2 and stats["checked_keys"] == 15
    assert stats["check_hits"] == 0 and stats["cached_misses"] == 15
    # a prefix lookup asks about the keys after the primary's run, in one check
    node.store([_key(100), _key(101)])
    keys = [_key(100), _key(101), _key(102), _key(103)]
    assert manager.lookup_prefix(keys, req_context="r3") is None
    node.settle()
    assert manager.lookup_prefix(keys, req_context="r3") == 2
    stats = node.stats()
    assert stats["existence_checks"] == 1 and stats["checked_keys"] == 2


def test_keys_no_backend_stores_are_never_asked_about(
    redis_standalone: RedisServer, make_node: Any
) -> None:
    node = make_node(redis_standalone)
    assert node.lookup([OffloadKey(b"abc"), OffloadKey(b"x" * 81)]) == [MISS, MISS]
    node.settle()
    assert node.stats()["existence_checks"] == 0


def test_answers_expire(redis_standalone: RedisServer, make_node: Any) -> None:
    """An answer is trusted for existence_cache_seconds: a block another node writes meanwhile
    is found once the "absent" answer has expired."""
    reader = make_node(redis_standalone, existence_cache_seconds=0.2)
    writer = make_node(redis_standalone)
    keys = [_key(i, "late") for i in range(3)]
    assert reader.lookup(keys) == [RETRY] * 3
    reader.settle()
    assert reader.lookup(keys) == [MISS] * 3
    writer.store(keys)
    time.sleep(0.25)  # past the answers' lifetime (a monotonic clock: never sooner)
    assert reader.lookup(keys) == [RETRY] * 3
    reader.settle()
    assert reader.lookup(keys) == [HIT] * 3
    reader.load_exact(keys)


def test_writes_skip_what_the_store_holds(redis_standalone: RedisServer, make_node: Any) -> None:
    a = make_node(redis_standalone, num_blocks=8)
    b = make_node(redis_standalone, num_blocks=8)
    keys = [_key(i, "w") for i in range(4)]
    a.store(keys)
    assert a.stats()["stored_blocks"] == 4 and a.backend.stats.bytes_written == 4 * BLOCK
    b.store(keys)  # b knows nothing: it sends them, the store keeps a's
    stats = b.stats()
    assert stats["stored_blocks"] == 4 and stats["put_skipped_present"] == 4
    assert b.backend.stats.bytes_written == 0
    # a block the cache says is there is not even sent
    fillers = [_key(i, "fill") for i in range(8)]
    a.store(fillers)  # evicts keys from a's CPU tier; a's cache still knows they are stored
    puts = a.backend.stats.puts
    a.store(keys)
    assert a.stats()["writes_skipped_cached"] == 4 and a.backend.stats.puts == puts


def test_selective_writes(redis_standalone: RedisServer, make_node: Any) -> None:
    node = make_node(redis_standalone, write_policy="write_through_selective",
                     selective_min_lookups=2)  # fmt: skip
    looked, fresh = _key(1, "sel"), _key(2, "sel")
    for _ in range(2):
        assert node.lookup([looked]) in ([RETRY], [MISS])
        node.settle()
    node.store([looked, fresh])
    assert node.stats()["stored_blocks"] == 1
    assert node.backend.stats.bytes_written == BLOCK


def test_a_shared_tier_takes_an_admission_gate(
    redis_standalone: RedisServer, make_node: Any
) -> None:
    node = make_node(redis_standalone, admission_min_count=2)
    looked, once, fresh = _key(1, "adm"), _key(2, "adm"), _key(3, "adm")
    for key, lookups in ((looked, 2), (once, 1)):
        for _ in range(lookups):
            assert node.lookup([key]) in ([RETRY], [MISS])
            node.settle()
    node.store([looked, once, fresh])
    stats = node.manager.metrics()["redis"]
    assert stats["stored_blocks"] == 1 and stats["stores_not_admitted"] == 2
    assert node.backend.stats.bytes_written == BLOCK
    other = make_node(redis_standalone, num_blocks=8)  # another node finds only the admitted
    assert other.lookup([looked, once]) == [RETRY, RETRY]  # asked with the request's batch
    other.settle()
    assert other.lookup([looked, once]) == [HIT, MISS]  # found and promoted; absent
    other.load_exact([looked])


def test_reset_cache_turns_the_shared_tier_off_and_deletes_nothing(
    redis_standalone: RedisServer, make_node: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """After reset_cache (a weight update) a node must never read blocks of the old weights,
    nor delete the other nodes' blocks: its shared tier stops reading and writing."""
    a, b = make_node(redis_standalone), make_node(redis_standalone)
    keys = [_key(i, "reset") for i in range(3)]
    a.store(keys)
    a.manager.reset_cache()
    assert a.backend.stats.deletes == 0
    assert a.tier.status == "reset" and "old weights" in caplog.text
    assert a.lookup(keys) == [MISS] * 3  # not even asked about
    puts = a.backend.stats.puts
    a.store([_key(9, "reset")])
    a.settle()
    assert a.backend.stats.puts == puts and a.stats()["existence_checks"] == 0
    assert a.manager.metrics()["redis"]["status"] == "reset"
    assert b.lookup(keys) == [RETRY] * 3  # the other node keeps sharing
    b.settle()
    assert b.lookup(keys) == [HIT] * 3
    b.load_exact(keys)


def test_a_value_overwritten_with_garbage_is_a_counted_miss(
    redis_standalone: RedisServer, make_node: Any
) -> None:
    writer, reader = make_node(redis_standalone), make_node(redis_standalone)
    keys = [_key(i, "garbage") for i in range(3)]
    writer.store(keys)
    _, payload_name = writer.backend.redis_keys(keys[1])
    client = raw_client(redis_standalone)
    try:
        client.set(payload_name, b"\x00garbage" * 100)
    finally:
        client.close()
    assert reader.lookup(keys) == [RETRY] * 3
    reader.settle()
    assert reader.lookup(keys) == [HIT, MISS, HIT]  # never served, now known absent
    reader.load_exact([keys[0], keys[2]])
    stats = reader.stats()
    assert stats["corrupt_blocks"] == 1 and stats["promotion_failures"] == 1
    assert stats["check_hits"] == 3 and stats["promoted_blocks"] == 2
    assert reader.backend.stats.corrupt == 1
    header_name, payload_name = writer.backend.redis_keys(keys[1])
    client = raw_client(redis_standalone)
    try:
        assert client.exists(header_name, payload_name) == 0  # unlinked
    finally:
        client.close()


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[RedisServer]:
    require_redis()
    server = RedisServer(tmp_path / "small", maxmemory_bytes=4 << 20,
                         maxmemory_policy="allkeys-lru")  # fmt: skip
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_redis_evicting_under_maxmemory_is_misses(
    small_server: RedisServer, make_node: Any
) -> None:
    writer = make_node(small_server, num_blocks=16)
    keys = [_key(i, "evict") for i in range(480)]  # 7.5 MiB of payload, twice maxmemory
    for start in range(0, len(keys), 16):
        writer.store(keys[start : start + 16])
    assert writer.stats()["stored_blocks"] == 480
    client = raw_client(small_server)
    try:
        held = [client.exists(*writer.backend.redis_keys(k)) == 2 for k in keys]
        assert int(client.info("stats")["evicted_keys"]) > 0
    finally:
        client.close()
    assert 0 < sum(held) < 480
    # another node asks the store: what Redis evicted is a miss, the rest a hit (or a miss
    # too, if Redis evicted it between the check and the read: reply buffers count toward
    # maxmemory, so the reads themselves make Redis evict)
    reader = make_node(small_server, num_blocks=512)
    assert reader.lookup(keys) == [RETRY] * 480
    reader.settle()
    answers = reader.lookup(keys)
    assert all(a is MISS for a, h in zip(answers, held, strict=True) if not h)
    hits = [k for k, a in zip(keys, answers, strict=True) if a is HIT]
    assert hits and set(answers) == {HIT, MISS}
    reader.load_exact(hits)
    stats = reader.stats()
    assert stats["promoted_blocks"] == len(hits) and stats["corrupt_blocks"] == 0
    assert stats["check_hits"] - len(hits) == stats["promotion_failures"]  # gone before read
    # the writer's cache believes it stored them all: its promotions find the evicted ones gone
    old = [k for k, h in zip(keys, held, strict=True) if not h][:16]
    assert writer.lookup(old) == [RETRY] * len(old)
    writer.settle()
    assert writer.lookup(old) == [MISS] * len(old)
    stats = writer.stats()
    assert stats["promotion_failures"] == len(old) and stats["corrupt_blocks"] == 0


@pytest.fixture
def own_cluster(tmp_path: Path) -> Iterator[RedisClusterProcesses]:
    """A cluster of this test's own (it will be hurt)."""
    require_redis()
    processes = RedisClusterProcesses(tmp_path / "cluster")
    try:
        processes.start()
        yield processes
    finally:
        processes.stop()


def test_a_cluster_node_killed_mid_run(own_cluster: RedisClusterProcesses, make_node: Any) -> None:
    """Keys on a dead master are misses (never exceptions), the others keep hitting, serving
    goes on; once the master is back (empty), its keys are written and read again."""
    fast = {"backend_options": {"retry_interval_s": 0.2, "timeout_s": 5.0},
            "quarantine_seconds": 0.5}  # fmt: skip
    writer = make_node(own_cluster, num_blocks=16, **fast)
    keys = [_key(i, "kill") for i in range(32)]
    writer.store(keys[:16])
    writer.store(keys[16:])  # the first half left the writer's CPU tier
    slot_of = {k: key_slot(writer.backend.redis_keys(k)[0]) for k in keys}
    victim = own_cluster.node_for_slot(slot_of[keys[0]])
    on_victim = [own_cluster.node_for_slot(slot_of[k]) is victim for k in keys]
    assert 0 < sum(on_victim[:16]) < 16
    victim.kill()

    # the writer's cache says the first half is stored: promotions of the victim's keys fail
    first = keys[:16]
    assert writer.lookup(first) == [RETRY] * 16
    writer.settle()
    assert writer.lookup(first) == [MISS if v else HIT for v in on_victim[:16]]
    writer.load_exact([k for k, v in zip(first, on_victim, strict=False) if not v])
    # a node that knows nothing asks: the victim's keys are unknown (quarantined), not absent
    reader = make_node(own_cluster, **fast)
    assert reader.lookup(keys) == [RETRY] * 32
    reader.settle()
    assert reader.lookup(keys) == [MISS if v else HIT for v in on_victim]
    stats = reader.stats()
    assert stats["check_unknown"] == sum(on_victim) and stats["check_hits"] == 32 - sum(on_victim)
    reader.load_exact([k for k, v in zip(keys, on_victim, strict=True) if not v])
    # serving goes on: new stores reach the live masters, the victim's share fails (counted)
    fresh = [_key(i, "during") for i in range(16)]
    writer.stats()  # (stats are deltas: from here on)
    writer.store(fresh)
    down = sum(own_cluster.node_for_slot(key_slot(writer.backend.redis_keys(k)[0])) is victim
               for k in fresh)  # fmt: skip
    stats = writer.stats()
    assert stats["store_failures"] == down and stats["stored_blocks"] == 16 - down

    victim.start()  # back, empty (it persisted nothing)
    own_cluster.wait_ok()  # (a backend opening meanwhile may ask it first, and it says "fail")
    lost = [k for k, v in zip(keys, on_victim, strict=True) if v]
    deadline = time.monotonic() + HANG_S
    while True:  # until the victim takes writes again (a node of its own per attempt)
        again = make_node(own_cluster, num_blocks=32, **fast)
        again.store(lost)
        if again.stats()["stored_blocks"] == len(lost):
            break
        assert time.monotonic() < deadline, "the restarted master never took a write"
    late = make_node(own_cluster, **fast)
    assert late.lookup(lost) == [RETRY] * len(lost)
    late.settle()
    assert late.lookup(lost) == [HIT] * len(lost)
    late.load_exact(lost)
    assert not late.backend.degraded


def test_a_resharded_slot_is_a_hit_not_a_quarantine(
    own_cluster: RedisClusterProcesses, make_node: Any
) -> None:
    """After a resharding, the first check and the first read of a moved key get MOVED from
    the old master: both follow the reply to the new one, the key is a hit with its bytes,
    and nothing is quarantined (the store still holds it)."""
    writer = make_node(own_cluster, num_blocks=16)
    keys = [_key(i, "reshard") for i in range(32)]
    writer.store(keys[:16])
    writer.store(keys[16:])  # the first half left the writer's CPU tier
    reader = make_node(own_cluster)  # knows nothing: it asks (EXISTS) first
    slot_of = {k: key_slot(writer.backend.redis_keys(k)[0]) for k in keys}
    moved_keys = [k for k in keys[:16] if slot_of[k] == slot_of[keys[0]]]
    source = own_cluster.node_for_slot(slot_of[keys[0]])
    target = next(n for n in own_cluster.nodes if n is not source)
    assert own_cluster.move_slot(slot_of[keys[0]], target) == 2 * len(
        [k for k in keys if slot_of[k] == slot_of[keys[0]]]
    )

    first = keys[:16]  # the writer's cache says stored: the promotions read at once
    assert writer.lookup(first) == [RETRY] * 16
    writer.settle()
    assert writer.lookup(first) == [HIT] * 16
    writer.load_exact(first)
    assert reader.lookup(keys) == [RETRY] * 32
    reader.settle()
    assert reader.lookup(keys) == [HIT] * 32
    reader.load_exact(keys)
    for node in (writer, reader):  # each learnt of the move from MOVED replies
        metrics = node.tier.metrics
        assert metrics.quarantined == metrics.check_unknown == metrics.promotion_failures == 0
        assert len(node.tier._quarantine) == 0
        assert node.backend.stats.extra["redirections"] >= len(moved_keys)
        assert not node.backend.degraded


def test_prometheus_samples_of_a_shared_tier(redis_standalone: RedisServer, make_node: Any) -> None:
    writer, reader = make_node(redis_standalone), make_node(redis_standalone)
    keys = [_key(i, "prom") for i in range(4)]
    writer.store(keys[:2])
    assert reader.lookup(keys) == [RETRY] * 4
    reader.settle()
    assert reader.lookup(keys) == [HIT, HIT, MISS, MISS]
    reader.store(keys[2:])
    samples = {(s.name, s.labels[2:]): s.value for s in read_samples(reader.manager)}
    assert samples[("tiering_existence_checks", ())] == 1
    assert samples[("tiering_checked_keys", ("present",))] == 2
    assert samples[("tiering_checked_keys", ("absent",))] == 2
    assert samples[("tiering_checked_keys", ("unknown",))] == 0
    assert samples[("tiering_cached_misses", ())] == 2
    assert samples[("tiering_skipped_writes", ("cached",))] == 0
    writer_samples = {(s.name, s.labels[2:]): s.value for s in read_samples(writer.manager)}
    assert writer_samples[("tiering_stored_blocks", ())] == 2
    names = {s.name for s in read_samples(writer.manager)}
    # Not sampled: the histogram (latency_records), and the hints followed (its primary's policy,
    # LRU, follows none).
    unsampled = {"tiering_job_latency_seconds", "tiering_hints_followed"}
    assert {spec.name for spec in CATALOGUE} - names == unsampled


def test_a_shared_tier_is_the_last_tier() -> None:
    shared = RedisBackend(capacity_bytes=1 << 30, block_bytes=BLOCK, fingerprint=FINGERPRINT,
                          url="redis://127.0.0.1:1/0", shared=True)  # fmt: skip
    local = MemoryBackend(capacity_bytes=1 << 20, block_bytes=BLOCK, fingerprint=FINGERPRINT)
    with pytest.raises(ConfigurationError, match="must be the last tier"):
        TieringOffloadingManager(
            CPUOffloadingManager(4),
            [SharedTier(shared, name="redis"), SecondaryTier(local, name="mem")],
            pool=torch.zeros(4, BLOCK, dtype=torch.uint8),
        )


def test_a_local_tier_before_the_shared_one_is_asked_first(
    redis_standalone: RedisServer, tmp_path: Path
) -> None:
    """A key a local tier holds is promoted from it; only the others are asked about."""
    backend = RedisBackend(capacity_bytes=1 << 30, block_bytes=BLOCK, fingerprint=FINGERPRINT,
                           key_prefix=prefix_for(tmp_path), shared=True,
                           url=redis_standalone.url)  # fmt: skip
    local = MemoryBackend(capacity_bytes=1 << 20, block_bytes=BLOCK, fingerprint=FINGERPRINT)
    pool = torch.zeros(4, BLOCK, dtype=torch.uint8)
    manager = TieringOffloadingManager(
        CPUOffloadingManager(4),
        [SecondaryTier(local, name="mem"), SharedTier(backend, name="redis")],
        pool=pool,
    )
    try:
        manager.wait_ready()
        keys = [_key(i, "local") for i in range(5)]
        out = manager.prepare_store(keys[:4])
        assert out is not None
        manager.complete_store(keys[:4])
        manager.wait_idle()
        out = manager.prepare_store(keys[4:])  # evicts keys[0] from the CPU tier
        assert out is not None and out.evicted_keys == [keys[0]]
        manager.complete_store(keys[4:])
        manager.wait_idle()
        stats = manager.get_stats()
        assert manager.lookup_result(keys[0], "r") is RETRY
        manager.wait_idle()
        assert manager.lookup_result(keys[0], "r") is HIT
        stats = manager.get_stats()
        assert stats["mem"]["promoted_blocks"] == 1
        assert stats["redis"]["existence_checks"] == 0 and stats["redis"]["promotions"] == 0
    finally:
        manager.shutdown()


def test_location_unknown_tells_a_check_from_a_promotion(
    redis_standalone: RedisServer, make_node: Any
) -> None:
    writer = make_node(redis_standalone)
    reader = make_node(redis_standalone, step_driven=True)
    stored, nobody = _key(1, "where"), _key(2, "where")
    writer.store([stored])
    assert reader.lookup([stored, nobody]) == [RETRY, RETRY]
    manager = reader.manager
    assert manager.location_unknown(stored) and manager.location_unknown(nobody)
    manager.on_schedule_end()  # the check is sent
    manager.wait_idle()  # ... and applied: stored is promoted, nobody is known absent
    assert reader.lookup([stored, nobody]) == [HIT, MISS]
    assert not manager.location_unknown(stored) and not manager.location_unknown(nobody)
    assert not writer.manager.location_unknown(stored)  # in its CPU tier
    plain = TieringOffloadingManager(
        CPUOffloadingManager(4), [], pool=torch.zeros(4, BLOCK, dtype=torch.uint8)
    )
    try:
        assert not plain.location_unknown(nobody)
    finally:
        plain.shutdown()
