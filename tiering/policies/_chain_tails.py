"""The tails of :class:`~tiering.policies.chain.ChainPolicy`: the keys of each request it
remembers, so that a later request holding one is known to continue it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tiering.policies._order import RecencyOrder

__all__ = ["Tails", "remember_tails"]

#: Per tail key: the class of the request it ends, the time, its depth from that request's end.
Tails = OrderedDict[bytes, tuple[int, int, int]]


def remember_tails(
    tails: Tails,
    keys: Sequence[bytes],
    depths: Sequence[int],
    request_class: int,
    continued: bytes | None,
    used_in: Sequence[RecencyOrder],
    now: int,
    limit: int,
) -> None:
    """Remember the keys of a request at ``depths`` from its end (``1``: its last key; the
    deepest first) as its tails, past the last two only those in its second half (a request
    holding one shares most of this one, as a continuation does; one in the first half may
    be a prefix many requests start from): the one it ``continued``, and those no list of
    ``used_in`` holds (held there, a block others share). The oldest are forgotten past
    ``limit``."""
    count = len(keys)
    reach = min(count, max(2, count // 2))  # past the last two, the second half only
    for depth in reversed(depths):
        if depth > reach:  # the first half: what others may start from (a system prompt)
            continue
        key = keys[-depth]
        if key != continued:
            for order in used_in:
                if key in order._main or key in order._parked:
                    break
            else:
                tails[key] = (request_class, now, depth)
                tails.move_to_end(key)
        else:  # forgotten when it was found: back as the newest
            tails[key] = (request_class, now, depth)
    while len(tails) > limit:
        tails.popitem(last=False)
