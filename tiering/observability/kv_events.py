"""KV-cache events over ZMQ, in the wire format vLLM's KV event subscribers read.

KV-cache-aware routers (vLLM's subscriber examples, llm-d's and Dynamo's routers) subscribe to
an engine's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events. This module
publishes a manager's events (:meth:`~tiering.TieringOffloadingManager.take_events`) the same
way vLLM 0.33's ``ZmqEventPublisher`` does, so those consumers read ours unchanged:

- a PUB socket sends each batch as three frames ``(topic, seq, payload)``: ``seq`` is the
  batch's sequence number (8 bytes, big-endian, from 0, one per batch) and ``payload`` an
  ``EventBatch`` in msgpack: ``[ts, [event, ...], data_parallel_rank]``, each event a map
  tagged ``{"type": "BlockStored", ...}`` with vLLM's field names;
- an optional ROUTER socket serves late subscribers: a request ``(b"", start_seq)`` (what a
  REQ or DEALER socket sends, ``start_seq`` 8 bytes big-endian) is answered with every batch
  still buffered from ``start_seq`` on, as ``(b"", topic, seq, payload)``, then an end marker
  ``(b"", b"", seq=-1, b"")``. The last ``buffer_steps`` batches are kept.

Media: the CPU primary tier's events carry ``medium="CPU"``; a secondary tier's carry
``medium="STORAGE"`` and ``ownership=<tier name>``, as vLLM's offloading connector publishes
its secondary tiers. Keys: an offload key is a block hash plus a 4-byte group index; an event
carries the block hash (by default as vLLM's 64-bit int: the hash's last 8 bytes, big-endian,
like ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``; or the raw bytes) and ``group_idx``. Keys of
one manager event and one group make one ``BlockStored`` or ``BlockRemoved``; stores carry no
token ids (``token_ids=[]``, ``block_size=0``), as vLLM's own placeholder payloads for
offloaded blocks.

Threads: :meth:`KVEventPublisher.publish` only puts the events on a bounded queue (it never
blocks; a full queue drops the batch and counts it). One thread of the publisher's own
converts, encodes and sends, and answers replay requests; it alone touches the sockets.
"""

from __future__ import annotations

import contextlib
import ipaddress
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import msgspec
import zmq

from tiering.core.keys import get_offload_block_hash, get_offload_group_idx
from tiering.errors import ConfigurationError

__all__ = [
    "DEFAULT_ENDPOINT",
    "END_SEQ",
    "MEDIUM_CPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "HashFormat",
    "KVEventPublisher",
    "KVEventsStats",
    "decode_batch",
    "to_kv_events",
]

MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
#: The sequence number of the replay socket's end marker.
END_SEQ = (-1).to_bytes(8, "big", signed=True)

HashFormat = Literal["int", "bytes"]
BlockHash = int | bytes


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a msgpack map tagged with the class name under ``"type"``."""


class BlockStored(KVCacheEvent):
    """Blocks now held on ``medium`` (vLLM's field names and order)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    """Blocks no longer held on ``medium``."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every block of the publisher is gone."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """An :class:`EventBatch` from a published payload (ours or a vLLM engine's)."""
    return _DECODER.decode(payload)


class _Event(Protocol):
    """What a manager's event gives (``OffloadingEvent``)."""

    @property
    def keys(self) -> Sequence[bytes]: ...

    @property
    def medium(self) -> str: ...

    @property
    def removed(self) -> bool: ...


def _external_hash(block_hash: bytes, hash_format: HashFormat) -> BlockHash:
    if hash_format == "bytes":
        return block_hash
    return int.from_bytes(block_hash[-8:], "big")


def to_kv_events(
    events: Iterable[_Event],
    *,
    hash_format: HashFormat = "int",
    primary_medium: str = MEDIUM_CPU,
    tier_names: dict[str, str] | None = None,
) -> list[BlockStored | BlockRemoved]:
    """vLLM KV events for a manager's events, in order.

    An event of ``primary_medium`` keeps it; any other medium is a secondary tier's: published
    as ``STORAGE`` owned by the tier (``owner`` of the event when it has one, else
    ``tier_names[medium]``, else the medium in lower case).
    """
    out: list[BlockStored | BlockRemoved] = []
    names = tier_names or {}
    for event in events:
        owner: str | None = getattr(event, "owner", None)
        if event.medium == primary_medium:
            medium, owner = primary_medium, None
        else:
            medium = MEDIUM_STORAGE
            if owner is None:
                owner = names.get(event.medium, event.medium.lower())
        by_group: dict[int, list[BlockHash]] = {}
        for key in event.keys:
            by_group.setdefault(get_offload_group_idx(key), []).append(
                _external_hash(get_offload_block_hash(key), hash_format)
            )
        for group_idx, hashes in by_group.items():
            if event.removed:
                out.append(BlockRemoved(hashes, medium, group_idx=group_idx, ownership=owner))
            else:
                out.append(
                    BlockStored(
                        hashes,
                        None,
                        [],
                        0,
                        None,
                        medium,
                        None,
                        group_idx=group_idx,
                        ownership=owner,
                    )  # fmt: skip
                )
    return out


@dataclass
class KVEventsStats:
    """Counters of a publisher (read them from any thread)."""

    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0  # the queue was full: the engine outran the publisher thread
    send_failures: int = 0
    replay_requests: int = 0


_STOP = object()


#: The publisher's default endpoint: loopback, so events (which name every block a node holds)
#: leave the host only when an operator binds another interface on purpose.
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"


def _is_loopback_tcp(endpoint: str) -> bool:
    """Whether ``endpoint`` is ``tcp://`` on a loopback host (127.0.0.0/8, localhost, [::1])."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bind_or_connect(
    socket: zmq.Socket[bytes], endpoint: str, *, bind: bool | None, always_bind: bool
) -> str:
    """Bind wildcard, loopback, ``ipc://`` and ``inproc://`` endpoints (and ``always_bind``);
    connect to the rest, as vLLM does (vLLM connects to an IPv4 loopback address; nothing but
    a process on the same host can reach a loopback bind, and the default endpoint must bind).
    ``bind`` overrides the guess. Returns the endpoint in use (the port ZMQ chose for ``:*``)."""
    if bind is None:
        bind = always_bind or "*" in endpoint or "::" in endpoint or _is_loopback_tcp(endpoint)
        bind = bind or endpoint.startswith(("ipc://", "inproc://"))
    try:
        if not bind:
            socket.connect(endpoint)
            return endpoint
        socket.bind(endpoint)
    except zmq.ZMQError as exc:
        action = "bind" if bind else "connect to"
        raise ConfigurationError(
            f"cannot {action} KV events endpoint {endpoint!r}: {exc}; give an endpoint such as "
            f"{DEFAULT_ENDPOINT!r} (bind on loopback), 'tcp://*:5557' (bind on every "
            "interface: routers on other hosts can subscribe) or 'tcp://router-host:5557' "
            "(connect)"
        ) from None
    last = socket.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else endpoint


class KVEventPublisher:
    """Publishes KV events on ``endpoint`` (PUB) and replays missed batches on
    ``replay_endpoint`` (ROUTER), as vLLM's ``ZmqEventPublisher``; see the module docstring.

    ``publish(manager.take_events())`` after each scheduler step (or on a timer); events of an
    empty list publish nothing. ``close()`` sends what is queued, then closes the sockets.
    Raises :class:`ConfigurationError` naming the endpoint if a socket cannot bind.

    The default ``endpoint`` binds loopback (``tcp://127.0.0.1:5557``): the events name every
    block this node holds, so only processes on this host can subscribe until an operator
    binds another interface on purpose (``tcp://*:5557``, or ``tcp://10.0.0.5:5557`` with
    ``bind=True``). Wildcard, loopback, ``ipc://`` and ``inproc://`` endpoints bind, others
    connect (vLLM's rule, plus loopback); ``bind`` overrides that (``bind=False`` to connect
    to a proxy on this host).
    """

    def __init__(
        self,
        endpoint: str = DEFAULT_ENDPOINT,
        *,
        bind: bool | None = None,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        data_parallel_rank: int = 0,
        hash_format: HashFormat = "int",
        tier_names: dict[str, str] | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        if hash_format not in ("int", "bytes"):
            raise ConfigurationError(f"hash_format must be 'int' or 'bytes', got {hash_format!r}")
        for name, value in (("buffer_steps", buffer_steps), ("hwm", hwm)):
            if value < 0:
                raise ConfigurationError(f"{name} must be >= 0, got {value}")
        if max_queue_size < 1:
            raise ConfigurationError(f"max_queue_size must be >= 1, got {max_queue_size}")
        self.topic = topic
        self.hash_format: HashFormat = hash_format
        self.data_parallel_rank = data_parallel_rank
        self.tier_names = dict(tier_names or {})
        self.stats = KVEventsStats()
        self._topic_bytes = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue_size)
        self._next_seq = 0
        self._context = context or zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self.endpoint = _bind_or_connect(self._pub, endpoint, bind=bind, always_bind=False)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                # A whole replay plus its end marker must fit in the send queue.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self.replay_endpoint = _bind_or_connect(
                    self._replay, replay_endpoint, bind=None, always_bind=True
                )
        except BaseException:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tiering-kv-events", daemon=True)
        self._thread.start()

    # -- the caller's side -------------------------------------------------------------------

    def publish(self, events: Sequence[_Event], ts: float | None = None) -> None:
        """Queue one batch of a manager's events (never blocks; a full queue drops it)."""
        if self._closed:
            raise ConfigurationError("the KV event publisher is closed")
        if events:
            self._put((time.time() if ts is None else ts, list(events)))

    def publish_all_cleared(self, ts: float | None = None) -> None:
        """Queue an ``AllBlocksCleared`` batch."""
        if self._closed:
            raise ConfigurationError("the KV event publisher is closed")
        self._put((time.time() if ts is None else ts, None))

    def _put(self, item: object) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.stats.batches_dropped += 1

    def flush(self, timeout: float | None = 10.0) -> bool:
        """Wait until every queued batch is sent; False on timeout (for tools and tests)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout``), stop the thread, close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the publisher's thread --------------------------------------------------------------

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    item = self._queue.get(timeout=0.01 if self._replay is not None else 0.1)
                except queue.Empty:
                    continue
                try:
                    if item is _STOP:
                        return
                    assert isinstance(item, tuple)
                    self._send(encoder, *item)
                finally:
                    self._queue.task_done()
        finally:
            self._close_sockets()

    def _send(self, encoder: msgspec.msgpack.Encoder, ts: float, events: list[Any] | None) -> None:
        kv_events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        if events is None:
            kv_events = [AllBlocksCleared()]
        else:
            kv_events = list(
                to_kv_events(events, hash_format=self.hash_format, tier_names=self.tier_names)
            )
        payload = encoder.encode(EventBatch(ts, kv_events, self.data_parallel_rank))
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic_bytes, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            self.stats.send_failures += 1  # replay still has it
            return
        self.stats.batches_published += 1
        self.stats.events_published += len(kv_events)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        self.stats.replay_requests += 1
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: ignore it, as vLLM does
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart(
                    (client, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self._pub.close(linger=100)
        if self._replay is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._replay.close(linger=0)
