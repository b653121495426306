"""Drive vLLM 0.33's own CPU manager and tiering's drop-in with the same request streams.

Used by the lockstep differential test (``tests/integrations/test_vllm_lockstep.py``) and by
``benchmarks/bench_vllm_hits.py``. Needs the ``vllm`` package (imported here, not by
``tiering.testing``).

A *request* is a chain of chunk keys (vLLM's ``make_offload_key`` of a block hash, group 0),
each with its end token recorded in the request's ``ReqContext``. It is served as vLLM's
connector serves one: ``lookup`` of its keys in order until the first answer that is not
``HIT``; ``prepare_load`` of the hits; ``prepare_store`` of the rest, in one or more calls;
``complete_store`` of what each call stored after the step that stored it, ``complete_load``
of the loads after their step; ``on_request_finished`` once every store completed.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingManager,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VLLMCPUManager
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from tiering.integrations import vllm_plugin

__all__ = [
    "CHUNK_BYTES",
    "Lockstep",
    "Mismatch",
    "chunk_key",
    "dropin_manager",
    "hit_ratio",
    "vllm_manager",
]

#: Bytes of one chunk of the drop-in's CPU tier here (the region is a file in /dev/shm).
CHUNK_BYTES = 4096
_STEP_END = ScheduleEndContext((), ())


def chunk_key(i: int) -> bytes:
    """The ``i``-th chunk key (group 0)."""
    return make_offload_key(i.to_bytes(32, "big"), 0)


def vllm_manager(
    num_chunks: int, policy: str, *, store_threshold: int = 1, max_tracker_size: int = 64_000
) -> OffloadingManager:
    """vLLM 0.33's own CPU manager (what its ``CPUOffloadingSpec`` builds), events on."""
    return VLLMCPUManager(
        num_chunks,
        cache_policy=policy,
        enable_events=True,
        store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
    )


def dropin_manager(
    num_chunks: int,
    policy: str,
    *,
    store_threshold: int = 1,
    max_tracker_size: int = 64_000,
    yaml_text: str = "version: 1\nprimary: {capacity: 4KiB}\n",
    extra: dict[str, Any] | None = None,
) -> OffloadingManager:
    """tiering's drop-in (``TieringSpec``) built by vLLM's factory over a real shared region,
    with ``eviction_policy`` and ``store_threshold`` as vLLM's keys. Call ``shutdown()``."""
    vllm_plugin.register()
    folder = Path(tempfile.mkdtemp(prefix="tiering-lockstep-"))
    yaml_path = folder / "tiering.yaml"
    yaml_path.write_text(yaml_text)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("layer.0",), 0),),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=True,
        extra_config={
            "spec_name": "TieringSpec",
            "tiering_config": str(yaml_path),
            "cpu_bytes_to_use": num_chunks * CHUNK_BYTES,
            "eviction_policy": policy,
            "store_threshold": store_threshold,
            "max_tracker_size": max_tracker_size,
            **(extra or {}),
        },
        engine_id=f"tiering-lockstep-{os.getpid()}-{random.getrandbits(48):012x}",
        model=OffloadingModelConfig("lockstep", "float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False),
    )
    try:
        return OffloadingSpecFactory.create_spec(config).get_manager()
    finally:  # the manager read the file: a CPU-only drop-in keeps nothing there
        shutil.rmtree(folder, ignore_errors=True)


def hit_ratio(manager: OffloadingManager, requests: Sequence[Sequence[bytes]]) -> float:
    """Serve ``requests`` one per scheduler step, each whole (look up, load the hits, store
    the rest, finish); the share of looked-up chunks that were ``HIT``."""
    hits = total = 0
    for n, request in enumerate(requests):
        keys = cast("list[OffloadKey]", list(request))
        ctx = ReqContext(f"r{n}")
        for i, key in enumerate(keys, 1):
            ctx.set_offload_key_position(key, 16 * i)
        manager.on_new_request(ctx)
        found = 0
        for key in keys:
            if manager.lookup(key, ctx) is not LookupResult.HIT:
                break
            found += 1
        hits += found
        total += len(keys)
        if found:
            manager.prepare_load(keys[:found], ctx)
        out = manager.prepare_store(keys[found:], ctx) if found < len(keys) else None
        manager.on_schedule_end(_STEP_END)
        if found:
            manager.complete_load(set(keys[:found]), ctx)
        if out is not None and out.keys_to_store:
            manager.complete_store(set(out.keys_to_store), ctx)
        manager.on_request_finished(ctx)
        list(manager.take_events())
    return hits / total if total else 0.0


@dataclass
class Mismatch:
    """The first call on which the two managers disagreed."""

    step: int
    call: str
    vllm: object
    dropin: object


@dataclass
class _Active:
    name: str
    keys: list[OffloadKey]
    ctx: tuple[ReqContext, ReqContext]
    to_offer: list[OffloadKey] = field(default_factory=list)
    loads: list[OffloadKey] = field(default_factory=list)
    stores: list[tuple[list[OffloadKey], list[OffloadKey]]] = field(default_factory=list)
    looked_up: bool = False


class Lockstep:
    """vLLM's manager and the drop-in, fed the same calls; :meth:`run` returns the first
    :class:`Mismatch` (``None``: every answer agreed).

    Compared: every ``lookup`` answer, every ``prepare_store``'s ``keys_to_store`` (in order)
    and its evicted keys (as a set), or both ``None``.
    """

    def __init__(self, vllm: OffloadingManager, dropin: OffloadingManager) -> None:
        self.vllm = vllm
        self.dropin = dropin
        self.calls = 0

    def run(
        self,
        rng: random.Random,
        prompts: Sequence[Sequence[bytes]],
        *,
        steps: int,
        max_active: int = 3,
        fail_store_every: int = 0,
        whole_stores: bool = False,
        pick: Callable[[random.Random], int] | None = None,
    ) -> Mismatch | None:
        """``steps`` scheduler steps; each may start a request (a prompt from ``prompts``,
        ``pick`` choosing its index), looks up a new request's keys, offers 1 to 3 chunks per
        active request and finishes those done. With ``fail_store_every`` = k, every k-th
        completed store fails. With ``whole_stores``, a request offers all its new chunks in
        one call, the step after its lookups."""
        active: list[_Active] = []
        completions = 0
        for step in range(steps):
            if len(active) < max_active and rng.random() < 0.7:
                index = pick(rng) if pick is not None else rng.randrange(len(prompts))
                keys = cast("list[OffloadKey]", list(prompts[index]))
                ctxs = (ReqContext(f"s{step}"), ReqContext(f"s{step}"))
                for ctx in ctxs:
                    for i, key in enumerate(keys, 1):
                        ctx.set_offload_key_position(key, 16 * i)
                self.vllm.on_new_request(ctxs[0])
                self.dropin.on_new_request(ctxs[1])
                active.append(_Active(f"s{step}", keys, ctxs))
            for request in active:
                if not request.looked_up:
                    request.looked_up = True
                    found = 0
                    for key in request.keys:
                        a = self.vllm.lookup(key, request.ctx[0])
                        b = self.dropin.lookup(key, request.ctx[1])
                        self.calls += 1
                        if a is not b:
                            return Mismatch(step, f"lookup {request.name}", a, b)
                        if a is not LookupResult.HIT:
                            break
                        found += 1
                    if found:
                        request.loads = request.keys[:found]
                        self.vllm.prepare_load(request.loads, request.ctx[0])
                        self.dropin.prepare_load(request.loads, request.ctx[1])
                    request.to_offer = request.keys[found:]
                    continue
                if not request.to_offer:
                    continue
                count = len(request.to_offer) if whole_stores else rng.randint(1, 3)
                offer, request.to_offer = request.to_offer[:count], request.to_offer[count:]
                a_out = self.vllm.prepare_store(offer, request.ctx[0])
                b_out = self.dropin.prepare_store(offer, request.ctx[1])
                self.calls += 1
                if (a_out is None) != (b_out is None):
                    return Mismatch(step, f"prepare_store {request.name}", a_out, b_out)
                if a_out is not None and b_out is not None:
                    a_view = (list(a_out.keys_to_store), set(a_out.evicted_keys))
                    b_view = (list(b_out.keys_to_store), set(b_out.evicted_keys))
                    if a_view != b_view:
                        return Mismatch(step, f"prepare_store {request.name}", a_view, b_view)
                    if a_out.keys_to_store:
                        request.stores.append((list(a_out.keys_to_store), []))
            self.vllm.on_schedule_end(_STEP_END)
            self.dropin.on_schedule_end(_STEP_END)
            # The model step ran: complete this step's loads and stores, finish those done.
            for request in list(active):
                if request.loads:
                    self.vllm.complete_load(set(request.loads), request.ctx[0])
                    self.dropin.complete_load(set(request.loads), request.ctx[1])
                    request.loads = []
                for stored, _ in request.stores:
                    completions += 1
                    ok = not (fail_store_every and completions % fail_store_every == 0)
                    self.vllm.complete_store(set(stored), request.ctx[0], ok)
                    self.dropin.complete_store(set(stored), request.ctx[1], ok)
                request.stores = []
                if request.looked_up and not request.to_offer:
                    self.vllm.on_request_finished(request.ctx[0])
                    self.dropin.on_request_finished(request.ctx[1])
                    active.remove(request)
            list(self.vllm.take_events())
            list(self.dropin.take_events())
        return None
