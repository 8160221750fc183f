"""Resolving a region of a chained image once, so the work per page does not grow with depth.

A page of link 0 (the image restored) may be PARENT in several links before one holds
its bytes (the *base*), and links above the base may add DELTA entries. Walking the
chain page by page costs O(depth) per page. Instead the links are folded once, their own
(non-PARENT) pages laid end to end, into per-page arrays: which link holds the base, its
class and slot, the page's digest link, and the list of (page, link, delta slot) to apply
above it. Restoring then reads each
base once and applies each relevant delta once; the result is checked against link 0's
digest, which covers the whole path.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

import numpy as np
import zstandard

from .arrays import distinct, scatter_rows
from .compression import FrameError, decompress_exact
from .delta import parse_index_lists
from .digests import verify_rows
from .errors import ChainError, LeanImageError
from .format import (
    CHAIN_DEPTH_MAX,
    DELTA_FRAME_BODY,
    DIGEST_SIZE,
    FRAME_PAGES_MAX_BYTES,
    IS_CONCRETE,
    NO_KEY,
    RECORD,
    RECORD_BODY_MAX,
    RECORD_TRAILER,
    PageClass,
    RecordType,
    align8,
    checksum64,
    page_items,
    record_size,
    row_digests,
    zero_page_digest,
)
from .frames import FrameBuffers
from . import pages as page_module
from .rules import implements

from .native import backend as _native  # the fold in one pass over the extents (None: numpy)


@dataclass
class Resolution:
    links: list  # [link 0, link 1, ...] LeanImage objects
    regions: list  # the region of the same name in each link (None past its end)
    base_link: np.ndarray  # per page: index of the link holding the base bytes
    base_class: np.ndarray  # per page: class of the base (STORED, ZERO, FREE, DISK)
    base_slot: np.ndarray  # per page: slot of the base in its link
    delta_pages: np.ndarray  # delta entries to apply, sorted by page then deepest link first
    delta_links: np.ndarray
    delta_slots: np.ndarray
    digest_link: np.ndarray  # per page: the nearest link whose own digest is the page's (spec §10.2)
    base_frame: np.ndarray  # per page: the PAGE_FRAME of its base link holding it (-1: base not STORED)
    delta_frames: np.ndarray  # per delta entry: the DELTA_FRAME of its link holding it
    digest_class: np.ndarray  # per page: its class in its digest link
    digest_rank: np.ndarray  # per page: the rank of its digest in its digest link's DIGESTS (-1: none)
    _stored: "_StoredPages | None" = field(default=None, repr=False)
    _patches: "_DeltaPatches | None" = field(default=None, repr=False)
    _chain_patches: "_ChainPatches | None" = field(default=None, repr=False)
    deltas_ahead: dict | None = field(default=None, repr=False)  # parse_deltas_ahead's, until used

    def delta_patches(self) -> "_DeltaPatches":
        """The deltas that apply, as word patches per DELTA_FRAME (built on first use)."""
        if self._patches is None:
            self._patches = _DeltaPatches(self)
        return self._patches

    def chain_patches(self) -> "_ChainPatches":
        """Every delta that applies, folded once for a forward pass (built on first use)."""
        if self._chain_patches is None:
            self._chain_patches = _ChainPatches(self)
        return self._chain_patches

    def stored_pages(self) -> "_StoredPages":
        """The STORED base pages served frame by frame (built on first use)."""
        if self._stored is None:
            self._stored = _StoredPages(self)
        return self._stored


FOLD_ENTRIES = 1 << 22  # own pages laid end to end at once (~50 bytes each while folded)


@implements("LI-CHN-004")
def resolve(image, region) -> Resolution:
    """Fold the chain of ``image`` for ``region`` into a Resolution. Each link is read from
    its extents, and only its non-PARENT pages are touched: the fold costs the base's pages
    plus each link's changed pages, not depth x pages. The links' own pages are laid end to
    end and folded a few million at a time (the nearest link wins: np.minimum.at over link
    indexes), so the work per link is a few list items, not a few numpy calls, and memory
    stays bounded however many pages the links hold."""
    links = image.chain()
    regions = [region] + [_same_region(link, region) for link in links[1:]]
    present = [depth for depth, r in enumerate(regions) if r is not None]
    n = region.num_pages
    inherits = np.zeros(len(links), bool)
    inherits[present] = [links[d].digests.inherits for d in present]
    own_extents = _own_extents if _native is None else _own_extents_native
    extents = own_extents([regions[d] for d in present], present, n)
    fold = _Fold(n)
    fold_own = _fold_own_pages_numpy if _native is None else _fold_own_pages_native
    delta_pages, delta_links, delta_slots = fold_own(fold, extents, inherits)
    for d in present:
        if not inherits[d]:  # 1.0: every page has its own digest
            fold.take_whole(d, regions[d])
    base_link, base_class, base_slot = fold.result("base")
    unresolved = np.flatnonzero(base_link < 0)
    if len(unresolved):
        page = int(unresolved[0])
        raise ChainError(
            f"region {region.name!r} page {page} has no base in any link of the chain ({len(links)} links)",
            rule="LI-CHN-004",
            structure=f"region[{region.region_id}]",
        )
    base_frame = np.full(n, -1, np.int64)
    stored = np.flatnonzero(base_class == PageClass.STORED)
    base_frame[stored] = _frames_of(
        [links[d].frames.page_frames for d in present], present, base_link[stored], base_slot[stored]
    )
    digest_link, digest_class, digest_rank = fold.result("digest")
    dframes = _frames_of([links[d].frames.delta_frames for d in present], present, delta_links, delta_slots)
    return Resolution(
        links,
        regions,
        base_link,
        base_class,
        base_slot,
        delta_pages,
        delta_links,
        delta_slots,
        digest_link,
        base_frame,
        dframes,
        digest_class,
        digest_rank,
    )


def _fold_own_pages_numpy(fold: "_Fold", extents: tuple, inherits: np.ndarray) -> tuple:
    """Every own page of ``extents`` (_own_extents) taken into ``fold`` for its base and
    digest, a few million at a time; the DELTA pages above their page's base, as (pages,
    links, slots) by page, deepest link first."""
    deltas = []
    for lo, hi in _parts(extents[2], FOLD_ENTRIES):
        pages, depths, classes, slots, ranks = _expand(extents, lo, hi)
        fold.take("base", IS_CONCRETE[classes], pages, depths, classes, slots)
        fold.take("digest", inherits[depths], pages, depths, classes, ranks)
        delta = classes == PageClass.DELTA
        deltas.append((pages[delta], depths[delta], slots[delta]))
    pages, depths, slots = (
        np.concatenate([d[k] for d in deltas] or [np.zeros(0, dtype)])
        for k, dtype in enumerate((np.int64, np.int32, np.int64))
    )
    base_link = fold.arrays["base"][0]
    delta = np.flatnonzero(depths < base_link[pages])  # above the base
    # by page, deepest link first (one entry per page and link: the keys are distinct)
    delta = delta[np.argsort((pages[delta] << 12) | (CHAIN_DEPTH_MAX - 1 - depths[delta].astype(np.int64)))]
    return pages[delta], depths[delta], slots[delta]


def _fold_own_pages_native(fold: "_Fold", extents: tuple, inherits: np.ndarray) -> tuple:
    """_fold_own_pages_numpy in one pass over the extents (leanimg._native), without
    expanding them page by page or sorting."""
    starts, classes, counts, slots, bearing, rank0, depths = extents
    room = int(counts[classes == PageClass.DELTA].sum())
    out = np.zeros(room, np.int64), np.zeros(room, np.int32), np.zeros(room, np.int64)
    (base_link, base_class, base_slot), (digest_link, digest_class, digest_rank) = (
        fold.arrays["base"],
        fold.arrays["digest"],
    )
    found = _native.fold_own_pages(
        starts,
        counts,
        classes,
        slots,
        bearing.view(np.uint8),
        rank0,
        depths,
        inherits.view(np.uint8),
        IS_CONCRETE.view(np.uint8),
        int(PageClass.DELTA),
        base_link,
        base_class,
        base_slot,
        digest_link,
        digest_class,
        digest_rank,
        *out,
    )
    return tuple(a[:found] for a in out)


def _own_extents(regions: list, depths: list[int], limit: int) -> tuple:
    """The extents of ``regions`` (the region in links ``depths``) that hold pages below
    ``limit`` other than PARENT, laid end to end field by field (copying whole extent tables
    costs more than the rest of the fold): (starts, classes, page counts, first slots, digest
    bearing, digest rank, link)."""
    lengths = np.array([len(r.extents) for r in regions], np.int64)
    starts = np.concatenate([r.starts for r in regions])
    classes = np.concatenate([r.extents["page_class"] for r in regions])
    mine = np.flatnonzero((classes != PageClass.PARENT) & (starts < limit))
    starts = starts[mine]
    counts = np.minimum(
        np.concatenate([r.extents["num_pages"] for r in regions])[mine].astype(np.int64), limit - starts
    )
    return (
        starts,
        classes[mine].astype(np.uint8),
        counts,
        np.concatenate([r.extents["first_slot"] for r in regions])[mine].astype(np.int64),
        np.concatenate([r.digest_bearing for r in regions])[mine],
        np.concatenate([r.digest_rank0 for r in regions])[mine].astype(np.int64),
        np.repeat(np.array(depths, np.int32), lengths)[mine],
    )


def _own_extents_native(regions: list, depths: list[int], limit: int) -> tuple:
    """_own_extents in one pass (leanimg._native), each link's extents read where they are."""
    total = sum(len(r.extents) for r in regions)
    out = (
        np.empty(total, np.int64),
        np.empty(total, np.int64),
        np.empty(total, np.uint8),
        np.empty(total, np.int64),
        np.empty(total, np.uint8),
        np.empty(total, np.int64),
        np.empty(total, np.int32),
    )
    found = _native.own_extents(
        [r.extents for r in regions],
        [r.digest_bearing for r in regions],
        [r.digest_rank0 for r in regions],
        np.array(depths, np.int32),
        limit,
        int(PageClass.PARENT),
        *out,
    )
    starts, counts, classes, slots, bearing, rank0, links = (a[:found] for a in out)
    return starts, classes, counts, slots, bearing.view(bool), rank0, links


def _parts(counts: np.ndarray, most: int):
    """[lo, hi) ranges of items whose ``counts`` sum to at most ``most`` (or one item)."""
    ends = np.cumsum(counts)
    lo = 0
    while lo < len(counts):
        done = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, done + most, side="right")))
        yield lo, hi
        lo = hi


def _expand(extents: tuple, lo: int, hi: int):
    """(page, link, class, slot, digest rank or -1) of every page of extents [lo, hi)."""
    starts, classes, counts, first_slots, bearing, rank0, links = (a[lo:hi] for a in extents)
    before = np.cumsum(counts) - counts  # each extent's first entry
    at = np.arange(int(counts.sum()))  # entry k is page (start - before) + k of its extent
    pages = np.repeat(starts - before, counts) + at
    slots = np.repeat(first_slots - before, counts) + at
    ranks = np.where(np.repeat(bearing, counts), np.repeat(rank0 - before, counts) + at, -1)
    return pages, np.repeat(links, counts), np.repeat(classes, counts), slots, ranks


class _Fold:
    """Per page, the nearest link offering it so far, for the base (concrete pages) and for the
    digest (own pages of 1.1 links, every page of 1.0 links), with the page's class there and
    its slot (base) or digest rank (digest). Entries may come in any order and in parts."""

    def __init__(self, n: int):
        self.n = n
        self.arrays = {
            kind: (
                np.full(n, CHAIN_DEPTH_MAX, np.int32),
                np.zeros(n, np.uint8),
                np.full(n, -1 if kind == "digest" else 0, np.int64),
            )
            for kind in ("base", "digest")
        }

    def take(self, kind: str, offered: np.ndarray, pages, depths, classes, values) -> None:
        """The entries where ``offered`` (a mask over them), each (page, link, class, value)."""
        nearest, cls, value = self.arrays[kind]
        here = np.full(self.n, CHAIN_DEPTH_MAX, np.int32)
        np.minimum.at(here, pages, np.where(offered, depths, CHAIN_DEPTH_MAX).astype(np.int32))
        win = np.flatnonzero(offered & (depths == here[pages]) & (depths < nearest[pages]))  # one entry per page
        nearest[pages[win]], cls[pages[win]], value[pages[win]] = depths[win], classes[win], values[win]

    def take_whole(self, depth: int, r) -> None:
        """Every page of region ``r`` of 1.0 link ``depth``, nearer than what was taken."""
        nearest, cls, value = self.arrays["digest"]
        pages = np.flatnonzero(nearest[: min(self.n, r.num_pages)] > depth)
        i = np.searchsorted(r.starts, pages, side="right") - 1
        nearest[pages], cls[pages] = depth, r.extents["page_class"][i]
        value[pages] = np.where(r.digest_bearing[i], r.digest_rank0[i] + pages - r.starts[i], -1)

    def result(self, kind: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(link, -1 where none; class; slot or rank) per page."""
        nearest, cls, value = self.arrays[kind]
        nearest[nearest == CHAIN_DEPTH_MAX] = -1
        return nearest, cls, value


def _frames_of(tables: list, depths: list[int], links: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Per (link, slot): the frame of that link's FrameTable (``tables``, of links ``depths``)
    holding the slot, by one binary search over the tables' starts keyed by link; a slot of a
    link with one frame is in frame 0 (a deep chain's small links: no search)."""
    if not len(slots):
        return np.zeros(0, np.int64)
    lengths = np.array([len(t.starts) for t in tables], np.int64)
    frames = np.zeros(len(slots), np.int64)
    several = np.zeros(max(depths) + 1, bool)
    several[depths] = lengths > 1
    search = np.flatnonzero(several[links])
    if not len(search):
        return frames
    keys = (np.repeat(np.array(depths, np.int64), lengths) << 48) + np.concatenate([t.starts for t in tables])
    first = np.zeros(max(depths) + 1, np.int64)
    first[depths] = np.cumsum(lengths) - lengths
    links, slots = links[search], slots[search]
    frames[search] = np.searchsorted(keys, (links.astype(np.int64) << 48) + slots, side="right") - 1 - first[links]
    return frames


def _same_region(link, region):
    for r in link.regions:
        if r.name == region.name:
            return r
    return None


def fill(
    resolution: Resolution,
    out: np.ndarray,
    first_page: int,
    count: int,
    want: np.ndarray | None = None,
    window: "_FrameWindow | None" = None,
    held: dict | None = None,
    forward: bool = False,
) -> None:
    """Write pages [first_page, first_page+count) of the resolved region into ``out``; with
    ``want`` (a mask over the range; it must include every page with deltas) only those;
    ``held``: frames already decompressed, (link, frame) -> content; ``forward``: the call is
    part of a forward pass over the region (a restore), whose deltas are folded at once."""
    stop = first_page + count
    classes = resolution.base_class[first_page:stop]
    want = np.ones(count, bool) if want is None else want
    if window is None:
        window = _FrameWindow(
            resolution.links[0].frames.pool,
            fill_frames(resolution, first_page, count, want) + fill_delta_frames(resolution, first_page, count),
        )
    resolution.stored_pages().copy(
        out, first_page, count, np.flatnonzero(want & (classes == PageClass.STORED)), window, held or {}
    )
    _fill_disk(resolution, out, first_page, count, np.flatnonzero(want & (classes == PageClass.DISK)))
    if forward:
        resolution.chain_patches().apply(out, first_page, stop)
    else:
        _apply_deltas(resolution, out, first_page, count, window)


def _fill_disk(resolution: Resolution, out: np.ndarray, first_page: int, count: int, rows: np.ndarray) -> None:
    """Rows ``rows`` of the range, whose bases are DISK pages, read from each base link's disks."""
    links = resolution.base_link[first_page : first_page + count][rows]
    slots = resolution.base_slot[first_page : first_page + count][rows]
    for link_index in distinct(links).tolist():
        mine = links == link_index
        resolution.links[link_index].fill_disk_pages(
            resolution.regions[link_index], first_page, out, rows[mine], slots[mine].astype(np.int64)
        )


def _delta_groups(resolution: Resolution, first_page: int, stop: int) -> list[tuple[int, int]]:
    """The (link, DELTA_FRAME) pairs holding deltas of pages [first_page, stop), deepest link
    first (a page's deltas apply from the deepest link up; one link has at most one per page,
    so its frames' order does not matter)."""
    lo, hi = (int(x) for x in np.searchsorted(resolution.delta_pages, [first_page, stop]))
    top = len(resolution.links) - 1
    keys = distinct(_frame_keys(top - resolution.delta_links[lo:hi].astype(np.int64), resolution.delta_frames[lo:hi]))
    return [(top - (key >> 32), key & 0xFFFFFFFF) for key in keys.tolist()]


def _apply_deltas(resolution: Resolution, out: np.ndarray, first_page: int, count: int, window) -> None:
    patches = resolution.delta_patches()
    stop = first_page + count
    for link_index, frame in _delta_groups(resolution, first_page, stop):
        if not patches.built(link_index, frame):
            window.step()
        patches.apply(link_index, frame, out, first_page, stop)


class _DeltaPatches:
    """The delta entries of a resolved region that apply (above their page's base), a
    DELTA_FRAME at a time turned once into word patches: INDEX_LIST entries as (page, word,
    value) arrays sorted by page, any other entry kept to go through the fully checked path.
    A range applies its slice of each frame's patch (deepest link first), so a frame whose
    entries spread over the whole region is parsed and indexed once, not once per range."""

    def __init__(self, resolution: Resolution):
        self.resolution = resolution
        keys = _frame_keys(resolution.delta_links, resolution.delta_frames)
        self.order = np.argsort(keys, kind="stable")  # pages ascend within a frame
        self.keys, starts = np.unique(keys[self.order], return_index=True)
        self.bounds = np.append(starts, len(keys))
        self.patches: dict = {}

    def built(self, link_index: int, frame: int) -> bool:
        return (link_index, frame) in self.patches

    def apply(self, link_index: int, frame: int, out: np.ndarray, first_page: int, stop: int) -> None:
        key = (link_index, frame)
        if key not in self.patches:
            self.patches[key] = self._build(link_index, frame)
        word_pages, word_at, values, slow_pages, slow_entries, last_page = self.patches[key]
        ps = self.resolution.links[0].page_size
        lo, hi = (int(x) for x in np.searchsorted(word_pages, [first_page, stop]))
        out.view("<u8")[(word_pages[lo:hi] - first_page) * (ps // 8) + word_at[lo:hi]] = values[lo:hi]
        lo, hi = (int(x) for x in np.searchsorted(slow_pages, [first_page, stop]))
        if hi > lo:
            _apply_checked(
                self.resolution.links[link_index], frame, out, slow_pages[lo:hi] - first_page, slow_entries[lo:hi], ps
            )
        if last_page < stop:  # no later range of a forward pass needs it
            del self.patches[key]

    def _build(self, link_index: int, frame: int):
        group = int(np.searchsorted(self.keys, (link_index << 32) | frame))
        entries = self.order[self.bounds[group] : self.bounds[group + 1]]
        pages = self.resolution.delta_pages[entries]
        first, _, _, (simple, word_start, num_words, positions, values) = self.resolution.links[
            link_index
        ].frames.delta_frame_parsed(frame)
        k = self.resolution.delta_slots[entries] - first
        fast = simple[k]
        counts = num_words[k[fast]]
        at = np.repeat(word_start[k[fast]] - np.concatenate(([0], np.cumsum(counts)[:-1])), counts) + np.arange(
            int(counts.sum())
        )
        return np.repeat(pages[fast], counts), positions[at], values[at], pages[~fast], k[~fast], int(pages[-1])


class _ChainPatches:
    """Every delta entry of a resolved region that applies, for a forward pass (a restore),
    built once on the read-ahead workers: the DELTA_FRAMEs holding them go in batches of
    whole frames (nearest link first), each batch read, decompressed, parsed and folded on a
    worker into the final value of every word it sets (a word several of its links set takes
    the nearest link's value), sorted by page and word. A range applies its slice of each
    batch, deepest batch first, so the nearest link's value is the one left: the work per
    range grows with the number of batches (one per BATCH_ENTRIES entries), not with depth.
    Pages with any entry other than a plain INDEX_LIST go entry by entry, deepest link first,
    all their entries through the fully checked path (_apply_checked), as _DeltaPatches does."""

    BATCH_ENTRIES = 1 << 14  # entries a worker reads and folds at once

    def __init__(self, resolution: Resolution):
        """Starts the batches on the workers; without workers the first ``apply`` runs them."""
        r = self.resolution = resolution
        self.words_per_page = r.links[0].page_size // 8
        self.of_frame, frames, sizes = _frames_in_use(r)
        cuts = _batch_cuts(sizes)
        # each frame's rows in their order: a radix sort where the frames fit 16 bits
        by_frame = np.argsort(
            self.of_frame.astype(np.uint16) if len(frames) <= 1 << 16 else self.of_frame, kind="stable"
        )
        row_cuts = np.searchsorted(self.of_frame[by_frame], cuts).tolist()
        pool, ps = r.links[0].frames.pool, r.links[0].page_size
        self.batches = []
        ahead, r.deltas_ahead = r.deltas_ahead or {}, None
        for lo, hi, row_lo, row_hi in zip(cuts, cuts[1:], row_cuts, row_cuts[1:]):
            rows = by_frame[row_lo:row_hi]
            parsed = ahead.get(_batch_key(frames[lo:hi]))
            job = (frames[lo:hi], lo, rows, self.of_frame, r.delta_slots, r.delta_pages, ps, parsed)
            self.batches.append((rows, job, pool.submit(_gather_and_fold, *job) if pool is not None else None))
        self.folds = None

    def _ready(self) -> None:
        """The batches' folds (waiting for the workers), deepest first; the rows of pages
        that go the checked path."""
        r = self.resolution
        results = [
            (rows, future.result() if future is not None else _gather_and_fold(*job))
            for rows, job, future in self.batches
        ]
        self.batches = []
        firsts = np.concatenate([result[0] for _, result in results] or [np.zeros(0, np.int64)])
        self.entry_in_frame = r.delta_slots - firsts[self.of_frame]
        plain = np.zeros(len(r.delta_pages), bool)
        for rows, (_, _, _, rows_plain) in results:
            plain[rows] = rows_plain
        slow_pages = distinct(r.delta_pages[~plain])
        self.slow_rows = np.flatnonzero(np.isin(r.delta_pages, slow_pages))
        folds = [(flat, values) for _, (_, flat, values, _) in reversed(results)]
        if len(slow_pages):  # their words come from the checked path, in its order
            folds = [
                (flat[keep], values[keep])
                for flat, values in folds
                for keep in [~np.isin(flat // self.words_per_page, slow_pages)]
            ]
        self.folds = folds

    def apply(self, out: np.ndarray, first_page: int, stop: int) -> None:
        if self.folds is None:
            self._ready()
        wpp, words = self.words_per_page, out.view("<u8")
        for flat, values in self.folds:
            lo, hi = (int(x) for x in np.searchsorted(flat, [first_page * wpp, stop * wpp]))
            words[flat[lo:hi] - first_page * wpp] = values[lo:hi]
        r = self.resolution
        lo, hi = (int(x) for x in np.searchsorted(r.delta_pages[self.slow_rows], [first_page, stop]))
        for row in self.slow_rows[lo:hi].tolist():
            _apply_checked(
                r.links[int(r.delta_links[row])],
                int(r.delta_frames[row]),
                out,
                np.array([int(r.delta_pages[row]) - first_page]),
                self.entry_in_frame[row : row + 1],
                r.links[0].page_size,
            )


def _frames_in_use(r: Resolution) -> tuple[np.ndarray, list, np.ndarray]:
    """The DELTA_FRAMEs the delta entries of ``r`` are in, by link then frame: per entry, the
    index of its frame among them; the frames, as (link, frame); their sizes in entries.
    Every link's frames are numbered end to end, so no sort is needed."""
    tables = [link.frames.delta_frames for link in r.links]
    counts = np.array([len(t) for t in tables], np.int64)
    first = np.cumsum(counts) - counts
    numbered = first[r.delta_links] + r.delta_frames
    used = np.zeros(int(counts.sum()), bool)
    used[numbered] = True
    ids = np.flatnonzero(used)
    link_of = np.repeat(np.arange(len(tables)), counts)[ids]
    frames = [(r.links[link], frame) for link, frame in zip(link_of.tolist(), (ids - first[link_of]).tolist())]
    sizes = np.concatenate([t.counts for t in tables] or [np.zeros(0, np.int64)]).astype(np.int64)[ids]
    return (np.cumsum(used) - 1)[numbered], frames, sizes


def _gather_and_fold(
    frames: list,
    first_frame: int,
    rows: np.ndarray,
    of_frame: np.ndarray,
    slots: np.ndarray,
    pages: np.ndarray,
    page_size: int,
    parsed=None,
):
    """_fold_delta_batch of the delta entries ``rows`` (their frame, ``of_frame``, counted from
    ``first_frame``; slot; page), gathered here, on the worker: numpy gathers without the GIL.
    ``parsed``: the future of the batch's _parse_delta_batch, begun ahead (parse_deltas_ahead)."""
    return _fold_delta_batch(
        frames,
        of_frame[rows] - first_frame,
        slots[rows],
        pages[rows],
        page_size,
        parsed.result() if parsed is not None else None,
    )


def parse_deltas_ahead(image) -> dict | None:
    """Begin reading and parsing the DELTA_FRAMEs of ``image``'s chain on its read-ahead workers
    (idle while the caller resolves the chain), in the batches _ChainPatches will make if
    every frame is in use (a chain restored whole): batch key (_batch_key) -> the future of
    its _parse_delta_batch; a batch _ChainPatches makes otherwise is read there, as before.
    None without workers or DELTA_FRAMEs. A frame's finding is raised only where a batch that uses it is folded."""
    from concurrent.futures import Future  # (the read-ahead workers imported it)

    links = image.chain()
    pool = links[0].frames.pool
    if pool is None or len(links) < 2:
        return None
    frames = [(link, frame) for link in links for frame in range(len(link.frames.delta_frames))]
    if not frames:
        return None
    sizes = np.concatenate([link.frames.delta_frames.counts for link in links]).astype(np.int64)
    cuts = _batch_cuts(sizes)
    batches = [(frames[lo:hi], Future()) for lo, hi in zip(cuts, cuts[1:])]
    pool.submit(_parse_in_turn, batches, image.page_size)  # one worker: the caller resolves meanwhile
    return {_batch_key(batch): future for batch, future in batches}


def _parse_in_turn(batches: list, page_size: int) -> None:
    """_parse_delta_batch of each (frames, future) in turn, its result (or finding) set in its future."""
    for frames, future in batches:
        try:
            future.set_result(_parse_delta_batch(frames, page_size))
        except BaseException as exc:
            future.set_exception(exc)


def _batch_cuts(sizes: np.ndarray) -> list[int]:
    """Where the batches of frames of ``sizes`` entries (in order) begin, and the end: a new
    batch where the entries so far pass a multiple of _ChainPatches.BATCH_ENTRIES."""
    if not len(sizes):
        return [0]
    return [0, *(np.flatnonzero(np.diff(np.cumsum(sizes) // _ChainPatches.BATCH_ENTRIES)) + 1).tolist(), len(sizes)]


def _batch_key(frames: list) -> tuple:
    return tuple((id(link), frame) for link, frame in frames)


def _fold_delta_batch(
    frames: list, frame_of_row: np.ndarray, slots: np.ndarray, pages: np.ndarray, page_size: int, parsed=None
):
    """Runs on a read-ahead worker: DELTA_FRAMEs ``frames`` ((link, frame), nearest link first)
    read, checked, decompressed and parsed as one, and the entries that apply (rows: their
    frame's index in ``frames``, slot and page) folded: (first delta per frame, the words set
    as page * words per page + word, ascending, their values, per row whether its entry is a
    plain INDEX_LIST). Only plain entries' words are folded; of a word several set, the
    nearest link's value is kept. ``parsed``: the batch's _parse_delta_batch, if done already."""
    firsts, counts, (simple, word_start, _, positions, values) = parsed or _parse_delta_batch(frames, page_size)
    entries = (np.cumsum(counts) - counts)[frame_of_row] + slots - firsts[frame_of_row]
    folded = (
        _fold_words_native(simple, word_start, positions, values, entries, pages, page_size)
        if _native is not None
        else None
    )
    if folded is not None:
        return (firsts, *folded)
    return (firsts, *_fold_words(simple, word_start, positions, values, entries, pages, page_size))


def _fold_words_native(simple, word_start, positions, values, entries, pages, page_size: int) -> tuple | None:
    """_fold_words in one call of leanimg._native.fold_words (None: an input it does not take)."""
    plain = np.zeros(len(entries), bool)
    flat, flat_values = np.empty(len(positions), np.int64), np.empty(len(positions), "<u8")
    count = _native.fold_words(
        simple.view(np.uint8),
        np.ascontiguousarray(word_start, np.int64),
        np.ascontiguousarray(positions, np.int64),
        np.ascontiguousarray(values, "<u8"),
        np.ascontiguousarray(entries, np.int64),
        np.ascontiguousarray(pages, np.int64),
        page_size // 8,
        int(pages.max()) + 1 if len(pages) else 0,
        plain.view(np.uint8),
        flat,
        flat_values,
    )
    return None if count < 0 else (flat[:count], flat_values[:count], plain)


def _fold_words(simple, word_start, positions, values, entries, pages, page_size: int) -> tuple:
    """The words of a batch's entries (parse_index_lists' arrays) that its rows apply (each
    row: its ``entries`` index and its page): (page * words per page + word, ascending, their
    values, per row whether its entry is a plain INDEX_LIST). Of a word several entries set,
    the first entry's value is kept (a batch's entries come nearest link first)."""
    plain = simple[entries]
    page_of_entry = np.full(len(simple), -1, np.int64)
    page_of_entry[entries[plain]] = pages[plain]
    word_page = np.repeat(page_of_entry, np.diff(word_start, append=len(positions)))
    kept = np.flatnonzero(word_page >= 0)
    flat = word_page[kept] * (page_size // 8) + positions[kept]
    order = np.argsort(flat, kind="stable")  # equal words keep the nearest link first
    flat, values = flat[order], values[kept][order]
    first = np.ones(len(flat), bool)
    first[1:] = flat[1:] != flat[:-1]
    return flat[first], values[first], plain


def _parse_delta_batch(frames: list, page_size: int):
    """DELTA_FRAMEs ``frames`` ((link, frame)) read, checked, decompressed and parsed as one:
    (first delta per frame, entries per frame, parse_index_lists' arrays over the frames laid
    end to end)."""
    read = _read_delta_batch_native(frames, page_size)
    if read is None:
        read = _read_delta_batch(frames)
    content, offsets, firsts, counts = read
    return firsts, counts, parse_index_lists(content, offsets, page_size)


def _read_delta_batch(frames: list) -> tuple:
    """(content, entry offsets, first delta per frame, entries per frame) of DELTA_FRAMEs
    ``frames`` laid end to end, each read by _quick_delta_frame or, failing that, by the frame
    store's checked path (which raises its finding)."""
    decompressor = zstandard.ZstdDecompressor()  # one per batch: a batch runs on one thread
    read = [
        _quick_delta_frame(link, frame, decompressor) or link.frames._read_delta_frame(frame) for link, frame in frames
    ]
    byte_base = np.cumsum([0] + [len(content) for content, _, _ in read])
    offsets = np.concatenate(
        [np.asarray(offsets[:-1], np.int64) + base for (_, offsets, _), base in zip(read, byte_base.tolist())]
        + [byte_base[-1:].astype(np.int64)]
    )
    return (
        b"".join(content for content, _, _ in read),
        offsets,
        np.array([first for _, _, first in read], np.int64),
        np.array([len(offsets) - 1 for _, offsets, _ in read], np.int64),
    )


# what one native call reads of a batch's records, at most (past it, they are read one by one)
NATIVE_BATCH_BYTES_MAX = 256 << 20


def _read_delta_batch_native(frames: list, page_size: int) -> tuple | None:
    """_read_delta_batch in one call of leanimg._native.read_delta_frames: every record read,
    tested as _quick_delta_frame tests it, and decompressed in C, the GIL released (so a batch
    on a read-ahead worker does not hold back the caller); None when any record is not of
    the plain case (a worker then reads them one by one, and the checked path raises any finding),
    or without the backend (LEANIMG_NATIVE=0)."""
    if _native is None:
        return None
    fds, offsets, lengths, firsts, nums = [], [], [], [], []
    for link, frame in frames:
        tables = link.tables
        position = int(tables.delta_frames.positions[frame])
        offset, kind, key, first, num = tables.entries[position].item()
        length = tables.listed_end(position) - offset
        if (
            kind != RecordType.DELTA_FRAME
            or key != NO_KEY
            or not 0 < num <= 0xFFFF_FFFF
            or first >= 1 << 63
            or offset + length > tables.file.size
        ):
            return None
        try:
            fds.append(tables.file.fileobj.fileno())
        except (OSError, ValueError):  # an object in a store: read through its pread
            return None
        offsets.append(offset)
        lengths.append(length)
        firsts.append(first)
        nums.append(num)
    if sum(lengths) > NATIVE_BATCH_BYTES_MAX:
        return None
    most = sum(nums) * 2 * page_size  # an entry of any encoding is shorter than two pages (spec §7.2)
    read = _native.read_delta_frames(
        np.array(fds, np.int32),
        np.array(offsets, np.int64),
        np.array(lengths, np.int64),
        np.array(firsts, np.int64),
        np.array(nums, np.int64),
        most,
    )
    if read is None:
        return None
    content, entry_offsets = read
    return content, np.frombuffer(entry_offsets, np.int64), np.array(firsts, np.int64), np.array(nums, np.int64)


# a DELTA_FRAME record's header and its body's fixed part (first_delta, num_deltas, reserved)
_DELTA_RECORD = struct.Struct(RECORD.struct.format + DELTA_FRAME_BODY.struct.format.lstrip("<"))


def _quick_delta_frame(link, frame: int, decompressor=None):
    """(content, entry offsets (an array), first delta) of a DELTA_FRAME as
    FrameStore._read_delta_frame gives them, when every rule it checks holds in its plain case: the record's framing,
    checksum, flags and padding (LI-REC-002..005), body length (LI-REC-007), reserved field
    (LI-REC-008), entry offsets (LI-DLT-001), size (LI-FRM-004), its INDEX entry (LI-IDX-001),
    a zstd frame of the declared size; else None, and that path reads it and raises its finding.
    One read and a few scalar tests, not a Record and its checks' generators (a deep chain's
    restore reads one DELTA_FRAME per link); ``decompressor``: one to use again (a batch's).
    leanimg._native.read_delta_frames tests the same (keep them alike)."""
    tables = link.tables
    position = int(tables.delta_frames.positions[frame])
    _, *listed = tables.entries[position].item()  # record_type, key, first, count
    raw = tables.listed_bytes(position, record_size(RECORD_BODY_MAX))
    if raw is None or len(raw) < _DELTA_RECORD.size + 4 + RECORD_TRAILER.size:
        return None
    kind, flags, body_length, first, num, reserved = _DELTA_RECORD.unpack_from(raw)
    body = RECORD.size
    table_end = body + DELTA_FRAME_BODY.size + 4 * (num + 1)
    frame_start = body + align8(DELTA_FRAME_BODY.size + 4 * (num + 1))
    trailer = int.from_bytes(raw[-RECORD_TRAILER.size :], "little")
    if (
        kind != RecordType.DELTA_FRAME
        or flags
        or reserved
        or num < 1
        or len(raw) != record_size(body_length)
        or frame_start > body + body_length
        or listed != [RecordType.DELTA_FRAME, NO_KEY, first, num]
        or any(raw[body + body_length : -RECORD_TRAILER.size])
        or any(raw[table_end:frame_start])
        or checksum64(memoryview(raw)[: -RECORD_TRAILER.size]) != trailer
    ):
        return None
    offsets = np.frombuffer(raw, "<u4", num + 1, body + DELTA_FRAME_BODY.size).astype(np.int64)
    size = int(offsets[-1])
    if offsets[0] != 0 or size > FRAME_PAGES_MAX_BYTES or (offsets[1:] < offsets[:-1]).any():
        return None
    try:
        content = decompress_exact(
            memoryview(raw)[frame_start : body + body_length],
            expected=size,
            limit=FRAME_PAGES_MAX_BYTES,
            decompressor=decompressor,
        )
    except FrameError:
        return None
    return content, offsets, first


def _apply_checked(link, frame: int, out: np.ndarray, rows: np.ndarray, entry_indexes: np.ndarray, ps: int) -> None:
    """Entries other than plain INDEX_LISTs, one page at a time through delta.apply, which
    decodes them and reports any broken rule."""
    from .delta import apply as apply_delta

    _, content, offsets, _ = link.frames.delta_frame_parsed(frame)
    offset, path = link.frames.delta_frame_location(frame)
    for row, entry_index in zip(rows.tolist(), entry_indexes.tolist()):
        entry = content[offsets[entry_index] : offsets[entry_index + 1]]
        try:
            page = apply_delta(
                entry,
                out[row * ps : (row + 1) * ps].tobytes(),
                offset=offset,
                structure=f"{path}.entries[{entry_index}]",
            )
        except LeanImageError as exc:
            exc.path = exc.path or link.path
            exc.args = (str(exc),)
            raise
        out[row * ps : (row + 1) * ps] = np.frombuffer(page, np.uint8)


def _frame_keys(links: np.ndarray, frames: np.ndarray) -> np.ndarray:
    """One int64 per (link index, frame), ordered by link then frame."""
    return (links.astype(np.int64) << 32) | frames.astype(np.int64)


class _StoredPages:
    """The STORED base pages of a resolved region, served a frame at a time.

    A chain's frames hold superseded pages beside live ones, and a link's frames spread over
    the whole region (its changed pages are scattered), so a restore reading the region in
    ranges would need most frames in every range.  In a forward pass (each call starting
    where the last ended, as restores read) a frame is decompressed once: the live pages later
    ranges need are copied out and carried (at most the live pages of the rest of the
    region), the frame is dropped.  Other calls (random reads) go frame by frame through
    each link's frame cache."""

    def __init__(self, resolution: Resolution):
        self.resolution = resolution
        pages = np.flatnonzero(resolution.base_frame >= 0)
        keys = _frame_keys(resolution.base_link[pages], resolution.base_frame[pages])
        order = np.argsort(keys, kind="stable")  # pages ascend within a frame
        self.pages = pages[order]
        self.keys, starts = np.unique(keys[order], return_index=True)
        self.bounds = np.append(starts, len(order))
        self.first = self.pages[starts] if len(starts) else starts  # per frame: lowest page
        self.last = self.pages[self.bounds[1:] - 1] if len(starts) else starts  # and highest
        self.group_of = np.full(len(resolution.base_frame), -1, np.int64)
        self.group_of[self.pages] = np.repeat(np.arange(len(self.keys)), np.diff(self.bounds))
        self.opened = np.zeros(len(self.keys), bool)  # decompressed in this forward pass
        self.carried: list = []  # (pages ascending, their bytes as page items)
        self.next_page = 0
        self.buffers = FrameBuffers()  # frames of a forward pass decompress into these
        self.handed_out: list = []  # frames the last pieces call's views are of
        self.out = None  # see buffer

    def continues(self, first_page: int) -> bool:
        """Whether a call at ``first_page`` is (or starts) a forward pass."""
        return first_page in (0, self.next_page)

    def buffer(self, size: int) -> np.ndarray:
        """The buffer pieces builds a range's pages in, the same from call to call (its views
        are valid until the next call, as those of frames are): fresh memory would cost a
        page fault and a cleared page every 4 KiB of every range."""
        if self.out is None or len(self.out) < size:
            self.out = np.empty(size, np.uint8)
        return self.out[:size]

    def take_back(self) -> None:
        """The frames the last call's pieces were views of are free again (the caller has
        written them: views are valid until the next call)."""
        for content in self.handed_out:
            self.buffers.give(content)
        self.handed_out = []

    def _forward(self, first_page: int) -> bool:
        """Whether a call at ``first_page`` continues the forward pass (or, at page 0, starts
        one); if not, the pass ends."""
        if first_page == self.next_page:
            return True
        self.carried = []
        self.opened[:] = False
        if first_page == 0:
            self.next_page = 0
            return True
        return False

    def to_open(self, first_page: int, rows: np.ndarray) -> np.ndarray:
        """Frames (indexes into self.keys, ascending) a call for pages ``first_page + rows``
        decompresses: those not opened earlier in the pass."""
        groups = distinct(self.group_of[first_page + rows])
        return groups[~self.opened[groups]] if self._forward(first_page) else groups

    def frame_of(self, group: int) -> tuple[int, int]:
        key = int(self.keys[group])
        return key >> 32, key & 0xFFFFFFFF

    def copy(self, out: np.ndarray, first_page: int, count: int, rows: np.ndarray, window, held: dict) -> None:
        """Pages ``first_page + rows`` (STORED bases) into ``out`` (the range's buffer); frames
        in ``held`` ((link, frame) -> content) are not decompressed again."""
        forward = self._forward(first_page)
        groups = self.to_open(first_page, rows)
        stop = first_page + count
        ps = self.resolution.links[0].page_size
        items = out.view(page_items(ps))
        if forward:
            self._take_carried(items, first_page, stop)
        for group in groups.tolist():
            link_index, frame = self.frame_of(group)
            link = self.resolution.links[link_index]
            loaded = None
            if (link_index, frame) in held:
                content = np.frombuffer(held[(link_index, frame)], page_items(ps))
            else:
                window.step()
                loaded = link.frames.frame(frame, keep=not forward)[0]
                content = np.frombuffer(loaded, page_items(ps))
            pages = self.pages[self.bounds[group] : self.bounds[group + 1]]
            ordinals = self.resolution.base_slot[pages] - int(link.frames.page_frames.starts[frame])
            lo, hi = (int(x) for x in np.searchsorted(pages, [first_page, stop]))
            _copy_rows(items, pages[lo:hi] - first_page, content, ordinals[lo:hi])
            if forward and hi < len(pages):
                self.carried.append((pages[hi:], content[ordinals[hi:]]))  # copies
            if forward and loaded is not None:
                del content
                self.buffers.give(loaded)
        if forward:
            self.opened[groups] = True
        self.next_page = stop

    def skip(self, first_page: int, count: int) -> None:
        """A call for pages none of which is copied here (blank, or views of frames no other
        range needs: none is carried) continues the pass all the same."""
        self._forward(first_page)
        self.next_page = first_page + count

    def _take_carried(self, items: np.ndarray, first_page: int, stop: int) -> None:
        kept = []
        for pages, data in self.carried:
            hi = int(np.searchsorted(pages, stop))
            items[pages[:hi] - first_page] = data[:hi]
            if hi < len(pages):
                kept.append((pages[hi:], data[hi:]))
        self.carried = kept

    def local(self, first_page: int, stop: int) -> np.ndarray:
        """Per frame: whether all its pages lie in [first_page, stop) (no other range needs it)."""
        return (self.first >= first_page) & (self.last < stop)


def _copy_rows(dst: np.ndarray, dst_rows: np.ndarray, src: np.ndarray, src_rows: np.ndarray) -> None:
    """dst[dst_rows] = src[src_rows] (arrays of page items): with leanimg._native one copy of
    each page, the GIL released; numpy gathers them into a temporary and copies them again."""
    if _native is None:
        dst[dst_rows] = src[src_rows]
    else:
        _native.copy_rows(
            src, np.ascontiguousarray(src_rows, np.int64), dst, np.ascontiguousarray(dst_rows, np.int64), dst.itemsize
        )


class _FrameWindow:
    """Frames (link, frame, with digests) in the order they will be read; the next AHEAD of
    them are decompressed on the read-ahead workers meanwhile (so decompression runs on all
    cores, not link after link on the caller's thread), never more at once."""

    AHEAD = 8

    def __init__(self, pool, order: list, buffers: FrameBuffers | None = None):
        """``buffers``: PAGE_FRAMEs are decompressed into these (a forward pass's, which gives
        each back when done with it)."""
        self.pool = pool
        self.buffers = buffers
        self.pending = list(reversed(order)) if pool is not None else []
        self.step(self.AHEAD)

    def step(self, count: int = 1) -> None:
        """One more frame (or ``count``) handed to the workers."""
        while count and self.pending:
            link, frame, with_digests = self.pending.pop()
            if with_digests is DELTAS:
                link.frames.prefetch_deltas([frame], self.pool)
            else:
                link.frames.prefetch([frame], self.pool, with_digests, self.buffers)
            count -= 1


DELTAS = "deltas"  # a _FrameWindow item that is a DELTA_FRAME, parsed ahead


def fill_delta_frames(resolution: Resolution, first_page: int, count: int) -> list:
    """The DELTA_FRAMEs fill applies for a range, in its order (deepest link first)."""
    patches = resolution.delta_patches()
    return [
        (resolution.links[link_index], frame, DELTAS)
        for link_index, frame in _delta_groups(resolution, first_page, first_page + count)
        if not patches.built(link_index, frame)
    ]


def fill_frames(resolution: Resolution, first_page: int, count: int, want: np.ndarray, held=()) -> list:
    """The STORED frames fill decompresses for the wanted pages of a range, in its order
    (those in ``held`` are decompressed already)."""
    stored = resolution.stored_pages()
    rows = np.flatnonzero(want & (resolution.base_class[first_page : first_page + count] == PageClass.STORED))
    order = []
    for group in stored.to_open(first_page, rows).tolist():
        link_index, frame = stored.frame_of(group)
        if (link_index, frame) not in held:
            order.append((resolution.links[link_index], frame, False))
    return order


def pieces(image, region, resolution: Resolution, first_page: int, count: int) -> list:
    """Pages [first_page, first_page+count) of link 0 as verified ``(n, data)`` runs, like
    LeanImage.region_pieces: a page whose bytes are a STORED page of some link, with no delta
    above it, in a frame no other range needs, is a view of that link's decompressed frame;
    pages with deltas or on a disk, and those of frames other ranges need too, are built in
    one buffer (fill; from the same decompressed frames).  Every page is checked against link 0's digest, which covers the
    whole path.  The frames and the buffer are used again by the next call: its views are
    valid until then."""
    ps = image.page_size
    stop = first_page + count
    stored = resolution.stored_pages()
    stored.take_back()
    if len(resolution.delta_pages):
        resolution.chain_patches()  # the workers read the DELTA_FRAMEs meanwhile
    links = resolution.base_link[first_page:stop]
    classes = resolution.base_class[first_page:stop]
    slots = resolution.base_slot[first_page:stop]
    lo, hi = (int(x) for x in np.searchsorted(resolution.delta_pages, [first_page, stop]))
    has_delta = np.zeros(count, bool)
    has_delta[resolution.delta_pages[lo:hi] - first_page] = True
    blank = ~has_delta & ((classes == PageClass.ZERO) | (classes == PageClass.FREE))
    frames = _direct_frames(resolution, first_page, count, ~has_delta & (classes == PageClass.STORED))
    direct = frames >= 0
    built = ~blank & ~direct
    own, expected = image.digests.expected_range(region, first_page, count)
    checked = (own != PageClass.FREE) & (own != PageClass.ZERO)
    _check_blank(image, region, first_page, np.flatnonzero(blank & checked), expected)
    direct_frames = _page_order_frames(links, frames)
    order = [(resolution.links[li], f, False) for li, f in direct_frames]
    if built.any():
        order += fill_frames(resolution, first_page, count, built, set(direct_frames))
    window = _FrameWindow(
        resolution.links[0].frames.pool, order, stored.buffers if stored.continues(first_page) else None
    )
    held = _hold_direct_frames(image, region, resolution, window, first_page, links, frames, slots, checked, expected)
    stored.handed_out = [content for content, _ in held.values()]
    out = None
    if built.any():
        out = stored.buffer(count * ps)
        blank_base = built & ((classes == PageClass.ZERO) | (classes == PageClass.FREE))
        out.reshape(-1, ps)[np.flatnonzero(blank_base)] = 0  # deltas apply over zeros
        fill(
            resolution,
            out,
            first_page,
            count,
            want=built,
            window=window,
            held={key: content for key, (content, _) in held.items()},
            forward=True,
        )
        check_built(image, region, first_page, out, np.flatnonzero(built & checked), expected)
    else:
        resolution.stored_pages().skip(first_page, count)
    if stop >= len(resolution.base_link):  # the forward pass is over: its folded deltas go
        resolution._chain_patches = None
    kind = np.where(blank, 0, np.where(direct, 1, 2))
    starts = np.ones(count, bool)
    starts[1:] = (kind[1:] != kind[:-1]) | (
        direct[1:] & ((links[1:] != links[:-1]) | (frames[1:] != frames[:-1]) | (slots[1:] != slots[:-1] + 1))
    )
    bounds = [*np.flatnonzero(starts).tolist(), count]
    result = []
    for lo, hi in zip(bounds, bounds[1:]):
        if kind[lo] == 0:
            result.append((hi - lo, None))
        elif kind[lo] == 2:
            result.append((hi - lo, memoryview(out)[lo * ps : hi * ps]))
        else:
            content, first_ordinal = held[(int(links[lo]), int(frames[lo]))]
            start = int(slots[lo]) - first_ordinal
            result.append((hi - lo, content[start * ps : (start + hi - lo) * ps]))
    return result


def _hold_direct_frames(image, region, resolution, window, first_page, links, frames, slots, checked, expected) -> dict:
    """Decompress the direct frames (in the order the pages need them) and check the direct
    pages' digests (only theirs: a frame's superseded pages are not read) against link 0's;
    (link, frame) -> (content view, first ordinal)."""
    ps = image.page_size
    rows = np.flatnonzero((frames >= 0) & checked)
    keys = _frame_keys(links[rows], frames[rows])
    by_frame = np.argsort(keys, kind="stable")  # each frame's rows found by bisection
    keys = keys[by_frame]
    got = np.zeros((len(links), DIGEST_SIZE), np.uint8)
    held = {}
    for link_index, frame in _page_order_frames(links, frames):
        link = resolution.links[link_index]
        window.step()
        content = link.frames.frame(frame, keep=False)[0]
        first_ordinal = int(link.frames.page_frames.starts[frame])
        held[(link_index, frame)] = (memoryview(content), first_ordinal)
        key = (link_index << 32) | frame
        lo, hi = np.searchsorted(keys, [key, key + 1])
        mine = rows[by_frame[lo:hi]]
        pages = np.frombuffer(content, np.uint8).reshape(-1, ps)
        scatter_rows(got, mine, row_digests(pages, slots[mine] - first_ordinal))
    verify_rows(region, first_page, rows, got, expected)
    return held


def _direct_frames(resolution: Resolution, first_page: int, count: int, candidate: np.ndarray) -> np.ndarray:
    """Per candidate page of the range, the frame of its base link holding it (or -1: not
    served as a view): frames whose pages all lie in the range (no other range needs them),
    at most DIRECT_FRAMES_MAX of them, those with the most pages. A direct frame's pages
    with deltas are built from the same decompressed frame."""
    stored = resolution.stored_pages()
    groups = stored.group_of[first_page : first_page + count]
    sizes = np.diff(stored.bounds)
    tally = np.bincount(groups[candidate], minlength=len(sizes))
    eligible = (tally > 0) & stored.local(first_page, first_page + count)
    if eligible.sum() > page_module.DIRECT_FRAMES_MAX:
        best = np.flatnonzero(eligible)[np.argsort(-sizes[eligible], kind="stable")[: page_module.DIRECT_FRAMES_MAX]]
        eligible[:] = False
        eligible[best] = True
    frames = np.full(count, -1, np.int64)
    chosen = np.flatnonzero(candidate)  # STORED: every one has a frame
    chosen = chosen[eligible[groups[chosen]]]
    frames[chosen] = resolution.base_frame[first_page + chosen]
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


def check_built(image, region, first_page: int, out: np.ndarray, rows: np.ndarray, expected: np.ndarray) -> None:
    """Rows ``rows`` of ``out`` (pages first_page + row) against ``expected`` digests; the
    first that differs raises LI-DIG-002."""
    if not len(rows):
        return
    got = np.zeros(expected.shape, np.uint8)
    scatter_rows(got, rows, row_digests(out.reshape(-1, image.page_size), rows))
    verify_rows(region, first_page, rows, got, expected)
