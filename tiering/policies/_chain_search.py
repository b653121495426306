"""The victim search of :class:`~tiering.policies.chain.ChainPolicy` where the three lists are
plain (no key pinned in place or released, the usual case): runs of victims from the list whose
oldest key ranks lowest, popped from the ``OrderedDict`` heads, the rank computed only for keys
not surely older than the point where the list's rank crosses the others'."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Collection, Sequence

from tiering.policies._order import RecencyOrder

__all__ = ["evict_in_place", "rank_at", "sure_stamp"]

_CLASSES = 3


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
) -> list[bytes] | None:
    """``ChainPolicy.evict`` where no list has a key pinned in place or released: each
    ``_main`` is in stamp order, so its head is its next victim. Keys are popped from the heads;
    those not taken (protected, or a list's next key not chosen) go back to their heads in
    their order, and all of them if ``n`` cannot be found."""
    kept: list[list[tuple[bytes, int]]] = [[], [], []]  # popped, not taken (stamp order)
    took: list[list[tuple[bytes, int]]] = [[], [], []]
    runs: list[tuple[int, int]] = []  # (list, how many): the victims' order
    pending: list[tuple[bytes, int] | None] = [None, None, None]
    ranked = [0.0, 0.0, 0.0]
    wanted = n
    for c in range(_CLASSES):
        main = mains[c]
        while main:
            entry = main.popitem(False)
            if entry[0] in guard:
                kept[c].append(entry)
                continue
            pending[c] = entry
            ranked[c] = rank_at(tables[c], now - entry[1])
            break
    while wanted:
        side, live = -1, 0
        best: tuple[float, int] = (0.0, 0)
        for c in range(_CLASSES):
            ahead = pending[c]
            if ahead is not None:
                live += 1
                if side < 0 or (ranked[c], ahead[1]) < best:
                    side, best = c, (ranked[c], ahead[1])
        if side < 0:
            break
        main, out, aside = mains[side], took[side], kept[side]
        chosen = pending[side]
        assert chosen is not None
        out.append(chosen)
        pending[side] = None
        before = len(out)
        if live == 1:  # the rest from this list, oldest first
            while len(out) - before < wanted - 1 and main:
                entry = main.popitem(False)
                (aside if entry[0] in guard else out).append(entry)
            wanted -= len(out) - before + 1
            runs.append((side, len(out) - before + 1))
            break
        bound_rank, bound_stamp = min(
            (ranked[c], other[1]) for c, other in enumerate(pending) if other is not None
        )
        table = tables[side]
        surely = sure_stamp(table, bound_rank, now)
        while len(out) - before < wanted - 1 and main:  # while it ranks below the others'
            entry = main.popitem(False)
            if entry[0] in guard:
                aside.append(entry)
                continue
            stamp = entry[1]
            if stamp > surely:  # not surely old enough: ranked
                value = rank_at(table, now - stamp)
                if value > bound_rank or (value == bound_rank and stamp >= bound_stamp):
                    pending[side], ranked[side] = entry, value
                    break
            out.append(entry)
        wanted -= len(out) - before + 1
        runs.append((side, len(out) - before + 1))
    found_all = not wanted
    for c in range(_CLASSES):
        main, back = mains[c], kept[c]
        leftover = pending[c]
        if leftover is not None:
            back.append(leftover)  # the last popped of its list
        if not found_all:
            back = sorted(back + took[c], key=lambda entry: entry[1])
        for key, stamp in reversed(back):  # back at the head, in their order
            main[key] = stamp
            main.move_to_end(key, last=False)
        if found_all:
            orders[c].size -= len(took[c])
    if not found_all:
        return None
    if len(runs) == 1:
        return [entry[0] for entry in took[runs[0][0]]]
    starts = [0, 0, 0]
    victims: list[bytes] = []
    for c, count in runs:
        victims += [entry[0] for entry in took[c][starts[c] : starts[c] + count]]
        starts[c] += count
    return victims


def sure_stamp(table: list[float], bound_rank: float, now: int) -> int:
    """A stamp at or before which a block of ``table``'s class surely ranks below
    ``bound_rank`` (its rank falls with age: the age where it crosses, with a margin); ``-1``
    where no age does. Blocks newer than it are ranked one by one."""
    if table[0] < bound_rank:
        return now
    if table[-1] >= bound_rank:
        return -1
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
