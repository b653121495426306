"""The CPU manager's collaborators, each on its own: slots, writes in flight, load pins, store
admission and counters (tiering.managers.cpu_*)."""

from __future__ import annotations

import pytest

from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ProtocolError
from tiering.managers.cpu_admission import StoreAdmission
from tiering.managers.cpu_counters import CPUCounters
from tiering.managers.cpu_pins import LoadPins
from tiering.managers.cpu_slots import SlotAllocator
from tiering.managers.cpu_writes import PendingWrites
from tiering.policies import make_policy


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def test_slots_are_fresh_in_order_then_the_most_recently_freed() -> None:
    slots_of: dict[OffloadKey, int] = {}
    alloc = SlotAllocator(4, slots_of, make_policy("lru", 4))
    assert alloc.allocate(3, [], None) == ([0, 1, 2], [])
    alloc.free([1, 0])  # 0 freed last: on top
    assert alloc.num_free == 3
    assert alloc.allocate(2, [], None) == ([3, 0], [])
    assert alloc.allocate(1, [], None) == ([1], [])
    assert alloc.num_free == 0
    alloc.clear()
    assert alloc.num_free == 4 and alloc.allocate(1, [], None) == ([0], [])


def test_a_shortfall_evicts_by_policy_and_a_hook_keeps_slots() -> None:
    policy = make_policy("lru", 3)
    slots_of = {k(1): 0, k(2): 1, k(3): 2}
    policy.insert_many([k(1), k(2), k(3)])
    alloc = SlotAllocator(3, slots_of, policy)
    assert alloc.allocate(3, [], None) == ([0, 1, 2], [])  # the fresh slots, now all taken
    seen: list[tuple[list[tuple[OffloadKey, int]], object]] = []

    def hook(freed: list[tuple[OffloadKey, int]], ctx: object) -> set[int]:
        seen.append((freed, ctx))
        return {0}  # k(1)'s slot stays allocated

    alloc.hook = hook
    # k(1) is protected: k(2) and k(3) go, their slots freed (the hook keeps neither).
    assert alloc.allocate(2, [k(1)], "ctx") == ([2, 1], [k(2), k(3)])
    assert seen == [([(k(2), 1), (k(3), 2)], "ctx")]
    assert slots_of == {k(1): 0}
    # The hook retains k(1)'s slot: the victim is gone, the slot is not free.
    assert alloc.allocate(1, [], "ctx") == (None, [k(1)])
    assert slots_of == {} and alloc.num_free == 0
    alloc.free([0])
    assert alloc.allocate(1, [], None) == ([0], [])


def test_allocation_fails_changing_nothing_when_the_policy_cannot_evict() -> None:
    policy = make_policy("lru", 1)
    slots_of = {k(1): 0}
    policy.insert(k(1))
    alloc = SlotAllocator(1, slots_of, policy)
    alloc.allocate(1, [], None)
    assert alloc.allocate(1, [k(1)], None) == (None, [])
    assert slots_of == {k(1): 0} and k(1) in policy


def test_writes_are_finished_by_their_owner_or_by_the_promotion() -> None:
    writes = PendingWrites()
    writes.not_ready.update([k(1), k(2), k(3)])
    writes.hand_to([k(1), k(2)], "req-a")  # k(3): a promotion's
    assert writes.claim_stores([k(1), k(3)], "req-b") == []
    assert writes.claim_promotions([k(1), k(3), k(3)]) == [k(3)]
    assert writes.claim_stores([k(2), k(1), k(2)], "req-a") == [k(2), k(1)]
    assert writes.not_ready == set()
    assert writes.claim_stores([k(1)], "req-a") == []  # finished once


def test_dropping_writes_keeps_a_store_owner() -> None:
    writes = PendingWrites()
    writes.not_ready.update([k(1), k(2)])
    writes.hand_to([k(1)], "req")
    assert writes.drop([k(1), k(1), k(9)]) == [k(1)]
    assert writes.not_ready == {k(2)}
    assert writes.claim_stores([k(1)], "req") == [k(1)]  # its owner still finishes it
    writes.clear()
    assert writes.not_ready == set() and writes.claim_stores([k(1)], "req") == []


def test_pins_reach_the_policy_only_at_the_first_pin_and_the_last_unpin() -> None:
    policy = make_policy("lru", 4)
    policy.insert_many([k(1), k(2)])
    pins = LoadPins(policy)
    pins.pin([k(1), k(1)], checked=False)
    assert policy.evict(2) is None  # k(1) pinned: only k(2) evictable
    pins.unpin([k(1)])
    assert policy.evict(2, protected={k(2)}) is None  # still pinned once
    pins.unpin([k(1)])
    assert policy.evict(1, protected={k(2)}) == [k(1)]


def test_unpinning_more_than_pinned_raises_changing_nothing() -> None:
    policy = make_policy("lru", 4)
    policy.insert_many([k(1), k(2)])
    pins = LoadPins(policy)
    pins.pin([k(1), k(2)], checked=True)
    with pytest.raises(ProtocolError, match=r"x2 but only 1 load"):
        pins.unpin([k(2), k(1), k(1)])
    pins.unpin([k(1), k(2)])  # the failed call took nothing
    assert sorted(policy.evict(2) or []) == sorted([k(1), k(2)])


def test_admission_counts_offers_in_vllms_order() -> None:
    admission = StoreAdmission(threshold=2, max_keys=2)
    assert admission.admitted([k(1), k(1), k(2)], [k(1), k(2)]) == []
    assert admission.admitted([k(1)], [k(1)]) == [k(1)]
    # k(3) is new: it forgets the least recently offered key not bumped (k(2)).
    assert admission.admitted([k(3)], [k(3)]) == []
    assert admission.admitted([k(2), k(3)], [k(2), k(3)]) == [k(3)]
    # Both known keys bumped by this offer: the new one is not counted.
    assert admission.admitted([k(2), k(3), k(4)], [k(4)]) == []
    assert admission.admitted([k(4)], [k(4)]) == []


def test_counters_report_their_growth_since_the_last_call() -> None:
    counts = CPUCounters(make_policy("lru", 4))
    counts.stored_blocks += 3
    counts.stores_skipped += 1
    counts.note_hint(True)
    counts.note_hint(None)  # not hinted: not counted
    assert counts.growth() == {  # LRU follows no hints: no hints_followed
        "stored_blocks": 3,
        "failed_stores": 0,
        "evicted_blocks": 0,
        "loaded_blocks": 0,
        "stores_skipped": 1,
        "hinted_requests": 1,
    }
    counts.stored_blocks += 2
    counts.note_hint(False)
    assert counts.growth()["stored_blocks"] == 2
    assert counts.as_dict()["stored_blocks"] == 5
    assert counts.as_dict()["hinted_requests"] == 2


def test_the_counters_read_the_hints_a_policy_followed() -> None:
    policy = make_policy("chain", 4)
    counts = CPUCounters(policy)
    assert counts.growth()["hints_followed"] == 0
    policy.note_request([k(0)], continues=True)  # a fresh policy follows hints ``True``
    policy.note_request([k(1)], continues=True)
    # Not ``False`` while no request was continued: it would tell none apart from the others.
    policy.note_request([k(2)], continues=False)
    assert counts.growth()["hints_followed"] == 2
    policy.clear()  # a counter: kept
    assert counts.growth()["hints_followed"] == 0 and counts.as_dict()["hints_followed"] == 2
