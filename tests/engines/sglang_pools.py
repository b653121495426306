"""SGLang 0.5.23's host KV pools, re-stated for CPU tests.

``sglang.srt.mem_cache.pool_host`` does not import on a CPU-only machine (its package imports
``memory_pool`` -> ``configs`` -> ``multimodal.internvl_utils`` -> torchvision, which must match
the installed torch), so these classes re-state only what a storage backend touches: the
``kv_buffer`` shapes of ``init_kv_buffer`` and ``get_page_buffer_meta`` (``pool_host/mha.py``
``MHATokenToKVPoolHost`` for ``layer_first``, ``page_first``, ``page_first_direct``,
``page_head``; ``pool_host/mla.py`` ``MLATokenToKVPoolHost`` for ``page_first_kv_split``), and
the v0 flat-page methods. Pointer arithmetic is written as SGLang writes it, not derived from
the tensors, so a mistake in either shows up as a byte mismatch.
"""

from __future__ import annotations

import torch


class MHAHostPool:
    """``MHATokenToKVPoolHost``'s buffer and page runs."""

    def __init__(
        self,
        layout: str,
        *,
        layer_num: int = 3,
        size: int = 64,
        page_size: int = 4,
        head_num: int = 2,
        head_dim: int = 8,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.layout = layout
        self.layer_num, self.size, self.page_size = layer_num, size, page_size
        self.head_num, self.head_dim, self.dtype = head_num, head_dim, dtype
        self.page_num = size // page_size
        if layout == "layer_first":
            dims: tuple[int, ...] = (2, layer_num, size, head_num, head_dim)
        elif layout == "page_first":
            dims = (2, size, layer_num, head_num, head_dim)
        elif layout == "page_first_direct":
            dims = (2, self.page_num, layer_num, page_size, head_num, head_dim)
        elif layout == "page_head":
            dims = (2, self.page_num, head_num, page_size, layer_num, head_dim)
        else:
            raise ValueError(layout)
        self.kv_buffer = torch.zeros(dims, dtype=dtype)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        ptr_list = []
        base = self.kv_buffer.data_ptr()
        idx = indices.tolist()
        item = self.dtype.itemsize
        v_offset = self.layer_num * self.size * self.head_num * self.head_dim * item
        if self.layout == "layer_first":
            for index in range(0, len(idx), self.page_size):
                for layer_id in range(self.layer_num):
                    k_ptr = (
                        base
                        + idx[index] * self.head_num * self.head_dim * item
                        + layer_id * self.size * self.head_num * self.head_dim * item
                    )
                    ptr_list += [k_ptr, k_ptr + v_offset]
            element = item * self.page_size * self.head_num * self.head_dim
        else:
            for index in range(0, len(idx), self.page_size):
                k_ptr = base + idx[index] * self.layer_num * self.head_num * self.head_dim * item
                ptr_list += [k_ptr, k_ptr + v_offset]
            element = self.layer_num * item * self.page_size * self.head_num * self.head_dim
        return ptr_list, [element] * len(ptr_list)

    def page_bytes(self, index: int) -> bytes:
        """The bytes of the page at token slot ``index`` (K then V), from the tensor's shape:
        what the tests compare."""
        p, buf = index // self.page_size, self.kv_buffer
        if self.layout == "layer_first":
            parts = [
                buf[kv, layer, index : index + self.page_size]
                for layer in range(self.layer_num)
                for kv in (0, 1)
            ]
        elif self.layout == "page_first":
            parts = [buf[kv, index : index + self.page_size] for kv in (0, 1)]
        else:
            parts = [buf[kv, p] for kv in (0, 1)]
        return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts)

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(
            2 * self.layer_num * self.page_size * self.head_num * self.head_dim, dtype=self.dtype
        )


class MLASplitHostPool:
    """``MLATokenToKVPoolHost`` in ``page_first_kv_split``: runs of different sizes (K latent,
    V rope, the indexer's K and its FP32 scales)."""

    layout = "page_first_kv_split"

    def __init__(
        self,
        *,
        layer_num: int = 3,
        size: int = 64,
        page_size: int = 4,
        kv_lora_rank: int = 16,
        qk_rope_head_dim: int = 4,
        index_layers: int = 2,
        index_head_dim: int = 8,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.layer_num, self.size, self.page_size, self.dtype = layer_num, size, page_size, dtype
        self.page_num = size // page_size
        self.qk_rope_head_dim = qk_rope_head_dim
        base = (self.page_num, layer_num, page_size, 1)
        self.k_buffer = torch.zeros((*base, kv_lora_rank), dtype=dtype)
        self.v_buffer = torch.zeros((*base, qk_rope_head_dim), dtype=dtype)
        index_dims = (self.page_num, index_layers, page_size, 1)
        self.index_k_buffer = torch.zeros((*index_dims, index_head_dim), dtype=dtype)
        self.index_k_scale_buffer = torch.zeros((*index_dims, 1), dtype=torch.float32)
        self.kv_buffer = self.k_buffer

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        assert len(indices) % self.page_size == 0
        idx = indices.tolist()
        k_width, k_item = self.k_buffer.shape[-1], self.k_buffer.element_size()
        n_index, index_width = self.index_k_buffer.shape[1], self.index_k_buffer.shape[-1]
        index_item = self.index_k_buffer.element_size()
        ptrs: list[int] = []
        for index in range(0, len(idx), self.page_size):
            ptrs.append(self.k_buffer.data_ptr() + idx[index] * self.layer_num * k_width * k_item)
            ptrs.append(
                self.v_buffer.data_ptr()
                + idx[index] * self.layer_num * self.qk_rope_head_dim * self.dtype.itemsize
            )
            ptrs.append(
                self.index_k_buffer.data_ptr() + idx[index] * n_index * index_width * index_item
            )
            ptrs.append(self.index_k_scale_buffer.data_ptr() + idx[index] * n_index * 4)
        sizes = [
            self.layer_num * k_item * self.page_size * k_width,
            self.layer_num * self.dtype.itemsize * self.page_size * self.qk_rope_head_dim,
            n_index * index_item * self.page_size * index_width,
            n_index * 4 * self.page_size,
        ]
        return ptrs, sizes * (len(idx) // self.page_size)

    def page_bytes(self, index: int) -> bytes:
        p = index // self.page_size
        parts = [
            self.k_buffer[p],
            self.v_buffer[p],
            self.index_k_buffer[p],
            self.index_k_scale_buffer[p],
        ]
        return b"".join(t.contiguous().view(torch.uint8).numpy().tobytes() for t in parts)


class MambaHostPool:
    """A hybrid model's state pool (``pool_host/mamba.py``, layer_first: one run per layer per
    state slot), reduced to what the v2 path uses: one slot is one page."""

    layout = "layer_first"

    def __init__(self, *, layer_num: int = 2, size: int = 16, state_elems: int = 24) -> None:
        self.layer_num, self.size, self.page_size = layer_num, size, 1
        self.dtype = torch.float32
        self.buffer = torch.zeros((layer_num, size, state_elems), dtype=torch.float32)

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        row = self.buffer.shape[-1] * 4
        ptrs = [
            self.buffer.data_ptr() + (layer * self.size + i) * row
            for i in indices.tolist()
            for layer in range(self.layer_num)
        ]
        return ptrs, [row] * len(ptrs)

    def page_bytes(self, index: int) -> bytes:
        return self.buffer[:, index].contiguous().view(torch.uint8).numpy().tobytes()
