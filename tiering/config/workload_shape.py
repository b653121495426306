"""The shape of generated traffic beyond its mix: a value the config's ``replay.shape`` and the
command line's ``--shape`` name (:mod:`tiering.replay.workloads` generates it)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tiering.errors import ConfigurationError

__all__ = ["WorkloadShape", "format_shape", "parse_shape"]


@dataclass(frozen=True)
class WorkloadShape:
    """What generated traffic looks like beyond its mix; the defaults are the calibrated shape
    (:mod:`tiering.replay.workloads`, docs/workloads.md). Other values shape a trace to an
    operator's traffic, or test a policy on traffic no tuning saw
    (``benchmarks/bench_policy_variants.py``).

    - ``continue_beta_a``: a conversation's chance of another turn is Beta(a, a + 1): 2 turns
      on average for every ``a`` (before the cap of 40); a smaller ``a`` makes conversations
      differ more (at 0.6, 73 % have one turn).
    - ``tenants``: tenants, each with its own system and tool prompt, Zipf-popular.
    - ``catalog_share``: the share of documents asked about that come from a catalog of popular
      ones (the rest are one-off uploads); ``catalog_alpha``: the catalog's Zipf exponent.
    - ``think_time_scale``: every delay between a session's requests (think, ask, tool run)
      times this.
    """

    continue_beta_a: float = 0.6
    tenants: int = 24
    catalog_share: float = 0.4
    catalog_alpha: float = 0.9
    think_time_scale: float = 1.0

    def __post_init__(self) -> None:
        if type(self.tenants) is not int or self.tenants < 1:
            raise ConfigurationError(
                f"WorkloadShape.tenants must be an int >= 1, got {self.tenants!r}"
            )
        checks = (
            ("continue_beta_a", lambda v: v > 0, "a finite number > 0"),
            ("catalog_share", lambda v: 0 <= v <= 1, "a number in [0, 1]"),
            ("catalog_alpha", lambda v: v >= 0, "a finite number >= 0"),
            ("think_time_scale", lambda v: v > 0, "a finite number > 0"),
        )
        for field, in_range, valid in checks:
            value = getattr(self, field)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (number and math.isfinite(value) and in_range(value)):
                raise ConfigurationError(f"WorkloadShape.{field} must be {valid}, got {value!r}")


def parse_shape(text: str) -> WorkloadShape:
    """``FIELD=VALUE[,FIELD=VALUE...]`` (``--shape``, the config's ``replay.shape``) as a
    :class:`WorkloadShape`; a field not named keeps its calibrated value.
    :class:`~tiering.errors.ConfigurationError` names what is wrong and what is valid."""
    defaults = {f.name: f.default for f in dataclasses.fields(WorkloadShape)}
    values: dict[str, float] = {}
    for part in text.split(","):
        name, equals, raw = (piece.strip() for piece in part.partition("="))
        if not equals or name not in defaults:
            raise ConfigurationError(
                f"{part.strip()!r} is not FIELD=VALUE with a field of "
                f"{', '.join(defaults)} (e.g. think_time_scale=5,tenants=3)"
            )
        if name in values:
            raise ConfigurationError(f"{name} is given twice")
        try:
            values[name] = int(raw) if isinstance(defaults[name], int) else float(raw)
        except ValueError:
            kind = "an int" if isinstance(defaults[name], int) else "a number"
            raise ConfigurationError(f"{name} must be {kind}, got {raw!r}") from None
    return WorkloadShape(**values)  # type: ignore[arg-type]


def format_shape(shape: WorkloadShape) -> str:
    """``shape`` as :func:`parse_shape` reads it: the fields that differ from the calibrated
    shape, ``FIELD=VALUE`` joined by commas ("" for the calibrated shape itself)."""
    return ",".join(
        f"{f.name}={getattr(shape, f.name)}"
        for f in dataclasses.fields(shape)
        if getattr(shape, f.name) != f.default
    )
