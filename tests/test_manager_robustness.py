"""The tiering manager at its boundary: whatever a backend raises, a tier that cannot open, and
arguments of the wrong type. The backends here are plugin-style subclasses of the memory
backend that raise for real; everything else is the real manager and tiers."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any, cast

import pytest
import torch

from tiering.backends.base import Outcome
from tiering.backends.memory import MemoryBackend
from tiering.core.block_format import HEADER_BYTES, make_layout_fingerprint
from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigurationError, InvalidArgumentError, InvalidKeyError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.protocol import LookupResult
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tiering_manager import TieringOffloadingManager

ROW_BYTES = 256
FINGERPRINT = make_layout_fingerprint({"robustness": ROW_BYTES})
RETRY, HIT, MISS = LookupResult.RETRY, LookupResult.HIT, LookupResult.MISS
SPEC = KVCacheSpec((KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (64,)),), hash_block_size=16)


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


class PluginBaseException(BaseException):
    """What a careless plugin might raise: not an Exception."""


class RaisingBackend(MemoryBackend):
    """A backend plugin that raises ``exc`` from ``method`` while ``armed``."""

    name = "raising"

    def __init__(self, method: str, exc: BaseException, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.method = method
        self.exc = exc
        self.armed = True

    def _maybe_raise(self, method: str) -> None:
        if self.armed and method == self.method:
            raise self.exc

    async def open(self) -> list[bytes]:
        self._maybe_raise("open")
        return await super().open()

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        self._maybe_raise("put")
        return await super().put(keys, values)

    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        self._maybe_raise("get")
        return await super().get(keys, buffers)

    async def close(self) -> None:
        self._maybe_raise("close")
        await super().close()


def backend_kwargs(blocks: int = 16) -> dict[str, Any]:
    return {
        "capacity_bytes": blocks * (HEADER_BYTES + ROW_BYTES),
        "block_bytes": ROW_BYTES,
        "fingerprint": FINGERPRINT,
    }


class Rig:
    """A manager over the given tiers, with a pool the test plays the worker on."""

    def __init__(self, tiers: list[SecondaryTier], primary_blocks: int = 2, **options: Any):
        self.pool = torch.zeros(primary_blocks, ROW_BYTES, dtype=torch.uint8)
        self.manager = TieringOffloadingManager(
            CPUOffloadingManager(primary_blocks), tiers, pool=self.pool, **options
        )

    def store(self, *keys: OffloadKey) -> None:
        out = self.manager.prepare_store(list(keys))
        assert out is not None
        for key, slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True):
            self.pool[slot] = key[7]
        self.manager.complete_store(list(keys))
        self.manager.wait_idle()

    def load_byte(self, key: OffloadKey) -> int:
        slot = int(self.manager.prepare_load([key]).block_ids[0])
        value = int(self.pool[slot][0])
        self.manager.complete_load([key])
        return value


@pytest.fixture
def rigs() -> Iterator[list[Rig]]:
    made: list[Rig] = []
    yield made
    for rig in made:
        rig.manager.shutdown()


RAISED = [
    KeyboardInterrupt("from a plugin"),
    SystemExit(3),
    PluginBaseException("odd"),
    RuntimeError("plain"),
]


def _io_thread_alive(manager: TieringOffloadingManager) -> bool:
    threads = [t for t in threading.enumerate() if t.name == "tiering-io"]
    return bool(threads) and manager._io._thread.is_alive()


@pytest.mark.parametrize("exc", RAISED, ids=lambda e: type(e).__name__)
def test_a_put_raising_anything_fails_the_store_and_the_io_thread_lives(
    rigs: list[Rig], exc: BaseException
) -> None:
    backend = RaisingBackend("put", exc, **backend_kwargs())
    tier = SecondaryTier(backend, name="plugin")
    rig = Rig([tier])
    rigs.append(rig)
    rig.manager.wait_ready()
    rig.store(k(1))  # wait_idle settles: the job failed, it did not hang
    assert tier.metrics.store_failures == 1 and tier.state(k(1)).name == "ABSENT"
    assert _io_thread_alive(rig.manager)
    backend.armed = False
    rig.store(k(2))
    assert tier.state(k(2)).name == "READY"
    rig.store(k(3), k(4))  # evicts 1 and 2 from the primary
    assert rig.manager.lookup_result(k(2)) is RETRY
    rig.manager.wait_idle()
    assert rig.manager.lookup_result(k(2)) is HIT and rig.load_byte(k(2)) == 2
    assert rig.manager.lookup_result(k(1)) is MISS  # its write failed: a miss, not garbage


@pytest.mark.parametrize("exc", RAISED, ids=lambda e: type(e).__name__)
def test_a_get_raising_anything_fails_the_promotion_and_the_io_thread_lives(
    rigs: list[Rig], exc: BaseException
) -> None:
    backend = RaisingBackend("get", exc, **backend_kwargs())
    tier = SecondaryTier(backend, name="plugin")
    rig = Rig([tier], step_driven=True)
    rigs.append(rig)
    rig.manager.wait_ready()
    rig.store(k(1), k(2))
    rig.store(k(3), k(4))
    assert rig.manager.lookup_result(k(1)) is RETRY
    rig.manager.wait_idle()
    assert tier.metrics.promotion_failures == 1
    assert rig.manager.lookup_result(k(1)) is MISS  # quarantined, not retried in a loop
    assert _io_thread_alive(rig.manager)
    backend.armed = False
    assert rig.manager.lookup_result(k(2)) is RETRY
    rig.manager.wait_idle()
    assert rig.manager.lookup_result(k(2)) is HIT and rig.load_byte(k(2)) == 2


@pytest.mark.parametrize("exc", RAISED, ids=lambda e: type(e).__name__)
def test_shutdown_survives_a_close_that_raises_anything(
    rigs: list[Rig], exc: BaseException
) -> None:
    backend = RaisingBackend("close", exc, **backend_kwargs())
    healthy = MemoryBackend(**backend_kwargs())
    rig = Rig([SecondaryTier(backend, name="plugin"), SecondaryTier(healthy, name="mem")])
    rig.manager.wait_ready()
    rig.store(k(1))
    rig.manager.shutdown()
    assert healthy.is_open is False  # the tier after the broken one was closed too
    assert not rig.manager._io._thread.is_alive()


@pytest.mark.parametrize("step_driven", [False, True], ids=["standalone", "step-driven"])
@pytest.mark.parametrize(
    "exc", [OSError(5, "Input/output error"), SystemExit(1)], ids=["OSError", "SystemExit"]
)
def test_a_tier_that_fails_to_open_is_degraded_and_the_others_serve(
    rigs: list[Rig], caplog: pytest.LogCaptureFixture, step_driven: bool, exc: BaseException
) -> None:
    broken = SecondaryTier(RaisingBackend("open", exc, **backend_kwargs()), name="broken")
    healthy = SecondaryTier(MemoryBackend(**backend_kwargs()), name="mem")
    with caplog.at_level(logging.WARNING, logger="tiering"):
        rig = Rig([broken, healthy], step_driven=step_driven)
        rigs.append(rig)
        manager = rig.manager
        manager.wait_ready()  # no raise
        rig.store(k(1), k(2))
        rig.store(k(3), k(4))  # 1 and 2 now only in the healthy tier
        assert manager.lookup_prefix([k(3), k(4)]) == 2
        # (Step-driven, a lookup reserves the promotion's primary slot at once: it evicts 3.)
        assert manager.lookup_result(k(1)) is RETRY
        manager.on_schedule_end()
        manager.wait_idle()
        assert manager.lookup_result(k(1)) is HIT and rig.load_byte(k(1)) == 1
    warnings = [r for r in caplog.records if "broken" in r.getMessage()]
    assert len(warnings) == 1 and "degraded" in warnings[0].getMessage()
    metrics = manager.metrics()["broken"]
    assert metrics["status"] == "degraded" and metrics["open_failures"] == 1
    assert type(exc).__name__ in metrics["open_error"]
    assert manager.metrics()["mem"]["status"] == "open"
    assert broken.is_open is False and len(broken) == 0
    assert manager.locate(k(2)) == "MEM"
    assert manager.get_stats()["broken"]["open_failures"] == 1
    manager.reset_cache()  # a degraded tier has nothing to clear
    assert manager.lookup_result(k(1)) is MISS


def test_arguments_of_the_wrong_type_are_typed_errors_and_change_nothing(rigs: list[Rig]) -> None:
    rig = Rig([SecondaryTier(MemoryBackend(**backend_kwargs()), name="mem")])
    rigs.append(rig)
    manager = rig.manager
    manager.wait_ready()
    rig.store(k(1), k(2))
    rig.store(k(3), k(4))  # 1 and 2 only in the tier: a lookup would queue their promotion
    before = (manager.metrics(), manager.take_events())
    with pytest.raises(InvalidKeyError, match="key must be an offload key"):
        manager.lookup_result(cast(OffloadKey, ["unhashable"]))
    with pytest.raises(InvalidKeyError, match="keys must be a collection"):
        manager.prepare_load(cast(list[OffloadKey], None))
    with pytest.raises(InvalidArgumentError, match="req_context"):
        manager.lookup_result(k(1), req_context={"unhashable": True})  # nothing counted
    with pytest.raises(InvalidArgumentError, match="req_context"):
        manager.lookup_prefix([k(3), k(2)], req_context=[1])
    with pytest.raises(InvalidArgumentError, match="success"):
        manager.complete_store([k(3)], success=cast(bool, "no"))
    with pytest.raises(InvalidArgumentError, match="keys_per_group"):
        manager.lookup_request(SPEC, cast(list[list[OffloadKey]], "not a list of groups"), 32)
    assert (manager.metrics(), manager.take_events()) == before
    assert manager.lookup_result(k(9), req_context={"unhashable": True}) is MISS  # no state kept
    with pytest.raises(ConfigurationError, match="step_driven"):
        TieringOffloadingManager(
            CPUOffloadingManager(2),
            pool=torch.zeros(2, 8, dtype=torch.uint8),
            step_driven=cast(bool, 1),
        )
