"""Checking an LMDB data file with plain reads, before LMDB maps it.

LMDB maps its data file and trusts it: a page number past the end of a truncated file is a
SIGBUS that kills the whole process (reading a value, or LMDB walking its own B-tree). So before
``lmdb.open``, :func:`check_data_file` reads the file with ``pread`` and checks what LMDB would
touch:

* both meta pages (pages 0 and 1): the meta flag, magic, format version and page size; the one
  LMDB will use (the higher transaction id) must not reference pages past the end of the file;
* every page of the B-trees it will walk (the main database, the named databases in it, and the
  free-page database): the page number stamped in the page, its kind, the bounds of its node
  table, each node within the page, each child page and overflow run within the file, and each
  overflow run's own header.

It reads every branch and leaf page once, plus one header per overflow value (the pages a
``recover: trust_header`` open reads anyway), and no payload. The file is not changed.

Layout of LMDB 0.9 on a 64-bit little-endian machine (``mdb.c``): a page starts with a 16-byte
header (``pgno`` u64, ``pad`` u16, ``flags`` u16, then ``lower``/``upper`` u16 for tree pages or
the overflow page count u32); node offsets (u16) follow it. A node is ``lo`` u16, ``hi`` u16,
``flags`` u16, ``ksize`` u16, the key, then the data (for ``F_BIGDATA``, the u64 page number
of its overflow run; for ``F_SUBDATA``, a 48-byte database record). A meta page holds, after the
page header, ``magic`` u32, ``version`` u32, ``address`` u64, ``mapsize`` u64, two database
records (free, main; the free one's ``pad`` is the page size), ``last_pg`` u64, ``txnid`` u64.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

__all__ = ["LMDBFileCheck", "check_data_file"]

_MAGIC = 0xBEEFC0DE
_DATA_VERSION = 1
_PAGE_HEADER = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_PAGE_HEADER_BYTES = 16
_OVERFLOW_PAGES = struct.Struct("<I")  # at offset 12 of an overflow page
_META = struct.Struct("<IIQQ")  # magic, version, address, mapsize
_DB = struct.Struct("<IHHQQQQQ")  # pad, flags, depth, branch, leaf, overflow, entries, root
_META_TAIL = struct.Struct("<QQ")  # last_pg, txnid
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_NODE_BYTES = 8
_PGNO = struct.Struct("<Q")
_INVALID_PGNO = (1 << 64) - 1

_P_BRANCH, _P_LEAF, _P_OVERFLOW, _P_META, _P_LEAF2 = 0x01, 0x02, 0x04, 0x08, 0x20
_F_BIGDATA, _F_SUBDATA, _F_DUPDATA = 0x01, 0x02, 0x04
_MAX_DEPTH = 32  # a B-tree of 2^63 pages is far shallower
_PAGE_SIZES = (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


class _Damaged(Exception):
    """The file is not what LMDB expects; the message says where."""


@dataclass
class LMDBFileCheck:
    """What :func:`check_data_file` found. ``problem`` is None when LMDB can open it safely."""

    problem: str | None = None
    page_bytes: int = 0
    last_page: int = 0
    file_bytes: int = 0
    #: entries of each named database, when the main database could be read
    entries: dict[bytes, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.problem is None


def check_data_file(path: str | os.PathLike[str]) -> LMDBFileCheck:
    """Check the LMDB data file at ``path`` with plain reads (see the module docstring).

    An absent or empty file is fine (LMDB creates a new environment); anything LMDB could not
    open without touching bytes past the end of the file, or whose structure is not LMDB's, is
    reported in ``problem``. Raises ``OSError`` only if the file cannot be read at all.
    """
    result = LMDBFileCheck()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return result
    try:
        result.file_bytes = os.fstat(fd).st_size
        if result.file_bytes == 0:
            return result
        try:
            _Walker(fd, result).run()
        except _Damaged as exc:
            result.problem = str(exc)
    finally:
        os.close(fd)
    return result


class _Walker:
    def __init__(self, fd: int, result: LMDBFileCheck) -> None:
        self.fd = fd
        self.result = result
        self.psize = 0
        self.last = 0
        self.seen: set[int] = set()

    def read(self, offset: int, size: int) -> bytes:
        data = os.pread(self.fd, size, offset)
        if len(data) < size:
            raise _Damaged(
                f"the file ends at byte {self.result.file_bytes}, inside bytes {offset}.."
                f"{offset + size} that LMDB would read"
            )
        return data

    def run(self) -> None:
        first = self.meta(0, None)
        psize = first[0]
        second = self.meta(1, psize)
        # LMDB uses the meta page with the higher transaction id.
        _, last_pg, txnid, free_db, main_db = max(first, second, key=lambda meta: meta[2])
        self.psize, self.last = psize, last_pg
        self.result.page_bytes, self.result.last_page = psize, last_pg
        if (last_pg + 1) * psize > self.result.file_bytes:
            # Count what is lost, from the pages that are still there, before refusing.
            self.last = self.result.file_bytes // psize - 1
            try:
                for name, record in self.tree(main_db, "the main database", subdbs=True):
                    self.result.entries[name] = _DB.unpack(record)[6]
            except _Damaged:
                self.result.entries.clear()
            raise _Damaged(
                f"the meta page (transaction {txnid}) uses pages up to {last_pg} of "
                f"{psize} bytes ({(last_pg + 1) * psize} bytes), but the file is "
                f"{self.result.file_bytes} bytes: it was truncated"
            )
        self.tree(free_db, "the free-page database", free_list=True)
        for name, record in self.tree(main_db, "the main database", subdbs=True):
            self.result.entries[name] = _DB.unpack(record)[6]
            self.tree(record, f"database {name!r}")

    def meta(self, index: int, psize: int | None) -> tuple[int, int, int, bytes, bytes]:
        offset = 0 if index == 0 else psize or 0
        page = self.read(offset, _PAGE_HEADER_BYTES + _META.size + 2 * _DB.size + _META_TAIL.size)
        _, _, flags, _, _ = _PAGE_HEADER.unpack_from(page)
        if not flags & _P_META:
            raise _Damaged(f"page {index} is not a meta page")
        magic, version, _, _ = _META.unpack_from(page, _PAGE_HEADER_BYTES)
        if magic != _MAGIC:
            raise _Damaged(f"meta page {index} has no LMDB magic number (not an LMDB file)")
        if version != _DATA_VERSION:
            raise _Damaged(f"meta page {index} has LMDB data format {version}, not 1")
        dbs = _PAGE_HEADER_BYTES + _META.size
        free_db = page[dbs : dbs + _DB.size]
        main_db = page[dbs + _DB.size : dbs + 2 * _DB.size]
        page_size = _DB.unpack(free_db)[0]
        if page_size not in _PAGE_SIZES or (psize is not None and page_size != psize):
            raise _Damaged(f"meta page {index} gives a page size of {page_size} bytes")
        last_pg, txnid = _META_TAIL.unpack_from(page, dbs + 2 * _DB.size)
        if last_pg < 1:
            raise _Damaged(f"meta page {index} gives {last_pg} as its last page")
        return page_size, last_pg, txnid, free_db, main_db

    def tree(
        self, record: bytes, what: str, *, subdbs: bool = False, free_list: bool = False
    ) -> list[tuple[bytes, bytes]]:
        """Check the B-tree of a database record; the named databases it holds if ``subdbs``."""
        root = _DB.unpack(record)[7]
        found: list[tuple[bytes, bytes]] = []
        if root == _INVALID_PGNO:
            return found
        stack = [(root, 0)]
        while stack:
            pgno, depth = stack.pop()
            if depth > _MAX_DEPTH:
                raise _Damaged(f"{what}: the tree is deeper than {_MAX_DEPTH} levels")
            stack += [
                (child, depth + 1) for child in self.page(pgno, what, found, subdbs, free_list)
            ]
        return found

    def page_range(self, pgno: int, count: int, what: str) -> None:
        if pgno < 2 or pgno + count - 1 > self.last:
            raise _Damaged(
                f"{what}: page {pgno}{f'..{pgno + count - 1}' if count > 1 else ''} is outside "
                f"the file's pages 2..{self.last}"
            )

    def page(
        self,
        pgno: int,
        what: str,
        found: list[tuple[bytes, bytes]],
        subdbs: bool,
        free_list: bool,
    ) -> list[int]:
        """Check one tree page; return its children (for a branch page)."""
        self.page_range(pgno, 1, what)
        if pgno in self.seen:
            raise _Damaged(f"{what}: page {pgno} is reached twice (a loop)")
        self.seen.add(pgno)
        psize = self.psize
        page = self.read(pgno * psize, psize)
        stamped, _, flags, lower, upper = _PAGE_HEADER.unpack_from(page)
        where = f"{what}, page {pgno}"
        if stamped != pgno:
            raise _Damaged(f"{where}: the page says it is page {stamped}")
        kind = flags & (_P_BRANCH | _P_LEAF | _P_OVERFLOW | _P_META | _P_LEAF2)
        if kind not in (_P_BRANCH, _P_LEAF):
            raise _Damaged(f"{where}: not a branch or leaf page (flags {flags:#x})")
        if not (_PAGE_HEADER_BYTES <= lower <= upper <= psize) or (lower - _PAGE_HEADER_BYTES) % 2:
            raise _Damaged(f"{where}: free-space bounds {lower}..{upper} are impossible")
        count = (lower - _PAGE_HEADER_BYTES) // 2
        offsets = struct.unpack_from(f"<{count}H", page, _PAGE_HEADER_BYTES)
        children = []
        for i, offset in enumerate(offsets):
            node = f"{where}, node {i}"
            if not upper <= offset <= psize - _NODE_BYTES:
                raise _Damaged(f"{node}: offset {offset} is outside the page's node area")
            lo, hi, node_flags, ksize = _NODE.unpack_from(page, offset)
            key_end = offset + _NODE_BYTES + ksize
            if key_end > psize:
                raise _Damaged(f"{node}: its key runs past the end of the page")
            if kind == _P_BRANCH:
                children.append(lo | hi << 16 | node_flags << 32)
                continue
            size = lo | hi << 16
            if node_flags & _F_DUPDATA:
                raise _Damaged(f"{node}: a duplicate-sorted value, which tiering never writes")
            if node_flags & _F_BIGDATA:
                if key_end + _PGNO.size > psize:
                    raise _Damaged(f"{node}: its overflow page number runs past the page")
                (first,) = _PGNO.unpack_from(page, key_end)
                self.overflow(first, size, node)
                if free_list:
                    self.free_list(self.read(first * psize + _PAGE_HEADER_BYTES, size), node)
                continue
            if key_end + size > psize:
                raise _Damaged(f"{node}: its {size}-byte value runs past the end of the page")
            value = page[key_end : key_end + size]
            if node_flags & _F_SUBDATA:
                if size != _DB.size:
                    raise _Damaged(f"{node}: a database record of {size} bytes, not {_DB.size}")
                if subdbs:
                    found.append((page[offset + _NODE_BYTES : key_end], value))
            elif free_list:
                self.free_list(value, node)
        return children

    def overflow(self, first: int, size: int, where: str) -> None:
        pages = (_PAGE_HEADER_BYTES - 1 + size) // self.psize + 1
        self.page_range(first, pages, f"{where}: its value")
        header = self.read(first * self.psize, _PAGE_HEADER_BYTES)
        stamped, _, flags, _, _ = _PAGE_HEADER.unpack_from(header)
        (count,) = _OVERFLOW_PAGES.unpack_from(header, 12)
        # A value rewritten in place may keep a longer run than it needs: count >= pages.
        if stamped != first or not flags & _P_OVERFLOW or count < pages:
            raise _Damaged(
                f"{where}: page {first} is not the start of an overflow run of {pages} pages "
                "or more"
            )
        self.page_range(first, count, f"{where}: its overflow run")

    def free_list(self, value: bytes, where: str) -> None:
        """A free-page record: a count, then that many page numbers, all within the file."""
        if len(value) < _PGNO.size or len(value) % _PGNO.size:
            raise _Damaged(f"{where}: a free-page list of {len(value)} bytes")
        numbers = struct.unpack_from(f"<{len(value) // _PGNO.size}Q", value)
        if numbers[0] > len(numbers) - 1:
            raise _Damaged(f"{where}: a free-page list of {numbers[0]} pages in {len(value)} bytes")
        for pgno in numbers[1 : numbers[0] + 1]:
            self.page_range(pgno, 1, f"{where}: a free page")
