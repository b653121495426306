"""One request of a replay trace (:class:`Request`: a full prompt plus the extra keys that
decide its prefix hashes), and :class:`TraceError`, raised for a bad request or trace file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from tiering.core.hashing import ExtraKeys
from tiering.errors import TieringError

__all__ = ["Request", "TraceError"]

_MAX_TOKEN_ID = 2**32 - 1


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
    #: The client's hint: a later request is expected to continue this one (True), none is
    #: (False), or not known (None); given to the policy with the request.
    continues: bool | None = None

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
        if self.continues is not None and type(self.continues) is not bool:
            raise TraceError(
                f"must be true, false or null, got {self.continues!r:.80}", field="continues"
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
            and self.continues == other.continues
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
