"""What the Redis backend does when a node or a command fails at run time: count, never raise.

Failures
    At run time a node that fails (refused, reset, timed out, TLS or auth failure) fails only
    its own keys (``FAILED``; a get's ``FAILED`` is a miss to the tier), is logged once,
    counted, and skipped for ``retry_interval_s`` before it is tried again
    (:mod:`~tiering.backends.redis.nodes`); nothing raises into the engine. A ``MOVED`` reply (a
    slot resharded, or a failover) points the slot at the master it names and the keys
    concerned are sent there once more, in the same call
    (:mod:`~tiering.backends.redis.pipelines`); the slot table is read again before the next
    call. ``ASK`` (a slot in mid-migration), ``TRYAGAIN`` and ``CLUSTERDOWN`` fail the keys
    concerned (``FAILED``) and have the slot table read again. A put that Redis refuses for
    memory (``OOM``, under ``noeviction``) is ``FULL``. (What fails at open raises: see
    :mod:`~tiering.backends.redis.connection`.)

The counters go to ``stats.extra``: ``node_errors`` (pipelines a node failed),
``node_down_keys`` (keys failed at once because their node was down), ``redirections`` (keys
answered ``MOVED``, ``ASK``, ...), ``oom_rejections``.
"""

from __future__ import annotations

import logging

from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    OutOfMemoryError,
    TryAgainError,
)

from tiering.backends.base import BackendStats, Outcome
from tiering.backends.redis.nodes import RedisNodes

__all__ = ["Faults"]

_log = logging.getLogger("tiering.backends.redis")

_MOVED = (MovedError, AskError, TryAgainError, ClusterDownError)


class Faults:
    """Counts events in ``stats.extra`` and gives the outcome of a command Redis refused."""

    __slots__ = ("_stats",)

    def __init__(self, stats: BackendStats) -> None:
        self._stats = stats

    def count(self, name: str, n: int = 1) -> None:
        if n:
            extra = self._stats.extra
            extra[name] = extra.get(name, 0) + n

    def error_outcome(self, error: BaseException, nodes: RedisNodes, *, writing: bool) -> Outcome:
        """The outcome of one command that Redis answered with an error."""
        if writing and isinstance(error, OutOfMemoryError):
            self.count("oom_rejections")
            return Outcome.FULL
        if isinstance(error, _MOVED):
            self.count("redirections")
            nodes.mark_stale()
        else:
            _log.warning("redis command failed: %s: %s", type(error).__name__, error)
        return Outcome.FAILED
