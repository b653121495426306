"""Offload keys and KV-cache group geometry."""

from __future__ import annotations

import pytest

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.keys import (
    check_keys,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from tiering.errors import ConfigurationError, InvalidKeyError


def full(block_size: int, name: str = "full") -> KVCacheGroup:
    return KVCacheGroup(GroupKind.FULL_ATTENTION, block_size, (1024,), name=name)


def test_offload_key_is_hash_plus_big_endian_group_index() -> None:
    key = make_offload_key(b"\xab" * 32, 258)
    assert key == b"\xab" * 32 + b"\x00\x00\x01\x02"
    assert get_offload_block_hash(key) == b"\xab" * 32
    assert get_offload_group_idx(key) == 258


@pytest.mark.parametrize(
    ("block_hash", "group_idx", "message"),
    [
        ("abc", 0, "block_hash must be bytes, got str"),
        (b"", 0, "must not be empty"),
        (b"h", -1, r"group_idx must be in \[0, 4294967295\], got -1"),
        (b"h", 2**32, "got 4294967296"),
        (b"h", True, "group_idx must be an int, got bool"),
    ],
)
def test_make_offload_key_rejects_bad_input(
    block_hash: object, group_idx: object, message: str
) -> None:
    with pytest.raises(InvalidKeyError, match=message):
        make_offload_key(block_hash, group_idx)  # type: ignore[arg-type]


def test_check_keys_names_the_bad_key() -> None:
    good = make_offload_key(b"x" * 8, 0)
    with pytest.raises(InvalidKeyError, match="key 1 is str"):
        check_keys([good, "nope"])
    with pytest.raises(InvalidKeyError, match="a single bytes"):
        check_keys(good)
    with pytest.raises(InvalidKeyError, match="key 0 is 3 bytes"):
        check_keys([b"abc"])


def test_block_size_not_divisible_by_hash_block_size_names_both_numbers_and_fix() -> None:
    groups = (full(16, "attn"), KVCacheGroup(GroupKind.MAMBA, 24, (4096,), name="mamba"))
    with pytest.raises(ConfigurationError) as err:
        KVCacheSpec(groups, hash_block_size=16)
    text = str(err.value)
    assert "group 1 ('mamba') has block_size=24" in text
    assert "hash_block_size=16 does not divide" in text
    assert "their GCD is 8" in text
    assert "align the block sizes" in text


def test_sliding_window_group_needs_a_window() -> None:
    with pytest.raises(ConfigurationError, match="has no sliding_window"):
        KVCacheGroup(GroupKind.SLIDING_WINDOW, 16, (1024,))
    with pytest.raises(ConfigurationError, match="only sliding_window groups have a window"):
        KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (1024,), sliding_window=32)
    with pytest.raises(ConfigurationError, match="unknown kind 'dense'; valid kinds"):
        KVCacheGroup("dense", 16, (1024,))  # type: ignore[arg-type]


def test_geometry_per_group() -> None:
    spec = KVCacheSpec(
        (
            full(16),
            KVCacheGroup(GroupKind.SLIDING_WINDOW, 32, (512, 512), sliding_window=100),
            KVCacheGroup(GroupKind.MAMBA, 32, (8192,)),
        ),
        hash_block_size=16,
        block_size_factor=2,
    )
    assert [spec.offloaded_block_size(g) for g in range(3)] == [32, 64, 64]
    assert [spec.hash_blocks_per_offloaded_block(g) for g in range(3)] == [2, 4, 4]
    assert [spec.window_in_offloaded_blocks(g) for g in range(3)] == [None, 2, 1]
    assert spec.offloaded_block_bytes_per_rank(1) == 2048


def test_offload_keys_use_last_hash_block_of_each_offloaded_block() -> None:
    spec = KVCacheSpec((full(16), full(32, "big")), hash_block_size=16)
    hashes = [bytes([i]) * 4 for i in range(7)]
    keys = spec.offload_keys(hashes)
    assert keys[0] == [make_offload_key(h, 0) for h in hashes]
    # Group 1: offloaded block i covers hash blocks 2i and 2i+1; the partial 7th gets no key.
    assert keys[1] == [make_offload_key(hashes[i], 1) for i in (1, 3, 5)]
