"""What a stored block's bytes mean, as a fingerprint every tier checks on read.

Two processes may share a tier only if their blocks mean the same thing: the same KV-cache
groups and page sizes, dtype, world size, offloaded-block geometry and hashing scheme. The
fingerprint of that description is written in every block header; a block written under another
fingerprint is never served (peers have served KV of another dtype or model this way). The
model's part names its checkpoint too (:mod:`tiering.model.identity`): a fine-tune or another
revision of one architecture has the same geometry but other KV.
"""

from __future__ import annotations

from collections.abc import Mapping

from tiering.core.block_format import make_layout_fingerprint
from tiering.core.groups import KVCacheSpec

__all__ = ["layout_fingerprint", "layout_identity"]


def layout_identity(
    spec: KVCacheSpec,
    *,
    block_bytes: int,
    dtype: str,
    world_size: int = 1,
    hash_algorithm: str = "sha256",
    model: str = "",
    weights: Mapping[str, object] | None = None,
) -> dict[str, object]:
    """A JSON-serializable description of the layout of one offloaded block (one pool row).
    ``weights`` names the checkpoint (:meth:`tiering.model.identity.ModelIdentity.fingerprint_part`;
    None: nothing does)."""
    description: dict[str, object] = {
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
    if weights is not None:  # absent, not null: a preset's fingerprint is what it always was
        description["weights"] = dict(weights)
    return description


def layout_fingerprint(
    spec: KVCacheSpec,
    *,
    block_bytes: int,
    dtype: str,
    world_size: int = 1,
    hash_algorithm: str = "sha256",
    model: str = "",
    weights: Mapping[str, object] | None = None,
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
            weights=weights,
        )
    )
