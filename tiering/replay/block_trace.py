"""Block-level traces: the Mooncake JSONL format, and requests described by block ids.

Production KV-cache traces do not ship prompts; they ship one id per fixed-size block of each
prompt, equal ids meaning a reusable block. The public Mooncake traces (FAST'25, from Kimi's
serving) set the format the field's tools share (Mooncake's simulator, Dynamo's load
generators, SGLang's benchmarks). A :class:`BlockRequest` is one such request; the realistic
generators of :mod:`tiering.replay.workloads` produce them too.

Mooncake JSONL
--------------
UTF-8, one JSON object per line, blank lines skipped::

    {"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

``timestamp`` (required)
    Arrival in milliseconds from the start of the trace, a number >= 0. Requests are ordered
    by it (stably: lines with equal timestamps keep their file order).
``input_length`` (required)
    Prompt tokens, an int > 0.
``output_length`` (optional, default 0)
    Generated tokens, an int >= 0.
``hash_ids`` (required)
    A non-empty list of ints >= 0, one per block of ``block_tokens`` prompt tokens (512 in the
    Mooncake traces; the last block may be partial). Equal ids at the same prefix mean the same
    tokens. tiering chains ids along each prompt (a block's key names its whole prefix, as an
    engine's prefix hashes do), so ids need not be unique across prefixes.

``continues`` (optional, true, false or null; tiering's, not Mooncake's)
    The client's hint: a later request is expected to continue this one, or none is. The
    study and the replay give it to the policy with the request; absent: not known.

Other fields (``session_id``, ``delay`` of other tools) are ignored. A file is a block trace
when its first non-blank line has ``hash_ids``; otherwise it is tiering's own JSONL
(:mod:`tiering.replay.traces`). :func:`read_block_trace` raises :class:`TraceError` naming the
file, the line and the field of the first bad line; a line with more ids than its
``input_length`` fills at the block size read, plus one, is one (the block size is wrong).

Qwen-Bailian JSONL
------------------
The public Alibaba Bailian traces (``alibaba-edu/qwen-bailian-usagetraces-anon``) are block
traces too: a line also has ``chat_id`` (which tells the format apart), ``parent_chat_id``,
``turn`` and ``type`` (ignored here), its ``timestamp`` is in *seconds*, and each id names 16
tokens::

    {"chat_id": 7, "parent_chat_id": -1, "timestamp": 12.5, "input_length": 40,
     "output_length": 9, "type": "text", "turn": 1, "hash_ids": [1, 2, 3]}

Every other rule is Mooncake's. :data:`MOONCAKE` and :data:`QWEN_BAILIAN` hold each format's
unit and block size; :func:`block_trace_format` tells which a file is.

Tokens for a replay. The full data path needs token ids: :func:`to_requests` expands block id
``i`` to the named segment ``"block/{i}"`` of ``block_tokens`` tokens (the last block cut to the
prompt's length; missing blocks padded with tokens unique to the request), so equal ids give
equal tokens and equal prefix hashes at any hash block size that divides ``block_tokens``.
"""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tiering.errors import ConfigurationError
from tiering.replay.traces import (
    DEFAULT_VOCAB_SIZE,
    Request,
    TraceError,
    random_segment_tokens,
    segment_tokens,
)

__all__ = [
    "DEFAULT_BLOCK_TOKENS",
    "MOONCAKE",
    "QWEN_BAILIAN",
    "BlockRequest",
    "BlockTrace",
    "BlockTraceFormat",
    "PrefixTrie",
    "block_summary",
    "block_trace_format",
    "is_mooncake_file",
    "open_block_trace",
    "read_block_trace",
    "read_mooncake",
    "to_requests",
    "write_mooncake",
]

#: Tokens per hash id in the Mooncake traces.
DEFAULT_BLOCK_TOKENS = 512

_REQUIRED = ("timestamp", "input_length", "hash_ids")


@dataclass(frozen=True, slots=True)
class BlockTraceFormat:
    """A block-trace format: its name, tokens per id, and the timestamp's unit."""

    name: str
    block_tokens: int
    timestamp_unit: str  # "ms" or "s"

    @property
    def seconds_per_unit(self) -> float:
        return 0.001 if self.timestamp_unit == "ms" else 1.0


#: The Mooncake FAST'25 traces: 512-token ids, timestamps in milliseconds.
MOONCAKE = BlockTraceFormat("mooncake", DEFAULT_BLOCK_TOKENS, "ms")
#: The Qwen-Bailian traces: 16-token ids, timestamps in seconds; lines carry ``chat_id``.
QWEN_BAILIAN = BlockTraceFormat("qwen-bailian", 16, "s")


@dataclass(frozen=True, slots=True)
class BlockRequest:
    """One request as a trace of block ids: ``block_ids[k]`` names prompt tokens
    ``[k * block_tokens, (k + 1) * block_tokens)`` (the last block may be partial)."""

    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    #: The client's hint, where the trace has one (``continues``): see the module docstring.
    continues: bool | None = None


def _check_block_tokens(block_tokens: object) -> int:
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise ConfigurationError(f"block tokens must be an int > 0, got {block_tokens!r}")
    return block_tokens


@dataclass(frozen=True, slots=True)
class BlockTrace:
    """The requests of a block-trace file, by arrival, and how its ids were read."""

    requests: list[BlockRequest]
    block_tokens: int
    format: BlockTraceFormat


def block_trace_format(path: str | os.PathLike[str]) -> BlockTraceFormat | None:
    """The format of ``path`` from its first non-blank line: a JSON object with ``hash_ids``
    is :data:`QWEN_BAILIAN` if it has ``chat_id`` too, else :data:`MOONCAKE`; anything else is
    not a block trace (``None``: tiering's own reader then reports the line)."""
    with Path(path).open("rb") as file:
        for raw in file:
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                return None
            if not isinstance(obj, dict) or "hash_ids" not in obj:
                return None
            return QWEN_BAILIAN if "chat_id" in obj else MOONCAKE
    return None


def is_mooncake_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a block trace (Mooncake's format or Qwen-Bailian's)."""
    return block_trace_format(path) is not None


def read_mooncake(
    path: str | os.PathLike[str], block_tokens: int | None = None
) -> list[BlockRequest]:
    """The requests of :func:`read_block_trace`."""
    return read_block_trace(path, block_tokens).requests


def read_block_trace(path: str | os.PathLike[str], block_tokens: int | None = None) -> BlockTrace:
    """The requests of a block-trace file (Mooncake or Qwen-Bailian, told by its first line),
    ordered by timestamp (stable); ``block_tokens`` per id (default: the format's).

    Raises ``FileNotFoundError`` if the file does not exist, :class:`TraceError` naming
    ``path:line`` and the field for the first bad line (a file that is no block trace fails on
    its first line), and ``ConfigurationError`` for a bad ``block_tokens``. Request ids are
    ``"line{N}"``.
    """
    tokens, fmt, lines = open_block_trace(path, block_tokens)
    requests = list(lines)
    requests.sort(key=lambda r: r.arrival_s)
    return BlockTrace(requests, tokens, fmt)


def open_block_trace(
    path: str | os.PathLike[str], block_tokens: int | None = None
) -> tuple[int, BlockTraceFormat, Iterator[BlockRequest]]:
    """A block-trace file's tokens per id and format, and its requests in **file order**, read
    as they are iterated (a reader that keeps less than every request, as the policy study,
    never holds them all).

    The file's existence, format and ``block_tokens`` are checked at once (errors as
    :func:`read_block_trace`); a bad line raises its :class:`TraceError` when it is reached.
    """
    trace_path = Path(path)
    if not trace_path.is_file():
        raise FileNotFoundError(errno.ENOENT, "no such trace file", str(trace_path))
    fmt = block_trace_format(trace_path) or MOONCAKE
    tokens = fmt.block_tokens if block_tokens is None else _check_block_tokens(block_tokens)
    return tokens, fmt, _requests_of(trace_path, fmt, tokens)


def _requests_of(trace_path: Path, fmt: BlockTraceFormat, tokens: int) -> Iterator[BlockRequest]:
    with trace_path.open("rb") as file:
        for line_number, raw in enumerate(file, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(
                    f"not UTF-8: {exc.reason} at byte {exc.start}",
                    path=str(trace_path),
                    line=line_number,
                ) from None
            if not text.strip():
                continue
            try:
                request = _parse_line(text, f"line{line_number}", fmt, tokens)
            except TraceError as exc:
                raise TraceError(
                    exc.reason, field=exc.field, path=str(trace_path), line=line_number
                ) from None
            yield request


def _parse_line(
    text: str, request_id: str, fmt: BlockTraceFormat, block_tokens: int
) -> BlockRequest:
    unit = "milliseconds" if fmt.timestamp_unit == "ms" else "seconds"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"invalid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"a {fmt.name} line must hold a JSON object")
    for name in _REQUIRED:
        if name not in obj:
            raise TraceError(
                f"missing; a {fmt.name} line needs timestamp ({fmt.timestamp_unit}), "
                "input_length and hash_ids",
                field=name,
            )
    timestamp = obj["timestamp"]
    if (
        isinstance(timestamp, bool)
        or not isinstance(timestamp, (int, float))
        or not math.isfinite(timestamp)
        or timestamp < 0
    ):
        raise TraceError(
            f"must be a number of {unit} >= 0, got {timestamp!r:.40}", field="timestamp"
        )
    input_length = obj["input_length"]
    if not _is_int(input_length) or input_length <= 0:
        raise TraceError(f"must be an int > 0, got {input_length!r:.40}", field="input_length")
    output_length = obj.get("output_length", 0)
    if not _is_int(output_length) or output_length < 0:
        raise TraceError(f"must be an int >= 0, got {output_length!r:.40}", field="output_length")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids:
        raise TraceError(f"must be a non-empty list of ints, got {ids!r:.60}", field="hash_ids")
    for i, block_id in enumerate(ids):
        if not _is_int(block_id) or block_id < 0:
            raise TraceError(f"must be an int >= 0, got {block_id!r:.40}", field=f"hash_ids[{i}]")
    fills = -(-input_length // block_tokens)
    if len(ids) > fills + 1:  # one more passes: a trace's own rounding is not a wrong size
        raise TraceError(
            f"{len(ids)} ids, but input_length {input_length} fills at most {fills} blocks of "
            f"{block_tokens} tokens: --block-tokens must be this trace's tokens per id "
            f"({fmt.name} traces: {fmt.block_tokens})",
            field="hash_ids",
        )
    continues = obj.get("continues")
    if continues is not None and type(continues) is not bool:
        raise TraceError(f"must be true, false or null, got {continues!r:.40}", field="continues")
    arrival_s = timestamp * fmt.seconds_per_unit
    return BlockRequest(request_id, arrival_s, input_length, output_length, tuple(ids), continues)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def write_mooncake(requests: Iterable[BlockRequest], path: str | os.PathLike[str]) -> int:
    """Write ``requests`` as Mooncake JSONL (timestamps in whole ms); return how many.

    Written beside ``path`` and renamed into place: a failure leaves any old file unchanged."""
    target = Path(path)
    partial = target.with_name(f".{target.name}.partial")
    written = 0
    try:
        with partial.open("w", encoding="utf-8") as file:
            for request in requests:
                record = {
                    "timestamp": round(request.arrival_s * 1000),
                    "input_length": request.input_tokens,
                    "output_length": request.output_tokens,
                    "hash_ids": list(request.block_ids),
                }
                if request.continues is not None:
                    record["continues"] = request.continues
                file.write(json.dumps(record, separators=(",", ":")))
                file.write("\n")
                written += 1
        os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return written


def to_requests(
    requests: Iterable[BlockRequest],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    *,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
) -> Iterator[Request]:
    """Token-level :class:`Request` objects for a replay (see the module docstring)."""
    _check_block_tokens(block_tokens)
    cache: dict[int, np.ndarray] = {}

    def block(block_id: int) -> np.ndarray:
        tokens = cache.get(block_id)
        if tokens is None:
            if len(cache) > 65_536:  # bounded: a long trace has millions of ids
                cache.clear()
            tokens = cache[block_id] = segment_tokens(f"block/{block_id}", block_tokens, vocab_size)
        return tokens

    for request in requests:
        parts = [block(i) for i in request.block_ids]
        have = len(parts) * block_tokens
        if have < request.input_tokens:
            parts.append(
                random_segment_tokens(
                    request.request_id, len(parts), request.input_tokens - have, vocab_size
                )
            )
        tokens = np.concatenate(parts)[: request.input_tokens]
        tokens.flags.writeable = False
        yield Request(
            request.request_id,
            tokens,
            arrival_s=request.arrival_s,
            output_tokens=request.output_tokens,
            continues=request.continues,
        )


class PrefixTrie:
    """Chains block ids along prompts: one small int key per distinct prefix.

    ``keys(ids)`` returns, per block, the key of the prefix ending there: equal keys mean equal
    whole prefixes (as an engine's chained block hashes), whatever the ids' own convention.
    ``parent[k]`` is the key of the prefix one block shorter (``-1`` for a first block).
    """

    __slots__ = ("_nodes", "parent")

    def __init__(self) -> None:
        self._nodes: dict[tuple[int, int], int] = {}
        self.parent: list[int] = []

    def __len__(self) -> int:
        return len(self.parent)

    def keys(self, ids: Sequence[int]) -> list[int]:
        nodes, parent = self._nodes, self.parent
        out: list[int] = []
        here = -1
        for block_id in ids:
            node = nodes.get((here, block_id))
            if node is None:
                node = nodes[(here, block_id)] = len(parent)
                parent.append(here)
            out.append(node)
            here = node
        return out


def block_summary(requests: Sequence[BlockRequest]) -> dict[str, float]:
    """Sizes of a block trace and the share of block references an unbounded prefix cache
    would serve (``reuse_ratio``: references to a prefix seen before, ids chained)."""
    trie = PrefixTrie()
    accesses = 0
    seen: set[int] = set()
    reused = 0
    for request in requests:
        for key in trie.keys(request.block_ids):
            accesses += 1
            if key in seen:
                reused += 1
            else:
                seen.add(key)
    count = len(requests)
    span_s = requests[-1].arrival_s - requests[0].arrival_s if count > 1 else 0.0
    return {
        "requests": count,
        "requests_per_hour": round(count / span_s * 3_600.0) if span_s > 0 else 0,
        "mean_input_tokens": round(sum(r.input_tokens for r in requests) / count) if count else 0,
        "mean_output_tokens": round(sum(r.output_tokens for r in requests) / count) if count else 0,
        "block_references": accesses,
        "unique_blocks": len(seen),
        "reuse_ratio": round(reused / accesses, 4) if accesses else 0.0,
    }
