"""A secondary tier's I/O: its jobs, and the coroutines they run on the manager's I/O loop.

:class:`TierIO` is the I/O side of one tier: its backend, the primary tier's rows its jobs move
blocks between (given by the manager that the tier serves, :meth:`TierIO.attach`), and its jobs:
it builds each :class:`~tiering.managers.tier_jobs.TierJob` with its coroutine, and counts the
stores and promotions in flight (``inflight``; the tier takes one back when it finishes it).
Its coroutines touch only the backend and the buffers they were given (rows of the primary tier,
or an embedder's memory), never the tier's index. Every failure becomes an outcome, nothing
escapes: whatever a backend raises fails the job's keys, never the I/O thread, and a backend
that breaks its contract (a wrong number of outcomes) fails the whole job.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np

from tiering.backends.base import Outcome
from tiering.errors import ConfigurationError, TieringError
from tiering.managers.tier_jobs import IOResult, TierJob

if TYPE_CHECKING:
    from tiering.managers.secondary_tier import SecondaryTier

__all__ = ["Put", "TierIO"]

# Under the tier's logger, as every message of a tier (operators filter on it).
logger = logging.getLogger("tiering.managers.secondary_tier")

FAILED = Outcome.FAILED

#: The backend call that writes a store job's blocks (``backend.put``, or a shared tier's
#: ``put_if_absent``).
Put = Callable[[list[bytes], list[memoryview]], Awaitable[list[Outcome]]]


class TierIO:
    """The I/O of ``tier`` over its backend; ``put`` writes a store job's blocks."""

    __slots__ = ("_backend", "_name", "_put", "_rows", "_tier", "inflight")

    def __init__(self, tier: SecondaryTier, put: Put) -> None:
        self._tier = tier
        self._backend = tier.backend
        self._name = tier.name
        self._put = put
        self._rows: np.ndarray | None = None
        self.inflight = 0  # store and promotion jobs built and not finished

    # -- the primary tier's rows (manager thread) ---------------------------------------------

    def attach(self, rows: np.ndarray) -> None:
        """Take the primary tier's rows (``(num_blocks, row_bytes)`` uint8); a tier serves one
        manager."""
        if self._rows is not None and self._rows is not rows:
            raise ConfigurationError(f"tier {self._name!r} already serves another manager")
        self._rows = rows

    def detach(self) -> None:
        """Drop the rows: the tier keeps no view of memory its owner may unmap."""
        self._rows = None

    def row(self, slot: int) -> memoryview:
        if self._rows is None:
            raise TieringError(f"tier {self._name!r} is not attached to a manager's rows")
        return memoryview(self._rows[slot])

    # -- jobs (manager thread) -----------------------------------------------------------------

    def write_job(
        self,
        kind: str,
        keys: Sequence[bytes],
        slots: Sequence[int],
        victims: Sequence[bytes],
        req_context: object,
        *,
        retried: bool = False,
        buffers: Sequence[memoryview] | None = None,
    ) -> TierJob:
        """A store job (in flight) writing ``keys`` after deleting ``victims``; ``buffers``: the
        memory to write (default: the primary rows at ``slots``)."""
        row = self.row
        buffers = tuple(row(s) for s in slots) if buffers is None else tuple(buffers)
        self.inflight += 1
        return TierJob(
            kind,
            self._tier,
            tuple(keys),
            self.write(keys, buffers, victims),
            slots=tuple(slots),
            buffers=buffers,
            removed=tuple(victims),
            req_context=req_context,
            retried=retried,
        )

    def read_job(
        self,
        keys: Sequence[bytes],
        slots: Sequence[int],
        req_context: object,
        buffers: Sequence[memoryview] | None,
    ) -> TierJob:
        """A promotion (in flight) reading ``keys`` into the primary rows at ``slots`` (or into
        ``buffers``, an embedder's memory)."""
        self.inflight += 1
        row = self.row
        buffers = tuple(row(s) for s in slots) if buffers is None else tuple(buffers)
        return TierJob(
            "promote",
            self._tier,
            tuple(keys),
            self.read(keys, buffers),
            slots=tuple(slots),
            buffers=buffers,
            req_context=req_context,
        )

    def delete_job(
        self, kind: str, keys: Sequence[bytes], removed: Sequence[bytes] = ()
    ) -> TierJob:
        """A job deleting ``keys`` from the backend (``kind``: "delete" or "purge")."""
        return TierJob(kind, self._tier, tuple(keys), self.delete(keys), removed=tuple(removed))

    # -- coroutines (I/O loop only) -----------------------------------------------------------

    async def write(
        self, keys: Sequence[bytes], buffers: Sequence[memoryview], victims: Collection[bytes]
    ) -> IOResult:
        """Delete ``victims`` from the backend, then write ``keys``."""
        start = time.perf_counter()
        try:
            if victims:
                await self._backend.delete(list(victims))
            outcomes = await self._put(list(keys), list(buffers))
            if len(outcomes) != len(keys):
                outcomes = [FAILED] * len(keys)  # a backend breaking its contract fails the job
        except asyncio.CancelledError:
            raise
        except BaseException:  # whatever a backend raises fails the job, never the I/O thread
            logger.debug("tier %r: write of %d blocks failed", self._name, len(keys), exc_info=True)
            outcomes = [FAILED] * len(keys)
        return IOResult(outcomes, time.perf_counter() - start)

    async def read(self, keys: Sequence[bytes], buffers: Sequence[memoryview]) -> IOResult:
        """Read ``keys`` into ``buffers``."""
        start = time.perf_counter()
        try:
            outcomes = await self._backend.get(list(keys), list(buffers))
            if len(outcomes) != len(keys):
                outcomes = [FAILED] * len(keys)
        except asyncio.CancelledError:
            raise
        except BaseException:
            logger.debug("tier %r: read of %d blocks failed", self._name, len(keys), exc_info=True)
            outcomes = [FAILED] * len(keys)
        return IOResult(outcomes, time.perf_counter() - start)

    async def delete(self, keys: Sequence[bytes]) -> None:
        try:
            await self._backend.delete(list(keys))
        except asyncio.CancelledError:
            raise
        except BaseException:  # best effort: the index has already forgotten them
            logger.debug("tier %r: delete failed", self._name, exc_info=True)

    async def close(self) -> None:
        await self._backend.close()
