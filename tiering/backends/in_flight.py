"""Operations in flight on an open backend, so that ``close`` can wait for them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

__all__ = ["InFlight"]


class InFlight:
    """A count of a backend's operations in flight and an event set while there are none.

    Made when the backend opens, on the loop its operations run on (the event is that loop's).
    Each operation runs in ``with in_flight.operation():``; ``close`` first marks the backend
    closing (so that no operation starts), then ``await in_flight.idle()``.
    """

    __slots__ = ("_count", "_idle")

    def __init__(self) -> None:
        self._count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def count(self) -> int:
        """Operations in flight now."""
        return self._count

    @contextlib.contextmanager
    def operation(self) -> Iterator[None]:
        """One operation, counted from entry to exit (an exception included)."""
        self._count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._count -= 1
            if not self._count:
                self._idle.set()

    async def idle(self) -> None:
        """Return once no operation is in flight."""
        await self._idle.wait()
