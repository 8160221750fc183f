"""The rules that span records (spec §5-§8, §10), each implemented once.

Every function here is a generator of findings (FormatError and its kin) over plain data:
parsed records, extent tables, index entries. The reader raises the first finding of each
(``first_problem``) when it opens or uses an image; ``leanimg validate`` reports them all.
Rules about one record alone are in structures.py, the delta-entry rules in delta.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Iterator

import numpy as np

from .arrays import distinct
from .errors import ChainError, DiskError, FormatError, LimitError
from .format import (
    HAS_DIGEST,
    IS_PAGE_CLASS,
    DISK_BODY,
    DISK_NAME_MAX,
    DISK_SECTOR_SIZE,
    DISKS_MAX,
    INDEX_BODY,
    INDEX_ENTRY,
    NO_KEY,
    RECORD,
    REGION_BODY,
    REGION_NAME_MAX,
    REGIONS_MAX,
    IncompatFeature,
    PageClass,
    RecordType,
)
from .rules import implements
from .structures import Record, record_path


def first_problem(problems: Iterable) -> None:
    """Raise the first finding, if any (what the reader does with every check)."""
    for problem in problems:
        raise problem


# --- region and disk tables (spec §5) -------------------------------------------
@implements("LI-REG-001")
def region_table_problems(records: list[Record]) -> Iterator[FormatError]:
    """Region ids and names unique; names 1-255 bytes of UTF-8."""
    yield from _table_problems(records, "region_id", REGION_BODY, REGION_NAME_MAX, REGIONS_MAX, "LI-REG-001")


@implements("LI-DSK-001")
def disk_table_problems(records: list[Record]) -> Iterator[FormatError]:
    """Disk ids and names unique; names 1-255 bytes of UTF-8."""
    yield from _table_problems(records, "disk_id", DISK_BODY, DISK_NAME_MAX, DISKS_MAX, "LI-DSK-001")


def _table_problems(
    records, id_field: str, structure, name_max: int, count_max: int, rule: str
) -> Iterator[FormatError]:
    ids, names = set(), set()
    if len(records) > count_max:
        yield LimitError(
            f"{len(records)} {structure.name[:-5]}s exceed this reader's limit {count_max}",
            offset=records[count_max].offset,
            structure=records[count_max].path(),
        )
    for record in records:
        p = record.parsed
        raw = bytes(record.body[structure.size : structure.size + p["name_length"]])
        if not 1 <= len(raw) <= name_max:
            yield record.error(
                rule, f"expected a name of 1..{name_max} bytes, got {p['name_length']}", structure.size, "name"
            )
            continue
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            yield record.error(rule, f"expected UTF-8 name, got invalid byte at {exc.start}", structure.size, "name")
            continue
        if p[id_field] in ids or p["name"] in names:
            yield record.error(
                rule, f"{id_field.split('_')[0]} id {p[id_field]} or name {p['name']!r} already declared", 0, id_field
            )
        ids.add(p[id_field])
        names.add(p["name"])


def record_references(record: Record) -> tuple[int, tuple[int, ...]]:
    """(record type, ids) for the order rule: the id a REGION or DISK declares, the region a
    PAGE_MAP or DIGESTS refers to, the disks of a DISK_REFS."""
    p, kind = record.parsed or {}, record.record_type  # {}: a record of no known type
    if kind == RecordType.REGION:
        return kind, (p["region_id"],)
    if kind == RecordType.DISK:
        return kind, (p["disk_id"],)
    if kind in (RecordType.PAGE_MAP, RecordType.DIGESTS):
        return kind, (p["region_id"],)
    if kind == RecordType.DISK_REFS:
        return kind, tuple(int(d) for d in distinct(p["refs"]["disk_id"]))
    return kind, ()


@implements("LI-REC-009")
def reference_order_problems(items: Iterable[tuple[int, int, int, tuple]]) -> Iterator[FormatError]:
    """A REGION or DISK record precedes every record that refers to it. ``items`` are
    (record type, position in file order, record offset, ids: record_references) in file order."""
    regions: set[int] = set()
    disks: set[int] = set()
    for kind, index, offset, ids in items:
        if kind == RecordType.REGION:
            regions.update(ids)
        elif kind == RecordType.DISK:
            disks.update(ids)
        elif kind in (RecordType.PAGE_MAP, RecordType.DIGESTS):
            if ids[0] not in regions:
                yield FormatError(
                    f"region {ids[0]} not declared by an earlier REGION record",
                    offset=offset + RECORD.size,
                    structure=record_path(index, field="region_id", record_type=kind),
                    rule="LI-REC-009",
                )
        elif kind == RecordType.DISK_REFS:
            unknown = sorted(set(ids) - disks)
            if unknown:
                yield FormatError(
                    f"refers to disk {unknown[0]} not declared by an earlier DISK record",
                    offset=offset + RECORD.size,
                    structure=record_path(index, field="refs", record_type=kind),
                    rule="LI-REC-009",
                )


# --- page maps, frames and slots (spec §6) ----------------------------------------
@implements("LI-MAP-001")
def coverage_problems(region_id: int, name: str, num_pages: int, extents: np.ndarray) -> Iterator[FormatError]:
    """The extents of a region cover it exactly once: from page 0, contiguous, to its end."""
    where = f"region[{region_id}] {name!r}.page_map"
    if len(extents) == 0:
        yield FormatError("no PAGE_MAP record", structure=where, rule="LI-MAP-001")
        return
    first = extents["first_page"].astype(np.int64)
    ends = first + extents["num_pages"].astype(np.int64)
    gaps = np.flatnonzero(first[1:] != ends[:-1])
    if first[0] != 0 or len(gaps) or ends[-1] != num_pages:
        at = int(gaps[0]) + 1 if len(gaps) else 0
        yield FormatError(
            f"expected extents covering pages 0..{num_pages} contiguously; extent {at} "
            f"starts at {int(first[at])}, last ends at {int(ends[-1])}",
            structure=where,
            rule="LI-MAP-001",
        )


@implements("LI-FRM-001")
def numbering_problems(name: str, firsts, counts, offsets) -> Iterator[FormatError]:
    """PAGE_FRAMEs (DELTA_FRAMEs) number their pages (entries) contiguously from 0 in file
    order; ``offsets`` are the records' file offsets."""
    yield from _contiguous(name, firsts, counts, offsets, "LI-FRM-001")


def _contiguous(name: str, firsts, counts, offsets, rule: str) -> Iterator[FormatError]:
    # u64 fields: as uint64, where a lying count wraps (and so mismatches) instead of overflowing
    firsts, counts = np.asarray(firsts, np.uint64), np.asarray(counts, np.uint64)
    expected = np.concatenate((np.zeros(1, np.uint64), np.cumsum(counts)[:-1])) if len(counts) else counts
    for k in np.flatnonzero(firsts != expected)[:20].tolist():
        yield FormatError(
            f"{name} {k}: expected first {int(expected[k])}, got {int(firsts[k])}",
            offset=int(offsets[k]) + RECORD.size,
            structure=f"{name}[{k}]",
            rule=rule,
        )


@implements("LI-MAP-004")
def slot_problems(
    extents: list[np.ndarray], stored: int, deltas: int, ref_firsts, ref_counts, ref_offsets
) -> Iterator[FormatError]:
    """Every stored ordinal, disk reference and delta entry is used by exactly one page of one
    region (``extents``: every region's page map); DISK_REFS records number their references
    contiguously from 0."""
    yield from _contiguous("disk_refs", ref_firsts, ref_counts, ref_offsets, "LI-MAP-004")
    references = int(np.sum(ref_counts)) if len(ref_counts) else 0
    laid = (
        extents[0]
        if len(extents) == 1
        else np.concatenate(extents)
        if extents
        else np.zeros(0, [("page_class", "<u2"), ("first_slot", "<u8"), ("num_pages", "<u8")])
    )
    columns = laid["page_class"], laid["first_slot"], laid["num_pages"]
    for cls, available, what in (
        (PageClass.STORED, stored, "stored ordinal"),
        (PageClass.DISK, references, "disk reference"),
        (PageClass.DELTA, deltas, "delta entry"),
    ):
        used = _slots_used(columns, cls)
        if isinstance(used, int):  # slots 0..used-1, each used once
            if used != available:
                k = min(used, available)
                yield _slot_finding(used, available, what, k)
            continue
        wrong = used != np.arange(len(used))
        if len(used) != available or wrong.any():
            k = int(np.flatnonzero(wrong)[0]) if wrong.any() else min(len(used), available)
            yield _slot_finding(len(used), available, what, k)


def _slot_finding(used: int, available: int, what: str, k: int) -> FormatError:
    return FormatError(
        f"{used} pages use {what}s and {available} exist; each must be used "
        f"exactly once (first mismatch at {what} {k})",
        structure="page_map",
        rule="LI-MAP-004",
    )


def _slots_used(columns: tuple, cls: int) -> np.ndarray | int:
    """The slots the pages of class ``cls`` use, sorted, or their number when they are
    0, 1, ... each once: work per extent, not per page, when the extents' slot ranges follow
    each other (the usual case, in file order or sorted). ``columns``: the extents'
    page_class, first_slot and num_pages."""
    classes, first_slots, num_pages = columns
    sel = classes == cls
    if not sel.any():
        return 0
    starts, counts = first_slots[sel].astype(np.int64), num_pages[sel].astype(np.int64)
    if not _follow_on(starts, counts):
        order = np.argsort(starts, kind="stable")
        starts, counts = starts[order], counts[order]
    if _follow_on(starts, counts):
        return int(counts.sum())  # each slot of 0..sum-1 used once
    return np.sort(
        np.repeat(starts - np.cumsum(np.concatenate(([0], counts[:-1]))), counts) + np.arange(int(counts.sum()))
    )


def _follow_on(starts: np.ndarray, counts: np.ndarray) -> bool:
    """Slot ranges [start, start + count) that tile 0.. without gap or overlap, in this order."""
    return starts[0] == 0 and bool((starts[1:] == starts[:-1] + counts[:-1]).all())


@implements("LI-HDR-009", "LI-MAP-005")
def feature_problems(header, classes: Counter) -> Iterator[FormatError]:
    """The DISK and DELTA incompatible bits are set when such pages exist; PARENT and DELTA
    pages appear only in an image with a parent. ``classes``: pages per class."""
    bits = header.incompatible_features
    for cls, bit in ((PageClass.DISK, IncompatFeature.DISK), (PageClass.DELTA, IncompatFeature.DELTA)):
        if classes[cls] and not bits & bit:
            yield FormatError(
                f"{cls.name} pages without the {bit.name} incompatible bit",
                offset=16,
                structure="header.incompatible_features",
                rule="LI-HDR-009",
            )
    if (classes[PageClass.PARENT] or classes[PageClass.DELTA]) and not header.has_parent:
        yield FormatError(
            f"{classes[PageClass.PARENT]} PARENT and {classes[PageClass.DELTA]} DELTA "
            "pages in an image without a parent",
            offset=56,
            structure="header.parent_uuid",
            rule="LI-MAP-005",
        )


def class_counts(extents: list[np.ndarray]) -> Counter:
    """Pages per class over extent tables (classes outside the spec counted by number)."""
    counts: Counter = Counter()
    for e in extents:
        pages = np.bincount(e["page_class"], weights=e["num_pages"], minlength=len(PageClass) + 1)
        for cls in np.flatnonzero(pages).tolist():
            counts[PageClass(cls) if IS_PAGE_CLASS[cls] else cls] += int(pages[cls])
    return counts


# --- digests (spec §6.5) ------------------------------------------------------------
@implements("LI-DIG-001")
def digest_coverage_problems(
    region_id: int, name: str, num_pages: int, parts: list[tuple[int, int, Record | None, int]]
) -> Iterator[FormatError]:
    """A region's DIGESTS records cover each of its pages once, in page order. ``parts``:
    (first_page, num_pages, record or None, record offset) in file order."""
    covered = 0
    for first, count, record, offset in parts:
        if first != covered:
            yield FormatError(
                f"expected first_page {covered}, got {first}",
                offset=offset + RECORD.size + 8,
                structure=record.path("first_page") if record else f"region[{region_id}].digests",
                rule="LI-DIG-001",
            )
        covered = first + count
    if covered != num_pages:
        yield FormatError(
            f"digests cover {covered} of {num_pages} pages",
            structure=f"region[{region_id}] {name!r}.digests",
            rule="LI-DIG-001",
        )


def digest_ranks(extents: np.ndarray, bearing_classes: np.ndarray = HAS_DIGEST) -> tuple[np.ndarray, np.ndarray]:
    """Per extent: whether its pages have stored digests, and how many digests precede it.
    ``bearing_classes``: the image's digest-bearing classes (format.digest_class_table)."""
    bearing = bearing_classes[extents["page_class"]]
    counts = np.where(bearing, extents["num_pages"].astype(np.int64), 0)
    rank0 = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts
    return bearing, rank0


def digests_before(extents: np.ndarray, bearing: np.ndarray, rank0: np.ndarray, pages) -> np.ndarray:
    """For each page number (0 up to the region's end), how many pages before it have stored digests."""
    pages = np.asarray(pages, np.int64)
    starts = extents["first_page"].astype(np.int64)
    i = np.maximum(np.searchsorted(starts, pages, side="right") - 1, 0)
    within = np.minimum(pages - starts[i], extents["num_pages"][i].astype(np.int64))
    return rank0[i] + np.where(bearing[i], within, 0)


@implements("LI-DIG-003")
def digest_count_problems(
    extents: np.ndarray,
    parts: list[tuple[int, int, int, Record | None, int]],
    bearing_classes: np.ndarray = HAS_DIGEST,
    ranks=None,
) -> Iterator[FormatError]:
    """num_digests of each DIGESTS record equals the digest-bearing pages of its range (STORED,
    DISK, DELTA, and PARENT unless the image inherits them: ``bearing_classes``).
    ``parts``: (first_page, num_pages, num_digests, record or None, record offset); ``ranks``:
    digest_ranks(extents, bearing_classes) if the caller has them."""
    bearing, rank0 = ranks if ranks is not None else digest_ranks(extents, bearing_classes)
    for first, count, num_digests, record, offset in parts:
        lo, hi = digests_before(extents, bearing, rank0, [first, first + count])
        if num_digests != int(hi - lo):
            yield FormatError(
                f"pages {first}..{first + count} have {int(hi - lo)} pages with stored digests, "
                f"num_digests is {num_digests}",
                offset=offset + RECORD.size + 4,
                structure=record.path("num_digests") if record else "digests.num_digests",
                rule="LI-DIG-003",
            )


@implements("LI-DIG-002")
def digest_problems(
    region_id: int, name: str, pages: np.ndarray, got: np.ndarray, expected: np.ndarray, where: str = ""
) -> Iterator[FormatError]:
    """Each page has the digest its table gives: ``got`` and ``expected`` are (n, 16) rows of
    pages ``pages`` of a region; ``where`` says where the content came from."""
    bad = np.flatnonzero((got != expected).any(axis=1))
    for k in bad.tolist():
        page = int(pages[k])
        yield FormatError(
            f"region {name!r} page {page}{where}: content digest {bytes(got[k]).hex()} differs "
            f"from recorded {bytes(expected[k]).hex()}",
            structure=f"region[{region_id}].page[{page}]",
            rule="LI-DIG-002",
        )


@implements("LI-CHN-006")
def inherited_digest_problems(
    region_id: int, name: str, free_pages: np.ndarray, link_path: str
) -> Iterator[ChainError]:
    """A PARENT page that inherits its digest (format 1.1) finds a digest down the chain:
    ``free_pages`` are such pages whose digest link (``link_path``) has them FREE."""
    for page in free_pages[:1].tolist():
        yield ChainError(
            f"region {name!r} page {page} is PARENT without a stored digest (INHERITED_DIGESTS), "
            f"and the page is FREE in {link_path}: it has no digest to inherit",
            structure=f"region[{region_id}].page[{page}]",
            rule="LI-CHN-006",
        )


# --- disk references (spec §6.4) ------------------------------------------------------
@implements("LI-DSK-003")
def disk_ref_problems(
    disk_sizes: dict[int, int], refs: np.ndarray, page_size: int, record_offset: int, path: str
) -> Iterator[FormatError]:
    """Each reference names a disk of the disk table and its page lies within that disk."""
    limit = np.array([disk_sizes.get(int(d), -1) for d in refs["disk_id"]], np.float64)
    ends = refs["sector"].astype(np.float64) * DISK_SECTOR_SIZE + page_size  # no u64 overflow
    for k in np.flatnonzero(ends > limit)[:20].tolist():
        yield FormatError(
            f"reference to disk {int(refs['disk_id'][k])} sector {int(refs['sector'][k])}: "
            "no such disk, or the page runs past its end",
            offset=record_offset + RECORD.size + 16 + 16 * k,
            structure=f"{path}.refs[{k}]",
            rule="LI-DSK-003",
        )


@implements("LI-DSK-005")
def disk_content_problems(
    region_id: int, name: str, pages: np.ndarray, got: np.ndarray, expected: np.ndarray, disk: str, sectors: np.ndarray
) -> Iterator[DiskError]:
    """The page-sized run of a disk at a referenced sector has the page's digest: ``got`` the
    digests of what was read for ``pages``, ``expected`` theirs."""
    for k in np.flatnonzero((got != expected).any(axis=1)).tolist():
        yield DiskError(
            f"region {name!r} page {int(pages[k])}: disk {disk!r} sector {int(sectors[k])} does not "
            "hold the page recorded at checkpoint (disk changed since?)",
            rule="LI-DSK-005",
            structure=f"region[{region_id}].page[{int(pages[k])}]",
        )


# --- index (spec §8.1) -----------------------------------------------------------------
def index_entry_of(record: Record, page_size: int) -> tuple[int, int, int, int, int]:
    """(record_offset, record_type, key, first, count): the INDEX entry of a parsed record."""
    return (record.offset, record.record_type, *_index_fields(record, page_size))


def _index_fields(record: Record, page_size: int) -> tuple[int, int, int]:
    p, kind = record.parsed or {}, record.record_type  # {}: a record of no known type
    if kind == RecordType.REGION:
        return p["region_id"], 0, p["size_bytes"] // page_size
    if kind == RecordType.DISK:
        return p["disk_id"], 0, p["size_bytes"] // DISK_SECTOR_SIZE
    if kind == RecordType.SOURCE_STATE:
        return p["tag"], p["sequence"], len(p["data"])
    if kind == RecordType.PAGE_FRAME:
        return NO_KEY, p["first_ordinal"], p["num_pages"]
    if kind == RecordType.DELTA_FRAME:
        return NO_KEY, p["first_delta"], p["num_deltas"]
    if kind == RecordType.DISK_REFS:
        return NO_KEY, p["first_ref"], p["num_refs"]
    if kind == RecordType.PAGE_MAP:
        e = p["extents"]
        return p["region_id"], int(e["first_page"][0]) if len(e) else 0, int(e["num_pages"].astype(np.int64).sum())
    if kind == RecordType.DIGESTS:
        return p["region_id"], p["first_page"], p["num_pages"]
    return NO_KEY, 0, 0


@implements("LI-IDX-001")
def index_problems(
    index: Record | None,
    listed: np.ndarray | None,
    found: list,
    *,
    first_entry: int = 0,
    header_length: int | None = None,
    complete: bool = False,
    after_index: list | None = None,
    footer_offset: int | None = None,
) -> Iterator[FormatError]:
    """The INDEX is the last record and lists every other record, in file order, with its
    offset, type, key, first and count.

    ``found``: (index_entry_of the record, or None where it could not be parsed; its end
    offset) for the records of entries ``first_entry``.. of ``listed``; with ``header_length`` the entries must also
    ascend from there; with ``complete`` ``found`` is every record before the INDEX, and
    ``after_index`` the records a scan found behind it. ``index`` None: a scan found none
    (``footer_offset`` says where it ended)."""
    if index is None:
        yield FormatError("no INDEX record", offset=footer_offset, structure="footer", rule="LI-IDX-001")
        return
    assert listed is not None  # the entries of the INDEX given
    entry_at = index.body_offset + INDEX_BODY.size
    offsets = listed["record_offset"].astype(np.int64)
    if header_length is not None and len(offsets) and (offsets[0] != header_length or (np.diff(offsets) <= 0).any()):
        yield FormatError(
            "expected index entries ascending from header_length",
            offset=entry_at,
            structure=index.path("entries"),
            rule="LI-IDX-001",
        )
    for record in after_index or []:
        yield FormatError(
            "a record follows the INDEX record", offset=record.offset, structure=record.path(), rule="LI-IDX-001"
        )
    for k, (want, end) in enumerate(found, first_entry):
        if k >= len(listed):
            break
        got = tuple(int(x) for x in listed[k])
        if want is not None and got != want:
            yield _entry_error(index, k, f"expected {want}, got {got}")
        following = int(offsets[k + 1]) if k + 1 < len(offsets) else index.offset
        if end is not None and following != end:
            yield _entry_error(index, k, f"the record ends at {end:#x}, the next listed one starts at {following:#x}")
    if complete and len(found) + first_entry != len(listed):
        yield FormatError(
            f"{len(listed)} entries for {len(found)} records",
            offset=index.offset,
            structure=index.path("entries"),
            rule="LI-IDX-001",
        )


def _entry_error(index: Record, k: int, problem: str) -> FormatError:
    """A finding of index_problems about the INDEX's entry ``k``."""
    return FormatError(
        f"entry {k}: {problem}",
        offset=index.body_offset + INDEX_BODY.size + INDEX_ENTRY.size * k,
        structure=index.path(f"entries[{k}]"),
        rule="LI-IDX-001",
    )


@implements("LI-SRC-001")
def source_sequence_problems(sequences: list[tuple[int, Record]]) -> Iterator[FormatError]:
    """SOURCE_STATE sequence numbers count up from 0 in file order."""
    for k, (sequence, record) in enumerate(sequences):
        if sequence != k:
            yield record.error("LI-SRC-001", f"expected sequence {k}, got {sequence}", 8, "sequence")
