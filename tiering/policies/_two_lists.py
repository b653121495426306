"""Two recency lists sharing pins: the held keys of ARC-like policies (``arc``, ``hybrid``),
with ARC's touch (a use moves a T1 key to T2) and what does not depend on how a policy chooses
between the lists; :class:`~tiering.policies._lists.ListsPolicy` holds the rest.

What the lists mean (used once / reused) and how victims are chosen between them is the
subclass's.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering.policies._checks import check_touch_keys
from tiering.policies._lists import ListsPolicy
from tiering.policies._order import RecencyOrder

__all__ = ["TwoListPolicy", "next_victim_bound", "stamped_keys"]


class TwoListPolicy(ListsPolicy):
    """Held keys in two :class:`RecencyOrder` lists, T1 and T2, that share their pins."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, 2)
        self._t1, self._t2 = self._lists

    # -- read-only views (tests, debugging) ---------------------------------------------------

    @property
    def t1_keys(self) -> tuple[bytes, ...]:
        """T1's keys, oldest first."""
        return tuple(self._t1)

    @property
    def t2_keys(self) -> tuple[bytes, ...]:
        """T2's keys, oldest first."""
        return tuple(self._t2)

    # -- EvictionPolicy -----------------------------------------------------------------------

    def __len__(self) -> int:
        return self._t1.size + self._t2.size

    def __contains__(self, key: object) -> bool:
        return key in self._t2 or key in self._t1

    def touch(self, keys: Sequence[bytes]) -> None:
        """A use: a T1 key moves to T2 as its most recent (a pinned one, still being written,
        stays in T1: preparing a block is not a second use), a T2 key becomes T2's most recent;
        ``keys[0]`` ends most recent. Absent keys (ARC's ghosts too) are ignored."""
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys)
        self._t1.touch_all_promoting(keys, self._t2)


def next_victim_bound(order: RecencyOrder, pending: tuple[bytes, int] | None, done: bool) -> int:
    """The stamp of ``order``'s next victim if already taken (``pending``), else a lower bound
    of it (its oldest key's stamp); -1 if it has none. For a search that compares two lists'
    next victims and takes a key (making its stamp exact) only from the list that may win."""
    if pending is not None:
        return pending[1]
    return -1 if done else order.oldest_stamp()


def stamped_keys(order: RecencyOrder) -> list[tuple[bytes, int]]:
    """``order``'s keys with their stamps, pinned ones included, in no particular order."""
    entries = [(k, s if s >= 0 else ~s) for k, s in order._main.items()]
    return entries + list(order._parked.items())
