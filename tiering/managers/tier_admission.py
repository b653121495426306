"""A secondary tier's admission gate: ``admission_min_count`` keeps blocks unlikely to return
off the tier's device.

A gated tier holds a :class:`~tiering.policies.admission.FrequencyGate` (a count-min sketch
with aging). The manager records in it every key it looks up past the primary
(:class:`~tiering.managers.tier_lookups.TierLookups`, where it counts lookups for
``write_through_selective`` tiers); when a store reaches the tier, only the keys the gate admits
(looked up ``admission_min_count`` times recently) are written, the others are counted in
``stores_not_admitted``. A ``write_through_selective`` tier applies its own rule first, then the
gate. A ``write_back`` tier takes no gate: it writes only what the primary evicts, when it
evicts it, and a block not admitted then would be lost from every tier at once.

:func:`admission_gate` checks the settings and builds the gate (None when it is off);
:func:`admit` filters a store's keys through it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from tiering.errors import ConfigurationError
from tiering.managers.tier_stats import TierMetrics
from tiering.managers.tier_write_policy import WritePolicy
from tiering.policies.admission import MAX_MIN_COUNT, FrequencyGate, default_width

__all__ = ["admission_gate", "admit"]


def admission_gate(
    name: str,
    capacity_blocks: int,
    write_policy: WritePolicy,
    min_count: int,
    width: int | None,
) -> FrequencyGate | None:
    """The gate of tier ``name`` (None: ``min_count`` is 0, no gate); ``width`` None sizes it
    from ``capacity_blocks`` (:func:`~tiering.policies.admission.default_width`). Raises
    :class:`ConfigurationError` for a setting out of bounds."""
    if isinstance(min_count, bool) or not isinstance(min_count, int):
        raise ConfigurationError(
            f"tier {name!r}: admission_min_count must be an int in [0, {MAX_MIN_COUNT}] "
            f"(0: no gate), got {min_count!r}"
        )
    if not 0 <= min_count <= MAX_MIN_COUNT:
        raise ConfigurationError(
            f"tier {name!r}: admission_min_count must be in [0, {MAX_MIN_COUNT}] (0: no gate; "
            f"the sketch's counters stop at {MAX_MIN_COUNT}), got {min_count}"
        )
    if width is not None and (isinstance(width, bool) or not isinstance(width, int) or width < 1):
        raise ConfigurationError(
            f"tier {name!r}: admission_width must be an int >= 1 (counters per row, rounded up "
            f"to a power of two) or null (8 per block of capacity), got {width!r}"
        )
    if min_count == 0:
        if width is not None:
            raise ConfigurationError(
                f"tier {name!r}: admission_width {width} is set but admission_min_count is 0 "
                "(no gate); set admission_min_count >= 1 or remove admission_width"
            )
        return None
    if write_policy is WritePolicy.WRITE_BACK:
        raise ConfigurationError(
            f"tier {name!r}: admission_min_count {min_count} does not apply to a write_back "
            "tier (it writes only the blocks the primary evicts; one not admitted would leave "
            "every tier); use write_through or write_through_selective, or set "
            "admission_min_count to 0"
        )
    return FrequencyGate(default_width(capacity_blocks) if width is None else width, min_count)


def admit(
    gate: FrequencyGate, keys: Sequence[bytes], held: Collection[bytes], metrics: TierMetrics
) -> list[bytes]:
    """The keys of a store to write: those ``gate`` admits, and those the tier ``held``
    already (not written again; its index decides). The others are counted not admitted."""
    admitted = [k for k in keys if k in held or gate.admits(k)]
    metrics.stores_not_admitted += len(keys) - len(admitted)
    return admitted
