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

Policy plugins (group ``tiering.policies``) use the same discovery, :data:`POLICY_PLUGINS`, from
:mod:`tiering.policies.registry`. A broken entry point (import error, wrong class) fails only
its own name, with a :class:`ConfigurationError` naming the entry point and its distribution.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

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
from tiering.errors import ConfigurationError

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
    "get_backend",
    "import_object",
    "register_backend",
    "rescan_plugins",
]

BACKEND_ENTRY_POINT_GROUP = "tiering.backends"
POLICY_ENTRY_POINT_GROUP = "tiering.policies"
BUILTIN_BACKENDS = ("file", "lmdb", "memory")

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
    "existence_cache_seconds",
    "existence_cache_max_keys",
)
#: Backend and tier names: a letter, then up to 63 letters, digits, '_' or '-'.
NAME_PATTERN = r"[A-Za-z][A-Za-z0-9_-]{0,63}"
_NAME_RE = re.compile(NAME_PATTERN)
_REQUIRED_PARAMS = ("capacity_bytes", "block_bytes", "fingerprint")

_T = TypeVar("_T")


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
        return "path" in inspect.signature(self.cls.__init__).parameters

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
    ) -> StorageBackend:
        """A new (not yet opened) backend: ``cls(path=..., capacity_bytes=..., ...)``."""
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
        factory: Callable[..., StorageBackend] = self.cls  # concrete classes take more keywords
        return factory(
            capacity_bytes=capacity_bytes,
            block_bytes=block_bytes,
            fingerprint=fingerprint,
            **kwargs,
        )


# -- entry points ------------------------------------------------------------------------------


class PluginGroup:
    """The entry points of one group: discovered once (cached), each loaded on first use.

    A load's result or error is cached too, so a broken plugin is imported once and fails
    with the same message every time. :meth:`clear` forgets everything (after installing a
    plugin at run time, or in tests).
    """

    def __init__(self, group: str, what: str) -> None:
        self.group = group
        self.what = what
        self._entry_points: dict[str, list[importlib.metadata.EntryPoint]] | None = None
        self._loaded: dict[str, object] = {}
        self._errors: dict[str, ConfigurationError] = {}

    def _discover(self) -> dict[str, list[importlib.metadata.EntryPoint]]:
        if self._entry_points is None:
            found: dict[str, list[importlib.metadata.EntryPoint]] = {}
            for ep in importlib.metadata.entry_points(group=self.group):
                same = found.setdefault(ep.name.lower(), [])
                if all(other.value != ep.value for other in same):  # a dist seen twice on sys.path
                    same.append(ep)
            self._entry_points = found
        return self._entry_points

    def names(self) -> tuple[str, ...]:
        """The entry-point names of the group (lower case), sorted; imports nothing."""
        return tuple(sorted(self._discover()))

    def describe(self, name: str) -> str:
        """``entry point 'x = pkg.mod:Cls' (group ..., distribution 'pkg 1.0')``, for messages."""
        return " and ".join(_describe_entry_point(ep) for ep in self._discover().get(name, []))

    def load(self, name: str, check: Callable[[object, str], _T]) -> _T | None:
        """The checked object of entry point ``name``, or None if there is no such entry point.

        ``check(obj, what)`` validates the loaded object (``what`` describes the entry point
        for its messages) and returns what to cache. Raises :class:`ConfigurationError` if the
        entry point is ambiguous, fails to import, or does not pass ``check``.
        """
        key = name.lower()
        if key in self._loaded:
            return self._loaded[key]  # type: ignore[return-value]
        if key in self._errors:
            raise self._errors[key]
        entry_points = self._discover().get(key)
        if not entry_points:
            return None
        try:
            result = self._load_checked(key, entry_points, check)
        except ConfigurationError as exc:
            self._errors[key] = exc
            raise
        self._loaded[key] = result
        return result

    def _load_checked(
        self,
        key: str,
        entry_points: list[importlib.metadata.EntryPoint],
        check: Callable[[object, str], _T],
    ) -> _T:
        if len(entry_points) > 1:
            raise ConfigurationError(
                f"{self.what} {key!r} is provided by more than one plugin: "
                f"{self.describe(key)}; uninstall one of them"
            )
        (ep,) = entry_points
        what = _describe_entry_point(ep)
        try:
            obj = ep.load()
        except Exception as exc:  # a plugin may fail in any way while importing
            raise ConfigurationError(
                f"{self.what} {key!r}: cannot load {what}: {type(exc).__name__}: {exc}"
            ) from exc
        return check(obj, f"{self.what} {key!r} from {what}")

    def clear(self) -> None:
        self._entry_points = None
        self._loaded.clear()
        self._errors.clear()


def _describe_entry_point(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    dist_text = f"{dist.name} {dist.version}" if dist is not None else "unknown"
    return f"entry point '{ep.name} = {ep.value}' (group {ep.group!r}, distribution {dist_text!r})"


BACKEND_PLUGINS = PluginGroup(BACKEND_ENTRY_POINT_GROUP, "backend")
POLICY_PLUGINS = PluginGroup(POLICY_ENTRY_POINT_GROUP, "policy")


def rescan_plugins() -> None:
    """Forget discovered and loaded plugins (backends and policies); the next lookup rescans."""
    BACKEND_PLUGINS.clear()
    POLICY_PLUGINS.clear()
    _by_import_path.clear()


def import_object(path: str, what: str) -> object:
    """The object at ``"package.module:Attribute"``; :class:`ConfigurationError` if missing."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"{what}: an import path looks like 'package.module:Class'")
    try:
        obj: object = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigurationError(
            f"{what}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigurationError(
                f"{what}: module {module_name!r} has no attribute {attr!r}"
            ) from None
    return obj


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


def get_backend(name: str) -> BackendEntry:
    """The backend registered or discovered as ``name``, or imported from ``"module:Class"``.

    Raises :class:`ConfigurationError` listing the known names if ``name`` is unknown, or
    saying why a plugin or import path does not give a usable backend class.
    """
    if not isinstance(name, str) or not name:
        raise ConfigurationError(
            f"a backend type must be a non-empty string, got {type(name).__name__}: {name!r:.80}"
        )
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
        raise ConfigurationError(
            f"unknown backend type {name!r}; known backends: {', '.join(available_backends())} "
            "(or a 'package.module:Class' path to a StorageBackend subclass)"
        )
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


for _name, _cls, _settings in (
    ("file", FileBackend, FileSettings),
    ("lmdb", LMDBBackend, LMDBSettings),
    ("memory", MemoryBackend, MemorySettings),
):
    _add(_make_entry(_name, _cls, _settings, "built-in", f"backend {_name!r}"), replace=False)
