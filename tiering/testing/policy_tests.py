"""``PolicyTests``: the conformance suite for :class:`~tiering.policies.base.EvictionPolicy`
implementations, shipped in the package so that plugin authors can run it on their own policies.

How to use it
-------------
Subclass it in a test module (the class name must start with ``Test``) and override the
``policy_factory`` fixture, which returns a callable ``capacity -> policy``::

    import pytest

    from tiering.testing import PolicyTests
    from tiering.testing.policy_tests import PolicyFactory
    from mypkg import MyPolicy


    class TestMyPolicy(PolicyTests):
        recency_ordered = False  # True only if victims come out in LRU order

        @pytest.fixture
        def policy_factory(self) -> PolicyFactory:
            return MyPolicy

What it checks (the contract in :mod:`tiering.policies.base`): container behaviour (``len``,
``in``, iteration), ``KeyError`` on a duplicate insert with no state changed, the batch forms
(``insert_many``, ``set_evictable_many``) equal to their one-key calls and checking every key
before changing anything, typed errors for bad keys and counts, ``touch`` and ``refresh``
order (a refresh is not a use), pinned (non-evictable) and protected keys never evicted,
all-or-nothing ``evict``, ``remove`` and ``clear``, and that evicting past thousands of pinned
keys is not a scan. Requires pytest.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection
from typing import Any, ClassVar

import pytest

from tiering.errors import InvalidKeyError
from tiering.policies.base import EvictionPolicy

__all__ = ["PolicyFactory", "PolicyTests", "evict_one_by_one", "fill", "policy_key", "policy_state"]

#: What the ``policy_factory`` fixture returns: a new policy of the given capacity.
PolicyFactory = Callable[[int], EvictionPolicy]


class _Enough(Exception):
    """Raised by :func:`python_steps`'s tracer once the limit is passed."""


def python_steps(work: Callable[[], object], limit: int) -> int:
    """How many lines of Python ``work()`` runs (``sys.settrace``), counting up to ``limit``
    and stopping ``work`` just past it: a measure of work that no clock, and so no busy
    machine, can stretch."""
    steps = 0

    def local(frame: Any, event: str, arg: Any) -> Any:
        nonlocal steps
        if event == "line":
            steps += 1
            if steps > limit:
                raise _Enough
        return local

    def calls(frame: Any, event: str, arg: Any) -> Any:
        return local

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        work()
    except _Enough:
        pass
    finally:
        sys.settrace(previous)
    return steps


def policy_key(i: int) -> bytes:
    """The ``i``-th test key (sorts like ``i``)."""
    return b"key-%05d" % i


def fill(policy: EvictionPolicy, count: int) -> list[bytes]:
    """Insert keys ``0..count-1`` in order; return them."""
    keys = [policy_key(i) for i in range(count)]
    for key in keys:
        policy.insert(key)
    return keys


def policy_state(policy: EvictionPolicy) -> dict[str, Any]:
    """Everything observable about a policy, including ARC-style history when it exposes it."""
    state: dict[str, Any] = {"order": list(policy), "len": len(policy)}
    for name in ("target_t1_size", "t1_keys", "t2_keys", "b1_keys", "b2_keys"):
        if hasattr(policy, name):
            state[name] = getattr(policy, name)
    return state


def evict_one_by_one(policy: EvictionPolicy) -> list[bytes]:
    """Evict single victims until the policy refuses; return them in order."""
    victims = []
    while (got := policy.evict(1)) is not None:
        victims += got
    return victims


class PolicyTests:
    """Conformance suite for :class:`EvictionPolicy` implementations (see the module docstring).

    Subclass it and override the ``policy_factory`` fixture (``capacity -> policy``). Tests of
    exact victim order assume a recency policy (LRU-like until keys are touched twice); a policy
    that orders keys otherwise sets ``recency_ordered = False`` to skip them.
    """

    recency_ordered: ClassVar[bool] = True

    @pytest.fixture
    def policy_factory(self) -> PolicyFactory:
        raise NotImplementedError("override the policy_factory fixture")

    def _need_recency(self) -> None:
        if not self.recency_ordered:
            pytest.skip("exact-order test for recency policies")

    # -- basic container behaviour --------------------------------------------------------

    def test_empty(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        assert len(policy) == 0
        assert list(policy) == []
        assert policy_key(0) not in policy
        assert policy.evict(1) is None
        assert policy.evict(0) == []

    def test_insert_contains_len_iter(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(8)
        keys = fill(policy, 5)
        assert len(policy) == 5
        assert sorted(policy) == keys
        assert all(key in policy for key in keys)
        assert policy_key(99) not in policy
        assert "not bytes" not in policy

    def test_insert_order_is_eviction_order(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(8)
        keys = fill(policy, 5)
        assert list(policy) == keys
        assert evict_one_by_one(policy) == keys

    def test_may_hold_more_than_capacity(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(2)
        keys = fill(policy, 5)
        assert sorted(policy) == keys  # only evict() removes keys

    def test_duplicate_insert_raises_key_error_and_changes_nothing(
        self, policy_factory: PolicyFactory
    ) -> None:
        policy = policy_factory(4)
        fill(policy, 3)
        before = policy_state(policy)
        with pytest.raises(KeyError, match="key-00001"):
            policy.insert(policy_key(1))
        with pytest.raises(KeyError, match="key-00001"):
            policy.insert(policy_key(1), evictable=False)
        assert policy_state(policy) == before
        assert policy.evict(3) is not None  # policy_key(1) stayed evictable

    @pytest.mark.parametrize("bad_key", ["key", bytearray(b"key"), 7, None, memoryview(b"k")])
    def test_insert_rejects_non_bytes_key(
        self, policy_factory: PolicyFactory, bad_key: object
    ) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        before = policy_state(policy)
        with pytest.raises(InvalidKeyError, match="must be bytes"):
            policy.insert(bad_key)  # type: ignore[arg-type]
        assert policy_state(policy) == before

    def test_touch_rejects_a_single_key(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        before = policy_state(policy)
        with pytest.raises(InvalidKeyError, match="sequence of keys"):
            policy.touch(policy_key(0))  # type: ignore[arg-type]
        assert policy_state(policy) == before

    @pytest.mark.parametrize("bad_n", [-1, 1.0, True, "1"])
    def test_evict_rejects_bad_count(self, policy_factory: PolicyFactory, bad_n: object) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        with pytest.raises(ValueError, match="number of victims"):
            policy.evict(bad_n)  # type: ignore[arg-type]
        assert len(policy) == 2

    def test_negative_capacity_rejected(self, policy_factory: PolicyFactory) -> None:
        with pytest.raises(ValueError, match="capacity"):
            policy_factory(-1)

    # -- batch forms ------------------------------------------------------------------------

    def _history(self, policy: EvictionPolicy) -> list[bytes]:
        """A policy with evictions, touches and a pin behind it (ARC: ghosts in B1 and B2).

        Returns the three victims (LRU, ARC: the first three keys filled), then the held keys
        in fill order; the first held one (LRU, ARC: ``keys[3]``) is pinned."""
        keys = fill(policy, 6)
        policy.touch([keys[4], keys[5]])
        victims = policy.evict(3)
        assert victims is not None and len(victims) == 3
        keys = [*victims, *(key for key in keys if key not in victims)]
        policy.set_evictable(keys[3], False)
        return keys

    @pytest.mark.parametrize("evictable", [True, False])
    def test_insert_many_is_insert_one_by_one(
        self, policy_factory: PolicyFactory, evictable: bool
    ) -> None:
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        batch = [keys[0], policy_key(10), keys[1], policy_key(11), keys[2], policy_key(12)]
        policy.insert_many(batch, evictable)
        for key in batch:
            twin.insert(key, evictable)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)
        assert policy_state(policy) == policy_state(twin)

    @pytest.mark.parametrize("evictable", [True, False])
    def test_insert_new_is_insert_many(
        self, policy_factory: PolicyFactory, evictable: bool
    ) -> None:
        """``insert_new`` (keys the caller checked: absent, once each) does what
        ``insert_many`` does with the same keys, ghosts and adaptation included."""
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        batch = [keys[0], policy_key(10), keys[1], policy_key(11), keys[2], policy_key(12)]
        policy.insert_new(batch, evictable)
        twin.insert_many(batch, evictable)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)
        assert policy_state(policy) == policy_state(twin)

    @pytest.mark.parametrize(
        ("batch", "error", "match"),
        [
            # Ints are indexes into _history's keys (4: held; 3: held, pinned).
            ([policy_key(10), 4], KeyError, 4),  # present
            ([policy_key(10), 3], KeyError, 3),  # present, pinned
            ([policy_key(10), policy_key(11), policy_key(10)], KeyError, "key-00010"),  # twice
            ([policy_key(10), "key"], InvalidKeyError, "must be bytes"),
        ],
    )
    def test_insert_many_checks_every_key_before_inserting_any(
        self,
        policy_factory: PolicyFactory,
        batch: list[object],
        error: type[Exception],
        match: str | int,
    ) -> None:
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        listed = [keys[item] if isinstance(item, int) else item for item in batch]
        if isinstance(match, int):
            match = keys[match].decode()
        with pytest.raises(error, match=match):
            policy.insert_many(listed)  # type: ignore[arg-type]
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)

    @pytest.mark.parametrize("evictable", [True, False])
    def test_set_evictable_many_is_set_evictable_one_by_one(
        self, policy_factory: PolicyFactory, evictable: bool
    ) -> None:
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        batch = [key for key in keys if key in policy]  # pinned and evictable ones
        policy.set_evictable_many(batch, evictable)
        for key in batch:
            twin.set_evictable(key, evictable)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)

    def test_pin_evictable_is_set_evictable_many_false(self, policy_factory: PolicyFactory) -> None:
        """The unchecked pin (held, evictable keys, once each), then letting them go, leaves
        the policy as the checked calls do."""
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        batch = [key for key in keys if key in policy and key != keys[3]]  # keys[3] is pinned
        policy.pin_evictable(batch)
        twin.set_evictable_many(batch, False)
        assert policy_state(policy) == policy_state(twin)
        assert policy.evict(1) is None and twin.evict(1) is None  # every held key is pinned
        policy.set_evictable_many(batch[::-1], True)
        twin.set_evictable_many(batch[::-1], True)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)

    @pytest.mark.parametrize("evictable", [True, False])
    def test_set_evictable_many_with_an_absent_key_changes_nothing(
        self, policy_factory: PolicyFactory, evictable: bool
    ) -> None:
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._history(policy)
        self._history(twin)
        batch = [key for key in keys if key in policy] + [policy_key(99)]
        with pytest.raises(KeyError, match="key-00099"):
            policy.set_evictable_many(batch, evictable)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)
        assert policy_state(policy) == policy_state(twin)

    # -- touch ------------------------------------------------------------------------------

    def test_touch_first_key_ends_most_recent(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(8)
        a, b, c = fill(policy, 3)
        policy.touch([a, b, c])
        assert evict_one_by_one(policy) == [c, b, a]

    def test_touch_order_exact(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(8)
        keys = fill(policy, 6)
        policy.touch([keys[1], policy_key(77), keys[3], keys[0]])  # an absent key is ignored
        expected = [keys[2], keys[4], keys[5], keys[0], keys[3], keys[1]]
        assert list(policy) == expected
        assert policy.evict(6) == expected

    def test_touch_absent_keys_is_a_no_op(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        fill(policy, 3)
        before = policy_state(policy)
        policy.touch([policy_key(50), policy_key(51)])
        policy.touch([])
        assert policy_state(policy) == before

    # -- refresh (recency without a use) -----------------------------------------------------

    def test_refresh_order_exact(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(8)
        keys = fill(policy, 6)
        policy.refresh([keys[1], policy_key(77), keys[3], keys[0]])  # an absent key is ignored
        expected = [keys[2], keys[4], keys[5], keys[0], keys[3], keys[1]]
        assert list(policy) == expected
        assert policy.evict(6) == expected

    def test_refresh_is_not_a_use(self, policy_factory: PolicyFactory) -> None:
        """Refreshing keys never used since their insert leaves a recency policy as if they had
        been inserted last, in refresh order (``keys[0]`` last): no use is counted."""
        self._need_recency()
        policy, twin = policy_factory(6), policy_factory(6)
        keys = fill(policy, 6)
        policy.refresh([keys[1], keys[4]])
        for i in (0, 2, 3, 5, 4, 1):
            twin.insert(keys[i])
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)

    def test_refresh_after_history_is_not_a_use(self, policy_factory: PolicyFactory) -> None:
        """The same with ghosts and a pin behind it: new keys refreshed, then evicted, come out
        as keys inserted in that order would."""
        self._need_recency()
        policy, twin = policy_factory(6), policy_factory(6)
        self._history(policy)
        self._history(twin)
        new = [policy_key(10), policy_key(11), policy_key(12)]
        policy.insert_many(new)
        policy.refresh([new[0], new[1]])
        twin.insert_many([new[2], new[1], new[0]])
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)

    def test_refresh_absent_keys_is_a_no_op(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        keys = fill(policy, 4)
        policy.touch([keys[3]])
        policy.evict(2)  # ghosts, for a policy that keeps them
        before = policy_state(policy)
        policy.refresh([keys[0], keys[1], policy_key(50)])
        policy.refresh([])
        assert policy_state(policy) == before

    def test_refresh_rejects_a_single_key(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        before = policy_state(policy)
        with pytest.raises(InvalidKeyError, match="sequence of keys"):
            policy.refresh(policy_key(0))  # type: ignore[arg-type]
        assert policy_state(policy) == before

    # -- pinned and protected keys ----------------------------------------------------------

    def test_pinned_keys_never_evicted(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(8)
        keys = fill(policy, 6)
        policy.set_evictable(keys[0], False)
        policy.set_evictable(keys[2], False)
        policy.insert(policy_key(6), evictable=False)
        victims = policy.evict(4)
        assert victims is not None
        if self.recency_ordered:
            assert victims == [keys[1], keys[3], keys[4], keys[5]]
        assert sorted(policy) == [keys[0], keys[2], policy_key(6)]
        assert policy.evict(1) is None
        policy.set_evictable(keys[2], True)
        assert policy.evict(1) == [keys[2]]

    def test_set_evictable_absent_raises_key_error(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        with pytest.raises(KeyError, match="key-00009"):
            policy.set_evictable(policy_key(9), False)
        with pytest.raises(KeyError, match="key-00009"):
            policy.set_evictable(policy_key(9), True)

    def test_set_evictable_is_idempotent(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        a, b = fill(policy, 2)
        policy.set_evictable(a, False)
        policy.set_evictable(a, False)
        policy.set_evictable(b, True)
        assert policy.evict(1) == [b]
        assert policy.evict(1) is None
        policy.set_evictable(a, True)
        policy.set_evictable(a, True)
        assert policy.evict(1) == [a]
        assert len(policy) == 0

    def test_unpinned_keys_keep_their_recency(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(16)
        keys = fill(policy, 8)
        for key in keys[:4]:
            policy.set_evictable(key, False)
        assert policy.evict(2) == [keys[4], keys[5]]  # the pinned keys were skipped
        policy.set_evictable(keys[2], True)
        policy.set_evictable(keys[0], True)
        policy.set_evictable(keys[2], False)  # pinned again: skipped again
        policy.set_evictable(keys[2], True)
        assert list(policy) == [keys[0], keys[1], keys[2], keys[3], keys[6], keys[7]]
        assert policy.evict(3) == [keys[0], keys[2], keys[6]]

    def test_touching_a_pinned_key_moves_it(self, policy_factory: PolicyFactory) -> None:
        self._need_recency()
        policy = policy_factory(16)
        keys = fill(policy, 4)
        policy.set_evictable(keys[0], False)
        assert policy.evict(1) == [keys[1]]
        policy.touch([keys[0]])
        policy.set_evictable(keys[0], True)
        assert evict_one_by_one(policy) == [keys[2], keys[3], keys[0]]

    def test_key_leaving_and_returning_keeps_its_latest_place(
        self, policy_factory: PolicyFactory
    ) -> None:
        self._need_recency()
        policy = policy_factory(16)
        keys = fill(policy, 6)
        policy.set_evictable(keys[0], False)
        assert policy.evict(1) == [keys[1]]  # keys[0] skipped while pinned
        policy.set_evictable(keys[0], True)
        policy.touch([keys[0]])  # now the most recent: keys[2..5], keys[0]
        for key in (keys[2], keys[3], keys[4], keys[5], keys[0]):
            policy.set_evictable(key, False)
        assert policy.evict(1) is None
        policy.set_evictable(keys[0], True)
        policy.set_evictable(keys[2], True)
        assert policy.evict(1) == [keys[2]]
        assert policy.evict(1) == [keys[0]]

    @pytest.mark.parametrize("as_type", [set, frozenset, list, tuple, dict.fromkeys])
    def test_protected_keys_never_evicted(
        self, policy_factory: PolicyFactory, as_type: Callable[[list[bytes]], Collection[bytes]]
    ) -> None:
        policy = policy_factory(8)
        keys = fill(policy, 6)
        protected = as_type([keys[0], keys[1], policy_key(99)])
        victims = policy.evict(3, protected)
        assert victims is not None
        if self.recency_ordered:
            assert victims == [keys[2], keys[3], keys[4]]
            assert list(policy) == [keys[0], keys[1], keys[5]]  # order kept
        assert keys[0] in policy and keys[1] in policy
        assert policy.evict(2, protected) is None
        assert policy.evict(1, protected) == [keys[5]]
        assert policy.evict(2) == [keys[0], keys[1]]

    def test_protected_rejects_a_single_key(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        fill(policy, 2)
        with pytest.raises(InvalidKeyError, match="collection of keys"):
            policy.evict(1, policy_key(0))  # type: ignore[arg-type]
        with pytest.raises(InvalidKeyError, match="collection of keys"):
            policy_factory(4).evict(0, policy_key(0))  # type: ignore[arg-type]
        assert len(policy) == 2

    # -- all or nothing ---------------------------------------------------------------------

    def _build_for_failure(self, policy: EvictionPolicy) -> list[bytes]:
        keys = fill(policy, 8)
        policy.touch([keys[5], keys[1]])
        policy.evict(1)
        policy.insert(policy_key(20))
        policy.touch([keys[6]])
        policy.set_evictable(keys[3], False)
        policy.insert(policy_key(21), evictable=False)
        return keys

    def test_failed_evict_changes_nothing(self, policy_factory: PolicyFactory) -> None:
        policy, twin = policy_factory(6), policy_factory(6)
        keys = self._build_for_failure(policy)
        self._build_for_failure(twin)
        before = policy_state(policy)
        available = len(policy) - 2  # two pinned keys
        protected = {keys[6], keys[1], policy_key(20)}
        assert policy.evict(available + 1) is None
        assert policy_state(policy) == before
        assert policy.evict(available - 2, protected) is None
        assert policy_state(policy) == before
        # Behaviour afterwards is the twin's, which never saw the failures.
        assert policy.evict(2, protected) == twin.evict(2, protected)
        assert policy_state(policy) == policy_state(twin)
        assert evict_one_by_one(policy) == evict_one_by_one(twin)
        assert policy_state(policy) == policy_state(twin)

    # -- remove and clear -------------------------------------------------------------------

    def test_remove(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(8)
        keys = fill(policy, 4)
        policy.set_evictable(keys[2], False)
        policy.remove(keys[1])
        policy.remove(keys[2])  # a pinned key can be removed
        policy.remove(policy_key(99))  # absent: ignored
        assert sorted(policy) == [keys[0], keys[3]]
        assert keys[1] not in policy and len(policy) == 2
        policy.insert(keys[2])  # removed keys can come back, evictable as asked
        assert sorted(policy.evict(3) or []) == [keys[0], keys[2], keys[3]]

    def test_clear(self, policy_factory: PolicyFactory) -> None:
        policy = policy_factory(4)
        keys = fill(policy, 6)
        policy.set_evictable(keys[0], False)
        policy.evict(2)
        policy.clear()
        assert len(policy) == 0 and list(policy) == []
        assert policy.evict(1) is None
        assert policy_state(policy) == policy_state(policy_factory(4))
        policy.insert(keys[0])  # no longer pinned, no longer present
        assert policy.evict(1) == [keys[0]]

    # -- cost -------------------------------------------------------------------------------

    def test_eviction_past_pinned_keys_is_not_a_scan(self, policy_factory: PolicyFactory) -> None:
        """20,000 keys, the oldest half pinned: 1,000 single-victim evictions cost about what
        they cost with nothing pinned, plus at most a few steps per pinned key.

        Cost is counted, not timed (a busy machine stretches time, not work): the lines of
        Python that run (``sys.settrace``). A policy that scans past the pinned keys runs
        10^7 more. (Work done in C, by a policy written in C, is not counted.)
        """
        count, pinned, victims = 20_000, 10_000, 1_000

        def evictions(n_pinned: int, limit: int) -> int:
            keys = [policy_key(i) for i in range(count)]
            policy = policy_factory(count)
            for i, key in enumerate(keys):
                policy.insert(key, evictable=i >= n_pinned)
            got: list[list[Any] | None] = []
            steps = python_steps(lambda: got.extend(policy.evict(1) for _ in range(victims)), limit)
            if self.recency_ordered and steps <= limit:
                assert got == [[key] for key in keys[n_pinned : n_pinned + victims]]
            return steps

        unpinned = evictions(0, 10**8)
        # Setting each pinned key aside once (a few lines per key) is fine; a scan past all of
        # them at every eviction is 1,000 times that.
        bound = 2 * unpinned + 10 * pinned
        steps = evictions(pinned, bound)
        assert steps <= bound, (
            f"{victims} evictions past {pinned} pinned keys ran more than {bound} lines of "
            f"Python ({unpinned} with nothing pinned): a scan past the pinned keys"
        )
