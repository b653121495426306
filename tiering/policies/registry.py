"""Policy lookup by name: built-ins, registered classes, entry-point plugins and import paths.

A policy name resolves in this order: names given to :func:`register_policy` (the built-ins
``lru``, ``arc``, ``arc_vllm``, ``hybrid`` and ``chain`` among them); entry points of group
``tiering.policies`` of installed distributions (value ``"module:Class"``), each imported only
when its name is first used; a ``"module:Class"`` import path. :func:`check_policy_name` checks a
name the same way without importing anything (the config layer checks a file with it).
"""

from __future__ import annotations

from tiering.core.plugin_loader import PluginGroup, check_import_path, import_object
from tiering.errors import ConfigurationError
from tiering.policies.arc import ARCPolicy
from tiering.policies.arc_vllm import VLLMARCPolicy
from tiering.policies.base import EvictionPolicy
from tiering.policies.chain import ChainPolicy
from tiering.policies.hybrid import HybridPolicy
from tiering.policies.lru import LRUPolicy

__all__ = [
    "POLICY_ENTRY_POINT_GROUP",
    "POLICY_PLUGINS",
    "available_policies",
    "check_policy_name",
    "get_policy_class",
    "make_policy",
    "register_policy",
]

POLICY_ENTRY_POINT_GROUP = "tiering.policies"
#: Policy plugins: discovered from installed metadata, each imported on first use.
POLICY_PLUGINS = PluginGroup(POLICY_ENTRY_POINT_GROUP, "policy")

_registry: dict[str, type[EvictionPolicy]] = {}


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
    """The names :func:`get_policy_class` accepts (besides ``"module:Class"`` paths), sorted.

    Plugins are listed by entry-point name without being imported; a broken one fails when
    :func:`get_policy_class` loads it.
    """
    return tuple(sorted({*_registry, *POLICY_PLUGINS.names()}))


def check_policy_name(name: str) -> None:
    """Raise :class:`ConfigurationError` unless ``name`` could name a policy; imports nothing.

    A registered name, an installed entry point's name or a well-formed ``"module:Class"``
    path passes; whether a plugin's code really gives a policy is known only once it is loaded
    (:func:`get_policy_class`).
    """
    if not isinstance(name, str):
        raise ConfigurationError(
            f"a policy name must be a string, got {type(name).__name__}: {name!r:.80}"
        )
    if ":" in name:
        check_import_path(name, f"policy path {name!r}")
        return
    if name.lower() not in available_policies():
        raise _unknown(name)


def get_policy_class(name: str) -> type[EvictionPolicy]:
    """The policy class registered or installed as ``name``, or imported from ``"module:Class"``.

    Raises :class:`ConfigurationError` naming the known policies if ``name`` is unknown, or
    explaining why a plugin or import path does not give an :class:`EvictionPolicy` subclass.
    """
    check_policy_name(name)
    if ":" in name:
        return _check_policy_class(
            import_object(name, f"policy path {name!r}"), f"policy path {name!r}"
        )
    registered = _registry.get(name.lower())
    if registered is not None:
        return registered
    loaded = POLICY_PLUGINS.load(name, _check_policy_class)
    if loaded is None:
        raise _unknown(name)
    return loaded


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    """A new policy of the class :func:`get_policy_class` finds for ``name``."""
    return get_policy_class(name)(capacity)


def _unknown(name: str) -> ConfigurationError:
    return ConfigurationError(
        f"unknown eviction policy {name!r}; known policies: {', '.join(available_policies())} "
        f"(or a 'module:Class' path to an EvictionPolicy subclass)"
    )


def _check_policy_class(obj: object, what: str) -> type[EvictionPolicy]:
    if not (isinstance(obj, type) and issubclass(obj, EvictionPolicy)):
        raise ConfigurationError(f"{what} must be an EvictionPolicy subclass, got {obj!r:.80}")
    return obj


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


register_policy(LRUPolicy.name, LRUPolicy)
register_policy(ARCPolicy.name, ARCPolicy)
register_policy(HybridPolicy.name, HybridPolicy)
register_policy(VLLMARCPolicy.name, VLLMARCPolicy)
register_policy(ChainPolicy.name, ChainPolicy)
