"""Chain classes for conversation and document traffic (``"chain"``): keep the prefixes that are
being continued, learning from the traffic how likely and how soon each kind comes back.

Why. On production traffic the blocks that come back are mostly those of a prompt that is sent
again with more after it: a conversation's next turn sends the whole conversation so far,
minutes later; a popular document is asked about again. Whether a newly stored block will come
back at all is what separates LRU from the optimum (docs/benchmarks.md), and the best cheap sign
of it is how often the prompt it belongs to was *continued* already: a conversation that has
had a next turn is likelier to have another than a fresh prompt, and one that had two likelier
still; a document read twice is a popular one. ARC's sign (a block was reused) comes one turn
later: a turn's new blocks are unused when stored, and ARC files them with one-off documents.

Decisions (four lists, each in recency order: class 0, blocks of requests that continued
nothing, not reused since stored; class 1, blocks reused since stored, or of a request that
continued a class-0 request; class 2, blocks of a request that continued a class-1 or class-2
request; the *shared* list, blocks used by a request that continued nothing: a system or tool
prompt, a document others read):

- **Requests.** :meth:`note_request` gives the policy a request's keys in prefix order before
  its stores (:meth:`note_finished_request` when the caller knows them only at the request's
  end, as vLLM's drop-in does: the same, its blocks moved to its class then). Its keys at
  depths ``_TAIL_DEPTHS`` (1, 2, 4, ..., 64) from its end, past the last two only those in
  its last 1/``_TAIL_REACH`` (a 32nd: a request holding one shares nearly all of it; in
  512-token blocks, the last two of a prompt under 64k tokens) are remembered as its *tails*
  (up to ``_TAIL_CAPACITIES`` x capacity of them, the oldest forgotten first), with its
  class, the time and the depth, except a key held before the request that it did not
  continue (a prefix others share, such as a system prompt, is nobody's tail). A request
  whose keys hold a remembered tail continues that request (the deepest one found; the tail
  is then forgotten, or remembered again as this request's own), and the continued class
  counts an extension after that delay. Through a tail at most ``_CONTINUE_DEPTH`` keys from
  that request's end (a conversation's next turn; a question after a document, which shares
  the document's last block, a key or two before the question's end), the request's class
  is one above the continued one's (at most 2). Through a deeper one it is a *branch*, a
  fresh prompt sharing a long prefix (another question about a document, in small blocks
  where a question fills many): class 0, as a request that continues nothing. Tails at
  depths, not only the last keys: in 16-token blocks the shared point is often many keys
  before a request's end, and with the last two only chain lost to LRU on documents. A
  caller's hint overrides the class: a request it expects to be continued (``continues``
  true) is at least class 1, one it expects not to be is class 0, while hints of that value
  tell continued requests apart: the share of the requests so hinted that were continued
  (from a prior of ``_HINT_PRIOR_REQUESTS`` right ones) is ``_HINT_MARGIN`` above, or below,
  that of all requests. Every statistic is learned from what the requests do, so a wrong hint
  costs hits and a hint source that tells nothing is soon not followed.
- **Stores.** A noted request's new blocks go to its class, the deepest ranked oldest (a block
  is of no use without the blocks before it, so a request's blocks go from the deepest up),
  except its *ghosts* (below), which go back to the shared list; any other store goes to
  class 0 in the order given, as ``insert_many`` says.
- **Uses.** A touch moves a held block up to class 1, or to the class of the request it is
  for if higher, or to the shared list if that request continued nothing (a pinned block
  being written stays); a block never moves down, and a shared block stays shared. A refresh
  keeps each block in its list. Told a request at its end, one that continued nothing makes
  the blocks it used (in classes 1 and 2 by then) shared.
- **Learned per class** (counts halved every ``_HALVING_CAPACITIES`` capacities of stored
  blocks, so the estimates follow the traffic): the share ``q`` of its requests continued
  later, and the distribution ``F`` of the delays before they were (a histogram of half-octave
  bins), each starting from the pooled estimate of all classes with the weight of
  ``_PRIOR_REQUESTS`` requests. Time is the policy's clock, one tick per key stored or
  touched. **Learned for the shared list**, in the same form: its *waits* (from a use or a
  store to the next use or eviction) and the share ``q`` a use ended, with their delays. A
  shared victim is remembered as a ghost (up to ``_GHOST_CAPACITIES`` x capacity, with its
  stamp), and a request holding a ghost ends that wait too: else a list evicted early would
  learn that its blocks are never used again. Its estimate starts from ``q`` =
  ``_SHARED_PRIOR_SHARE`` and the classes' pooled delays.
- **Victims.** Each list gives up its oldest block first; between the four oldest, the
  victim is the one whose chance of being continued within the next ``H`` ticks, given its
  age ``a``, is least per tick it is expected to be held (*hit density*, times ``H``, which
  every list shares): ``q (F(a + H) - F(a)) / (1 - q M(a))``, where ``M(a)`` is the mean of
  ``F`` over ``[a, a + H]`` (exact: in a bin ``F`` is linear in ``2 log2(t + 1)``) and ``H``
  the ticks in which a capacity of blocks is stored (measured over the halving window:
  touches tick the clock too, and vLLM's drop-in ranks a request's blocks again at its end).
  A block likely back soon frees its place sooner than one as likely back only near the
  horizon: an agent loop paused for seconds outranks a shared prompt back in minutes (ranked
  by the chance alone, ``chain`` was 0.25 points under LRU at 2 % of ``toolagent``). The
  ranks are taken at the ages ``2**(j/2) - 1`` and linear between them, each made the
  least of it and those at younger ages (a block never ranks above a younger one of its
  class: classes that learned alike rank by age alone). A tie goes to the older block, then
  the lower list. The ranks are computed from the counts when first needed and again once
  ``_TABLE_REQUESTS`` more requests were noted. Pinned and protected blocks are passed over,
  as in every built-in.

Where it comes from and what it gives: the chain-class rule of the project's third session,
with delay histograms instead of exponential delays (think times are log-normal: a block that
has waited a minute is likelier to be continued soon than a fresh one) and tails that a
question after a document does not hide; the shared list (the twelfth session) keeps what many
requests start from, as ARC's second list does; hit density (the eighteenth session) is
LHD's measure (Beckmann et al., NSDI '18) on these classes. In the study on the generated
traces (seeds 0-15, 1-20 % of the unique blocks, 512-token blocks) it is within 0.2 points of
the better of LRU and ARC at all 320 points, and at 5 % closes 19-28 % of the LRU -> Belady
gap on conversations, 15-23 % on documents, 8-18 % on the production mix (docs/benchmarks.md);
on the public Mooncake traces (nothing set on them), within 0.2 points at all 10 points and
7 % and 4 % of the gap at 5 %. Most of the rest is whether a request will be continued,
which those traces do not show: with the hint, right for every request, the same classes close
57-98 % at 5 %, and 33-63 % with one hint in ten wrong (``benchmarks/bench_headroom.py``).
Told no requests (a manager that does not know them) every new block goes to class 0, nothing
is shared and no class learns anything, so they rank alike and the older head goes: it is
LRU, victim for victim (tested).

Cost: four :class:`~tiering.policies._order.RecencyOrder` lists sharing pins, a dict probe
per key of each noted request up to its deepest tail and a set of its keys (and one in the
ghosts, when there are any), an ordered dict of tails, another of ghosts; per use of a key the
shared list holds, a dict probe and a logarithm; victims read from the lists' heads in runs
(:mod:`~tiering.policies._chain_search`), a logarithm only for those near the point where one
list's rank crosses another's (past a class's delays, where ranks are equal, the older stamp
goes without one); the ranks computed again (four lists x 64 ages) once every
``_TABLE_REQUESTS`` requests. Per stored block, LRU's metadata times 1.1-1.2 storing new
blocks and 1.45-1.5 in requests that reuse blocks (1.6 at 1,000 blocks since hit density: the
ranks' recompute); per block referenced on traffic, where the lists compete, 1.7-1.9 (ARC:
1.3), and as much with a connector's copies in flight (keys pinned in place are passed over,
keys released in order read as a second source of their list: the plain search still applies)
(``benchmarks/bench_metadata.py``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from typing import ClassVar, NamedTuple

from tiering.policies._chain_hints import HintRecord
from tiering.policies._chain_ranks import BINS as _BINS
from tiering.policies._chain_ranks import delay_bin, rank_tables
from tiering.policies._chain_search import CLASSES as _CLASSES
from tiering.policies._chain_search import LISTS as _LISTS
from tiering.policies._chain_search import SHARED as _SHARED
from tiering.policies._chain_search import (
    evict_in_place,
    evict_taking_ahead,
    negated_tables,
    rank_at,
)
from tiering.policies._chain_tails import Tails, remember_tails
from tiering.policies._checks import (
    check_evict_count,
    check_insert_key,
    check_touch_keys,
    protected_set,
)
from tiering.policies._lists import ListsPolicy
from tiering.policies._order import RecencyOrder
from tiering.policies._two_lists import stamped_keys as _stamped
from tiering.policies.base import check_hint

__all__ = ["ChainClassStats", "ChainPolicy"]

_NO_KEYS: frozenset[bytes] = frozenset()


class ChainClassStats(NamedTuple):
    """What the policy has learned of one class (counts halved as they age)."""

    requests: float  #: requests whose new blocks went to this class
    continued: float  #: of those, continued by a later request
    delay_bins: tuple[float, ...]  #: the continuations' delays: bin b holds 2**(b/2)-1 ticks on


class ChainPolicy(ListsPolicy):
    """Three classes by how often a prompt was continued; the victim is the class head least
    likely to be continued soon. See the module docstring."""

    name = "chain"

    #: Depths from a request's end (1: its last key) of the keys remembered as its tails.
    _TAIL_DEPTHS: ClassVar[tuple[int, ...]] = (1, 2, 4, 8, 16, 32, 64)
    #: Tails past a request's last two keys are in its last 1/``_TAIL_REACH`` of keys.
    _TAIL_REACH: ClassVar[int] = 32
    #: A continuation through a tail at most this deep raises the class; deeper: a branch.
    _CONTINUE_DEPTH: ClassVar[int] = 4
    #: Tails remembered, in capacities.
    _TAIL_CAPACITIES: ClassVar[int] = 4
    #: Weight, in requests, of the pooled estimate each class's estimate starts from.
    _PRIOR_REQUESTS: ClassVar[float] = 4.0
    #: The counts halve after this many capacities of stored blocks.
    _HALVING_CAPACITIES: ClassVar[int] = 10
    #: The ranks are computed again from the counts once this many requests were noted.
    _TABLE_REQUESTS: ClassVar[int] = 64
    #: Ghosts of the shared list's victims remembered (learning how soon they are used
    #: again), in capacities.
    _GHOST_CAPACITIES: ClassVar[int] = 2
    #: The share of the shared list's waits ended by a use that its estimate starts from.
    _SHARED_PRIOR_SHARE: ClassVar[float] = 0.5
    #: A hint is followed while the share of the requests it named that were continued is
    #: this far from the share of all requests (above for ``True``, below for ``False``) ...
    _HINT_MARGIN: ClassVar[float] = 0.1
    #: ... starting from the hint being right, with the weight of this many requests.
    _HINT_PRIOR_REQUESTS: ClassVar[float] = 4.0
    #: Search lists with nothing released out of order by reading their heads in place
    #: (:mod:`~tiering.policies._chain_search`); tests turn it off to check both searches.
    _PLAIN_SEARCH: ClassVar[bool] = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, _LISTS)
        self._tails: Tails = OrderedDict()
        # Per class, then the shared list (its "requests" are waits, "continued" those a use
        # ended: of the keys it held, or of its ghosts).
        self._requests = [0.0] * _LISTS
        self._continued = [0.0] * _LISTS
        self._delays = [[0.0] * _BINS for _ in range(_LISTS)]
        self._hints = HintRecord(self._HINT_MARGIN, self._HINT_PRIOR_REQUESTS)
        self._ghosts: OrderedDict[bytes, int] = OrderedDict()  # shared victims: key -> stamp
        self._to_shared: frozenset[bytes] = _NO_KEYS  # the noted request's ghosts
        self._tables: list[list[float]] | None = None  # per class: ranks by age (knots)
        self._negated: list[list[float]] = []  # the tables' ranks negated, for bisect
        self._requests_since_tables = 0
        self._stored_since_halving = 0
        self._window_start = -1  # the clock when the counts last halved
        self._ticks_per_store = 1.0  # clock ticks per block stored, in the last window
        self._request_class = 0  # of the request last noted, for its stores and uses
        self._request_keys: tuple[bytes, ...] = ()  # of the request last noted
        self._request_set: frozenset[bytes] | None = None  # its keys, made when first needed

    # -- read-only views (tests, debugging) ---------------------------------------------------

    @property
    def class_stats(self) -> tuple[ChainClassStats, ...]:
        """What was learned of each class, 0 to 2, then of the shared list (its requests are
        the waits of its blocks, from a use to the next use or eviction; continued, those a use
        ended, of a block held or of a ghost)."""
        return tuple(
            ChainClassStats(self._requests[c], self._continued[c], tuple(self._delays[c]))
            for c in range(_LISTS)
        )

    @property
    def hint_stats(self) -> dict[bool, tuple[float, float]]:
        """Per hint value, the requests so hinted and how many were continued (both halved)."""
        return self._hints.stats()

    hints_followed = property(lambda self: self._hints.followed)  # never halved, kept by clear()

    @property
    def tail_keys(self) -> tuple[bytes, ...]:
        """The remembered tails, the oldest first."""
        return tuple(self._tails)

    # -- requests -----------------------------------------------------------------------------

    def note_request(self, keys: Sequence[bytes], continues: bool | None = None) -> None:
        """Learn from a request's keys (prefix order), before its stores: class it (as the
        hint says, if given), remember its tails and class the blocks it will store and use."""
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys, "note_request")
        if continues is not None:
            check_hint(continues)
        if not keys:
            return
        now = self._now()
        self._to_shared = self._ghost_uses(keys, now) if self._ghosts else _NO_KEYS
        request_class, continued = self._classify(keys, now, continues)
        self._remember(keys, request_class, continued, self._lists, now, continues)  # held: no
        self._request_class = request_class
        self._request_keys = tuple(keys)
        self._request_set = None

    def note_finished_request(self, keys: Sequence[bytes], continues: bool | None = None) -> None:
        """:meth:`note_request` once the request has stored its blocks: its blocks are moved up
        to its class now (a use: they were stored in class 0 and used in class 1), and its tails
        are those it stored (in class 0) or continued, or holds no longer."""
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys, "note_finished_request")
        if continues is not None:
            check_hint(continues)
        if not keys:
            return
        lists = self._lists
        now = self._now()
        back = self._ghost_uses(keys, now) if self._ghosts else _NO_KEYS
        request_class, continued = self._classify(keys, now, continues)
        # Not a block it used: one it stored is in class 0 (or gone).
        self._remember(keys, request_class, continued, lists[1:], now, continues)
        self._sync_clocks()
        if back:  # stored again in class 0: the shared list's
            lists[_SHARED].gather_all([key for key in keys if key in back], lists[:1])
        if request_class:
            lists[request_class].gather_all(keys, lists[:request_class])
        else:  # continuing nothing, the blocks it used (in classes 1-2) are shared
            shared = lists[_SHARED]
            before = shared.size
            shared.gather_all(keys, lists[1:_SHARED])
            self._requests[_SHARED] += shared.size - before

    def _ghost_uses(self, keys: Sequence[bytes], now: int) -> frozenset[bytes]:
        """Learn from the keys of a request that are ghosts of the shared list (a use that
        ended a wait, after its block was evicted): the ghosts, forgotten."""
        ghosts = self._ghosts
        found = [key for key in keys if key in ghosts]
        delays = self._delays[_SHARED]
        for key in found:
            delays[delay_bin(max(0, now - ghosts.pop(key)))] += 1
        self._continued[_SHARED] += len(found)
        self._requests[_SHARED] += len(found)
        return frozenset(found)

    def _classify(
        self, keys: Sequence[bytes], now: int, continues: bool | None = None
    ) -> tuple[int, bytes | None]:
        """The class of a request (at least 1 if the hint says a later request continues it,
        0 if it says none does) and the tail it continues (the deepest), learning from it."""
        tails = self._tails
        found_key = next(filter(tails.__contains__, reversed(keys)), None)  # the deepest
        request_class = 0
        if found_key is not None:
            continued_class, at, depth, hinted = tails.pop(found_key)  # continued from this turn
            if hinted is not None:
                self._hints.continued[hinted] += 1
            self._continued[continued_class] += 1
            self._delays[continued_class][delay_bin(now - at)] += 1
            if depth <= self._CONTINUE_DEPTH:
                request_class = min(continued_class + 1, _CLASSES - 1)
            else:  # a branch: class 0, and the key is a tail only as any other key is
                found_key = None
        if continues is not None:
            self._hints.requests[continues] += 1
            requests, continued = self._requests, self._continued
            total = requests[0] + requests[1] + requests[2]
            pooled = (continued[0] + continued[1] + continued[2]) / total if total > 0 else 0.5
            if self._hints.follows(continues, pooled):
                request_class = max(request_class, 1) if continues else 0
        self._requests[request_class] += 1
        self._requests_since_tables += 1
        return request_class, found_key

    def _remember(
        self,
        keys: Sequence[bytes],
        request_class: int,
        continued: bytes | None,
        used_in: Sequence[RecencyOrder],
        now: int,
        hint: bool | None,
    ) -> None:
        """Remember the request's tails (:func:`remember_tails`), with its hint."""
        rule = (self._TAIL_DEPTHS, self._TAIL_REACH, self._TAIL_CAPACITIES * max(self.capacity, 1))
        remember_tails(self._tails, keys, rule, request_class, continued, used_in, now, hint)

    # -- EvictionPolicy -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[bytes]:
        # The order successive evict(1) calls take keys in, with every key evictable: nothing
        # learned changes while evicting, so each key's rank is fixed.
        tables, now = self._class_tables(), self._now()
        lists = [sorted(_stamped(order), key=lambda entry: entry[1]) for order in self._lists]
        heads = [0] * _LISTS
        while True:
            best = -1
            best_rank = (0.0, 0)
            for c in range(_LISTS):
                if heads[c] < len(lists[c]):
                    stamp = lists[c][heads[c]][1]
                    rank = (rank_at(tables[c], now - stamp), stamp)
                    if best < 0 or rank < best_rank:
                        best, best_rank = c, rank
            if best < 0:
                return
            yield lists[best][heads[best]][0]
            heads[best] += 1

    def touch(self, keys: Sequence[bytes]) -> None:
        """A use: a held block moves up to class 1, or to the noted request's class if it is
        for that request and higher, or to the shared list if that request continues nothing,
        as that list's most recent (a pinned one, still being written, stays); a shared block
        stays shared; ``keys[0]`` ends most recent. Absent keys are ignored."""
        if isinstance(keys, (bytes, bytearray, str)):
            check_touch_keys(keys)
        if not keys:
            return
        lists = self._lists
        shared = lists[_SHARED]
        if shared.size:
            used = _shared_uses(shared, keys, self._now(), self._delays[_SHARED])
            self._continued[_SHARED] += used
            self._requests[_SHARED] += used
        target = 1
        if self._in_request(keys[0], 0):
            target = self._request_class or _SHARED  # class 0: it continues nothing
        if target == _SHARED:
            before = shared.size
            shared.gather_all(keys, lists[:_SHARED])
            self._requests[_SHARED] += shared.size - before
            return
        gathering = lists[target]
        if target < _CLASSES - 1 or shared._clock > gathering._clock:
            self._sync_clocks()  # (else gather_all syncs the clocks of the lists it is given)
        gathering.gather_all(keys, lists[:target])
        latest = gathering  # the list whose clock leads: the shared list's stamps follow it
        if target < _CLASSES - 1:
            latest = lists[_CLASSES - 1]
            latest.sync_clock(gathering)
            latest.touch_all(keys)
        if shared.size:
            shared.sync_clock(latest)
            shared.touch_all(keys)

    def insert(self, key: bytes, evictable: bool = True) -> None:
        if type(key) is not bytes:
            check_insert_key(key)
        if key in self:
            raise KeyError(key)
        self.insert_new((key,), evictable)

    def insert_new(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        if not keys:
            return
        in_request = self._in_request(keys[0], -len(keys))  # its stores: its last blocks
        self._sync_clocks()
        order = self._lists[self._request_class if in_request else 0]
        # A request's blocks, deepest oldest: it goes before the blocks it needs.
        ordered = keys[::-1] if in_request else keys
        back = self._to_shared
        if back and in_request and not back.isdisjoint(keys):
            # The request's ghosts go back to the shared list, the rest to its class.
            if len(set(keys)) < len(keys) or any(key in self for key in keys):
                raise KeyError("insert_new: a key was held already or listed twice")
            order.add_all([key for key in ordered if key not in back], evictable)
            self._sync_clocks()
            self._lists[_SHARED].add_all([key for key in ordered if key in back], evictable)
        elif not order.add_all(ordered, evictable):
            raise KeyError("insert_new: a key was held already or listed twice")
        self._stored_since_halving += len(keys)
        if self._stored_since_halving >= self._HALVING_CAPACITIES * max(self.capacity, 1):
            now = self._now()
            self._ticks_per_store = (now - self._window_start) / self._stored_since_halving
            self._window_start = now
            self._stored_since_halving = 0
            for c in range(_LISTS):
                self._requests[c] /= 2
                self._continued[c] /= 2
                self._delays[c] = [count / 2 for count in self._delays[c]]
            self._hints.halve()

    def set_evictable_many(self, keys: Sequence[bytes], evictable: bool) -> None:
        if evictable and len(keys) > 1 and keys[0] not in self._lists[0]._pinned_in_place:
            # A request's blocks were stored deepest first (stamps falling along the prefix):
            # let go in stamp order, each goes back in its place (none released out of order,
            # which would cost every later victim search a heap).
            for order in self._lists:
                parked = order._parked
                first = parked.get(keys[0])
                if first is not None:
                    last = parked.get(keys[-1])
                    if last is not None and last < first:
                        keys = keys[::-1]
                    changed, rest = order.set_evictable_each(keys, True)
                    if not rest:
                        return  # all of one list's: the usual case
                    _, elsewhere = order.set_evictable_each(changed, False)  # undone, then
                    if elsewhere:  # the general way (partners' keys pinned in place: again)
                        order.pin_all_in_place(elsewhere)
                    break
        super().set_evictable_many(keys, evictable)

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        if type(n) is not int or n < 0:
            check_evict_count(n)
        guard = protected if type(protected) is set else protected_set(protected)
        if n == 0:
            return []
        orders = self._lists
        if n > orders[0].evictable_count:  # of all the lists (partners)
            return None
        if self._tables is None or self._requests_since_tables >= self._TABLE_REQUESTS:
            self._class_tables()  # due: made at this eviction, whether or not lists compete
        first, second, third, shared = orders
        # The shared list's victims, with their stamps (none to look for in an empty list).
        ghosts: list[tuple[bytes, int]] | None = [] if shared.size else None
        if self._PLAIN_SEARCH and not (first._heap or second._heap or third._heap or shared._heap):
            mains = [order._main for order in orders]
            in_place = first._pinned_in_place  # shared: the four lists' (loads in flight)
            if in_place:  # passed over where they stand, as protected keys are
                guard = in_place.keys() | guard
            victims = evict_in_place(mains, n, guard, self._ranking, orders, ghosts)
        else:
            tables, _, now = self._ranking()
            victims = evict_taking_ahead(orders, n, guard, tables, now, ghosts)
        if victims is not None and ghosts:
            remembered = self._ghosts
            remembered.update(ghosts)
            while len(remembered) > self._GHOST_CAPACITIES * max(self.capacity, 1):
                remembered.popitem(last=False)
        return victims

    def clear(self) -> None:
        super().clear()
        self._tails.clear()
        self._requests = [0.0] * _LISTS
        self._continued = [0.0] * _LISTS
        self._delays = [[0.0] * _BINS for _ in range(_LISTS)]
        self._hints.clear()
        self._ghosts.clear()
        self._to_shared = _NO_KEYS
        self._tables = None
        self._negated = []
        self._requests_since_tables = 0
        self._stored_since_halving = 0
        self._window_start = -1
        self._ticks_per_store = 1.0
        self._request_class = 0
        self._request_keys = ()
        self._request_set = None

    # -- internals ----------------------------------------------------------------------------

    def _in_request(self, key: bytes, likely_at: int) -> bool:
        """Whether ``key`` is one of the noted request's keys: at ``likely_at`` (a lookup
        touches from its first key, a store is of its last), else in the set of them."""
        keys = self._request_keys
        if -len(keys) <= likely_at < len(keys) and keys[likely_at] == key:
            return True
        found = self._request_set
        if found is None:
            found = self._request_set = frozenset(keys)
        return key in found

    def _ranking(self) -> tuple[list[list[float]], list[list[float]], int]:
        """The tables, negated too, and the clock: what ranking a list's blocks takes."""
        return self._class_tables(), self._negated, self._now()

    def _sync_clocks(self) -> None:
        first, second, third, shared = self._lists
        first._clock = second._clock = third._clock = shared._clock = max(
            first._clock, second._clock, third._clock, shared._clock
        )

    def _now(self) -> int:
        first, second, third, shared = self._lists
        return max(first._clock, second._clock, third._clock, shared._clock)

    def _horizon_ticks(self) -> int:
        """The ticks in which a capacity of blocks is stored: a block's time to come back before
        it would be evicted. Touches tick the clock too, as many as the traffic's hits (and
        vLLM's drop-in ranks a request's blocks again at its end), so the ticks per stored
        block are measured: over the current window once it holds a capacity, else the last."""
        capacity = max(self.capacity, 1)
        ratio = self._ticks_per_store
        if self._stored_since_halving >= capacity:
            ratio = (self._now() - self._window_start) / self._stored_since_halving
        return max(1, round(capacity * ratio))

    def _class_tables(self) -> list[list[float]]:
        """Per class, then for the shared list, its ranks at the knot ages
        (:func:`~tiering.policies._chain_ranks.rank_tables`), computed from the counts when
        first needed and again once ``_TABLE_REQUESTS`` more requests were noted."""
        if self._tables is not None and self._requests_since_tables < self._TABLE_REQUESTS:
            return self._tables
        self._requests_since_tables = 0
        tables = rank_tables(
            (self._requests, self._continued, self._delays),
            _CLASSES,
            (self._PRIOR_REQUESTS, self._SHARED_PRIOR_SHARE),
            max(self.capacity, 1),
            self._horizon_ticks(),
        )
        self._tables = tables
        self._negated = negated_tables(tables)
        return tables


def _shared_uses(shared: RecencyOrder, keys: Sequence[bytes], now: int, delays: list[float]) -> int:
    """How many of ``keys`` the shared list holds: each use ends a wait (its delay since the
    key's stamp counted in ``delays``) and starts another."""
    main, parked = shared._main, shared._parked
    used = 0
    for key in keys:
        stamp = main.get(key)
        if stamp is None:
            stamp = parked.get(key)
            if stamp is None:
                continue
        elif stamp < 0:  # released: its stamp, complemented
            stamp = ~stamp
        delays[delay_bin(max(0, now - stamp))] += 1
        used += 1
    return used
