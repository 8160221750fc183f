"""Resolution: a chained region folded once into per-page arrays (spec §10.2).

A page of link 0 (the image restored) may be PARENT in several links before one holds
its bytes (the *base*), and links above the base may add DELTA entries. Walking the
chain page by page costs O(depth) per page. Instead the links are folded once, their own
(non-PARENT) pages laid end to end, into per-page arrays: which link holds the base, its
class and slot, the page's digest link, and the list of (page, link, delta slot) to apply
above it. Restoring then reads each base once and applies each relevant delta once; the
result is checked against link 0's digest, which covers the whole path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, NamedTuple

import numpy as np

from ..errors import ChainError
from ..format import CHAIN_DEPTH_MAX, IS_CONCRETE, PageClass
from ..rules import implements

from ..native import backend as _native  # the fold in one pass over the extents (None: numpy)

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..reader import LeanImage
    from ..tables import FrameTable, Region
    from .deltas import ChainPatches
    from .forward import StoredPages
    from .random_access import DeltaPatches


@dataclass
class Resolution:
    """What ``resolve`` finds for a region, and the stages built on it when first used
    (``forward.stored_pages``, ``random_access.delta_patches``, ``deltas.chain_patches``)."""

    links: list[LeanImage]  # [link 0, link 1, ...]
    regions: list[Region | None]  # the region of the same name in each link (None past its end)
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
    stored: StoredPages | None = field(default=None, repr=False)  # forward.stored_pages
    patches: DeltaPatches | None = field(default=None, repr=False)  # random_access.delta_patches
    chain_patches: ChainPatches | None = field(default=None, repr=False)  # deltas.chain_patches
    # deltas.parse_deltas_ahead's batch parses (batch key -> future), until a ChainPatches takes them
    deltas_ahead: dict[tuple, Future] | None = field(default=None, repr=False)


# --- a (link index, frame) pair packed into one int64: sorts by link, then frame ----------------
FRAME_BITS = 32


def frame_keys(links: np.ndarray, frames: np.ndarray) -> np.ndarray:
    """One int64 per (link index, frame), ordered by link then frame."""
    return (links.astype(np.int64) << FRAME_BITS) | frames.astype(np.int64)


def frame_key(link_index: int, frame: int) -> int:
    """frame_keys of one (link index, frame)."""
    return (link_index << FRAME_BITS) | frame


def split_frame_key(key: int) -> tuple[int, int]:
    """(link index, frame) of a key of frame_keys."""
    return key >> FRAME_BITS, key & ((1 << FRAME_BITS) - 1)


# --- the fold of the links' own pages --------------------------------------------------------
FOLD_ENTRIES = 1 << 22  # own pages laid end to end at once (~50 bytes each while folded)


class OwnExtents(NamedTuple):
    """The extents of a chain's links that hold pages of a region other than PARENT, laid end
    to end field by field (_own_extents): one item per extent."""

    starts: np.ndarray  # first page (int64)
    classes: np.ndarray  # page class (uint8)
    counts: np.ndarray  # pages, cut at the region's end (int64)
    first_slots: np.ndarray  # slot of the first page (int64)
    bearing: np.ndarray  # whether its pages have stored digests (bool)
    rank0: np.ndarray  # digest rank of its first page (int64)
    links: np.ndarray  # the link it is of (int32)


class OwnPages(NamedTuple):
    """OwnExtents expanded page by page (_expand): one item per page."""

    pages: np.ndarray
    links: np.ndarray
    classes: np.ndarray
    slots: np.ndarray
    ranks: np.ndarray  # digest rank, -1: none stored


class Deltas(NamedTuple):
    """The DELTA pages above their page's base: by page, deepest link first."""

    pages: np.ndarray  # int64
    links: np.ndarray  # int32
    slots: np.ndarray  # int64


@implements("LI-CHN-004")
def resolve(image: LeanImage, region: Region) -> Resolution:
    """Fold the chain of ``image`` for ``region`` into a Resolution. Each link is read from
    its extents, and only its non-PARENT pages are touched: the fold costs the base's pages
    plus each link's changed pages, not depth x pages. The links' own pages are laid end to
    end and folded a few million at a time (the nearest link wins: np.minimum.at over link
    indexes), so the work per link is a few list items, not a few numpy calls, and memory
    stays bounded however many pages the links hold."""
    links = image.chain()
    regions = [region] + [_same_region(link, region) for link in links[1:]]
    present = [depth for depth, r in enumerate(regions) if r is not None]
    own = [r for r in regions if r is not None]
    n = region.num_pages
    inherits = np.zeros(len(links), bool)
    inherits[present] = [links[d].digests.inherits for d in present]
    own_extents = _own_extents if _native is None else _own_extents_native
    extents = own_extents(own, present, n)
    fold = _Fold(n)
    fold_own = _fold_own_pages_numpy if _native is None else _fold_own_pages_native
    delta_pages, delta_links, delta_slots = fold_own(fold, extents, inherits)
    for d, r in zip(present, own):
        if not inherits[d]:  # 1.0: every page has its own digest
            fold.take_whole(d, r)
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


def _fold_own_pages_numpy(fold: _Fold, extents: OwnExtents, inherits: np.ndarray) -> Deltas:
    """Every own page of ``extents`` (_own_extents) taken into ``fold`` for its base and
    digest, a few million at a time; the DELTA pages above their page's base, by page,
    deepest link first."""
    deltas = []
    for lo, hi in _parts(extents.counts, FOLD_ENTRIES):
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
    return Deltas(pages[delta], depths[delta], slots[delta])


def _fold_own_pages_native(fold: _Fold, extents: OwnExtents, inherits: np.ndarray) -> Deltas:
    """_fold_own_pages_numpy in one pass over the extents (leanimg._native), without
    expanding them page by page or sorting."""
    assert _native is not None  # chosen by resolve only with the backend
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
    return Deltas(*(a[:found] for a in out))


def _own_extents(regions: list[Region], depths: list[int], limit: int) -> OwnExtents:
    """The extents of ``regions`` (the region in links ``depths``) that hold pages below
    ``limit`` other than PARENT, laid end to end field by field (copying whole extent tables
    costs more than the rest of the fold)."""
    lengths = np.array([len(r.extents) for r in regions], np.int64)
    starts = np.concatenate([r.starts for r in regions])
    classes = np.concatenate([r.extents["page_class"] for r in regions])
    mine = np.flatnonzero((classes != PageClass.PARENT) & (starts < limit))
    starts = starts[mine]
    counts = np.minimum(
        np.concatenate([r.extents["num_pages"] for r in regions])[mine].astype(np.int64), limit - starts
    )
    return OwnExtents(
        starts,
        classes[mine].astype(np.uint8),
        counts,
        np.concatenate([r.extents["first_slot"] for r in regions])[mine].astype(np.int64),
        np.concatenate([r.digest_bearing for r in regions])[mine],
        np.concatenate([r.digest_rank0 for r in regions])[mine].astype(np.int64),
        np.repeat(np.array(depths, np.int32), lengths)[mine],
    )


def _own_extents_native(regions: list[Region], depths: list[int], limit: int) -> OwnExtents:
    """_own_extents in one pass (leanimg._native), each link's extents read where they are."""
    assert _native is not None  # chosen by resolve only with the backend
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
    return OwnExtents(starts, classes, counts, slots, bearing.view(bool), rank0, links)


def _parts(counts: np.ndarray, most: int) -> Iterator[tuple[int, int]]:
    """[lo, hi) ranges of items whose ``counts`` sum to at most ``most`` (or one item)."""
    ends = np.cumsum(counts)
    lo = 0
    while lo < len(counts):
        done = int(ends[lo - 1]) if lo else 0
        hi = max(lo + 1, int(np.searchsorted(ends, done + most, side="right")))
        yield lo, hi
        lo = hi


def _expand(extents: OwnExtents, lo: int, hi: int) -> OwnPages:
    """Every page of extents [lo, hi)."""
    starts, classes, counts, first_slots, bearing, rank0, links = (a[lo:hi] for a in extents)
    before = np.cumsum(counts) - counts  # each extent's first entry
    at = np.arange(int(counts.sum()))  # entry k is page (start - before) + k of its extent
    pages = np.repeat(starts - before, counts) + at
    slots = np.repeat(first_slots - before, counts) + at
    ranks = np.where(np.repeat(bearing, counts), np.repeat(rank0 - before, counts) + at, -1)
    return OwnPages(pages, np.repeat(links, counts), np.repeat(classes, counts), slots, ranks)


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

    def take(
        self,
        kind: str,
        offered: np.ndarray,
        pages: np.ndarray,
        depths: np.ndarray,
        classes: np.ndarray,
        values: np.ndarray,
    ) -> None:
        """The entries where ``offered`` (a mask over them), each (page, link, class, value)."""
        nearest, cls, value = self.arrays[kind]
        here = np.full(self.n, CHAIN_DEPTH_MAX, np.int32)
        np.minimum.at(here, pages, np.where(offered, depths, CHAIN_DEPTH_MAX).astype(np.int32))
        win = np.flatnonzero(offered & (depths == here[pages]) & (depths < nearest[pages]))  # one entry per page
        nearest[pages[win]], cls[pages[win]], value[pages[win]] = depths[win], classes[win], values[win]

    def take_whole(self, depth: int, r: Region) -> None:
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


def _frames_of(tables: list[FrameTable], depths: list[int], links: np.ndarray, slots: np.ndarray) -> np.ndarray:
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


def _same_region(link: LeanImage, region: Region) -> Region | None:
    for r in link.regions:
        if r.name == region.name:
            return r
    return None
