"""Finding plugin classes: ``"package.module:Class"`` import paths and entry-point groups.

The one place where ``tiering`` turns a name into code. Both registries (eviction policies in
:mod:`tiering.policies.registry`, storage backends in :mod:`tiering.backends.registry`) resolve
names
through it, so they fail the same way, with a :class:`ConfigurationError` saying which module,
attribute or entry point (and distribution) is at fault.

Checking a name and importing it are separate steps: :func:`check_import_path` and
:meth:`PluginGroup.names` read no module and run no plugin code (the config layer checks a file
with them); :func:`import_object` and :meth:`PluginGroup.load` import, and are called only when
the object is needed (a manager is built).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from collections.abc import Callable
from typing import TypeVar

from tiering.errors import ConfigurationError

__all__ = ["PluginGroup", "check_import_path", "describe_entry_point", "import_object"]

_T = TypeVar("_T")

# A dotted module name, ':' and a dotted attribute path: 'package.module:Class'.
_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT_PATH_RE = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}(\.{_IDENTIFIER})*")


def check_import_path(path: str, what: str) -> tuple[str, str]:
    """``(module, attribute)`` of ``"package.module:Attribute"``; imports nothing.

    Raises :class:`ConfigurationError` naming ``what`` if ``path`` is not of that form.
    """
    if not isinstance(path, str) or not _IMPORT_PATH_RE.fullmatch(path):
        raise ConfigurationError(
            f"{what}: an import path looks like 'package.module:Class', got {path!r:.100}"
        )
    module_name, _, attr = path.partition(":")
    return module_name, attr


def import_object(path: str, what: str) -> object:
    """The object at ``"package.module:Attribute"`` (imports the module: runs its code).

    Raises :class:`ConfigurationError` naming ``what`` if the path is malformed, the module
    fails to import (in any way: a plugin's module may raise anything), or has no such attribute.
    """
    module_name, attr = check_import_path(path, what)
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


def _distribution_name(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return "" if dist is None else re.sub(r"[-_.]+", "-", dist.name).lower()


def describe_entry_point(ep: importlib.metadata.EntryPoint) -> str:
    """``entry point 'x = pkg.mod:Cls' (group 'g', distribution 'pkg 1.0')``, for messages."""
    dist = getattr(ep, "dist", None)
    dist_text = f"{dist.name} {dist.version}" if dist is not None else "unknown"
    return f"entry point '{ep.name} = {ep.value}' (group {ep.group!r}, distribution {dist_text!r})"


class PluginGroup:
    """The entry points of one group: discovered once (cached), each loaded on first use.

    Discovery reads installed distributions' metadata only. A load's result or error is cached
    too, so a broken plugin is imported once and fails with the same message every time.
    :meth:`clear` forgets everything (after installing a plugin at run time, or in tests).
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

    def is_own(self, name: str) -> bool:
        """Whether entry point ``name`` is tiering's own (declared by the ``tiering``
        distribution itself, like ``type: redis``): part of tiering, not a plugin."""
        entry_points = self._discover().get(name.lower(), [])
        return len(entry_points) == 1 and _distribution_name(entry_points[0]) == "tiering"

    def describe(self, name: str) -> str:
        """How :func:`describe_entry_point` names the entry point(s) called ``name``."""
        return " and ".join(describe_entry_point(ep) for ep in self._discover().get(name, []))

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
        what = describe_entry_point(ep)
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
