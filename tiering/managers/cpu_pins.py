"""Load pins of the CPU primary tier: how many loads hold each ready key.

A load (:meth:`~tiering.managers.cpu_manager.CPUOffloadingManager.prepare_load`, or a lower
tier copying a block out) pins its keys until it completes; a pinned key may not be evicted.
:class:`LoadPins` counts the pins per key in one flat dict (key -> count > 0) and tells the
eviction policy only at the edges: the first pin of a key makes it unevictable, the last unpin
makes it evictable again, each batch in one policy call.
"""

from __future__ import annotations

from tiering.core.keys import OffloadKey
from tiering.errors import ProtocolError
from tiering.policies import EvictionPolicy

__all__ = ["LoadPins"]


class LoadPins:
    """Pin counts of ready keys, over the eviction ``policy`` that holds them."""

    __slots__ = ("_counts", "_policy")

    def __init__(self, policy: EvictionPolicy) -> None:
        self._counts: dict[OffloadKey, int] = {}  # ready keys pinned by loads (count > 0)
        self._policy = policy

    def pin(self, key_list: list[OffloadKey], *, checked: bool) -> None:
        """Count a load's pin of each key; the policy pins those no load held. ``checked``:
        the caller found every key ready (held and, with no pin, evictable), so the policy
        need not look them up (:meth:`EvictionPolicy.pin_evictable`: one dict probe a key
        less, ~430 ns a key at 1e6 blocks)."""
        pins = self._counts
        get = pins.get
        first: list[OffloadKey] = []  # the keys no load pinned yet, once each
        for key in key_list:
            count = get(key, 0)
            if not count:
                first.append(key)
            pins[key] = count + 1
        if first:
            try:
                if checked:
                    self._policy.pin_evictable(first)
                else:
                    self._policy.set_evictable_many(first, False)
            except BaseException:
                for key in key_list:  # counted above: take the counts back
                    left = pins[key] - 1
                    if left:
                        pins[key] = left
                    else:
                        del pins[key]
                raise

    def unpin(self, key_list: list[OffloadKey]) -> None:
        """Take back one pin of each listed key; the policy lets go of the keys no load holds
        any more. Raises ProtocolError, changing nothing, if a key is listed more often than it
        is pinned."""
        pins = self._counts
        get = pins.get
        unpinned: list[OffloadKey] = []
        # One pass, undone if a key turns out short of pins (a key listed more often than it
        # was loaded): checking first cost two more passes over the keys on every call.
        for done, key in enumerate(key_list):
            left = get(key, 0) - 1
            if left > 0:
                pins[key] = left
            elif not left:
                del pins[key]
                unpinned.append(key)
            else:
                for undone in key_list[:done]:
                    pins[undone] = get(undone, 0) + 1
                self._check_unpins(key_list)  # raises, naming the first key short of pins
        if unpinned:
            self._policy.set_evictable_many(unpinned, True)

    def _check_unpins(self, key_list: list[OffloadKey]) -> None:
        """Raise ProtocolError for the first key listed more often than it is pinned."""
        wanted: dict[OffloadKey, int] = {}
        for key in key_list:
            wanted[key] = wanted.get(key, 0) + 1
        for key, times in wanted.items():
            pinned = self._counts.get(key, 0)
            if pinned < times:
                raise ProtocolError(
                    f"complete_load for key {key.hex()} x{times} but only {pinned} load(s) of it "
                    "were prepared"
                )

    def clear(self) -> None:
        """Forget every pin (the policy is cleared by its owner)."""
        self._counts.clear()
