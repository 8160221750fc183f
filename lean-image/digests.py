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
from .arrays import gather_rows, joined, scatter_rows
from .checks import first_problem
from .errors import ChainError, LeanImageError
from .format import (
    DIGEST_SIZE,
    DIGESTS_BODY,
    RECORD,
    RECORD_BODY_MAX,
    RECORD_TRAILER,
    PageClass,
    RecordType,
    checksum64,
    digest_class_table,
    inherits_digests,
    page_digest,
    record_size,
    zero_page_digest,
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
                fields = [r.fields for r in records]
                first_problem(
                    checks.digest_count_problems(
                        region.extents,
                        [
                            (p["first_page"], p["num_pages"], p["num_digests"], r, r.offset)
                            for p, r in zip(fields, records)
                        ],
                        self._bearing_classes,
                        (region.digest_bearing, region.digest_rank0),
                    )
                )
            except LeanImageError as exc:  # in a chain, say which link's DIGESTS
                exc.path = exc.path or self.tables.file.name
                exc.args = (str(exc),)
                raise
            parts = [p["digests"] for p in fields]
            self._tables[region.region_id] = np.concatenate(parts) if parts else np.zeros((0, DIGEST_SIZE), np.uint8)
        return self._tables[region.region_id]

    def has_table(self, region: Region) -> bool:
        """Whether the stored digests of ``region`` were read already (``table`` gives them)."""
        return region.region_id in self._tables

    def keep_table(self, region: Region, table: np.ndarray) -> None:
        """``table``, the stored digests of ``region`` read and checked elsewhere (read_tables,
        with other links'), as ``table`` would give them."""
        self._tables[region.region_id] = table

    def expected_range(self, region: Region, first_page: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Classes of a range and the digest each page must have (zero rows for FREE)."""
        classes, expected = self.own_range(region, first_page, count)
        if self.inherits:
            rows = np.flatnonzero(classes == PageClass.PARENT)
            if len(rows):
                scatter_rows(expected, rows, self._inherited(region, first_page + rows))
        return classes, expected

    def own_range(self, region: Region, first_page: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """As expected_range, from this image alone: inherited digests are left zero."""
        lo, hi = region.extent_span(first_page, count)
        e = region.extents[lo:hi]
        sizes = e["num_pages"].astype(np.int64)
        skip = first_page - int(region.starts[lo])
        classes = np.repeat(e["page_class"].astype(np.uint8), sizes)[skip : skip + count]
        within = (
            np.arange(count)
            + skip
            - np.repeat(np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes)[skip : skip + count]
        )
        ranks = np.repeat(region.digest_rank0[lo:hi], sizes)[skip : skip + count] + within
        bearing = np.repeat(region.digest_bearing[lo:hi], sizes)[skip : skip + count]
        expected = np.zeros((count, DIGEST_SIZE), np.uint8)
        scatter_rows(expected, bearing, gather_rows(self.table(region), ranks[bearing]))
        expected[classes == PageClass.ZERO] = np.frombuffer(zero_page_digest(self.page_size), np.uint8)
        return classes, expected

    def _inherited(self, region: Region, pages: np.ndarray) -> np.ndarray:
        """The inherited digests of PARENT pages ``pages`` (ascending): each from its digest link."""
        image = self._image() if self._image is not None else None
        if image is None or image.parent is None:
            raise ChainError(
                f"region {region.name!r} page {int(pages[0])} is PARENT and inherits its digest "
                "(format 1.1): it can be checked only with the parent chain (--parent)",
                structure=f"region[{region.region_id}].page[{int(pages[0])}]",
            )
        table, free_in = self._inherited_table(region, image)
        depths = free_in[pages]
        if (depths >= 0).any():
            depth = int(depths[depths >= 0].min())  # the nearest link where one is FREE
            first_problem(
                checks.inherited_digest_problems(
                    region.region_id, region.name, pages[depths == depth], image.resolution(region).links[depth].path
                )
            )
        return gather_rows(table, pages)

    def _inherited_table(self, region: Region, image) -> tuple[np.ndarray, np.ndarray]:
        """Per page of the region, the digest its digest link holds for it, and that link's
        index where the page is FREE there (-1: not FREE): one vectorised pass over the
        digest links found by chain.resolve (class and digest rank per page) and their stored
        digests laid end to end, so reading it range by range costs no work per link and range."""
        if region.region_id not in self._inherited_tables:
            resolution = image.resolution(region)
            links = resolution.digest_link
            table = np.zeros((len(links), DIGEST_SIZE), np.uint8)
            free_in = np.full(len(links), -1, np.int32)
            pages = np.flatnonzero(links > 0)
            if len(pages):
                depth_of = links[pages]
                depths = np.flatnonzero(np.bincount(depth_of))  # the digest links, ascending
                stored, bases = read_tables(
                    [resolution.links[d].digests for d in depths.tolist()],
                    [resolution.regions[d] for d in depths.tolist()],
                )
                ranks, classes = resolution.digest_rank[pages], resolution.digest_class[pages]
                bearing = ranks >= 0
                base_of = np.zeros(int(depths[-1]) + 1, np.int64)  # digest link -> its first row in stored
                base_of[depths] = bases
                scatter_rows(table, pages[bearing], gather_rows(stored, base_of[depth_of[bearing]] + ranks[bearing]))
                table[pages[classes == PageClass.ZERO]] = np.frombuffer(zero_page_digest(self.page_size), np.uint8)
                free = classes == PageClass.FREE
                free_in[pages[free]] = depth_of[free]
            self._inherited_tables[region.region_id] = (table, free_in)
        return self._inherited_tables[region.region_id]

    def expected(self, region: Region, page: int) -> bytes | None:
        """The digest page ``page`` must have: stored, implied (ZERO), inherited or None (FREE)."""
        classes, expected = self.expected_range(region, page, 1)
        return None if classes[0] == PageClass.FREE else expected[0].tobytes()


def verify_rows(
    region: Region, first_page: int, rows: np.ndarray | None, got: np.ndarray, expected: np.ndarray, where: str = ""
) -> None:
    """Raise LI-DIG-002 for the first of pages ``first_page + rows`` whose digest (``got``)
    is not the one ``expected`` (both (n, 16), indexed by row; ``rows`` None: every row).
    The common case, all equal, costs one numpy comparison."""
    if rows is None:
        if np.array_equal(got, expected):
            return
        rows = np.arange(len(got))
    rows = np.asarray(rows, np.int64)
    first_problem(
        checks.digest_problems(region.region_id, region.name, first_page + rows, got[rows], expected[rows], where)
    )


def verify_page(region: Region, page: int, data, expected: bytes | None) -> None:
    """One page's content against the digest it must have (None: a FREE page, anything goes)."""
    if expected is None:
        return
    got = np.frombuffer(page_digest(data), np.uint8).reshape(1, DIGEST_SIZE)
    verify_rows(region, page, np.zeros(1, np.int64), got, np.frombuffer(expected, np.uint8).reshape(1, DIGEST_SIZE))


# a DIGESTS record's header and its body's fixed part
_DIGESTS_HEAD = np.dtype(RECORD.dtype.descr + DIGESTS_BODY.dtype.descr)


def read_tables(stores: list[DigestStore], regions: list[Region]) -> tuple[np.ndarray, np.ndarray]:
    """The stored digests of region ``regions[k]`` of each store, as DigestStore.table gives
    them one by one, laid end to end, and the row where each store's begin. The DIGESTS records of all
    are read (one read each) and their rules tested together; a store whose records pass is
    given its table, any other reads its own through DigestStore.table, in order, which raises
    its finding (the same as when each was read alone)."""
    for k, parts in enumerate(_records_pass(stores, regions)):
        if parts is not None and not stores[k].has_table(regions[k]):
            stores[k].keep_table(
                regions[k],
                parts[0]
                if len(parts) == 1
                else np.concatenate(parts)
                if parts
                else np.zeros((0, DIGEST_SIZE), np.uint8),
            )
    tables = [store.table(region) for store, region in zip(stores, regions)]
    lengths = np.array([len(t) for t in tables], np.int64)
    return np.concatenate(tables), np.cumsum(lengths) - lengths


def _records_pass(stores: list[DigestStore], regions: list[Region]) -> list:
    """Per store: its region's digest rows (one array per DIGESTS record) if every rule
    DigestStore.table checks holds for them (in its plain case), else None. The rules: the
    record's framing, checksum and flags (LI-REC-002/003/005), padding (LI-REC-004), body
    length (LI-REC-007), the INDEX entry it fills (LI-IDX-001) and num_digests (LI-DIG-003)."""
    raws, owners, entries = [], [], []
    usable = np.ones(len(stores), bool)
    for k, (store, region) in enumerate(zip(stores, regions)):
        if store.has_table(region):
            continue  # read before: table() has it
        tables = store.tables
        for position in tables.digest_positions.get(region.region_id, []):
            raw = tables.listed_bytes(position, record_size(RECORD_BODY_MAX))
            if raw is None or len(raw) < RECORD.size + DIGESTS_BODY.size + RECORD_TRAILER.size:
                usable[k] = False  # read alone, which raises its finding
                continue
            raws.append(raw)
            owners.append(k)
            entries.append(tables.entries[position : position + 1])
    if not raws:
        return [[] if ok else None for ok in usable]
    owner = np.array(owners, np.int64)
    head = np.frombuffer(b"".join(raw[: _DIGESTS_HEAD.itemsize] for raw in raws), _DIGESTS_HEAD)
    sizes = np.array([len(raw) for raw in raws], np.int64)
    entry = joined(entries)
    body = head["body_length"].astype(np.int64)
    num_pages = head["num_pages"].astype(np.int64)
    first_page = head["first_page"].astype(np.int64)
    limits = np.array([r.num_pages for r in regions], np.int64)[owner]
    ok = (
        (head["record_type"] == RecordType.DIGESTS)
        & (head["flags"] == 0)
        & (body == DIGESTS_BODY.size + DIGEST_SIZE * head["num_digests"].astype(np.int64))
        & (sizes == RECORD.size + body + RECORD_TRAILER.size)
        & (num_pages >= 1)
        & (head["num_digests"] <= head["num_pages"])
        & (entry["record_type"] == RecordType.DIGESTS)
        & (entry["key"] == head["region_id"])
        & (entry["first"] == head["first_page"])
        & (entry["count"] == head["num_pages"])
        & (head["first_page"] < limits)
        & (head["num_pages"] <= limits)
        & (first_page + num_pages <= limits)
    )
    trailers = np.frombuffer(b"".join(raw[-RECORD_TRAILER.size :] for raw in raws), "<u8")
    sums = np.array([checksum64(memoryview(raw)[: -RECORD_TRAILER.size]) for raw in raws], np.uint64)
    ok &= trailers == sums
    ok &= _bearing_between(regions, owner, first_page, first_page + num_pages, ok) == head["num_digests"]
    usable &= np.bincount(owner[~ok], minlength=len(stores)) == 0
    parts: list = [[] for _ in stores]
    for k, raw, n in zip(owner.tolist(), raws, head["num_digests"].tolist()):
        if usable[k]:
            start = RECORD.size + DIGESTS_BODY.size
            parts[k].append(np.frombuffer(raw, np.uint8, n * DIGEST_SIZE, start).reshape(-1, DIGEST_SIZE))
    return [p if ok_k else None for p, ok_k in zip(parts, usable.tolist())]


def _bearing_between(
    regions: list[Region], owner: np.ndarray, starts: np.ndarray, ends: np.ndarray, ok: np.ndarray
) -> np.ndarray:
    """Per DIGESTS record (of region regions[owner]): the pages with stored digests in
    [start, end) (checks.digests_before), where ``ok`` (elsewhere: -1). A record covering its
    whole region, the usual case, takes the region's total without a search."""
    totals = np.array(
        [
            int(r.digest_rank0[-1]) + (int(r.extents["num_pages"][-1]) if r.digest_bearing[-1] else 0)
            if len(r.extents)
            else 0
            for r in regions
        ],
        np.int64,
    )
    pages = np.array([r.num_pages for r in regions], np.int64)
    counts = np.where(ok & (starts == 0) & (ends == pages[owner]), totals[owner], -1)
    for k in np.flatnonzero(ok & (counts < 0)).tolist():
        r = regions[owner[k]]
        lo, hi = checks.digests_before(r.extents, r.digest_bearing, r.digest_rank0, [starts[k], ends[k]])
        counts[k] = hi - lo
    return counts
