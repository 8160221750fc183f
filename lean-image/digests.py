"""The digest each page of an image must have (spec §6.5): stored in the DIGESTS records for
the digest-bearing pages (STORED, DISK, DELTA, and PARENT in a 1.0 image), implied for ZERO
pages, none for FREE pages, and, for a PARENT page of an image with INHERITED_DIGESTS (1.1),
inherited: the digest of the page in its *digest link*, the nearest link of the chain where the
page is not such a PARENT page (chain.resolve finds it for a whole region at once). A region's
DIGESTS records are read when its digests are first needed, and checked then (LI-DIG-003).
"""

from __future__ import annotations

import weakref

import numpy as np

from . import checks
from .checks import first_problem
from .errors import ChainError, LeanImageError
from .format import (
    DIGEST_SIZE, PageClass, digest_class_table, inherits_digests, page_digest, zero_page_digest,
)
from .tables import ImageTables, Region


class DigestStore:
    def __init__(self, tables: ImageTables, image=None):
        """``image``: the LeanImage these are the digests of, whose chain inherited digests
        come from (None: an image read without its chain)."""
        self.tables = tables
        # weak: the image holds this store, and a cycle would keep both (and their tables) until a
        # garbage collection, which numpy's allocations do not prompt
        self._image = weakref.ref(image) if image is not None else None
        self.page_size = tables.page_size
        self.inherits = inherits_digests(tables.header.incompatible_features)
        self._bearing_classes = digest_class_table(tables.header.incompatible_features)
        self._tables: dict[int, np.ndarray] = {}
        self._inherited_tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def table(self, region: Region) -> np.ndarray:
        """The stored digests of a region, (pages with digests, 16) uint8, in page order."""
        if region.region_id not in self._tables:
            try:
                records = self.tables.digest_records(region)
                first_problem(checks.digest_count_problems(region.extents, [
                    (r.parsed["first_page"], r.parsed["num_pages"], r.parsed["num_digests"], r, r.offset)
                    for r in records], self._bearing_classes, (region.digest_bearing, region.digest_rank0)))
            except LeanImageError as exc:      # in a chain, say which link's DIGESTS
                exc.path = exc.path or self.tables.file.name
                exc.args = (str(exc),)
                raise
            parts = [r.parsed["digests"] for r in records]
            self._tables[region.region_id] = np.concatenate(parts) if parts else np.zeros((0, DIGEST_SIZE), np.uint8)
        return self._tables[region.region_id]

    def expected_range(self, region: Region, first_page: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Classes of a range and the digest each page must have (zero rows for FREE)."""
        classes, expected = self.own_range(region, first_page, count)
        if self.inherits:
            rows = np.flatnonzero(classes == PageClass.PARENT)
            if len(rows):
                expected[rows] = self._inherited(region, first_page + rows)
        return classes, expected

    def own_range(self, region: Region, first_page: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """As expected_range, from this image alone: inherited digests are left zero."""
        lo, hi = region.extent_span(first_page, count)
        e = region.extents[lo:hi]
        sizes = e["num_pages"].astype(np.int64)
        skip = first_page - int(region.starts[lo])
        classes = np.repeat(e["page_class"].astype(np.uint8), sizes)[skip:skip + count]
        within = np.arange(count) + skip - np.repeat(np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes)[skip:skip + count]
        ranks = np.repeat(region.digest_rank0[lo:hi], sizes)[skip:skip + count] + within
        bearing = np.repeat(region.digest_bearing[lo:hi], sizes)[skip:skip + count]
        expected = np.zeros((count, DIGEST_SIZE), np.uint8)
        expected[bearing] = self.table(region)[ranks[bearing]]
        expected[classes == PageClass.ZERO] = np.frombuffer(zero_page_digest(self.page_size), np.uint8)
        return classes, expected

    def own_pages(self, region: Region, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Classes and own digests (as own_range) of scattered pages, by binary search: the
        cost grows with the pages asked for, not with the range they span."""
        pages = np.asarray(pages, np.int64)
        i = np.searchsorted(region.starts, pages, side="right") - 1
        classes = region.extents["page_class"][i].astype(np.uint8)
        bearing = region.digest_bearing[i]
        ranks = region.digest_rank0[i] + pages - region.starts[i]
        expected = np.zeros((len(pages), DIGEST_SIZE), np.uint8)
        expected[bearing] = self.table(region)[ranks[bearing]]
        expected[classes == PageClass.ZERO] = np.frombuffer(zero_page_digest(self.page_size), np.uint8)
        return classes, expected

    def _inherited(self, region: Region, pages: np.ndarray) -> np.ndarray:
        """The inherited digests of PARENT pages ``pages`` (ascending): each from its digest link."""
        image = self._image() if self._image is not None else None
        if image is None or image.parent is None:
            raise ChainError(f"region {region.name!r} page {int(pages[0])} is PARENT and inherits its digest "
                             "(format 1.1): it can be checked only with the parent chain (--parent)",
                             structure=f"region[{region.region_id}].page[{int(pages[0])}]")
        table, free_in = self._inherited_table(region, image)
        depths = free_in[pages]
        if (depths >= 0).any():
            depth = int(depths[depths >= 0].min())          # the nearest link where one is FREE
            first_problem(checks.inherited_digest_problems(region.region_id, region.name, pages[depths == depth],
                                                           image.resolution(region).links[depth].path))
        return table[pages]

    def _inherited_table(self, region: Region, image) -> tuple[np.ndarray, np.ndarray]:
        """Per page of the region, the digest its digest link holds for it, and that link's
        index where the page is FREE there (-1: not FREE): one pass over the links for the
        whole region, so reading it range by range costs no work per link and range."""
        if region.region_id not in self._inherited_tables:
            resolution = image.resolution(region)
            links = resolution.digest_link
            table = np.zeros((len(links), DIGEST_SIZE), np.uint8)
            free_in = np.full(len(links), -1, np.int32)
            order = np.argsort(links, kind="stable")
            depths, starts = np.unique(links[order], return_index=True)
            for depth, lo, hi in zip(depths.tolist(), starts.tolist(), [*starts[1:].tolist(), len(order)]):
                if depth <= 0:
                    continue
                pages = order[lo:hi]
                classes, table[pages] = resolution.links[depth].digests.own_pages(resolution.regions[depth], pages)
                free_in[pages[classes == PageClass.FREE]] = depth
            self._inherited_tables[region.region_id] = (table, free_in)
        return self._inherited_tables[region.region_id]

    def expected(self, region: Region, page: int) -> bytes | None:
        """The digest page ``page`` must have: stored, implied (ZERO), inherited or None (FREE)."""
        classes, expected = self.expected_range(region, page, 1)
        return None if classes[0] == PageClass.FREE else expected[0].tobytes()


def verify_rows(region: Region, first_page: int, rows: np.ndarray | None, got: np.ndarray, expected: np.ndarray,
                where: str = "") -> None:
    """Raise LI-DIG-002 for the first of pages ``first_page + rows`` whose digest (``got``)
    is not the one ``expected`` (both (n, 16), indexed by row; ``rows`` None: every row).
    The common case, all equal, costs one numpy comparison."""
    if rows is None:
        if np.array_equal(got, expected):
            return
        rows = np.arange(len(got))
    rows = np.asarray(rows, np.int64)
    first_problem(checks.digest_problems(region.region_id, region.name, first_page + rows, got[rows],
                                         expected[rows], where))


def verify_page(region: Region, page: int, data, expected: bytes | None) -> None:
    """One page's content against the digest it must have (None: a FREE page, anything goes)."""
    if expected is None:
        return
    got = np.frombuffer(page_digest(data), np.uint8).reshape(1, DIGEST_SIZE)
    verify_rows(region, page, np.zeros(1, np.int64), got, np.frombuffer(expected, np.uint8).reshape(1, DIGEST_SIZE))
