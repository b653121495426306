"""What :class:`~tiering.policies.chain.ChainPolicy` learns of its callers' hints: per hint value
(``continues`` true or false), the requests so hinted and how many of them were continued, and
whether hints of that value tell continued requests apart, so that it follows them; and how
many hinted requests it followed (the policy's ``hints_followed``, a counter)."""

from __future__ import annotations

__all__ = ["HintRecord"]


class HintRecord:
    """Counts of hinted requests and of those continued later, per hint value (halved with the
    policy's other counts); :meth:`holds` says whether a value is worth following, and
    :meth:`follows` says so of one hinted request, counting it in :attr:`followed` if so."""

    __slots__ = ("continued", "followed", "margin", "prior_requests", "requests")

    def __init__(self, margin: float, prior_requests: float) -> None:
        #: How far from all requests' share a value's share must be to be followed.
        self.margin = margin
        #: The weight, in requests, of the belief a value's hints start from (that they are right).
        self.prior_requests = prior_requests
        self.requests = {True: 0.0, False: 0.0}
        self.continued = {True: 0.0, False: 0.0}
        #: Hinted requests whose hint :meth:`follows` followed: a counter, never halved, kept
        #: through :meth:`clear` (a metric's running total).
        self.followed = 0

    def holds(self, continues: bool, pooled_share: float) -> bool:
        """Whether hints ``continues`` tell continued requests apart: the share of the requests
        so hinted that were continued (from ``prior_requests`` right ones) is ``margin`` above
        (``True``) or below (``False``) ``pooled_share``, that of all requests."""
        prior = self.prior_requests
        right = 1.0 if continues else 0.0
        share = (self.continued[continues] + prior * right) / (self.requests[continues] + prior)
        if continues:
            return share >= pooled_share + self.margin
        return share <= pooled_share - self.margin

    def follows(self, continues: bool, pooled_share: float) -> bool:
        """:meth:`holds`, asked once per hinted request (the policy follows its hint if so):
        a request whose hint is followed is counted in :attr:`followed`."""
        if self.holds(continues, pooled_share):
            self.followed += 1
            return True
        return False

    def halve(self) -> None:
        for hint in (True, False):
            self.requests[hint] /= 2
            self.continued[hint] /= 2

    def clear(self) -> None:
        """Forget what was learned (:attr:`followed`, a counter, is kept)."""
        self.requests = {True: 0.0, False: 0.0}
        self.continued = {True: 0.0, False: 0.0}

    def stats(self) -> dict[bool, tuple[float, float]]:
        """Per hint value, (requests, continued)."""
        return {hint: (self.requests[hint], self.continued[hint]) for hint in (True, False)}
