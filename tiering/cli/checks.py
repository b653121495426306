"""A check's verdict (OK / WARN / FAIL), and the JSON document of a list of checks.

``tiering doctor`` prints one :class:`Check` a line; ``config check`` reports its findings as
checks too, and both print :func:`checks_document` with ``--json``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

OK, WARN, FAIL = "OK", "WARN", "FAIL"
VERDICTS = (OK, WARN, FAIL)


@dataclass(frozen=True)
class Check:
    """One line of ``tiering doctor``: a verdict (OK / WARN / FAIL) and why."""

    name: str
    verdict: str
    detail: str
    tier: str | None = None  # the secondary tier it is about, if any


def checks_document(
    command: str, config: str | None, checks: Sequence[Check], exit_code: int
) -> dict[str, Any]:
    """The JSON object ``doctor --json`` and ``config check --json`` print (docs/cli.md)::

        {"json_version": 1, "command": "doctor", "config": "tiering.yaml" | null,
         "exit_code": 0, "counts": {"OK": 9, "WARN": 2, "FAIL": 0},
         "checks": [{"name": "torch", "status": "OK", "message": "2.13.0", "tier": null}, ...]}

    ``status`` is ``OK``, ``WARN`` or ``FAIL``; ``tier`` names the secondary tier a check is
    about (null otherwise). ``config check`` adds ``model`` and ``tiers``.
    """
    return {
        "json_version": 1,
        "command": command,
        "config": None if config is None else str(config),
        "exit_code": exit_code,
        "counts": {verdict: sum(c.verdict == verdict for c in checks) for verdict in VERDICTS},
        "checks": [
            {"name": c.name, "status": c.verdict, "message": c.detail, "tier": c.tier}
            for c in checks
        ],
    }
