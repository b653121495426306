"""A secondary tier's jobs, and what finishing one asks of the manager.

A :class:`TierJob` is one batch of I/O between the primary tier's rows and one tier: the tier
builds it (``start_store``, ``start_write_back``, ``start_promotion``, ...), the manager holds the
primary rows it reads, emits its removal events, submits its ``io`` coroutine to the I/O loop
and hands the coroutine's result (an :class:`IOResult`) back to the tier, whose ``finish_*``
answers with a :class:`StoreResult` or a :class:`PromotionResult`. See
:mod:`tiering.managers.secondary_tier`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Coroutine, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiering.backends.base import Outcome
from tiering.errors import TieringError
from tiering.managers.deadline import Timer
from tiering.managers.latency import LatencyRecord

if TYPE_CHECKING:
    from tiering.managers.secondary_tier import SecondaryTier

__all__ = ["IOResult", "PromotionResult", "StoreResult", "TierJob", "job_outcomes"]

FAILED = Outcome.FAILED


@dataclass(frozen=True)
class IOResult:
    """What a tier's read or write coroutine returns: one outcome per key, and its duration."""

    outcomes: list[Outcome]
    elapsed_s: float


@dataclass(eq=False)  # identity: jobs live in a set
class TierJob:
    """One batch of I/O between the primary tier's rows and one tier.

    The manager holds the primary rows of ``keys`` (at ``slots``) while the job runs, emits
    ``removed`` (keys the tier forgot to make room) when it submits ``io``, and hands ``io``'s
    result back to the tier. ``req_context`` is the context of the call that started the job.
    Await a submitted job with ``await job``.
    """

    kind: str  # "store", "write_back", "promote", "check", "open", "delete", "close"
    tier: SecondaryTier
    keys: tuple[bytes, ...]
    io: Coroutine[Any, Any, Any]
    slots: tuple[int, ...] = ()
    buffers: tuple[memoryview, ...] = ()
    removed: tuple[bytes, ...] = ()
    req_context: object = None
    retried: bool = False  # a FULL retry: holds the rows of the job it retries, never retries
    future: concurrent.futures.Future[Any] | None = None  # set by the manager on submission
    seq: int = 0  # submission order (set by the manager): results apply in this order
    epoch: int = 0  # the manager's step when submitted (set by the manager)
    started_s: float = field(default_factory=time.perf_counter)
    # Deadlines (tiering.managers.deadline; set by the manager): ``future`` settles when the I/O
    # returns or the deadline passes, whichever is first; ``io_future`` only when the I/O returns.
    io_future: concurrent.futures.Future[Any] | None = None
    timer: Timer | None = None
    finished: bool = False  # the I/O returned (set under the manager's claim lock)
    timed_out: bool = False  # the deadline passed first: the result, when it comes, is late

    def done(self) -> bool:
        return self.future is not None and self.future.done()

    def __await__(self) -> Generator[Any, None, Any]:
        if self.future is None:
            raise TieringError(f"{self.kind} job of tier {self.tier.name!r} was never submitted")
        return asyncio.wrap_future(self.future).__await__()


@dataclass(frozen=True)
class StoreResult:
    """What finishing a store job asks of the manager.

    ``stored``: keys the backend acknowledged (stored events). ``settled``: ``(key, slot)`` of the
    keys whose primary rows the job no longer needs. ``retry``: a job for the keys that found the
    backend full, room made (submit it; it keeps their rows held), or None.
    """

    stored: list[bytes]
    settled: list[tuple[bytes, int]]
    retry: TierJob | None


@dataclass(frozen=True)
class PromotionResult:
    """What finishing a promotion asks of the manager: ``loaded`` keys are in their primary slots
    (complete the primary store), ``failed`` ones are not (drop them), ``removed`` ones the tier
    forgot (gone or corrupt in the backend: removal events)."""

    loaded: list[bytes]
    failed: list[bytes]
    removed: list[bytes]


def job_outcomes(job: TierJob, result: object, latencies: LatencyRecord) -> list[Outcome]:
    """The outcome of each of ``job``'s keys from its I/O's ``result`` (its duration recorded in
    ``latencies``): all FAILED if the job itself failed (it should not, but be safe)."""
    if isinstance(result, IOResult):
        latencies.add(result.elapsed_s)
        return result.outcomes
    return [FAILED] * len(job.keys)
