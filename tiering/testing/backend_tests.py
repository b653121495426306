"""``BackendTests``: the conformance suite every :class:`~tiering.backends.base.StorageBackend`
must pass, shipped in the package so that plugin authors can run it on their own backends.

How to use it
-------------
Subclass it in a test module (the class name must start with ``Test`` for pytest to collect it),
implement :meth:`BackendTests.make_backend` and, for the corruption tests,
:meth:`BackendTests.corrupt_stored_block`; set the class attributes that describe your backend::

    from pathlib import Path

    from tiering.testing import BackendTests
    from mypkg import MyBackend


    class TestMyBackend(BackendTests):
        persistent = True  # False skips the restart tests

        def make_backend(self, path: Path, *, capacity_bytes: int, block_bytes: int,
                         fingerprint: bytes) -> MyBackend:
            return MyBackend(path=path, capacity_bytes=capacity_bytes,
                             block_bytes=block_bytes, fingerprint=fingerprint)

        def corrupt_stored_block(self, backend: MyBackend, key: bytes) -> None:
            ...  # flip one payload byte of ``key``'s stored block, *bypassing* the backend API

Requirements: pytest and pytest-asyncio. Every async test carries ``pytest.mark.asyncio``, so
the suite runs under ``asyncio_mode = "strict"`` (and "auto"). Each test builds its own
backend(s) in pytest's ``tmp_path`` with :meth:`BackendTests.new_backend` and closes them, so
no fixtures need overriding. To run the suite with several configurations, subclass once per
configuration (for instance with different ``make_backend`` settings).

What it checks (the contract in :mod:`tiering.backends.base`): bit-exact round trips in
batches of several sizes; one result per key, in order, with mixed hits and misses; missing
keys; put-replaces; delete; contains; capacity (``capacity_blocks`` puts fit, one more is
``FULL`` and disturbs nothing) and ``usage_bytes``; restart recovery (persistent backends);
checksum failures (``CORRUPT``, then ``MISSING``, never ``OK``); concurrent put/get/delete on
one key (every ``OK`` get returns one written payload exactly); cancelled puts and gets
(afterwards ``OK`` with the exact payload or ``MISSING``, never corrupt, and the backend keeps
working); misuse errors raised before any I/O (``ValueError`` for buffer sizes,
``InvalidKeyError`` for keys, ``BackendError`` when not open); idempotent ``close``; hostile
key bytes; and that a large put or get leaves the event loop free (measured in the loop
thread's CPU time, not with a wall clock: another task runs while it is in flight, and between
any two of its turns the loop runs at most half of the call's CPU time; see
:mod:`tiering.testing.loop_use`). The optional operations, whether a backend overrides them or
not: ``exists`` (as ``contains`` on a healthy store) and ``put_if_absent`` (a block already
stored is left as it is and counted in ``stats.extra["put_skipped_present"]``; racing calls
leave one intact value). Through the embedders' facade (:mod:`tiering.testing.embed_tests`):
blocks given as runs of memory and of mixed lengths shorter than the slot round-trip bit-exact
and with their lengths, through a restart; a block too long for the slot or for the caller's
memory is refused or a miss, writing nothing. For a shared backend (``capabilities.shared``):
two instances on one store see each other's writes and deletes at once.

Hooks a subclass may override: :meth:`capacity_bytes_for` (how much ``capacity_bytes`` gives
room for ``n`` blocks; the default adds 8 KiB per block), :meth:`expected_usage_bytes` (exact
``usage_bytes`` for ``n`` stored blocks; the default only checks it is monotone and bounded),
and :meth:`make_buffers` (the caller buffers; the default uses page-aligned rows, shifted by
``buffer_offset_bytes``).
"""

from __future__ import annotations

from tiering.testing.backend_suite.bad_input import BackendBadInputTests
from tiering.testing.backend_suite.base import BackendTestsBase
from tiering.testing.backend_suite.concurrency import BackendConcurrencyTests
from tiering.testing.backend_suite.durability import BackendDurabilityTests
from tiering.testing.backend_suite.lifecycle import BackendLifecycleTests
from tiering.testing.backend_suite.optional_ops import BackendOptionalOpsTests
from tiering.testing.backend_suite.round_trips import BackendRoundTripTests

__all__ = ["BackendTests"]


# The topics are listed last first: pytest collects a class's bases before the class itself, in
# reverse method resolution order, so this runs them in the order of the topics (lifecycle, round
# trips, durability, concurrency, bad input, optional operations).
class BackendTests(
    BackendOptionalOpsTests,
    BackendBadInputTests,
    BackendConcurrencyTests,
    BackendDurabilityTests,
    BackendRoundTripTests,
    BackendLifecycleTests,
    BackendTestsBase,
):
    """The shared conformance tests; subclass it and implement :meth:`make_backend`. The
    embedder tests (runs and lengths through :class:`tiering.embed.TierStore`) come from
    :class:`~tiering.testing.embed_tests.EmbedTests`."""
