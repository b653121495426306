"""Policy lookup by name: built-ins, registered classes and ``"module:Class"`` import paths."""

from __future__ import annotations

import importlib

from tiering.errors import ConfigurationError
from tiering.policies.arc import ARCPolicy
from tiering.policies.base import EvictionPolicy
from tiering.policies.lru import LRUPolicy

__all__ = ["available_policies", "get_policy_class", "make_policy", "register_policy"]

_registry: dict[str, type[EvictionPolicy]] = {}


def discover_policies() -> dict[str, type[EvictionPolicy]]:
    """Policies provided by installed third-party packages, by name.

    The hook for plugin discovery: entry points of group ``tiering.policies`` (value
    ``"module:Class"``), found once and imported on first use (cached; see
    :class:`tiering.registry.PluginGroup`). The registry merges the result under the explicitly
    registered names. A broken plugin is left out here; looking up its name raises its error.
    """
    from tiering.registry import POLICY_PLUGINS  # late: tiering.registry imports the backends

    found: dict[str, type[EvictionPolicy]] = {}
    for name in POLICY_PLUGINS.names():
        try:
            loaded = POLICY_PLUGINS.load(name, _check_policy_class)
        except ConfigurationError:
            continue  # fails only its own name, in get_policy_class
        if loaded is not None:
            found[name] = loaded
    return found


def register_policy(name: str, cls: type[EvictionPolicy], *, replace: bool = False) -> None:
    """Make ``cls`` available as ``name`` (case-insensitive).

    Raises :class:`ConfigurationError` if ``cls`` is not an :class:`EvictionPolicy` subclass, if
    ``name`` is not a valid name, or if ``name`` is taken by another class and not ``replace``.
    """
    if not isinstance(name, str) or not name or ":" in name or name != name.strip():
        raise ConfigurationError(
            f"a policy name must be a non-empty string without ':' or surrounding spaces, "
            f"got {name!r}"
        )
    _check_policy_class(cls, f"policy {name!r}")
    key = name.lower()
    current = _registry.get(key)
    if current is not None and current is not cls and not replace:
        raise ConfigurationError(
            f"policy name {name!r} is already registered to {_qualname(current)}; "
            f"pass replace=True to override it"
        )
    _registry[key] = cls


def available_policies() -> tuple[str, ...]:
    """The names :func:`get_policy_class` accepts (besides ``"module:Class"`` paths), sorted."""
    return tuple(sorted(_known()))


def get_policy_class(name: str) -> type[EvictionPolicy]:
    """The policy class registered as ``name``, or imported from a ``"module:Class"`` path.

    Raises :class:`ConfigurationError` naming the known policies if ``name`` is unknown, or
    explaining why a ``"module:Class"`` path does not give an :class:`EvictionPolicy` subclass.
    """
    if not isinstance(name, str):
        raise ConfigurationError(
            f"a policy name must be a string, got {type(name).__name__}: {name!r:.80}"
        )
    if ":" in name:
        return _import_policy_class(name)
    registered = _registry.get(name.lower())
    if registered is not None:
        return registered  # registered names need no plugin discovery
    known = _known()
    cls = known.get(name.lower())
    if cls is None:
        _raise_if_broken_plugin(name)
        raise ConfigurationError(
            f"unknown eviction policy {name!r}; known policies: {', '.join(sorted(known))} "
            f"(or a 'module:Class' path to an EvictionPolicy subclass)"
        )
    return cls


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A new policy of the class :func:`get_policy_class` finds for ``name``."""
    return get_policy_class(name)(capacity)


def _known() -> dict[str, type[EvictionPolicy]]:
    discovered = {key.lower(): cls for key, cls in discover_policies().items()}
    return {**discovered, **_registry}


def _raise_if_broken_plugin(name: str) -> None:
    """Raise the load error of a policy entry point named ``name``, if there is one."""
    from tiering.registry import POLICY_PLUGINS

    POLICY_PLUGINS.load(name.lower(), _check_policy_class)


def _import_policy_class(path: str) -> type[EvictionPolicy]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(
            f"a policy path must look like 'package.module:Class', got {path!r}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import module {module_name!r} for policy {path!r}: {exc}"
        ) from exc
    obj: object = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ConfigurationError(
                f"module {module_name!r} has no attribute {attr!r} (policy {path!r})"
            ) from None
    return _check_policy_class(obj, f"policy path {path!r}")


def _check_policy_class(obj: object, what: str) -> type[EvictionPolicy]:
    if not (isinstance(obj, type) and issubclass(obj, EvictionPolicy)):
        raise ConfigurationError(f"{what} must be an EvictionPolicy subclass, got {obj!r:.80}")
    return obj


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


register_policy(LRUPolicy.name, LRUPolicy)
register_policy(ARCPolicy.name, ARCPolicy)
