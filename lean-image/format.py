"""Constants and structures of lean image format v1.0, named as in spec/format.md.

Every struct string is explicit little-endian with no implicit padding; the
test suite checks that each ``calcsize`` equals the size the spec's tables give.
"""

from __future__ import annotations

import enum
import functools
import struct

import numpy as np
import xxhash

FORMAT_MAJOR = 1
FORMAT_MINOR = 0

# --- header (spec §3) --------------------------------------------------------
HEADER_MAGIC = b"\x89LEANIMG"
HEADER_STRUCT = struct.Struct("<8sHHIQQQ16s16s16sIIQ")
HEADER_SIZE_V1_0 = 104
HEADER_CHECKSUM_OFFSET = 96
HEADER_LENGTH_MAX = 4096
PAGE_SIZE_MIN = 4096
PAGE_SIZE_MAX = 65536


class IncompatFeature(enum.IntFlag):
    """A reader MUST refuse an image with an incompatible bit it does not know."""
    PARENT = 1 << 0       # PARENT or DELTA pages: the image needs its parent
    DISK = 1 << 1         # DISK pages: restore needs the disks of the disk table
    DELTA = 1 << 2        # DELTA pages present


class CompatFeature(enum.IntFlag):
    """A reader MAY ignore compatible bits it does not know."""
    SOURCE_STATE = 1 << 0  # SOURCE_STATE records present: a save file can be rebuilt


class AutoclearFeature(enum.IntFlag):
    """A writer that modifies an image MUST clear autoclear bits it does not know."""


KNOWN_INCOMPAT = int(IncompatFeature.PARENT | IncompatFeature.DISK | IncompatFeature.DELTA)
KNOWN_COMPAT = int(CompatFeature.SOURCE_STATE)

# --- records (spec §4) -------------------------------------------------------
RECORD_HEADER_STRUCT = struct.Struct("<IIQ")
RECORD_TRAILER_STRUCT = struct.Struct("<Q")
RECORD_ALIGN = 8
RECORD_OPTIONAL_BIT = 0x8000_0000


class RecordType(enum.IntEnum):
    REGION = 0x0000_0001
    DISK = 0x0000_0002
    PAGE_FRAME = 0x0000_0010
    DELTA_FRAME = 0x0000_0011
    DISK_REFS = 0x0000_0012
    PAGE_MAP = 0x0000_0020
    DIGESTS = 0x0000_0021
    INDEX = 0x0000_00FF
    SOURCE_STATE = 0x8000_0003


REGION_STRUCT = struct.Struct("<IIQQII")        # id, flags, gpa, size, name_len, reserved
REGION_FLAG_HAS_GPA = 1 << 0
REGION_NAME_MAX = 255

DISK_STRUCT = struct.Struct("<IIQII16sII")       # id, flags, size, sector, fp_method, fp, name_len, rsvd
DISK_SECTOR_SIZE = 512
DISK_NAME_MAX = 255
FINGERPRINT_SAMPLED_XXH3 = 1
FINGERPRINT_SAMPLES = 64
FINGERPRINT_SAMPLE_SIZE = 4096

SOURCE_STATE_STRUCT = struct.Struct("<IIQ")      # source_format, tag, sequence


class SourceFormat(enum.IntEnum):
    QEMU = 1
    XEN = 2


PAGE_FRAME_STRUCT = struct.Struct("<QII")        # first_ordinal, num_pages, reserved
DELTA_FRAME_STRUCT = struct.Struct("<QII")       # first_delta, num_deltas, reserved
DISK_REFS_STRUCT = struct.Struct("<QII")         # first_ref, num_refs, reserved
DISK_REF_STRUCT = struct.Struct("<IIQ")          # disk_id, reserved, sector
PAGE_MAP_STRUCT = struct.Struct("<II")           # region_id, num_extents
EXTENT_STRUCT = struct.Struct("<QIHHQ")          # first_page, num_pages, class, reserved, first_slot
DIGESTS_STRUCT = struct.Struct("<IIQQ")          # region_id, num_digests, first_page, num_pages
DIGEST_SIZE = 16
INDEX_STRUCT = struct.Struct("<II")              # num_entries, reserved
INDEX_ENTRY_STRUCT = struct.Struct("<QIIQQ")     # record_offset, record_type, key, first, count
NO_KEY = 0xFFFF_FFFF

# numpy dtypes mirroring the repeated structures (all little-endian)
EXTENT_DTYPE = [("first_page", "<u8"), ("num_pages", "<u4"), ("page_class", "<u2"),
                ("reserved", "<u2"), ("first_slot", "<u8")]
DISK_REF_DTYPE = [("disk_id", "<u4"), ("reserved", "<u4"), ("sector", "<u8")]
INDEX_ENTRY_DTYPE = [("record_offset", "<u8"), ("record_type", "<u4"), ("key", "<u4"),
                     ("first", "<u8"), ("count", "<u8")]


class PageClass(enum.IntEnum):
    STORED = 1
    ZERO = 2
    FREE = 3
    DISK = 4
    PARENT = 5
    DELTA = 6


SLOT_CLASSES = {PageClass.STORED, PageClass.DISK, PageClass.DELTA}
# pages whose digest is stored in DIGESTS records; a ZERO page's digest is implied, FREE has none
DIGEST_CLASSES = {PageClass.STORED, PageClass.DISK, PageClass.PARENT, PageClass.DELTA}

# --- delta entries (spec §6) -------------------------------------------------
DELTA_ENTRY_STRUCT = struct.Struct("<BBH")       # encoding, reserved, num_words
DELTA_RUNS_STRUCT = struct.Struct("<H")          # num_runs
WORD_SIZE = 8


class DeltaEncoding(enum.IntEnum):
    INDEX_LIST = 1
    BITMAP = 2
    RUNS = 3


# --- footer (spec §8) --------------------------------------------------------
FOOTER_MAGIC = b"\x89LEANEND"
FOOTER_STRUCT = struct.Struct("<8sQQ16sQ")       # magic, index_offset, file_length, digest, checksum
FOOTER_SIZE = 48

# --- resource limits a reader MAY enforce (spec §9) ---------------------------
FRAME_PAGES_MAX_BYTES = 16 * 1024 * 1024     # decompressed size of one frame, writers MUST NOT exceed
RECORD_BODY_MAX = 256 * 1024 * 1024          # reference reader limit on one record body
REGIONS_MAX = 4096
DISKS_MAX = 256
REGION_SIZE_MAX = 1 << 48
CHAIN_DEPTH_MAX = 4096

DEFAULT_FRAME_BYTES = 2 * 1024 * 1024   # reference writer: 512 pages of 4 KiB per frame
DEFAULT_ZSTD_LEVEL = 3
DIGEST_CHUNK_PAGES = 1 << 16
EXTENT_CHUNK = 1 << 16
DISK_REF_CHUNK = 1 << 16


def align8(n: int) -> int:
    return (n + RECORD_ALIGN - 1) & ~(RECORD_ALIGN - 1)


def record_size(body_length: int) -> int:
    """Bytes one record occupies: header, body, zero padding, checksum."""
    return RECORD_HEADER_STRUCT.size + align8(body_length) + RECORD_TRAILER_STRUCT.size


def checksum64(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def page_digest(data) -> bytes:
    """xxh3-128 of one page, canonical (big-endian) 16 bytes."""
    return xxhash.xxh3_128_digest(data)


def page_digests(data, page_size: int) -> np.ndarray:
    """The digest of every page of contiguous ``data``, as an (n, 16) uint8 array."""
    view = memoryview(data).cast("B")
    joined = b"".join([xxhash.xxh3_128_digest(view[k:k + page_size])
                       for k in range(0, len(view), page_size)])
    return np.frombuffer(joined, np.uint8).reshape(-1, DIGEST_SIZE)


def row_digests(pages: np.ndarray, rows) -> np.ndarray:
    """The digests of rows ``rows`` of an (n, page_size) uint8 array, as (len(rows), 16) uint8."""
    joined = b"".join([xxhash.xxh3_128_digest(pages[r]) for r in np.asarray(rows).tolist()])
    return np.frombuffer(joined, np.uint8).reshape(-1, DIGEST_SIZE)


@functools.lru_cache(maxsize=None)
def zero_page_digest(page_size: int) -> bytes:
    """The implied digest of a ZERO page (spec §6.5)."""
    return page_digest(bytes(page_size))


def is_mandatory(record_type: int) -> bool:
    return not record_type & RECORD_OPTIONAL_BIT
