"""Hybrid lookup across full-attention, sliding-window and Mamba groups."""

from __future__ import annotations

import math
from typing import cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.lookup import HybridHit, KeyState, find_hybrid_hit
from tiering.errors import ConfigurationError, InvalidArgumentError

R, A, P = KeyState.READY, KeyState.ABSENT, KeyState.PENDING


def make_spec(*groups: KVCacheGroup, factor: int = 1) -> KVCacheSpec:
    return KVCacheSpec(groups, hash_block_size=16, block_size_factor=factor)


FULL16 = KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (64,))
FULL32 = KVCacheGroup(GroupKind.FULL_ATTENTION, 32, (64,))
SWA16 = KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, (64,), sliding_window=32)  # 2 blocks
MAMBA32 = KVCacheGroup(GroupKind.MAMBA, 32, (64,))


def run(
    spec: KVCacheSpec,
    states: list[list[KeyState]],
    prompt_tokens: int,
    *,
    engine_recomputes_last_token: bool = False,
) -> tuple[HybridHit, list[list[bytes]], list[bytes]]:
    keys = [[bytes([g, i]) for i in range(len(s))] for g, s in enumerate(states)]
    table = {k: st for g, s in enumerate(states) for k, st in zip(keys[g], s, strict=True)}
    asked: list[bytes] = []

    def state_of(key: bytes) -> KeyState:
        asked.append(key)
        return table[key]

    hit = find_hybrid_hit(
        spec,
        keys,
        state_of,
        prompt_tokens,
        engine_recomputes_last_token=engine_recomputes_last_token,
    )
    return hit, keys, asked


def test_full_attention_needs_the_whole_prefix() -> None:
    hit, keys, _ = run(make_spec(FULL16), [[R, R, A, R]], prompt_tokens=100)
    assert hit.answer == 32
    assert hit.needed_keys == ((keys[0][0], keys[0][1]),)


def test_last_prompt_token_is_always_computed() -> None:
    hit, _, _ = run(make_spec(FULL16), [[R, R, R, R]], prompt_tokens=64)
    assert hit.answer == 48  # 64 would leave nothing to compute
    hit, _, _ = run(make_spec(FULL16), [[R, R, R, R]], prompt_tokens=65)
    assert hit.answer == 64


def test_engine_that_recomputes_the_last_token_may_hit_the_whole_prompt() -> None:
    # vLLM's case: a 432-token prompt fully offloaded in 16-token blocks.
    hit, keys, _ = run(make_spec(FULL16), [[R] * 27], prompt_tokens=432)
    assert hit.answer == 416
    hit, keys, _ = run(
        make_spec(FULL16), [[R] * 27], prompt_tokens=432, engine_recomputes_last_token=True
    )
    assert hit.answer == 432 and hit.needed_keys == (tuple(keys[0]),)
    hit, _, _ = run(
        make_spec(FULL16), [[R] * 27], prompt_tokens=433, engine_recomputes_last_token=True
    )
    assert hit.answer == 432  # not a whole number of blocks: unchanged


def test_a_window_or_mamba_group_always_leaves_the_last_token() -> None:
    for window_group in (SWA16, MAMBA32):
        spec = make_spec(FULL16, window_group)
        states = [[R] * 4, [R] * (4 if window_group is SWA16 else 2)]
        for recomputes in (False, True):
            hit, _, _ = run(spec, states, 64, engine_recomputes_last_token=recomputes)
            assert hit.answer == (48 if window_group is SWA16 else 32)


def test_bad_arguments_are_typed_errors_naming_them() -> None:
    spec = make_spec(FULL16)
    with pytest.raises(InvalidArgumentError, match="num_prompt_tokens"):
        run(spec, [[R]], -1)
    with pytest.raises(InvalidArgumentError, match="num_prompt_tokens"):
        run(spec, [[R]], cast(int, 1.5))
    with pytest.raises(InvalidArgumentError, match="spec must be a KVCacheSpec"):
        find_hybrid_hit(cast(KVCacheSpec, None), [[b"k"]], lambda k: R, 10)
    with pytest.raises(InvalidArgumentError, match="engine_recomputes_last_token"):
        run(spec, [[R]], 10, engine_recomputes_last_token=cast(bool, "yes"))
    with pytest.raises(ConfigurationError, match="keys for 2 groups"):
        find_hybrid_hit(spec, [[b"k"], [b"k"]], lambda k: R, 10)


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


def brute_force(
    spec: KVCacheSpec, states: list[list[KeyState]], prompt_tokens: int, recomputes: bool
) -> int:
    """The rule stated plainly: the largest valid T, trying every multiple of every size."""
    sizes = [spec.offloaded_block_size(g) for g in range(spec.num_groups)]
    step = math.lcm(*sizes)
    best = 0
    full_attention_only = all(g.kind is GroupKind.FULL_ATTENTION for g in spec.groups)
    last = prompt_tokens + 1 if recomputes and full_attention_only else prompt_tokens
    for tokens in range(step, last, step):
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
    recomputes=st.booleans(),
)
def test_matches_the_plain_rule(
    kinds: list[str], data: st.DataObject, prompt_tokens: int, recomputes: bool
) -> None:
    table = {"full16": FULL16, "full32": FULL32, "swa16": SWA16, "mamba32": MAMBA32}
    spec = make_spec(*(table[k] for k in kinds))
    states = [
        data.draw(st.lists(st.sampled_from([R, A, P]), max_size=20)) for _ in range(spec.num_groups)
    ]
    hit, _, _ = run(spec, states, prompt_tokens, engine_recomputes_last_token=recomputes)
    assert hit.num_tokens == brute_force(spec, states, prompt_tokens, recomputes)
    assert hit.num_tokens <= prompt_tokens
    if not recomputes:
        assert hit.num_tokens < max(prompt_tokens, 1)
