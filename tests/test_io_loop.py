"""The I/O loop's job wrapper: what a job may raise, and how an unfinished job is closed."""

from __future__ import annotations

import types
from collections.abc import Generator

import pytest

from tiering.errors import BackendError
from tiering.managers.io_loop import IOLoop, _contained


@types.coroutine
def _suspend() -> Generator[None, None, None]:
    yield


async def _never_finishes() -> int:
    await _suspend()
    return 1


async def _exits() -> int:
    raise SystemExit(3)


def test_a_job_closed_before_it_finished_closes_quietly() -> None:
    """A job abandoned unfinished (its loop stopped, its deadline passed) is closed with
    GeneratorExit; answering that with another exception makes Python report it as
    unraisable (and, here, once broke the interpreter's next compile)."""
    job = _contained(_never_finishes())
    job.send(None)  # suspended inside the job
    job.close()  # no exception


def test_a_job_raising_a_base_exception_fails_as_a_backend_error() -> None:
    loop = IOLoop(name="test-io-loop")
    try:
        future = loop.submit(_exits())
        with pytest.raises(BackendError, match="a background job raised SystemExit"):
            future.result(timeout=60)  # a bound for a broken loop, not a timing
    finally:
        loop.close()
