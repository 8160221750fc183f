"""The digest each page of an image must have (spec §6.5): stored in the DIGESTS records for
STORED, DISK, PARENT and DELTA pages, implied for ZERO pages, none for FREE pages. A region's
DIGESTS records are read when its digests are first needed, and checked then (LI-DIG-003).
"""

from __future__ import annotations

import numpy as np

from . import checks
from .checks import first_problem
from .format import DIGEST_SIZE, PageClass, page_digest, zero_page_digest
from .tables import ImageTables, Region


class DigestStore:
    def __init__(self, tables: ImageTables):
        self.tables = tables
        self.page_size = tables.page_size
        self._tables: dict[int, np.ndarray] = {}

    def table(self, region: Region) -> np.ndarray:
        """The stored digests of a region, (pages with digests, 16) uint8, in page order."""
        if region.region_id not in self._tables:
            records = self.tables.digest_records(region)
            first_problem(checks.digest_count_problems(region.extents, [
                (r.parsed["first_page"], r.parsed["num_pages"], r.parsed["num_digests"], r, r.offset)
                for r in records]))
            parts = [r.parsed["digests"] for r in records]
            self._tables[region.region_id] = np.concatenate(parts) if parts else np.zeros((0, DIGEST_SIZE), np.uint8)
        return self._tables[region.region_id]

    def expected_range(self, region: Region, first_page: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Classes of a range and the digest each page must have (zero rows for FREE)."""
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

    def expected(self, region: Region, page: int) -> bytes | None:
        """The digest page ``page`` must have: stored, implied (ZERO) or None (FREE)."""
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
