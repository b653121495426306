"""The continuation hint under vLLM 0.33: read from a request's ``kv_transfer_params`` or its
``kv_hints`` (vLLM's own ``ReqContext``, ``Request`` and scheduler carry them), passed to the
primary policy with the request when it finishes; a malformed one is logged and ignored."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from test_vllm_dropin import (  # noqa: F401 (fixtures)
    adapter,
    counters,
    drivers,
    dropin_extra,
    registered,
    start,
    write_yaml,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadPromMetrics
from vllm.v1.kv_hints import KvHintAction, KvHintsEnvelope
from vllm.v1.kv_offload.base import ReqContext
from vllm_harness import BLOCK_SIZE, EngineDriver, ManagerDriver, keys_for, vllm_config

from tiering.integrations.vllm import PRIMARY_LABEL, TieringManager
from tiering.integrations.vllm_hints import HINT_ACTION, HINT_PARAM, request_hint
from tiering.integrations.vllm_metric_names import TieringTierMetrics
from tiering.policies import ChainPolicy


def envelope(*actions: tuple[str, dict[str, object]]) -> KvHintsEnvelope:
    return KvHintsEnvelope(
        protocol_version="1",
        message_id="m",
        actions=[
            KvHintAction(action_id=f"a{i}", action_type=kind, action_version="1", payload=payload)
            for i, (kind, payload) in enumerate(actions)
        ],
    )


@pytest.mark.parametrize(
    ("request_fields", "hint"),
    [
        ({}, None),
        ({"kv_transfer_params": {"other": 1}}, None),
        ({"kv_transfer_params": {HINT_PARAM: True}}, True),
        ({"kv_transfer_params": {HINT_PARAM: False}}, False),
        ({"kv_hints": envelope(("other.action", {"continues": True}))}, None),
        ({"kv_hints": envelope((HINT_ACTION, {"continues": False}))}, False),
        # the last action of the hint's type counts
        (
            {
                "kv_hints": envelope(
                    (HINT_ACTION, {"continues": False}), (HINT_ACTION, {"continues": True})
                )
            },
            True,
        ),
        # kv_transfer_params first
        (
            {
                "kv_transfer_params": {HINT_PARAM: False},
                "kv_hints": envelope((HINT_ACTION, {"continues": True})),
            },
            False,
        ),
    ],
)
def test_the_hint_is_read_from_either_channel(
    request_fields: dict[str, object], hint: bool | None
) -> None:
    assert request_hint(ReqContext(req_id="r", **request_fields)) is hint  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("request_fields", "where"),
    [
        ({"kv_transfer_params": {HINT_PARAM: "yes"}}, "kv_transfer_params['tiering_continues']"),
        ({"kv_transfer_params": {HINT_PARAM: 1}}, "kv_transfer_params['tiering_continues']"),
        ({"kv_hints": envelope((HINT_ACTION, {}))}, "kv_hints action 'a0' payload['continues']"),
    ],
)
def test_a_malformed_hint_is_logged_and_ignored(
    request_fields: dict[str, object], where: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tiering.integrations.vllm_hints"):
        assert request_hint(ReqContext(req_id="r7", **request_fields)) is None  # type: ignore[arg-type]
    params = request_fields.get("kv_transfer_params", {})
    value = params.get(HINT_PARAM) if isinstance(params, dict) else None
    assert [record.getMessage() for record in caplog.records] == [
        f"request r7: {where} must be true or false, got {value!r}; the request is not hinted"
    ]


def chain_of(driver: ManagerDriver) -> ChainPolicy:
    policy = adapter(driver).manager.primary.policy
    assert isinstance(policy, ChainPolicy)
    return policy


@pytest.mark.parametrize("channel", ["kv_transfer_params", "kv_hints"])
def test_a_hinted_request_is_classed_when_it_finishes(
    tmp_path: Path,
    drivers: list[ManagerDriver],  # noqa: F811 (the fixture)
    channel: str,
) -> None:
    """A fresh request is class 0 unhinted, class 1 hinted to be continued; a continuation
    (class 1 unhinted) is class 0 hinted not to be."""
    driver = start(drivers, write_yaml(tmp_path, []), extra={"eviction_policy": "chain"})
    policy = chain_of(driver)

    def hinted(continues: bool) -> dict[str, object]:
        if channel == "kv_transfer_params":
            return {"kv_transfer_params": {HINT_PARAM: continues}}
        return {"kv_hints": envelope((HINT_ACTION, {"continues": continues}))}

    a, b, c = keys_for("a", 1), keys_for("b", 1), keys_for("c", 1)
    plain = driver.new_request("plain")
    driver.store(plain, a)
    driver.finish_request(plain)
    assert policy.list_keys(0) == tuple(a) and policy.class_stats[0].requests == 1
    opened = driver.new_request("open", **hinted(True))
    driver.store(opened, b)
    driver.finish_request(opened)
    assert policy.list_keys(1) == tuple(b) and policy.class_stats[1].requests == 1
    closing = driver.new_request("closing", **hinted(False))  # continues "open": b, then c
    for position, key in enumerate([*b, *c], 1):
        closing.set_offload_key_position(key, position * BLOCK_SIZE)
    driver.load(closing, b)
    driver.store(closing, c)
    driver.finish_request(closing)
    assert policy.class_stats[1].continued == 1  # what it did is learned, whatever the hint
    assert policy.class_stats[0].requests == 2 and set(c) <= set(policy.list_keys(0))
    # Both hints followed: "open"'s (from the prior that hints are right) and "closing"'s (of
    # the requests hinted False none was continued yet, of all requests half were).
    stats = counters(driver)
    requests = (TieringTierMetrics.HINTED_REQUESTS, (PRIMARY_LABEL,))
    followed = (TieringTierMetrics.HINTS_FOLLOWED, (PRIMARY_LABEL,))
    assert (stats[requests], stats[followed]) == (2, 2)
    plain = driver.new_request("plain again")
    driver.store(plain, keys_for("d", 1))
    driver.finish_request(plain)
    stats = counters(driver)  # a counter reports what is new only
    assert requests not in stats and followed not in stats


def test_vllm_s_scheduler_carries_the_hint_to_the_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """End to end: ``kv_hints`` given with the request reach the policy through vLLM's own
    ``Request``, scheduler and ``OffloadingConnector``; the stats the scheduler takes from the
    connector each step count them, and vLLM's Prometheus side takes those."""
    extra = dropin_extra(write_yaml(tmp_path, []), 32, eviction_policy="chain")
    extra["cpu_bytes_to_use"] = 32 * 4096
    config = vllm_config(extra, num_gpu_blocks=32)
    engine = EngineDriver(config, 32)
    registry = CollectorRegistry()
    kinds = {kind: partial(kind, registry=registry) for kind in (Counter, Gauge, Histogram)}
    prometheus = OffloadPromMetrics(config, kinds, ["engine"], {0: ["0"]})
    taken = engine.connector.get_kv_connector_stats

    def observed() -> KVConnectorStats | None:
        stats = taken()  # what the scheduler passes on (to the stat loggers, with log_stats)
        if stats is not None:
            prometheus.observe(stats.data)
        return stats

    monkeypatch.setattr(engine.connector, "get_kv_connector_stats", observed)
    labels = {"engine": "0", "tier": PRIMARY_LABEL}

    def sampled(name: str) -> float | None:
        return registry.get_sample_value(name, labels)

    try:
        manager = engine.manager
        assert isinstance(manager, TieringManager)
        policy = manager.manager.primary.policy
        assert isinstance(policy, ChainPolicy)
        engine.add_request("plain", list(range(1, 1 + 2 * BLOCK_SIZE + 1)))
        engine.run()
        assert policy.class_stats[0].requests == 1 and policy.class_stats[1].requests == 0
        assert sampled("tiering:tier_hinted_requests_total") is None  # none yet
        engine.add_request(
            "open",
            list(range(500, 500 + 2 * BLOCK_SIZE + 1)),
            kv_hints=envelope((HINT_ACTION, {"continues": True})),
        )
        engine.run()
        assert policy.class_stats[1].requests == 1
        engine.add_request(
            "one-off",
            list(range(900, 900 + 2 * BLOCK_SIZE + 1)),
            kv_transfer_params={HINT_PARAM: False},
        )
        engine.run()
        assert policy.class_stats[0].requests == 2 and policy.class_stats[1].requests == 1
        assert sampled("tiering:tier_hinted_requests_total") == 2
        # "one-off"'s hint (False) is not followed: no request had been continued yet.
        assert sampled("tiering:tier_hints_followed_total") == policy.hints_followed == 1
    finally:
        engine.shutdown()
