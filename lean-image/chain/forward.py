"""The forward pass: a resolved region read range after range from its start, as restores
read it. A chain's frames hold superseded pages beside live ones and spread over the whole
region; in a forward pass each PAGE_FRAME is decompressed once (into buffers lent by
frames.FrameBuffers) and the live pages later ranges need are carried (StoredPages). The
frames a range reads are handed to the read-ahead workers a few at a time, in the order
they are read (FrameWindow), random reads' too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from ..arrays import distinct
from ..format import PageClass, page_items
from ..frames import FrameBuffers
from .resolution import Resolution, frame_keys, split_frame_key

from ..native import backend as _native  # base pages copied in one pass (None: numpy)

if TYPE_CHECKING:
    from concurrent.futures import ThreadPoolExecutor
    from typing import Collection, Mapping

    from ..reader import LeanImage


def stored_pages(resolution: Resolution) -> StoredPages:
    """The STORED base pages of ``resolution`` served frame by frame (built on first use)."""
    if resolution.stored is None:
        resolution.stored = StoredPages(resolution)
    return resolution.stored


class StoredPages:
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
        keys = frame_keys(resolution.base_link[pages], resolution.base_frame[pages])
        order = np.argsort(keys, kind="stable")  # pages ascend within a frame
        self.pages = pages[order]
        self.keys, starts = np.unique(keys[order], return_index=True)
        self.bounds = np.append(starts, len(order))
        self.first = self.pages[starts] if len(starts) else starts  # per frame: lowest page
        self.last = self.pages[self.bounds[1:] - 1] if len(starts) else starts  # and highest
        self.group_of = np.full(len(resolution.base_frame), -1, np.int64)
        self.group_of[self.pages] = np.repeat(np.arange(len(self.keys)), np.diff(self.bounds))
        self.opened = np.zeros(len(self.keys), bool)  # decompressed in this forward pass
        self.carried: list[tuple[np.ndarray, np.ndarray]] = []  # (pages ascending, their bytes as page items)
        self.next_page = 0
        self.buffers = FrameBuffers()  # frames of a forward pass decompress into these
        self.handed_out: list = []  # frames the last pieces call's views are of
        self.out: np.ndarray | None = None  # see buffer

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
        """(link index, frame) of frame ``group``."""
        return split_frame_key(int(self.keys[group]))

    def copy(
        self,
        out: np.ndarray,
        first_page: int,
        count: int,
        rows: np.ndarray,
        window: FrameWindow,
        decompressed: Mapping[tuple[int, int], memoryview],
    ) -> None:
        """Pages ``first_page + rows`` (STORED bases) into ``out`` (the range's buffer); frames
        in ``decompressed`` ((link index, frame) -> content) are not decompressed again."""
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
            if (link_index, frame) in decompressed:
                content = np.frombuffer(decompressed[(link_index, frame)], page_items(ps))
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


class FrameToRead(NamedTuple):
    """A frame a FrameWindow hands to the read-ahead workers."""

    link: LeanImage
    frame: int
    deltas: bool  # a DELTA_FRAME (read and parsed ahead), else a PAGE_FRAME (decompressed ahead)


class FrameWindow:
    """Frames in the order they will be read; the next AHEAD of them are decompressed on the
    read-ahead workers meanwhile (so decompression runs on all cores, not link after link on
    the caller's thread), never more at once."""

    AHEAD = 8

    def __init__(self, pool: ThreadPoolExecutor | None, order: list[FrameToRead], buffers: FrameBuffers | None = None):
        """``buffers``: PAGE_FRAMEs are decompressed into these (a forward pass's, which gives
        each back when done with it)."""
        self.pool = pool
        self.buffers = buffers
        self.pending = list(reversed(order)) if pool is not None else []
        self.step(self.AHEAD)

    def step(self, count: int = 1) -> None:
        """One more frame (or ``count``) handed to the workers."""
        while count and self.pending:
            link, frame, deltas = self.pending.pop()
            if deltas:
                link.frames.prefetch_deltas([frame], self.pool)
            else:
                link.frames.prefetch([frame], self.pool, False, self.buffers)
            count -= 1


def fill_frames(
    resolution: Resolution,
    first_page: int,
    count: int,
    want: np.ndarray,
    decompressed: Collection[tuple[int, int]] = (),
) -> list[FrameToRead]:
    """The STORED frames fill decompresses for the wanted pages of a range, in its order
    (those in ``decompressed``, (link index, frame), are decompressed already)."""
    stored = stored_pages(resolution)
    rows = np.flatnonzero(want & (resolution.base_class[first_page : first_page + count] == PageClass.STORED))
    order = []
    for group in stored.to_open(first_page, rows).tolist():
        link_index, frame = stored.frame_of(group)
        if (link_index, frame) not in decompressed:
            order.append(FrameToRead(resolution.links[link_index], frame, False))
    return order
