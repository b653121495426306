"""Storage backends by name: built-ins, registered classes, entry-point plugins, import paths.

A tier's ``type`` names its backend. Names resolve in this order:

1. the built-ins ``file``, ``lmdb``, ``memory`` and classes given to :func:`register_backend`;
2. entry points of group ``tiering.backends`` of installed distributions (value
   ``"module:Class"``), discovered on the first lookup of a name that step 1 does not know, or
   on :func:`available_backends`, and each imported only when its name is first used;
3. a ``"module:Class"`` import path given directly as the type.

A backend class is a :class:`~tiering.backends.base.StorageBackend` subclass whose keyword
arguments are ``capacity_bytes``, ``block_bytes``, ``fingerprint``, ``path`` if it stores files,
and one per field of its settings class: a frozen dataclass it declares as
``settings_class: ClassVar[type]`` (none: the backend takes no other keys). The config parses a
tier's other keys against that class (see :mod:`tiering.backends.settings`).

:func:`check_backend_type` checks a type without importing anything: a plugin's code runs only
when :func:`get_backend` resolves it (when a manager is built). Discovery and imports go through
:mod:`tiering.core.plugin_loader`, as for policy plugins (group ``tiering.policies``,
:data:`POLICY_PLUGINS`). A broken entry point (import error, wrong class) fails only its own
name, with a :class:`ConfigurationError` naming the entry point and its distribution.

Adding a built-in backend is one entry in ``_BUILTINS``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiering.backends.base import StorageBackend
from tiering.backends.file import FileBackend
from tiering.backends.lmdb import LMDBBackend
from tiering.backends.memory import MemoryBackend
from tiering.backends.settings import (
    FileSettings,
    LMDBSettings,
    MemorySettings,
    NoSettings,
    SettingsField,
    settings_fields,
)
from tiering.core.plugin_loader import PluginGroup, check_import_path, import_object
from tiering.errors import ConfigurationError
from tiering.policies.registry import POLICY_ENTRY_POINT_GROUP, POLICY_PLUGINS

__all__ = [
    "BACKEND_ENTRY_POINT_GROUP",
    "BACKEND_PLUGINS",
    "BUILTIN_BACKENDS",
    "GENERIC_TIER_KEYS",
    "NAME_PATTERN",
    "POLICY_ENTRY_POINT_GROUP",
    "POLICY_PLUGINS",
    "BackendEntry",
    "PluginGroup",
    "available_backends",
    "check_backend_type",
    "get_backend",
    "import_object",
    "register_backend",
    "rescan_plugins",
]

BACKEND_ENTRY_POINT_GROUP = "tiering.backends"
#: The built-in backends: name, class, settings class.
_BUILTINS: tuple[tuple[str, type[StorageBackend], type], ...] = (
    ("file", FileBackend, FileSettings),
    ("lmdb", LMDBBackend, LMDBSettings),
    ("memory", MemoryBackend, MemorySettings),
)
BUILTIN_BACKENDS = tuple(name for name, _, _ in _BUILTINS)

#: Tier keys the config handles itself; a settings class may not use them as keys.
GENERIC_TIER_KEYS = (
    "name",
    "type",
    "capacity",
    "path",
    "policy",
    "write_policy",
    "selective_min_lookups",
    "max_inflight_jobs",
    "quarantine_seconds",
    "io_timeout_s",
    "existence_cache_seconds",
    "existence_cache_max_keys",
    "admission_min_count",
    "admission_width",
)
#: Backend and tier names: a letter, then up to 63 letters, digits, '_' or '-'.
NAME_PATTERN = r"[A-Za-z][A-Za-z0-9_-]{0,63}"
_NAME_RE = re.compile(NAME_PATTERN)
_REQUIRED_PARAMS = ("capacity_bytes", "block_bytes", "fingerprint")


@dataclass(frozen=True)
class BackendEntry:
    """A backend class, the name it resolved from, and its settings class."""

    name: str
    cls: type[StorageBackend]
    settings_class: type
    origin: str = "built-in"  # "built-in", "registered", an entry point, or "import path"

    @property
    def accepts_path(self) -> bool:
        """Whether the backend takes a ``path`` (a directory it owns)."""
        return self.accepts("path")

    def accepts(self, keyword: str) -> bool:
        """Whether the backend's ``__init__`` names the keyword argument ``keyword``."""
        return keyword in inspect.signature(self.cls.__init__).parameters

    def settings_fields(self) -> tuple[SettingsField, ...]:
        return settings_fields(self.settings_class)

    def create(
        self,
        *,
        path: Path | None,
        capacity_bytes: int,
        block_bytes: int,
        fingerprint: bytes,
        settings: object,
        layout_description: Mapping[str, Any] | None = None,
        read_only: bool = False,
    ) -> StorageBackend:
        """A new (not yet opened) backend: ``cls(path=..., capacity_bytes=..., ...)``.

        ``layout_description`` is passed if the class takes it. ``read_only`` (for
        ``tiering inspect``) needs a class that takes it: :class:`ConfigurationError` otherwise.
        """
        if not isinstance(settings, self.settings_class):
            raise ConfigurationError(
                f"backend {self.name!r} takes settings of type "
                f"{self.settings_class.__qualname__}, got {type(settings).__qualname__}"
            )
        kwargs: dict[str, Any] = {f.name: getattr(settings, f.name) for f in self.settings_fields()}
        if self.accepts_path:
            if path is None:
                raise ConfigurationError(f"backend {self.name!r} needs a path (a directory)")
            kwargs["path"] = path
        if layout_description is not None and self.accepts("layout_description"):
            kwargs["layout_description"] = layout_description
        if read_only:
            if not self.accepts("read_only"):
                raise ConfigurationError(f"backend {self.name!r} has no read-only mode")
            kwargs["read_only"] = True
        factory: Callable[..., StorageBackend] = self.cls  # concrete classes take more keywords
        return factory(
            capacity_bytes=capacity_bytes,
            block_bytes=block_bytes,
            fingerprint=fingerprint,
            **kwargs,
        )


BACKEND_PLUGINS = PluginGroup(BACKEND_ENTRY_POINT_GROUP, "backend")


def rescan_plugins() -> None:
    """Forget discovered and loaded plugins (backends and policies); the next lookup rescans."""
    BACKEND_PLUGINS.clear()
    POLICY_PLUGINS.clear()
    _by_import_path.clear()


# -- the backend registry ------------------------------------------------------------------------

_registry: dict[str, BackendEntry] = {}
_by_import_path: dict[str, BackendEntry] = {}


def register_backend(
    name: str,
    cls: type[StorageBackend],
    settings_class: type | None = None,
    *,
    replace: bool = False,
) -> BackendEntry:
    """Make ``cls`` available as tier type ``name`` (case-insensitive); returns its entry.

    ``settings_class`` defaults to ``cls.settings_class`` if the class declares one, else no
    extra keys. Raises :class:`ConfigurationError` if the name is not valid, if it is taken by
    another class and not ``replace``, or if the class or its settings do not fit together.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigurationError(
            f"a backend name must be a letter followed by up to 63 letters, digits, '_' or "
            f"'-', got {name!r}"
        )
    entry = _make_entry(name.lower(), cls, settings_class, "registered", f"backend {name!r}")
    return _add(entry, replace=replace)


def _add(entry: BackendEntry, *, replace: bool) -> BackendEntry:
    current = _registry.get(entry.name)
    if current is not None and current.cls is not entry.cls and not replace:
        raise ConfigurationError(
            f"backend name {entry.name!r} is already registered to {_qualname(current.cls)}; "
            "pass replace=True to override it"
        )
    _registry[entry.name] = entry
    return entry


def available_backends() -> tuple[str, ...]:
    """Every backend name :func:`get_backend` knows (registered and discovered), sorted.

    Discovered plugins are listed by name without being imported; a broken one fails when
    :func:`get_backend` loads it.
    """
    return tuple(sorted({*_registry, *BACKEND_PLUGINS.names()}))


def check_backend_type(name: str) -> BackendEntry | None:
    """Check a tier type without importing plugin code; its entry if it is tiering's own.

    Built-in and registered names give their entry, and so does an entry point of tiering's
    own distribution (``redis``: imported here, as it is part of tiering). A plugin's entry
    point name or a well-formed ``"module:Class"`` path gives None: its class (and so its
    settings) is known only once :func:`get_backend` imports it. Raises
    :class:`ConfigurationError` for anything else, listing the known names.
    """
    _check_type_is_text(name)
    if ":" in name:
        check_import_path(name, f"backend path {name!r}")
        return None
    entry = _registry.get(name.lower())
    if entry is not None:
        return entry
    if name.lower() not in BACKEND_PLUGINS.names():
        raise _unknown(name)
    return get_backend(name) if BACKEND_PLUGINS.is_own(name) else None


def _check_type_is_text(name: object) -> None:
    if not isinstance(name, str) or not name:
        raise ConfigurationError(
            f"a backend type must be a non-empty string, got {type(name).__name__}: {name!r:.80}"
        )


def _unknown(name: str) -> ConfigurationError:
    return ConfigurationError(
        f"unknown backend type {name!r}; known backends: {', '.join(available_backends())} "
        "(or a 'package.module:Class' path to a StorageBackend subclass)"
    )


def get_backend(name: str) -> BackendEntry:
    """The backend registered or discovered as ``name``, or imported from ``"module:Class"``.

    Raises :class:`ConfigurationError` listing the known names if ``name`` is unknown, or
    saying why a plugin or import path does not give a usable backend class.
    """
    _check_type_is_text(name)
    if ":" in name:
        return _from_import_path(name)
    key = name.lower()
    entry = _registry.get(key)
    if entry is not None:
        return entry

    def check(obj: object, what: str) -> BackendEntry:
        return _make_entry(key, obj, None, what, what)

    loaded = BACKEND_PLUGINS.load(key, check)
    if loaded is None:
        raise _unknown(name)
    return loaded


def _from_import_path(path: str) -> BackendEntry:
    entry = _by_import_path.get(path)
    if entry is None:
        what = f"backend path {path!r}"
        entry = _make_entry(path, import_object(path, what), None, "import path", what)
        _by_import_path[path] = entry
    return entry


def _make_entry(
    name: str, cls: object, settings_class: type | None, origin: str, what: str
) -> BackendEntry:
    """Check that ``cls`` is a usable backend class with ``settings_class``; the entry."""
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ConfigurationError(f"{what} must be a StorageBackend subclass, got {cls!r:.80}")
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        raise ConfigurationError(f"{what}: {_qualname(cls)} is abstract (missing: {missing})")
    if settings_class is None:
        settings_class = getattr(cls, "settings_class", None) or NoSettings
    fields = settings_fields(settings_class)  # raises for a non-dataclass or an unsupported type
    clashes = [f.key for f in fields if f.key in GENERIC_TIER_KEYS or f.name == "path"]
    if clashes:
        raise ConfigurationError(
            f"{what}: settings class {settings_class.__qualname__} uses the generic tier "
            f"key(s) {', '.join(clashes)}; rename the field(s)"
        )
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    needed = [*_REQUIRED_PARAMS, *(f.name for f in fields)]
    missing_params = [p for p in needed if p not in params and not takes_any]
    if missing_params:
        raise ConfigurationError(
            f"{what}: {_qualname(cls)}.__init__ does not accept {', '.join(missing_params)}; "
            "a backend takes capacity_bytes, block_bytes, fingerprint and one keyword per "
            f"field of its settings class {settings_class.__qualname__}"
        )
    return BackendEntry(name, cls, settings_class, origin)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


for _name, _cls, _settings in _BUILTINS:
    _add(_make_entry(_name, _cls, _settings, "built-in", f"backend {_name!r}"), replace=False)
