"""Every call order the protocol allows serves the right bytes (issue 24).

A hypothesis state machine drives a :class:`TieringOffloadingManager` over real file, LMDB and
memory tiers (gated: tier I/O finishes when the machine says, in any order, or fails) with every
public call, interleaving several requests: lookups (single, prefix, hybrid), loads, touches,
stores completed with their keys, a subset or a superset of the offered keys (others' keys too),
requests noted to the policy (before or after their stores; ``chain`` moves blocks then),
failed stores, step ends, events, resets. Keys are content-addressed, as in an engine: the only
right bytes for a key are :func:`payload` of it. The machine checks the bytes of every load (when it
is prepared and again when it completes), of every block a tier writes (read back from the
backend) and of every block left at the end; and that a key a lookup answered HIT is still
there for ``prepare_load`` until a call that may evict.

``make test`` runs a bounded number of examples; a longer search::

    TIERING_PROPERTY_EXAMPLES=2000 python -m pytest -q tests/test_call_orders.py
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tiering.backends.base import StorageBackend
from tiering.backends.file import FileBackend, slot_bytes_for
from tiering.backends.lmdb import LMDBBackend
from tiering.backends.memory import MemoryBackend
from tiering.core.block_format import HEADER_BYTES, make_layout_fingerprint
from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ProtocolError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.protocol import LookupResult
from tiering.managers.secondary_tier import SecondaryTier, WritePolicy
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.testing.gated_backend import GatedBackend, wait_until_quiet

ROW_BYTES = 256
FINGERPRINT = make_layout_fingerprint({"call-orders": ROW_BYTES})
# Few keys and slots: requests collide on keys, and evictions and promotions are frequent.
KEYS = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(5)]
REQUESTS: list[Hashable] = ["a", "b", "c", None]
EXAMPLES = int(os.environ.get("TIERING_PROPERTY_EXAMPLES", "150"))
HIT, MISS = LookupResult.HIT, LookupResult.MISS
BLOCK_TOKENS = 16
SPEC = KVCacheSpec(
    groups=(KVCacheGroup(GroupKind.FULL_ATTENTION, BLOCK_TOKENS, (ROW_BYTES,)),),
    hash_block_size=BLOCK_TOKENS,
)

# The gate holds tier I/O as long as an example needs: no job may time out meanwhile
# (deadlines have their own tests in test_tier_deadlines.py).
NO_DEADLINE_S = 86400.0


def payload(key: bytes) -> np.ndarray:
    """The one right content of ``key``'s block."""
    digest = hashlib.sha256(key).digest()
    return np.frombuffer((digest * (ROW_BYTES // len(digest)))[:ROW_BYTES], np.uint8)


GARBAGE = np.full(ROW_BYTES, 0xEE, np.uint8)  # what a failed copy leaves in a slot


def make_backend(kind: str, blocks: int, directory: str) -> StorageBackend:
    if kind == "memory":
        return MemoryBackend(
            capacity_bytes=blocks * (HEADER_BYTES + ROW_BYTES),
            block_bytes=ROW_BYTES,
            fingerprint=FINGERPRINT,
        )
    if kind == "file":
        return FileBackend(
            path=os.path.join(directory, "file"),
            capacity_bytes=blocks * slot_bytes_for(ROW_BYTES),
            block_bytes=ROW_BYTES,
            fingerprint=FINGERPRINT,
        )
    capacity_bytes = blocks * 512  # the smallest capacity that holds ``blocks`` (no I/O)
    while True:
        backend = LMDBBackend(
            path=os.path.join(directory, "lmdb"),
            capacity_bytes=capacity_bytes,
            block_bytes=ROW_BYTES,
            fingerprint=FINGERPRINT,
            sync=False,
            metasync=False,
        )
        if backend.capacity_blocks >= blocks:
            return backend
        capacity_bytes += 64


@dataclass
class Store:
    """A store the machine's engine prepared: the request, the keys it offered, the keys (and
    slots) it was handed and has not completed, and whether its worker has copied them."""

    req: Hashable
    offered: list[OffloadKey]
    open: dict[OffloadKey, int]
    written: bool = False


@dataclass
class Load:
    req: Hashable
    keys: list[OffloadKey]
    slots: list[int] = field(default_factory=list)


class CallOrders(RuleBasedStateMachine):
    """The engine side of the protocol, in any order it allows, with a model of the bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.manager: TieringOffloadingManager | None = None
        self.gates: list[GatedBackend] = []
        self.directory = tempfile.mkdtemp(prefix="tiering-call-orders-")
        self.stores: dict[int, Store] = {}
        self.loads: dict[int, Load] = {}
        self.next_id = 0
        # Keys a lookup answered HIT since the last call that may evict: prepare_load must pin
        # them. Calls that apply no I/O results (and start no promotion) keep them: lookups
        # answered at once (HIT; MISS standalone), touch, prepare_load; so does tier I/O.
        self.safe: set[OffloadKey] = set()

    # -- setup and teardown -------------------------------------------------------------------

    @initialize(
        step_driven=st.booleans(),
        kinds=st.permutations(["memory", "file", "lmdb"]).flatmap(
            lambda p: st.integers(1, 3).map(lambda n: p[:n])
        ),
        write_policies=st.lists(st.sampled_from(list(WritePolicy)), min_size=3, max_size=3),
        primary_blocks=st.integers(2, 3),
        tier_blocks=st.lists(st.integers(2, 5), min_size=3, max_size=3),
        max_inflight_jobs=st.integers(1, 2),
        policy=st.sampled_from(["lru", "arc", "chain"]),
    )
    def build(
        self,
        step_driven: bool,
        kinds: list[str],
        write_policies: list[WritePolicy],
        primary_blocks: int,
        tier_blocks: list[int],
        max_inflight_jobs: int,
        policy: str,
    ) -> None:
        tiers = []
        for kind, write_policy, blocks in zip(kinds, write_policies, tier_blocks, strict=False):
            gate = GatedBackend(make_backend(kind, blocks, self.directory))
            self.gates.append(gate)
            tiers.append(
                SecondaryTier(
                    gate,
                    write_policy=write_policy,
                    selective_min_lookups=1,
                    max_inflight_jobs=max_inflight_jobs,
                    quarantine_seconds=1e9,  # no clock in the test: a failed read stays out
                    io_timeout_s=NO_DEADLINE_S,
                )
            )
        self.step_driven = step_driven
        self.pool = torch.zeros(primary_blocks, ROW_BYTES, dtype=torch.uint8)
        self.rows = self.pool.numpy()
        self.manager = TieringOffloadingManager(
            CPUOffloadingManager(primary_blocks, policy),
            tiers,
            pool=self.pool,
            step_driven=step_driven,
        )
        self.manager.wait_ready()
        for gate in self.gates:
            gate.close_gate()

    def teardown(self) -> None:
        try:
            if self.manager is not None:
                for gate in self.gates:
                    gate.open_gate()
                self.manager.wait_idle()
                for gate in self.gates:
                    self.check_tier_blocks(gate, KEYS)
        finally:
            if self.manager is not None:
                self.manager.shutdown()
            shutil.rmtree(self.directory, ignore_errors=True)

    @property
    def m(self) -> TieringOffloadingManager:
        assert self.manager is not None
        return self.manager

    # -- checks ---------------------------------------------------------------------------------

    def check_slots(self, what: str, keys: list[OffloadKey], slots: list[int]) -> None:
        for key, slot in zip(keys, slots, strict=True):
            if not np.array_equal(self.rows[slot], payload(key)):
                found = [
                    k.hex()[14:16] for k in KEYS if np.array_equal(self.rows[slot], payload(k))
                ]
                raise AssertionError(
                    f"{what}: slot {slot} of key {key.hex()} holds the wrong bytes "
                    f"(those of key(s) {found or 'none'})"
                )

    def check_tier_blocks(self, gate: GatedBackend, keys: Sequence[bytes]) -> None:
        for key, value in zip(keys, gate.read_back(keys), strict=True):
            if value is not None:
                assert np.array_equal(np.frombuffer(value, np.uint8), payload(key)), (
                    f"tier {gate.name!r} holds wrong bytes under key {key.hex()}"
                )

    def evicting_call(self) -> None:
        """A call that may evict (or, standalone, apply I/O results): hits may be gone."""
        self.safe.clear()

    def standalone_call(self) -> None:
        """A call that applies I/O results standalone (and may evict then) but not step-driven."""
        if not self.step_driven:
            self.safe.clear()

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    # -- lookups --------------------------------------------------------------------------------

    @rule(req=st.sampled_from(REQUESTS), key=st.sampled_from(KEYS))
    def lookup(self, req: Hashable, key: OffloadKey) -> None:
        answer = self.m.lookup_result(key, req_context=req)
        if answer is HIT:
            self.safe.add(key)
        elif answer is not MISS or self.step_driven:
            # RETRY / HIT_PENDING (and a step-driven MISS: a promotion that found no slot may
            # still have evicted for a write-back) may have started promotions, which evict.
            self.evicting_call()

    @rule(
        req=st.sampled_from(REQUESTS), keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)
    )
    def lookup_prefix(self, req: Hashable, keys: list[OffloadKey]) -> None:
        count = self.m.lookup_prefix(keys, req_context=req)
        self.evicting_call()
        if count is not None:  # nothing promoted: the leading keys stay
            self.safe.update(keys[:count])

    @rule(
        req=st.sampled_from(REQUESTS),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
    )
    def lookup_request(self, req: Hashable, keys: list[OffloadKey]) -> None:
        """The hybrid lookup (one full-attention group here), and the boolean ``lookup``."""
        tokens = self.m.lookup_request(SPEC, [keys], BLOCK_TOKENS * len(keys) + 1, req_context=req)
        self.evicting_call()
        if tokens is not None:  # nothing promoted: the hit's keys stay
            self.safe.update(keys[: tokens // BLOCK_TOKENS])
        if self.m.lookup(keys[0], req_context=req) is True:
            self.safe.add(keys[0])
        else:
            self.evicting_call()

    @rule(req=st.sampled_from(REQUESTS), keys=st.lists(st.sampled_from(KEYS), max_size=3))
    def touch(self, req: Hashable, keys: list[OffloadKey]) -> None:
        self.m.touch(keys, req_context=req)

    @rule(
        req=st.sampled_from(REQUESTS),
        keys=st.lists(st.sampled_from(KEYS), max_size=4, unique=True),
        ended=st.booleans(),
    )
    def note_request(self, req: Hashable, keys: list[OffloadKey], ended: bool) -> None:
        # Before its stores or (ended) after them, between any two calls of any request:
        # chain moves a continuation's blocks between its lists then, pins and all.
        self.m.note_request(keys, req_context=req, ended=ended)

    # -- loads ----------------------------------------------------------------------------------

    @rule(req=st.sampled_from(REQUESTS), data=st.data())
    def prepare_load(self, req: Hashable, data: st.DataObject) -> None:
        # Mostly keys the primary holds (ready ones load, wrongly if a bug made them ready).
        source = data.draw(st.sampled_from(["primary", "hits", "any"]))
        held = sorted(self.m.primary.slots)
        pool = {"primary": held, "hits": sorted(self.safe)}.get(source) or KEYS
        keys = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=3))
        must_load = all(key in self.safe for key in keys)
        try:
            spec = self.m.prepare_load(keys, req_context=req)
        except ProtocolError as exc:
            assert not must_load, f"prepare_load refused keys a lookup answered HIT: {exc}"
            return
        slots = spec.block_ids.tolist()
        self.check_slots("prepare_load", keys, slots)
        self.loads[self._id()] = Load(req, keys, slots)

    @precondition(lambda self: bool(self.loads))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        load_id = data.draw(st.sampled_from(sorted(self.loads)))
        load = self.loads.pop(load_id)
        self.check_slots("a pinned slot, at complete_load", load.keys, load.slots)
        self.m.complete_load(load.keys, req_context=load.req)
        self.standalone_call()

    # -- stores ---------------------------------------------------------------------------------

    @rule(
        req=st.sampled_from(REQUESTS),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
        write_now=st.booleans(),
    )
    def prepare_store(self, req: Hashable, keys: list[OffloadKey], write_now: bool) -> None:
        out = self.m.prepare_store(keys, req_context=req)
        self.evicting_call()
        if out is None:
            return
        handed = dict(zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True))
        store = Store(req, keys, handed)
        self.stores[self._id()] = store
        if write_now:
            self.write(store)

    def write(self, store: Store) -> None:
        """The store's worker copies each handed key's block into its slot."""
        for key, slot in store.open.items():
            self.rows[slot] = payload(key)
        store.written = True

    @precondition(lambda self: any(not s.written for s in self.stores.values()))
    @rule(data=st.data())
    def worker_copies(self, data: st.DataObject) -> None:
        unwritten = sorted(i for i, s in self.stores.items() if not s.written)
        self.write(self.stores[data.draw(st.sampled_from(unwritten))])

    @rule(
        req=st.sampled_from(REQUESTS),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
        data=st.data(),
        listed=st.sampled_from(["handed", "offered", "subset", "superset"]),
        success=st.booleans(),
    )
    def store(
        self,
        req: Hashable,
        keys: list[OffloadKey],
        data: st.DataObject,
        listed: str,
        success: bool,
    ) -> None:
        """A whole store in one go, the usual flow: prepare, copy, complete."""
        before = set(self.stores)
        self.prepare_store(req, keys, write_now=success)
        for store_id in set(self.stores) - before:  # none if prepare_store answered None
            self.complete(data, store_id, listed, success)

    @precondition(lambda self: bool(self.stores))
    @rule(
        data=st.data(),
        listed=st.sampled_from(["handed", "offered", "subset", "superset"]),
        success=st.booleans(),
    )
    def complete_store(self, data: st.DataObject, listed: str, success: bool) -> None:
        self.complete(data, data.draw(st.sampled_from(sorted(self.stores))), listed, success)

    def complete(self, data: st.DataObject, store_id: int, listed: str, success: bool) -> None:
        store = self.stores[store_id]
        if listed == "handed":
            keys = list(store.open)
        elif listed == "offered":
            keys = list(store.offered)
        elif listed == "subset":
            keys = data.draw(st.lists(st.sampled_from(store.offered), max_size=len(store.offered)))
        else:  # superset: other keys too, held by others, promoted, or unknown
            keys = store.offered + data.draw(st.lists(st.sampled_from(KEYS), max_size=4))
        # A request completes, with one store, no key another of its stores still copies.
        others = [s for i, s in self.stores.items() if i != store_id and s.req == store.req]
        keys = [k for k in keys if not any(k in s.open and not s.written for s in others)]
        if success:
            if not store.written:
                self.write(store)
        else:
            for key in keys:
                if key in store.open:
                    self.rows[store.open[key]] = GARBAGE  # the failed copy's leftovers
        self.m.complete_store(keys, success=success, req_context=store.req)
        self.standalone_call()
        for s in [store, *others]:
            for key in keys:
                s.open.pop(key, None)
        for i in [i for i, s in self.stores.items() if not s.open]:
            del self.stores[i]

    # -- steps, events, resets, tier I/O ---------------------------------------------------------

    @rule()
    def on_schedule_end(self) -> None:
        self.m.on_schedule_end()
        self.evicting_call()

    @rule(req=st.sampled_from(REQUESTS), events=st.booleans())
    def bookkeeping(self, req: Hashable, events: bool) -> None:
        """The request hooks, stats, and (or) events."""
        self.m.on_new_request(req)
        self.m.on_request_finished(req)
        self.m.has_pending_work()
        self.m.get_stats()
        if events:
            self.m.take_events()
            self.standalone_call()

    @rule(now=st.integers(0, 7))
    def reset(self, now: int) -> None:
        if now != 7:  # rarely: a reset starts the model over
            return
        for gate in self.gates:
            gate.open_gate()
        self.m.reset_cache()
        for gate in self.gates:
            gate.close_gate()
        # Whatever was in flight is dropped: its workers stop and its loads are void.
        self.stores.clear()
        self.loads.clear()
        self.evicting_call()

    @precondition(lambda self: any(gate.parked for gate in self.gates))
    @rule(data=st.data(), calls=st.integers(1, 3))
    def tier_io_finishes(self, data: st.DataObject, calls: int) -> None:
        """Some parked tier I/O calls finish, in an order the machine picks; some fail."""
        for _ in range(calls):
            parked = [
                (gate, call)
                for gate in self.gates
                for call in sorted(gate.parked, key=lambda c: (c.op, c.keys))
            ]
            if not parked:
                return
            gate, call = data.draw(st.sampled_from(parked))
            gate.release(call, fail=data.draw(st.integers(0, 3)) == 3)
            wait_until_quiet(self.m.inflight_jobs, self.gates)
            if call.op == "put":
                self.check_tier_blocks(gate, list(call.keys))

    @invariant()
    def quiet_and_hits_are_loadable(self) -> None:
        """Between two calls nothing runs but what waits at a gate (so which I/O may finish
        next is the same on every run); every key in ``safe`` is ready in the primary."""
        if self.manager is not None:
            wait_until_quiet(self.m.inflight_jobs, self.gates)
            primary = self.m.primary
            for key in self.safe:
                assert primary.lookup(key) is True, f"key {key.hex()} answered HIT is gone"


def test_call_orders_never_serve_wrong_bytes() -> None:
    run_state_machine_as_test(
        CallOrders,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=50,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )


@pytest.mark.parametrize("between", ["nothing", "lookup_of_an_absent_key", "touch"])
def test_a_hit_stays_loadable_while_tier_io_finishes(between: str) -> None:
    """The lookup-HIT / prepare_load-refused case (issue 24): standalone, a call applied the
    I/O results that had arrived since the lookup, which started a promotion that had waited
    for the tier's job slot, and its reservation evicted the key just answered HIT."""
    gate = GatedBackend(make_backend("memory", 8, ""))
    pool = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
    rows = pool.numpy()
    manager = TieringOffloadingManager(
        CPUOffloadingManager(2),
        [SecondaryTier(gate, max_inflight_jobs=1, io_timeout_s=NO_DEADLINE_S)],
        pool=pool,
    )
    try:
        manager.wait_ready()
        k1, k2, k3, k4, absent = KEYS[0:5]
        for pair in ([k1, k2], [k3, k4]):
            out = manager.prepare_store(pair)
            assert out is not None
            for key, slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True):
                rows[slot] = payload(key)
            manager.complete_store(pair)
            manager.wait_idle()  # the primary holds k3, k4; the tier k1..k4
        gate.close_gate()
        assert manager.lookup_result(k1, req_context="a") is LookupResult.RETRY
        assert manager.lookup_result(k1, req_context="a") is LookupResult.RETRY  # submitted
        assert manager.lookup_result(k2, req_context="a") is LookupResult.RETRY
        assert manager.lookup_result(k2, req_context="a") is LookupResult.RETRY  # waits: 1 job
        assert manager.lookup_result(k4, req_context="b") is HIT
        wait_until_quiet(manager.inflight_jobs, [gate])
        (read,) = gate.parked
        gate.release(read)  # k1's promotion finishes: its result waits for the next call
        wait_until_quiet(manager.inflight_jobs, [gate])
        if between == "lookup_of_an_absent_key":
            assert manager.lookup_result(absent, req_context="b") is MISS
        elif between == "touch":
            manager.touch([k4], req_context="b")
        spec = manager.prepare_load([k4], req_context="b")
        assert np.array_equal(rows[spec.block_ids[0]], payload(k4))
        manager.complete_load([k4], req_context="b")
    finally:
        gate.open_gate()
        manager.shutdown()


def test_another_requests_complete_store_leaves_a_promotion_alone() -> None:
    """The wrong-bytes case (issue 24): request B offered K, which a promotion was reading
    into a reserved slot, got nothing for it, and completed every key it offered; K became
    ready with the slot's old bytes. A failed store freed the slot the read was filling."""
    for success in (True, False):
        gate = GatedBackend(make_backend("memory", 8, ""))
        pool = torch.zeros(2, ROW_BYTES, dtype=torch.uint8)
        rows = pool.numpy()
        manager = TieringOffloadingManager(
            CPUOffloadingManager(2),
            [SecondaryTier(gate, io_timeout_s=NO_DEADLINE_S)],
            pool=pool,
            step_driven=True,
        )
        try:
            manager.wait_ready()
            k1, k2, k3 = KEYS[0:3]
            for key in (k1, k2, k3):
                out = manager.prepare_store([key], req_context="w")
                assert out is not None
                rows[out.store_spec.block_ids[0]] = payload(key)
                manager.complete_store([key], req_context="w")
                manager.wait_idle()
            gate.close_gate()
            assert manager.lookup_result(k1, req_context="a") is LookupResult.RETRY
            out = manager.prepare_store([k1], req_context="b")
            assert out is not None and out.keys_to_store == []
            manager.complete_store([k1], success=success, req_context="b")
            assert manager.lookup_result(k1, req_context="c") is LookupResult.RETRY
            manager.on_schedule_end()  # the read is submitted; it waits at the gate
            wait_until_quiet(manager.inflight_jobs, [gate])
            (read,) = gate.parked
            gate.release(read)
            wait_until_quiet(manager.inflight_jobs, [gate])
            manager.on_schedule_end()  # its result applies
            assert manager.lookup_result(k1, req_context="c") is HIT
            spec = manager.prepare_load([k1], req_context="c")
            assert np.array_equal(rows[spec.block_ids[0]], payload(k1))
            manager.complete_load([k1], req_context="c")
        finally:
            gate.open_gate()
            manager.shutdown()
