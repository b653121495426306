"""Restart and corruption through the whole manager: CPU -> file and CPU -> LMDB.

A first process stores blocks; a second one, with the same config, must find them in the
secondary tiers and load them bit-exact: after a clean shutdown, and after a SIGKILL that came
once the stores were acknowledged durable. A block that does not verify is a miss, never data.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiering.config import build_manager, build_pool, load_config
from tiering.managers.tiering_manager import TieringOffloadingManager

WORKER = Path(__file__).parent / "workers" / "restart_worker.py"
sys.path.insert(0, str(WORKER.parent))
from restart_worker import key, payload  # noqa: E402

NUM_BLOCKS = 12


def write_config(tmp_path: Path, tiers: str) -> Path:
    path = tmp_path / "tiering.yaml"
    path.write_text(
        "version: 1\n"
        "model: {shape: tiny}\n"
        "primary: {capacity: 64KiB}\n"  # 16 blocks of 4 KiB
        "events: {enabled: true}\n"
        f"secondary_tiers:\n{tiers}"
    )
    return path


FILE_TIER = "  - {name: nvme, type: file, capacity: 1MiB, path: nvme, durability: fsync}\n"
LMDB_TIER = "  - {name: lmdb, type: lmdb, capacity: 1MiB, path: lmdb, sync: true}\n"


def first_line(proc: subprocess.Popen[bytes]) -> str:
    """The worker's first line, read a byte at a time from the pipe: a buffered readline() may
    also take the lines after it, and communicate() would then never see them."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    line = bytearray()
    while (byte := os.read(fd, 1)) not in (b"", b"\n"):
        line += byte
    return line.decode()


def store_in_subprocess(config: Path, mode: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(config), str(NUM_BLOCKS), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    line = first_line(proc)
    if line != "DURABLE":
        proc.kill()
        raise AssertionError(f"worker failed: {line!r} {proc.communicate()[1].decode()}")
    if mode == "hang":
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
    else:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        assert out.decode().strip() == "CLOSED"


def reopen(config_path: Path) -> tuple[TieringOffloadingManager, torch.Tensor]:
    config = load_config(config_path)
    pool = build_pool(config)
    manager = build_manager(config, pool=pool)
    manager.wait_ready()
    return manager, pool.rows_view()


def load_all(manager: TieringOffloadingManager, rows: torch.Tensor) -> list[int]:
    """Promote every block, then load it; return the ids whose bytes were exact."""
    keys = [key(i) for i in range(NUM_BLOCKS)]
    assert manager.lookup_prefix(keys) is None  # all below the (empty) CPU tier: promotions
    manager.wait_idle()
    exact = []
    for i, k in enumerate(keys):
        if manager.lookup(k) is True:
            slot = int(manager.prepare_load([k]).block_ids[0])
            if torch.equal(rows[slot], payload(i, rows.shape[1])):
                exact.append(i)
            manager.complete_load([k])
    return exact


@pytest.mark.parametrize("mode", ["shutdown", "hang"])
@pytest.mark.parametrize("tier", [FILE_TIER, LMDB_TIER], ids=["file", "lmdb"])
def test_blocks_survive_a_restart_bit_exact(tmp_path: Path, tier: str, mode: str) -> None:
    config = write_config(tmp_path, tier)
    store_in_subprocess(config, mode)
    manager, rows = reopen(config)
    try:
        assert len(manager.tiers[0]) == NUM_BLOCKS
        assert load_all(manager, rows) == list(range(NUM_BLOCKS))
    finally:
        manager.shutdown()


def test_corrupt_block_after_restart_is_a_counted_miss(tmp_path: Path) -> None:
    tier = (
        "  - {name: nvme, type: file, capacity: 1MiB, path: nvme, durability: fsync,"
        " recover: trust_header}\n"
    )
    config = write_config(tmp_path, tier)
    store_in_subprocess(config, "shutdown")
    slot_files = [p for p in (tmp_path / "nvme").iterdir() if p.stat().st_size >= 1 << 16]
    assert len(slot_files) == 1
    # Flip one payload byte of every block: headers stay valid, so only the checksum can tell.
    data = bytearray(slot_files[0].read_bytes())
    manager, rows = reopen(config)
    manager.shutdown()
    slot_bytes = (len(data)) // manager.tiers[0].capacity_blocks
    for slot in range(NUM_BLOCKS):
        data[slot * slot_bytes + slot_bytes - 100] ^= 0xFF
    slot_files[0].write_bytes(bytes(data))
    manager, rows = reopen(config)
    try:
        assert len(manager.tiers[0]) == NUM_BLOCKS  # trust_header: the index believes them
        assert load_all(manager, rows) == []  # ...but no read returns them
        metrics = manager.tiers[0].metrics
        assert metrics.corrupt_blocks == NUM_BLOCKS
        assert len(manager.tiers[0]) == 0
        assert manager.lookup(key(0)) is False  # forgotten, not retried
    finally:
        manager.shutdown()
