"""Tests of tiering.replay.traces: generators, the segment PRNG, JSONL files and summaries."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tiering.core.hashing import ExtraKeys, PrefixHasher
from tiering.errors import ConfigurationError, TieringError
from tiering.replay.traces import (
    BUILTIN_TRACES,
    Request,
    TraceError,
    agent_loops,
    builtin_trace,
    hash_requests,
    multi_turn_chat,
    rag,
    random_segment_tokens,
    read_jsonl,
    segment_tokens,
    trace_summary,
    write_jsonl,
)

BLOCK = 16


def arr(ids: list[int]) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


def ids_of(tokens: np.ndarray) -> list[int]:
    return [int(t) for t in tokens]


# -- the segment PRNG, re-implemented from the module docstring ----------------------------------


def reference_named(name: str, n: int, vocab: int = 128_000) -> list[int]:
    stream = hashlib.shake_256(b"tiering:segment:v1:" + name.encode()).digest(4 * n)
    return [v % vocab for v in struct.unpack(f"<{n}I", stream)]


def reference_random(request_id: str, index: int, n: int, vocab: int = 128_000) -> list[int]:
    rid = request_id.encode()
    seed = b"tiering:random:v1:" + struct.pack("<I", len(rid)) + rid + struct.pack("<I", index)
    stream = hashlib.shake_256(seed).digest(4 * n)
    return [v % vocab for v in struct.unpack(f"<{n}I", stream)]


def test_segment_tokens_follow_the_documented_prng() -> None:
    assert ids_of(segment_tokens("sys-1", 300)) == reference_named("sys-1", 300)
    assert ids_of(segment_tokens("sys-1", 50, vocab_size=1000)) == reference_named(
        "sys-1", 50, 1000
    )
    assert ids_of(random_segment_tokens("r7", 2, 40)) == reference_random("r7", 2, 40)
    # A shorter segment of a name is a prefix of a longer one.
    assert ids_of(segment_tokens("doc", 100)) == ids_of(segment_tokens("doc", 300))[:100]
    assert ids_of(segment_tokens("doc", 100)) != ids_of(segment_tokens("doc2", 100))
    tokens = segment_tokens("x", 10_000)
    assert tokens.dtype == np.int32 and not tokens.flags.writeable
    assert 0 <= tokens.min() and tokens.max() < 128_000


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: segment_tokens("", 4), r"field 'name': a segment name must be a non-empty str"),
        (lambda: segment_tokens("a", 0), r"field 'tokens': must be an int > 0, got 0"),
        (lambda: random_segment_tokens("r", -1, 4), r"field 'index': must be an int in"),
    ],
)
def test_segment_arguments_are_checked(call: object, match: str) -> None:
    with pytest.raises(TraceError, match=match):
        call()  # type: ignore[operator]
    for vocab_size in (0, 2**31 + 1):
        with pytest.raises(
            ConfigurationError, match=r"vocab_size must be an int in \[1, 2\*\*31\]"
        ):
            segment_tokens("a", 4, vocab_size=vocab_size)
    assert ids_of(segment_tokens("a", 4, vocab_size=2**31)) == reference_named("a", 4, 2**31)


# -- Request -------------------------------------------------------------------------------------


def test_request_normalizes_and_freezes_tokens() -> None:
    source = np.array([5, 6, 7], dtype=np.int64)
    request = Request("r", source, cache_salt="")
    assert request.token_ids.dtype == np.int32 and not request.token_ids.flags.writeable
    source[0] = 99  # the request kept a copy
    assert ids_of(request.token_ids) == [5, 6, 7]
    assert request.cache_salt is None and request.arrival_s == 0.0
    assert request.extra_keys == ExtraKeys()
    big = Request("b", arr([2**32 - 1, 0]))
    assert big.token_ids.dtype == np.int64 and ids_of(big.token_ids) == [2**32 - 1, 0]
    assert Request("r", arr([5, 6, 7])) == request
    assert Request("r", arr([5, 6, 8])) != request
    assert len({request, Request("r", arr([5, 6, 7]))}) == 1
    assert Request("r", [5, 6, 7]) == request  # type: ignore[arg-type]  # lists are accepted


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"request_id": ""}, r"field 'request_id': must be a non-empty str"),
        ({"token_ids": []}, r"field 'token_ids': a prompt needs at least one token"),
        ({"token_ids": [1, -2]}, r"field 'token_ids': token 1 is -2; token ids must be ints"),
        ({"token_ids": [1, 2**32]}, r"field 'token_ids': token 1 is 4294967296"),
        ({"token_ids": [1, 2.0]}, r"field 'token_ids': token 1 is 2.0"),
        ({"token_ids": [True]}, r"field 'token_ids': token 0 is True"),
        ({"token_ids": np.zeros((2, 2), np.int32)}, r"must be a 1-D integer array"),
        ({"token_ids": "abc"}, r"must be a 1-D integer numpy array or a list of ints"),
        ({"arrival_s": -1.0}, r"field 'arrival_s': must be a finite number of seconds >= 0"),
        ({"arrival_s": float("nan")}, r"field 'arrival_s'"),
        ({"cache_salt": b"x"}, r"field 'cache_salt': must be a str or None, got bytes"),
        ({"lora_name": ""}, r"field 'lora_name': must be a non-empty str or None"),
        ({"output_tokens": -1}, r"field 'output_tokens': must be an int >= 0, got -1"),
    ],
)
def test_request_rejects_bad_fields(kwargs: dict[str, object], match: str) -> None:
    fields: dict[str, object] = {"request_id": "r", "token_ids": [1, 2, 3], **kwargs}
    with pytest.raises(TraceError, match=match) as info:
        Request(**fields)  # type: ignore[arg-type]
    assert isinstance(info.value, TieringError) and isinstance(info.value, ValueError)


# -- generators ----------------------------------------------------------------------------------


def small_chat(seed: int = 0) -> list[Request]:
    return list(
        multi_turn_chat(
            num_conversations=12,
            turns_per_conversation=(2, 5),
            system_prompt_tokens=4 * BLOCK,
            user_turn_tokens=(5, 40),
            output_tokens=(5, 40),
            num_system_prompts=3,
            seed=seed,
        )
    )


@pytest.mark.parametrize("name", BUILTIN_TRACES)
def test_generators_are_deterministic_for_a_seed(name: str) -> None:
    first = builtin_trace(name, "tiny", seed=3)
    assert first == builtin_trace(name, "tiny", seed=3)
    other = builtin_trace(name, "tiny", seed=4)
    assert [r.token_ids.tobytes() for r in first] != [r.token_ids.tobytes() for r in other]
    assert len({r.request_id for r in first}) == len(first)  # ids are unique
    arrivals = [r.arrival_s for r in first]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0


def test_chat_turns_extend_the_previous_turn() -> None:
    requests = small_chat()
    by_conversation: dict[str, list[Request]] = {}
    for request in requests:
        conversation, turn = re.fullmatch(r"chat-s0-(c\d+)-t(\d+)", request.request_id).groups()  # type: ignore[union-attr]
        turns = by_conversation.setdefault(conversation, [])
        assert int(turn) == len(turns)  # turns of a conversation arrive in order
        turns.append(request)
    assert len(by_conversation) == 12
    for turns in by_conversation.values():
        assert 2 <= len(turns) <= 5
        for previous, current in zip(turns, turns[1:], strict=False):
            head = len(previous.token_ids)
            # prompt = previous prompt + its reply + a new user turn of 5-40 tokens
            assert np.array_equal(current.token_ids[:head], previous.token_ids)
            new_user = len(current.token_ids) - head - previous.output_tokens
            assert 5 <= new_user <= 40
            assert 5 <= previous.output_tokens <= 40


def test_chat_system_prompt_blocks_are_shared_and_the_rest_is_not() -> None:
    requests = small_chat()
    hashes = list(hash_requests(requests, PrefixHasher(BLOCK)))
    system_prompts = {tuple(h[:4]) for h in hashes}
    assert len(system_prompts) == 3  # every request starts with one of the 3 system prompts
    for digests, request in zip(hashes, requests, strict=True):
        prompt = next(
            k
            for k in range(3)
            if ids_of(request.token_ids[:64]) == ids_of(segment_tokens(f"chat/sys/{k}", 64))
        )
        assert prompt in range(3) and len(digests) == len(request.token_ids) // BLOCK
    # The first block after the system prompt belongs to one conversation only.
    conversation_of_block: dict[bytes, str] = {}
    for digests, request in zip(hashes, requests, strict=True):
        if len(digests) > 4:
            conversation = request.request_id.rsplit("-", 1)[0]
            assert conversation_of_block.setdefault(digests[4], conversation) == conversation


def test_chat_popularity_is_zipf_skewed() -> None:
    requests = list(multi_turn_chat(num_conversations=50, turns_per_conversation=10, seed=1))
    positions: dict[str, list[int]] = {}
    for position, request in enumerate(requests):
        positions.setdefault(request.request_id.rsplit("-", 1)[0], []).append(position)
    # Conversation 0 is the most popular: it finishes its 10 turns long before conversation 49.
    assert max(positions["chat-s1-c0"]) < max(positions["chat-s1-c49"])
    assert np.mean(positions["chat-s1-c0"]) < np.mean(positions["chat-s1-c49"]) / 3


def test_rag_prompts_are_instruction_documents_question() -> None:
    requests = list(
        rag(
            num_documents=30,
            document_tokens=BLOCK * 2,
            docs_per_request=(1, 3),
            question_tokens=(4, 8),
            num_requests=200,
            instruction_tokens=BLOCK,
            seed=5,
        )
    )
    instruction = ids_of(segment_tokens("rag/instruction", BLOCK))
    documents = {segment_tokens(f"rag/doc/{d}", 2 * BLOCK).tobytes(): d for d in range(30)}
    first_docs: Counter[int] = Counter()
    for request in requests:
        tokens = request.token_ids
        assert ids_of(tokens[:BLOCK]) == instruction
        k, question = divmod(len(tokens) - BLOCK, 2 * BLOCK)
        assert 1 <= k <= 3 and 4 <= question <= 8
        chosen = [
            documents[tokens[BLOCK + 2 * BLOCK * j : BLOCK + 2 * BLOCK * (j + 1)].tobytes()]
            for j in range(k)
        ]
        assert len(set(chosen)) == k  # distinct documents
        first_docs[chosen[0]] += 1
    assert first_docs.most_common(1)[0][0] == 0  # document 0 is the most popular
    # Two requests that retrieve the same first document share its hash blocks.
    hashes = list(hash_requests(requests, PrefixHasher(BLOCK)))
    first_doc_blocks = {tuple(h[:3]) for h in hashes}
    assert len(first_doc_blocks) == len(first_docs)


def test_agent_steps_grow_one_context_per_agent() -> None:
    requests = list(
        agent_loops(
            num_agents=6,
            steps_per_agent=(3, 6),
            tool_prompt_tokens=2 * BLOCK,
            step_tokens=(8, 20),
            task_tokens=BLOCK,
            action_tokens=(4, 9),
            seed=2,
        )
    )
    tools = ids_of(segment_tokens("agent/tools", 2 * BLOCK))
    last: dict[str, Request] = {}
    for request in requests:
        assert ids_of(request.token_ids[: 2 * BLOCK]) == tools
        agent = request.request_id.rsplit("-", 1)[0]
        previous = last.get(agent)
        if previous is None:
            assert 3 * BLOCK + 8 <= len(request.token_ids) <= 3 * BLOCK + 20
        else:
            head = len(previous.token_ids)
            assert np.array_equal(request.token_ids[:head], previous.token_ids)
            assert 8 <= len(request.token_ids) - head - previous.output_tokens <= 20
        assert 4 <= request.output_tokens <= 9
        last[agent] = request
    assert len(last) == 6
    # The tool prompt's blocks are shared by all agents; the task block is per agent.
    hashes = list(hash_requests(requests, PrefixHasher(BLOCK)))
    assert len({tuple(h[:2]) for h in hashes}) == 1
    assert len({h[2] for h in hashes}) == 6


def test_mixed_trace_keeps_tenants_apart() -> None:
    requests = builtin_trace("mixed", "tiny")
    kinds = Counter(r.request_id.split("-")[0] for r in requests)
    assert set(kinds) == {"chat", "rag", "agent"}
    for request in requests:
        kind = request.request_id.split("-")[0]
        assert request.lora_name == ("rag-lora" if kind == "rag" else None)
        assert request.cache_salt == ("agents" if kind == "agent" else None)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: multi_turn_chat(num_conversations=0), r"num_conversations must be an int > 0"),
        (lambda: multi_turn_chat(turns_per_conversation=(5, 2)), r"1 <= low <= high"),
        (
            lambda: multi_turn_chat(user_turn_tokens="x"),  # type: ignore[arg-type]
            r"user_turn_tokens must be an int or",
        ),
        (lambda: multi_turn_chat(zipf_alpha=-1), r"zipf_alpha must be a number >= 0"),
        (lambda: rag(num_documents=3, docs_per_request=(1, 4)), r"at least that many documents"),
        (lambda: agent_loops(arrival_rate_per_s=0), r"arrival_rate_per_s must be a finite"),
        (lambda: agent_loops(seed=-1), r"seed must be an int >= 0"),
        (lambda: agent_loops(cache_salt=""), r"cache_salt must be a non-empty str or None"),
        (lambda: builtin_trace("chats"), r"unknown built-in trace 'chats'; valid names: chat"),
        (lambda: builtin_trace("chat", "huge"), r"unknown trace scale 'huge'; valid scales"),
    ],
)
def test_generator_arguments_are_checked_at_call_time(call: object, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        call()  # type: ignore[operator]  # no next(): generators check before the first request


@pytest.mark.parametrize("name", BUILTIN_TRACES)
def test_demo_scale_sizes(name: str) -> None:
    summary = trace_summary(builtin_trace(name, "demo"), hash_block_size=BLOCK)
    assert 1_000 <= summary["requests"] <= 3_000
    assert 1_000 <= summary["mean_prompt_tokens"] <= 2_000
    assert summary["max_prompt_tokens"] <= 4_096
    assert summary["hash_blocks"] == pytest.approx(summary["prompt_tokens"] / BLOCK, rel=0.01)
    assert 0.01 < summary["compulsory_miss_ratio"] < 0.7  # much reuse, but not all
    tiny = trace_summary(builtin_trace(name, "tiny"), hash_block_size=BLOCK)
    assert tiny["requests"] <= summary["requests"] / 5


def test_trace_summary_counts_blocks_exactly() -> None:
    shared = list(range(32))
    requests = [
        Request("a", arr([*shared, 100, 101])),  # blocks: s0 s1 (2 tokens left over)
        Request("b", arr(shared + list(range(200, 216)))),  # s0 s1 + 1 new
        Request("c", arr(shared), cache_salt="t"),  # salted: 2 new
        Request("d", arr(shared[:20]), lora_name="l", output_tokens=7),  # 1 new (LoRA)
    ]
    summary = trace_summary(requests, hash_block_size=16)
    assert summary == {
        "requests": 4,
        "prompt_tokens": 34 + 48 + 32 + 20,
        "output_tokens": 7,
        "mean_prompt_tokens": (34 + 48 + 32 + 20) / 4,
        "max_prompt_tokens": 48,
        "hash_block_size": 16,
        "hash_blocks": 2 + 3 + 2 + 1,
        "unique_hash_blocks": 2 + 1 + 2 + 1,
        "compulsory_miss_ratio": 6 / 8,
        "cache_salts": 1,
        "lora_names": 1,
    }


# -- JSONL ---------------------------------------------------------------------------------------


def test_jsonl_round_trip(tmp_path: Path) -> None:
    requests = builtin_trace("mixed", "tiny")
    requests.append(Request("wide", arr([2**32 - 1, 3]), arrival_s=1e9, output_tokens=0))
    path = tmp_path / "trace.jsonl"
    assert write_jsonl(requests, path) == len(requests)
    assert list(read_jsonl(path)) == requests
    assert list(read_jsonl(str(path))) == requests
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"id", "tokens", "salt", "lora", "output_tokens", "arrival_s"}


def test_compact_segments_expand_deterministically(tmp_path: Path) -> None:
    lines = [
        {"id": "r1", "segments": [{"name": "sys-1", "tokens": 40}, {"random": 10}]},
        {
            "id": "r2",
            "segments": [{"name": "sys-1", "tokens": 40}, {"random": 10}, {"random": 10}],
            "salt": "tenant",
            "lora": "adapter",
            "output_tokens": 12,
            "arrival_s": 2,
        },
        {"id": 3, "segments": [{"name": "sys-1", "tokens": 24}]},
        "",  # blank lines are skipped
    ]
    path = tmp_path / "compact.jsonl"
    path.write_text("\n".join(json.dumps(x) if x else "" for x in lines) + "\n")
    r1, r2, r3 = read_jsonl(path)
    assert list(read_jsonl(path)) == [r1, r2, r3]  # the same tokens on every read
    sys_1 = reference_named("sys-1", 40)
    assert ids_of(r1.token_ids) == sys_1 + reference_random("r1", 1, 10)
    assert ids_of(r2.token_ids) == (
        sys_1 + reference_random("r2", 1, 10) + reference_random("r2", 2, 10)
    )
    assert ids_of(r3.token_ids) == sys_1[:24] and r3.request_id == "3"
    assert ids_of(r1.token_ids[40:]) != ids_of(r2.token_ids[40:50])  # random parts differ
    assert (r2.cache_salt, r2.lora_name, r2.output_tokens, r2.arrival_s) == (
        "tenant",
        "adapter",
        12,
        2.0,
    )
    small = list(read_jsonl(path, vocab_size=100))
    assert ids_of(small[0].token_ids)[:40] == reference_named("sys-1", 40, 100)


GOOD = '{"id": "ok", "tokens": [1, 2, 3]}'


@pytest.mark.parametrize(
    ("bad_line", "field", "reason"),
    [
        ('{"id": "x", "tokens": [1, 2', None, r"invalid JSON: .* \(column \d+\)"),
        ("[1, 2, 3]", None, r"a line must hold a JSON object, got a JSON array"),
        ('{"id": "x", "tokens": [1], "tokenz": [1]}', "tokenz", r"unknown field; valid fields"),
        ('{"tokens": [1]}', "id", r"missing; every request needs an id"),
        ('{"id": "", "tokens": [1]}', "id", r"must be a non-empty string"),
        ('{"id": "ok", "tokens": [1]}', "id", r"duplicate request id 'ok' \(first on line 1\)"),
        ('{"id": "x"}', None, r"give exactly one of 'tokens'.*got neither"),
        ('{"id": "x", "tokens": [1], "segments": []}', None, r"give exactly one of .*got both"),
        (
            '{"id": "x", "tokens": "1 2"}',
            "tokens",
            r"must be a list of token ids, got a JSON string",
        ),
        ('{"id": "x", "tokens": []}', "tokens", r"a prompt needs at least one token"),
        ('{"id": "x", "tokens": [1, -5]}', "tokens", r"token 1 is -5"),
        ('{"id": "x", "tokens": [1, 2.5]}', "tokens", r"token 1 is 2.5"),
        ('{"id": "x", "tokens": [1, 99999999999999999999999]}', "tokens", r"a token id is beyond"),
        ('{"id": "x", "tokens": [1], "salt": 5}', "salt", r"must be a string or null"),
        ('{"id": "x", "tokens": [1], "lora": ""}', "lora", r"must be a non-empty str or None"),
        (
            '{"id": "x", "tokens": [1], "output_tokens": -3}',
            "output_tokens",
            r"must be an int >= 0",
        ),
        (
            '{"id": "x", "tokens": [1], "output_tokens": true}',
            "output_tokens",
            r"must be an int >= 0",
        ),
        (
            '{"id": "x", "tokens": [1], "arrival_s": "soon"}',
            "arrival_s",
            r"must be a finite number",
        ),
        ('{"id": "x", "segments": []}', "segments", r"must be a non-empty list of segments"),
        (
            '{"id": "x", "segments": [{"random": 3}, {"name": "a"}]}',
            "segments[1]",
            r'a segment must be \{"name": str, "tokens": int\} or \{"random": int\}',
        ),
        (
            '{"id": "x", "segments": [{"name": "a", "tokens": 0}]}',
            "segments[0].tokens",
            r"must be an int > 0, got 0",
        ),
        (
            '{"id": "x", "segments": [{"name": 7, "tokens": 3}]}',
            "segments[0].name",
            r"must be a non-empty string, got 7",
        ),
        (
            '{"id": "x", "segments": [{"random": 1.5}]}',
            "segments[0].random",
            r"must be an int > 0, got 1.5",
        ),
    ],
)
def test_bad_lines_name_file_line_and_field(
    tmp_path: Path, bad_line: str, field: str | None, reason: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD}\n\n{bad_line}\n{GOOD.replace('ok', 'after')}\n")
    requests = read_jsonl(path)
    assert next(requests).request_id == "ok"  # lazily: lines before the bad one are yielded
    where = re.escape(f"{path}:3: ") + (re.escape(f"field {field!r}: ") if field else "")
    with pytest.raises(TraceError, match=f"^{where}{reason}") as info:
        next(requests)
    assert (info.value.path, info.value.line, info.value.field) == (str(path), 3, field)
    assert isinstance(info.value, ValueError)


def test_non_utf8_line_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b'\n{"id": "\xe9", "tokens": [1]}\n')
    with pytest.raises(TraceError, match=re.escape(f"{path}:2: ") + "not UTF-8"):
        list(read_jsonl(path))
    with pytest.raises(FileNotFoundError, match="no such trace file"):
        read_jsonl(tmp_path / "missing.jsonl")  # at once, not on the first next()


def test_write_rejects_non_requests_and_keeps_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_jsonl([Request("old", arr([9]))], path)
    before = path.read_bytes()
    with pytest.raises(TraceError, match=r"item 1 is a dict, not a Request"):
        write_jsonl([Request("a", arr([1])), {"id": "b"}], path)  # type: ignore[list-item]
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.jsonl"]  # no partial file left
