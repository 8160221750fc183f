"""A range of a chained image as verified runs (pieces: LeanImage.region_pieces of a chain):
pages served as views of their link's decompressed frame where no other range needs that
frame (the direct frames), blank runs for ZERO and FREE pages, the rest built in one buffer
(fill); every page checked against the digest of the image read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..arrays import scatter_rows
from ..digests import verify_rows
from ..format import DIGEST_SIZE, PageClass, row_digests, zero_page_digest
from ..frames import DIRECT_FRAMES_MAX
from .deltas import chain_patches
from .build import check_built, fill
from .forward import FrameToRead, FrameWindow, fill_frames, stored_pages
from .resolution import Resolution, frame_key, frame_keys

if TYPE_CHECKING:
    from ..reader import LeanImage
    from ..tables import Region


def pieces(
    image: LeanImage, region: Region, resolution: Resolution, first_page: int, count: int
) -> list[tuple[int, memoryview | None]]:
    """Pages [first_page, first_page+count) of link 0 as verified ``(n, data)`` runs, like
    LeanImage.region_pieces: a page whose bytes are a STORED page of some link, with no delta
    above it, in a frame no other range needs, is a view of that link's decompressed frame;
    pages with deltas or on a disk, and those of frames other ranges need too, are built in
    one buffer (fill; from the same decompressed frames).  Every page is checked against link 0's digest,
    which covers the
    whole path.  The frames and the buffer are used again by the next call: its views are
    valid until then."""
    ps = image.page_size
    stop = first_page + count
    stored = stored_pages(resolution)
    stored.take_back()
    if len(resolution.delta_pages):
        chain_patches(resolution)  # the workers read the DELTA_FRAMEs meanwhile
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
    order = [FrameToRead(resolution.links[li], f, False) for li, f in direct_frames]
    if built.any():
        order += fill_frames(resolution, first_page, count, built, set(direct_frames))
    window = FrameWindow(
        resolution.links[0].frames.pool, order, stored.buffers if stored.continues(first_page) else None
    )
    viewed = _decompress_direct_frames(
        image, region, resolution, window, first_page, links, frames, slots, checked, expected
    )
    stored.handed_out = [content for content, _ in viewed.values()]
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
            decompressed={key: content for key, (content, _) in viewed.items()},
            forward=True,
        )
        check_built(image, region, first_page, out, np.flatnonzero(built & checked), expected)
    else:
        stored_pages(resolution).skip(first_page, count)
    if stop >= len(resolution.base_link):  # the forward pass is over: its folded deltas go
        resolution.chain_patches = None
    kind = np.where(blank, 0, np.where(direct, 1, 2))
    starts = np.ones(count, bool)
    starts[1:] = (kind[1:] != kind[:-1]) | (
        direct[1:] & ((links[1:] != links[:-1]) | (frames[1:] != frames[:-1]) | (slots[1:] != slots[:-1] + 1))
    )
    bounds = [*np.flatnonzero(starts).tolist(), count]
    result: list[tuple[int, memoryview | None]] = []
    for lo, hi in zip(bounds, bounds[1:]):
        if kind[lo] == 0:
            result.append((hi - lo, None))
        elif kind[lo] == 2:
            assert out is not None  # pages built: built.any()
            result.append((hi - lo, out.data[lo * ps : hi * ps]))
        else:
            content, first_ordinal = viewed[(int(links[lo]), int(frames[lo]))]
            start = int(slots[lo]) - first_ordinal
            result.append((hi - lo, content[start * ps : (start + hi - lo) * ps]))
    return result


def _decompress_direct_frames(
    image: LeanImage,
    region: Region,
    resolution: Resolution,
    window: FrameWindow,
    first_page: int,
    links: np.ndarray,
    frames: np.ndarray,
    slots: np.ndarray,
    checked: np.ndarray,
    expected: np.ndarray,
) -> dict[tuple[int, int], tuple[memoryview, int]]:
    """Decompress the direct frames (in the order the pages need them) and check the direct
    pages' digests (only theirs: a frame's superseded pages are not read) against link 0's;
    (link index, frame) -> (content view, first ordinal)."""
    ps = image.page_size
    rows = np.flatnonzero((frames >= 0) & checked)
    keys = frame_keys(links[rows], frames[rows])
    by_frame = np.argsort(keys, kind="stable")  # each frame's rows found by bisection
    keys = keys[by_frame]
    got = np.zeros((len(links), DIGEST_SIZE), np.uint8)
    viewed = {}
    for link_index, frame in _page_order_frames(links, frames):
        link = resolution.links[link_index]
        window.step()
        content = link.frames.frame(frame, keep=False)[0]
        first_ordinal = int(link.frames.page_frames.starts[frame])
        viewed[(link_index, frame)] = (memoryview(content), first_ordinal)
        key = frame_key(link_index, frame)
        lo, hi = np.searchsorted(keys, [key, key + 1])
        mine = rows[by_frame[lo:hi]]
        pages = np.frombuffer(content, np.uint8).reshape(-1, ps)
        scatter_rows(got, mine, row_digests(pages, slots[mine] - first_ordinal))
    verify_rows(region, first_page, rows, got, expected)
    return viewed


def _direct_frames(resolution: Resolution, first_page: int, count: int, candidate: np.ndarray) -> np.ndarray:
    """Per candidate page of the range, the frame of its base link holding it (or -1: not
    served as a view): frames whose pages all lie in the range (no other range needs them),
    at most DIRECT_FRAMES_MAX of them, those with the most pages. A direct frame's pages
    with deltas are built from the same decompressed frame."""
    stored = stored_pages(resolution)
    groups = stored.group_of[first_page : first_page + count]
    sizes = np.diff(stored.bounds)
    tally = np.bincount(groups[candidate], minlength=len(sizes))
    eligible = (tally > 0) & stored.local(first_page, first_page + count)
    if eligible.sum() > DIRECT_FRAMES_MAX:
        best = np.flatnonzero(eligible)[np.argsort(-sizes[eligible], kind="stable")[:DIRECT_FRAMES_MAX]]
        eligible[:] = False
        eligible[best] = True
    frames = np.full(count, -1, np.int64)
    chosen = np.flatnonzero(candidate)  # STORED: every one has a frame
    chosen = chosen[eligible[groups[chosen]]]
    frames[chosen] = resolution.base_frame[first_page + chosen]
    return frames


def _page_order_frames(links: np.ndarray, frames: np.ndarray) -> list[tuple[int, int]]:
    """(link index, frame) of the direct frames, in the order the pages first need them."""
    rows = np.flatnonzero(frames >= 0)
    keys = frame_keys(links[rows], frames[rows])
    _, first = np.unique(keys, return_index=True)
    return [(int(links[r]), int(frames[r])) for r in rows[np.sort(first)].tolist()]


def _check_blank(image: LeanImage, region: Region, first_page: int, rows: np.ndarray, expected: np.ndarray) -> None:
    """Pages that resolve to ZERO or FREE but carry a digest in link 0 must be zero pages."""
    if len(rows):
        zero = np.broadcast_to(np.frombuffer(zero_page_digest(image.page_size), np.uint8), expected.shape)
        verify_rows(region, first_page, rows, zero, expected)
