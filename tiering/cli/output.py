"""What every command prints with: byte counts in binary units, JSON documents."""

from __future__ import annotations

import json
import sys
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` in binary units, three significant digits: ``"1.5 GiB"``, ``"512 B"``."""
    value = float(num_bytes)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            if unit == "B":
                return f"{num_bytes} B"
            return f"{value:.3g} {unit}" if value < 1000 else f"{value:.0f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def print_json(document: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(document, indent=2, sort_keys=True) + "\n")
