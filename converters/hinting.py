"""Hints applied while converting (spec/hints.md): FREE by the stream-offset rule, DISK
verified by content, UNCHANGED verified against the parent (or trusted, when asked).

A ``HintPlan`` holds the hints resolved to pages of the save's regions as numpy arrays (per
page: the latest stream offset of a FREE hint, the hinted disk block, whether a dirty log says
unchanged). The converters tell it where each page's last copy ends in the stream; it answers
which pages are FREE, verifies DISK hints in a page sink, and at the end handles the pages the
stream never sent and counts what it applied and ignored.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from leanimg.arrays import distinct
from leanimg.format import DISK_SECTOR_SIZE, PageClass, row_digests
from leanimg.hints import Guest, HintError, Hints, RecordType, check_against, read_hints, resolve
from leanimg.rules import implements
from leanimg.writer import LeanImageWriter


@dataclass
class HintOptions:
    """``convert --hints``: the hints, how far to trust them, and what came of them
    (``report``, set by the conversion).

    ``source`` is a path, bytes, a binary stream, a read ``Hints``, or a callable returning one
    of those: a producer that writes hints while the save stream flows (``leanimg checkpoint``)
    passes a callable, which is called only once the converter needs the hints (the spooled
    QEMU path and the Xen path: after the whole stream was read)."""

    source: object
    trust_dirty_log: bool = False
    hints: Hints | None = None
    report: dict | None = None

    @property
    def deferred(self) -> bool:
        return callable(self.source) and self.hints is None

    def load(self) -> Hints:
        if self.hints is None:
            source = self.source() if callable(self.source) else self.source
            self.hints = source if isinstance(source, Hints) else read_hints(source)
        return self.hints

    @property
    def has_disk_hints(self) -> bool:
        return bool(self.load().of_kind(RecordType.DISK))


@dataclass
class _RegionHints:
    region_id: int
    name: str
    num_pages: int
    free_until: np.ndarray | None = None  # int64: latest stream_offset of a FREE hint, -1 none
    disk_index: np.ndarray | None = None  # int16: index in HintPlan.disk_names, -1 none
    disk_sector: np.ndarray | None = None  # uint64
    unchanged: np.ndarray | None = None  # bool
    last_end: np.ndarray = field(default=None)  # int64: where the page's last copy ends, -1 never sent
    made_free: np.ndarray | None = None  # bool: FREE because of a hint
    skipped: np.ndarray | None = None  # bool: pages the feed must not hand on


class HintPlan:
    """The hints of one conversion. ``regions``: region name -> (region id, pages)."""

    def __init__(
        self,
        options: HintOptions,
        writer: LeanImageWriter,
        source: str,
        regions: dict,
        disks: dict,
        parent=None,
        stream_length: int | None = None,
    ):
        self.options, self.writer, self.parent = options, writer, parent
        self.hints = options.load()
        self.guest = Guest(
            writer.page_size,
            source,
            {name: pages for name, (_, pages) in regions.items()},
            stream_length,
            {name: disk.size for name, disk in disks.items()},
            parent.header.image_uuid if parent is not None else None,
        )
        resolved = resolve(self.hints, self.guest)
        self.disks = disks
        self.disk_names = sorted({name for r in resolved if r.disks for name in r.disks})
        self.counts: dict[str, Counter] = {kind: Counter() for kind in ("FREE", "DISK", "UNCHANGED")}
        self.regions = {
            rid: _RegionHints(rid, name, pages, last_end=np.full(pages, -1, np.int64))
            for name, (rid, pages) in regions.items()
        }
        by_name = {r.name: r for r in self.regions.values()}
        for r in sorted(resolved, key=lambda r: (r.kind != RecordType.FREE, r.record.stream_offset)):
            self._mark(by_name[r.region], r)

    def _mark(self, region: _RegionHints, r) -> None:
        """FREE hints in ascending stream_offset (a later one overrides), DISK in file order."""
        n = region.num_pages
        if r.kind == RecordType.FREE:
            if region.free_until is None:
                region.free_until = np.full(n, -1, np.int64)
            for lo, count in zip(r.first.tolist(), r.count.tolist()):
                region.free_until[lo : lo + count] = r.record.stream_offset
        elif r.kind == RecordType.UNCHANGED:
            if region.unchanged is None:
                region.unchanged = np.zeros(n, bool)
            for lo, count in zip(r.first.tolist(), r.count.tolist()):
                region.unchanged[lo : lo + count] = True
        else:
            if region.disk_index is None:
                region.disk_index = np.full(n, -1, np.int16)
                region.disk_sector = np.zeros(n, np.uint64)
            step = self.writer.page_size // DISK_SECTOR_SIZE
            for lo, count, disk, sector in zip(r.first.tolist(), r.count.tolist(), r.disks, r.sectors.tolist()):
                region.disk_index[lo : lo + count] = self.disk_names.index(disk)
                region.disk_sector[lo : lo + count] = sector + step * np.arange(count, dtype=np.uint64)

    # -- FREE ---------------------------------------------------------------------------
    @implements("LI-HNT-023")
    def free_mask(self, region_id: int, first: int, ends: np.ndarray) -> np.ndarray:
        """Record that pages ``first..`` were sent with copies ending at ``ends``; return which of
        them a FREE hint makes FREE: those whose last copy ended at or before the hint's offset
        (ends never decrease for a page: a later copy ends later)."""
        region = self.regions[region_id]
        region.last_end[first : first + len(ends)] = ends
        if region.free_until is None:
            return np.zeros(len(ends), bool)
        return (ends >= 0) & (ends <= region.free_until[first : first + len(ends)])

    def free_pages(self, region_id: int, last_end: np.ndarray) -> np.ndarray:
        """For a converter that knows every page's last copy up front (spooled QEMU, Xen): the
        pages FREE by a hint, given to the writer now; the converter then skips them, and the
        pages hinted UNCHANGED that the stream never sent (``finish`` gives those)."""
        mask = self.free_mask(region_id, 0, last_end)
        for a, b, free in _runs(mask):
            if free:
                self.writer.put_free(region_id, a, b - a)
        region = self.regions[region_id]
        region.made_free = mask
        region.skipped = mask if region.unchanged is None else mask | (region.unchanged & (last_end < 0))
        return mask

    def skip_free(self, sink):
        """``sink`` without the pages ``free_pages`` took care of."""

        def put(region_id: int, first: int, data) -> None:
            mask = self.regions[region_id].skipped
            rows = _rows(data, self.writer.page_size)
            part = mask[first : first + len(rows)] if mask is not None else None
            if part is None or not part.any():
                sink(region_id, first, data)
                return
            for a, b, free in _runs(part):
                if not free:
                    sink(region_id, first + a, rows[a:b])

        return put

    # -- DISK ---------------------------------------------------------------------------
    def zero_pages(self, region_id: int, zeros: np.ndarray) -> np.ndarray:
        """Of the pages a converter knows to be zeros without reading them, those it may make ZERO
        now (not the ones ``skip_free`` would skip); their DISK hints are counted as for a zero
        page that passes through ``disk_sink``."""
        region = self.regions.get(region_id)
        if region is None:
            return zeros
        if region.skipped is not None:
            zeros = zeros & ~region.skipped
        if region.disk_index is not None:
            self.counts["DISK"]["ignored: content differs from the disk block (or a zero page)"] += int(
                (zeros & (region.disk_index >= 0)).sum()
            )
        return zeros

    def disk_sink(self, inner):
        """A page sink that makes verified DISK hints DISK references and hands the rest to
        ``inner``."""
        if not self.disk_names:
            return inner
        ids = np.array([self.writer.disk_id(name) for name in self.disk_names], np.int64)
        return lambda region_id, first, data: self._put_disk_hinted(ids, inner, region_id, first, data)

    @implements("LI-HNT-024")
    def _put_disk_hinted(self, ids, inner, region_id: int, first: int, data) -> None:
        region, ps = self.regions[region_id], self.writer.page_size
        rows = _rows(data, ps)
        index = region.disk_index[first : first + len(rows)] if region.disk_index is not None else None
        hinted = np.flatnonzero(index >= 0) if index is not None else np.zeros(0, np.int64)
        if not len(hinted):
            inner(region_id, first, data)
            return
        sectors = region.disk_sector[first + hinted]
        ok = rows[hinted].view(np.uint64).any(axis=1)  # a zero page stays ZERO
        for k in distinct(index[hinted]).tolist():
            mine = np.flatnonzero(index[hinted] == k)
            on_disk = self.disks[self.disk_names[k]].read_runs(sectors[mine].astype(np.int64) * DISK_SECTOR_SIZE, ps)
            ok[mine] &= (on_disk == rows[hinted[mine]]).all(axis=1)
        self.counts["DISK"]["applied"] += int(ok.sum())
        self.counts["DISK"]["ignored: content differs from the disk block (or a zero page)"] += int((~ok).sum())
        good = hinted[ok]
        is_disk = np.zeros(len(rows), bool)
        is_disk[good] = True
        for a, b, on_disk in _runs(is_disk):
            if not on_disk:
                inner(region_id, first + a, rows[a:b])
        self.writer.put_disks(
            region_id,
            first + good,
            ids[index[good]],
            sectors[ok],
            row_digests(np.ascontiguousarray(rows[good]), np.arange(len(good))),
        )

    # -- the end ------------------------------------------------------------------------
    def check_length(self, stream_length: int) -> None:
        """A converter that learns the stream's length only at its end checks the offsets then."""
        if self.guest.stream_length is None:
            self.guest.stream_length = stream_length
            for finding in check_against(self.hints, self.guest):
                raise finding

    def finish(self) -> dict:
        """Before the converter frees the pages never sent: UNCHANGED pages among them, then
        the counts. Returns the report (also in options.report)."""
        for region in self.regions.values():
            if region.unchanged is not None:
                self._unchanged(region)
            self._count(region)
        report = {kind: dict(counter) for kind, counter in self.counts.items() if counter}
        self.options.report = report
        return report

    @implements("LI-HNT-022")
    def _unchanged(self, region: _RegionHints) -> None:
        classes = self.writer.page_classes(region.region_id)
        absent = region.unchanged & (classes == 0)
        sent = region.unchanged & (classes != 0)
        self.counts["UNCHANGED"]["verified: PARENT"] += int((sent & (classes == PageClass.PARENT)).sum())
        self.counts["UNCHANGED"]["ignored: page changed (or classed otherwise)"] += int(
            (sent & (classes != PageClass.PARENT)).sum()
        )
        pages = np.flatnonzero(absent)
        if not len(pages):
            return
        if not self.options.trust_dirty_log:
            raise HintError(
                f"region {region.name!r}: page {int(pages[0])} (and {len(pages) - 1} more) is hinted "
                "UNCHANGED but the stream never sends it: its content cannot be checked; convert with "
                "--trust-dirty-log to take such pages from the parent",
                structure="UNCHANGED",
                rule="LI-HNT-022",
            )
        parent_region = next((r for r in self.parent.regions if r.name == region.name), None)
        if parent_region is None or int(pages[-1]) >= parent_region.num_pages:
            raise HintError(
                f"region {region.name!r}: page {int(pages[-1])} is hinted UNCHANGED but the parent has no such page",
                structure="UNCHANGED",
                rule="LI-HNT-022",
            )
        for a, b, on in _runs(absent):
            if on:
                self._take_from_parent(region.region_id, parent_region, a, b - a)
        self.counts["UNCHANGED"]["applied on trust (not in the stream): from the parent"] += len(pages)

    def _take_from_parent(self, region_id: int, parent_region, first: int, count: int) -> None:
        classes, digests = self.parent.digests.expected_range(parent_region, first, count)
        kind = np.where(classes == PageClass.FREE, 0, np.where(classes == PageClass.ZERO, 1, 2))
        for a, b in _kind_runs(kind):
            if kind[a] == 0:
                self.writer.put_free(region_id, first + a, b - a)
            elif kind[a] == 1:
                self.writer.put_zero(region_id, first + a, b - a)
            else:
                self.writer.put_parent(region_id, first + a, digests[a:b].tobytes())

    def _count(self, region: _RegionHints) -> None:
        sent = region.last_end >= 0
        if region.free_until is not None:
            hinted = region.free_until >= 0
            free = self.counts["FREE"]
            made = (
                region.made_free
                if region.made_free is not None
                else hinted & sent & (region.last_end <= region.free_until)
            )
            free["applied"] += int((hinted & made).sum())
            free["ignored: defeated by a later copy"] += int((hinted & sent & ~made).sum())
            free["not in the stream (FREE anyway)"] += int((hinted & ~sent).sum())
        if region.disk_index is not None:
            self.counts["DISK"]["ignored: page not in the stream or FREE"] += int(
                (
                    (region.disk_index >= 0) & (~sent | (region.made_free if region.made_free is not None else False))
                ).sum()
            )


def _rows(data, page_size: int) -> np.ndarray:
    if isinstance(data, np.ndarray) and data.ndim == 2:
        return data
    return np.frombuffer(memoryview(data).cast("B"), np.uint8).reshape(-1, page_size)


def _runs(flags: np.ndarray):
    """(start, stop, flag) of the runs of equal values of a bool array."""
    for a, b in _kind_runs(flags.astype(np.int8)):
        yield a, b, bool(flags[a])


def _kind_runs(values: np.ndarray):
    if not len(values):
        return
    edges = np.flatnonzero(np.diff(values)) + 1
    bounds = [0, *edges.tolist(), len(values)]
    yield from zip(bounds, bounds[1:])


def guest_of_save(source_format: str, path: str) -> Guest:
    """What hints for the save file ``path`` are checked against: its regions and length (one
    pass over the stream)."""
    from . import libvirt, qemu, xen

    with open(path, "rb") as f:
        if source_format == "libvirt":  # hints count offsets in its QEMU stream, the payload
            f = libvirt.open_payload(f, libvirt.read_save_header(f, libvirt.file_size(f)))
        if source_format == "xen":
            result = xen.scan(f)
            result.skeleton.close()
            return Guest(
                xen.PAGE_SIZE, "xen", {xen.REGION_NAME: max(result.num_pfns, 1)}, result.length, parent_known=False
            )
        regions, page_size = {}, 4096
        for event in qemu.read_qemu_stream(f, batch=True):
            if isinstance(event, qemu.RamBlocks):
                page_size = event.page_size
                regions = {b.name: b.length // page_size for b in event.blocks}
            elif isinstance(event, qemu.StreamEnd):
                return Guest(page_size, "qemu", regions, event.length, parent_known=False)
    raise AssertionError("read_qemu_stream ended without StreamEnd")
