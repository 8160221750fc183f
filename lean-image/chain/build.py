"""A range of a resolved region built into one buffer (fill): its STORED bases copied from
their frames, its DISK bases read from the links' disks, its deltas applied (folded at once
in a forward pass, else a DELTA_FRAME at a time); and the built pages checked against the
digests of the image read (check_built), which cover the whole path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ..arrays import distinct, scatter_rows
from ..digests import verify_rows
from ..format import PageClass, row_digests
from .deltas import chain_patches
from .forward import FrameWindow, fill_frames, stored_pages
from .random_access import apply_deltas, fill_delta_frames
from .resolution import Resolution

if TYPE_CHECKING:
    from typing import Mapping

    from ..reader import LeanImage
    from ..tables import Region


def fill(
    resolution: Resolution,
    out: np.ndarray,
    first_page: int,
    count: int,
    want: np.ndarray | None = None,
    window: FrameWindow | None = None,
    decompressed: Mapping[tuple[int, int], memoryview] | None = None,
    forward: bool = False,
) -> None:
    """Write pages [first_page, first_page+count) of the resolved region into ``out``; with
    ``want`` (a mask over the range; it must include every page with deltas) only those;
    ``decompressed``: frames already decompressed, (link index, frame) -> content; ``forward``: the call is
    part of a forward pass over the region (a restore), whose deltas are folded at once."""
    stop = first_page + count
    classes = resolution.base_class[first_page:stop]
    want = np.ones(count, bool) if want is None else want
    if window is None:
        window = FrameWindow(
            resolution.links[0].frames.pool,
            fill_frames(resolution, first_page, count, want) + fill_delta_frames(resolution, first_page, count),
        )
    stored_pages(resolution).copy(
        out, first_page, count, np.flatnonzero(want & (classes == PageClass.STORED)), window, decompressed or {}
    )
    _fill_disk(resolution, out, first_page, count, np.flatnonzero(want & (classes == PageClass.DISK)))
    if forward:
        chain_patches(resolution).apply(out, first_page, stop)
    else:
        apply_deltas(resolution, out, first_page, count, window)


def _fill_disk(resolution: Resolution, out: np.ndarray, first_page: int, count: int, rows: np.ndarray) -> None:
    """Rows ``rows`` of the range, whose bases are DISK pages, read from each base link's disks."""
    links = resolution.base_link[first_page : first_page + count][rows]
    slots = resolution.base_slot[first_page : first_page + count][rows]
    for link_index in distinct(links).tolist():
        mine = links == link_index
        resolution.links[link_index].fill_disk_pages(
            resolution.regions[link_index], first_page, out, rows[mine], slots[mine].astype(np.int64)
        )


def check_built(
    image: LeanImage, region: Region, first_page: int, out: np.ndarray, rows: np.ndarray, expected: np.ndarray
) -> None:
    """Rows ``rows`` of ``out`` (pages first_page + row) against ``expected`` digests; the
    first that differs raises LI-DIG-002."""
    if not len(rows):
        return
    got = np.zeros(expected.shape, np.uint8)
    scatter_rows(got, rows, row_digests(out.reshape(-1, image.page_size), rows))
    verify_rows(region, first_page, rows, got, expected)
