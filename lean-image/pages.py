"""Resolving the pages of an image (spec §6.6, §10.2, §11): which class and slot a page has,
its bytes from a frame, a disk or the parent chain, checked against its digest, one page at a
time or a whole range (region_bytes into one buffer, region_pieces as views of the frames for
restores that write without copying).
"""

from __future__ import annotations

import numpy as np

from . import checks
from .arrays import distinct
from .checks import first_problem
from .digests import verify_page, verify_rows
from .errors import DiskNotGiven, LeanImageError
from .format import DIGEST_SIZE, DISK_SECTOR_SIZE, SLOT_CLASSES, PageClass, row_digests
from .frames import DIRECT_FRAMES_MAX
from .tables import Region


def page_location(region: Region, page: int) -> tuple[int, int]:
    """(class, slot) of one page: binary search over the region's extents."""
    if not 0 <= page < region.num_pages:
        raise LeanImageError(f"page {page} outside region {region.name!r} of {region.num_pages} pages")
    i = int(np.searchsorted(region.starts, page, side="right")) - 1
    extent = region.extents[i]
    cls = int(extent["page_class"])
    slot = int(extent["first_slot"]) + page - int(extent["first_page"]) if cls in SLOT_CLASSES else 0
    return cls, slot


def classes(region: Region, first_page: int = 0, count: int | None = None) -> np.ndarray:
    """Per-page class of a range of a region (uint8 array), from the extents it overlaps."""
    count = region.num_pages - first_page if count is None else count
    if count <= 0:
        return np.zeros(0, np.uint8)
    lo, hi = region.extent_span(first_page, count)
    e = region.extents[lo:hi]
    full = np.repeat(e["page_class"].astype(np.uint8), e["num_pages"].astype(np.int64))
    skip = first_page - int(region.starts[lo])
    return full[skip : skip + count]


def page_slots(region: Region, first_page: int, count: int) -> np.ndarray:
    """Per page of a range, its slot (stored ordinal, disk reference or delta entry index;
    meaningless for classes without slots)."""
    if count <= 0:
        return np.zeros(0, np.int64)
    lo, hi = region.extent_span(first_page, count)
    e = region.extents[lo:hi]
    sizes = e["num_pages"].astype(np.int64)
    skip = first_page - int(region.starts[lo])
    starts = np.repeat(e["first_slot"].astype(np.int64) - e["first_page"].astype(np.int64), sizes)
    return starts[skip : skip + count] + first_page + np.arange(count)


def read_page(image, region: Region, page: int) -> bytes:
    """One page, resolved through disks and the parent chain, checked against its digest."""
    cls, slot = page_location(region, page)
    if cls == PageClass.FREE:
        return bytes(image.page_size)
    if cls in (PageClass.PARENT, PageClass.DELTA):
        return bytes(region_bytes(image, region, page, 1))
    if cls == PageClass.ZERO:
        data = bytes(image.page_size)
    elif cls == PageClass.STORED:
        data = image.frames.stored_page(slot)
    else:
        out = np.zeros(image.page_size, np.uint8)
        fill_disk_pages(image, region, page, out, np.zeros(1, np.int64), np.array([slot], np.int64))
        return out.tobytes()
    verify_page(region, page, data, image.digests.expected(region, page))
    return data


def region_bytes(image, region: Region, first_page: int, count: int) -> memoryview:
    """Pages [first_page, first_page+count) resolved and verified, in one buffer."""
    if image.parent is not None:
        return _chained_region_bytes(image, region, first_page, count)
    ps = image.page_size
    out = np.zeros(count * ps, np.uint8)
    got = np.zeros((count, DIGEST_SIZE), np.uint8)
    cls, expected = image.digests.expected_range(region, first_page, count)
    slots = page_slots(region, first_page, count)
    stored = np.flatnonzero(cls == PageClass.STORED)
    for lo, hi in _runs(stored, slots):
        _copy_stored(image, out, got, int(stored[lo]), int(slots[stored[lo]]), hi - lo)
    disk = np.flatnonzero(cls == PageClass.DISK)
    if len(disk):
        fill_disk_pages(image, region, first_page, out, disk, slots[disk])
    verify_rows(region, first_page, stored, got, expected)
    return out.data


def _runs(rows: np.ndarray, slots: np.ndarray):
    """[lo, hi) runs of ``rows`` (indexes into ``slots``) whose rows and slots both ascend by one."""
    if not len(rows):
        return []
    breaks = np.flatnonzero((np.diff(rows) != 1) | (np.diff(slots[rows]) != 1)) + 1
    bounds = [0, *breaks.tolist(), len(rows)]
    return list(zip(bounds, bounds[1:]))


def _chained_region_bytes(image, region: Region, first_page: int, count: int) -> memoryview:
    """Through the chain resolved once per region (chain/): work per page independent of depth."""
    from .chain import check_built, fill

    out = np.zeros(count * image.page_size, np.uint8)
    fill(image.resolution(region), out, first_page, count)
    cls, expected = image.digests.expected_range(region, first_page, count)
    checked = np.flatnonzero((cls != PageClass.FREE) & (cls != PageClass.ZERO))
    check_built(image, region, first_page, out, checked, expected)
    return out.data


def _copy_stored(image, out: np.ndarray, got: np.ndarray | None, row: int, ordinal: int, count: int) -> None:
    """Copy STORED pages into ``out`` from row ``row``; with ``got``, their digests too."""
    ps = image.page_size
    for data, digests, start, n in image.frames.stored_spans(ordinal, count, with_digests=got is not None):
        out[row * ps : (row + n) * ps] = np.frombuffer(data, np.uint8, n * ps, start * ps)
        if got is not None:
            got[row : row + n] = digests[start : start + n]
        row += n


def region_pieces(image, region: Region, first_page: int, count: int) -> list[tuple[int, memoryview | None]]:
    """Pages [first_page, first_page+count) in order as verified runs ``(n, data)``: data
    None for ZERO and FREE pages, else n pages of bytes.  In a self-contained image the
    STORED runs are views of the decompressed frames (checked by the frames' digests), so a
    restorer can hand them to the kernel without copying them.  The views are valid until the
    next call on the same image (a chain builds its ranges in memory used again)."""
    if image.parent is not None:
        from .chain import pieces

        return pieces(image, region, image.resolution(region, deltas_ahead=first_page == 0), first_page, count)
    if count > 0 and blank_end(image, region, first_page) >= first_page + count:
        image.digests.table(region)  # the region's DIGESTS read and checked on first use, as for any range
        return [(count, None)]  # ZERO and FREE pages only: no content, nothing per page
    cls, expected = image.digests.expected_range(region, first_page, count)
    blank = (cls == PageClass.ZERO) | (cls == PageClass.FREE)
    if blank.all():
        return [(count, None)]
    slots = page_slots(region, first_page, count)
    if (~blank & (cls != PageClass.STORED)).any() or image.frames.frames_touched(slots[~blank]) > DIRECT_FRAMES_MAX:
        return _split_pieces(image, region_bytes(image, region, first_page, count), blank)
    starts = np.ones(count, bool)
    starts[1:] = (blank[1:] != blank[:-1]) | (~blank[1:] & (slots[1:] != slots[:-1] + 1))
    bounds = [*np.flatnonzero(starts).tolist(), count]
    runs: list[tuple[int, memoryview | None]] = []
    for lo, hi in zip(bounds, bounds[1:]):
        if blank[lo]:
            runs.append((hi - lo, None))
            continue
        row = lo
        for data, digests, start, n in image.frames.stored_spans(int(slots[lo]), hi - lo):
            verify_rows(region, first_page + row, None, digests[start : start + n], expected[row : row + n])
            runs.append((n, memoryview(data)[start * image.page_size : (start + n) * image.page_size]))
            row += n
    return runs


def blank_end(image, region: Region, page: int) -> int:
    """Where the run of ZERO and FREE pages from ``page`` ends in a self-contained image
    (``page`` itself when that page is neither, or the image has a parent: its PARENT pages
    resolve through the chain). Work per extent of the run, not per page."""
    if image.parent is not None or not 0 <= page < region.num_pages:
        return page
    i = int(np.searchsorted(region.starts, page, side="right")) - 1
    return max(page, int(region.blank_ends[i]))


def region_windows(image, region: Region, step: int):
    """(first_page, count) windows covering ``region`` in order, for a sequential restore
    calling region_pieces on each: ``step`` pages each, except that a run of ZERO and FREE
    pages longer than ``step`` in a self-contained image is one window of its own, so a guest
    of mostly blank pages costs work per extent, not per page."""
    runs = _blank_runs(image, region, step)
    done = 0
    for start, stop in runs:
        for first in range(done, start, step):
            yield first, min(step, start - first)
        yield start, stop - start
        done = stop
    for first in range(done, region.num_pages, step):
        yield first, min(step, region.num_pages - first)


def _blank_runs(image, region: Region, longer_than: int) -> list[tuple[int, int]]:
    """[start, stop) of the runs of ZERO and FREE extents of more than ``longer_than`` pages
    (none in an image with a parent)."""
    if image.parent is not None or not len(region.extents):
        return []
    ends = region.blank_ends
    first = np.ones(len(ends), bool)  # the extents that begin a blank run
    first[1:] = ends[1:] != ends[:-1]
    first &= ends > region.starts
    starts, stops = region.starts[first], ends[first]
    long = stops - starts > longer_than
    return list(zip(starts[long].tolist(), stops[long].tolist()))


def _split_pieces(image, data: memoryview, blank: np.ndarray) -> list[tuple[int, memoryview | None]]:
    edges = np.flatnonzero(blank[1:] != blank[:-1]) + 1
    bounds = [0, *edges.tolist(), len(blank)]
    ps = image.page_size
    return [(hi - lo, None if blank[lo] else data[lo * ps : hi * ps]) for lo, hi in zip(bounds, bounds[1:])]


def fill_disk_pages(
    image, region: Region, first_page: int, out: np.ndarray, rows: np.ndarray, slots: np.ndarray
) -> None:
    """Pages ``first_page + rows`` (DISK, references ``slots``) into ``out``, each checked
    against its digest; with sort_blocks every disk's blocks are read in ascending physical
    order, neighbours coalesced, else one read per page in page order."""
    ps = image.page_size
    refs = image.tables.disk_refs
    ids, sectors = refs.disk_ids[slots], refs.sectors[slots].astype(np.int64)
    _, expected = image.digests.expected_range(region, first_page, int(rows.max()) + 1)
    pages = out.reshape(-1, ps)
    for disk_id in distinct(ids).tolist():
        mine = np.flatnonzero(ids == disk_id)
        source = _disk_source(image, region, first_page + int(rows[mine[0]]), disk_id)
        source.read_runs(sectors[mine] * DISK_SECTOR_SIZE, ps, sort=image.sort_blocks, out=pages, rows=rows[mine])
        first_problem(
            checks.disk_content_problems(
                region.region_id,
                region.name,
                first_page + rows[mine],
                row_digests(pages, rows[mine]),
                expected[rows[mine]],
                source.name,
                sectors[mine],
            )
        )


def _disk_source(image, region: Region, page: int, disk_id: int):
    source = image.disk_sources.get(disk_id)
    if source is None:
        info = next(d for d in image.disks if d.disk_id == disk_id)
        raise DiskNotGiven(
            f"region {region.name!r} page {page} is on disk {info.name!r}: pass --disk {info.name}=PATH",
            structure=f"disk {info.name!r}",
        )
    return source


def restore_chunk_pages(image) -> int:
    """Pages per region_bytes call for a sequential restore: larger for chains and images
    with disk references, whose cost per call grows with the links and disk reads a chunk
    draws on. A chain's pieces are built in one buffer of this size, touched fresh in each
    process (a 64 MiB one cost 7-60 ms of page faults on this project's VMs; 32 MiB
    restored the sparse bench chains 4-9 % faster, and 16 or 8 MiB no faster than 32)."""
    if image.parent is not None:
        return (32 << 20) // image.page_size
    return (64 << 20) // image.page_size if len(image.tables.disk_refs) else (4 << 20) // image.page_size


def gather_chunk_pages(image) -> int:
    """Pages per region_pieces call for a sequential restore: STORED pages come as views of
    frames (no buffer this size is allocated), and fewer, larger calls cost less per page."""
    return max(restore_chunk_pages(image), (32 << 20) // image.page_size)
