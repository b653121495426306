"""The backend registry: built-ins, import paths, entry-point plugins (real installed metadata)."""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar, Literal

import pytest

from tiering.backends.file import FileBackend
from tiering.backends.lmdb import LMDBBackend
from tiering.backends.memory import MemoryBackend
from tiering.backends.registry import (
    BACKEND_PLUGINS,
    GENERIC_TIER_KEYS,
    available_backends,
    get_backend,
    register_backend,
    rescan_plugins,
)
from tiering.backends.settings import (
    FileSettings,
    LMDBSettings,
    MemorySettings,
    NoSettings,
    SettingsProblem,
    parse_settings,
)
from tiering.errors import ConfigurationError
from tiering.policies import available_policies, get_policy_class

FINGERPRINT = bytes(range(16))

# -- built-ins ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "cls", "settings_class", "accepts_path"),
    [
        ("file", FileBackend, FileSettings, True),
        ("lmdb", LMDBBackend, LMDBSettings, True),
        ("memory", MemoryBackend, MemorySettings, False),
    ],
)
def test_builtin_backends(name: str, cls: type, settings_class: type, accepts_path: bool) -> None:
    entry = get_backend(name)
    assert (entry.name, entry.cls, entry.settings_class, entry.origin) == (
        name,
        cls,
        settings_class,
        "built-in",
    )
    assert entry.accepts_path is accepts_path
    assert get_backend(name.upper()) is entry  # names are case-insensitive
    assert {"file", "lmdb", "memory"} <= set(available_backends())


@pytest.mark.parametrize(
    ("settings_class", "cls"), [(FileSettings, FileBackend), (LMDBSettings, LMDBBackend)]
)
def test_settings_defaults_match_the_backends(settings_class: type, cls: type) -> None:
    params = inspect.signature(cls).parameters
    for f in fields(settings_class):
        assert f.name in params, f.name
        assert f.default == params[f.name].default, f.name


def test_settings_reject_bad_values_with_the_key_and_choices() -> None:
    with pytest.raises(
        SettingsProblem, match=r"durability: 'sometimes' is not valid: give one of 'none', 'fsync'"
    ):
        parse_settings(FileSettings, {"durability": "sometimes"})
    with pytest.raises(
        SettingsProblem, match=r"io_threads: 0 is too small: give an integer from 1 to 64"
    ):
        parse_settings(FileSettings, {"io_threads": 0})
    with pytest.raises(SettingsProblem, match=r"o_direct: 'yes' is not valid: give true or false"):
        parse_settings(FileSettings, {"o_direct": "yes"})
    with pytest.raises(
        SettingsProblem, match=r"unknown key 'durabilty'; did you mean 'durability'"
    ):
        parse_settings(FileSettings, {"durabilty": "none"})
    with pytest.raises(SettingsProblem, match=r"map_async: true requires writemap: true"):
        parse_settings(LMDBSettings, {"map_async": True})
    with pytest.raises(SettingsProblem, match=r"max_txn_bytes: '1 parsec' is not a size"):
        parse_settings(LMDBSettings, {"max_txn_bytes": "1 parsec"})
    with pytest.raises(SettingsProblem, match=r"max_txn_bytes: '-1MiB' is not a valid size"):
        parse_settings(LMDBSettings, {"max_txn_bytes": "-1MiB"})
    assert parse_settings(LMDBSettings, {"max_txn_bytes": "8MiB", "map_size_bytes": None}) == (
        LMDBSettings(max_txn_bytes=8 << 20)
    )


def test_settings_required_and_typed_fields() -> None:
    @dataclass(frozen=True)
    class Settings:
        mode: Literal["a", "b"]
        ratio: float = 0.5
        where: Path | None = None

    with pytest.raises(SettingsProblem, match=r"mode: missing; give one of 'a', 'b'"):
        parse_settings(Settings, {})
    parsed = parse_settings(
        Settings, {"mode": "b", "ratio": 2, "where": "sub"}, base_dir=Path("/base")
    )
    assert parsed == Settings("b", 2.0, Path("/base/sub"))
    with pytest.raises(SettingsProblem, match=r"ratio: True is not valid: give a number"):
        parse_settings(Settings, {"mode": "a", "ratio": True})


# -- import paths and registration -----------------------------------------------------------


class TinyBackend(MemoryBackend):
    """A plugin-style backend with its own settings."""

    @dataclass(frozen=True)
    class Settings:
        label: str = "tiny"
        spare_bytes: int = 4096

    name = "tiny"
    settings_class: ClassVar[type] = Settings

    def __init__(
        self,
        *,
        capacity_bytes: int,
        block_bytes: int,
        fingerprint: bytes,
        label: str = "tiny",
        spare_bytes: int = 4096,
    ) -> None:
        super().__init__(
            capacity_bytes=capacity_bytes, block_bytes=block_bytes, fingerprint=fingerprint
        )
        self.label = label
        self.spare_bytes = spare_bytes


def test_module_class_path_as_a_type() -> None:
    entry = get_backend(f"{__name__}:TinyBackend")
    assert entry.cls is TinyBackend
    assert entry.settings_class is TinyBackend.Settings
    assert entry.origin == "import path"
    backend = entry.create(
        path=None,
        capacity_bytes=1 << 20,
        block_bytes=256,
        fingerprint=FINGERPRINT,
        settings=TinyBackend.Settings(label="x", spare_bytes=8),
    )
    assert isinstance(backend, TinyBackend)
    assert (backend.label, backend.spare_bytes, backend.capacity_bytes) == ("x", 8, 1 << 20)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_such_module_x:Cls", r"cannot import module 'no_such_module_x': ModuleNotFoundError"),
        (f"{__name__}:Missing", r"has no attribute 'Missing'"),
        (f"{__name__}:FINGERPRINT", r"must be a StorageBackend subclass, got b'"),
        ("tiering.backends.base:StorageBackend", r"is abstract \(missing: "),
        (":Cls", r"an import path looks like 'package.module:Class'"),
    ],
)
def test_bad_import_paths(path: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        get_backend(path)


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigurationError) as info:
        get_backend("nvme")
    message = str(info.value)
    assert message.startswith("unknown backend type 'nvme'; known backends: ")
    for name in available_backends():  # built-ins and installed plugins alike
        assert name in message
    assert "'package.module:Class' path to a StorageBackend subclass" in message


def test_register_and_replace() -> None:
    entry = register_backend("tiny-test", TinyBackend)
    try:
        assert get_backend("TINY-TEST") is entry
        assert entry.settings_class is TinyBackend.Settings
        assert "tiny-test" in available_backends()
        register_backend("tiny-test", TinyBackend)  # the same class again is fine
        with pytest.raises(ConfigurationError, match=r"already registered to .*TinyBackend"):
            register_backend("tiny-test", MemoryBackend)
        replaced = register_backend("tiny-test", MemoryBackend, replace=True)
        assert replaced.settings_class is NoSettings
    finally:
        from tiering.backends import registry

        registry._registry.pop("tiny-test", None)


def test_register_rejects_mismatched_settings() -> None:
    @dataclass(frozen=True)
    class Extra:
        unknown_knob: int = 1

    with pytest.raises(ConfigurationError, match=r"does not accept unknown_knob"):
        register_backend("bad-settings", MemoryBackend, Extra)

    @dataclass(frozen=True)
    class Clash:
        capacity: int = 1

    with pytest.raises(ConfigurationError, match=r"uses the generic tier key\(s\) capacity"):
        register_backend("bad-settings", TinyBackend, Clash)

    @dataclass(frozen=True)
    class Listy:
        items: list[int] | None = None

    with pytest.raises(ConfigurationError, match=r"field 'items' has type .*supported: bool"):
        register_backend("bad-settings", TinyBackend, Listy)
    with pytest.raises(ConfigurationError, match=r"a backend name must be a letter"):
        register_backend("has space", TinyBackend)
    assert "bad-settings" not in available_backends()
    assert "capacity" in GENERIC_TIER_KEYS


# -- entry points: a real dist-info directory on sys.path ---------------------------------------

PLUGIN_MODULE = """
from dataclasses import dataclass
from typing import ClassVar

from tiering.backends.memory import MemoryBackend
from tiering.policies.lru import LRUPolicy


@dataclass(frozen=True)
class FakeSettings:
    flavour: str = "plain"


class FakeBackend(MemoryBackend):
    name = "fake"
    settings_class: ClassVar[type] = FakeSettings

    def __init__(self, *, capacity_bytes, block_bytes, fingerprint, flavour="plain"):
        super().__init__(
            capacity_bytes=capacity_bytes, block_bytes=block_bytes, fingerprint=fingerprint
        )
        self.flavour = flavour


class FakePolicy(LRUPolicy):
    name = "fakepolicy"


class NotABackend:
    pass
"""

ENTRY_POINTS = """
[tiering.backends]
fake = tiering_fake_plugin:FakeBackend
broken = tiering_missing_module_x:Nope
notabackend = tiering_fake_plugin:NotABackend

[tiering.policies]
fakepolicy = tiering_fake_plugin:FakePolicy
brokenpolicy = tiering_missing_module_x:Nope
"""


@pytest.fixture
def fake_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "tiering_fake_plugin.py").write_text(textwrap.dedent(PLUGIN_MODULE))
    dist_info = tmp_path / "tiering_fake_plugin-1.2.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tiering-fake-plugin\nVersion: 1.2\n"
    )
    (dist_info / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    rescan_plugins()
    yield tmp_path
    monkeypatch.undo()
    sys.modules.pop("tiering_fake_plugin", None)
    rescan_plugins()


def test_entry_point_backend_is_discovered_and_loaded_lazily(fake_plugin: Path) -> None:
    assert {"fake", "broken", "notabackend"} <= set(available_backends())
    assert "tiering_fake_plugin" not in sys.modules  # listing imports nothing
    entry = get_backend("fake")
    assert entry.cls.__module__ == "tiering_fake_plugin"
    assert entry.settings_class.__name__ == "FakeSettings"
    assert "entry point 'fake = tiering_fake_plugin:FakeBackend'" in entry.origin
    assert "distribution 'tiering-fake-plugin 1.2'" in entry.origin
    assert get_backend("fake") is entry  # cached
    backend = entry.create(
        path=None,
        capacity_bytes=1 << 16,
        block_bytes=64,
        fingerprint=FINGERPRINT,
        settings=entry.settings_class(flavour="spicy"),
    )
    assert backend.flavour == "spicy"  # type: ignore[attr-defined]


def test_broken_entry_points_fail_alone_and_clearly(fake_plugin: Path) -> None:
    with pytest.raises(
        ConfigurationError,
        match=r"backend 'broken': cannot load entry point 'broken = tiering_missing_module_x:Nope' "
        r"\(group 'tiering.backends', distribution 'tiering-fake-plugin 1.2'\): "
        r"ModuleNotFoundError",
    ):
        get_backend("broken")
    with pytest.raises(
        ConfigurationError,
        match=r"backend 'notabackend' from entry point .*must be a StorageBackend subclass",
    ):
        get_backend("notabackend")
    # The broken ones do not break the others, and keep failing the same way.
    assert get_backend("fake").cls.__name__ == "FakeBackend"
    assert get_backend("file").cls is FileBackend
    with pytest.raises(ConfigurationError, match=r"backend 'broken': cannot load"):
        get_backend("broken")


def test_entry_point_policies(fake_plugin: Path) -> None:
    assert get_policy_class("lru").name == "lru"  # registered names need no discovery
    assert "tiering_fake_plugin" not in sys.modules
    assert get_policy_class("fakepolicy").__name__ == "FakePolicy"
    assert "fakepolicy" in available_policies()
    assert "brokenpolicy" in available_policies()  # listed by name; fails when it is loaded
    with pytest.raises(
        ConfigurationError,
        match=r"policy 'brokenpolicy': cannot load entry point .*distribution "
        r"'tiering-fake-plugin 1.2'",
    ):
        get_policy_class("brokenpolicy")
    with pytest.raises(
        ConfigurationError, match=r"unknown eviction policy 'nope'; known .*fakepolicy"
    ):
        get_policy_class("nope")


def test_rescan_forgets_plugins(fake_plugin: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "fake" in BACKEND_PLUGINS.names()
    monkeypatch.syspath_prepend(str(fake_plugin / "nowhere"))
    sys.path.remove(str(fake_plugin))
    assert "fake" in BACKEND_PLUGINS.names()  # cached until a rescan
    rescan_plugins()
    assert "fake" not in available_backends()
    with pytest.raises(ConfigurationError, match=r"unknown backend type 'fake'"):
        get_backend("fake")
