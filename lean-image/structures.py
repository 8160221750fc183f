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
    DELTA_FRAME_STRUCT, DIGEST_SIZE, DIGESTS_STRUCT, DISK_NAME_MAX, DISK_REF_DTYPE, DISK_REF_STRUCT,
    DISK_REFS_STRUCT, DISK_SECTOR_SIZE, DISK_STRUCT, EXTENT_DTYPE, EXTENT_STRUCT,
    FINGERPRINT_SAMPLED_XXH3, FOOTER_MAGIC, FOOTER_SIZE, FOOTER_STRUCT, FORMAT_MAJOR,
    HEADER_CHECKSUM_OFFSET, HEADER_LENGTH_MAX, HEADER_MAGIC, HEADER_SIZE_V1_0, HEADER_STRUCT,
    INDEX_ENTRY_DTYPE, INDEX_ENTRY_STRUCT, INDEX_STRUCT, KNOWN_INCOMPAT, PAGE_FRAME_STRUCT,
    PAGE_MAP_STRUCT, PAGE_SIZE_MAX, PAGE_SIZE_MIN, RECORD_BODY_MAX, RECORD_HEADER_STRUCT,
    RECORD_TRAILER_STRUCT, REGION_FLAG_HAS_GPA, REGION_NAME_MAX, REGION_SIZE_MAX, REGION_STRUCT,
    SOURCE_STATE_STRUCT, IncompatFeature, RecordType, SourceFormat, align8, checksum64,
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
@dataclass
class Header:
    magic: bytes
    major_version: int
    minor_version: int
    header_length: int
    incompatible_features: int
    compatible_features: int
    autoclear_features: int
    image_uuid: bytes
    parent_uuid: bytes
    parent_digest: bytes
    page_size: int
    reserved: int
    header_checksum: int
    raw: bytes = b""

    @property
    def has_parent(self) -> bool:
        return self.parent_uuid != bytes(16)


def read_header(image: ImageFile) -> Header:
    """Read and check the fixed part; raise on what makes the rest unreadable."""
    raw = image.read_exact(0, min(HEADER_SIZE_V1_0, image.size), "header")
    if len(raw) < len(HEADER_MAGIC):
        raise TruncatedError(f"expected magic {HEADER_MAGIC.hex(' ')}, the file has only {len(raw)} bytes",
                             offset=0, structure="header.magic", rule="LI-HDR-001")
    if raw[:8] != HEADER_MAGIC:
        raise FormatError(f"expected magic {HEADER_MAGIC.hex(' ')}, got {raw[:8].hex(' ')}",
                          offset=0, structure="header.magic", rule="LI-HDR-001")
    if len(raw) < HEADER_SIZE_V1_0:
        raise TruncatedError(f"expected a {HEADER_SIZE_V1_0}-byte header, file has {len(raw)} bytes",
                             offset=0, structure="header", rule="LI-HDR-003")
    header = Header(*HEADER_STRUCT.unpack(raw))
    if header.major_version != FORMAT_MAJOR:
        raise FormatError(f"expected major_version {FORMAT_MAJOR}, got {header.major_version}",
                          offset=8, structure="header.major_version", rule="LI-HDR-002")
    length = header.header_length
    if length % 8 or not HEADER_SIZE_V1_0 <= length <= HEADER_LENGTH_MAX:
        raise FormatError(f"expected header_length a multiple of 8 in {HEADER_SIZE_V1_0}.."
                          f"{HEADER_LENGTH_MAX}, got {length}", offset=12,
                          structure="header.header_length", rule="LI-HDR-003")
    header.raw = image.read_exact(0, length, "header")
    return header


def header_problems(header: Header) -> Iterator[FormatError]:
    raw = bytearray(header.raw)
    raw[HEADER_CHECKSUM_OFFSET:HEADER_CHECKSUM_OFFSET + 8] = bytes(8)
    computed = checksum64(bytes(raw))
    if computed != header.header_checksum:
        yield FormatError(f"expected header_checksum {computed:#018x}, got {header.header_checksum:#018x}",
                          offset=HEADER_CHECKSUM_OFFSET, structure="header.header_checksum", rule="LI-HDR-004")
    unknown = header.incompatible_features & ~KNOWN_INCOMPAT
    if unknown:
        yield FormatError(f"unknown incompatible feature bits {unknown:#x}", offset=16,
                          structure="header.incompatible_features", rule="LI-HDR-005")
    ps = header.page_size
    if ps & (ps - 1) or not PAGE_SIZE_MIN <= ps <= PAGE_SIZE_MAX:
        yield FormatError(f"expected page_size a power of two in {PAGE_SIZE_MIN}..{PAGE_SIZE_MAX}, got {ps}",
                          offset=88, structure="header.page_size", rule="LI-HDR-006")
    if header.reserved or (header.minor_version == 0 and any(header.raw[HEADER_SIZE_V1_0:])):
        yield FormatError("expected reserved header bytes zero", offset=92, structure="header.reserved",
                          rule="LI-HDR-007")
    has_uuid, has_digest = header.parent_uuid != bytes(16), header.parent_digest != bytes(16)
    has_bit = bool(header.incompatible_features & IncompatFeature.PARENT)
    if not has_uuid == has_digest == has_bit:
        yield FormatError(f"parent_uuid {'set' if has_uuid else 'zero'}, parent_digest "
                          f"{'set' if has_digest else 'zero'}, PARENT bit {'set' if has_bit else 'clear'}: "
                          "expected all three to agree", offset=56, structure="header.parent_uuid",
                          rule="LI-HDR-008")


# --- footer --------------------------------------------------------------------
@dataclass
class Footer:
    magic: bytes
    index_offset: int
    file_length: int
    image_digest: bytes
    footer_checksum: int
    offset: int = 0


def read_footer(image: ImageFile, header_length: int) -> Footer:
    offset = image.size - FOOTER_SIZE
    if offset < header_length:
        raise TruncatedError(f"expected a {FOOTER_SIZE}-byte footer after the header, file has "
                             f"{image.size} bytes (incomplete image)", offset=max(offset, 0),
                             structure="footer", rule="LI-FTR-001")
    raw = image.read_exact(offset, FOOTER_SIZE, "footer")
    footer = Footer(*FOOTER_STRUCT.unpack(raw), offset=offset)
    if footer.magic != FOOTER_MAGIC:
        raise FormatError(f"expected footer magic {FOOTER_MAGIC.hex(' ')}, got {footer.magic.hex(' ')} "
                          "(incomplete or truncated image)", offset=offset, structure="footer.magic",
                          rule="LI-FTR-001")
    computed = checksum64(raw[:40])
    if computed != footer.footer_checksum:
        raise FormatError(f"expected footer_checksum {computed:#018x}, got {footer.footer_checksum:#018x}",
                          offset=offset + 40, structure="footer.footer_checksum", rule="LI-FTR-002")
    if footer.file_length != image.size:
        raise FormatError(f"expected file_length {image.size}, got {footer.file_length}",
                          offset=offset + 16, structure="footer.file_length", rule="LI-FTR-003")
    if not header_length <= footer.index_offset < offset or footer.index_offset % 8:
        raise FormatError(f"expected index_offset an aligned offset in {header_length:#x}..{offset:#x}, "
                          f"got {footer.index_offset:#x}", offset=offset + 8,
                          structure="footer.index_offset", rule="LI-FTR-005")
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
        return RECORD_HEADER_STRUCT.size + align8(self.body_length) + RECORD_TRAILER_STRUCT.size

    @property
    def end(self) -> int:
        return self.offset + self.size

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
    if limit - offset < RECORD_HEADER_STRUCT.size + RECORD_TRAILER_STRUCT.size:
        raise FormatError(f"{limit - offset} bytes before {limit:#x} cannot hold a record",
                          offset=offset, structure=path, rule="LI-REC-001")
    head = image.read_exact(offset, RECORD_HEADER_STRUCT.size, path)
    record_type, flags, body_length = RECORD_HEADER_STRUCT.unpack(head)
    end = offset + RECORD_HEADER_STRUCT.size + align8(body_length) + RECORD_TRAILER_STRUCT.size
    if end > limit:
        raise TruncatedError(f"record of {end - offset} bytes runs past {limit:#x}",
                             offset=offset + 8, structure=path + ".body_length", rule="LI-REC-002")
    if body_length > RECORD_BODY_MAX:
        raise LimitError(f"body_length {body_length} exceeds this reader's limit {RECORD_BODY_MAX} "
                         "(spec §9.2): the image may be valid but is not readable here",
                         offset=offset + 8, structure=path + ".body_length")
    return record_type, flags, body_length


def read_record(image: ImageFile, offset: int, limit: int, index: int | None = None) -> Record:
    """Read one record, checking framing, checksum, padding and flags."""
    record_type, flags, body_length = read_record_header(image, offset, limit, index)
    padded = align8(body_length)
    raw = image.read_exact(offset, RECORD_HEADER_STRUCT.size + padded + 8, record_path(index))
    (stored,) = RECORD_TRAILER_STRUCT.unpack_from(raw, len(raw) - 8)
    body = memoryview(raw)[16:16 + body_length]      # a view: frame bodies are large
    record = Record(offset, record_type, flags, body_length, stored, body)
    computed = checksum64(memoryview(raw)[:-8])
    if computed != stored:
        raise FormatError(f"expected record_checksum {computed:#018x}, got {stored:#018x}",
                          offset=offset + len(raw) - 8, structure=record_path(index, record, "record_checksum"),
                          rule="LI-REC-003")
    if any(raw[16 + body_length:-8]):
        raise FormatError("expected zero padding", offset=offset + 16 + body_length,
                          structure=record_path(index, record, "padding"), rule="LI-REC-004")
    if flags:
        raise FormatError(f"expected flags 0, got {flags:#x}", offset=offset + 4,
                          structure=record_path(index, record, "flags"), rule="LI-REC-005")
    return record


# --- record bodies ---------------------------------------------------------------
class _Body:
    """Cursor over a record body raising LI-REC-007/008 with exact offsets."""

    def __init__(self, record: Record, index: int | None):
        self.record, self.index = record, index
        self.base = record.offset + RECORD_HEADER_STRUCT.size

    def fail(self, rule: str, message: str, at: int = 0, field: str = "") -> FormatError:
        return FormatError(message, offset=self.base + at, rule=rule,
                           structure=record_path(self.index, self.record, field))

    def fixed(self, st: struct.Struct) -> tuple:
        if self.record.body_length < st.size:
            raise self.fail("LI-REC-007", f"expected a body of at least {st.size} bytes, "
                            f"got {self.record.body_length}", 0, "body_length")
        return st.unpack_from(self.record.body)

    def expect_length(self, expected: int) -> None:
        if self.record.body_length != expected:
            raise self.fail("LI-REC-007", f"expected body_length {expected}, got {self.record.body_length}",
                            -8, "body_length")

    def zero(self, value: int, at: int, field: str) -> None:
        if value:
            raise self.fail("LI-REC-008", f"expected reserved {field} 0, got {value:#x}", at, field)

    def name(self, start: int, length: int, limit: int, rule: str) -> str:
        raw = bytes(self.record.body[start:start + length])
        if not 1 <= length <= limit:
            raise self.fail(rule, f"expected a name of 1..{limit} bytes, got {length}", start, "name")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(rule, f"expected UTF-8 name, got invalid byte at {exc.start}", start, "name")


def _parse_region(b: _Body) -> dict:
    region_id, flags, gpa, size, name_length, reserved = b.fixed(REGION_STRUCT)
    b.expect_length(REGION_STRUCT.size + name_length)
    b.zero(reserved, 28, "reserved")
    name = b.name(REGION_STRUCT.size, name_length, REGION_NAME_MAX, "LI-REG-001")
    return dict(region_id=region_id, flags=flags, guest_phys_base=gpa, size_bytes=size, name=name)


def _parse_disk(b: _Body) -> dict:
    disk_id, flags, size, sector_size, method, fingerprint, name_length, reserved = b.fixed(DISK_STRUCT)
    b.expect_length(DISK_STRUCT.size + name_length)
    b.zero(flags, 4, "flags")
    b.zero(reserved, 44, "reserved")
    name = b.name(DISK_STRUCT.size, name_length, DISK_NAME_MAX, "LI-DSK-001")
    return dict(disk_id=disk_id, flags=flags, size_bytes=size, sector_size=sector_size,
                fingerprint_method=method, fingerprint=fingerprint, name=name)


def _parse_source_state(b: _Body) -> dict:
    source_format, tag, sequence = b.fixed(SOURCE_STATE_STRUCT)
    data = bytes(b.record.body[SOURCE_STATE_STRUCT.size:])
    return dict(source_format=source_format, tag=tag, sequence=sequence, len_data=len(data), data=data)


def _parse_page_frame(b: _Body) -> dict:
    first, num_pages, reserved = b.fixed(PAGE_FRAME_STRUCT)
    b.zero(reserved, 12, "reserved")
    size = PAGE_FRAME_STRUCT.size
    return dict(first_ordinal=first, num_pages=num_pages, len_zstd=b.record.body_length - size,
                ofs_zstd=b.base + size)


def _parse_delta_frame(b: _Body) -> dict:
    first, num_deltas, reserved = b.fixed(DELTA_FRAME_STRUCT)
    b.zero(reserved, 12, "reserved")
    table_end = DELTA_FRAME_STRUCT.size + 4 * (num_deltas + 1)
    zstd_start = align8(table_end)
    if b.record.body_length < zstd_start:
        raise b.fail("LI-REC-007", f"expected {num_deltas + 1} entry offsets, body has "
                     f"{b.record.body_length} bytes", 8, "num_deltas")
    offsets = np.frombuffer(b.record.body, dtype="<u4", count=num_deltas + 1, offset=DELTA_FRAME_STRUCT.size)
    if any(b.record.body[table_end:zstd_start]):
        raise b.fail("LI-REC-004", "expected zero padding after entry_offsets", table_end, "padding")
    return dict(first_delta=first, num_deltas=num_deltas, entry_offsets=offsets,
                len_zstd=b.record.body_length - zstd_start, ofs_zstd=b.base + zstd_start)


def _parse_disk_refs(b: _Body) -> dict:
    first, num_refs, reserved = b.fixed(DISK_REFS_STRUCT)
    b.zero(reserved, 12, "reserved")
    b.expect_length(DISK_REFS_STRUCT.size + DISK_REF_STRUCT.size * num_refs)
    if num_refs == 0:
        raise b.fail("LI-REC-007", "expected num_refs >= 1, got 0", 8, "num_refs")
    refs = np.frombuffer(b.record.body, dtype=DISK_REF_DTYPE, offset=DISK_REFS_STRUCT.size)
    bad = np.flatnonzero(refs["reserved"])
    if len(bad):
        b.zero(int(refs["reserved"][bad[0]]), DISK_REFS_STRUCT.size + 16 * int(bad[0]) + 4,
               f"refs[{int(bad[0])}].reserved")
    return dict(first_ref=first, num_refs=num_refs, refs=refs)


def _parse_page_map(b: _Body) -> dict:
    region_id, num_extents = b.fixed(PAGE_MAP_STRUCT)
    b.expect_length(PAGE_MAP_STRUCT.size + EXTENT_STRUCT.size * num_extents)
    extents = np.frombuffer(b.record.body, dtype=EXTENT_DTYPE, offset=PAGE_MAP_STRUCT.size)
    bad = np.flatnonzero(extents["reserved"])
    if len(bad):
        b.zero(int(extents["reserved"][bad[0]]), PAGE_MAP_STRUCT.size + 24 * int(bad[0]) + 14,
               f"extents[{int(bad[0])}].reserved")
    return dict(region_id=region_id, num_extents=num_extents, extents=extents)


def _parse_digests(b: _Body) -> dict:
    region_id, num_digests, first, num_pages = b.fixed(DIGESTS_STRUCT)
    b.expect_length(DIGESTS_STRUCT.size + DIGEST_SIZE * num_digests)
    if num_pages == 0 or num_digests > num_pages:
        raise b.fail("LI-REC-007", f"expected num_pages >= 1 and num_digests <= num_pages, got "
                     f"{num_pages} and {num_digests}", 16, "num_pages")
    digests = np.frombuffer(b.record.body, dtype=np.uint8, offset=DIGESTS_STRUCT.size).reshape(-1, DIGEST_SIZE)
    return dict(region_id=region_id, num_digests=num_digests, first_page=first, num_pages=num_pages,
                digests=digests)


def _parse_index(b: _Body) -> dict:
    num_entries, reserved = b.fixed(INDEX_STRUCT)
    b.zero(reserved, 4, "reserved")
    b.expect_length(INDEX_STRUCT.size + INDEX_ENTRY_STRUCT.size * num_entries)
    entries = np.frombuffer(b.record.body, dtype=INDEX_ENTRY_DTYPE, offset=INDEX_STRUCT.size)
    return dict(num_entries=num_entries, entries=entries)


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
    """Decode a record body by type; unknown optional types give {}."""
    parser = BODY_PARSERS.get(record.record_type)
    if parser is None:
        if record.record_type & 0x8000_0000:
            record.parsed = {}
            return record.parsed
        raise FormatError(f"unknown mandatory record type {record.record_type:#010x}",
                          offset=record.offset, structure=record_path(index, record, "record_type"),
                          rule="LI-REC-006")
    record.parsed = parser(_Body(record, index))
    return record.parsed


def body_problems(record: Record, index: int | None, page_size: int) -> Iterator[FormatError]:
    """Value rules of one parsed body that do not need other records."""
    p, b = record.parsed, _Body(record, index)
    kind = record.record_type
    if kind == RecordType.REGION:
        if p["flags"] & ~REGION_FLAG_HAS_GPA or (not p["flags"] & REGION_FLAG_HAS_GPA and p["guest_phys_base"]):
            yield b.fail("LI-REG-003", f"flags {p['flags']:#x} with guest_phys_base {p['guest_phys_base']:#x}",
                         4, "flags")
        size = p["size_bytes"]
        if size == 0 or size % page_size or size > REGION_SIZE_MAX:
            yield b.fail("LI-REG-002", f"expected size_bytes a non-zero multiple of {page_size} "
                         f"at most 2^48, got {size}", 16, "size_bytes")
    elif kind == RecordType.DISK:
        if p["sector_size"] != DISK_SECTOR_SIZE or p["fingerprint_method"] != FINGERPRINT_SAMPLED_XXH3 \
                or p["size_bytes"] == 0:
            yield b.fail("LI-DSK-002", f"expected sector_size 512, fingerprint_method 1, size > 0; got "
                         f"{p['sector_size']}, {p['fingerprint_method']}, {p['size_bytes']}", 8, "size_bytes")
    elif kind == RecordType.SOURCE_STATE:
        if p["source_format"] not in {int(s) for s in SourceFormat}:
            yield b.fail("LI-SRC-002", f"expected source_format 1 or 2, got {p['source_format']}", 0,
                         "source_format")
    elif kind == RecordType.PAGE_FRAME:
        if not 1 <= p["num_pages"] <= (16 << 20) // page_size:
            yield b.fail("LI-FRM-004", f"expected 1..{(16 << 20) // page_size} pages, got {p['num_pages']}",
                         8, "num_pages")
    elif kind == RecordType.DELTA_FRAME:
        offsets = p["entry_offsets"].astype(np.int64)
        if p["num_deltas"] == 0 or offsets[0] != 0 or (np.diff(offsets) < 0).any():
            yield b.fail("LI-DLT-001", "expected entry_offsets from 0, never decreasing, and num_deltas >= 1",
                         16, "entry_offsets")
    elif kind == RecordType.PAGE_MAP:
        e = p["extents"]
        bad = np.flatnonzero((e["page_class"] < 1) | (e["page_class"] > 6) | (e["num_pages"] == 0))
        if p["num_extents"] == 0 or len(bad):
            i = int(bad[0]) if len(bad) else 0
            yield b.fail("LI-MAP-002", "expected page_class 1..6 and num_pages >= 1 in every extent"
                         + (f", extent {i} has class {int(e['page_class'][i])}, {int(e['num_pages'][i])} pages"
                            if len(bad) else ", got no extents"),
                         PAGE_MAP_STRUCT.size + 24 * i, f"extents[{i}]")
        no_slot = ~np.isin(e["page_class"], [1, 4, 6]) & (e["first_slot"] != 0)
        if no_slot.any():
            i = int(np.flatnonzero(no_slot)[0])
            yield b.fail("LI-MAP-003", f"expected first_slot 0 for class {int(e['page_class'][i])}, "
                         f"got {int(e['first_slot'][i])}", PAGE_MAP_STRUCT.size + 24 * i + 16,
                         f"extents[{i}].first_slot")


def raw_body_dict(record: Record) -> dict:
    """The body as dump_structure reports it (names as in the .ksy)."""
    p = record.parsed or {}
    kind = record.record_type
    if kind == RecordType.SOURCE_STATE:
        return {k: p[k] for k in ("source_format", "tag", "sequence", "len_data")}
    if kind == RecordType.PAGE_FRAME:
        return {k: p[k] for k in ("first_ordinal", "num_pages", "len_zstd")}
    if kind == RecordType.DELTA_FRAME:
        return dict(first_delta=p["first_delta"], num_deltas=p["num_deltas"],
                    entry_offsets=[int(x) for x in p["entry_offsets"]], len_zstd=p["len_zstd"])
    if kind == RecordType.DISK_REFS:
        return dict(first_ref=p["first_ref"], num_refs=p["num_refs"],
                    refs=[dict(disk_id=int(r["disk_id"]), sector=int(r["sector"])) for r in p["refs"]])
    if kind == RecordType.PAGE_MAP:
        return dict(region_id=p["region_id"], num_extents=p["num_extents"],
                    extents=[dict(first_page=int(e["first_page"]), num_pages=int(e["num_pages"]),
                                  page_class=int(e["page_class"]), first_slot=int(e["first_slot"]))
                             for e in p["extents"]])
    if kind == RecordType.DIGESTS:
        return dict(region_id=p["region_id"], num_digests=p["num_digests"], first_page=p["first_page"],
                    num_pages=p["num_pages"], digests=[bytes(d) for d in p["digests"]])
    if kind == RecordType.INDEX:
        return dict(num_entries=p["num_entries"],
                    entries=[dict(record_offset=int(e["record_offset"]), record_type=int(e["record_type"]),
                                  key=int(e["key"]), first=int(e["first"]), count=int(e["count"]))
                             for e in p["entries"]])
    return dict(p)
