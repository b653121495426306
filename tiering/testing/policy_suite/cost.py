"""``PolicyTests``, cost: evicting past thousands of pinned keys is not a scan, counted in lines
of Python run (:func:`python_steps`), not timed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from tiering.testing.policy_suite.base import PolicyFactory, PolicyTestsBase, policy_key

__all__ = ["PolicyCostTests", "python_steps"]


class _Enough(Exception):
    """Raised by :func:`python_steps`'s tracer once the limit is passed."""


def python_steps(work: Callable[[], object], limit: int) -> int:
    """How many lines of Python ``work()`` runs (``sys.settrace``), counting up to ``limit``
    and stopping ``work`` just past it: a measure of work that no clock, and so no busy
    machine, can stretch."""
    steps = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > limit:
                raise _Enough
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        work()
    except _Enough:
        pass
    finally:
        sys.settrace(previous)
    return steps


class PolicyCostTests(PolicyTestsBase):
    """The cost of evicting past pinned keys."""

    # -- cost -------------------------------------------------------------------------------

    def test_eviction_past_pinned_keys_is_not_a_scan(self, policy_factory: PolicyFactory) -> None:
        """20,000 keys, the oldest half pinned: 1,000 single-victim evictions cost about what
        they cost with nothing pinned, plus at most a few steps per pinned key.

        Cost is counted, not timed (a busy machine stretches time, not work): the lines of
        Python that run (``sys.settrace``). A policy that scans past the pinned keys runs
        10^7 more. (Work done in C, by a policy written in C, is not counted.)
        """
        count, pinned, victims = 20_000, 10_000, 1_000

        def evictions(n_pinned: int, limit: int) -> int:
            keys = [policy_key(i) for i in range(count)]
            policy = policy_factory(count)
            for i, key in enumerate(keys):
                policy.insert(key, evictable=i >= n_pinned)
            got: list[list[Any] | None] = []
            steps = python_steps(lambda: got.extend(policy.evict(1) for _ in range(victims)), limit)
            if self.recency_ordered and steps <= limit:
                assert got == [[key] for key in keys[n_pinned : n_pinned + victims]]
            return steps

        unpinned = evictions(0, 10**8)
        # Setting each pinned key aside once (a few lines per key) is fine; a scan past all of
        # them at every eviction is 1,000 times that.
        bound = 2 * unpinned + 10 * pinned
        steps = evictions(pinned, bound)
        assert steps <= bound, (
            f"{victims} evictions past {pinned} pinned keys ran more than {bound} lines of "
            f"Python ({unpinned} with nothing pinned): a scan past the pinned keys"
        )
