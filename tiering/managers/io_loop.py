"""A private asyncio event loop on a background thread, for I/O started by sync callers.

The scheduler of a serving engine runs its own loop (or none); the manager's sync protocol must
never block it. Jobs are coroutines submitted here; they return ``concurrent.futures.Future``
objects, which asyncio code can await with ``asyncio.wrap_future``.

The thread survives anything a job raises. asyncio lets ``KeyboardInterrupt`` and ``SystemExit``
out of a task, which would end ``run_forever`` and leave every pending future unresolved (a
``drain`` that never settles); a backend plugin could raise either, or any other
``BaseException``. So each job is wrapped: an exception that is not an ``Exception`` becomes a
:class:`~tiering.errors.BackendError` on the job's future, and the loop runs on.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from tiering.errors import BackendError, TieringError

__all__ = ["IOLoop"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


async def _contained(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro``; a ``BaseException`` that is not an ``Exception`` becomes a BackendError.

    ``GeneratorExit`` is let through: it is how a job that never finished is closed (its loop
    stopped, or the job abandoned after its deadline), and a coroutine must not answer it with
    another exception."""
    try:
        return await coro
    except (Exception, asyncio.CancelledError, GeneratorExit):
        raise
    except BaseException as exc:
        raise BackendError(
            f"a background job raised {type(exc).__name__}: {exc!r:.200}; it failed, the I/O "
            "loop goes on"
        ) from exc


class IOLoop:
    """Owns one event loop running on a daemon thread until :meth:`close`."""

    def __init__(self, name: str = "tiering-io") -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()
        self._closed = False

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._ready.set)
        while True:
            try:
                self._loop.run_forever()
            except BaseException:  # raised through the loop by a callback: log it, keep serving
                logger.exception("the tiering I/O loop caught an exception; it keeps running")
                continue
            break  # close() stopped it
        self._loop.run_until_complete(self._loop.shutdown_asyncgens())
        self._loop.close()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; never blocks."""
        if self._closed:
            coro.close()
            raise TieringError("the I/O loop is closed")
        return asyncio.run_coroutine_threadsafe(_contained(coro), self._loop)

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def close(self, timeout: float = 30.0) -> None:
        """Stop the loop after the callbacks already queued; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._loop.call_soon_threadsafe(self._loop.stop)
        if not self.in_loop_thread():
            self._thread.join(timeout)
