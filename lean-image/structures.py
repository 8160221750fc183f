"""Parsing of the header, records and footer (spec §3-§8), shared by reader,
validator and ``dump_structure``. Checks come as generators of FormatError so the
reader can raise the first while the validator collects them all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator, Literal, cast, overload

import numpy as np
import xxhash

from .compression import FrameError, declared_size
from .errors import FormatError, LeanImageError, LimitError, TruncatedError
from .format import (
    BODY_OF,
    DELTA_FRAME_BODY,
    DIGEST_SIZE,
    DIGESTS_BODY,
    DISK_REF,
    DISK_REFS_BODY,
    DISK_SECTOR_SIZE,
    EXTENT,
    FINGERPRINT_SAMPLED_XXH3,
    FOOTER,
    FOOTER_MAGIC,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    FRAME_PAGES_MAX_BYTES,
    HEADER,
    HEADER_LENGTH_MAX,
    HEADER_MAGIC,
    INDEX_BODY,
    INDEX_ENTRY,
    KNOWN_INCOMPAT,
    PAGE_FRAME_BODY,
    PAGE_MAP_BODY,
    PAGE_SIZE_MAX,
    PAGE_SIZE_MIN,
    RECORD,
    RECORD_BODY_MAX,
    RECORD_OPTIONAL_BIT,
    RECORD_TRAILER,
    REGION_FLAG_HAS_GPA,
    REGION_SIZE_MAX,
    HAS_SLOT,
    IS_PAGE_CLASS,
    PRIVATE_SOURCE_FORMATS,
    SOURCE_STATE_BODY,
    IncompatFeature,
    RecordType,
    SourceFormat,
    Structure,
    align8,
    checksum64,
    record_size,
    valid_page_size,
)
from .rules import implements

# the body structure of each record type, looked up by the type a record gives (an int: the
# type may be one format.RecordType does not name)
_BODY_OF = cast("dict[int, Structure]", BODY_OF)


# a link file smaller than this is read whole when opened: the tables opening checks are then
# one read, not one per record (a cold chain of 1000 small links paid ~1 ms per link for them)
WHOLE_READ_BELOW = 1 << 20


class ImageFile:
    """Positional reads with exact-length checking. With ``whole_below``, a file smaller than
    that many bytes is read in one read (a chain's small links: one I/O per file, not one per
    record), served from memory until ``drop_whole`` (the file is not read again meanwhile).
    ``whole``: the file's bytes, read whole already (``holding``)."""

    def __init__(self, fileobj, name: str = "", whole_below: int = 0, whole: bytes | None = None):
        self.fileobj = fileobj
        self.name = name
        self._whole: bytes | None = whole
        if whole is not None:
            self.size = len(whole)
            return
        fileobj.seek(0, 2)
        self.size = fileobj.tell()
        if self.size < whole_below:
            data = self.pread(self.size, 0)
            self._whole = data if len(data) == self.size else None

    @classmethod
    def holding(cls, fileobj, name: str, data: bytes) -> "ImageFile":
        """As ``ImageFile(fileobj, name, whole_below)`` for a file already read whole into ``data``."""
        return cls(fileobj, name, whole=data)

    def pread(self, length: int, offset: int) -> bytes:
        """os.pread of the file (an object in a store, locations.open_image, has its own)."""
        own = getattr(self.fileobj, "pread", None)
        return own(length, offset) if own is not None else os.pread(self.fileobj.fileno(), length, offset)

    @property
    def holds_whole(self) -> bool:
        return self._whole is not None

    def drop_whole(self) -> None:
        """Read from the file again from now on (memory held only while opening)."""
        self._whole = None

    @overload
    def read_exact(self, offset: int, length: int, structure, view: Literal[False] = False) -> bytes: ...

    @overload
    def read_exact(self, offset: int, length: int, structure, view: bool) -> bytes | memoryview: ...

    def read_exact(self, offset: int, length: int, structure, view: bool = False) -> bytes | memoryview:
        """``structure``: the path errors name, or a function giving it (built only on an error).
        ``view``: of a file held whole, a memoryview of its bytes rather than a copy (for a
        caller that copies what it keeps)."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise TruncatedError(
                f"expected {length} bytes, file ends at {self.size:#x}", offset=offset, structure=_named(structure)
            )
        whole = self._whole
        if whole is not None:
            data = memoryview(whole)[offset : offset + length] if view else whole[offset : offset + length]
        else:
            data = self.pread(length, offset)
        if len(data) != length:
            raise TruncatedError(
                f"expected {length} bytes, got {len(data)}", offset=offset, structure=_named(structure)
            )
        return data


def _named(structure) -> str:
    return structure() if callable(structure) else structure


# --- header --------------------------------------------------------------------
_HEADER_FIELDS = tuple(f.name for f in HEADER.head)
_FOOTER_FIELDS = tuple(f.name for f in FOOTER.head)


class Header:
    """The header's fields (named as HEADER declares them) and its raw bytes."""

    # HEADER's head fields, set from the bytes in __init__ (declared here for type checkers)
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

    def __init__(self, raw: bytes):
        self.__dict__.update(zip(_HEADER_FIELDS, HEADER.struct.unpack_from(raw)))  # (a deep chain makes many)
        self.raw = raw

    @property
    def has_parent(self) -> bool:
        return self.parent_uuid != bytes(16)

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in HEADER.head}


def _header_error(field: str, message: str, rule: str, error=FormatError) -> FormatError:
    return error(message, offset=HEADER.offset(field), structure=f"header.{field}", rule=rule)


@implements("LI-HDR-001", "LI-HDR-002", "LI-HDR-003")
def read_header(image: ImageFile) -> Header:
    """Read and check the fixed part; raise on what makes the rest unreadable."""
    raw = image.read_exact(0, min(HEADER.size, image.size), "header")
    if len(raw) < len(HEADER_MAGIC):
        raise _header_error(
            "magic",
            f"expected magic {HEADER_MAGIC.hex(' ')}, the file has only {len(raw)} bytes",
            "LI-HDR-001",
            TruncatedError,
        )
    if raw[: len(HEADER_MAGIC)] != HEADER_MAGIC:
        raise _header_error("magic", f"expected magic {HEADER_MAGIC.hex(' ')}, got {raw[:8].hex(' ')}", "LI-HDR-001")
    if len(raw) < HEADER.size:
        raise TruncatedError(
            f"expected a {HEADER.size}-byte header, file has {len(raw)} bytes",
            offset=0,
            structure="header",
            rule="LI-HDR-003",
        )
    header = Header(raw)
    if header.major_version != FORMAT_MAJOR:
        raise _header_error(
            "major_version", f"expected major_version {FORMAT_MAJOR}, got {header.major_version}", "LI-HDR-002"
        )
    length = header.header_length
    if length % 8 or not HEADER.size <= length <= HEADER_LENGTH_MAX:
        raise _header_error(
            "header_length",
            f"expected header_length a multiple of 8 in {HEADER.size}..{HEADER_LENGTH_MAX}, got {length}",
            "LI-HDR-003",
        )
    header.raw = image.read_exact(0, length, "header")
    return header


def header_checksum(raw: bytes) -> int:
    """xxh3-64 of the header with its checksum field zeroed (spec §3.6)."""
    at = HEADER.offset("header_checksum")
    return checksum64(bytes(raw[:at]) + bytes(8) + bytes(raw[at + 8 :]))


@implements("LI-HDR-004", "LI-HDR-005", "LI-HDR-006", "LI-HDR-007", "LI-HDR-008", "LI-HDR-010")
def header_problems(header: Header) -> Iterator[FormatError]:
    computed = header_checksum(header.raw)
    if computed != header.header_checksum:
        yield _header_error(
            "header_checksum",
            f"expected header_checksum {computed:#018x}, got {header.header_checksum:#018x}",
            "LI-HDR-004",
        )
    unknown = header.incompatible_features & ~KNOWN_INCOMPAT
    if unknown:
        yield _header_error("incompatible_features", f"unknown incompatible feature bits {unknown:#x}", "LI-HDR-005")
    if not valid_page_size(header.page_size):
        yield _header_error(
            "page_size",
            f"expected page_size a power of two in {PAGE_SIZE_MIN}..{PAGE_SIZE_MAX}, got {header.page_size}",
            "LI-HDR-006",
        )
    if header.reserved or (header.minor_version <= FORMAT_MINOR and any(header.raw[HEADER.size :])):
        yield _header_error("reserved", "expected reserved header bytes zero", "LI-HDR-007")
    has_uuid, has_digest = header.parent_uuid != bytes(16), header.parent_digest != bytes(16)
    has_bit = bool(header.incompatible_features & IncompatFeature.PARENT)
    if not has_uuid == has_digest == has_bit:
        yield _header_error(
            "parent_uuid",
            f"parent_uuid {'set' if has_uuid else 'zero'}, parent_digest "
            f"{'set' if has_digest else 'zero'}, PARENT bit {'set' if has_bit else 'clear'}: "
            "expected all three to agree",
            "LI-HDR-008",
        )
    if header.incompatible_features & IncompatFeature.INHERITED_DIGESTS and not has_bit:
        yield _header_error(
            "incompatible_features",
            "INHERITED_DIGESTS bit set without the PARENT bit: an image without a parent has no digests to inherit",
            "LI-HDR-010",
        )


# --- footer --------------------------------------------------------------------
class Footer:
    """The footer's fields (named as FOOTER declares them) and its file offset."""

    # FOOTER's head fields, set from the bytes in __init__ (declared here for type checkers)
    magic: bytes
    index_offset: int
    file_length: int
    image_digest: bytes
    footer_checksum: int

    def __init__(self, raw: bytes, offset: int):
        self.__dict__.update(zip(_FOOTER_FIELDS, FOOTER.struct.unpack_from(raw)))
        self.offset = offset

    def fields(self) -> dict:
        return {f.name: getattr(self, f.name) for f in FOOTER.head}


# the declarations above name every field the structures unpack
assert set(Header.__annotations__) == set(_HEADER_FIELDS) and set(Footer.__annotations__) == set(_FOOTER_FIELDS)


def footer_checksum(raw: bytes) -> int:
    return checksum64(bytes(raw[: FOOTER.offset("footer_checksum")]))


@implements("LI-FTR-001", "LI-FTR-002", "LI-FTR-003")
def read_footer(image: ImageFile, header_length: int) -> Footer:
    offset = image.size - FOOTER.size

    def fail(field: str, message: str, rule: str, error=FormatError):
        return error(message, offset=offset + FOOTER.offset(field), structure=f"footer.{field}", rule=rule)

    if offset < header_length:
        raise TruncatedError(
            f"expected a {FOOTER.size}-byte footer after the header, file has {image.size} bytes (incomplete image)",
            offset=max(offset, 0),
            structure="footer",
            rule="LI-FTR-001",
        )
    raw = image.read_exact(offset, FOOTER.size, "footer")
    footer = Footer(raw, offset)
    if footer.magic != FOOTER_MAGIC:
        raise fail(
            "magic",
            f"expected footer magic {FOOTER_MAGIC.hex(' ')}, got {footer.magic.hex(' ')} "
            "(incomplete or truncated image)",
            "LI-FTR-001",
        )
    computed = footer_checksum(raw)
    if computed != footer.footer_checksum:
        raise fail(
            "footer_checksum",
            f"expected footer_checksum {computed:#018x}, got {footer.footer_checksum:#018x}",
            "LI-FTR-002",
        )
    if footer.file_length != image.size:
        raise fail("file_length", f"expected file_length {image.size}, got {footer.file_length}", "LI-FTR-003")
    for problem in index_location_problems(footer, header_length):
        raise problem
    return footer


@implements("LI-FTR-004")
def image_digest_problems(image: ImageFile, footer: Footer) -> Iterator[FormatError]:
    """image_digest is the xxh3-128 of every byte before the footer (reads the whole file)."""
    hasher = xxhash.xxh3_128()
    image.fileobj.seek(0)
    remaining = footer.offset
    while remaining:
        chunk = image.fileobj.read(min(remaining, 8 << 20))
        if not chunk:
            break
        hasher.update(chunk)
        remaining -= len(chunk)
    if hasher.digest() != footer.image_digest:
        yield FormatError(
            f"expected image_digest {hasher.digest().hex()}, got {footer.image_digest.hex()}",
            offset=footer.offset + FOOTER.offset("image_digest"),
            structure="footer.image_digest",
            rule="LI-FTR-004",
        )


@implements("LI-FTR-005")
def index_location_problems(
    footer: Footer, header_length: int, index: Record | None = None, scanned_index: Record | None = None
) -> Iterator[FormatError]:
    """index_offset is an aligned offset between header and footer; with ``index`` (the record
    read there) it is the INDEX record ending at the footer; with ``scanned_index`` (the INDEX
    a sequential scan found) it is that one."""
    field_offset = footer.offset + FOOTER.offset("index_offset")
    where = "footer.index_offset"
    if not header_length <= footer.index_offset < footer.offset or footer.index_offset % 8:
        yield FormatError(
            f"expected index_offset an aligned offset in {header_length:#x}..{footer.offset:#x}, "
            f"got {footer.index_offset:#x}",
            offset=field_offset,
            structure=where,
            rule="LI-FTR-005",
        )
    elif index is not None and (index.record_type != RecordType.INDEX or index.end != footer.offset):
        yield FormatError(
            f"expected the INDEX record ending at the footer {footer.offset:#x}, got "
            f"{index.name} ending at {index.end:#x}",
            offset=footer.index_offset,
            structure=where,
            rule="LI-FTR-005",
        )
    elif scanned_index is not None and scanned_index.offset != footer.index_offset:
        yield FormatError(
            f"expected index_offset {scanned_index.offset:#x}, got {footer.index_offset:#x}",
            offset=field_offset,
            structure=where,
            rule="LI-FTR-005",
        )


# --- records -------------------------------------------------------------------
@dataclass
class Record:
    offset: int
    record_type: int
    flags: int
    body_length: int
    record_checksum: int
    body: memoryview
    index: int | None = None  # position in file order, for structure paths
    parsed: dict | None = None

    @property
    def fields(self) -> dict:
        """The parsed body: parse_body has run (every reader of records parses what it reads)."""
        if self.parsed is None:
            raise RuntimeError(f"{self.path()}: read but not parsed")
        return self.parsed

    @property
    def size(self) -> int:
        return record_size(self.body_length)

    @property
    def end(self) -> int:
        return self.offset + self.size

    @property
    def body_offset(self) -> int:
        return self.offset + RECORD.size

    @property
    def name(self) -> str:
        return record_type_name(self.record_type)

    def path(self, field: str = "") -> str:
        return record_path(self.index, self, field)

    def error(self, rule: str | None, message: str, at: int = 0, field: str = "") -> FormatError:
        """A finding about this record, ``at`` bytes into its body."""
        return FormatError(message, offset=self.body_offset + at, structure=self.path(field), rule=rule)


def record_type_name(record_type: int) -> str:
    """A record type as structure paths name it: ``page_map``, or ``type_0x00000077``."""
    try:
        return RecordType(record_type).name.lower()
    except ValueError:
        return f"type_{record_type:#010x}"


def record_path(
    index: int | None, record: Record | None = None, field: str = "", *, record_type: int | None = None
) -> str:
    """``record[3].page_map.extents``: position, type (of ``record`` or ``record_type``), field."""
    kind = record.record_type if record is not None else record_type
    name = record_type_name(kind) if kind is not None else "record"
    where = f"record[{index}]" if index is not None else "record"
    return f"{where}.{name}" + (f".{field}" if field else "")


@implements("LI-REC-002")
def read_record_header(image: ImageFile, offset: int, limit: int, index: int | None) -> tuple[int, int, int]:
    head = RECORD.unpack(image.read_exact(offset, RECORD.size, lambda: record_path(index)))
    end = offset + record_size(head.body_length)
    if end > limit:
        raise TruncatedError(
            f"record of {end - offset} bytes runs past {limit:#x}",
            offset=offset + RECORD.offset("body_length"),
            structure=record_path(index, record_type=head.record_type) + ".body_length",
            rule="LI-REC-002",
        )
    if head.body_length > RECORD_BODY_MAX:
        raise LimitError(
            f"body_length {head.body_length} exceeds this reader's limit {RECORD_BODY_MAX} "
            "(spec §9.2): the image may be valid but is not readable here",
            offset=offset + RECORD.offset("body_length"),
            structure=record_path(index, record_type=head.record_type) + ".body_length",
        )
    return head.record_type, head.flags, head.body_length


@implements("LI-REC-003", "LI-REC-005")
def read_record(image: ImageFile, offset: int, limit: int, index: int | None = None) -> Record:
    """Read one record, checking framing, checksum, padding and flags."""
    record_type, flags, body_length = read_record_header(image, offset, limit, index)
    raw = image.read_exact(offset, record_size(body_length), lambda: record_path(index))
    trailer_at = len(raw) - RECORD_TRAILER.size
    (stored,) = RECORD_TRAILER.unpack_from(raw, trailer_at)
    body = memoryview(raw)[RECORD.size : RECORD.size + body_length]  # a view: frame bodies are large
    record = Record(offset, record_type, flags, body_length, stored, body, index)
    computed = checksum64(memoryview(raw)[:trailer_at])
    if computed != stored:
        raise FormatError(
            f"expected record_checksum {computed:#018x}, got {stored:#018x}",
            offset=offset + trailer_at,
            structure=record.path("record_checksum"),
            rule="LI-REC-003",
        )
    for problem in padding_problems(
        raw[RECORD.size + body_length : trailer_at], offset + RECORD.size + body_length, lambda: record.path("padding")
    ):
        raise problem
    if flags:
        raise FormatError(
            f"expected flags 0, got {flags:#x}",
            offset=offset + RECORD.offset("flags"),
            structure=record.path("flags"),
            rule="LI-REC-005",
        )
    return record


@implements("LI-REC-004")
def padding_problems(padding, offset: int, structure) -> Iterator[FormatError]:
    if any(padding):
        yield FormatError("expected zero padding", offset=offset, structure=_named(structure), rule="LI-REC-004")


@implements("LI-REC-001")
def scan_records(image: ImageFile, start: int, limit: int, listed=()) -> Iterator[Record | LeanImageError]:
    """Every record from ``start`` to ``limit`` in file order, or the error that stopped one.

    After a record that cannot be read, the scan continues behind it when its framing is
    sound; at an offset the INDEX does not list (``listed``: the record offsets it gives)
    with a listed record further on, the bytes in between belong to no record."""
    offset, i = start, 0
    listed = sorted(listed)
    while offset < limit:
        if limit - offset < RECORD.size + RECORD_TRAILER.size:
            yield FormatError(
                f"{limit - offset} bytes before {limit:#x} cannot hold a record",
                offset=offset,
                structure=record_path(i),
                rule="LI-REC-001",
            )
            return
        try:
            record = read_record(image, offset, limit, i)
        except LeanImageError as exc:
            following = [o for o in listed if o > offset]
            if listed and offset not in listed and following:
                yield FormatError(
                    f"bytes {offset:#x}..{following[0]:#x} belong to no record: the index "
                    f"lists the next record at {following[0]:#x}",
                    offset=offset,
                    structure=record_path(i),
                    rule="LI-REC-001",
                )
                offset = following[0]
                continue
            yield exc
            try:
                offset = offset + record_size(read_record_header(image, offset, limit, i)[2])
            except LeanImageError:
                return
            i += 1
            continue
        yield record
        offset, i = record.end, i + 1


# --- record bodies ---------------------------------------------------------------
class _Body:
    """Cursor over a record body of a type BODY_OF names: parsed fields, and findings at exact offsets."""

    def __init__(self, record: Record, index: int | None):
        self.record, self.index = record, index
        self.structure = _BODY_OF[record.record_type]
        self.base = record.body_offset

    def fail(self, rule: str, message: str, at: int = 0, field: str = "") -> FormatError:
        return FormatError(
            message, offset=self.base + at, rule=rule, structure=record_path(self.index, self.record, field)
        )

    def fail_at(self, rule: str, message: str, field: str) -> FormatError:
        """An error about a head field of the body, at that field's offset."""
        return self.fail(rule, message, self.structure.offset(field), field)

    def table(self, at: int, element, count: int) -> np.ndarray:
        """``count`` elements of a declared structure from body offset ``at``."""
        return np.frombuffer(self.record.body, dtype=element.dtype, count=count, offset=at)

    def name(self, values: dict) -> str:
        """The name (checked by the region and disk table rules, checks.py), decoded leniently."""
        start = self.structure.size
        return bytes(self.record.body[start : start + values["name_length"]]).decode("utf-8", "replace")


def _first(problems) -> None:
    for problem in problems:
        raise problem


@implements("LI-REC-007")
def body_length_problems(record: Record, head: dict | None) -> Iterator[FormatError]:
    """body_length as the type's structure requires (spec §4.4); ``head`` is None when the
    body is shorter than the structure's fixed part."""
    structure = _BODY_OF[record.record_type]
    if head is None:
        yield record.error(
            "LI-REC-007",
            f"expected a body of at least {structure.size} bytes, got {record.body_length}",
            0,
            "body_length",
        )
        return
    kind = record.record_type
    if kind == RecordType.DELTA_FRAME:
        needed = align8(DELTA_FRAME_BODY.size + 4 * (head["num_deltas"] + 1))
        if record.body_length < needed:
            yield record.error(
                "LI-REC-007",
                f"expected {head['num_deltas'] + 1} entry offsets, body has {record.body_length} bytes",
                structure.offset("num_deltas"),
                "num_deltas",
            )
        return
    exact = _exact_body_length(kind, head)
    if exact is not None and record.body_length != exact:
        yield record.error(
            "LI-REC-007",
            f"expected body_length {exact}, got {record.body_length}",
            RECORD.offset("body_length") - RECORD.size,
            "body_length",
        )
    elif kind == RecordType.DISK_REFS and head["num_refs"] == 0:
        yield record.error("LI-REC-007", "expected num_refs >= 1, got 0", structure.offset("num_refs"), "num_refs")
    elif kind == RecordType.DIGESTS and (head["num_pages"] == 0 or head["num_digests"] > head["num_pages"]):
        yield record.error(
            "LI-REC-007",
            f"expected num_pages >= 1 and num_digests <= num_pages, got {head['num_pages']} and {head['num_digests']}",
            structure.offset("num_pages"),
            "num_pages",
        )


def _exact_body_length(kind: int, head: dict) -> int | None:
    """The body_length a type's head fixes (spec §4.4), or None where the body runs on."""
    tails: dict[int, Callable[[], int]] = {
        RecordType.REGION: lambda: head["name_length"],
        RecordType.DISK: lambda: head["name_length"],
        RecordType.DISK_REFS: lambda: DISK_REF.size * head["num_refs"],
        RecordType.PAGE_MAP: lambda: EXTENT.size * head["num_extents"],
        RecordType.DIGESTS: lambda: DIGEST_SIZE * head["num_digests"],
        RecordType.INDEX: lambda: INDEX_ENTRY.size * head["num_entries"],
    }
    tail = tails.get(kind)
    return None if tail is None else _BODY_OF[kind].size + tail()


@implements("LI-REC-008")
def reserved_problems(structure, values, at: int | None, path: str) -> Iterator[FormatError]:
    """The fields ``structure`` declares zero (reserved ones, DISK flags) are zero; ``values`` is
    one head (a dict) or a table of them (a numpy array), ``at`` the file offset of the first."""
    for field in structure.zero_fields:
        column = values[field]
        if isinstance(column, np.ndarray):
            bad = np.flatnonzero(column)
            if len(bad):
                k = int(bad[0])
                yield FormatError(
                    f"expected {field} of element {k} 0, got {int(column[k]):#x}",
                    offset=at + structure.size * k + structure.offset(field),
                    structure=f"{path}[{k}].{field}",
                    rule="LI-REC-008",
                )
        elif column:
            yield FormatError(
                f"expected {field} 0, got {column:#x}",
                offset=None if at is None else at + structure.offset(field),
                structure=f"{path}.{field}" if path else field,
                rule="LI-REC-008",
            )


def _parse_region(b: _Body, p: dict) -> dict:
    p["name"] = b.name(p)
    return p


def _parse_disk(b: _Body, p: dict) -> dict:
    p["name"] = b.name(p)
    return p


def _parse_source_state(b: _Body, p: dict) -> dict:
    p["data"] = b.record.body[SOURCE_STATE_BODY.size :]
    return p


def _parse_page_frame(b: _Body, p: dict) -> dict:
    p["frame"] = b.record.body[PAGE_FRAME_BODY.size :]
    return p


def _parse_delta_frame(b: _Body, p: dict) -> dict:
    table_end = DELTA_FRAME_BODY.size + 4 * (p["num_deltas"] + 1)
    frame_start = align8(table_end)
    p["entry_offsets"] = np.frombuffer(
        b.record.body, dtype="<u4", count=p["num_deltas"] + 1, offset=DELTA_FRAME_BODY.size
    )
    p["padding"] = bytes(b.record.body[table_end:frame_start])
    _first(padding_problems(p["padding"], b.base + table_end, b.record.path("padding")))
    p["frame"] = b.record.body[frame_start:]
    return p


def _parse_disk_refs(b: _Body, p: dict) -> dict:
    p["refs"] = b.table(DISK_REFS_BODY.size, DISK_REF, p["num_refs"])
    _first(reserved_problems(DISK_REF, p["refs"], b.base + DISK_REFS_BODY.size, b.record.path("refs")))
    return p


def _parse_page_map(b: _Body, p: dict) -> dict:
    p["extents"] = b.table(PAGE_MAP_BODY.size, EXTENT, p["num_extents"])
    _first(reserved_problems(EXTENT, p["extents"], b.base + PAGE_MAP_BODY.size, b.record.path("extents")))
    return p


def _parse_digests(b: _Body, p: dict) -> dict:
    p["digests"] = np.frombuffer(b.record.body, dtype=np.uint8, offset=DIGESTS_BODY.size).reshape(-1, DIGEST_SIZE)
    return p


def _parse_index(b: _Body, p: dict) -> dict:
    p["entries"] = b.table(INDEX_BODY.size, INDEX_ENTRY, p["num_entries"])
    return p


BODY_PARSERS: dict[int, Callable[[_Body, dict], dict]] = {
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


@implements("LI-REC-006")
def parse_body(record: Record, index: int | None = None) -> dict:
    """Decode a record body by type into its declared fields; unknown optional types give {}."""
    if index is not None:
        record.index = index
    parser = BODY_PARSERS.get(record.record_type)
    if parser is None:
        if record.record_type & RECORD_OPTIONAL_BIT:
            record.parsed = {}
            return record.parsed
        raise FormatError(
            f"unknown mandatory record type {record.record_type:#010x}",
            offset=record.offset,
            structure=record.path("record_type"),
            rule="LI-REC-006",
        )
    b = _Body(record, record.index)
    structure = b.structure
    head = structure.unpack(record.body)._asdict() if record.body_length >= structure.size else None
    _first(body_length_problems(record, head))
    assert head is not None  # (body_length_problems raised for a body shorter than its head)
    _first(reserved_problems(structure, head, b.base, record.path()))
    record.parsed = parser(b, head)
    return record.parsed


def parse_tested_body(record: Record) -> dict:
    """parse_body for a record of a known type whose body length and reserved fields were
    tested already (links_batch tests a batch's INDEX records together): no finding to look for."""
    b = _Body(record, record.index)
    record.parsed = BODY_PARSERS[record.record_type](b, b.structure.unpack(record.body)._asdict())
    return record.parsed


def body_problems(record: Record, index: int | None, page_size: int) -> Iterator[FormatError]:
    """Value rules of one parsed body that do not need other records."""
    check = BODY_CHECKS.get(record.record_type)
    if check is not None:
        yield from check(record.fields, _Body(record, index), page_size)


@implements("LI-REG-002", "LI-REG-003")
def _region_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    has_gpa = p["flags"] & REGION_FLAG_HAS_GPA
    if p["flags"] & ~REGION_FLAG_HAS_GPA or (not has_gpa and p["guest_phys_base"]):
        yield b.fail_at("LI-REG-003", f"flags {p['flags']:#x} with guest_phys_base {p['guest_phys_base']:#x}", "flags")
    size = p["size_bytes"]
    if size == 0 or size % page_size or size > REGION_SIZE_MAX:
        yield b.fail_at(
            "LI-REG-002",
            f"expected size_bytes a non-zero multiple of {page_size} at most 2^48, got {size}",
            "size_bytes",
        )


@implements("LI-DSK-002")
def _disk_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    if (
        p["sector_size"] != DISK_SECTOR_SIZE
        or p["fingerprint_method"] != FINGERPRINT_SAMPLED_XXH3
        or p["size_bytes"] == 0
    ):
        yield b.fail_at(
            "LI-DSK-002",
            f"expected sector_size 512, fingerprint_method 1, size > 0; got "
            f"{p['sector_size']}, {p['fingerprint_method']}, {p['size_bytes']}",
            "size_bytes",
        )


@implements("LI-SRC-002")
def _source_state_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    if p["source_format"] not in {int(s) for s in SourceFormat} and p["source_format"] < PRIVATE_SOURCE_FORMATS:
        yield b.fail_at(
            "LI-SRC-002",
            f"expected source_format 1, 2 or at least {PRIVATE_SOURCE_FORMATS:#x} "
            f"(private use), got {p['source_format']:#x}",
            "source_format",
        )


@implements("LI-FRM-004")
def frame_size_problems(record_type: int, amount: int, page_size: int, offset: int, path: str) -> Iterator[FormatError]:
    """A PAGE_FRAME holds 1 page or more and at most 16 MiB of them (``amount``: num_pages);
    a DELTA_FRAME at most 16 MiB of entries (``amount``: their bytes). ``offset``: the
    record's body."""
    if record_type == RecordType.PAGE_FRAME:
        most = FRAME_PAGES_MAX_BYTES // page_size
        if not 1 <= amount <= most:
            yield FormatError(
                f"expected 1..{most} pages, got {amount}",
                rule="LI-FRM-004",
                offset=offset + PAGE_FRAME_BODY.offset("num_pages"),
                structure=f"{path}.num_pages",
            )
    elif amount > FRAME_PAGES_MAX_BYTES:
        yield FormatError(
            f"entries of {amount} bytes exceed {FRAME_PAGES_MAX_BYTES} bytes",
            rule="LI-FRM-004",
            offset=offset + DELTA_FRAME_BODY.size,
            structure=f"{path}.entry_offsets",
        )


def _page_frame_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    yield from frame_size_problems(RecordType.PAGE_FRAME, p["num_pages"], page_size, b.base, b.record.path())


@implements("LI-DLT-001")
def _delta_offsets(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    """entry_offsets start at 0, never decrease and end at the size the zstd frame declares."""
    offsets = p["entry_offsets"].astype(np.int64)
    if p["num_deltas"] == 0 or offsets[0] != 0 or (np.diff(offsets) < 0).any():
        yield b.fail(
            "LI-DLT-001",
            "expected entry_offsets from 0, never decreasing, and num_deltas >= 1",
            DELTA_FRAME_BODY.size,
            "entry_offsets",
        )
        return
    try:
        declared = declared_size(p["frame"])
    except FrameError:
        return  # not a zstd frame: LI-FRM-002 when it is read
    if declared is not None and declared != int(offsets[-1]):
        yield b.fail(
            "LI-DLT-001",
            f"last entry offset {int(offsets[-1])}, zstd frame declares {declared} bytes",
            DELTA_FRAME_BODY.size + 4 * (len(offsets) - 1),
            "entry_offsets",
        )


def _delta_frame_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    yield from _delta_offsets(p, b, page_size)
    yield from frame_size_problems(
        RecordType.DELTA_FRAME, int(p["entry_offsets"][-1]), page_size, b.base, b.record.path()
    )


@implements("LI-MAP-002", "LI-MAP-003")
def _page_map_values(p: dict, b: _Body, page_size: int) -> Iterator[FormatError]:
    e = p["extents"]
    bad = np.flatnonzero(~IS_PAGE_CLASS[e["page_class"]] | (e["num_pages"] == 0))
    if p["num_extents"] == 0 or len(bad):
        i = int(bad[0]) if len(bad) else 0
        yield b.fail(
            "LI-MAP-002",
            "expected page_class 1..6 and num_pages >= 1 in every extent"
            + (
                f", extent {i} has class {int(e['page_class'][i])}, {int(e['num_pages'][i])} pages"
                if len(bad)
                else ", got no extents"
            ),
            PAGE_MAP_BODY.size + EXTENT.size * i,
            f"extents[{i}]",
        )
    no_slot = ~HAS_SLOT[e["page_class"]] & (e["first_slot"] != 0)
    if no_slot.any():
        i = int(np.flatnonzero(no_slot)[0])
        yield b.fail(
            "LI-MAP-003",
            f"expected first_slot 0 for class {int(e['page_class'][i])}, got {int(e['first_slot'][i])}",
            PAGE_MAP_BODY.size + EXTENT.size * i + EXTENT.offset("first_slot"),
            f"extents[{i}].first_slot",
        )


BODY_CHECKS: dict[int, Callable[[dict, _Body, int], Iterator[FormatError]]] = {
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


def dump_structure(path) -> dict:
    """Every structure of an image with every field its declaration (format.py) names, as plain
    Python values: the names the spec's tables and the .ksy use."""
    from .locations import display, open_image

    with open_image(path) as fileobj:
        image = ImageFile(fileobj, display(path))
        header = read_header(image)
        footer = read_footer(image, header.header_length)
        records = []
        for item in scan_records(image, header.header_length, footer.offset):
            if isinstance(item, LeanImageError):
                raise item
            records.append(dump_record(item, parse_body(item)))
    header_dump = dict(header.fields(), extension=bytes(header.raw[HEADER.size :]))
    return dict(header=header_dump, records=records, footer=footer.fields())


def dump_record(record: Record, body: dict) -> dict:
    structure = _BODY_OF.get(record.record_type)
    return dict(
        offset=record.offset,
        record_type=record.record_type,
        flags=record.flags,
        body_length=record.body_length,
        body=dump_fields(structure, body) if structure else bytes(record.body),
        padding=bytes(align8(record.body_length) - record.body_length),
        record_checksum=record.record_checksum,
    )
