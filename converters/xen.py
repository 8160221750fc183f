"""Read and write Xen save streams: xl save files, the libxl stream v2, the libxc stream v2/v3.

Written from Xen's docs/specs/libxc-migration-stream.pandoc (revision 3),
docs/specs/libxl-migration-stream.pandoc (revision 2) and tools/xl/xl.h. Three forms nest::

    xl save file   32-byte magic, u4 byteorder 0x01020304, u4 mandatory flags, u4 optional
                   flags, u4 optional data length, optional data (u4 config length, config)
                   then a libxl stream (flag STREAMv2) or a libxc stream (flag clear)
    libxl stream   be64 "LibxlFmt", be32 version 2, be32 options; records u4 type, u4 length,
                   body, zero padding to 8; LIBXC_CONTEXT hands the stream to libxc
    libxc stream   be64 marker ~0, be32 "XENF", be32 version 2|3, be16 options, 6 reserved
                   bytes; domain header u4 type, u2 page_shift, u2 reserved, u4 xen major,
                   u4 xen minor; records as libxl's, up to END

Inside a libxl stream a libxc CHECKPOINT hands the stream back to libxl (Remus/COLO), which
sends its records up to CHECKPOINT_END and hands it back to libxc (libxl_stream_read.c).

Conversion reads the stream twice (``scan`` then ``feed_pages``): the first pass checks
everything, seeks over page contents and writes the **skeleton** (below) to a scratch file;
it learns the highest pfn (the region size) and the last entry of every pfn (the copy
that wins when a checkpointed stream re-sends pages). The second pass hands the pages
whose last entry carries data to the image, in runs of consecutive pfns. A stream read
from a pipe is first copied to a scratch file (``spool_to_file``).

The skeleton is the stream without its page contents, a sequence of items::

    u4 kind, u4 reserved (0), u8 length, payload, zero padding to 8
    kind 1 BYTES      payload copied verbatim to the output (headers, every record but
                      PAGE_DATA, with their record headers and padding)
    kind 2 PAGE_DATA  payload = one PAGE_DATA record's pfn array (u8 per entry, type bits
                      included); the record is rebuilt from it and the pages of the region

``write_stream`` rebuilds the stream from the skeleton and a page reader; when every page
was sent once the result is byte-identical to the input.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import tempfile
from typing import BinaryIO, Callable, Iterator

import numpy as np

from leanimg.arrays import distinct
from leanimg.errors import SourceFormatError, fits_in_memory

from .cursor import Cursor

PAGE_SIZE = 4096
PAGE_SHIFT = 12
REGION_NAME = "xen-pfn"

XL_MAGIC = b"Xen saved domain, xl format\n \0 \r"
XL_HEADER = struct.Struct("<32sIIII")  # magic, byteorder, mandatory, optional flags, optdata length
XL_BYTEORDER = 0x01020304
XL_BYTEORDER_SWAPPED = 0x04030201  # the marker as a big-endian writer leaves it
XL_FLAG_JSON = 1 << 0
XL_FLAG_STREAMV2 = 1 << 1
XL_KNOWN_MANDATORY = XL_FLAG_JSON | XL_FLAG_STREAMV2

LIBXL_HEADER = struct.Struct(">QII")  # ident, version, options
LIBXL_IDENT = 0x4C6962786C466D74  # "LibxlFmt"
LIBXL_MAGIC = LIBXL_IDENT.to_bytes(8, "big")
LIBXL_VERSION = 2
LIBXL_OPT_BIG_ENDIAN = 1 << 0
LIBXL_OPT_LEGACY = 1 << 1

LIBXC_IMAGE_HEADER = struct.Struct(">QIIHHI")  # marker, ident, version, options, reserved x2
LIBXC_MARKER = 0xFFFFFFFFFFFFFFFF
LIBXC_IDENT = 0x58454E46  # "XENF"
LIBXC_VERSIONS = (2, 3)
LIBXC_OPT_BIG_ENDIAN = 1 << 0
LIBXC_DOMAIN_HEADER = struct.Struct("<IHHII")  # type, page_shift, reserved, xen major, minor
DOMAIN_TYPES = {1: "x86 PV", 2: "x86 HVM"}

RECORD_HEADER = struct.Struct("<II")  # type, body_length
PAGE_DATA_HEADER = struct.Struct("<II")  # count, reserved
OPTIONAL_RECORD = 1 << 31

# libxc record types
(
    END,
    PAGE_DATA,
    X86_PV_INFO,
    X86_PV_P2M_FRAMES,
    X86_PV_VCPU_BASIC,
    X86_PV_VCPU_EXTENDED,
    X86_PV_VCPU_XSAVE,
    SHARED_INFO,
    X86_TSC_INFO,
    HVM_CONTEXT,
    HVM_PARAMS,
    TOOLSTACK,
    X86_PV_VCPU_MSRS,
    VERIFY,
    CHECKPOINT,
    CHECKPOINT_DIRTY_PFN_LIST,
    STATIC_DATA_END,
    X86_CPUID_POLICY,
    X86_MSR_POLICY,
) = range(0x13)
LIBXC_RECORD_NAMES = dict(
    enumerate(
        (
            "END",
            "PAGE_DATA",
            "X86_PV_INFO",
            "X86_PV_P2M_FRAMES",
            "X86_PV_VCPU_BASIC",
            "X86_PV_VCPU_EXTENDED",
            "X86_PV_VCPU_XSAVE",
            "SHARED_INFO",
            "X86_TSC_INFO",
            "HVM_CONTEXT",
            "HVM_PARAMS",
            "TOOLSTACK",
            "X86_PV_VCPU_MSRS",
            "VERIFY",
            "CHECKPOINT",
            "CHECKPOINT_DIRTY_PFN_LIST",
            "STATIC_DATA_END",
            "X86_CPUID_POLICY",
            "X86_MSR_POLICY",
        )
    )
)
LIBXC_EMPTY_RECORDS = {END, VERIFY, CHECKPOINT, STATIC_DATA_END}
LIBXC_V3_RECORDS = {STATIC_DATA_END, X86_CPUID_POLICY, X86_MSR_POLICY}

# libxl record types
(LIBXL_END, LIBXC_CONTEXT, EMULATOR_XENSTORE_DATA, EMULATOR_CONTEXT, CHECKPOINT_END, CHECKPOINT_STATE) = range(6)
LIBXL_RECORD_NAMES = dict(
    enumerate(
        ("END", "LIBXC_CONTEXT", "EMULATOR_XENSTORE_DATA", "EMULATOR_CONTEXT", "CHECKPOINT_END", "CHECKPOINT_STATE")
    )
)
LIBXL_EMPTY_RECORDS = {LIBXL_END, LIBXC_CONTEXT, CHECKPOINT_END}

# PAGE_DATA pfn entries: bits 63-60 XEN_DOMCTL_PFINFO_* type, 59-52 reserved, 51-0 pfn
PFN_MASK = (1 << 52) - 1
PFN_RESERVED_MASK = ((1 << 60) - 1) & ~PFN_MASK
TYPE_SHIFT = 60
PFINFO_TYPES = {
    0x0: "NOTAB",
    0x1: "L1TAB",
    0x2: "L2TAB",
    0x3: "L3TAB",
    0x4: "L4TAB",
    0x9: "L1TAB_PIN",
    0xA: "L2TAB_PIN",
    0xB: "L3TAB_PIN",
    0xC: "L4TAB_PIN",
    0xD: "BROKEN",
    0xE: "XALLOC",
    0xF: "XTAB",
}
INVALID_TYPES = (0x5, 0x6, 0x7, 0x8)  # reserved in the spec


def carries_data(types: np.ndarray) -> np.ndarray:
    """Entries followed by page contents: NOTAB, L1-L4TAB and their pinned variants."""
    return (types & 0x7) <= 0x4


# skeleton items
ITEM_HEADER = struct.Struct("<IIQ")  # kind, reserved, length
ITEM_BYTES, ITEM_PAGE_DATA = 1, 2

# limits of this tool (not of the formats)
RECORD_LIMIT = 256 << 20  # a non-page record held in memory
PFN_LIMIT = 1 << 26  # pfn space of a guest: 256 GiB (the scan keeps 8-16 bytes a pfn, the writer 1)
BYTES_ITEM_TARGET = 16 << 20  # verbatim bytes gathered into one skeleton item
READ_PAGES = 1024  # pages read at once when feeding the image


@dataclasses.dataclass
class ScanResult:
    """What the first pass learned; ``skeleton`` is an open scratch file, rewound."""

    form: str  # "xl/libxl", "xl/libxc", "libxl" or "libxc"
    libxc_version: int
    domain_type: str
    num_pfns: int  # highest pfn in any PAGE_DATA entry + 1 (0: none)
    last_entry: np.ndarray  # per pfn: index of its last PAGE_DATA entry, -1 if never sent
    data_offsets: list[int]  # per PAGE_DATA record: file offset of its first page
    data_entries: int  # entries carrying page contents, over all records
    resent: bool  # some pfn has more than one entry
    checkpoints: int
    skeleton: BinaryIO
    length: int  # bytes of the stream
    last_end: np.ndarray | None = None  # per pfn: stream offset where its winning copy's data
    # ends, -1 if its last entry carries none (spec/hints.md §3)


# ---------------------------------------------------------------------------- skeleton file (first pass)


class _Skeleton:
    """Writes skeleton items to a scratch file, gathering verbatim bytes into large items."""

    def __init__(self, directory=None):
        self.file = tempfile.TemporaryFile(prefix="leanimg-xen-", dir=directory)
        self.pending: list[bytes] = []
        self.pending_bytes = 0

    def verbatim(self, *parts: bytes) -> None:
        for part in parts:
            self.pending.append(part)
            self.pending_bytes += len(part)
        if self.pending_bytes >= BYTES_ITEM_TARGET:
            self.flush()

    def page_data(self, pfn_array: bytes) -> None:
        self.flush()
        self._item(ITEM_PAGE_DATA, pfn_array)

    def flush(self) -> None:
        if self.pending:
            self._item(ITEM_BYTES, b"".join(self.pending))
            self.pending, self.pending_bytes = [], 0

    def _item(self, kind: int, payload: bytes) -> None:
        self.file.write(ITEM_HEADER.pack(kind, 0, len(payload)) + payload + _padding(len(payload)))

    def finish(self) -> BinaryIO:
        self.flush()
        self.file.seek(0)
        return self.file


def _padding(length: int) -> bytes:
    return bytes(-length % 8)


# ---------------------------------------------------------------------------- first pass


def scan(f: BinaryIO, directory=None) -> ScanResult:
    """Check the whole stream in the seekable file ``f`` and build its skeleton."""
    scanner = _Scanner(Cursor.over_file(f, structure="stream"), _Skeleton(directory))
    try:
        return scanner.run()
    except BaseException:
        scanner.skeleton.file.close()
        raise


class _Scanner:
    def __init__(self, inp: Cursor, skeleton: _Skeleton):
        self.inp, self.skeleton = inp, skeleton
        self.form: list[str] = []
        self.version = 0
        self.domain_type = ""
        self.libxc_index = 0
        self.libxc_state = "not started"  # running, checkpoint, ended
        self.embedded = False
        self.last_entry = np.full(0, -1, np.int64)
        self.last_end_offset = np.full(0, -1, np.int64)
        self.num_pfns = 0
        self.entries = 0
        self.data_entries = 0
        self.data_offsets: list[int] = []
        self.resent = False
        self.checkpoints = 0

    def run(self) -> ScanResult:
        inp = self.inp
        head = inp.peek(len(XL_MAGIC))
        if head == XL_MAGIC:
            self._xl_header()
        elif head[:8] == LIBXL_MAGIC:
            self._libxl_stream()
        else:
            self._libxc_stream()
        inp.structure = "after END"
        if not inp.at_end():
            raise inp.error(f"expected end of input after the final END record, got {inp.remaining()} more bytes")
        return ScanResult(
            form="/".join(self.form),
            libxc_version=self.version,
            domain_type=self.domain_type,
            num_pfns=self.num_pfns,
            last_entry=self.last_entry[: self.num_pfns],
            data_offsets=self.data_offsets,
            data_entries=self.data_entries,
            resent=self.resent,
            checkpoints=self.checkpoints,
            skeleton=self.skeleton.finish(),
            length=inp.size,
            last_end=self.last_end_offset[: self.num_pfns],
        )

    # --- xl -------------------------------------------------------------------------

    def _xl_header(self) -> None:
        inp = self.inp
        inp.structure = "xl header"
        raw = inp.take(XL_HEADER.size, "the xl header")
        _, byteorder, mandatory, optional, optlen = XL_HEADER.unpack(raw)
        if byteorder == XL_BYTEORDER_SWAPPED:
            raise inp.unsupported("big-endian xl save file (byte-order marker 0x04030201) is not supported", at=32)
        if byteorder != XL_BYTEORDER:
            raise inp.error(f"expected byte-order marker {XL_BYTEORDER:#010x}, got {byteorder:#010x}", at=32)
        unknown = mandatory & ~XL_KNOWN_MANDATORY
        if unknown:
            raise inp.unsupported(f"unknown mandatory flags {unknown:#x} in the xl header", at=36)
        if optlen > RECORD_LIMIT:
            raise inp.unsupported(f"xl optional data of {optlen} bytes exceeds {RECORD_LIMIT}", at=44)
        inp.structure = "xl optional data"
        optdata = inp.take(optlen, "xl optional data")
        self._check_xl_config(optdata)
        self.skeleton.verbatim(raw, optdata)
        self.form.append("xl")
        if mandatory & XL_FLAG_STREAMV2:
            self._libxl_stream()
        else:
            self._libxc_stream()

    def _check_xl_config(self, optdata: bytes) -> None:
        if not optdata:
            return
        if len(optdata) < 4:
            raise self.inp.error(
                f"expected the u4 config length in the xl optional data, got {len(optdata)} bytes", back=len(optdata)
            )
        (config_len,) = struct.unpack_from("<I", optdata)
        if config_len > len(optdata) - 4:
            raise self.inp.error(
                f"xl config of {config_len} bytes does not fit the {len(optdata)} bytes of optional data",
                back=len(optdata),
            )

    # --- libxl ----------------------------------------------------------------------

    def _libxl_stream(self) -> None:
        inp = self.inp
        inp.structure = "libxl header"
        start = inp.offset
        raw = inp.take(LIBXL_HEADER.size, "the libxl header")
        ident, version, options = LIBXL_HEADER.unpack(raw)
        if ident != LIBXL_IDENT:
            raise inp.error(f'expected libxl ident {LIBXL_IDENT:#018x} ("LibxlFmt"), got {ident:#018x}', at=start)
        if version != LIBXL_VERSION:
            raise inp.error(f"expected libxl stream version {LIBXL_VERSION}, got {version}", at=start + 8)
        if options & LIBXL_OPT_BIG_ENDIAN:
            raise inp.unsupported("big-endian libxl stream (options bit 0) is not supported", at=start + 12)
        reserved = options & ~(LIBXL_OPT_BIG_ENDIAN | LIBXL_OPT_LEGACY)
        if reserved:
            raise inp.error(f"reserved bits set in the libxl header options: {reserved:#x}", at=start + 12)
        self.skeleton.verbatim(raw)
        self.form.append("libxl")
        self.embedded = True
        index = 0
        while True:
            inp.structure = f"libxl record[{index}]"
            start = inp.offset
            head = inp.take(RECORD_HEADER.size, "a record header")
            rtype = RECORD_HEADER.unpack(head)[0]
            inp.structure = f"libxl record[{index}] {_name(LIBXL_RECORD_NAMES, rtype)}"
            body = self._record(start, head, LIBXL_RECORD_NAMES, LIBXL_EMPTY_RECORDS, "libxl")
            index += 1
            if rtype == LIBXC_CONTEXT:
                if self.libxc_state != "not started":
                    raise inp.error("a second LIBXC_CONTEXT record")
                self._libxc_stream()
            elif rtype == CHECKPOINT_END:
                if self.libxc_state != "checkpoint":
                    raise inp.error("CHECKPOINT_END without a libxc CHECKPOINT before it")
                self._libxc_records()
            elif rtype == LIBXL_END:
                if self.libxc_state != "ended":
                    raise inp.error(f"libxl END while the libxc stream is {self.libxc_state}")
                return
            elif rtype in (EMULATOR_XENSTORE_DATA, EMULATOR_CONTEXT) and len(body) < 8:
                raise inp.error(f"expected an emulator record of at least 8 bytes, got {len(body)}")

    # --- libxc ----------------------------------------------------------------------

    def _libxc_stream(self) -> None:
        inp = self.inp
        inp.structure = "libxc image header"
        start = inp.offset
        raw = inp.take(LIBXC_IMAGE_HEADER.size, "the libxc image header")
        marker, ident, version, options, reserved1, reserved2 = LIBXC_IMAGE_HEADER.unpack(raw)
        if marker != LIBXC_MARKER:
            raise inp.error(
                f"expected libxc marker {LIBXC_MARKER:#018x}, got {marker:#018x} (not a "
                f"Xen save stream, or a legacy pre-4.6 one)",
                at=start,
            )
        if ident != LIBXC_IDENT:
            raise inp.error(f'expected libxc ident {LIBXC_IDENT:#010x} ("XENF"), got {ident:#010x}', at=start + 8)
        if version not in LIBXC_VERSIONS:
            raise inp.error(f"expected libxc stream version 2 or 3, got {version}", at=start + 12)
        if options & LIBXC_OPT_BIG_ENDIAN:
            raise inp.unsupported("big-endian libxc stream (options bit 0) is not supported", at=start + 16)
        if options & ~LIBXC_OPT_BIG_ENDIAN:
            raise inp.error(
                f"reserved bits set in the libxc image options: {options & ~LIBXC_OPT_BIG_ENDIAN:#x}", at=start + 16
            )
        if reserved1 or reserved2:
            raise inp.error(
                f"reserved fields of the libxc image header not zero: {reserved1:#06x}:{reserved2:#010x}", at=start + 18
            )
        self.version = version
        inp.structure = "libxc domain header"
        domain = inp.take(LIBXC_DOMAIN_HEADER.size, "the libxc domain header")
        gtype, page_shift, reserved, _, _ = LIBXC_DOMAIN_HEADER.unpack(domain)
        if gtype not in DOMAIN_TYPES:
            raise inp.unsupported(f"domain type {gtype:#x} (only 1 x86 PV and 2 x86 HVM are supported)", at=start + 24)
        if page_shift != PAGE_SHIFT:
            raise inp.unsupported(f"page shift {page_shift} (only 12, 4096-byte pages)", at=start + 28)
        if reserved:
            raise inp.error(f"reserved field of the libxc domain header not zero: {reserved:#06x}", at=start + 30)
        self.domain_type = DOMAIN_TYPES[gtype]
        self.skeleton.verbatim(raw, domain)
        self.form.append("libxc")
        self._libxc_records()

    def _libxc_records(self) -> None:
        """Records up to END, or up to a CHECKPOINT when libxl embeds the stream."""
        inp = self.inp
        self.libxc_state = "running"
        while True:
            inp.structure = f"libxc record[{self.libxc_index}]"
            rtype = self._libxc_record()
            self.libxc_index += 1
            if rtype == END:
                self.libxc_state = "ended"
                return
            if rtype == CHECKPOINT:
                self.checkpoints += 1
                if self.embedded:
                    self.libxc_state = "checkpoint"
                    return

    def _libxc_record(self) -> int:
        inp = self.inp
        start = inp.offset
        head = inp.take(RECORD_HEADER.size, "a record header")
        rtype, length = RECORD_HEADER.unpack(head)
        inp.structure = f"libxc record[{self.libxc_index}] {_name(LIBXC_RECORD_NAMES, rtype)}"
        if rtype == PAGE_DATA:
            self._page_data(start, length)
            return rtype
        self._record(start, head, LIBXC_RECORD_NAMES, LIBXC_EMPTY_RECORDS, "libxc")
        if rtype in LIBXC_V3_RECORDS and self.version < 3:
            raise inp.error(f"{LIBXC_RECORD_NAMES[rtype]} record in a version {self.version} stream", at=start)
        return rtype

    def _record(self, start: int, head: bytes, names: dict, empty: set, layer: str) -> bytes:
        """The body of a record kept verbatim (``head`` read at ``start``): checks the type,
        the length and the padding."""
        inp = self.inp
        rtype, length = RECORD_HEADER.unpack(head)
        if rtype not in names and not rtype & OPTIONAL_RECORD:
            raise inp.unsupported(f"unknown mandatory {layer} record type {rtype:#010x}", at=start)
        if rtype in empty and length:
            raise inp.error(f"expected an empty {names[rtype]} record, got body_length {length}", at=start + 4)
        if length > RECORD_LIMIT:
            inp.need(length, "the record body")
            raise inp.unsupported(f"record body of {length} bytes exceeds {RECORD_LIMIT}", at=start + 4)
        body = inp.take(length, "the record body")
        padding = inp.take(-length % 8, "the record padding")
        if any(padding):
            raise inp.error(f"expected zero padding, got {padding.hex()}", back=len(padding))
        self.skeleton.verbatim(head, body, padding)
        return body

    # --- PAGE_DATA ------------------------------------------------------------------

    def _page_data(self, start: int, length: int) -> None:
        inp = self.inp
        if length < PAGE_DATA_HEADER.size + 8:
            raise inp.error(f"expected a PAGE_DATA body of at least 16 bytes, got {length}", at=start + 4)
        inp.need(length, "the PAGE_DATA body")
        count, reserved = inp.unpack(PAGE_DATA_HEADER, "the PAGE_DATA count")
        if count == 0:
            raise inp.error("PAGE_DATA count is 0 (the spec requires > 0)", at=start + 8)
        if reserved:
            raise inp.error(f"reserved field of PAGE_DATA not zero: {reserved:#010x}", at=start + 12)
        if 8 + 8 * count > length:
            raise inp.error(
                f"PAGE_DATA count {count} needs {8 + 8 * count} bytes of pfns, the record has {length}", at=start + 8
            )
        raw = inp.take(8 * count, "the PAGE_DATA pfn array")
        entries = np.frombuffer(raw, "<u8")
        self._check_entries(entries, start + 16)
        types = (entries >> TYPE_SHIFT).astype(np.uint8)
        data_mask = carries_data(types)
        with_data = int(np.count_nonzero(data_mask))
        expected = 8 + 8 * count + PAGE_SIZE * with_data
        if length != expected:
            raise inp.error(
                f"PAGE_DATA of {count} entries ({with_data} with page contents) must be "
                f"{expected} bytes, body_length is {length}",
                at=start + 4,
            )
        self.data_offsets.append(inp.offset)
        ends = inp.offset + PAGE_SIZE * np.cumsum(data_mask, dtype=np.int64)
        inp.skip(PAGE_SIZE * with_data, "PAGE_DATA page contents")
        self._note_entries(entries & np.uint64(PFN_MASK))
        self._note_ends((entries & np.uint64(PFN_MASK)).astype(np.int64), np.where(data_mask, ends, -1))
        self.data_entries += with_data
        self.skeleton.page_data(raw)

    def _check_entries(self, entries: np.ndarray, offset: int) -> None:
        bad = np.flatnonzero(entries & np.uint64(PFN_RESERVED_MASK))
        if len(bad):
            i = int(bad[0])
            raise self.inp.error(f"reserved bits set in pfn[{i}]: {int(entries[i]):#018x}", at=offset + 8 * i)
        types = entries >> np.uint64(TYPE_SHIFT)
        bad = np.flatnonzero(np.isin(types, INVALID_TYPES))
        if len(bad):
            i = int(bad[0])
            raise self.inp.error(
                f"invalid page type {int(types[i]):#x} in pfn[{i}]: {int(entries[i]):#018x}", at=offset + 8 * i
            )
        pfns = entries & np.uint64(PFN_MASK)
        top = int(pfns.max())
        if top >= PFN_LIMIT:
            raise self.inp.unsupported(
                f"pfn {top:#x} beyond this tool's limit of {PFN_LIMIT:#x} pfns", at=offset + 8 * int(pfns.argmax())
            )

    def _note_entries(self, pfns: np.ndarray) -> None:
        """Remember each pfn's latest entry: the copy that wins when pages are re-sent."""
        pfns = pfns.astype(np.int64)
        top = int(pfns.max()) + 1
        if top > len(self.last_entry):
            self.last_entry = self._grown(self.last_entry, max(top, min(2 * len(self.last_entry), PFN_LIMIT)))
        self.num_pfns = max(self.num_pfns, top)
        ids = self.entries + np.arange(len(pfns), dtype=np.int64)
        if not self.resent:
            self.resent = bool((self.last_entry[pfns] >= 0).any()) or len(distinct(pfns)) < len(pfns)
        np.maximum.at(self.last_entry, pfns, ids)
        self.entries += len(pfns)

    def _note_ends(self, pfns: np.ndarray, ends: np.ndarray) -> None:
        """Each pfn's last entry in this record decides where its winning copy ends."""
        if len(self.last_end_offset) < len(self.last_entry):
            self.last_end_offset = self._grown(self.last_end_offset, len(self.last_entry))
        unique, first_from_back = np.unique(pfns[::-1], return_index=True)
        self.last_end_offset[unique] = ends[len(pfns) - 1 - first_from_back]

    def _grown(self, table: np.ndarray, size: int) -> np.ndarray:
        """``table`` extended to ``size`` entries (-1: never sent), or a LimitError when that
        does not fit in this process's memory (a pfn near PFN_LIMIT in a small stream)."""
        with fits_in_memory(f"a table of {size} pfns ({8 * size} bytes)", self.inp.structure):
            grown = np.full(size, -1, np.int64)
        grown[: len(table)] = table
        return grown


def _name(names: dict, rtype: int) -> str:
    if rtype in names:
        return names[rtype]
    return f"optional {rtype:#010x}" if rtype & OPTIONAL_RECORD else f"{rtype:#010x}"


# ---------------------------------------------------------------------------- skeleton


def iter_items(f: BinaryIO, limit: int = RECORD_LIMIT) -> Iterator[tuple[int, bytes]]:
    """(kind, payload) of every skeleton item read from ``f``; raises on a malformed one."""
    offset = 0
    while True:
        head = _read_exact(f, ITEM_HEADER.size)
        if not head:
            return
        if len(head) != ITEM_HEADER.size:
            raise SourceFormatError("truncated skeleton item header", offset=offset, structure="xen skeleton")
        kind, reserved, length = ITEM_HEADER.unpack(head)
        if kind not in (ITEM_BYTES, ITEM_PAGE_DATA) or reserved:
            raise SourceFormatError(
                f"expected item kind 1 or 2 with reserved 0, got {kind}, {reserved}",
                offset=offset,
                structure="xen skeleton",
            )
        if length > limit or (kind == ITEM_PAGE_DATA and (length == 0 or length % 8)):
            raise SourceFormatError(
                f"skeleton item of kind {kind} with length {length}", offset=offset, structure="xen skeleton"
            )
        payload = _read_exact(f, length + (-length % 8))
        if len(payload) != length + (-length % 8):
            raise SourceFormatError("truncated skeleton item", offset=offset, structure="xen skeleton")
        yield kind, payload[:length]
        offset += ITEM_HEADER.size + len(payload)


def _read_exact(f: BinaryIO, n: int) -> bytes:
    """Up to n bytes, fewer only at end of input (decompressing readers return short reads)."""
    parts, got = [], 0
    while got < n:
        part = f.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


# ---------------------------------------------------------------------------- second pass


def feed_pages(f: BinaryIO, result: ScanResult, put_data: Callable[[int, bytes], None], progress=None) -> None:
    """Hand the winning copy of every page to ``put_data(first_pfn, data)``, in runs of
    consecutive pfns; ``f`` is the stream ``scan`` read."""
    entry = 0
    records = (payload for kind, payload in iter_items(result.skeleton) if kind == ITEM_PAGE_DATA)
    for data_offset, raw in zip(result.data_offsets, records):
        entries = np.frombuffer(raw, "<u8")
        with_data = carries_data((entries >> np.uint64(TYPE_SHIFT)).astype(np.uint8))
        pfns = (entries & np.uint64(PFN_MASK)).astype(np.int64)[with_data]
        ids = entry + np.flatnonzero(with_data)
        wins = result.last_entry[pfns] == ids
        for lo in range(0, len(pfns), READ_PAGES):
            hi = min(lo + READ_PAGES, len(pfns))
            if wins[lo:hi].any():
                _feed_chunk(f, data_offset + lo * PAGE_SIZE, pfns[lo:hi], wins[lo:hi], put_data)
            if progress:
                progress((hi - lo) * PAGE_SIZE)
        entry += len(entries)
    result.skeleton.seek(0)


def _feed_chunk(f: BinaryIO, offset: int, pfns: np.ndarray, wins: np.ndarray, put_data) -> None:
    data = os.pread(f.fileno(), len(pfns) * PAGE_SIZE, offset)
    pages = np.frombuffer(data, np.uint8).reshape(len(pfns), PAGE_SIZE)
    if not wins.all():
        pages, pfns = pages[wins], pfns[wins]
    breaks = np.flatnonzero(np.diff(pfns) != 1) + 1
    bounds = [0, *breaks.tolist(), len(pfns)]
    for lo, hi in zip(bounds, bounds[1:]):
        put_data(int(pfns[lo]), memoryview(np.ascontiguousarray(pages[lo:hi])).cast("B"))


def spool_to_file(source: BinaryIO, directory=None) -> BinaryIO:
    """A seekable scratch copy of a stream read from a pipe (the caller closes it)."""
    copy = tempfile.TemporaryFile(prefix="leanimg-xen-input-", dir=directory)
    try:
        shutil.copyfileobj(source, copy, 4 << 20)
        copy.flush()
        copy.seek(0)
    except BaseException:
        copy.close()
        raise
    return copy


# ---------------------------------------------------------------------------- writing


def write_stream(
    out: BinaryIO, items: Iterator[tuple[int, bytes]], read_pages: Callable[[int, int], bytes], num_pfns: int
) -> int:
    """Rebuild the stream from skeleton items; ``read_pages(first_pfn, count)`` returns the
    contents of consecutive pfns. Returns the number of bytes written."""
    written = 0
    for kind, payload in items:
        if kind == ITEM_BYTES:
            out.write(payload)
            written += len(payload)
        else:
            written += _write_page_data(out, payload, read_pages, num_pfns)
    return written


def _write_page_data(out: BinaryIO, raw: bytes, read_pages, num_pfns: int) -> int:
    entries = np.frombuffer(raw, "<u8")
    pfns = (entries & np.uint64(PFN_MASK)).astype(np.int64)
    with_data = carries_data((entries >> np.uint64(TYPE_SHIFT)).astype(np.uint8))
    data_pfns = pfns[with_data]
    if len(data_pfns) and int(data_pfns.max()) >= num_pfns:
        raise SourceFormatError(
            f"skeleton PAGE_DATA names pfn {int(data_pfns.max()):#x}, the region has {num_pfns} pages",
            structure="xen skeleton",
        )
    length = PAGE_DATA_HEADER.size + len(raw) + PAGE_SIZE * len(data_pfns)
    out.write(RECORD_HEADER.pack(PAGE_DATA, length) + PAGE_DATA_HEADER.pack(len(entries), 0) + raw)
    breaks = np.flatnonzero(np.diff(data_pfns) != 1) + 1
    bounds = [0, *breaks.tolist(), len(data_pfns)]
    for lo, hi in zip(bounds, bounds[1:]):
        if hi > lo:
            out.write(read_pages(int(data_pfns[lo]), hi - lo))
    return RECORD_HEADER.size + length


def describe(items: Iterator[tuple[int, bytes]]) -> str:
    """A one-line description of the stream from the first skeleton item (its headers)."""
    first = next((payload for kind, payload in items if kind == ITEM_BYTES), b"")
    layers, pos = [], 0
    if first.startswith(XL_MAGIC):
        layers.append("xl save file")
        pos = XL_HEADER.size + XL_HEADER.unpack_from(first)[4]
    if first[pos : pos + 8] == LIBXL_MAGIC:
        layers.append("libxl v2")
        pos += LIBXL_HEADER.size + RECORD_HEADER.size  # the LIBXC_CONTEXT record
    if first[pos : pos + 8] == b"\xff" * 8 and len(first) >= pos + LIBXC_IMAGE_HEADER.size + 4:
        version = LIBXC_IMAGE_HEADER.unpack_from(first, pos)[2]
        gtype = LIBXC_DOMAIN_HEADER.unpack_from(first, pos + LIBXC_IMAGE_HEADER.size)[0]
        layers.append(f"libxc v{version}, {DOMAIN_TYPES.get(gtype, hex(gtype))}")
    return "Xen " + ", ".join(layers)
