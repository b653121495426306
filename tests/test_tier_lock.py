"""Nothing deletes a tier that a live process holds: ``tiering wipe``, ``replay --fresh`` and a
backend's recovery take the lock the backends hold while open, and refuse (a typed error naming
the tier and the holding process, nothing deleted) until that process has let go."""

from __future__ import annotations

import asyncio
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiering import cli
from tiering.backends.file import FileBackend
from tiering.backends.lmdb import LMDBBackend
from tiering.backends.tier_lock import TierInUseError, flock_holders, hold_directory_locks
from tiering.config import load_config, wipe_tiers
from tiering.errors import BackendError, TieringError

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).parent / "workers" / "holder_worker.py"

CONFIG = """\
version: 1
model:
  shape: tiny
primary:
  capacity: 64KiB
secondary_tiers:
  - name: nvme
    type: file
    path: ./tiers/nvme
    capacity: 1MiB
  - name: db
    type: lmdb
    path: ./tiers/db
    capacity: 1MiB
    sync: false
"""


def tree_state(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


class Holder:
    """A second process holding the config's tiers open (tests/workers/holder_worker.py)."""

    def __init__(self, config_path: Path, blocks: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(config_path), str(blocks)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=config_path.parent,
        )
        assert self.proc.stdout is not None
        # Until the tiers are open and written (a hung start fails the test, never hangs it).
        ready, _, _ = select.select([self.proc.stdout], [], [], 300)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("HOLDING "):
            self.proc.kill()
            _out, err = self.proc.communicate(timeout=60)
            raise AssertionError(f"the holder did not start: {line!r} {err}")
        self.pid = int(line.split()[1])

    def release(self) -> None:
        """Let it store one more block, close its tiers and exit; check it did so cleanly."""
        out, err = self.proc.communicate("", timeout=120)
        assert self.proc.returncode == 0, err
        assert "CLOSED" in out

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate(timeout=60)


@pytest.fixture
def config_path(tmp_path: Path) -> Path:
    path = tmp_path / "tiering.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture
def holder(config_path: Path) -> Iterator[Holder]:
    held = Holder(config_path, blocks=3)
    try:
        yield held
    finally:
        held.kill()


def test_wipe_refuses_tiers_a_live_process_holds_then_wipes_them_once_it_exits(
    config_path: Path, holder: Holder, capsys: pytest.CaptureFixture[str]
) -> None:
    tiers = config_path.parent / "tiers"
    before = tree_state(tiers)
    assert {"nvme/slots.bin", "db/data.mdb", "db/tiering-lmdb.lock"} <= set(before)

    status = cli.main(["wipe", "--config", str(config_path)])
    err = capsys.readouterr().err
    assert status == cli.EXIT_ERROR
    assert "'nvme'" in err and f"process {holder.pid}" in err and "in use" in err
    assert tree_state(tiers) == before  # nothing deleted

    # Each tier alone: the LMDB tier names its holder too.
    status = cli.main(["wipe", "--config", str(config_path), "--tier", "db"])
    err = capsys.readouterr().err
    assert status == cli.EXIT_ERROR
    assert "'db'" in err and f"process {holder.pid}" in err
    assert tree_state(tiers) == before

    config = load_config(config_path)
    with pytest.raises(TierInUseError) as caught:
        wipe_tiers(list(config.secondary_tiers))
    assert caught.value.holders == (holder.pid,) and caught.value.tier == "nvme"
    assert isinstance(caught.value, TieringError)
    assert tree_state(tiers) == before

    holder.release()  # it wrote one more block into its (never unlinked) files, then closed
    after_holder = tree_state(tiers)
    assert after_holder["nvme/slots.bin"] != before["nvme/slots.bin"]

    status = cli.main(["wipe", "--config", str(config_path)])
    out = capsys.readouterr().out
    assert status == cli.EXIT_OK, out
    assert not (tiers / "nvme").exists() and not (tiers / "db").exists()


def test_replay_fresh_refuses_tiers_a_live_process_holds(config_path: Path, holder: Holder) -> None:
    tiers = config_path.parent / "tiers"
    before = tree_state(tiers)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiering.cli",
            "replay",
            "--config",
            str(config_path),
            "--fresh",
            "--trace",
            "chat",
            "--scale",
            "tiny",
            "--max-requests",
            "3",
            "--no-progress",
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        timeout=300,
    )
    assert result.returncode == cli.EXIT_ERROR, result.stderr
    assert f"process {holder.pid}" in result.stderr and "'nvme'" in result.stderr
    assert tree_state(tiers) == before


@pytest.mark.asyncio
@pytest.mark.parametrize("tier", ["nvme", "db"])
async def test_recovery_of_another_layout_refuses_a_held_tier(
    config_path: Path, holder: Holder, tier: str
) -> None:
    """A backend told to wipe data of another layout never gets to look: the holder's lock
    comes first, and the error names it."""
    tiers = config_path.parent / "tiers"
    before = tree_state(tiers)
    config = load_config(config_path)
    block_bytes, other_layout = config.block_bytes(), b"\x01" * 16
    backend: FileBackend | LMDBBackend
    if tier == "nvme":
        backend = FileBackend(
            path=tiers / "nvme",
            capacity_bytes=1 << 20,
            block_bytes=block_bytes,
            fingerprint=other_layout,
            on_layout_mismatch="wipe",
        )
    else:
        backend = LMDBBackend(
            path=str(tiers / "db"),
            capacity_bytes=1 << 20,
            block_bytes=block_bytes,
            fingerprint=other_layout,
            on_layout_mismatch="wipe",
        )
    with pytest.raises(TierInUseError) as caught:
        await backend.open()
    assert caught.value.holders == (holder.pid,)
    assert isinstance(caught.value, BackendError)  # what callers catching BackendError expect
    await backend.close()
    assert tree_state(tiers) == before


def test_flock_holders_names_this_process_and_nothing_once_released(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    with hold_directory_locks(tmp_path / "d", (".",), tier="t"):
        fd = os.open(tmp_path / "d", os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert flock_holders(fd) == (os.getpid(),)
            with (
                pytest.raises(TierInUseError, match=r"tier 't'.*process \d+ \(this one\)"),
                hold_directory_locks(tmp_path / "d", (".",), tier="t"),
            ):
                pass
        finally:
            os.close(fd)
    with hold_directory_locks(tmp_path / "d", (".",)):  # released: free again
        pass


def test_a_backend_in_this_process_is_refused_by_wipe(config_path: Path) -> None:
    """flock is per open file description: the same process holding a tier is refused too."""
    config = load_config(config_path)
    backend = FileBackend(
        path=config_path.parent / "tiers" / "nvme",
        capacity_bytes=1 << 20,
        block_bytes=config.block_bytes(),
        fingerprint=config.fingerprint(),
    )
    loop = asyncio.new_event_loop()
    loop.run_until_complete(backend.open())
    try:
        with pytest.raises(TierInUseError, match="this one"):
            wipe_tiers([config.tier("nvme")])
        assert (config_path.parent / "tiers" / "nvme" / "slots.bin").exists()
    finally:
        loop.run_until_complete(backend.close())
        loop.close()
    wipe_tiers([config.tier("nvme")])
    assert not (config_path.parent / "tiers" / "nvme").exists()
