"""The tokens of a trace's segments: every part of a prompt is a *segment* whose tokens are a
pure function of a name, so the same name always expands to the same tokens (in any process,
with any numpy version)::

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
"""

from __future__ import annotations

import hashlib

import numpy as np

from tiering.errors import ConfigurationError
from tiering.replay.trace_requests import TraceError, _is_int

__all__ = ["DEFAULT_VOCAB_SIZE", "random_segment_tokens", "segment_tokens"]

DEFAULT_VOCAB_SIZE = 128_000

_MAX_VOCAB_SIZE = 2**31  # generated and expanded tokens are int32
_SEGMENT_TAG = b"tiering:segment:v1:"
_RANDOM_TAG = b"tiering:random:v1:"
_TOKEN_BYTES = 4


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
