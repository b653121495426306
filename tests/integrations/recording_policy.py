"""An LRU policy that records the calls a tier makes on it, for protocol-order tests."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import ClassVar

from tiering.policies import LRUPolicy


class RecordingLRU(LRUPolicy):
    """LRU, each ``note_misses``, ``evict`` (its victims) and insert recorded in order."""

    name = "recording_lru"
    calls: ClassVar[list[tuple[str, tuple[bytes, ...]]]] = []

    def note_misses(self, keys: Sequence[bytes]) -> None:
        self.calls.append(("note_misses", tuple(keys)))
        super().note_misses(keys)

    def evict(self, n: int, protected: Collection[bytes] = ()) -> list[bytes] | None:
        victims = super().evict(n, protected)
        self.calls.append(("evict", tuple(victims or ())))
        return victims

    def insert(self, key: bytes, evictable: bool = True) -> None:
        self.calls.append(("insert", (key,)))
        super().insert(key, evictable)

    def insert_new(self, keys: Sequence[bytes], evictable: bool = True) -> None:
        self.calls.append(("insert", tuple(keys)))
        super().insert_new(keys, evictable)
