"""Disk guard: a file or LMDB tier on a filesystem that another process fills shrinks (evicting)
ahead of ENOSPC, and keeps ``min_free_bytes`` of it free; without a guard the same fill is
ENOSPC (failed stores, or a tier that cannot open).

The filesystem is a real 16 MiB tmpfs, mounted by the test (the project's machines and CI run
as root). Where mounting is not permitted, the guard reads a fake ``statvfs`` of the same size
over a plain directory (``disk_guard.STATVFS``), and the no-guard cases, which need a real full
disk, are skipped with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tiering.backends import disk_guard
from tiering.backends.file import FileBackend
from tiering.backends.lmdb import LMDBBackend
from tiering.core.block_format import make_layout_fingerprint
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigurationError
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tiering_manager import TieringOffloadingManager

MiB = 1 << 20
DISK_BYTES = 16 * MiB
ROW_BYTES = 256 << 10
FINGERPRINT = make_layout_fingerprint({"disk_guard": ROW_BYTES})
MIN_FREE = 2 * MiB


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def row(i: int) -> torch.Tensor:
    return (torch.arange(ROW_BYTES, dtype=torch.int64) * 3 + i * 101).remainder(256).to(torch.uint8)


@dataclass
class Disk:
    path: Path
    real: bool  # a mounted tmpfs (else a directory whose statvfs is faked)

    def free_bytes(self) -> int:
        st = disk_guard.STATVFS(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, name: str, nbytes: int) -> None:
        """Another process writes ``nbytes`` into a file of its own there."""
        subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; f = open(sys.argv[1], 'ab'); f.write(b'x' * int(sys.argv[2]))",
                str(self.path / name),
                str(nbytes),
            ],
            check=True,
            timeout=120,
        )


class _FakeStatvfs:
    """A 16 MiB filesystem whose use is what the files under ``root`` occupy."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def __call__(self, path: str | Path) -> os.statvfs_result:
        used = sum(p.stat().st_blocks * 512 for p in self.root.rglob("*") if p.is_file())
        free = max(0, DISK_BYTES - used) // 4096
        total = DISK_BYTES // 4096
        return os.statvfs_result((4096, 4096, total, free, free, 0, 0, 0, 0, 255))


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Disk]:
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0700", "tmpfs", str(mount_point)],
        capture_output=True,
        timeout=60,
    )
    if mounted.returncode != 0:
        monkeypatch.setattr(disk_guard, "STATVFS", _FakeStatvfs(mount_point))
        yield Disk(mount_point, real=False)
        return
    try:
        yield Disk(mount_point, real=True)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False, timeout=60)


class Rig:
    """A manager over a 4-block primary and one tier; stores wait for the tier's write."""

    def __init__(self, tier: SecondaryTier) -> None:
        self.tier = tier
        self.pool = torch.zeros(4, ROW_BYTES, dtype=torch.uint8)
        self.manager = TieringOffloadingManager(CPUOffloadingManager(4), [tier], pool=self.pool)
        self.manager.wait_ready()

    def store(self, first: int, last: int) -> None:
        for i in range(first, last):
            out = self.manager.prepare_store([k(i)])
            assert out is not None
            self.pool[int(out.store_spec.block_ids[0])] = row(i)
            self.manager.complete_store([k(i)])
            self.manager.wait_idle()

    def load(self, i: int) -> torch.Tensor:
        manager = self.manager
        if manager.lookup(k(i)) is None:
            manager.wait_idle()
        assert manager.lookup(k(i)) is True
        slot = int(manager.prepare_load([k(i)]).block_ids[0])
        data = self.pool[slot].clone()
        manager.complete_load([k(i)])
        return data


def lmdb_tier(disk: Disk, min_free_bytes: int | None) -> SecondaryTier:
    backend = LMDBBackend(
        path=disk.path / "lmdb",
        capacity_bytes=12 * MiB,
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
        sync=False,
        metasync=False,
        max_txn_bytes=2 * MiB,
        min_free_bytes=min_free_bytes,
    )
    return SecondaryTier(backend, name="lmdb")


def file_tier(disk: Disk, min_free_bytes: int | None) -> SecondaryTier:
    backend = FileBackend(
        path=disk.path / "nvme",
        capacity_bytes=12 * MiB,
        block_bytes=ROW_BYTES,
        fingerprint=FINGERPRINT,
        min_free_bytes=min_free_bytes,
    )
    return SecondaryTier(backend, name="nvme")


def test_an_lmdb_tier_shrinks_ahead_of_a_disk_another_process_fills(disk: Disk) -> None:
    rig = Rig(lmdb_tier(disk, MIN_FREE))
    tier, manager = rig.tier, rig.manager
    try:
        rig.store(0, 16)  # ~4 MiB: room to spare
        assert len(tier) == 16 and tier.metrics.evictions == 0
        disk.fill("other-data", 8 * MiB)  # another program takes most of the rest
        rig.store(16, 48)  # 8 MiB more than the disk has room for
        backend = tier.backend
        assert tier.metrics.store_failures == 0 and backend.stats.put_failures == 0  # no ENOSPC
        assert tier.metrics.evictions > 0  # it made room by evicting instead
        assert backend.effective_capacity_blocks < backend.capacity_blocks
        assert len(tier) <= backend.effective_capacity_blocks
        assert disk.free_bytes() >= MIN_FREE
        for i in range(44, 48):  # the newest blocks are there, bit-exact
            assert manager.locate(k(i)) is not None
            assert torch.equal(rig.load(i), row(i))
    finally:
        manager.shutdown()


def test_without_a_guard_the_same_fill_is_enospc(disk: Disk) -> None:
    if not disk.real:
        pytest.skip("needs a real full filesystem (mounting a tmpfs was not permitted)")
    rig = Rig(lmdb_tier(disk, None))
    tier, manager = rig.tier, rig.manager
    try:
        rig.store(0, 16)
        disk.fill("other-data", 8 * MiB)
        rig.store(16, 48)
        assert tier.metrics.store_failures > 0  # ENOSPC: what the guard prevents
    finally:
        manager.shutdown()


def test_a_file_tier_opens_on_a_fuller_disk_smaller_and_never_takes_the_reserve(
    disk: Disk,
) -> None:
    disk.fill("other-data", 8 * MiB)  # 8 MiB free: less than the 12 MiB capacity
    rig = Rig(file_tier(disk, MIN_FREE))
    tier, manager = rig.tier, rig.manager
    try:
        assert tier.is_open, tier.open_error
        backend = tier.backend
        assert 0 < backend.effective_capacity_blocks < backend.capacity_blocks
        rig.store(0, 40)  # 10 MiB
        assert tier.metrics.store_failures == 0 and backend.stats.put_failures == 0
        assert tier.metrics.evictions > 0
        assert len(tier) <= backend.effective_capacity_blocks
        assert disk.free_bytes() >= MIN_FREE
        for i in range(36, 40):
            assert torch.equal(rig.load(i), row(i))
        # More of the disk goes to the other program: the tier shrinks, never grows into it.
        before = len(tier)
        disk.fill("other-data", disk.free_bytes() - MiB)
        rig.store(40, 44)
        assert tier.metrics.store_failures == 0
        assert len(tier) <= before
    finally:
        manager.shutdown()


def test_without_a_guard_a_file_tier_cannot_open_on_that_disk(disk: Disk) -> None:
    if not disk.real:
        pytest.skip("needs a real full filesystem (mounting a tmpfs was not permitted)")
    disk.fill("other-data", 8 * MiB)
    rig = Rig(file_tier(disk, None))
    try:
        assert rig.tier.status == "degraded" and "preallocate" in str(rig.tier.open_error)
    finally:
        rig.manager.shutdown()


def test_the_guard_reads_min_free_and_the_watermark(tmp_path: Path) -> None:
    def fake(free: int, used: int) -> disk_guard.Statvfs:
        def statvfs(path: str | Path) -> os.statvfs_result:
            total = DISK_BYTES // 4096
            return os.statvfs_result(
                (4096, 4096, total, (DISK_BYTES - used) // 4096, free // 4096, 0, 0, 0, 0, 255)
            )

        return statvfs

    guard = disk_guard.DiskGuard(tmp_path, min_free_bytes=MIN_FREE, statvfs=fake(6 * MiB, 10 * MiB))
    assert guard.allowed_bytes(3 * MiB) == 3 * MiB + 4 * MiB
    guard = disk_guard.DiskGuard(
        tmp_path, min_free_bytes=MIN_FREE, max_fs_used_fraction=0.5, statvfs=fake(6 * MiB, 10 * MiB)
    )
    assert guard.allowed_bytes(3 * MiB) == 1 * MiB  # 8 MiB allowed in use, 10 used: -2 MiB
    assert guard.allowed_blocks(3 * MiB, block_bytes=MiB // 2) == 2
    assert disk_guard.DiskGuard.build(tmp_path, None, None) is None
    for bad in ({"min_free_bytes": -1}, {"max_fs_used_fraction": 0}, {"max_fs_used_fraction": 2}):
        with pytest.raises(ConfigurationError):
            disk_guard.DiskGuard(tmp_path, **bad)  # type: ignore[arg-type]
