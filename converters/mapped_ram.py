"""QEMU's mapped-ram files (QEMU >= 9.0; docs/devel/migration/mapped-ram.rst, migration/ram.c).

With the capability ``mapped-ram`` a ``migrate file:PATH`` writes no page entries: in the
'ram' START section each RAM block's MEM_SIZE entry (name, length[, address]) is followed by
a header, and the block's pages lie at fixed offsets of the file::

    header      be32 version (1), be64 page_size, be64 bitmap_offset, be64 pages_offset
    bitmap      at bitmap_offset (right after the header): one bit per page, as the host's
                unsigned longs (x86-64: page i is byte i >> 3, bit i & 7), ceil(pages/64) * 8
                bytes, written when the save completes; a set bit: the page is in its slot
    pages       page i at pages_offset + i * page_size; pages_offset is the first 1 MiB
                boundary after the bitmap; a clear bit's slot is a hole (the page is zero)

The stream goes on at pages_offset + length (the next block's MEM_SIZE entry, or the START
section's EOS), so the file is sparse; the PART and END sections that follow carry EOS only.
With multifd the channels write the same slots: the file is the same.

A block skipped by x-ignore-shared has bitmap_offset = pages_offset = 0 and no pages.

This module knows the layout (``BlockLayout``), checks a header against the file it was read
from, lists a block's pages as runs, and writes a block's header, bitmap and pages;
converters/qemu.py reads and writes the stream around them.
"""

from __future__ import annotations

import dataclasses
import io
import os
import struct
from typing import BinaryIO, Iterator

import numpy as np

from leanimg.errors import SourceFormatError, UnsupportedError

HEADER = struct.Struct(">IQQQ")
VERSION = 1
ALIGNMENT = 1 << 20  # MAPPED_RAM_FILE_OFFSET_ALIGNMENT
RUN_PAGES = 1024  # pages read (or given back) at a time
BITMAP_WINDOW = 1 << 18  # pages whose bits are unpacked at a time (32 KiB of bitmap)
READ_AHEAD = 32 << 20  # bytes of slots advised to the kernel ahead of the reader
CAPABILITY = "mapped-ram"


@dataclasses.dataclass(frozen=True)
class BlockLayout:
    """Where one RAM block's bitmap and pages lie in a mapped-ram file."""

    name: str
    length: int
    page_size: int
    header_at: int
    bitmap_offset: int
    pages_offset: int

    @property
    def num_pages(self) -> int:
        return self.length // self.page_size

    @property
    def bitmap_size(self) -> int:
        return bitmap_size(self.num_pages)

    @property
    def ignored(self) -> bool:
        """x-ignore-shared's empty header: the block has no pages in the file."""
        return self.bitmap_offset == 0 and self.pages_offset == 0

    @property
    def end(self) -> int:
        """Where the stream goes on after this block."""
        return self.header_at + HEADER.size if self.ignored else self.pages_offset + self.length

    def header_bytes(self) -> bytes:
        return HEADER.pack(VERSION, self.page_size, self.bitmap_offset, self.pages_offset)


def bitmap_size(num_pages: int) -> int:
    return (num_pages + 63) // 64 * 8


def layout_at(name: str, length: int, page_size: int, header_at: int) -> BlockLayout:
    """The layout QEMU gives a block whose header is written at ``header_at``."""
    bitmap_offset = header_at + HEADER.size
    pages_offset = -(-(bitmap_offset + bitmap_size(length // page_size)) // ALIGNMENT) * ALIGNMENT
    return BlockLayout(name, length, page_size, header_at, bitmap_offset, pages_offset)


# ---------------------------------------------------------------------------- reading


class RandomAccess:
    """Reads at given offsets of the input a stream cursor reads from, without moving it."""

    def __init__(self, f: BinaryIO, offset: int):
        """``offset``: where the capability mapped-ram was read (for the error on a pipe)."""
        self.f = f
        if not _seekable(f):
            raise UnsupportedError(
                "a mapped-ram file read from a pipe or decompressed as it is read: its "
                "pages lie at fixed offsets, so convert the file itself",
                offset=offset,
                structure="configuration",
            )
        try:
            self.fd = f.fileno()
            self.size = os.fstat(self.fd).st_size
        except (AttributeError, io.UnsupportedOperation, OSError):
            self.fd = None  # an in-memory file (tests, fuzzing)
            here = f.tell()
            self.size = f.seek(0, os.SEEK_END)
            f.seek(here)

    def advise(self, offset: int, length: int) -> None:
        """Ask the kernel to start reading these bytes: slots between holes are read at offsets
        its read-ahead does not foresee (cold, that halved the speed of reading the file)."""
        if self.fd is not None and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, length, os.POSIX_FADV_WILLNEED)

    def read(self, n: int, offset: int) -> bytes:
        if self.fd is not None:
            return os.pread(self.fd, n, offset)
        here = self.f.tell()
        try:
            self.f.seek(offset)
            return self.f.read(n)
        finally:
            self.f.seek(here)


def _seekable(f) -> bool:
    try:
        return f.seekable()
    except (AttributeError, ValueError):
        return False


def read_header(
    raw: bytes, name: str, length: int, page_size: int, header_at: int, file_size: int, ignore_shared: bool
) -> BlockLayout:
    """The layout of the header ``raw`` read at ``header_at``, checked: a version this reader
    knows, the stream's page size, the bitmap after the header, the pages after the bitmap on a
    page boundary, all inside the file. Raises with the offset of the field at fault."""
    version, size, bitmap_offset, pages_offset = HEADER.unpack(raw)
    where = f"mapped-ram header of {name!r}"

    def bad(message: str, field: int) -> SourceFormatError:
        return SourceFormatError(message, offset=header_at + field, structure=where)

    if version != VERSION:
        raise UnsupportedError(
            f"mapped-ram header version {version} (this reader knows {VERSION})", offset=header_at, structure=where
        )
    if size != page_size:
        raise bad(f"expected the stream's page size {page_size}, got {size}", 4)
    layout = BlockLayout(name, length, page_size, header_at, bitmap_offset, pages_offset)
    if ignore_shared and layout.ignored:
        return layout
    if bitmap_offset != header_at + HEADER.size:
        raise bad(
            f"expected the bitmap right after the header at {header_at + HEADER.size:#x}, "
            f"got bitmap_offset {bitmap_offset:#x}",
            12,
        )
    bitmap_end = bitmap_offset + layout.bitmap_size
    if pages_offset % page_size or pages_offset < bitmap_end:
        raise bad(
            f"expected pages_offset on a page boundary at or after the bitmap's end {bitmap_end:#x}, "
            f"got {pages_offset:#x}",
            20,
        )
    if layout.end > file_size:
        raise bad(
            f"expected the pages [{pages_offset:#x}, {layout.end:#x}) inside the file of {file_size:#x} bytes", 20
        )
    return layout


def page_runs(source: RandomAccess, layout: BlockLayout) -> Iterator[tuple[int, int, bytes | None]]:
    """(first page, count, their bytes or None for zero pages) in page order, at most
    RUN_PAGES pages each: set bits are read from their slots, clear bits are zero. The bitmap
    is read a window at a time, so memory stays bounded whatever the block's length."""
    if layout.ignored:
        return
    for window in range(0, layout.num_pages, BITMAP_WINDOW):
        count = min(BITMAP_WINDOW, layout.num_pages - window)
        bits = _bitmap_window(source, layout, window, count)
        edges = np.flatnonzero(np.diff(bits)) + 1
        runs = [
            (window + lo, window + hi, bool(bits[lo])) for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), count])
        ]
        ahead = _Advice(source, layout, [(lo, hi) for lo, hi, data in runs if data])
        for lo, hi, data in runs:
            if data:
                ahead.reach(lo)
                yield from _slots(source, layout, lo, hi)
            else:
                yield lo, hi - lo, None


class _Advice:
    """Keeps READ_AHEAD bytes of the data runs ahead of the reader advised to the kernel."""

    def __init__(self, source: RandomAccess, layout: BlockLayout, runs: list[tuple[int, int]]):
        self.source, self.layout, self.runs = source, layout, runs
        self.next = 0  # the first run not advised yet
        self.advised_to = 0  # page up to which runs are advised

    def reach(self, page: int) -> None:
        ps, until = self.layout.page_size, page + READ_AHEAD // self.layout.page_size
        while self.next < len(self.runs) and self.advised_to < until:
            lo, hi = self.runs[self.next]
            self.source.advise(self.layout.pages_offset + lo * ps, (hi - lo) * ps)
            self.advised_to, self.next = hi, self.next + 1


def _bitmap_window(source: RandomAccess, layout: BlockLayout, first: int, count: int) -> np.ndarray:
    """The bits of pages [first, first + count) (first a multiple of 8), one uint8 each."""
    at, size = layout.bitmap_offset + first // 8, (count + 7) // 8
    raw = source.read(size, at)
    if len(raw) != size:
        raise SourceFormatError(
            f"expected {size} bytes of bitmap, got {len(raw)}",
            offset=at,
            structure=f"mapped-ram bitmap of {layout.name!r}",
        )
    return np.unpackbits(np.frombuffer(raw, np.uint8), bitorder="little")[:count]


def _slots(source: RandomAccess, layout: BlockLayout, first: int, stop: int) -> Iterator[tuple[int, int, bytes]]:
    ps = layout.page_size
    for at in range(first, stop, RUN_PAGES):
        n = min(RUN_PAGES, stop - at)
        data = source.read(n * ps, layout.pages_offset + at * ps)
        if len(data) != n * ps:
            raise SourceFormatError(
                f"expected {n * ps} bytes of pages, got {len(data)}",
                offset=layout.pages_offset + at * ps,
                structure=f"mapped-ram pages of {layout.name!r}",
            )
        yield at, n, data


# ---------------------------------------------------------------------------- writing


class BlockWriter:
    """Writes one block's pages into their slots of a seekable ``out`` whose file starts at
    ``start`` (holes for zero pages) and its bitmap when done."""

    def __init__(self, out: BinaryIO, layout: BlockLayout, start: int = 0):
        self.out, self.layout, self.start = out, layout, start
        self.bitmap = np.zeros(layout.bitmap_size, np.uint8)
        self.page = 0

    def zeros(self, count: int) -> None:
        self.page += count

    def pages(self, data, nonzero: np.ndarray | None = None) -> None:
        """``data``: whole pages from the current one on; ``nonzero`` says which are not zero
        (None: all of them). Runs of non-zero pages are written, zero pages left as holes."""
        ps = self.layout.page_size
        view = memoryview(data).cast("B")
        count = len(view) // ps
        if nonzero is None:
            nonzero = np.ones(count, bool)
        edges = np.flatnonzero(np.diff(nonzero.astype(np.int8))) + 1
        for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), count]):
            if nonzero[lo]:
                self.out.seek(self.start + self.layout.pages_offset + (self.page + lo) * ps)
                self.out.write(view[lo * ps : hi * ps])
        set_pages = self.page + np.flatnonzero(nonzero)
        np.bitwise_or.at(self.bitmap, set_pages >> 3, (1 << (set_pages & 7)).astype(np.uint8))
        self.page += count

    def finish(self) -> None:
        if self.page != self.layout.num_pages:
            raise ValueError(
                f"page_source supplied {self.page} of block {self.layout.name!r}'s {self.layout.num_pages} pages"
            )
        self.out.seek(self.start + self.layout.bitmap_offset)
        self.out.write(self.bitmap.tobytes())
        self.out.seek(self.start + self.layout.end)
