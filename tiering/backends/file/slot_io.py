"""The file backend's I/O paths: the bytes of slots, moved on its I/O threads.

Writes
    ``put`` allocates a free slot per key (lowest number first, so a fresh file fills
    sequentially) and hands the slots to a thread pool the backend owns, in chunks of at most
    ``batch_blocks`` slots and 4 MiB (small enough that the bytes checksummed are still in the
    CPU cache when they are copied). Up to ``io_threads`` threads share the chunks, each taking
    the next one in order (:func:`tiering.backends.lanes.run_in_lanes`), so a put costs one
    thread hand-off per thread, not per chunk. A chunk writes each run of neighbouring slots
    with one ``os.pwritev`` whose iovecs are, per slot, the header area and the caller's payload
    (plus a zero pad when the payload is not a multiple of 4096): bytes go straight from the
    caller's buffer to the kernel. If that call fails, the run is retried slot by slot, so that
    only the slots that fail again are ``FAILED``. Only when a slot is written (and, with
    ``durability="fsync"``, ``fdatasync`` returned) does the index switch to it; the slot a
    replaced key used is freed afterwards, so a failed replace never destroys the old entry.
    A replace therefore needs a free slot: at full capacity it reports ``FULL``.

Reads
    ``get`` reads each run of neighbouring slots with one ``os.preadv`` (header areas into
    small buffers, payloads straight into the caller's buffers) and verifies header, stamp,
    key, fingerprint and payload checksum on the caller's bytes, right after each run's read.
    A buffered get reads in chunks of at most 8 MiB on one lane, in slot order, and in runs of
    at most 1 MiB (a bigger slot in parts of 1 MiB, its checksum computed part by part), so the
    bytes are still in the CPU cache when they are checksummed and the kernel's readahead keeps
    the device busy meanwhile (O_DIRECT gets take ``batch_blocks`` slots per chunk and per call
    on every lane: bigger calls, deeper device queue). A failed call is retried slot by slot,
    as for writes. A slot being read is pinned: it is not invalidated or reused until the read
    finishes, so a concurrent put or delete of the same key never tears a read. A block that
    does not verify is counted, dropped from the index, its header zeroed on disk, and reported
    ``CORRUPT``. A read error (EIO) does the same and reports ``FAILED``.

O_DIRECT
    With ``o_direct=True`` the slot file bypasses the page cache. The kernel then needs buffers
    whose address and length are multiples of 4096; a caller buffer that is not goes through a
    per-thread bounce buffer (``mmap``), which costs one extra memcpy per block (~0.1 ms per
    MiB here) and is counted in ``stats.extra["o_direct_bounces"]``. Note that torch's CPU
    allocator aligns tensors to 64 bytes only: a pool meant for O_DIRECT should be carved out
    at a 4096-byte boundary (:class:`tiering.managers.pool.CPUBlockPool` rows are). A run of
    neighbouring bounced slots moves with one call through up to 8 MiB of bounce area per
    thread. Whether O_DIRECT pays is a property of the machine: see
    ``benchmarks/bench_file_tier.py``.

Durability
    ``durability="none"`` acknowledges a put once its bytes are in the page cache (they survive
    a process crash, not a power loss); ``"fsync"`` runs one ``fdatasync`` after all the put's
    writes and acknowledges only after it succeeds. Meanwhile each run's writeback is started
    as soon as it is written (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, a hint that waits for
    nothing and promises nothing), so the device works while later runs are checksummed and
    copied and the ``fdatasync`` has less left to wait for. An fsync error is fatal for the
    keys it covers (the kernel may have dropped their pages; a retried fsync could falsely
    succeed): they are ``FAILED`` and never visible. Because one file descriptor is shared, a
    failed fsync in one put also fails every put whose writes overlapped it. ``close`` always
    flushes.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import threading
from collections.abc import Iterator
from pathlib import Path

from tiering.backends._fileops import FileOps
from tiering.backends.file.buffers import Job, Scratch, advance, is_aligned
from tiering.backends.file.io_plan import IoPlan
from tiering.backends.file.slot_format import (
    HEADER_AREA_BYTES,
    STAMP_END,
    SlotGeometry,
    read_stamp,
    stamp,
)
from tiering.core.block_format import (
    HEADER_BYTES,
    checksum_in_parts,
    pack_header,
    unpack_header,
    verify_block,
)
from tiering.errors import CorruptBlockError

# One logger for the whole backend, named as before it became a package.
logger = logging.getLogger("tiering.backends.file")


class SlotIO:
    """Reads, writes, syncs and zeroes slots of the slot file; called on the I/O threads.

    ``fd`` is the slot file's descriptor (-1 while closed), set by the backend. The methods
    hold no event-loop state: the index and the free slots are the loop's
    (:mod:`tiering.backends.file.slot_index`).
    """

    __slots__ = (
        "fd",
        "ops",
        "path",
        "o_direct",
        "block_bytes",
        "slot_bytes",
        "fingerprint",
        "sync_failures",
        "zero_area",
        "_payload_area_bytes",
        "_pad_bytes",
        "_zero_pad",
        "_start_writeback",
        "_max_run",
        "_read_run_slots",
        "_read_part_bytes",
        "_bounce_run",
        "_local",
        "_sync_lock",
    )

    def __init__(
        self,
        path: Path,
        ops: FileOps,
        geometry: SlotGeometry,
        plan: IoPlan,
        fingerprint: bytes,
        *,
        o_direct: bool,
    ) -> None:
        self.fd = -1
        self.ops = ops
        self.path = path
        self.o_direct = o_direct
        self.block_bytes = geometry.block_bytes
        self.slot_bytes = geometry.slot_bytes
        self.fingerprint = fingerprint
        self._payload_area_bytes = geometry.payload_area_bytes
        self._pad_bytes = geometry.pad_bytes
        self._zero_pad = memoryview(bytes(geometry.pad_bytes))
        self.zero_area = memoryview(mmap.mmap(-1, HEADER_AREA_BYTES))
        self._start_writeback = plan.start_writeback
        self._max_run = plan.max_run
        self._read_run_slots = plan.read_run_slots
        self._read_part_bytes = plan.read_part_bytes
        self._bounce_run = plan.bounce_run
        self._local = threading.local()
        self._sync_lock = threading.Lock()
        self.sync_failures = 0  # generation counter, read and bumped by I/O threads

    def needs_bounce(self, view: memoryview) -> bool:
        return self.o_direct and not is_aligned(view)

    def sync_generation(self) -> int:
        """The fdatasync failures so far: a put notes it before its writes (see sync_writes)."""
        with self._sync_lock:
            return self.sync_failures

    def scratch(self) -> Scratch:
        """This thread's scratch buffers."""
        scratch: Scratch | None = getattr(self._local, "scratch", None)
        if scratch is None:
            scratch = Scratch(
                self._max_run, self._payload_area_bytes, self._pad_bytes, self._bounce_run
            )
            self._local.scratch = scratch
        return scratch

    def _runs(self, jobs: list[Job], max_run: int | None = None) -> Iterator[list[Job]]:
        """Split jobs into runs of consecutive slots that one pwritev/preadv can move, each of
        at most ``max_run`` slots (default: as many as one call takes)."""
        limit = self._max_run if max_run is None else max_run
        run: list[Job] = []
        for job in jobs:
            if run and (
                job.bounce != run[-1].bounce
                or job.slot != run[-1].slot + 1
                or len(run) == (self._bounce_run if job.bounce else limit)
            ):
                yield run
                run = []
            run.append(job)
        if run:
            yield run

    def _iovecs(self, run: list[Job], scratch: Scratch, pad: memoryview) -> list[memoryview]:
        """[header area, payload, pad] per slot: the slots' bytes, contiguous in the file. A
        bounced slot's payload area is padded already."""
        iovecs: list[memoryview] = []
        for i, job in enumerate(run):
            iovecs += [scratch.area(i), scratch.payload(i) if job.bounce else job.view]
            if self._pad_bytes and not job.bounce and i + 1 < len(run):
                iovecs.append(pad)
        return iovecs

    # -- writes ----------------------------------------------------------------------------------

    def write_jobs(self, index: int, jobs: list[Job]) -> list[BaseException | None]:
        del index  # chunks are written in any order
        scratch = self.scratch()
        errors: list[BaseException | None] = []
        for run in self._runs(jobs):
            errors += self._write_run(run, scratch)
        return errors

    def sync_writes(
        self, errors: list[BaseException | None], generation: int
    ) -> list[BaseException | None]:
        """fdatasync after a put's writes; on failure every write of the put fails.

        ``generation`` is the failure count when the put began: a failed fdatasync of another
        put that overlapped these writes may have consumed the error this one would see.
        """
        sync_error = self.sync()
        with self._sync_lock:
            overlapped_failure = self.sync_failures != generation
        if sync_error is None and overlapped_failure:
            sync_error = OSError(errno.EIO, "an fdatasync that covered these writes failed")
        if sync_error is None:
            return errors
        return [error or sync_error for error in errors]

    def _write_run(self, run: list[Job], scratch: Scratch) -> list[BaseException | None]:
        try:
            for i, job in enumerate(run):
                header = pack_header(job.key, job.view, self.fingerprint)
                area = scratch.area(i)
                area[:HEADER_BYTES] = header
                area[HEADER_BYTES:STAMP_END] = stamp(header, job.seq)
                if job.bounce:
                    scratch.payload(i)[: self.block_bytes] = job.view
            offset = run[0].slot * self.slot_bytes
            self.write_all(self._iovecs(run, scratch, self._zero_pad), offset)
            if self._start_writeback:
                with contextlib.suppress(OSError):  # a hint: the put's fdatasync decides
                    self.ops.start_writeback(self.fd, offset, len(run) * self.slot_bytes)
        except Exception as exc:
            if len(run) == 1:
                return [exc]
            # Retry slot by slot, so that only the slots that fail again are FAILED.
            return [self._write_run([job], scratch)[0] for job in run]
        return [None] * len(run)

    def invalidate_slots(self, slots: list[int], sync: bool) -> None:
        """Zero the slots' header areas (then fdatasync, if ``sync``); raise the first error."""
        first_error: OSError | None = None
        for slot in slots:
            try:
                self.write_all([self.zero_area], slot * self.slot_bytes)
            except OSError as exc:
                first_error = first_error or exc
        if sync:
            first_error = first_error or self.sync()
        if first_error is not None:
            raise first_error

    # -- reads -----------------------------------------------------------------------------------

    def read_jobs(self, index: int, jobs: list[Job]) -> list[BaseException | None]:
        """Read and verify a chunk, each run verified right after its read (bytes in cache)."""
        del index  # lanes read side by side (O_DIRECT) or there is one (buffered)
        scratch = self.scratch()
        errors: list[BaseException | None] = []
        for run in self._runs(jobs, self._read_run_slots):
            if self._read_part_bytes:  # buffered (never bounced), one big slot a run
                errors.append(self._read_in_parts(run[0], scratch))
            else:
                errors += self._verified(run, self._read_run(run, scratch))
        return errors

    def _read_in_parts(self, job: Job, scratch: Scratch) -> BaseException | None:
        """Read and verify one slot in parts of ``_read_part_bytes`` (the header area with the
        first), checksumming each part right after its read; None, or why it cannot be used."""
        part_bytes = self._read_part_bytes
        offset = job.slot * self.slot_bytes
        payload_sum = checksum_in_parts()
        try:
            for start in range(0, self.block_bytes, part_bytes):
                part = job.view[start : start + part_bytes]
                if start:
                    done = self.pread_all([part], offset + HEADER_AREA_BYTES + start)
                    wanted = part.nbytes
                else:
                    done = self.pread_all([scratch.area(0), part], offset)
                    wanted = HEADER_AREA_BYTES + part.nbytes
                if done < wanted:
                    return CorruptBlockError(f"slot {job.slot} truncated")
                payload_sum.update(part)
        except OSError as exc:
            return exc
        try:
            head = bytes(scratch.area(0)[:STAMP_END])
            self._verify_read(job, head, payload_sum.intdigest())
        except Exception as exc:  # CorruptBlockError: this key only
            return exc
        return None

    def _read_run(self, run: list[Job], scratch: Scratch) -> list[BaseException | bytes]:
        """Read a run of slots into the jobs' buffers; per slot, a copy of its header and stamp
        (the scratch is reused by the next run), or why it cannot be used."""
        try:
            iovecs = self._iovecs(run, scratch, scratch.pad_sink)
            done = self.pread_all(iovecs, run[0].slot * self.slot_bytes)
        except OSError as exc:
            if len(run) == 1:
                return [exc]
            return [self._read_run([job], scratch)[0] for job in run]  # find the bad slot(s)
        reads: list[BaseException | bytes] = []
        for i, job in enumerate(run):
            if done < i * self.slot_bytes + HEADER_AREA_BYTES + self.block_bytes:
                reads.append(CorruptBlockError(f"slot {job.slot} truncated"))
                continue
            if job.bounce:
                job.view[:] = scratch.payload(i)[: self.block_bytes]
            reads.append(bytes(scratch.area(i)[:STAMP_END]))
        return reads

    def _verified(
        self, jobs: list[Job], reads: list[BaseException | bytes]
    ) -> list[BaseException | None]:
        errors: list[BaseException | None] = []
        for job, read in zip(jobs, reads, strict=True):
            if isinstance(read, BaseException):
                errors.append(read)
                continue
            try:
                self._verify_read(job, read)
                errors.append(None)
            except Exception as exc:  # CorruptBlockError: this key only
                errors.append(exc)
        return errors

    def _verify_read(self, job: Job, head: bytes, payload_checksum: int | None = None) -> None:
        """Check a slot read into ``job.view``; ``head``: its header area's header and stamp;
        ``payload_checksum``: the payload's, if computed while it was read."""
        header = unpack_header(head)
        if read_stamp(memoryview(head)) != job.seq:
            raise CorruptBlockError(f"slot {job.slot} holds another write of the key")
        verify_block(
            header,
            job.view,
            expected_key=job.key,
            expected_fingerprint=self.fingerprint,
            payload_checksum=payload_checksum,
        )

    # -- system calls ----------------------------------------------------------------------------

    def write_all(self, buffers: list[memoryview], offset: int) -> None:
        total = sum(buf.nbytes for buf in buffers)
        while True:
            done = self.ops.pwritev(self.fd, buffers, offset)
            if done >= total:
                return
            if done <= 0:
                raise OSError(errno.EIO, f"pwritev wrote nothing at offset {offset}")
            buffers, offset, total = advance(buffers, done), offset + done, total - done

    def pread_all(self, buffers: list[memoryview], offset: int) -> int:
        """Read until the buffers are full or the file ends; return the bytes read."""
        total = sum(buf.nbytes for buf in buffers)
        read = 0
        while read < total:
            done = self.ops.preadv(self.fd, buffers, offset + read)
            if done <= 0:
                break
            read += done
            buffers = advance(buffers, done)
        return read

    def sync(self) -> OSError | None:
        """fdatasync the slot file; a failure bumps the generation every writer checks."""
        try:
            self.ops.fdatasync(self.fd)
        except OSError as exc:
            with self._sync_lock:
                self.sync_failures += 1
            logger.error("file backend %s: fdatasync failed: %s", self.path, exc)
            return exc
        return None
