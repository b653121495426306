"""What a stored block's bytes mean, as a fingerprint every tier checks on read.

Two processes may share a tier only if their blocks mean the same thing: the same KV-cache
groups and page sizes, dtype, world size, offloaded-block geometry and hashing scheme. The
fingerprint of that description is written in every block header; a block written under another
fingerprint is never served (peers have served KV of another dtype or model this way).
"""

from __future__ import annotations

from tiering.backends.block_format import make_layout_fingerprint
from tiering.groups import KVCacheSpec

__all__ = ["layout_fingerprint", "layout_identity"]


def layout_identity(
    spec: KVCacheSpec,
    *,
    block_bytes: int,
    dtype: str,
    world_size: int = 1,
    hash_algorithm: str = "sha256",
    model: str = "",
) -> dict[str, object]:
    """A JSON-serializable description of the layout of one offloaded block (one pool row)."""
    return {
        "model": model,
        "dtype": dtype,
        "world_size": world_size,
        "block_bytes": block_bytes,
        "hash_algorithm": hash_algorithm,
        "hash_block_size": spec.hash_block_size,
        "block_size_factor": spec.block_size_factor,
        "groups": [
            {
                "kind": g.kind.value,
                "block_size": g.block_size,
                "page_size_bytes": list(g.page_size_bytes),
                "sliding_window": g.sliding_window,
            }
            for g in spec.groups
        ],
    }


def layout_fingerprint(
    spec: KVCacheSpec,
    *,
    block_bytes: int,
    dtype: str,
    world_size: int = 1,
    hash_algorithm: str = "sha256",
    model: str = "",
) -> bytes:
    """The 16-byte fingerprint of :func:`layout_identity` (same arguments)."""
    return make_layout_fingerprint(
        layout_identity(
            spec,
            block_bytes=block_bytes,
            dtype=dtype,
            world_size=world_size,
            hash_algorithm=hash_algorithm,
            model=model,
        )
    )
