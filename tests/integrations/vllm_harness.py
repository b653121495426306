"""Drive the real vLLM 0.33 offloading stack on CPU, playing the GPU worker.

Everything here is vLLM's own code, configured as its engine core configures it: a
``VllmConfig`` built from a small local model config (``data/tiny-llama``; no hub access), a
``KVCacheConfig`` with one full-attention group (or, ``sliding_window`` given, a hybrid one: a
full-attention group and a sliding-window group), the ``OffloadingConfig`` vLLM derives from them
(``build_offloading_config``), the spec ``OffloadingSpecFactory`` creates from it, and, for the end
to end tests, vLLM's ``Scheduler`` with its ``OffloadingConnector``. What vLLM would run on a GPU
is played here: the worker maps the CPU tier's shared region with vLLM's ``SharedOffloadRegion``
and moves bytes between it and a numpy array standing for the GPU KV cache.

Tier I/O finishes while the model runs; the drivers make that explicit by draining every tier's
jobs between steps (``drain_tiers``), so a scenario gives the same answers on every run. With
tiering's drop-in (``TieringSpec``) a tier's results apply at the second step boundary after
its job started (the first comes before the model step that hides the I/O): ``settle``.
"""

from __future__ import annotations

import gc
import hashlib
import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.kv_hints import KvHintsEnvelope
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

MODEL_DIR = Path(__file__).resolve().parent / "data" / "tiny-llama"
#: Engine ids (and so CPU regions, /dev/shm/vllm_offload_<id>.mmap) of this test process.
ENGINE_ID_PREFIX = f"tiering-test-{os.getpid()}-"
BLOCK_SIZE = 16  # tokens per GPU block (and per offloaded chunk: blocks_per_chunk is 1)
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
_KV_HEADS, _HEAD_SIZE = 2, 16  # as data/tiny-llama/config.json


def attention_spec(dtype: torch.dtype = torch.float16) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=_KV_HEADS, head_size=_HEAD_SIZE, dtype=dtype
    )


def gpu_block_bytes(sliding_window: int | None = None) -> int:
    """KV bytes of one GPU block over all layers of its group (what one offloaded chunk holds):
    both layers with one group, one layer per group in the hybrid layout."""
    layers = len(LAYERS) if sliding_window is None else 1
    return int(attention_spec().page_size_bytes) * layers


def kv_cache_config(num_gpu_blocks: int, sliding_window: int | None = None) -> KVCacheConfig:
    """One full-attention group, each layer's pages contiguous (layer-outermost); or, with
    ``sliding_window`` (tokens), a hybrid model: layer 0 full attention, layer 1 a sliding
    window, each group in a tensor of its own (vLLM's hybrid allocator shares block ids)."""
    page = int(attention_spec().page_size_bytes)
    if sliding_window is None:
        tensor = KVCacheTensor(
            size=page * len(LAYERS) * num_gpu_blocks,
            layers=list(LAYERS),
            layer_stride=page * num_gpu_blocks,
            block_stride=page,
        )
        group = KVCacheGroupSpec(list(LAYERS), attention_spec())
        return KVCacheConfig(
            num_blocks=num_gpu_blocks, kv_cache_tensors=[tensor], kv_cache_groups=[group]
        )
    window = SlidingWindowSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=_KV_HEADS,
        head_size=_HEAD_SIZE,
        dtype=torch.float16,
        sliding_window=sliding_window,
    )
    tensors = [
        KVCacheTensor(
            size=page * num_gpu_blocks,
            layers=[layer],
            layer_stride=page * num_gpu_blocks,
            block_stride=page,
        )
        for layer in LAYERS
    ]
    groups = [
        KVCacheGroupSpec([LAYERS[0]], attention_spec()),
        KVCacheGroupSpec([LAYERS[1]], window),
    ]
    return KVCacheConfig(
        num_blocks=num_gpu_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )


def vllm_config(
    extra_config: Mapping[str, Any],
    *,
    engine_id: str | None = None,
    num_gpu_blocks: int = 16,
    enable_events: bool = True,
    max_model_len: int = 256,
    transfer: KVTransferConfig | None = None,
    model_dir: Path = MODEL_DIR,
    revision: str | None = None,
) -> VllmConfig:
    """A CPU ``VllmConfig`` for the tiny model (in ``model_dir``) with the OffloadingConnector
    (``transfer`` as given, e.g. parsed from a documented ``--kv-transfer-config``, else one
    built here)."""
    model = ModelConfig(
        model=str(model_dir),
        revision=revision,
        skip_tokenizer_init=True,
        dtype="float16",
        max_model_len=max_model_len,
    )
    if transfer is None:
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=engine_id or f"{ENGINE_ID_PREFIX}{uuid.uuid4().hex}",
            kv_connector_extra_config=dict(extra_config),
        )
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
        kv_transfer_config=transfer,
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=max(256, max_model_len),
            max_num_seqs=8,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig(device="cpu"),
        kv_events_config=KVEventsConfig(enable_kv_cache_events=enable_events, publisher="null"),
    )
    config.cache_config.num_gpu_blocks = num_gpu_blocks
    return config


def offloading_config(
    extra_config: Mapping[str, Any],
    *,
    engine_id: str | None = None,
    num_gpu_blocks: int = 16,
    enable_events: bool = True,
    sliding_window: int | None = None,
) -> OffloadingConfig:
    """The ``OffloadingConfig`` vLLM's connector builds for this engine."""
    config = vllm_config(
        extra_config,
        engine_id=engine_id,
        num_gpu_blocks=num_gpu_blocks,
        enable_events=enable_events,
    )
    return build_offloading_config(config, kv_cache_config(num_gpu_blocks, sliding_window))


def tiering_spec_extra(cpu_chunks: int, tiers: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """``kv_connector_extra_config``: vLLM's own tiering spec, ``tiers`` below its CPU tier."""
    return {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": cpu_chunks * gpu_block_bytes(),
        "secondary_tiers": [dict(t) for t in tiers],
    }


def chunk_ids(spec: LoadStoreSpec) -> list[int]:
    """The CPU-tier rows a load or store spec names."""
    assert isinstance(spec, BlockIDsLoadStoreSpec), spec
    return [int(c) for c in spec.block_ids]


def payload(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes a chunk stored under ``key`` holds in these tests (distinct per key)."""
    seed = hashlib.sha256(b"payload" + key).digest()
    reps = -(-nbytes // len(seed))
    return np.frombuffer((seed * reps)[:nbytes], dtype=np.uint8)


def keys_for(prefix: str, count: int) -> list[OffloadKey]:
    return [
        make_offload_key(hashlib.sha256(f"{prefix}{i}".encode()).digest(), 0) for i in range(count)
    ]


def wait_for_io(manager: OffloadingManager) -> None:
    """Let a manager's tier I/O finish, whichever spec built it."""
    wait = getattr(manager, "wait_for_tier_io", None)
    if wait is not None:
        wait()
    for tier in getattr(manager, "secondary_tiers", []):
        tier.drain_jobs()


class WorkerRows:
    """The worker's mapping of the CPU tier's rows: vLLM's ``SharedOffloadRegion`` (rank 0)."""

    def __init__(self, spec: CPUOffloadingSpec) -> None:
        self.region = SharedOffloadRegion(
            engine_id=spec.config.engine_id,
            num_chunks=spec.num_chunks,
            rank=0,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
        view = self.region.create_next_worker_view(spec.cpu_page_size_per_worker)
        self.rows: np.ndarray = view.numpy().view(np.uint8)
        self.chunk_bytes = spec.cpu_page_size_per_worker

    def write(self, chunk_id: int, data: np.ndarray) -> None:
        self.rows[chunk_id] = data

    def read(self, chunk_id: int) -> bytes:
        return self.rows[chunk_id].tobytes()

    def close(self) -> None:
        self.rows = np.empty((0, 0), np.uint8)
        self.region.cleanup()


@dataclass
class EventRecord:
    """An ``OffloadingEvent`` as plain values (comparable across runs)."""

    keys: tuple[bytes, ...]
    medium: str
    removed: bool
    ownership: str | None
    removal_expected: bool = False
    metadata_only: bool = False

    @classmethod
    def of(cls, event: OffloadingEvent) -> EventRecord:
        return cls(
            tuple(event.keys),
            event.medium.value,
            event.removed,
            event.ownership,
            event.removal_expected,
            event.metadata_only,
        )


@dataclass
class ManagerDriver:
    """vLLM's manager for one spec, driven the way its connector drives it, step by step."""

    spec: CPUOffloadingSpec
    manager: OffloadingManager = field(init=False)
    rows: WorkerRows = field(init=False)

    def __post_init__(self) -> None:
        self.manager = self.spec.get_manager()
        self.rows = WorkerRows(self.spec)

    @classmethod
    def create(cls, config: OffloadingConfig) -> ManagerDriver:
        spec = OffloadingSpecFactory.create_spec(config)
        assert isinstance(spec, CPUOffloadingSpec)
        return cls(spec)

    @property
    def tiers(self) -> list[Any]:
        return list(getattr(self.manager, "secondary_tiers", []))

    def drain_tiers(self) -> None:
        """Let the tiers' I/O finish, as it does while the model runs a step."""
        wait_for_io(self.manager)

    def settle(self) -> None:
        """Two step boundaries with the tiers' I/O done before each: everything started so far
        has applied (tiering's drop-in applies a job's result at the second boundary)."""
        for _ in range(2):
            self.drain_tiers()
            self.end_step()

    def new_request(self, req_id: str, **request: Any) -> ReqContext:
        """A request started (``request``: its ``kv_transfer_params``, ``kv_hints``)."""
        context = ReqContext(req_id=req_id, **request)
        with self.manager.lock:
            self.manager.on_new_request(context)
        return context

    def finish_request(self, context: ReqContext) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(context)

    def end_step(self) -> None:
        with self.manager.lock:
            self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def lookup(self, context: ReqContext, keys: Iterable[OffloadKey]) -> list[LookupResult]:
        """One scheduler step's lookups, ending the step (promotions are submitted then)."""
        with self.manager.lock:
            results = [self.manager.lookup(k, context) for k in keys]
            self.manager.on_schedule_end(ScheduleEndContext((), ()))
        self.drain_tiers()
        return results

    def store(self, context: ReqContext, keys: Sequence[OffloadKey]) -> PrepareStoreOutput:
        """A step storing ``keys`` (the worker writes their payloads), then its completion."""
        with self.manager.lock:
            out = self.manager.prepare_store(keys, context)
            assert out is not None, "the CPU tier could not make room"
            self.manager.on_schedule_end(ScheduleEndContext((), ()))
        for key, chunk_id in zip(out.keys_to_store, chunk_ids(out.store_spec), strict=True):
            self.rows.write(chunk_id, payload(key, self.rows.chunk_bytes))
        with self.manager.lock:
            self.manager.complete_store(out.keys_to_store, context)
        self.drain_tiers()
        return out

    def load(self, context: ReqContext, keys: Sequence[OffloadKey]) -> list[bytes]:
        """Load ``keys`` (all HIT) to the GPU: the bytes the worker reads from their rows."""
        with self.manager.lock:
            spec = self.manager.prepare_load(keys, context)
            self.manager.on_schedule_end(ScheduleEndContext((), ()))
        data = [self.rows.read(c) for c in chunk_ids(spec)]
        with self.manager.lock:
            self.manager.complete_load(keys, context)
        return data

    def take_events(self) -> list[EventRecord]:
        with self.manager.lock:
            return [EventRecord.of(e) for e in self.manager.take_events()]

    def shutdown(self) -> None:
        self.rows.close()
        self.manager.shutdown()


class EngineDriver:
    """vLLM's ``Scheduler`` with its ``OffloadingConnector``, stepped with a played worker.

    The worker keeps the GPU KV cache as a numpy array. A scheduled token range fills each
    full block it completes with bytes derived from the block's hash; loads copy rows into
    blocks and stores copy blocks into rows (deferred to the next step, as vLLM's worker does).
    Completed jobs go back through ``ModelRunnerOutput.kv_connector_output``.
    """

    def __init__(
        self, config: VllmConfig, num_gpu_blocks: int, sliding_window: int | None = None
    ) -> None:
        kv_config = kv_cache_config(num_gpu_blocks, sliding_window)
        scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
        kv_config.hash_block_size = hash_block_size
        kv_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            kv_config, config, scheduler_block_size, hash_block_size
        )
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
        )
        connector = self.scheduler.connector
        assert connector is not None
        self.connector = connector
        self.manager: OffloadingManager = connector.scheduler.manager
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(hash_block_size, hash_fn)
        # The worker's geometry, from the spec vLLM builds (building one opens nothing).
        spec = OffloadingSpecFactory.create_spec(build_offloading_config(config, kv_config))
        assert isinstance(spec, CPUOffloadingSpec)
        self.row_bytes = gpu_block_bytes(sliding_window)
        assert spec.cpu_page_size_per_worker == self.row_bytes
        self.region = SharedOffloadRegion(
            engine_id=config.kv_transfer_config.engine_id,
            num_chunks=spec.num_chunks,
            rank=0,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=self.row_bytes,
        )
        self.rows = self.region.create_next_worker_view(self.row_bytes).numpy().view(np.uint8)
        # One array stands for every group's tensor: vLLM's hybrid allocator gives a block id
        # to one group at a time, and row i of the array is block i's page.
        self.gpu = np.zeros((num_gpu_blocks, self.row_bytes), np.uint8)
        self.num_groups = len(kv_config.kv_cache_groups)
        self._pending_stores: list[tuple[int, list[int], list[int]]] = []
        self._completed = OffloadingWorkerMetadata()
        # req -> (group, block index, bytes) of every block a load wrote
        self.loaded_blocks: dict[str, list[tuple[int, int, bytes]]] = {}

    def block_content(self, block_hash: bytes, group: int = 0) -> np.ndarray:
        """The bytes block ``block_hash`` of ``group`` holds (distinct per group)."""
        return payload(make_offload_key(block_hash, group), self.row_bytes)

    def add_request(
        self,
        req_id: str,
        prompt: list[int],
        max_tokens: int = 1,
        kv_transfer_params: dict[str, Any] | None = None,
        kv_hints: KvHintsEnvelope | None = None,
    ) -> Request:
        """A request added as vLLM's engine core adds it (``kv_transfer_params`` through its
        sampling parameters' ``extra_args``, as the OpenAI server passes them)."""
        extra_args = (
            None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        )
        request = Request(
            req_id,
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra_args),
            None,
            block_hasher=self._hasher,
            kv_hints=kv_hints,
        )
        self.scheduler.add_request(request)
        return request

    def drain_tiers(self) -> None:
        wait_for_io(self.manager)

    def step(self) -> dict[str, int]:
        """One engine step; returns the tokens scheduled per request."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        finished_recving: set[str] = set()
        for job_id, src, dst in self._pending_stores:  # deferred from the last step
            for block_id, chunk_id in zip(src, dst, strict=True):
                self.rows[chunk_id] = self.gpu[block_id]
            self._completed.mark_completed(job_id)
        self._pending_stores.clear()
        for job_id, job in meta.load_jobs.items():
            for chunk_id, block_id in zip(
                job.src_spec.block_ids, job.dst_spec.block_ids, strict=True
            ):
                self.gpu[int(block_id)] = self.rows[int(chunk_id)]
            self._completed.mark_completed(job_id)
            finished_recving.add(job.req_id)
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(job.req_id)
            group_sizes = getattr(job.dst_spec, "group_sizes", None) or [len(job.dst_spec)]
            start = 0
            for group, size in enumerate(group_sizes):
                for block_id in job.dst_spec.block_ids[start : start + size]:
                    index = block_ids[group].index(int(block_id))
                    self.loaded_blocks.setdefault(job.req_id, []).append(
                        (group, index, self.gpu[int(block_id)].tobytes())
                    )
                start += size
        req_ids, sampled = [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            groups = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            # schedule() has already advanced num_computed_tokens past this step's tokens.
            start, end = request.num_computed_tokens - num_tokens, request.num_computed_tokens
            for group, block_ids in enumerate(groups):
                for index in range(start // BLOCK_SIZE, end // BLOCK_SIZE):
                    if index < len(request.block_hashes) and block_ids[index] != 0:  # 0: null
                        content = self.block_content(request.block_hashes[index], group)
                        self.gpu[block_ids[index]] = content
            req_ids.append(req_id)
            sampled.append([7] if end >= request.num_tokens else [])
        for job_id, job in meta.store_jobs.items():
            self._pending_stores.append(
                (
                    job_id,
                    [int(b) for b in job.src_spec.block_ids],
                    [int(c) for c in job.dst_spec.block_ids],
                )
            )
        completed = self._completed if self._completed.completed_jobs else None
        self._completed = OffloadingWorkerMetadata()
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
            kv_connector_output=KVConnectorOutput(
                finished_recving=finished_recving or None, kv_connector_worker_meta=completed
            ),
        )
        self.scheduler.update_from_output(out, output)
        self.drain_tiers()
        return dict(out.num_scheduled_tokens)

    def run(self, max_steps: int = 40, idle_steps: int = 3) -> list[dict[str, int]]:
        """Step until no request is left, the connector has no work pending (as vLLM's engine
        core does) and ``idle_steps`` steps in a row did nothing."""
        trace, idle = [], 0
        for _ in range(max_steps):
            scheduled = self.step()
            trace.append(scheduled)
            busy = (
                scheduled
                or self.scheduler.has_requests()
                or self._pending_stores
                or self.connector.has_pending_push_work()
            )
            idle = 0 if busy else idle + 1
            if idle >= idle_steps:
                return trace
        raise AssertionError(f"the engine did not go idle in {max_steps} steps: {trace}")

    def shutdown(self) -> None:
        self.rows = np.empty((0, 0), np.uint8)
        gc.collect()  # views of the region in garbage cycles would keep it mapped
        self.region.cleanup()
        self.connector.shutdown()
