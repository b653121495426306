"""Chain classes for conversation traffic (``"chain"``): keep the prefixes that are being
continued, learning from the traffic how likely and how soon each kind comes back.

Why. On chat traffic the blocks that come back are mostly a conversation's: its next turn
sends the whole conversation so far as its prefix, minutes later. Whether a newly stored block
will come back at all is what separates LRU from the optimum (docs/benchmarks.md, eighth
session), and the best cheap sign of it is whether the request *continued* an earlier one: a
conversation that has had a next turn is likelier to have another, and sooner, than a fresh
prompt. ARC's sign (a block was reused) comes one turn later: a turn's new blocks are unused
when stored, and ARC files them with one-off documents.

Decisions (T1: class 0, blocks of requests that continued nothing, not reused since stored;
T2: class 1, blocks reused since stored and blocks of requests that continued an earlier one):

- **Requests.** :meth:`note_request` gives the policy a request's keys in prefix order
  (:meth:`note_finished_request` when the caller knows them only at the request's end, as
  vLLM's drop-in does: the same, a continuation's blocks moved to T2 then). The
  last key of every request is remembered as a *tail* (held or not, up to
  ``_TAIL_CAPACITIES`` x capacity of them, the oldest forgotten first), with the request's
  class and the time. A request whose keys hold a remembered tail continues it (the deepest
  one found): its new blocks go to T2, and the continued class counts an extension after
  that delay. The tail continued is forgotten (a conversation goes on once from each turn)
  unless it is the request's own last key (a prompt read again whole).
- **Reuse.** A touch moves a held block to T2, as ARC does (a pinned block being written
  stays).
- **Learned per class** (counts halved every ``_HALVING_CAPACITIES`` capacities of stored
  blocks, so the estimates follow the traffic): the share ``q`` of its requests continued
  later and the mean delay ``tau`` before they were, each starting from the pooled estimate
  of both classes with the weight of ``_PRIOR_REQUESTS`` requests. Time is the policy's clock,
  one tick per key stored or touched.
- **Victims.** Each list is in recency order, so its head is its oldest block. The victim is
  the head least likely to be continued within the next ``capacity`` ticks given its age ``a``
  (exponential delays: ``q s (1 - e^(-capacity / tau)) / (1 - q + q s)`` with
  ``s = e^(-a / tau)``, compared as logarithms); a tie goes to T1. Within a class that
  probability falls with age, so comparing the two heads is exact. Pinned and protected
  blocks are passed over, as in every built-in.
- **Prefix order.** New blocks are inserted deepest most recent (``insert_many``'s contract);
  an engine's adapter ranks a request's blocks again at its end (:meth:`refresh`, each block
  staying in its list).

Where it comes from and what it gives: the chain-class rule of the project's third session,
with two classes. In the study (``tiering policy-study``) on the public Mooncake traces,
within 0.2 points of the better of LRU and ARC at 9 of 10 points (``hybrid``: 8), with 40-60 %
more prefix hits than LRU at 1-2 % of the conversation trace's unique blocks; on the generated
traces under ARC by up to 2.3 points at 1 % of the document trace (floods of one-off
documents) and under LRU by up to 0.4 at 10-20 % of the production trace
(docs/benchmarks.md). Told no requests (a manager that does not know them) every new block goes
to T1 and both classes learn nothing, so they rank alike and the older head goes: it is LRU,
victim for victim (tested).

Cost: ARC's lists (:class:`~tiering.policies._order.RecencyOrder` partners sharing pins), a
dict probe per key of each noted request and a set of its keys, an ordered dict of tails; per
victim one key taken ahead from its list and ranked (two logarithms and an exponential).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from typing import ClassVar, NamedTuple

from tiering.policies._checks import (
    check_evict_count,
    check_insert_key,
    check_touch_keys,
    protected_set,
)
from tiering.policies._two_lists import TwoListPolicy
from tiering.policies._two_lists import stamped_keys as _stamped

__all__ = ["ChainPolicy", "ChainClassStats"]


class ChainClassStats(NamedTuple):
    """What the policy has learned of one class (counts halved as they age)."""

    requests: float  #: requests whose new blocks went to this class
    continued: float  #: of those, continued by a later request
    delay_ticks: float  #: the continuations' delays, summed, in clock ticks


class ChainPolicy(TwoListPolicy):
    """Two classes, fresh (T1) and continued or reused (T2); the victim is the head least
    likely to be continued soon. See the module docstring."""

    name = "chain"

    #: Tails remembered, in capacities.
    _TAIL_CAPACITIES: ClassVar[int] = 4
    #: Weight, in requests, of the pooled estimate each class's estimate starts from.
    _PRIOR_REQUESTS: ClassVar[float] = 4.0
    #: The counts halve after this many capacities of stored blocks.
    _HALVING_CAPACITIES: ClassVar[int] = 10

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._tails: OrderedDict[bytes, tuple[int, int]] = OrderedDict()  # key: class, time
        self._requests = [0.0, 0.0]
        self._continued = [0.0, 0.0]
        self._delay_ticks = [0.0, 0.0]
        self._stored_since_halving = 0
        self._request_class = 0  # of the request last noted, for its stores
        self._request_keys: frozenset[bytes] = frozenset()
        self._request_last: bytes | None = None

    # -- read-only views (tests, debugging) ---------------------------------------------------

    @property
    def class_stats(self) -> tuple[ChainClassStats, ChainClassStats]:
        """What was learned of class 0 (fresh) and class 1 (continued)."""
        return (
            ChainClassStats(self._requests[0], self._continued[0], self._delay_ticks[0]),
            ChainClassStats(self._requests[1], self._continued[1], self._delay_ticks[1]),
        )

    @property
    def tail_keys(self) -> tuple[bytes, ...]:
        """The remembered tails, the oldest first."""
        return tuple(self._tails)

    # -- EvictionPolicy -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[bytes]:
        # The order successive evict(1) calls take keys in, with every key evictable: nothing
        # learned changes while evicting, so each list's ranks are fixed.
        rank0, rank1 = self._rankers()
        t1 = sorted(_stamped(self._t1), key=lambda entry: entry[1])
        t2 = sorted(_stamped(self._t2), key=lambda entry: entry[1])
        i = j = 0
        while i < len(t1) or j < len(t2):
            if i < len(t1) and (j == len(t2) or rank0(t1[i][1]) <= rank1(t2[j][1])):
                yield t1[i][0]
                i += 1
            else:
                yield t2[j][0]
                j += 1

    def note_request(self, keys: Sequence[bytes]) -> None:
        """Learn from a request's keys (prefix order) and class the blocks it will store."""
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys, "note_request")
        if not keys:
            return
        self._request_class = self._classify(keys)
        self._request_keys = frozenset(keys)
        self._request_last = keys[-1]

    def note_finished_request(self, keys: Sequence[bytes]) -> None:
        """:meth:`note_request` once the request has stored its blocks: a continuation's are
        moved to T2 now (a touch: T1's held keys of the request are its own new blocks), and
        its last block, if it stored it, is remembered as a tail."""
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys, "note_finished_request")
        if not keys:
            return
        last = keys[-1]
        # Its last block in T1 is one it stored (a block held before and read again is in T2:
        # a touch moved it), and only a stored last block starts a tail: a request that ends
        # inside a prefix others hold (a shared first block) continues nothing of its own.
        stored_last = last in self._t1
        request_class = self._classify(keys)
        if request_class:
            self._t1.touch_all_promoting(keys, self._t2)
        if stored_last:
            self._remember_tail(last, request_class)

    def _classify(self, keys: Sequence[bytes]) -> int:
        """The class of a request (1: it continues a remembered tail), learning from it."""
        tails = self._tails
        found: tuple[int, int] | None = None
        found_key = b""
        for key in keys:  # the deepest tail the request holds
            entry = tails.get(key)
            if entry is not None:
                found, found_key = entry, key
        last = keys[-1]
        now = self._now()
        request_class = 0
        if found is not None:
            continued_class, at = found
            request_class = 1
            self._continued[continued_class] += 1
            self._delay_ticks[continued_class] += now - at
            if found_key != last:
                del tails[found_key]  # continued once from this turn
            else:  # read again whole: still its tail, now as a continued request's
                tails[last] = (1, now)
                tails.move_to_end(last)
        self._requests[request_class] += 1
        return request_class

    def insert(self, key: bytes, evictable: bool = True) -> None:
        if type(key) is not bytes:
            check_insert_key(key)
        if key in self:
            raise KeyError(key)
        self.insert_new((key,), evictable)

    def insert_new(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        if not keys:
            return
        in_request = keys[0] in self._request_keys
        request_class = self._request_class if in_request else 0
        t1, t2 = self._t1, self._t2
        t1.sync_clock(t2)
        if not (t2 if request_class else t1).add_all(keys, evictable):
            raise KeyError("insert_new: a key was held already or listed twice")
        last = self._request_last
        if in_request and last is not None and last in keys:  # the request's deepest block
            self._remember_tail(last, request_class)
        self._stored_since_halving += len(keys)
        if self._stored_since_halving >= self._HALVING_CAPACITIES * max(self.capacity, 1):
            self._stored_since_halving = 0
            for counts in (self._requests, self._continued, self._delay_ticks):
                counts[0] /= 2
                counts[1] /= 2

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        if type(n) is not int or n < 0:
            check_evict_count(n)
        guard = protected if type(protected) is set else protected_set(protected)
        if n == 0:
            return []
        t1, t2 = self._t1, self._t2
        if n > t1.evictable_count:  # of T1 and T2 together (partners)
            return None
        rank0, rank1 = self._rankers()
        taken: list[bytes] = []
        # The lower-ranked of the two lists' next victims (first evictable, unprotected keys),
        # one at a time: each list's is taken ahead (its stamp, hence its rank, exact), and the
        # one not chosen at the end is put back in its place. Once a list has nothing left,
        # the rest come from the other, oldest first, in one take.
        orders = (t1, t2)
        ranks = (rank0, rank1)
        pending: list[tuple[bytes, int] | None] = [None, None]
        ranked = [0.0, 0.0]
        try:
            for side in (0, 1):
                ahead = pending[side] = orders[side].take_one(guard)
                if ahead is not None:
                    ranked[side] = ranks[side](ahead[1])
            while len(taken) < n:
                first, second = pending
                if first is None or second is None:
                    side = 1 if first is None else 0
                    ahead = pending[side]
                    if ahead is None:
                        break
                    taken.append(ahead[0])
                    pending[side] = None
                    taken += orders[side].take(n - len(taken), guard)
                    break
                side = 0 if ranked[0] <= ranked[1] else 1
                taken.append((first if side == 0 else second)[0])
                ahead = pending[side] = orders[side].take_one(guard)
                if ahead is not None:
                    ranked[side] = ranks[side](ahead[1])
            for order, held_back in zip(orders, pending, strict=True):
                if held_back is not None:
                    order.put_back_last()
        except BaseException:
            t1.end_search(undo=True)
            t2.end_search(undo=True)
            raise
        found_all = len(taken) == n
        t1.end_search(undo=not found_all)
        t2.end_search(undo=not found_all)
        return taken if found_all else None

    def clear(self) -> None:
        super().clear()
        self._tails.clear()
        self._requests = [0.0, 0.0]
        self._continued = [0.0, 0.0]
        self._delay_ticks = [0.0, 0.0]
        self._stored_since_halving = 0
        self._request_class = 0
        self._request_keys = frozenset()
        self._request_last = None

    # -- internals ----------------------------------------------------------------------------

    def _now(self) -> int:
        t1, t2 = self._t1, self._t2
        t1.sync_clock(t2)
        return t1._clock

    def _remember_tail(self, key: bytes, request_class: int) -> None:
        tails = self._tails
        tails[key] = (request_class, self._now())
        tails.move_to_end(key)
        while len(tails) > self._TAIL_CAPACITIES * max(self.capacity, 1):
            tails.popitem(last=False)

    def _rankers(self) -> tuple[_Rank, _Rank]:
        """Per class, the log-probability of being continued within ``capacity`` ticks of a
        block last stamped at a given time, now (see the module docstring)."""
        requests, continued, delays = self._requests, self._continued, self._delay_ticks
        all_requests = requests[0] + requests[1]
        all_continued = continued[0] + continued[1]
        pooled_share = all_continued / all_requests if all_requests > 0 else 0.5
        pooled_delay = (delays[0] + delays[1]) / all_continued if all_continued > 0 else None
        prior = self._PRIOR_REQUESTS
        horizon = float(max(self.capacity, 1))
        now = self._now()
        ranks = []
        for c in (0, 1):
            share = (continued[c] + prior * pooled_share) / (requests[c] + prior)
            share = min(max(share, 1e-3), 1 - 1e-3)
            mean_delay = horizon if pooled_delay is None else pooled_delay
            delay = (delays[c] + prior * mean_delay) / (continued[c] + prior)
            ranks.append(_Rank(now, share, max(delay, 1.0), horizon))
        return ranks[0], ranks[1]


class _Rank:
    """log P(continued within ``horizon`` ticks | a block stamped at ``stamp``, its class)."""

    __slots__ = ("_base", "_delay", "_now", "_share")

    def __init__(self, now: int, share: float, delay: float, horizon: float) -> None:
        self._now = now
        self._share = share
        self._delay = delay
        # log(q (1 - e^(-H/tau))): constant for the class
        self._base = math.log(share) + math.log(-math.expm1(-horizon / delay))

    def __call__(self, stamp: int) -> float:
        exponent = -(self._now - stamp) / self._delay  # log s
        share = self._share
        return self._base + exponent - math.log1p(share * (math.exp(exponent) - 1.0))
