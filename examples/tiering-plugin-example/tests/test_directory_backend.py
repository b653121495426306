"""The tiering conformance suite, run on DirectoryBackend, plus its settings checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiering.backends.base import StorageBackend
from tiering.core.block_format import HEADER_BYTES
from tiering.errors import ConfigurationError
from tiering.testing import BackendTests

from tiering_plugin_example import DirectoryBackend, DirectorySettings


class TestDirectoryBackend(BackendTests):
    persistent = True

    def make_backend(
        self, path: Path, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes
    ) -> StorageBackend:
        return DirectoryBackend(
            path=path,
            capacity_bytes=capacity_bytes,
            block_bytes=block_bytes,
            fingerprint=fingerprint,
        )

    def expected_usage_bytes(self, backend: StorageBackend, n_blocks: int) -> int:
        return n_blocks * (HEADER_BYTES + backend.block_bytes)

    def corrupt_stored_block(self, backend: StorageBackend, key: bytes) -> None:
        assert isinstance(backend, DirectoryBackend)
        block_file = backend.path / f"{key.hex()}.blk"
        stored = bytearray(block_file.read_bytes())
        stored[HEADER_BYTES + 7] ^= 0x01  # one payload bit
        block_file.write_bytes(stored)


@pytest.mark.parametrize("io_threads", [0, 65, 2.0, "2", True])
def test_bad_io_threads_is_a_configuration_error(io_threads: object) -> None:
    with pytest.raises(ConfigurationError, match="io_threads must be an int in 1..64"):
        DirectorySettings(io_threads=io_threads)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="io_threads"):
        DirectoryBackend(
            path="unused",
            capacity_bytes=1 << 20,
            block_bytes=4096,
            fingerprint=bytes(16),
            io_threads=io_threads,  # type: ignore[arg-type]
        )
