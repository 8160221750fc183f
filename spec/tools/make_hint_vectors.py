#!/usr/bin/env python3
"""Write the hint-protocol test vectors (spec/hints.md) to tests/vectors/hints/.

Self-contained on purpose, like make_examples.py: struct and xxhash only, every constant
restated, so another implementation can regenerate and check them without leanimg.

    python3 spec/tools/make_hint_vectors.py [OUTDIR]

valid/*.hnt are well-formed hints; invalid/*.hnt break exactly one structural rule
(LI-HNT-001..016) each. hints.json lists every file with its kind, rule and what it tests.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import xxhash

MAGIC = b"\x89LEANHNT"
HEADER = struct.Struct("<8sHHIHHI")  # checksum (u8) follows
RECORD_HEAD = struct.Struct("<HHI")
NAME_HEAD = struct.Struct("<HHI")
RANGE_HEAD = struct.Struct("<QHHHHII")
RANGE = struct.Struct("<QQ")
DISK_RUN = struct.Struct("<QIHHQ")
DISK_NAME, REGION_NAME, PARENT, FREE, DISK, UNCHANGED, END = range(1, 8)
QEMU_PC, XEN = 1, 2
GPA, REGION = 1, 2
UUID = bytes(range(1, 17))


def xxh(data: bytes) -> bytes:
    return struct.pack("<Q", xxhash.xxh3_64_intdigest(data))


def header(page_size=4096, address_map=QEMU_PC, major=1, flags=0, reserved=0, bad_checksum=False) -> bytes:
    head = HEADER.pack(MAGIC, major, 0, page_size, address_map, flags, reserved)
    return head + (b"\0" * 8 if bad_checksum else xxh(head))


def record(rtype: int, payload: bytes, flags: int = 0, length: int | None = None) -> bytes:
    head = RECORD_HEAD.pack(rtype, flags, len(payload) if length is None else length)
    return head + payload + xxh(head + payload)


def name(rtype: int, ident: int, text: bytes, reserved: int = 0) -> bytes:
    return record(rtype, NAME_HEAD.pack(ident, len(text), reserved) + text)


def ranges(rtype: int, entries, *, offset=0, addressing=GPA, region=0, source=0, reserved=0, count=None) -> bytes:
    body = b"".join(RANGE.pack(*e) if rtype != DISK else DISK_RUN.pack(*e) for e in entries)
    n = len(entries) if count is None else count
    return record(rtype, RANGE_HEAD.pack(offset, addressing, region, source, reserved, n, 0) + body)


def parent(reserved: int = 0) -> bytes:
    return record(PARENT, UUID + struct.pack("<Q", reserved))


def end(count: int) -> bytes:
    return record(END, struct.pack("<Q", count))


def hints(*records: bytes, count: int | None = None, head: bytes | None = None) -> bytes:
    return (head or header()) + b"".join(records) + end(len(records) if count is None else count)


def good_records() -> list[bytes]:
    """A disk and a region name, a parent, FREE (guest-physical, balloon), DISK (two runs),
    UNCHANGED (region-relative)."""
    return [
        name(DISK_NAME, 0, b"vda"),
        name(REGION_NAME, 0, b"pc.ram"),
        parent(),
        ranges(FREE, [(0x1000, 4), (0x100000, 16)], offset=1 << 20, source=2),
        ranges(DISK, [(0x200000, 2, 0, 0, 2048), (0x300000, 1, 0, 0, 8)], offset=2 << 20),
        ranges(UNCHANGED, [(0, 8), (100, 1)], offset=0, addressing=REGION),
    ]


VALID = {
    "valid/everything.hnt": ("every record kind, guest-physical and region-relative", hints(*good_records())),
    "valid/empty.hnt": ("no hints at all: a header and END", hints()),
    "valid/optional-record.hnt": (
        "an unknown record type with the OPTIONAL bit, skipped",
        hints(record(0x8000 | 42, b"future"), ranges(FREE, [(0, 1)])),
    ),
    "valid/xen.hnt": (
        "Xen pfns: FREE from the balloon, DISK runs",
        hints(
            name(DISK_NAME, 3, b"xvda"),
            ranges(FREE, [(40 << 12, 8)], offset=4096, source=2),
            ranges(DISK, [(5 << 12, 3, 3, 0, 16)]),
            head=header(address_map=XEN),
        ),
    ),
}

g = good_records()
INVALID = {
    "LI-HNT-001": ("bad magic", b"\x89LEANHNX" + hints()[8:]),
    "LI-HNT-002": ("major_version 2", hints(head=header(major=2))),
    "LI-HNT-003": ("header checksum zero", hints(head=header(bad_checksum=True))),
    "LI-HNT-004": ("page_size 5000", hints(head=header(page_size=5000))),
    "LI-HNT-005": ("truncated in the middle of a record", hints(*g)[:-40]),
    "LI-HNT-006": ("payload_length 2 MiB", header() + struct.pack("<HHI", FREE, 0, 2 << 20) + b"\0" * 64),
    "LI-HNT-007": (
        "a record checksum off by one",
        hints(*g[:3], g[3][:-8] + struct.pack("<Q", (struct.unpack("<Q", g[3][-8:])[0] + 1) % (1 << 64)), *g[4:]),
    ),
    "LI-HNT-008": ("unknown mandatory record type 99", hints(record(99, b""))),
    "LI-HNT-009": ("FREE count 3 with two ranges", hints(ranges(FREE, [(0, 1), (0x2000, 1)], count=3))),
    "LI-HNT-010": ("reserved field of a range header non-zero", hints(ranges(FREE, [(0, 1)], reserved=1))),
    "LI-HNT-011": ("END record_count 5 after 6 records", hints(*g, count=5)),
    "LI-HNT-012": ("DISK run names disk id 7, never declared", hints(ranges(DISK, [(0, 1, 7, 0, 0)]))),
    "LI-HNT-013": ("FREE ranges overlap within a record", hints(ranges(FREE, [(0, 4), (0x2000, 4)]))),
    "LI-HNT-014": ("more than 65536 records", hints(*[record(0x8000 | 1, b"")] * 65537)),
    "LI-HNT-015": ("UNCHANGED without a PARENT record", hints(ranges(UNCHANGED, [(0, 1)]))),
    "LI-HNT-016": ("FREE source 9", hints(ranges(FREE, [(0, 1)], source=9))),
}


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "tests/vectors/hints"
    meta = {}
    for rel, (what, data) in VALID.items():
        meta[rel] = {"kind": "valid", "rule": None, "description": what}
        _write(out / rel, data)
    for rule, (what, data) in INVALID.items():
        rel = f"invalid/{rule.lower()}.hnt"
        meta[rel] = {"kind": "invalid", "rule": rule, "description": what}
        _write(out / rel, data)
    (out / "hints.json").write_text(json.dumps({"vectors": meta}, indent=2) + "\n")


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


if __name__ == "__main__":
    main()
