"""The writer thread: every write transaction runs on ONE thread the backend owns.

LMDB binds a write transaction to the thread that began it. Concurrent ``put``/``delete`` calls
are coalesced: the writer takes what is queued and writes it in one transaction of at most
``max_txn_bytes`` of values (a bigger batch is split into several transactions, see
:mod:`tiering.backends.lmdb.transactions`; its keys become visible when ``put`` returns, as the
index is what ``get`` and ``contains`` consult). Opening and closing the environment run on it
too (a ``Call``), and every 30 s it reclaims reader slots left by dead processes.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import lmdb

from tiering.backends.lmdb.environment import READER_CHECK_INTERVAL_S, LMDBEnvironment
from tiering.backends.lmdb.threads import STOP, Call, Job, wait_uncancellable
from tiering.backends.lmdb.transactions import WriteTransactions
from tiering.errors import BackendError

__all__ = ["Writer"]

_log = logging.getLogger(__package__)  # the package's logger, as before the split


class Writer:
    """The writer thread and its queue of jobs and calls (started at open, stopped at close)."""

    __slots__ = ("_environment", "_jobs", "_path", "_thread", "_transactions")

    def __init__(self, environment: LMDBEnvironment, transactions: WriteTransactions) -> None:
        self._environment = environment
        self._path = environment.path
        self._transactions = transactions
        self._jobs: queue.SimpleQueue[Job | Call | object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # -- the event loop's side -------------------------------------------------------------------

    def start(self) -> None:
        # Each thread gets its own queue: a thread still finishing after stop() (its STOP is
        # queued behind the item it runs) must not take the next thread's jobs.
        jobs: queue.SimpleQueue[Job | Call | object] = queue.SimpleQueue()
        self._jobs = jobs
        self._thread = threading.Thread(
            target=self._loop, args=(jobs,), name=f"lmdb-writer:{self._path}", daemon=True
        )
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> Call:
        """Queue ``fn`` to run on the writer thread; its result comes in ``call.future``."""
        call = Call(fn)
        self._jobs.put(call)
        return call

    async def submit(self, job: Job) -> list[Any]:
        self._jobs.put(job)
        (results,) = await wait_uncancellable([job.future])
        return results

    async def stop(self, close: Callable[[], None] | None) -> None:
        """Run ``close`` (if any) on the writer thread, then let the thread return."""
        if close is not None:
            call = self.call(close)
            await wait_uncancellable([call.future])
        self._jobs.put(STOP)
        self._thread = None

    def forget(self) -> None:
        """Drop the thread without stopping it (a forked child: it is the parent's)."""
        self._thread = None

    # -- the writer thread -----------------------------------------------------------------------

    def _loop(self, jobs: queue.SimpleQueue[Job | Call | object]) -> None:
        carry: object = None  # an item taken while coalescing, to run next
        while True:
            item = carry if carry is not None else jobs.get()
            carry = None
            if item is STOP:
                return
            if isinstance(item, Call):
                if item.future.set_running_or_notify_cancel():
                    try:
                        item.future.set_result(item.fn())
                    except BaseException as exc:  # handed to the caller
                        item.future.set_exception(exc)
                continue
            assert isinstance(item, Job)
            group, carry = self._coalesce(item, jobs)
            self._run(group)
            if time.monotonic() - self._environment.last_reader_check > READER_CHECK_INTERVAL_S:
                env = self._environment.env
                assert env is not None
                with contextlib.suppress(lmdb.Error):
                    self._environment.check_readers(env)

    def _coalesce(
        self, first: Job, jobs: queue.SimpleQueue[Job | Call | object]
    ) -> tuple[list[Job], object]:
        """``first`` and the jobs already queued, up to about one transaction of values; and an
        item taken that is not a job (to run next), or None."""
        group = [first]
        puts = len(first.keys) if first.kind == "put" else 0
        txn_blocks = self._environment.geometry.txn_blocks
        while puts < txn_blocks:
            try:
                nxt = jobs.get_nowait()
            except queue.Empty:
                break
            if not isinstance(nxt, Job):
                return group, nxt
            group.append(nxt)
            puts += len(nxt.keys) if nxt.kind == "put" else 0
        return group, None

    def _run(self, group: list[Job]) -> None:
        """Run the jobs not cancelled before they started, and hand each its results."""
        running = []
        for job in group:
            if job.future.set_running_or_notify_cancel():
                running.append(job)
            else:
                job.values = None  # cancelled before it started: never written
        error: BaseException | None = None
        try:
            self._transactions.run_group(running)
        except BaseException as exc:  # a bug: fail the batch, keep the writer alive
            _log.exception("LMDB writer failed at %s", self._path)
            error = exc
        for job in running:
            job.values = None  # keep no reference to the caller's buffers
            if error is None:
                job.future.set_result(job.results)
            else:
                job.future.set_exception(BackendError(f"LMDB writer failed: {error!r}"))
