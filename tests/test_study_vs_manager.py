"""The policy study drives each policy as the managers do: lockstep against the CPU manager and
a secondary tier's index, for every registered policy.

A policy that adapts on misses (``arc_vllm``: vLLM's ARC moves its target in ``note_misses``)
is where a study that skipped a call of the protocol would part from the running manager.
"""

from __future__ import annotations

from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.backends.base import Outcome
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.managers.cpu_manager import CPUOffloadingManager
from tiering.managers.tier_index import TierIndex
from tiering.policies import available_policies, get_policy_class
from tiering.replay.study import StudyTrace, TierModel, run_study, simulate_cpu

# Requests of at most 6 distinct keys out of 14, for caches of at least 6 blocks: the manager
# refuses a store larger than the cache, where the study stores in chunks.
_requests = st.lists(
    st.lists(st.integers(0, 13), min_size=1, max_size=6, unique=True), min_size=1, max_size=50
)


def _keys(requests: list[list[int]]) -> list[list[OffloadKey]]:
    return [[make_offload_key(i.to_bytes(32, "big"), 0) for i in r] for r in requests]


@settings(max_examples=60, deadline=None)
@given(requests=_requests, capacity=st.integers(6, 9))
def test_the_study_hits_what_the_cpu_manager_hits(requests: list[list[int]], capacity: int) -> None:
    key_lists = _keys(requests)
    for name in available_policies():
        studied = get_policy_class(name)(capacity)
        study = simulate_cpu(studied, key_lists).flags
        manager = CPUOffloadingManager(capacity, name)
        flags = bytearray()
        for keys in key_lists:
            manager.note_request(keys)
            hits = [manager.lookup(key) is True for key in keys]
            flags += bytes(hits)
            if any(hits):
                manager.touch(keys)
            out = manager.prepare_store(keys)
            assert out is not None, name
            manager.complete_store(out.keys_to_store)
        assert flags == study, name
        # The same calls: the same rule followed (hybrid's duel), switched as often.
        policy = manager.policy
        assert (policy.rule, policy.rule_switches) == (studied.rule, studied.rule_switches), name


@settings(max_examples=60, deadline=None)
@given(requests=_requests, capacity=st.integers(6, 9))
def test_a_tier_in_the_study_holds_what_the_tiers_index_holds(
    requests: list[list[int]], capacity: int
) -> None:
    """A write-through tier behind a one-block CPU tier: each request's CPU misses are looked
    up in the tier (a hit touched), the rest written as one store the way the tier's
    :class:`TierIndex` reserves and publishes it."""
    key_lists = _keys(requests)
    trace = StudyTrace(cast("list[list[bytes]]", key_lists), [1] * len(key_lists), 1)
    for name in available_policies():
        tier = TierModel("t", capacity, policy=name, block_bytes=1)
        (row,) = run_study(trace, [1], ["lru"], tiers=[tier], block_bytes=1, belady=False)
        cpu = simulate_cpu(get_policy_class("lru")(1), key_lists).flags
        policy = get_policy_class(name)(capacity)
        index = TierIndex(quarantine_seconds=0.0, quarantine_max_keys=1)
        served = written = position = 0
        for keys in key_lists:
            missed = [k for i, k in enumerate(keys) if not cpu[position + i]]
            position += len(keys)
            computed = []
            for key in missed:
                if key in policy:
                    policy.touch([key])
                    served += 1
                else:
                    computed.append(key)
            reserved = index.reserve(policy, computed, capacity)
            assert reserved is not None, name
            index.publish(policy, reserved[0], [Outcome.OK] * len(reserved[0]))
            written += len(reserved[0])
        assert row["tiers"]["t"]["served_blocks"] == served, name
        assert row["tiers"]["t"]["bytes_written"] == written, name
