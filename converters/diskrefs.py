"""Pages that duplicate the VM's disk become DISK references (spec §6.4), for any converter.

Three steps, memory bounded by the number of guest pages, each disk read once:

1. ``PageIndex.add`` over the guest's pages: a 64-bit sketch (computed with numpy over every
   page at once) and the xxh3-128 digest of every non-zero page.
2. ``scan_disk``: stream the disk's data ranges (holes and unallocated clusters skipped) at
   each partition's phase, sketch every page-sized block the same way, and hash only the
   blocks whose sketch a guest page has; a digest match records (disk, sector) for the page.
3. ``DiskPages.put`` over the guest's pages again: a matched page is compared byte for byte
   with the disk before it becomes a DISK reference; anything else goes to the next sink.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from leanimg.arrays import distinct
from leanimg.disks.partitions import aligned_ranges, scan_segments
from leanimg.format import DIGEST_SIZE, DISK_SECTOR_SIZE, row_digests
from leanimg.writer import LeanImageWriter

SCAN_CHUNK = 8 << 20
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


@dataclass
class DiskMatches:
    """The matched pages of one region, sorted by page."""

    pages: np.ndarray
    disk_ids: np.ndarray
    sectors: np.ndarray
    digests: np.ndarray


class PageIndex:
    """Step 1 and 2: the guest's non-zero pages by sketch, and the disk blocks they match."""

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

    def matches(self) -> dict[int, DiskMatches]:
        """Per region id, the matched pages sorted by page."""
        found = np.flatnonzero(self.disk_ids >= 0)
        out = {}
        for region in distinct(self.regions[found]).tolist():
            rows = found[self.regions[found] == region]
            rows = rows[np.argsort(self.pages[rows])]
            out[region] = DiskMatches(
                self.pages[rows].astype(np.int64), self.disk_ids[rows], self.sectors[rows], self.digests[rows]
            )
        return out


def scan_disk(index: PageIndex, disk, disk_id: int, *, all_phases: bool = False, progress=None) -> int:
    """Step 2 for one disk: match its blocks against the index; returns bytes read."""
    ps, read_bytes = index.page_size, 0
    ranges = disk.data_ranges()
    for start, end, phase in scan_segments(disk, ps, all_phases):
        for lo, hi in aligned_ranges(ranges, start, end, phase, ps):
            for at in range(lo, hi, SCAN_CHUNK):
                length = min(SCAN_CHUNK, hi - at)
                data = disk.read(at, length)
                blocks = np.frombuffer(data, np.uint64).reshape(-1, ps // 8)
                index.match_blocks(blocks, at + ps * np.arange(len(blocks), dtype=np.int64), disk_id)
                read_bytes += length
                if progress:
                    progress(length)
    return read_bytes


@dataclass
class DiskPages:
    """Step 3: a page sink that writes matched pages as DISK references, the rest to ``inner``."""

    writer: LeanImageWriter
    matches: dict[int, DiskMatches]
    disks: dict[int, object]  # disk id -> DiskSource
    inner: object  # put_data(region_id, first_page, data)
    counts: dict[int, int] = field(default_factory=dict)  # disk id -> DISK pages written

    def put(self, region_id: int, first_page: int, data) -> None:
        ps = self.writer.page_size
        data = memoryview(data).cast("B")
        count = len(data) // ps
        found = self.matches.get(region_id)
        lo, hi = np.searchsorted(found.pages, [first_page, first_page + count]) if found else (0, 0)
        if lo == hi:
            self.inner(region_id, first_page, data)
            return
        rows = found.pages[lo:hi] - first_page
        confirmed = self._confirm(data, rows, found.disk_ids[lo:hi], found.sectors[lo:hi])
        is_disk = np.zeros(count, bool)
        is_disk[rows[confirmed]] = True
        for a, b, on_disk in _runs(is_disk):
            if not on_disk:
                self.inner(region_id, first_page + a, data[a * ps : b * ps])
        ids = found.disk_ids[lo:hi][confirmed]
        self.writer.put_disks(
            region_id,
            first_page + rows[confirmed],
            ids,
            found.sectors[lo:hi][confirmed],
            found.digests[lo:hi][confirmed],
        )
        for disk_id, n in zip(*np.unique(ids, return_counts=True)):
            self.counts[int(disk_id)] = self.counts.get(int(disk_id), 0) + int(n)

    def _confirm(self, data, rows, disk_ids, sectors) -> np.ndarray:
        """Byte comparison of each matched page with its disk block (read sorted)."""
        ps = self.writer.page_size
        pages = np.frombuffer(data, np.uint8).reshape(-1, ps)
        ok = np.zeros(len(rows), bool)
        for disk_id in distinct(disk_ids).tolist():
            mine = np.flatnonzero(disk_ids == disk_id)
            on_disk = self.disks[disk_id].read_runs(sectors[mine].astype(np.int64) * DISK_SECTOR_SIZE, ps)
            ok[mine] = (on_disk == pages[rows[mine]]).all(axis=1)
        return ok


def _runs(flags: np.ndarray):
    edges = np.flatnonzero(np.diff(flags.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(flags)]
    for a, b in zip(bounds, bounds[1:]):
        yield a, b, bool(flags[a])


@dataclass
class DiskSummary:
    """What the disk classification did: DISK pages per disk name, bytes scanned."""

    pages: dict[str, int]
    scanned_bytes: int
    indexed_pages: int
    page_size: int


def classify_by_disks(
    writer: LeanImageWriter, disks: dict[str, object], feed, put_data, *, all_phases: bool = False, progress=None
) -> DiskSummary:
    """Write the guest's pages through the three steps; pages on no disk go to ``put_data``.

    ``feed(sink)`` calls ``sink(region id, first page, data)`` for every run of pages of the
    guest, each page once; it is called twice (the converter re-reads its source or spool).
    """
    index = PageIndex(writer.page_size)
    feed(index.add)
    index.freeze()
    by_id, scanned = {}, 0
    for name, disk in disks.items():
        disk_id = writer.disk_id(name)
        by_id[disk_id] = disk
        scanned += scan_disk(index, disk, disk_id, all_phases=all_phases, progress=progress)
    sink = DiskPages(writer, index.matches(), by_id, put_data)
    feed(sink.put)
    names = {writer.disk_id(name): name for name in disks}
    return DiskSummary({names[i]: n for i, n in sink.counts.items()}, scanned, len(index.sketches), writer.page_size)


def declare_disks(writer: LeanImageWriter, disks: dict[str, object]) -> None:
    """Add each disk to the image's disk table with its size and identity fingerprint."""
    for name, disk in disks.items():
        writer.add_disk(name, disk.size, disk.fingerprint())
