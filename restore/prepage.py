"""Prepaging orders for `leanimg serve --postcopy`: which pages to push while the guest runs.

A strategy hands out runs of pages that must travel (neither ZERO nor FREE) and were not sent
yet, in its order; the server marks what it sends (``Block.sent``) and tells the strategy of
every fault.

- none:        nothing is pushed; pages travel only when the destination asks for them.
- sequential:  every block in stream order, pages ascending.
- bubble:      the "bubbling" of Hines, Deshpande, Gopalan, Post-Copy Live Migration of
               Virtual Machines: pages are pushed outwards from the latest fault,
               alternately forward and backward, so the pages around what the guest
               touches now come next; without a fault (or once a bubble reaches both
               ends of its block) sequential.
- disk-sorted: as sequential, but DISK pages last, in ascending order of their disk blocks
               (one pass over each disk, neighbours read together).
"""

from __future__ import annotations

import numpy as np

from leanimg.arrays import distinct
from leanimg.format import PageClass

STRATEGIES = ("none", "sequential", "bubble", "disk-sorted")
WINDOW = 4096  # pages looked at per step when searching for unsent ones


def make_strategy(name: str, image, blocks):
    if name == "none":
        return Nothing()
    if name == "sequential":
        return Ordered(blocks, [(b, np.flatnonzero(~b.blank)) for b in blocks])
    if name == "bubble":
        return Bubble(blocks)
    if name == "disk-sorted":
        return Ordered(blocks, _disk_sorted_order(image, blocks))
    raise ValueError(f"unknown prepaging strategy {name!r}")


class Nothing:
    exhausted = True

    def fault(self, block, page: int) -> None:
        pass

    def next_runs(self, limit: int) -> list:
        return []


class Ordered:
    """Pages in a fixed order: ``order`` is [(block, page numbers)], taken one after another."""

    def __init__(self, blocks, order):
        self.blocks = blocks
        self.block_of = np.concatenate([np.zeros(0, np.int32)] + [np.full(len(p), b.index, np.int32) for b, p in order])
        self.page_of = np.concatenate([np.zeros(0, np.int64)] + [p.astype(np.int64) for _, p in order])
        self.cursor = 0

    @property
    def exhausted(self) -> bool:
        return self.cursor >= len(self.page_of)

    def fault(self, block, page: int) -> None:
        pass

    def next_runs(self, limit: int) -> list:
        picked_blocks, picked_pages = [], []
        want = limit
        while want and not self.exhausted:
            hi = min(len(self.page_of), self.cursor + WINDOW)
            bs, ps = self.block_of[self.cursor : hi], self.page_of[self.cursor : hi]
            unsent = np.ones(len(ps), bool)
            for index in distinct(bs).tolist():
                mine = bs == index
                unsent[mine] = ~self.blocks[index].sent[ps[mine]]
            chosen = np.flatnonzero(unsent)[:want]
            picked_blocks.append(bs[chosen])
            picked_pages.append(ps[chosen])
            want -= len(chosen)
            self.cursor = hi if want else self.cursor + int(chosen[-1]) + 1
        if not picked_pages:
            return []
        return runs(self.blocks, np.concatenate(picked_blocks), np.concatenate(picked_pages))


class Bubble:
    """Outwards from the latest fault, alternately forward and backward; else sequential."""

    def __init__(self, blocks):
        self.blocks = blocks
        self.fallback = Ordered(blocks, [(b, np.flatnonzero(~b.blank)) for b in blocks])
        self.block = None
        self.forward = self.backward = 0

    @property
    def exhausted(self) -> bool:
        return self.block is None and self.fallback.exhausted

    def fault(self, block, page: int) -> None:
        self.block, self.forward, self.backward = block, page + 1, page - 1

    def next_runs(self, limit: int) -> list:
        while self.block is not None:
            pages = self._around(max(1, limit // 2))
            if len(pages):
                return runs(self.blocks, np.full(len(pages), self.last_block.index, np.int32), pages)
        return self.fallback.next_runs(limit)

    def _around(self, half: int) -> np.ndarray:
        """Up to ``half`` unsent pages behind the bubble and ``half`` ahead of it, ascending;
        moves both edges (by a window where there are none) and ends the bubble at both ends."""
        block = self.block
        todo = ~block.blank & ~block.sent
        ahead = np.flatnonzero(todo[self.forward : self.forward + WINDOW])[:half] + self.forward
        lo = max(0, self.backward - WINDOW + 1)
        behind = (np.flatnonzero(todo[lo : self.backward + 1])[::-1][:half] + lo)[::-1]
        self.forward = int(ahead[-1]) + 1 if len(ahead) == half else self.forward + WINDOW
        self.backward = int(behind[0]) - 1 if len(behind) == half else lo - 1
        if self.forward >= len(todo) and self.backward < 0:
            self.block = None
        self.last_block = block
        return np.concatenate([behind, ahead])


def _disk_sorted_order(image, blocks):
    """Sequential order of every block's pages but its DISK pages; then the DISK pages of all
    blocks by (disk, sector)."""
    order, disk_keys, disk_pages = [], [], []
    refs = image.tables.disk_refs
    for b in blocks:
        disk = b.classes == PageClass.DISK
        order.append((b, np.flatnonzero(~b.blank & ~disk)))
        pages = np.flatnonzero(disk)
        if len(pages):
            slots = image.page_slots(b.region, 0, len(b.classes))[pages]
            key = refs.disk_ids[slots].astype(np.uint64) << np.uint64(48) | refs.sectors[slots].astype(np.uint64)
            disk_keys.append(key)
            disk_pages.append((b, pages))
    if disk_pages:
        keys = np.concatenate(disk_keys)
        block_of = np.concatenate([np.full(len(p), b.index) for b, p in disk_pages])
        page_of = np.concatenate([p for _, p in disk_pages])
        sorted_rows = np.argsort(keys, kind="stable")
        for b in blocks:
            mine = sorted_rows[block_of[sorted_rows] == b.index]
            if len(mine):
                order.append((b, page_of[mine]))
    return order


def runs(blocks, block_of: np.ndarray, page_of: np.ndarray) -> list:
    """(block, first page, count) for each run of consecutive pages of one block."""
    if not len(page_of):
        return []
    breaks = np.flatnonzero((np.diff(block_of) != 0) | (np.diff(page_of) != 1)) + 1
    bounds = [0, *breaks.tolist(), len(page_of)]
    return [(blocks[int(block_of[lo])], int(page_of[lo]), hi - lo) for lo, hi in zip(bounds, bounds[1:])]
