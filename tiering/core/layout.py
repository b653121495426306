"""Registering an engine's KV-cache tensors as canonical byte views.

An engine hands over its per-layer KV tensors in whatever layout its attention backend uses.
:func:`register_kv_caches` turns them into *canonical tensors*: ``uint8`` views of shape
``(num_blocks, page_bytes)`` that alias the engine's memory, so a copier moves block ``b`` of
every layer with plain byte copies and never needs to know the layout again.

Layouts understood (``num_blocks`` comes from the cache config, never from a shape; a tensor
that holds more blocks than that is over-allocated and only its first ``num_blocks`` are used):

* ``blocks_first``: ``(num_blocks, ...)`` with the block dimension physically outermost. One
  canonical tensor whose page is the block stride in bytes (padding included).
* ``kv_first``: the FlashAttention ``(2, num_blocks, ...)`` K/V split. Two canonical tensors,
  K then V, each half a page. If the block dimension is physically outermost despite the logical
  shape (a permuted view), it is one canonical tensor instead.
* Mamba states: a layer gives a list of state tensors that share one storage and whose first
  dimension is ``num_blocks``; their common block stride is the page, and the canonical tensor
  is rebuilt from the storage starting at the lowest state.
* Cross-layer: one tensor ``(num_blocks, ...)`` holding every layer, so that block ``b`` of
  every layer is one run of memory (vLLM's ``register_cross_layers_kv_cache``). Register it
  whole with :func:`register_cross_layer_kv_cache`, or pass per-layer views of it (e.g.
  ``big[:, i]``) to :func:`register_kv_caches`: views of one storage with one block stride that
  start within one stride of each other become a single canonical tensor whose page is the
  whole run, each layer a ref at its offset in the page. Either way a block copies as one run.

Layout detection (``kv_layout="auto"``): a tensor with at least 3 dimensions, ``shape[0] == 2``
and ``shape[1] >= num_blocks`` is read as ``kv_first``; anything else as ``blocks_first``. This
misreads a blocks-first tensor only when ``num_blocks <= 2`` and its second dimension is at
least ``num_blocks``; pass ``kv_layout="blocks_first"`` (for all layers or per layer) then.

Several layers may share one tensor (same data pointer): it is registered once and every layer
gets a reference to it. Layers declared as sharing (``shared_by``) must agree on data pointer,
shape, stride, dtype and device; undeclared layers whose tensors start at the same address must
too, and distinct canonical tensors (and the layers within one page) must not overlap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import torch

from tiering.core.canonical_kv import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    _check_positive,
)
from tiering.core.groups import KVCacheSpec
from tiering.core.layout_builder import LayerTensors, _Builder
from tiering.errors import ConfigurationError, LayoutError

__all__ = [
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "KVLayout",
    "LayerTensors",
    "register_cross_layer_kv_cache",
    "register_kv_caches",
]

KVLayout = Literal["auto", "blocks_first", "kv_first"]
_LAYOUTS = ("auto", "blocks_first", "kv_first")


def register_kv_caches(
    kv_caches: Mapping[str, LayerTensors],
    spec: KVCacheSpec,
    num_blocks: int,
    *,
    layer_groups: Mapping[str, int] | None = None,
    shared_by: Sequence[Sequence[str]] = (),
    kv_layout: KVLayout | Mapping[str, KVLayout] = "auto",
) -> CanonicalKVCaches:
    """Register one rank's KV tensors; see the module docstring for the layouts.

    ``num_blocks`` is the engine block count from the cache config. ``layer_groups`` maps each
    layer to its group index; by default it comes from the groups' ``layer_names``. A layer's
    un-padded page is its entry in its group's ``page_size_bytes`` (by position in
    ``layer_names``, or in ``kv_caches`` order when the group names no layers). ``shared_by``
    lists sets of layers declared to share one tensor. ``kv_layout`` overrides detection, for
    all layers or per layer.

    Raises :class:`LayoutError` naming the layer for any mismatch: unknown or missing layers,
    fewer than ``num_blocks`` blocks, an unsupported physical order, a page smaller than the
    declared page size, sharing mismatches, overlapping tensors, mixed devices.
    """
    _check_positive(num_blocks, "num_blocks")
    if not kv_caches:
        raise LayoutError("no KV-cache tensors to register")
    pages = _layer_pages(kv_caches, spec, layer_groups)
    share_leader = _share_leaders(kv_caches, shared_by)
    builder = _Builder(num_blocks)
    layer_views = {
        name: builder.register(name, tensors, share_leader.get(name), _layout_of(kv_layout, name))
        for name, tensors in kv_caches.items()
    }
    tensors, placements = builder.build()
    layer_refs: dict[str, list[CanonicalKVCacheRef]] = {}
    for name, views in layer_views.items():
        group_idx, page = pages[name]
        halves = len(views)
        if page % halves:
            raise LayoutError(
                f"layer {name!r}: its K/V split needs an even page size, but group {group_idx} "
                f"declares {page} bytes"
            )
        refs = []
        for view in views:
            place = placements[view]
            if page // halves > place.room:
                raise LayoutError(
                    f"layer {name!r}: group {group_idx} declares {page} page bytes but the "
                    f"tensor's block stride holds only {place.room * halves}"
                )
            refs.append(CanonicalKVCacheRef(place.tensor_idx, page // halves, place.offset))
        layer_refs[name] = refs
    group_refs = _group_refs(spec, pages, layer_refs)
    return CanonicalKVCaches(tuple(tensors), group_refs, num_blocks, spec)


def register_cross_layer_kv_cache(
    kv_cache: torch.Tensor, spec: KVCacheSpec, num_blocks: int
) -> CanonicalKVCaches:
    """Register one tensor ``(num_blocks, ...)`` that holds every layer of a one-group spec.

    This is vLLM's ``register_cross_layers_kv_cache``: block ``b`` of every layer is one run of
    the tensor's memory, so one canonical tensor covers the model and a copy moves one run per
    block. The group's un-padded page is the sum of its layers' ``page_size_bytes``. Raises
    :class:`LayoutError` if the spec has several groups, the tensor holds fewer than
    ``num_blocks`` blocks, its block dimension is not physically outermost, or its block stride
    is smaller than the group's page.
    """
    _check_positive(num_blocks, "num_blocks")
    if spec.num_groups != 1:
        raise LayoutError(
            f"a cross-layer KV cache holds one KV-cache group, but the spec has {spec.num_groups}; "
            "register hybrid models layer by layer with register_kv_caches"
        )
    if not isinstance(kv_cache, torch.Tensor):
        raise LayoutError(f"a cross-layer KV cache is one tensor, got {type(kv_cache).__name__}")
    group = spec.groups[0]
    name = group.layer_names[0] if group.layer_names else "cross_layer"
    builder = _Builder(num_blocks)
    builder.register(name, kv_cache, None, "blocks_first")
    (canonical,), (place,) = builder.build()
    if group.layer_names:
        canonical = CanonicalKVCacheTensor(
            canonical.tensor, canonical.page_bytes, group.layer_names
        )
    page = sum(group.page_size_bytes)
    if page > place.room:
        raise LayoutError(
            f"cross-layer KV cache: group 0 declares {page} page bytes over its "
            f"{len(group.page_size_bytes)} layers but the tensor's block stride holds only "
            f"{place.room}"
        )
    return CanonicalKVCaches((canonical,), ((CanonicalKVCacheRef(0, page),),), num_blocks, spec)


def _layer_pages(
    kv_caches: Mapping[str, LayerTensors],
    spec: KVCacheSpec,
    layer_groups: Mapping[str, int] | None,
) -> dict[str, tuple[int, int]]:
    """Each registered layer's ``(group index, declared page bytes)``."""
    if layer_groups is None:
        layer_groups = {}
        for g, group in enumerate(spec.groups):
            if not group.layer_names:
                raise LayoutError(
                    f"group {g} ({group.label!r}) names no layers; name them in the group or "
                    "pass layer_groups"
                )
            layer_groups.update({name: g for name in group.layer_names})
    for name in kv_caches:
        if name not in layer_groups:
            raise LayoutError(f"layer {name!r} belongs to no KV-cache group")
    members: list[list[str]] = [[] for _ in spec.groups]
    for name, g in layer_groups.items():
        if isinstance(g, bool) or not isinstance(g, int) or not 0 <= g < spec.num_groups:
            raise LayoutError(
                f"layer {name!r}: group index {g!r} is out of range; "
                f"valid: 0..{spec.num_groups - 1}"
            )
        if name not in kv_caches:
            raise LayoutError(f"layer {name!r} of group {g} has no registered KV-cache tensor")
        members[g].append(name)
    pages: dict[str, tuple[int, int]] = {}
    for g, group in enumerate(spec.groups):
        order = list(group.layer_names) if group.layer_names else members[g]
        if sorted(order) != sorted(members[g]) or len(order) != len(group.page_size_bytes):
            raise LayoutError(
                f"group {g} ({group.label!r}) declares {len(group.page_size_bytes)} page sizes "
                f"but has layers {sorted(members[g])}"
            )
        pages.update({name: (g, group.page_size_bytes[i]) for i, name in enumerate(order)})
    return pages


def _share_leaders(
    kv_caches: Mapping[str, LayerTensors], shared_by: Sequence[Sequence[str]]
) -> dict[str, str]:
    """Map each layer of a declared sharing set to the set's first layer in ``kv_caches``."""
    order = {name: i for i, name in enumerate(kv_caches)}
    leaders: dict[str, str] = {}
    for names in shared_by:
        names = list(names)
        for name in names:
            if name not in order:
                raise LayoutError(f"shared_by names layer {name!r}, which is not registered")
            if name in leaders:
                raise LayoutError(f"layer {name!r} appears in more than one shared_by set")
        leader = min(names, key=order.__getitem__)
        leaders.update({name: leader for name in names})
    return leaders


def _layout_of(kv_layout: KVLayout | Mapping[str, KVLayout], name: str) -> str:
    layout = kv_layout.get(name, "auto") if isinstance(kv_layout, Mapping) else kv_layout
    if layout not in _LAYOUTS:
        raise ConfigurationError(f"layer {name!r}: kv_layout {layout!r} is not one of {_LAYOUTS}")
    return layout


def _group_refs(
    spec: KVCacheSpec,
    pages: Mapping[str, tuple[int, int]],
    layer_refs: Mapping[str, list[CanonicalKVCacheRef]],
) -> tuple[tuple[CanonicalKVCacheRef, ...], ...]:
    """Per group, its layers' refs in layer order, each place in a canonical tensor once (the
    largest page wins)."""
    by_group: list[dict[tuple[int, int], CanonicalKVCacheRef]] = [{} for _ in spec.groups]
    for name, (g, _) in pages.items():
        for ref in layer_refs[name]:
            place = (ref.tensor_idx, ref.offset_bytes)
            known = by_group[g].get(place)
            if known is None or known.page_bytes < ref.page_bytes:
                by_group[g][place] = ref
    return tuple(tuple(refs.values()) for refs in by_group)
