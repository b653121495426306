"""Prefix hashing: chained, reproducible hashes of a request's token blocks.

Token ids are cut into *hash blocks* of ``hash_block_size`` tokens. Every **full** hash block
gets a digest that covers its parent's digest, its tokens and its extra keys (LoRA name,
multimodal items); a trailing partial block gets none. Because each digest covers its parent,
the digest of block ``i`` identifies the whole prefix ``tokens[: (i + 1) * hash_block_size]``.
:meth:`tiering.core.groups.KVCacheSpec.offload_keys` turns these digests into per-group offload
keys.

Unlike vLLM's default scheme there is no pickle, no builtin ``hash()`` and no random root: the
same tokens and extra keys give the same digests in every process and on every machine, with or
without ``PYTHONHASHSEED``, so tiers shared between processes or hosts can be looked up.

Algorithms
----------
``"sha256"`` (default, 32-byte digests)
    Collision resistant: safe when tenants must not be able to forge a collision with another
    tenant's prefix.
``"xxh3_128"`` (16-byte digests, needs the optional ``xxhash`` package: ``tiering[fast]``)
    Much faster but **not** cryptographic: anyone who controls prompts can craft colliding
    prefixes. Use it only when every prompt comes from a trusted party.

Byte encoding, version 1 (``HASH_ENCODING_VERSION``)
----------------------------------------------------
Notation: ``u32le``/``u64le``/``i64le`` are 4/8/8-byte little-endian integers (unsigned, unsigned,
two's complement), ``||`` is concatenation, ``H`` the selected algorithm (xxh3_128 digests are
its canonical big-endian 16 bytes, as ``xxhash.xxh3_128_digest`` returns them). Strings are
encoded as UTF-8; ``bytes`` are taken as they are. ::

    ROOT_TAG  = b"tiering:root:v1"      (15 ASCII bytes; the version number is part of the tag)
    BLOCK_TAG = b"tiering:block:v1"     (16 ASCII bytes)
    field(kind, payload) = kind (1 byte) || u32le(len(payload)) || payload

    root(no salt) = H(ROOT_TAG)
    root(salt)    = H(ROOT_TAG || field(b"S", salt))

    digest(block i) = H(BLOCK_TAG || u32le(n) || parent || tokens || [lora] || mm...)
        n       = hash_block_size (tokens in the block)
        parent  = root(salt) for block 0, else digest(block i - 1)
        tokens  = the block's n token ids, each as u32le
        lora    = field(b"L", lora_name), on every block when a LoRA name is set
        mm      = field(b"M", i64le(offset - block_start) || u64le(length) || identifier)
                  for each multimodal item overlapping the block, sorted by
                  (offset, length, identifier); the offset is relative to the block's first
                  token, so it is negative for an item that began in an earlier block.

*Why uint32 tokens.* Token ids are non-negative and every tokenizer in use has far fewer than
2**32 entries; 4 bytes per token hashes half the bytes of int64 (SHA-256 costs time per byte)
and lets ``int32``/``uint32`` arrays be hashed without a copy. An id outside
``[0, 2**32 - 1]`` raises :class:`HashInputError` rather than being wrapped.

*Why the salt is in the root.* The root is the parent of block 0 and every digest covers its
parent, so two salts give disjoint digests at **every** position, while one salt shares all of
them. An empty salt (``""`` or ``b""``) means no salt, as in vLLM.

The tags, the fixed-size header and the length-prefixed fields make the encoding unambiguous;
tags are short so that a 16-token block plus a 32-byte parent still fits in two SHA-256
compression blocks. Any change to these bytes must bump ``HASH_ENCODING_VERSION``, which
changes both tags and therefore every digest.

Incremental hashing
-------------------
A request grows; hash only its new full blocks by passing the digest of the last hashed block
as ``parent`` and the first unhashed token as ``start_token``::

    hashes = hasher.hash_blocks(tokens, extra)                  # blocks 0 .. k-1
    hashes += hasher.hash_blocks(tokens, extra, parent=hashes[-1],
                                 start_token=len(hashes) * hasher.hash_block_size)

``tokens`` is always the whole request so far (multimodal offsets stay absolute); only
``tokens[start_token:]`` is converted and hashed, and ``extra.cache_salt`` is not read (it is
already in ``parent``). The result equals one-shot hashing.

Token ids may be a list (or other sequence) of ints, a 1-D numpy array or a 1-D CPU torch
tensor of any integer dtype; they are converted once to a contiguous u32le buffer whose slices
are hashed without further copies (a ``uint32`` little-endian array needs no conversion).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeGuard, Union

import numpy as np

from tiering.errors import ConfigurationError, TieringError

if TYPE_CHECKING:
    import torch

__all__ = [
    "HASH_ENCODING_VERSION",
    "SUPPORTED_ALGORITHMS",
    "ExtraKeys",
    "HashInputError",
    "MultiModalItem",
    "PrefixHasher",
    "TokenIds",
    "available_algorithms",
    "hash_prefix_blocks",
]

HASH_ENCODING_VERSION = 1
SUPPORTED_ALGORITHMS = ("sha256", "xxh3_128")

ROOT_TAG = f"tiering:root:v{HASH_ENCODING_VERSION}".encode("ascii")
BLOCK_TAG = f"tiering:block:v{HASH_ENCODING_VERSION}".encode("ascii")
_SALT_KIND = b"S"
_LORA_KIND = b"L"
_MM_KIND = b"M"

MAX_TOKEN_ID = 2**32 - 1
_MAX_POSITION = 2**62  # token offsets and lengths of multimodal items
_TOKEN_BYTES = 4
_TOKEN_DTYPE = np.dtype("<u4")
# array.array code for a 4-byte unsigned int: "I" on every mainstream platform, else "L".
_ARRAY_U32_CODE = "I" if array("I").itemsize == _TOKEN_BYTES else "L"

TokenIds = Union[Sequence[int], np.ndarray, "torch.Tensor"]


class HashInputError(TieringError, TypeError, ValueError):
    """Tokens, extra keys or a hashing argument cannot be hashed.

    Covers wrong types (a float tensor, a 2-D array) and wrong values (a negative token id, a
    ``start_token`` that is not on a block boundary), so it derives from both ``TypeError``
    and ``ValueError``. The message names the bad value and what is valid.
    """


class _HashObject(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...

    def copy(self) -> _HashObject: ...


@dataclass(frozen=True)
class MultiModalItem:
    """A multimodal input (image, audio...) that covers tokens ``[offset, offset + length)``.

    ``identifier`` identifies the content (e.g. a hash of the image); a ``str`` is hashed as
    its UTF-8 bytes, so ``"ab"`` and ``b"ab"`` are the same identifier.
    """

    identifier: bytes | str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, (bytes, str)):
            raise HashInputError(
                f"MultiModalItem.identifier must be bytes or str, got "
                f"{type(self.identifier).__name__}: {self.identifier!r:.80}"
            )
        if not self.identifier:
            raise HashInputError("MultiModalItem.identifier must not be empty")
        # Bounded so that the encoding's i64 relative offset and u64 length always fit.
        if not _is_int_in(self.offset, 0, _MAX_POSITION):
            raise HashInputError(
                "MultiModalItem.offset must be an int in [0, 2**62] (a token index), "
                f"got {self.offset!r}"
            )
        if not _is_int_in(self.length, 1, _MAX_POSITION):
            raise HashInputError(
                f"MultiModalItem.length must be an int in [1, 2**62] (tokens), got {self.length!r}"
            )

    @property
    def identifier_bytes(self) -> bytes:
        ident = self.identifier
        return ident.encode("utf-8") if isinstance(ident, str) else ident


@dataclass(frozen=True)
class ExtraKeys:
    """What besides the token ids decides whether two prefixes share KV blocks.

    ``lora_name`` is hashed into every block; each of ``mm_items`` into the blocks it overlaps;
    ``cache_salt`` into the root of the chain, so it changes every block. An empty salt is no
    salt.
    """

    lora_name: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    cache_salt: str | bytes | None = None

    def __post_init__(self) -> None:
        if self.lora_name is not None and not isinstance(self.lora_name, str):
            raise HashInputError(
                f"ExtraKeys.lora_name must be a str or None, got "
                f"{type(self.lora_name).__name__}: {self.lora_name!r:.80}"
            )
        if isinstance(self.mm_items, (str, bytes, MultiModalItem)) or not isinstance(
            self.mm_items, Sequence
        ):
            raise HashInputError(
                f"ExtraKeys.mm_items must be a sequence of MultiModalItem, got "
                f"{type(self.mm_items).__name__}"
            )
        items = tuple(self.mm_items)
        for i, item in enumerate(items):
            if not isinstance(item, MultiModalItem):
                raise HashInputError(
                    f"ExtraKeys.mm_items[{i}] must be a MultiModalItem, got "
                    f"{type(item).__name__}: {item!r:.80}"
                )
        object.__setattr__(self, "mm_items", items)
        salt = self.cache_salt
        if salt is not None and not isinstance(salt, (str, bytes)):
            raise HashInputError(
                f"ExtraKeys.cache_salt must be str, bytes or None, got "
                f"{type(salt).__name__}: {salt!r:.80}"
            )
        if not salt:
            object.__setattr__(self, "cache_salt", None)

    @property
    def salt_bytes(self) -> bytes | None:
        salt = self.cache_salt
        return salt.encode("utf-8") if isinstance(salt, str) else salt


_NO_EXTRA = ExtraKeys()


def available_algorithms() -> tuple[str, ...]:
    """The algorithm names usable in this environment (``xxh3_128`` needs ``xxhash``)."""
    try:
        _hash_constructor("xxh3_128")
    except ConfigurationError:
        return ("sha256",)
    return SUPPORTED_ALGORITHMS


def _hash_constructor(algorithm: str) -> Callable[[bytes], _HashObject]:
    if algorithm == "sha256":
        return hashlib.sha256
    if algorithm == "xxh3_128":
        try:
            xxhash = importlib.import_module("xxhash")
        except ImportError:
            raise ConfigurationError(
                "algorithm 'xxh3_128' needs the optional 'xxhash' package; install it with "
                "`pip install 'tiering[fast]'` (or `pip install xxhash`), or use 'sha256'"
            ) from None
        constructor: Callable[[bytes], _HashObject] | None = getattr(xxhash, "xxh3_128", None)
        if constructor is None:
            raise ConfigurationError(
                "the installed 'xxhash' package has no xxh3_128; upgrade it to >= 3.0"
            )
        return constructor
    raise ConfigurationError(
        f"unknown hash algorithm {algorithm!r}; valid names: {', '.join(SUPPORTED_ALGORITHMS)}"
    )


def _is_int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _field(kind: bytes, payload: bytes) -> bytes:
    return kind + len(payload).to_bytes(4, "little") + payload


class PrefixHasher:
    """Hashes the full hash blocks of token sequences; see the module docstring for the bytes.

    Immutable and safe to share between threads and requests.
    """

    def __init__(self, hash_block_size: int, algorithm: str = "sha256") -> None:
        if not _is_int_in(hash_block_size, 1, MAX_TOKEN_ID):  # the encoding stores it as u32
            raise ConfigurationError(
                f"hash_block_size (tokens) must be an int in [1, {MAX_TOKEN_ID}], "
                f"got {hash_block_size!r}"
            )
        if not isinstance(algorithm, str):
            raise ConfigurationError(
                f"algorithm must be a str, got {type(algorithm).__name__}; valid names: "
                f"{', '.join(SUPPORTED_ALGORITHMS)}"
            )
        self._new = _hash_constructor(algorithm)
        self._hash_block_size = hash_block_size
        self._algorithm = algorithm
        # Every block message starts with the same bytes; hashing them once and copying the
        # state per block is cheaper than feeding them again.
        self._block_prefix_state = self._new(BLOCK_TAG + hash_block_size.to_bytes(4, "little"))
        self._unsalted_root = self._new(ROOT_TAG).digest()
        self._digest_size = len(self._unsalted_root)

    @property
    def hash_block_size(self) -> int:
        """Tokens per hash block."""
        return self._hash_block_size

    @property
    def algorithm(self) -> str:
        return self._algorithm

    @property
    def digest_size(self) -> int:
        """Bytes per block digest: 32 for sha256, 16 for xxh3_128."""
        return self._digest_size

    def root_hash(self, cache_salt: str | bytes | None = None) -> bytes:
        """The parent digest of block 0 for ``cache_salt`` (a fixed constant without a salt)."""
        return self._root(ExtraKeys(cache_salt=cache_salt).salt_bytes)

    def _root(self, salt: bytes | None) -> bytes:
        if salt is None:
            return self._unsalted_root
        return self._new(ROOT_TAG + _field(_SALT_KIND, salt)).digest()

    def hash_blocks(
        self,
        tokens: TokenIds,
        extra: ExtraKeys | None = None,
        *,
        parent: bytes | None = None,
        start_token: int = 0,
    ) -> list[bytes]:
        """Digests of the full hash blocks of ``tokens`` from ``start_token`` on.

        ``tokens`` is a list (or other sequence) of ints, a 1-D numpy array or a 1-D CPU torch
        tensor of any integer dtype, holding the whole request so far. Returns one digest per
        full block ``start_token // hash_block_size, ...``; a trailing partial block gets none.

        ``start_token = 0`` starts the chain at the root chosen by ``extra.cache_salt`` and
        needs ``parent=None``. To continue a chain, pass ``start_token = k * hash_block_size``
        and ``parent`` = the digest of block ``k - 1``; the salt is then already in ``parent``
        and ``extra.cache_salt`` is not read. LoRA name and multimodal items apply per block.

        Raises :class:`HashInputError` for bad tokens or arguments; nothing is cached, so a
        failed call changes nothing.
        """
        if extra is None:
            extra = _NO_EXTRA
        elif not isinstance(extra, ExtraKeys):
            raise HashInputError(f"extra must be ExtraKeys or None, got {type(extra).__name__}")
        block_size = self._hash_block_size
        ids = _checked_token_ids(tokens)
        num_tokens = len(ids)
        if isinstance(start_token, bool) or not isinstance(start_token, int):
            raise HashInputError(f"start_token must be an int, got {type(start_token).__name__}")
        if start_token < 0 or start_token % block_size or start_token > num_tokens:
            raise HashInputError(
                f"start_token={start_token} must be a multiple of hash_block_size={block_size} "
                f"in [0, {num_tokens}] (the number of tokens given)"
            )
        if start_token == 0:
            if parent is not None:
                raise HashInputError(
                    "parent must be None when start_token=0: the chain starts at the root "
                    "chosen by extra.cache_salt"
                )
            parent = self._root(extra.salt_bytes)
        else:
            if parent is None:
                raise HashInputError(
                    f"start_token={start_token} continues a chain: pass the digest of block "
                    f"{start_token // block_size - 1} as parent"
                )
            if not isinstance(parent, bytes) or len(parent) != self._digest_size:
                raise HashInputError(
                    f"parent must be a {self._digest_size}-byte {self._algorithm} digest, got "
                    f"{type(parent).__name__} of length {_len_or_none(parent)}"
                )
        first_block = start_token // block_size
        end_block = num_tokens // block_size
        if end_block <= first_block:
            return []
        token_bytes = _ids_as_u32le(ids, start_token, end_block * block_size)

        lora_field = b""
        if extra.lora_name is not None:
            lora_field = _field(_LORA_KIND, extra.lora_name.encode("utf-8"))
        mm_fields: dict[int, list[bytes]] = {}
        if extra.mm_items:
            mm_fields = _mm_fields_by_block(extra.mm_items, block_size, first_block, end_block)

        block_bytes = block_size * _TOKEN_BYTES
        prefix_state = self._block_prefix_state
        digests: list[bytes] = []
        for block_idx, off in enumerate(range(0, len(token_bytes), block_bytes), first_block):
            state = prefix_state.copy()
            state.update(parent)
            state.update(token_bytes[off : off + block_bytes])
            if lora_field:
                state.update(lora_field)
            if mm_fields:
                for mm_field in mm_fields.get(block_idx, ()):
                    state.update(mm_field)
            parent = state.digest()
            digests.append(parent)
        return digests


def hash_prefix_blocks(
    tokens: TokenIds,
    hash_block_size: int,
    extra: ExtraKeys | None = None,
    algorithm: str = "sha256",
) -> list[bytes]:
    """One-shot form of :meth:`PrefixHasher.hash_blocks`: digests of every full hash block."""
    return PrefixHasher(hash_block_size, algorithm).hash_blocks(tokens, extra)


def _mm_fields_by_block(
    items: tuple[MultiModalItem, ...], block_size: int, first_block: int, end_block: int
) -> dict[int, list[bytes]]:
    """The encoded multimodal fields of each block in ``[first_block, end_block)`` that has any."""
    fields: dict[int, list[bytes]] = {}
    ordered = sorted(items, key=lambda it: (it.offset, it.length, it.identifier_bytes))
    for item in ordered:
        ident = item.identifier_bytes
        stop = item.offset + item.length  # exclusive
        lo = max(item.offset // block_size, first_block)
        hi = min((stop - 1) // block_size + 1, end_block)
        for block_idx in range(lo, hi):
            relative_offset = item.offset - block_idx * block_size
            payload = (
                relative_offset.to_bytes(8, "little", signed=True)
                + item.length.to_bytes(8, "little")
                + ident
            )
            fields.setdefault(block_idx, []).append(_field(_MM_KIND, payload))
    return fields


def _len_or_none(value: object) -> int | None:
    try:
        return len(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _is_torch_tensor(value: object) -> TypeGuard[torch.Tensor]:
    # torch is only looked up if the caller already imported it: a tensor argument implies it
    # is loaded, and hashing lists or arrays should not pay torch's import time.
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(value, torch_module.Tensor)


def _checked_token_ids(tokens: object) -> np.ndarray | Sequence[int]:
    """``tokens`` as a 1-D integer numpy array (numpy or torch input) or as the sequence it is.

    Checks type, shape, dtype and device; token id ranges are checked on conversion.
    """
    if type(tokens) is list or type(tokens) is tuple:  # the common case, without ABC checks
        return tokens
    if isinstance(tokens, np.ndarray):
        if tokens.ndim != 1:
            raise HashInputError(f"token ids must be a 1-D array, got shape {tuple(tokens.shape)}")
        if tokens.dtype.kind not in "iu":
            raise HashInputError(f"token ids must have an integer dtype, got numpy {tokens.dtype}")
        return tokens
    if _is_torch_tensor(tokens):
        if tokens.dtype not in _torch_integer_dtypes():
            raise HashInputError(f"token ids must have an integer dtype, got torch {tokens.dtype}")
        if tokens.dim() != 1:
            raise HashInputError(f"token ids must be a 1-D tensor, got shape {tuple(tokens.shape)}")
        if tokens.device.type != "cpu":
            raise HashInputError(
                f"token ids must be on the CPU, got a tensor on {tokens.device}; call .cpu() first"
            )
        return tokens.numpy()  # a view: no copy
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(tokens, Sequence):
        raise HashInputError(
            "token ids must be a sequence of ints, a 1-D integer numpy array or a 1-D integer "
            f"CPU torch tensor, got {type(tokens).__name__}"
        )
    return tokens


@functools.cache
def _torch_integer_dtypes() -> frozenset[object]:
    torch_module = sys.modules["torch"]
    names = ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    return frozenset(getattr(torch_module, name) for name in names if hasattr(torch_module, name))


def _ids_as_u32le(ids: np.ndarray | Sequence[int], start: int, stop: int) -> memoryview:
    """``ids[start:stop]`` as one contiguous buffer of u32le token ids (a byte memoryview)."""
    if not isinstance(ids, np.ndarray):
        return _sequence_as_u32le(ids, start, stop)
    part = ids[start:stop]
    _check_id_range(part, start)
    return np.ascontiguousarray(part, dtype=_TOKEN_DTYPE).data.cast("B")


def _check_id_range(ids: np.ndarray, start: int) -> None:
    # One reduction at most. Seen as unsigned, a negative 8-byte id is above MAX_TOKEN_ID, so a
    # single max() catches both ends for 8-byte dtypes; narrower signed ones need only min().
    dtype = ids.dtype
    if dtype.itemsize > _TOKEN_BYTES:
        out_of_range = ids.view(dtype.str.replace("i", "u")).max() > MAX_TOKEN_ID
    else:
        out_of_range = dtype.kind == "i" and ids.min() < 0
    if out_of_range:
        bad = int(np.flatnonzero((ids < 0) | (ids > MAX_TOKEN_ID))[0])
        raise HashInputError(_bad_token_message(start + bad, ids[bad].item()))


def _sequence_as_u32le(tokens: Sequence[int], start: int, stop: int) -> memoryview:
    # array.array converts a list about twice as fast as numpy and range-checks every item.
    try:
        ids = array(_ARRAY_U32_CODE, tokens[start:stop])
    except (OverflowError, TypeError):
        for i in range(start, stop):
            value = tokens[i]
            if not hasattr(value, "__index__") or not 0 <= value.__index__() <= MAX_TOKEN_ID:
                raise HashInputError(_bad_token_message(i, value)) from None
        raise  # unreachable unless array() and this check disagree
    if sys.byteorder == "big":
        ids.byteswap()
    return memoryview(ids).cast("B")


def _bad_token_message(index: int, value: object) -> str:
    return (
        f"token {index} is {value!r:.40}; token ids must be ints in [0, {MAX_TOKEN_ID}] "
        "(they are hashed as uint32)"
    )
