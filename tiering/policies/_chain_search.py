"""The victim searches of :class:`~tiering.policies.chain.ChainPolicy`: where its lists are
plain (no key released out of order, the usual case, even with copies in flight): runs of
victims from the list whose oldest key ranks lowest, read in place from the ``OrderedDict``
heads (merged with the keys released in order, where a list has some) and deleted once all
are found, the rank computed only for keys not surely older than the point where the list's
rank crosses the others'; and where they are not, each list's next victim taken ahead, one at
a time."""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet

from tiering.policies._order import RecencyOrder

__all__ = [
    "CLASSES",
    "LISTS",
    "SHARED",
    "evict_in_place",
    "evict_taking_ahead",
    "negated_tables",
    "rank_at",
    "sure_stamp",
]

#: How many classes of requests a chain policy has (a list each).
CLASSES = 3
#: The list of shared blocks (used by a request that continues nothing), after the classes'.
SHARED = CLASSES
#: How many lists a chain policy has.
LISTS = CLASSES + 1

_key_of = operator.itemgetter(0)
_PLACED = (0).__le__  # a stamp in its place (a released key's marker is negative)


def rank_at(ranks: list[float], age_ticks: int) -> float:
    """A class's rank at ``age_ticks``: linear between its knots in half-octaves."""
    x = 2 * math.log2(age_ticks + 1)
    j = int(x)
    if j >= len(ranks) - 1:
        return ranks[-1]
    return ranks[j] + (ranks[j + 1] - ranks[j]) * (x - j)


def evict_in_place(
    mains: list[OrderedDict[bytes, int]],
    n: int,
    guard: AbstractSet[bytes],
    ranking: Callable[[], tuple[list[list[float]], list[list[float]], int]],
    orders: Sequence[RecencyOrder],
    ghosts: list[tuple[bytes, int]] | None = None,
) -> list[bytes] | None:
    """``ChainPolicy.evict`` where no list has a key released out of order (no ``_heap``):
    a list's keys in their places (``_main``'s, the markers of released keys passed over) are
    in stamp order, and so are its keys released in order (``_rel``), so the unguarded keys
    of each, from the head, are its next victims (``guard``: the protected keys and those
    pinned in place). Each is read where it is (an iterator, nothing moved while searching),
    a list with released keys as two sources ranked alike, which merges them by stamp: runs
    of victims from the source whose next key ranks lowest, the rank computed only for keys
    not surely older than the point where it crosses the best of the others' (``ranking``
    gives the tables, negated too, and the clock: asked only where two sources have keys).
    The victims are then deleted; none if ``n`` cannot be found. Those of the shared list,
    with their stamps, are added to ``ghosts``."""
    live: list[int] = []  # per source, its list
    readers: list[Iterator[tuple[bytes, int]]] = []
    for c, main in enumerate(mains):
        if not main:
            continue
        rel = orders[c]._rel
        live.append(c)
        if rel:  # in C: _main's entries whose stamps are not markers (>= 0), then _rel's
            readers.append(itertools.compress(main.items(), map(_PLACED, main.values())))
            live.append(c)
            readers.append(iter(rel.items()))
        else:
            readers.append(iter(main.items()))
    if len(live) == 1:  # one source to take from: its oldest go, no rank needed
        only = live[0]
        entries = _first_unguarded(readers[0], n, guard)
        if len(entries) < n:
            return None
        return _delete(mains, orders, [(only, entries)], ghosts)
    tables, negated, now = ranking()  # sources compete: ranks needed
    # Per source (by position in ``live``): its next victim (unprotected) and its rank.
    ahead: list[tuple[bytes, int] | None] = [None] * len(live)
    ranked = [2.0] * len(live)
    for i, c in enumerate(live):
        for head in readers[i]:
            if head[0] not in guard:
                ahead[i] = head
                ranked[i] = rank_at(tables[c], now - head[1])
                break
    runs: list[tuple[int, list[tuple[bytes, int]]]] = []  # (list, its entries): victim order
    wanted = n
    while wanted:
        # The lowest (rank, stamp) of the sources' next victims, and the next lowest: the bound.
        side = bound = -1
        for i, candidate in enumerate(ahead):
            if candidate is None:
                continue
            if side < 0:
                side = i
                continue
            low = ahead[side]
            assert low is not None
            if (ranked[i], candidate[1]) < (ranked[side], low[1]):
                side, bound = i, side
            elif bound < 0:
                bound = i
            else:
                other = ahead[bound]
                assert other is not None
                if (ranked[i], candidate[1]) < (ranked[bound], other[1]):
                    bound = i
        if side < 0:
            break
        chosen = ahead[side]
        assert chosen is not None
        ahead[side] = None
        run = [chosen]
        runs.append((live[side], run))
        wanted -= 1
        if not wanted:
            break
        reader = readers[side]
        if bound < 0:  # the rest from this source, oldest first
            more = _first_unguarded(reader, wanted, guard)
            run += more
            wanted -= len(more)
            break
        bounding = ahead[bound]
        assert bounding is not None
        bound_rank, bound_stamp = ranked[bound], bounding[1]
        table = tables[live[side]]
        surely = sure_stamp(table, bound_rank, bound_stamp, now, negated[live[side]])
        while wanted:  # while it ranks below the others' best
            entry = next(reader, None)
            if entry is None:
                break
            if entry[0] in guard:
                continue
            stamp = entry[1]
            if stamp > surely:  # not surely old enough: ranked
                value = rank_at(table, now - stamp)
                if value > bound_rank or (value == bound_rank and stamp >= bound_stamp):
                    ahead[side], ranked[side] = entry, value
                    break
            run.append(entry)
            wanted -= 1
    if wanted:
        return None
    return _delete(mains, orders, runs, ghosts)


def _first_unguarded(
    reader: Iterator[tuple[bytes, int]], n: int, guard: AbstractSet[bytes]
) -> list[tuple[bytes, int]]:
    """Up to ``n`` entries of ``reader`` whose keys ``guard`` does not hold, in order."""
    found = list(itertools.islice(reader, n))
    if not guard or guard.isdisjoint(map(_key_of, found)):  # the usual case: none protected
        return found
    found = [entry for entry in found if entry[0] not in guard]
    if len(found) < n:
        for entry in reader:
            if entry[0] not in guard:
                found.append(entry)
                if len(found) == n:
                    break
    return found


def _delete(
    mains: list[OrderedDict[bytes, int]],
    orders: Sequence[RecencyOrder],
    runs: list[tuple[int, list[tuple[bytes, int]]]],
    ghosts: list[tuple[bytes, int]] | None,
) -> list[bytes]:
    """Delete the runs' entries from their lists (the readers are done with them); their keys,
    in the runs' order. The shared list's, with their stamps, are added to ``ghosts``."""
    victims: list[bytes] = []
    for c, entries in runs:
        keys = list(map(_key_of, entries))
        any(map(mains[c].__delitem__, keys))  # a loop in C: each call returns None
        rel = orders[c]._rel
        if rel:  # a released key's place goes with it
            for key in keys:
                rel.pop(key, None)
        orders[c].size -= len(keys)
        victims += keys
        if c == SHARED and ghosts is not None:
            ghosts += entries
    return victims


def sure_stamp(
    table: list[float],
    bound_rank: float,
    bound_stamp: int,
    now: int,
    negated: list[float] | None = None,
) -> int:
    """A stamp at or before which a block of ``table``'s class surely goes before a block
    ranked ``bound_rank`` with stamp ``bound_stamp`` (its rank falls with age: the age where it
    crosses, with a margin; where the class's last ranks equal ``bound_rank``, from the age
    they do so on, the older stamp); ``-1`` where no age does. Blocks newer than it are ranked
    one by one. ``negated``: the table's ranks negated (:func:`negated_tables`), for a search
    in C."""
    if table[0] < bound_rank:
        return now
    last = table[-1]
    if last > bound_rank:
        return -1
    if negated is None:
        negated = [-rank for rank in table]
    if last == bound_rank:  # ranks equal to the bound from knot ``high`` on, exactly
        high = bisect.bisect_left(negated, -bound_rank)  # the first rank <= the bound
        return min(now - math.ceil(2 ** (high / 2) - 1) - 1, bound_stamp - 1)
    # table[high - 1] >= bound_rank > table[high]: the ranks do not increase.
    high = bisect.bisect_right(negated, -bound_rank)
    above, below = table[high - 1], table[high]
    crossing = high - 1 + (above - bound_rank) / (above - below) + 1e-6  # in half-octaves
    return now - math.ceil(2 ** (crossing / 2) - 1)


def negated_tables(tables: list[list[float]]) -> list[list[float]]:
    """Each table's ranks negated: ascending, for :mod:`bisect` (made with the tables)."""
    return [[-rank for rank in table] for table in tables]


def evict_taking_ahead(
    orders: Sequence[RecencyOrder],
    n: int,
    guard: AbstractSet[bytes],
    tables: list[list[float]],
    now: int,
    ghosts: list[tuple[bytes, int]] | None,
) -> list[bytes] | None:
    """``ChainPolicy.evict`` where a list has keys pinned in place or released: each list's
    next victim is taken ahead through :meth:`RecencyOrder.take_one`. The victims taken from
    the shared list, with their stamps, are added to ``ghosts``."""
    lists = len(orders)
    log2 = math.log2
    taken: list[bytes] = []
    # The lowest-ranked of the lists' next victims (first evictable, unprotected keys), one
    # at a time: each list's is taken ahead (its stamp, hence its rank, exact), and those
    # not chosen at the end are put back in their places. Once one list alone has keys
    # left, the rest come from it, oldest first, in one take.
    pending: list[tuple[bytes, int] | None] = [None] * lists
    ranked = [0.0] * lists
    stamps = [0] * lists
    try:
        for c in range(lists):
            if orders[c].size:
                ahead = pending[c] = orders[c].take_one(guard)
                if ahead is not None:
                    ranked[c], stamps[c] = rank_at(tables[c], now - ahead[1]), ahead[1]
        while len(taken) < n:
            side, live = -1, 0
            for c in range(lists):
                if pending[c] is not None:
                    live += 1
                    if side < 0 or (ranked[c], stamps[c]) < (ranked[side], stamps[side]):
                        side = c
            if side < 0:
                break
            ahead = pending[side]
            assert ahead is not None
            pending[side] = None
            if live == 1 and side != SHARED:
                taken.append(ahead[0])
                taken += orders[side].take(n - len(taken), guard)
                break
            # A run from the winning list while its next key ranks below the best of the
            # others (whose next keys stay as they are).
            bound_rank, bound_stamp = min(
                ((ranked[c], stamps[c]) for c in range(lists) if pending[c] is not None),
                default=(2.0, 0),  # the shared list alone: taken one by one, for its ghosts
            )
            order, table = orders[side], tables[side]
            last_knot = len(table) - 1
            while True:
                taken.append(ahead[0])
                if side == SHARED and ghosts is not None:
                    ghosts.append(ahead)
                if len(taken) == n:
                    break
                ahead = order.take_one(guard)
                if ahead is None:
                    break
                stamp = ahead[1]
                x = 2 * log2(now - stamp + 1)  # _rank, inline: a call per victim costs
                j = int(x)
                rank = (
                    table[-1] if j >= last_knot else table[j] + (table[j + 1] - table[j]) * (x - j)
                )
                if rank > bound_rank or (rank == bound_rank and stamp >= bound_stamp):
                    pending[side], ranked[side], stamps[side] = ahead, rank, stamp
                    break
        for order, held_back in zip(orders, pending, strict=True):
            if held_back is not None:
                order.put_back_last()
    except BaseException:
        for order in orders:
            order.end_search(undo=True)
        raise
    found_all = len(taken) == n
    for order in orders:
        order.end_search(undo=not found_all)
    return taken if found_all else None
