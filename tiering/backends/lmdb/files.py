"""The names an LMDB tier gives things: the files of its directory, and the environment's named
databases and ``meta`` keys.

One environment per directory, with two named databases: ``blocks`` (offload key ->
``block_format`` header + payload) and ``meta`` (the layout the blocks were written for, and a
commit counter). ``tiering-lmdb.lock`` is created by tiering only: it marks a directory as
tiering's LMDB (:func:`tiering.backends.lmdb.directory.recognizes_directory`) and carries the
directory lock (:class:`tiering.backends.lmdb.locks.DirectoryLock`).
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "BLOCKS_DB",
    "DAMAGED_SUFFIX",
    "DATA_FILE",
    "LAYOUT_KEY",
    "LMDB_LOCK_FILE",
    "LOCK_FILE",
    "META_DB",
    "TICK_KEY",
]

BLOCKS_DB: Final = b"blocks"
META_DB: Final = b"meta"
LAYOUT_KEY: Final = b"layout"
TICK_KEY: Final = b"tick"
LOCK_FILE: Final = "tiering-lmdb.lock"  # only tiering creates it: it marks tiering's LMDB
DATA_FILE: Final = "data.mdb"
LMDB_LOCK_FILE: Final = "lock.mdb"
DAMAGED_SUFFIX: Final = ".damaged"
