"""A shared Redis tier in a TieringOffloadingManager, on real servers: the manager conformance
suite (standalone and step-driven), and what a shared tier does that others do not."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from redis_helpers import prefix_for, target_options

from tiering.backends.redis import RedisBackend
from tiering.manager import CPUOffloadingManager
from tiering.protocol import OffloadingManager
from tiering.shared_tier import SharedTier
from tiering.testing import ManagerTests
from tiering.testing.redis_servers import RedisClusterProcesses
from tiering.tiering_manager import TieringOffloadingManager

pytest_plugins = ["redis_fixtures"]  # the real-server fixtures

ROW_BYTES = 512
FINGERPRINT = b"shared-tier-fp01"
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
