"""The buffers the file backend's I/O threads move bytes through: one job per slot of a batch,
per-thread aligned scratch (header areas, the O_DIRECT bounce area), and iovec arithmetic."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

from tiering.backends.file.slot_format import ALIGN_BYTES, HEADER_AREA_BYTES


@dataclass(slots=True)
class Job:
    """One slot of a batch: written by put, read by get (runs on an I/O thread)."""

    position: int  # index in the caller's batch
    key: bytes
    view: memoryview
    slot: int
    seq: int
    bounce: bool  # O_DIRECT and the caller's buffer is not aligned


class Scratch:
    """Per-thread aligned buffers: header areas for one run of slots and, lazily, padded
    payload areas for ``payload_slots`` slots (the O_DIRECT bounce buffer of one run; the
    recovery scan uses the first) and a pad sink."""

    def __init__(
        self, max_run: int, payload_area_bytes: int, pad_bytes: int, payload_slots: int
    ) -> None:
        self._payload_area_bytes = payload_area_bytes
        self._payload_slots = payload_slots
        self._areas = memoryview(mmap.mmap(-1, max_run * HEADER_AREA_BYTES))
        self._payloads: memoryview | None = None
        self.pad_sink = memoryview(bytearray(pad_bytes))

    def area(self, i: int) -> memoryview:
        return self._areas[i * HEADER_AREA_BYTES : (i + 1) * HEADER_AREA_BYTES]

    def payload(self, i: int) -> memoryview:
        """The ``i``-th padded payload area (0 <= i < payload_slots), page-aligned."""
        if self._payloads is None:
            self._payloads = memoryview(
                mmap.mmap(-1, self._payload_slots * self._payload_area_bytes)
            )
        size = self._payload_area_bytes
        return self._payloads[i * size : (i + 1) * size]


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def is_aligned(view: memoryview) -> bool:
    """Whether O_DIRECT can move ``view`` as it is (address and length multiples of 4096)."""
    return view.nbytes % ALIGN_BYTES == 0 and _address(view) % ALIGN_BYTES == 0


def advance(buffers: list[memoryview], done: int) -> list[memoryview]:
    """The iovecs left after a short transfer of ``done`` bytes."""
    rest: list[memoryview] = []
    for buf in buffers:
        if done >= buf.nbytes:
            done -= buf.nbytes
            continue
        rest.append(buf[done:])
        done = 0
    return rest
