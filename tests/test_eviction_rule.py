"""The victim rule a policy follows, made visible: ``EvictionPolicy.rule`` / ``rules`` /
``rule_switches``, the manager's ``tiering_eviction_rule`` metrics, and the study's
``rule_shares`` and ``rule_switches``.

Traffic that makes ``hybrid`` switch: four hot keys used twice, then a scan of one-off keys
with a hot key between each pair. ARC keeps the hot keys in T2 and serves them; hybrid's own
rule and LRU lose them to the scan, so ARC's shadow leads and hybrid follows it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiering.cli import main
from tiering.config import build_manager, parse_config
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.observability.prometheus import TieringCollector
from tiering.policies import ARCPolicy, HybridPolicy, LRUPolicy
from tiering.policies._shadows import RULES
from tiering.replay.study import StudyTrace, run_study, simulate_cpu
from tiering.replay.study_cli import format_rows


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def hot_keys_and_a_scan(rounds: int = 300) -> list[list[OffloadKey]]:
    hot = [k(i) for i in range(4)]
    requests = [[key] for key in hot for _ in range(2)]
    for i in range(rounds):
        requests.append([k(1000 + 2 * i), k(1001 + 2 * i)])
        requests.append([hot[i % 4]])
    return requests


class _Recording(HybridPolicy):
    """Hybrid, recording its rule after each store."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.followed: list[str] = []

    def insert_new(self, keys: Any, evictable: bool = True) -> None:
        super().insert_new(keys, evictable)
        self.followed.append(self.rule)


def test_one_rule_policies_name_themselves_and_never_switch() -> None:
    for policy in (LRUPolicy(6), ARCPolicy(6)):
        simulate_cpu(policy, hot_keys_and_a_scan())
        assert (policy.rule, policy.rules, policy.rule_switches) == (
            policy.name,
            (policy.name,),
            0,
        )


def test_hybrid_counts_each_change_of_its_rule_and_keeps_the_count_through_clear() -> None:
    policy = _Recording(6)
    assert (policy.rule, policy.rules, policy.rule_switches) == ("hybrid", RULES, 0)
    simulate_cpu(policy, hot_keys_and_a_scan())
    before = ["hybrid", *policy.followed[:-1]]
    changes = sum(a != b for a, b in zip(before, policy.followed, strict=True))
    assert policy.rule == "arc" and changes == 1
    assert policy.rule_switches == changes
    policy.clear()
    assert (policy.rule, policy.rule_switches) == ("hybrid", 1)  # back to the first: not a switch


def test_hybrid_without_shadows_has_one_rule() -> None:
    class Alone(HybridPolicy):
        _FOLLOWS_SHADOWS = False

    policy = Alone(6)
    simulate_cpu(policy, hot_keys_and_a_scan())
    assert (policy.rule, policy.rules, policy.rule_switches) == ("hybrid", ("hybrid",), 0)


# -- metrics ----------------------------------------------------------------------------------

CONFIG = {
    "version": 1,
    "model": {"shape": "tiny"},  # 4 KiB blocks
    "primary": {"capacity": "24KiB", "policy": "hybrid"},  # 6 blocks
    "secondary_tiers": [{"name": "ram", "type": "memory", "capacity": "1MiB", "policy": "arc"}],
}


def _rule_samples(manager: TieringOffloadingManager) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    registry.register(TieringCollector(manager))
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name.startswith("tiering_eviction_rule"):
                tier = sample.labels["tier"]
                out[(sample.name, f"{tier}:{sample.labels.get('rule', '')}")] = sample.value
    return out


def test_the_rule_each_tier_follows_is_scraped() -> None:
    manager = build_manager(parse_config(CONFIG, env={}))
    try:
        manager.wait_ready()
        _drive_and_scrape(manager)
    finally:
        manager.shutdown()


def _drive_and_scrape(manager: TieringOffloadingManager) -> None:
    before = _rule_samples(manager)
    assert before == {
        ("tiering_eviction_rule", "primary:hybrid"): 1.0,
        ("tiering_eviction_rule", "primary:lru"): 0.0,
        ("tiering_eviction_rule", "primary:arc"): 0.0,
        ("tiering_eviction_rule_switches_total", "primary:"): 0.0,
        ("tiering_eviction_rule", "ram:arc"): 1.0,
        ("tiering_eviction_rule_switches_total", "ram:"): 0.0,
    }
    for keys in hot_keys_and_a_scan():
        if manager.lookup_prefix(keys):
            manager.touch(keys)
        out = manager.prepare_store(keys)
        assert out is not None
        manager.complete_store(out.keys_to_store)
        manager.wait_idle()
    policy = manager.primary.policy
    assert policy.rule == "arc" and policy.rule_switches >= 1
    after = _rule_samples(manager)
    for rule in RULES:
        assert after[("tiering_eviction_rule", f"primary:{rule}")] == (rule == "arc")
    assert after[("tiering_eviction_rule_switches_total", "primary:")] == policy.rule_switches
    assert after[("tiering_eviction_rule", "ram:arc")] == 1.0
    totals = manager.metrics()
    assert totals["primary"]["eviction_rule"] == "arc"
    assert totals["primary"]["eviction_rules"] == list(RULES)
    assert totals["ram"]["eviction_rule_switches"] == 0


# -- the study --------------------------------------------------------------------------------


def _trace() -> StudyTrace:
    key_lists: list[list[bytes]] = [list(keys) for keys in hot_keys_and_a_scan()]
    return StudyTrace(key_lists, [512 * len(keys) for keys in key_lists], 512)


def test_the_study_reports_the_rules_each_policy_followed() -> None:
    trace = _trace()
    rows = run_study(trace, [6], ["lru", "hybrid"])
    by_policy = {row["policy"]: row for row in rows}
    assert by_policy["lru"]["rule_shares"] == {"lru": 1.0}
    assert by_policy["lru"]["rule_switches"] == 0
    assert "rule_shares" not in by_policy["belady"]
    policy = _Recording(6)
    simulate_cpu(policy, trace.key_lists)
    stored = len(policy.followed)  # requests that stored misses, the rule read before each
    first_arc = ["hybrid", *policy.followed].index("arc")
    hybrid = by_policy["hybrid"]
    assert hybrid["rule_switches"] == policy.rule_switches == 1
    assert hybrid["rule_shares"] == {
        "arc": round((stored - first_arc) / stored, 4),
        "hybrid": round(first_arc / stored, 4),
    }
    text = format_rows(rows).splitlines()
    at = text.index(next(line for line in text if "rules followed" in line))
    (line,) = text[at + 2 :]
    assert line.split()[:3] == ["hybrid", "6", "1"]
    assert "arc " in line and "hybrid " in line


def test_no_rules_section_when_no_policy_switched() -> None:
    rows = run_study(_trace(), [6], ["lru", "arc"])
    assert all(row.get("rule_switches", 0) == 0 for row in rows)
    assert "rules followed" not in format_rows(rows)


def test_policy_study_json_has_the_rule_columns(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "scan.jsonl"
    with trace.open("w") as out:
        for i, keys in enumerate(hot_keys_and_a_scan()):
            ids = [int.from_bytes(key[:8], "big") for key in keys]
            out.write(json.dumps({"timestamp": i, "input_length": 512 * len(ids),
                                  "output_length": 1, "hash_ids": ids}) + "\n")  # fmt: skip
    config = tmp_path / "tiering.yaml"
    config.write_text("version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 8KiB}\n")
    code = main(["policy-study", "--config", str(config), "--trace", str(trace),
                 "--policies", "hybrid", "--sizes", "0.01", "--json"])  # fmt: skip
    assert code == 0
    (row, _belady) = json.loads(capsys.readouterr().out)["policy_study"]
    assert row["policy"] == "hybrid"
    assert isinstance(row["rule_switches"], int)
    assert abs(sum(row["rule_shares"].values()) - 1) < 1e-3
