"""Registering KV-cache tensors: layouts, padding, sharing, and the byte formulas."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.layout import (
    CanonicalKVCacheRef,
    KVLayout,
    register_cross_layer_kv_cache,
    register_kv_caches,
)
from tiering.errors import ConfigurationError, LayoutError

NUM_BLOCKS = 6


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random bytes viewed as ``dtype`` (NaN patterns included: compare bytes, not values)."""
    numel = 1
    for dim in shape:
        numel *= dim
    size = torch.tensor([], dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def full_group(
    pages: tuple[int, ...], names: tuple[str, ...], block_size: int = 16
) -> KVCacheGroup:
    return KVCacheGroup(GroupKind.FULL_ATTENTION, block_size, pages, layer_names=names)


def one_group_spec(page: int, names: tuple[str, ...] = ("layer",), factor: int = 1) -> KVCacheSpec:
    return KVCacheSpec((full_group((page,) * len(names), names),), 16, factor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_blocks_first_is_one_aliasing_byte_view(dtype: torch.dtype) -> None:
    engine = random_tensor((NUM_BLOCKS, 16, 2, 8), dtype)
    page = engine[0].numel() * engine.element_size()
    caches = register_kv_caches({"layer": engine}, one_group_spec(page), NUM_BLOCKS)

    (canonical,) = caches.tensors
    assert canonical.tensor.dtype == torch.uint8
    assert canonical.tensor.shape == (NUM_BLOCKS, page) and canonical.page_bytes == page
    for block in range(NUM_BLOCKS):
        assert torch.equal(canonical.tensor[block], as_bytes(engine[block]))
    canonical.tensor[3].fill_(0)  # writing through the view changes the engine tensor
    assert torch.equal(as_bytes(engine[3]), torch.zeros(page, dtype=torch.uint8))
    assert as_bytes(engine[2]).any()
    assert caches.group_refs == ((CanonicalKVCacheRef(0, page),),)


def test_kv_first_split_gives_k_and_v_halves() -> None:
    engine = random_tensor((2, NUM_BLOCKS, 16, 2, 8), torch.float16)
    half = 16 * 2 * 8 * 2
    caches = register_kv_caches({"layer": engine}, one_group_spec(2 * half), NUM_BLOCKS)

    k, v = caches.tensors
    assert (k.part, v.part) == ("K", "V")
    assert k.tensor.shape == v.tensor.shape == (NUM_BLOCKS, half)
    for block in range(NUM_BLOCKS):
        assert torch.equal(k.tensor[block], as_bytes(engine[0, block]))
        assert torch.equal(v.tensor[block], as_bytes(engine[1, block]))
    v.tensor[4].fill_(0)
    assert not as_bytes(engine[1, 4]).any() and as_bytes(engine[0, 4]).any()
    assert caches.group_refs == ((CanonicalKVCacheRef(0, half), CanonicalKVCacheRef(1, half)),)
    assert caches.engine_block_bytes == 2 * half


def test_kv_first_shape_with_blocks_physically_outermost_is_one_view() -> None:
    physical = random_tensor((NUM_BLOCKS, 2, 16, 8), torch.bfloat16)
    engine = physical.transpose(0, 1)  # logical (2, num_blocks, ...), blocks outermost in memory
    page = 2 * 16 * 8 * 2
    caches = register_kv_caches({"layer": engine}, one_group_spec(page), NUM_BLOCKS)

    (canonical,) = caches.tensors
    assert canonical.page_bytes == page
    for block in range(NUM_BLOCKS):
        assert torch.equal(canonical.tensor[block], as_bytes(physical[block]))


def mamba_states(num_blocks: int, page: int, seed: int = 0) -> list[torch.Tensor]:
    """A conv state (fp16, 96 bytes) and an SSM state (fp32, 128 bytes) in one padded page."""
    raw = random_tensor((num_blocks * page,), torch.uint8, seed)
    conv = raw.view(torch.float16).as_strided((num_blocks, 3, 16), (page // 2, 16, 1), 0)
    ssm = raw.view(torch.float32).as_strided((num_blocks, 4, 8), (page // 4, 8, 1), 96 // 4)
    return [conv, ssm]


def test_mamba_states_rebuild_one_page_view_from_their_storage() -> None:
    page = 256
    states = mamba_states(NUM_BLOCKS, page)
    group = KVCacheGroup(GroupKind.MAMBA, 16, (224,), layer_names=("mamba",))
    caches = register_kv_caches({"mamba": states}, KVCacheSpec((group,), 16), NUM_BLOCKS)

    (canonical,) = caches.tensors
    assert canonical.tensor.shape == (NUM_BLOCKS, page)
    assert caches.group_refs == ((CanonicalKVCacheRef(0, 224),),)
    for block in range(NUM_BLOCKS):
        assert torch.equal(canonical.tensor[block, :96], as_bytes(states[0][block]))
        assert torch.equal(canonical.tensor[block, 96:224], as_bytes(states[1][block]))
    canonical.tensor[1, 96:224].fill_(0)
    assert not as_bytes(states[1][1]).any() and as_bytes(states[0][1]).any()
    assert caches.bytes_per_gpu_block(0) == 224
    assert caches.offloaded_block_bytes_per_rank() == page  # padding is really allocated


def test_mamba_states_must_share_storage_and_block_stride() -> None:
    group = KVCacheGroup(GroupKind.MAMBA, 16, (128,), layer_names=("m",))
    spec = KVCacheSpec((group,), 16)
    foreign = [mamba_states(NUM_BLOCKS, 256)[0], random_tensor((NUM_BLOCKS, 4, 8), torch.float32)]
    with pytest.raises(LayoutError, match=r"layer 'm': state tensor 1 does not share"):
        register_kv_caches({"m": foreign}, spec, NUM_BLOCKS)


def test_num_blocks_comes_from_config_not_from_a_padded_shape() -> None:
    engine = random_tensor((NUM_BLOCKS + 5, 16, 8), torch.float16)
    page = 16 * 8 * 2
    caches = register_kv_caches({"layer": engine}, one_group_spec(page), NUM_BLOCKS)

    assert caches.num_blocks == NUM_BLOCKS
    assert caches.tensors[0].tensor.shape == (NUM_BLOCKS, page)
    assert caches.registered_bytes == NUM_BLOCKS * page
    assert caches.offloaded_block_bytes_per_rank() == page


def test_kv_split_padded_in_blocks_uses_first_num_blocks_of_each_half() -> None:
    engine = random_tensor((2, NUM_BLOCKS + 3, 16, 8), torch.float16)
    half = 16 * 8 * 2
    caches = register_kv_caches({"layer": engine}, one_group_spec(2 * half), NUM_BLOCKS)
    k, v = caches.tensors
    assert torch.equal(v.tensor[NUM_BLOCKS - 1], as_bytes(engine[1, NUM_BLOCKS - 1]))
    assert k.tensor.shape == (NUM_BLOCKS, half)


@pytest.mark.parametrize("shape", [(NUM_BLOCKS - 1, 16, 8), (2, NUM_BLOCKS - 1, 16, 8)])
def test_fewer_blocks_than_num_blocks_is_a_layout_error(shape: tuple[int, ...]) -> None:
    engine = random_tensor(shape, torch.float16)
    with pytest.raises(LayoutError, match=rf"layer 'layer'.*fewer than num_blocks={NUM_BLOCKS}"):
        register_kv_caches({"layer": engine}, one_group_spec(256), NUM_BLOCKS)


def test_padded_page_is_registered_and_the_ref_keeps_the_unpadded_size() -> None:
    buffer = random_tensor((NUM_BLOCKS, 640), torch.uint8)
    engine = buffer[:, :512].view(torch.float16)  # 512 used bytes per 640-byte page
    caches = register_kv_caches({"layer": engine}, one_group_spec(512), NUM_BLOCKS)

    assert caches.tensors[0].page_bytes == 640
    assert caches.group_refs == ((CanonicalKVCacheRef(0, 512),),)
    assert caches.bytes_per_gpu_block(0) == 512
    assert caches.offloaded_block_bytes_per_rank() == 640


def test_declared_page_larger_than_the_tensor_page_is_an_error() -> None:
    engine = random_tensor((NUM_BLOCKS, 16, 8), torch.float16)
    with pytest.raises(LayoutError, match=r"layer 'layer': group 0 declares 512 page bytes"):
        register_kv_caches({"layer": engine}, one_group_spec(512), NUM_BLOCKS)


def test_auto_detection_rule_and_explicit_override() -> None:
    # num_blocks=2: a blocks-first (2, 16, 8) tensor also reads as a K/V split; the documented
    # rule picks the split, and kv_layout overrides it.
    engine = random_tensor((2, 16, 8), torch.float16)
    auto = register_kv_caches({"layer": engine}, one_group_spec(2 * 8 * 2), 2)
    assert [t.part for t in auto.tensors] == ["K", "V"]
    spec = one_group_spec(16 * 8 * 2)
    for layout in ("blocks_first", {"layer": "blocks_first"}):
        forced = register_kv_caches({"layer": engine}, spec, 2, kv_layout=layout)  # type: ignore[arg-type]
        assert [t.part for t in forced.tensors] == [""]
        assert torch.equal(forced.tensors[0].tensor[1], as_bytes(engine[1]))
    with pytest.raises(ConfigurationError, match=r"kv_layout 'sideways'"):
        register_kv_caches({"layer": engine}, spec, 2, kv_layout="sideways")  # type: ignore[arg-type]


def test_unsupported_physical_order_is_rejected() -> None:
    engine = random_tensor((128, NUM_BLOCKS), torch.float16).t()  # blocks innermost
    with pytest.raises(LayoutError, match=r"layer 'layer'.*separate contiguous pages"):
        register_kv_caches({"layer": engine}, one_group_spec(256), NUM_BLOCKS)


def hybrid_spec(factor: int) -> KVCacheSpec:
    full = full_group((1024,), ("full.0",))
    window = KVCacheGroup(
        GroupKind.SLIDING_WINDOW, 16, (1024,), sliding_window=64, layer_names=("swa.0",)
    )
    return KVCacheSpec((full, window), 16, factor)


def test_layers_of_two_groups_sharing_one_tensor_register_it_once() -> None:
    engine = random_tensor((2, NUM_BLOCKS, 16, 2, 8), torch.float16)
    caches = register_kv_caches(
        {"full.0": engine, "swa.0": engine},
        hybrid_spec(1),
        NUM_BLOCKS,
        shared_by=[["full.0", "swa.0"]],
    )
    assert len(caches.tensors) == 2
    assert caches.tensors[0].layer_names == ("full.0", "swa.0")
    assert caches.group_refs[0] == caches.group_refs[1]
    assert caches.offloaded_block_bytes_per_rank() == 1024
    # Undeclared sharing of an identical tensor is detected by its address.
    undeclared = register_kv_caches({"full.0": engine, "swa.0": engine}, hybrid_spec(1), NUM_BLOCKS)
    assert len(undeclared.tensors) == 2


@pytest.mark.parametrize("mismatch", ["shape", "stride", "dtype", "pointer"])
def test_declared_sharing_mismatch_names_the_layer(mismatch: str) -> None:
    buffer = random_tensor((2, NUM_BLOCKS + 1, 16, 2, 8), torch.float16)
    engine = buffer[:, :NUM_BLOCKS]
    other = {
        "shape": buffer,
        "stride": engine.as_strided(engine.shape, (engine.stride(0), 256, 1, 128, 16)),
        "dtype": engine.view(torch.bfloat16),
        "pointer": engine.clone(),
    }[mismatch]
    with pytest.raises(LayoutError, match=r"layer 'swa\.0' is declared to share layer 'full\.0'"):
        register_kv_caches(
            {"full.0": engine, "swa.0": other},
            hybrid_spec(1),
            NUM_BLOCKS,
            shared_by=[("full.0", "swa.0")],
        )


def test_undeclared_same_address_with_another_shape_names_both_layers() -> None:
    engine = random_tensor((2, NUM_BLOCKS + 1, 16, 2, 8), torch.float16)
    with pytest.raises(LayoutError, match=r"layer 'swa\.0'.*same address as layer 'full\.0'"):
        register_kv_caches(
            {"full.0": engine[:, :NUM_BLOCKS], "swa.0": engine}, hybrid_spec(1), NUM_BLOCKS
        )


def test_overlapping_tensors_are_rejected() -> None:
    buffer = random_tensor((NUM_BLOCKS + 1, 512), torch.float16)
    with pytest.raises(LayoutError, match=r"layer 'swa\.0'.*overlap those of 'full\.0'"):
        register_kv_caches(
            {"full.0": buffer[:NUM_BLOCKS], "swa.0": buffer[1:]}, hybrid_spec(1), NUM_BLOCKS
        )


def test_offloaded_block_bytes_formula_with_world_size_2_and_factor_2() -> None:
    # Two groups with different page sizes on separate tensors; one padded tensor.
    small = random_tensor((NUM_BLOCKS, 16, 8), torch.float16)  # 256 bytes
    big = random_tensor((2, NUM_BLOCKS + 2, 16, 8, 4), torch.float32)  # 2 x 2048 bytes
    groups = (
        full_group((256,), ("small",)),
        KVCacheGroup(
            GroupKind.SLIDING_WINDOW, 32, (4096,), sliding_window=64, layer_names=("big",)
        ),
    )
    spec = KVCacheSpec(groups, 16, block_size_factor=2)
    caches = register_kv_caches({"small": small, "big": big}, spec, NUM_BLOCKS)

    registered = sum(t.tensor.numel() for t in caches.tensors)
    assert registered == NUM_BLOCKS * (256 + 4096)
    per_rank = registered // NUM_BLOCKS * 2
    assert caches.offloaded_block_bytes_per_rank() == per_rank == 8704
    assert caches.offloaded_block_bytes(world_size=2) == per_rank * 2 == 17408
    assert caches.offloaded_block_bytes(world_size=2, block_size_factor=1) == 8704
    assert caches.bytes_per_gpu_block(0) == 256 and caches.bytes_per_gpu_block(1) == 4096
    budget = 10 * 17408 + 17407
    assert caches.cpu_num_blocks(budget, world_size=2) == 10
    with pytest.raises(ConfigurationError, match=r"cpu_bytes_budget=17407 cannot hold one"):
        caches.cpu_num_blocks(17407, world_size=2)
    with pytest.raises(LayoutError, match=r"group index 2 is out of range; valid: 0\.\.1"):
        caches.bytes_per_gpu_block(2)


def test_layer_groups_can_be_given_explicitly() -> None:
    groups = (
        KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (256, 512)),
        KVCacheGroup(GroupKind.FULL_ATTENTION, 16, (256,)),
    )
    kv = {
        "a": random_tensor((NUM_BLOCKS, 128), torch.float16),
        "c": random_tensor((NUM_BLOCKS, 128), torch.float16),
        "b": random_tensor((NUM_BLOCKS, 256), torch.float16),
    }
    spec = KVCacheSpec(groups, 16)
    caches = register_kv_caches(kv, spec, NUM_BLOCKS, layer_groups={"a": 0, "c": 1, "b": 0})
    assert caches.group_refs == (
        (CanonicalKVCacheRef(0, 256), CanonicalKVCacheRef(2, 512)),
        (CanonicalKVCacheRef(1, 256),),
    )
    with pytest.raises(LayoutError, match=r"group 0 \('full_attention'\) names no layers"):
        register_kv_caches(kv, spec, NUM_BLOCKS)


def test_missing_and_unknown_layers_are_named() -> None:
    spec = hybrid_spec(1)
    engine = random_tensor((NUM_BLOCKS, 512), torch.float16)
    with pytest.raises(LayoutError, match=r"layer 'swa\.0' of group 1 has no registered"):
        register_kv_caches({"full.0": engine}, spec, NUM_BLOCKS)
    extra = {"full.0": engine, "swa.0": engine.clone(), "mystery": engine.clone()}
    with pytest.raises(LayoutError, match=r"layer 'mystery' belongs to no KV-cache group"):
        register_kv_caches(extra, spec, NUM_BLOCKS)
    with pytest.raises(ConfigurationError, match=r"num_blocks must be a positive int, got 0"):
        register_kv_caches({"full.0": engine}, spec, 0)


@settings(max_examples=40, deadline=None)
@given(
    num_blocks=st.integers(1, 5),
    extra_blocks=st.integers(0, 3),
    inner=st.tuples(st.integers(1, 4), st.integers(1, 8)),
    pad_elems=st.integers(0, 5),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.uint8]),
    kv_first=st.booleans(),
)
def test_canonical_rows_are_the_engine_blocks_bytes(
    num_blocks: int,
    extra_blocks: int,
    inner: tuple[int, int],
    pad_elems: int,
    dtype: torch.dtype,
    kv_first: bool,
) -> None:
    allocated = num_blocks + extra_blocks
    page_elems = inner[0] * inner[1]
    lead = (2, allocated) if kv_first else (allocated,)
    buffer = random_tensor((*lead, page_elems + pad_elems), dtype, seed=num_blocks)
    engine = buffer[..., :page_elems].reshape(*lead, *inner)  # stays a view: pages padded
    size = engine.element_size()
    page = page_elems * size * (2 if kv_first else 1)
    layout: KVLayout = "kv_first" if kv_first else "blocks_first"
    caches = register_kv_caches(
        {"layer": engine}, one_group_spec(page), num_blocks, kv_layout=layout
    )
    halves = [engine[0], engine[1]] if kv_first else [engine]
    assert len(caches.tensors) == len(halves)
    for canonical, half in zip(caches.tensors, halves, strict=True):
        if allocated > 1:  # a single block's stride is arbitrary: its page is its span
            assert canonical.page_bytes == (page_elems + pad_elems) * size
        for block in range(num_blocks):
            used = canonical.tensor[block, : page_elems * size]
            assert torch.equal(used, as_bytes(half[block]))


# -- cross-layer layouts: one tensor (num_blocks, ...) holding every layer --------------------


def cross_layer_spec(layers: int, page: int, groups: int = 1) -> KVCacheSpec:
    return KVCacheSpec(
        tuple(
            full_group((page,) * layers, tuple(f"g{g}.layer.{i}" for i in range(layers)))
            for g in range(groups)
        ),
        16,
    )


def test_per_layer_views_of_a_cross_layer_tensor_register_as_one_run_per_block() -> None:
    # The case: per-layer views big[:, i] failed with "... past its storage".
    layers, page = 4, 2 * 16 * 2 * 8 * 2
    big = random_tensor((NUM_BLOCKS, layers, 2, 16, 2, 8), torch.bfloat16)
    spec = cross_layer_spec(layers, page)
    views = {f"g0.layer.{i}": big[:, i] for i in range(layers)}
    caches = register_kv_caches(views, spec, NUM_BLOCKS)

    (canonical,) = caches.tensors
    assert canonical.page_bytes == canonical.block_stride_bytes == layers * page
    assert canonical.layer_names == tuple(views)
    assert caches.group_refs == (
        tuple(CanonicalKVCacheRef(0, page, i * page) for i in range(layers)),
    )
    assert caches.offloaded_block_bytes_per_rank() == layers * page
    assert caches.bytes_per_gpu_block(0) == layers * page
    for block in range(NUM_BLOCKS):
        assert torch.equal(canonical.tensor[block], as_bytes(big[block]))


def test_a_whole_cross_layer_tensor_registers_as_one_canonical_tensor() -> None:
    layers, page = 3, 16 * 8 * 2
    big = random_tensor((NUM_BLOCKS + 2, layers, 16, 8), torch.float16)  # over-allocated
    caches = register_cross_layer_kv_cache(big, cross_layer_spec(layers, page), NUM_BLOCKS)
    (canonical,) = caches.tensors
    assert canonical.tensor.shape == (NUM_BLOCKS, layers * page)
    assert canonical.layer_names == tuple(f"g0.layer.{i}" for i in range(layers))
    assert caches.group_refs == ((CanonicalKVCacheRef(0, layers * page),),)
    assert torch.equal(canonical.tensor[NUM_BLOCKS - 1], as_bytes(big[NUM_BLOCKS - 1]))


def test_a_cross_layer_tensor_needs_one_group_room_and_blocks_outermost() -> None:
    layers, page = 2, 16 * 8 * 2
    big = random_tensor((NUM_BLOCKS, layers, 16, 8), torch.float16)
    with pytest.raises(LayoutError, match=r"holds one KV-cache group, but the spec has 2"):
        register_cross_layer_kv_cache(big, cross_layer_spec(layers, page, groups=2), NUM_BLOCKS)
    with pytest.raises(LayoutError, match=r"declares 1536 page bytes over its 2 layers"):
        register_cross_layer_kv_cache(big, cross_layer_spec(layers, page + 512), NUM_BLOCKS)
    with pytest.raises(LayoutError, match=r"separate contiguous pages"):
        register_cross_layer_kv_cache(big.transpose(0, 2), cross_layer_spec(1, page), NUM_BLOCKS)


def test_kv_split_views_of_a_cross_layer_tensor_give_a_k_run_and_a_v_run() -> None:
    layers, half = 3, 16 * 4 * 4
    big = random_tensor((2, NUM_BLOCKS, layers, 16, 4), torch.float32)
    views = {f"g0.layer.{i}": big[:, :, i] for i in range(layers)}
    caches = register_kv_caches(views, cross_layer_spec(layers, 2 * half), NUM_BLOCKS)
    k, v = caches.tensors
    assert (k.part, v.part, k.page_bytes, v.page_bytes) == ("K", "V", layers * half, layers * half)
    assert torch.equal(k.tensor[5], as_bytes(big[0, 5]))
    assert torch.equal(v.tensor[5], as_bytes(big[1, 5]))
    assert caches.group_refs[0][:2] == (CanonicalKVCacheRef(0, half), CanonicalKVCacheRef(1, half))
    assert caches.group_refs[0][-1] == CanonicalKVCacheRef(1, half, 2 * half)


def test_some_layers_of_a_cross_layer_tensor_cover_only_their_run() -> None:
    # Layers 1 and 2 of 4 registered (e.g. one pipeline stage): whole strides from layer 1
    # would run past the storage, so the page is the run the registered layers cover.
    layers, page = 4, 16 * 8 * 2
    big = random_tensor((NUM_BLOCKS, layers, 16, 8), torch.float16)
    views = {"g0.layer.0": big[:, 1], "g0.layer.1": big[:, 2]}
    caches = register_kv_caches(views, cross_layer_spec(2, page), NUM_BLOCKS)
    (canonical,) = caches.tensors
    assert canonical.page_bytes == 2 * page and canonical.block_stride_bytes == layers * page
    assert torch.equal(canonical.tensor[3], as_bytes(big[3, 1:3]))
    assert caches.offloaded_block_bytes_per_rank() == 2 * page


def test_overlapping_layers_within_one_block_are_rejected() -> None:
    buffer = random_tensor((NUM_BLOCKS, 1024), torch.uint8)
    views = {"full.0": buffer[:, :600], "swa.0": buffer[:, 512:]}
    with pytest.raises(LayoutError, match=r"layer 'swa\.0'.*overlap those of 'full\.0'"):
        register_kv_caches(views, hybrid_spec(1), NUM_BLOCKS)
    flat = buffer.view(-1)
    spilling = {
        "full.0": buffer[:, :512],
        "swa.0": flat[700:].as_strided((NUM_BLOCKS - 1, 512), (1024, 1)),
    }
    with pytest.raises(LayoutError, match=r"layer 'swa\.0': its blocks of 512 bytes from byte 700"):
        register_kv_caches(spilling, hybrid_spec(1), NUM_BLOCKS - 1)
