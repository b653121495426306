"""The eviction-policy interface.

A policy orders the keys that one tier holds and picks victims. It holds metadata only: no
buffers, no I/O, nothing that blocks. Like cachetools' caches, it is not thread-safe; the tier that
owns it serializes calls.

A key is *evictable* unless its tier says otherwise: a block being written (not ready yet) or
being read (pinned by a load) is not, and the tier flips the flag with :meth:`set_evictable`.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from typing import ClassVar

from tiering.errors import InvalidArgumentError
from tiering.policies._checks import check_insert_key

__all__ = ["EvictionPolicy", "check_hint", "takes_hints", "tell_request"]


class EvictionPolicy(ABC):
    """Orders the keys of one tier and chooses which to evict.

    Contract shared by every policy (the conformance suite in ``tiering.testing`` checks it):

    - ``capacity`` is the number of blocks the tier can hold; policies that keep history (ARC's
      ghost lists) bound it by ``capacity``. The policy never evicts on its own: only
      :meth:`evict` removes keys, so a tier may briefly hold more than ``capacity`` keys if it
      chooses to.
    - :meth:`insert` adds a key that is absent; inserting a present key raises ``KeyError``.
    - :meth:`insert_many` and :meth:`set_evictable_many` are the batch forms of :meth:`insert`
      and :meth:`set_evictable` (the same result as one call per key, in order); each checks
      every key before it changes anything. :meth:`insert_new` is :meth:`insert_many` for a
      caller that has checked the keys itself. A manager calls them once per protocol call, so a
      policy that overrides them saves a Python call per key; the defaults loop.
      :meth:`pin_evictable` is :meth:`set_evictable_many` (``False``) for a caller that knows
      the keys are held and evictable.
    - :meth:`touch` marks keys as used, the *first* key of the list ending most recent (a
      prefix's first block is the most valuable). Absent keys are ignored.
    - :meth:`refresh` makes keys recent without counting a use (a request's own new blocks at
      its end: a store is not a reuse), in the same order as :meth:`touch`. A policy that
      counts uses (ARC's T1 -> T2, a frequency count) leaves them uncounted: in a recency
      policy, refreshing a key never used since its insert leaves the policy as if that key
      had been inserted last. The default calls :meth:`touch` (right for a policy that counts
      no uses, such as LRU); a policy that counts uses overrides it.
    - :meth:`note_misses` tells the policy which absent keys are about to be inserted, before
      the eviction that makes room for them (a policy that learns from misses, as vLLM's ARC
      from a ghost hit, adapts there); the default does nothing.
    - :meth:`note_request` gives the policy a request's keys, in prefix order, before the
      request's touches and stores (a policy that learns from requests, such as ``chain``,
      classes the request there); the default does nothing. A caller that does not know
      requests never calls it, and every policy must work without it;
      :meth:`note_finished_request` is its form for a caller that learns a request only when it
      ends. A policy told a request may rank the blocks the request stores in its own order
      (``chain`` ranks them deepest oldest: a block is of no use without those before it);
      stores of no noted request keep :meth:`insert_many`'s order. Both take an optional
      *hint*, ``continues``: ``True`` if the caller expects a later request to continue this
      one (an open chat session), ``False`` if it expects none to (a one-off call, a session
      closed), ``None`` (the default) if it does not know. A hint only ranks; a wrong one may
      cost hits but never changes which keys are held or evictable. Callers pass it only when
      it is not ``None``, so a policy that ignores hints may leave it out of its signature
      (:func:`takes_hints`); one that declares it accepts ``None`` and both ``bool`` values
      and raises :class:`~tiering.errors.InvalidArgumentError` for anything else.
    - :meth:`evict` is all or nothing: it returns exactly ``n`` victims, removed from the
      policy, or ``None`` with no state changed. It never returns a non-evictable key nor one
      in ``protected``. Its cost per victim does not grow with the number of pinned keys, and
      no call pays at once for pinned keys that piled up at the oldest end.
    - :attr:`rule` names the victim rule followed now, one of :attr:`rules`;
      :attr:`rule_switches` counts its changes. A policy of one rule (LRU, ARC) names itself
      and never switches; an adaptive one (``hybrid``) names the rule it follows at the moment.
      Metrics read them from another thread: each is an attribute read, nothing more.
    - :attr:`hints_followed` counts the hinted requests whose hint the policy followed (ranked
      the request as the hint says), so that an operator sees whether a hint source is
      followed: a counter, never smaller, kept through :meth:`clear`, read as
      :attr:`rule_switches` is. ``None`` (the default) for a policy that does not follow hints
      (LRU, ARC, ``hybrid``); one that follows them only while they prove right (``chain``)
      counts only those it followed.
    - No method blocks or does I/O; none is thread-safe.
    """

    #: The name the policy is registered under (``"lru"``, ``"arc"``).
    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity

    @property
    def rule(self) -> str:
        """The victim rule followed now, one of :attr:`rules` (the default: the policy's
        name)."""
        return getattr(self, "name", type(self).__name__)

    @property
    def rules(self) -> tuple[str, ...]:
        """Every rule :attr:`rule` may name (a metric reports each: 1 for the one followed)."""
        return (self.rule,)

    @property
    def rule_switches(self) -> int:
        """How many times :attr:`rule` changed since the policy was built (a counter: kept
        through :meth:`clear`). The default: 0."""
        return 0

    @property
    def hints_followed(self) -> int | None:
        """How many hinted requests (:meth:`note_request`, :meth:`note_finished_request`) the
        policy followed the hint of (a counter: kept through :meth:`clear`), or ``None`` (the
        default) if it does not follow hints."""
        return None

    @abstractmethod
    def __len__(self) -> int:
        """The number of keys held (ghost entries excluded)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is held (ghost entries excluded)."""

    @abstractmethod
    def __iter__(self) -> Iterator[bytes]:
        """The held keys, from the first to be evicted to the last (pinned ones included)."""

    @abstractmethod
    def insert(self, key: bytes, evictable: bool = True) -> None:
        """Add an absent ``key`` as the most recently used. Raises ``KeyError`` if present."""

    def insert_many(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        """:meth:`insert` each key in order (the last ends most recent). Raises KeyError naming
        the first key that is present or listed twice, InvalidKeyError for one that is not
        ``bytes``; either way before inserting any."""
        listed: set[bytes] = set()
        for key in keys:
            check_insert_key(key)
            if key in self or key in listed:
                raise KeyError(key)
            listed.add(key)
        for key in keys:
            self.insert(key, evictable)

    def insert_new(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        """:meth:`insert_many` of keys the caller guarantees are ``bytes``, absent and listed
        once (a manager's or tier's own reservation, checked where it was made): a policy may
        skip :meth:`insert_many`'s checks. The default makes them anyway."""
        self.insert_many(keys, evictable)

    @abstractmethod
    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` as used; ``keys[0]`` ends most recent. Absent keys are ignored."""

    def refresh(self, keys: Sequence[bytes]) -> None:
        """Make ``keys`` recent without counting a use; ``keys[0]`` ends most recent. Absent
        keys (ghosts included) are ignored. The default is :meth:`touch`: a policy whose touch
        counts a use must override it."""
        self.touch(keys)

    def note_misses(self, keys: Sequence[bytes]) -> None:
        """``keys``, absent, are about to be inserted once room is made for them: the managers
        call this before :meth:`evict` (and may then fail to make room, so an insert need not
        follow). Changes no held key and evicts nothing. The default does nothing."""
        return

    def note_request(self, keys: Sequence[bytes], continues: bool | None = None) -> None:
        """The keys of one request, in prefix order (held, absent or ghosts alike), before its
        :meth:`touch` and :meth:`insert_new` calls; at most once per request; ``continues``:
        the caller's hint (see the class docstring). Changes no held key's order or
        evictability and evicts nothing. The default checks the hint and does nothing."""
        if continues is not None:
            check_hint(continues)

    def note_finished_request(self, keys: Sequence[bytes], continues: bool | None = None) -> None:
        """:meth:`note_request` from a caller that knows a request whole only when it ends
        (vLLM's connector), after its stores: once per request, instead of
        :meth:`note_request`. May move the request's keys between a policy's lists (keeping
        their evictability) and evicts nothing. The default checks the hint and does nothing."""
        if continues is not None:
            check_hint(continues)

    @abstractmethod
    def set_evictable(self, key: bytes, evictable: bool) -> None:
        """Allow or forbid evicting a held ``key``. Raises ``KeyError`` if absent."""

    def set_evictable_many(self, keys: Sequence[bytes], evictable: bool) -> None:
        """:meth:`set_evictable` for each key. Raises KeyError naming the first absent key,
        having changed none."""
        for key in keys:
            if key not in self:
                raise KeyError(key)
        for key in keys:
            self.set_evictable(key, evictable)

    def pin_evictable(self, keys: Sequence[bytes]) -> None:
        """``set_evictable_many(keys, False)`` of keys the caller guarantees are held,
        evictable and listed once (a manager that counts its loads' pins itself, pinning a
        ready key no load holds): a policy may skip looking each one up. The default makes the
        checked call."""
        self.set_evictable_many(keys, False)

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget ``key`` without recording history (a failed store). Absent keys are ignored."""

    @abstractmethod
    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        """Remove and return ``n`` evictable keys not in ``protected``, or ``None`` (no change)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and all history (ghosts, adaptive targets)."""


def check_hint(continues: object) -> None:
    """Raise :class:`~tiering.errors.InvalidArgumentError` unless ``continues`` is a hint:
    ``None``, ``True`` or ``False``."""
    if continues is not None and type(continues) is not bool:
        raise InvalidArgumentError(
            f"continues must be True, False or None (not known), got {continues!r:.80}"
        )


def takes_hints(policy: EvictionPolicy) -> bool:
    """Whether ``policy``'s :meth:`~EvictionPolicy.note_request` and
    :meth:`~EvictionPolicy.note_finished_request` take the ``continues`` hint (a plugin written
    before hints existed may not: a manager then keeps them from it)."""
    cls = type(policy)
    return _takes(cls.note_request) and _takes(cls.note_finished_request)


@functools.lru_cache(maxsize=64)
def _takes(method: object) -> bool:
    try:
        parameters = inspect.signature(method).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):  # no signature to read (a builtin): keep hints from it
        return False
    return "continues" in parameters or any(
        parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters.values()
    )


def tell_request(
    policy: EvictionPolicy,
    keys: Sequence[bytes],
    *,
    ended: bool = False,
    continues: bool | None = None,
) -> None:
    """Tell ``policy`` a request, as a manager does: :meth:`~EvictionPolicy.note_request`, or
    with ``ended`` :meth:`~EvictionPolicy.note_finished_request`; the hint checked first (an
    :class:`~tiering.errors.InvalidArgumentError` changes nothing) and passed only if given
    and the policy takes hints."""
    check_hint(continues)
    note = policy.note_finished_request if ended else policy.note_request
    if continues is None or not takes_hints(policy):
        note(keys)
    else:
        note(keys, continues=continues)
