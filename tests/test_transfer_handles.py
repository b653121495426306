"""A CUDA store's handle while its copies are enqueued on the store lane's thread: never done
before the copies are both enqueued and finished, errors from either kept, and a stream made
to wait only on a recorded event. Run anywhere: events and the lane's future are stood in for
(tests/test_transfer_cuda.py runs the real lane)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, cast

import pytest

from tiering.transfer import TransferHandle
from tiering.transfer.plan import TransferResult

RESULT = TransferResult(2, 0, 2048, (2,))


class FakeEvent:
    def __init__(self) -> None:
        self.complete = False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True

    def elapsed_time(self, end: FakeEvent) -> float:
        return 1.5  # ms


class FakeStream:
    def __init__(self) -> None:
        self.waited: list[Any] = []

    def wait_event(self, event: Any) -> None:
        self.waited.append(event)


def store_handle() -> tuple[TransferHandle, Future[tuple[object, BaseException | None]], FakeEvent]:
    enqueued: Future[tuple[object, BaseException | None]] = Future()
    end = FakeEvent()
    handle = TransferHandle(
        7,
        "store",
        RESULT,
        start=cast(Any, FakeEvent()),
        end=cast(Any, end),
        enqueued=enqueued,
    )
    return handle, enqueued, end


def test_not_done_until_enqueued_and_finished_on_the_device() -> None:
    handle, enqueued, end = store_handle()
    end.complete = True  # an event not yet recorded reads as complete: it must not count
    assert not handle._query() and not handle.done
    keepalive = object()
    enqueued.set_result((keepalive, None))
    end.complete = False
    assert not handle._query()
    assert handle._keepalive is keepalive  # held while the device may still read it
    end.complete = True
    assert handle._query() and handle.ok and handle.copy_s == pytest.approx(1.5e-3)
    assert handle._keepalive is None


@pytest.mark.parametrize("how", ["strategy raised", "thread raised"])
def test_an_error_on_the_lane_thread_is_the_handles(how: str) -> None:
    handle, enqueued, end = store_handle()
    boom = RuntimeError("cuMemcpyBatchAsync failed")
    if how == "strategy raised":
        enqueued.set_result((None, boom))
    else:
        enqueued.set_exception(boom)
    end.complete = True
    assert handle._query() and handle.done and not handle.ok
    assert handle.error is boom


def test_wait_and_make_stream_wait_take_the_enqueued_copies_first() -> None:
    handle, enqueued, end = store_handle()
    enqueued.set_result((None, None))
    stream = FakeStream()
    handle.make_stream_wait(stream)  # type: ignore[arg-type]
    assert stream.waited == [end] and handle._enqueued is None
    handle._wait()
    assert handle.ok
