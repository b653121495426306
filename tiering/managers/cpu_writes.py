"""The blocks being written into the CPU primary tier, and who may finish each.

A block is *not ready* while it is written. It is written either by a store
(``prepare_store`` handed its slot to one request, whose ``complete_store`` alone finishes it)
or by a tiering manager's promotion (``reserve_for_promotion``, finished by
``complete_promotion`` alone): a store never completes or frees a slot a read is filling.
:class:`PendingWrites` keeps the keys not ready (a set: a lookup probes it directly) and the
request each store's keys were handed to.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable

from tiering.core.keys import OffloadKey

__all__ = ["PendingWrites"]

#: The owner of no store (a key no ``prepare_store`` handed out, or one a promotion fills).
_NOBODY: object = object()


class PendingWrites:
    """Keys being written (``not_ready``), each a store's (with its request) or a promotion's."""

    __slots__ = ("_owners", "not_ready")

    def __init__(self) -> None:
        #: Being written (by a store or a promotion); read-only for callers.
        self.not_ready: set[OffloadKey] = set()
        # Keys prepare_store handed out and no complete_store finished yet, by the request key
        # (request_key) of the call that got them; the other keys not ready are promotions'.
        self._owners: dict[OffloadKey, Hashable] = {}

    def hand_to(self, keys: list[OffloadKey], owner: Hashable) -> None:
        """``keys`` (not ready) are a store's: the request ``owner``'s to finish."""
        self._owners.update(dict.fromkeys(keys, owner))

    def claim_stores(self, key_list: list[OffloadKey], owner: Hashable) -> list[OffloadKey]:
        """The listed keys handed to ``owner`` and not finished yet (in order, once each): no
        longer being written."""
        owners = self._owners
        get = owners.get
        done = [key for key in key_list if get(key, _NOBODY) == owner]
        if not done:
            return done
        for key in done:
            owners.pop(key, None)  # (a key listed twice is there once)
        return self._settle(done)

    def claim_promotions(self, key_list: list[OffloadKey]) -> list[OffloadKey]:
        """The listed keys a promotion is writing (not a store's), in order, once each: no
        longer being written."""
        not_ready, owners = self.not_ready, self._owners
        done = [key for key in key_list if key in not_ready and key not in owners]
        return self._settle(done) if done else done

    def _settle(self, done: list[OffloadKey]) -> list[OffloadKey]:
        not_ready = self.not_ready
        before = len(not_ready)
        not_ready.difference_update(done)
        if before - len(not_ready) != len(done):  # a key listed twice counts once
            done = list(dict.fromkeys(done))
        return done

    def drop(self, keys: Iterable[OffloadKey]) -> list[OffloadKey]:
        """The keys of ``keys`` being written (once each), no longer being written (a store's
        keeps its owner: its ``complete_store`` then finds the key unknown or ready)."""
        not_ready = self.not_ready
        dropped = [k for k in dict.fromkeys(keys) if k in not_ready]
        not_ready.difference_update(dropped)
        return dropped

    def clear(self) -> None:
        self.not_ready.clear()
        self._owners.clear()
