"""The state of one parse: where the config came from, and how its problems are worded.

Every problem is a :class:`ConfigError` naming the file, the line when known, the dotted key
path (``secondary_tiers[1].capacity``) and, for a key an environment variable set, the variable.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tiering.errors import ConfigError


@dataclass
class _Context:
    source: str
    base_dir: Path
    env_origins: dict[str, str] = field(default_factory=dict)  # key path -> variable

    def error(self, path: str, problem: str, line: int | None = None) -> ConfigError:
        variable = self.env_origins.get(path)
        where = f"{self.source}:{line}" if line and not variable else self.source
        text = f"{where}: {path}: {problem}" if path else f"{where}: {problem}"
        if variable:
            text += f" (set by environment variable {variable})"
        return ConfigError(text)
