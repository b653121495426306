"""Recovery at open: the stored layout checked against the configured one, and the index of
stored keys rebuilt from what verifies.

Layout
    ``meta`` records the layout the blocks were written for (with the directory's marker, which
    may describe it). Blocks of another layout are refused by default (``on_layout_mismatch``),
    or set aside or wiped as configured (:mod:`tiering.backends.lmdb.opening`).

Recovery (``recover``)
    ``"trust_header"`` (default): at open, every stored value's header is checked (its own
    checksum, the key it names, the layout fingerprint, the payload size); payload checksums are
    checked on every get anyway. ``"verify"``: the payload checksum is checked too (reads the whole
    database). ``"wipe"``: start empty. Entries that fail are deleted, and so counted; entries the
    blocks database claims but a damaged page hides from the cursor or from a lookup are
    counted too. If more blocks verify than ``capacity_blocks`` (a smaller capacity than the
    last run), the surplus is deleted. Read-only, nothing is deleted: what fails is not indexed.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lmdb

from tiering.backends.lmdb.environment import LMDBEnvironment
from tiering.backends.lmdb.files import LAYOUT_KEY
from tiering.backends.lmdb.record import RecordFormat
from tiering.backends.lmdb.threads import Count, Job
from tiering.backends.lmdb.transactions import WriteTransactions
from tiering.backends.ownership import LayoutMismatchError, LayoutRecord, TierDirectory
from tiering.backends.settings import RecoverMode

__all__ = ["Recovery"]

_log = logging.getLogger(__package__)  # the package's logger, as before the split


class Recovery:
    """Checks what an opened environment holds, and rebuilds the index (writer thread)."""

    __slots__ = (
        "_count",
        "_environment",
        "_index",
        "_layout",
        "_path",
        "_read_only",
        "_record",
        "_recover",
        "_transactions",
    )

    def __init__(
        self,
        environment: LMDBEnvironment,
        record: RecordFormat,
        transactions: WriteTransactions,
        index: set[bytes],
        *,
        layout: LayoutRecord,
        recover: RecoverMode,
        read_only: bool,
        count: Count,
    ) -> None:
        self._environment = environment
        self._path = environment.path
        self._record = record
        self._transactions = transactions
        self._index = index
        self._layout = layout  # the configured layout
        self._recover = recover
        self._read_only = read_only
        self._count = count

    def layout_mismatch(
        self, env: lmdb.Environment, found: TierDirectory
    ) -> LayoutMismatchError | None:
        """The error to raise if the environment holds blocks of another layout, else None."""
        blocks_db, meta_db = self._environment.blocks_db, self._environment.meta_db
        if blocks_db is None or meta_db is None:
            return None
        with env.begin() as txn:
            stored = txn.get(LAYOUT_KEY, db=meta_db)
            entries = txn.stat(blocks_db)["entries"]
        marker = found.marker.layout if found.marker is not None else None
        if not entries:
            return None
        on_disk: LayoutRecord | None = marker
        layout_record = self._record.layout_record()
        if stored is not None and len(stored) == len(layout_record):
            record = LayoutRecord(
                int.from_bytes(stored[2:10], "little"),
                bytes(stored[10:]),
                marker.description if marker is not None else None,
            )
            on_disk = (
                record
                if marker is not None and marker.matches(record)
                else (LayoutRecord(record.block_bytes, record.fingerprint))
            )
            if stored[:2] != layout_record[:2]:  # another block format: not readable
                on_disk = LayoutRecord(record.block_bytes, b"\0" * 16)
        if on_disk is None or on_disk.matches(self._layout):
            return None
        return LayoutMismatchError(
            Path(self._path), on_disk, self._layout, what="the LMDB directory"
        )

    def rebuild_index(self, env: lmdb.Environment, *, wipe: bool) -> list[bytes]:
        """Rebuild the index from what is stored, deleting what does not verify (read-only:
        leaving it, and not indexing it). ``wipe``: drop every block first."""
        index = self._index
        blocks_db = self._environment.blocks_db
        if blocks_db is None or self._environment.meta_db is None:
            index.clear()
            return []
        dropped = 0 if self._read_only else self._record_layout(env, wipe=wipe)
        good, bad, unseen = self._scan(env, blocks_db)
        capacity_blocks = self._environment.geometry.capacity_blocks
        kept = list(good)
        surplus = kept[capacity_blocks:]
        del kept[capacity_blocks:]
        doomed = bad + surplus
        index.clear()
        index.update(kept)
        index.update(doomed)
        if doomed and not self._read_only:
            self._transactions.run_group([Job("delete", doomed, None)])  # grows the map if it must
        index.clear()
        index.update(kept)
        self._count("recovered_blocks", len(kept))
        self._count("recovery_dropped_blocks", dropped + len(doomed) + unseen)
        if doomed or dropped or unseen:
            _log.warning(
                "LMDB at %s: dropped %d stored blocks at open (%d did not verify, %d over "
                "capacity, %d of another layout or wiped, %d unreachable in a damaged page)",
                self._path,
                dropped + len(doomed) + unseen,
                len(bad),
                len(surplus),
                dropped,
                unseen,
            )
        return kept

    def _record_layout(self, env: lmdb.Environment, *, wipe: bool) -> int:
        """Write the configured layout to ``meta``, dropping every block first if ``wipe`` (or
        ``recover: wipe``). Returns how many blocks were dropped."""
        blocks_db = self._environment.blocks_db
        assert blocks_db is not None
        dropped = 0
        with env.begin(db=self._environment.meta_db, write=True) as txn:
            if wipe or self._recover == "wipe":
                dropped = txn.stat(blocks_db)["entries"]
                txn.drop(blocks_db, delete=False)
            txn.put(LAYOUT_KEY, self._record.layout_record())
        return dropped

    def _scan(
        self, env: lmdb.Environment, blocks_db: lmdb._Database
    ) -> tuple[dict[bytes, None], list[bytes], int]:
        """Walk the blocks: those that verify (in order), those that do not, and how many the
        database claims but the walk did not see."""
        verifies = self._record.verifies
        good: dict[bytes, None] = {}  # ordered, and a key a damaged page repeats counts once
        bad: list[bytes] = []
        verify_payload = self._recover == "verify"
        with env.begin(db=blocks_db, buffers=True) as rtxn:
            claimed = rtxn.stat(blocks_db)["entries"]
            for key_view, raw in rtxn.cursor().iternext():
                key = bytes(key_view)
                if verifies(key, raw, verify_payload=verify_payload):
                    good[key] = None
                else:
                    bad.append(key)
            # A damaged page can leave a key that a walk finds but a lookup does not (keys out
            # of order): get() could never serve it.
            unreachable = [key for key in good if rtxn.get(key) is None]
        for key in unreachable:
            del good[key]
        # A damaged leaf page can hide entries from the cursor: they are lost too, and counted.
        unseen = max(0, claimed - len(good) - len(bad))
        return good, bad, unseen
