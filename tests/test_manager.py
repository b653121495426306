"""The CPU primary tier's manager protocol."""

from __future__ import annotations

import pytest

from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import InvalidKeyError, ProtocolError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.protocol import OffloadingEvent


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def stored(manager: CPUOffloadingManager, *ids: int) -> list[int]:
    out = manager.prepare_store([k(i) for i in ids])
    assert out is not None
    manager.complete_store([k(i) for i in ids])
    return out.store_spec.block_ids.tolist()


@pytest.fixture(params=["lru", "arc"])
def manager(request: pytest.FixtureRequest) -> CPUOffloadingManager:
    return CPUOffloadingManager(4, policy=request.param, enable_events=True)


def test_lookup_states(manager: CPUOffloadingManager) -> None:
    assert manager.lookup(k(1)) is False
    out = manager.prepare_store([k(1)])
    assert out is not None and out.keys_to_store == [k(1)]
    assert manager.lookup(k(1)) is None  # being written: retry later
    manager.complete_store([k(1)])
    assert manager.lookup(k(1)) is True


def test_lookup_prefix(manager: CPUOffloadingManager) -> None:
    stored(manager, 1, 2)
    assert manager.prepare_store([k(3)]) is not None
    assert manager.lookup_prefix([k(1), k(2), k(4)]) == 2
    assert manager.lookup_prefix([k(1), k(3)]) is None
    assert manager.lookup_prefix([k(4), k(1)]) == 0


def test_slots_fresh_in_order_then_most_recently_freed_first() -> None:
    manager = CPUOffloadingManager(4, "lru")
    assert stored(manager, 1, 2, 3, 4) == [0, 1, 2, 3]
    # LRU order is 1, 2, 3, 4: evicting two frees slots 0 then 1; slot 1 is reused first.
    out = manager.prepare_store([k(5), k(6)])
    assert out is not None
    assert out.evicted_keys == [k(1), k(2)]
    assert out.store_spec.block_ids.tolist() == [1, 0]


def test_prepare_store_filters_present_and_dedupes(manager: CPUOffloadingManager) -> None:
    stored(manager, 1)
    out = manager.prepare_store([k(1), k(2), k(2), k(3)])
    assert out is not None
    assert out.keys_to_store == [k(2), k(3)]
    assert out.evicted_keys == []
    empty = manager.prepare_store([k(1)])
    assert empty is not None and empty.keys_to_store == [] and len(empty.store_spec) == 0


def test_prepare_store_none_changes_nothing(manager: CPUOffloadingManager) -> None:
    stored(manager, 1, 2, 3)
    manager.prepare_load([k(1), k(2), k(3)])
    before = (list(manager.policy), manager.num_free_blocks, manager.lookup_prefix([k(1)]))
    assert manager.prepare_store([k(4), k(5)]) is None  # one free slot, the rest pinned
    assert (list(manager.policy), manager.num_free_blocks, manager.lookup_prefix([k(1)])) == before
    assert manager.lookup(k(4)) is False
    assert manager.prepare_store([k(i) for i in range(10, 15)]) is None  # more than capacity


def test_keys_of_the_store_request_are_protected() -> None:
    manager = CPUOffloadingManager(2, "lru")
    stored(manager, 1, 2)
    # k(1) is the LRU block but belongs to this request: k(2) is evicted instead.
    out = manager.prepare_store([k(1), k(3)])
    assert out is not None and out.evicted_keys == [k(2)]


def test_blocks_being_written_or_loaded_are_not_evicted() -> None:
    manager = CPUOffloadingManager(3, "lru")
    stored(manager, 1, 2)
    assert manager.prepare_store([k(3)]) is not None  # in flight
    manager.prepare_load([k(1)])
    out = manager.prepare_store([k(4)])
    assert out is not None and out.evicted_keys == [k(2)]
    assert manager.prepare_store([k(5)]) is None  # 1 pinned, 3 and 4 in flight
    manager.complete_load([k(1)])
    out = manager.prepare_store([k(5)])
    assert out is not None and out.evicted_keys == [k(1)]


def test_touch_first_key_ends_most_recent() -> None:
    manager = CPUOffloadingManager(3, "lru")
    stored(manager, 1, 2, 3)
    manager.touch([k(1), k(2), k(3)])  # order now 3, 2, 1 (1 most recent)
    out = manager.prepare_store([k(4), k(5)])
    assert out is not None and out.evicted_keys == [k(3), k(2)]


def test_failed_store_removes_unready_keys_and_frees_slots(manager: CPUOffloadingManager) -> None:
    stored(manager, 1)
    out = manager.prepare_store([k(2), k(3)])
    assert out is not None
    free_before = manager.num_free_blocks
    manager.complete_store([k(1), k(2), k(3)], success=False)
    assert manager.lookup(k(1)) is True  # already ready: untouched
    assert manager.lookup(k(2)) is False and manager.lookup(k(3)) is False
    assert manager.num_free_blocks == free_before + 2
    # Fresh slot 3 goes first, then freed slots, most recently freed (2) first.
    again = manager.prepare_store([k(4), k(5), k(6)])
    assert again is not None and again.store_spec.block_ids.tolist() == [3, 2, 1]


def test_prepare_load_gives_slots_in_key_order_and_pins(manager: CPUOffloadingManager) -> None:
    slots = stored(manager, 1, 2, 3)
    spec = manager.prepare_load([k(3), k(1)])
    assert spec.medium == "CPU"
    assert spec.block_ids.tolist() == [slots[2], slots[0]]
    manager.complete_load([k(3), k(1)])


def test_misuse_raises_and_changes_nothing(manager: CPUOffloadingManager) -> None:
    stored(manager, 1)
    manager.prepare_store([k(2)])
    with pytest.raises(ProtocolError, match="is not stored"):
        manager.prepare_load([k(1), k(9)])
    with pytest.raises(ProtocolError, match="still being written"):
        manager.prepare_load([k(1), k(2)])
    # The failed calls pinned nothing: k(1) is evictable, so complete_load has nothing to undo.
    with pytest.raises(ProtocolError, match="only 0 load"):
        manager.complete_load([k(1)])
    manager.prepare_load([k(1)])
    with pytest.raises(ProtocolError, match=r"x2 but only 1 load"):
        manager.complete_load([k(1), k(1)])
    manager.complete_load([k(1)])
    with pytest.raises(InvalidKeyError):
        manager.prepare_store(["not bytes"])  # type: ignore[list-item]
    with pytest.raises(InvalidKeyError):
        manager.lookup(12)  # type: ignore[arg-type]
    assert manager.lookup(k(2)) is None and len(manager) == 2


def test_events_in_order(manager: CPUOffloadingManager) -> None:
    small = CPUOffloadingManager(1, "lru", enable_events=True)
    stored(small, 1)
    stored(small, 2)
    assert small.take_events() == [
        OffloadingEvent((k(1),), "CPU", False),
        OffloadingEvent((k(1),), "CPU", True),
        OffloadingEvent((k(2),), "CPU", False),
    ]
    assert small.take_events() == []
    quiet = CPUOffloadingManager(1, "lru")
    stored(quiet, 1)
    assert quiet.take_events() == []


def test_reset_cache_drops_everything(manager: CPUOffloadingManager) -> None:
    stored(manager, 1, 2)
    manager.take_events()
    manager.reset_cache()
    assert manager.lookup(k(1)) is False and len(manager) == 0
    assert manager.take_events() == [OffloadingEvent((k(1), k(2)), "CPU", True)]
    assert stored(manager, 3) == [0]
    manager.shutdown()
    manager.shutdown()


def test_a_pin_the_policy_refuses_counts_nothing() -> None:
    """``pin`` (a tiering manager's hold) of a key the policy does not hold raises, and the
    keys before it are not left pinned."""
    manager = CPUOffloadingManager(2, "lru")
    out = manager.prepare_store([k(1), k(2)])
    assert out is not None
    manager.complete_store([k(1), k(2)])
    manager.prepare_load([k(2)])
    with pytest.raises(KeyError):
        manager.pin([k(1), k(2), k(9)])
    manager.complete_load([k(2)])  # the one load of k(2): its count is back to 1, not 2
    with pytest.raises(ProtocolError, match="only 0 load"):
        manager.complete_load([k(1)])
    out = manager.prepare_store([k(3), k(4)])
    assert out is not None and sorted(out.evicted_keys) == [k(1), k(2)]
