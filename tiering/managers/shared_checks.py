"""Existence checks of the shared tier: keys no tier knows the location of.

A shared tier (:mod:`tiering.managers.shared_tier`, at most one, the last) has no index: a key
that no local tier holds, and that the shared tier knows nothing of (``TierKeyState.UNKNOWN``),
joins its request's promotion batch like a promotion and the lookup answers ``RETRY``. When the
batch is submitted (:mod:`tiering.managers.promotions`), its keys for the shared tier come here:
those the tier's cache says are present are promoted at once; the unknown ones become one
existence check of the store (:meth:`SharedChecks.start`), and the keys it finds are promoted
when its result applies (:meth:`SharedChecks.finish` hands them back). Meanwhile the checked keys
count as being promoted (a lookup answers ``RETRY``, and no second check starts for them).

Without a shared tier none of this runs: no tier answers UNKNOWN, and an absent key takes the
same branches as before.
"""

from __future__ import annotations

from collections.abc import Sequence

from tiering.core.keys import OffloadKey
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.secondary_tier import SecondaryTier, TierJob, TierKeyState
from tiering.managers.shared_tier import SharedTier

__all__ = ["SharedChecks"]

ABSENT = TierKeyState.ABSENT


class SharedChecks:
    """The existence checks of ``tier``, the tier at ``index`` (the last) below ``primary``,
    after the local ``tiers_above`` (see the module docstring).

    ``promoting`` is the table of keys waiting for or in a promotion (key -> tier index), shared
    with the promotions: a checked key is in it, at ``index``, until its check's result applies.
    """

    def __init__(
        self,
        tier: SharedTier,
        index: int,
        primary: CPUOffloadingManager,
        tiers_above: Sequence[SecondaryTier],
        promoting: dict[bytes, int],
    ) -> None:
        self.tier = tier
        self.index = index
        self.primary = primary
        self.tiers_above = tuple(tiers_above)
        self.promoting = promoting

    def location_unknown(self, key: OffloadKey) -> bool:
        """Whether no tier knows where ``key`` is: the primary and every local tier lack it,
        and the shared tier knows nothing of it (no side effects)."""
        if self.primary.lookup(key) is not False:
            return False
        for tier in self.tiers_above:
            if tier.state(key) is not ABSENT:
                return False
        return self.tier.is_unknown(key)

    def start(self, keys: list[bytes], req_context: object) -> tuple[list[bytes], TierJob | None]:
        """Split ``keys`` (not being promoted) into those the tier knows are present, to promote
        now, and one existence check job for those it knows nothing of (None if there are none,
        or the tier takes no check), whose keys now count as being promoted: submit it."""
        tier = self.tier
        present, unknown = tier.partition(keys)
        primary = self.primary
        unknown = [k for k in unknown if k not in primary]
        job = None
        if unknown:
            job = tier.start_check(unknown, req_context=req_context)
            if job is not None:
                promoting, index = self.promoting, self.index
                for key in job.keys:
                    promoting[key] = index
        return present, job

    def finish(self, job: TierJob, result: object) -> list[bytes]:
        """Apply a check's result (the tier caches every answer); its keys are no longer being
        promoted. Return the keys it found that are not being promoted now: promote them."""
        present = self.tier.finish_check(job, result)
        promoting = self.promoting
        for key in job.keys:
            promoting.pop(key, None)
        return [k for k in present if k not in promoting]
