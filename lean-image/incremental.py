"""Writing pages against a parent image: PARENT, DELTA or by content (spec §10).

Unchanged pages are found by digest alone, so the parent's page bytes are read only for
pages that changed (to encode a delta), never the whole parent.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .arrays import distinct
from .format import DIGEST_SIZE, PageClass, page_digest
from .reader import LeanImage
from .rules import implements
from .writer import LeanImageWriter, ParentLink


def parent_link(parent: LeanImage) -> ParentLink:
    return ParentLink(parent.header.image_uuid, parent.footer.image_digest)


class AgainstParent:
    """Feeds pages to ``writer``, each classified against the same page of ``parent``: unchanged
    pages PARENT, zero pages ZERO, runs of changed ones to ``changed`` (by default
    ``put_changed``; a converter with disks puts its disk lookup in front of it, so only pages
    changed since the parent are looked up on the disks)."""

    def __init__(self, writer: LeanImageWriter, parent: LeanImage | None):
        self.writer, self.parent = writer, parent
        self.counts: Counter = Counter()
        self._parent_regions = {r.name: r for r in parent.regions} if parent else {}
        self._names: dict[int, str] = {}
        self.changed = self.put_changed  # (region id, first page, data)

    @implements("LI-HNT-025")  # a page becomes PARENT only when its digest equals the parent's
    def put_pages(self, region_id: int, region_name: str, first_page: int, data) -> None:
        data = memoryview(data).cast("B")
        ps = self.writer.page_size
        count = len(data) // ps
        self._names[region_id] = region_name
        parent_region = self._parent_regions.get(region_name)
        if parent_region is None:
            self.changed(region_id, first_page, data)
            return
        assert self.parent is not None  # (parent regions are the parent's)
        within = max(0, min(count, parent_region.num_pages - first_page))
        words = np.frombuffer(data, np.uint64).reshape(count, ps // 8)
        nonzero: np.ndarray = np.any(words, axis=1)
        digests = np.zeros((count, DIGEST_SIZE), np.uint8)
        for i in np.flatnonzero(nonzero).tolist():
            digests[i] = np.frombuffer(page_digest(data[i * ps : (i + 1) * ps]), np.uint8)
        same = np.zeros(count, bool)
        if within:
            parent_classes, expected = self.parent.digests.expected_range(parent_region, first_page, within)
            same[:within] = (
                nonzero[:within] & (parent_classes != PageClass.FREE) & (digests[:within] == expected).all(axis=1)
            )
        for start, stop, kind in _runs(same, nonzero):
            if kind == "parent":
                self.writer.put_parent(region_id, first_page + start, digests[start:stop].tobytes())
                self.counts[PageClass.PARENT] += stop - start
            elif kind == "zero":
                self.writer.put_zero(region_id, first_page + start, stop - start)
                self.counts[PageClass.ZERO] += stop - start
            else:
                self.changed(region_id, first_page + start, data[start * ps : stop * ps])

    def put_changed(self, region_id: int, first_page: int, data) -> None:
        """Pages that differ from the parent's (of a region ``put_pages`` has seen): DELTA where
        the writer finds that smaller, else STORED (or ZERO: the writer's own test)."""
        data = memoryview(data).cast("B")
        parent_region = self._parent_regions.get(self._names[region_id])
        if parent_region is None:  # a region the parent has not: by content, as without a parent
            self.writer.put_pages(region_id, first_page, data)
            return
        if not self.writer.allow_delta:
            self.writer.put_pages(region_id, first_page, data)
            self.counts[PageClass.STORED] += len(data) // self.writer.page_size
            return
        assert self.parent is not None  # (parent regions are the parent's)
        ps = self.writer.page_size
        for i in range(len(data) // ps):
            page = first_page + i
            new = bytes(data[i * ps : (i + 1) * ps])
            if page < parent_region.num_pages:
                cls = self.writer.put_changed(region_id, page, self.parent.read_page(parent_region, page), new)
            else:
                self.writer.put_pages(region_id, page, new)
                cls = PageClass.STORED
            self.counts[cls] += 1


def _runs(same: np.ndarray, nonzero: np.ndarray):
    """(start, stop, kind) runs of 'parent', 'zero' and 'changed' pages."""
    kind = np.where(same, 0, np.where(nonzero, 2, 1))
    edges = np.flatnonzero(np.diff(kind)) + 1
    bounds = [0, *edges.tolist(), len(kind)]
    names = ("parent", "zero", "changed")
    for a, b in zip(bounds, bounds[1:]):
        yield a, b, names[int(kind[a])]


def rebase(
    image: LeanImage, dest, onto: LeanImage | None, *, allow_delta: bool = True, chunk_pages: int = 1024, progress=None
) -> Counter:
    """Write ``image``'s memory as a new image whose parent is ``onto`` (None: self-contained).

    flatten = rebase onto None; merge = rebase onto the grandparent. Source state is kept, and
    so are DISK references: a page whose bytes come, through the links folded away, from a
    DISK page of any of them stays a DISK reference (with that link's disk declared), so
    neither the disk nor those pages are read. ``progress`` is called with the bytes of guest
    memory done, chunk by chunk.
    """
    link = parent_link(onto) if onto is not None else None
    folded = image.chain()[: len(image.chain()) - (len(onto.chain()) if onto is not None else 0)]
    writer = LeanImageWriter(dest, page_size=image.page_size, parent=link, allow_delta=allow_delta and onto is not None)
    with writer:
        disk_ids = _declare_disks(writer, folded)
        if image.source_states:
            writer.declare_source_state()
        feeder = AgainstParent(writer, onto)
        regions = [(r, writer.add_region(r.name, r.size_bytes, r.guest_phys_base)) for r in image.regions]
        for state in image.source_states:
            writer.add_source_state(state.source_format, state.tag, state.data)
        for region, region_id in regions:
            on_disk = DiskBases(image, region, folded, disk_ids)
            for first in range(0, region.num_pages, chunk_pages):
                count = min(chunk_pages, region.num_pages - first)
                classes = on_disk.classes(first, image.classes(region, first, count))
                for a, b, cls in _class_runs(classes, (PageClass.FREE, PageClass.DISK)):
                    if cls == PageClass.FREE:
                        writer.put_free(region_id, first + a, b - a)
                    elif cls == PageClass.DISK:
                        on_disk.copy(writer, region_id, first + a, b - a)
                    else:
                        feeder.put_pages(
                            region_id, region.name, first + a, image.region_bytes(region, first + a, b - a)
                        )
                        continue
                    feeder.counts[PageClass(cls)] += b - a
                if progress is not None:
                    progress(count * image.page_size)
    return feeder.counts


def _declare_disks(writer: LeanImageWriter, links: list) -> dict:
    """Declare the disks of ``links`` in ``writer``, once per name: {(depth, disk id): new id}.
    A disk whose name an earlier link gave to a disk of another size or fingerprint is left
    out (a disk table names each disk once): its pages are read instead."""
    known: dict = {}  # name -> (size, fingerprint, new id)
    ids: dict = {}
    for depth, link in enumerate(links):
        for d in link.disks:
            identity = (d.size_bytes, bytes(d.fingerprint))
            if d.name not in known:
                known[d.name] = (*identity, writer.add_disk(d.name, d.size_bytes, d.fingerprint))
            if known[d.name][:2] == identity:
                ids[depth, d.disk_id] = known[d.name][2]
    return ids


class DiskBases:
    """The pages of one region whose bytes, through the folded links, are a DISK page of one of
    them with no delta above it: they are written as that DISK reference."""

    def __init__(self, image: LeanImage, region, folded: list, disk_ids: dict):
        n = region.num_pages
        self.link = np.full(n, -1, np.int64)
        self.slot = np.zeros(n, np.int64)
        self.new_id = np.full(n, -1, np.int64)
        if not disk_ids:
            self.resolution = None
            return
        res = self.resolution = image.resolution(region)
        candidate = (res.base_class == PageClass.DISK) & (res.base_link < len(folded))
        candidate[res.delta_pages] = False
        pages = np.flatnonzero(candidate)
        depths, slots = res.base_link[pages], res.base_slot[pages]
        new_ids = np.full(len(pages), -1, np.int64)
        for depth in distinct(depths).tolist():
            at = depths == depth
            old = res.links[depth].tables.disk_refs.disk_ids[slots[at]].astype(np.int64)
            new_ids[at] = _map_ids(old, depth, disk_ids)
        keep = pages[new_ids >= 0]
        self.link[keep], self.slot[keep] = depths[new_ids >= 0], slots[new_ids >= 0]
        self.new_id[keep] = new_ids[new_ids >= 0]

    def classes(self, first: int, classes: np.ndarray) -> np.ndarray:
        """``classes`` of pages [first, first+len) with DISK where the bytes are a disk's."""
        on_disk = self.link[first : first + len(classes)] >= 0
        return np.where(on_disk, PageClass.DISK, classes).astype(classes.dtype)

    def copy(self, writer: LeanImageWriter, region_id: int, first: int, count: int) -> None:
        assert self.resolution is not None  # (DISK pages exist only where disks were declared)
        pages = np.arange(first, first + count)
        links, slots = self.link[pages], self.slot[pages]
        sectors = np.zeros(count, np.int64)
        digests = np.zeros((count, DIGEST_SIZE), np.uint8)
        for depth in distinct(links).tolist():
            at = np.flatnonzero(links == depth)
            link, region = self.resolution.links[depth], self.resolution.regions[depth]
            sectors[at] = link.tables.disk_refs.sectors[slots[at]]
            lo, hi = int(pages[at[0]]), int(pages[at[-1]]) + 1
            _, expected = link.digests.expected_range(region, lo, hi - lo)
            digests[at] = expected[pages[at] - lo]
        writer.put_disks(region_id, pages, self.new_id[pages], sectors, digests)


def _map_ids(old: np.ndarray, depth: int, disk_ids: dict) -> np.ndarray:
    mapped = np.full(len(old), -1, np.int64)
    for (d, old_id), new_id in disk_ids.items():
        if d == depth:
            mapped[old == old_id] = new_id
    return mapped


def _class_runs(classes: np.ndarray, kept: tuple):
    """(start, stop, class) runs where a class in ``kept`` stands alone and any other class
    is reported as -1 (pages whose bytes are needed)."""
    key = np.where(np.isin(classes, kept), classes.astype(np.int64), -1)
    edges = np.flatnonzero(np.diff(key)) + 1
    bounds = [0, *edges.tolist(), len(key)]
    for a, b in zip(bounds, bounds[1:]):
        yield a, b, int(key[a])
