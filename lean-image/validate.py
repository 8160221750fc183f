"""Strict conformance check of one image (spec/conformance.md).

Unlike the reader, which stops at the first problem, ``validate`` scans every
record in file order and collects findings, each with rule id, byte offset and
structure path. Memory stays bounded by one record plus per-page bookkeeping.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import zstandard

from . import checks
from . import delta as deltacodec
from .arrays import distinct
from .errors import InputMissing, LeanImageError, LimitError
from .format import (
    DIGEST_SIZE,
    PAGE_SIZE_MIN,
    PageClass,
    RecordType,
    digest_class_table,
    inherits_digests,
    page_digests,
    valid_page_size,
)
from .locations import display, is_remote, open_image
from .s3 import StoreError
from .reader import LeanImage, decompress_frame
from .structures import (
    ImageFile,
    Record,
    body_problems,
    header_problems,
    image_digest_problems,
    index_location_problems,
    parse_body,
    read_footer,
    read_header,
    read_record,
    scan_records,
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


RULE_MENTION = re.compile(r"\b(LI-[A-Z]{3}-)(\d{3})(?:\.\.(\d{3}))?\b")


def rule_ids_in(text: str) -> list[str]:
    """The rule ids a sentence names, a range ``LI-CHN-001..005`` spelled out."""
    return [
        f"{prefix}{k:03d}"
        for prefix, first, last in RULE_MENTION.findall(text)
        for k in range(int(first), int(last or first) + 1)
    ]


@dataclass
class Verdict:
    """What a check of one file found (``validate``, ``validate-hints``): valid when nothing was
    found, complete when no rule is listed as not checked (CLI exit 0, 1 or 4)."""

    path: str
    findings: list = field(default_factory=list)
    suppressed: Counter = field(default_factory=Counter)
    # the checks the inputs did not allow: sentences naming their rule ids and what would allow them
    unchecked: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not self.findings

    @property
    def complete(self) -> bool:
        return not self.unchecked

    def skip(self, reason: str) -> None:
        """Record a check the inputs did not allow: ``reason`` names its rule ids (``LI-CHN-001..005``
        for a range) and the input it needs."""
        self.unchecked.append(reason)

    @property
    def not_checked(self) -> list[str]:
        """The ids of the rules not checked, sorted, each once."""
        return sorted({rule for reason in self.unchecked for rule in rule_ids_in(reason)})

    @property
    def not_checked_reasons(self) -> list[str]:
        """One sentence per check not made, naming its rules and the input it needs."""
        return list(self.unchecked)

    def verdict_json(self) -> dict:
        """The fields every check report shares (spec/guides/json.md)."""
        return dict(
            path=self.path,
            valid=self.valid,
            complete=self.complete,
            findings=[
                dict(rule=f.rule, offset=f.offset, structure=f.structure, message=f.message) for f in self.findings
            ],
            suppressed=dict(self.suppressed),
            not_checked=self.not_checked,
            not_checked_reasons=self.not_checked_reasons,
        )


@dataclass
class Report(Verdict):
    checked: Counter = field(default_factory=Counter)
    fetched: list = field(default_factory=list)  # s3.take_fetched(): objects read from a store
    # checks an input missing at run time prevented: structure -> (count, first message)
    unavailable: dict = field(default_factory=dict)

    def add_all(self, problems) -> None:
        for problem in problems:
            self.add(problem)

    def add(self, error: LeanImageError) -> None:
        if isinstance(error, StoreError):  # the store failed, not the image: no verdict
            raise error
        if isinstance(error, InputMissing):  # not a fault of the image: not checked
            count, first = self.unavailable.get(error.structure, (0, error.message))
            self.unavailable[error.structure] = (count + 1, first)
            return
        rule = error.rule or ("reader-limit" if isinstance(error, LimitError) else "io")
        if sum(1 for f in self.findings if f.rule == rule) >= FINDINGS_PER_RULE:
            self.suppressed[rule] += 1
            return
        self.findings.append(Finding(rule, error.offset, error.structure or "", error.message))

    def to_json(self) -> dict:
        extra = {"fetched": self.fetched} if self.fetched else {}
        return dict(self.verdict_json(), checked=dict(self.checked), **extra)


@dataclass
class _Scan:
    """What the sequential pass collected: small records whole, frames without their frame."""

    found: list = field(default_factory=list)  # per record before the INDEX: (entry or None, end)
    references: list = field(default_factory=list)  # (type, position, offset, ids) in file order
    regions: list = field(default_factory=list)  # REGION records
    disks: list = field(default_factory=list)  # DISK records
    maps: dict = field(default_factory=dict)  # region_id -> [extents]
    digests: dict = field(default_factory=dict)  # region_id -> [DIGESTS records]
    refs: list = field(default_factory=list)  # DISK_REFS records
    frames: list = field(default_factory=list)  # (position, offset, parsed fields but the frame)
    delta_frames: list = field(default_factory=list)
    sequences: list = field(default_factory=list)  # (sequence, SOURCE_STATE record)
    index: Record | None = None
    after_index: list = field(default_factory=list)
    complete_maps: dict = field(default_factory=dict)  # region_id -> extents covering it exactly


def validate(path, *, disks: dict | None = None, parents=(), progress=None) -> Report:
    """Check ``path`` against every rule of format v1.0 that its inputs allow. ``progress`` is
    called with the bytes done: of the file as its records are scanned, then a page's size for
    each page resolved through a disk or the parent (see ``work_bytes``)."""
    path = display(path)
    report = Report(path)
    try:
        fileobj = open_image(path)
    except OSError as exc:
        report.add(LeanImageError(f"cannot open: {exc.strerror}"))
        return report
    except LeanImageError as exc:
        report.add(exc)
        return report
    with fileobj:
        _validate_file(ImageFile(fileobj, path), report, disks or {}, list(parents), progress)
    for structure, (count, first) in report.unavailable.items():
        report.skip(
            f"LI-DIG-002 of {count} page(s) whose bytes are on {structure} (through "
            f"the chain), which was not given; the first: {first}"
        )
    return report


def _validate_file(image: ImageFile, report: Report, disks: dict, parents: list, progress=None) -> None:
    try:
        header = read_header(image)
    except LeanImageError as exc:
        report.add(exc)
        return
    report.add_all(header_problems(header))
    page_size = header.page_size if valid_page_size(header.page_size) else PAGE_SIZE_MIN  # to go on checking
    try:
        footer = read_footer(image, header.header_length)
    except LeanImageError as exc:
        report.add(exc)
        footer = None
    limit = footer.offset if footer else image.size
    scan = _scan(image, header.header_length, limit, page_size, report, _listed_offsets(image, footer), progress)
    if footer:
        _check_footer(image, footer, header, scan, report)
    _check_tables(header, scan, page_size, report)
    _check_content(image, header, scan, page_size, report, disks, parents, progress)


def work_bytes(path, *, disks: dict | None = None, parents=()) -> int:
    """What ``validate`` will report to ``progress`` in all, for a progress bar: the file's size,
    and a page's size per page it will resolve through the disks or the parent."""
    try:
        with LeanImage.open_link(path) as link:
            records = link.footer.offset - link.header.header_length
            wanted = ({PageClass.DISK} if disks else set()) | (
                {PageClass.PARENT, PageClass.DELTA} if link.header.has_parent and parents else set()
            )
            pages = sum(int(e["num_pages"]) for r in link.regions for e in r.extents if int(e["page_class"]) in wanted)
            return records + pages * link.page_size
    except LeanImageError:  # validate will say what is wrong
        return 0 if is_remote(path) else os.path.getsize(path)


# --- sequential pass ---------------------------------------------------------------
def _listed_offsets(image: ImageFile, footer) -> list[int]:
    """Record offsets the INDEX lists (plus its own), when footer and INDEX are readable."""
    if footer is None:
        return []
    try:
        index = read_record(image, footer.index_offset, footer.offset)
        if index.record_type != RecordType.INDEX:
            return []
        entries = parse_body(index)["entries"]
    except LeanImageError:
        return []
    return sorted({int(o) for o in entries["record_offset"]} | {footer.index_offset}) if len(entries) else []


def _scan(
    image: ImageFile, start: int, limit: int, page_size: int, report: Report, listed: list[int], progress=None
) -> _Scan:
    scan = _Scan()
    done = start
    for item in scan_records(image, start, limit, listed):
        if progress is not None and getattr(item, "end", None):
            progress(max(0, item.end - done))
            done = max(done, item.end)
        if isinstance(item, LeanImageError):
            report.add(item)
            if scan.index is None and item.rule != "LI-REC-001":
                scan.found.append((None, None))
            continue
        report.checked["records"] += 1
        try:
            parse_body(item)
        except LeanImageError as exc:
            report.add(exc)
            if scan.index is None:
                scan.found.append((None, item.end))
            continue
        problems = list(body_problems(item, item.index, page_size))
        report.add_all(problems)
        _collect(item, scan, page_size, bad_body=bool(problems))
    return scan


def _collect(record: Record, scan: _Scan, page_size: int, bad_body: bool) -> None:
    p, kind = record.fields, record.record_type
    if kind == RecordType.INDEX and scan.index is None:
        scan.index = record
        return
    if scan.index is not None:
        scan.after_index.append(record)
        return
    scan.found.append((checks.index_entry_of(record, page_size), record.end))
    scan.references.append((kind, record.index, record.offset, checks.record_references(record)[1]))
    if kind == RecordType.REGION:
        scan.regions.append(record)
    elif kind == RecordType.DISK:
        scan.disks.append(record)
    elif kind == RecordType.SOURCE_STATE:
        scan.sequences.append((p["sequence"], record))
    elif kind in (RecordType.PAGE_FRAME, RecordType.DELTA_FRAME):
        frames = scan.frames if kind == RecordType.PAGE_FRAME else scan.delta_frames
        frames.append((record.index, record.offset, {k: v for k, v in p.items() if k != "frame"}, bad_body))
    elif kind == RecordType.DISK_REFS:
        scan.refs.append(record)
    elif kind == RecordType.PAGE_MAP:
        scan.maps.setdefault(p["region_id"], []).append(p["extents"])
    elif kind == RecordType.DIGESTS:
        scan.digests.setdefault(p["region_id"], []).append(record)


# --- footer and index ------------------------------------------------------------------
def _check_footer(image: ImageFile, footer, header, scan: _Scan, report: Report) -> None:
    report.add_all(image_digest_problems(image, footer))
    entries = None
    if scan.index is not None:
        report.add_all(index_location_problems(footer, header.header_length, scanned_index=scan.index))
        entries = scan.index.fields["entries"]
    report.add_all(
        checks.index_problems(
            scan.index,
            entries,
            scan.found,
            complete=True,
            after_index=scan.after_index,
            footer_offset=footer.offset,
        )
    )


# --- cross-record tables ---------------------------------------------------------------
def _check_tables(header, scan: _Scan, page_size: int, report: Report) -> None:
    report.add_all(checks.region_table_problems(scan.regions))
    report.add_all(checks.disk_table_problems(scan.disks))
    report.add_all(checks.reference_order_problems(scan.references))
    bearing_classes = digest_class_table(header.incompatible_features)
    for region in scan.regions:
        _check_region_tables(region.fields, scan, page_size, report, bearing_classes)
    report.checked["pages"] = sum(int(e["num_pages"].astype(np.int64).sum()) for e in scan.complete_maps.values())
    if len(scan.complete_maps) == len(scan.regions):  # slot use is only meaningful over complete page maps
        report.add_all(
            checks.slot_problems(
                list(scan.complete_maps.values()),
                sum(f[2]["num_pages"] for f in scan.frames),
                sum(f[2]["num_deltas"] for f in scan.delta_frames),
                [r.fields["first_ref"] for r in scan.refs],
                [r.fields["num_refs"] for r in scan.refs],
                [r.offset for r in scan.refs],
            )
        )
    for name, frames, first, count in (
        ("page_frame", scan.frames, "first_ordinal", "num_pages"),
        ("delta_frame", scan.delta_frames, "first_delta", "num_deltas"),
    ):
        report.add_all(
            checks.numbering_problems(
                name, [f[2][first] for f in frames], [f[2][count] for f in frames], [f[1] for f in frames]
            )
        )
    report.add_all(checks.feature_problems(header, checks.class_counts(list(scan.complete_maps.values()))))
    sizes = {d.fields["disk_id"]: d.fields["size_bytes"] for d in scan.disks}
    for record in scan.refs:
        report.add_all(checks.disk_ref_problems(sizes, record.fields["refs"], page_size, record.offset, record.path()))
    report.add_all(checks.source_sequence_problems(scan.sequences))


def _check_region_tables(
    region: dict, scan: _Scan, page_size: int, report: Report, bearing_classes: np.ndarray
) -> None:
    region_id, name, num_pages = region["region_id"], region["name"], region["size_bytes"] // page_size
    parts = scan.maps.get(region_id, [])
    extents = np.concatenate(parts) if parts else np.zeros(0, dtype=[("first_page", "<u8")])
    coverage = list(checks.coverage_problems(region_id, name, num_pages, extents))
    report.add_all(coverage)
    digest_records = scan.digests.get(region_id, [])
    ranges = [(r.fields["first_page"], r.fields["num_pages"], r, r.offset) for r in digest_records]
    order = list(checks.digest_coverage_problems(region_id, name, num_pages, ranges))
    report.add_all(order)
    if not coverage:
        scan.complete_maps[region_id] = extents
        if not order:
            report.add_all(
                checks.digest_count_problems(
                    extents,
                    [(first, count, r.fields["num_digests"], r, r.offset) for first, count, r, _ in ranges],
                    bearing_classes,
                )
            )


# --- content: frames, deltas, disks, parent ------------------------------------------------
def _check_content(
    image: ImageFile, header, scan: _Scan, page_size: int, report: Report, disks: dict, parents: list, progress=None
) -> None:
    tables = _digest_lookup(scan, digest_class_table(header.incompatible_features))
    if tables is None:
        return
    _check_frames(image, scan, page_size, tables, report)
    _note_unchecked(header, scan, disks, parents, report)
    lean = _open_for_chain(image.name, header, disks, parents, report)
    if lean is None:
        _check_delta_structure(image, scan, page_size, report)
        return
    with lean:
        _check_resolved(lean, report, progress)


def _digest_lookup(scan: _Scan, bearing_classes: np.ndarray):
    """Per region: (region, extents, stored digests: the digest arrays of its DIGESTS records in
    order and the rank each begins at, rank of each extent); None when maps or digest tables are
    broken (no content can then be matched with its digest)."""
    tables = {}
    for region in scan.regions:
        region_id = region.fields["region_id"]
        e = scan.complete_maps.get(region_id)
        if e is None:
            return None
        bearing, rank0 = checks.digest_ranks(e, bearing_classes)
        parts = [r.fields["digests"] for r in scan.digests.get(region_id, [])]
        lengths = np.array([len(part) for part in parts], np.int64)
        if int(lengths.sum()) != int(np.where(bearing, e["num_pages"].astype(np.int64), 0).sum()):
            return None
        tables[region_id] = (region.fields, e, (parts, np.cumsum(lengths) - lengths), rank0)
    return tables


class _StoredOwners:
    """The STORED pages that own each stored ordinal, a frame at a time: the STORED extents of
    every region sorted by first slot, expanded to pages only where they overlap the frame's
    ordinals, so memory follows the extents and one frame, not the image's stored pages."""

    def __init__(self, tables: dict):
        columns = []
        for region_index, (_, e, _, rank0) in enumerate(tables.values()):
            stored = np.flatnonzero(e["page_class"] == PageClass.STORED)
            columns.append(
                (
                    e["first_slot"][stored].astype(np.int64),
                    e["num_pages"][stored].astype(np.int64),
                    e["first_page"][stored].astype(np.int64),
                    rank0[stored].astype(np.int64),
                    np.full(len(stored), region_index, np.int64),
                )
            )
        self.digests = [t[2] for t in tables.values()]
        self.region_ids = np.array(list(tables), np.int64)
        slot, count, page, rank, region = (
            (np.concatenate(column) for column in zip(*columns)) if columns else (np.zeros(0, np.int64),) * 5
        )
        order = np.argsort(slot, kind="stable")  # ties: in region, then page order
        self.slot, self.count, self.page, self.rank = slot[order], count[order], page[order], rank[order]
        self.region, self.seq = region[order], order
        limit = np.iinfo(np.int64).max
        ends = np.where(self.slot > limit - self.count, limit, self.slot + self.count)  # u8 slots: no wrap
        self.ends = ends
        self.reach = np.maximum.accumulate(ends) if len(ends) else ends  # the furthest end so far

    def in_range(self, first: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The owners of ordinals [first, first + n), by ordinal (then region and page order):
        their ordinals, expected digests, region ids and pages."""
        lo = int(np.searchsorted(self.reach, first, side="right"))  # before lo: every extent ends by first
        hi = int(np.searchsorted(self.slot, first + n, side="left"))  # from hi: every extent starts after
        sel = lo + np.flatnonzero(self.ends[lo:hi] > first)
        slot = self.slot[sel]
        start = np.maximum(slot, first)
        lengths = np.minimum(self.ends[sel], first + n) - start
        total = int(lengths.sum())
        owner = np.repeat(np.arange(len(sel)), lengths)
        ordinals = np.repeat(start, lengths) + np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        into = ordinals - slot[owner]
        order = np.lexsort((self.seq[sel][owner], ordinals))
        ordinals, owner, into = ordinals[order], owner[order], into[order]
        region = self.region[sel][owner]
        ranks = self.rank[sel][owner] + into
        expected = np.zeros((total, DIGEST_SIZE), np.uint8)
        for r in distinct(region).tolist():
            mine = np.flatnonzero(region == r)
            parts, starts = self.digests[r]
            which = np.searchsorted(starts, ranks[mine], side="right") - 1
            for k in distinct(which).tolist():
                rows = which == k
                expected[mine[rows]] = parts[k][ranks[mine[rows]] - starts[k]]
        return ordinals, expected, self.region_ids[region], self.page[sel][owner] + into


def _check_frames(image: ImageFile, scan: _Scan, page_size: int, tables: dict, report: Report) -> None:
    owners = _StoredOwners(tables)
    names = {region_id: t[0]["name"] for region_id, t in tables.items()}
    decompressor = zstandard.ZstdDecompressor()
    for i, offset, p, bad_body in scan.frames:
        if bad_body:
            continue  # its size or count is already reported
        record = read_record(image, offset, image.size, i)
        try:
            content = decompress_frame(
                decompressor, parse_body(record, i)["frame"], p["num_pages"] * page_size, offset, record.path("frame")
            )
        except LeanImageError as exc:
            report.add(exc)
            continue
        report.checked["stored_pages"] += p["num_pages"]
        got = page_digests(content, page_size)
        first = min(p["first_ordinal"], 1 << 62)  # a lying u8 must not overflow the search
        ordinals, expected, region_of, page_of = owners.in_range(first, len(got))
        rows = ordinals - first
        for region_id in distinct(region_of).tolist():
            mine = np.flatnonzero(region_of == region_id)
            report.add_all(
                checks.digest_problems(
                    region_id,
                    names[region_id],
                    page_of[mine],
                    got[rows[mine]],
                    expected[mine],
                    where=f" (in {record.path()})",
                )
            )


def _check_delta_structure(image: ImageFile, scan: _Scan, page_size: int, report: Report) -> None:
    """Every delta entry decodes (spec §7), when no parent lets them be applied."""
    decompressor = zstandard.ZstdDecompressor()
    for i, offset, p, bad_body in scan.delta_frames:
        if bad_body:
            continue
        record = read_record(image, offset, image.size, i)
        offsets = p["entry_offsets"].astype(np.int64)
        try:
            content = decompress_frame(
                decompressor, parse_body(record, i)["frame"], int(offsets[-1]), offset, record.path("frame")
            )
        except LeanImageError as exc:
            report.add(exc)
            continue
        for k in range(len(offsets) - 1):
            try:
                deltacodec.decode_positions(
                    content[offsets[k] : offsets[k + 1]],
                    page_size,
                    offset=offset,
                    structure=record.path(f"entries[{k}]"),
                )
            except LeanImageError as exc:
                report.add(exc)


def _note_unchecked(header, scan: _Scan, disks: dict, parents: list, report: Report) -> None:
    """Say which checks the inputs did not allow, so 'valid' is never read as more than it is."""
    missing = sorted(d.fields["name"] for d in scan.disks if d.fields["name"] not in disks)
    if missing and scan.refs:
        report.skip(f"LI-DSK-004, LI-DSK-005 and DISK page digests (LI-DIG-002): no --disk for {', '.join(missing)}")
    if header.has_parent and not parents:
        inherited = (
            ", LI-CHN-006 (PARENT pages inherit their digests from the parent)"
            if inherits_digests(header.incompatible_features)
            else ""
        )
        report.skip(
            f"LI-CHN-001..005{inherited}, PARENT and DELTA page digests (LI-DIG-002) and delta application: no --parent"
        )


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


def _check_resolved(lean: LeanImage, report: Report, progress=None) -> None:
    """DISK, PARENT and DELTA pages resolved through disks and parent, each checked by digest."""
    wanted = set()
    if lean.has_disk_sources:
        wanted.add(PageClass.DISK)
    if lean.parent is not None:
        wanted |= {PageClass.PARENT, PageClass.DELTA}
    for region in lean.regions:
        for extent in region.extents:
            cls = int(extent["page_class"])
            if cls not in wanted:
                continue
            first, count = int(extent["first_page"]), int(extent["num_pages"])
            for start in range(first, first + count, RESOLVE_CHUNK_PAGES):
                _check_range(lean, region, cls, start, min(RESOLVE_CHUNK_PAGES, first + count - start), report)
            if progress is not None:
                progress(count * lean.page_size)


RESOLVE_CHUNK_PAGES = 1024


def _check_range(lean: LeanImage, region, cls: int, first: int, count: int, report: Report) -> None:
    """Pages resolved and checked a range at a time (region_bytes verifies each one); when
    the range holds a finding, page by page, so that every page's finding is reported."""
    counter = f"{PageClass(cls).name.lower()}_pages"
    try:
        lean.region_bytes(region, first, count)
        report.checked[counter] += count
        return
    except LeanImageError:
        pass
    for page in range(first, first + count):
        try:
            lean.read_page(region, page)
            report.checked[counter] += 1
        except LeanImageError as exc:
            report.add(exc)
