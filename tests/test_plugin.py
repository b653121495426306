"""The backend plugin kit end to end: install the example package, discover it through its entry
point, run the conformance suite on it, and use it from a YAML config."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tiering import cli
from tiering.backends import registry
from tiering.backends.base import StorageBackend
from tiering.config import PluginSettings, build_manager, build_pool, load_config, resolve_plugins
from tiering.core.block_format import HEADER_BYTES
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.errors import ConfigError
from tiering.testing import BackendTests

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tiering-plugin-example"


@pytest.fixture(scope="module")
def example_plugin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[registry.BackendEntry]:
    """Install the example package into this interpreter's environment (offline, idempotent)
    and return its backend as the registry finds it through the entry point."""
    # Build from a copy, so that setuptools' build/ and egg-info never land in the repository.
    source = tmp_path_factory.mktemp("plugin") / EXAMPLE.name
    shutil.copytree(
        EXAMPLE, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-index",  # offline: setuptools comes from this environment
            "--no-deps",
            "--no-build-isolation",
            "--force-reinstall",
            "--quiet",
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"pip install failed:\n{result.stdout}\n{result.stderr}"
    importlib.invalidate_caches()  # the running interpreter must see the new distribution
    registry.rescan_plugins()
    yield registry.get_backend("example_dir")
    registry.rescan_plugins()


def test_the_entry_point_is_discovered(example_plugin: registry.BackendEntry) -> None:
    assert "example_dir" in registry.available_backends()
    assert example_plugin.cls.__name__ == "DirectoryBackend"
    assert example_plugin.cls.__module__ == "tiering_plugin_example"
    assert "entry point 'example_dir = tiering_plugin_example:DirectoryBackend'" in (
        example_plugin.origin
    )
    assert example_plugin.settings_class.__name__ == "DirectorySettings"
    assert [f.key for f in example_plugin.settings_fields()] == ["io_threads"]
    assert example_plugin.accepts_path


class TestExamplePluginConformance(BackendTests):
    """The shipped conformance suite, run on the plugin found through its entry point."""

    persistent = True

    @pytest.fixture(autouse=True)
    def _plugin(self, example_plugin: registry.BackendEntry) -> None:
        self.entry = example_plugin

    def make_backend(
        self, path: Path, *, capacity_bytes: int, block_bytes: int, fingerprint: bytes
    ) -> StorageBackend:
        return self.entry.cls(  # type: ignore[call-arg]
            path=path,
            capacity_bytes=capacity_bytes,
            block_bytes=block_bytes,
            fingerprint=fingerprint,
        )

    def expected_usage_bytes(self, backend: StorageBackend, n_blocks: int) -> int:
        return n_blocks * (HEADER_BYTES + backend.block_bytes)

    def corrupt_stored_block(self, backend: StorageBackend, key: bytes) -> None:
        block_file = Path(backend.path) / f"{key.hex()}.blk"  # type: ignore[attr-defined]
        stored = bytearray(block_file.read_bytes())
        stored[HEADER_BYTES + 5] ^= 0x08  # one payload bit, behind the backend's back
        block_file.write_bytes(stored)


CONFIG = """\
version: 1
model:
  shape: tiny
primary:
  capacity: 8KiB  # two 4 KiB blocks
secondary_tiers:
  - name: plugged
    type: example_dir
    path: ./plugged
    capacity: 1MiB
    io_threads: 3
"""


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(32, "big"), 0)


def test_a_yaml_tier_of_the_plugin_type_stores_and_promotes_bit_exact(
    example_plugin: registry.BackendEntry, tmp_path: Path
) -> None:
    config_path = tmp_path / "tiering.yaml"
    config_path.write_text(CONFIG)
    config = load_config(config_path)
    (tier,) = config.secondary_tiers
    assert tier.type == "example_dir" and tier.path == tmp_path / "plugged"
    # Reading the config imports no plugin: its keys wait, as written, until it is built.
    assert tier.settings == PluginSettings({"io_threads": 3}, tmp_path)
    (resolved,) = resolve_plugins(config).secondary_tiers
    assert resolved.settings == example_plugin.settings_class(io_threads=3)

    pool = build_pool(config)
    rows = pool.rows_view()
    manager = build_manager(config, pool=pool)
    try:
        manager.wait_ready()
        backend = manager.tiers[0].backend
        assert isinstance(backend, example_plugin.cls)
        assert backend.settings.io_threads == 3  # type: ignore[attr-defined]
        payloads = {}
        generator = torch.Generator().manual_seed(11)
        for i in range(3):  # the third store evicts key(0) from the two-block primary
            out = manager.prepare_store([key(i)])
            assert out is not None
            payloads[key(i)] = torch.randint(
                0, 256, (rows.shape[1],), dtype=torch.uint8, generator=generator
            )
            rows[int(out.store_spec.block_ids[0])] = payloads[key(i)]
            manager.complete_store([key(i)])
            manager.wait_idle()
        assert sorted(p.name for p in (tmp_path / "plugged").iterdir()) == sorted(
            f"{key(i).hex()}.blk" for i in range(3)
        )
        assert manager.primary.lookup(key(0)) is False  # evicted from the primary...
        assert manager.lookup(key(0)) is None  # ...found in the plugin tier: promoting
        manager.wait_idle()
        assert manager.lookup(key(0)) is True
        spec = manager.prepare_load([key(0)])
        assert torch.equal(rows[int(spec.block_ids[0])], payloads[key(0)])
        manager.complete_load([key(0)])
    finally:
        manager.shutdown()


def test_a_bad_plugin_setting_is_a_config_error_naming_the_key(
    example_plugin: registry.BackendEntry, tmp_path: Path
) -> None:
    config_path = tmp_path / "bad.yaml"
    config_path.write_text(CONFIG.replace("io_threads: 3", "io_threads: 0"))
    config = load_config(config_path)  # the plugin's keys are checked when it is imported
    with pytest.raises(
        ConfigError, match=r"bad.yaml:11: secondary_tiers\[0\]\.io_threads: 0 is too small"
    ):
        build_manager(config)
    config_path.write_text(CONFIG.replace("io_threads: 3", "io_thread: 3"))
    with pytest.raises(ConfigError, match="unknown key 'io_thread'; did you mean 'io_threads'"):
        resolve_plugins(load_config(config_path))
    assert not (tmp_path / "plugged").exists()  # refused before anything was created


def test_the_test_kits_import_without_pytest_and_say_what_is_missing() -> None:
    """``tiering.testing`` loads its suites lazily: without pytest, importing the package works
    and asking for a suite names what to install."""
    script = (
        "import sys\n"
        "sys.modules['pytest'] = None  # as if pytest were not installed\n"
        "import tiering.testing as kits\n"
        "for name in ('BackendTests', 'PolicyTests'):\n"
        "    try:\n"
        "        getattr(kits, name)\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"tiering.testing.{name} needs pytest; install it (pip install pytest pytest-asyncio) "
        "to run the conformance suites"
        for name in ("BackendTests", "PolicyTests")
    ]


def test_the_test_kits_are_exported() -> None:
    import tiering.testing as kits
    from tiering.testing.backend_tests import BackendTests as backend_suite
    from tiering.testing.manager_tests import ManagerTests as manager_suite
    from tiering.testing.policy_tests import PolicyTests as policy_suite

    assert kits.BackendTests is backend_suite
    assert kits.PolicyTests is policy_suite
    assert kits.ManagerTests is manager_suite
    assert sorted(kits.__all__) == [
        "BackendTests",
        "CopyStrategyTests",
        "ManagerTests",
        "PolicyTests",
    ]
    with pytest.raises(AttributeError, match="no attribute 'PolicyTest'"):
        kits.PolicyTest  # noqa: B018


def test_inspect_skips_a_plugin_tier_it_cannot_read_without_writing(
    example_plugin: registry.BackendEntry, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config_path = tmp_path / "tiering.yaml"
    config_path.write_text(CONFIG)
    (tmp_path / "plugged").mkdir()
    (tmp_path / "plugged" / "x.blk").write_bytes(b"some block")
    assert cli.main(["inspect", "--config", str(config_path)]) == 0
    out = capsys.readouterr().out
    assert "skipped: the example_dir backend has no read-only mode, and inspect never writes" in out
    assert os.listdir(tmp_path / "plugged") == ["x.blk"]
