"""How blocks map onto LMDB pages: one block's footprint, the capacity in blocks, the map size.

Capacity (``page`` = the environment's page size, 4096 on x86-64 Linux)
    A block's value is ``HEADER_BYTES + block_bytes``. A value too large for a leaf node (almost
    every KV block) lives on overflow pages: ``ceil((value + 16) / page)`` whole pages (16 = the
    page header), which is one block's footprint. A small value lives in a leaf node of
    ``8 + key + value`` bytes plus a 2-byte slot; leaves may be half empty after splits, so its
    footprint is twice that (with the longest key). ``capacity_blocks = capacity_bytes //
    footprint``, ``usage_bytes = stored blocks x footprint``. The backend reports ``FULL`` for a
    put that would store more than ``capacity_blocks`` distinct keys.

Map size
    ``map = capacity_blocks x footprint + overhead``, where the overhead, in pages, is: 64 (meta
    pages, database roots, margin); the B+tree over the keys, with half-full pages (leaves of
    ``8 + 80 + 8 + 2``-byte nodes for overflow values; branches of ``8 + 80 + 2``-byte nodes;
    plus the tree depth); and copy-on-write slack for 4 write transactions of ``txn_blocks``
    blocks (the one being written, and pages freed by the last ones, which LMDB reuses only two
    commits later and only once no reader still sees them), with their freelist records
    (8 bytes per freed page). ``map_size_bytes`` overrides it (tests; experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

from tiering.core.block_format import HEADER_BYTES, MAX_KEY_BYTES
from tiering.errors import ConfigurationError

__all__ = [
    "MAX_VALUE_BYTES",
    "LMDBGeometry",
    "blocks_within",
    "derive_geometry",
    "lmdb_geometry",
]

# LMDB (0.9, 64-bit) layout constants used by the capacity formula.
_PAGE_HEADER_BYTES: Final = 16
_NODE_HEADER_BYTES: Final = 8
_NODE_SLOT_BYTES: Final = 2
_PGNO_BYTES: Final = 8
_FIXED_OVERHEAD_PAGES: Final = 64
_SLACK_TXNS: Final = 4
MAX_VALUE_BYTES: Final = 0xFFFFFFFF  # mv_size of an LMDB value is 32-bit on disk


@dataclass(frozen=True)
class LMDBGeometry:
    """How blocks map onto LMDB pages (see the module docstring for the formulas)."""

    page_bytes: int
    value_bytes: int  # header + payload
    footprint_bytes: int  # storage one stored block takes
    capacity_blocks: int
    txn_blocks: int  # the most blocks one write transaction carries
    map_bytes: int


def lmdb_geometry(
    *, block_bytes: int, capacity_bytes: int, page_bytes: int, max_txn_bytes: int
) -> LMDBGeometry:
    """The footprint of one block, the capacity in blocks and the map size for these settings."""
    value_bytes = HEADER_BYTES + block_bytes
    usable = page_bytes - _PAGE_HEADER_BYTES
    node_max = (usable // 2) & ~1  # LMDB's me_nodemax: larger nodes go to overflow pages
    overflow_footprint = math.ceil((value_bytes + _PAGE_HEADER_BYTES) / page_bytes) * page_bytes
    longest_inline = _NODE_HEADER_BYTES + MAX_KEY_BYTES + value_bytes + _NODE_SLOT_BYTES
    inline_footprint = 2 * longest_inline
    shortest_node = _NODE_HEADER_BYTES + 1 + value_bytes
    longest_node = _NODE_HEADER_BYTES + MAX_KEY_BYTES + value_bytes
    footprints = []
    if shortest_node <= node_max:  # some keys leave the value inline
        footprints.append(inline_footprint)
    if longest_node > node_max:  # some keys push it to overflow pages
        footprints.append(overflow_footprint)
    footprint = max(footprints)
    capacity_blocks = capacity_bytes // footprint
    txn_blocks = max(1, min(capacity_blocks, max_txn_bytes // footprint))

    leaf_node = _NODE_HEADER_BYTES + MAX_KEY_BYTES + _PGNO_BYTES + _NODE_SLOT_BYTES
    branch_node = _NODE_HEADER_BYTES + MAX_KEY_BYTES + _NODE_SLOT_BYTES
    overflow_values = longest_node > node_max
    leaf_pages = math.ceil(capacity_blocks * 2 * leaf_node / usable) if overflow_values else 0
    data_pages = math.ceil(capacity_blocks * footprint / page_bytes)
    tree_pages = leaf_pages + math.ceil((leaf_pages + data_pages) * 2 * branch_node / usable) + 8
    txn_pages = math.ceil(txn_blocks * footprint / page_bytes) + min(txn_blocks, leaf_pages) + 8
    freelist_pages = math.ceil(txn_pages * _PGNO_BYTES / usable) + 2
    slack_pages = _SLACK_TXNS * (txn_pages + freelist_pages)
    map_pages = data_pages + tree_pages + slack_pages + _FIXED_OVERHEAD_PAGES
    return LMDBGeometry(
        page_bytes=page_bytes,
        value_bytes=value_bytes,
        footprint_bytes=footprint,
        capacity_blocks=capacity_blocks,
        txn_blocks=txn_blocks,
        map_bytes=map_pages * page_bytes,
    )


def derive_geometry(
    page_bytes: int, *, block_bytes: int, capacity_bytes: int, max_txn_bytes: int
) -> LMDBGeometry:
    """:func:`lmdb_geometry`, or ``ConfigurationError`` if the capacity holds no block."""
    geometry = lmdb_geometry(
        block_bytes=block_bytes,
        capacity_bytes=capacity_bytes,
        page_bytes=page_bytes,
        max_txn_bytes=max_txn_bytes,
    )
    if geometry.capacity_blocks < 1:
        raise ConfigurationError(
            f"capacity_bytes={capacity_bytes} holds no block: one block of "
            f"{block_bytes} bytes takes {geometry.footprint_bytes} bytes of LMDB pages"
        )
    return geometry


def blocks_within(geometry: LMDBGeometry, limit_bytes: int) -> int:
    """How many blocks a data file of at most ``limit_bytes`` holds, after the fixed overhead
    and the B+tree over a full tier's keys (the disk guard's cap on the capacity)."""
    g = geometry
    leaf = _NODE_HEADER_BYTES + MAX_KEY_BYTES + _PGNO_BYTES + _NODE_SLOT_BYTES
    tree_bytes = (_FIXED_OVERHEAD_PAGES + 16) * g.page_bytes + 2 * leaf * g.capacity_blocks
    return max(0, (limit_bytes - tree_bytes) // g.footprint_bytes)
