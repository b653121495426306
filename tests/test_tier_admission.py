"""Admission for secondary tiers: a tier's ``admission_min_count`` gate in the running manager
(real file and LMDB tiers), its config keys, its metrics and the policy study's use of it."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tiering.backends.memory import MemoryBackend
from tiering.cli import main as cli_main
from tiering.config import build_manager, build_pool, config_json_schema, load_config
from tiering.core.block_format import HEADER_BYTES
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigError, ConfigurationError
from tiering.managers.secondary_tier import SecondaryTier
from tiering.managers.tiering_manager import TieringOffloadingManager
from tiering.observability.prometheus import TieringCollector
from tiering.policies.admission import FrequencyGate

SAMPLE = Path(__file__).parent / "data" / "mooncake_sample.jsonl"
ROW_BYTES = 4096  # the tiny model's block


def key(name: str) -> OffloadKey:
    return make_offload_key(hashlib.sha256(name.encode()).digest(), 0)


def payload(k: OffloadKey) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(k[:6], "big"))
    return torch.randint(0, 256, (ROW_BYTES,), dtype=torch.uint8, generator=gen)


def write_config(tmp_path: Path, tier: str) -> Path:
    path = tmp_path / "tiering.yaml"
    path.write_text(
        "version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 16KiB}\n"  # 4 CPU blocks
        f"secondary_tiers:\n  - {{name: disk, capacity: 1MiB, path: disk, {tier}}}\n"
    )
    return path


class Engine:
    """A manager built from a YAML file, and the engine's side of a store (known bytes)."""

    def __init__(self, config_path: Path) -> None:
        config = load_config(config_path, env={})
        self.pool = build_pool(config)
        self.rows = self.pool.rows_view()
        self.manager: TieringOffloadingManager = build_manager(config, pool=self.pool)
        self.manager.wait_ready()
        self.tier = self.manager.tiers[0]

    def store(self, *keys: OffloadKey) -> None:
        out = self.manager.prepare_store(list(keys))
        assert out is not None
        for k, slot in zip(out.keys_to_store, out.store_spec.block_ids.tolist(), strict=True):
            self.rows[slot] = payload(k)
        self.manager.complete_store(list(keys))
        self.manager.wait_idle()

    def load_exact(self, k: OffloadKey) -> None:
        spec = self.manager.prepare_load([k])
        (slot,) = spec.block_ids.tolist()
        assert torch.equal(self.rows[slot], payload(k))
        self.manager.complete_load([k])

    def close(self) -> None:
        self.manager.shutdown()
        self.pool.close()


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for engine in made:
        engine.close()


def scrape(manager: TieringOffloadingManager) -> dict[tuple[str, str], float]:
    registry = CollectorRegistry()
    registry.register(TieringCollector(manager))
    text = generate_latest(registry).decode()
    return {
        (s.name, s.labels.get("tier", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("tier_type", ["file", "lmdb"])
def test_a_gated_tier_writes_only_blocks_looked_up_min_count_times(
    tmp_path: Path, engines: list[Engine], tier_type: str
) -> None:
    config = write_config(tmp_path, f"type: {tier_type}, admission_min_count: 2")
    engine = Engine(config)
    engines.append(engine)
    manager, tier = engine.manager, engine.tier
    assert tier.admission is not None and tier.admission.min_count == 2
    assert tier.admission.width == 1024  # 8 counters per block of capacity, a power of two
    a0, a1, a2 = key("a0"), key("a1"), key("a2")
    # Looked up past the primary 0, 1 and 2 times (each a miss), then stored.
    assert manager.lookup(a1) is False
    assert manager.lookup(a2) is False
    assert manager.lookup(a2) is False
    engine.store(a0, a1, a2)
    assert [tier.state(k).name for k in (a0, a1, a2)] == ["ABSENT", "ABSENT", "READY"]
    m = tier.metrics
    assert (m.stores_not_admitted, m.stored_blocks, m.store_jobs) == (2, 1, 1)
    assert m.bytes_written == ROW_BYTES
    # Not admitted: a miss in the tier, still a hit in the CPU tier (not recorded: a CPU hit
    # is not a lookup past the primary).
    assert manager.lookup(a1) is True
    engine.load_exact(a1)
    # Four new blocks (never looked up: not admitted) push a0, a1, a2 out of the CPU tier.
    fillers = [key(f"f{i}") for i in range(4)]
    engine.store(*fillers)
    assert m.stores_not_admitted == 2 + 4
    assert manager.lookup(a2) is None  # in the tier: promoted
    manager.wait_idle()
    assert manager.lookup(a2) is True
    engine.load_exact(a2)  # bit-exact from the tier
    assert manager.lookup(a1) is False  # in no tier now: its second lookup past the primary
    assert manager.lookup(a0) is False  # its first
    engine.store(a1, a0)
    assert tier.state(a1).name == "READY" and tier.state(a0).name == "ABSENT"
    assert (m.stores_not_admitted, m.stored_blocks, m.bytes_written) == (7, 2, 2 * ROW_BYTES)
    assert manager.metrics()["disk"]["stores_not_admitted"] == 7
    values = scrape(manager)
    assert values[("tiering_stores_not_admitted_total", "disk")] == 7
    assert values[("tiering_stored_blocks_total", "disk")] == 2
    engine.close()
    engines.remove(engine)
    # What is on disk: exactly the admitted blocks, served bit-exact after a restart.
    again = Engine(config)
    engines.append(again)
    assert set(again.tier.held) == {a1, a2}
    assert again.manager.lookup(a1) is None
    again.manager.wait_idle()
    again.load_exact(a1)


def test_a_selective_tier_applies_its_rule_then_the_gate(
    tmp_path: Path, engines: list[Engine]
) -> None:
    tier = "type: file, write_policy: write_through_selective, selective_min_lookups: 1, "
    engine = Engine(write_config(tmp_path, tier + "admission_min_count: 3"))
    engines.append(engine)
    b1, b2, b3 = key("b1"), key("b2"), key("b3")
    for k, lookups in ((b1, 1), (b2, 2), (b3, 3)):
        for _ in range(lookups):
            assert engine.manager.lookup(k) is False
    engine.store(key("b0"), b1, b2, b3)
    # b0 fails the selective rule (not counted); b1 and b2 pass it and fail the gate.
    assert set(engine.tier.held) == {b3}
    assert engine.tier.metrics.stores_not_admitted == 2


def test_the_tiers_gate_ages_by_halving(tmp_path: Path, engines: list[Engine]) -> None:
    tier = "type: file, admission_min_count: 2, admission_width: 9"
    engine = Engine(write_config(tmp_path, tier))
    engines.append(engine)
    gate = engine.tier.admission
    assert gate is not None and gate.width == 16  # rounded up to a power of two, at least 16
    hot, other = key("hot"), key("other")
    for _ in range(3):
        gate.record(hot)
    for _ in range(10 * 16 - 4):  # one record short of the aging period (160 records)
        gate.record(other)
    assert (gate.estimate(hot), gate.estimate(other)) == (3, 156)
    gate.record(other)  # the 160th: every counter halves
    assert (gate.estimate(hot), gate.estimate(other)) == (1, 78)
    engine.store(hot)
    assert hot not in engine.tier.held and engine.tier.metrics.stores_not_admitted == 1


def test_keys_that_differ_only_in_their_lowest_bit_are_counted_apart() -> None:
    gate = FrequencyGate(64, min_count=2)
    even, odd = (2).to_bytes(8, "little"), (3).to_bytes(8, "little")
    gate.record(even)
    gate.record(even)
    assert gate.admits(even) and gate.estimate(odd) == 0 and not gate.admits(odd)


def test_without_a_gate_lookups_past_the_primary_are_not_counted(
    tmp_path: Path, engines: list[Engine]
) -> None:
    engine = Engine(write_config(tmp_path, "type: file"))
    engines.append(engine)
    assert engine.tier.admission is None
    lookups = engine.manager._tier_lookups
    assert not lookups.counts_lookups and lookups.gates == ()
    assert engine.manager._one_tier_held is engine.tier.held  # the hot path's shortcut stays
    engine.store(key("c"))
    assert engine.tier.metrics.stores_not_admitted == 0 and key("c") in engine.tier.held


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        (
            "admission_min_count: -1",
            "secondary_tiers[0].admission_min_count: -1 is too small: give an integer from 0 "
            "to 255",
        ),
        (
            "admission_min_count: 256",
            "secondary_tiers[0].admission_min_count: 256 is too large: give an integer from 0 "
            "to 255",
        ),
        (
            "admission_min_count: two",
            "secondary_tiers[0].admission_min_count: 'two' is not valid: give an integer from 0 "
            "to 255",
        ),
        (
            "admission_min_count: 2, admission_width: 0",
            "secondary_tiers[0].admission_width: 0 is too small: give an integer >= 1 or null",
        ),
        (
            "admission_width: 64",
            "secondary_tiers[0].admission_width: 64 is set but admission_min_count is 0 (no "
            "gate); set admission_min_count >= 1 or remove admission_width",
        ),
        (
            "admission_min_count: 2, write_policy: write_back",
            "secondary_tiers[0].admission_min_count: 2: admission applies to write_through and "
            "write_through_selective tiers, not write_back",
        ),
    ],
)
def test_bad_admission_keys_are_config_errors(tmp_path: Path, tier: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write_config(tmp_path, f"type: file, {tier}"), env={})
    assert f"tiering.yaml:5: {message}" in str(info.value)  # the tier's line


def test_admission_keys_take_env_overrides_and_are_in_the_schema(tmp_path: Path) -> None:
    path = write_config(tmp_path, "type: file")
    env = {
        "TIERING_SECONDARY_TIERS__DISK__ADMISSION_MIN_COUNT": "3",
        "TIERING_SECONDARY_TIERS__DISK__ADMISSION_WIDTH": "4096",
    }
    (tier,) = load_config(path, env=env).secondary_tiers
    assert (tier.admission_min_count, tier.admission_width) == (3, 4096)
    bad = {"TIERING_SECONDARY_TIERS__DISK__ADMISSION_MIN_COUNT": "-3"}
    with pytest.raises(ConfigError, match="TIERING_SECONDARY_TIERS__DISK__ADMISSION_MIN_COUNT"):
        load_config(path, env=bad)
    text = json.dumps(config_json_schema())
    assert '"admission_min_count"' in text and '"admission_width"' in text


def _memory_backend() -> MemoryBackend:
    return MemoryBackend(
        capacity_bytes=8 * (HEADER_BYTES + 256), block_bytes=256, fingerprint=bytes(16)
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"admission_min_count": 2, "write_policy": "write_back"},
            "tier 'memory': admission_min_count 2 does not apply to a write_back tier",
        ),
        (
            {"admission_min_count": 256},
            "tier 'memory': admission_min_count must be in [0, 255]",
        ),
        (
            {"admission_min_count": 1, "admission_width": 0},
            "tier 'memory': admission_width must be an int >= 1",
        ),
        (
            {"admission_width": 8},
            "tier 'memory': admission_width 8 is set but admission_min_count is 0",
        ),
    ],
)
def test_a_tier_built_by_hand_checks_its_admission(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        SecondaryTier(_memory_backend(), **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_a_tier_built_by_hand_sizes_its_gate_from_its_capacity() -> None:
    gate = SecondaryTier(_memory_backend(), admission_min_count=4).admission
    assert gate is not None and (gate.width, gate.min_count) == (64, 4)  # 8 blocks: at least 64


# -- the policy study -----------------------------------------------------------------------------


def _study(tmp_path: Path, capsys: pytest.CaptureFixture[str], tier: str, *extra: str) -> dict:
    path = tmp_path / "study.yaml"
    path.write_text(
        "version: 1\nmodel: {shape: tiny}\nprimary: {capacity: 256KiB}\n"
        f"secondary_tiers:\n  - {{name: nvme, type: file, capacity: 1MiB, path: nvme{tier}}}\n"
    )
    args = ["policy-study", "--config", str(path), "--trace", str(SAMPLE), "--sizes", "0.3"]
    assert cli_main([*args, "--policies", "lru", "--json", *extra]) == 0
    shutil.rmtree(tmp_path / "nvme", ignore_errors=True)
    rows = json.loads(capsys.readouterr().out)["policy_study"]
    (lru,) = [r for r in rows if r["policy"] == "lru"]
    assert lru["capacity_blocks"] == 3
    return dict(lru["tiers"]["nvme"])


# By hand. The sample, in arrival order, as study blocks (512 tokens; partial last blocks
# dropped; A = [1], B = [1, 2], C = [1, 2, 3], ...): A B C | A B C | A E | I | F | A B C H.
# An LRU CPU tier of 3 blocks misses A B C, then hits A B C and A, then misses E (evicting C),
# I (evicting B), F (evicting A), A B C H. Lookups past the CPU tier: A B C E I F A B C H.
# The tier (8 study blocks of 128 KiB: never full). Without a gate it writes every block it
# does not serve: A B C, E, I, F, then serves A B C and writes H: 7 written, 3 served. With
# admission_min_count 2 it writes only A B C, at their second lookup (the last request), and
# serves nothing.
BLOCK = 128 * 1024


def test_the_study_reports_the_configured_gate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gated = _study(tmp_path, capsys, ", admission_min_count: 2")
    assert gated == {
        "capacity_blocks": 8,
        "served_blocks": 0,
        "bytes_written": 3 * BLOCK,
        "bytes_written_per_hit": None,
        "bytes_written_without_admission": 7 * BLOCK,
        "bytes_written_per_hit_without_admission": round(7 * BLOCK / 3),
        "served_blocks_without_admission": 3,
    }
    ungated = _study(tmp_path, capsys, "")
    assert ungated["bytes_written"] == ungated["bytes_written_without_admission"] == 7 * BLOCK
    assert ungated["served_blocks"] == 3


def test_admission_on_the_command_line_overrides_the_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --admission 0: no gate, whatever the config says.
    off = _study(tmp_path, capsys, ", admission_min_count: 2", "--admission", "0")
    assert off["bytes_written"] == off["bytes_written_without_admission"] == 7 * BLOCK
    # --admission 3: A B C reach only 2 lookups; nothing is written.
    strict = _study(tmp_path, capsys, ", admission_min_count: 2", "--admission", "3")
    assert strict["bytes_written"] == 0
    # --admission 2 on a tier configured without a gate.
    on = _study(tmp_path, capsys, "", "--admission", "2")
    assert on["bytes_written"] == 3 * BLOCK
