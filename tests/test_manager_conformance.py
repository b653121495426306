"""The shared manager conformance suite, run for both managers in several configurations."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from tiering.backends.file import FileBackend, slot_bytes_for
from tiering.backends.memory import MemoryBackend
from tiering.core.block_format import HEADER_BYTES, make_layout_fingerprint
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.protocol import OffloadingManager
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.testing import ManagerTests

ROW_BYTES = 512
FINGERPRINT = make_layout_fingerprint({"manager-conformance": ROW_BYTES})


class TestCPUManagerLRU(ManagerTests):
    def make_manager(
        self, num_blocks: int, *, store_threshold: int = 1, enable_events: bool = True
    ) -> OffloadingManager:
        return CPUOffloadingManager(
            num_blocks, "lru", enable_events, store_threshold=store_threshold
        )


class TestCPUManagerARC(ManagerTests):
    lru_order = False

    def make_manager(
        self, num_blocks: int, *, store_threshold: int = 1, enable_events: bool = True
    ) -> OffloadingManager:
        return CPUOffloadingManager(
            num_blocks, "arc", enable_events, store_threshold=store_threshold
        )


class TieringSuite(ManagerTests):
    """ManagerTests for TieringOffloadingManager; subclasses choose tiers and the step mode."""

    step_driven = False
    options: ClassVar[dict[str, Any]] = {}

    def make_tiers(self) -> list[SecondaryTier]:
        return []

    def make_manager(
        self, num_blocks: int, *, store_threshold: int = 1, enable_events: bool = True
    ) -> OffloadingManager:
        pool = torch.zeros(num_blocks, ROW_BYTES, dtype=torch.uint8)
        manager = TieringOffloadingManager(
            CPUOffloadingManager(num_blocks, "lru", store_threshold=store_threshold),
            self.make_tiers(),
            pool=pool,
            enable_events=enable_events,
            step_driven=self.step_driven,
            **self.options,
        )
        manager.wait_ready()
        self.remember_rows(manager, pool.numpy())
        return manager

    def settle(self, manager: OffloadingManager) -> None:
        assert isinstance(manager, TieringOffloadingManager)
        manager.on_schedule_end()
        manager.wait_idle()  # the step's I/O drained, its results applied in order


def memory_tier(blocks: int = 64) -> SecondaryTier:
    backend = MemoryBackend(
        capacity_bytes=blocks * (HEADER_BYTES + ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
    )
    return SecondaryTier(backend, name="mem")


class TestTieringManagerWithoutTiers(TieringSuite):
    pass


class TestTieringManagerStepDrivenWithoutTiers(TieringSuite):
    step_driven = True


class TestTieringManagerMemoryTier(TieringSuite):
    has_lower_tiers = True

    def make_tiers(self) -> list[SecondaryTier]:
        return [memory_tier()]


class TestTieringManagerMemoryTierStepDriven(TieringSuite):
    has_lower_tiers = True
    step_driven = True

    def make_tiers(self) -> list[SecondaryTier]:
        return [memory_tier()]


class TestTieringManagerFileAndMemoryTiersStepDriven(TieringSuite):
    """A real file tier first, then a small memory tier (write-back is left out: its
    prepare_store may evict and still answer None, the protocol's one documented exception)."""

    has_lower_tiers = True
    step_driven = True

    @pytest.fixture(autouse=True)
    def _folder(self, tmp_path: Path) -> None:
        self.folder = tmp_path
        self.made = 0

    def make_tiers(self) -> list[SecondaryTier]:
        self.made += 1
        file_backend = FileBackend(
            path=self.folder / f"nvme-{self.made}",
            capacity_bytes=64 * slot_bytes_for(ROW_BYTES),
            block_bytes=ROW_BYTES,
            fingerprint=FINGERPRINT,
        )
        return [SecondaryTier(file_backend, name="nvme"), memory_tier(8)]
