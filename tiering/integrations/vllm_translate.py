"""Translating between vLLM 0.33's types and tiering's in the drop-in.

- Lookup answers: tiering's ``HIT``, ``MISS`` and ``HIT_PENDING`` are vLLM's; tiering's
  ``RETRY`` (a promotion under way) is vLLM's ``HIT_PENDING`` (the module docstring of
  :mod:`tiering.integrations.vllm` says why).
- Keys: vLLM's keys are tiering's (the same bytes), typed once; a ``set`` of keys (vLLM
  completes jobs with one) is put in prefix order first, so what follows is the same on every run.
- Events: the CPU tier's are vLLM's ``CPU`` medium; a tier's are ``STORAGE`` with its owner (and
  its removals expected); a reset's removal of keys never announced is metadata only.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Final, cast

from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadingEvent, OffloadKey, ReqContext

from tiering.core.keys import OffloadKey as Key
from tiering.managers.protocol import LookupResult as TieringLookupResult
from tiering.managers.protocol import OffloadingEvent as TieringEvent

__all__ = [
    "ANSWERS",
    "HIT",
    "HIT_PENDING",
    "MISS",
    "RETRY",
    "T_HIT",
    "T_HIT_PENDING",
    "T_RETRY",
    "in_prefix_order",
    "reset_events",
    "tiering_keys",
    "vllm_event",
    "vllm_keys",
]

T_HIT: Final = TieringLookupResult.HIT
T_RETRY: Final = TieringLookupResult.RETRY
T_HIT_PENDING: Final = TieringLookupResult.HIT_PENDING
ANSWERS: Final = {
    TieringLookupResult.HIT: LookupResult.HIT,
    TieringLookupResult.MISS: LookupResult.MISS,
    TieringLookupResult.HIT_PENDING: LookupResult.HIT_PENDING,
    TieringLookupResult.RETRY: LookupResult.HIT_PENDING,
}
HIT, MISS, HIT_PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING
RETRY: Final = LookupResult.RETRY


def tiering_keys(keys: Iterable[OffloadKey]) -> list[Key]:
    """vLLM's keys as tiering's (the same bytes)."""
    return cast("list[Key]", keys if isinstance(keys, list) else list(keys))


def vllm_keys(keys: Iterable[Key]) -> list[OffloadKey]:
    return cast("list[OffloadKey]", list(keys))


def in_prefix_order(keys: Collection[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
    """``keys`` as a list; a set (vLLM completes jobs with one) in prefix order, then by key,
    so what follows from it (tier writes, events) is the same on every run."""
    if isinstance(keys, list):
        return keys
    position = req_context.get_offload_key_position
    return sorted(keys, key=lambda k: (position(k) or 0, k))


def vllm_event(event: TieringEvent) -> OffloadingEvent:
    if event.owner is None:
        return OffloadingEvent(keys=vllm_keys(event.keys), medium=Medium.CPU, removed=event.removed)
    # A tier announces its removals too: consumers keep a stored block's metadata until then.
    return OffloadingEvent(
        keys=vllm_keys(event.keys),
        medium=Medium.STORAGE,
        removed=event.removed,
        ownership=event.owner,
        removal_expected=not event.removed,
    )


def reset_events(event: TieringEvent, unannounced: set[bytes]) -> list[OffloadingEvent]:
    """A reset's events; the CPU tier's removal of keys never announced is metadata only."""
    translated = vllm_event(event)
    if event.owner is not None or not event.removed or not unannounced:
        return [translated]
    announced = vllm_keys(k for k in event.keys if k not in unannounced)
    silent = vllm_keys(k for k in event.keys if k in unannounced)
    out = []
    if announced:
        out.append(OffloadingEvent(keys=announced, medium=Medium.CPU, removed=True))
    if silent:
        out.append(
            OffloadingEvent(keys=silent, medium=Medium.CPU, removed=True, metadata_only=True)
        )
    return out
