"""Offline cache simulations: Belady's MIN bound, a reference LRU, and any eviction policy.

The model is a cache of unit-size items (block keys: ``bytes``, ints, any hashable) driven one
access at a time. An access to a held item is a *hit*; a miss inserts the item, first evicting
one item if the cache is full (demand paging). These functions are references for studies and
tests, independent of the tiered manager: ``tiering replay`` compares its own counters with them.

Belady's MIN
    On a miss with a full cache, evict the held item whose next use is furthest in the future
    (never used again counts as furthest). Among demand-paging policies MIN has the most hits
    on any sequence (Belady 1966; Mattson et al. 1970), so it bounds LRU, ARC and every policy
    in :mod:`tiering.policies` from above. ``bypass=True`` also lets a missed item *not* be
    inserted when its own next use is furthest: that is optimal for caches that may refuse an
    item (admission control) and can only have more hits.

    Cost: one backward pass computes every access's next use; the held items sit in a max-heap
    keyed by next use with lazy invalidation (an entry is stale once its next use has passed;
    the heap is compacted when stale entries outnumber live ones), so a run is O(n log n).

Requests looked up whole
    The manager (and :mod:`tiering.replay.study`, which drives policies as it does) looks a
    request's blocks up before it stores the missing ones, so a block the request stores
    cannot evict a block the same request then hits. With a cache smaller than a request that
    lets a policy beat MIN on the flattened accesses (capacity 1, requests ``[a, b]`` then
    ``[a, b, c]``: LRU keeps ``b`` and hits it, MIN on ``a b a b c`` hits nothing).
    :func:`belady_request_hits` bounds that model: a request hits the blocks held when it
    arrives; then, of the blocks held and the request's own, the cache keeps the ``capacity``
    blocks that a later request asks for soonest. Any policy's cache after a request is one of
    those choices (it may keep fewer of the request's blocks, never others), so by MIN's
    exchange argument no policy has more block hits; nor does MIN on the flattened accesses.
    On the realistic traces at 1-20 % of their unique blocks both give the same figures.

Prefix hits
    A request reads its blocks in prefix order, and a KV block is useless after the first
    missing block before it (the engine must recompute from there). For request-structured
    traces :func:`simulate` therefore also counts *prefix hits*: per request, the number of
    leading blocks that hit. MIN maximizes block hits, **not** prefix hits: another policy can
    have more prefix hits than MIN on the same trace. The valid upper bound on any
    demand-paging policy's prefix hits is MIN's *block* hits (prefix hits <= block hits <=
    MIN's block hits).
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass

from tiering.errors import ConfigurationError
from tiering.policies.base import EvictionPolicy
from tiering.policies.registry import available_policies, get_policy_class

__all__ = [
    "REFERENCE_POLICIES",
    "PolicyFactory",
    "Stats",
    "belady_hits",
    "belady_request_hits",
    "lru_hits",
    "simulate",
]

#: Names :func:`simulate` implements itself; every other name is looked up in
#: :mod:`tiering.policies`.
REFERENCE_POLICIES = ("lru", "belady", "belady-bypass")

#: Makes a fresh policy for a capacity in blocks (a policy class is one).
PolicyFactory = Callable[[int], EvictionPolicy]

# Below this heap size, stale entries are not worth a compaction pass.
_MIN_HEAP_TO_COMPACT = 1024


@dataclass(frozen=True)
class Stats:
    """Counters of one simulated run over a request-structured trace."""

    policy: str
    capacity_blocks: int
    requests: int
    block_accesses: int
    block_hits: int
    prefix_hit_blocks: int
    """Per request, the leading blocks that hit, summed over requests."""
    unique_blocks: int
    """Distinct keys in the trace: each costs one compulsory miss."""

    @property
    def block_misses(self) -> int:
        return self.block_accesses - self.block_hits

    @property
    def block_hit_ratio(self) -> float:
        return self.block_hits / self.block_accesses if self.block_accesses else 0.0

    @property
    def prefix_hit_ratio(self) -> float:
        """Prefix hits per block access: the fraction of prompt blocks an engine could skip."""
        return self.prefix_hit_blocks / self.block_accesses if self.block_accesses else 0.0

    @property
    def max_block_hits(self) -> int:
        """Hits of an unbounded cache: every access but the first to each key."""
        return self.block_accesses - self.unique_blocks


def lru_hits(accesses: Sequence[Hashable], capacity: int) -> int:
    """Hits of least-recently-used on ``accesses`` with room for ``capacity`` items.

    A plain ``OrderedDict`` implementation, independent of :class:`tiering.policies.LRUPolicy`.
    """
    _check_capacity(capacity)
    return sum(_lru_hit_flags(accesses, capacity))


def belady_hits(accesses: Sequence[Hashable], capacity: int, *, bypass: bool = False) -> int:
    """Hits of Belady's MIN on ``accesses`` with room for ``capacity`` items.

    The most hits any demand-paging policy can get; with ``bypass=True``, the most any policy
    that may also decline to insert a missed item can get. O(n log n).
    """
    _check_capacity(capacity)
    return sum(_belady_hit_flags(accesses, capacity, bypass))


def simulate(
    policy: str | PolicyFactory,
    requests: Iterable[Sequence[Hashable]],
    capacity: int,
) -> Stats:
    """Run ``policy`` over the flattened block accesses of ``requests``; count hits.

    ``requests`` holds one sequence of block keys per request, in prefix order (a request's
    hash-block or offload keys). ``policy`` is ``"lru"`` (the reference LRU of
    :func:`lru_hits`), ``"belady"`` / ``"belady-bypass"`` (MIN on the flattened sequence, see
    the module docstring for what it bounds), the name of a policy in
    :mod:`tiering.policies` (``"arc"``, a registered name, or ``"module:Class"``), or a
    callable returning a fresh :class:`EvictionPolicy` for a capacity (e.g.
    ``tiering.policies.LRUPolicy`` to drive the project's own LRU).

    A policy is driven access by access: a held key is touched; a missing key makes the cache
    evict one key if it holds ``capacity`` keys, then it is inserted. Policies need ``bytes``
    keys; if any key is not ``bytes``, every key is mapped to a distinct ``bytes`` key first.

    Raises :class:`ConfigurationError` for an unknown policy name or a bad capacity.
    """
    _check_capacity(capacity)
    label, run = _resolve(policy)
    key_lists = [list(keys) for keys in requests]
    accesses: list[Hashable] = [key for keys in key_lists for key in keys]
    flags = run(accesses, capacity)
    prefix_hits = 0
    start = 0
    for keys in key_lists:
        end = start + len(keys)
        position = start
        while position < end and flags[position]:
            position += 1
        prefix_hits += position - start
        start = end
    return Stats(
        policy=label,
        capacity_blocks=capacity,
        requests=len(key_lists),
        block_accesses=len(accesses),
        block_hits=sum(flags),
        prefix_hit_blocks=prefix_hits,
        unique_blocks=len(set(accesses)),
    )


# -- the simulations: each returns one hit flag (0/1) per access -------------------------------

_HitFlags = Callable[[Sequence[Hashable], int], bytearray]


def _lru_hit_flags(accesses: Sequence[Hashable], capacity: int) -> bytearray:
    flags = bytearray(len(accesses))
    if capacity == 0:
        return flags
    cache: OrderedDict[Hashable, None] = OrderedDict()
    move_to_end, popitem = cache.move_to_end, cache.popitem
    for i, key in enumerate(accesses):
        if key in cache:
            move_to_end(key)
            flags[i] = 1
        else:
            if len(cache) >= capacity:
                popitem(last=False)
            cache[key] = None
    return flags


def _next_uses(accesses: Sequence[Hashable]) -> list[int]:
    """Per access ``i``, the index of the next access to the same key, else ``n + i``.

    The "never again" values are distinct and beyond every real index, so they rank as the
    furthest uses and no two heap entries ever tie (the keys themselves are never compared,
    which lets keys of mixed types share a heap).
    """
    n = len(accesses)
    next_use = [0] * n
    seen: dict[Hashable, int] = {}
    for i in range(n - 1, -1, -1):
        key = accesses[i]
        next_use[i] = seen.get(key, n + i)
        seen[key] = i
    return next_use


def _belady_hit_flags(accesses: Sequence[Hashable], capacity: int, bypass: bool) -> bytearray:
    n = len(accesses)
    flags = bytearray(n)
    if capacity == 0:
        return flags
    next_use = _next_uses(accesses)
    held: set[Hashable] = set()
    # Entries (-next_use, key). An entry is live iff its next use is still ahead (> i): when a
    # key is used again at i, the entry that pointed at i goes stale and a new one is pushed;
    # when a key is evicted, its only live entry is the one popped.
    heap: list[tuple[int, Hashable]] = []
    push, pop = heapq.heappush, heapq.heappop
    for i, key in enumerate(accesses):
        if len(heap) > _MIN_HEAP_TO_COMPACT and len(heap) > 2 * len(held):
            heap = [entry for entry in heap if -entry[0] >= i]  # live: next use not passed
            heapq.heapify(heap)
        use = next_use[i]
        if key in held:
            flags[i] = 1
        else:
            if len(held) >= capacity:
                while -heap[0][0] <= i:  # drop stale entries down to the live furthest use
                    pop(heap)
                if bypass and use > -heap[0][0]:
                    continue  # the missed key is needed last of all: do not cache it
                held.remove(pop(heap)[1])
            held.add(key)
        push(heap, (-use, key))
    return flags


def belady_request_hits(key_lists: Sequence[Sequence[Hashable]], capacity: int) -> int:
    """MIN's block hits when each request is looked up whole before its misses are stored
    (see the module docstring)."""
    _check_capacity(capacity)
    return sum(_belady_request_hit_flags(key_lists, capacity))


def _belady_request_hit_flags(key_lists: Sequence[Sequence[Hashable]], capacity: int) -> bytearray:
    return RequestMIN(key_lists).hit_flags(capacity)


class RequestMIN:
    """MIN over requests (:func:`belady_request_hits`) for any capacity of one trace.

    What does not depend on the capacity is computed once, in arrays of 8 bytes per access
    (lists of Python ints would take 36): each access's next use and the request of that next
    use. A study of five capacities runs it once instead of five times.
    """

    __slots__ = ("_flat", "_key_lists", "_next_request", "_next_use")

    def __init__(self, key_lists: Sequence[Sequence[Hashable]]) -> None:
        self._key_lists = key_lists
        flat = [key for keys in key_lists for key in keys]
        n = len(flat)
        never = len(key_lists)  # beyond every request: "never again", distinct by position
        next_use = array("q", bytes(8 * n))
        next_request = array("q", bytes(8 * n))
        seen: dict[Hashable, int] = {}  # key -> its next access, as request * n + position
        i = n
        for r in range(len(key_lists) - 1, -1, -1):
            for _ in key_lists[r]:
                i -= 1
                key = flat[i]
                later = seen.get(key)
                if later is None:
                    next_use[i] = n + i
                    next_request[i] = never + i
                else:
                    next_request[i], next_use[i] = divmod(later, n)
                seen[key] = r * n + i
        self._flat = flat
        self._next_use = next_use
        self._next_request = next_request

    def hit_flags(self, capacity: int) -> bytearray:
        """One flag per access: held when its request looked the cache up."""
        flat, next_use, next_request = self._flat, self._next_use, self._next_request
        flags = bytearray(len(flat))
        if capacity == 0:
            return flags
        held: set[Hashable] = set()
        # Entries (-next request using the key, -next position, key): the position breaks
        # ties, so keys are never compared. A key's entry is live iff its next request lies
        # after the current one; every held key has exactly one live entry (pushed at its
        # last access).
        heap: list[tuple[int, int, Hashable]] = []
        push, pop = heapq.heappush, heapq.heappop
        start = 0
        for r, keys in enumerate(self._key_lists):
            end = start + len(keys)
            if len(heap) > _MIN_HEAP_TO_COMPACT and len(heap) > 2 * len(held):
                heap = [entry for entry in heap if -entry[0] >= r]
                heapq.heapify(heap)
            for i in range(start, end):  # the request finds the cache as the last one left it
                if flat[i] in held:
                    flags[i] = 1
            for i in range(start, end):
                held.add(flat[i])
                # Ties (one later request): the deeper block goes first, as a prefix wants.
                push(heap, (-next_request[i], -next_use[i], flat[i]))
            while len(held) > capacity:  # keep the blocks asked for soonest
                entry = pop(heap)
                if -entry[0] > r:
                    held.remove(entry[2])
            start = end
        return flags


def _policy_hit_flags(factory: PolicyFactory) -> _HitFlags:
    def run(accesses: Sequence[Hashable], capacity: int) -> bytearray:
        flags = bytearray(len(accesses))
        if capacity == 0:
            return flags
        cache = factory(capacity)
        if not isinstance(cache, EvictionPolicy):
            raise ConfigurationError(
                f"the policy factory returned {type(cache).__name__}, not an EvictionPolicy"
            )
        keys = _as_bytes_keys(accesses)
        contains, touch, insert, evict = cache.__contains__, cache.touch, cache.insert, cache.evict
        for i, key in enumerate(keys):
            if contains(key):
                touch([key])
                flags[i] = 1
                continue
            if len(cache) >= capacity and evict(1) is None:
                raise RuntimeError(
                    f"policy {type(cache).__name__} refused to evict from a full cache of "
                    f"{len(cache)} keys, none of them pinned"
                )
            insert(key)
        return flags

    return run


def _as_bytes_keys(accesses: Sequence[Hashable]) -> Sequence[bytes]:
    if all(type(key) is bytes for key in accesses):
        return accesses  # type: ignore[return-value]
    ids: dict[Hashable, bytes] = {}
    return [ids.setdefault(key, len(ids).to_bytes(8, "little")) for key in accesses]


def _resolve(policy: str | PolicyFactory) -> tuple[str, _HitFlags]:
    if isinstance(policy, str):
        name = policy.strip().lower()
        if name == "lru":
            return "lru", _lru_hit_flags
        if name == "belady":
            return "belady", lambda accesses, cap: _belady_hit_flags(accesses, cap, False)
        if name == "belady-bypass":
            return "belady-bypass", lambda accesses, cap: _belady_hit_flags(accesses, cap, True)
        try:
            policy_class = get_policy_class(policy)
        except ConfigurationError:
            raise ConfigurationError(
                f"unknown policy {policy!r} for simulate; valid: "
                f"{', '.join(REFERENCE_POLICIES)}, a registered eviction policy "
                f"({', '.join(available_policies())}) or a 'module:Class' path"
            ) from None
        return policy, _policy_hit_flags(policy_class)
    if isinstance(policy, EvictionPolicy) or not callable(policy):
        raise ConfigurationError(
            f"policy must be a name or a callable that makes a fresh EvictionPolicy for a "
            f"capacity (e.g. a policy class), got {type(policy).__name__}"
        )
    label = getattr(policy, "name", None) or getattr(policy, "__name__", None) or repr(policy)
    return str(label), _policy_hit_flags(policy)


def _check_capacity(capacity: object) -> None:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
        raise ConfigurationError(f"capacity (blocks) must be an int >= 0, got {capacity!r}")
