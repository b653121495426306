"""The local-NVMe file backend: fixed-size slots in one preallocated file.

:class:`FileBackend` (:mod:`~tiering.backends.file.backend`) keeps blocks in the slots of one
preallocated file; each idea has its own module:

- :mod:`~tiering.backends.file.slot_format`: the layout of the slot file and of a slot (header
  area, stamp), :func:`slot_bytes_for`;
- :mod:`~tiering.backends.file.manifest`: ``manifest.json``, replaced atomically;
- :mod:`~tiering.backends.file.directory`: the directory the backend owns (claim, lock, layout
  mismatches) and opening the slot file;
- :mod:`~tiering.backends.file.capacity`: the capacity, the disk guard, preallocation;
- :mod:`~tiering.backends.file.recovery`: rebuilding the index from the slot file on open;
- :mod:`~tiering.backends.file.slot_index`: which key lives in which slot, free slots, pins;
- :mod:`~tiering.backends.file.invalidation`: zeroing slots that left the index (deletes);
- :mod:`~tiering.backends.file.slot_io`: the write and read paths (runs of neighbouring slots,
  reads in parts, O_DIRECT bounces, durability), on the threads of
  :mod:`~tiering.backends.file.workers`, cut as :mod:`~tiering.backends.file.io_plan` says;
- :mod:`~tiering.backends.file.buffers`: the jobs and per-thread scratch the I/O paths use;
- :mod:`~tiering.backends.file.validation`: what the constructor and the batch calls accept.
"""

from tiering.backends.file.backend import FileBackend
from tiering.backends.file.slot_format import (
    ALIGN_BYTES,
    HEADER_AREA_BYTES,
    MANIFEST_NAME,
    SLOTS_NAME,
    slot_bytes_for,
)
from tiering.backends.settings import Durability, RecoverMode

__all__ = [
    "ALIGN_BYTES",
    "HEADER_AREA_BYTES",
    "MANIFEST_NAME",
    "SLOTS_NAME",
    "Durability",
    "FileBackend",
    "RecoverMode",
    "slot_bytes_for",
]
