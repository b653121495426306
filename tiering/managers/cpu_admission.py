"""Store admission of the CPU primary tier: ``store_threshold``.

vLLM's option of that name: a key is stored only once :meth:`prepare_store
<tiering.managers.cpu_manager.CPUOffloadingManager.prepare_store>` was offered it that many
times. :class:`StoreAdmission` counts the offers per key, for at most ``max_keys`` keys, the
least recently offered forgotten first (vLLM's order, see :meth:`StoreAdmission.admitted`).
A promotion from a lower tier is not an offer: it does not come here.
"""

from __future__ import annotations

from collections import OrderedDict

from tiering.core.keys import OffloadKey

__all__ = ["StoreAdmission"]


class StoreAdmission:
    """Offer counts per key against ``threshold`` (> 1: with 1 every offer is admitted and the
    manager keeps no counts)."""

    __slots__ = ("_offers", "max_keys", "threshold")

    def __init__(self, threshold: int, max_keys: int) -> None:
        self.threshold = threshold
        self.max_keys = max_keys
        # Offers per key, least recently offered first.
        self._offers: OrderedDict[OffloadKey, int] = OrderedDict()

    def admitted(self, key_list: list[OffloadKey], to_store: list[OffloadKey]) -> list[OffloadKey]:
        """Count one offer per key of the call; keep the keys of ``to_store`` offered often
        enough (in order)."""
        offers = self._offers
        # vLLM's order: the keys already counted are bumped first (most recently offered, and
        # never forgotten for this offer's new keys), then the new keys are appended, each
        # forgetting the least recently offered key not bumped; with none left, it is not
        # counted.
        offered = list(dict.fromkeys(key_list))
        bumped = 0
        move_to_end = offers.move_to_end
        for key in offered:
            count = offers.get(key)
            if count is not None:
                move_to_end(key)
                offers[key] = count + 1
                bumped += 1
        forgettable = len(offers) - bumped
        max_keys = self.max_keys
        for key in offered:
            if key in offers:
                continue
            if len(offers) >= max_keys:
                if not forgettable:
                    continue
                offers.popitem(last=False)
                forgettable -= 1
            offers[key] = 1
        threshold = self.threshold
        return [k for k in to_store if offers.get(k, 0) >= threshold]
