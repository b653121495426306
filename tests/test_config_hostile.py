"""A config is input: any bytes and any environment give a ConfigError naming the file (and the
key or variable), never another exception; checking a config runs no plugin code; numbers are
finite; a tier path must be one that can exist."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiering.backends import registry
from tiering.config import ConfigWarning, build_manager, load_config, resolve_plugins
from tiering.errors import ConfigError

VALID = """\
version: 1
model: {shape: tiny, world_size: 1}
hashing: {hash_block_size: 16, algorithm: sha256}
block_size_factor: 1
primary: {capacity: 64KiB, policy: lru}
secondary_tiers:
  - {name: nvme, type: file, capacity: 1MiB, path: ./t/nvme, quarantine_seconds: 10, io_threads: 2}
  - {name: db, type: lmdb, capacity: 1MiB, path: ./t/db, max_txn_bytes: 64KiB}
replay: {trace: mixed, scale: demo, seed: 0, max_requests: null}
"""

# Scalars that PyYAML turns into something surprising, or that no key should accept.
TRICKY = [
    ".nan",
    ".inf",
    "-.inf",
    "1e400",
    "!!float nan",
    "!!int x",
    "2023-02-30",
    "2001-12-14t21:59:43.10-05:00",
    "!!timestamp 2023-13-01",
    "!!binary aGVsbG8=",
    "!!set {a}",
    "!!python/name:os.system",
    "9" * 5000,
    "99999999999999999999999999999",
    "'\\0'",
    '"\\0"',
    '"a\\0b"',
    "~",
    "[1, 2]",
    "{a: 1}",
    "0x10",
    "-5GiB",
    "'~nosuchuserxyz/x'",
    "'" + "a" * 300 + "'",
    "'" + "/a" * 2100 + "'",
]
KEYS = [
    "capacity",
    "path",
    "policy",
    "quarantine_seconds",
    "io_threads",
    "shape",
    "world_size",
    "hash_block_size",
    "block_size_factor",
    "max_txn_bytes",
    "seed",
    "max_requests",
    "name",
    "type",
]
ENV_NAMES = [
    "TIERING_PRIMARY__CAPACITY",
    "TIERING_SECONDARY_TIERS__NVME__PATH",
    "TIERING_SECONDARY_TIERS__NVME__QUARANTINE_SECONDS",
    "TIERING_SECONDARY_TIERS__DB__MAP_SIZE_BYTES",
    "TIERING_REPLAY__SEED",
    "TIERING_MODEL__SHAPE",
    "TIERING_BLOCK_SIZE_FACTOR",
    "TIERING_",
    "TIERING___",
    "TIERING_SECONDARY_TIERS____",
]


def _load(path: Path, env: dict[str, str]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConfigWarning)
        load_config(path, env=env)


def _assert_config_error_or_valid(path: Path, env: dict[str, str]) -> None:
    try:
        _load(path, env)
    except ConfigError as exc:
        assert str(exc).startswith(str(path)), exc  # names the file


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.binary(max_size=300))
def test_any_bytes_give_a_config_error(
    tmp_path_factory: pytest.TempPathFactory, data: bytes
) -> None:
    path = tmp_path_factory.mktemp("bytes") / "tiering.yaml"
    path.write_bytes(data)
    _assert_config_error_or_valid(path, {})


@pytest.mark.parametrize(
    "text",
    ["k+\x06", "\x7f", "version: 1\x0c", "a: \x1f", "\u0096"],
    ids=["ack", "del", "form-feed", "unit-separator", "c1-control"],
)
def test_unprintable_characters_are_config_errors(tmp_path: Path, text: str) -> None:
    path = tmp_path / "tiering.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=r"tiering\.yaml: invalid config YAML: .*unacceptable"):
        _load(path, {})


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    edits=st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(TRICKY)), max_size=3),
    env=st.dictionaries(
        st.sampled_from(ENV_NAMES) | st.text(max_size=24).map(lambda t: "TIERING_" + t),
        st.sampled_from(TRICKY) | st.text(max_size=24),
        max_size=3,
    ),
)
def test_any_value_and_any_override_give_a_config_error(
    tmp_path_factory: pytest.TempPathFactory, edits: list[tuple[str, str]], env: dict[str, str]
) -> None:
    directory = tmp_path_factory.mktemp("values")
    text = VALID
    for key, value in edits:
        text = text.replace(f"{key}: ", f"{key}: {value} #", 1)
    path = directory / "tiering.yaml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    _assert_config_error_or_valid(path, env)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("'!!int x'", None),
        ("!!int x", r"tiering\.yaml: invalid config YAML: ValueError"),
        ("2023-02-30", r"tiering\.yaml: invalid config YAML: ValueError: day is out of range"),
    ],
)
def test_scalars_pyyaml_cannot_construct(tmp_path: Path, value: str, message: str | None) -> None:
    path = tmp_path / "tiering.yaml"
    path.write_text(VALID.replace("seed: 0", f"seed: {value}"))
    with pytest.raises(ConfigError, match=message or r"replay\.seed: '!!int x' is not valid"):
        _load(path, {})
    path.write_text(VALID)
    with pytest.raises(ConfigError, match=r"tiering\.yaml: .*environment variable TIERING_REPLAY"):
        _load(path, {"TIERING_REPLAY__SEED": value})


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf", "!!float nan", "1.0e+400"])
def test_non_finite_numbers_are_refused(tmp_path: Path, value: str) -> None:
    path = tmp_path / "tiering.yaml"
    path.write_text(VALID.replace("quarantine_seconds: 10", f"quarantine_seconds: {value}"))
    with pytest.raises(
        ConfigError,
        match=r"tiering\.yaml:7: secondary_tiers\[0\]\.quarantine_seconds: .* \(a finite number\)",
    ):
        _load(path, {})
    path.write_text(VALID)
    with pytest.raises(
        ConfigError, match=r"quarantine_seconds: .*finite.*TIERING_SECONDARY_TIERS__NVME__QUARANT"
    ):
        _load(path, {"TIERING_SECONDARY_TIERS__NVME__QUARANTINE_SECONDS": value})


def test_integers_stop_at_63_bits(tmp_path: Path) -> None:
    path = tmp_path / "tiering.yaml"
    path.write_text(VALID.replace("io_threads: 2", "io_threads: 99999999999999999999999"))
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.io_threads: .*out of range"):
        _load(path, {})


@pytest.mark.parametrize(
    ("path_text", "message"),
    [
        ('"/tmp/a\\0b"', "a path cannot contain a NUL character"),
        (
            "'" + "x" * 256 + "'",
            "a part of the path is 256 bytes long; a file name has at most 255",
        ),
        ("'" + "/x" * 2048 + "'", "the path is 4096 bytes long; the longest is 4095"),
        ("'~nosuchuserxyz/tier'", "cannot expand '~'"),
        ("./a-file/tier", r"a-file' is not a directory"),
        ("./a-file", "exists and is not a directory"),
        ("./dangling/tier", "is a broken symlink"),
    ],
    ids=["nul", "long-name", "long-path", "unknown-user", "under-a-file", "a-file", "dangling"],
)
def test_impossible_tier_paths_are_refused(tmp_path: Path, path_text: str, message: str) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    path = tmp_path / "tiering.yaml"
    path.write_text(VALID.replace("path: ./t/nvme", f"path: {path_text}"))
    with pytest.raises(ConfigError, match=r"tiering\.yaml:7: secondary_tiers\[0\]\.path: .*"):
        _load(path, {})
    with pytest.raises(ConfigError) as caught:
        _load(path, {})
    assert message in str(caught.value)


# -- checking a config runs no plugin code ------------------------------------------------------

PLUGIN_MODULE = """
import os
from pathlib import Path

from tiering.backends.memory import MemoryBackend
from tiering.policies.lru import LRUPolicy

Path(os.environ["LOUD_PLUGIN_IMPORT_LOG"]).open("a").write(__name__ + "\\n")


class LoudBackend(MemoryBackend):
    name = "loud"


class LoudPolicy(LRUPolicy):
    name = "loudpolicy"
"""

PLUGIN_CONFIG = """\
version: 1
model: {shape: tiny}
primary: {capacity: 16KiB, policy: "tiering_loud_plugin:LoudPolicy"}
secondary_tiers:
  - {type: "tiering_loud_plugin:LoudBackend", capacity: 64KiB, policy: loudpolicy2}
  - {type: loudep, capacity: 64KiB}
"""

ENTRY_POINTS = """\
[tiering.backends]
loudep = tiering_loud_plugin:LoudBackend

[tiering.policies]
loudpolicy2 = tiering_loud_plugin:LoudPolicy
"""


@pytest.fixture
def loud_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A plugin module that logs every import of it, installed with entry points."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "tiering_loud_plugin.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    dist_info = site / "tiering_loud_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: tiering-loud-plugin\n")
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    log = tmp_path / "imports.log"
    monkeypatch.setenv("LOUD_PLUGIN_IMPORT_LOG", str(log))
    monkeypatch.syspath_prepend(str(site))
    registry.rescan_plugins()
    yield log
    monkeypatch.undo()
    sys.modules.pop("tiering_loud_plugin", None)
    registry.rescan_plugins()


def test_checking_a_config_imports_no_plugin(loud_plugin: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiering.yaml"
    path.write_text(PLUGIN_CONFIG)
    config = load_config(path, env={})
    assert [t.name for t in config.secondary_tiers] == ["loudbackend", "loudep"]
    assert not loud_plugin.exists() and "tiering_loud_plugin" not in sys.modules
    resolved = resolve_plugins(config)  # what build_manager does first: now it is imported
    assert loud_plugin.read_text() == "tiering_loud_plugin\n"
    assert [type(t.settings).__name__ for t in resolved.secondary_tiers] == ["NoSettings"] * 2
    manager = build_manager(config)
    try:
        assert [type(t.backend).__name__ for t in manager.tiers] == ["LoudBackend"] * 2
    finally:
        manager.shutdown()


def test_the_cli_config_check_imports_no_plugin(loud_plugin: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiering.yaml"
    path.write_text(PLUGIN_CONFIG)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-m", "tiering.cli", "config", "check", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "plugin, imported when built" in result.stdout
    assert not loud_plugin.exists()


def test_malformed_plugin_names_are_refused_without_importing(tmp_path: Path) -> None:
    path = tmp_path / "tiering.yaml"
    path.write_text(PLUGIN_CONFIG.replace("tiering_loud_plugin:LoudPolicy", "os.system"))
    with pytest.raises(ConfigError, match=r"tiering\.yaml:3: primary\.policy: unknown eviction"):
        load_config(path, env={})
    path.write_text(PLUGIN_CONFIG.replace("tiering_loud_plugin:LoudPolicy", "os:sys tem"))
    with pytest.raises(ConfigError, match=r"an import path looks like 'package\.module:Class'"):
        load_config(path, env={})
