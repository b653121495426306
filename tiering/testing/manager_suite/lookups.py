"""``ManagerTests``, lookups: answers in every block state and ``lookup`` agreeing with
``lookup_result``; prefix lookups; hybrid lookups and the ``engine_recomputes_last_token``
alignment.
"""

from __future__ import annotations

import pytest

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.keys import OffloadKey
from tiering.testing.manager_suite.base import (
    HIT,
    HIT_PENDING,
    MISS,
    ManagerFactory,
    ManagerTestsBase,
    k,
)

__all__ = ["ManagerLookupTests"]


class ManagerLookupTests(ManagerTestsBase):
    """Lookup answers."""

    # -- lookups -----------------------------------------------------------------------------------

    def test_lookup_in_every_state(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        self.assert_miss(manager, k(1))
        assert manager.lookup(k(1)) is False
        out = manager.prepare_store([k(1)])
        assert out is not None and out.keys_to_store == [k(1)]
        assert manager.lookup_result(k(1)) is HIT_PENDING and manager.lookup(k(1)) is None
        manager.complete_store([k(1)])
        assert manager.lookup_result(k(1)) is HIT and manager.lookup(k(1)) is True
        assert manager.lookup_result(k(1), req_context="r") is HIT

    def test_too_short_bytes_key_is_a_miss(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        assert manager.lookup_result(OffloadKey(b"abc")) is MISS

    def test_lookup_prefix(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        self.store(manager, [k(1), k(2)])
        assert manager.prepare_store([k(3)]) is not None
        assert self.settled_prefix(manager, [k(1), k(2), k(4)]) == 2
        assert manager.lookup_prefix([k(1), k(3)]) is None
        assert manager.lookup_prefix([k(4), k(1)]) == 0
        assert manager.lookup_prefix([]) == 0

    @pytest.mark.parametrize(
        ("recomputes", "expected"), [(False, 416), (True, 432)], ids=["default", "engine"]
    )
    def test_lookup_request_alignment(
        self, new_manager: ManagerFactory, recomputes: bool, expected: int
    ) -> None:
        spec = KVCacheSpec((KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (64,)),), hash_block_size=16)
        keys = spec.offload_keys([i.to_bytes(8, "big") for i in range(27)])  # 432 tokens
        manager = new_manager(32)
        self.store(manager, keys[0])
        answer = manager.lookup_request(
            spec, keys, 432, req_context="r", engine_recomputes_last_token=recomputes
        )
        assert answer == expected
        assert manager.lookup_request(spec, keys, 433) == 432  # one token more to compute

    def test_lookup_request_leaves_a_token_for_a_window_group(
        self, new_manager: ManagerFactory
    ) -> None:
        spec = KVCacheSpec(
            (
                KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (64,)),
                KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, (64,), sliding_window=32),
            ),
            hash_block_size=16,
        )
        keys = spec.offload_keys([i.to_bytes(8, "big") for i in range(4)])  # 64 tokens
        manager = new_manager(8)
        self.store(manager, keys[0] + keys[1])
        for recomputes in (False, True):
            answer = manager.lookup_request(spec, keys, 64, engine_recomputes_last_token=recomputes)
            assert answer == 48
