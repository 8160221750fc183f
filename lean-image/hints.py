"""The hint protocol (spec/hints.md): what a writer may be told while it writes, in one byte
format for a file and for a stream over a pipe or socket.

Producers write hints with ``HintWriter``; ``read_hints`` reads a whole file or stream (the
first violation raises ``HintError`` naming offset, structure and rule), ``iter_records``
yields records as they arrive, ``check_hints`` yields every violation (``leanimg
validate-hints``). ``Guest`` describes the save the hints are for; ``check_against`` checks
the rules that need it and ``resolve`` turns the hints into page ranges per region. Applying
them to a conversion is the converters' business (converters/hinting.py).
"""

from __future__ import annotations

import io
import os
import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import BinaryIO, Iterator

import numpy as np
import xxhash

from .arrays import distinct
from .errors import LeanImageError
from .rules import implements

MAGIC = b"\x89LEANHNT"
MAJOR, MINOR = 1, 0
HEADER = struct.Struct("<8sHHIHHIQ")  # magic, major, minor, page_size, address_map, flags, reserved, checksum
RECORD_HEAD = struct.Struct("<HHI")  # type, flags, payload_length
CHECKSUM = struct.Struct("<Q")
NAME_HEAD = struct.Struct("<HHI")  # id, name_length, reserved
PARENT_BODY = struct.Struct("<16sQ")  # image_uuid, reserved
RANGE_HEAD = struct.Struct("<QHHHHII")  # stream_offset, addressing, region_id, source, reserved, count, reserved
END_BODY = struct.Struct("<Q")
RANGE = np.dtype([("first", "<u8"), ("num_pages", "<u8")])
DISK_RUN = np.dtype(
    [("first", "<u8"), ("num_pages", "<u4"), ("disk_id", "<u2"), ("reserved", "<u2"), ("sector", "<u8")]
)

OPTIONAL = 0x8000
MAX_PAYLOAD = 1 << 20
MAX_RECORDS = 1 << 16
MAX_RANGES = 1 << 22
MAX_IDS = 256
SECTOR = 512
GIB = 1 << 30


class RecordType(IntEnum):
    DISK_NAME = 1
    REGION_NAME = 2
    PARENT = 3
    FREE = 4
    DISK = 5
    UNCHANGED = 6
    END = 7


class AddressMap(IntEnum):
    NONE = 0
    QEMU_PC = 1
    XEN = 2


class Addressing(IntEnum):
    GUEST_PHYSICAL = 1
    REGION = 2


class FreeSource(IntEnum):
    UNSPECIFIED = 0
    GUEST = 1  # the guest's own free lists
    BALLOON = 2  # pages a balloon holds
    HYPERVISOR = 3  # pages the hypervisor skipped under free-page hinting


RANGE_KINDS = {RecordType.FREE: RANGE, RecordType.UNCHANGED: RANGE, RecordType.DISK: DISK_RUN}


class HintError(LeanImageError):
    """The hints violate spec/hints.md (a rule LI-HNT-NNN)."""


@dataclass
class RangeRecord:
    """A FREE, DISK or UNCHANGED record: ``entries`` is an array of RANGE or DISK_RUN."""

    kind: RecordType
    stream_offset: int
    addressing: int
    region_id: int
    source: int
    entries: np.ndarray
    offset: int  # of the record in the hints
    index: int  # record number

    @property
    def structure(self) -> str:
        return f"record[{self.index}] {self.kind.name}"


@dataclass
class Hints:
    page_size: int
    address_map: int
    disks: dict = field(default_factory=dict)  # id -> name
    regions: dict = field(default_factory=dict)  # id -> name
    parent_uuid: bytes | None = None
    records: list = field(default_factory=list)  # RangeRecords in file order
    length: int = 0

    def of_kind(self, kind: RecordType) -> list[RangeRecord]:
        return [r for r in self.records if r.kind == kind]


# ---------------------------------------------------------------------------- reading


class _Input:
    """Exact reads from a binary stream, knowing the offset; short only at end of input."""

    def __init__(self, stream: BinaryIO):
        self.stream, self.offset = stream, 0

    def read(self, n: int) -> bytes:
        parts, got = [], 0
        while got < n:
            part = self.stream.read(n - got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        data = b"".join(parts)
        self.offset += len(data)
        return data


class _Scanner:
    """Reads hints front to back; ``events`` yields a HintError for every violation and each
    range record it accepts, as it accepts it (records are also collected in ``hints``)."""

    def __init__(self, stream: BinaryIO):
        self.inp = _Input(stream)
        self.hints: Hints | None = None
        self.count = 0
        self.ranges = 0
        self.ended = False

    @property
    def _hints(self) -> Hints:
        """The hints being read: set by the header, which every record follows."""
        assert self.hints is not None
        return self.hints

    def events(self) -> Iterator[HintError | RangeRecord]:
        fatal = yield from self._header()
        if fatal:
            return
        while not self.ended:
            fatal = yield from self._record()
            if fatal:
                return
        yield from self._after_end()

    @implements("LI-HNT-001", "LI-HNT-002", "LI-HNT-003", "LI-HNT-004")
    def _header(self):
        raw = self.inp.read(HEADER.size)
        if len(raw) < len(MAGIC) or raw[: len(MAGIC)] != MAGIC:
            yield HintError(
                f"expected magic {MAGIC.hex(' ')}, got {raw[:8].hex(' ') or 'end of input'}",
                offset=0,
                structure="header.magic",
                rule="LI-HNT-001",
            )
            return True
        if len(raw) < HEADER.size:
            yield HintError(
                f"truncated header: {len(raw)} of {HEADER.size} bytes",
                offset=len(raw),
                structure="header",
                rule="LI-HNT-005",
            )
            return True
        _, major, _, page_size, address_map, flags, reserved, checksum = HEADER.unpack(raw)
        if major != MAJOR:
            yield HintError(
                f"expected major_version 1, got {major}", offset=8, structure="header.major_version", rule="LI-HNT-002"
            )
            return True
        want = xxhash.xxh3_64_intdigest(raw[:24])
        if checksum != want:
            yield HintError(
                f"header_checksum {checksum:#018x}, the header's xxh3-64 is {want:#018x}",
                offset=24,
                structure="header.header_checksum",
                rule="LI-HNT-003",
            )
        if not (4096 <= page_size <= 65536 and page_size & (page_size - 1) == 0):
            yield HintError(
                f"page_size {page_size} is not a power of two in 4096..65536",
                offset=12,
                structure="header.page_size",
                rule="LI-HNT-004",
            )
            page_size = 4096
        if address_map not in set(AddressMap) or (address_map == AddressMap.XEN and page_size != 4096):
            yield HintError(
                f"address_map {address_map} unknown (0 none, 1 QEMU pc, 2 Xen with 4096-byte pages)",
                offset=16,
                structure="header.address_map",
                rule="LI-HNT-004",
            )
        if flags or reserved:
            yield HintError(
                f"flags {flags:#x} and reserved {reserved:#x} must be zero",
                offset=18,
                structure="header.flags",
                rule="LI-HNT-004",
            )
        self.hints = Hints(page_size, address_map)
        return False

    @implements("LI-HNT-005", "LI-HNT-006", "LI-HNT-007", "LI-HNT-008", "LI-HNT-014")
    def _record(self):
        start, index = self.inp.offset, self.count
        where = f"record[{index}]"
        head = self.inp.read(RECORD_HEAD.size)
        if len(head) < RECORD_HEAD.size:
            yield HintError(
                "input ended without an END record (truncated hints)"
                if not head
                else f"truncated record header: {len(head)} of {RECORD_HEAD.size} bytes",
                offset=start,
                structure=where,
                rule="LI-HNT-005",
            )
            return True
        rtype, flags, length = RECORD_HEAD.unpack(head)
        if length > MAX_PAYLOAD:
            yield HintError(
                f"payload_length {length} exceeds the limit of {MAX_PAYLOAD} bytes",
                offset=start + 4,
                structure=f"{where}.payload_length",
                rule="LI-HNT-006",
            )
            return True
        body = self.inp.read(length + CHECKSUM.size)
        if len(body) < length + CHECKSUM.size:
            yield HintError(
                f"truncated record: {len(body)} of {length + CHECKSUM.size} bytes after its header",
                offset=start,
                structure=where,
                rule="LI-HNT-005",
            )
            return True
        self.count += 1
        if self.count > MAX_RECORDS:
            yield HintError(f"more than {MAX_RECORDS} records", offset=start, structure=where, rule="LI-HNT-014")
            return True
        payload, (checksum,) = body[:length], CHECKSUM.unpack(body[length:])
        want = xxhash.xxh3_64_intdigest(head + payload)
        if checksum != want:
            yield HintError(
                f"record_checksum {checksum:#018x}, the record's xxh3-64 is {want:#018x}",
                offset=start + 8 + length,
                structure=f"{where}.record_checksum",
                rule="LI-HNT-007",
            )
            return False
        known = rtype in set(RecordType)
        if flags or (not known and not rtype & OPTIONAL):
            yield HintError(
                f"record type {rtype:#x} (flags {flags:#x}) is not a known type with zero flags",
                offset=start,
                structure=f"{where}.type",
                rule="LI-HNT-008",
            )
            return False
        if not known:
            return False
        kind = RecordType(rtype)
        where = f"{where} {kind.name}"
        if kind == RecordType.END:
            yield from self._end(payload, start, where, index)
            self.ended = True
        elif kind in (RecordType.DISK_NAME, RecordType.REGION_NAME):
            yield from self._name(kind, payload, start, where)
        elif kind == RecordType.PARENT:
            yield from self._parent(payload, start, where)
        else:
            record = yield from self._ranges(kind, payload, start, where, index)
            if record is not None:
                self.ranges += len(record.entries)
                if self.ranges > MAX_RANGES:
                    yield HintError(
                        f"more than {MAX_RANGES} ranges in all", offset=start, structure=where, rule="LI-HNT-014"
                    )
                    return True
                self._hints.records.append(record)
                yield record
        return False

    @implements("LI-HNT-011")
    def _end(self, payload: bytes, start: int, where: str, index: int):
        ok = yield from self._sized(payload, END_BODY.size, start, where)
        if not ok:
            return
        (count,) = END_BODY.unpack(payload)
        if count != index:
            yield HintError(
                f"record_count {count}, {index} records precede END",
                offset=start + 8,
                structure=f"{where}.record_count",
                rule="LI-HNT-011",
            )

    def _after_end(self):
        self._hints.length = self.inp.offset
        extra = self.inp.read(1)
        if extra:
            yield self._trailing(self._hints.length)

    @staticmethod
    def _trailing(offset: int) -> HintError:
        return _end_error("bytes follow the END record", offset)

    @implements("LI-HNT-009")
    def _sized(self, payload: bytes, expected: int, start: int, where: str):
        if len(payload) != expected:
            yield HintError(
                f"payload of {len(payload)} bytes, the structure needs {expected}",
                offset=start + 4,
                structure=f"{where}.payload_length",
                rule="LI-HNT-009",
            )
            return False
        return True

    @implements("LI-HNT-010")
    def _reserved(self, value: int, offset: int, where: str):
        if value:
            yield HintError(
                f"reserved field is {value:#x}, must be zero", offset=offset, structure=where, rule="LI-HNT-010"
            )

    @implements("LI-HNT-012")
    def _name(self, kind: RecordType, payload: bytes, start: int, where: str):
        if len(payload) < NAME_HEAD.size:
            yield from self._sized(payload, NAME_HEAD.size, start, where)
            return
        ident, length, reserved = NAME_HEAD.unpack_from(payload)
        ok = yield from self._sized(payload, NAME_HEAD.size + length, start, where)
        if not ok:
            return
        yield from self._reserved(reserved, start + 8 + 4, f"{where}.reserved")
        table = self._hints.disks if kind == RecordType.DISK_NAME else self._hints.regions
        raw = payload[NAME_HEAD.size :]
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            name = None
        problem = (
            "id must be below 256"
            if ident >= MAX_IDS
            else f"id {ident} declared twice"
            if ident in table
            else "name must be 1-255 bytes of UTF-8"
            if name is None or not 1 <= length <= 255
            else f"name {name!r} declared twice"
            if name in table.values()
            else None
        )
        if problem:
            yield HintError(problem, offset=start + 8, structure=where, rule="LI-HNT-012")
            return
        table[ident] = name

    @implements("LI-HNT-015")
    def _parent(self, payload: bytes, start: int, where: str):
        ok = yield from self._sized(payload, PARENT_BODY.size, start, where)
        if not ok:
            return
        image_uuid, reserved = PARENT_BODY.unpack(payload)
        yield from self._reserved(reserved, start + 8 + 16, f"{where}.reserved")
        if self._hints.parent_uuid is not None:
            yield HintError(
                "a second PARENT record (one parent per hints)", offset=start, structure=where, rule="LI-HNT-015"
            )
            return
        if self._hints.of_kind(RecordType.UNCHANGED):
            yield HintError("PARENT after an UNCHANGED record", offset=start, structure=where, rule="LI-HNT-015")
        self._hints.parent_uuid = image_uuid

    @implements("LI-HNT-016")
    def _ranges(self, kind: RecordType, payload: bytes, start: int, where: str, index: int):
        if len(payload) < RANGE_HEAD.size:
            yield from self._sized(payload, RANGE_HEAD.size, start, where)
            return None
        offset, addressing, region_id, source, reserved, count, reserved2 = RANGE_HEAD.unpack_from(payload)
        dtype = RANGE_KINDS[kind]
        ok = yield from self._sized(payload, RANGE_HEAD.size + count * dtype.itemsize, start, where)
        if not ok:
            return None
        body = start + RECORD_HEAD.size
        yield from self._reserved(reserved | reserved2, body + 14, f"{where}.reserved")
        entries = np.frombuffer(payload, dtype, count, RANGE_HEAD.size)
        if kind == RecordType.DISK:
            yield from self._reserved(int(entries["reserved"].any()), body + RANGE_HEAD.size, f"{where}.runs")
        if (
            addressing not in set(Addressing)
            or (kind == RecordType.FREE and source not in set(FreeSource))
            or (kind != RecordType.FREE and source)
        ):
            yield HintError(
                f"addressing {addressing} (1 or 2) or source {source} (FREE: 0-3, else 0) unknown",
                offset=body + 10,
                structure=f"{where}.addressing",
                rule="LI-HNT-016",
            )
            return None
        record = RangeRecord(kind, offset, addressing, region_id, source, entries, start, index)
        fine = yield from self._check_ranges(record, body + RANGE_HEAD.size)
        fine = fine and (yield from self._check_refs(record))
        if kind == RecordType.UNCHANGED and self._hints.parent_uuid is None:
            yield _parent_missing(record)
            fine = False
        return record if fine else None

    @implements("LI-HNT-013")
    def _check_ranges(self, record: RangeRecord, at: int):
        e, ps = record.entries, self._hints.page_size
        if not len(e):
            yield HintError("count is 0", offset=at - 8, structure=f"{record.structure}.count", rule="LI-HNT-013")
            return False
        first, num = e["first"].astype(np.uint64), e["num_pages"].astype(np.uint64)
        gpa = record.addressing == Addressing.GUEST_PHYSICAL
        span = num * np.uint64(ps) if gpa else num
        with np.errstate(over="ignore"):
            end = first + span
        bad = (num == 0) | (end < first) | (gpa and num > np.uint64((1 << 64) // ps - 1))
        if gpa:
            bad |= (first % np.uint64(ps)) != 0
        bad[1:] |= first[1:] < end[:-1]
        problem = None
        if gpa and self._hints.address_map == AddressMap.NONE:
            problem, i = "guest-physical ranges need an address map (header address_map 0)", 0
        elif bad.any():
            i = int(np.flatnonzero(bad)[0])
            problem = (
                f"range {i}: first {int(first[i]):#x}, num_pages {int(num[i])}: empty, overflowing, not "
                "page-aligned, or not after the previous range (ranges are sorted and disjoint)"
            )
        if problem:
            yield HintError(
                problem,
                offset=at + i * e.dtype.itemsize,
                structure=f"{record.structure}.ranges[{i}]",
                rule="LI-HNT-013",
            )
            return False
        return True

    def _check_refs(self, record: RangeRecord):
        """Ids a record uses are declared before it."""
        missing = []
        if record.addressing == Addressing.REGION and record.region_id not in self._hints.regions:
            missing.append(f"region id {record.region_id}")
        if record.kind == RecordType.DISK:
            unknown = set(distinct(record.entries["disk_id"]).tolist()) - set(self._hints.disks)
            missing += [f"disk id {i}" for i in sorted(unknown)]
        if missing:
            yield _undeclared(record, missing)
            return False
        return True


def _undeclared(record: RangeRecord, missing: list) -> HintError:
    return HintError(
        f"{', '.join(missing)} not declared before use",
        offset=record.offset,
        structure=record.structure,
        rule="LI-HNT-012",
    )


def _parent_missing(record: RangeRecord) -> HintError:
    return HintError(
        "an UNCHANGED record without a PARENT record before it",
        offset=record.offset,
        structure=record.structure,
        rule="LI-HNT-015",
    )


def _end_error(message: str, offset: int) -> HintError:
    return HintError(message, offset=offset, structure="after END", rule="LI-HNT-011")


def _open(source):
    if isinstance(source, (bytes, bytearray, memoryview)):
        return io.BytesIO(bytes(source)), True
    if isinstance(source, (str, os.PathLike)):
        return open(source, "rb"), True
    return source, False


def check_hints(source) -> tuple[Hints | None, list[HintError]]:
    """Every violation of the structural rules (001-016) and the hints read (None when the
    header is unreadable). ``source``: a path, bytes, or a binary stream."""
    stream, owned = _open(source)
    try:
        scanner = _Scanner(stream)
        findings = [e for e in scanner.events() if isinstance(e, HintError)]
        return scanner.hints, findings
    finally:
        if owned:
            stream.close()


def read_hints(source) -> Hints:
    """The hints of ``source`` (path, bytes or binary stream); the first violation raises."""
    stream, owned = _open(source)
    try:
        scanner = _Scanner(stream)
        for event in scanner.events():
            if isinstance(event, HintError):
                raise event
        assert scanner.hints is not None  # a header without hints is a violation, raised above
        return scanner.hints
    finally:
        if owned:
            stream.close()


class HintReader:
    """Reads hints as they arrive (a pipe or socket): ``records()`` yields each FREE, DISK and
    UNCHANGED record once its checksum was checked and raises at the first violation; the
    hints are complete only when it ends without error (END seen). ``hints`` holds the names,
    the parent and the records read so far."""

    def __init__(self, stream: BinaryIO):
        self._scanner = _Scanner(stream)

    @property
    def hints(self) -> Hints | None:
        return self._scanner.hints

    def records(self) -> Iterator[RangeRecord]:
        for event in self._scanner.events():
            if isinstance(event, HintError):
                raise event
            yield event


def iter_records(stream: BinaryIO) -> Iterator[RangeRecord]:
    """HintReader(stream).records()."""
    return HintReader(stream).records()


# ---------------------------------------------------------------------------- against a save


@dataclass
class Guest:
    """The save (or image) hints are for: what the rules 017-021 are checked against."""

    page_size: int
    source: str  # "qemu" or "xen"
    regions: dict  # region name -> number of pages
    stream_length: int | None = None  # bytes of the save stream (None: not known)
    disks: dict | None = None  # disk name -> size in bytes (None: not known)
    parent_uuid: bytes | None = None  # the writer's parent image
    parent_known: bool = True  # False: whether there is a parent is not known


@dataclass
class Resolved:
    """One range record in pages of a region of the guest."""

    record: RangeRecord
    region: str
    first: np.ndarray  # int64 first page of each range
    count: np.ndarray  # int64 pages of each range
    disks: list | None = None  # DISK: the disk name of each run
    sectors: np.ndarray | None = None

    @property
    def kind(self) -> RecordType:
        return self.record.kind


def qemu_pc_low_ram(ram_bytes: int) -> int:
    """Bytes of pc.ram mapped below 4 GiB on QEMU's i440fx pc (hw/i386/pc_piix.c)."""
    return ram_bytes if ram_bytes < 3 * GIB + GIB // 2 else 3 * GIB


def _map_pages(record: RangeRecord, hints: Hints, guest: Guest):
    """(region name, first page and page count of each range, which ranges lie outside memory).
    Bounds are compared in float64: a u8 count near 2^64 must not wrap into a small one."""
    e, ps = record.entries, hints.page_size
    first = e["first"].astype(np.uint64)
    count = e["num_pages"].astype(np.float64)
    if record.addressing == Addressing.REGION:
        name = hints.regions[record.region_id]
        start = first.astype(np.float64)
    elif hints.address_map == AddressMap.XEN:
        name = "xen-pfn"
        start = (first >> np.uint64(12)).astype(np.float64)
    else:
        name = "pc.ram"
        ram = guest.regions.get(name, 0) * ps
        low = qemu_pc_low_ram(ram)
        end = first.astype(np.float64) + count * ps
        below = end <= low
        above = (first >= np.uint64(4 * GIB)) & (end <= 4 * GIB + ram - low)
        start = np.where(below, first.astype(np.float64), first.astype(np.float64) - 4 * GIB + low) / ps
        start[~(below | above)] = -1
    outside = (start < 0) | (start + count > guest.regions.get(name, 0))
    pages = np.where(outside, 0, start).astype(np.int64)
    return name, pages, np.where(outside, 0, count).astype(np.int64), outside


@implements("LI-HNT-017")
def _check_fit(hints: Hints, guest: Guest):
    if hints.page_size != guest.page_size:
        yield HintError(
            f"page_size {hints.page_size}, the save's pages are {guest.page_size} bytes",
            offset=12,
            structure="header.page_size",
            rule="LI-HNT-017",
        )
    fits: dict[int, bool] = {
        AddressMap.NONE: True,
        AddressMap.QEMU_PC: guest.source == "qemu" and "pc.ram" in guest.regions,
        AddressMap.XEN: guest.source == "xen",
    }
    if not fits.get(hints.address_map, False):
        yield HintError(
            f"address_map {AddressMap(hints.address_map).name} does not fit a {guest.source} save with "
            f"regions {', '.join(guest.regions)}",
            offset=16,
            structure="header.address_map",
            rule="LI-HNT-017",
        )


@implements("LI-HNT-018")
def _check_within(hints: Hints, guest: Guest):
    for record in hints.records:
        if record.addressing == Addressing.REGION and hints.regions[record.region_id] not in guest.regions:
            yield HintError(
                f"region {hints.regions[record.region_id]!r} is not in the save (regions {', '.join(guest.regions)})",
                offset=record.offset,
                structure=record.structure,
                rule="LI-HNT-018",
            )
            continue
        name, first, num, outside = _map_pages(record, hints, guest)
        if outside.any():
            i = int(np.flatnonzero(outside)[0])
            yield HintError(
                f"range {i} (first {int(record.entries['first'][i]):#x}, {int(num[i])} pages) lies "
                f"outside guest memory (region {name!r} of {guest.regions.get(name, 0)} pages)",
                offset=record.offset + RECORD_HEAD.size + RANGE_HEAD.size + i * record.entries.itemsize,
                structure=f"{record.structure}.ranges[{i}]",
                rule="LI-HNT-018",
            )


@implements("LI-HNT-019")
def _check_offsets(hints: Hints, stream_length: int):
    for record in hints.records:
        if record.stream_offset > stream_length:
            yield HintError(
                f"stream_offset {record.stream_offset} is past the end of the save stream "
                f"({stream_length} bytes): a hint requested after the save ended",
                offset=record.offset + RECORD_HEAD.size,
                structure=f"{record.structure}.stream_offset",
                rule="LI-HNT-019",
            )


@implements("LI-HNT-020")
def _check_disks(hints: Hints, disks: dict):
    for record in hints.of_kind(RecordType.DISK):
        runs = record.entries
        for disk_id in distinct(runs["disk_id"]).tolist():
            name = hints.disks[disk_id]
            if name not in disks:
                yield HintError(
                    f"DISK hints name disk {name!r}, which is not given (give it with --disk {name}=PATH)",
                    offset=record.offset,
                    structure=record.structure,
                    rule="LI-HNT-020",
                )
                continue
            mine = runs[runs["disk_id"] == disk_id]
            ends = mine["sector"].astype(np.float64) * SECTOR + mine["num_pages"].astype(np.float64) * hints.page_size
            if (ends > disks[name]).any():
                k = int(np.flatnonzero(ends > disks[name])[0])
                yield HintError(
                    f"a run at sector {int(mine['sector'][k])} of {int(mine['num_pages'][k])} pages "
                    f"runs past the end of disk {name!r} ({disks[name]} bytes)",
                    offset=record.offset,
                    structure=record.structure,
                    rule="LI-HNT-020",
                )


@implements("LI-HNT-021")
def _check_parent(hints: Hints, guest: Guest):
    if not guest.parent_known or not hints.of_kind(RecordType.UNCHANGED):
        return
    assert hints.parent_uuid is not None  # UNCHANGED records are accepted only after PARENT (LI-HNT-015)
    if guest.parent_uuid is None:
        yield HintError(
            f"UNCHANGED hints are against parent image {hints.parent_uuid.hex()}: give it with --parent",
            offset=HEADER.size,
            structure="PARENT",
            rule="LI-HNT-021",
        )
    elif guest.parent_uuid != hints.parent_uuid:
        yield HintError(
            f"UNCHANGED hints are against image {hints.parent_uuid.hex()}, the parent given is "
            f"{guest.parent_uuid.hex()}",
            offset=HEADER.size,
            structure="PARENT.image_uuid",
            rule="LI-HNT-021",
        )


def check_against(hints: Hints, guest: Guest) -> Iterator[HintError]:
    """The violations of the rules that need the save (017-021)."""
    fit = list(_check_fit(hints, guest))
    yield from fit
    if fit:
        return
    yield from _check_within(hints, guest)
    if guest.stream_length is not None:  # not known: 019 is not checked
        yield from _check_offsets(hints, guest.stream_length)
    if guest.disks is not None:  # not known: 020 is not checked
        yield from _check_disks(hints, guest.disks)
    yield from _check_parent(hints, guest)


def resolve(hints: Hints, guest: Guest) -> list[Resolved]:
    """Every range record in pages of the guest's regions, in file order; the first violation
    of rules 017-021 raises."""
    for finding in check_against(hints, guest):
        raise finding
    out = []
    for record in hints.records:
        name, first, num, _ = _map_pages(record, hints, guest)
        if record.kind == RecordType.DISK:
            names = [hints.disks[i] for i in record.entries["disk_id"].tolist()]
            out.append(Resolved(record, name, first, num, names, record.entries["sector"].astype(np.uint64)))
        else:
            out.append(Resolved(record, name, first, num))
    return out


# ---------------------------------------------------------------------------- writing


class CountingReader(io.RawIOBase):
    """A binary stream that counts the bytes it has handed out: put it between a save stream
    and the converter, and ``offset`` is the ``stream_offset`` of a hint requested now."""

    def __init__(self, stream: BinaryIO):
        super().__init__()
        self.stream, self.offset = stream, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if hasattr(self.stream, "readinto"):
            n = self.stream.readinto(buffer) or 0
        else:
            data = self.stream.read(len(buffer))
            n = len(data)
            buffer[:n] = data
        self.offset += n
        return n


class HintWriter:
    """Writes hints to a binary stream (a file, pipe or socket), flushing after each record.

    ``free``, ``unchanged`` and ``disk_runs`` take ranges either guest-physical (byte
    addresses, the default when the header has an address map) or in pages of a region (pass
    ``region=NAME``). Ranges are sorted and merged, and split over records as the limits
    require. ``close`` writes END; hints without it are refused as truncated.
    """

    def __init__(self, out: BinaryIO, *, page_size: int = 4096, address_map: int = AddressMap.NONE):
        self.out, self.page_size, self.address_map = out, page_size, AddressMap(address_map)
        self.count = 0
        self.written = 0
        self._disks: dict[str, int] = {}
        self._regions: dict[str, int] = {}
        self._parent: bytes | None = None
        self._closed = False
        head = HEADER.pack(MAGIC, MAJOR, MINOR, page_size, int(address_map), 0, 0, 0)
        self._emit(head[:24] + CHECKSUM.pack(xxhash.xxh3_64_intdigest(head[:24])))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()

    def _emit(self, data: bytes) -> None:
        self.out.write(data)
        self.written += len(data)
        flush = getattr(self.out, "flush", None)
        if flush:
            flush()

    def _record(self, rtype: int, payload: bytes) -> None:
        if self._closed:
            raise ValueError("the hints are closed")
        head = RECORD_HEAD.pack(rtype, 0, len(payload))
        self._emit(head + payload + CHECKSUM.pack(xxhash.xxh3_64_intdigest(head + payload)))
        self.count += 1

    def _name(self, table: dict, rtype: RecordType, name: str) -> int:
        if name not in table:
            raw = name.encode("utf-8")
            if not 1 <= len(raw) <= 255 or len(table) >= MAX_IDS:
                raise ValueError(f"name {name!r}: 1-255 bytes of UTF-8, at most {MAX_IDS} names")
            table[name] = len(table)
            self._record(rtype, NAME_HEAD.pack(table[name], len(raw), 0) + raw)
        return table[name]

    def disk(self, name: str) -> int:
        return self._name(self._disks, RecordType.DISK_NAME, name)

    def region(self, name: str) -> int:
        return self._name(self._regions, RecordType.REGION_NAME, name)

    def parent(self, image_uuid: bytes) -> None:
        """The parent image UNCHANGED hints are against (its header's image_uuid)."""
        if self._parent is not None and self._parent != image_uuid:
            raise ValueError("one parent per hints")
        if self._parent is None:
            self._parent = bytes(image_uuid)
            self._record(RecordType.PARENT, PARENT_BODY.pack(self._parent, 0))

    def free(self, ranges, *, stream_offset: int, source: int = FreeSource.GUEST, region: str | None = None) -> None:
        """FREE: ``ranges`` (n, 2) of (first, num_pages); ``stream_offset``: the bytes of the save
        stream the writer had received when the snapshot was requested (spec/hints.md §2)."""
        self._ranges(RecordType.FREE, _merged(ranges, self._unit(region)), stream_offset, int(source), region)

    def unchanged(self, ranges, *, stream_offset: int, region: str | None = None) -> None:
        if self._parent is None:
            raise ValueError("UNCHANGED hints need parent() first")
        self._ranges(RecordType.UNCHANGED, _merged(ranges, self._unit(region)), stream_offset, 0, region)

    def disk_runs(self, runs, *, stream_offset: int, region: str | None = None) -> None:
        """DISK: ``runs`` of (first, num_pages, disk name, sector): page first + k is at
        sector + k * page_size / 512 of the disk."""
        rows = sorted(runs, key=lambda run: run[0])
        entries = np.zeros(len(rows), DISK_RUN)
        for i, (first, num, disk, sector) in enumerate(rows):
            entries[i] = (first, num, self.disk(disk), 0, sector)
        self._ranges(RecordType.DISK, entries, stream_offset, 0, region)

    def _unit(self, region: str | None) -> int:
        return 1 if region is not None else self.page_size

    def _ranges(self, kind: RecordType, entries: np.ndarray, stream_offset: int, source: int, region) -> None:
        if region is None and self.address_map == AddressMap.NONE:
            raise ValueError("guest-physical hints need an address map: pass region=NAME or address_map")
        addressing = Addressing.REGION if region is not None else Addressing.GUEST_PHYSICAL
        region_id = self.region(region) if region is not None else 0
        per_record = (MAX_PAYLOAD - RANGE_HEAD.size) // entries.itemsize
        for lo in range(0, len(entries), per_record):
            part = entries[lo : lo + per_record]
            head = RANGE_HEAD.pack(stream_offset, addressing, region_id, source, 0, len(part), 0)
            self._record(kind, head + part.tobytes())

    def close(self) -> None:
        if not self._closed:
            self._record(RecordType.END, END_BODY.pack(self.count))
            self._closed = True


def _merged(ranges, unit: int) -> np.ndarray:
    """(first, num_pages) ranges sorted, overlapping and adjacent ones merged; ``unit`` is the
    size of a page in ``first``'s unit (page_size for byte addresses, 1 for page indexes)."""
    rows = np.asarray(ranges, np.uint64).reshape(-1, 2)
    rows = rows[rows[:, 1] > 0]
    if not len(rows):
        return np.zeros(0, RANGE)
    if (rows[:, 0].astype(np.float64) + rows[:, 1].astype(np.float64) * unit >= 2.0**64).any():
        raise ValueError("a range runs past 2^64")
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    starts, ends = rows[:, 0], rows[:, 0] + rows[:, 1] * np.uint64(unit)
    reach = np.maximum.accumulate(ends)
    new = np.ones(len(rows), bool)
    new[1:] = starts[1:] > reach[:-1]
    group = np.cumsum(new) - 1
    out = np.zeros(int(group[-1]) + 1, RANGE)
    out["first"] = starts[new]
    group_end = np.maximum.reduceat(ends, np.flatnonzero(new))
    out["num_pages"] = (group_end - out["first"]) // np.uint64(unit)
    return out
