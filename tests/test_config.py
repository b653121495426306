"""The YAML config: exact errors for bad input, env overrides, units, schema, building a manager."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import stat
import typing
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.backends.file import FileBackend
from tiering.backends.lmdb import LMDBBackend
from tiering.backends.memory import MemoryBackend
from tiering.backends.settings import (
    MAX_INT,
    SIZE_UNITS,
    FileSettings,
    LMDBSettings,
    format_size,
    parse_size,
)
from tiering.config import (
    MAX_CONFIG_BYTES,
    ConfigWarning,
    HashingConfig,
    ReplaySettings,
    TierConfig,
    TieringConfig,
    _TierKeys,
    build_backend,
    build_manager,
    build_pool,
    build_tier,
    config_json_schema,
    layout_for_config,
    load_config,
    parse_config,
)
from tiering.core.hashing import SUPPORTED_ALGORITHMS
from tiering.core.identity import layout_fingerprint
from tiering.core.keys import make_offload_key
from tiering.errors import ConfigError, ConfigurationError
from tiering.managers.secondary_tier import SecondaryTier, WritePolicy
from tiering.model.kv_tensors import allocate_kv_caches
from tiering.model.shapes import get_model_shape
from tiering.replay.traces import SCALES

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tiering.yaml"

VALID = """\
version: 1
model:
  shape: tiny
hashing:
  hash_block_size: 16
primary:
  capacity: 64KiB
  policy: lru
secondary_tiers:
  - name: nvme
    type: file
    capacity: 1MiB
    path: data/nvme
  - type: lmdb
    capacity: 1MiB
    path: data/lmdb
    sync: false
"""


def write(tmp_path: Path, text: str, name: str = "tiering.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> TieringConfig:
    return load_config(write(tmp_path, text), env=env or {})


# -- a valid file ----------------------------------------------------------------------------


def test_valid_config_gives_typed_frozen_objects(tmp_path: Path) -> None:
    config = load(tmp_path, VALID)
    assert config.source == str(tmp_path / "tiering.yaml")
    assert config.version == 1
    assert config.model is not None and config.model.shape == "tiny"
    assert config.model.world_size == 1
    assert config.hashing == HashingConfig(16, "sha256")
    assert config.block_size_factor == 1
    assert config.primary.capacity_bytes == 64 * 1024
    nvme, lmdb = config.secondary_tiers
    assert nvme == TierConfig(
        name="nvme",
        type="file",
        capacity_bytes=1 << 20,
        path=tmp_path / "data" / "nvme",
        policy="lru",
        write_policy=WritePolicy.WRITE_THROUGH,
        selective_min_lookups=2,
        max_inflight_jobs=4,
        quarantine_seconds=10.0,
        settings=FileSettings(),
    )
    assert lmdb.name == "lmdb"  # the name defaults to the type
    assert lmdb.settings == LMDBSettings(sync=False)
    assert config.events.enabled is False and config.metrics.enabled is True
    assert config.replay == ReplaySettings()
    assert config.tier("lmdb") is lmdb
    with pytest.raises(ConfigError, match=r"no tier named 'ssd'; tiers: nvme, lmdb"):
        config.tier("ssd")
    for obj, attr in [
        (config, "version"),
        (config.primary, "capacity_bytes"),
        (nvme, "capacity_bytes"),
        (nvme.settings, "durability"),
        (config.replay, "seed"),
    ]:
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(obj, attr, 0)
    json.dumps(config.as_dict())  # JSON-serializable
    assert config.as_dict()["secondary_tiers"][0]["path"] == str(tmp_path / "data" / "nvme")


def test_parsing_has_no_side_effects(tmp_path: Path) -> None:
    load(tmp_path, VALID)
    assert not (tmp_path / "data").exists()


def test_relative_paths_are_taken_from_the_yaml_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    text = VALID.replace("path: data/lmdb", "path: ../shared/./lmdb")
    text += "replay:\n  trace: traces/mine.jsonl\n"
    config = load_config(write(tmp_path / "conf", text), env={})
    assert config.secondary_tiers[0].path == tmp_path / "conf" / "data" / "nvme"
    assert config.secondary_tiers[1].path == tmp_path / "shared" / "lmdb"
    assert config.replay.trace == str(tmp_path / "conf" / "traces" / "mine.jsonl")
    parsed = parse_config({"version": 1, "primary": {"capacity": 1}}, env={})
    assert parsed.source == "<config>"


def test_example_config_loads(tmp_path: Path) -> None:
    shutil.copy(EXAMPLE, tmp_path / "tiering.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the demo config must not warn
        config = load_config(tmp_path / "tiering.yaml", env={})
    assert [(t.name, t.type) for t in config.secondary_tiers] == [
        ("nvme", "file"),
        ("lmdb", "lmdb"),
    ]
    assert config.primary.capacity_bytes == 512 << 20
    assert [t.capacity_bytes for t in config.secondary_tiers] == [2 << 30, 1 << 30]
    for tier in config.secondary_tiers:
        assert tier.path is not None and tier.path.is_relative_to(tmp_path / "demo-data")
    assert config.model is not None and config.model.shape == "llama-3-8b"
    assert config.num_cpu_blocks() == 256


# -- exact errors for each class of bad input ------------------------------------------------

BAD_INPUTS = [
    # (yaml text, expected message: file:line: key path: problem)
    ("", r"tiering.yaml: the config is empty; it needs at least 'version: 1'"),
    ("- 1\n- 2\n", r"tiering.yaml:1: the top level must be a mapping .*got _LineList|list"),
    (
        "version: 1\nprimry:\n  capacity: 1GiB\n",
        r"tiering.yaml:2: primry: unknown key 'primry'; did you mean 'primary'\? \(valid keys: ",
    ),
    ("primary:\n  capacity: 1GiB\n", r"tiering.yaml:1: version: missing; add 'version: 1'"),
    (
        "version: 2\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:1: version: unsupported config version 2; supported: 1",
    ),
    (
        "version: 1.0\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:1: version: must be the integer 1, got float 1.0; write 'version: 1'",
    ),
    (
        "version: '1'\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:1: version: must be the integer 1, got str '1'; write 'version: 1'",
    ),
    (
        "version: true\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:1: version: must be the integer 1, got bool True; write 'version: 1'",
    ),
    (
        "version: 1.5\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:1: version: must be the integer 1, got float 1.5",
    ),
    ("version: 1\n", r"tiering.yaml:1: primary: missing; give at least 'version: 1' and"),
    (
        "version: 1\nprimary:\n  policy: lru\n",
        r"tiering.yaml:2: primary.capacity: missing; give a size: an int of bytes or a number "
        r"with a unit \(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB\)",
    ),
    (
        "version: 1\nprimary:\n  capacity: -4GiB\n",
        r"tiering.yaml:3: primary.capacity: '-4GiB' is not a valid size: sizes must be >= 1",
    ),
    (
        "version: 1\nprimary:\n  capacity: 0\n",
        r"tiering.yaml:3: primary.capacity: 0 is not a valid size: sizes must be >= 1",
    ),
    (
        "version: 1\nprimary:\n  capacity: 4 gigs\n",
        r"tiering.yaml:3: primary.capacity: '4 gigs' is not a size: write a number and a unit "
        r"\(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB\)",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1.5B\n",
        r"primary.capacity: '1.5B' is not a whole number of bytes",
    ),
    (
        "version: 1\nprimary:\n  capacity: 4.5\n",
        r"primary.capacity: 4.5 is not a size: give an int of bytes or a string with a unit",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\n  policy: lfu\n",
        r"tiering.yaml:4: primary.policy: unknown eviction policy 'lfu'; known policies: "
        r".*arc, .*lru",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\n  polcy: lru\n",
        r"tiering.yaml:4: primary.polcy: unknown key 'polcy'; did you mean 'policy'\?",
    ),
    (
        "version: 1\nmodel:\n  shape: tiny\n  world_size: two\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:4: model.world_size: 'two' is not valid: give an integer >= 1",
    ),
    (
        "version: 1\nmodel:\n  shape: gpt-9\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:3: model.shape: unknown model shape 'gpt-9'; known shapes: hybrid-swa, "
        r"llama-3-8b, tiny, tiny-hybrid",
    ),
    (
        "version: 1\nmodel:\n  shape: tiny\nhashing:\n  hash_block_size: 5\n"
        "primary:\n  capacity: 1GiB\n",
        r"tiering.yaml:5: hashing.hash_block_size: group 0 \('full_attention'\) has "
        r"block_size=16 tokens, which hash_block_size=5 does not divide: set hash_block_size "
        r"to a divisor",
    ),
    (
        "version: 1\nhashing:\n  algorithm: md5\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:3: hashing.algorithm: 'md5' is not valid: give one of 'sha256', "
        r"'xxh3_128'",
    ),
    (
        "version: 1\nblock_size_factor: 0\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:2: block_size_factor: 0 is not valid: give an integer >= 1",
    ),
    (
        "version: 1\nmodel:\n  shape: llama-3-8b\nprimary:\n  capacity: 1MiB\n",
        r"tiering.yaml:5: primary.capacity: 1MiB holds no block of model 'llama-3-8b' "
        r"\(2MiB each\); give at least 2MiB",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n  type: file\n",
        r"tiering.yaml:4: secondary_tiers: must be a list of tiers, got _LineMap|dict",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n  - capacity: 1GiB\n",
        r"tiering.yaml:5: secondary_tiers\[0\].type: missing; give a backend name "
        r"\(file, lmdb, memory, ...\)",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: nvme\n    capacity: 1GiB\n",
        r"tiering.yaml:5: secondary_tiers\[0\].type: unknown backend type 'nvme'; known "
        r"backends: .*file, lmdb, memory",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: memory\n    capacity: 1GiB\n  - type: memory\n    capacity: 2GiB\n",
        r"tiering.yaml:7: secondary_tiers\[1\].name: duplicate tier name 'memory' \(also "
        r"secondary_tiers\[0\]\)",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: memory\n    name: fast-one\n    capacity: 1GiB\n"
        "  - type: memory\n    name: FAST_ONE\n    capacity: 2GiB\n",
        r"tiering.yaml:9: secondary_tiers\[1\].name: duplicate tier name 'FAST_ONE'",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: memory\n    name: 'no spaces'\n    capacity: 1GiB\n",
        r"tiering.yaml:6: secondary_tiers\[0\].name: 'no spaces' is not a valid tier name",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: file\n    capacity: 1GiB\n    path: a\n"
        "  - type: lmdb\n    capacity: 1GiB\n    path: ./a\n",
        r"tiering.yaml:10: secondary_tiers\[1\].path: '.*/a' is also the path of "
        r"secondary_tiers\[0\]",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: file\n    capacity: 1GiB\n",
        r"tiering.yaml:5: secondary_tiers\[0\].path: missing; the 'file' backend keeps its "
        r"data in a directory",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: memory\n    capacity: 1GiB\n    path: x\n",
        r"tiering.yaml:7: secondary_tiers\[0\].path: the 'memory' backend takes no path",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: file\n    capacity: 1GiB\n    path: a-file/sub\n",
        r"tiering.yaml:7: secondary_tiers\[0\].path: 'a-file/sub': cannot create '.*a-file/sub': "
        r"'.*a-file' is not a directory",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: file\n    capacity: 1GiB\n    path: a-file\n",
        r"secondary_tiers\[0\].path: 'a-file': '.*a-file' exists and is not a directory",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: file\n    capacity: 1GiB\n    path: d\n    capacty: 2GiB\n",
        r"tiering.yaml:8: secondary_tiers\[0\].capacty: unknown key 'capacty'; did you mean "
        r"'capacity'\?",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: file\n    capacity: 1GiB\n    path: d\n    durability: sometimes\n",
        r"tiering.yaml:8: secondary_tiers\[0\].durability: 'sometimes' is not valid: give one "
        r"of 'none', 'fsync'",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: lmdb\n    capacity: 1GiB\n    path: d\n    map_async: true\n",
        r"tiering.yaml:5: secondary_tiers\[0\]: map_async: true requires writemap: true",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: memory\n    capacity: 1GiB\n    write_policy: later\n",
        r"tiering.yaml:7: secondary_tiers\[0\].write_policy: 'later' is not valid: give one "
        r"of 'write_through', 'write_back', 'write_through_selective'",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: memory\n    capacity: 1GiB\n    policy: fifo\n",
        r"tiering.yaml:7: secondary_tiers\[0\].policy: unknown eviction policy 'fifo'",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n"
        "  - type: memory\n    capacity: 1GiB\n    max_inflight_jobs: 0\n",
        r"tiering.yaml:7: secondary_tiers\[0\].max_inflight_jobs: 0 is too small: give an "
        r"integer >= 1",
    ),
    (
        "version: 1\nmodel:\n  shape: llama-3-8b\nprimary:\n  capacity: 1GiB\n"
        "secondary_tiers:\n  - type: memory\n    capacity: 1MB\n",
        r"tiering.yaml:8: secondary_tiers\[0\].capacity: 1MB holds no block of model "
        r"'llama-3-8b'",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nsecondary_tiers:\n  - memory\n",
        r"tiering.yaml:5: secondary_tiers\[0\]: a tier must be a mapping",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nreplay:\n  scale: huge\n",
        r"tiering.yaml:5: replay.scale: 'huge' is not a trace scale; valid: tiny, demo, large",
    ),
    (
        "version: 1\nprimary:\n  capacity: 1GiB\nreplay:\n  trace: chats\n",
        r"tiering.yaml:5: replay.trace: 'chats' is neither a built-in trace \(chat, rag, agent, "
        r"mixed, conversation, toolagent, documents, production\) nor a path to a .jsonl file",
    ),
    (
        "version: 1\nprimary: 4GiB\n",
        r"tiering.yaml:2: primary: must be a mapping \(keys capacity, policy, store_threshold, "
        r"copy_backend, store_copy_backend\), got str: '4GiB'",
    ),
    (
        "version: 1\nevents:\n  enabled: 'yes'\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:3: events.enabled: 'yes' is not valid: give true or false",
    ),
    # YAML-level attacks and mistakes
    (
        "version: 1\nprimary:\n  capacity: 1GiB\n  capacity: 2GiB\n",
        r"tiering.yaml:4: invalid config YAML: duplicate key 'capacity' \(first on line 3\)",
    ),
    (
        "version: 1\nprimary: &p\n  capacity: 1GiB\nreplay: *p\n",
        r"tiering.yaml:4: invalid config YAML: YAML aliases \(\*name\) are not allowed",
    ),
    (
        "version: 1\nprimary: !!python/object/apply:os.system ['echo pwned']\n",
        r"tiering.yaml:2: invalid config YAML: could not determine a constructor for the tag "
        r"'tag:yaml.org,2002:python/object/apply:os.system'.*only plain YAML",
    ),
    (
        "version: 1\nprimary:\n  capacity: !!python/name:os.system\n",
        r"tiering.yaml:3: invalid config YAML: could not determine a constructor for the tag "
        r"'tag:yaml.org,2002:python/name:os.system'",
    ),
    (
        "version: 1\n1: x\nprimary:\n  capacity: 1GiB\n",
        r"tiering.yaml:2: invalid config YAML: keys must be strings, got int 1",
    ),
    ("version: 1\nprimary: [\n", r"tiering.yaml:3: invalid config YAML: "),
    ("version: 1\n---\nversion: 1\n", r"tiering.yaml:\d: invalid config YAML: expected a single"),
    (
        "version: 1\nprimary:\n  <<: {capacity: 1GiB}\n",
        r"tiering.yaml:3: invalid config YAML: .*tag:yaml.org,2002:merge",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD_INPUTS)
def test_bad_input_gives_an_exact_error(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, text)


def test_alias_bomb_is_refused_at_the_first_alias(tmp_path: Path) -> None:
    lines = ["version: 1", "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    with pytest.raises(ConfigError, match=r"tiering.yaml:3: invalid config YAML: YAML aliases"):
        load(tmp_path, "\n".join(lines) + "\n")


def test_deep_nesting_is_refused(tmp_path: Path) -> None:
    text = "version: 1\nprimary: " + "[" * 5000 + "]" * 5000 + "\n"
    with pytest.raises(ConfigError, match=r"tiering.yaml:2: .*nested deeper than 32 levels"):
        load(tmp_path, text)


def test_large_file_is_refused_before_parsing(tmp_path: Path) -> None:
    text = VALID + "#" + "x" * (2 * MAX_CONFIG_BYTES) + "\n"  # 2 MiB, valid YAML otherwise
    with pytest.raises(ConfigError, match=r"tiering.yaml: the file is over 1MiB"):
        load(tmp_path, text)


def test_unreadable_and_non_utf8_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing.yaml: cannot read the config: No such file"):
        load_config(tmp_path / "missing.yaml", env={})
    (tmp_path / "latin1.yaml").write_bytes(b"version: 1\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text \(byte 16\)"):
        load_config(tmp_path / "latin1.yaml", env={})


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_tier_parent(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        text = VALID.replace("path: data/nvme", "path: locked/nvme")
        with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].path: .*is not writable"):
            load(tmp_path, text)
    finally:
        locked.chmod(0o700)


def test_errors_are_config_errors_and_value_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, "version: 1\nprimary:\n  capacity: lots\n")
    assert isinstance(info.value, ConfigurationError) and isinstance(info.value, ValueError)


# -- warnings ----------------------------------------------------------------------------------


def test_small_lower_tier_under_write_through_warns(tmp_path: Path) -> None:
    text = VALID.replace("capacity: 64KiB", "capacity: 4MiB")
    with pytest.warns(ConfigWarning) as record:
        load(tmp_path, text)
    assert [str(w.message).split(": ", 1)[1] for w in record] == [
        f"secondary_tiers[{i}] ('{name}'): capacity 1MiB is smaller than the primary's 4MiB "
        "under write_through, so it holds mostly blocks the primary holds too and will rarely "
        "serve a hit; make it larger or use write_back"
        for i, name in enumerate(["nvme", "lmdb"])
    ]
    assert all(w.filename == __file__ for w in record)  # points at the caller
    write_back = text.replace("path: data/nvme", "path: data/nvme\n    write_policy: write_back")
    write_back = write_back.replace("sync: false", "sync: false\n    write_policy: write_back")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load(tmp_path, write_back)


# -- environment overrides ---------------------------------------------------------------------


def test_env_overrides(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        VALID,
        env={
            "TIERING_PRIMARY__CAPACITY": "8MiB",
            "TIERING_SECONDARY_TIERS__NVME__CAPACITY": "100GiB",
            "TIERING_SECONDARY_TIERS__NVME__DURABILITY": "fsync",
            "TIERING_SECONDARY_TIERS__LMDB__WRITE_POLICY": "write_back",
            "TIERING_HASHING__ALGORITHM": "xxh3_128",
            "TIERING_BLOCK_SIZE_FACTOR": "2",
            "TIERING_EVENTS__ENABLED": "true",  # a section the file does not have
            "TIERING_REPLAY__MAX_REQUESTS": "",  # empty: null
            "TIERING_CONFIG": "ignored.yaml",  # the CLI's, not an override
            "HOME": "/nowhere",
        },
    )
    assert config.primary.capacity_bytes == 8 << 20
    assert config.secondary_tiers[0].capacity_bytes == 100 << 30
    assert config.secondary_tiers[0].settings == FileSettings(durability="fsync")
    assert config.secondary_tiers[1].write_policy is WritePolicy.WRITE_BACK
    assert config.hashing.algorithm == "xxh3_128"
    assert config.block_size_factor == 2
    assert config.events.enabled is True
    assert config.replay.max_requests is None


def test_env_overrides_default_to_os_environ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERING_PRIMARY__POLICY", "arc")
    assert load_config(write(tmp_path, VALID)).primary.policy == "arc"
    assert load_config(write(tmp_path, VALID), env={}).primary.policy == "lru"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"TIERING_PRIMARY__CAPACITTY": "1GiB"},
            r"tiering.yaml: environment variable TIERING_PRIMARY__CAPACITTY: primary: unknown "
            r"key 'capacitty'; did you mean 'capacity'\?",
        ),
        (
            {"TIERING_PRIMRY__CAPACITY": "1GiB"},
            r"environment variable TIERING_PRIMRY__CAPACITY: unknown key 'primry'; did you mean "
            r"'primary'\?",
        ),
        (
            {"TIERING_SECONDARY_TIERS__SSD__CAPACITY": "1GiB"},
            r"environment variable TIERING_SECONDARY_TIERS__SSD__CAPACITY: no tier named 'SSD' "
            r"\(tiers: NVME, LMDB\)",
        ),
        (
            {"TIERING_SECONDARY_TIERS__NVME__SYNC": "true"},
            r"environment variable TIERING_SECONDARY_TIERS__NVME__SYNC: tier 'nvme': unknown "
            r"key 'sync'",
        ),
        (
            {"TIERING_PRIMARY": "1GiB"},
            r"environment variable TIERING_PRIMARY: malformed override; the form is "
            r"TIERING_PRIMARY__KEY",
        ),
        (
            {"TIERING_PRIMARY__CAPACITY": "[1, 2]"},
            r"environment variable TIERING_PRIMARY__CAPACITY: give a single value",
        ),
        (
            {"TIERING_PRIMARY__CAPACITY": "lots"},
            r"tiering.yaml: primary.capacity: 'lots' is not a size.* \(set by environment "
            r"variable TIERING_PRIMARY__CAPACITY\)",
        ),
        (
            {"TIERING_SECONDARY_TIERS__LMDB__CAPACITY": "-1"},
            r"secondary_tiers\[1\].capacity: -1 is not a valid size.*\(set by environment "
            r"variable TIERING_SECONDARY_TIERS__LMDB__CAPACITY\)",
        ),
    ],
)
def test_bad_env_overrides_name_the_variable(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, VALID, env=env)


# -- sizes -------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=1 << 60))
def test_format_then_parse_round_trips(num_bytes: int) -> None:
    text = format_size(num_bytes)
    assert parse_size(text) == num_bytes
    assert re.fullmatch(r"[0-9]+(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)", text)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(min_value=1, max_value=1 << 30),
    st.sampled_from(sorted(SIZE_UNITS)),
    st.sampled_from(["", " "]),
)
def test_number_and_unit_parse(count: int, unit: str, space: str) -> None:
    if count * SIZE_UNITS[unit] > MAX_INT:  # over a file offset: refused (next test)
        with pytest.raises(ConfigurationError, match="out of range"):
            parse_size(f"{count}{space}{unit}")
        return
    assert parse_size(f"{count}{space}{unit}") == count * SIZE_UNITS[unit]


def test_sizes_and_integers_stop_at_63_bits() -> None:
    assert parse_size(MAX_INT) == MAX_INT
    for bad in (MAX_INT + 1, "8388608TiB", "9223372036854775808"):
        with pytest.raises(ConfigurationError, match=r"out of range: the largest value is"):
            parse_size(bad)


def test_size_examples() -> None:
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("500MB") == 500_000_000
    assert parse_size(" 4096 ") == parse_size(4096) == 4096
    assert format_size(3 << 29) == "1536MiB"
    assert format_size(10**9) == "1GB"
    assert format_size(1000 * 1024) == "1000KiB"
    for bad in (True, 1.0, None, "4 GIB", "4GiBs", "0KiB", "-1"):
        with pytest.raises(ConfigurationError):
            parse_size(bad)


# -- the JSON schema ---------------------------------------------------------------------------

_CHECKED_KEYWORDS = {
    "type", "properties", "required", "additionalProperties", "items", "enum", "const",
    "minimum", "maximum", "minLength", "pattern", "oneOf", "anyOf", "not", "$ref",
}  # fmt: skip
_ANNOTATIONS = {"$schema", "title", "description", "default", "$defs"}


def _check(instance: Any, schema: dict[str, Any], root: dict[str, Any]) -> bool:
    """A tiny validator for the JSON Schema keywords the config schema uses."""
    if "$ref" in schema:
        target: Any = root
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        if not _check(instance, target, root):
            return False
    kinds = {
        "object": lambda v: isinstance(v, dict),
        "array": lambda v: isinstance(v, list),
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "null": lambda v: v is None,
    }
    checks = [
        ("type", lambda s: kinds[s](instance)),
        ("enum", lambda s: instance in s and not isinstance(instance, bool)),
        ("const", lambda s: instance == s and not isinstance(instance, bool)),
        ("minimum", lambda s: not kinds["number"](instance) or instance >= s),
        ("maximum", lambda s: not kinds["number"](instance) or instance <= s),
        ("minLength", lambda s: not isinstance(instance, str) or len(instance) >= s),
        ("pattern", lambda s: not isinstance(instance, str) or re.search(s, instance)),
        ("oneOf", lambda s: sum(_check(instance, sub, root) for sub in s) == 1),
        ("anyOf", lambda s: any(_check(instance, sub, root) for sub in s)),
        ("not", lambda s: not _check(instance, s, root)),
    ]
    for keyword, ok in checks:
        if keyword in schema and not ok(schema[keyword]):
            return False
    if isinstance(instance, dict):
        properties = schema.get("properties", {})
        if any(key not in instance for key in schema.get("required", [])):
            return False
        for key, value in instance.items():
            if key in properties:
                if not _check(value, properties[key], root):
                    return False
            elif schema.get("additionalProperties", True) is False:
                return False
    if isinstance(instance, list) and "items" in schema:
        return all(_check(item, schema["items"], root) for item in instance)
    return True


def _keywords(schema: Any, out: set[str]) -> set[str]:
    if isinstance(schema, dict):
        for key, value in schema.items():
            out.add(key)
            if key in ("properties", "$defs"):
                for sub in value.values():
                    _keywords(sub, out)
            elif key not in ("enum", "const", "default", "required"):
                _keywords(value, out)
    elif isinstance(schema, list):
        for sub in schema:
            _keywords(sub, out)
    return out


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value))


def test_schema_is_deterministic_json_schema() -> None:
    schema = config_json_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    text = json.dumps(schema, sort_keys=True)
    assert json.dumps(config_json_schema(), sort_keys=True) == text
    assert _keywords(schema, set()) <= _CHECKED_KEYWORDS | _ANNOTATIONS
    file_branch = schema["properties"]["secondary_tiers"]["items"]["oneOf"][0]
    assert file_branch["properties"]["durability"]["enum"] == ["none", "fsync"]
    assert file_branch["properties"]["durability"]["default"] == "none"


def test_example_config_validates_against_the_schema(tmp_path: Path) -> None:
    import yaml

    schema = config_json_schema()
    document = _plain(yaml.safe_load(EXAMPLE.read_text()))
    assert _check(document, schema, schema)
    assert _check(_plain(yaml.safe_load(VALID)), schema, schema)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["primary"].update(capacity="4 gigs"),
        lambda d: d["primary"].update(capacity=0),
        lambda d: d.update(primry={}),
        lambda d: d["secondary_tiers"][0].update(durability="sometimes"),
        lambda d: d["secondary_tiers"][0].update(capacty=1),
        lambda d: d["secondary_tiers"][0].pop("path"),
        lambda d: d["secondary_tiers"][1].update(o_direct=True),  # a file key on an lmdb tier
        lambda d: d["secondary_tiers"].append({"type": "memory", "capacity": 1, "path": "x"}),
        lambda d: d["model"].update(shape="gpt-9"),
        lambda d: d.update(version=2),
        lambda d: d["replay"].update(scale="huge"),
        lambda d: d["events"].update(enabled="yes"),
    ],
)
def test_schema_rejects_what_the_parser_rejects(tmp_path: Path, mutate: Any) -> None:
    import yaml

    schema = config_json_schema()
    document = _plain(yaml.safe_load(EXAMPLE.read_text()))
    mutate(document)
    assert not _check(document, schema, schema)
    with pytest.raises(ConfigError):
        parse_config(document, base_dir=tmp_path, env={})


def test_schema_accepts_plugin_tiers() -> None:
    schema = config_json_schema()
    document = {
        "version": 1,
        "primary": {"capacity": "1GiB"},
        "secondary_tiers": [{"type": "pkg.mod:Backend", "capacity": "1GiB", "colour": "red"}],
    }
    assert _check(document, schema, schema)


def test_dataclass_literals_match_the_library() -> None:
    hints = typing.get_type_hints(HashingConfig)
    assert typing.get_args(hints["algorithm"]) == SUPPORTED_ALGORITHMS
    hints = typing.get_type_hints(_TierKeys)
    assert set(typing.get_args(hints["write_policy"])) == {p.value for p in WritePolicy}
    schema = config_json_schema()
    assert schema["properties"]["replay"]["properties"]["scale"]["enum"] == list(SCALES)


# -- block geometry ------------------------------------------------------------------------------


@pytest.mark.parametrize("shape_name", ["tiny", "tiny-hybrid", "llama-3-8b"])
@pytest.mark.parametrize("factor", [1, 2])
def test_block_bytes_match_allocated_tensors(shape_name: str, factor: int) -> None:
    config = parse_config(
        {
            "version": 1,
            "model": {"shape": shape_name, "world_size": 2},
            "block_size_factor": factor,
            "primary": {"capacity": "1GiB"},
        },
        env={},
    )
    shape = get_model_shape(shape_name)
    if shape_name == "llama-3-8b":
        assert config.block_bytes_per_rank() == 2 * 1024 * 1024 * factor
    else:
        _, caches = allocate_kv_caches(shape, 4, config.kv_cache_spec())
        assert config.block_bytes_per_rank() == caches.offloaded_block_bytes_per_rank()
        assert config.block_bytes() == caches.offloaded_block_bytes(world_size=2)
    layout = layout_for_config(config)
    assert layout.block_bytes == config.block_bytes() == 2 * config.block_bytes_per_rank()
    assert layout.fingerprint == layout_fingerprint(
        config.kv_cache_spec(),
        block_bytes=config.block_bytes(),
        dtype=shape.dtype,
        world_size=2,
        hash_algorithm="sha256",
        model=shape_name,
    )


def test_fingerprint_depends_on_what_the_bytes_mean() -> None:
    def fingerprint(**changes: Any) -> bytes:
        data: dict[str, Any] = {
            "version": 1,
            "model": {"shape": "tiny"},
            "primary": {"capacity": 1 << 20},
        }
        data.update(changes)
        return parse_config(data, env={}).fingerprint()

    base = fingerprint()
    assert fingerprint() == base
    assert fingerprint(hashing={"algorithm": "xxh3_128"}) != base
    assert fingerprint(block_size_factor=2) != base
    assert fingerprint(model={"shape": "tiny-hybrid"}) != base


def test_a_config_without_model_needs_explicit_geometry(tmp_path: Path) -> None:
    config = parse_config({"version": 1, "primary": {"capacity": "1KiB"}}, env={})
    with pytest.raises(ConfigError, match=r"<config>: model: missing; give model.shape"):
        build_manager(config)
    with pytest.raises(ConfigError, match=r"primary.capacity: 1KiB holds no block of 4096 bytes"):
        build_manager(config, block_bytes=4096, fingerprint=bytes(16))


# -- building ----------------------------------------------------------------------------------


def test_build_backend_and_tier_do_no_io(tmp_path: Path) -> None:
    config = load(tmp_path, VALID)
    layout = layout_for_config(config)
    nvme, lmdb = config.secondary_tiers
    backend = build_backend(nvme, block_bytes=layout.block_bytes, fingerprint=layout.fingerprint)
    assert isinstance(backend, FileBackend) and not backend.is_open
    tier = build_tier(lmdb, block_bytes=layout.block_bytes, fingerprint=layout.fingerprint)
    assert isinstance(tier, SecondaryTier) and isinstance(tier.backend, LMDBBackend)
    assert tier.name == "lmdb" and tier.max_inflight_jobs == 4
    assert not (tmp_path / "data").exists()
    too_small = dataclasses.replace(nvme, capacity_bytes=100)
    with pytest.raises(ConfigError, match=r"tier 'nvme' \(file\): capacity_bytes"):
        build_backend(too_small, block_bytes=layout.block_bytes, fingerprint=layout.fingerprint)


def test_build_manager_with_memory_tier_and_explicit_geometry() -> None:
    config = parse_config(
        {
            "version": 1,
            "primary": {"capacity": "4KiB", "policy": "arc", "store_threshold": 3},
            "secondary_tiers": [{"type": "memory", "capacity": "64KiB", "policy": "lru"}],
            "events": {"enabled": True},
        },
        env={},
    )
    manager = build_manager(config, block_bytes=1024, fingerprint=bytes(16))
    try:
        assert manager.primary.num_blocks == 4
        assert manager.primary.policy.name == "arc"
        assert manager.store_threshold == 3
        assert manager.enable_events is True
        assert [type(t.backend) for t in manager.tiers] == [MemoryBackend]
        assert manager.row_bytes == 1024
    finally:
        manager.shutdown()


def _payload(key: bytes, row_bytes: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "big"))
    return torch.randint(0, 256, (row_bytes,), dtype=torch.uint8, generator=gen)


def test_build_manager_from_the_example_stores_and_promotes_bit_exact(tmp_path: Path) -> None:
    shutil.copy(EXAMPLE, tmp_path / "tiering.yaml")  # ./demo-data now lands in tmp_path
    config = load_config(
        tmp_path / "tiering.yaml",
        env={  # the demo's sizes, shrunk: 4 CPU blocks of 2 MiB, 16 blocks per lower tier
            "TIERING_PRIMARY__CAPACITY": "8MiB",
            "TIERING_SECONDARY_TIERS__NVME__CAPACITY": "40MiB",
            "TIERING_SECONDARY_TIERS__LMDB__CAPACITY": "40MiB",
        },
    )
    pool = build_pool(config)
    manager = build_manager(config, pool=pool)
    try:
        manager.wait_ready()
        assert [type(t.backend) for t in manager.tiers] == [FileBackend, LMDBBackend]
        for tier in config.secondary_tiers:
            assert tier.path is not None
            assert stat.S_IMODE(tier.path.stat().st_mode) == 0o700
        rows = pool.rows_view()
        hot, cold = make_offload_key(b"h" * 32, 0), make_offload_key(b"c" * 32, 0)
        for _ in range(2):  # looked up twice: the selective NVMe tier will take it
            assert manager.lookup(hot) is False
        for key in (hot, cold):
            out = manager.prepare_store([key])
            assert out is not None
            (slot,) = out.store_spec.block_ids.tolist()
            rows[slot] = _payload(key, manager.row_bytes)
            manager.complete_store([key])
        manager.wait_idle()
        fillers = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
        out = manager.prepare_store(fillers)  # evicts both from the CPU tier
        assert out is not None and set(out.evicted_keys) == {hot, cold}
        manager.complete_store(fillers)
        manager.wait_idle()
        assert manager.locate(hot) == "NVME"
        assert manager.locate(cold) == "LMDB"
        for key in (hot, cold):
            assert manager.lookup(key) is None  # a promotion starts
            manager.wait_idle()
            assert manager.lookup(key) is True
            spec = manager.prepare_load([key])
            (slot,) = spec.block_ids.tolist()
            assert torch.equal(rows[slot], _payload(key, manager.row_bytes))
            manager.complete_load([key])
        assert manager.tiers[0].metrics.promoted_blocks == 1
        assert manager.tiers[1].metrics.promoted_blocks == 1
    finally:
        manager.shutdown()
        pool.close()


def test_every_key_is_documented() -> None:
    docs = (EXAMPLE.parent.parent / "docs" / "config.md").read_text()
    schema = config_json_schema()
    keys = set(schema["properties"])
    for section in schema["properties"].values():
        keys |= set(section.get("properties", {}))
    for branch in schema["properties"]["secondary_tiers"]["items"]["oneOf"]:
        keys |= set(branch["properties"])
    missing = sorted(k for k in keys if f"`{k}`" not in docs and f".{k}`" not in docs)
    assert missing == []
