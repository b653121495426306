"""A tier's ``path``: expanded, made absolute from the config's directory, and checked.

Parsing has no side effects: a tier directory is only checked to be usable, or creatable by this
user (and to be nameable on this system at all); :func:`tiering.config.build_manager` creates it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tiering.backends.registry import BackendEntry
from tiering.config.context import _Context
from tiering.config.yaml_lines import _key_line, _line_of


def _parse_tier_path(
    ctx: _Context, item: Mapping[str, Any], path: str, entry: BackendEntry | None
) -> Path | None:
    """The tier's directory; for a plugin (``entry`` None) whether it needs one is checked when
    it is imported."""
    line = _key_line(item, "path")
    if entry is not None and not entry.accepts_path:
        if "path" in item:
            raise ctx.error(f"{path}.path", f"the {entry.name!r} backend takes no path", line)
        return None
    raw = item.get("path")
    if raw is None:
        if entry is None:
            return None
        raise ctx.error(
            f"{path}.path",
            f"missing; the {entry.name!r} backend keeps its data in a directory: give one "
            f"(relative paths are taken from {str(ctx.base_dir)!r})",
            _line_of(item),
        )
    if not isinstance(raw, str) or not raw.strip():
        raise ctx.error(f"{path}.path", f"{raw!r} is not valid: give a directory path", line)
    problem = _path_text_problem(raw)
    if problem:
        raise ctx.error(f"{path}.path", f"{raw!r:.200}: {problem}", line)
    try:
        expanded = Path(raw).expanduser()
    except RuntimeError as exc:  # '~user' of an unknown user, or no home directory
        raise ctx.error(f"{path}.path", f"{raw!r}: cannot expand '~': {exc}", line) from None
    directory = Path(os.path.normpath(ctx.base_dir / expanded))
    problem = _path_text_problem(str(directory)) or _directory_problem(directory)
    if problem:
        raise ctx.error(f"{path}.path", f"{raw!r:.200}: {problem}", line)
    return directory


# Linux's limits: a file name of at most NAME_MAX bytes, a path of fewer than PATH_MAX bytes.
_NAME_MAX_BYTES = 255
_PATH_MAX_BYTES = 4096


def _path_text_problem(text: str) -> str | None:
    """Why ``text`` cannot name a file on this system at all (None if it can)."""
    if "\0" in text:
        return "a path cannot contain a NUL character"
    try:
        encoded = os.fsencode(text)
    except UnicodeEncodeError as exc:
        return f"cannot be encoded as a file name ({exc.reason} at character {exc.start})"
    if len(encoded) >= _PATH_MAX_BYTES:
        return f"the path is {len(encoded)} bytes long; the longest is {_PATH_MAX_BYTES - 1}"
    longest = max(encoded.split(b"/"), key=len)
    if len(longest) > _NAME_MAX_BYTES:
        return (
            f"a part of the path is {len(longest)} bytes long; a file name has at most "
            f"{_NAME_MAX_BYTES}"
        )
    return None


def _directory_problem(directory: Path) -> str | None:
    """Why ``directory`` cannot be used or created by this user (None if it can)."""
    try:
        if directory.exists():
            if not directory.is_dir():
                return f"{str(directory)!r} exists and is not a directory"
            if not os.access(directory, os.W_OK | os.X_OK):
                return f"directory {str(directory)!r} is not writable by this user"
            return None
        parent = directory
        while not parent.exists():
            if os.path.lexists(parent):
                return f"cannot create {str(directory)!r}: {str(parent)!r} is a broken symlink"
            parent = parent.parent
    except OSError as exc:
        return f"cannot inspect {str(directory)!r}: {exc.strerror or exc}"
    if not parent.is_dir():
        return f"cannot create {str(directory)!r}: {str(parent)!r} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {str(directory)!r}: {str(parent)!r} is not writable by this user"
    return None
