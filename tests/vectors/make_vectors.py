#!/usr/bin/env python3
"""Generate the conformance test vectors of lean image format v1.1 (and of 1.0, which it includes).

    python3 tests/vectors/make_vectors.py [OUTDIR]     (default: this directory)

Writes ``valid/*.lean`` (+ the small disk file they need), ``invalid/*.lean`` and
``vectors.json``. Deterministic: fixed UUIDs, seeded content, single-threaded
compression at a fixed zstd level, so re-running gives byte-identical files.

Children are written as format 1.0 (PARENT digests stored) unless a vector says 1.1
(``inherit=True``: INHERITED_DIGESTS, PARENT digests come from the parent), so the 1.0
vectors stay byte-identical to those of the 1.0 generator.

Valid vectors come straight from ``LeanImageWriter`` (or from it plus a
hand-spliced record). Each invalid vector is a valid image with exactly one rule
broken; every checksum, digest, index entry and footer field that is not the
point of the vector is recomputed, so a validator reports that rule (any
unavoidable follow-on findings are listed as ``also_reported``).
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import struct
import sys
import uuid
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import xxhash
import zstandard

from leanimg.format import (
    DELTA_ENTRY,
    DELTA_FRAME_BODY,
    DIGESTS_BODY,
    EXTENT,
    FOOTER_MAGIC,
    FOOTER,
    HEADER,
    INDEX_ENTRY,
    INDEX_BODY,
    NO_KEY,
    PAGE_FRAME_BODY,
    PAGE_MAP_BODY,
    RECORD,
    DeltaEncoding,
    PageClass,
    RecordType,
    SourceFormat,
    align8,
    checksum64,
    page_digest,
)
from leanimg.writer import LeanImageWriter, ParentLink, disk_fingerprint

HERE = Path(__file__).resolve().parent
ZSTD_LEVEL = 3
PS = 4096
_NS = uuid.UUID("6c65616e-696d-6700-0000-766563746f72")  # fixed namespace for vector UUIDs


RAW: dict[str, bytes] = {}  # base image name -> expected raw restore, from the content fed


def fixed_uuid(name: str) -> bytes:
    return uuid.uuid5(_NS, name).bytes


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def random_pages(seed: int, count: int, page_size: int = PS) -> bytes:
    """Distinct, non-zero, but compressible pages (keeps the vectors small): a random
    64-byte pattern per page with 8 random words sprinkled in."""
    r = rng(seed)
    pages = []
    for _ in range(count):
        words = np.tile(r.integers(1, 1 << 63, 8, dtype=np.uint64), page_size // 64)
        words[r.choice(page_size // 8, 8, replace=False)] = r.integers(1, 1 << 63, 8, dtype=np.uint64)
        pages.append(words.astype("<u8").tobytes())
    return b"".join(pages)


def compress(data: bytes, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=content_size, write_checksum=False).compress(
        data
    )


def write_image(build, *, page_size=PS, parent=None, frame_pages=256, name="img", **kw) -> bytes:
    """Run ``build(writer)`` on a LeanImageWriter writing to memory; return the image bytes."""
    out = io.BytesIO()
    kw.setdefault("inherit_digests", False if parent is not None else None)
    writer = LeanImageWriter(
        out,
        page_size=page_size,
        parent=parent,
        frame_pages=frame_pages,
        level=ZSTD_LEVEL,
        threads=1,
        image_uuid=fixed_uuid(name),
        **kw,
    )
    with writer:
        build(writer)
    return out.getvalue()


def footer_digest(data: bytes) -> bytes:
    return data[-48:][24:40]


# --- low-level image model: header + records, re-serialized with fix-ups ------------------
@dataclass
class Rec:
    type: int
    body: bytes
    key: int = NO_KEY
    first: int = 0
    count: int = 0
    flags: int = 0
    checksum: int | None = None  # None: computed
    padding: bytes | None = None  # None: zeros

    def serialize(self) -> bytes:
        head = RECORD.struct.pack(self.type, self.flags, len(self.body))
        pad = self.padding if self.padding is not None else bytes(align8(len(self.body)) - len(self.body))
        raw = head + self.body + pad
        return raw + struct.pack("<Q", checksum64(raw) if self.checksum is None else self.checksum)


class Lean:
    """An image taken apart: header bytes and the records before the INDEX (with their
    index key/first/count). ``build`` puts it back together, recomputing the header
    checksum, record checksums, INDEX, image_digest and footer checksum unless told not to."""

    def __init__(self, header: bytes, records: list[Rec]):
        self.header = bytearray(header)
        self.records = records

    @classmethod
    def parse(cls, data: bytes) -> "Lean":
        header_length = struct.unpack_from("<I", data, 12)[0]
        index_offset = struct.unpack_from("<Q", data, len(data) - 40)[0]
        _, _, index_len = RECORD.struct.unpack_from(data, index_offset)
        index_body = data[index_offset + 16 : index_offset + 16 + index_len]
        (n, _) = INDEX_BODY.struct.unpack_from(index_body)
        entries = [INDEX_ENTRY.struct.unpack_from(index_body, 8 + 32 * k) for k in range(n)]
        records = []
        for offset, rtype, key, first, count in entries:
            t, flags, blen = RECORD.struct.unpack_from(data, offset)
            assert t == rtype and flags == 0
            records.append(Rec(t, data[offset + 16 : offset + 16 + blen], key, first, count))
        return cls(data[:header_length], records)

    def copy(self) -> "Lean":
        return Lean(bytes(self.header), [replace(r) for r in self.records])

    # navigation
    def find(self, rtype: int, n: int = 0) -> int:
        hits = [i for i, r in enumerate(self.records) if r.type == rtype]
        return hits[n]

    def count(self, rtype: int) -> int:
        return sum(r.type == rtype for r in self.records)

    # header edits
    def set_header(self, fmt: str, offset: int, value) -> "Lean":
        struct.pack_into("<" + fmt, self.header, offset, value)
        return self

    # serialization
    def build(
        self,
        *,
        fix_header: bool = True,
        index_entries=None,
        index_extra: bytes = b"",
        footer: dict | None = None,
        fix_footer_checksum: bool = True,
    ) -> bytes:
        header = bytearray(self.header)
        if fix_header:
            struct.pack_into("<Q", header, HEADER.offset("header_checksum"), 0)
            struct.pack_into("<Q", header, HEADER.offset("header_checksum"), checksum64(bytes(header)))
        out = bytearray(header)
        entries = []
        for rec in self.records:
            entries.append((len(out), rec.type, rec.key, rec.first, rec.count))
            out += rec.serialize()
        if index_entries is not None:
            entries = index_entries(entries)
        index_offset = len(out)
        index_body = INDEX_BODY.struct.pack(len(entries), 0) + b"".join(INDEX_ENTRY.struct.pack(*e) for e in entries)
        out += Rec(RecordType.INDEX, index_body + index_extra).serialize()
        fields = dict(
            magic=FOOTER_MAGIC,
            index_offset=index_offset,
            file_length=len(out) + 48,
            image_digest=xxhash.xxh3_128_digest(bytes(out)),
            footer_checksum=0,
        )
        fields.update(footer or {})
        raw = FOOTER.struct.pack(*fields.values())
        if fix_footer_checksum:
            raw = raw[:40] + struct.pack("<Q", checksum64(raw[:40]))
        return bytes(out + raw)


# --- body helpers ------------------------------------------------------------------------
def patch(body: bytes, offset: int, fmt: str, value) -> bytes:
    b = bytearray(body)
    struct.pack_into("<" + fmt, b, offset, value)
    return bytes(b)


def rewrite_body(lean: Lean, i: int, fn) -> Lean:
    """Replace record i's body by fn(body); build() then fixes its checksum, index and footer."""
    lean.records[i].body = fn(lean.records[i].body)
    return lean


def extents_of(body: bytes) -> list[list[int]]:
    _, n = PAGE_MAP_BODY.struct.unpack_from(body)
    return [list(EXTENT.struct.unpack_from(body, 8 + 24 * k)) for k in range(n)]


def page_map_body(region_id: int, extents) -> bytes:
    return PAGE_MAP_BODY.struct.pack(region_id, len(extents)) + b"".join(EXTENT.struct.pack(*e) for e in extents)


DIGEST_BEARING = {PageClass.STORED, PageClass.DISK, PageClass.PARENT, PageClass.DELTA}


def page_classes(lean: "Lean", region_id: int) -> list[int]:
    """The class of every page of a region, from its PAGE_MAP records in file order."""
    classes = []
    for rec in lean.records:
        if rec.type == RecordType.PAGE_MAP and PAGE_MAP_BODY.struct.unpack_from(rec.body)[0] == region_id:
            for first, n, cls, _, _ in extents_of(rec.body):
                assert first == len(classes)
                classes += [cls] * n
    return classes


def digest_rank(lean: "Lean", region_id: int, page: int, cls: PageClass) -> int:
    """Position of ``page``'s digest among the region's stored digests (its rank among the
    STORED, DISK, PARENT and DELTA pages); asserts the page has class ``cls``."""
    classes = page_classes(lean, region_id)
    assert classes[page] == cls, (page, classes[page], cls)
    return sum(c in DIGEST_BEARING for c in classes[:page])


def digests_body(region_id: int, first_page: int, num_pages: int, digests: bytes) -> bytes:
    assert len(digests) % 16 == 0
    return DIGESTS_BODY.struct.pack(region_id, len(digests) // 16, first_page, num_pages) + digests


def split_delta_frame(body: bytes):
    first, n, reserved = DELTA_FRAME_BODY.struct.unpack_from(body)
    offsets = list(struct.unpack_from(f"<{n + 1}I", body, 16))
    zstd_at = align8(16 + 4 * (n + 1))
    content = zstandard.ZstdDecompressor().decompress(body[zstd_at:])
    return first, [content[offsets[k] : offsets[k + 1]] for k in range(n)]


def delta_frame_body(
    first: int, entries: list[bytes], offsets=None, content_size: bool = True, frame_content: bytes | None = None
) -> bytes:
    if offsets is None:
        offsets = [0]
        for e in entries:
            offsets.append(offsets[-1] + len(e))
    table = DELTA_FRAME_BODY.struct.pack(first, len(offsets) - 1, 0) + struct.pack(f"<{len(offsets)}I", *offsets)
    table += bytes(align8(len(table)) - len(table))
    content = b"".join(entries) if frame_content is None else frame_content
    return table + compress(content, content_size)


# --- base images --------------------------------------------------------------------------
def img_basic() -> bytes:
    """One region with GPA: STORED, ZERO and FREE pages, one SOURCE_STATE record."""
    data = bytearray(random_pages(1, 8))
    data[3 * PS : 4 * PS] = bytes(PS)  # a ZERO page inside put_pages

    def build(w):
        w.declare_source_state()
        w.add_source_state(SourceFormat.QEMU, 7, b"qemu-dev-state")  # 14 bytes: padded body
        r = w.add_region("pc.ram", 12 * PS, guest_phys_base=0)
        w.put_pages(r, 0, bytes(data))
        w.put_zero(r, 8, 2)
        w.put_free(r, 10, 2)

    RAW["basic"] = bytes(data) + bytes(4 * PS)
    return write_image(build, name="basic")


def img_multi_region() -> bytes:
    """Three regions (one without GPA), pages fed interleaved and out of order, many frames."""
    pages = {name: random_pages(seed, n) for name, seed, n in (("pc.ram", 2, 6), ("vga.vram", 3, 3), ("pc.rom", 4, 2))}

    def build(w):
        a = w.add_region("pc.ram", 8 * PS, guest_phys_base=0)
        b = w.add_region("vga.vram", 4 * PS)
        c = w.add_region("pc.rom", 2 * PS, guest_phys_base=0xFFFE0000)
        w.put_pages(b, 1, pages["vga.vram"])
        w.put_pages(a, 4, pages["pc.ram"][: 2 * PS])
        w.put_pages(c, 0, pages["pc.rom"])
        w.put_free(a, 6, 2)
        w.put_pages(a, 0, pages["pc.ram"][2 * PS : 6 * PS])
        w.put_zero(b, 0)

    ram = pages["pc.ram"]
    RAW["multi-region"] = (
        ram[2 * PS : 6 * PS] + ram[: 2 * PS] + bytes(2 * PS) + bytes(PS) + pages["vga.vram"] + pages["pc.rom"]
    )
    return write_image(build, name="multi-region", frame_pages=2)


def img_page_size_8192() -> bytes:
    ps = 8192

    def build(w):
        r = w.add_region("ram", 4 * ps, guest_phys_base=0x100000)
        w.put_pages(r, 0, random_pages(5, 2, ps))
        w.put_zero(r, 2)
        w.put_free(r, 3)

    RAW["page-size-8192"] = random_pages(5, 2, ps) + bytes(2 * ps)
    return write_image(build, page_size=ps, name="page-size-8192")


def img_source_state() -> bytes:
    def build(w):
        w.add_source_state(SourceFormat.QEMU, 1, b"QEVM\x00\x00\x00\x03")
        w.add_source_state(SourceFormat.QEMU, 2, bytes(range(40)))
        w.add_source_state(SourceFormat.XEN, 3, b"")
        r = w.add_region("ram", 2 * PS)
        w.put_pages(r, 0, random_pages(6, 1))
        w.put_zero(r, 1)

    RAW["source-state"] = random_pages(6, 1) + bytes(PS)
    return write_image(build, name="source-state")


def img_source_state_private() -> bytes:
    def build(w):
        w.add_source_state(0xB5A1_7E00, 1, b"toyvm device state")
        w.add_source_state(0xFFFF_FFFF, 7, b"")
        r = w.add_region("ram", 2 * PS)
        w.put_pages(r, 0, random_pages(16, 1))
        w.put_free(r, 1)

    RAW["source-state-private"] = random_pages(16, 1) + bytes(PS)
    return write_image(build, name="source-state-private")


DISK_SIZE = 16384


def disk0_bytes() -> bytes:
    return random_pages(7, DISK_SIZE // PS)


def disk_fp(data: bytes) -> bytes:
    return disk_fingerprint(lambda o, n: data[o : o + n], len(data))


def img_disk(extra_disk: bool = False) -> bytes:
    """DISK pages: page 1 at sector 8, page 2 at sector 1 of disk0 (tests/vectors/valid/disk0.raw)."""
    disk = disk0_bytes()

    def build(w):
        d = w.add_disk("disk0", len(disk), disk_fp(disk))
        if extra_disk:
            w.add_disk("disk1", 1 << 20, bytes(range(16)))
        r = w.add_region("ram", 4 * PS)
        w.put_pages(r, 0, random_pages(8, 1))
        w.put_disk(r, 1, d, 8, page_digest(disk[8 * 512 : 8 * 512 + PS]))
        w.put_disk(r, 2, d, 1, page_digest(disk[512 : 512 + PS]))
        w.put_zero(r, 3)

    RAW["disk"] = random_pages(8, 1) + disk[8 * 512 : 8 * 512 + PS] + disk[512 : 512 + PS] + bytes(PS)
    return write_image(build, name="disk-extra" if extra_disk else "disk")


def img_parent(name: str = "parent", page_size: int = PS) -> bytes:
    def build(w):
        r = w.add_region("ram", 12 * page_size, guest_phys_base=0)
        w.put_pages(r, 0, random_pages(9, 10, page_size))
        w.put_zero(r, 10)
        w.put_free(r, 11)

    RAW["parent"] = random_pages(9, 10, page_size) + bytes(2 * page_size)
    return write_image(build, page_size=page_size, name=name)


def parent_pages() -> bytes:
    return random_pages(9, 10)


def changed(page: bytes, positions) -> bytes:
    words = np.frombuffer(page, "<u8").copy()
    words[np.asarray(positions, dtype=np.int64)] ^= np.uint64(0x5A5A_0000_0000_A5A5)
    return words.tobytes()


DELTA_CHANGES = {
    4: [3, 77, 400],  # few scattered words -> INDEX_LIST
    5: list(range(5, 512, 12)),  # 42 scattered words -> BITMAP
    6: list(range(10, 70)) + list(range(200, 260)),  # two long runs -> RUNS
}
EXPECTED_ENCODING = {4: DeltaEncoding.INDEX_LIST, 5: DeltaEncoding.BITMAP, 6: DeltaEncoding.RUNS}


def img_child(
    parent: bytes,
    *,
    name: str = "child",
    link: ParentLink | None = None,
    extra_region: bool = False,
    page_size: int = PS,
    inherit: bool = False,
) -> bytes:
    """PARENT pages, DELTA pages in all three encodings, one fully rewritten STORED page, a ZERO page
    (``inherit``: format 1.1, the PARENT pages' digests inherited from the parent)."""
    old = parent_pages()
    pdigests = Lean.parse(parent).records
    link = link or ParentLink(fixed_uuid("parent"), footer_digest(parent))

    def page(k):
        return old[k * PS : (k + 1) * PS]

    def build(w):
        r = w.add_region("ram", 12 * PS, guest_phys_base=0)
        digs = [page_digest(page(k)) for k in range(10)]
        w.put_parent(r, 0, b"".join(digs[0:4]))
        for k, positions in DELTA_CHANGES.items():
            cls = w.put_changed(r, k, page(k), changed(page(k), positions))
            assert cls == PageClass.DELTA, (k, cls)
        assert w.put_changed(r, 7, page(7), random_pages(10, 1)) == PageClass.STORED
        w.put_parent(r, 8, b"".join(digs[8:10]))
        w.put_zero(r, 10)
        w.put_free(r, 11)
        if extra_region:
            x = w.add_region("extra", 1 * PS)
            w.put_parent(x, 0, page_digest(page(0)))

    del pdigests
    data = write_image(build, parent=link, name=name, inherit_digests=inherit)
    RAW["child"] = (
        old[: 4 * PS]
        + b"".join(changed(page(k), DELTA_CHANGES[k]) for k in (4, 5, 6))
        + random_pages(10, 1)
        + old[8 * PS : 10 * PS]
        + bytes(2 * PS)
    )
    if not extra_region:
        lean = Lean.parse(data)
        _, entries = split_delta_frame(lean.records[lean.find(RecordType.DELTA_FRAME)].body)
        assert [e[0] for e in entries] == [int(EXPECTED_ENCODING[k]) for k in (4, 5, 6)], entries
    return data


def img_parent_only_child(parent: bytes) -> bytes:
    """A child with only PARENT (and STORED) pages."""

    def build(w):
        r = w.add_region("ram", 12 * PS, guest_phys_base=0)
        old = parent_pages()
        w.put_parent(r, 0, b"".join(page_digest(old[k * PS : (k + 1) * PS]) for k in range(10)))
        w.put_pages(r, 10, random_pages(11, 1))
        w.put_free(r, 11)

    RAW["child-parent-only"] = parent_pages() + random_pages(11, 1) + bytes(PS)
    return write_image(
        build,
        parent=ParentLink(fixed_uuid("parent"), footer_digest(parent)),
        name="child-parent-only",
        allow_delta=False,
    )


def img_uniform() -> bytes:
    """Four identical STORED pages in two frames of two, two DIGESTS-able pages: shifting
    ordinals or digest positions changes no page content."""
    page = random_pages(12, 1)

    def build(w):
        r = w.add_region("ram", 4 * PS)
        for k in (0, 1, 2, 3):
            w.put_pages(r, k, page)

    RAW["uniform"] = page * 4
    return write_image(build, name="uniform", frame_pages=2)


def img_two_regions() -> bytes:
    def build(w):
        a = w.add_region("ram0", 2 * PS)
        b = w.add_region("ram1", 2 * PS)
        w.put_pages(a, 0, random_pages(13, 1))
        w.put_zero(a, 1)
        w.put_pages(b, 0, random_pages(14, 1))
        w.put_free(b, 1)

    RAW["two-regions"] = random_pages(13, 1) + bytes(PS) + random_pages(14, 1) + bytes(PS)
    return write_image(build, name="two-regions")


def split_digests(data: bytes, sizes: list[int]) -> bytes:
    """The image with its (single) DIGESTS record of region 0 split into records of ``sizes`` pages."""
    lean = Lean.parse(data)
    i = lean.find(RecordType.DIGESTS)
    rid, n, first, pages = DIGESTS_BODY.struct.unpack_from(lean.records[i].body)
    assert first == 0 and pages == sum(sizes) and lean.count(RecordType.DIGESTS) == 1
    digests = lean.records[i].body[24:]
    bearing = [c in DIGEST_BEARING for c in page_classes(lean, rid)]
    records, page, rank = [], 0, 0
    for size in sizes:
        k = sum(bearing[page : page + size])
        records.append(
            Rec(
                RecordType.DIGESTS, digests_body(rid, page, size, digests[16 * rank : 16 * (rank + k)]), rid, page, size
            )
        )
        page, rank = page + size, rank + k
    assert rank == n
    lean.records[i : i + 1] = records
    return lean.build()


def with_optional_record(data: bytes) -> bytes:
    lean = Lean.parse(data)
    at = lean.find(RecordType.PAGE_MAP)
    lean.records.insert(at, Rec(0x8000_7777, b"future optional record: readers skip me\x00\x01\x02"))
    return lean.build()


# --- the vectors ------------------------------------------------------------------------
class Vectors:
    def __init__(self, outdir: Path):
        self.outdir = outdir
        self.meta: dict[str, dict] = {}

    def _write(self, rel: str, data: bytes) -> None:
        path = self.outdir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def valid(self, name: str, data: bytes, description: str, *, raw: bytes, disks=None, parents=()) -> None:
        """``raw`` is the expected raw restore, known from the content fed (not from a reader)."""
        rel = f"valid/{name}.lean"
        self._write(rel, data)
        self.meta[rel] = dict(
            kind="valid",
            description=description,
            disks=dict(disks or {}),
            parents=list(parents),
            raw_sha256=hashlib.sha256(raw).hexdigest(),
            raw_size=len(raw),
        )

    def invalid(self, name: str, rule: str, data: bytes, description: str, *, disks=None, parents=(), also=()) -> None:
        rel = f"invalid/{name}.lean"
        self._write(rel, data)
        self.meta[rel] = dict(
            kind="invalid",
            rule=rule,
            description=description,
            disks=dict(disks or {}),
            parents=list(parents),
            also_reported=sorted(also),
        )

    def support(self, rel: str, data: bytes, description: str) -> None:
        self._write(rel, data)
        self.meta[rel] = dict(kind="support", description=description)

    def finish(self) -> None:
        doc = dict(
            format="lean image v1.1 (1.0 vectors included)",
            note="paths are relative to this file; disks maps disk name -> path (--disk NAME=PATH), "
            "parents lists --parent paths; an invalid vector must be reported with 'rule' "
            "(validators may also report the rules in 'also_reported', nothing else)",
            vectors=dict(sorted(self.meta.items())),
        )
        (self.outdir / "vectors.json").write_text(json.dumps(doc, indent=2, sort_keys=False) + "\n")


INHERITED_DIGESTS = 1 << 3  # incompatible feature bit of format 1.1


def img_grandchild(child: bytes, child_raw: bytes, *, name: str) -> bytes:
    """A format 1.1 child of ``child`` (the page contents ``child_raw``): PARENT pages whose digest
    lies one or two links down, a DELTA over the child's DELTA page 4 (two deltas to apply), a
    DELTA over a PARENT page, a new STORED page over the child's ZERO page, the FREE page kept FREE."""
    old = [child_raw[k * PS : (k + 1) * PS] for k in range(12)]

    def build(w):
        r = w.add_region("ram", 12 * PS, guest_phys_base=0)
        w.put_parent(r, 0, bytes(16 * 4))  # digests given, not stored: 1.1 inherits them
        assert w.put_changed(r, 4, old[4], changed(old[4], [1, 2])) == PageClass.DELTA
        w.put_parent(r, 5, bytes(16 * 3))
        assert w.put_changed(r, 8, old[8], changed(old[8], [100])) == PageClass.DELTA
        w.put_parent(r, 9, bytes(16))
        w.put_pages(r, 10, random_pages(12, 1))
        w.put_free(r, 11)

    RAW[name] = (
        b"".join(old[:4])
        + changed(old[4], [1, 2])
        + b"".join(old[5:8])
        + changed(old[8], [100])
        + old[9]
        + random_pages(12, 1)
        + bytes(PS)
    )
    return write_image(
        build,
        parent=ParentLink(fixed_uuid(name.replace("grand", "")), footer_digest(child)),
        name=name,
        inherit_digests=True,
    )


def img_parent_over_free(parent: bytes) -> bytes:
    """A format 1.1 child whose every page is PARENT, page 11 over parent.lean's FREE page."""

    def build(w):
        w.put_parent(w.add_region("ram", 12 * PS, guest_phys_base=0), 0, bytes(16 * 12))

    return write_image(
        build,
        parent=ParentLink(fixed_uuid("parent"), footer_digest(parent)),
        name="chn-006",
        inherit_digests=True,
        allow_delta=False,
    )


def generate(outdir: Path) -> None:
    outdir = Path(outdir)
    for sub in ("valid", "invalid"):
        if (outdir / sub).exists():
            shutil.rmtree(outdir / sub)
    v = Vectors(outdir)

    basic = img_basic()
    multi = img_multi_region()
    p8k = img_page_size_8192()
    source = img_source_state()
    disk = img_disk()
    disk_extra = img_disk(extra_disk=True)
    parent = img_parent()
    child = img_child(parent)
    child_po = img_parent_only_child(parent)
    child11 = img_child(parent, name="child11", inherit=True)
    grandchild11 = img_grandchild(child11, RAW["child"], name="grandchild11")
    grandchild_mixed = img_grandchild(child, RAW["child"], name="grandchild")
    uniform = img_uniform()
    two = img_two_regions()
    optional = with_optional_record(basic)

    # ---- valid -------------------------------------------------------------------------
    v.support("valid/disk0.raw", disk0_bytes(), "16 KiB raw disk 'disk0' for the DISK-page vectors")
    v.valid(
        "basic",
        basic,
        "one region with GPA: STORED, ZERO (fed and put_zero) and FREE pages; one SOURCE_STATE record",
        raw=RAW["basic"],
    )
    v.valid(
        "multi-region",
        multi,
        "three regions (vga.vram without GPA), pages fed interleaved and out of order, frames of 2 pages",
        raw=RAW["multi-region"],
    )
    v.valid("page-size-8192", p8k, "page_size 8192: STORED, ZERO, FREE", raw=RAW["page-size-8192"])
    v.valid(
        "source-state",
        source,
        "three SOURCE_STATE records (QEMU, QEMU, Xen with empty data), SOURCE_STATE compat bit",
        raw=RAW["source-state"],
    )
    v.valid(
        "source-state-private",
        img_source_state_private(),
        "two SOURCE_STATE records of private-use "
        "source_formats 0xb5a17e00 and 0xffffffff (a writer plugin's own, spec §5.4)",
        raw=RAW["source-state-private"],
    )
    v.valid(
        "disk", disk, "two DISK pages on disk0 (sectors 8 and 1)", disks={"disk0": "valid/disk0.raw"}, raw=RAW["disk"]
    )
    v.valid(
        "disk-unused-entry",
        disk_extra,
        "DISK pages on disk0 and a second, unreferenced disk table entry",
        disks={"disk0": "valid/disk0.raw"},
        raw=RAW["disk"],
    )
    v.valid("parent", parent, "parent image for the chain vectors: STORED, ZERO, FREE", raw=RAW["parent"])
    v.valid(
        "child-delta",
        child,
        "child of parent.lean: PARENT pages, DELTA pages in encodings INDEX_LIST "
        "(page 4), BITMAP (page 5) and RUNS (page 6), a rewritten STORED page",
        parents=["valid/parent.lean"],
        raw=RAW["child"],
    )
    v.valid(
        "child-parent-only",
        child_po,
        "child of parent.lean with PARENT and STORED pages, no DELTA bit",
        parents=["valid/parent.lean"],
        raw=RAW["child-parent-only"],
    )
    v.valid(
        "v11-child-delta",
        child11,
        "format 1.1 (INHERITED_DIGESTS, minor_version 1) child of parent.lean "
        "with the pages of child-delta: PARENT pages have no stored digest, DIGESTS hold the STORED and "
        "DELTA pages' only",
        parents=["valid/parent.lean"],
        raw=RAW["child"],
    )
    v.valid(
        "v11-grandchild",
        grandchild11,
        "format 1.1 child of v11-child-delta: inherited digests found two "
        "links down (pages 0-3, 9), a DELTA over a DELTA, a DELTA over an inherited PARENT page",
        parents=["valid/v11-child-delta.lean", "valid/parent.lean"],
        raw=RAW["grandchild11"],
    )
    v.valid(
        "v11-over-1.0",
        grandchild_mixed,
        "format 1.1 child of the 1.0 child-delta: a PARENT page's digest is the 1.0 link's stored one",
        parents=["valid/child-delta.lean", "valid/parent.lean"],
        raw=RAW["grandchild"],
    )
    v.valid(
        "optional-record",
        optional,
        "basic.lean plus an unknown OPTIONAL record type 0x80007777 "
        "(hand-spliced, index and footer recomputed): readers skip it",
        raw=RAW["basic"],
    )
    lean = Lean.parse(basic)
    lean.header[12:16] = struct.pack("<I", 112)
    lean.header += bytes(8)
    v.valid(
        "header-extended",
        lean.build(),
        "basic.lean with header_length 112 (8 zero bytes past the v1.0 "
        "header: a zero field means the same as an absent one)",
        raw=RAW["basic"],
    )
    v.valid(
        "minor-version-1",
        Lean.parse(basic).set_header("H", 10, 1).build(),
        "basic.lean with minor_version 1: readers accept any minor of major 1",
        raw=RAW["basic"],
    )
    v.valid(
        "unknown-compat-bits",
        Lean.parse(basic).set_header("Q", 24, 1 | 1 << 40).set_header("Q", 32, 1 << 5).build(),
        "basic.lean with an unknown compatible and an unknown autoclear feature bit: ignored",
        raw=RAW["basic"],
    )
    v.valid("uniform", uniform, "four identical STORED pages in two frames", raw=RAW["uniform"])
    v.valid("two-regions", two, "two regions ram0/ram1 with STORED, ZERO and FREE pages", raw=RAW["two-regions"])
    v.valid(
        "digests-split",
        split_digests(basic, [3, 1, 6, 2]),
        "basic.lean with its DIGESTS record split in four covering pages 0-2 (3 STORED: num_digests 3), "
        "3 (ZERO: num_digests 0), 4-9 (4 STORED, 2 ZERO: num_digests 4) and 10-11 (FREE: num_digests 0); "
        "a page's digest is found by its rank",
        raw=RAW["basic"],
    )

    # ---- invalid: header ------------------------------------------------------------------
    L = Lean.parse
    bad = bytearray(basic)
    bad[1] ^= 0x20
    v.invalid("hdr-001-magic", "LI-HDR-001", bytes(bad), "header magic 89 6C 45 41 ... (one bit flipped)")
    v.invalid(
        "hdr-002-major", "LI-HDR-002", L(basic).set_header("H", 8, 2).build(), "major_version 2 (header checksum fixed)"
    )
    v.invalid(
        "hdr-003-length-unaligned",
        "LI-HDR-003",
        L(basic).set_header("I", 12, 108).build(),
        "header_length 108, not a multiple of 8 (header checksum fixed)",
    )
    v.invalid(
        "hdr-003-length-big",
        "LI-HDR-003",
        L(basic).set_header("I", 12, 8192).build(),
        "header_length 8192 > 4096 (header checksum fixed)",
    )
    v.invalid(
        "hdr-004-checksum",
        "LI-HDR-004",
        L(basic).set_header("Q", 96, 0x1234).build(fix_header=False),
        "header_checksum wrong",
    )
    v.invalid(
        "hdr-005-incompat",
        "LI-HDR-005",
        L(basic).set_header("Q", 16, 1 << 9).build(),
        "unknown incompatible feature bit 9 set (header checksum fixed)",
    )
    v.invalid(
        "hdr-006-page-size",
        "LI-HDR-006",
        L(basic).set_header("I", 88, 2048).build(),
        "page_size 2048 (header checksum fixed)",
    )
    v.invalid(
        "hdr-006-page-size-not-pow2",
        "LI-HDR-006",
        L(basic).set_header("I", 88, 12288).build(),
        "page_size 12288, not a power of two (header checksum fixed)",
    )
    v.invalid(
        "hdr-007-reserved",
        "LI-HDR-007",
        L(basic).set_header("I", 92, 1).build(),
        "reserved header field (offset 92) = 1 (header checksum fixed)",
    )
    lean = L(basic)
    lean.header[12:16] = struct.pack("<I", 112)
    lean.header += b"\x01" + bytes(7)
    v.invalid(
        "hdr-007-tail",
        "LI-HDR-007",
        lean.build(),
        "header_length 112 with a non-zero byte past the v1.0 header (header checksum fixed)",
    )
    v.invalid(
        "hdr-008-uuid-only",
        "LI-HDR-008",
        L(basic).set_header("16s", 56, fixed_uuid("nobody")).build(),
        "parent_uuid set, parent_digest zero, PARENT bit clear (header checksum fixed)",
    )
    v.invalid(
        "hdr-008-bit-only",
        "LI-HDR-008",
        L(basic).set_header("Q", 16, 1).build(),
        "PARENT incompatible bit set without parent_uuid/parent_digest (header checksum fixed)",
    )
    v.invalid(
        "hdr-009-disk-bit",
        "LI-HDR-009",
        L(disk).set_header("Q", 16, 0).build(),
        "DISK pages, DISK incompatible bit clear (header checksum fixed)",
    )
    v.invalid(
        "hdr-010-inherited-no-parent",
        "LI-HDR-010",
        L(basic).set_header("H", 10, 1).set_header("Q", 16, INHERITED_DIGESTS).build(),
        "basic.lean (no parent) with the INHERITED_DIGESTS incompatible bit and minor_version 1",
    )
    v.invalid(
        "hdr-009-delta-bit",
        "LI-HDR-009",
        L(child).set_header("Q", 16, 1).build(),
        "DELTA pages, DELTA incompatible bit clear (header checksum fixed)",
    )

    # ---- invalid: records -------------------------------------------------------------------
    rec2 = Lean.parse(basic)
    body = bytearray(rec2.header)
    body[96:104] = bytes(8)
    body[96:104] = struct.pack("<Q", checksum64(bytes(body)))
    entries = []
    for k, r in enumerate(rec2.records):
        if k == 2:
            body += bytes(8)
        entries.append((len(body), r.type, r.key, r.first, r.count))
        body += r.serialize()
    index_offset = len(body)
    body += Rec(
        RecordType.INDEX,
        INDEX_BODY.struct.pack(len(entries), 0) + b"".join(INDEX_ENTRY.struct.pack(*e) for e in entries),
    ).serialize()
    head = FOOTER.struct.pack(FOOTER_MAGIC, index_offset, len(body) + 48, xxhash.xxh3_128_digest(bytes(body)), 0)
    v.invalid(
        "rec-001-gap",
        "LI-REC-001",
        bytes(body) + head[:40] + struct.pack("<Q", checksum64(head[:40])),
        "8 zero bytes between records 1 and 2 (index offsets, digest, footer fixed)",
        also=["LI-REC-002", "LI-REC-003", "LI-IDX-001"],
    )

    lean = L(basic)
    data = lean.build()
    index_offset = struct.unpack_from("<Q", data, len(data) - 40)[0]
    bad = bytearray(data[:-48])
    struct.pack_into("<Q", bad, index_offset + 8, len(data))  # INDEX body_length runs past the footer
    head = FOOTER.struct.pack(FOOTER_MAGIC, index_offset, len(data), xxhash.xxh3_128_digest(bytes(bad)), 0)
    v.invalid(
        "rec-002-past-footer",
        "LI-REC-002",
        bytes(bad) + head[:40] + struct.pack("<Q", checksum64(head[:40])),
        "INDEX body_length runs past the footer (digest and footer fixed)",
        also=["LI-IDX-001"],
    )

    lean = L(basic)
    lean.records[lean.find(RecordType.SOURCE_STATE)].checksum = 0xDEADBEEF
    v.invalid("rec-003-checksum", "LI-REC-003", lean.build(), "SOURCE_STATE record_checksum wrong", also=["LI-IDX-001"])
    lean = L(basic)
    lean.records[lean.find(RecordType.SOURCE_STATE)].padding = b"\x00\x01"
    v.invalid(
        "rec-004-padding",
        "LI-REC-004",
        lean.build(),
        "SOURCE_STATE padding byte non-zero (record checksum fixed)",
        also=["LI-IDX-001"],
    )
    lean = L(basic)
    lean.records[lean.find(RecordType.SOURCE_STATE)].flags = 1
    v.invalid(
        "rec-005-flags", "LI-REC-005", lean.build(), "SOURCE_STATE record flags 1 (checksum fixed)", also=["LI-IDX-001"]
    )
    lean = L(basic)
    lean.records.insert(lean.find(RecordType.PAGE_MAP), Rec(0x0000_0077, b"mandatory future record"))
    v.invalid(
        "rec-006-unknown-mandatory",
        "LI-REC-006",
        lean.build(),
        "unknown mandatory record type 0x77 (listed in the index)",
        also=["LI-IDX-001"],
    )
    lean = L(basic)
    i = lean.find(RecordType.SOURCE_STATE)
    rewrite_body(lean, i, lambda b: b[:12])
    v.invalid(
        "rec-007-short-body",
        "LI-REC-007",
        lean.build(),
        "SOURCE_STATE body of 12 bytes, shorter than its 16-byte structure",
        also=["LI-IDX-001"],
    )
    lean = L(basic)
    i = lean.find(RecordType.REGION)
    rewrite_body(lean, i, lambda b: patch(b, 24, "I", 5))
    v.invalid(
        "rec-007-region-length",
        "LI-REC-007",
        lean.build(),
        "REGION name_length 5 with a 6-byte name (body_length mismatch)",
        also=["LI-IDX-001", "LI-REC-009", "LI-MAP-004"],
    )
    lean = L(basic)
    i = lean.find(RecordType.PAGE_FRAME)
    rewrite_body(lean, i, lambda b: patch(b, 12, "I", 1))
    v.invalid(
        "rec-008-frame-reserved",
        "LI-REC-008",
        lean.build(),
        "PAGE_FRAME reserved field 1 (record checksum fixed, index valid)",
        also=["LI-IDX-001", "LI-MAP-004"],
    )
    lean = L(child)
    i = lean.find(RecordType.DELTA_FRAME)
    first, entries = split_delta_frame(lean.records[i].body)
    entries[0] = entries[0][:1] + b"\x01" + entries[0][2:]
    rewrite_body(lean, i, lambda b: delta_frame_body(first, entries))
    v.invalid(
        "rec-008-delta-entry-reserved",
        "LI-REC-008",
        lean.build(),
        "DELTA entry 0 reserved byte 1 (frame recompressed, checksums fixed)",
    )
    lean = L(basic)
    i = lean.find(RecordType.PAGE_MAP)
    rewrite_body(lean, i, lambda b: page_map_body(0, [e[:3] + [7] + e[4:] for e in extents_of(b)]))
    v.invalid(
        "rec-008-extent-reserved",
        "LI-REC-008",
        lean.build(),
        "PAGE_MAP extent reserved field 7",
        also=["LI-IDX-001", "LI-MAP-001", "LI-MAP-004"],
    )
    lean = L(multi)
    i = lean.find(RecordType.REGION, 1)
    rec = lean.records.pop(i)
    lean.records.append(rec)
    v.invalid(
        "rec-009-region-late",
        "LI-REC-009",
        lean.build(),
        "REGION vga.vram after its PAGE_MAP and DIGESTS records (index follows file order)",
    )

    # ---- invalid: regions and disks -------------------------------------------------------
    lean = L(two)
    rewrite_body(lean, lean.find(RecordType.REGION, 1), lambda b: b[:-1] + b"0")
    v.invalid("reg-001-duplicate-name", "LI-REG-001", lean.build(), "two regions named ram0")
    lean = L(basic)
    rewrite_body(lean, lean.find(RecordType.REGION), lambda b: patch(b, 16, "Q", 12 * PS + 512))
    v.invalid("reg-002-size", "LI-REG-002", lean.build(), "region size_bytes 12 pages + 512 bytes")
    lean = L(multi)
    rewrite_body(lean, lean.find(RecordType.REGION, 1), lambda b: patch(b, 8, "Q", 0xA0000))
    v.invalid(
        "reg-003-gpa-without-flag", "LI-REG-003", lean.build(), "region without HAS_GPA has guest_phys_base 0xA0000"
    )
    lean = L(basic)
    rewrite_body(lean, lean.find(RecordType.REGION), lambda b: patch(b, 4, "I", 3))
    v.invalid("reg-003-flags", "LI-REG-003", lean.build(), "region flags 0x3 (bit 1 undefined)")
    lean = L(disk_extra)
    rewrite_body(lean, lean.find(RecordType.DISK, 1), lambda b: b[:-1] + b"0")
    v.invalid("dsk-001-duplicate-name", "LI-DSK-001", lean.build(), "two disks named disk0")
    lean = L(disk)
    rewrite_body(lean, lean.find(RecordType.DISK), lambda b: patch(b, 16, "I", 4096))
    v.invalid("dsk-002-sector-size", "LI-DSK-002", lean.build(), "disk sector_size 4096")
    lean = L(disk)
    rewrite_body(lean, lean.find(RecordType.DISK), lambda b: patch(b, 20, "I", 2))
    v.invalid("dsk-002-fingerprint-method", "LI-DSK-002", lean.build(), "disk fingerprint_method 2")
    lean = L(disk)
    rewrite_body(lean, lean.find(RecordType.DISK_REFS), lambda b: patch(b, 16 + 16 + 8, "Q", 25))
    v.invalid(
        "dsk-003-past-end",
        "LI-DSK-003",
        lean.build(),
        "disk reference 1 at sector 25: the page runs past the 16 KiB disk",
    )
    lean = L(disk)
    rewrite_body(lean, lean.find(RecordType.DISK_REFS), lambda b: patch(b, 16, "I", 9))
    v.invalid(
        "dsk-003-no-disk",
        "LI-DSK-003",
        lean.build(),
        "disk reference 0 names disk_id 9 (no such disk)",
        also=["LI-REC-009"],
    )
    lean = L(disk)
    rewrite_body(lean, lean.find(RecordType.DISK), lambda b: b[:24] + bytes(16) + b[40:])
    v.invalid(
        "dsk-004-fingerprint",
        "LI-DSK-004",
        lean.build(),
        "disk table fingerprint of disk0 zeroed: the supplied valid/disk0.raw does not match",
        disks={"disk0": "valid/disk0.raw"},
    )
    lean = L(disk)
    rewrite_body(lean, lean.find(RecordType.DISK), lambda b: patch(b, 8, "Q", DISK_SIZE * 2))
    lean.records[lean.find(RecordType.DISK)].count = DISK_SIZE * 2 // 512
    v.invalid(
        "dsk-004-size",
        "LI-DSK-004",
        lean.build(),
        "disk table size of disk0 32 KiB: the supplied 16 KiB valid/disk0.raw does not match",
        disks={"disk0": "valid/disk0.raw"},
    )
    lean = L(disk)
    i = lean.find(RecordType.DIGESTS)
    k = digest_rank(lean, 0, 1, PageClass.DISK)
    rewrite_body(lean, i, lambda b: b[: 24 + 16 * k] + bytes(range(16)) + b[24 + 16 * (k + 1) :])
    v.invalid(
        "dsk-005-digest",
        "LI-DSK-005",
        lean.build(),
        "digest of DISK page 1 altered: disk0 at sector 8 does not have it (needs --disk)",
        disks={"disk0": "valid/disk0.raw"},
    )

    # ---- invalid: page maps ---------------------------------------------------------------------
    lean = L(basic)
    i = lean.find(RecordType.PAGE_MAP)

    def gap_map(b):
        ext = extents_of(b)
        ext[-1][0] += 1  # the last extent starts one page late (a gap) and ends one page
        return page_map_body(0, ext)

    rewrite_body(lean, i, gap_map)
    lean.records[i].first = 0
    v.invalid(
        "map-001-gap",
        "LI-MAP-001",
        lean.build(),
        "the last (FREE) extent starts one page after the previous one ends and runs one page past "
        "the region end (page count unchanged)",
    )
    lean = L(basic)
    i = lean.find(RecordType.PAGE_MAP)
    rewrite_body(
        lean,
        i,
        lambda b: page_map_body(0, [e if e[2] != PageClass.ZERO else e[:2] + [7] + e[3:] for e in extents_of(b)]),
    )
    v.invalid("map-002-class", "LI-MAP-002", lean.build(), "a ZERO extent changed to page_class 7")
    lean = L(basic)
    i = lean.find(RecordType.PAGE_MAP)
    rewrite_body(
        lean, i, lambda b: page_map_body(0, [e if e[2] != PageClass.FREE else e[:4] + [3] for e in extents_of(b)])
    )
    v.invalid("map-003-slot", "LI-MAP-003", lean.build(), "FREE extent with first_slot 3")
    lean = L(uniform)
    i = lean.find(RecordType.PAGE_MAP)
    rewrite_body(lean, i, lambda b: page_map_body(0, [[0, 1, 1, 0, 0], [1, 3, 1, 0, 0]]))
    v.invalid(
        "map-004-ordinal-twice",
        "LI-MAP-004",
        lean.build(),
        "stored ordinal 0 used by pages 0 and 1, ordinal 3 unused (pages identical, digests hold)",
    )
    v.invalid(
        "map-005-parent-pages",
        "LI-MAP-005",
        L(child_po).set_header("Q", 16, 0).set_header("16s", 56, bytes(16)).set_header("16s", 72, bytes(16)).build(),
        "PARENT pages in an image whose header names no parent",
    )

    # ---- invalid: frames ------------------------------------------------------------------------
    lean = L(uniform)
    i = lean.find(RecordType.PAGE_FRAME, 1)
    rewrite_body(lean, i, lambda b: patch(b, 0, "Q", 3))
    lean.records[i].first = 3
    v.invalid(
        "frm-001-numbering",
        "LI-FRM-001",
        lean.build(),
        "second PAGE_FRAME first_ordinal 3 instead of 2 (index follows)",
        also=["LI-MAP-004"],
    )
    lean = L(basic)
    i = lean.find(RecordType.PAGE_FRAME)
    rewrite_body(lean, i, lambda b: b[:16] + b"\x29\xb5\x2f\xfe" + b[20:])
    v.invalid("frm-002-magic", "LI-FRM-002", lean.build(), "PAGE_FRAME zstd magic damaged")
    lean = L(basic)
    i = lean.find(RecordType.PAGE_FRAME)
    rewrite_body(lean, i, lambda b: b + compress(b"\x00" * 16))
    v.invalid("frm-002-two-frames", "LI-FRM-002", lean.build(), "PAGE_FRAME body holds a second zstd frame")
    lean = L(basic)
    i = lean.find(RecordType.PAGE_FRAME)
    content = zstandard.ZstdDecompressor().decompress(lean.records[i].body[16:])
    rewrite_body(lean, i, lambda b: b[:16] + compress(content, content_size=False))
    v.invalid("frm-003-no-content-size", "LI-FRM-003", lean.build(), "PAGE_FRAME zstd frame without Frame_Content_Size")
    lean = L(basic)
    i = lean.find(RecordType.PAGE_FRAME)
    rewrite_body(lean, i, lambda b: b[:16] + compress(content + bytes(PS)))
    v.invalid(
        "frm-003-content-size",
        "LI-FRM-003",
        lean.build(),
        "PAGE_FRAME of 7 pages whose zstd frame declares 8 pages of content",
    )
    lean = L(basic)
    n = lean.count(RecordType.PAGE_FRAME)
    last = lean.find(RecordType.PAGE_FRAME, n - 1)
    total = lean.records[last].first + lean.records[last].count
    lean.records.insert(
        last + 1, Rec(RecordType.PAGE_FRAME, PAGE_FRAME_BODY.struct.pack(total, 0, 0) + compress(b""), NO_KEY, total, 0)
    )
    v.invalid("frm-004-empty", "LI-FRM-004", lean.build(), "a PAGE_FRAME with num_pages 0 (empty zstd frame)")

    # ---- invalid: delta entries --------------------------------------------------------------------
    def child_delta(fn, **kw):
        lean = L(child)
        i = lean.find(RecordType.DELTA_FRAME)
        first, entries = split_delta_frame(lean.records[i].body)
        rewrite_body(lean, i, lambda b: fn(first, entries))
        return lean.build()

    def swap_offsets(first, entries):
        offs = [0, len(entries[0]), len(entries[0]) + len(entries[1]), sum(map(len, entries))]
        offs[1], offs[2] = offs[2], offs[1]
        return delta_frame_body(first, entries, offs)

    v.invalid(
        "dlt-001-decreasing",
        "LI-DLT-001",
        child_delta(swap_offsets),
        "DELTA_FRAME entry_offsets not monotonic (offsets[1] > offsets[2])",
        also=["LI-DLT-002"],
    )

    def end_mismatch(first, entries):
        offs = [0]
        for e in entries:
            offs.append(offs[-1] + len(e))
        return delta_frame_body(first, entries, offs, frame_content=b"".join(entries) + bytes(8))

    v.invalid(
        "dlt-001-end",
        "LI-DLT-001",
        child_delta(end_mismatch),
        "DELTA_FRAME entry_offsets end 8 bytes before the decompressed size",
        also=["LI-FRM-003"],
    )

    def bad_encoding(first, entries):
        entries = list(entries)
        entries[0] = b"\x04" + entries[0][1:]
        return delta_frame_body(first, entries)

    v.invalid("dlt-002-encoding", "LI-DLT-002", child_delta(bad_encoding), "DELTA entry 0 with encoding 4")

    def bad_length(first, entries):
        entries = list(entries)
        entries[0] = entries[0] + bytes(8)
        return delta_frame_body(first, entries)

    v.invalid(
        "dlt-002-length",
        "LI-DLT-002",
        child_delta(bad_length),
        "INDEX_LIST entry 8 bytes longer than its word count gives",
    )

    def unsorted(first, entries):
        entries = list(entries)
        e = bytearray(entries[0])
        e[4:6], e[6:8] = e[6:8], e[4:6]  # swap the first two word indexes
        entries[0] = bytes(e)
        return delta_frame_body(first, entries)

    v.invalid(
        "dlt-003-unsorted",
        "LI-DLT-003",
        child_delta(unsorted),
        "INDEX_LIST word indexes not ascending (first two swapped)",
    )

    def out_of_page(first, entries):
        entries = list(entries)
        e = bytearray(entries[0])
        struct.pack_into("<H", e, 4 + 2 * 2, 600)  # last index 600 >= 512
        entries[0] = bytes(e)
        return delta_frame_body(first, entries)

    v.invalid("dlt-003-out-of-page", "LI-DLT-003", child_delta(out_of_page), "INDEX_LIST word index 600 >= page_size/8")

    def touching_runs(first, entries):
        entries = list(entries)
        e = bytearray(entries[2])
        # runs (10,60) (200,60) -> (10,60) (70,60): touching
        struct.pack_into("<H", e, 4 + 2 + 4, 70)
        entries[2] = bytes(e)
        return delta_frame_body(first, entries)

    v.invalid(
        "dlt-003-touching-runs",
        "LI-DLT-003",
        child_delta(touching_runs),
        "RUNS entry whose second run starts where the first ends",
    )

    def too_big(first, entries):
        entries = list(entries)
        n = 504
        bits = np.zeros(512, bool)
        bits[:n] = True
        entries[1] = DELTA_ENTRY.struct.pack(2, 0, n) + np.packbits(bits, bitorder="little").tobytes() + bytes(8 * n)
        return delta_frame_body(first, entries)

    v.invalid(
        "dlt-004-too-big", "LI-DLT-004", child_delta(too_big), "BITMAP entry of 504 words: 4100 bytes >= page_size"
    )

    # ---- invalid: digests ----------------------------------------------------------------------------
    lean = L(uniform)
    i = lean.find(RecordType.DIGESTS)
    b = lean.records[i].body
    rid, n, first, pages = DIGESTS_BODY.struct.unpack_from(b)
    assert (n, first, pages) == (4, 0, 4)
    d = b[24:]
    lean.records[i] = Rec(RecordType.DIGESTS, digests_body(rid, 2, 2, d[32:]), rid, 2, 2)
    lean.records.insert(i + 1, Rec(RecordType.DIGESTS, digests_body(rid, 0, 2, d[:32]), rid, 0, 2))
    v.invalid(
        "dig-001-order",
        "LI-DIG-001",
        lean.build(),
        "region digests split in two DIGESTS records given in the wrong order (pages 2-3, then 0-1)",
    )
    lean = L(uniform)
    i = lean.find(RecordType.DIGESTS)
    rewrite_body(lean, i, lambda b: digests_body(rid, 0, 3, b[24 : 24 + 48]))
    lean.records[i].count = 3
    v.invalid(
        "dig-001-short",
        "LI-DIG-001",
        lean.build(),
        "DIGESTS record covering 3 of 4 pages (num_digests 3, consistent with the range)",
    )
    lean = L(basic)
    i = lean.find(RecordType.DIGESTS)
    k = digest_rank(lean, 0, 0, PageClass.STORED)
    rewrite_body(lean, i, lambda b: b[: 24 + 16 * k] + bytes([b[24 + 16 * k] ^ 1]) + b[24 + 16 * k + 1 :])
    v.invalid("dig-002-stored", "LI-DIG-002", lean.build(), "digest of STORED page 0 altered")
    lean = L(basic)
    k = digest_rank(lean, 0, 5, PageClass.STORED)
    rewrite_body(
        lean,
        i,
        lambda b: (
            b[: 24 + 16 * k]
            + b[24 + 16 * (k + 1) : 24 + 16 * (k + 2)]
            + b[24 + 16 * k : 24 + 16 * (k + 1)]
            + b[24 + 16 * (k + 2) :]
        ),
    )
    v.invalid(
        "dig-002-swapped",
        "LI-DIG-002",
        lean.build(),
        "digests of STORED pages 5 and 6 swapped (each page's digest is another page's)",
    )
    lean = L(child)
    i = lean.find(RecordType.DIGESTS)
    k = digest_rank(lean, 0, 2, PageClass.PARENT)
    rewrite_body(lean, i, lambda b: b[: 24 + 16 * k] + bytes(range(16)) + b[24 + 16 * (k + 1) :])
    v.invalid(
        "dig-002-parent",
        "LI-DIG-002",
        lean.build(),
        "digest of PARENT page 2 of child-delta altered: parent.lean's page 2 does not have it (needs --parent)",
        parents=["valid/parent.lean"],
    )
    lean = L(child)
    k = digest_rank(lean, 0, 5, PageClass.DELTA)
    rewrite_body(
        lean, i, lambda b: b[: 24 + 16 * k] + page_digest(parent_pages()[5 * PS : 6 * PS]) + b[24 + 16 * (k + 1) :]
    )
    v.invalid(
        "dig-002-delta",
        "LI-DIG-002",
        lean.build(),
        "digest of DELTA page 5 of child-delta replaced by the parent page's digest: the delta "
        "applied to parent.lean's page 5 does not have it (needs --parent)",
        parents=["valid/parent.lean"],
    )
    lean = L(basic)
    i = lean.find(RecordType.DIGESTS)
    k = digest_rank(lean, 0, 3, PageClass.ZERO)
    rewrite_body(
        lean, i, lambda b: digests_body(rid, 0, 12, b[24 : 24 + 16 * k] + page_digest(bytes(PS)) + b[24 + 16 * k :])
    )
    v.invalid(
        "dig-003-zero-page-digest",
        "LI-DIG-003",
        lean.build(),
        "a digest stored for ZERO page 3 (num_digests 8 and body_length agree) where pages 0-11 "
        "have 7 STORED pages; ZERO pages have no stored digest",
    )
    lean = L(basic)
    i = lean.find(RecordType.DIGESTS)
    d = lean.records[i].body[24:]
    k = digest_rank(lean, 0, 7, PageClass.STORED)
    assert len(d) == 16 * (k + 1) and set(page_classes(lean, 0)[8:]) <= {PageClass.ZERO, PageClass.FREE}
    lean.records[i] = Rec(RecordType.DIGESTS, digests_body(rid, 0, 8, d[: 16 * k]), rid, 0, 8)
    lean.records.insert(i + 1, Rec(RecordType.DIGESTS, digests_body(rid, 8, 4, d[16 * k :]), rid, 8, 4))
    v.invalid(
        "dig-003-split",
        "LI-DIG-003",
        lean.build(),
        "region digests split in two DIGESTS records, pages 0-7 with num_digests 6 and pages 8-11 "
        "(ZERO and FREE only) with num_digests 1: STORED page 7's digest is in the wrong record "
        "(the region's total of 7 digests, in order, is right)",
    )

    v.invalid(
        "dig-003-v11-parent-digests",
        "LI-DIG-003",
        L(child).set_header("H", 10, 1).set_header("Q", 16, 0x5 | INHERITED_DIGESTS).build(),
        "child-delta (digests of its PARENT pages stored, as in 1.0) with INHERITED_DIGESTS set: "
        "num_digests counts the PARENT pages, which a 1.1 image does not store",
    )
    v.invalid(
        "dig-003-v10-no-parent-digests",
        "LI-DIG-003",
        L(child11).set_header("H", 10, 0).set_header("Q", 16, 0x5).build(),
        "v11-child-delta with INHERITED_DIGESTS cleared: its PARENT pages lack the stored digests a 1.0 image has",
    )

    # ---- invalid: index and footer ------------------------------------------------------------------
    lean = L(basic)
    lean.records[lean.find(RecordType.REGION)].count = 13
    v.invalid("idx-001-count", "LI-IDX-001", lean.build(), "index entry of the REGION says 13 pages, not 12")
    v.invalid(
        "idx-001-missing", "LI-IDX-001", L(basic).build(index_entries=lambda es: es[:-1]), "index lacks its last entry"
    )
    v.invalid(
        "idx-001-order",
        "LI-IDX-001",
        L(multi).build(index_entries=lambda es: [es[1], es[0]] + es[2:]),
        "first two index entries swapped",
    )
    data = basic
    bad = bytearray(data)
    bad[-48] ^= 0x01
    v.invalid("ftr-001-magic", "LI-FTR-001", bytes(bad), "footer magic damaged", also=["LI-REC-002"])
    v.invalid("ftr-001-truncated", "LI-FTR-001", data[:-48], "footer missing (image cut before it)")
    v.invalid(
        "ftr-002-checksum",
        "LI-FTR-002",
        L(basic).build(footer=dict(footer_checksum=1), fix_footer_checksum=False),
        "footer_checksum wrong",
        also=["LI-REC-002"],
    )
    v.invalid(
        "ftr-003-length",
        "LI-FTR-003",
        L(basic).build(footer=dict(file_length=len(basic) + 8)),
        "file_length 8 bytes more than the file size (footer checksum fixed)",
        also=["LI-REC-002"],
    )
    v.invalid(
        "ftr-004-digest",
        "LI-FTR-004",
        L(basic).build(footer=dict(image_digest=bytes(16))),
        "image_digest zero (footer checksum fixed)",
    )
    lean = L(basic)
    v.invalid(
        "ftr-005-index-offset",
        "LI-FTR-005",
        lean.build(footer=dict(index_offset=len(lean.header))),
        "index_offset points at the first record, not the INDEX (footer checksum fixed)",
    )

    # ---- invalid: chains (need --parent) -----------------------------------------------------------------
    v.invalid(
        "chn-001-wrong-parent",
        "LI-CHN-001",
        L(child).set_header("16s", 56, fixed_uuid("someone-else")).build(),
        "child-delta with another parent_uuid; parent.lean supplied",
        parents=["valid/parent.lean"],
    )
    v.invalid(
        "chn-002-parent-digest",
        "LI-CHN-002",
        L(child).set_header("16s", 72, bytes(range(1, 17))).build(),
        "child-delta whose parent_digest is not parent.lean's image_digest",
        parents=["valid/parent.lean"],
    )
    v.invalid(
        "chn-003-page-size",
        "LI-CHN-003",
        img_child(parent, name="chn-003", link=ParentLink(fixed_uuid("page-size-8192"), footer_digest(p8k))),
        "child (page_size 4096) of page-size-8192.lean",
        parents=["valid/page-size-8192.lean"],
    )
    v.invalid(
        "chn-004-region",
        "LI-CHN-004",
        img_child(parent, name="chn-004", extra_region=True),
        "child with PARENT pages in region 'extra', which parent.lean lacks",
        parents=["valid/parent.lean"],
    )
    a_uuid, b_uuid = fixed_uuid("cycle-a"), fixed_uuid("cycle-b")

    def cycle(name, other):
        def build(w):
            r = w.add_region("ram", PS)
            w.put_parent(r, 0, page_digest(bytes(PS)))

        return write_image(build, parent=ParentLink(other, bytes(range(16))), name=name)

    v.invalid(
        "chn-005-cycle-a",
        "LI-CHN-005",
        cycle("cycle-a", b_uuid),
        "image A whose parent is chn-005-cycle-b, whose parent is A",
        parents=["invalid/chn-005-cycle-b.lean"],
    )
    v.invalid(
        "chn-005-cycle-b",
        "LI-CHN-005",
        cycle("cycle-b", a_uuid),
        "image B whose parent is chn-005-cycle-a, whose parent is B",
        parents=["invalid/chn-005-cycle-a.lean"],
    )
    v.invalid(
        "chn-006-parent-over-free",
        "LI-CHN-006",
        img_parent_over_free(parent),
        "format 1.1 child of parent.lean, all pages PARENT: page 11 is FREE in parent.lean, so it has "
        "no digest to inherit",
        parents=["valid/parent.lean"],
    )
    v.invalid(
        "chn-001-missing-parent",
        "LI-CHN-001",
        child,
        "child-delta validated with only an unrelated candidate parent",
        parents=["valid/basic.lean"],
    )

    # ---- invalid: source state -------------------------------------------------------------------------
    lean = L(source)
    i = lean.find(RecordType.SOURCE_STATE, 1)
    rewrite_body(lean, i, lambda b: patch(b, 8, "Q", 2))
    lean.records[i].first = 2
    v.invalid("src-001-sequence", "LI-SRC-001", lean.build(), "SOURCE_STATE sequences 0, 2, 2")
    lean = L(source)
    i = lean.find(RecordType.SOURCE_STATE, 2)
    rewrite_body(lean, i, lambda b: patch(b, 0, "I", 3))
    v.invalid("src-002-format", "LI-SRC-002", lean.build(), "SOURCE_STATE source_format 3")

    v.finish()


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE)
