"""The tails of :class:`~tiering.policies.chain.ChainPolicy`: the keys of each request it
remembers, so that a later request holding one is known to continue it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tiering.policies._order import RecencyOrder

__all__ = ["Tails", "remember_tails"]

#: Per tail key: the class of the request it ends, the time, its depth from that request's end,
#: and that request's hint (``continues``: True, False or None).
Tails = OrderedDict[bytes, tuple[int, int, int, bool | None]]


def remember_tails(
    tails: Tails,
    keys: Sequence[bytes],
    rule: tuple[Sequence[int], int, int],
    request_class: int,
    continued: bytes | None,
    used_in: Sequence[RecencyOrder],
    now: int,
    hint: bool | None = None,
) -> None:
    """Remember the keys of a request at ``depths`` from its end (``1``: its last key; the
    deepest first) as its tails, past the last two only those in its last 1/``reach_divisor``
    (a request holding one then shares nearly all of this one, as a continuation does;
    deeper, it may share a prefix many requests start from): the one it ``continued``, and
    those no list of ``used_in`` holds (held there, a block others share). The oldest are
    forgotten past ``limit``. ``rule`` is ``(depths, reach_divisor, limit)``; ``hint``: the
    request's, kept with its tails."""
    depths, reach_divisor, limit = rule
    count = len(keys)
    reach = min(count, max(2, count // reach_divisor))
    for depth in reversed(depths):
        if depth > reach:  # too far from the end: what others may start from
            continue
        key = keys[-depth]
        if key != continued:
            for order in used_in:
                if key in order._main or key in order._parked:
                    break
            else:
                tails[key] = (request_class, now, depth, hint)
                tails.move_to_end(key)
        else:  # forgotten when it was found: back as the newest
            tails[key] = (request_class, now, depth, hint)
    while len(tails) > limit:
        tails.popitem(last=False)
