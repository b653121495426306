"""The file backend's collaborators, one at a time: the slot geometry, the I/O plan, the index
(and its slot table), and recovery's choice among copies of one key."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

from tiering.backends.base import BackendStats, Outcome
from tiering.backends.file.io_plan import IoPlan
from tiering.backends.file.recovery import Found, ScanResult, rebuild_index
from tiering.backends.file.slot_format import SlotGeometry, slot_bytes_for
from tiering.backends.file.slot_index import Entry, SlotIndex, SlotTable

KiB, MiB = 1024, 1024 * 1024
MAX_RUN = min(16, os.sysconf("SC_IOV_MAX") // 3)


def test_slot_geometry_pads_the_payload_to_the_next_page() -> None:
    geometry = SlotGeometry.for_block(10_000)
    assert geometry == SlotGeometry(10_000, 4096 + 12_288, 12_288, 2_288)
    assert slot_bytes_for(256 * KiB) == 4096 + 256 * KiB


def test_io_plan_of_buffered_256k_blocks() -> None:
    plan = IoPlan.build(
        SlotGeometry.for_block(256 * KiB),
        o_direct=False,
        io_threads=2,
        batch_blocks=16,
        durability="none",
    )
    # slot 266,240 bytes: 31 fit in 8 MiB, 15 in 4 MiB, 3 in 1 MiB
    assert plan == IoPlan(
        read_task_slots=16,
        read_lanes=1,
        write_chunk_slots=15,
        start_writeback=False,
        max_run=MAX_RUN,
        read_run_slots=min(3, MAX_RUN),
        read_part_bytes=0,
        bounce_run=min(32, MAX_RUN),
    )


def test_io_plan_of_buffered_2m_blocks_reads_in_parts_and_starts_writeback() -> None:
    plan = IoPlan.build(
        SlotGeometry.for_block(2 * MiB),
        o_direct=False,
        io_threads=2,
        batch_blocks=16,
        durability="fsync",
    )
    assert (plan.read_task_slots, plan.write_chunk_slots, plan.read_run_slots) == (3, 1, 1)
    assert (plan.read_part_bytes, plan.bounce_run, plan.start_writeback) == (1 * MiB, 4, True)


def test_io_plan_of_o_direct_reads_on_every_lane_in_whole_batches() -> None:
    plan = IoPlan.build(
        SlotGeometry.for_block(256 * KiB),
        o_direct=True,
        io_threads=3,
        batch_blocks=16,
        durability="fsync",
    )
    assert (plan.read_task_slots, plan.read_lanes, plan.read_run_slots) == (16, 3, MAX_RUN)
    assert (plan.read_part_bytes, plan.start_writeback) == (0, False)


def test_slot_table_hands_out_the_lowest_slots_and_defers_pinned_retirements() -> None:
    table = SlotTable(5, {1})
    assert table.allocate_many(3) == [0, 2, 3]
    assert len(table) == 1
    table.release(0)
    assert table.allocate_many(9) == [0, 4]
    table.pin(2)
    table.pin(2)
    assert table.retire(2) is False  # read: wait for the readers
    assert table.unpin(2) is False
    assert table.unpin(2) is True  # the last reader left a retired slot
    assert table.retire(3) is True


def _index() -> tuple[SlotIndex, BackendStats]:
    stats = BackendStats()
    index = SlotIndex(stats, 4096, Path("/nowhere"))
    index.rebuild({}, 4, 0)
    return index, stats


def test_index_commits_written_puts_and_retires_failed_ones() -> None:
    index, stats = _index()
    view = memoryview(bytearray(4096))
    jobs = index.allocate_jobs([b"a", b"b", b"c"], [view] * 3, 2, lambda v: False)
    assert [(j.position, j.key, j.slot, j.seq) for j in jobs] == [(0, b"a", 0, 1), (1, b"b", 1, 2)]
    results = [Outcome.FULL] * 3
    retired = index.commit_puts(jobs, [None, OSError("EIO")], results)
    assert results == [Outcome.OK, Outcome.FAILED, Outcome.FULL]
    assert retired == [1]
    assert index.entries == {b"a": Entry(0, 1)}
    assert (stats.put_failures, stats.bytes_written, index.seq) == (1, 4096, 2)


def test_index_keeps_the_put_that_started_later() -> None:
    index, _ = _index()
    view = memoryview(bytearray(4096))
    (first,) = index.allocate_jobs([b"k"], [view], 1, lambda v: False)
    (second,) = index.allocate_jobs([b"k"], [view], 1, lambda v: False)
    assert index.commit_puts([second], [None], [Outcome.FULL]) == []
    assert index.commit_puts([first], [None], [Outcome.FULL]) == [first.slot]  # landed last
    assert index.entries == {b"k": Entry(second.slot, second.seq)}


def test_index_defers_zeroing_a_deleted_slot_until_its_reader_leaves() -> None:
    index, stats = _index()
    index.rebuild({b"k": Entry(2, 9)}, 4, 9)
    view = memoryview(bytearray(4096))
    jobs = index.pin_jobs([b"x", b"k"], [view, view], lambda v: False)
    assert [(j.position, j.slot, j.seq) for j in jobs] == [(1, 2, 9)]
    assert index.drop([b"k", b"x"]) == ([True, False], [])  # pinned: not zeroed yet
    results = [Outcome.MISSING] * 2
    index.commit_gets(jobs, [None], results)
    assert results == [Outcome.MISSING, Outcome.OK]
    assert (stats.hits, stats.bytes_read) == (1, 4096)
    assert index.unpin(jobs) == [2]


def test_recovery_keeps_the_newest_copy_of_a_key() -> None:
    index, _ = _index()
    extra: Counter[str] = Counter()
    scan = ScanResult([Found(0, b"k", 5), Found(1, b"k", 7), Found(2, b"j", 1)], [3], 0)
    assert rebuild_index(index, scan, 4, extra, Path("/nowhere")) == [b"k", b"j"]
    assert index.entries == {b"k": Entry(1, 7), b"j": Entry(2, 1)}
    assert scan.rejected == [3, 0]  # the older copy joins the rejected: zeroed on open
    assert (extra["recovery_duplicates"], extra["recovery_rejected"], index.seq) == (1, 1, 7)
    assert index.slots.allocate_many(4) == [0, 3]
