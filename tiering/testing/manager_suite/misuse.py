"""``ManagerTests``, misuse: errors typed, naming the argument, and nothing changed."""

from __future__ import annotations

from typing import Any, cast

import pytest

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.keys import OffloadKey
from tiering.errors import InvalidArgumentError, InvalidKeyError
from tiering.managers.protocol import OffloadingManager
from tiering.testing.manager_suite.base import (
    HIT_PENDING,
    RETRY,
    ManagerFactory,
    ManagerTestsBase,
    k,
)

__all__ = ["ManagerMisuseTests"]


class ManagerMisuseTests(ManagerTestsBase):
    """Misuse errors."""

    # -- misuse -----------------------------------------------------------------------------------

    def _observe(self, manager: OffloadingManager) -> list[object]:
        """What a caller can see of keys 1-3, and the events since the previous call."""
        answers: list[object] = [manager.lookup_result(x) for x in (k(1), k(2), k(3))]
        if self.shared_lower_tier and RETRY in answers:
            self.settle(manager)  # keys in no tier: their existence checks settle first
            answers = [manager.lookup_result(x) for x in (k(1), k(2), k(3))]
        return answers + [manager.take_events()]

    @pytest.mark.parametrize(
        "bad_key", ["key", bytearray(b"key-bytes-1"), 7, None, ["key"]], ids=repr
    )
    def test_bad_keys_raise_invalid_key_error(
        self, new_manager: ManagerFactory, bad_key: object
    ) -> None:
        manager = new_manager()
        self.store(manager, [k(1)])
        assert manager.prepare_store([k(2)]) is not None
        manager.prepare_load([k(1)])
        manager.take_events()
        before = self._observe(manager)
        key = cast(OffloadKey, bad_key)
        for call in (
            lambda: manager.lookup_result(key),
            lambda: manager.lookup(key),
            lambda: manager.lookup_prefix([k(1), key]),
            lambda: manager.prepare_load([k(1), key]),
            lambda: manager.complete_load([k(1), key]),
            lambda: manager.touch([k(1), key]),
            lambda: manager.prepare_store([k(3), key]),
            lambda: manager.complete_store([k(2), key]),
            lambda: manager.complete_store([k(2), key], success=False),
        ):
            with pytest.raises(InvalidKeyError):
                call()
        assert self._observe(manager) == before
        manager.complete_load([k(1)])  # exactly the one pin is left

    @pytest.mark.parametrize("bad_keys", [None, 7, b"a-single-key", "text"], ids=repr)
    def test_a_non_collection_of_keys_is_rejected(
        self, new_manager: ManagerFactory, bad_keys: object
    ) -> None:
        manager = new_manager()
        self.store(manager, [k(1)])
        manager.take_events()
        before = self._observe(manager)
        keys = cast(list[OffloadKey], bad_keys)
        for call in (
            lambda: manager.lookup_prefix(keys),
            lambda: manager.prepare_load(keys),
            lambda: manager.complete_load(keys),
            lambda: manager.touch(keys),
            lambda: manager.prepare_store(keys),
            lambda: manager.complete_store(keys),
        ):
            with pytest.raises(InvalidKeyError, match="keys|key"):
                call()
        assert self._observe(manager) == before

    @pytest.mark.parametrize("bad", ["yes", 1, None, 0.0], ids=repr)
    def test_success_must_be_a_bool(self, new_manager: ManagerFactory, bad: object) -> None:
        manager = new_manager()
        assert manager.prepare_store([k(1)]) is not None
        with pytest.raises(InvalidArgumentError, match="success"):
            manager.complete_store([k(1)], success=cast(bool, bad))
        assert manager.lookup_result(k(1)) is HIT_PENDING

    def test_positional_context_or_success_is_rejected(self, new_manager: ManagerFactory) -> None:
        manager = new_manager()
        assert manager.prepare_store([k(1)]) is not None
        anything = cast(Any, manager)
        with pytest.raises(InvalidArgumentError, match="success and req_context"):
            anything.complete_store([k(1)], "req-1", True)  # vLLM's order
        assert manager.lookup_result(k(1)) is HIT_PENDING
        for name in ("lookup_prefix", "prepare_load", "complete_load", "touch", "prepare_store"):
            with pytest.raises(InvalidArgumentError, match="req_context"):
                getattr(anything, name)([k(1)], "req-1")
        assert manager.lookup_result(k(1)) is HIT_PENDING

    def test_hybrid_lookup_misuse(self, new_manager: ManagerFactory) -> None:
        spec = KVCacheSpec((KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (64,)),), hash_block_size=16)
        keys = spec.offload_keys([i.to_bytes(8, "big") for i in range(2)])
        manager = new_manager()
        with pytest.raises(InvalidArgumentError, match="num_prompt_tokens"):
            manager.lookup_request(spec, keys, -1)
        with pytest.raises(InvalidArgumentError, match="num_prompt_tokens"):
            manager.lookup_request(spec, keys, cast(int, "32"))
        with pytest.raises(InvalidArgumentError, match="spec"):
            manager.lookup_request(cast(KVCacheSpec, "spec"), keys, 32)
        with pytest.raises(InvalidArgumentError, match="engine_recomputes_last_token"):
            manager.lookup_request(spec, keys, 32, engine_recomputes_last_token=cast(bool, 1))
        with pytest.raises(InvalidKeyError):
            manager.lookup_request(spec, [[k(1), cast(OffloadKey, 3)]], 32)
