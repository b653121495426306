"""The values of vLLM's ``kv_connector_extra_config`` that tiering's vLLM integration reads,
checked in one place before vLLM's code or tiering's converts them.

vLLM converts its own keys with ``int()``, ``float()`` and ``bool()`` where it uses them, so a
bad value surfaces as a builtin ``ValueError`` or ``TypeError`` far from the key
(``max_tracker_size: "abc"``), or is taken silently (``offload_prompt_only: "false"`` is true).
:func:`check_spec_extra` (the drop-in, ``TieringSpec``) and :func:`check_tier_entry` (an entry of
vLLM's ``secondary_tiers``) raise :class:`~tiering.errors.ConfigError` naming the key, the bad
value and what is valid, before anything is built. Every value vLLM's own conversion accepts
and means the same by (an integer given as a JSON number, an integral float or a decimal
string) passes unchanged, so what reaches vLLM's code is what it would have parsed.

A key given as ``null`` is refused unless the table says what null means: vLLM reads its keys
with ``extra.get(key, default)``, for which an explicit null is not the default.

:func:`primary_policy` and :func:`primary_store_threshold` say what the drop-in's CPU tier takes:
vLLM's key when given (vLLM's names for vLLM's policies), else the YAML's ``primary`` section.
"""

from __future__ import annotations

import difflib
import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from tiering.config import TieringConfig
from tiering.errors import ConfigError, ConfigurationError
from tiering.policies.registry import check_policy_name

__all__ = [
    "SPEC_KEYS",
    "TIER_ENTRY_KEYS",
    "VLLM_POLICIES",
    "check_spec_extra",
    "check_tier_entry",
    "primary_policy",
    "primary_store_threshold",
    "spec_int",
]

_log = logging.getLogger(__name__)

_INT_TEXT = re.compile(r"\s*[+-]?[0-9]+\s*")


def _as_int(value: object) -> int | None:
    """``value`` as vLLM's ``int()`` would read it, if it is an integer (no bool, no fraction)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) and value.is_integer() else None
    if isinstance(value, str) and _INT_TEXT.fullmatch(value):
        return int(value)
    return None


def _as_seconds(value: object) -> float | None:
    """``value`` as vLLM's ``float()`` would read it, if it is a finite number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
    else:
        return None
    return number if math.isfinite(number) else None


def _int_at_least(minimum: int) -> Callable[[object], bool]:
    def check(value: object) -> bool:
        number = _as_int(value)
        return number is not None and number >= minimum

    return check


def _is_bool(value: object) -> bool:
    return isinstance(value, bool)


def _is_path(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def _is_policy(value: object) -> bool:
    try:
        check_policy_name(value)  # type: ignore[arg-type]  # checks the type itself
    except ConfigurationError:
        return False
    return True


def _is_mapping(value: object) -> bool:
    return isinstance(value, Mapping)


@dataclass(frozen=True)
class _Key:
    """How one key is checked: ``ok(value)``, the valid values in words, what null means."""

    ok: Callable[[object], bool]
    valid: str
    null: str | None = None  # what an explicit null means; None: null is refused


#: The keys the drop-in (``TieringSpec``) and the parts of vLLM it runs read.
SPEC_KEYS: Mapping[str, _Key] = {
    "tiering_config": _Key(_is_path, "the path of a tiering YAML file (a non-empty string)"),
    "cpu_bytes_to_use": _Key(_int_at_least(1), "a positive integer number of bytes"),
    "eviction_policy": _Key(
        _is_policy,
        "'lru', 'arc' or a tiering policy (a registered name or 'package.module:Class')",
        null="the YAML's primary.policy",
    ),
    "store_threshold": _Key(
        _int_at_least(0),
        "an integer >= 0 (a block is stored on its Nth offer; below 2, on every offer); "
        "leave the key out to use the YAML's primary.store_threshold",
    ),
    "max_tracker_size": _Key(
        _int_at_least(1),
        "an integer >= 1 (keys the store-threshold table tracks; default 64000)",
    ),
    "tiering_deterministic_steps": _Key(
        _is_bool,
        "true or false (default false: tier results apply when vLLM's own manager applies "
        "them; true: only at step ends, a step or two later, the same calls giving the same "
        "answers)",
    ),
    "offload_prompt_only": _Key(_is_bool, "true or false (default true)"),
    "self_describing_kv_events": _Key(_is_bool, "true or false (default false)"),
    "canonical_layout": _Key(_is_bool, "true or false (default false)"),
    "tier_poll_interval_s": _Key(
        lambda v: _as_seconds(v) is not None, "a finite number of seconds"
    ),
    "sync_load_budget_bytes": _Key(_int_at_least(0), "an integer number of bytes >= 0"),
    "backpressure": _Key(_is_mapping, "a mapping of back-pressure settings", null="none"),
}

#: Keys of a ``secondary_tiers`` entry of type ``tiering`` that the tier reads itself (the
#: others are a YAML tier's keys, which the tiering config parser checks).
TIER_ENTRY_KEYS: Mapping[str, _Key] = {
    "tiering_config": _Key(
        _is_path, "the path of a tiering YAML file (a non-empty string)", null="not given"
    ),
    "tier": _Key(_is_path, "the name of a tier of that YAML file", null="not given"),
    "backend": _Key(
        _is_path,
        "a backend type: file, lmdb, memory, redis, a plugin's name or 'package.module:Class'",
        null="not given",
    ),
    "enable_kv_events": _Key(_is_bool, "true or false (default false)"),
    "locality": _Key(
        lambda v: isinstance(v, str) and v.upper() in ("LOCAL", "REMOTE"),
        "'LOCAL' or 'REMOTE'",
        null="not given",
    ),
}


def _check(where: str, keys: Mapping[str, _Key], values: Mapping[str, Any]) -> None:
    for name, key in keys.items():
        if name not in values:
            continue
        value = values[name]
        if value is None and key.null is not None:
            continue
        if value is None or not key.ok(value):
            given = "null" if value is None else f"{value!r:.80} ({type(value).__name__})"
            leave_out = "; or leave the key out" if value is None else ""
            raise ConfigError(f"{where}: {name!r} is {given}; valid: {key.valid}{leave_out}")


def check_spec_extra(extra: Mapping[str, Any]) -> None:
    """Check the drop-in's ``kv_connector_extra_config``; :class:`ConfigError` naming the key.

    ``tiering_config`` and ``cpu_bytes_to_use`` are required. A key close to a known one (a
    typo: ``max_traker_size``) is logged as a warning: vLLM's other keys (``spec_name``,
    ``block_size``, ...) pass through unchecked.
    """
    where = "TieringSpec: kv_connector_extra_config"
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {type(extra).__name__}")
    for required in ("tiering_config", "cpu_bytes_to_use"):
        if extra.get(required) is None:
            raise ConfigError(
                f"{where} needs {required!r}: {SPEC_KEYS[required].valid}; got "
                f"{extra.get(required)!r}"
            )
    _check(where, SPEC_KEYS, extra)
    for name in extra:
        if name in SPEC_KEYS or not isinstance(name, str):
            continue
        close = difflib.get_close_matches(name, list(SPEC_KEYS), n=1, cutoff=0.8)
        if close:
            _log.warning("%s: unknown key %r; did you mean %r?", where, name, close[0])


def check_tier_entry(tier_type: str, entry: Mapping[str, Any]) -> None:
    """Check the keys a ``tiering`` entry of vLLM's ``secondary_tiers`` reads itself."""
    _check(f"vLLM secondary tier {tier_type!r}", TIER_ENTRY_KEYS, entry)


def spec_int(extra: Mapping[str, Any], name: str) -> int:
    """The integer value of key ``name`` of a checked ``extra``, read as vLLM reads it."""
    number = _as_int(extra.get(name))
    if number is None:  # check_spec_extra was not called, or the key has no integer value
        _check("TieringSpec: kv_connector_extra_config", {name: SPEC_KEYS[name]}, extra)
        raise ConfigError(f"TieringSpec: kv_connector_extra_config: {name!r} is not given")
    return number


#: vLLM's ``eviction_policy`` names -> tiering's policies that behave as vLLM's do.
VLLM_POLICIES: Final = {"lru": "lru", "arc": "arc_vllm"}


def primary_policy(extra: Any, config: TieringConfig) -> str:
    """vLLM's ``eviction_policy`` if given (``arc`` is vLLM's ARC variant, ``arc_vllm``;
    another name is a tiering policy), else the YAML's ``primary.policy`` as named (there
    ``arc`` is the paper's)."""
    name = extra.get("eviction_policy")
    if not name:
        return str(config.primary.policy)
    name = str(name)
    return VLLM_POLICIES.get(name.lower(), name)


def primary_store_threshold(extra: Any, config: TieringConfig) -> int:
    """vLLM's ``store_threshold`` if given (values below 2 store every offer), else the
    YAML's ``primary.store_threshold``. The value was checked by ``check_spec_extra``."""
    value = extra.get("store_threshold")
    if value is None:
        return config.primary.store_threshold
    return max(spec_int(extra, "store_threshold"), 1)
