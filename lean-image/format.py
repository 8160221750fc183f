"""Every constant and on-disk structure of lean image format v1.1, declared once.

Each structure is declared here as the spec's byte table declares it (spec/format.md): field
names, types and order. From that one declaration come the struct used to pack and unpack
it, the numpy dtype of its tables, the byte offset of each field (for error messages), and
the names the Kaitai description (ksy/leanimg.ksy) uses; tests/test_format.py checks the
declarations against the spec's tables and the .ksy, so none of the three can drift.
"""

from __future__ import annotations

import enum
import functools
import struct
from typing import cast

import numpy as np
import xxhash

from .native import backend as _backend

# the same digests and checksums as the xxhash module, many pages a call (None: xxhash)
_native_digests = _backend.digest_rows if _backend is not None else None
_native_span_checksums = _backend.span_checksums if _backend is not None else None

# Field types as the spec's tables write them; a name ending in [] is a variable-length array.
_SCALARS = {"u1": "B", "u2": "H", "u4": "I", "u8": "Q", "b[8]": "8s", "uuid": "16s", "digest": "16s"}
_NUMPY = {"u1": "<u1", "u2": "<u2", "u4": "<u4", "u8": "<u8", "b[8]": "S8", "uuid": ("u1", 16), "digest": ("u1", 16)}


class Values(tuple):
    """The head fields of one structure as a tuple that also answers by name (a namedtuple
    without the cost of building one class per structure when the module is imported)."""

    __slots__ = ()
    _fields: tuple = ()
    _index: dict = {}

    def __getattr__(self, name: str):
        try:
            return self[self._index[name]]
        except KeyError:
            raise AttributeError(name) from None

    def _asdict(self) -> dict:
        return dict(zip(self._fields, self))

    @classmethod
    def _make(cls, iterable) -> "Values":
        return cls(iterable)


class Field:
    """One field of a structure: its name and its type in the spec's notation."""

    def __init__(self, name: str, type_: str):
        self.name, self.type = name, type_

    @property
    def is_fixed(self) -> bool:
        return self.type in _SCALARS

    @property
    def element(self) -> str | None:
        """The element type of an array field (``extent`` for ``extent[]``), else None."""
        return self.type[:-2] if self.type.endswith("[]") else None

    @functools.cached_property
    def struct(self) -> struct.Struct:
        return struct.Struct("<" + _SCALARS[self.type])


class Structure:
    """An on-disk structure: its fixed-size head packs and unpacks with one struct; fields
    after the first variable-length one (names, arrays, frames) are parsed by their users."""

    def __init__(self, name: str, fields: list[tuple[str, str]], zero: tuple[str, ...] = ()):
        self.name = name  # the type's name in ksy/leanimg.ksy
        self.fields = [Field(*f) for f in fields]
        # head fields that must be zero (rule LI-REC-008): the reserved ones, and any named here
        self.zero_fields = [f.name for f in self.fields if f.name == "reserved" or f.name in zero]
        head = []
        for f in self.fields:
            if not f.is_fixed:
                break
            head.append(f)
        self.head = head
        self.struct = struct.Struct("<" + "".join(_SCALARS[f.type] for f in head))
        self.size = self.struct.size
        self.offsets = {}
        at = 0
        for f in head:
            self.offsets[f.name] = at
            at += f.struct.size
        self.Values = cast(
            "type[Values]",  # (a subclass of Values, which mypy cannot tell of a type() call)
            type(
                f"{name}_values",
                (Values,),
                {
                    "__slots__": (),
                    "_fields": tuple(f.name for f in head),
                    "_index": {f.name: k for k, f in enumerate(head)},
                },
            ),
        )

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def offset(self, name: str) -> int:
        """Byte offset of a head field within the structure."""
        return self.offsets[name]

    @functools.cached_property
    def dtype(self) -> np.dtype:
        """numpy dtype of the head, for tables of this structure."""
        return np.dtype([(f.name, _NUMPY[f.type]) for f in self.head])

    def pack(self, **values) -> bytes:
        """The head from keyword values; fields not given (reserved ones) are zero."""
        unknown = set(values) - set(self.offsets)
        if unknown:
            raise TypeError(f"{self.name} has no field {sorted(unknown)[0]!r}")
        return self.struct.pack(
            *[values.get(f.name, b"" if f.type in ("b[8]", "uuid", "digest") else 0) for f in self.head]
        )

    def unpack(self, buffer, offset: int = 0):
        """The head's fields as a named tuple."""
        return self.Values._make(self.struct.unpack_from(buffer, offset))


FORMAT_MAJOR = 1
FORMAT_MINOR = 1  # this toolkit reads and writes 1.1
FORMAT_MINOR_PLAIN = 0  # the minor of an image that sets no bit defined in 1.1: a 1.0 image

# --- header (spec §3) --------------------------------------------------------
HEADER = Structure(
    "header",
    [
        ("magic", "b[8]"),
        ("major_version", "u2"),
        ("minor_version", "u2"),
        ("header_length", "u4"),
        ("incompatible_features", "u8"),
        ("compatible_features", "u8"),
        ("autoclear_features", "u8"),
        ("image_uuid", "uuid"),
        ("parent_uuid", "uuid"),
        ("parent_digest", "digest"),
        ("page_size", "u4"),
        ("reserved", "u4"),
        ("header_checksum", "u8"),
        ("extension", "b[]"),
    ],
)
HEADER_MAGIC = b"\x89LEANIMG"
HEADER_LENGTH_MAX = 4096
PAGE_SIZE_MIN = 4096
PAGE_SIZE_MAX = 65536


class IncompatFeature(enum.IntFlag):
    """A reader MUST refuse an image with an incompatible bit it does not know."""

    PARENT = 1 << 0  # PARENT or DELTA pages: the image needs its parent
    DISK = 1 << 1  # DISK pages: restore needs the disks of the disk table
    DELTA = 1 << 2  # DELTA pages present
    INHERITED_DIGESTS = 1 << 3  # (1.1) PARENT pages carry no stored digest: the parent chain gives it


class CompatFeature(enum.IntFlag):
    """A reader MAY ignore compatible bits it does not know."""

    SOURCE_STATE = 1 << 0  # SOURCE_STATE records present: a save file can be rebuilt


class AutoclearFeature(enum.IntFlag):
    """A writer that modifies an image MUST clear autoclear bits it does not know."""


KNOWN_INCOMPAT = int(
    IncompatFeature.PARENT | IncompatFeature.DISK | IncompatFeature.DELTA | IncompatFeature.INHERITED_DIGESTS
)
KNOWN_COMPAT = int(CompatFeature.SOURCE_STATE)

# --- records (spec §4) -------------------------------------------------------
RECORD = Structure(
    "record",
    [
        ("record_type", "u4"),
        ("flags", "u4"),
        ("body_length", "u8"),
        ("body", "b[]"),
        ("padding", "b[]"),
        ("record_checksum", "u8"),
    ],
)
RECORD_TRAILER = RECORD.field("record_checksum").struct
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


NAME_FIELDS = [("name_length", "u4"), ("reserved", "u4"), ("name", "b[]")]  # how REGION and DISK bodies end
REGION_BODY = Structure(
    "region_body", [("region_id", "u4"), ("flags", "u4"), ("guest_phys_base", "u8"), ("size_bytes", "u8"), *NAME_FIELDS]
)
REGION_FLAG_HAS_GPA = 1 << 0
REGION_NAME_MAX = 255

DISK_BODY = Structure(
    "disk_body",
    [
        ("disk_id", "u4"),
        ("flags", "u4"),
        ("size_bytes", "u8"),
        ("sector_size", "u4"),
        ("fingerprint_method", "u4"),
        ("fingerprint", "digest"),
        *NAME_FIELDS,
    ],
    zero=("flags",),
)
DISK_SECTOR_SIZE = 512
DISK_NAME_MAX = 255
FINGERPRINT_SAMPLED_XXH3 = 1
FINGERPRINT_SAMPLES = 64
FINGERPRINT_SAMPLE_SIZE = 4096

SOURCE_STATE_BODY = Structure(
    "source_state_body", [("source_format", "u4"), ("tag", "u4"), ("sequence", "u8"), ("data", "b[]")]
)


class SourceFormat(enum.IntEnum):
    QEMU = 1
    XEN = 2


PRIVATE_SOURCE_FORMATS = 0x8000_0000  # source_format values from here up: private use (spec §5.4)


PAGE_FRAME_BODY = Structure(
    "page_frame_body", [("first_ordinal", "u8"), ("num_pages", "u4"), ("reserved", "u4"), ("frame", "b[]")]
)
DELTA_FRAME_BODY = Structure(
    "delta_frame_body",
    [
        ("first_delta", "u8"),
        ("num_deltas", "u4"),
        ("reserved", "u4"),
        ("entry_offsets", "u4[]"),
        ("padding", "b[]"),
        ("frame", "b[]"),
    ],
)
DISK_REFS_BODY = Structure(
    "disk_refs_body", [("first_ref", "u8"), ("num_refs", "u4"), ("reserved", "u4"), ("refs", "disk_ref[]")]
)
DISK_REF = Structure("disk_ref", [("disk_id", "u4"), ("reserved", "u4"), ("sector", "u8")])
PAGE_MAP_BODY = Structure("page_map_body", [("region_id", "u4"), ("num_extents", "u4"), ("extents", "extent[]")])
EXTENT = Structure(
    "extent",
    [("first_page", "u8"), ("num_pages", "u4"), ("page_class", "u2"), ("reserved", "u2"), ("first_slot", "u8")],
)
DIGESTS_BODY = Structure(
    "digests_body",
    [("region_id", "u4"), ("num_digests", "u4"), ("first_page", "u8"), ("num_pages", "u8"), ("digests", "digest[]")],
)
DIGEST_SIZE = 16
INDEX_BODY = Structure("index_body", [("num_entries", "u4"), ("reserved", "u4"), ("entries", "index_entry[]")])
INDEX_ENTRY = Structure(
    "index_entry", [("record_offset", "u8"), ("record_type", "u4"), ("key", "u4"), ("first", "u8"), ("count", "u8")]
)
NO_KEY = 0xFFFF_FFFF


class PageClass(enum.IntEnum):
    STORED = 1
    ZERO = 2
    FREE = 3
    DISK = 4
    PARENT = 5
    DELTA = 6


SLOT_CLASSES = {PageClass.STORED, PageClass.DISK, PageClass.DELTA}
# pages whose digest is stored in DIGESTS records; a ZERO page's digest is implied, FREE has none,
# and in an image with INHERITED_DIGESTS a PARENT page's digest is the parent's (spec §6.1)
DIGEST_CLASSES = {PageClass.STORED, PageClass.DISK, PageClass.PARENT, PageClass.DELTA}
OWN_DIGEST_CLASSES = DIGEST_CLASSES - {PageClass.PARENT}
# classes that hold a page's bytes themselves: the base a chain's PARENT and DELTA pages rest on
CONCRETE_CLASSES = {PageClass.STORED, PageClass.ZERO, PageClass.FREE, PageClass.DISK}


def _class_table(classes) -> np.ndarray:
    table = np.zeros(1 << 16, bool)
    table[[int(c) for c in classes]] = True
    return table


# indexed by a u2 page_class: a vectorised ``in`` for whole extent tables
IS_PAGE_CLASS = _class_table(PageClass)
HAS_SLOT = _class_table(SLOT_CLASSES)
HAS_DIGEST = _class_table(DIGEST_CLASSES)
HAS_OWN_DIGEST = _class_table(OWN_DIGEST_CLASSES)
IS_CONCRETE = _class_table(CONCRETE_CLASSES)


def inherits_digests(incompatible_features: int) -> bool:
    """Whether an image's PARENT pages take their digests from the parent chain (format 1.1)."""
    return bool(incompatible_features & _INHERITED_DIGESTS)  # an int: IntFlag's & costs ~3 us


_INHERITED_DIGESTS = int(IncompatFeature.INHERITED_DIGESTS)


def digest_class_table(incompatible_features: int) -> np.ndarray:
    """HAS_DIGEST or HAS_OWN_DIGEST: the digest-bearing classes of an image with these bits."""
    return HAS_OWN_DIGEST if inherits_digests(incompatible_features) else HAS_DIGEST


# --- delta entries (spec §6) -------------------------------------------------
DELTA_ENTRY = Structure(
    "delta_entry",
    [
        ("encoding", "u1"),
        ("reserved", "u1"),
        ("num_words", "u2"),
        ("word_indexes", "u2[]"),
        ("bitmap", "b[]"),
        ("num_runs", "u2"),
        ("runs", "delta_run[]"),
        ("values", "u8[]"),
    ],
)
DELTA_RUN = Structure("delta_run", [("start_word", "u2"), ("run_length", "u2")])
WORD_SIZE = 8


class DeltaEncoding(enum.IntEnum):
    INDEX_LIST = 1
    BITMAP = 2
    RUNS = 3


# --- footer (spec §8) --------------------------------------------------------
FOOTER_MAGIC = b"\x89LEANEND"
FOOTER = Structure(
    "footer",
    [
        ("magic", "b[8]"),
        ("index_offset", "u8"),
        ("file_length", "u8"),
        ("image_digest", "digest"),
        ("footer_checksum", "u8"),
    ],
)

# --- resource limits a reader MAY enforce (spec §9) ---------------------------
FRAME_PAGES_MAX_BYTES = 16 * 1024 * 1024  # decompressed size of one frame, writers MUST NOT exceed
RECORD_BODY_MAX = 256 * 1024 * 1024  # reference reader limit on one record body
REGIONS_MAX = 4096
DISKS_MAX = 256
REGION_SIZE_MAX = 1 << 48
CHAIN_DEPTH_MAX = 4096

DEFAULT_FRAME_BYTES = 2 * 1024 * 1024  # reference writer: 512 pages of 4 KiB per frame
DEFAULT_ZSTD_LEVEL = 3
DIGEST_CHUNK_PAGES = 1 << 16
EXTENT_CHUNK = 1 << 16
DISK_REF_CHUNK = 1 << 16


def valid_page_size(page_size: int) -> bool:
    """A power of two from 4096 to 65536 (spec §3.7)."""
    return not page_size & (page_size - 1) and PAGE_SIZE_MIN <= page_size <= PAGE_SIZE_MAX


def align8(n: int) -> int:
    return (n + RECORD_ALIGN - 1) & ~(RECORD_ALIGN - 1)


def record_size(body_length: int) -> int:
    """Bytes one record occupies: header, body, zero padding, checksum."""
    return RECORD.size + align8(body_length) + RECORD_TRAILER.size


def checksum64(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def span_checksums(buffers: list, offsets, lengths) -> np.ndarray:
    """checksum64 of bytes [offsets[k], offsets[k] + lengths[k]) of each of ``buffers`` (u8):
    a batch of links' checksums in one call (leanimg._native), or one call each. ValueError:
    a span outside its buffer."""
    offsets, lengths = np.asarray(offsets, np.int64), np.asarray(lengths, np.int64)
    out = np.zeros(len(buffers), np.uint64)
    if _native_span_checksums is not None:
        _native_span_checksums(list(buffers), np.ascontiguousarray(offsets), np.ascontiguousarray(lengths), out)
        return out
    for k, (buffer, at, length) in enumerate(zip(buffers, offsets.tolist(), lengths.tolist())):
        view = memoryview(buffer).cast("B")
        if at < 0 or length < 0 or at + length > len(view):
            raise ValueError(f"span_checksums: span {k} is outside its buffer")
        out[k] = checksum64(view[at : at + length])
    return out


def page_digest(data) -> bytes:
    """xxh3-128 of one page, canonical (big-endian) 16 bytes."""
    return xxhash.xxh3_128_digest(data)


def page_digests(data, page_size: int) -> np.ndarray:
    """The digest of every page of contiguous ``data``, as an (n, 16) uint8 array."""
    view = memoryview(data).cast("B")
    if _native_digests is not None and len(view) % page_size == 0:
        return _digest_rows_native(view, page_size, np.arange(len(view) // page_size, dtype=np.int64))
    joined = b"".join([xxhash.xxh3_128_digest(view[k : k + page_size]) for k in range(0, len(view), page_size)])
    return np.frombuffer(joined, np.uint8).reshape(-1, DIGEST_SIZE)


def page_items(page_size: int) -> np.dtype:
    """One page as one numpy item: fancy-indexed copies of whole pages move one block per
    page (several times faster than rows of an (n, page_size) uint8 array)."""
    return np.dtype((np.void, page_size))


def row_digests(pages: np.ndarray, rows) -> np.ndarray:
    """The digests of rows ``rows`` of an (n, page_size) uint8 array, as (len(rows), 16) uint8."""
    if _native_digests is not None and pages.ndim == 2 and pages.flags.c_contiguous:
        return _digest_rows_native(pages, pages.shape[1], np.asarray(rows, np.int64))
    joined = b"".join([xxhash.xxh3_128_digest(pages[r]) for r in np.asarray(rows).tolist()])
    return np.frombuffer(joined, np.uint8).reshape(-1, DIGEST_SIZE)


def _digest_rows_native(data, page_size: int, rows: np.ndarray) -> np.ndarray:
    """page_digests/row_digests by leanimg._native: one call, the GIL released meanwhile
    (so read-ahead workers and the caller digest pages at once)."""
    assert _native_digests is not None  # (its callers take this path only when it is)
    digests = np.empty((len(rows), DIGEST_SIZE), np.uint8)
    _native_digests(data, page_size, np.ascontiguousarray(rows), digests)
    return digests


@functools.lru_cache(maxsize=None)
def zero_page_digest(page_size: int) -> bytes:
    """The implied digest of a ZERO page (spec §6.5)."""
    return page_digest(bytes(page_size))


def is_mandatory(record_type: int) -> bool:
    return not record_type & RECORD_OPTIONAL_BIT


STRUCTURES = {
    s.name: s
    for s in (
        HEADER,
        RECORD,
        REGION_BODY,
        DISK_BODY,
        SOURCE_STATE_BODY,
        PAGE_FRAME_BODY,
        DELTA_FRAME_BODY,
        DISK_REFS_BODY,
        DISK_REF,
        PAGE_MAP_BODY,
        EXTENT,
        DIGESTS_BODY,
        INDEX_BODY,
        INDEX_ENTRY,
        FOOTER,
        DELTA_ENTRY,
        DELTA_RUN,
    )
}

BODY_OF = {
    RecordType.REGION: REGION_BODY,
    RecordType.DISK: DISK_BODY,
    RecordType.SOURCE_STATE: SOURCE_STATE_BODY,
    RecordType.PAGE_FRAME: PAGE_FRAME_BODY,
    RecordType.DELTA_FRAME: DELTA_FRAME_BODY,
    RecordType.DISK_REFS: DISK_REFS_BODY,
    RecordType.PAGE_MAP: PAGE_MAP_BODY,
    RecordType.DIGESTS: DIGESTS_BODY,
    RecordType.INDEX: INDEX_BODY,
}
