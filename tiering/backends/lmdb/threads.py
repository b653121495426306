"""What the LMDB backend hands its threads: the work items queued for the writer thread (a
``Job`` of puts, deletes or purges; a ``Call`` of open or close), waiting for them without
letting a cancelled caller return early, and the ``stats.extra`` counters any thread may bump."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, TypeVar

__all__ = ["STOP", "Call", "Count", "Job", "Kind", "wait_uncancellable"]

_T = TypeVar("_T")

Kind = Literal["put", "delete", "purge"]


class Count(Protocol):
    """Adds ``n`` to ``stats.extra[name]`` (callable from any of the backend's threads)."""

    def __call__(self, name: str, n: int = 1) -> None: ...


@dataclass(eq=False)
class Job:
    """One put/delete/purge batch queued for the writer; ``results`` holds one entry per key."""

    kind: Kind
    keys: Sequence[bytes]
    values: list[memoryview] | None
    future: concurrent.futures.Future[list[Any]] = field(default_factory=concurrent.futures.Future)
    results: list[Any] = field(default_factory=list)


@dataclass(eq=False)
class Call:
    """A function to run on the writer thread (open and close touch the environment there)."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


STOP: Final = object()  # queued last: the writer thread returns


async def wait_uncancellable(futures: Sequence[concurrent.futures.Future[_T]]) -> list[_T]:
    """The results of ``futures`` (work on the backend's threads).

    If the caller is cancelled, work that has not started is cancelled, and work that has started
    is waited for before ``CancelledError`` propagates: a thread must never touch a caller's
    buffer after the call that lent it has returned.
    """
    wrapped = [asyncio.wrap_future(f) for f in futures]
    try:
        await asyncio.shield(asyncio.gather(*wrapped))
    except asyncio.CancelledError:
        for f in futures:
            f.cancel()  # only succeeds for work that has not started
        while not all(w.done() for w in wrapped):
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([asyncio.shield(w) for w in wrapped if not w.done()])
        raise
    return [w.result() for w in wrapped]
