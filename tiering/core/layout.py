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
from dataclasses import dataclass
from typing import Literal

import torch

from tiering.core.groups import KVCacheSpec
from tiering.errors import ConfigurationError, LayoutError

__all__ = [
    "CanonicalKVCacheRef",
    "CanonicalKVCacheTensor",
    "CanonicalKVCaches",
    "KVLayout",
    "register_cross_layer_kv_cache",
    "register_kv_caches",
]

KVLayout = Literal["auto", "blocks_first", "kv_first"]
_LAYOUTS = ("auto", "blocks_first", "kv_first")

LayerTensors = torch.Tensor | Sequence[torch.Tensor]


@dataclass(frozen=True, eq=False)
class CanonicalKVCacheTensor:
    """A ``uint8`` view ``(num_blocks, page_bytes)`` of engine memory; row ``b`` is block ``b``.

    ``page_bytes`` is the block stride in the engine's memory, padding included (the bytes
    really allocated per block), or the run the layers cover when whole strides do not fit in
    the storage. Rows are ``block_stride_bytes`` apart: equal to ``page_bytes`` except where a
    page is a slice of a longer per-block run. ``layer_names`` are the layers that registered
    it (the first stands for all) and ``part`` is ``"K"`` or ``"V"`` for the halves of a K/V
    split, ``""`` otherwise.
    """

    tensor: torch.Tensor
    page_bytes: int
    layer_names: tuple[str, ...]
    part: str = ""

    @property
    def label(self) -> str:
        return f"{self.layer_names[0]}[{self.part}]" if self.part else self.layer_names[0]

    @property
    def block_stride_bytes(self) -> int:
        """Bytes from block ``b`` to block ``b + 1`` in the engine's memory (``>= page_bytes``;
        larger when the layers of a block are one run, each layer's tensor a slice of it)."""
        return int(self.tensor.stride(0))

    @property
    def extent_bytes(self) -> int:
        """Bytes from the first byte of block 0 to the last byte of the last block."""
        return (self.tensor.shape[0] - 1) * self.block_stride_bytes + self.page_bytes


@dataclass(frozen=True)
class CanonicalKVCacheRef:
    """A group's use of one canonical tensor: ``page_bytes`` (un-padded) from byte
    ``offset_bytes`` of each page (non-zero for the layers of a cross-layer layout)."""

    tensor_idx: int
    page_bytes: int
    offset_bytes: int = 0


@dataclass(frozen=True, eq=False)
class CanonicalKVCaches:
    """The canonical tensors of one rank plus, per group, the references its layers make.

    ``group_refs[g]`` lists each canonical tensor group ``g`` uses once, in layer order.
    """

    tensors: tuple[CanonicalKVCacheTensor, ...]
    group_refs: tuple[tuple[CanonicalKVCacheRef, ...], ...]
    num_blocks: int
    spec: KVCacheSpec

    @property
    def device(self) -> torch.device:
        return self.tensors[0].tensor.device

    @property
    def engine_block_bytes(self) -> int:
        """Bytes of one engine block id across all canonical tensors of this rank (padded)."""
        return sum(t.page_bytes for t in self.tensors)

    @property
    def registered_bytes(self) -> int:
        """Bytes of all canonical tensors: ``num_blocks`` pages each."""
        return self.num_blocks * self.engine_block_bytes

    def bytes_per_gpu_block(self, group_idx: int) -> int:
        """Bytes one engine block of group ``group_idx`` really holds on this rank (un-padded)."""
        self._check_group(group_idx)
        return sum(ref.page_bytes for ref in self.group_refs[group_idx])

    def offloaded_block_bytes_per_rank(self, block_size_factor: int | None = None) -> int:
        """Bytes of one offloaded block on one rank.

        ``registered_bytes / num_blocks * block_size_factor``: measured from the tensors really
        registered (padding included), not from declared page sizes. Every group's offloaded
        block fits in it; a group uses the parts of the canonical tensors it references.
        """
        factor = self._factor(block_size_factor)
        return self.registered_bytes // self.num_blocks * factor

    def offloaded_block_bytes(self, world_size: int, block_size_factor: int | None = None) -> int:
        """Bytes of one offloaded block summed over ``world_size`` ranks (one pool row)."""
        _check_positive(world_size, "world_size")
        return self.offloaded_block_bytes_per_rank(block_size_factor) * world_size

    def cpu_num_blocks(
        self, cpu_bytes_budget: int, world_size: int, block_size_factor: int | None = None
    ) -> int:
        """Offloaded blocks a CPU budget holds; the budget is the total over all ranks.

        Raises :class:`ConfigurationError` if the budget cannot hold a single block.
        """
        if isinstance(cpu_bytes_budget, bool) or not isinstance(cpu_bytes_budget, int):
            raise ConfigurationError(f"cpu_bytes_budget must be an int, got {cpu_bytes_budget!r}")
        block_bytes = self.offloaded_block_bytes(world_size, block_size_factor)
        num_blocks = cpu_bytes_budget // block_bytes
        if num_blocks <= 0:
            raise ConfigurationError(
                f"cpu_bytes_budget={cpu_bytes_budget} cannot hold one offloaded block of "
                f"{block_bytes} bytes (world_size={world_size}); give at least {block_bytes}"
            )
        return num_blocks

    def _factor(self, block_size_factor: int | None) -> int:
        if block_size_factor is None:
            return self.spec.block_size_factor
        _check_positive(block_size_factor, "block_size_factor")
        return block_size_factor

    def _check_group(self, group_idx: int) -> None:
        if not 0 <= group_idx < len(self.group_refs):
            raise LayoutError(
                f"group index {group_idx} is out of range; valid: 0..{len(self.group_refs) - 1}"
            )


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


@dataclass(frozen=True, eq=False)
class _View:
    """One layer's (or one K/V half's) blocks in an engine storage, before canonicalisation.

    Block ``b`` of the view holds ``span`` bytes from byte ``offset + b * stride`` of the storage.
    """

    label: str
    part: str
    source: torch.Tensor  # any tensor on the storage (keeps it alive, gives its device)
    offset: int
    stride: int
    span: int

    @property
    def storage_ptr(self) -> int:
        return self.source.untyped_storage().data_ptr()

    @property
    def storage_bytes(self) -> int:
        return self.source.untyped_storage().nbytes()


@dataclass(frozen=True)
class _Placement:
    """Where a view landed: a canonical tensor, its offset in the page, and its room there."""

    tensor_idx: int
    offset: int
    room: int


class _Builder:
    """Collects the views of every layer, then merges them into canonical tensors.

    Views of one storage that share a block stride and start within one stride of each other
    are the layers of a cross-layer layout (each block one run holding every layer): they become
    one canonical tensor whose page is that run, and each layer a ref at its offset in it.
    Every other view is a canonical tensor of its own. A layer that shares another layer's
    tensor (declared with ``shared_by``, or at the same address) gets that layer's views.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.views: list[_View] = []
        self._by_layer: dict[str, tuple[tuple[object, ...], list[int]]] = {}
        self._by_address: dict[int, str] = {}
        self._sharers: dict[int, list[str]] = {}  # view index -> layers that share it

    def register(
        self, name: str, tensors: LayerTensors, leader: str | None, layout: str
    ) -> list[int]:
        """View indices for a layer, creating them unless it shares another layer's tensor."""
        states = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if not states or not all(isinstance(t, torch.Tensor) for t in states):
            raise LayoutError(f"layer {name!r}: expected a tensor or a non-empty list of tensors")
        signature = _signature(states)
        owner = leader if leader is not None and leader != name else None
        if owner is None:
            owner = self._by_address.get(states[0].data_ptr())
            if owner is not None and self._by_layer[owner][0] != signature:
                raise LayoutError(
                    f"layer {name!r}: its tensor starts at the same address as layer {owner!r}'s "
                    f"but differs in shape, stride, dtype or device "
                    f"({_describe(states)} vs {_describe_sig(self._by_layer[owner][0])})"
                )
        if owner is not None:
            owner_sig, indices = self._by_layer[owner]
            if owner_sig != signature:
                raise LayoutError(
                    f"layer {name!r} is declared to share layer {owner!r}'s tensor but differs: "
                    f"{_describe(states)} vs {_describe_sig(owner_sig)}"
                )
            for idx in indices:
                self._sharers[idx].append(name)
            self._by_layer[name] = (signature, indices)
            return indices
        if self.views and states[0].device != self.views[0].source.device:
            raise LayoutError(
                f"layer {name!r} is on {states[0].device} but earlier layers are on "
                f"{self.views[0].source.device}; register one device at a time"
            )
        if isinstance(tensors, torch.Tensor):
            views = self._attention_views(name, tensors, layout)
        else:
            views = [self._state_view(name, states)]
        indices = []
        for view in views:
            indices.append(len(self.views))
            self._sharers[len(self.views)] = [name]
            self.views.append(view)
        self._by_layer[name] = (signature, indices)
        self._by_address[states[0].data_ptr()] = name
        return indices

    def _attention_views(self, name: str, tensor: torch.Tensor, layout: str) -> list[_View]:
        if layout == "auto":
            is_split = tensor.dim() >= 3 and tensor.shape[0] == 2
            layout = (
                "kv_first" if is_split and tensor.shape[1] >= self.num_blocks else "blocks_first"
            )
        block_dim = 1 if layout == "kv_first" else 0
        if tensor.dim() <= block_dim or tensor.shape[block_dim] < self.num_blocks:
            raise LayoutError(
                f"layer {name!r}: shape {tuple(tensor.shape)} ({layout}) has fewer than "
                f"num_blocks={self.num_blocks} blocks in dimension {block_dim}"
            )
        size = tensor.element_size()
        offset = int(tensor.storage_offset()) * size
        block_stride = tensor.stride(block_dim) * size
        if tensor.shape[block_dim] == 1:  # torch keeps no meaningful stride for a size-1 dim
            inner = (0, 1) if block_dim == 1 and tensor.shape[0] == 2 else (block_dim,)
            block_stride = _span_bytes(tensor, exclude=inner)
        span = _span_bytes(tensor, exclude=(block_dim,))
        if block_stride > 0 and span <= block_stride:
            # The block dimension is physically outermost: one page holds everything.
            return [_View(name, "", tensor, offset, block_stride, span)]
        if block_dim == 1 and tensor.shape[0] == 2 and tensor.stride(0) > 0:
            half_stride = tensor.stride(0) * size
            if self.num_blocks * block_stride > half_stride:
                raise LayoutError(
                    f"layer {name!r}: shape {tuple(tensor.shape)} with strides {tensor.stride()}: "
                    f"the K part of {self.num_blocks} blocks overlaps the V part"
                )
            half_span = _span_bytes(tensor, exclude=(0, 1))
            if 0 < half_span <= block_stride:
                return [
                    _View(name, part, tensor, offset + i * half_stride, block_stride, half_span)
                    for i, part in enumerate("KV")
                ]
        raise LayoutError(
            f"layer {name!r}: shape {tuple(tensor.shape)} with strides {tensor.stride()} does not "
            f"keep the blocks of dimension {block_dim} in separate contiguous pages; supported: "
            "(num_blocks, ...), or (2, num_blocks, ...) with K and V each a contiguous region"
        )

    def _state_view(self, name: str, states: list[torch.Tensor]) -> _View:
        if any(state.dim() == 0 for state in states):
            raise LayoutError(f"layer {name!r}: state tensors need a block dimension first")
        first = states[0]
        storage_ptr = first.untyped_storage().data_ptr()
        block_stride = first.stride(0) * first.element_size()
        for i, state in enumerate(states):
            stride = state.stride(0) * state.element_size()
            if state.untyped_storage().data_ptr() != storage_ptr or stride != block_stride:
                raise LayoutError(
                    f"layer {name!r}: state tensor {i} does not share state 0's storage and "
                    f"block stride ({stride} vs {block_stride} bytes)"
                )
            if state.shape[0] < self.num_blocks:
                raise LayoutError(
                    f"layer {name!r}: state tensor {i} has shape {tuple(state.shape)}, fewer than "
                    f"num_blocks={self.num_blocks} blocks"
                )
        if block_stride <= 0:
            raise LayoutError(f"layer {name!r}: state tensors have no positive block stride")
        starts = [int(s.storage_offset()) * s.element_size() for s in states]
        start = min(starts)
        span = 0
        for i, (state, state_start) in enumerate(zip(states, starts, strict=True)):
            end = state_start - start + _span_bytes(state, exclude=(0,))
            if end > block_stride:
                raise LayoutError(
                    f"layer {name!r}: state tensor {i} spills out of the {block_stride}-byte page "
                    "its block stride defines"
                )
            span = max(span, end)
        return _View(name, "", first, start, block_stride, span)

    def build(self) -> tuple[list[CanonicalKVCacheTensor], list[_Placement]]:
        """Canonical tensors (in registration order of their first view) and each view's place."""
        clusters = self._clusters()
        clusters.sort(key=min)
        tensors: list[CanonicalKVCacheTensor] = []
        placements: dict[int, _Placement] = {}
        for members in clusters:
            members.sort(key=lambda i: self.views[i].offset)
            tensor_idx = len(tensors)
            canonical, rooms = self._canonical(members)
            tensors.append(canonical)
            start = self.views[members[0]].offset
            for i, room in zip(members, rooms, strict=True):
                placements[i] = _Placement(tensor_idx, self.views[i].offset - start, room)
        _check_no_overlap(tensors)
        return tensors, [placements[i] for i in range(len(self.views))]

    def _clusters(self) -> list[list[int]]:
        """Views of one storage and stride whose blocks interleave (start within one stride)."""
        by_storage: dict[tuple[int, int], list[int]] = {}
        for i, view in enumerate(self.views):
            by_storage.setdefault((view.storage_ptr, view.stride), []).append(i)
        clusters: list[list[int]] = []
        for members in by_storage.values():
            members.sort(key=lambda i: self.views[i].offset)
            current = [members[0]]
            for i in members[1:]:
                if self.views[i].offset - self.views[current[0]].offset < self.views[i].stride:
                    current.append(i)
                else:
                    clusters.append(current)
                    current = [i]
            clusters.append(current)
        return clusters

    def _canonical(self, members: list[int]) -> tuple[CanonicalKVCacheTensor, list[int]]:
        """The canonical tensor of one cluster of views (sorted by offset), and each one's room.

        Its page is the block stride (padding included: the bytes really allocated per block)
        when ``num_blocks`` whole strides fit in the storage, else the run the views cover.
        """
        views = [self.views[i] for i in members]
        first = views[0]
        start, stride = first.offset, first.stride
        for before, after in zip(views, views[1:], strict=False):
            if after.offset < before.offset + before.span:
                raise LayoutError(
                    f"layer {after.label!r}: its KV-cache blocks overlap those of "
                    f"{before.label!r}; declare layers that share a tensor with shared_by"
                )
        last = views[-1]
        covered = last.offset - start + last.span
        if covered > stride:
            raise LayoutError(
                f"layer {last.label!r}: its blocks of {last.span} bytes from byte "
                f"{last.offset - start} of a {stride}-byte block stride run into the next "
                f"block of layer {first.label!r}"
            )
        fits = start + self.num_blocks * stride <= first.storage_bytes
        page = stride if fits else covered
        end = start + (self.num_blocks - 1) * stride + page
        if end > first.storage_bytes:
            raise LayoutError(
                f"layer {first.label!r}: {self.num_blocks} pages of {page} bytes from byte "
                f"{start} end at {end}, past its storage of {first.storage_bytes} bytes"
            )
        storage = first.source.untyped_storage()
        base = torch.empty(0, dtype=torch.uint8, device=first.source.device).set_(storage)
        tensor = base.as_strided((self.num_blocks, page), (stride, 1), start)
        names: list[str] = []
        for i in members:
            names += [n for n in self._sharers[i] if n not in names]
        parts = {view.part for view in views}
        part = parts.pop() if len(parts) == 1 else ""
        rooms = [
            after.offset - before.offset for before, after in zip(views, views[1:], strict=False)
        ]
        rooms.append(start + page - last.offset)
        return CanonicalKVCacheTensor(tensor, page, tuple(names), part), rooms


def _check_no_overlap(tensors: Sequence[CanonicalKVCacheTensor]) -> None:
    spans = sorted(
        (t.tensor.data_ptr(), t.tensor.data_ptr() + t.extent_bytes, t.label) for t in tensors
    )
    for (_, end, label), (start, _, next_label) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise LayoutError(
                f"layer {next_label!r}: its KV-cache blocks overlap those of {label!r}; "
                "declare layers that share a tensor with shared_by"
            )


def _span_bytes(tensor: torch.Tensor, exclude: tuple[int, ...]) -> int:
    """Bytes from the first to the last element of one slice across the excluded dimensions."""
    if any(s == 0 for s in tensor.shape):
        return 0
    last = sum(
        (tensor.shape[d] - 1) * tensor.stride(d) for d in range(tensor.dim()) if d not in exclude
    )
    if any(tensor.stride(d) < 0 for d in range(tensor.dim())):
        return 1 << 62  # negative strides never form a page
    return (last + 1) * tensor.element_size()


def _signature(states: list[torch.Tensor]) -> tuple[object, ...]:
    return tuple((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device) for t in states)


def _describe(states: list[torch.Tensor]) -> str:
    return _describe_sig(_signature(states))


def _describe_sig(signature: tuple[object, ...]) -> str:
    parts = []
    for entry in signature:
        assert isinstance(entry, tuple)
        ptr, shape, stride, dtype, device = entry
        parts.append(f"shape={shape} stride={stride} dtype={dtype} device={device} ptr={ptr:#x}")
    return "; ".join(parts)


def _check_positive(value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigurationError(f"{what} must be a positive int, got {value!r}")
