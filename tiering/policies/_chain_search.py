"""The victim searches of :class:`~tiering.policies.chain.ChainPolicy`: where its lists are
plain (no key pinned in place or released, the usual case): runs of victims from the list whose
oldest key ranks lowest, popped from the ``OrderedDict`` heads, the rank computed only for keys
not surely older than the point where the list's rank crosses the others'; and where they
are not, each list's next victim taken ahead, one at a time."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Sequence

from tiering.policies._order import RecencyOrder

__all__ = [
    "CLASSES",
    "LISTS",
    "SHARED",
    "evict_in_place",
    "evict_taking_ahead",
    "rank_at",
    "sure_stamp",
]

#: How many classes of requests a chain policy has (a list each).
CLASSES = 3
#: The list of shared blocks (used by a request that continues nothing), after the classes'.
SHARED = CLASSES
#: How many lists a chain policy has.
LISTS = CLASSES + 1


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
    guard: Collection[bytes],
    tables: list[list[float]],
    now: int,
    orders: Sequence[RecencyOrder],
    ghosts: list[tuple[bytes, int]] | None = None,
) -> list[bytes] | None:
    """``ChainPolicy.evict`` where no list has a key pinned in place or released: each
    ``_main`` is in stamp order, so its head is its next victim. Each list's next victim is
    looked at where it is; the chosen list's keys are popped from its head; those popped and
    not taken (protected, or the key that ended a run) go back to its head in their order, and
    every popped key if ``n`` cannot be found. The victims taken from the shared list, with
    their stamps, are added to ``ghosts``."""
    lists = range(len(mains))
    kept: list[list[tuple[bytes, int]]] = [[] for _ in lists]  # popped, not taken (in order)
    took: list[list[tuple[bytes, int]]] = [[] for _ in lists]
    runs: list[tuple[int, int]] = []  # (list, how many): the victims' order
    pending: list[tuple[bytes, int] | None] = [None for _ in lists]
    popped = [False for _ in lists]  # whether pending[c] was popped (else still at the head)
    ranked = [0.0 for _ in lists]
    for c in lists:
        for entry in mains[c].items():  # looked at, not popped
            if entry[0] not in guard:
                pending[c] = entry
                ranked[c] = rank_at(tables[c], now - entry[1])
                break
    wanted = n
    while wanted:
        side, others = -1, 0
        for c in lists:
            ahead = pending[c]
            if ahead is not None:
                if side < 0:
                    side = c
                    continue
                others += 1
                low = pending[side]
                assert low is not None
                if (ranked[c], ahead[1]) < (ranked[side], low[1]):
                    side = c
        if side < 0:
            break
        main, out, aside = mains[side], took[side], kept[side]
        popitem = main.popitem
        chosen = pending[side]
        assert chosen is not None
        if popped[side]:
            out.append(chosen)
        else:  # pop it (and the protected keys before it)
            while (entry := popitem(False))[0] in guard:
                aside.append(entry)
            out.append(entry)
        pending[side], popped[side] = None, False
        count = 1
        if not others:  # the rest from this list, oldest first
            if not guard and len(main) >= wanted - 1:  # the usual case: a plain take
                out += [popitem(False) for _ in range(wanted - 1)]
                count = wanted
            else:
                while count < wanted and main:
                    entry = popitem(False)
                    if entry[0] in guard:
                        aside.append(entry)
                    else:
                        out.append(entry)
                        count += 1
            wanted -= count
            runs.append((side, count))
            break
        bound_rank, bound_stamp = 2.0, 0
        for c in lists:
            other = pending[c]
            if other is not None and (ranked[c], other[1]) < (bound_rank, bound_stamp):
                bound_rank, bound_stamp = ranked[c], other[1]
        table = tables[side]
        surely = sure_stamp(table, bound_rank, bound_stamp, now)
        while count < wanted and main:  # while it ranks below the others'
            entry = popitem(False)
            if entry[0] in guard:
                aside.append(entry)
                continue
            stamp = entry[1]
            if stamp > surely:  # not surely old enough: ranked
                value = rank_at(table, now - stamp)
                if value > bound_rank or (value == bound_rank and stamp >= bound_stamp):
                    pending[side], popped[side], ranked[side] = entry, True, value
                    break
            out.append(entry)
            count += 1
        wanted -= count
        runs.append((side, count))
    found_all = not wanted
    for c in lists:
        back = kept[c]
        if popped[c]:
            back.append(pending[c])  # type: ignore[arg-type]  # the last popped of its list
        if found_all:
            orders[c].size -= len(took[c])
        else:
            back = sorted(back + took[c], key=lambda entry: entry[1])
        if back:
            main = mains[c]
            for key, stamp in reversed(back):  # back at the head, in their order
                main[key] = stamp
                main.move_to_end(key, last=False)
    if not found_all:
        return None
    if ghosts is not None:
        ghosts += took[SHARED]
    if len(runs) == 1:
        return [entry[0] for entry in took[runs[0][0]]]
    starts = [0 for _ in lists]
    victims: list[bytes] = []
    for c, count in runs:
        victims += [entry[0] for entry in took[c][starts[c] : starts[c] + count]]
        starts[c] += count
    return victims


def sure_stamp(table: list[float], bound_rank: float, bound_stamp: int, now: int) -> int:
    """A stamp at or before which a block of ``table``'s class surely goes before a block
    ranked ``bound_rank`` with stamp ``bound_stamp`` (its rank falls with age: the age where it
    crosses, with a margin; where the class's last ranks equal ``bound_rank``, from the age
    they do so on, the older stamp); ``-1`` where no age does. Blocks newer than it are ranked
    one by one."""
    if table[0] < bound_rank:
        return now
    last = table[-1]
    if last > bound_rank:
        return -1
    if last == bound_rank:  # ranks equal to the bound from knot ``high`` on, exactly
        low, high = -1, len(table) - 1
        while high - low > 1:
            middle = (low + high) // 2
            if table[middle] > bound_rank:
                low = middle
            else:
                high = middle
        return min(now - math.ceil(2 ** (high / 2) - 1) - 1, bound_stamp - 1)
    low, high = 0, len(table) - 1  # table[low] >= bound_rank > table[high]: non-increasing
    while high - low > 1:
        middle = (low + high) // 2
        if table[middle] < bound_rank:
            high = middle
        else:
            low = middle
    above, below = table[low], table[high]
    crossing = low + (above - bound_rank) / (above - below) + 1e-6  # in half-octaves
    return now - math.ceil(2 ** (crossing / 2) - 1)


def evict_taking_ahead(
    orders: Sequence[RecencyOrder],
    n: int,
    guard: Collection[bytes],
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
