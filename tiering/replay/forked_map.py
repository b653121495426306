"""Independent pieces of one long computation in forked worker processes (the policy study's
rows: one policy at one size each).

Why fork: the pieces read one large, read-only input (a trace of millions of block keys), and
a forked child sees the parent's memory without pickling it; only each piece's small result
comes back. Pages a child writes (Python's reference counts included) are copied, so each
worker may come to hold a copy of what it reads: memory grows with the number of jobs.

Where ``fork`` is not available (Windows, or a platform whose default forbids it), or with one
job, the pieces run here, in order.
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from contextlib import contextmanager
from typing import Any, TypeVar

__all__ = ["can_fork", "map_forked"]

T = TypeVar("T")

# The function of the map in progress: set before the workers fork, so they inherit it.
_task: Callable[[int], Any] | None = None


def can_fork() -> bool:
    """Whether this platform can run pieces in forked processes."""
    return "fork" in multiprocessing.get_all_start_methods()


@contextmanager
def map_forked(
    func: Callable[[int], T], count: int, jobs: int
) -> Iterator[Iterator[tuple[int, T]]]:
    """``with map_forked(func, count, jobs) as results:``, ``results`` yielding ``(i, func(i))``
    for every ``i`` in ``range(count)``, as the pieces complete.

    With ``jobs > 1`` (and ``fork`` available) the workers are forked on entry, so threads the
    caller starts in the block (a progress bar's) are not forked; ``func`` and everything it
    reads are the parent's as of entry. A piece's exception is raised when its result is
    reached; leaving the block cancels the pieces not started and waits for the running ones.
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if jobs == 1 or count <= 1 or not can_fork():
        yield ((i, func(i)) for i in range(count))
        return
    global _task
    if _task is not None:
        raise RuntimeError("map_forked is not reentrant: another map is in progress")
    sys.stdout.flush()  # a child would write again what the parent had buffered
    sys.stderr.flush()
    _task = func
    pool = ProcessPoolExecutor(
        max_workers=min(jobs, count), mp_context=multiprocessing.get_context("fork")
    )
    try:
        futures = {pool.submit(_run_piece, i): i for i in range(count)}  # the fork is here
        yield ((futures[f], f.result()) for f in as_completed(futures))
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        _task = None


def _run_piece(index: int) -> Any:
    assert _task is not None  # inherited from the parent at the fork
    return _task(index)
