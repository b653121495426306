"""Hybrid lookup across full-attention, sliding-window and Mamba groups."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from tiering.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.lookup import HybridHit, KeyState, find_hybrid_hit

R, A, P = KeyState.READY, KeyState.ABSENT, KeyState.PENDING


def make_spec(*groups: KVCacheGroup, factor: int = 1) -> KVCacheSpec:
    return KVCacheSpec(groups, hash_block_size=16, block_size_factor=factor)


FULL16 = KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (64,))
FULL32 = KVCacheGroup(GroupKind.FULL_ATTENTION, 32, (64,))
SWA16 = KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, (64,), sliding_window=32)  # 2 blocks
MAMBA32 = KVCacheGroup(GroupKind.MAMBA, 32, (64,))


def run(
    spec: KVCacheSpec, states: list[list[KeyState]], prompt_tokens: int
) -> tuple[HybridHit, list[list[bytes]], list[bytes]]:
    keys = [[bytes([g, i]) for i in range(len(s))] for g, s in enumerate(states)]
    table = {k: st for g, s in enumerate(states) for k, st in zip(keys[g], s, strict=True)}
    asked: list[bytes] = []

    def state_of(key: bytes) -> KeyState:
        asked.append(key)
        return table[key]

    return find_hybrid_hit(spec, keys, state_of, prompt_tokens), keys, asked


def test_full_attention_needs_the_whole_prefix() -> None:
    hit, keys, _ = run(make_spec(FULL16), [[R, R, A, R]], prompt_tokens=100)
    assert hit.answer == 32
    assert hit.needed_keys == ((keys[0][0], keys[0][1]),)


def test_last_prompt_token_is_always_computed() -> None:
    hit, _, _ = run(make_spec(FULL16), [[R, R, R, R]], prompt_tokens=64)
    assert hit.answer == 48  # 64 would leave nothing to compute
    hit, _, _ = run(make_spec(FULL16), [[R, R, R, R]], prompt_tokens=65)
    assert hit.answer == 64


def test_sliding_window_needs_only_the_window_before_the_hit_end() -> None:
    spec = make_spec(FULL16, SWA16)
    # Window group lost blocks 0-1 (outside the window) but holds 2-3.
    hit, keys, _ = run(spec, [[R, R, R, R], [A, A, R, R]], prompt_tokens=1000)
    assert hit.answer == 64
    assert hit.needed_keys[1] == (keys[1][2], keys[1][3])
    # A hole inside the window before the end moves the hit back to the last full window.
    hit, _, _ = run(spec, [[R, R, R, R], [R, R, A, R]], prompt_tokens=1000)
    assert hit.answer == 32


def test_mamba_needs_only_the_block_at_the_hit_end_and_all_groups_align() -> None:
    spec = make_spec(FULL16, MAMBA32)
    # Full group: 5 blocks of 16 = 80 tokens; Mamba blocks of 32: state at 32 and 64 present.
    hit, keys, _ = run(spec, [[R, R, R, R, R], [A, R]], prompt_tokens=1000)
    assert hit.answer == 64  # a multiple of 16 and 32 both groups can serve
    assert hit.needed_keys == (tuple(keys[0][:4]), (keys[1][1],))
    hit, _, _ = run(spec, [[R, R, R, R, R], [R, A]], prompt_tokens=1000)
    assert hit.answer == 32


def test_pending_needed_block_means_retry_later_but_unneeded_pending_does_not() -> None:
    spec = make_spec(FULL16, SWA16)
    hit, keys, _ = run(spec, [[R, R, R, R], [R, A, R, P]], prompt_tokens=1000)
    assert hit.answer is None
    assert hit.num_tokens == 64
    assert hit.pending_keys == (keys[1][3],)
    # Block 0 of the window group is pending but outside the window of the best hit.
    hit, _, _ = run(spec, [[R, R, R, R], [P, A, R, R]], prompt_tokens=1000)
    assert hit.answer == 64


def test_offloaded_blocks_of_several_gpu_blocks() -> None:
    spec = make_spec(FULL16, FULL32, factor=2)  # offloaded blocks of 32 and 64 tokens
    hit, _, _ = run(spec, [[R, R, R], [R, A]], prompt_tokens=1000)
    assert hit.answer == 64


def test_only_keys_that_can_matter_are_asked() -> None:
    hit, keys, asked = run(make_spec(FULL16), [[R] * 10], prompt_tokens=33)
    assert hit.answer == 32
    assert asked == keys[0][:2]


def test_no_hit_is_zero() -> None:
    hit, _, _ = run(make_spec(FULL16, SWA16), [[A, R], [R, R]], prompt_tokens=100)
    assert hit.answer == 0
    assert hit.needed_keys == ((), ())


def brute_force(spec: KVCacheSpec, states: list[list[KeyState]], prompt_tokens: int) -> int:
    """The rule stated plainly: the largest valid T, trying every multiple of every size."""
    sizes = [spec.offloaded_block_size(g) for g in range(spec.num_groups)]
    step = math.lcm(*sizes)
    best = 0
    for tokens in range(step, prompt_tokens, step):
        ok = True
        for g, s in enumerate(states):
            n = tokens // sizes[g]
            if n > len(s):
                ok = False
                break
            window = spec.window_in_offloaded_blocks(g)
            first = 0 if window is None else max(0, n - window)
            if any(s[i] is A for i in range(first, n)):
                ok = False
        if ok:
            best = tokens
    return best


@given(
    kinds=st.lists(
        st.sampled_from(["full16", "full32", "swa16", "mamba32"]), min_size=1, max_size=4
    ),
    data=st.data(),
    prompt_tokens=st.integers(0, 300),
)
def test_matches_the_plain_rule(kinds: list[str], data: st.DataObject, prompt_tokens: int) -> None:
    table = {"full16": FULL16, "full32": FULL32, "swa16": SWA16, "mamba32": MAMBA32}
    spec = make_spec(*(table[k] for k in kinds))
    states = [
        data.draw(st.lists(st.sampled_from([R, A, P]), max_size=20)) for _ in range(spec.num_groups)
    ]
    hit, _, _ = run(spec, states, prompt_tokens)
    assert hit.num_tokens == brute_force(spec, states, prompt_tokens)
    assert hit.num_tokens < max(prompt_tokens, 1)
