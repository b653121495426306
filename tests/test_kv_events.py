"""KV events over ZMQ: real PUB/SUB and ROUTER/DEALER sockets, decoded as vLLM's subscribers do."""

from __future__ import annotations

import errno
import inspect
import socket
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq

from tiering.backends.memory import MemoryBackend
from tiering.core.block_format import HEADER_BYTES, make_layout_fingerprint
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigurationError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.protocol import OffloadingEvent
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.observability.kv_events import (
    DEFAULT_ENDPOINT,
    END_SEQ,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    decode_batch,
    to_kv_events,
)
from tiering.testing.redis_servers import free_port

ROW_BYTES = 128
POLL_MS = 5_000  # an upper bound that only a broken publisher reaches


def key(i: int, group: int = 0) -> OffloadKey:
    # A 32-byte hash whose last 8 bytes are i: the int form of the hash is i.
    return make_offload_key(b"\xab" * 24 + i.to_bytes(8, "big"), group)


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)  # closes what a failed test left open, so it cannot hang


def subscriber(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, topic: str) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(endpoint)
    return sub


def receive(sub: zmq.Socket[bytes]) -> tuple[bytes, int, EventBatch]:
    assert sub.poll(POLL_MS), "no batch arrived"
    topic, seq, payload = sub.recv_multipart()
    return topic, int.from_bytes(seq, "big"), decode_batch(payload)


def wait_subscribed(publisher: KVEventPublisher, sub: zmq.Socket[bytes]) -> int:
    """Publish one-key batches until the subscriber sees one (a SUB socket misses what is sent
    before its subscription reaches the publisher), then take the probes still on their way
    (sent while the first was in flight: on a busy machine, 10 ms is not enough for one);
    returns the sequence number of the last probe, so the next batch is the test's own."""
    for attempt in range(1000):
        publisher.publish([OffloadingEvent((key(10_000 + attempt),), "CPU", False)])
        publisher.flush()
        if sub.poll(10):
            _, seq, _ = receive(sub)
            last_probe = publisher.stats.batches_published - 1
            while seq < last_probe:  # once subscribed, every later probe arrives, in order
                _, seq, _ = receive(sub)
            return seq
    raise AssertionError("the subscriber never received a batch")


def test_events_map_keys_media_and_owners() -> None:
    events = [
        OffloadingEvent((key(1), key(2, group=1), key(3)), "CPU", False),
        OffloadingEvent((key(4),), "NVME", True),
    ]
    kv = to_kv_events(events, tier_names={"NVME": "nvme"})
    assert kv == [
        BlockStored([1, 3], None, [], 0, None, "CPU", None, group_idx=0),
        BlockStored([2], None, [], 0, None, "CPU", None, group_idx=1),
        BlockRemoved([4], "STORAGE", group_idx=0, ownership="nvme"),
    ]
    raw = to_kv_events(events[1:], hash_format="bytes")
    assert raw == [
        BlockRemoved([b"\xab" * 24 + (4).to_bytes(8, "big")], "STORAGE", 0, None, "nvme")
    ]


def test_wire_format_is_vllms(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    """Frames (topic, seq, payload); the payload as plain msgpack is vLLM's array-like batch
    holding tagged maps with vLLM's field names."""
    with KVEventPublisher(
        "tcp://127.0.0.1:*", topic="kv", data_parallel_rank=3, context=context
    ) as publisher:
        sub = subscriber(context, publisher.endpoint, "kv")
        wait_subscribed(publisher, sub)
        publisher.publish([OffloadingEvent((key(7),), "LMDB", False)], ts=12.5)
        publisher.flush()
        assert sub.poll(POLL_MS)
        topic, seq_bytes, payload = sub.recv_multipart()
        sub.close()
    assert topic == b"kv" and len(seq_bytes) == 8
    assert msgspec.msgpack.decode(payload) == [
        12.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [7],
                "parent_block_hash": None,
                "token_ids": [],
                "block_size": 0,
                "lora_id": None,
                "medium": "STORAGE",
                "lora_name": None,
                "group_idx": 0,
                "ownership": "lmdb",
            }
        ],
        3,
    ]


def test_sequence_numbers_and_replay_for_a_late_subscriber(
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    with KVEventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", context=context
    ) as publisher:
        assert publisher.replay_endpoint is not None
        # Three batches before anyone listens: only the replay socket can give them.
        for i in range(3):
            publisher.publish([OffloadingEvent((key(i),), "CPU", i == 2)])
        publisher.flush()
        sub = subscriber(context, publisher.endpoint, "")
        first_live = wait_subscribed(publisher, sub)
        assert first_live >= 3
        publisher.publish([OffloadingEvent((key(99),), "CPU", False)])
        publisher.flush()
        _, seq, batch = receive(sub)
        assert seq == first_live + 1  # consecutive
        assert batch.events == [BlockStored([99], None, [], 0, None, "CPU", None, group_idx=0)]

        # The subscriber missed 0..first_live-1: ask the replay socket from 0.
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed: list[tuple[int, EventBatch]] = []
        while True:
            assert dealer.poll(POLL_MS), "the replay never ended"
            empty, topic, seq_bytes, payload = dealer.recv_multipart()
            assert empty == b""
            if seq_bytes == END_SEQ:
                assert (topic, payload) == (b"", b"")
                break
            replayed.append((int.from_bytes(seq_bytes, "big"), decode_batch(payload)))
        dealer.close()
        sub.close()
    assert [s for s, _ in replayed] == list(range(first_live + 2))
    assert [b.events[0] for _, b in replayed[:3]] == [
        BlockStored([0], None, [], 0, None, "CPU", None, group_idx=0),
        BlockStored([1], None, [], 0, None, "CPU", None, group_idx=0),
        BlockRemoved([2], "CPU", group_idx=0),
    ]
    assert all(b.data_parallel_rank == 0 for _, b in replayed)
    assert publisher.stats.batches_published == first_live + 2
    assert publisher.stats.replay_requests == 1


def test_replay_buffer_keeps_the_last_batches(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KVEventPublisher(
        "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", buffer_steps=2, context=context
    ) as publisher:
        assert publisher.replay_endpoint is not None
        for i in range(5):
            publisher.publish([OffloadingEvent((key(i),), "CPU", False)])
        publisher.flush()
        req = context.socket(zmq.REQ)  # what vLLM's subscriber example uses
        req.setsockopt(zmq.LINGER, 0)
        req.connect(publisher.replay_endpoint)
        req.send((1).to_bytes(8, "big"))
        assert req.poll(POLL_MS)
        topic, seq_bytes, payload = req.recv_multipart()
        req.close()
    assert int.from_bytes(seq_bytes, "big") == 3  # 0..2 fell out of a 2-batch buffer
    assert decode_batch(payload).events[0] == BlockStored(
        [3], None, [], 0, None, "CPU", None, group_idx=0
    )


def test_a_managers_events_of_every_medium(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    fingerprint = make_layout_fingerprint({"kv-events": ROW_BYTES})
    backend = MemoryBackend(
        capacity_bytes=8 * (HEADER_BYTES + ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=fingerprint,
    )
    manager = TieringOffloadingManager(
        CPUOffloadingManager(2, "lru", enable_events=True),
        [SecondaryTier(backend, name="ram")],
        pool=torch.zeros(2, ROW_BYTES, dtype=torch.uint8),
    )
    try:
        manager.wait_ready()
        with KVEventPublisher(
            "tcp://127.0.0.1:*",
            tier_names={t.medium: t.name for t in manager.tiers},
            context=context,
        ) as publisher:
            sub = subscriber(context, publisher.endpoint, "")
            wait_subscribed(publisher, sub)
            for i in range(3):  # the third store evicts key 0 from the CPU tier
                out = manager.prepare_store([key(i)])
                assert out is not None
                manager.complete_store(out.keys_to_store)
                manager.wait_idle()
            publisher.publish(manager.take_events())
            publisher.flush()
            _, _, batch = receive(sub)
            sub.close()
    finally:
        manager.shutdown()
    seen = {
        (type(e).__name__, e.medium, e.ownership, tuple(e.block_hashes))
        for e in batch.events
        if isinstance(e, BlockStored | BlockRemoved)
    }
    assert seen == {
        ("BlockStored", "CPU", None, (0,)),
        ("BlockStored", "CPU", None, (1,)),
        ("BlockStored", "CPU", None, (2,)),
        ("BlockRemoved", "CPU", None, (0,)),
        ("BlockStored", "STORAGE", "ram", (0,)),
        ("BlockStored", "STORAGE", "ram", (1,)),
        ("BlockStored", "STORAGE", "ram", (2,)),
    }


def test_an_endpoint_in_use_is_a_clear_error(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    with KVEventPublisher("tcp://127.0.0.1:*", context=context) as first:
        with pytest.raises(ConfigurationError, match=r"cannot bind KV events endpoint 'tcp://"):
            KVEventPublisher(first.endpoint.replace("127.0.0.1", "*"), context=context)
    with pytest.raises(ConfigurationError, match="hash_format"):
        KVEventPublisher("tcp://127.0.0.1:*", hash_format="hex", context=context)  # type: ignore[arg-type]


def _listening(port: int) -> bool:
    """Whether something listens on ``port`` of 127.0.0.1 (a bind there fails)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            assert exc.errno == errno.EADDRINUSE, exc
            return True
    return False


def test_the_default_endpoint_binds_loopback_only(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    default = inspect.signature(KVEventPublisher).parameters["endpoint"].default
    assert default == DEFAULT_ENDPOINT == "tcp://127.0.0.1:5557"
    # A loopback endpoint binds (the default's shape, on a port of the test's own): subscribers
    # on this host connect to it; it does not try to connect to a router.
    port = free_port()
    with KVEventPublisher(f"tcp://127.0.0.1:{port}", context=context) as publisher:
        assert publisher.endpoint == f"tcp://127.0.0.1:{port}"
        assert _listening(port)
        sub = subscriber(context, publisher.endpoint, "")
        wait_subscribed(publisher, sub)
        publisher.publish([OffloadingEvent((key(3),), "CPU", False)], ts=1.0)
        _, _, batch = receive(sub)
        assert [type(e).__name__ for e in batch.events] == ["BlockStored"]
        sub.close()
    port = free_port()
    with KVEventPublisher(f"tcp://localhost:{port}", context=context) as publisher:
        assert _listening(port)


def test_bind_false_connects_to_a_loopback_proxy(context: zmq.Context[zmq.Socket[bytes]]) -> None:
    proxy = context.socket(zmq.SUB)  # e.g. an XSUB proxy on this host that publishers connect to
    proxy.setsockopt(zmq.LINGER, 0)
    proxy.setsockopt(zmq.SUBSCRIBE, b"")
    proxy.bind("tcp://127.0.0.1:*")
    endpoint = proxy.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    with KVEventPublisher(endpoint.decode(), bind=False, context=context) as publisher:
        assert publisher.endpoint == endpoint.decode()
        wait_subscribed(publisher, proxy)
    proxy.close()
    with pytest.raises(ConfigurationError, match=r"'tcp://\*:5557' \(bind on every interface"):
        KVEventPublisher("tcp://127.0.0.1:*", bind=False, context=context)  # cannot connect to *
