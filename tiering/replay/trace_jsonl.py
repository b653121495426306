"""JSONL trace files: tiering's own trace format, read lazily and written atomically.

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
``continues`` (optional, true, false or null)
    The client's hint: a later request is expected to continue this one (a chat session
    still open), or none is (a one-off call). The replay and the study give it to the policy
    with the request (``note_request(..., continues=...)``); null or absent: not known.

Example::

    {"id": "r1", "segments": [{"name": "sys-1", "tokens": 2048}, {"random": 40}], "arrival_s": 0}
    {"id": "r2", "tokens": [101, 7, 9931], "salt": "tenant-a", "lora": null, "arrival_s": 0.25}

:func:`read_jsonl` raises :class:`TraceError` naming the file, the line number and the field for
the first bad line; :func:`write_jsonl` writes the explicit ``tokens`` form.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from tiering.replay.trace_requests import Request, TraceError, _checked_tokens, _is_int
from tiering.replay.trace_segments import (
    DEFAULT_VOCAB_SIZE,
    _check_vocab_size,
    random_segment_tokens,
    segment_tokens,
)

__all__ = ["is_trace_file", "read_jsonl", "write_jsonl"]


def is_trace_file(trace: str) -> bool:
    """Whether a ``--trace`` value names a file (a ``.jsonl`` name or a path), not a built-in
    trace made from a scale and a seed."""
    return trace.endswith(".jsonl") or "/" in trace


_JSON_FIELDS = (
    "id",
    "tokens",
    "segments",
    "salt",
    "lora",
    "output_tokens",
    "arrival_s",
    "continues",
)
# Request field -> JSON field, to name the file's field when Request rejects a value.
_JSON_NAME = {
    "request_id": "id",
    "token_ids": "tokens",
    "cache_salt": "salt",
    "lora_name": "lora",
    "output_tokens": "output_tokens",
    "arrival_s": "arrival_s",
    "continues": "continues",
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
            continues=obj.get("continues"),
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
