"""Synthetic trace generators, and the built-in workloads made with them.

:func:`multi_turn_chat`, :func:`rag` and :func:`agent_loops` return lazy iterators of requests,
deterministic for a ``seed`` (a private ``numpy.random.Generator``, no global state); their
arguments are checked when called, before the first request. Ranges such as ``(32, 160)`` are
inclusive and drawn uniformly; an int means a fixed value. :func:`builtin_trace` returns the
named workloads ``"chat"``, ``"rag"``, ``"agent"`` and ``"mixed"`` at scales ``"tiny"`` (unit
tests), ``"demo"`` and ``"large"`` (five times the demo counts); at ``"demo"`` scale, with
``seed=0``:

========  ========  ===========  ==========  ============================================
name      requests  mean prompt  compulsory  shape
                    tokens       misses
========  ========  ===========  ==========  ============================================
chat      2,069     1,649        0.118       300 conversations x 2-12 turns, 4 system
                                             prompts of 768 tokens, user 32-160, output
                                             32-192 tokens
rag       2,000     1,540        0.614       1,000 documents of 200-600 tokens, 2-4 per
                                             request, 256-token instruction, 16-64-token
                                             question
agent     1,550     1,630        0.056       100 agents x 5-25 steps, 768-token tool
                                             prompt, 64-token task, observations 16-96,
                                             actions 16-48
mixed     1,945     1,620        0.294       a third of each, merged by arrival time; rag
                                             uses LoRA ``"rag-lora"``, agent the salt
                                             ``"agents"``
========  ========  ===========  ==========  ============================================

"Compulsory misses" is the share of 16-token hash blocks seen for the first time (the miss
ratio of an unbounded cache, :func:`tiering.replay.traces.trace_summary`). Prompts stay under
4,096 tokens; the generators take about 0.1 s per thousand requests.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence

import numpy as np

from tiering.config import BUILTIN_TRACES, SCALES
from tiering.errors import ConfigurationError
from tiering.replay.trace_requests import Request, _is_int
from tiering.replay.trace_segments import DEFAULT_VOCAB_SIZE, _check_vocab_size, segment_tokens

__all__ = [
    "IntRange",
    "agent_loops",
    "builtin_trace",
    "multi_turn_chat",
    "rag",
]

#: A token count: a fixed int, or an inclusive ``(low, high)`` range drawn uniformly.
IntRange = int | tuple[int, int]

_SCALE_FACTORS = {"tiny": 0.1, "demo": 1.0, "large": 5.0}
_DEFAULT_RATE_PER_S = 10.0


def multi_turn_chat(
    num_conversations: int = 300,
    turns_per_conversation: IntRange = (2, 12),
    system_prompt_tokens: int = 768,
    user_turn_tokens: IntRange = (32, 160),
    output_tokens: IntRange = (32, 192),
    num_system_prompts: int = 4,
    zipf_alpha: float = 0.9,
    seed: int = 0,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    arrival_rate_per_s: float = _DEFAULT_RATE_PER_S,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> Iterator[Request]:
    """Multi-turn conversations sharing a few system prompts, interleaved in time.

    Each conversation gets a system prompt (Zipf(``zipf_alpha``) popularity over
    ``num_system_prompts``) and a number of turns. Turn ``t``'s prompt is the system prompt,
    then every earlier turn's user and assistant tokens, then the new user turn; its
    ``output_tokens`` are the assistant tokens the next turn includes. Which conversation
    sends the next request is drawn with Zipf(``zipf_alpha``) popularity over the unfinished
    conversations (conversation 0 is the most popular). Arrivals are Poisson at
    ``arrival_rate_per_s``. Request ids are ``"chat-s{seed}-c{conversation}-t{turn}"``.
    """
    _check_count(num_conversations, "num_conversations")
    turns = _check_range(turns_per_conversation, "turns_per_conversation", 1)
    _check_count(system_prompt_tokens, "system_prompt_tokens")
    user = _check_range(user_turn_tokens, "user_turn_tokens", 1)
    output = _check_range(output_tokens, "output_tokens", 1)
    _check_count(num_system_prompts, "num_system_prompts")
    _check_common(zipf_alpha, seed, vocab_size, arrival_rate_per_s, cache_salt, lora_name)
    structure_rng, arrival_rng = _rngs(seed)
    prompt_of_conversation = structure_rng.choice(
        num_system_prompts,
        size=num_conversations,
        p=_zipf_weights(num_system_prompts, zipf_alpha, normalized=True),
    )
    turns_of_conversation = _draw(structure_rng, turns, num_conversations)
    system_prompts = [
        segment_tokens(f"chat/sys/{k}", system_prompt_tokens, vocab_size)
        for k in range(num_system_prompts)
    ]

    def requests() -> Iterator[Request]:
        contexts: list[list[np.ndarray]] = [
            [system_prompts[k]] for k in prompt_of_conversation.tolist()
        ]
        schedule = _session_schedule(structure_rng, turns_of_conversation, zipf_alpha)
        arrivals = _arrivals(arrival_rng, len(schedule), arrival_rate_per_s)
        next_turn = [0] * num_conversations
        for conv, arrival in zip(schedule, arrivals, strict=True):
            turn = next_turn[conv]
            next_turn[conv] += 1
            name = f"chat/s{seed}/c{conv}"
            user_turn = segment_tokens(
                f"{name}/u{turn}", _draw_one(structure_rng, user), vocab_size
            )
            reply_tokens = _draw_one(structure_rng, output)
            context = contexts[conv]
            context.append(user_turn)
            yield _request(
                f"chat-s{seed}-c{conv}-t{turn}",
                context,
                arrival,
                cache_salt,
                lora_name,
                reply_tokens,
            )
            context.append(segment_tokens(f"{name}/a{turn}", reply_tokens, vocab_size))

    return requests()


def rag(
    num_documents: int = 1_000,
    document_tokens: IntRange = (200, 600),
    docs_per_request: IntRange = (2, 4),
    question_tokens: IntRange = (16, 64),
    num_requests: int = 2_000,
    zipf_alpha: float = 0.9,
    seed: int = 0,
    *,
    instruction_tokens: int = 256,
    output_tokens: IntRange = (32, 256),
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    arrival_rate_per_s: float = _DEFAULT_RATE_PER_S,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> Iterator[Request]:
    """Retrieval-augmented requests: instruction, retrieved documents, question.

    The pool holds ``num_documents`` documents, each with a fixed length drawn from
    ``document_tokens``. A request retrieves ``docs_per_request`` distinct documents with
    Zipf(``zipf_alpha``) popularity (document 0 is the most popular) and concatenates them
    in retrieval order after the shared instruction; a unique question ends the prompt. Request
    ids are ``"rag-s{seed}-{i}"``; document ``d`` is the named segment ``"rag/doc/{d}"``.
    """
    _check_count(num_documents, "num_documents")
    doc_range = _check_range(document_tokens, "document_tokens", 1)
    docs = _check_range(docs_per_request, "docs_per_request", 1)
    if docs[1] > num_documents:
        raise ConfigurationError(
            f"docs_per_request up to {docs[1]} needs at least that many documents, "
            f"got num_documents={num_documents}"
        )
    question = _check_range(question_tokens, "question_tokens", 1)
    _check_count(num_requests, "num_requests")
    _check_count(instruction_tokens, "instruction_tokens")
    output = _check_range(output_tokens, "output_tokens", 0)
    _check_common(zipf_alpha, seed, vocab_size, arrival_rate_per_s, cache_salt, lora_name)
    structure_rng, arrival_rng = _rngs(seed)
    doc_lengths = _draw(structure_rng, doc_range, num_documents).tolist()
    popularity = _zipf_weights(num_documents, zipf_alpha, normalized=True)
    instruction = segment_tokens("rag/instruction", instruction_tokens, vocab_size)

    def requests() -> Iterator[Request]:
        arrivals = _arrivals(arrival_rng, num_requests, arrival_rate_per_s)
        for i, arrival in enumerate(arrivals):
            k = _draw_one(structure_rng, docs)
            chosen = structure_rng.choice(num_documents, size=k, replace=False, p=popularity)
            parts = [instruction]
            parts += [
                segment_tokens(f"rag/doc/{d}", doc_lengths[d], vocab_size) for d in chosen.tolist()
            ]
            request_id = f"rag-s{seed}-{i}"
            parts.append(
                segment_tokens(f"rag/s{seed}/q{i}", _draw_one(structure_rng, question), vocab_size)
            )
            reply_tokens = _draw_one(structure_rng, output)
            yield _request(request_id, parts, arrival, cache_salt, lora_name, reply_tokens)

    return requests()


def agent_loops(
    num_agents: int = 100,
    steps_per_agent: IntRange = (5, 25),
    tool_prompt_tokens: int = 768,
    step_tokens: IntRange = (16, 96),
    zipf_alpha: float = 0.9,
    seed: int = 0,
    *,
    task_tokens: int = 64,
    action_tokens: IntRange = (16, 48),
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    arrival_rate_per_s: float = _DEFAULT_RATE_PER_S,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> Iterator[Request]:
    """Agents looping over tool calls, each with a growing context after a shared tool prompt.

    Agent ``a``'s context starts with the shared tool/system prompt and its own task. Step
    ``s``'s prompt is that context plus every earlier step's observation and action, plus the
    new observation (``step_tokens``, the tool result); its ``output_tokens`` are the action
    (``action_tokens``), which the next step includes. Which agent steps next is drawn with
    Zipf(``zipf_alpha``) popularity over the unfinished agents. Request ids are
    ``"agent-s{seed}-a{agent}-{step}"``.
    """
    _check_count(num_agents, "num_agents")
    steps = _check_range(steps_per_agent, "steps_per_agent", 1)
    _check_count(tool_prompt_tokens, "tool_prompt_tokens")
    observation = _check_range(step_tokens, "step_tokens", 1)
    _check_count(task_tokens, "task_tokens")
    action = _check_range(action_tokens, "action_tokens", 1)
    _check_common(zipf_alpha, seed, vocab_size, arrival_rate_per_s, cache_salt, lora_name)
    structure_rng, arrival_rng = _rngs(seed)
    steps_of_agent = _draw(structure_rng, steps, num_agents)
    tool_prompt = segment_tokens("agent/tools", tool_prompt_tokens, vocab_size)

    def requests() -> Iterator[Request]:
        contexts = [
            [tool_prompt, segment_tokens(f"agent/s{seed}/a{a}/task", task_tokens, vocab_size)]
            for a in range(num_agents)
        ]
        schedule = _session_schedule(structure_rng, steps_of_agent, zipf_alpha)
        arrivals = _arrivals(arrival_rng, len(schedule), arrival_rate_per_s)
        next_step = [0] * num_agents
        for agent, arrival in zip(schedule, arrivals, strict=True):
            step = next_step[agent]
            next_step[agent] += 1
            name = f"agent/s{seed}/a{agent}"
            context = contexts[agent]
            context.append(
                segment_tokens(f"{name}/o{step}", _draw_one(structure_rng, observation), vocab_size)
            )
            action_count = _draw_one(structure_rng, action)
            yield _request(
                f"agent-s{seed}-a{agent}-{step}",
                context,
                arrival,
                cache_salt,
                lora_name,
                action_count,
            )
            context.append(segment_tokens(f"{name}/x{step}", action_count, vocab_size))

    return requests()


def builtin_trace(name: str, scale: str = "demo", seed: int = 0) -> list[Request]:
    """The named workload (``"chat"``, ``"rag"``, ``"agent"``, ``"mixed"``) at ``scale``.

    Sizes are in the module docstring's table. ``"tiny"`` has a tenth of the demo counts,
    ``"large"`` five times; token lengths are the same at every scale. Raises
    :class:`ConfigurationError` for an unknown name or scale.
    """
    if name not in BUILTIN_TRACES:
        raise ConfigurationError(
            f"unknown built-in trace {name!r}; valid names: {', '.join(BUILTIN_TRACES)}"
        )
    if scale not in _SCALE_FACTORS:
        raise ConfigurationError(
            f"unknown trace scale {scale!r}; valid scales: {', '.join(SCALES)}"
        )
    factor = _SCALE_FACTORS[scale]

    def count(demo: int) -> int:
        return max(1, round(demo * factor))

    if name == "chat":
        return list(multi_turn_chat(num_conversations=count(300), seed=seed))
    if name == "rag":
        return list(rag(num_documents=count(1_000), num_requests=count(2_000), seed=seed))
    if name == "agent":
        return list(agent_loops(num_agents=count(100), seed=seed))
    rate = _DEFAULT_RATE_PER_S / 3  # three streams at a third of the rate: the same total rate
    parts = [
        multi_turn_chat(num_conversations=count(100), seed=seed, arrival_rate_per_s=rate),
        rag(
            num_documents=count(1_000),
            num_requests=count(700),
            seed=seed,
            arrival_rate_per_s=rate,
            lora_name="rag-lora",
        ),
        agent_loops(num_agents=count(35), seed=seed, arrival_rate_per_s=rate, cache_salt="agents"),
    ]
    return list(heapq.merge(*parts, key=lambda request: request.arrival_s))


# -- generator helpers -------------------------------------------------------------------------


def _rngs(seed: int) -> tuple[np.random.Generator, np.random.Generator]:
    # Separate streams, so that changing the arrival rate does not change the prompts.
    structure, arrival = np.random.SeedSequence(seed).spawn(2)
    return np.random.default_rng(structure), np.random.default_rng(arrival)


def _zipf_weights(n: int, alpha: float, *, normalized: bool = False) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    return weights / weights.sum() if normalized else weights


def _draw(rng: np.random.Generator, bounds: tuple[int, int], size: int) -> np.ndarray:
    return rng.integers(bounds[0], bounds[1] + 1, size=size)


def _draw_one(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    low, high = bounds
    return low if low == high else int(rng.integers(low, high + 1))


def _session_schedule(
    rng: np.random.Generator, lengths: np.ndarray, zipf_alpha: float
) -> list[int]:
    """The session of each request, in order: Zipf popularity over unfinished sessions."""
    weights = _zipf_weights(len(lengths), zipf_alpha)
    remaining = lengths.astype(np.int64)
    schedule: list[int] = []
    for _ in range(int(remaining.sum())):
        cumulative = np.cumsum(weights)
        index = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
        if index >= len(weights) or weights[index] == 0:  # rounding at the top end
            index = int(np.flatnonzero(weights)[-1])
        schedule.append(index)
        remaining[index] -= 1
        if remaining[index] == 0:
            weights[index] = 0.0
    return schedule


def _arrivals(rng: np.random.Generator, n: int, rate_per_s: float) -> list[float]:
    return np.cumsum(rng.exponential(1.0 / rate_per_s, size=n)).tolist()


def _request(
    request_id: str,
    parts: Sequence[np.ndarray],
    arrival_s: float,
    cache_salt: str | None,
    lora_name: str | None,
    output_tokens: int,
) -> Request:
    tokens = np.concatenate(parts)
    tokens.flags.writeable = False  # fresh and int32: Request keeps it without a copy
    return Request(request_id, tokens, arrival_s, cache_salt, lora_name, output_tokens)


def _check_count(value: object, name: str) -> None:
    if not _is_int(value) or value <= 0:
        raise ConfigurationError(f"{name} must be an int > 0, got {value!r}")


def _check_range(value: object, name: str, minimum: int) -> tuple[int, int]:
    if _is_int(value):
        low = high = value
    elif (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and _is_int(value[0])
        and _is_int(value[1])
    ):
        low, high = value
    else:
        raise ConfigurationError(
            f"{name} must be an int or an inclusive (low, high) pair of ints, got {value!r}"
        )
    assert isinstance(low, int) and isinstance(high, int)
    if not minimum <= low <= high:
        raise ConfigurationError(f"{name} must satisfy {minimum} <= low <= high, got {value!r}")
    return low, high


def _check_common(
    zipf_alpha: object,
    seed: object,
    vocab_size: object,
    arrival_rate_per_s: object,
    cache_salt: object,
    lora_name: object,
) -> None:
    if (
        isinstance(zipf_alpha, bool)
        or not isinstance(zipf_alpha, (int, float))
        or not 0 <= zipf_alpha < math.inf
    ):
        raise ConfigurationError(
            f"zipf_alpha must be a number >= 0 (0 = uniform), got {zipf_alpha!r}"
        )
    if not _is_int(seed) or seed < 0:
        raise ConfigurationError(f"seed must be an int >= 0, got {seed!r}")
    _check_vocab_size(vocab_size)
    if (
        isinstance(arrival_rate_per_s, bool)
        or not isinstance(arrival_rate_per_s, (int, float))
        or not 0 < arrival_rate_per_s < math.inf
    ):
        raise ConfigurationError(
            f"arrival_rate_per_s must be a finite number > 0, got {arrival_rate_per_s!r}"
        )
    for value, name in ((cache_salt, "cache_salt"), (lora_name, "lora_name")):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigurationError(f"{name} must be a non-empty str or None, got {value!r}")
