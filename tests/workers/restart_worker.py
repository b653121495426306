"""A process that stores known blocks through a tiered store built from a YAML config.

Usage: python restart_worker.py CONFIG NUM_BLOCKS {shutdown|hang}

Each block ``i`` has key ``make_offload_key(i, 0)`` and payload bytes derived from ``i``. Once
every tier reported the blocks stored (durable: the config asks for fsync/sync), it prints
``DURABLE`` and then either shuts down cleanly or waits to be killed.
"""

from __future__ import annotations

import sys
import time

import torch

from tiering.config import build_manager, build_pool, load_config
from tiering.core.keys import OffloadKey, make_offload_key


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def payload(i: int, row_bytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 256, (row_bytes,), dtype=torch.uint8, generator=gen)


def main() -> None:
    config = load_config(sys.argv[1])
    num_blocks, mode = int(sys.argv[2]), sys.argv[3]
    pool = build_pool(config)
    rows = pool.rows_view()
    manager = build_manager(config, pool=pool)
    manager.wait_ready()
    keys = [key(i) for i in range(num_blocks)]
    out = manager.prepare_store(keys)
    assert out is not None
    for k, slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True):
        rows[slot] = payload(keys.index(k), rows.shape[1])
    manager.complete_store(keys)
    manager.wait_idle()
    stored: dict[str, set[OffloadKey]] = {tier.medium: set() for tier in manager.tiers}
    for event in manager.take_events():
        if not event.removed and event.medium in stored:
            stored[event.medium].update(event.keys)
    assert all(s == set(keys) for s in stored.values()), {m: len(s) for m, s in stored.items()}
    print("DURABLE", flush=True)
    if mode == "shutdown":
        manager.shutdown()
        print("CLOSED", flush=True)
        return
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
