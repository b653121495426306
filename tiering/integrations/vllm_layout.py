"""What a stored chunk's bytes mean under vLLM 0.33: the layout fingerprint of a CPU-tier row.

vLLM's CPU tier keeps one row per offloaded chunk in its shared offload region: every worker's
slot for that chunk, side by side (``cpu_page_size_per_worker`` bytes each, one slot in all when
the layout is replicated), then padding up to a page. A tier below it stores the slots, not the
padding. Two engines may share stored chunks only if their rows mean the same thing, so the
fingerprint written into (and checked on) every stored block covers everything that changes a
row's bytes: the model and KV dtype, the KV-cache groups (block sizes, layers, windows), tokens per
hash, blocks per chunk, the bytes a worker keeps per block, the parallel layout (TP, PP, PCP and
DCP sizes, world size and this rank), the host layout (replicated, canonical, the resolved
KV-cache layout) and the checkpoint (revision, quantization, model dtype and the weight files:
:mod:`tiering.integrations.vllm_identity`). Data-parallel replicas share one layout and are not
part of it.

Every input comes from the ``OffloadingConfig`` vLLM builds for its offloading spec
(``vllm.distributed.kv_transfer.kv_connector.v1.offloading.config.build_offloading_config``), so
the scheduler and the tiers derive the same fingerprint without asking the workers.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import OffloadingSpec

from tiering.core.block_format import make_layout_fingerprint
from tiering.integrations.vllm_identity import model_identity_of

__all__ = ["LAYOUT_VERSION", "chunk_data_bytes", "layout_fingerprint", "layout_identity"]

#: Bumped when the meaning of a fingerprint's inputs changes (2: the checkpoint's identity).
LAYOUT_VERSION = 2


def chunk_data_bytes(spec: OffloadingSpec) -> int:
    """Bytes of one offloaded chunk over every worker slot of a row (page padding excluded)."""
    config = spec.config
    copies = 1 if spec.replicated_layout else config.parallel.world_size
    return config.worker_kv_bytes_per_block * config.cache.blocks_per_chunk * copies


def layout_identity(spec: OffloadingSpec) -> dict[str, object]:
    """A JSON-serializable description of what one stored chunk's bytes mean."""
    config = spec.config
    parallel = config.parallel
    return {
        "engine": "vllm",
        "layout_version": LAYOUT_VERSION,
        "model": config.model.name,
        "model_identity": model_identity_of(spec),
        "dtype": config.model.dtype,
        "groups": [
            {
                "group_id": group.group_id,
                "tokens_per_block": group.tokens_per_block,
                "layer_names": list(group.layer_names),
                "sliding_window_size_in_chunks": group.sliding_window_size_in_chunks,
            }
            for group in config.groups
        ],
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": config.cache.blocks_per_chunk,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "chunk_bytes": chunk_data_bytes(spec),
        "parallel": {
            "world_size": parallel.world_size,
            "tp_size": parallel.tp_size,
            "pp_size": parallel.pp_size,
            "pcp_size": parallel.pcp_size,
            "dcp_size": parallel.dcp_size,
            "rank": parallel.rank,
        },
        "replicated_layout": bool(spec.replicated_layout),
        "canonical_layout": config.canonical_layout,
        "kv_cache_layout": config.kv_cache_layout,
    }


def layout_fingerprint(spec: OffloadingSpec) -> bytes:
    """The 16-byte fingerprint of :func:`layout_identity`."""
    return make_layout_fingerprint(layout_identity(spec))
