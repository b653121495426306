"""What the drop-in keeps per vLLM request: its cache accesses, and their recency at its end.

vLLM 0.33's CPU manager applies a request's accesses when the request finishes, in prefix
order (its head the most recent): a block the request *reused* (loaded, or offered to store
while ready) counts as a use; a block it *stored* (or promoted) itself is recent again but no
use, so ARC keeps it in T1 ("a store is not a frequency hit"). :class:`RequestAccesses` keeps
that record; :meth:`RequestAccesses.apply_at_end` makes the same pass through tiering's
``touch`` (a use) and ``refresh`` (no use).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, cast

from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from tiering.core.keys import OffloadKey as Key
from tiering.integrations.vllm_hints import request_hint

__all__ = ["RequestAccesses", "prefix_order"]


class _Recency(Protocol):
    def note_request(
        self,
        keys: list[Key],
        *,
        req_context: object = None,
        ended: bool = False,
        continues: bool | None = None,
    ) -> None: ...

    def touch(self, keys: list[Key], *, req_context: object = None) -> None: ...

    def refresh(self, keys: list[Key], *, req_context: object = None) -> None: ...


@dataclass
class RequestAccesses:
    """One request's accesses until it finishes."""

    #: Keys loaded or offered to store (new or resident), in first-seen order.
    accessed: dict[OffloadKey, None] = field(default_factory=dict)
    #: Keys it stored, or promoted (vLLM: its promotion is a store): not reuses.
    inserted: set[OffloadKey] = field(default_factory=set)
    #: Ready keys it loaded or offered to store, not inserted by it before: its reuses.
    reused: set[OffloadKey] = field(default_factory=set)
    #: Keys whose promotion served it (their load source is the tier, not the CPU).
    promoted: set[OffloadKey] = field(default_factory=set)

    def record(
        self,
        keys: Iterable[OffloadKey],
        *,
        reused: Iterable[OffloadKey] = (),
        stored: Iterable[OffloadKey] = (),
    ) -> bool:
        """Note accesses; whether a key was seen for the first time or stored."""
        accessed = self.accessed
        before = len(accessed)
        accessed.update(dict.fromkeys(keys))
        inserted = self.inserted
        grew = len(inserted)
        inserted.update(stored)
        # Reading back a block the request stored (or promoted) itself is no second use.
        self.reused.update(k for k in reused if k not in inserted)
        return len(accessed) != before or len(inserted) != grew

    def clear(self) -> None:
        self.accessed.clear()
        self.inserted.clear()
        self.reused.clear()
        self.promoted.clear()

    def ranked(self, req_context: ReqContext) -> list[Key] | None:
        """Every key accessed, head first, if vLLM gave each one's end token, else None."""
        position = req_context.get_offload_key_position
        ends = [position(k) for k in self.accessed]
        if None in ends:
            return None
        ranked = sorted(zip(cast("list[int]", ends), self.accessed, strict=True), key=_first)
        return [cast("Key", key) for _, key in ranked]

    def apply_at_end(self, manager: _Recency, req_context: ReqContext) -> None:
        """The request's end: its keys in prefix order, the head most recent; a use for those
        it reused, a refresh for the others. Runs of one kind, the tail's first, make the one
        pass from the tail to the head that vLLM's policies make."""
        if not self.accessed:
            return
        keys = prefix_order(list(self.accessed), req_context)
        # The request whole, known only now (vLLM's connector gives its keys a step at a time):
        # a policy that learns from requests (chain) learns from it before the ranking below.
        # With the client's hint, if it sent one (tiering.integrations.vllm_hints).
        manager.note_request(
            cast("list[Key]", keys),
            req_context=req_context,
            ended=True,
            continues=request_hint(req_context),
        )
        reused = self.reused
        end = len(keys)
        while end:
            start = end - 1
            kind = keys[start] in reused
            while start and (keys[start - 1] in reused) is kind:
                start -= 1
            run = cast("list[Key]", keys[start:end])
            if kind:
                manager.touch(run, req_context=req_context)
            else:
                manager.refresh(run, req_context=req_context)
            end = start


def prefix_order(keys: list[OffloadKey], req_context: ReqContext) -> list[OffloadKey]:
    """``keys`` head first when vLLM recorded every key's end token, else as given."""
    position = req_context.get_offload_key_position
    positions = [position(k) for k in keys]
    if None in positions:
        return keys
    ends = cast("list[int]", positions)
    return [keys[i] for i in sorted(range(len(keys)), key=ends.__getitem__)]


def _first(pair: tuple[int, OffloadKey]) -> int:
    return pair[0]
