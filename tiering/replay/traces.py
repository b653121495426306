"""Workload traces for replay: requests, synthetic generators, and a JSONL file format.

A trace is a sequence of :class:`Request` objects, each a full prompt (token ids) plus the
extra keys that decide prefix sharing (cache salt, LoRA name). Shared parts of prompts (system
prompts, tool prompts, documents) are identical token for token across requests, so their
hash blocks match; every other part is unique to its request, conversation or agent.

The parts live in their own modules, and this module exports them all:

- :mod:`tiering.replay.trace_requests`: :class:`Request` and :class:`TraceError`;
- :mod:`tiering.replay.trace_segments`: the tokens of named and random segments
  (:func:`segment_tokens`, :func:`random_segment_tokens`), the same in every process;
- :mod:`tiering.replay.trace_generators`: :func:`multi_turn_chat`, :func:`rag`,
  :func:`agent_loops` and the named workloads of :func:`builtin_trace`;
- :mod:`tiering.replay.trace_jsonl`: the JSONL file format (:func:`read_jsonl`,
  :func:`write_jsonl`).

Here: :func:`hash_requests` and :func:`trace_summary`, what a prefix cache sees of a trace.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from tiering.config import BUILTIN_TRACES, SCALES
from tiering.core.hashing import PrefixHasher
from tiering.replay.trace_generators import (
    IntRange,
    agent_loops,
    builtin_trace,
    multi_turn_chat,
    rag,
)
from tiering.replay.trace_jsonl import is_trace_file, read_jsonl, write_jsonl
from tiering.replay.trace_requests import Request, TraceError
from tiering.replay.trace_segments import DEFAULT_VOCAB_SIZE, random_segment_tokens, segment_tokens

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
    "is_trace_file",
    "multi_turn_chat",
    "rag",
    "random_segment_tokens",
    "read_jsonl",
    "segment_tokens",
    "trace_summary",
    "write_jsonl",
]


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
