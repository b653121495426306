"""Workload traces for replay: requests, synthetic generators, and a JSONL file format.

A trace is a sequence of :class:`Request` objects, each a full prompt (token ids) plus the
extra keys that decide prefix sharing (cache salt, LoRA name). Shared parts of prompts (system
prompts, tool prompts, documents) are identical token for token across requests, so their
hash blocks match; every other part is unique to its request, conversation or agent.

Generators
----------
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
ratio of an unbounded cache, :func:`trace_summary`). Prompts stay under 4,096 tokens; the
generators take about 0.1 s per thousand requests.

Token contents
--------------
Every part of a prompt is a *segment* whose tokens are a pure function of a name, so the same
name always expands to the same tokens (in any process, with any numpy version)::

    named segment (name, n):      stream = SHAKE-256(b"tiering:segment:v1:" || utf8(name))
    random segment i of request R: stream = SHAKE-256(b"tiering:random:v1:"
                                                      || u32le(len(utf8(R))) || utf8(R)
                                                      || u32le(i))
    token j = u32le(stream[4j : 4j + 4]) mod vocab_size,      j = 0 .. n - 1

``u32le`` is a 4-byte little-endian unsigned int, ``i`` the 0-based position of the segment in
the request's segment list, ``vocab_size`` 128,000 unless given (at most 2**31). A shorter
segment of a name is a prefix of a longer one (SHAKE-256 is an extendable-output function).
The modulo bias is below 3e-5 and irrelevant for hashing. The generators name their segments
``"chat/sys/{k}"``, ``"chat/s{seed}/c{conversation}/u{turn}"``, ``"rag/doc/{d}"``,
``"agent/tools"`` etc.

JSONL trace files
-----------------
UTF-8, one JSON object per line; blank lines are skipped. Fields:

``id`` (required)
    The request id: a non-empty string (an integer is taken as its decimal string). Ids must
    be unique within a file.
``tokens`` or ``segments`` (exactly one is required)
    ``tokens``: the prompt as a non-empty list of int token ids in ``[0, 2**32 - 1]``.
    ``segments``: a compact description, a non-empty list of segments concatenated in order:
    ``{"name": "sys-1", "tokens": 2048}`` expands to the named segment (same name, same
    tokens, in every request and file); ``{"random": 40}`` to 40 tokens unique to this
    request (derived from its id, so re-reading the file gives the same tokens).
``salt``, ``lora`` (optional, string or null)
    The cache salt (an empty salt means no salt) and the LoRA adapter name (non-empty).
``output_tokens`` (optional int >= 0, default 0)
    Tokens generated after the prompt.
``arrival_s`` (optional number >= 0, default 0)
    Arrival time in seconds from the start of the trace.

Example::

    {"id": "r1", "segments": [{"name": "sys-1", "tokens": 2048}, {"random": 40}], "arrival_s": 0}
    {"id": "r2", "tokens": [101, 7, 9931], "salt": "tenant-a", "lora": null, "arrival_s": 0.25}

:func:`read_jsonl` raises :class:`TraceError` naming the file, the line number and the field for
the first bad line; :func:`write_jsonl` writes the explicit ``tokens`` form.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from tiering.config import BUILTIN_TRACES, SCALES
from tiering.core.hashing import ExtraKeys, PrefixHasher
from tiering.errors import ConfigurationError, TieringError

__all__ = [
    "BUILTIN_TRACES",
    "DEFAULT_VOCAB_SIZE",
    "SCALES",
    "IntRange",
    "Request",
    "TraceError",
    "agent_loops",
    "builtin_trace",
    "hash_requests",
    "multi_turn_chat",
    "rag",
    "random_segment_tokens",
    "read_jsonl",
    "segment_tokens",
    "trace_summary",
    "write_jsonl",
]

DEFAULT_VOCAB_SIZE = 128_000

#: A token count: a fixed int, or an inclusive ``(low, high)`` range drawn uniformly.
IntRange = int | tuple[int, int]

_MAX_TOKEN_ID = 2**32 - 1
_MAX_VOCAB_SIZE = 2**31  # generated and expanded tokens are int32
_SEGMENT_TAG = b"tiering:segment:v1:"
_RANDOM_TAG = b"tiering:random:v1:"
_TOKEN_BYTES = 4
_SCALE_FACTORS = {"tiny": 0.1, "demo": 1.0, "large": 5.0}
_DEFAULT_RATE_PER_S = 10.0


class TraceError(TieringError, ValueError):
    """A request or a trace file is invalid.

    The message names the bad field and value and what is valid; for a file it starts with
    ``path:line:``. The parts are also available as ``reason``, ``field``, ``path``, ``line``.
    """

    def __init__(
        self,
        reason: str,
        *,
        field: str | None = None,
        path: str | None = None,
        line: int | None = None,
    ) -> None:
        self.reason = reason
        self.field = field
        self.path = path
        self.line = line
        where = f"{path}:{line}: " if path is not None else ""
        what = f"field {field!r}: " if field is not None else ""
        super().__init__(f"{where}{what}{reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        kwargs = {"field": self.field, "path": self.path, "line": self.line}
        return (_rebuild_trace_error, (self.reason, kwargs))


def _rebuild_trace_error(reason: str, kwargs: dict[str, Any]) -> TraceError:
    return TraceError(reason, **kwargs)


# -- requests ----------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Request:
    """One request of a trace: the full prompt and what else decides its prefix hashes.

    ``token_ids`` is stored as a read-only 1-D ``int32`` array (``int64`` if an id needs it);
    a writeable input array is copied. ``output_tokens`` counts the tokens generated after the
    prompt (the next turn of a chat includes them). ``arrival_s`` is seconds from the start of
    the trace. An empty ``cache_salt`` is stored as ``None``. Raises :class:`TraceError` naming
    the bad field. Equality compares every field, tokens by value.
    """

    request_id: str
    token_ids: np.ndarray
    arrival_s: float = 0.0
    cache_salt: str | None = None
    lora_name: str | None = None
    output_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise TraceError(
                f"must be a non-empty str, got {self.request_id!r:.80}", field="request_id"
            )
        object.__setattr__(self, "token_ids", _checked_tokens(self.token_ids))
        arrival = self.arrival_s
        if (
            isinstance(arrival, bool)
            or not isinstance(arrival, (int, float))
            or not math.isfinite(arrival)
            or arrival < 0
        ):
            raise TraceError(
                f"must be a finite number of seconds >= 0, got {arrival!r:.80}", field="arrival_s"
            )
        object.__setattr__(self, "arrival_s", float(arrival))
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise TraceError(
                f"must be a str or None, got {type(self.cache_salt).__name__}", field="cache_salt"
            )
        if not self.cache_salt:
            object.__setattr__(self, "cache_salt", None)
        if self.lora_name is not None and (
            not isinstance(self.lora_name, str) or not self.lora_name
        ):
            raise TraceError(
                f"must be a non-empty str or None, got {self.lora_name!r:.80}", field="lora_name"
            )
        if not _is_int(self.output_tokens) or self.output_tokens < 0:
            raise TraceError(
                f"must be an int >= 0, got {self.output_tokens!r:.80}", field="output_tokens"
            )

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def extra_keys(self) -> ExtraKeys:
        """The extra keys to hash this request's blocks with (LoRA name, cache salt)."""
        return ExtraKeys(lora_name=self.lora_name, cache_salt=self.cache_salt)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Request):
            return NotImplemented
        return (
            self.request_id == other.request_id
            and self.arrival_s == other.arrival_s
            and self.cache_salt == other.cache_salt
            and self.lora_name == other.lora_name
            and self.output_tokens == other.output_tokens
            and np.array_equal(self.token_ids, other.token_ids)
        )

    def __hash__(self) -> int:
        return hash((self.request_id, len(self.token_ids)))


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _checked_tokens(tokens: object, field: str = "token_ids") -> np.ndarray:
    """``tokens`` as a read-only 1-D int32 (or int64) array; raises :class:`TraceError`."""
    if isinstance(tokens, np.ndarray):
        array = tokens
    elif isinstance(tokens, (list, tuple)):
        for i, token in enumerate(tokens):
            if not _is_int(token):
                raise TraceError(
                    f"token {i} is {token!r:.40}; token ids must be ints in [0, {_MAX_TOKEN_ID}]",
                    field=field,
                )
        try:
            array = np.array(tokens, dtype=np.int64)
        except OverflowError:
            raise TraceError(f"a token id is beyond [0, {_MAX_TOKEN_ID}]", field=field) from None
    else:
        raise TraceError(
            f"must be a 1-D integer numpy array or a list of ints, got {type(tokens).__name__}",
            field=field,
        )
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TraceError(
            f"must be a 1-D integer array, got shape {array.shape} dtype {array.dtype}",
            field=field,
        )
    if not len(array):
        raise TraceError("a prompt needs at least one token", field=field)
    low, high = int(array.min()), int(array.max())
    if low < 0 or high > _MAX_TOKEN_ID:
        bad = int(np.flatnonzero((array < 0) | (array > _MAX_TOKEN_ID))[0])
        raise TraceError(
            f"token {bad} is {int(array[bad])}; token ids must be ints in [0, {_MAX_TOKEN_ID}]",
            field=field,
        )
    dtype = np.int32 if high <= np.iinfo(np.int32).max else np.int64
    if array.dtype != dtype or array.flags.writeable:
        array = array.astype(dtype)  # a copy: the caller's array stays the caller's
    array.flags.writeable = False
    return array


# -- segment contents --------------------------------------------------------------------------


def segment_tokens(name: str, num_tokens: int, vocab_size: int = DEFAULT_VOCAB_SIZE) -> np.ndarray:
    """The ``num_tokens`` tokens of the named segment ``name`` (see the module docstring)."""
    if not isinstance(name, str) or not name:
        raise TraceError(f"a segment name must be a non-empty str, got {name!r:.80}", field="name")
    return _stream_tokens(_SEGMENT_TAG + name.encode("utf-8"), num_tokens, vocab_size)


def random_segment_tokens(
    request_id: str, index: int, num_tokens: int, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> np.ndarray:
    """The tokens of ``{"random": num_tokens}`` at position ``index`` of request ``request_id``."""
    if not isinstance(request_id, str) or not request_id:
        raise TraceError(f"must be a non-empty str, got {request_id!r:.80}", field="request_id")
    if not _is_int(index) or not 0 <= index < 2**32:
        raise TraceError(f"must be an int in [0, 2**32), got {index!r:.40}", field="index")
    rid = request_id.encode("utf-8")
    seed = _RANDOM_TAG + len(rid).to_bytes(4, "little") + rid + index.to_bytes(4, "little")
    return _stream_tokens(seed, num_tokens, vocab_size)


def _stream_tokens(seed: bytes, num_tokens: int, vocab_size: int) -> np.ndarray:
    if not _is_int(num_tokens) or num_tokens <= 0:
        raise TraceError(f"must be an int > 0, got {num_tokens!r:.40}", field="tokens")
    _check_vocab_size(vocab_size)
    stream = hashlib.shake_256(seed).digest(_TOKEN_BYTES * num_tokens)
    tokens = np.frombuffer(stream, dtype="<u4") % np.uint32(vocab_size)
    out = tokens.astype(np.int32)  # vocab_size <= 2**31: every id fits
    out.flags.writeable = False
    return out


def _check_vocab_size(vocab_size: object) -> None:
    if not _is_int(vocab_size) or not 1 <= vocab_size <= _MAX_VOCAB_SIZE:
        raise ConfigurationError(f"vocab_size must be an int in [1, 2**31], got {vocab_size!r}")


# -- generators --------------------------------------------------------------------------------


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


# -- JSONL -------------------------------------------------------------------------------------

_JSON_FIELDS = ("id", "tokens", "segments", "salt", "lora", "output_tokens", "arrival_s")
# Request field -> JSON field, to name the file's field when Request rejects a value.
_JSON_NAME = {
    "request_id": "id",
    "token_ids": "tokens",
    "cache_salt": "salt",
    "lora_name": "lora",
    "output_tokens": "output_tokens",
    "arrival_s": "arrival_s",
}


def read_jsonl(
    path: str | os.PathLike[str], *, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Iterator[Request]:
    """The requests of a JSONL trace file (format in the module docstring), lazily.

    ``vocab_size`` bounds the tokens that ``segments`` expand to. Raises
    ``FileNotFoundError`` at once if the file does not exist, and :class:`TraceError` naming
    ``path:line`` and the field when iteration reaches a bad line (the requests before it
    have been yielded).
    """
    _check_vocab_size(vocab_size)
    trace_path = Path(path)
    if not trace_path.is_file():
        raise FileNotFoundError(errno.ENOENT, "no such trace file", str(trace_path))
    return _read_jsonl(trace_path, vocab_size)


def _read_jsonl(path: Path, vocab_size: int) -> Iterator[Request]:
    first_line_of_id: dict[str, int] = {}
    with path.open("rb") as file:
        for line_number, raw in enumerate(file, start=1):
            try:
                text = raw.decode("utf-8")
                if not text.strip():
                    continue
                try:
                    obj = json.loads(text)
                except json.JSONDecodeError as exc:
                    raise TraceError(f"invalid JSON: {exc.msg} (column {exc.colno})") from None
                request = _parse_request(obj, vocab_size)
            except UnicodeDecodeError as exc:
                raise TraceError(
                    f"not UTF-8: {exc.reason} at byte {exc.start}", path=str(path), line=line_number
                ) from None
            except TraceError as exc:
                raise TraceError(
                    exc.reason, field=exc.field, path=str(path), line=line_number
                ) from None
            first = first_line_of_id.setdefault(request.request_id, line_number)
            if first != line_number:
                raise TraceError(
                    f"duplicate request id {request.request_id!r} (first on line {first})",
                    field="id",
                    path=str(path),
                    line=line_number,
                )
            yield request


def _parse_request(obj: object, vocab_size: int) -> Request:
    if not isinstance(obj, dict):
        raise TraceError(f"a line must hold a JSON object, got a JSON {_json_type(obj)}")
    unknown = [key for key in obj if key not in _JSON_FIELDS]
    if unknown:
        raise TraceError(
            f"unknown field; valid fields: {', '.join(_JSON_FIELDS)}", field=unknown[0]
        )
    if "id" not in obj:
        raise TraceError("missing; every request needs an id", field="id")
    request_id = obj["id"]
    if _is_int(request_id):
        request_id = str(request_id)
    elif not isinstance(request_id, str) or not request_id:
        raise TraceError(f"must be a non-empty string, got {request_id!r:.80}", field="id")
    has_tokens, has_segments = "tokens" in obj, "segments" in obj
    if has_tokens == has_segments:
        raise TraceError(
            "give exactly one of 'tokens' (a list of token ids) and 'segments' "
            f"(a compact description), got {'both' if has_tokens else 'neither'}"
        )
    if has_tokens:
        tokens = obj["tokens"]
        if not isinstance(tokens, list):
            raise TraceError(
                f"must be a list of token ids, got a JSON {_json_type(tokens)}", field="tokens"
            )
        token_ids = _checked_tokens(tokens, field="tokens")
    else:
        token_ids = _expand_segments(obj["segments"], request_id, vocab_size)
    for key in ("salt", "lora"):
        value = obj.get(key)
        if value is not None and not isinstance(value, str):
            raise TraceError(f"must be a string or null, got a JSON {_json_type(value)}", field=key)
    try:
        return Request(
            request_id=request_id,
            token_ids=token_ids,
            arrival_s=obj.get("arrival_s", 0.0),
            cache_salt=obj.get("salt"),
            lora_name=obj.get("lora"),
            output_tokens=obj.get("output_tokens", 0),
        )
    except TraceError as exc:
        field = _JSON_NAME.get(exc.field, exc.field) if exc.field is not None else None
        raise TraceError(exc.reason, field=field) from None


def _expand_segments(segments: object, request_id: str, vocab_size: int) -> np.ndarray:
    if not isinstance(segments, list) or not segments:
        raise TraceError(
            f"must be a non-empty list of segments, got {segments!r:.80}", field="segments"
        )
    parts = []
    for i, segment in enumerate(segments):
        where = f"segments[{i}]"
        if isinstance(segment, dict) and set(segment) == {"name", "tokens"}:
            name, count = segment["name"], segment["tokens"]
            if not isinstance(name, str) or not name:
                raise TraceError(
                    f"must be a non-empty string, got {name!r:.80}", field=f"{where}.name"
                )
            if not _is_int(count) or count <= 0:
                raise TraceError(f"must be an int > 0, got {count!r:.40}", field=f"{where}.tokens")
            parts.append(segment_tokens(name, count, vocab_size))
        elif isinstance(segment, dict) and set(segment) == {"random"}:
            count = segment["random"]
            if not _is_int(count) or count <= 0:
                raise TraceError(f"must be an int > 0, got {count!r:.40}", field=f"{where}.random")
            parts.append(random_segment_tokens(request_id, i, count, vocab_size))
        else:
            raise TraceError(
                'a segment must be {"name": str, "tokens": int} or {"random": int}, '
                f"got {segment!r:.80}",
                field=where,
            )
    return np.concatenate(parts)


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def write_jsonl(requests: Iterable[Request], path: str | os.PathLike[str]) -> int:
    """Write ``requests`` to ``path`` in the explicit ``tokens`` form; return how many.

    The file is written beside ``path`` and renamed into place, so a failure (an item that is
    not a :class:`Request`, a full disk) leaves no partial file and any old file unchanged.
    """
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    written = 0
    try:
        with partial.open("w", encoding="utf-8") as file:
            for request in requests:
                if not isinstance(request, Request):
                    raise TraceError(f"item {written} is a {type(request).__name__}, not a Request")
                record = {
                    "id": request.request_id,
                    "tokens": request.token_ids.tolist(),
                    "salt": request.cache_salt,
                    "lora": request.lora_name,
                    "output_tokens": request.output_tokens,
                    "arrival_s": request.arrival_s,
                }
                file.write(json.dumps(record, separators=(",", ":")))
                file.write("\n")
                written += 1
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return written


# -- hashing and summaries ---------------------------------------------------------------------


def hash_requests(requests: Iterable[Request], hasher: PrefixHasher) -> Iterator[list[bytes]]:
    """Per request, the digests of its full hash blocks (with its salt and LoRA name)."""
    for request in requests:
        yield hasher.hash_blocks(request.token_ids, request.extra_keys)


def trace_summary(
    requests: Iterable[Request], hash_block_size: int, algorithm: str = "sha256"
) -> dict[str, Any]:
    """Sizes of a trace and how much of it an unbounded prefix cache could reuse.

    Keys: ``requests``, ``prompt_tokens``, ``output_tokens``, ``mean_prompt_tokens``,
    ``max_prompt_tokens``, ``hash_block_size``, ``hash_blocks`` (full blocks accessed),
    ``unique_hash_blocks``, ``compulsory_miss_ratio`` (unique / accessed blocks: the miss
    ratio of an unbounded cache), ``cache_salts`` and ``lora_names`` (distinct values).
    Consumes ``requests`` once.
    """
    hasher = PrefixHasher(hash_block_size, algorithm)
    num_requests = prompt_tokens = output = max_prompt = blocks = 0
    unique: set[bytes] = set()
    salts: set[str] = set()
    loras: set[str] = set()
    for request in requests:
        num_requests += 1
        prompt_tokens += request.num_prompt_tokens
        max_prompt = max(max_prompt, request.num_prompt_tokens)
        output += request.output_tokens
        if request.cache_salt is not None:
            salts.add(request.cache_salt)
        if request.lora_name is not None:
            loras.add(request.lora_name)
        digests = hasher.hash_blocks(request.token_ids, request.extra_keys)
        blocks += len(digests)
        unique.update(digests)
    return {
        "requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output,
        "mean_prompt_tokens": prompt_tokens / num_requests if num_requests else 0.0,
        "max_prompt_tokens": max_prompt,
        "hash_block_size": hash_block_size,
        "hash_blocks": blocks,
        "unique_hash_blocks": len(unique),
        "compulsory_miss_ratio": len(unique) / blocks if blocks else 0.0,
        "cache_salts": len(salts),
        "lora_names": len(loras),
    }
