"""Tests of tiering.core.hashing: the pinned byte encoding, determinism, chaining and extra keys."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.hashing import (
    HASH_ENCODING_VERSION,
    ExtraKeys,
    HashInputError,
    MultiModalItem,
    PrefixHasher,
    available_algorithms,
    hash_prefix_blocks,
)
from tiering.errors import ConfigurationError, TieringError

try:
    import xxhash
except ImportError:  # the "fast" extra is optional; xxh3 tests are skipped without it
    xxhash = None  # type: ignore[assignment]

MAX_ID = 2**32 - 1
FAST = settings(max_examples=60, deadline=None)

# ---------------------------------------------------------------------------------------------
# An independent encoder written from the module docstring (version 1), with literal tags.


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128(data: bytes) -> bytes:
    assert xxhash is not None
    return bytes(xxhash.xxh3_128_digest(data))


def _ref_field(kind: bytes, payload: bytes) -> bytes:
    return kind + struct.pack("<I", len(payload)) + payload


def _utf8(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else value


def _ref_digests(
    tokens: Sequence[int],
    block_size: int,
    *,
    lora: str | None = None,
    items: Sequence[tuple[bytes | str, int, int]] = (),
    salt: str | bytes | None = None,
    hash_fn: Callable[[bytes], bytes] = _sha256,
) -> list[bytes]:
    root_msg = b"tiering:root:v1"
    if salt:
        root_msg += _ref_field(b"S", _utf8(salt))
    parent = hash_fn(root_msg)
    ordered = sorted(items, key=lambda it: (it[1], it[2], _utf8(it[0])))
    out = []
    for i in range(len(tokens) // block_size):
        start = i * block_size
        msg = b"tiering:block:v1" + struct.pack("<I", block_size) + parent
        msg += struct.pack(f"<{block_size}I", *tokens[start : start + block_size])
        if lora is not None:
            msg += _ref_field(b"L", lora.encode("utf-8"))
        for ident, offset, length in ordered:
            if offset < start + block_size and offset + length > start:
                msg += _ref_field(b"M", struct.pack("<qQ", offset - start, length) + _utf8(ident))
        parent = hash_fn(msg)
        out.append(parent)
    return out


def _extra(
    lora: str | None, items: Sequence[tuple[bytes | str, int, int]], salt: str | bytes | None
) -> ExtraKeys:
    return ExtraKeys(
        lora_name=lora,
        mm_items=tuple(MultiModalItem(i, o, n) for i, o, n in items),
        cache_salt=salt,
    )


token_lists = st.lists(st.integers(0, MAX_ID), max_size=70)
block_sizes = st.integers(1, 9)
mm_item_specs = st.lists(
    st.tuples(st.binary(min_size=1, max_size=8), st.integers(0, 70), st.integers(1, 30)),
    max_size=4,
)
salts = st.one_of(st.none(), st.text(max_size=8), st.binary(max_size=8))
lora_names = st.one_of(st.none(), st.text(max_size=8))


# ---------------------------------------------------------------------------------------------
# The encoding is pinned.


def test_encoding_version_and_literal_digests_are_pinned() -> None:
    # Any change to these bytes must bump HASH_ENCODING_VERSION (and these constants).
    assert HASH_ENCODING_VERSION == 1
    hasher = PrefixHasher(2)
    assert hasher.root_hash() == hashlib.sha256(b"tiering:root:v1").digest()
    assert hasher.root_hash().hex() == (
        "18bea8cf18c874def0c0cbef816205b091dba8f1d478dc4ab70cb13e69e4272c"
    )
    block0 = hashlib.sha256(
        b"tiering:block:v1"
        + b"\x02\x00\x00\x00"
        + hasher.root_hash()
        + b"\x01\x00\x00\x00\x02\x00\x00\x00"
    ).digest()
    block1 = hashlib.sha256(
        b"tiering:block:v1" + b"\x02\x00\x00\x00" + block0 + b"\x03\x00\x00\x00\x04\x00\x00\x00"
    ).digest()
    assert hasher.hash_blocks([1, 2, 3, 4, 5]) == [block0, block1]
    assert block1.hex() == "043e097ed6b7f38be54da3383834a823c82249886aae5b53a97dc006f100e299"
    assert hasher.digest_size == 32


def test_extra_key_fields_tiny_input() -> None:
    tokens = [7, 8, 9, 10, 11, 12]
    items: list[tuple[bytes | str, int, int]] = [(b"img", 1, 3), ("aud", 4, 1)]
    got = hash_prefix_blocks(tokens, 2, _extra("adapter-ä", items, "tenant"))
    salt_root = hashlib.sha256(b"tiering:root:v1" + b"S\x06\x00\x00\x00tenant").digest()
    lora = b"L" + struct.pack("<I", 10) + "adapter-ä".encode()
    img_b0 = b"M" + struct.pack("<I", 19) + struct.pack("<qQ", 1, 3) + b"img"
    img_b1 = b"M" + struct.pack("<I", 19) + struct.pack("<qQ", -1, 3) + b"img"
    aud_b2 = b"M" + struct.pack("<I", 19) + struct.pack("<qQ", 0, 1) + b"aud"
    head = b"tiering:block:v1\x02\x00\x00\x00"
    b0 = _sha256(head + salt_root + struct.pack("<2I", 7, 8) + lora + img_b0)
    b1 = _sha256(head + b0 + struct.pack("<2I", 9, 10) + lora + img_b1)
    b2 = _sha256(head + b1 + struct.pack("<2I", 11, 12) + lora + aud_b2)
    assert got == [b0, b1, b2]


@FAST
@given(token_lists, block_sizes, lora_names, mm_item_specs, salts)
def test_matches_independent_encoder(
    tokens: list[int],
    block_size: int,
    lora: str | None,
    items: list[tuple[bytes, int, int]],
    salt: str | bytes | None,
) -> None:
    got = PrefixHasher(block_size).hash_blocks(tokens, _extra(lora, items, salt))
    assert got == _ref_digests(tokens, block_size, lora=lora, items=items, salt=salt)


# ---------------------------------------------------------------------------------------------
# Determinism, input types, partial blocks, chaining.

_CHILD = """
import sys
from tiering.core.hashing import ExtraKeys, MultiModalItem, hash_prefix_blocks
extra = ExtraKeys(lora_name="l", mm_items=(MultiModalItem("x", 3, 9),), cache_salt="s")
for algorithm in sys.argv[1:]:
    for extra_keys in (None, extra):
        print(",".join(d.hex() for d in hash_prefix_blocks(list(range(50)), 8, extra_keys,
                                                            algorithm)))
"""


@pytest.mark.slow
def test_same_digests_in_processes_with_different_hash_seeds() -> None:
    algorithms = list(available_algorithms())
    extra = ExtraKeys(lora_name="l", mm_items=(MultiModalItem("x", 3, 9),), cache_salt="s")
    expected = "".join(
        ",".join(d.hex() for d in hash_prefix_blocks(list(range(50)), 8, keys, algorithm)) + "\n"
        for algorithm in algorithms
        for keys in (None, extra)
    )
    repo_root = Path(__file__).resolve().parents[1]
    for seed in ("0", "4242", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        result = subprocess.run(
            [sys.executable, "-c", _CHILD, *algorithms],
            env=env,
            cwd=repo_root,
            capture_output=True,
            text=True,
            check=True,
        )
        assert result.stdout == expected, f"PYTHONHASHSEED={seed}"


@pytest.mark.parametrize(
    "convert",
    [
        pytest.param(tuple, id="tuple"),
        pytest.param(lambda t: np.array(t, dtype=np.int64), id="np-int64"),
        pytest.param(lambda t: np.array(t, dtype=np.int32), id="np-int32"),
        pytest.param(lambda t: np.array(t, dtype=np.uint32), id="np-uint32"),
        pytest.param(lambda t: np.array(t, dtype=np.uint64), id="np-uint64"),
        pytest.param(lambda t: np.array(t, dtype=np.uint16), id="np-uint16"),
        pytest.param(lambda t: np.array(t, dtype=">i4"), id="np-big-endian"),
        pytest.param(lambda t: np.repeat(np.array(t, np.int64), 2)[::2], id="np-strided"),
        pytest.param(lambda t: torch.tensor(t, dtype=torch.int64), id="torch-int64"),
        pytest.param(lambda t: torch.tensor(t, dtype=torch.int32), id="torch-int32"),
        pytest.param(lambda t: torch.tensor(t, dtype=torch.int16), id="torch-int16"),
        pytest.param(lambda t: torch.tensor(t).to(torch.uint32), id="torch-uint32"),
        pytest.param(
            lambda t: torch.tensor(t, dtype=torch.int64).repeat_interleave(2)[::2],
            id="torch-strided",
        ),
    ],
)
def test_list_numpy_and_torch_give_equal_digests(convert: Callable[[list[int]], object]) -> None:
    tokens = [(i * 7919) % 30000 for i in range(67)]
    extra = ExtraKeys(lora_name="a", mm_items=(MultiModalItem(b"m", 20, 13),), cache_salt="s")
    hasher = PrefixHasher(16)
    expected = hasher.hash_blocks(tokens, extra)
    assert len(expected) == 4
    converted: Any = convert(tokens)
    assert hasher.hash_blocks(converted, extra) == expected
    tail = hasher.hash_blocks(converted, extra, parent=expected[1], start_token=32)
    assert tail == expected[2:]


def test_uint32_extremes_are_accepted_by_every_input_type() -> None:
    tokens = [0, MAX_ID, 1, MAX_ID - 1]
    expected = _ref_digests(tokens, 2)
    assert hash_prefix_blocks(tokens, 2) == expected
    assert hash_prefix_blocks(np.array(tokens, dtype=np.int64), 2) == expected
    assert hash_prefix_blocks(np.array(tokens, dtype=np.uint64), 2) == expected
    assert hash_prefix_blocks(torch.tensor(tokens, dtype=torch.int64), 2) == expected


def test_trailing_partial_block_has_no_digest() -> None:
    hasher = PrefixHasher(4)
    tokens = list(range(11))
    digests = hasher.hash_blocks(tokens)
    assert len(digests) == 2
    assert digests == hasher.hash_blocks(tokens[:8])
    assert hasher.hash_blocks(tokens[:3]) == []
    assert hasher.hash_blocks([]) == []
    assert hasher.hash_blocks(np.zeros(3, dtype=np.int64)) == []


def test_changing_token_zero_changes_every_digest() -> None:
    hasher = PrefixHasher(4)
    tokens = list(range(100, 140))
    base = hasher.hash_blocks(tokens)
    changed = hasher.hash_blocks([999, *tokens[1:]])
    assert len(base) == len(changed) == 10
    assert all(a != b for a, b in zip(base, changed, strict=True))
    assert set(base).isdisjoint(changed)


@FAST
@given(st.lists(st.integers(0, 1000), min_size=12, max_size=60), st.data())
def test_changing_block_k_keeps_earlier_digests_and_changes_later_ones(
    tokens: list[int], data: st.DataObject
) -> None:
    block_size = 3
    hasher = PrefixHasher(block_size)
    position = data.draw(st.integers(0, len(tokens) // block_size * block_size - 1))
    changed = list(tokens)
    changed[position] = tokens[position] + 1
    k = position // block_size
    a, b = hasher.hash_blocks(tokens), hasher.hash_blocks(changed)
    assert a[:k] == b[:k]
    assert all(x != y for x, y in zip(a[k:], b[k:], strict=True))


# ---------------------------------------------------------------------------------------------
# Extra keys.


@FAST
@given(
    st.lists(st.integers(0, MAX_ID), min_size=1, max_size=40),
    st.integers(1, 4),
    st.one_of(st.text(min_size=1, max_size=6), st.binary(min_size=1, max_size=6)),
    st.one_of(st.text(min_size=1, max_size=6), st.binary(min_size=1, max_size=6)),
    lora_names,
)
def test_salts_isolate_every_position(
    tokens: list[int], block_size: int, salt_a: str | bytes, salt_b: str | bytes, lora: str | None
) -> None:
    hasher = PrefixHasher(block_size)
    a = hasher.hash_blocks(tokens, ExtraKeys(lora_name=lora, cache_salt=salt_a))
    b = hasher.hash_blocks(tokens, ExtraKeys(lora_name=lora, cache_salt=salt_b))
    unsalted = hasher.hash_blocks(tokens, ExtraKeys(lora_name=lora))
    assert set(a).isdisjoint(unsalted)
    if _utf8(salt_a) == _utf8(salt_b):
        assert a == b
    else:
        assert set(a).isdisjoint(b)
    assert hasher.hash_blocks(tokens, ExtraKeys(lora_name=lora, cache_salt=salt_a)) == a


def test_str_salt_is_its_utf8_bytes_and_empty_salt_is_no_salt() -> None:
    tokens = list(range(8))
    assert hash_prefix_blocks(tokens, 4, ExtraKeys(cache_salt="é")) == hash_prefix_blocks(
        tokens, 4, ExtraKeys(cache_salt="é".encode())
    )
    assert hash_prefix_blocks(tokens, 4, ExtraKeys(cache_salt="")) == hash_prefix_blocks(tokens, 4)
    assert ExtraKeys(cache_salt=b"").cache_salt is None


def test_lora_name_is_in_every_block() -> None:
    hasher = PrefixHasher(4)
    tokens = list(range(32))
    base = hasher.hash_blocks(tokens)
    with_a = hasher.hash_blocks(tokens, ExtraKeys(lora_name="a"))
    with_b = hasher.hash_blocks(tokens, ExtraKeys(lora_name="b"))
    assert set(base).isdisjoint(with_a)
    assert set(with_a).isdisjoint(with_b)
    # Not only through the chain: every single block, hashed from the same parent, differs.
    for k in range(1, 8):
        end = (k + 1) * 4
        plain = hasher.hash_blocks(tokens[:end], parent=base[k - 1], start_token=k * 4)
        lora = hasher.hash_blocks(
            tokens[:end], ExtraKeys(lora_name="a"), parent=base[k - 1], start_token=k * 4
        )
        assert plain != lora


@pytest.mark.parametrize(
    ("offset", "length", "overlapped_blocks"),
    [
        (5, 7, {1, 2}),
        (4, 4, {1}),
        (0, 1, {0}),
        (3, 2, {0, 1}),
        (7, 20, {1, 2, 3, 4, 5, 6}),
        (31, 1, {7}),
    ],
)
def test_mm_item_is_in_exactly_the_blocks_it_overlaps(
    offset: int, length: int, overlapped_blocks: set[int]
) -> None:
    hasher = PrefixHasher(4)
    tokens = list(range(32))
    item = ExtraKeys(mm_items=(MultiModalItem(b"image-hash", offset, length),))
    base = hasher.hash_blocks(tokens)
    with_item = hasher.hash_blocks(tokens, item)
    first = min(overlapped_blocks)
    assert with_item[:first] == base[:first]
    assert set(with_item[first:]).isdisjoint(base)  # the chain carries the item onward
    # Block by block from a common parent: only overlapped blocks change.
    for k in range(1, 8):
        end = (k + 1) * 4
        plain = hasher.hash_blocks(tokens[:end], parent=base[k - 1], start_token=k * 4)
        mm = hasher.hash_blocks(tokens[:end], item, parent=base[k - 1], start_token=k * 4)
        assert (plain != mm) == (k in overlapped_blocks), k


def test_mm_item_position_and_identity_matter() -> None:
    tokens = list(range(16))

    def digests(*items: MultiModalItem) -> list[bytes]:
        return hash_prefix_blocks(tokens, 8, ExtraKeys(mm_items=items))

    base = digests(MultiModalItem("img", 2, 4))
    assert digests(MultiModalItem("img", 3, 4))[0] != base[0]
    assert digests(MultiModalItem("img", 2, 5))[0] != base[0]
    assert digests(MultiModalItem("img2", 2, 4))[0] != base[0]
    assert digests(MultiModalItem(b"img", 2, 4)) == base
    # The order in which items are given does not matter.
    a, b = MultiModalItem("a", 5, 2), MultiModalItem("b", 1, 3)  # both in block 0
    assert digests(a, b) == digests(b, a)


# ---------------------------------------------------------------------------------------------
# Incremental hashing.


@FAST
@given(
    st.lists(st.integers(0, MAX_ID), max_size=60),
    st.integers(1, 6),
    lora_names,
    mm_item_specs,
    salts,
    st.data(),
)
def test_incremental_equals_one_shot(
    tokens: list[int],
    block_size: int,
    lora: str | None,
    items: list[tuple[bytes, int, int]],
    salt: str | bytes | None,
    data: st.DataObject,
) -> None:
    hasher = PrefixHasher(block_size)
    extra = _extra(lora, items, salt)
    one_shot = hasher.hash_blocks(np.array(tokens, dtype=np.int64), extra)
    # The request grows in random steps; each step hashes only its new full blocks.
    cuts = sorted(data.draw(st.lists(st.integers(0, len(tokens)), max_size=5)))
    digests: list[bytes] = []
    for cut in [*cuts, len(tokens)]:
        parent = digests[-1] if digests else None
        digests += hasher.hash_blocks(
            tokens[:cut], extra, parent=parent, start_token=len(digests) * block_size
        )
    assert digests == one_shot


# ---------------------------------------------------------------------------------------------
# Bad input.


@pytest.mark.parametrize("size", [0, -16, True, 1.5, "16", 2**32])
def test_bad_hash_block_size_is_a_configuration_error(size: object) -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"hash_block_size \(tokens\) must be an int in \[1, 4294967295\], got",
    ):
        PrefixHasher(size)  # type: ignore[arg-type]


def test_unknown_algorithm_lists_valid_names() -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"unknown hash algorithm 'md5'; valid names: "
        r"sha256, xxh3_128",
    ):
        PrefixHasher(16, "md5")
    with pytest.raises(ConfigurationError, match="valid names: sha256, xxh3_128"):
        hash_prefix_blocks([1], 1, algorithm="SHA256")


@pytest.mark.parametrize(
    ("tokens", "message"),
    [
        (torch.arange(8, dtype=torch.float32), r"integer dtype, got torch torch\.float32"),
        (torch.ones(8, dtype=torch.bool), r"integer dtype, got torch torch\.bool"),
        (torch.zeros(2, 4, dtype=torch.int64), r"1-D tensor, got shape \(2, 4\)"),
        (torch.zeros(8, dtype=torch.int64, device="meta"), "must be on the CPU.*meta"),
        (np.arange(8, dtype=np.float64), "integer dtype, got numpy float64"),
        (np.zeros((2, 4), dtype=np.int64), r"1-D array, got shape \(2, 4\)"),
        ("abcdefgh", "got str"),
        (b"abcdefgh", "got bytes"),
        (iter(range(8)), "got range_iterator"),
        ([0, 1, 2, -1], r"token 3 is -1; token ids must be ints in \[0, 4294967295\]"),
        ([0, 1, 2**32, 3], r"token 2 is 4294967296; token ids must be ints"),
        ([0, 1.0, 2, 3], r"token 1 is 1\.0; token ids must be ints"),
        ([0, "1", 2, 3], r"token 1 is '1'"),
        (np.array([0, 5, -3, 1]), r"token 2 is -3"),
        (np.array([0, 5, 3, 2**40], dtype=np.uint64), r"token 3 is 1099511627776"),
        (torch.tensor([0, -7, 1, 2], dtype=torch.int8), r"token 1 is -7"),
        (torch.tensor([0, 1, 2, -(2**40)]), r"token 3 is -1099511627776"),
        (np.array([0, 1, 2**32, 2]), r"token 2 is 4294967296"),
        (np.array([0, 1, 2, -1], dtype=">i8"), r"token 3 is -1"),
        (np.array([9, 0, -5, 0, 1, 0, 2, 0])[::2], r"token 1 is -5"),
    ],
)
def test_bad_tokens_raise_hash_input_error(tokens: object, message: str) -> None:
    with pytest.raises(HashInputError, match=message):
        PrefixHasher(2).hash_blocks(tokens)  # type: ignore[arg-type]


def test_hash_input_error_is_a_tiering_value_and_type_error() -> None:
    assert issubclass(HashInputError, TieringError)
    assert issubclass(HashInputError, ValueError)
    assert issubclass(HashInputError, TypeError)


def test_bad_token_beyond_the_last_full_block_is_not_read() -> None:
    # Only full blocks are hashed; a bad id in the partial tail is not looked at.
    assert len(hash_prefix_blocks([1, 2, -1], 2)) == 1


def test_bad_chain_arguments() -> None:
    hasher = PrefixHasher(4)
    tokens = list(range(16))
    digests = hasher.hash_blocks(tokens)
    with pytest.raises(
        HashInputError,
        match=r"start_token=6 must be a multiple of "
        r"hash_block_size=4 in \[0, 16\]",
    ):
        hasher.hash_blocks(tokens, parent=digests[0], start_token=6)
    with pytest.raises(HashInputError, match=r"start_token=20 must be .* in \[0, 16\]"):
        hasher.hash_blocks(tokens, parent=digests[3], start_token=20)
    with pytest.raises(HashInputError, match=r"start_token=-4"):
        hasher.hash_blocks(tokens, parent=digests[0], start_token=-4)
    with pytest.raises(HashInputError, match="pass the digest of block 1 as parent"):
        hasher.hash_blocks(tokens, start_token=8)
    with pytest.raises(HashInputError, match="parent must be None when start_token=0"):
        hasher.hash_blocks(tokens, parent=digests[0])
    with pytest.raises(HashInputError, match="32-byte sha256 digest, got bytes of length 16"):
        hasher.hash_blocks(tokens, parent=digests[0][:16], start_token=4)
    with pytest.raises(HashInputError, match="got str of length 32"):
        hasher.hash_blocks(tokens, parent="x" * 32, start_token=4)  # type: ignore[arg-type]
    with pytest.raises(HashInputError, match="extra must be ExtraKeys or None, got dict"):
        hasher.hash_blocks(tokens, {"lora_name": "a"})  # type: ignore[arg-type]
    # A full block at the chain's end returns nothing rather than failing.
    assert hasher.hash_blocks(tokens, parent=digests[3], start_token=16) == []


_ITEM = {"identifier": b"x", "offset": 0, "length": 3}


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (
            MultiModalItem,
            {**_ITEM, "offset": -1},
            r"offset must be an int in \[0, 2\*\*62\].*got -1",
        ),
        (MultiModalItem, {**_ITEM, "length": 0}, r"length must be an int in \[1, 2\*\*62\].*got 0"),
        (MultiModalItem, {**_ITEM, "offset": 1.0}, r"offset must be an int in .*got 1\.0"),
        (MultiModalItem, {**_ITEM, "offset": True}, r"offset must be an int in .*got True"),
        (MultiModalItem, {**_ITEM, "length": 2**63}, r"length must be .*got 9223372036854775808"),
        (MultiModalItem, {**_ITEM, "identifier": b""}, "identifier must not be empty"),
        (MultiModalItem, {**_ITEM, "identifier": 17}, "identifier must be bytes or str, got int"),
        (ExtraKeys, {"lora_name": b"a"}, "lora_name must be a str or None, got bytes"),
        (ExtraKeys, {"cache_salt": 5}, "cache_salt must be str, bytes or None, got int"),
        (ExtraKeys, {"mm_items": (("x", 0, 1),)}, r"mm_items\[0\] must be a MultiModalItem"),
        (ExtraKeys, {"mm_items": MultiModalItem("x", 0, 1)}, "a sequence of MultiModalItem"),
    ],
)
def test_bad_extra_keys(cls: type, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(HashInputError, match=message):
        cls(**kwargs)


def test_extra_keys_accepts_a_list_of_items_and_stores_a_tuple() -> None:
    item = MultiModalItem("x", 0, 1)
    items: Any = [item]
    assert ExtraKeys(mm_items=items).mm_items == (item,)
    assert hash(ExtraKeys(mm_items=items)) == hash(ExtraKeys(mm_items=(item,)))


# ---------------------------------------------------------------------------------------------
# xxh3_128.


@pytest.mark.skipif(xxhash is None, reason="xxhash is not installed (pip install 'tiering[fast]')")
def test_xxh3_128_follows_the_same_encoding_with_16_byte_digests() -> None:
    tokens = list(range(1000, 1070))
    items = [(b"img", 10, 20)]
    hasher = PrefixHasher(16, algorithm="xxh3_128")
    assert hasher.digest_size == 16
    got = hasher.hash_blocks(torch.tensor(tokens), _extra("l", items, "salt"))
    assert [len(d) for d in got] == [16] * 4
    expected = _ref_digests(tokens, 16, lora="l", items=items, salt="salt", hash_fn=_xxh3_128)
    assert got == expected
    assert set(got).isdisjoint(hash_prefix_blocks(tokens, 16, _extra("l", items, "salt")))
    assert "xxh3_128" in available_algorithms()


def test_missing_xxhash_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xxhash", None)  # makes `import xxhash` fail
    with pytest.raises(
        ConfigurationError,
        match=r"'xxh3_128' needs the optional 'xxhash'.*"
        r"tiering\[fast\]",
    ):
        PrefixHasher(16, "xxh3_128")
    assert available_algorithms() == ("sha256",)
    assert len(PrefixHasher(16).hash_blocks(list(range(16)))) == 1


# ---------------------------------------------------------------------------------------------
# Integration with KVCacheSpec.offload_keys.


def test_offload_keys_of_groups_with_block_sizes_16_and_32() -> None:
    spec = KVCacheSpec(
        groups=(
            KVCacheGroup(GroupKind.FULL_ATTENTION, block_size=16, page_size_bytes=(4096,)),
            KVCacheGroup(GroupKind.FULL_ATTENTION, block_size=32, page_size_bytes=(8192,)),
        ),
        hash_block_size=16,
    )
    hasher = PrefixHasher(spec.hash_block_size)
    digests = hasher.hash_blocks(torch.arange(100, dtype=torch.int64))  # 6 full hash blocks
    assert len(digests) == 6
    keys = spec.offload_keys(digests)
    assert keys[0] == [d + b"\x00\x00\x00\x00" for d in digests]
    assert keys[1] == [digests[i] + b"\x00\x00\x00\x01" for i in (1, 3, 5)]
