"""Resolving a region of a chained image once, so the work per page does not grow with depth.

A page of link 0 (the image restored) may be PARENT in several links before one holds
its bytes (the *base*), and links above the base may add DELTA entries. Walking the
chain page by page costs O(depth) per page. Instead the links are folded once, from
the root to link 0, into per-page arrays: which link holds the base, its class and slot,
and the list of (page, link, delta slot) to apply above it. Restoring then reads each
base once and applies each relevant delta once; the result is checked against link 0's
digest, which covers the whole path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .digests import verify_rows
from .errors import ChainError, LeanImageError
from .format import DIGEST_SIZE, IS_CONCRETE, PageClass, page_items, row_digests, zero_page_digest
from . import pages as page_module
from .rules import implements


@dataclass
class Resolution:
    links: list                 # [link 0, link 1, ...] LeanImage objects
    regions: list               # the region of the same name in each link (None past its end)
    base_link: np.ndarray       # per page: index of the link holding the base bytes
    base_class: np.ndarray      # per page: class of the base (STORED, ZERO, FREE, DISK)
    base_slot: np.ndarray       # per page: slot of the base in its link
    delta_pages: np.ndarray     # delta entries to apply, sorted by page then deepest link first
    delta_links: np.ndarray
    delta_slots: np.ndarray
    digest_link: np.ndarray     # per page: the nearest link whose own digest is the page's (spec §10.2)


@implements("LI-CHN-004")
def resolve(image, region) -> Resolution:
    """Fold the chain of ``image`` for ``region`` into a Resolution. Each link is read from
    its extents, and only its non-PARENT pages are touched: the fold costs the base's pages
    plus each link's changed pages, not depth x pages."""
    links = image.chain()
    regions = [region] + [_same_region(link, region) for link in links[1:]]
    n = region.num_pages
    base_link = np.full(n, -1, np.int32)
    base_class = np.zeros(n, np.uint8)
    base_slot = np.zeros(n, np.int64)
    digest_link = np.full(n, -1, np.int32)
    deltas = []
    for depth in range(len(links) - 1, -1, -1):
        r = regions[depth]
        if r is None:
            continue
        pages, classes, slots = _own_pages(r, n)
        concrete = IS_CONCRETE[classes]
        idx = pages[concrete]
        base_link[idx] = depth
        base_class[idx] = classes[concrete]
        base_slot[idx] = slots[concrete]
        if links[depth].digests.inherits:
            digest_link[pages] = depth
        else:
            digest_link[:min(n, r.num_pages)] = depth       # 1.0: a PARENT page has its own digest
        is_delta = classes == PageClass.DELTA
        if is_delta.any():
            deltas.append((pages[is_delta], np.full(int(is_delta.sum()), depth, np.int32), slots[is_delta]))
    unresolved = np.flatnonzero(base_link < 0)
    if len(unresolved):
        page = int(unresolved[0])
        raise ChainError(f"region {region.name!r} page {page} has no base in any link of the chain "
                         f"({len(links)} links)", rule="LI-CHN-004", structure=f"region[{region.region_id}]")
    if deltas:
        pages = np.concatenate([d[0] for d in deltas])
        dlinks = np.concatenate([d[1] for d in deltas])
        dslots = np.concatenate([d[2] for d in deltas])
        keep = dlinks < base_link[pages]               # only deltas above the base apply
        pages, dlinks, dslots = pages[keep], dlinks[keep], dslots[keep]
        order = np.lexsort((-dlinks, pages))           # by page, deepest link first
        pages, dlinks, dslots = pages[order], dlinks[order], dslots[order]
    else:
        pages = dlinks = dslots = np.zeros(0, np.int64)
    return Resolution(links, regions, base_link, base_class, base_slot, pages, dlinks, dslots, digest_link)


def _own_pages(region, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(page, class, slot) of every page of ``region`` below ``limit`` that is not PARENT, from
    its extents: as many entries as the link holds pages of its own."""
    e = region.extents
    mine = np.flatnonzero((e["page_class"] != PageClass.PARENT) & (region.starts < limit))
    starts = region.starts[mine]
    counts = np.minimum(e["num_pages"][mine].astype(np.int64), limit - starts)
    total = int(counts.sum())
    within = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    pages = np.repeat(starts, counts) + within
    classes = np.repeat(e["page_class"][mine].astype(np.uint8), counts)
    slots = np.repeat(e["first_slot"][mine].astype(np.int64), counts) + within
    return pages, classes, slots


def _same_region(link, region):
    for r in link.regions:
        if r.name == region.name:
            return r
    return None


def fill(resolution: Resolution, out: np.ndarray, first_page: int, count: int,
         want: np.ndarray | None = None, window: "_FrameWindow | None" = None) -> None:
    """Write pages [first_page, first_page+count) of the resolved region into ``out``; with
    ``want`` (a mask over the range; it must include every page with deltas) only those."""
    from .delta import apply as apply_delta
    ps = resolution.links[0].page_size
    stop = first_page + count
    links = resolution.base_link[first_page:stop]
    classes = resolution.base_class[first_page:stop]
    slots = resolution.base_slot[first_page:stop]
    want = np.ones(count, bool) if want is None else want
    if window is None:
        window = _FrameWindow(resolution.links[0].frames.pool, fill_frames(resolution, first_page, count, want)
                              + fill_delta_frames(resolution, first_page, count))
    for link_index in np.unique(links[want & ((classes == PageClass.STORED) | (classes == PageClass.DISK))]):
        link = resolution.links[int(link_index)]
        mine = want & (links == link_index)
        for cls in (PageClass.STORED, PageClass.DISK):
            rows = np.flatnonzero(mine & (classes == cls))
            if not len(rows):
                continue
            if cls == PageClass.STORED:
                _copy_runs(link, out, rows, slots[rows], ps, window)
            else:
                link.fill_disk_pages(resolution.regions[int(link_index)], first_page, out, rows,
                                     slots[rows].astype(np.int64))
    lo, hi = (int(x) for x in np.searchsorted(resolution.delta_pages, [first_page, stop]))
    pages = resolution.delta_pages[lo:hi]
    links_of = resolution.delta_links[lo:hi]
    slots_of = resolution.delta_slots[lo:hi]
    words = out.view("<u8")
    for link_index in sorted(np.unique(links_of).tolist(), reverse=True):     # deepest first
        mine = links_of == link_index
        _apply_link_deltas(resolution.links[link_index], words, out, pages[mine] - first_page,
                           slots_of[mine], ps, apply_delta, window)


def _apply_link_deltas(link, words, out, rows, slots, ps, apply_delta, window) -> None:
    """One link's deltas (at most one per page): INDEX_LIST entries parsed per frame with
    numpy and applied in one scatter; any other entry through the fully checked path."""
    frames = link.frames.delta_frames.frame_of(slots)     # every slot has one (checked at open)
    for frame in np.unique(frames).tolist():
        window.step()
        sel = frames == frame
        first, content, offsets, (simple, word_start, num_words, positions, values) = \
            link.frames.delta_frame_parsed(frame)
        k = slots[sel] - first
        frame_rows = rows[sel]
        fast = simple[k]
        counts = num_words[k[fast]]
        at = np.repeat(word_start[k[fast]] - np.concatenate(([0], np.cumsum(counts)[:-1])), counts) + \
            np.arange(int(counts.sum()))
        words[np.repeat(frame_rows[fast] * (ps // 8), counts) + positions[at]] = values[at]
        for row, entry_index in zip(frame_rows[~fast].tolist(), k[~fast].tolist()):
            entry = content[offsets[entry_index]:offsets[entry_index + 1]]
            offset, path = link.frames.delta_frame_location(frame)
            try:
                page = apply_delta(entry, out[row * ps:(row + 1) * ps].tobytes(), offset=offset,
                                   structure=f"{path}.entries[{entry_index}]")
            except LeanImageError as exc:
                exc.path = exc.path or link.path
                exc.args = (str(exc),)
                raise
            out[row * ps:(row + 1) * ps] = np.frombuffer(page, np.uint8)


class _FrameWindow:
    """Frames (link, frame, with digests) in the order they will be read; the next AHEAD of
    them are decompressed on the read-ahead workers meanwhile (so decompression runs on all
    cores, not link after link on the caller's thread), never more at once."""

    AHEAD = 8

    def __init__(self, pool, order: list):
        self.pool = pool
        self.pending = list(reversed(order)) if pool is not None else []
        self.step(self.AHEAD)

    def step(self, count: int = 1) -> None:
        """One more frame (or ``count``) handed to the workers."""
        while count and self.pending:
            link, frame, with_digests = self.pending.pop()
            if with_digests is DELTAS:
                link.frames.prefetch_deltas([frame], self.pool)
            else:
                link.frames.prefetch([frame], self.pool, with_digests)
            count -= 1


DELTAS = "deltas"       # a _FrameWindow item that is a DELTA_FRAME, parsed ahead


def fill_delta_frames(resolution: Resolution, first_page: int, count: int) -> list:
    """The DELTA_FRAMEs fill applies for a range, in its order (deepest link first)."""
    lo, hi = (int(x) for x in np.searchsorted(resolution.delta_pages, [first_page, first_page + count]))
    links_of, slots_of = resolution.delta_links[lo:hi], resolution.delta_slots[lo:hi]
    order = []
    for link_index in sorted(np.unique(links_of).tolist(), reverse=True):
        link = resolution.links[link_index]
        frames = np.unique(link.frames.delta_frames.frame_of(slots_of[links_of == link_index]))
        order += [(link, f, DELTAS) for f in frames.tolist()]
    return order


def fill_frames(resolution: Resolution, first_page: int, count: int, want: np.ndarray) -> list:
    """The STORED frames fill reads for the wanted pages of a range, in its order."""
    stop = first_page + count
    links = resolution.base_link[first_page:stop]
    stored = want & (resolution.base_class[first_page:stop] == PageClass.STORED)
    slots = resolution.base_slot[first_page:stop]
    order = []
    for link_index in np.unique(links[stored]).tolist():
        link = resolution.links[link_index]
        frames = np.unique(link.frames.page_frames.frame_of(slots[stored & (links == link_index)]))
        order += [(link, f, False) for f in frames.tolist()]
    return order


def _copy_runs(link, out: np.ndarray, rows: np.ndarray, slots: np.ndarray, ps: int, window: _FrameWindow) -> None:
    """Copy STORED pages of one link: one decompressed frame and one numpy copy per frame."""
    starts = link.frames.page_frames.starts
    frames = link.frames.page_frames.frame_of(slots)     # every slot has one (checked at open)
    pages = out.view(page_items(ps))
    for frame in np.unique(frames).tolist():
        window.step()
        sel = frames == frame
        content = np.frombuffer(link.frames.frame_pages(frame), page_items(ps))
        pages[rows[sel]] = content[slots[sel] - starts[frame]]


def pieces(image, region, resolution: Resolution, first_page: int, count: int) -> list:
    """Pages [first_page, first_page+count) of link 0 as verified ``(n, data)`` runs, like
    LeanImage.region_pieces: a page whose bytes are a STORED page of some link, with no delta
    above it, is a view of that link's decompressed frame (digested on the workers); pages
    with deltas or on a disk are built in one buffer (fill).  Every page is checked against
    link 0's digest, which covers the whole path."""
    ps = image.page_size
    stop = first_page + count
    links = resolution.base_link[first_page:stop]
    classes = resolution.base_class[first_page:stop]
    slots = resolution.base_slot[first_page:stop]
    lo, hi = (int(x) for x in np.searchsorted(resolution.delta_pages, [first_page, stop]))
    has_delta = np.zeros(count, bool)
    has_delta[resolution.delta_pages[lo:hi] - first_page] = True
    blank = ~has_delta & ((classes == PageClass.ZERO) | (classes == PageClass.FREE))
    frames = _direct_frames(resolution, links, slots, ~has_delta & (classes == PageClass.STORED))
    direct = frames >= 0
    built = ~blank & ~direct
    own, expected = image.digests.expected_range(region, first_page, count)
    checked = (own != PageClass.FREE) & (own != PageClass.ZERO)
    _check_blank(image, region, first_page, np.flatnonzero(blank & checked), expected)
    order = fill_frames(resolution, first_page, count, built) + fill_delta_frames(resolution, first_page, count) \
        if built.any() else []
    order += [(resolution.links[li], f, True) for li, f in _page_order_frames(links, frames)]
    window = _FrameWindow(resolution.links[0].frames.pool, order)
    out = None
    if built.any():
        out = np.zeros(count * ps, np.uint8)
        fill(resolution, out, first_page, count, want=built, window=window)
        check_built(image, region, first_page, out, np.flatnonzero(built & checked), expected)
    held = _hold_direct_frames(image, region, resolution, window, first_page, links, frames, slots,
                               checked, expected)
    kind = np.where(blank, 0, np.where(direct, 1, 2))
    starts = np.ones(count, bool)
    starts[1:] = (kind[1:] != kind[:-1]) | (direct[1:] & (
        (links[1:] != links[:-1]) | (frames[1:] != frames[:-1]) | (slots[1:] != slots[:-1] + 1)))
    bounds = [*np.flatnonzero(starts).tolist(), count]
    result = []
    for lo, hi in zip(bounds, bounds[1:]):
        if kind[lo] == 0:
            result.append((hi - lo, None))
        elif kind[lo] == 2:
            result.append((hi - lo, memoryview(out)[lo * ps:hi * ps]))
        else:
            content, first_ordinal = held[(int(links[lo]), int(frames[lo]))]
            start = int(slots[lo]) - first_ordinal
            result.append((hi - lo, content[start * ps:(start + hi - lo) * ps]))
    return result


def _hold_direct_frames(image, region, resolution, window, first_page, links, frames, slots, checked,
                        expected) -> dict:
    """Decompress the direct frames (in the order the pages need them), check every direct
    page's digest against link 0's at once; (link, frame) -> (content view, first ordinal)."""
    rows = np.flatnonzero(frames >= 0)
    got = np.zeros((len(links), DIGEST_SIZE), np.uint8)
    held = {}
    for link_index, frame in _page_order_frames(links, frames):
        link = resolution.links[link_index]
        window.step()
        content, digests = link.frames.frame(frame, with_digests=True)
        first_ordinal = int(link.frames.page_frames.starts[frame])
        held[(link_index, frame)] = (memoryview(content), first_ordinal)
        mine = rows[(links[rows] == link_index) & (frames[rows] == frame)]
        got[mine] = digests[slots[mine] - first_ordinal]
    verify_rows(region, first_page, rows[checked[rows]], got, expected)
    return held


def _direct_frames(resolution: Resolution, links: np.ndarray, slots: np.ndarray,
                   candidate: np.ndarray) -> np.ndarray:
    """Per page, the frame of its base link holding it (or -1: not served as a view): at most
    DIRECT_FRAMES_MAX distinct frames, those with the most pages."""
    frames = np.full(len(links), -1, np.int64)
    for link_index in np.unique(links[candidate]).tolist():
        link = resolution.links[link_index]
        sel = np.flatnonzero(candidate & (links == link_index))
        frames[sel] = link.frames.page_frames.frame_of(slots[sel])
    chosen = np.flatnonzero(frames >= 0)
    keys = (links[chosen].astype(np.int64) << 32) | frames[chosen]
    unique, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
    if len(unique) > page_module.DIRECT_FRAMES_MAX:
        keep = np.zeros(len(unique), bool)
        keep[np.argsort(-counts, kind="stable")[:page_module.DIRECT_FRAMES_MAX]] = True
        frames[chosen[~keep[inverse]]] = -1
    return frames


def _page_order_frames(links: np.ndarray, frames: np.ndarray) -> list:
    """(link index, frame) of the direct frames, in the order the pages first need them."""
    rows = np.flatnonzero(frames >= 0)
    keys = (links[rows].astype(np.int64) << 32) | frames[rows]
    _, first = np.unique(keys, return_index=True)
    return [(int(links[r]), int(frames[r])) for r in rows[np.sort(first)].tolist()]


def _check_blank(image, region, first_page: int, rows: np.ndarray, expected: np.ndarray) -> None:
    """Pages that resolve to ZERO or FREE but carry a digest in link 0 must be zero pages."""
    if len(rows):
        zero = np.broadcast_to(np.frombuffer(zero_page_digest(image.page_size), np.uint8), expected.shape)
        verify_rows(region, first_page, rows, zero, expected)


def check_built(image, region, first_page: int, out: np.ndarray, rows: np.ndarray,
                expected: np.ndarray) -> None:
    """Rows ``rows`` of ``out`` (pages first_page + row) against ``expected`` digests; the
    first that differs raises LI-DIG-002."""
    if not len(rows):
        return
    got = np.zeros(expected.shape, np.uint8)
    got[rows] = row_digests(out.reshape(-1, image.page_size), rows)
    verify_rows(region, first_page, rows, got, expected)
