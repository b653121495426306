"""A tier whose disk is full: stores fail cleanly, nothing half-written is visible, and the
manager keeps serving. The writes really go to /dev/full, through the file backend's seam."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from tiering.backends._fileops import FileOps
from tiering.backends.file import FileBackend, slot_bytes_for
from tiering.core.block_format import make_layout_fingerprint
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tiering_manager import TieringOffloadingManager

ROW_BYTES = 4096
FINGERPRINT = make_layout_fingerprint({"faults": ROW_BYTES})


class DevFullWrites(FileOps):
    """Block writes go to /dev/full (ENOSPC from the kernel) while ``full`` is set."""

    full = True

    def pwritev(
        self, fd: int, buffers: Sequence[memoryview | bytes | bytearray], offset: int
    ) -> int:
        if not self.full:
            return super().pwritev(fd, buffers, offset)
        devfull = os.open("/dev/full", os.O_WRONLY)
        try:
            return os.pwritev(devfull, buffers, offset)
        finally:
            os.close(devfull)


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def test_full_disk_fails_stores_cleanly_and_the_manager_keeps_serving(tmp_path: Path) -> None:
    ops = DevFullWrites()
    backend = FileBackend(
        path=tmp_path / "nvme",
        capacity_bytes=16 * slot_bytes_for(ROW_BYTES),
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
        file_ops=ops,
    )
    ops.full = False  # the backend opens (writes its manifest) on a healthy disk
    tier = SecondaryTier(backend, name="nvme")
    pool = torch.zeros(4, ROW_BYTES, dtype=torch.uint8)
    manager = TieringOffloadingManager(
        CPUOffloadingManager(4, enable_events=True), [tier], pool=pool
    )
    try:
        manager.wait_ready()
        ops.full = True

        def store(*ids: int) -> None:
            keys = [k(i) for i in ids]
            out = manager.prepare_store(keys)
            assert out is not None
            for slot, i in zip(out.store_spec.block_ids.tolist(), ids, strict=True):
                pool[slot] = i
            manager.complete_store(keys)
            manager.wait_idle()

        store(1, 2)
        assert tier.metrics.store_failures == 2
        assert len(tier) == 0 and tier.state(k(1)).name == "ABSENT"
        assert not [e for e in manager.take_events() if e.medium == "NVME"]
        # The primary copies are intact and load.
        spec = manager.prepare_load([k(1), k(2)])
        assert [int(pool[s][0]) for s in spec.block_ids.tolist()] == [1, 2]
        manager.complete_load([k(1), k(2)])
        # The disk recovers: later stores reach the tier, and come back bit-exact.
        ops.full = False
        store(3, 4, 5, 6)  # evicts 1 and 2 from the primary
        assert tier.state(k(3)).name == "READY"
        assert manager.lookup(k(1)) is False  # its tier write failed: a miss, not garbage
        store(7, 8, 9, 10)  # push 3 out of the primary
        assert manager.lookup(k(3)) is None
        manager.wait_idle()
        assert manager.lookup(k(3)) is True
        slot = int(manager.prepare_load([k(3)]).block_ids[0])
        assert torch.equal(pool[slot], torch.full((ROW_BYTES,), 3, dtype=torch.uint8))
        manager.complete_load([k(3)])
    finally:
        manager.shutdown()
