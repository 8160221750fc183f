"""Parsing of the header, records and footer (spec §3-§8), shared by reader,
validator and ``dump_structure``. Checks come as generators of FormatError so the
reader can raise the first while the validator collects them all.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .errors import FormatError, LimitError, TruncatedError
from .format import (
    BODY_OF, DELTA_FRAME_BODY, DIGEST_SIZE, DIGESTS_BODY, DISK_BODY, DISK_NAME_MAX, DISK_REF, DISK_REFS_BODY,
    DISK_SECTOR_SIZE, EXTENT, FINGERPRINT_SAMPLED_XXH3, FOOTER, FOOTER_MAGIC, FORMAT_MAJOR,
    FRAME_PAGES_MAX_BYTES, HEADER, HEADER_LENGTH_MAX, HEADER_MAGIC, INDEX_BODY, INDEX_ENTRY, KNOWN_INCOMPAT,
    PAGE_FRAME_BODY, PAGE_MAP_BODY, PAGE_SIZE_MAX, PAGE_SIZE_MIN, RECORD, RECORD_BODY_MAX,
    RECORD_OPTIONAL_BIT, RECORD_TRAILER, REGION_BODY, REGION_FLAG_HAS_GPA, REGION_NAME_MAX,
    REGION_SIZE_MAX, SLOT_CLASSES, SOURCE_STATE_BODY, IncompatFeature, PageClass, RecordType, SourceFormat,
    align8, checksum64,
)

KNOWN_TYPES = {int(t) for t in RecordType}


def extent_ranks(extents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per extent: whether its pages have stored digests, and how many digests precede it."""
    from .format import DIGEST_CLASSES
    bearing = np.isin(extents["page_class"], [int(c) for c in DIGEST_CLASSES])
    counts = np.where(bearing, extents["num_pages"].astype(np.int64), 0)
    rank0 = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts
    return bearing, rank0


def bearing_before(extents: np.ndarray, bearing: np.ndarray, rank0: np.ndarray, pages: np.ndarray) -> np.ndarray:
    """For each page number (up to the region end), how many pages before it have stored digests."""
    starts = extents["first_page"].astype(np.int64)
    i = np.searchsorted(starts, pages, side="right") - 1
    within = np.minimum(pages - starts[i], extents["num_pages"][i].astype(np.int64))
    return rank0[i] + np.where(bearing[i], within, 0)


class ImageFile:
    """Positional reads with exact-length checking."""

    def __init__(self, fileobj, name: str = ""):
        self.fileobj = fileobj
        self.name = name
        fileobj.seek(0, 2)
        self.size = fileobj.tell()

    def read_exact(self, offset: int, length: int, structure: str) -> bytes:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise TruncatedError(f"expected {length} bytes, file ends at {self.size:#x}",
                                 offset=offset, structure=structure)
        data = os.pread(self.fileobj.fileno(), length, offset)
        if len(data) != length:
            raise TruncatedError(f"expected {length} bytes, got {len(data)}", offset=offset,
                                 structure=structure)
        return data


# --- header --------------------------------------------------------------------
class Header:
    """The header's fields (named as HEADER declares them) and its raw bytes."""

    def __init__(self, raw: bytes):
        self.__dict__.update(HEADER.unpack(raw)._asdict())
        self.raw = raw

    @property
    def has_parent(self) -> bool:
        return self.parent_uuid != bytes(16)

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in HEADER.head}


def _header_error(field: str, message: str, rule: str, error=FormatError) -> FormatError:
    return error(message, offset=HEADER.offset(field), structure=f"header.{field}", rule=rule)


def read_header(image: ImageFile) -> Header:
    """Read and check the fixed part; raise on what makes the rest unreadable."""
    raw = image.read_exact(0, min(HEADER.size, image.size), "header")
    if len(raw) < len(HEADER_MAGIC):
        raise _header_error("magic", f"expected magic {HEADER_MAGIC.hex(' ')}, the file has only {len(raw)} "
                            "bytes", "LI-HDR-001", TruncatedError)
    if raw[:len(HEADER_MAGIC)] != HEADER_MAGIC:
        raise _header_error("magic", f"expected magic {HEADER_MAGIC.hex(' ')}, got {raw[:8].hex(' ')}",
                            "LI-HDR-001")
    if len(raw) < HEADER.size:
        raise TruncatedError(f"expected a {HEADER.size}-byte header, file has {len(raw)} bytes",
                             offset=0, structure="header", rule="LI-HDR-003")
    header = Header(raw)
    if header.major_version != FORMAT_MAJOR:
        raise _header_error("major_version", f"expected major_version {FORMAT_MAJOR}, got "
                            f"{header.major_version}", "LI-HDR-002")
    length = header.header_length
    if length % 8 or not HEADER.size <= length <= HEADER_LENGTH_MAX:
        raise _header_error("header_length", f"expected header_length a multiple of 8 in {HEADER.size}.."
                            f"{HEADER_LENGTH_MAX}, got {length}", "LI-HDR-003")
    header.raw = image.read_exact(0, length, "header")
    return header


def header_checksum(raw: bytes) -> int:
    """xxh3-64 of the header with its checksum field zeroed (spec §3.6)."""
    at = HEADER.offset("header_checksum")
    return checksum64(bytes(raw[:at]) + bytes(8) + bytes(raw[at + 8:]))


def header_problems(header: Header) -> Iterator[FormatError]:
    computed = header_checksum(header.raw)
    if computed != header.header_checksum:
        yield _header_error("header_checksum", f"expected header_checksum {computed:#018x}, got "
                            f"{header.header_checksum:#018x}", "LI-HDR-004")
    unknown = header.incompatible_features & ~KNOWN_INCOMPAT
    if unknown:
        yield _header_error("incompatible_features", f"unknown incompatible feature bits {unknown:#x}",
                            "LI-HDR-005")
    ps = header.page_size
    if ps & (ps - 1) or not PAGE_SIZE_MIN <= ps <= PAGE_SIZE_MAX:
        yield _header_error("page_size", f"expected page_size a power of two in {PAGE_SIZE_MIN}.."
                            f"{PAGE_SIZE_MAX}, got {ps}", "LI-HDR-006")
    if header.reserved or (header.minor_version == 0 and any(header.raw[HEADER.size:])):
        yield _header_error("reserved", "expected reserved header bytes zero", "LI-HDR-007")
    has_uuid, has_digest = header.parent_uuid != bytes(16), header.parent_digest != bytes(16)
    has_bit = bool(header.incompatible_features & IncompatFeature.PARENT)
    if not has_uuid == has_digest == has_bit:
        yield _header_error("parent_uuid", f"parent_uuid {'set' if has_uuid else 'zero'}, parent_digest "
                            f"{'set' if has_digest else 'zero'}, PARENT bit {'set' if has_bit else 'clear'}: "
                            "expected all three to agree", "LI-HDR-008")


# --- footer --------------------------------------------------------------------
class Footer:
    """The footer's fields (named as FOOTER declares them) and its file offset."""

    def __init__(self, raw: bytes, offset: int):
        self.__dict__.update(FOOTER.unpack(raw)._asdict())
        self.offset = offset

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in FOOTER.head}


def footer_checksum(raw: bytes) -> int:
    return checksum64(bytes(raw[:FOOTER.offset("footer_checksum")]))


def read_footer(image: ImageFile, header_length: int) -> Footer:
    offset = image.size - FOOTER.size

    def fail(field: str, message: str, rule: str, error=FormatError):
        return error(message, offset=offset + FOOTER.offset(field), structure=f"footer.{field}", rule=rule)

    if offset < header_length:
        raise TruncatedError(f"expected a {FOOTER.size}-byte footer after the header, file has "
                             f"{image.size} bytes (incomplete image)", offset=max(offset, 0),
                             structure="footer", rule="LI-FTR-001")
    raw = image.read_exact(offset, FOOTER.size, "footer")
    footer = Footer(raw, offset)
    if footer.magic != FOOTER_MAGIC:
        raise fail("magic", f"expected footer magic {FOOTER_MAGIC.hex(' ')}, got {footer.magic.hex(' ')} "
                   "(incomplete or truncated image)", "LI-FTR-001")
    computed = footer_checksum(raw)
    if computed != footer.footer_checksum:
        raise fail("footer_checksum", f"expected footer_checksum {computed:#018x}, got "
                   f"{footer.footer_checksum:#018x}", "LI-FTR-002")
    if footer.file_length != image.size:
        raise fail("file_length", f"expected file_length {image.size}, got {footer.file_length}", "LI-FTR-003")
    if not header_length <= footer.index_offset < offset or footer.index_offset % 8:
        raise fail("index_offset", f"expected index_offset an aligned offset in {header_length:#x}..{offset:#x}, "
                   f"got {footer.index_offset:#x}", "LI-FTR-005")
    return footer


# --- records -------------------------------------------------------------------
@dataclass
class Record:
    offset: int
    record_type: int
    flags: int
    body_length: int
    record_checksum: int
    body: memoryview
    parsed: dict | None = None

    @property
    def size(self) -> int:
        return RECORD.size + align8(self.body_length) + RECORD_TRAILER.size

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def body_offset(self) -> int:
        return self.offset + RECORD.size

    @property
    def name(self) -> str:
        try:
            return RecordType(self.record_type).name.lower()
        except ValueError:
            return f"type_{self.record_type:#010x}"


def record_path(index: int | None, record: Record | None = None, field: str = "") -> str:
    name = record.name if record else "record"
    where = f"record[{index}]" if index is not None else "record"
    return f"{where}.{name}" + (f".{field}" if field else "")


def read_record_header(image: ImageFile, offset: int, limit: int, index: int | None) -> tuple[int, int, int]:
    path = record_path(index)
    if limit - offset < RECORD.size + RECORD_TRAILER.size:
        raise FormatError(f"{limit - offset} bytes before {limit:#x} cannot hold a record",
                          offset=offset, structure=path, rule="LI-REC-001")
    head = RECORD.unpack(image.read_exact(offset, RECORD.size, path))
    end = offset + RECORD.size + align8(head.body_length) + RECORD_TRAILER.size
    if end > limit:
        raise TruncatedError(f"record of {end - offset} bytes runs past {limit:#x}",
                             offset=offset + RECORD.offset("body_length"), structure=path + ".body_length",
                             rule="LI-REC-002")
    if head.body_length > RECORD_BODY_MAX:
        raise LimitError(f"body_length {head.body_length} exceeds this reader's limit {RECORD_BODY_MAX} "
                         "(spec §9.2): the image may be valid but is not readable here",
                         offset=offset + RECORD.offset("body_length"), structure=path + ".body_length")
    return head.record_type, head.flags, head.body_length


def read_record(image: ImageFile, offset: int, limit: int, index: int | None = None) -> Record:
    """Read one record, checking framing, checksum, padding and flags."""
    record_type, flags, body_length = read_record_header(image, offset, limit, index)
    padded = align8(body_length)
    raw = image.read_exact(offset, RECORD.size + padded + RECORD_TRAILER.size, record_path(index))
    trailer_at = len(raw) - RECORD_TRAILER.size
    (stored,) = RECORD_TRAILER.unpack_from(raw, trailer_at)
    body = memoryview(raw)[RECORD.size:RECORD.size + body_length]      # a view: frame bodies are large
    record = Record(offset, record_type, flags, body_length, stored, body)
    computed = checksum64(memoryview(raw)[:trailer_at])
    if computed != stored:
        raise FormatError(f"expected record_checksum {computed:#018x}, got {stored:#018x}",
                          offset=offset + trailer_at, structure=record_path(index, record, "record_checksum"),
                          rule="LI-REC-003")
    if any(raw[RECORD.size + body_length:trailer_at]):
        raise FormatError("expected zero padding", offset=offset + RECORD.size + body_length,
                          structure=record_path(index, record, "padding"), rule="LI-REC-004")
    if flags:
        raise FormatError(f"expected flags 0, got {flags:#x}", offset=offset + RECORD.offset("flags"),
                          structure=record_path(index, record, "flags"), rule="LI-REC-005")
    return record


# --- record bodies ---------------------------------------------------------------
class _Body:
    """Cursor over a record body raising LI-REC-007/008 with exact offsets."""

    def __init__(self, record: Record, index: int | None):
        self.record, self.index = record, index
        self.structure = BODY_OF.get(record.record_type)
        self.base = record.body_offset

    def fail(self, rule: str, message: str, at: int = 0, field: str = "") -> FormatError:
        return FormatError(message, offset=self.base + at, rule=rule,
                           structure=record_path(self.index, self.record, field))

    def fail_at(self, rule: str, message: str, field: str) -> FormatError:
        """An error about a head field of the body, at that field's offset."""
        return self.fail(rule, message, self.structure.offset(field), field)

    def head(self) -> dict:
        st = self.structure
        if self.record.body_length < st.size:
            raise self.fail("LI-REC-007", f"expected a body of at least {st.size} bytes, "
                            f"got {self.record.body_length}", 0, "body_length")
        return st.unpack(self.record.body)._asdict()

    def expect_length(self, expected: int) -> None:
        if self.record.body_length != expected:
            raise self.fail("LI-REC-007", f"expected body_length {expected}, got {self.record.body_length}",
                            RECORD.offset("body_length") - RECORD.size, "body_length")

    def zero(self, values: dict, field: str) -> None:
        if values[field]:
            raise self.fail_at("LI-REC-008", f"expected reserved {field} 0, got {values[field]:#x}", field)

    def table(self, at: int, element, count: int, field: str) -> np.ndarray:
        """``count`` elements of a declared structure from body offset ``at``; reserved ones zero."""
        rows = np.frombuffer(self.record.body, dtype=element.dtype, count=count, offset=at)
        if "reserved" in element.offsets:
            bad = np.flatnonzero(rows["reserved"])
            if len(bad):
                k = int(bad[0])
                raise self.fail("LI-REC-008", f"expected reserved {field}[{k}].reserved 0, got "
                                f"{int(rows['reserved'][k]):#x}", at + element.size * k + element.offset("reserved"),
                                f"{field}[{k}].reserved")
        return rows

    def name(self, values: dict, limit: int, rule: str) -> str:
        start, length = self.structure.size, values["name_length"]
        raw = bytes(self.record.body[start:start + length])
        if not 1 <= length <= limit:
            raise self.fail(rule, f"expected a name of 1..{limit} bytes, got {length}", start, "name")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(rule, f"expected UTF-8 name, got invalid byte at {exc.start}", start, "name")


def _parse_region(b: _Body) -> dict:
    p = b.head()
    b.expect_length(REGION_BODY.size + p["name_length"])
    b.zero(p, "reserved")
    p["name"] = b.name(p, REGION_NAME_MAX, "LI-REG-001")
    return p


def _parse_disk(b: _Body) -> dict:
    p = b.head()
    b.expect_length(DISK_BODY.size + p["name_length"])
    b.zero(p, "flags")
    b.zero(p, "reserved")
    p["name"] = b.name(p, DISK_NAME_MAX, "LI-DSK-001")
    return p


def _parse_source_state(b: _Body) -> dict:
    p = b.head()
    p["data"] = b.record.body[SOURCE_STATE_BODY.size:]
    return p


def _parse_page_frame(b: _Body) -> dict:
    p = b.head()
    b.zero(p, "reserved")
    p["frame"] = b.record.body[PAGE_FRAME_BODY.size:]
    return p


def _parse_delta_frame(b: _Body) -> dict:
    p = b.head()
    b.zero(p, "reserved")
    table_end = DELTA_FRAME_BODY.size + 4 * (p["num_deltas"] + 1)
    frame_start = align8(table_end)
    if b.record.body_length < frame_start:
        raise b.fail_at("LI-REC-007", f"expected {p['num_deltas'] + 1} entry offsets, body has "
                        f"{b.record.body_length} bytes", "num_deltas")
    p["entry_offsets"] = np.frombuffer(b.record.body, dtype="<u4", count=p["num_deltas"] + 1,
                                       offset=DELTA_FRAME_BODY.size)
    p["padding"] = bytes(b.record.body[table_end:frame_start])
    if any(p["padding"]):
        raise b.fail("LI-REC-004", "expected zero padding after entry_offsets", table_end, "padding")
    p["frame"] = b.record.body[frame_start:]
    return p


def _parse_disk_refs(b: _Body) -> dict:
    p = b.head()
    b.zero(p, "reserved")
    b.expect_length(DISK_REFS_BODY.size + DISK_REF.size * p["num_refs"])
    if p["num_refs"] == 0:
        raise b.fail_at("LI-REC-007", "expected num_refs >= 1, got 0", "num_refs")
    p["refs"] = b.table(DISK_REFS_BODY.size, DISK_REF, p["num_refs"], "refs")
    return p


def _parse_page_map(b: _Body) -> dict:
    p = b.head()
    b.expect_length(PAGE_MAP_BODY.size + EXTENT.size * p["num_extents"])
    p["extents"] = b.table(PAGE_MAP_BODY.size, EXTENT, p["num_extents"], "extents")
    return p


def _parse_digests(b: _Body) -> dict:
    p = b.head()
    b.expect_length(DIGESTS_BODY.size + DIGEST_SIZE * p["num_digests"])
    if p["num_pages"] == 0 or p["num_digests"] > p["num_pages"]:
        raise b.fail_at("LI-REC-007", f"expected num_pages >= 1 and num_digests <= num_pages, got "
                        f"{p['num_pages']} and {p['num_digests']}", "num_pages")
    p["digests"] = np.frombuffer(b.record.body, dtype=np.uint8,
                                 offset=DIGESTS_BODY.size).reshape(-1, DIGEST_SIZE)
    return p


def _parse_index(b: _Body) -> dict:
    p = b.head()
    b.zero(p, "reserved")
    b.expect_length(INDEX_BODY.size + INDEX_ENTRY.size * p["num_entries"])
    p["entries"] = b.table(INDEX_BODY.size, INDEX_ENTRY, p["num_entries"], "entries")
    return p


BODY_PARSERS = {
    RecordType.REGION: _parse_region,
    RecordType.DISK: _parse_disk,
    RecordType.SOURCE_STATE: _parse_source_state,
    RecordType.PAGE_FRAME: _parse_page_frame,
    RecordType.DELTA_FRAME: _parse_delta_frame,
    RecordType.DISK_REFS: _parse_disk_refs,
    RecordType.PAGE_MAP: _parse_page_map,
    RecordType.DIGESTS: _parse_digests,
    RecordType.INDEX: _parse_index,
}


def parse_body(record: Record, index: int | None = None) -> dict:
    """Decode a record body by type into its declared fields; unknown optional types give {}."""
    parser = BODY_PARSERS.get(record.record_type)
    if parser is None:
        if record.record_type & RECORD_OPTIONAL_BIT:
            record.parsed = {}
            return record.parsed
        raise FormatError(f"unknown mandatory record type {record.record_type:#010x}",
                          offset=record.offset, structure=record_path(index, record, "record_type"),
                          rule="LI-REC-006")
    record.parsed = parser(_Body(record, index))
    return record.parsed


def body_problems(record: Record, index: int | None, page_size: int) -> Iterator[FormatError]:
    """Value rules of one parsed body that do not need other records."""
    check = BODY_CHECKS.get(record.record_type)
    if check is not None:
        yield from check(record.parsed, _Body(record, index), page_size)


def _region_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    has_gpa = p["flags"] & REGION_FLAG_HAS_GPA
    if p["flags"] & ~REGION_FLAG_HAS_GPA or (not has_gpa and p["guest_phys_base"]):
        yield b.fail_at("LI-REG-003", f"flags {p['flags']:#x} with guest_phys_base {p['guest_phys_base']:#x}",
                        "flags")
    size = p["size_bytes"]
    if size == 0 or size % page_size or size > REGION_SIZE_MAX:
        yield b.fail_at("LI-REG-002", f"expected size_bytes a non-zero multiple of {page_size} "
                        f"at most 2^48, got {size}", "size_bytes")


def _disk_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    if p["sector_size"] != DISK_SECTOR_SIZE or p["fingerprint_method"] != FINGERPRINT_SAMPLED_XXH3 \
            or p["size_bytes"] == 0:
        yield b.fail_at("LI-DSK-002", f"expected sector_size 512, fingerprint_method 1, size > 0; got "
                        f"{p['sector_size']}, {p['fingerprint_method']}, {p['size_bytes']}", "size_bytes")


def _source_state_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    if p["source_format"] not in {int(s) for s in SourceFormat}:
        yield b.fail_at("LI-SRC-002", f"expected source_format 1 or 2, got {p['source_format']}",
                        "source_format")


def _page_frame_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    most = FRAME_PAGES_MAX_BYTES // page_size
    if not 1 <= p["num_pages"] <= most:
        yield b.fail_at("LI-FRM-004", f"expected 1..{most} pages, got {p['num_pages']}", "num_pages")


def _delta_frame_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    offsets = p["entry_offsets"].astype(np.int64)
    if p["num_deltas"] == 0 or offsets[0] != 0 or (np.diff(offsets) < 0).any():
        yield b.fail("LI-DLT-001", "expected entry_offsets from 0, never decreasing, and num_deltas >= 1",
                     DELTA_FRAME_BODY.size, "entry_offsets")


def _page_map_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    e = p["extents"]
    bad = np.flatnonzero(~np.isin(e["page_class"], [int(c) for c in PageClass]) | (e["num_pages"] == 0))
    if p["num_extents"] == 0 or len(bad):
        i = int(bad[0]) if len(bad) else 0
        yield b.fail("LI-MAP-002", "expected page_class 1..6 and num_pages >= 1 in every extent"
                     + (f", extent {i} has class {int(e['page_class'][i])}, {int(e['num_pages'][i])} pages"
                        if len(bad) else ", got no extents"),
                     PAGE_MAP_BODY.size + EXTENT.size * i, f"extents[{i}]")
    no_slot = ~np.isin(e["page_class"], [int(c) for c in SLOT_CLASSES]) & (e["first_slot"] != 0)
    if no_slot.any():
        i = int(np.flatnonzero(no_slot)[0])
        yield b.fail("LI-MAP-003", f"expected first_slot 0 for class {int(e['page_class'][i])}, "
                     f"got {int(e['first_slot'][i])}",
                     PAGE_MAP_BODY.size + EXTENT.size * i + EXTENT.offset("first_slot"),
                     f"extents[{i}].first_slot")


BODY_CHECKS = {
    RecordType.REGION: _region_values,
    RecordType.DISK: _disk_values,
    RecordType.SOURCE_STATE: _source_state_values,
    RecordType.PAGE_FRAME: _page_frame_values,
    RecordType.DELTA_FRAME: _delta_frame_values,
    RecordType.PAGE_MAP: _page_map_values,
}


def dump_value(value):
    """A parsed field as plain Python: tables as lists of dicts, arrays as lists, views as bytes."""
    if isinstance(value, np.ndarray):
        if value.dtype.names:
            return [{name: dump_value(row[name]) for name in value.dtype.names} for row in value]
        if value.dtype == np.uint8 and value.ndim == 2:
            return [bytes(row) for row in value]
        return [int(x) for x in value]
    if isinstance(value, (memoryview, bytearray, np.void)):
        return bytes(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


def dump_fields(structure, values: dict) -> dict:
    """Every field ``structure`` declares, from parsed ``values``, as plain Python."""
    return {f.name: dump_value(values[f.name]) for f in structure.fields if f.name in values}
