"""Unit tests of leanimg.structures: header, footer and record parsing, the record scan, body
parsing by type and the single-record rules, on small images from LeanImageWriter and on
damaged copies of them."""

from __future__ import annotations

import struct
from contextlib import contextmanager

import numpy as np
import pytest

from helpers import make_record, write_two_link_chain
from leanimg.errors import FormatError, LeanImageError, LimitError, TruncatedError
from leanimg.format import (
    BODY_OF,
    DELTA_FRAME_BODY,
    DIGESTS_BODY,
    DISK_BODY,
    DISK_REF,
    DISK_REFS_BODY,
    EXTENT,
    FOOTER,
    HEADER,
    INDEX_ENTRY,
    PAGE_FRAME_BODY,
    PAGE_MAP_BODY,
    RECORD,
    RECORD_BODY_MAX,
    REGION_BODY,
    SOURCE_STATE_BODY,
    IncompatFeature,
    RecordType,
    checksum64,
)
from leanimg.structures import (
    ImageFile,
    body_length_problems,
    body_problems,
    dump_structure,
    footer_checksum,
    header_checksum,
    header_problems,
    image_digest_problems,
    index_location_problems,
    parse_body,
    read_footer,
    read_header,
    read_record,
    reserved_problems,
    scan_records,
)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return write_two_link_chain(tmp_path_factory.mktemp("structures"))


@contextmanager
def image_file(path):
    with open(path, "rb") as f:
        yield ImageFile(f, str(path))


def records_of(path) -> list:
    """Every record of a sound image, read by the scan and parsed."""
    with image_file(path) as image:
        footer = read_footer(image, read_header(image).header_length)
        records = list(scan_records(image, HEADER.size, footer.offset))
    for record in records:
        parse_body(record)
    return records


def damaged(tmp_path, source, edit, name="damaged.lean"):
    """A copy of ``source`` changed in place by ``edit(bytearray)``."""
    data = bytearray(source.read_bytes())
    edit(data)
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def set_header(field, value, fix=True):
    def edit(data):
        fmt = HEADER.field(field).struct.format
        struct.pack_into(fmt, data, HEADER.offset(field), value)
        if fix:
            struct.pack_into("<Q", data, HEADER.offset("header_checksum"), header_checksum(bytes(data[: HEADER.size])))

    return edit


def set_footer(field, value, fix=True):
    def edit(data):
        at = len(data) - FOOTER.size
        struct.pack_into(FOOTER.field(field).struct.format, data, at + FOOTER.offset(field), value)
        if fix:
            struct.pack_into("<Q", data, at + FOOTER.offset("footer_checksum"), footer_checksum(bytes(data[at:])))

    return edit


def rechecksum(data: bytearray, offset: int) -> None:
    """Recompute the record_checksum of the record at ``offset`` after an edit."""
    (body_length,) = struct.unpack_from("<Q", data, offset + 8)
    trailer = offset + RECORD.size + (body_length + 7 & ~7)
    struct.pack_into("<Q", data, trailer, checksum64(bytes(data[offset:trailer])))


def flip(at: int):
    def edit(data):
        data[at] ^= 0x01

    return edit


# --- header -------------------------------------------------------------------------------
def test_read_header_gives_every_declared_field(chain):
    with image_file(chain.child) as image:
        header = read_header(image)
    assert set(header.fields()) == {f.name for f in HEADER.head}
    assert (header.major_version, header.header_length, header.page_size) == (1, HEADER.size, 4096)
    assert header.image_uuid == chain.child_uuid and header.parent_uuid == chain.parent_uuid
    assert header.has_parent
    assert (
        header.incompatible_features
        == IncompatFeature.PARENT | IncompatFeature.DISK | IncompatFeature.DELTA | IncompatFeature.INHERITED_DIGESTS
    )
    assert list(header_problems(header)) == []


def test_a_flat_image_has_no_parent(chain):
    with image_file(chain.parent) as image:
        header = read_header(image)
    assert not header.has_parent and header.parent_digest == bytes(16)


@pytest.mark.parametrize(
    "edit,rule,field",
    [
        (flip(0), "LI-HDR-001", "magic"),
        (set_header("major_version", 2), "LI-HDR-002", "major_version"),
        (set_header("header_length", 96), "LI-HDR-003", "header_length"),
        (set_header("header_length", 108), "LI-HDR-003", "header_length"),
        (set_header("header_length", 4104), "LI-HDR-003", "header_length"),
    ],
)
def test_read_header_refuses_a_damaged_header(chain, tmp_path, edit, rule, field):
    with image_file(damaged(tmp_path, chain.parent, edit)) as image, pytest.raises(FormatError) as info:
        read_header(image)
    assert (info.value.rule, info.value.offset, info.value.structure) == (rule, HEADER.offset(field), f"header.{field}")


@pytest.mark.parametrize(
    "size,rule,structure",
    [(0, "LI-HDR-001", "header.magic"), (5, "LI-HDR-001", "header.magic"), (50, "LI-HDR-003", "header")],
)
def test_read_header_of_a_truncated_file(chain, tmp_path, size, rule, structure):
    path = tmp_path / "short.lean"
    path.write_bytes(chain.parent.read_bytes()[:size])
    with image_file(path) as image, pytest.raises(TruncatedError) as info:
        read_header(image)
    assert (info.value.rule, info.value.offset, info.value.structure) == (rule, 0, structure)


@pytest.mark.parametrize(
    "edit,rule,field",
    [
        (lambda data: None, None, None),
        (set_header("header_checksum", 1, fix=False), "LI-HDR-004", "header_checksum"),
        (set_header("incompatible_features", 1 << 7), "LI-HDR-005", "incompatible_features"),
        (set_header("page_size", 5000), "LI-HDR-006", "page_size"),
        (set_header("reserved", 1), "LI-HDR-007", "reserved"),
        (set_header("parent_uuid", b"\x01" * 16), "LI-HDR-008", "parent_uuid"),
    ],
)
def test_header_problems_one_rule_per_damage(chain, tmp_path, edit, rule, field):
    with image_file(damaged(tmp_path, chain.parent, edit)) as image:
        problems = list(header_problems(read_header(image)))
    if rule is None:
        assert problems == []
        return
    assert [(p.rule, p.offset, p.structure) for p in problems] == [(rule, HEADER.offset(field), f"header.{field}")]


# --- footer -------------------------------------------------------------------------------
def test_read_footer_locates_the_index(chain):
    with image_file(chain.parent) as image:
        footer = read_footer(image, HEADER.size)
        assert set(footer.fields()) == {f.name for f in FOOTER.head}
        assert footer.offset == image.size - FOOTER.size == footer.file_length - FOOTER.size
        index = read_record(image, footer.index_offset, footer.offset)
        assert index.record_type == RecordType.INDEX and index.end == footer.offset
        assert list(image_digest_problems(image, footer)) == []
        assert list(index_location_problems(footer, HEADER.size, index=index, scanned_index=index)) == []


@pytest.mark.parametrize(
    "edit,rule,field",
    [
        (set_footer("magic", b"\x89LEANENX", fix=False), "LI-FTR-001", "magic"),
        (set_footer("footer_checksum", 7, fix=False), "LI-FTR-002", "footer_checksum"),
        (set_footer("file_length", 1 << 20), "LI-FTR-003", "file_length"),
        (set_footer("index_offset", 1001), "LI-FTR-005", "index_offset"),
        (set_footer("index_offset", 8), "LI-FTR-005", "index_offset"),
    ],
)
def test_read_footer_refuses_a_damaged_footer(chain, tmp_path, edit, rule, field):
    path = damaged(tmp_path, chain.parent, edit)
    footer_at = path.stat().st_size - FOOTER.size
    with image_file(path) as image, pytest.raises(FormatError) as info:
        read_footer(image, HEADER.size)
    assert (info.value.rule, info.value.offset, info.value.structure) == (
        rule,
        footer_at + FOOTER.offset(field),
        f"footer.{field}",
    )


def test_read_footer_of_a_file_too_short_for_one(chain, tmp_path):
    path = tmp_path / "short.lean"
    path.write_bytes(chain.parent.read_bytes()[: HEADER.size + 20])
    with image_file(path) as image, pytest.raises(TruncatedError) as info:
        read_footer(image, HEADER.size)
    assert (info.value.rule, info.value.structure) == ("LI-FTR-001", "footer")


def test_index_location_problems_name_a_record_that_is_not_the_index(chain):
    records = records_of(chain.parent)
    with image_file(chain.parent) as image:
        footer = read_footer(image, HEADER.size)
    (wrong,) = index_location_problems(footer, HEADER.size, index=records[0])
    assert (wrong.rule, wrong.offset, wrong.structure) == ("LI-FTR-005", footer.index_offset, "footer.index_offset")
    other = make_record(RecordType.INDEX, bytes(8), offset=footer.index_offset - 64)
    (moved,) = index_location_problems(footer, HEADER.size, scanned_index=other)
    assert moved.rule == "LI-FTR-005" and moved.offset == footer.offset + FOOTER.offset("index_offset")


def test_image_digest_problems_after_a_change_before_the_footer(chain, tmp_path):
    path = damaged(tmp_path, chain.parent, flip(HEADER.size + RECORD.size))  # inside the first body
    with image_file(path) as image:
        footer = read_footer(image, HEADER.size)
        (problem,) = image_digest_problems(image, footer)
    assert (problem.rule, problem.offset, problem.structure) == (
        "LI-FTR-004",
        footer.offset + FOOTER.offset("image_digest"),
        "footer.image_digest",
    )


# --- records ------------------------------------------------------------------------------
def test_read_record_reads_what_the_index_lists(chain):
    records = records_of(chain.child)
    entries = records[-1].parsed["entries"]
    with image_file(chain.child) as image:
        for k, entry in enumerate(entries):
            record = read_record(image, int(entry["record_offset"]), records[-1].offset, k)
            assert record.record_type == entry["record_type"] and record.index == k
            assert record.end == (int(entries["record_offset"][k + 1]) if k + 1 < len(entries) else records[-1].offset)
            assert record.path("x") == f"record[{k}].{RecordType(record.record_type).name.lower()}.x"


def _region_record_at(path) -> int:
    return records_of(path)[0].offset  # the parent's first record: REGION "ram", 5 padding bytes


@pytest.mark.parametrize(
    "what,rule,field",
    [("body", "LI-REC-003", "record_checksum"), ("padding", "LI-REC-004", "padding"), ("flags", "LI-REC-005", "flags")],
)
def test_read_record_refuses_a_damaged_record(chain, tmp_path, what, rule, field):
    at = _region_record_at(chain.parent)
    body_length = REGION_BODY.size + len("ram")
    where = {"body": at + RECORD.size, "padding": at + RECORD.size + body_length, "flags": at + 4}[what]
    trailer = at + RECORD.size + 40

    def edit(data):
        data[where] ^= 1
        if what != "body":
            rechecksum(data, at)

    path = damaged(tmp_path, chain.parent, edit)
    with image_file(path) as image, pytest.raises(FormatError) as info:
        read_record(image, at, image.size, 0)
    assert info.value.rule == rule
    assert info.value.offset == (trailer if what == "body" else where)
    assert info.value.structure == f"record[0].region.{field}"


def test_read_record_refuses_a_body_past_the_limit(chain):
    at = _region_record_at(chain.parent)
    with image_file(chain.parent) as image, pytest.raises(TruncatedError) as info:
        read_record(image, at, at + 40, 3)  # the record is 64 bytes long
    assert info.value.rule == "LI-REC-002" and info.value.offset == at + RECORD.offset("body_length")
    assert info.value.structure.startswith("record[3]") and info.value.structure.endswith(".body_length")


def test_read_record_refuses_a_body_over_the_reader_limit_without_reading_it(chain, tmp_path):
    at = _region_record_at(chain.parent)
    path = damaged(tmp_path, chain.parent, lambda d: struct.pack_into("<Q", d, at + 8, RECORD_BODY_MAX + 8))
    with image_file(path) as image, pytest.raises(LimitError) as info:
        read_record(image, at, 1 << 40, 0)
    assert info.value.rule is None and info.value.offset == at + 8


def test_scan_records_yields_every_record_in_file_order(chain):
    records = records_of(chain.child)
    entries = records[-1].parsed["entries"]
    assert [r.offset for r in records] == [int(o) for o in entries["record_offset"]] + [records[-1].offset]
    assert [r.index for r in records] == list(range(len(records)))
    assert all(a.end == b.offset for a, b in zip(records, records[1:]))
    assert records[0].offset == HEADER.size and records[-1].record_type == RecordType.INDEX


def _with_gap(chain, tmp_path) -> tuple:
    """The parent with 16 bytes of junk between header and first record: (path, records' new offsets, limit)."""
    data = chain.parent.read_bytes()
    offsets = [r.offset + 16 for r in records_of(chain.parent)]
    path = tmp_path / "gap.lean"
    path.write_bytes(data[: HEADER.size] + b"\xaa" * 16 + data[HEADER.size :])
    return path, offsets, len(data) + 16 - FOOTER.size


def test_scan_records_reports_bytes_the_index_does_not_list_and_resumes(chain, tmp_path):
    path, offsets, limit = _with_gap(chain, tmp_path)
    with image_file(path) as image:
        items = list(scan_records(image, HEADER.size, limit, listed=offsets))
    gap = items[0]
    assert isinstance(gap, FormatError)
    assert (gap.rule, gap.offset, gap.structure.split(".")[0]) == ("LI-REC-001", HEADER.size, "record[0]")
    assert [r.offset for r in items[1:]] == offsets


def test_scan_records_without_an_index_stops_at_unreadable_framing(chain, tmp_path):
    path, _, limit = _with_gap(chain, tmp_path)
    with image_file(path) as image:
        items = list(scan_records(image, HEADER.size, limit))
    assert len(items) == 1 and items[0].rule == "LI-REC-002"


def test_scan_records_goes_on_after_a_bad_checksum(chain, tmp_path):
    records = records_of(chain.parent)
    path = damaged(tmp_path, chain.parent, flip(records[1].body_offset + 20))
    with image_file(path) as image:
        items = list(scan_records(image, HEADER.size, records[-1].end))
    assert len(items) == len(records)
    assert isinstance(items[1], FormatError) and items[1].rule == "LI-REC-003"
    assert [r.index for r in items if not isinstance(r, FormatError)] == [0, *range(2, len(records))]


def test_scan_records_tail_too_short_for_a_record(chain):
    with image_file(chain.parent) as image:
        (item,) = scan_records(image, HEADER.size, HEADER.size + 16)
    assert (item.rule, item.offset, item.structure.split(".")[0]) == ("LI-REC-001", HEADER.size, "record[0]")


# --- bodies -------------------------------------------------------------------------------
def test_parse_body_gives_every_declared_field_of_each_record_type(chain):
    records = records_of(chain.child)
    assert {r.record_type for r in records} == {int(t) for t in RecordType}
    for record in records:
        assert set(record.parsed) == {f.name for f in BODY_OF[record.record_type].fields}, record.name


def test_parse_body_tables_have_the_declared_dtypes(chain):
    by_type = {}
    for record in records_of(chain.child):
        by_type.setdefault(record.record_type, []).append(record.parsed)
    assert by_type[RecordType.PAGE_MAP][0]["extents"].dtype == EXTENT.dtype
    assert by_type[RecordType.DISK_REFS][0]["refs"].dtype == DISK_REF.dtype
    assert by_type[RecordType.INDEX][0]["entries"].dtype == INDEX_ENTRY.dtype
    assert by_type[RecordType.DIGESTS][0]["digests"].shape == (by_type[RecordType.DIGESTS][0]["num_digests"], 16)
    delta = by_type[RecordType.DELTA_FRAME][0]
    assert len(delta["entry_offsets"]) == delta["num_deltas"] + 1 == 3 and delta["entry_offsets"][0] == 0


def test_parse_body_values_of_the_child(chain):
    by_type = {}
    for record in records_of(chain.child):
        by_type.setdefault(record.record_type, []).append(record.parsed)
    regions = by_type[RecordType.REGION]
    assert [(r["name"], r["flags"], r["guest_phys_base"], r["size_bytes"]) for r in regions] == [
        ("ram", 0, 0, 8 * 4096),
        ("rom", 1, 0xF0000, 2 * 4096),
    ]
    (disk,) = by_type[RecordType.DISK]
    assert (disk["name"], disk["sector_size"], disk["fingerprint_method"], disk["size_bytes"]) == (
        "disk0",
        512,
        1,
        chain.disk.stat().st_size,
    )
    assert [(s["tag"], s["sequence"], bytes(s["data"])) for s in by_type[RecordType.SOURCE_STATE]] == [
        (3, 0, b"cpu state"),
        (4, 1, b"devices"),
    ]
    (refs,) = by_type[RecordType.DISK_REFS]
    assert refs["refs"]["sector"].tolist() == [8, 0]
    ram_map = by_type[RecordType.PAGE_MAP][0]["extents"]
    assert np.repeat(ram_map["page_class"], ram_map["num_pages"]).tolist() == [5, 6, 1, 2, 3, 4, 4, 6]


def test_parse_body_of_unknown_types():
    assert parse_body(make_record(0x8000_0099, b"anything", parse=False)) == {}
    with pytest.raises(FormatError) as info:
        parse_body(make_record(0x99, b"anything", offset=200, parse=False), 4)
    assert (info.value.rule, info.value.offset, info.value.structure) == (
        "LI-REC-006",
        200,
        "record[4].type_0x00000099.record_type",
    )


def test_parse_body_checks_length_and_reserved_fields():
    short = make_record(RecordType.PAGE_FRAME, bytes(10), parse=False)
    with pytest.raises(FormatError) as info:
        parse_body(short)
    assert info.value.rule == "LI-REC-007"
    reserved = make_record(RecordType.PAGE_FRAME, PAGE_FRAME_BODY.pack(num_pages=1, reserved=9), offset=64, parse=False)
    with pytest.raises(FormatError) as info:
        parse_body(reserved, 2)
    assert (info.value.rule, info.value.offset, info.value.structure) == (
        "LI-REC-008",
        64 + RECORD.size + PAGE_FRAME_BODY.offset("reserved"),
        "record[2].page_frame.reserved",
    )
    extents = (
        PAGE_MAP_BODY.pack(num_extents=2)
        + EXTENT.pack(num_pages=1, page_class=2)
        + EXTENT.pack(first_page=1, num_pages=1, page_class=2, reserved=1)
    )
    with pytest.raises(FormatError) as info:
        parse_body(make_record(RecordType.PAGE_MAP, extents, offset=64, parse=False), 2)
    assert info.value.rule == "LI-REC-008" and info.value.structure == "record[2].page_map.extents[1].reserved"
    assert info.value.offset == 64 + RECORD.size + PAGE_MAP_BODY.size + EXTENT.size + EXTENT.offset("reserved")


def test_reserved_problems_of_a_head_and_of_a_table():
    assert list(reserved_problems(REGION_BODY, {"reserved": 0}, 100, "r")) == []
    (head,) = reserved_problems(REGION_BODY, {"reserved": 3}, 100, "record[1].region")
    assert (head.rule, head.offset, head.structure) == (
        "LI-REC-008",
        100 + REGION_BODY.offset("reserved"),
        "record[1].region.reserved",
    )
    (flags,) = reserved_problems(DISK_BODY, {"flags": 1, "reserved": 0}, None, "")
    assert (flags.rule, flags.offset, flags.structure) == ("LI-REC-008", None, "flags")
    table = np.zeros(4, DISK_REF.dtype)
    table["reserved"][2] = 5
    (row,) = reserved_problems(DISK_REF, table, 1000, "x.refs")
    assert (row.offset, row.structure) == (1000 + 2 * DISK_REF.size + DISK_REF.offset("reserved"), "x.refs[2].reserved")


def _head(record):
    structure = BODY_OF[record.record_type]
    return structure.unpack(record.body)._asdict() if record.body_length >= structure.size else None


@pytest.mark.parametrize(
    "record_type,body,field",
    [
        (RecordType.DIGESTS, bytes(12), "body_length"),
        (RecordType.REGION, REGION_BODY.pack(size_bytes=4096, name_length=4) + b"ram", "body_length"),
        (
            RecordType.PAGE_MAP,
            PAGE_MAP_BODY.pack(num_extents=2) + EXTENT.pack(num_pages=1, page_class=2),
            "body_length",
        ),
        (RecordType.DISK_REFS, DISK_REFS_BODY.pack(num_refs=0), "num_refs"),
        (RecordType.DIGESTS, DIGESTS_BODY.pack(num_pages=0), "num_pages"),
        (RecordType.DIGESTS, DIGESTS_BODY.pack(num_digests=2, num_pages=1) + bytes(32), "num_pages"),
        (RecordType.DELTA_FRAME, DELTA_FRAME_BODY.pack(num_deltas=3) + bytes(8), "num_deltas"),
    ],
)
def test_body_length_problems(record_type, body, field):
    record = make_record(record_type, body, offset=200, index=5, parse=False)
    (problem,) = body_length_problems(record, _head(record))
    assert problem.rule == "LI-REC-007"
    assert problem.structure == f"record[5].{RecordType(record_type).name.lower()}.{field}"


def test_body_length_problems_accept_exact_lengths():
    for record_type, body in (
        (RecordType.REGION, REGION_BODY.pack(size_bytes=4096, name_length=3) + b"ram"),
        (RecordType.DIGESTS, DIGESTS_BODY.pack(num_digests=1, num_pages=2) + bytes(16)),
        (RecordType.DELTA_FRAME, DELTA_FRAME_BODY.pack(num_deltas=1) + bytes(8)),
        (RecordType.PAGE_FRAME, PAGE_FRAME_BODY.pack(num_pages=1) + b"any frame"),
    ):
        record = make_record(record_type, body, parse=False)
        assert list(body_length_problems(record, _head(record))) == [], record.name


@pytest.mark.parametrize(
    "record_type,body,rule,field",
    [
        (RecordType.REGION, REGION_BODY.pack(flags=2, size_bytes=4096, name_length=1) + b"r", "LI-REG-003", "flags"),
        (
            RecordType.REGION,
            REGION_BODY.pack(guest_phys_base=4096, size_bytes=4096, name_length=1) + b"r",
            "LI-REG-003",
            "flags",
        ),
        (RecordType.REGION, REGION_BODY.pack(size_bytes=4097, name_length=1) + b"r", "LI-REG-002", "size_bytes"),
        (
            RecordType.DISK,
            DISK_BODY.pack(size_bytes=512, sector_size=4096, fingerprint_method=1, name_length=1) + b"d",
            "LI-DSK-002",
            "size_bytes",
        ),
        (RecordType.SOURCE_STATE, SOURCE_STATE_BODY.pack(source_format=9), "LI-SRC-002", "source_format"),
        (RecordType.PAGE_FRAME, PAGE_FRAME_BODY.pack(num_pages=0), "LI-FRM-004", "num_pages"),
        (
            RecordType.DELTA_FRAME,
            DELTA_FRAME_BODY.pack(num_deltas=1) + struct.pack("<2I", 4, 8),
            "LI-DLT-001",
            "entry_offsets",
        ),
        (
            RecordType.PAGE_MAP,
            PAGE_MAP_BODY.pack(num_extents=1) + EXTENT.pack(num_pages=1, page_class=7),
            "LI-MAP-002",
            "extents[0]",
        ),
        (
            RecordType.PAGE_MAP,
            PAGE_MAP_BODY.pack(num_extents=1) + EXTENT.pack(num_pages=1, page_class=2, first_slot=3),
            "LI-MAP-003",
            "extents[0].first_slot",
        ),
    ],
)
def test_body_problems_value_rules(record_type, body, rule, field):
    record = make_record(record_type, body, offset=64, index=1)
    problems = list(body_problems(record, 1, 4096))
    assert [(p.rule, p.structure) for p in problems] == [(rule, f"record[1].{record.name}.{field}")]
    assert problems[0].offset >= record.body_offset


def test_body_problems_of_sound_records_are_none(chain):
    assert all(list(body_problems(r, r.index, 4096)) == [] for r in records_of(chain.child))


# --- dump -----------------------------------------------------------------------------------
def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return isinstance(value, (int, str, bytes))


def test_dump_structure_names_every_declared_field(chain):
    dump = dump_structure(chain.child)
    assert set(dump["header"]) == {f.name for f in HEADER.fields} and dump["header"]["extension"] == b""
    assert set(dump["footer"]) == {f.name for f in FOOTER.head}
    index = dump["records"][-1]["body"]
    assert [r["offset"] for r in dump["records"][:-1]] == [e["record_offset"] for e in index["entries"]]
    for record in dump["records"]:
        assert set(record["body"]) == {f.name for f in BODY_OF[record["record_type"]].fields}
        assert record["flags"] == 0 and record["padding"] == bytes(len(record["padding"]))
    assert _plain(dump)


def test_dump_structure_raises_on_a_damaged_record(chain, tmp_path):
    records = records_of(chain.parent)
    with pytest.raises(LeanImageError) as info:
        dump_structure(damaged(tmp_path, chain.parent, flip(records[2].body_offset)))
    assert info.value.rule == "LI-REC-003" and info.value.structure == "record[2].page_frame.record_checksum"
