"""One engine node of the shared-tier tests: a CPU tier and a TieringOffloadingManager built
from a YAML file whose last tier is a shared Redis tier, driven by commands on stdin.

Usage: python shared_node.py CONFIG_YAML standalone|step_driven

Each line on stdin is a JSON command; each gets one JSON line back on stdout:

- ``{"op": "keys", "prompt": P, "blocks": N, "salt": S}``: the offload keys (hex) of prompt
  ``P`` (a seed for its tokens), ``N`` blocks of 16 tokens, hashed with ``cache_salt`` ``S``
  (or none); every node computes the same keys from the same tokens.
- ``{"op": "store", "keys": [...]}``: prepare_store, write each key's payload into its row (a
  worker's copy), complete_store; answers the keys stored.
- ``{"op": "lookup", "keys": [...], "req": R}``: ``lookup_result`` of each key, in order (as
  vLLM's scheduler scans a prompt: it does not stop at RETRY); the answers' names.
- ``{"op": "settle"}``: the end of a step (``on_schedule_end``), then ``wait_idle``.
- ``{"op": "load", "keys": [...]}``: prepare_load, compare each row with the key's payload,
  complete_load; answers whether every row was bit-exact.
- ``{"op": "stats"}``: ``get_stats()`` of the shared tier (deltas) and its backend's counters.
- ``{"op": "quit"}``.

A key's payload is derived from the key alone, so a node can check bytes another node wrote.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from typing import Any

import numpy as np

from tiering.config import build_manager, build_pool, load_config
from tiering.core.hashing import ExtraKeys, PrefixHasher
from tiering.core.keys import OffloadKey, make_offload_key

FINGERPRINT = b"shared-nodes-fp1"
TOKENS_PER_BLOCK = 16


def payload(key: bytes, row_bytes: int) -> np.ndarray:
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "big")
    return np.frombuffer(random.Random(seed).randbytes(row_bytes), np.uint8)


def main(config_path: str, mode: str) -> int:
    config = load_config(config_path)
    (tier_config,) = [t for t in config.secondary_tiers if t.type == "redis"]
    row_bytes = 64 << 10
    pool = build_pool(config, block_bytes=row_bytes)
    manager = build_manager(
        config,
        block_bytes=row_bytes,
        fingerprint=FINGERPRINT,
        pool=pool,
        step_driven=mode == "step_driven",
    )
    manager.wait_ready()
    rows = pool.rows_view().numpy()
    tier = next(t for t in manager.tiers if t.name == tier_config.name)
    hasher = PrefixHasher(TOKENS_PER_BLOCK)
    try:
        for line in sys.stdin:
            command: dict[str, Any] = json.loads(line)
            op = command["op"]
            reply: dict[str, Any]
            if op == "quit":
                break
            keys = [OffloadKey(bytes.fromhex(k)) for k in command.get("keys", [])]
            if op == "keys":
                rng = random.Random(command["prompt"])
                tokens = [rng.randrange(32000) for _ in range(command["blocks"] * TOKENS_PER_BLOCK)]
                salt = command.get("salt")
                extra = ExtraKeys(cache_salt=salt) if salt is not None else None
                hashes = hasher.hash_blocks(tokens, extra)
                reply = {"keys": [make_offload_key(h, 0).hex() for h in hashes]}
            elif op == "store":
                out = manager.prepare_store(keys, req_context="store")
                assert out is not None, "no room in the CPU tier"
                slots = out.store_spec.block_ids.tolist()
                for key, slot in zip(out.keys_to_store, slots, strict=True):
                    rows[slot] = payload(key, row_bytes)
                manager.complete_store(keys, req_context="store")
                reply = {"stored": [k.hex() for k in out.keys_to_store]}
            elif op == "lookup":
                answers = [manager.lookup_result(k, command["req"]).name for k in keys]
                reply = {"answers": answers}
            elif op == "settle":
                manager.on_schedule_end()
                manager.wait_idle()
                reply = {}
            elif op == "load":
                spec = manager.prepare_load(keys)
                slots = spec.block_ids.tolist()
                exact = all(
                    np.array_equal(rows[s], payload(k, row_bytes))
                    for k, s in zip(keys, slots, strict=True)
                )
                manager.complete_load(keys)
                reply = {"exact": exact}
            elif op == "stats":
                stats = manager.get_stats()[tier.name]
                backend = tier.backend.stats
                reply = {"tier": stats, "backend": {**vars(backend), **backend.extra}}
                reply["backend"].pop("extra")
            else:
                reply = {"error": f"unknown op {op!r}"}
            print(json.dumps(reply), flush=True)
    finally:
        manager.shutdown()
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
