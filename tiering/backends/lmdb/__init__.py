"""The LMDB backend: every block is one value of an LMDB environment (a memory-mapped B+tree).

Layout
    One environment per directory, with two named databases: ``blocks`` (offload key ->
    ``block_format`` header + payload) and ``meta`` (the layout the blocks were written for, and a
    commit counter). A file lock in the directory keeps a second backend, in this process or
    another, from opening it: the backend's in-memory index must be the only writer's view.

Threads
    Every write transaction runs on ONE writer thread the backend owns; concurrent ``put`` and
    ``delete`` calls are coalesced into transactions of at most ``max_txn_bytes`` of values.
    Reads run on up to ``read_threads`` threads that share a get's blocks, in one read
    transaction per thread, copying each payload once, straight from the map into the caller's
    buffer, and checking its checksum as it is filled.

The modules, one idea each:

* :mod:`~tiering.backends.lmdb.backend`: :class:`LMDBBackend`, the event loop's side (settings,
  calls, index, lifecycle, stats; fork safety);
* :mod:`~tiering.backends.lmdb.arguments`: checking settings and block buffers;
* :mod:`~tiering.backends.lmdb.geometry`: capacity and map size (:func:`lmdb_geometry`);
* :mod:`~tiering.backends.lmdb.record`: the stored value (header + payload), the layout record,
  :func:`copy_and_checksum`;
* :mod:`~tiering.backends.lmdb.environment`: opening the environment, the durability flags,
  reader slots, map growth and the disk guard's cap;
* :mod:`~tiering.backends.lmdb.locks`: the directory lock and the reader gate;
* :mod:`~tiering.backends.lmdb.reads`: the read threads' path;
* :mod:`~tiering.backends.lmdb.threads`, :mod:`~tiering.backends.lmdb.writer` and
  :mod:`~tiering.backends.lmdb.transactions`: the writer thread, coalescing, write transactions
  and ``MapFullError``;
* :mod:`~tiering.backends.lmdb.directory`, :mod:`~tiering.backends.lmdb.opening`,
  :mod:`~tiering.backends.lmdb.recovery` and :mod:`~tiering.backends.lmdb.check`: claiming the
  directory, checking its files before LMDB maps them, opening, and rebuilding the index;
* :mod:`~tiering.backends.lmdb.files`: the names of its files, databases and ``meta`` keys.

Never open an LMDB directory from an untrusted source: LMDB trusts its own file format.
"""

from __future__ import annotations

from tiering.backends.lmdb.backend import LMDBBackend
from tiering.backends.lmdb.geometry import LMDBGeometry, lmdb_geometry
from tiering.backends.lmdb.record import copy_and_checksum
from tiering.backends.settings import RecoverMode

__all__ = ["LMDBBackend", "LMDBGeometry", "RecoverMode", "copy_and_checksum", "lmdb_geometry"]
