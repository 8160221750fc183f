"""Strict conformance check of one image (spec/conformance.md).

Unlike the reader, which stops at the first problem, ``validate`` scans every
record in file order and collects findings, each with rule id, byte offset and
structure path. Memory stays bounded by one record plus per-page bookkeeping.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import xxhash
import zstandard

from . import delta as deltacodec
from .errors import LeanImageError, LimitError
from .format import (
    DIGEST_SIZE, DISK_SECTOR_SIZE, IncompatFeature, PageClass, RecordType, page_digests,
)
from .reader import LeanImage, decompress_frame
from .structures import (
    ImageFile, bearing_before, extent_ranks, Record, body_problems, header_problems, parse_body, read_footer, read_header, read_record,
    read_record_header, record_path,
)

FINDINGS_PER_RULE = 20


@dataclass
class Finding:
    rule: str
    offset: int | None
    structure: str
    message: str

    def __str__(self) -> str:
        where = f"offset {self.offset:#x}" if self.offset is not None else "offset -"
        return f"{self.rule} {where} {self.structure}: {self.message}"


@dataclass
class Report:
    path: str
    findings: list[Finding] = field(default_factory=list)
    suppressed: Counter = field(default_factory=Counter)
    checked: Counter = field(default_factory=Counter)
    not_checked: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.findings

    def add(self, error: LeanImageError) -> None:
        rule = error.rule or ("reader-limit" if isinstance(error, LimitError) else "io")
        if sum(1 for f in self.findings if f.rule == rule) >= FINDINGS_PER_RULE:
            self.suppressed[rule] += 1
            return
        self.findings.append(Finding(rule, error.offset, error.structure or "", error.message))

    def to_json(self) -> dict:
        return dict(path=self.path, valid=self.valid, findings=[asdict(f) for f in self.findings],
                    suppressed=dict(self.suppressed), checked=dict(self.checked), not_checked=self.not_checked)


@dataclass
class _Scan:
    """What the sequential pass collected."""
    records: list = field(default_factory=list)          # (offset, type, key, first, count)
    regions: dict = field(default_factory=dict)          # region_id -> parsed region
    disks: dict = field(default_factory=dict)            # disk_id -> parsed disk
    maps: dict = field(default_factory=dict)             # region_id -> [extents]
    digests: dict = field(default_factory=dict)          # region_id -> [(first_page, digests)]
    refs: list = field(default_factory=list)
    frames: list = field(default_factory=list)           # (index, record offset, parsed)
    delta_frames: list = field(default_factory=list)
    sequences: list = field(default_factory=list)
    index: Record | None = None
    index_position: int | None = None
    covered: set = field(default_factory=set)


def validate(path, *, disks: dict | None = None, parents=()) -> Report:
    """Check ``path`` against every rule of format v1.0 that its inputs allow."""
    path = os.fspath(path)
    report = Report(path)
    try:
        fileobj = open(path, "rb")
    except OSError as exc:
        report.add(LeanImageError(f"cannot open: {exc.strerror}"))
        return report
    with fileobj:
        _validate_file(ImageFile(fileobj, path), report, disks or {}, list(parents))
    return report


def _validate_file(image: ImageFile, report: Report, disks: dict, parents: list) -> None:
    try:
        header = read_header(image)
    except LeanImageError as exc:
        report.add(exc)
        return
    for problem in header_problems(header):
        report.add(problem)
    page_size = header.page_size if header.page_size in (1 << k for k in range(12, 17)) else 4096
    try:
        footer = read_footer(image, header.header_length)
    except LeanImageError as exc:
        report.add(exc)
        footer = None
    limit = footer.offset if footer else image.size
    listed = _listed_offsets(image, footer, page_size)
    scan = _scan_records(image, header.header_length, limit, page_size, report, listed)
    if footer:
        _check_footer(image, footer, scan, report)
    _check_tables(header, scan, page_size, report)
    _check_content(image, header, scan, page_size, report, disks, parents)


# --- sequential pass ---------------------------------------------------------------
def _listed_offsets(image: ImageFile, footer, page_size: int) -> list[int]:
    """Record offsets the INDEX lists (plus its own), when footer and INDEX are readable."""
    if footer is None:
        return []
    try:
        index = read_record(image, footer.index_offset, footer.offset)
        entries = parse_body(index)["entries"] if index.record_type == RecordType.INDEX else []
    except LeanImageError:
        return []
    return sorted({int(o) for o in entries["record_offset"]} | {footer.index_offset}) if len(entries) else []


def _scan_records(image: ImageFile, start: int, limit: int, page_size: int, report: Report,
                  listed: list[int]) -> _Scan:
    scan = _Scan()
    offset, i = start, 0
    while offset < limit:
        try:
            record = read_record(image, offset, limit, i)
        except LeanImageError as exc:
            following = [o for o in listed if o > offset]
            if listed and offset not in listed and following:
                report.add(LeanImageError(f"bytes {offset:#x}..{following[0]:#x} belong to no record: the "
                                          f"index lists the next record at {following[0]:#x}", offset=offset,
                                          structure=record_path(i), rule="LI-REC-001"))
                offset = following[0]
                continue
            report.add(exc)
            end = _skip(image, offset, limit, i)
            if end is None:
                return scan
            offset, i = end, i + 1
            continue
        report.checked["records"] += 1
        try:
            parse_body(record, i)
        except LeanImageError as exc:
            report.add(exc)
            offset, i = record.end, i + 1
            continue
        for problem in body_problems(record, i, page_size):
            report.add(problem)
        _collect(record, i, scan, report, page_size)
        offset, i = record.end, i + 1
    return scan


def _skip(image: ImageFile, offset: int, limit: int, i: int) -> int | None:
    """After a bad record whose framing is sound, where the next one starts."""
    try:
        _, _, body_length = read_record_header(image, offset, limit, i)
    except LeanImageError:
        return None
    return offset + 16 + ((body_length + 7) & ~7) + 8


def _collect(record: Record, i: int, scan: _Scan, report: Report, page_size: int) -> None:
    p, kind = record.parsed, record.record_type
    key, first, count = 0xFFFF_FFFF, 0, 0
    if kind == RecordType.INDEX:
        scan.index, scan.index_position = record, i
        return
    if scan.index is not None:
        report.add(LeanImageError("a record follows the INDEX record", offset=record.offset,
                                  structure=record_path(i, record), rule="LI-IDX-001"))
    if kind == RecordType.REGION:
        _unique(scan.regions, p["region_id"], p["name"], record, i, "LI-REG-001", report)
        scan.regions[p["region_id"]] = p
        key, count = p["region_id"], p["size_bytes"] // page_size
    elif kind == RecordType.DISK:
        _unique(scan.disks, p["disk_id"], p["name"], record, i, "LI-DSK-001", report)
        scan.disks[p["disk_id"]] = p
        key, count = p["disk_id"], p["size_bytes"] // DISK_SECTOR_SIZE
    elif kind == RecordType.SOURCE_STATE:
        scan.sequences.append((p["sequence"], record, i))
        key, first, count = p["tag"], p["sequence"], len(p["data"])
    elif kind == RecordType.PAGE_FRAME:
        scan.frames.append((i, record.offset, _without_frame(p)))
        first, count = p["first_ordinal"], p["num_pages"]
    elif kind == RecordType.DELTA_FRAME:
        scan.delta_frames.append((i, record.offset, _without_frame(p)))
        first, count = p["first_delta"], p["num_deltas"]
    elif kind == RecordType.DISK_REFS:
        unknown = sorted(set(int(d) for d in np.unique(p["refs"]["disk_id"])) - set(scan.disks))
        if unknown:
            report.add(LeanImageError(f"refers to disk {unknown[0]} not declared by an earlier DISK record",
                                      offset=record.offset + 32, structure=record_path(i, record, "refs"),
                                      rule="LI-REC-009"))
        scan.refs.append((i, record, p))
        first, count = p["first_ref"], p["num_refs"]
    elif kind == RecordType.PAGE_MAP:
        _declared(scan.regions, p["region_id"], record, i, report)
        scan.maps.setdefault(p["region_id"], []).append(p["extents"])
        key = p["region_id"]
        first = int(p["extents"]["first_page"][0]) if len(p["extents"]) else 0
        count = int(p["extents"]["num_pages"].astype(np.int64).sum())
    elif kind == RecordType.DIGESTS:
        _declared(scan.regions, p["region_id"], record, i, report)
        scan.digests.setdefault(p["region_id"], []).append((p["first_page"], p["digests"], record, i))
        key, first, count = p["region_id"], p["first_page"], p["num_pages"]
    scan.records.append((record.offset, record.record_type, key, first, count))


def _without_frame(parsed: dict) -> dict:
    """The fields of a frame record without its frame: the scan must not hold every frame."""
    return {k: v for k, v in parsed.items() if k != "frame"}


def _unique(table: dict, ident: int, name: str, record, i, rule, report) -> None:
    if ident in table or any(t["name"] == name for t in table.values()):
        report.add(LeanImageError(f"id {ident} or name {name!r} already declared", offset=record.offset,
                                  structure=record_path(i, record), rule=rule))


def _declared(regions: dict, region_id: int, record, i, report) -> None:
    if region_id not in regions:
        report.add(LeanImageError(f"region {region_id} not declared by an earlier REGION record",
                                  offset=record.offset + 16, structure=record_path(i, record, "region_id"),
                                  rule="LI-REC-009"))


# --- footer and index ------------------------------------------------------------------
def _check_footer(image: ImageFile, footer, scan: _Scan, report: Report) -> None:
    hasher = xxhash.xxh3_128()
    image.fileobj.seek(0)
    remaining = footer.offset
    while remaining:
        chunk = image.fileobj.read(min(remaining, 8 << 20))
        hasher.update(chunk)
        remaining -= len(chunk)
    if hasher.digest() != footer.image_digest:
        report.add(LeanImageError(f"expected image_digest {hasher.digest().hex()}, got {footer.image_digest.hex()}",
                                  offset=footer.offset + 24, structure="footer.image_digest", rule="LI-FTR-004"))
    if scan.index is None:
        report.add(LeanImageError("no INDEX record", offset=footer.offset, structure="footer",
                                  rule="LI-IDX-001"))
        return
    if scan.index.offset != footer.index_offset:
        report.add(LeanImageError(f"expected index_offset {scan.index.offset:#x}, got {footer.index_offset:#x}",
                                  offset=footer.offset + 8, structure="footer.index_offset", rule="LI-FTR-005"))
    entries = scan.index.parsed["entries"]
    listed = [tuple(int(x) for x in e) for e in entries]
    if listed != scan.records:
        k = next((j for j, (a, b) in enumerate(zip(listed, scan.records)) if a != b),
                 min(len(listed), len(scan.records)))
        got = listed[k] if k < len(listed) else "nothing"
        want = scan.records[k] if k < len(scan.records) else "nothing"
        report.add(LeanImageError(f"entry {k}: expected {want}, got {got} "
                                  f"({len(listed)} entries for {len(scan.records)} records)",
                                  offset=scan.index.offset + 24 + 32 * k,
                                  structure=f"record[{scan.index_position}].index.entries[{k}]", rule="LI-IDX-001"))


# --- cross-record tables ---------------------------------------------------------------
def _check_tables(header, scan: _Scan, page_size: int, report: Report) -> None:
    extents = {}
    for region_id, region in scan.regions.items():
        parts = scan.maps.get(region_id, [])
        e = np.concatenate(parts) if parts else np.zeros(0, dtype=[("first_page", "<u8")])
        covered = _check_coverage(region, e, page_size, report)
        if covered:
            extents[region_id] = e
        _check_digest_tables(region, scan.digests.get(region_id, []), e if covered else None, page_size, report)
    scan.covered = set(extents)
    all_extents = list(extents.values())
    classes = Counter()
    for e in all_extents:
        for cls, n in zip(e["page_class"], e["num_pages"]):
            classes[int(cls)] += int(n)
    report.checked["pages"] = sum(classes.values())
    if len(extents) == len(scan.regions):   # slot use is only meaningful over complete page maps
        _check_all_slots(all_extents, scan, report)
    _check_numbering([f[2]["first_ordinal"] for f in scan.frames], [f[2]["num_pages"] for f in scan.frames],
                     [f[1] for f in scan.frames], "page_frame", report)
    _check_numbering([f[2]["first_delta"] for f in scan.delta_frames],
                     [f[2]["num_deltas"] for f in scan.delta_frames], [f[1] for f in scan.delta_frames],
                     "delta_frame", report)
    _check_numbering([r[2]["first_ref"] for r in scan.refs], [r[2]["num_refs"] for r in scan.refs],
                     [r[1].offset for r in scan.refs], "disk_refs", report, rule="LI-MAP-004")
    _check_features(header, classes, report)
    _check_refs(scan, page_size, report)
    for k, (sequence, record, i) in enumerate(scan.sequences):
        if sequence != k:
            report.add(LeanImageError(f"expected sequence {k}, got {sequence}", offset=record.offset + 24,
                                      structure=record_path(i, record, "sequence"), rule="LI-SRC-001"))


def _check_all_slots(all_extents: list, scan: "_Scan", report: Report) -> None:
    _check_slots(all_extents, PageClass.STORED, sum(f[2]["num_pages"] for f in scan.frames), "stored ordinal", report)
    _check_slots(all_extents, PageClass.DISK, sum(r[2]["num_refs"] for r in scan.refs), "disk reference", report)
    _check_slots(all_extents, PageClass.DELTA, sum(f[2]["num_deltas"] for f in scan.delta_frames),
                 "delta entry", report)


def _check_coverage(region: dict, e: np.ndarray, page_size: int, report: Report) -> bool:
    """Whether the extents cover the region exactly (only then may they be expanded per page)."""
    num_pages = region["size_bytes"] // page_size
    where = f"region[{region['region_id']}] {region['name']!r}.page_map"
    if len(e) == 0:
        report.add(LeanImageError("no PAGE_MAP record", structure=where, rule="LI-MAP-001"))
        return False
    first = e["first_page"].astype(np.int64)
    ends = first + e["num_pages"].astype(np.int64)
    gaps = np.flatnonzero(first[1:] != ends[:-1])
    if first[0] != 0 or len(gaps) or ends[-1] != num_pages:
        at = int(gaps[0]) + 1 if len(gaps) else 0
        report.add(LeanImageError(f"expected extents covering pages 0..{num_pages} contiguously; extent {at} "
                                  f"starts at {int(first[at])}, last ends at {int(ends[-1])}",
                                  structure=where, rule="LI-MAP-001"))
        return False
    return True


def _check_digest_tables(region: dict, parts: list, e: np.ndarray | None, page_size: int, report: Report) -> None:
    num_pages = region["size_bytes"] // page_size
    covered, in_order = 0, True
    for first, digests, record, i in parts:
        if first != covered:
            report.add(LeanImageError(f"expected first_page {covered}, got {first}", offset=record.offset + 24,
                                      structure=record_path(i, record, "first_page"), rule="LI-DIG-001"))
            in_order = False
        covered = first + record.parsed["num_pages"]
        in_order = in_order and covered <= num_pages
    if covered != num_pages:
        report.add(LeanImageError(f"digests cover {covered} of {num_pages} pages",
                                  structure=f"region[{region['region_id']}] {region['name']!r}.digests",
                                  rule="LI-DIG-001"))
    if e is None or covered != num_pages or not in_order:
        return
    bearing, rank0 = extent_ranks(e)
    for first, digests, record, i in parts:
        bounds = np.array([first, first + record.parsed["num_pages"]], np.int64)
        lo, hi = bearing_before(e, bearing, rank0, np.minimum(bounds, num_pages - 1))
        hi += int(bounds[1] >= num_pages and bearing[-1])
        expected = int(hi - lo)
        if len(digests) != expected:
            report.add(LeanImageError(f"pages {first}..{int(bounds[1])} have {expected} pages with stored digests, "
                                      f"num_digests is {len(digests)}", offset=record.offset + 20,
                                      structure=record_path(i, record, "num_digests"), rule="LI-DIG-003"))


def _slot_users(extents: list, cls: int) -> np.ndarray:
    parts = []
    for e in extents:
        sel = e[e["page_class"] == cls]
        if len(sel):
            counts = sel["num_pages"].astype(np.int64)
            starts = sel["first_slot"].astype(np.int64)
            parts.append(np.repeat(starts - np.cumsum(np.concatenate(([0], counts[:-1]))), counts)
                         + np.arange(int(counts.sum())))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _check_slots(extents: list, cls: int, available: int, what: str, report: Report) -> None:
    used = np.sort(_slot_users(extents, cls))
    if len(used) != available or (len(used) and (used != np.arange(available)).any()):
        k = int(np.flatnonzero(used != np.arange(len(used)))[0]) if len(used) and \
            (used != np.arange(len(used))).any() else min(len(used), available)
        report.add(LeanImageError(f"{len(used)} pages use {what}s and {available} exist; each must be used "
                                  f"exactly once (first mismatch at {what} {k})", structure="page_map",
                                  rule="LI-MAP-004"))


def _check_numbering(firsts, counts, offsets, name, report, rule="LI-FRM-001") -> None:
    expected = 0
    for k, (first, count, offset) in enumerate(zip(firsts, counts, offsets)):
        if first != expected:
            report.add(LeanImageError(f"expected first {expected}, got {first}", offset=offset + 16,
                                      structure=f"{name}[{k}]", rule=rule))
        expected = first + count


def _check_features(header, classes: Counter, report: Report) -> None:
    bits = header.incompatible_features
    if classes[PageClass.DISK] and not bits & IncompatFeature.DISK:
        report.add(LeanImageError("DISK pages without the DISK incompatible bit", offset=16,
                                  structure="header.incompatible_features", rule="LI-HDR-009"))
    if classes[PageClass.DELTA] and not bits & IncompatFeature.DELTA:
        report.add(LeanImageError("DELTA pages without the DELTA incompatible bit", offset=16,
                                  structure="header.incompatible_features", rule="LI-HDR-009"))
    if (classes[PageClass.PARENT] or classes[PageClass.DELTA]) and not header.has_parent:
        report.add(LeanImageError(f"{classes[PageClass.PARENT]} PARENT and {classes[PageClass.DELTA]} DELTA "
                                  "pages in an image without a parent", offset=56,
                                  structure="header.parent_uuid", rule="LI-MAP-005"))


def _check_refs(scan: _Scan, page_size: int, report: Report) -> None:
    sizes = {disk_id: d["size_bytes"] for disk_id, d in scan.disks.items()}
    for i, record, p in scan.refs:
        refs = p["refs"]
        limit = np.array([sizes.get(int(d), -1) for d in refs["disk_id"]], np.float64)
        ends = refs["sector"].astype(np.float64) * DISK_SECTOR_SIZE + page_size   # no u64 overflow
        for k in np.flatnonzero(ends > limit)[:FINDINGS_PER_RULE].tolist():
            report.add(LeanImageError(f"reference to disk {int(refs['disk_id'][k])} sector {int(refs['sector'][k])}: "
                                      "no such disk, or the page runs past its end", offset=record.offset + 32 + 16 * k,
                                      structure=record_path(i, record, f"refs[{k}]"), rule="LI-DSK-003"))


# --- content: frames, deltas, disks, parent ------------------------------------------------
def _check_content(image: ImageFile, header, scan: _Scan, page_size: int, report: Report,
                   disks: dict, parents: list) -> None:
    tables = _digest_lookup(scan, page_size)
    if tables is None:
        return
    _check_frames(image, scan, page_size, tables, report)
    _note_unchecked(header, scan, disks, parents, report)
    lean = _open_for_chain(image.name, header, disks, parents, report)
    if lean is None:
        _check_delta_structure(image, scan, page_size, report)
        return
    with lean:
        _check_resolved(lean, tables, report)


def _digest_lookup(scan: _Scan, page_size: int):
    """Per region: (region, extents, stored digests, rank of each extent); None when maps are broken."""
    tables = {}
    for region_id, region in scan.regions.items():
        parts = scan.maps.get(region_id)
        if not parts or region_id not in scan.covered or not _digests_complete(scan, region_id, region, page_size):
            return None
        e = np.concatenate(parts)
        bearing, rank0 = extent_ranks(e)
        digests = [d for _, d, _, _ in scan.digests.get(region_id, [])]
        table = np.concatenate(digests) if digests else np.zeros((0, DIGEST_SIZE), np.uint8)
        if len(table) != int(rank0[-1]) + (int(e["num_pages"][-1]) if bearing[-1] else 0):
            return None
        tables[region_id] = (region, e, table, rank0)
    return tables


def _digests_complete(scan: _Scan, region_id: int, region: dict, page_size: int) -> bool:
    covered = sum(r.parsed["num_pages"] for _, _, r, _ in scan.digests.get(region_id, []))
    return covered == region["size_bytes"] // page_size


def _stored_owners(tables: dict):
    """Every STORED page as (ordinal, expected digest, region index, page), sorted by ordinal.

    Sized by the STORED pages, each of which has its digest in the file, so a frame header
    declaring a huge page count cannot make this large.
    """
    parts, names = [], []
    for region, e, table, rank0 in tables.values():
        stored = np.flatnonzero(e["page_class"] == PageClass.STORED)
        counts = e["num_pages"][stored].astype(np.int64)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        parts.append((np.repeat(e["first_slot"][stored].astype(np.int64), counts) + within,
                      table[np.repeat(rank0[stored], counts) + within],
                      np.full(len(within), len(names)),
                      np.repeat(e["first_page"][stored].astype(np.int64), counts) + within))
        names.append(region["name"])
    ordinals, digests, region_of, page_of = (np.concatenate(column) for column in zip(*parts)) if parts else \
        (np.zeros(0, np.int64), np.zeros((0, DIGEST_SIZE), np.uint8), np.zeros(0, np.int64), np.zeros(0, np.int64))
    order = np.argsort(ordinals, kind="stable")
    return ordinals[order], digests[order], region_of[order], page_of[order], names


def _check_frames(image: ImageFile, scan: _Scan, page_size: int, tables: dict, report: Report) -> None:
    ordinals, expected, region_of, page_of, names = _stored_owners(tables)
    decompressor = zstandard.ZstdDecompressor()
    for i, offset, p in scan.frames:
        record = read_record(image, offset, image.size, i)
        try:
            content = decompress_frame(decompressor, parse_body(record, i)["frame"], p["num_pages"] * page_size, offset,
                                       record_path(i, record, "zstd"))
        except LeanImageError as exc:
            report.add(exc)
            continue
        report.checked["stored_pages"] += p["num_pages"]
        got = page_digests(content, page_size)
        first = min(p["first_ordinal"], 1 << 62)       # a lying u8 must not overflow the search
        lo, hi = np.searchsorted(ordinals, [first, first + len(got)])
        rows = ordinals[lo:hi] - first
        bad = lo + np.flatnonzero((got[rows] != expected[lo:hi]).any(axis=1))
        for j in bad[:FINDINGS_PER_RULE].tolist():
            report.add(LeanImageError(f"stored ordinal {int(ordinals[j])} (region {names[region_of[j]]!r} page "
                                      f"{int(page_of[j])}) does not match its digest", offset=offset,
                                      structure=record_path(i, record), rule="LI-DIG-002"))


def _check_delta_structure(image: ImageFile, scan: _Scan, page_size: int, report: Report) -> None:
    decompressor = zstandard.ZstdDecompressor()
    for i, offset, p in scan.delta_frames:
        record = read_record(image, offset, image.size, i)
        offsets = p["entry_offsets"].astype(np.int64)
        data = parse_body(record, i)["frame"]
        try:
            declared = zstandard.get_frame_parameters(data).content_size
        except zstandard.ZstdError:
            declared = None
        if declared is not None and declared != int(offsets[-1]):
            report.add(LeanImageError(f"last entry offset {int(offsets[-1])}, zstd frame declares {declared} bytes",
                                      offset=offset + 16 + 4 * (len(offsets) - 1),
                                      structure=record_path(i, record, "entry_offsets"), rule="LI-DLT-001"))
            continue
        try:
            content = decompress_frame(decompressor, data, int(offsets[-1]),
                                       offset, record_path(i, record, "zstd"))
        except LeanImageError as exc:
            report.add(exc)
            continue
        for k in range(len(offsets) - 1):
            try:
                deltacodec.decode_positions(content[offsets[k]:offsets[k + 1]], page_size, offset=offset,
                                            structure=record_path(i, record, f"entries[{k}]"))
            except LeanImageError as exc:
                report.add(exc)


def _note_unchecked(header, scan: _Scan, disks: dict, parents: list, report: Report) -> None:
    """Say which checks the inputs did not allow, so 'valid' is never read as more than it is."""
    missing = sorted(d["name"] for d in scan.disks.values() if d["name"] not in disks)
    if missing and scan.refs:
        report.not_checked.append(f"LI-DSK-004, LI-DSK-005 and DISK page digests (LI-DIG-002): "
                                  f"no --disk for {', '.join(missing)}")
    if header.has_parent and not parents:
        report.not_checked.append("LI-CHN-001..005, PARENT and DELTA page digests (LI-DIG-002) and delta "
                                  "application: no --parent")


def _open_for_chain(path: str, header, disks: dict, parents: list, report: Report):
    """The image opened through the reader when its disks/parent were supplied."""
    needs_parent = header.has_parent
    if not disks and not (needs_parent and parents):
        return None
    try:
        return LeanImage.open(path, parents=parents, disks=disks)
    except LeanImageError as exc:
        report.add(exc)
        return None


def _check_resolved(lean: LeanImage, tables: dict, report: Report) -> None:
    """DISK, PARENT and DELTA pages resolved through disks and parent, each checked by digest."""
    wanted = set()
    if lean._disk_sources:
        wanted.add(PageClass.DISK)
    if lean.parent is not None:
        wanted |= {PageClass.PARENT, PageClass.DELTA}
    for region in lean.regions:
        for extent in region.extents:
            cls = int(extent["page_class"])
            if cls not in wanted:
                continue
            first = int(extent["first_page"])
            for page in range(first, first + int(extent["num_pages"])):
                try:
                    lean.read_page(region, page)
                    report.checked[f"{PageClass(cls).name.lower()}_pages"] += 1
                except LeanImageError as exc:
                    report.add(exc)
