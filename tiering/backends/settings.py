"""Backend settings classes, and the rules that turn config values into typed settings fields.

A backend's settings are a frozen dataclass whose fields are the backend's own keyword
arguments (``durability``, ``sync``, ...), with the backend's defaults. A config section is
parsed against such a class by :func:`parse_settings`; each field's type comes from its
annotation:

========================  ===============================================================
annotation                accepted values
========================  ===============================================================
``bool``                  ``true`` / ``false`` only
``int``                   an integer of at most 63 bits; if the field name ends in
                          ``_bytes``, also a size with a unit (``"64MiB"``, see
                          :func:`parse_size`); sizes are > 0
``float``                 a finite number (NaN and infinities are refused)
``str``                   a string
``Literal["a", "b"]``     one of the listed values
``pathlib.Path``          a string; relative paths are taken from the config's directory
``X | None``              ``null`` or an ``X``
========================  ===============================================================

Optional field metadata (``dataclasses.field(metadata={...})``): ``"min"`` / ``"max"``
(inclusive bounds of a number), ``"key"`` (the config key, when it differs from the field
name), ``"doc"`` (one line for the JSON schema and ``tiering config`` output).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

from tiering.backends.ownership import MismatchPolicy
from tiering.errors import ConfigurationError

__all__ = [
    "MAX_INT",
    "REQUIRED",
    "Durability",
    "MismatchPolicy",
    "RecoverMode",
    "SIZE_JSON_SCHEMA",
    "SIZE_PATTERN",
    "SIZE_UNITS",
    "FileSettings",
    "LMDBSettings",
    "MemorySettings",
    "NoSettings",
    "SettingsField",
    "SettingsProblem",
    "coerce_value",
    "describe_field",
    "field_json_schema",
    "format_size",
    "parse_settings",
    "parse_size",
    "settings_fields",
    "unknown_key_message",
]

#: Size units: decimal (1000^n) and binary (1024^n), as in ``4GiB`` or ``500MB``.
SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "TiB": 1024**4,
}
SIZE_PATTERN = r"^\s*[0-9]+(\.[0-9]+)?\s*(" + "|".join(SIZE_UNITS) + r")?\s*$"
#: The largest integer (and size) a setting takes: a file offset is a signed 64-bit number.
MAX_INT = (1 << 63) - 1
_SIZE_RE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_UNITS_TEXT = ", ".join(SIZE_UNITS)


# -- the built-in backends' settings ---------------------------------------------------------
# The backends take these types from here (this module imports no backend).

#: When the file backend acknowledges a write: in the page cache, or after fdatasync.
Durability = Literal["none", "fsync"]
#: What a persistent backend checks of its stored blocks when it opens.
RecoverMode = Literal["verify", "trust_header", "wipe"]


_MISMATCH_DOC = (
    "when the directory holds blocks of another layout: refuse to open, set_aside (move them "
    "to a sibling folder), or wipe (delete tiering's files there)"
)


@dataclass(frozen=True)
class FileSettings:
    """Settings of the ``file`` backend (:class:`~tiering.backends.file.FileBackend`)."""

    durability: Durability = field(
        default="none",
        metadata={"doc": "none: acknowledge once in the page cache; fsync: after fdatasync"},
    )
    o_direct: bool = field(
        default=False, metadata={"doc": "open the slot file with O_DIRECT (bypass the page cache)"}
    )
    recover: RecoverMode = field(
        default="verify",
        metadata={"doc": "on open: verify every block, trust_header (check on read), or wipe"},
    )
    io_threads: int = field(
        default=2,
        metadata={
            "min": 1,
            "max": 64,
            "doc": "threads of the backend's I/O pool (a put uses all; a buffered get one)",
        },
    )
    batch_blocks: int = field(
        default=16,
        metadata={"min": 1, "max": 1024, "doc": "blocks per pwritev/preadv chunk"},
    )
    on_layout_mismatch: MismatchPolicy = field(default="refuse", metadata={"doc": _MISMATCH_DOC})
    min_free_bytes: int | None = field(
        default=None,
        metadata={
            "doc": "disk guard: keep at least this much of the filesystem free (the tier "
            "shrinks, evicting, as other data fills it); null: no guard"
        },
    )
    max_fs_used_fraction: float | None = field(
        default=None,
        metadata={
            "min": 0.01,
            "max": 1.0,
            "doc": "disk guard: keep the filesystem's use at or below this fraction; null: none",
        },
    )

    def __post_init__(self) -> None:
        if self.o_direct and not hasattr(os, "O_DIRECT"):
            raise ConfigurationError("o_direct: true needs O_DIRECT, which this OS does not have")


@dataclass(frozen=True)
class LMDBSettings:
    """Settings of the ``lmdb`` backend (:class:`~tiering.backends.lmdb.LMDBBackend`)."""

    sync: bool = field(default=True, metadata={"doc": "fsync data on every commit"})
    metasync: bool = field(default=True, metadata={"doc": "fsync the meta page on every commit"})
    writemap: bool = field(default=False, metadata={"doc": "write through a writable mmap"})
    map_async: bool = field(
        default=False, metadata={"doc": "asynchronous msync with writemap (needs writemap)"}
    )
    max_readers: int = field(
        default=126, metadata={"min": 1, "doc": "LMDB reader slots, shared by all processes"}
    )
    read_threads: int = field(default=2, metadata={"min": 1, "doc": "threads serving reads"})
    recover: RecoverMode = field(
        default="trust_header",
        metadata={"doc": "on open: verify every block, trust_header (check on read), or wipe"},
    )
    max_txn_bytes: int = field(
        default=64 << 20, metadata={"doc": "bytes of values per write transaction"}
    )
    map_size_bytes: int | None = field(
        default=None, metadata={"doc": "LMDB map size; null derives it from capacity"}
    )
    on_layout_mismatch: MismatchPolicy = field(default="refuse", metadata={"doc": _MISMATCH_DOC})
    min_free_bytes: int | None = field(
        default=None,
        metadata={
            "doc": "disk guard: keep at least this much of the filesystem free (the tier "
            "shrinks, evicting, as other data fills it); null: no guard"
        },
    )
    max_fs_used_fraction: float | None = field(
        default=None,
        metadata={
            "min": 0.01,
            "max": 1.0,
            "doc": "disk guard: keep the filesystem's use at or below this fraction; null: none",
        },
    )

    def __post_init__(self) -> None:
        if self.map_async and not self.writemap:
            raise ConfigurationError("map_async: true requires writemap: true (LMDB ignores it)")
        if self.max_readers < self.read_threads:
            raise ConfigurationError(
                f"max_readers={self.max_readers} is below read_threads={self.read_threads}: "
                "each read thread holds a reader slot"
            )


@dataclass(frozen=True)
class MemorySettings:
    """The ``memory`` backend takes no settings besides the generic tier keys."""


@dataclass(frozen=True)
class NoSettings:
    """The settings of a plugin backend that declares no ``settings_class``: no extra keys."""


# -- sizes -----------------------------------------------------------------------------------


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as ``"64GiB"``, ``"1.5 GB"`` or ``"4096"``.

    Units: B, KB, MB, GB, TB (powers of 1000) and KiB, MiB, GiB, TiB (powers of 1024). Raises
    :class:`ConfigurationError` for anything else, for a fraction of a byte, and for sizes
    that are not positive.
    """
    size = _size_value(value)
    if size <= 0:
        raise ConfigurationError(f"{value!r} is not a size: sizes must be > 0 bytes")
    return size


def _check_int_range(value: int, raw: object) -> int:
    if abs(value) > MAX_INT:
        raise ConfigurationError(
            f"{raw!r:.40} is out of range: the largest value is {MAX_INT} (2^63 - 1)"
        )
    return value


def _size_value(value: object) -> int:
    """Bytes from an int or a size string, of any sign."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigurationError(
            f"{value!r} is not a size: give an int of bytes or a string with a unit "
            f"({_UNITS_TEXT}), e.g. '64GiB'"
        )
    if isinstance(value, int):
        return _check_int_range(value, value)
    text = value.strip()
    negative = text.startswith("-")
    match = _SIZE_RE.fullmatch(text[1:] if negative else text)
    if match is None or match.group(2) not in ("", *SIZE_UNITS):
        raise ConfigurationError(
            f"{value!r} is not a size: write a number and a unit ({_UNITS_TEXT}), "
            "e.g. '64GiB' or '500MB'"
        )
    exact = Decimal(match.group(1)) * SIZE_UNITS[match.group(2) or "B"]
    if exact != exact.to_integral_value():
        raise ConfigurationError(f"{value!r} is not a whole number of bytes")
    return _check_int_range(-int(exact) if negative else int(exact), value)


def format_size(num_bytes: int) -> str:
    """``num_bytes`` in the largest unit that divides it exactly (``parse_size`` inverts it)."""
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes <= 0:
        raise ConfigurationError(f"a size must be an int > 0, got {num_bytes!r}")
    for unit, factor in sorted(SIZE_UNITS.items(), key=lambda item: -item[1]):
        if factor > 1 and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return f"{num_bytes}B"


# -- fields ----------------------------------------------------------------------------------


class _Required:
    def __repr__(self) -> str:
        return "<required>"


REQUIRED: Any = _Required()


@dataclass(frozen=True)
class SettingsField:
    """One field of a settings class, as the config sees it."""

    name: str  # the dataclass field (and backend keyword) name
    key: str  # the config key
    annotation: Any  # the base type, ``None`` stripped
    optional: bool  # ``None`` is allowed
    default: Any  # ``REQUIRED`` when the key must be given
    minimum: float | None
    maximum: float | None
    doc: str

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    @property
    def is_size(self) -> bool:
        return self.annotation is int and self.name.endswith("_bytes")


_SCALARS = (bool, int, float, str, Path)


def settings_fields(cls: type) -> tuple[SettingsField, ...]:
    """The fields of the settings dataclass ``cls``, checked to be of supported types.

    Raises :class:`ConfigurationError` naming the class and field otherwise.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigurationError(f"a settings class must be a dataclass, got {cls!r:.80}")
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:  # an unresolvable annotation: say which class
        raise ConfigurationError(
            f"cannot resolve the annotations of settings class {cls.__qualname__}: {exc}"
        ) from exc
    out = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        annotation, optional = _strip_none(hints[f.name])
        if not (annotation in _SCALARS or typing.get_origin(annotation) is Literal):
            raise ConfigurationError(
                f"settings class {cls.__qualname__}: field {f.name!r} has type {hints[f.name]!r}; "
                "supported: bool, int, float, str, pathlib.Path, Literal[...], and X | None"
            )
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = REQUIRED
        minimum = f.metadata.get(
            "min", 1 if annotation is int and f.name.endswith("_bytes") else None
        )
        out.append(
            SettingsField(
                name=f.name,
                key=str(f.metadata.get("key", f.name)),
                annotation=annotation,
                optional=optional,
                default=default,
                minimum=minimum,
                maximum=f.metadata.get("max"),
                doc=str(f.metadata.get("doc", "")),
            )
        )
    return tuple(out)


def _strip_none(annotation: Any) -> tuple[Any, bool]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        if len(args) == 1:
            return args[0], optional
    return annotation, False


def describe_field(f: SettingsField) -> str:
    """What a field accepts, in words (for error messages and docs)."""
    if typing.get_origin(f.annotation) is Literal:
        text = "one of " + ", ".join(repr(c) for c in typing.get_args(f.annotation))
    elif f.is_size:
        text = f"a size: an int of bytes or a number with a unit ({_UNITS_TEXT}), e.g. '64GiB'"
    elif f.annotation is bool:
        text = "true or false"
    elif f.annotation is Path:
        text = "a path (relative to the config file's directory)"
    else:
        text = {int: "an integer", float: "a number", str: "a string"}[f.annotation]
    if f.minimum is not None and f.maximum is not None and not f.is_size:
        text += f" from {f.minimum} to {f.maximum}"
    elif f.minimum is not None and not f.is_size:
        text += f" >= {f.minimum}"
    elif f.maximum is not None:
        text += f" <= {f.maximum}"
    return text + (" or null" if f.optional else "")


def coerce_value(f: SettingsField, value: object, *, base_dir: Path | None = None) -> Any:
    """``value`` as field ``f``'s type; raises :class:`ConfigurationError` saying what is valid."""
    if value is None:
        if f.optional:
            return None
        raise ConfigurationError(f"null is not allowed: give {describe_field(f)}")
    annotation = f.annotation
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        if value not in choices or isinstance(value, bool) != any(
            isinstance(c, bool) for c in choices
        ):
            raise ConfigurationError(f"{value!r} is not valid: give {describe_field(f)}")
        return value
    if f.is_size:
        result: Any = _size_value(value)
    elif annotation is bool:
        if not isinstance(value, bool):
            raise ConfigurationError(f"{value!r} is not valid: give {describe_field(f)}")
        result = value
    elif annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigurationError(f"{value!r} is not valid: give {describe_field(f)}")
        result = _check_int_range(value, value)
    elif annotation is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigurationError(f"{value!r} is not valid: give {describe_field(f)}")
        if isinstance(value, int):
            _check_int_range(value, value)
        result = float(value)
        if not math.isfinite(result):
            raise ConfigurationError(
                f"{value!r} is not valid: give {describe_field(f)} (a finite number)"
            )
    elif annotation is str:
        if not isinstance(value, str):
            raise ConfigurationError(f"{value!r} is not valid: give {describe_field(f)}")
        result = value
    else:  # Path
        if not isinstance(value, str) or not value:
            raise ConfigurationError(f"{value!r} is not valid: give {describe_field(f)}")
        result = Path(value).expanduser()
        if not result.is_absolute() and base_dir is not None:
            result = base_dir / result
    _check_bounds(f, value, result)
    return result


def _check_bounds(f: SettingsField, raw: object, value: Any) -> None:
    if f.is_size and f.minimum is not None and value < f.minimum:
        raise ConfigurationError(
            f"{raw!r} is not a valid size: sizes must be >= {f.minimum} byte(s)"
        )
    if f.minimum is not None and value < f.minimum:
        raise ConfigurationError(f"{raw!r} is too small: give {describe_field(f)}")
    if f.maximum is not None and value > f.maximum:
        raise ConfigurationError(f"{raw!r} is too large: give {describe_field(f)}")


class SettingsProblem(ConfigurationError):
    """A settings mapping has a bad key or value; ``key`` names it (None: the whole mapping)."""

    def __init__(self, key: str | None, problem: str, value: object = None) -> None:
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem
        self.value = value


def parse_settings(
    cls: type,
    values: Mapping[str, Any],
    *,
    base_dir: Path | None = None,
    other_keys: Collection[str] = (),
) -> Any:
    """An instance of the settings dataclass ``cls`` from a mapping of config keys.

    Every key must be a field's key; ``other_keys`` are keys the caller handles, only offered
    as suggestions for a misspelled key. Raises :class:`SettingsProblem` for the first unknown
    key, missing required key or bad value, or if the class's own checks fail.
    """
    specs = settings_fields(cls)
    by_key = {f.key: f for f in specs}
    for key in values:
        if key not in by_key:
            raise SettingsProblem(key, unknown_key_message(key, [*by_key, *other_keys]), key)
    kwargs = {}
    for f in specs:
        if f.key in values:
            try:
                kwargs[f.name] = coerce_value(f, values[f.key], base_dir=base_dir)
            except ConfigurationError as exc:
                raise SettingsProblem(f.key, str(exc), values[f.key]) from None
        elif f.required:
            raise SettingsProblem(f.key, f"missing; give {describe_field(f)}")
    try:
        return cls(**kwargs)
    except SettingsProblem:
        raise
    except (ConfigurationError, ValueError, TypeError) as exc:
        raise SettingsProblem(None, str(exc)) from None


def unknown_key_message(key: object, valid: Collection[str]) -> str:
    """ "unknown key 'x'; did you mean 'y'? valid keys: ..." (closest match by difflib)."""
    message = f"unknown key {key!r}"
    close = difflib.get_close_matches(str(key), list(valid), n=1, cutoff=0.6)
    if close:
        message += f"; did you mean {close[0]!r}?"
    return message + f" (valid keys: {', '.join(sorted(valid))})"


def field_json_schema(f: SettingsField) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of field ``f``'s values."""
    schema: dict[str, Any]
    if typing.get_origin(f.annotation) is Literal:
        schema = {"enum": list(typing.get_args(f.annotation))}
    elif f.is_size:
        schema = {"$ref": "#/$defs/size"}
    else:
        kind = {bool: "boolean", int: "integer", float: "number", str: "string", Path: "string"}
        schema = {"type": kind[f.annotation]}
        if f.minimum is not None:
            schema["minimum"] = f.minimum
        if f.maximum is not None:
            schema["maximum"] = f.maximum
    if f.optional:
        schema = {"anyOf": [schema, {"type": "null"}]}
    if f.doc:
        schema["description"] = f.doc
    if not f.required and _json_scalar(f.default):
        schema["default"] = f.default
    return schema


def _json_scalar(value: object) -> bool:
    return value is None or isinstance(value, bool | int | float | str)


#: The JSON Schema of a size (referenced as ``#/$defs/size``).
SIZE_JSON_SCHEMA: dict[str, Any] = {
    "description": f"bytes: an integer, or a number with a unit ({_UNITS_TEXT})",
    "anyOf": [
        {"type": "integer", "minimum": 1},
        {"type": "string", "pattern": SIZE_PATTERN},
    ],
}
