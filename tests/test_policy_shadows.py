"""Hybrid's sampled shadows: which rule leads, how it is scored, and that following it keeps
hybrid within 0.2 points of LRU and ARC where its own rule alone fell under them."""

from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant
from test_policies import ARCMachine, LRUMachine

from tiering.policies import ARCPolicy, EvictionPolicy, HybridPolicy, LRUPolicy
from tiering.policies._shadows import (
    HALF_LIFE_CAPACITIES,
    MAX_SAMPLE_BITS,
    MIN_LEAD,
    MIN_SHADOW_BLOCKS,
    RULES,
    LRUShadow,
    ShadowCache,
    ShadowDuel,
    sample_bits,
)
from tiering.replay.study import (
    capacities_for,
    run_study,
    simulate_cpu,
    study_trace_from_blocks,
)
from tiering.replay.workloads import workload_trace
from tiering.testing import PolicyTests
from tiering.testing.policy_tests import PolicyFactory


def k(i: int) -> bytes:
    return i.to_bytes(8, "little")


# -- ShadowDuel ------------------------------------------------------------------------------


def test_sample_bits_leave_each_shadow_its_minimum() -> None:
    m = MIN_SHADOW_BLOCKS
    sizes = (1, m, 2 * m - 1, 2 * m, 4 * m, 8 * m, 32 * m, 10**7)
    assert [sample_bits(c) for c in sizes] == [0, 0, 0, 1, 2, 3, 5, MAX_SAMPLE_BITS]


def _hot_keys_and_a_scan(duel: ShadowDuel, rounds: int) -> list[str]:
    """Four hot keys used twice, then one-off keys with a hot key touched between them: ARC
    keeps the hot keys in T2, LRU loses them to the scan. The leader after each round."""
    hot = [k(i) for i in range(4)]
    leaders = []
    for key in hot:
        duel.stored([key])
        duel.touched([key])
    for i in range(rounds):
        duel.stored([k(100 + 2 * i), k(101 + 2 * i)])
        duel.touched([hot[i % 4]])
        leaders.append(duel.leader)
    return leaders


def test_a_rule_leads_once_it_is_min_lead_prefix_hits_ahead() -> None:
    leaders = _hot_keys_and_a_scan(ShadowDuel(6, ["lru", "arc"]), 200)
    switched = leaders.index("arc")
    assert 0 < switched and leaders[switched:] == ["arc"] * (200 - switched)
    before, at = ShadowDuel(6, ["lru", "arc"]), ShadowDuel(6, ["lru", "arc"])
    _hot_keys_and_a_scan(before, switched)
    _hot_keys_and_a_scan(at, switched + 1)
    assert before.scores["arc"] - before.scores["lru"] < MIN_LEAD
    assert at.scores["arc"] - at.scores["lru"] >= MIN_LEAD


def test_a_shadow_scores_the_leading_run_of_held_keys_only() -> None:
    duel = ShadowDuel(2, ["lru"])
    duel.stored([k(1), k(2), k(3)])  # more than it holds: the last two stay, as demand paging
    duel.touched([k(1), k(2), k(3)])  # k(1) missing: k(2) and k(3) serve no prefix
    assert duel.scores == {"lru": 0.0}
    # Now k(1) stored, k(3) evicted (the least recent after the touch of k(2), k(3)).
    duel.touched([k(1), k(2), k(3)])
    assert duel.scores == {"lru": 2.0}


def test_keys_touched_then_stored_are_one_reference() -> None:
    # The study's driver touches a request's missing keys, then stores them.
    duel = ShadowDuel(8, ["lru"])
    duel.touched([k(1), k(2)])
    duel.stored([k(1), k(2)])  # not held before the touch: not a hit now
    assert duel.scores == {"lru": 0.0}
    duel.touched([k(1), k(2)])
    assert duel.scores == {"lru": 2.0}
    duel.stored([k(3)])  # a store after a store: counted
    duel.stored([k(3)])
    assert duel.scores == {"lru": 3.0}


def test_scores_halve_every_half_life_of_sampled_references() -> None:
    duel = ShadowDuel(1, ["lru"])
    duel.stored([k(1)])
    for _ in range(HALF_LIFE_CAPACITIES - 2):
        duel.touched([k(1)])
    assert duel.scores == {"lru": HALF_LIFE_CAPACITIES - 2}
    duel.touched([k(1)])  # the 64th reference: 63 hits, halved
    assert duel.scores == {"lru": (HALF_LIFE_CAPACITIES - 1) / 2}


def test_only_sampled_keys_reach_large_shadows() -> None:
    capacity = 8 * MIN_SHADOW_BLOCKS  # 1 key in 8
    duel = ShadowDuel(capacity, ["lru"])
    keys = [k(i) for i in range(4000)]
    sampled = [key for key in keys if zlib.crc32(key) & 7 == 0]
    assert 400 < len(sampled) <= MIN_SHADOW_BLOCKS  # the shadow holds them all
    duel.stored(keys)
    duel.touched(keys)
    # The real cache would miss none of these either; the run is over sampled keys only.
    assert duel.scores == {"lru": float(len(sampled))}
    duel.touched([key for key in keys if key not in sampled])  # no sampled key: no score
    assert duel.scores == {"lru": float(len(sampled))}


def test_clear_forgets_scores_and_the_leader() -> None:
    duel = ShadowDuel(6, ["lru", "arc"])
    assert _hot_keys_and_a_scan(duel, 200)[-1] == "arc"
    duel.clear()
    assert duel.leader == "lru"
    assert duel.scores == {"lru": 0.0, "arc": 0.0}


_calls = st.lists(
    st.lists(st.sampled_from([k(i) for i in range(12)]), unique=True, max_size=5), max_size=60
)


@settings(max_examples=300, deadline=None)
@given(calls=_calls, capacity=st.integers(1, 6), rule=st.sampled_from(RULES))
def test_a_shadow_takes_the_victims_its_policy_takes(
    calls: list[list[bytes]], capacity: int, rule: str
) -> None:
    """Lockstep with the policy the shadow stands for, driven as the study drives it (touch
    the call's keys, evict for the missing ones, store them), nothing pinned or protected:
    the same keys held, the same lists and ghosts, the same leading runs; the duel's
    :class:`LRUShadow` holds LRU's keys in LRU's eviction order."""
    shadow = ShadowCache(rule, capacity)
    lru_shadow = LRUShadow(capacity)
    classes: dict[str, type[EvictionPolicy]] = {
        "lru": LRUPolicy,
        "arc": ARCPolicy,
        "hybrid": _following("hybrid", shadows=False),
    }
    policy = classes[rule](capacity)
    for keys in calls:
        run = 0
        for key in keys:
            if key not in policy:
                break
            run += 1
        policy.touch(keys)
        missing = [key for key in keys if key not in policy][-capacity:]
        shortfall = len(policy) + len(missing) - capacity
        if shortfall > 0:
            assert policy.evict(shortfall) is not None
        policy.insert_new(missing)
        assert shadow.refer(keys) == run
        assert sorted(policy) == sorted(shadow)
        if rule == "lru":
            assert lru_shadow.refer(keys) == run
            assert list(lru_shadow) == list(policy)
        if isinstance(policy, ARCPolicy):
            assert policy.t1_keys == tuple(shadow._t1)
            assert policy.t2_keys == tuple(shadow._t2)
            assert policy.b1_keys == tuple(shadow._b1)
            assert policy.b2_keys == tuple(shadow._b2)
            assert policy.target_t1_size == shadow.target


# -- hybrid following each rule --------------------------------------------------------------


def _following(rule: str, shadows: bool) -> type[HybridPolicy]:
    return type(
        f"Hybrid{rule.upper()}{'Shadowed' if shadows else 'Only'}",
        (HybridPolicy,),
        {"_FIRST_RULE": rule, "_FOLLOWS_SHADOWS": shadows},
    )


class TestHybridFromEachRule(PolicyTests):
    """The conformance suite on hybrid starting from LRU's and from ARC's rule (shadows on:
    these tests' few hits never give another rule the lead)."""

    @pytest.fixture(params=["lru", "arc"])
    def policy_factory(self, request: pytest.FixtureRequest) -> PolicyFactory:
        return _following(request.param, shadows=True)


class HybridLRURuleMachine(LRUMachine):
    """Hybrid held to LRU's rule evicts, orders and holds exactly as LRU's model, pins and
    protected keys included (the victim is the older of the lists' first evictable keys)."""

    policy_class = _following("lru", shadows=False)  # type: ignore[assignment]


class HybridARCRuleMachine(ARCMachine):
    """Hybrid held to ARC's rule keeps ARC's lists and ARC's own target exactly."""

    policy_class = _following("arc", shadows=False)

    @invariant()
    def same_lists(self) -> None:
        hybrid, model = self.policy, self.model
        assert isinstance(hybrid, HybridPolicy)
        assert hybrid.t1_keys == tuple(model.t1)
        assert hybrid.t2_keys == tuple(model.t2)
        assert hybrid.b1_keys == tuple(model.b1)
        assert hybrid.b2_keys == tuple(model.b2)
        assert hybrid._arc_target() == model.p
        assert list(hybrid) == list(iter(_arc_from(model)))


def _arc_from(model: object) -> list[bytes]:
    # ARC's eviction order from the model's lists: T1 while over p, then T2, then the rest.
    t1, t2, p = list(model.t1), list(model.t2), model.p  # type: ignore[attr-defined]
    out = []
    while t1 and t2:
        out.append(t1.pop(0) if len(t1) > p else t2.pop(0))
    return out + t1 + t2


# The settings of the machines subclassed (test_policies) apply.
TestHybridLRURuleMachine = HybridLRURuleMachine.TestCase
TestHybridARCRuleMachine = HybridARCRuleMachine.TestCase


# -- the floor, where the hybrid rule alone missed it ----------------------------------------


@pytest.mark.parametrize(
    ("trace", "seed", "fraction", "rule"),
    [
        # The hybrid rule alone: 0.6404 against LRU's 0.6430; its shadows say LRU.
        ("toolagent", 1, 0.01, "lru"),
        # The hybrid rule alone: 0.1987 against ARC's 0.2025; its shadows say ARC.
        ("conversation", 0, 0.01, "arc"),
    ],
)
def test_hybrid_follows_the_rule_that_serves_more_prefixes(
    trace: str, seed: int, fraction: float, rule: str
) -> None:
    study = study_trace_from_blocks(workload_trace(trace, "demo", seed), 512)
    (capacity,) = capacities_for(study.unique_blocks, [fraction])
    rows = run_study(study, [capacity], ["lru", "arc", "hybrid"], belady=False)
    ratio = {row["policy"]: row["prefix_hit_ratio"] for row in rows}
    assert ratio["hybrid"] >= max(ratio["lru"], ratio["arc"]) - 0.002, ratio
    policy = HybridPolicy(capacity)
    simulate_cpu(policy, study.key_lists)
    assert policy.rule == rule
