"""One engine-side process of the two-process Redis test: ``put`` or ``get`` seeded blocks.

Usage: python redis_worker.py put|get TARGET_KEY TARGET_VALUE PREFIX N SEED

``TARGET_KEY`` is ``url`` or ``cluster_nodes``. ``put`` writes N blocks of seeded random bytes;
``get`` reads them and prints ``OK <n>`` if all N came back bit-exact, else what differed.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import sys

from tiering.backends.base import Outcome
from tiering.backends.redis import RedisBackend
from tiering.core.keys import make_offload_key

BLOCK_BYTES = 64 << 10


async def main(role: str, target_key: str, target: str, prefix: str, n: int, seed: int) -> int:
    keys = [make_offload_key(hashlib.sha256(b"%d" % i).digest(), 0) for i in range(n)]
    rng = random.Random(seed)
    expected = [rng.randbytes(BLOCK_BYTES) for _ in range(n)]
    backend = RedisBackend(
        capacity_bytes=1 << 30,
        block_bytes=BLOCK_BYTES,
        fingerprint=b"two-process-fp-1",
        key_prefix=prefix,
        shared=True,
        **{target_key: target},
    )
    async with backend:
        if role == "put":
            outcomes = await backend.put(keys, [memoryview(v) for v in expected])
            print("OK" if outcomes == [Outcome.OK] * n else f"PUT {outcomes}", n)
            return 0
        buffers = [memoryview(bytearray(BLOCK_BYTES)) for _ in range(n)]
        outcomes = await backend.get(keys, buffers)
        same = [bytes(b) == e for b, e in zip(buffers, expected, strict=True)]
        if outcomes == [Outcome.OK] * n and all(same):
            print("OK", n)
        else:
            print("GET", [o.value for o in outcomes], same)
    return 0


if __name__ == "__main__":
    role, target_key, target, prefix, n, seed = sys.argv[1:7]
    sys.exit(asyncio.run(main(role, target_key, target, prefix, int(n), int(seed))))
