"""A process that holds a config's tiers open, as a running engine does.

Usage: python holder_worker.py CONFIG NUM_BLOCKS

It builds the manager, stores NUM_BLOCKS blocks (write-through into every tier), prints
``HOLDING <pid>`` and keeps the tiers open until its stdin closes; then it stores one more block
(so a wipe meanwhile would have it write into deleted files), shuts down and prints ``CLOSED``.
"""

from __future__ import annotations

import os
import sys

from tiering.config import build_manager, build_pool, load_config
from tiering.core.keys import OffloadKey, make_offload_key


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def store(manager: object, pool: object, i: int) -> None:
    out = manager.prepare_store([key(i)])  # type: ignore[attr-defined]
    assert out is not None
    pool.rows_view()[int(out.store_spec.block_ids[0])].fill_(i + 1)  # type: ignore[attr-defined]
    manager.complete_store([key(i)])  # type: ignore[attr-defined]
    manager.wait_idle()  # type: ignore[attr-defined]


def main() -> None:
    config = load_config(sys.argv[1])
    blocks = int(sys.argv[2])
    pool = build_pool(config)
    manager = build_manager(config, pool=pool)
    manager.wait_ready()
    for tier in manager.tiers:
        assert tier.is_open, (tier.name, tier.open_error)
    for i in range(blocks):
        store(manager, pool, i)
    print(f"HOLDING {os.getpid()}", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    store(manager, pool, blocks)
    manager.shutdown()
    pool.close()
    print("CLOSED", flush=True)


if __name__ == "__main__":
    main()
