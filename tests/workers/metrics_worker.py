"""A process with a manager that exports its metrics in prometheus_client's multi-process mode.

Usage: PROMETHEUS_MULTIPROC_DIR=DIR python metrics_worker.py NUM_BLOCKS

It builds a manager (a CPU primary tier of 2 blocks over a memory tier), stores NUM_BLOCKS
blocks, copying the metrics after the first and at the end, prints the memory tier's store
latency record (bucket counts and total, JSON) and exits.
"""

from __future__ import annotations

import json
import sys

from tiering.config import build_manager, parse_config
from tiering.core.keys import make_offload_key
from tiering.observability.prometheus import MultiprocessExporter

CONFIG = {
    "version": 1,
    "model": {"shape": "tiny"},
    "primary": {"capacity": "8KiB"},
    "secondary_tiers": [{"name": "ram", "type": "memory", "capacity": "1MiB"}],
}


def main() -> None:
    num_blocks = int(sys.argv[1])
    manager = build_manager(parse_config(CONFIG, env={}))
    try:
        manager.wait_ready()
        exporter = MultiprocessExporter(manager, interval_s=None)
        for i in range(num_blocks):
            out = manager.prepare_store([make_offload_key(i.to_bytes(8, "big"), 0)])
            assert out is not None
            manager.complete_store(out.keys_to_store)
            manager.wait_idle()
            if i == 0:
                exporter.update()  # a copy between jobs: the next one copies what changed
        exporter.close()
        record = manager.tiers[0].metrics.store_latency_s
        print(json.dumps({"bucket_counts": record.bucket_counts, "total_s": record.total_s}))
    finally:
        manager.shutdown()


if __name__ == "__main__":
    main()
