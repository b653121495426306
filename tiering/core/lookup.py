"""Hybrid lookup: how many prompt tokens can be loaded, across every KV-cache group.

Each group needs a different part of the prefix to resume at a hit end of ``T`` tokens:

- full attention: every offloaded block before ``T``;
- sliding window: only the blocks covering the window before ``T``;
- Mamba: only the block that ends at ``T`` (it holds the state).

The answer is the largest ``T`` that is a whole number of offloaded blocks of every group, that
every group can serve, and that leaves the last prompt token to compute (the engine needs its
logits). If a block that this ``T`` needs is still being written, the answer is "retry later";
a block being written is never treated as a miss, because that would give up a hit that will be
ready in a moment.

An engine that recomputes the last token itself after a full hit (vLLM does) may be given a hit
that covers the whole prompt: ``engine_recomputes_last_token=True``. That applies only where
every group is full attention: a sliding-window or Mamba group's state at the hit end cannot be
recomputed over, so with one of those the last token is left to compute either way (vLLM's rule
too). For a 432-token prompt fully offloaded in 16-token blocks the answer is then 432 rather
than 416.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiering.core.groups import KVCacheSpec
from tiering.errors import ConfigurationError, InvalidArgumentError

__all__ = ["HybridHit", "KeyState", "check_hybrid_args", "find_hybrid_hit", "state_from_lookup"]


class KeyState(enum.IntEnum):
    """What a tier knows of one key."""

    ABSENT = 0
    READY = 1
    PENDING = 2  # being written, or loadable from a lower tier after a promotion


def state_from_lookup(answer: bool | None) -> KeyState:
    """Map a manager's ``lookup`` answer (True / False / None) onto a KeyState."""
    if answer is None:
        return KeyState.PENDING
    return KeyState.READY if answer else KeyState.ABSENT


@dataclass(frozen=True)
class HybridHit:
    """The result of a hybrid lookup.

    ``num_tokens`` is the hit length (0 for none). ``needed_keys[g]`` lists the keys of group ``g``
    that loading ``num_tokens`` tokens needs; ``pending_keys`` are those of them not ready yet.
    ``retry_later`` is True iff ``pending_keys`` is not empty.
    """

    num_tokens: int
    needed_keys: tuple[tuple[bytes, ...], ...]
    pending_keys: tuple[bytes, ...]

    @property
    def retry_later(self) -> bool:
        return bool(self.pending_keys)

    @property
    def answer(self) -> int | None:
        """What a scheduler wants: the hit length, or None to retry later."""
        return None if self.retry_later else self.num_tokens


def find_hybrid_hit(
    spec: KVCacheSpec,
    keys_per_group: Sequence[Sequence[bytes]],
    state_of: Callable[[bytes], KeyState],
    num_prompt_tokens: int,
    *,
    engine_recomputes_last_token: bool = False,
) -> HybridHit:
    """Find the longest loadable prefix of a request; see the module docstring.

    ``keys_per_group[g]`` are the request's offload keys of group ``g`` in block order
    (``KVCacheSpec.offload_keys``). ``state_of`` is asked about each key at most once, in group
    order and block order, and only for keys that can matter. With
    ``engine_recomputes_last_token`` a full-attention-only hit may cover the whole prompt.

    Raises :class:`InvalidArgumentError` for a ``spec`` that is not a :class:`KVCacheSpec` or a
    ``num_prompt_tokens`` that is not an int >= 0, and :class:`ConfigurationError` when
    ``keys_per_group`` does not have one entry per group of ``spec``.
    """
    check_hybrid_args(spec, keys_per_group, num_prompt_tokens, engine_recomputes_last_token)
    block_tokens = [spec.offloaded_block_size(g) for g in range(spec.num_groups)]
    step = math.lcm(*block_tokens)
    # The last prompt token is computed (its logits are needed) unless the engine recomputes it
    # itself and no group keeps a state at the hit end; no group can serve past its own keys.
    whole_prompt = engine_recomputes_last_token and all(
        spec.window_in_offloaded_blocks(g) is None for g in range(spec.num_groups)
    )
    max_tokens = num_prompt_tokens if whole_prompt else max(num_prompt_tokens - 1, 0)
    for g, keys in enumerate(keys_per_group):
        max_tokens = min(max_tokens, len(keys) * block_tokens[g])
    max_steps = max_tokens // step
    if max_steps == 0:
        return HybridHit(0, tuple(() for _ in keys_per_group), ())

    # Optimistic pass: a pending key counts as a hit; the states are kept for the final check.
    states: list[list[KeyState]] = []
    usable: list[Callable[[int], bool]] = []
    for g, keys in enumerate(keys_per_group):
        limit = max_steps * step // block_tokens[g]
        group_states = [state_of(k) for k in keys[:limit]]
        states.append(group_states)
        usable.append(_group_rule(spec, g, group_states))

    for k in range(max_steps, 0, -1):
        tokens = k * step
        if all(usable[g](tokens // block_tokens[g]) for g in range(spec.num_groups)):
            return _hit(spec, keys_per_group, states, tokens, block_tokens)
    return HybridHit(0, tuple(() for _ in keys_per_group), ())


def check_hybrid_args(
    spec: object,
    keys_per_group: object,
    num_prompt_tokens: object,
    engine_recomputes_last_token: object = False,
) -> None:
    """Raise a typed error naming the first bad argument of a hybrid lookup (changes nothing)."""
    if not isinstance(spec, KVCacheSpec):
        raise InvalidArgumentError(
            f"spec must be a KVCacheSpec, got {type(spec).__name__}: {spec!r:.80}"
        )
    if isinstance(num_prompt_tokens, bool) or not isinstance(num_prompt_tokens, int):
        raise InvalidArgumentError(
            f"num_prompt_tokens must be an int >= 0, got {type(num_prompt_tokens).__name__}: "
            f"{num_prompt_tokens!r:.80}"
        )
    if num_prompt_tokens < 0:
        raise InvalidArgumentError(f"num_prompt_tokens must be >= 0, got {num_prompt_tokens}")
    if type(engine_recomputes_last_token) is not bool:
        raise InvalidArgumentError(
            "engine_recomputes_last_token must be a bool, got "
            f"{type(engine_recomputes_last_token).__name__}: {engine_recomputes_last_token!r:.80}"
        )
    if not isinstance(keys_per_group, Sequence) or isinstance(keys_per_group, (bytes, str)):
        raise InvalidArgumentError(
            "keys_per_group must be a sequence with one sequence of keys per group, got "
            f"{type(keys_per_group).__name__}: {keys_per_group!r:.80}"
        )
    if len(keys_per_group) != spec.num_groups:
        raise ConfigurationError(
            f"got keys for {len(keys_per_group)} groups, the spec has {spec.num_groups}"
        )


def _group_rule(spec: KVCacheSpec, g: int, states: list[KeyState]) -> Callable[[int], bool]:
    """A predicate: can group ``g`` resume after its first ``n`` offloaded blocks?"""
    present = [s is not KeyState.ABSENT for s in states]
    window = spec.window_in_offloaded_blocks(g)  # Mamba: a window of one block
    if window is None:  # full attention: a prefix of hits
        prefix = next((i for i, hit in enumerate(present) if not hit), len(present))
        return lambda n: n <= prefix
    # run[i]: consecutive hits ending at block i (inclusive).
    run: list[int] = []
    for i, hit in enumerate(present):
        run.append((run[i - 1] + 1 if i else 1) if hit else 0)
    return lambda n: run[n - 1] >= min(window, n)


def _hit(
    spec: KVCacheSpec,
    keys_per_group: Sequence[Sequence[bytes]],
    states: list[list[KeyState]],
    tokens: int,
    block_tokens: list[int],
) -> HybridHit:
    needed: list[tuple[bytes, ...]] = []
    pending: list[bytes] = []
    for g, keys in enumerate(keys_per_group):
        n = tokens // block_tokens[g]
        window = spec.window_in_offloaded_blocks(g)
        first = 0 if window is None else max(0, n - window)
        needed.append(tuple(keys[first:n]))
        pending.extend(keys[i] for i in range(first, n) if states[g][i] is KeyState.PENDING)
    return HybridHit(tokens, tuple(needed), tuple(pending))
