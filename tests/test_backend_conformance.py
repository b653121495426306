"""The shared backend conformance suite, run for FileBackend in several configurations and for
MemoryBackend."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import pytest

from tiering.backends.base import StorageBackend
from tiering.backends.file import HEADER_AREA_BYTES, SLOTS_NAME, FileBackend, slot_bytes_for
from tiering.backends.memory import MemoryBackend
from tiering.core.block_format import HEADER_BYTES, unpack_header
from tiering.errors import CorruptBlockError
from tiering.testing import BackendTests


def _o_direct_supported() -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            fd = os.open(Path(tmp) / "probe", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError:
            return False
        os.close(fd)
        return True


needs_o_direct = pytest.mark.skipif(
    not _o_direct_supported(), reason="the temp file system does not support O_DIRECT"
)


def find_slot_offset(slots_file: Path, key: bytes, block_bytes: int) -> int:
    """The file offset of the slot whose header names ``key`` (ground truth, no backend API)."""
    slot_bytes = slot_bytes_for(block_bytes)
    with open(slots_file, "rb") as f:
        offset = 0
        while header := f.read(HEADER_BYTES):
            try:
                if unpack_header(header).key == key:
                    return offset
            except CorruptBlockError:
                pass
            offset += slot_bytes
            f.seek(offset)
    raise AssertionError(f"no slot holds {key!r}")


class FileBackendSuite(BackendTests):
    """BackendTests for FileBackend; subclasses vary ``options``."""

    options: ClassVar[dict[str, Any]] = {}

    def make_backend(
        self, path: Path, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes
    ) -> StorageBackend:
        return FileBackend(
            path=path,
            capacity_bytes=capacity_bytes,
            block_bytes=block_bytes,
            fingerprint=fingerprint,
            **self.options,
        )

    def capacity_bytes_for(self, n_blocks: int, block_bytes: int) -> int:
        return n_blocks * slot_bytes_for(block_bytes)

    def expected_usage_bytes(self, backend: StorageBackend, n_blocks: int) -> int:
        return n_blocks * slot_bytes_for(backend.block_bytes)

    def corrupt_stored_block(self, backend: StorageBackend, key: bytes) -> None:
        assert isinstance(backend, FileBackend)
        slots_file = backend.path / SLOTS_NAME
        offset = find_slot_offset(slots_file, key, backend.block_bytes)
        position = offset + HEADER_AREA_BYTES + backend.block_bytes // 2
        fd = os.open(slots_file, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, position)
            os.pwrite(fd, bytes([byte[0] ^ 0x10]), position)
        finally:
            os.close(fd)


class TestFileBackend(FileBackendSuite):
    pass


class TestFileBackendFsync(FileBackendSuite):
    options = {"durability": "fsync", "io_threads": 3, "batch_blocks": 4}


class TestFileBackendTrustHeaderOddSize(FileBackendSuite):
    """Payloads that are not a multiple of 4096, unaligned buffers, header-only recovery."""

    block_bytes = 10_000
    buffer_offset_bytes = 8
    options = {"recover": "trust_header", "io_threads": 1, "batch_blocks": 1}


@needs_o_direct
class TestFileBackendODirect(FileBackendSuite):
    """O_DIRECT with page-aligned caller buffers: no bounce buffer."""

    options = {"o_direct": True}


@needs_o_direct
class TestFileBackendODirectBounce(FileBackendSuite):
    """O_DIRECT with unaligned buffers and an odd block size: every block is bounced."""

    block_bytes = 12_345
    buffer_offset_bytes = 8
    options = {"o_direct": True, "durability": "fsync"}


class TestMemoryBackend(BackendTests):
    """The in-memory backend: not persistent, same verified block format."""

    persistent = False

    def make_backend(
        self, path: Path, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes
    ) -> StorageBackend:
        return MemoryBackend(
            capacity_bytes=capacity_bytes, block_bytes=block_bytes, fingerprint=fingerprint
        )

    def capacity_bytes_for(self, n_blocks: int, block_bytes: int) -> int:
        return n_blocks * (HEADER_BYTES + block_bytes)

    def expected_usage_bytes(self, backend: StorageBackend, n_blocks: int) -> int:
        return n_blocks * (HEADER_BYTES + backend.block_bytes)

    def corrupt_stored_block(self, backend: StorageBackend, key: bytes) -> None:
        assert isinstance(backend, MemoryBackend)
        backend.corrupt(key, HEADER_BYTES + backend.block_bytes // 2)
