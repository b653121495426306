"""Turning engine tensors into canonical tensors: each layer's blocks as a *view* of its
storage (an offset, a block stride and a span), then views merged into canonical tensors.

Views of one storage that share a block stride and start within one stride of each other are
the layers of a cross-layer layout (each block one run holding every layer): they become one
canonical tensor whose page is that run, and each layer a ref at its offset in it. Every other
view is a canonical tensor of its own. :func:`tiering.core.layout.register_kv_caches` drives it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tiering.core.canonical_kv import CanonicalKVCacheTensor
from tiering.errors import LayoutError

__all__ = ["LayerTensors"]

LayerTensors = torch.Tensor | Sequence[torch.Tensor]


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
