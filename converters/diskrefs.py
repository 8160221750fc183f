"""Pages that duplicate the VM's disk become DISK references (spec §6.4), for any converter.

A page becomes a DISK reference to the first block, in scan order, whose digest (the format's
xxh3-128, spec §6.5) equals the page's: the disks in turn, each read by ``disk_blocks`` (its
data ranges at each partition's phase). The digest is computed from the bytes the scan read,
which is what LI-DSK-005 asks of a reference (a reader checks the same digest); the block is
not read a second time. Two ways to find that block, one rule:

- pages that can be read twice (a spooled stream, a Xen file): ``PageIndex``, bounded by the
  guest's pages. 1. ``PageIndex.add`` over the guest's pages: a 64-bit sketch (numpy, every
  page at once) and the digest of every non-zero page. 2. ``scan_disk``: sketch every block
  read, hash only the blocks whose sketch a guest page has; a digest match records (disk,
  sector) for the page. 3. ``DiskPages.put`` over the guest's pages again.
- pages seen once as they stream past (``convert`` of a QEMU stream, ``checkpoint`` in stop
  or background mode): ``BlockIndex``, the digests of the disks' non-zero blocks (28 bytes a
  block, bounded by the disks' data: ``BlockIndex.fits``), built before the pages come;
  ``DiskPages.put`` looks each page's digest up as it arrives.

Either way ``DiskPages`` writes the pages found as DISK references; anything else goes to the
next sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from leanimg.arrays import distinct, gather_rows, nonzero_rows, stretches
from leanimg.disks.partitions import aligned_ranges, scan_bytes, scan_segments
from leanimg.format import DIGEST_SIZE, DISK_SECTOR_SIZE, row_digests
from leanimg.writer import LeanImageWriter

SCAN_CHUNK = 8 << 20
BATCH_PAGES = 4096  # DiskPages: pages looked up and written at once
INDEX_THREADS = 2  # BlockIndex: disk chunks read and hashed at once
MAX_INDEXED_BLOCKS = 16 << 20  # BlockIndex: 64 GiB of scanned disk data, ~450 MiB while built
# odd 64-bit multipliers: a sampled word's contribution to the sketch depends on its position
_MULTIPLIERS = np.array(
    [
        0x9E3779B97F4A7C15,
        0xC2B2AE3D27D4EB4F,
        0x165667B19E3779F9,
        0xD6E8FEB86659FD93,
        0xFF51AFD7ED558CCD,
        0xC4CEB9FE1A85EC53,
    ],
    np.uint64,
)


def sketch(words: np.ndarray) -> np.ndarray:
    """A cheap 64-bit summary per row of ``words`` (pages as uint64 rows); 0 for a zero page.

    The sum of all words plus six sampled words, each weighted by a multiplier: pages that
    differ anywhere almost always get different sketches, and equal pages always equal ones.
    """
    n = words.shape[1]
    picks = words[:, [0, 1, n // 4, n // 2, 3 * n // 4, n - 1]]
    with np.errstate(over="ignore"):
        return words.sum(axis=1, dtype=np.uint64) + (picks * _MULTIPLIERS).sum(axis=1, dtype=np.uint64)


def scan_chunks(disk, page_size: int, all_phases: bool = False):
    """(offset, length) of the chunks a scan reads, in scan order, SCAN_CHUNK bytes at most:
    the whole disk at phase 0, each partition at its own phase (disks/partitions.py), holes
    and unallocated clusters skipped."""
    ranges = disk.data_ranges()
    for start, end, phase in scan_segments(disk, page_size, all_phases):
        for lo, hi in aligned_ranges(ranges, start, end, phase, page_size):
            for at in range(lo, hi, SCAN_CHUNK):
                yield at, min(SCAN_CHUNK, hi - at)


def read_blocks(disk, page_size: int, at: int, length: int) -> np.ndarray:
    """The chunk at ``at`` as rows of uint64 words, one a block."""
    return np.frombuffer(disk.read(at, length), np.uint64).reshape(-1, page_size // 8)


def disk_blocks(disk, page_size: int, *, all_phases: bool = False, progress=None):
    """The blocks a scan reads, in scan order (scan_chunks): (rows of uint64 words, their
    byte offsets), a chunk at a time, the next ones read meanwhile on a thread."""
    chunks = scan_chunks(disk, page_size, all_phases)
    for (at, length), blocks in in_order(lambda chunk: read_blocks(disk, page_size, *chunk), chunks, 1):
        yield blocks, at + page_size * np.arange(len(blocks), dtype=np.int64)
        if progress:
            progress(length)


def in_order(work: Callable, items, threads: int):
    """(item, work(item)) for each of ``items``, in their order, with ``threads`` at work at
    once and as many done ahead: a failure is raised at its item's turn, what is queued behind
    it cancelled."""
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    pending: deque = deque()
    with ThreadPoolExecutor(threads, thread_name_prefix="leanimg-disk-index") as pool:
        try:
            for item in items:
                pending.append((item, pool.submit(work, item)))
                if len(pending) > 2 * threads:
                    done, future = pending.popleft()
                    yield done, future.result()
            while pending:
                done, future = pending.popleft()
                yield done, future.result()
        finally:
            for _, future in pending:
                future.cancel()


# (rows of the batch found on a disk, their disk ids, their sectors, their digests: (n, 16) uint8)
Candidates = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


class PageIndex:
    """Pages read twice, steps 1 and 2: the guest's non-zero pages by sketch, and the disk
    blocks they match."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        self.sketches = np.zeros(0, np.uint64)

    def add(self, region_id: int, first_page: int, data) -> None:
        ps = self.page_size
        words = np.frombuffer(data, np.uint64).reshape(-1, ps // 8)
        sketches = sketch(words)
        keep = np.flatnonzero(sketches)
        if not len(keep):
            return
        digests = row_digests(np.frombuffer(data, np.uint8).reshape(-1, ps), keep)
        self._parts.append(
            (sketches[keep], digests, np.full(len(keep), region_id, np.uint32), first_page + keep.astype(np.uint64))
        )

    def freeze(self) -> None:
        """Sort by sketch; ready for scans."""
        if not self._parts:
            self._parts = [
                (
                    np.zeros(0, np.uint64),
                    np.zeros((0, DIGEST_SIZE), np.uint8),
                    np.zeros(0, np.uint32),
                    np.zeros(0, np.uint64),
                )
            ]
        sketches, digests, regions, pages = (np.concatenate(column) for column in zip(*self._parts))
        self._parts = []
        order = np.argsort(sketches, kind="stable")
        self.sketches, self.digests = sketches[order], digests[order]
        self.regions, self.pages = regions[order], pages[order]
        self._run_stop = np.searchsorted(self.sketches, self.sketches, side="right")
        self.disk_ids = np.full(len(order), -1, np.int64)
        self.sectors = np.zeros(len(order), np.uint64)

    @property
    def unmatched(self) -> int:
        return int((self.disk_ids < 0).sum())

    def match_blocks(self, blocks: np.ndarray, offsets: np.ndarray, disk_id: int) -> None:
        """Record guest pages equal to any of ``blocks`` (rows) found at byte ``offsets``; a
        page keeps the first block found for it."""
        sketches = sketch(blocks)
        pos = np.searchsorted(self.sketches, sketches)
        hit = (pos < len(self.sketches)) & (sketches != 0)
        hit[hit] = self.sketches[pos[hit]] == sketches[hit]
        hits = np.flatnonzero(hit)
        if not len(hits):
            return
        digests = row_digests(blocks.view(np.uint8), hits)
        first, stop = pos[hits], self._run_stop[pos[hits]]
        single = stop - first == 1  # the usual case: one guest page per sketch
        self._assign(first[single], digests[single], offsets[hits[single]], disk_id)
        for k in np.flatnonzero(~single).tolist():  # the same content several times in memory
            rows = np.arange(first[k], stop[k])
            self._assign(
                rows,
                np.broadcast_to(digests[k], (len(rows), DIGEST_SIZE)),
                np.full(len(rows), offsets[hits[k]]),
                disk_id,
            )

    def _assign(self, rows: np.ndarray, digests: np.ndarray, offsets: np.ndarray, disk_id: int) -> None:
        ok = (self.disk_ids[rows] < 0) & (self.digests[rows] == digests).all(axis=1)
        rows, offsets = rows[ok], offsets[ok]
        rows, first = np.unique(rows, return_index=True)  # first block (lowest offset) wins
        self.disk_ids[rows] = disk_id
        self.sectors[rows] = offsets[first] // DISK_SECTOR_SIZE

    def matches(self) -> Callable[[list, np.ndarray], Candidates]:
        """Step 3's lookup: runs (region id, first page, count) laid end to end -> their
        matched pages, by row of the batch."""
        found = np.flatnonzero(self.disk_ids >= 0)
        by_region = {}
        for region in distinct(self.regions[found]).tolist():
            rows = found[self.regions[found] == region]
            rows = rows[np.argsort(self.pages[rows])]
            by_region[region] = (
                self.pages[rows].astype(np.int64),
                self.disk_ids[rows],
                self.sectors[rows],
                self.digests[rows],
            )
        empty = (np.zeros(0, np.int64),) * 3 + (np.zeros((0, DIGEST_SIZE), np.uint8),)

        def candidates(runs: list, data: np.ndarray) -> Candidates:
            found, start = [], 0
            for region_id, first_page, count in runs:
                pages, disk_ids, sectors, digests = by_region.get(region_id, empty)
                lo, hi = np.searchsorted(pages, [first_page, first_page + count])
                found.append((pages[lo:hi] - first_page + start, disk_ids[lo:hi], sectors[lo:hi], digests[lo:hi]))
                start += count
            rows, disk_ids, sectors, digests = (np.concatenate(column) for column in zip(*found))
            return rows.astype(np.int64), disk_ids.astype(np.int64), sectors.astype(np.uint64), digests

        return candidates


def scan_disk(index: PageIndex, disk, disk_id: int, *, all_phases: bool = False, progress=None) -> int:
    """Step 2 for one disk: match its blocks against the index; returns bytes read."""
    read_bytes = 0
    for blocks, offsets in disk_blocks(disk, index.page_size, all_phases=all_phases, progress=progress):
        index.match_blocks(blocks, offsets, disk_id)
        read_bytes += blocks.nbytes
    return read_bytes


class BlockIndex:
    """Pages seen once: the disks' non-zero blocks by digest, the first block in scan order
    kept for each digest; ``lookup`` gives a batch's pages whose digest a block has."""

    def __init__(self, page_size: int):
        self.page_size = page_size
        self.scanned = self.looked_up = 0  # bytes of disk read, non-zero pages looked up
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    @staticmethod
    def fits(disks: dict[str, object], page_size: int, all_phases: bool = False) -> bool:
        """Whether the disks' blocks stay within MAX_INDEXED_BLOCKS (else: pages read twice)."""
        blocks = sum(scan_bytes(disk, page_size, all_phases) for disk in disks.values()) // page_size
        return blocks <= MAX_INDEXED_BLOCKS

    def add_disk(self, disk, disk_id: int, *, all_phases: bool = False, progress=None) -> None:
        """Index the disk's non-zero blocks: its chunks read and hashed on INDEX_THREADS
        threads (pread and the digests run without the GIL; the disk is read ahead while a
        chunk is hashed), gathered in scan order."""

        def digest_chunk(chunk: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
            at, length = chunk
            blocks = read_blocks(disk, self.page_size, at, length)
            keep = np.flatnonzero(nonzero_rows(blocks))
            digests = row_digests(blocks.view(np.uint8), keep).view(np.uint64)  # (n, 2): the digest's halves
            return digests, (at + self.page_size * keep) // DISK_SECTOR_SIZE

        chunks = scan_chunks(disk, self.page_size, all_phases)
        for (at, length), (digests, sectors) in in_order(digest_chunk, chunks, INDEX_THREADS):
            self._parts.append((digests, sectors, np.full(len(sectors), disk_id, np.int32)))
            self.scanned += length
            if progress:
                progress(length)

    def freeze(self) -> None:
        """Sort by digest (its first half), keeping the first block in scan order of each;
        ready for lookups."""
        parts = self._parts or [(np.zeros((0, 2), np.uint64), np.zeros(0, np.int64), np.zeros(0, np.int32))]
        self._parts = []
        digests, sectors, disk_ids = (np.concatenate(column) for column in zip(*parts))
        del parts  # (the parts are copied: let them go before the sort's copies are made)
        # by the first half (lookup searches by it), stable: scan order among equal digests
        order = np.argsort(digests[:, 0], kind="stable")
        digests = gather_rows(digests, order)
        first = np.ones(len(order), bool)
        first[1:] = (digests[1:] != digests[:-1]).any(axis=1)
        keep = order[first]
        self.digests, self.sectors, self.disk_ids = digests[first], sectors[keep], disk_ids[keep]

    def lookup(self, runs: list, pages: np.ndarray) -> Candidates:
        """The rows of ``pages`` (a batch of DiskPages: any runs) whose digest a block has.
        Searched by the digest's first half: two blocks that share it (a 64-bit coincidence)
        can only leave a page stored."""
        nonzero = np.flatnonzero(nonzero_rows(pages))
        self.looked_up += len(nonzero)
        digests = row_digests(pages, nonzero).view(np.uint64)
        pos = np.searchsorted(self.digests[:, 0], digests[:, 0])
        hit = pos < len(self.digests)
        hit[hit] = (self.digests[pos[hit]] == digests[hit]).all(axis=1)
        rows, at = nonzero[hit], pos[hit]
        return rows, self.disk_ids[at], self.sectors[at], digests[hit].view(np.uint8)


@dataclass
class DiskPages:
    """A page sink: the pages ``found`` names a block for (a block with the page's digest)
    become DISK references, the rest go to ``inner`` in the order given. Runs are gathered into
    batches of BATCH_PAGES (copied into one reused buffer: the caller may reuse its own) so that
    the lookups, ``inner`` and put_disks work on many pages at once (``inner`` once for each
    stretch of runs of one region: the pages between DISK pages come with gaps); a run larger
    than a batch is a batch of its own, looked up where it lies. ``flush`` writes what is
    gathered (the converter calls it after the last page)."""

    writer: LeanImageWriter
    found: Callable[[list, np.ndarray], Candidates]  # PageIndex.matches() or BlockIndex.lookup
    inner: Callable | None = None  # put_pages_at(region_id, page numbers, rows), set by the converter
    counts: dict[int, int] = field(default_factory=dict)  # disk id -> DISK pages written
    _batch: list = field(default_factory=list)  # (region id, first page, count) gathered
    _buffer: np.ndarray | None = None  # (BATCH_PAGES, page size) uint8: the gathered pages
    _gathered: int = 0

    def put(self, region_id: int, first_page: int, data) -> None:
        ps = self.writer.page_size
        rows = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
        rows = rows.reshape(-1, ps)
        if self._gathered + len(rows) > BATCH_PAGES:
            self.flush()
        if len(rows) > BATCH_PAGES:
            self._write([(region_id, first_page, len(rows))], np.ascontiguousarray(rows, np.uint8))
            return
        if self._buffer is None:
            self._buffer = np.empty((BATCH_PAGES, ps), np.uint8)
        self._buffer[self._gathered : self._gathered + len(rows)] = rows
        self._batch.append((region_id, first_page, len(rows)))
        self._gathered += len(rows)

    def flush(self) -> None:
        if self._batch:
            assert self._buffer is not None  # (allocated by the first put)
            self._write(self._batch, self._buffer[: self._gathered])
        self._batch, self._gathered = [], 0

    def _write(self, runs: list, pages: np.ndarray) -> None:
        """The batch ``runs`` (region id, first page, count), laid end to end in ``pages``."""
        assert self.inner is not None  # (set by the converter before any page)
        rows, disk_ids, sectors, digests = self.found(runs, pages)
        is_disk = np.zeros(len(pages), bool)
        is_disk[rows] = True
        region_of_row = np.repeat([r for r, _, _ in runs], [count for _, _, count in runs])
        page_of_row = np.concatenate([first + np.arange(count) for _, first, count in runs])
        for start, stop in stretches(region_of_row):
            kept = start + np.flatnonzero(~is_disk[start:stop])
            if len(kept):
                self.inner(int(region_of_row[start]), page_of_row[kept], gather_rows(pages, kept))
        for region_id in distinct(region_of_row[rows]).tolist():
            mine = np.flatnonzero(region_of_row[rows] == region_id)
            self.writer.put_disks(region_id, page_of_row[rows[mine]], disk_ids[mine], sectors[mine], digests[mine])
        for disk_id, n in zip(*np.unique(disk_ids, return_counts=True)):
            self.counts[int(disk_id)] = self.counts.get(int(disk_id), 0) + int(n)


@dataclass
class DiskSummary:
    """What the disk classification did: DISK pages per disk name, bytes scanned."""

    pages: dict[str, int]
    scanned_bytes: int
    indexed_pages: int
    page_size: int


def classify_by_disks(
    writer: LeanImageWriter, disks: dict[str, object], feed, sink_with, *, all_phases: bool = False, progress=None
) -> DiskSummary:
    """Write the guest's pages through the three steps: ``sink_with(disk_pages)`` is the sink
    with step 3's DiskPages where the converter wants it (its ``inner`` set: where pages on no
    disk go).

    ``feed(sink)`` calls ``sink(region id, first page, data)`` for every run of pages of the
    guest, each page once; it is called twice (the converter re-reads its source or spool).
    """
    index = PageIndex(writer.page_size)
    feed(index.add)
    index.freeze()
    scanned = 0
    for name, disk in disks.items():
        scanned += scan_disk(index, disk, writer.disk_id(name), all_phases=all_phases, progress=progress)
    sink = DiskPages(writer, index.matches())
    feed(sink_with(sink))
    sink.flush()
    return _summary(writer, disks, sink, scanned, len(index.sketches))


class StreamedDiskPages:
    """Pages seen once (a QEMU stream read as it comes): the disks are indexed first
    (BlockIndex), then ``sink`` (a DiskPages, its ``inner`` set by the converter) writes each
    run's pages found on them as DISK references; ``summary()`` at the end."""

    def __init__(self, writer: LeanImageWriter, disks: dict[str, object], *, all_phases=False, progress=None):
        self.writer, self.disks = writer, disks
        self.index = BlockIndex(writer.page_size)
        for name, disk in disks.items():
            self.index.add_disk(disk, writer.disk_id(name), all_phases=all_phases, progress=progress)
        self.index.freeze()
        self.sink = DiskPages(writer, self.index.lookup)

    def summary(self) -> DiskSummary:
        return _summary(self.writer, self.disks, self.sink, self.index.scanned, self.index.looked_up)


def _summary(writer: LeanImageWriter, disks: dict, sink: DiskPages, scanned: int, indexed: int) -> DiskSummary:
    names = {writer.disk_id(name): name for name in disks}
    return DiskSummary({names[i]: n for i, n in sink.counts.items()}, scanned, indexed, writer.page_size)


def declare_disks(writer: LeanImageWriter, disks: dict[str, object]) -> None:
    """Add each disk to the image's disk table with its size and identity fingerprint."""
    for name, disk in disks.items():
        writer.add_disk(name, disk.size, disk.fingerprint())
