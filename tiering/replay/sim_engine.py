"""A serving engine reduced to what KV offloading sees: the replay tool's engine.

For each request it does what a scheduler and one worker do with a tiered store, on real
tensors: hash the prompt, look the prefix up across KV-cache groups, load the hit into engine
blocks through the CPU pool, "prefill" the rest (write bytes that are a function of each block's
key), then plan and run the store of the new blocks. Every loaded block is checked against the
bytes its key must hold, so the replay also proves the data path bit-exact end to end.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tiering.core.groups import GroupKind, KVCacheGroup, KVCacheSpec
from tiering.core.hashing import ExtraKeys, PrefixHasher
from tiering.core.layout import CanonicalKVCaches
from tiering.core.store_plan import NULL_BLOCK_ID, plan_store
from tiering.errors import TieringError
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.replay.traces import Request
from tiering.transfer import PoolTransfer, TransferEngine, TransferHandle

__all__ = ["RequestResult", "SimulatedEngine", "engine_blocks_needed"]

_MIX = 0x9E3779B97F4A7C15  # spreads tensor indices over 64 bits
_MASK63 = (1 << 63) - 1


@dataclass(frozen=True)
class RequestResult:
    request_id: str
    prompt_tokens: int
    hit_tokens: int
    blocks_looked_up: int
    blocks_found: dict[str, int]  # medium -> blocks of the request found there before lookup
    blocks_loaded_from: dict[str, int]  # medium -> loaded blocks that were there before lookup
    blocks_loaded: int
    bytes_loaded: int
    blocks_stored: int
    bytes_stored: int
    lookup_retries: int
    load_s: float  # the request's whole load: lookups, waits for promotions, the copy
    store_s: float
    store_refused: bool
    load_copy_s: float = 0.0  # the copy job alone: CPU pool to engine blocks
    store_copy_s: float = 0.0  # the copy job alone: engine blocks to CPU pool
    blocks_refused: int = 0  # blocks the CPU tier refused to store (prepare_store gave None)


def _window_engine_blocks(group: KVCacheGroup) -> int | None:
    """Engine blocks a group keeps before the current position; None: all (full attention)."""
    if group.kind is GroupKind.FULL_ATTENTION:
        return None
    if group.kind is GroupKind.MAMBA:
        return 1
    return math.ceil((group.sliding_window or 0) / group.block_size)


def engine_blocks_needed(spec: KVCacheSpec, num_tokens: int) -> int:
    """Engine blocks a request of ``num_tokens`` tokens holds at once, the null block excluded:
    every group's, before a sliding window drops any (:meth:`SimulatedEngine._block_tables`)."""
    return sum(math.ceil(num_tokens / group.block_size) for group in spec.groups)


class SimulatedEngine:
    """Runs requests against a manager, with ``num_engine_blocks`` blocks of engine KV cache.

    ``caches`` are the engine's registered KV tensors (see ``ModelShape.allocate``), on CPU or
    CUDA; ``transfers`` moves their blocks to and from the manager's CPU pool. Each copy is
    waited for before the manager hears of it (``complete_load`` / ``complete_store``), so
    results do not depend on timing. Block id 0 is the null block, never allocated.
    """

    def __init__(
        self,
        manager: TieringOffloadingManager,
        spec: KVCacheSpec,
        caches: CanonicalKVCaches,
        transfers: TransferEngine,
        hasher: PrefixHasher,
        *,
        max_lookup_retries: int = 8,
        verify: bool = True,
    ) -> None:
        self.manager = manager
        self.spec = spec
        self.caches = caches
        self.transfers = transfers
        self.hasher = hasher
        self.max_lookup_retries = max_lookup_retries
        self.verify = verify
        self.num_engine_blocks = caches.num_blocks
        self._free_blocks = list(range(caches.num_blocks - 1, 0, -1))
        self._group_tensors = [
            sorted({ref.tensor_idx for ref in refs}) for refs in caches.group_refs
        ]
        self.verify_failures = 0

    # -- block contents --------------------------------------------------------------------------

    def _fill(self, group: int, engine_id: int, key: bytes) -> None:
        base = int.from_bytes(key[:8], "little") & _MASK63
        for t in self._group_tensors[group]:
            page = self.caches.tensors[t].tensor[engine_id]
            page.view(torch.int64).fill_(base ^ ((t * _MIX) & _MASK63))

    def _check(self, group: int, engine_id: int, key: bytes) -> bool:
        base = int.from_bytes(key[:8], "little") & _MASK63
        for t in self._group_tensors[group]:
            words = self.caches.tensors[t].tensor[engine_id].view(torch.int64)
            if not bool((words == (base ^ ((t * _MIX) & _MASK63))).all()):
                return False
        return True

    # -- engine block tables ---------------------------------------------------------------------

    def _allocate(self, n: int) -> list[int]:
        if n > len(self._free_blocks):
            raise TieringError(
                f"a request needs {n} engine blocks but only {len(self._free_blocks)} of "
                f"{self.num_engine_blocks - 1} are free; give the replay more engine blocks "
                "(--engine-blocks, replay.engine_blocks)"
            )
        return [self._free_blocks.pop() for _ in range(n)]

    def _block_tables(self, num_tokens: int, loaded_from: list[int]) -> list[list[int]]:
        """Engine block ids per group; a sliding-window group's blocks before its window are
        null, except those the load fills (they drop out of the window during prefill)."""
        tables = []
        for g, group in enumerate(self.spec.groups):
            n = math.ceil(num_tokens / group.block_size)
            first_real = 0
            window_blocks = _window_engine_blocks(group)
            if window_blocks is not None:
                first_real = min(max(0, n - window_blocks - 1), loaded_from[g])
            ids = [NULL_BLOCK_ID] * first_real + self._allocate(n - first_real)
            tables.append(ids)
        return tables

    def _drop_out_of_window(self, tables: list[list[int]], num_tokens: int) -> None:
        for g, group in enumerate(self.spec.groups):
            window_blocks = _window_engine_blocks(group)
            if window_blocks is None:
                continue
            for i in range(max(0, len(tables[g]) - window_blocks - 1)):
                if tables[g][i] != NULL_BLOCK_ID:
                    self._free_blocks.append(tables[g][i])
                    tables[g][i] = NULL_BLOCK_ID

    def _release(self, tables: list[list[int]]) -> None:
        for ids in tables:
            self._free_blocks.extend(i for i in ids if i != NULL_BLOCK_ID)

    # -- one request -----------------------------------------------------------------------------

    def run(self, request: Request) -> RequestResult:
        tokens = request.token_ids
        num_tokens = len(tokens)
        extra = ExtraKeys(lora_name=request.lora_name, cache_salt=request.cache_salt)
        hashes = self.hasher.hash_blocks(tokens, extra)
        keys = self.spec.offload_keys(hashes)
        located: dict[bytes, str] = {}
        found: dict[str, int] = {}
        for group_keys in keys:
            for key in group_keys:
                medium = self.manager.locate(key)
                if medium is not None:
                    located[key] = medium
                    found[medium] = found.get(medium, 0) + 1
        loaded_from: dict[str, int] = {}
        # Every group's keys, prefix order within each: the request as a policy learns it.
        self.manager.note_request(
            [key for group_keys in keys for key in group_keys],
            req_context=request.request_id,
            continues=request.continues,
        )

        start = time.perf_counter()
        retries = 0
        hit_tokens: int | None = None
        while True:
            hit_tokens = self.manager.lookup_request(
                self.spec, keys, num_tokens, req_context=request.request_id
            )
            if hit_tokens is not None:
                break
            retries += 1
            if retries > self.max_lookup_retries:
                hit_tokens = 0
                break
            self.manager.wait_idle()

        factor = self.spec.block_size_factor
        hit_blocks = [hit_tokens // self.spec.offloaded_block_size(g) for g in range(len(keys))]
        load_first = []
        for g in range(len(keys)):
            window = self.spec.window_in_offloaded_blocks(g)
            load_first.append(0 if window is None else max(0, hit_blocks[g] - window))
        tables = self._block_tables(num_tokens, [b * factor for b in load_first])

        blocks_loaded = bytes_loaded = 0
        load_copy_s = store_copy_s = 0.0
        if hit_tokens:
            load_keys = [
                k for g in range(len(keys)) for k in keys[g][load_first[g] : hit_blocks[g]]
            ]
            for key in load_keys:
                medium = located.get(key, "NEW")  # "NEW": stored while this request waited
                loaded_from[medium] = loaded_from.get(medium, 0) + 1
            self.manager.touch(load_keys, req_context=request.request_id)
            slots = self.manager.prepare_load(load_keys, req_context=request.request_id).block_ids
            engine_ids: list[int] = []
            sizes: list[int] = []
            for g in range(len(keys)):
                ids = tables[g][load_first[g] * factor : hit_blocks[g] * factor]
                engine_ids.extend(ids)
                sizes.append(len(ids))
            load = PoolTransfer(np.asarray(engine_ids), tuple(sizes), slots)
            copy_started = time.perf_counter()
            handle = self._finish(self.transfers.submit_load(load))
            load_copy_s = time.perf_counter() - copy_started
            self.manager.complete_load(load_keys, req_context=request.request_id)
            blocks_loaded = len(load_keys)
            bytes_loaded = handle.bytes
            if self.verify:
                self._verify_loaded(keys, tables, load_first, hit_blocks)
        load_s = time.perf_counter() - start

        # Prefill: every full block after the hit gets the bytes of its key.
        for g, group_keys in enumerate(keys):
            for i in range(hit_blocks[g], len(group_keys)):
                for j in range(factor):
                    engine_id = tables[g][i * factor + j]
                    if engine_id != NULL_BLOCK_ID:
                        self._fill(g, engine_id, group_keys[i])
        self._drop_out_of_window(tables, num_tokens)

        start = time.perf_counter()
        candidates = plan_store(self.spec, keys, tables, hit_blocks)
        out = self.manager.prepare_store(list(candidates.keys), req_context=request.request_id)
        blocks_stored = bytes_stored = 0
        if out is not None and out.keys_to_store:
            job = candidates.build_job(out.keys_to_store)
            transfer = PoolTransfer.from_block_indices(
                job.src_block_ids,
                job.group_sizes,
                job.block_indices,
                out.store_spec.block_ids,
                factor,
            )
            copy_started = time.perf_counter()
            handle = self._finish(self.transfers.submit_store(transfer))
            store_copy_s = time.perf_counter() - copy_started
            self.manager.complete_store(out.keys_to_store, req_context=request.request_id)
            blocks_stored = len(out.keys_to_store)
            bytes_stored = handle.bytes
        store_s = time.perf_counter() - start
        self._release(tables)
        return RequestResult(
            request_id=request.request_id,
            prompt_tokens=num_tokens,
            hit_tokens=hit_tokens,
            blocks_looked_up=sum(len(k) for k in keys),
            blocks_found=found,
            blocks_loaded_from=loaded_from,
            blocks_loaded=blocks_loaded,
            bytes_loaded=bytes_loaded,
            blocks_stored=blocks_stored,
            bytes_stored=bytes_stored,
            lookup_retries=retries,
            load_s=load_s,
            store_s=store_s,
            store_refused=out is None,
            load_copy_s=load_copy_s,
            store_copy_s=store_copy_s,
            blocks_refused=len(candidates.keys) if out is None else 0,
        )

    def _finish(self, handle: TransferHandle) -> TransferHandle:
        """Wait for a copy; a failed copy stops the replay (its blocks are not what they claim)."""
        self.transfers.wait(handle)
        if handle.error is not None:
            raise TieringError(
                f"{handle.direction} job {handle.job_id} failed: {handle.error}"
            ) from handle.error
        return handle

    def _verify_loaded(
        self,
        keys: Sequence[Sequence[bytes]],
        tables: list[list[int]],
        first: list[int],
        end: list[int],
    ) -> None:
        factor = self.spec.block_size_factor
        for g, group_keys in enumerate(keys):
            for i in range(first[g], end[g]):
                for j in range(factor):
                    engine_id = tables[g][i * factor + j]
                    if engine_id != NULL_BLOCK_ID and not self._check(g, engine_id, group_keys[i]):
                        self.verify_failures += 1
                        raise TieringError(
                            f"block {i} of group {g} (key {group_keys[i].hex()}) loaded with "
                            "bytes that are not its own: the data path is broken"
                        )
