"""A memory backend whose writes wait for the test to open a gate: holds I/O in flight on purpose.

Used as a plugin backend (``gated_backend:GatedMemoryBackend``) to make "a store is still
writing" a state a test controls, instead of a race it hopes to win.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

from tiering.backends.base import Outcome
from tiering.backends.memory import MemoryBackend


class GatedMemoryBackend(MemoryBackend):
    """Puts wait until :attr:`gate` is set (a threading.Event shared by every instance)."""

    gate = threading.Event()

    async def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> list[Outcome]:
        await asyncio.get_running_loop().run_in_executor(None, self.gate.wait)
        return await super().put(keys, values)


class HangingOpenBackend(MemoryBackend):
    """``open`` waits until :attr:`release` is set: a tier whose mount or server hangs."""

    release = threading.Event()

    async def open(self) -> list[bytes]:
        await asyncio.get_running_loop().run_in_executor(None, self.release.wait)
        return await super().open()
