"""The CPU block pool: preallocated memory, pinning, shared memory across processes.

Copies between the pool and KV caches are tested in test_transfer_*.py; here they only carry
bytes between processes.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiering.errors import BackendError, ConfigurationError, LayoutError, UnsafeFileError
from tiering.managers.pool import CPUBlockPool
from tiering.testing.copy_strategy_tests import (
    NUM_SLOTS,
    HybridModel,
    group_block,
    make_hybrid_kv,
    transfer,
)

# --- pool memory -------------------------------------------------------------------------


def test_pool_is_preallocated_zeroed_and_unpinned_without_cuda() -> None:
    pool = CPUBlockPool(4, 1000, world_size=2, pin_memory="auto")
    assert pool.rows_view().shape == (4, 2000) and pool.nbytes == 8000
    assert not pool.rows_view().any()
    assert pool.is_pinned == torch.cuda.is_available()
    assert pool.rank_view(1).shape == (4, 1000)
    assert pool.rank_view(1).data_ptr() == pool.rows_view().data_ptr() + 1000


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinning works with CUDA")
def test_forced_pinning_without_cuda_falls_back_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="tiering.managers.pool"):
        pool = CPUBlockPool(2, 64, pin_memory=True)
    assert not pool.is_pinned
    assert "pinned host memory unavailable" in caplog.text
    pool.rows_view()[1].fill_(3)  # usable
    assert pool.block_view(1).sum() == 3 * 64


def test_bad_pool_settings_are_configuration_errors() -> None:
    with pytest.raises(ConfigurationError, match=r"pin_memory must be True, False or 'auto'"):
        CPUBlockPool(2, 64, pin_memory="yes")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"num_blocks must be a positive int, got 0"):
        CPUBlockPool(0, 64)
    with pytest.raises(ConfigurationError, match=r"shared pool name '\.\.' is invalid"):
        CPUBlockPool.create_shared("..", 2, 64)


def test_rows_memoryview_is_writable_zero_copy_for_preadv(tmp_path: Path) -> None:
    pool = CPUBlockPool(6, 100, world_size=2)
    payload = bytes(range(256)) * 2  # rows 2 and 3: 400 bytes
    path = tmp_path / "rows.bin"
    path.write_bytes(payload[:400])
    view = pool.rows_memoryview(2, 4)
    assert len(view) == 400 and not view.readonly
    fd = os.open(path, os.O_RDONLY)
    try:
        assert os.preadv(fd, [view], 0) == 400
    finally:
        os.close(fd)
    assert bytes(pool.rows_view()[2:4].numpy()) == payload[:400]
    assert not pool.rows_view()[1].any() and not pool.rows_view()[4].any()
    with pytest.raises(LayoutError, match=r"slot range \[4, 7\) is empty or out of range"):
        pool.rows_memoryview(4, 7)
    with pytest.raises(LayoutError, match=r"slot range \[6, 7\)"):
        pool.block_view(6)


# --- shared memory -----------------------------------------------------------------------


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"tiering-test-{os.getpid()}-{time.monotonic_ns()}"
    yield name
    for base in (Path("/dev/shm"), Path(tempfile.gettempdir())):
        (base / name).unlink(missing_ok=True)


CHILD_STORE = """
import sys
sys.path.insert(0, sys.argv[1])
from tiering.managers.pool import CPUBlockPool
from tiering.testing.copy_strategy_tests import HybridModel, transfer
name, block_bytes = sys.argv[2], int(sys.argv[3])
pool = CPUBlockPool.open_shared(name, 12, block_bytes, world_size=2, timeout_s=30)
model = HybridModel(seed=31, pool=pool, rank=1)
model.store(transfer([[1, 2], [3], [0, 4], [5]], [[0, 1], [2], [3, 4], [5]]))
assert not pool.is_creator
pool.close()
print("stored")
"""


def test_blocks_written_by_one_process_read_bit_exact_by_another(shm_name: str) -> None:
    rank0 = HybridModel(seed=30)
    block_bytes = rank0.caches.offloaded_block_bytes_per_rank()
    pool = CPUBlockPool.create_shared(shm_name, NUM_SLOTS, block_bytes, world_size=2)
    assert pool.is_creator and pool.path is not None and pool.path.exists()
    job = transfer([[1, 2], [3], [0, 4], [5]], [[0, 1], [2], [3, 4], [5]])
    rank0 = HybridModel(seed=30, pool=pool, rank=0)
    rank0.store(job)

    tests_dir = str(Path(__file__).parent)
    child = subprocess.run(
        [sys.executable, "-c", CHILD_STORE, tests_dir, shm_name, str(block_bytes)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "stored"

    # Read the child's (rank 1) blocks back through this process, into fresh tensors.
    reader = HybridModel(seed=32, pool=pool, rank=1, zero=True)
    reader.load(job)
    expected = make_hybrid_kv(31)
    for g, blocks in enumerate(([1, 2], [3], [4], [5])):
        for block in blocks:
            assert group_block(reader.kv, g, block) == group_block(expected, g, block)
    # Rank 0's parts are intact next to them in the same rows.
    rank0_view = pool.rank_view(0)
    assert torch.equal(rank0_view[0, :512], rank0.caches.tensors[0].tensor[1])
    pool.close()
    assert not pool.path.exists()


def test_joiner_waits_for_a_late_creator(shm_name: str) -> None:
    joined: list[CPUBlockPool] = []
    thread = threading.Thread(
        target=lambda: joined.append(CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=30))
    )
    thread.start()
    time.sleep(0.05)
    creator = CPUBlockPool.create_shared(shm_name, 3, 128)
    thread.join(timeout=30)
    (joiner,) = joined
    creator.rows_view()[2].fill_(9)
    assert (joiner.block_view(2) == 9).all()
    joiner.close()
    assert creator.path is not None and creator.path.exists()  # only the creator unlinks
    creator.close()
    assert not creator.path.exists()


def test_joiner_times_out_with_a_clear_error(shm_name: str) -> None:
    with pytest.raises(BackendError, match=r"timed out after 0\.2 s waiting for the shared pool"):
        CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=0.2)
    # A file of the right size that nobody initialised never becomes ready either.
    path = Path("/dev/shm") / shm_name
    if path.parent.is_dir():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # private, as a pool's
        os.write(fd, bytes(4096 + 3 * 128))
        os.close(fd)
        with pytest.raises(BackendError, match=r"timed out"):
            CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=0.1)


def test_joiner_rejects_a_pool_of_another_geometry(shm_name: str) -> None:
    with CPUBlockPool.create_shared(shm_name, 3, 128, world_size=2):
        with pytest.raises(
            LayoutError, match=r"world_size=2 num_blocks=3 block_bytes=128.*expected"
        ):
            CPUBlockPool.open_shared(shm_name, 4, 128, world_size=2, timeout_s=1)
        with pytest.raises(FileExistsError):
            CPUBlockPool.create_shared(shm_name, 3, 128, world_size=2)
        second = CPUBlockPool.open_or_create_shared(shm_name, 3, 128, world_size=2)
        assert not second.is_creator
        second.close()


def test_joiner_refuses_a_pool_file_open_to_group_or_others(shm_name: str) -> None:
    with CPUBlockPool.create_shared(shm_name, 3, 128) as creator:
        assert creator.path is not None
        path = creator.path
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for mode in (0o666, 0o640, 0o604, 0o620):
            os.chmod(path, mode)
            with pytest.raises(UnsafeFileError) as caught:
                CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=5)
            message = str(caught.value)
            assert repr(str(path)) in message and f"with mode {mode:04o}" in message
            assert f"owned by uid {os.geteuid()}" in message and "mode 0600" in message
        os.chmod(path, 0o600)
        with CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=5) as joiner:
            creator.rows_view()[2].fill_(9)
            assert (joiner.block_view(2) == 9).all()


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_joiner_refuses_a_pool_file_owned_by_another_user(shm_name: str) -> None:
    other_uid = 54321 if os.geteuid() != 54321 else 54322
    with CPUBlockPool.create_shared(shm_name, 3, 128) as creator:
        assert creator.path is not None
        path = creator.path
        os.chown(path, other_uid, -1)  # mode stays 0600: only the owner differs
        with pytest.raises(UnsafeFileError, match=rf"owned by uid {other_uid} with mode 0600"):
            CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=5)
        expected = rf"expected a file owned by .*uid {os.geteuid()}"
        with pytest.raises(UnsafeFileError, match=expected):
            CPUBlockPool.open_or_create_shared(shm_name, 3, 128, timeout_s=5)
        os.chown(path, os.geteuid(), -1)
        CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=5).close()


CHILD_CRASH = """
import os, signal, sys
from tiering.managers.pool import CPUBlockPool
pool = CPUBlockPool.create_shared(sys.argv[1], 3, 128)
pool.rows_view()[1].fill_(5)
print("created", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a crash: never closes, never unlinks
"""


def _orphan_pool(shm_name: str) -> Path:
    """A pool file left behind by a creator killed with SIGKILL."""
    child = subprocess.run(
        [sys.executable, "-c", CHILD_CRASH, shm_name], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL and child.stdout == "created\n", child.stderr
    (path,) = [
        p
        for p in (Path("/dev/shm") / shm_name, Path(tempfile.gettempdir()) / shm_name)
        if p.exists()
    ]
    return path


def test_a_pool_left_by_a_crashed_creator_is_never_joined_and_is_replaced(
    shm_name: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = _orphan_pool(shm_name)
    orphan_inode = path.stat().st_ino
    with pytest.raises(BackendError, match=r"left by a creator that exited"):
        CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=0.1)
    pool = CPUBlockPool.open_or_create_shared(shm_name, 3, 128)
    assert pool.is_creator and path.stat().st_ino != orphan_inode
    assert "its creator had exited" in caplog.text
    assert (pool.block_view(1) == 0).all()  # a fresh pool, not the orphan's bytes
    assert not list(path.parent.glob(f".{shm_name}.*.tmp"))  # no temp file left
    pool.close()
    assert not path.exists()


def test_a_waiting_joiner_attaches_to_the_replacement_not_the_orphan(shm_name: str) -> None:
    _orphan_pool(shm_name)
    joined: list[CPUBlockPool] = []
    thread = threading.Thread(
        target=lambda: joined.append(CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=30))
    )
    thread.start()
    time.sleep(0.05)
    assert not joined  # the orphan is there, but its creator is gone: keep waiting
    creator = CPUBlockPool.create_shared(shm_name, 3, 128)
    thread.join(timeout=30)
    (joiner,) = joined
    creator.rows_view()[2].fill_(9)
    assert (joiner.block_view(2) == 9).all() and (joiner.block_view(1) == 0).all()
    joiner.close()
    creator.close()


def test_an_orphan_is_replaced_while_a_joiner_is_probing_it(shm_name: str) -> None:
    # A joiner checks whether a pool's creator lives with a shared lock, for microseconds; on a
    # busy machine it may be descheduled holding it. A creator replacing the orphan meanwhile
    # must not take that probe for a live creator (it did: FileExistsError, and every joiner
    # then waited for a replacement that never came).
    path = _orphan_pool(shm_name)
    probe = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(probe, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the probe, held
        creator = CPUBlockPool.open_or_create_shared(shm_name, 3, 128, timeout_s=0.1)
        assert creator.is_creator and os.stat(path).st_ino != os.fstat(probe).st_ino
    finally:
        os.close(probe)
    joiner = CPUBlockPool.open_shared(shm_name, 3, 128, timeout_s=30)
    creator.rows_view()[1].fill_(4)
    assert (joiner.block_view(1) == 4).all()
    joiner.close()
    creator.close()


def test_a_live_creator_in_another_process_is_not_replaced(shm_name: str) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD_CRASH.replace("os.kill(os.getpid(), signal.SIGKILL)", "sys.stdin.read()"),
            shm_name,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "created\n"
        with pytest.raises(FileExistsError):
            CPUBlockPool.create_shared(shm_name, 3, 128)
        joiner = CPUBlockPool.open_or_create_shared(shm_name, 3, 128, timeout_s=5)
        assert not joiner.is_creator and (joiner.block_view(1) == 5).all()
        joiner.close()
    finally:
        holder.communicate("", timeout=60)
    assert holder.returncode == 0


def test_a_file_system_without_hard_links_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_links(*args: object, **kwargs: object) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(BackendError, match=r"cannot link the shared pool into place.*hard links"):
        CPUBlockPool.create_shared(tmp_path / "pool.mmap", 2, 64)
    assert list(tmp_path.iterdir()) == []  # neither the pool nor its temporary file


def test_shared_pool_at_an_explicit_path(tmp_path: Path) -> None:
    path = tmp_path / "pool.mmap"
    with CPUBlockPool.create_shared(path, 2, 64) as pool:
        pool.rows_memoryview(1, 2)[:] = bytes([7]) * 64
        assert path.stat().st_size == 4096 + 128
        with open(path, "rb") as f:  # the row is on the file, after the header page
            f.seek(4096 + 64)
            assert f.read(64) == bytes([7]) * 64
    assert not path.exists()


def test_touching_pages_without_madvise_populate_still_gives_a_zeroed_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiering.managers import pool as pool_module

    monkeypatch.setattr(pool_module._SharedRegion, "_populate", lambda self: False)
    with CPUBlockPool.create_shared(tmp_path / "pool.mmap", 3, 5000) as pool:
        assert pool.rows_view().shape == (3, 5000) and not pool.rows_view().any()


def test_shared_pool_errors_are_backend_errors(tmp_path: Path) -> None:
    with pytest.raises(BackendError, match=r"cannot create the shared pool .*missing"):
        CPUBlockPool.create_shared(tmp_path / "missing" / "pool.mmap", 2, 64)


def test_closing_a_shared_pool_under_a_transfer_engine_is_safe(shm_name: str) -> None:
    model = HybridModel(seed=40)
    block_bytes = model.caches.offloaded_block_bytes_per_rank()
    pool = CPUBlockPool.create_shared(shm_name, NUM_SLOTS, block_bytes)
    model = HybridModel(seed=40, pool=pool)
    view = pool.rows_memoryview(0, 1)
    pool.close()  # the engine and the memoryview still reference the mapping
    assert pool.path is not None and not pool.path.exists()
    with pytest.raises(BackendError, match=r"is closed"):
        model.load(transfer([[1], [], [], []], [[0], [], [], []]))
    view[0] = 1  # still mapped, so no crash


def test_shared_mapping_is_released_once_the_last_view_is_gone(shm_name: str) -> None:
    import gc
    import weakref

    pool = CPUBlockPool.create_shared(shm_name, 4, 4096)
    assert pool._shared is not None
    mapping = weakref.ref(pool._shared._mmap)
    view = pool.rows_memoryview(0, 2)
    pool.close()
    gc.collect()
    assert mapping() is not None  # the view keeps the memory mapped
    del view
    gc.collect()
    assert mapping() is None
