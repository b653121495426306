"""A storage backend wrapper whose I/O calls wait at a gate the test opens: tier I/O finishes
when, and in the order, a test says (not when the I/O thread happens to get there).

:class:`GatedBackend` wraps any real backend (file, LMDB, memory, a plugin). While the gate is
closed, each ``put``, ``get``, ``delete``, ``contains`` and ``exists`` call *parks* before it
reaches the wrapped backend; :meth:`GatedBackend.release` lets one parked call through (or fails
it without touching the wrapped backend: ``FAILED`` outcomes, or a ``BackendError``), and
:func:`wait_until_quiet` waits until every job of a manager has either finished or parked again,
so the manager's state is the same on every run of a test. ``open`` and ``close`` never park.
:meth:`GatedBackend.read_back` reads blocks from the wrapped backend (on the manager's I/O
loop), to check what a tier really wrote.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from tiering.backends.base import BackendCapabilities, Outcome, StorageBackend
from tiering.errors import BackendError
from tiering.managers.secondary_tier import TierJob

__all__ = ["GatedBackend", "ParkedCall", "wait_until_quiet"]

T = TypeVar("T")


@dataclass(frozen=True)
class ParkedCall:
    """One I/O call waiting at a gate: its operation and keys."""

    op: str  # "put", "get", "delete", "contains", "exists"
    keys: tuple[bytes, ...]
    _go: asyncio.Future[bool]  # its result: whether the call fails
    _loop: asyncio.AbstractEventLoop


class GatedBackend(StorageBackend):
    """``inner`` behind a gate: closed, every I/O call parks until :meth:`release` (open at
    first, so a tier opens and recovers as usual; :meth:`close_gate` to start holding)."""

    def __init__(self, inner: StorageBackend) -> None:
        super().__init__(block_bytes=inner.block_bytes, fingerprint=inner.fingerprint)
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]  # the registry's ClassVar, per instance
        self.stats = inner.stats
        self._lock = threading.Lock()
        self._parked: list[ParkedCall] = []
        self._gated = False
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- the gate (test thread) -----------------------------------------------------------------

    def close_gate(self) -> None:
        """From now on, I/O calls park until released."""
        with self._lock:
            self._gated = True

    def open_gate(self) -> None:
        """Let every parked call through, and every later one (e.g. before ``reset_cache`` or
        ``shutdown``, which wait for the tiers' I/O)."""
        with self._lock:
            self._gated = False
            parked, self._parked = self._parked, []
        for call in parked:
            call._loop.call_soon_threadsafe(_go, call._go, False)

    @property
    def parked(self) -> list[ParkedCall]:
        """The calls waiting at the gate, oldest first."""
        with self._lock:
            return list(self._parked)

    def release(self, call: ParkedCall, *, fail: bool = False) -> None:
        """Let one parked call through to the wrapped backend; with ``fail``, make it fail
        instead (``put``/``get``: every outcome ``FAILED``; others raise ``BackendError``)."""
        with self._lock:
            self._parked.remove(call)
        call._loop.call_soon_threadsafe(_go, call._go, fail)

    def read_back(self, keys: Sequence[bytes], timeout_s: float = 120.0) -> list[bytes | None]:
        """The bytes the wrapped backend holds under each key (None: it serves none), read on
        the I/O loop the backend was opened on. Call it while no I/O of the tier is running
        (:func:`wait_until_quiet`)."""
        if self._loop is None:
            raise RuntimeError("the backend was never opened")
        buffers = [memoryview(bytearray(self.block_bytes)) for _ in keys]
        done = asyncio.run_coroutine_threadsafe(self.inner.get(list(keys), buffers), self._loop)
        outcomes = done.result(timeout_s)
        return [
            bytes(b) if o is Outcome.OK else None for o, b in zip(outcomes, buffers, strict=True)
        ]

    async def _pass(self, op: str, keys: Sequence[bytes], call: Callable[[], Awaitable[T]]) -> T:
        loop = asyncio.get_running_loop()
        with self._lock:
            go: asyncio.Future[bool] | None = None
            if self._gated:
                go = loop.create_future()
                self._parked.append(ParkedCall(op, tuple(keys), go, loop))
        if go is not None and await go:
            if op in ("put", "get"):
                return [Outcome.FAILED] * len(keys)  # type: ignore[return-value]
            raise BackendError(f"{op} of {len(keys)} key(s) failed (injected by the test)")
        return await call()

    # -- StorageBackend ---------------------------------------------------------------------------

    @property
    def capabilities(self) -> BackendCapabilities:
        return self.inner.capabilities

    @property
    def capacity_bytes(self) -> int:
        return self.inner.capacity_bytes

    @property
    def capacity_blocks(self) -> int:
        return self.inner.capacity_blocks

    @property
    def usage_bytes(self) -> int:
        return self.inner.usage_bytes

    @property
    def is_open(self) -> bool:
        return self.inner.is_open

    async def open(self) -> list[bytes]:
        self._loop = asyncio.get_running_loop()
        return await self.inner.open()

    async def close(self) -> None:
        await self.inner.close()

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        return await self._pass("put", keys, lambda: self.inner.put(keys, values))

    async def get(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> list[Outcome]:
        return await self._pass("get", keys, lambda: self.inner.get(keys, buffers))

    async def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._pass("contains", keys, lambda: self.inner.contains(keys))

    async def delete(self, keys: Sequence[bytes]) -> list[bool]:
        return await self._pass("delete", keys, lambda: self.inner.delete(keys))

    async def exists(self, keys: Sequence[bytes]) -> list[bool | None]:
        return await self._pass("exists", keys, lambda: self.inner.exists(keys))


def _go(future: asyncio.Future[bool], fail: bool) -> None:
    if not future.done():
        future.set_result(fail)


def wait_until_quiet(
    jobs: Callable[[], Iterable[TierJob]],
    backends: Sequence[GatedBackend],
    timeout_s: float = 120.0,
) -> None:
    """Wait until every job ``jobs()`` lists has finished (its result queued for the manager)
    or waits at a gate: then nothing the I/O thread does can change until the next release.
    ``jobs`` is the manager's ``inflight_jobs``. ``timeout_s`` only bounds a hang (a bug), it
    measures nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        running = sum(1 for job in jobs() if not job.done())
        parked = sum(len(b.parked) for b in backends)
        if running == parked:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{running} tier job(s) running, {parked} parked, after {timeout_s} s"
            )
        time.sleep(0.0005)
