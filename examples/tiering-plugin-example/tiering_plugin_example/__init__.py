"""An example ``tiering`` backend: one file per block, ``<key hex>.blk`` = block header + payload.

A put writes a temp file and renames it into place, so a block is stored whole or not at all; a
get verifies header, key, fingerprint and checksum, and deletes a block that fails. All file I/O
runs on the backend's own threads. Registered as ``example_dir`` (see pyproject.toml).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from tiering.backends.base import BackendCapabilities, Outcome, StorageBackend
from tiering.core.block_format import (
    HEADER_BYTES,
    MAX_KEY_BYTES,
    pack_header,
    unpack_header,
    verify_block,
)
from tiering.core.keys import check_keys
from tiering.errors import BackendError, ConfigurationError, CorruptBlockError, InvalidKeyError

__all__ = ["DirectoryBackend", "DirectorySettings"]
_T = TypeVar("_T")


@dataclass(frozen=True)
class DirectorySettings:
    """The YAML keys a tier of this type takes besides ``path`` and ``capacity``."""

    # The config checks "min"/"max" and puts "doc" into the JSON schema.
    io_threads: int = field(default=2, metadata={"min": 1, "max": 64, "doc": "I/O threads"})

    def __post_init__(self) -> None:
        if type(self.io_threads) is not int or not 1 <= self.io_threads <= 64:
            raise ConfigurationError(f"io_threads must be an int in 1..64, got {self.io_threads!r}")


class DirectoryBackend(StorageBackend):
    """Blocks as files in the directory ``path``; persistent, recovered (verified) on open."""

    name: ClassVar[str] = "example_dir"
    settings_class: ClassVar[type] = DirectorySettings

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        capacity_bytes: int,
        block_bytes: int,
        fingerprint: bytes,
        io_threads: int = 2,
    ) -> None:
        super().__init__(block_bytes=block_bytes, fingerprint=fingerprint)
        self.settings = DirectorySettings(io_threads=io_threads)
        self.path, self._capacity_bytes = Path(path), capacity_bytes
        self._file_bytes = HEADER_BYTES + block_bytes
        self._index: set[bytes] = set()
        self._lock = threading.Lock()  # a file's rename or unlink and its index update go together
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: set[asyncio.Future[Any]] = set()

    @property
    def capabilities(self) -> BackendCapabilities:
        return BackendCapabilities(
            persistent=True, supports_delete=True, max_value_bytes=self.block_bytes
        )

    @property
    def capacity_bytes(self) -> int:
        return self._capacity_bytes

    @property
    def capacity_blocks(self) -> int:
        return self._capacity_bytes // self._file_bytes

    @property
    def usage_bytes(self) -> int:
        return len(self._index) * self._file_bytes

    @property
    def is_open(self) -> bool:
        return self._pool is not None

    async def open(self) -> list[bytes]:
        self._pool = ThreadPoolExecutor(self.settings.io_threads, thread_name_prefix=self.name)
        return await self._run(self._recover)

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if self._inflight:
            await asyncio.wait(self._inflight)
        if pool is not None:
            pool.shutdown()

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        pairs = self._check(keys, values)
        outcomes = await self._run(lambda: [self._put_one(key, value) for key, value in pairs])
        self.stats.puts += outcomes.count(Outcome.OK)
        self.stats.put_failures += outcomes.count(Outcome.FAILED)
        self.stats.bytes_written += outcomes.count(Outcome.OK) * self.block_bytes
        return outcomes

    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        pairs = self._check(keys, buffers)
        outcomes = await self._run(lambda: [self._get_one(key, buffer) for key, buffer in pairs])
        self.stats.gets += len(outcomes)
        self.stats.hits += outcomes.count(Outcome.OK)
        self.stats.misses += outcomes.count(Outcome.MISSING)
        self.stats.corrupt += outcomes.count(Outcome.CORRUPT)
        self.stats.read_failures += outcomes.count(Outcome.FAILED)
        self.stats.bytes_read += outcomes.count(Outcome.OK) * self.block_bytes
        return outcomes

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [key in self._index for key, _ in self._check(keys, None)]

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        pairs = self._check(keys, None)
        deleted = await self._run(lambda: [self._delete_one(key) for key, _ in pairs])
        self.stats.deletes += sum(deleted)
        return deleted

    def _check(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview] | None
    ) -> list[tuple[bytes, memoryview]]:
        """Misuse raises here, before any I/O; returns (key, byte view of its buffer) pairs."""
        if self._pool is None:
            raise BackendError(f"{self.name} backend at {self.path} is not open")
        key_list = check_keys(keys)
        if any(len(key) > MAX_KEY_BYTES for key in key_list):
            raise InvalidKeyError(f"a stored key must be at most {MAX_KEY_BYTES} bytes")
        if buffers is None:
            return [(key, memoryview(b"")) for key in key_list]
        views = [memoryview(buffer).cast("B") for buffer in buffers]
        if [view.nbytes for view in views] != [self.block_bytes] * len(key_list):
            raise ValueError(f"give one buffer of block_bytes={self.block_bytes} per key")
        return list(zip(key_list, views, strict=True))

    async def _run(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` on the backend's threads; if cancelled, wait for it before raising."""
        assert self._pool is not None
        # ``fn`` holds the caller's buffers. The executor keeps its work item (and so what it
        # calls) a moment after the result is set, so the thread drops ``fn`` first: once we
        # return, nothing here exports the caller's memory.
        box = [fn]
        del fn

        def call() -> _T:
            try:
                return box[0]()
            finally:
                box.clear()

        future = asyncio.get_running_loop().run_in_executor(self._pool, call)
        self._inflight.add(future)
        future.add_done_callback(self._inflight.discard)
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:  # the thread may still be using the caller's buffers
            await asyncio.wait([future])
            raise

    def _file(self, key: bytes) -> Path:
        return self.path / f"{key.hex()}.blk"  # hex: a hostile key never reaches the file system

    def _put_one(self, key: bytes, value: memoryview) -> Outcome:
        with self._lock:  # also keeps the capacity check and the rename together
            if key not in self._index and len(self._index) >= self.capacity_blocks:
                return Outcome.FULL
            temp = self._file(key).with_suffix(".tmp")
            try:
                with open(temp, "wb") as f:
                    f.write(pack_header(key, value, self.fingerprint))
                    f.write(value)
                os.replace(temp, self._file(key))
            except OSError:
                temp.unlink(missing_ok=True)
                return Outcome.FAILED
            self._index.add(key)
            return Outcome.OK

    def _get_one(self, key: bytes, buffer: memoryview) -> Outcome:
        try:
            with open(self._file(key), "rb") as f:
                header, inode = f.read(HEADER_BYTES), os.fstat(f.fileno()).st_ino
                size = f.readinto(buffer)
            verify_block(
                unpack_header(header),
                buffer[:size],
                expected_key=key,
                expected_fingerprint=self.fingerprint,
            )
            return Outcome.OK
        except FileNotFoundError:
            return Outcome.MISSING
        except CorruptBlockError:
            self._delete_one(key, only_inode=inode)
            return Outcome.CORRUPT
        except OSError:
            return Outcome.FAILED

    def _delete_one(self, key: bytes, only_inode: int | None = None) -> bool:
        with self._lock:
            try:
                if only_inode is not None and os.stat(self._file(key)).st_ino != only_inode:
                    return False  # a put replaced the corrupt block after it was read
                os.unlink(self._file(key))
            except FileNotFoundError:
                pass
            stored = key in self._index
            self._index.discard(key)
            return stored

    def _recover(self) -> list[bytes]:
        """Index every block file that verifies; delete the rest and unfinished temp files."""
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        for temp in self.path.glob("*.tmp"):
            temp.unlink()
        scratch = memoryview(bytearray(self.block_bytes))
        self._index = set()
        for block_file in self.path.glob("*.blk"):
            try:
                key = bytes.fromhex(block_file.stem)
            except ValueError:
                continue  # not a file this backend wrote
            if self._get_one(key, scratch) is Outcome.OK:
                self._index.add(key)
        return list(self._index)
