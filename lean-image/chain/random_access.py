"""Random access to a resolved region (region_bytes, read_page, a post-copy serve's faults):
the deltas that apply are turned into word patches one DELTA_FRAME at a time, each built
once and applied range by range (DeltaPatches), where a forward pass folds them all at once
(deltas.ChainPatches).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..arrays import distinct
from .deltas import apply_checked
from .forward import FrameToRead, FrameWindow
from .resolution import Resolution, frame_key, frame_keys, split_frame_key


def delta_patches(resolution: Resolution) -> DeltaPatches:
    """The deltas of ``resolution`` that apply, as word patches per DELTA_FRAME (built on first use)."""
    if resolution.patches is None:
        resolution.patches = DeltaPatches(resolution)
    return resolution.patches


class FramePatch(NamedTuple):
    """The entries of one DELTA_FRAME that apply (DeltaPatches._build)."""

    word_pages: np.ndarray  # plain INDEX_LIST entries' words: their page, ascending
    word_at: np.ndarray  # the word in its page
    values: np.ndarray  # its value
    slow_pages: np.ndarray  # pages of the other entries (the checked path), ascending
    slow_entries: np.ndarray  # their entry in the frame
    last_page: int  # the highest page the frame patches


class DeltaPatches:
    """The delta entries of a resolved region that apply (above their page's base), a
    DELTA_FRAME at a time turned once into word patches: INDEX_LIST entries as (page, word,
    value) arrays sorted by page, any other entry kept to go through the fully checked path.
    A range applies its slice of each frame's patch (deepest link first), so a frame whose
    entries spread over the whole region is parsed and indexed once, not once per range."""

    def __init__(self, resolution: Resolution):
        self.resolution = resolution
        keys = frame_keys(resolution.delta_links, resolution.delta_frames)
        self.order = np.argsort(keys, kind="stable")  # pages ascend within a frame
        self.keys, starts = np.unique(keys[self.order], return_index=True)
        self.bounds = np.append(starts, len(keys))
        self.patches: dict[tuple[int, int], FramePatch] = {}

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
            apply_checked(
                self.resolution.links[link_index], frame, out, slow_pages[lo:hi] - first_page, slow_entries[lo:hi], ps
            )
        if last_page < stop:  # no later range of a forward pass needs it
            del self.patches[key]

    def _build(self, link_index: int, frame: int) -> FramePatch:
        group = int(np.searchsorted(self.keys, frame_key(link_index, frame)))
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
        return FramePatch(
            np.repeat(pages[fast], counts), positions[at], values[at], pages[~fast], k[~fast], int(pages[-1])
        )


def _delta_groups(resolution: Resolution, first_page: int, stop: int) -> list[tuple[int, int]]:
    """The (link, DELTA_FRAME) pairs holding deltas of pages [first_page, stop), deepest link
    first (a page's deltas apply from the deepest link up; one link has at most one per page,
    so its frames' order does not matter)."""
    lo, hi = (int(x) for x in np.searchsorted(resolution.delta_pages, [first_page, stop]))
    top = len(resolution.links) - 1
    keys = distinct(frame_keys(top - resolution.delta_links[lo:hi].astype(np.int64), resolution.delta_frames[lo:hi]))
    return [(top - depth, frame) for depth, frame in map(split_frame_key, keys.tolist())]


def apply_deltas(resolution: Resolution, out: np.ndarray, first_page: int, count: int, window: FrameWindow) -> None:
    """The deltas of pages [first_page, first_page+count) applied to ``out``, a DELTA_FRAME at a time."""
    patches = delta_patches(resolution)
    stop = first_page + count
    for link_index, frame in _delta_groups(resolution, first_page, stop):
        if not patches.built(link_index, frame):
            window.step()
        patches.apply(link_index, frame, out, first_page, stop)


def fill_delta_frames(resolution: Resolution, first_page: int, count: int) -> list[FrameToRead]:
    """The DELTA_FRAMEs fill applies for a range, in its order (deepest link first)."""
    patches = delta_patches(resolution)
    return [
        FrameToRead(resolution.links[link_index], frame, True)
        for link_index, frame in _delta_groups(resolution, first_page, first_page + count)
        if not patches.built(link_index, frame)
    ]
