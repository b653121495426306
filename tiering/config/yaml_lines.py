"""Reading a config's YAML strictly, keeping the line of every mapping, key and item.

Only plain YAML is read: :class:`_StrictLoader` is a :class:`yaml.SafeLoader` that also refuses
aliases, duplicate keys, non-string keys and nesting deeper than :data:`MAX_NESTING_DEPTH`;
files over :data:`MAX_CONFIG_BYTES` are refused. Mappings and lists come back as
:class:`_LineMap` / :class:`_LineList`, which remember their lines, so that every
:class:`ConfigError` can name the line of the bad key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tiering.backends.settings import format_size
from tiering.config.schema import MAX_CONFIG_BYTES, MAX_NESTING_DEPTH
from tiering.errors import ConfigError


class _LineMap(dict[str, Any]):
    """A mapping read from YAML, with the (1-based) line of the mapping and of each key."""

    def __init__(self, line: int | None = None) -> None:
        super().__init__()
        self.line = line
        self.key_lines: dict[str, int] = {}


class _LineList(list[Any]):
    """A sequence read from YAML, with the line of the sequence and of each item."""

    def __init__(self, line: int | None = None) -> None:
        super().__init__()
        self.line = line
        self.item_lines: list[int] = []


def _rejected(problem: str, mark: yaml.Mark | None) -> yaml.MarkedYAMLError:
    return yaml.MarkedYAMLError(problem=problem, problem_mark=mark)


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that also refuses aliases, duplicate keys, non-string keys and deep nesting.

    Aliases are refused outright (not bounded): a config never needs them, and refusing them
    makes the size of the loaded data linear in the file's size ("billion laughs").
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            raise _rejected(
                "YAML aliases (*name) are not allowed in a tiering config; write the value out",
                self.peek_event().start_mark,
            )
        self._depth += 1
        try:
            if self._depth > MAX_NESTING_DEPTH:
                raise _rejected(
                    f"nested deeper than {MAX_NESTING_DEPTH} levels", self.peek_event().start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _construct_map(loader: yaml.SafeLoader, node: yaml.MappingNode) -> _LineMap:
    data = _LineMap(node.start_mark.line + 1)
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if not isinstance(key, str):
            raise _rejected(
                f"keys must be strings, got {type(key).__name__} {key!r}", key_node.start_mark
            )
        if key in data:
            raise _rejected(
                f"duplicate key {key!r} (first on line {data.key_lines[key]})", key_node.start_mark
            )
        data[key] = loader.construct_object(value_node, deep=True)
        data.key_lines[key] = line
    return data


def _construct_seq(loader: yaml.SafeLoader, node: yaml.SequenceNode) -> _LineList:
    data = _LineList(node.start_mark.line + 1)
    for item in node.value:
        data.append(loader.construct_object(item, deep=True))
        data.item_lines.append(item.start_mark.line + 1)
    return data


_StrictLoader.add_constructor("tag:yaml.org,2002:map", _construct_map)
_StrictLoader.add_constructor("tag:yaml.org,2002:seq", _construct_seq)


def _load_yaml(text: str, source: str) -> Any:
    """The one YAML document in ``text``, read with :class:`_StrictLoader`."""
    try:
        # The reader checks the text in the constructor: unprintable characters raise there.
        loader = _StrictLoader(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid config YAML: {exc}") from None
    try:
        return loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = " ".join(p for p in (exc.context, exc.problem) if p) or str(exc)
        if "constructor for the tag" in problem:
            problem += "; only plain YAML (mappings, lists, strings, numbers, booleans) is allowed"
        raise ConfigError(f"{where}: invalid config YAML: {problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: invalid config YAML: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:
        # PyYAML's constructors raise these for some scalars ('!!int x', '2023-02-30').
        raise ConfigError(
            f"{source}: invalid config YAML: {type(exc).__name__}: {exc}; write the value as "
            "a plain number or a quoted string"
        ) from None
    finally:
        loader.dispose()


def _read_text(path: Path, source: str) -> str:
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read the config: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{source}: the file is over {format_size(MAX_CONFIG_BYTES)} (the largest config "
            "read); a tiering config is a few KB"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{source}: not UTF-8 text (byte {exc.start})") from None


def _line_of(value: object) -> int | None:
    return getattr(value, "line", None)


def _key_line(mapping: object, key: str | None) -> int | None:
    lines = getattr(mapping, "key_lines", {})
    return lines.get(key, _line_of(mapping)) if key else _line_of(mapping)


def _copy_tree(value: Any) -> Any:
    """A mutable copy (overrides are applied to it), keeping line numbers."""
    if isinstance(value, Mapping):
        out = _LineMap(_line_of(value))
        for key, item in value.items():
            out[key] = _copy_tree(item)
        out.key_lines.update(getattr(value, "key_lines", {}))
        return out
    if isinstance(value, list | tuple):
        items = _LineList(_line_of(value))
        items.extend(_copy_tree(v) for v in value)
        items.item_lines.extend(getattr(value, "item_lines", []))
        return items
    return value


def _with_lines(original: Mapping[str, Any], subset: dict[str, Any]) -> _LineMap:
    out = _LineMap(_line_of(original))
    out.update(subset)
    lines = getattr(original, "key_lines", {})
    out.key_lines.update({k: lines[k] for k in subset if k in lines})
    return out
