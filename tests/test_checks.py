"""Unit tests of leanimg.checks: each cross-record rule function on small hand-built extent
tables, index entries and parsed records. A sound input yields nothing; each violation yields
the rule that function is registered for (leanimg.rules.IMPLEMENTATIONS), at the expected
offset and structure path."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from helpers import make_record, write_two_link_chain
from leanimg import checks
from leanimg.errors import FormatError, LimitError
from leanimg.format import (
    DIGESTS_BODY,
    DISK_BODY,
    DISK_REF,
    EXTENT,
    HEADER,
    INDEX_BODY,
    INDEX_ENTRY,
    NO_KEY,
    RECORD,
    REGION_BODY,
    REGIONS_MAX,
    SOURCE_STATE_BODY,
    IncompatFeature,
    PageClass,
    RecordType,
)
from leanimg.rules import IMPLEMENTATIONS
from leanimg.structures import Header, ImageFile, parse_body, read_footer, read_header, scan_records

S, Z, F, D, P, DL = (
    PageClass.STORED,
    PageClass.ZERO,
    PageClass.FREE,
    PageClass.DISK,
    PageClass.PARENT,
    PageClass.DELTA,
)


def extents(*rows) -> np.ndarray:
    """An extent table from (first_page, num_pages, page_class, first_slot) rows."""
    table = np.zeros(len(rows), EXTENT.dtype)
    for k, (first, count, cls, slot) in enumerate(rows):
        table[k] = (first, count, int(cls), 0, slot)
    return table


def found(problems, function) -> list[tuple]:
    """(rule, offset, structure) of each finding, checking that ``function`` is the one
    registered implementation of its rule."""
    out = []
    for problem in problems:
        assert isinstance(problem, FormatError) or problem.rule is not None
        assert IMPLEMENTATIONS[problem.rule] is function, (problem.rule, function.__name__)
        out.append((problem.rule, problem.offset, problem.structure))
    return out


def rules(problems, function) -> list[str]:
    return [rule for rule, _, _ in found(problems, function)]


def region_record(region_id: int, name: bytes, *, index: int = 0, offset: int = 104):
    return make_record(
        RecordType.REGION,
        REGION_BODY.pack(region_id=region_id, size_bytes=4096, name_length=len(name)) + name,
        offset=offset,
        index=index,
    )


def disk_record(disk_id: int, name: bytes, *, index: int = 0, offset: int = 104):
    return make_record(
        RecordType.DISK,
        DISK_BODY.pack(disk_id=disk_id, size_bytes=4096, sector_size=512, fingerprint_method=1, name_length=len(name))
        + name,
        offset=offset,
        index=index,
    )


# --- first_problem ---------------------------------------------------------------------------
def test_first_problem_raises_the_first_finding_only():
    a, b = FormatError("a", rule="LI-MAP-001"), FormatError("b", rule="LI-MAP-001")
    with pytest.raises(FormatError) as info:
        checks.first_problem(iter([a, b]))
    assert info.value is a
    assert checks.first_problem(iter([])) is None


# --- region and disk tables ----------------------------------------------------------------------
def test_region_table_of_unique_names_and_ids_is_sound():
    records = [region_record(0, b"ram", index=0), region_record(1, "vidéo".encode(), index=1)]
    assert list(checks.region_table_problems(records)) == []


@pytest.mark.parametrize(
    "second,field",
    [
        ((0, b"rom"), "region_id"),
        ((1, b"ram"), "region_id"),
        ((1, b""), "name"),
        ((1, b"x" * 256), "name"),
        ((1, b"\xff\xfe"), "name"),
    ],
)
def test_region_table_problems(second, field):
    records = [region_record(0, b"ram", index=0), region_record(*second, index=1, offset=200)]
    assert found(checks.region_table_problems(records), checks.region_table_problems) == [
        ("LI-REG-001", 200 + RECORD.size + (REGION_BODY.size if field == "name" else 0), f"record[1].region.{field}")
    ]


def test_disk_table_problems_duplicate_name():
    records = [disk_record(0, b"vda", index=0), disk_record(1, b"vda", index=1, offset=300)]
    assert found(checks.disk_table_problems(records), checks.disk_table_problems) == [
        ("LI-DSK-001", 300 + RECORD.size, "record[1].disk.disk_id")
    ]
    assert list(checks.disk_table_problems(records[:1])) == []


def test_region_table_over_the_reader_limit_is_a_limit_error():
    record = region_record(0, b"ram")
    first = next(checks.region_table_problems([record] * (REGIONS_MAX + 1)))
    assert isinstance(first, LimitError) and first.rule is None


# --- reference order -----------------------------------------------------------------------------
def test_reference_order_sound():
    items = [
        (RecordType.DISK, 0, 104, (0,)),
        (RecordType.REGION, 1, 200, (0,)),
        (RecordType.DISK_REFS, 2, 300, (0,)),
        (RecordType.PAGE_MAP, 3, 400, (0,)),
        (RecordType.DIGESTS, 4, 500, (0,)),
        (RecordType.PAGE_FRAME, 5, 600, ()),
    ]
    assert list(checks.reference_order_problems(items)) == []


@pytest.mark.parametrize(
    "items,expected",
    [
        (
            [(RecordType.PAGE_MAP, 0, 104, (0,)), (RecordType.REGION, 1, 200, (0,))],
            (104, "record[0].page_map.region_id"),
        ),
        ([(RecordType.REGION, 0, 104, (0,)), (RecordType.DIGESTS, 1, 200, (1,))], (200, "record[1].digests.region_id")),
        ([(RecordType.DISK, 0, 104, (0,)), (RecordType.DISK_REFS, 1, 200, (0, 2))], (200, "record[1].disk_refs.refs")),
    ],
)
def test_reference_order_problems(items, expected):
    offset, path = expected
    assert found(checks.reference_order_problems(items), checks.reference_order_problems) == [
        ("LI-REC-009", offset + RECORD.size, path)
    ]


# --- coverage ---------------------------------------------------------------------------------------
def test_coverage_of_contiguous_extents_is_sound():
    assert list(checks.coverage_problems(0, "ram", 6, extents((0, 2, S, 0), (2, 1, Z, 0), (3, 3, F, 0)))) == []


@pytest.mark.parametrize(
    "table",
    [
        extents((0, 2, S, 0), (3, 3, Z, 0)),  # gap
        extents((0, 3, S, 0), (2, 4, Z, 0)),  # overlap
        extents((1, 5, S, 0)),  # not from page 0
        extents((0, 5, S, 0)),  # short
        extents((0, 7, S, 0)),  # past the end
        extents(),  # no PAGE_MAP at all
    ],
)
def test_coverage_problems(table):
    assert found(checks.coverage_problems(3, "ram", 6, table), checks.coverage_problems) == [
        ("LI-MAP-001", None, "region[3] 'ram'.page_map")
    ]


# --- frame numbering ---------------------------------------------------------------------------------
def test_numbering_from_zero_is_sound():
    assert list(checks.numbering_problems("page_frame", [0, 2, 5], [2, 3, 1], [100, 200, 300])) == []
    assert list(checks.numbering_problems("page_frame", [], [], [])) == []


def test_numbering_problems_one_per_misnumbered_frame():
    problems = checks.numbering_problems("delta_frame", [0, 3, 5, 7], [2, 3, 1, 1], [100, 200, 300, 400])
    assert found(problems, checks.numbering_problems) == [
        ("LI-FRM-001", 200 + RECORD.size, "delta_frame[1]"),
        ("LI-FRM-001", 400 + RECORD.size, "delta_frame[3]"),
    ]


def test_numbering_problems_are_capped():
    n = 100
    assert len(list(checks.numbering_problems("page_frame", [1] * n, [1] * n, range(n)))) == 20


# --- slots ----------------------------------------------------------------------------------------
def test_slots_used_once_contiguously_in_any_page_order():
    """Fast path: the slot ranges, sorted, follow each other from 0."""
    ram = extents((0, 2, S, 3), (2, 3, S, 0), (5, 1, D, 1), (6, 1, DL, 0))
    rom = extents((0, 1, S, 5), (1, 1, D, 0))
    assert list(checks.slot_problems([ram, rom], 6, 1, [0], [2], [500])) == []


def test_slots_overlapping_ranges_are_found_even_when_the_count_adds_up():
    """Slow path: ranges [0, 2) and [1, 3) and [3, 4) use 4 slots, but slot 1 twice and none is left for 2."""
    table = extents((0, 2, S, 0), (2, 2, S, 1), (4, 1, S, 3))
    problems = list(checks.slot_problems([table], 5, 0, [], [], []))
    assert found(problems, checks.slot_problems) == [("LI-MAP-004", None, "page_map")]
    assert "first mismatch at stored ordinal 2" in problems[0].message


@pytest.mark.parametrize(
    "table,stored,deltas,what",
    [
        (extents((0, 2, S, 0), (2, 2, S, 3)), 4, 0, "stored ordinal 2"),  # gap: ordinal 2 unused
        (extents((0, 2, S, 0)), 3, 0, "stored ordinal 2"),  # a frame page nobody uses
        (extents((0, 2, S, 1)), 3, 0, "stored ordinal 0"),  # not from 0
        (extents((0, 1, DL, 0), (1, 1, DL, 0)), 0, 2, "delta entry 1"),  # one entry twice
    ],
)
def test_slot_problems(table, stored, deltas, what):
    problems = list(checks.slot_problems([table], stored, deltas, [], [], []))
    assert rules(problems, checks.slot_problems) == ["LI-MAP-004"]
    assert f"first mismatch at {what}" in problems[0].message


def test_slot_problems_disk_refs_numbered_contiguously():
    table = extents((0, 5, D, 0))
    assert list(checks.slot_problems([table], 0, 0, [0, 3], [3, 2], [100, 200])) == []
    assert found(checks.slot_problems([table], 0, 0, [0, 4], [3, 2], [100, 200]), checks.slot_problems) == [
        ("LI-MAP-004", 200 + RECORD.size, "disk_refs[1]")
    ]


def test_slot_problems_disk_pages_without_references():
    problems = list(checks.slot_problems([extents((0, 2, D, 0))], 0, 0, [0], [1], [100]))
    assert rules(problems, checks.slot_problems) == ["LI-MAP-004"]
    assert "disk reference" in problems[0].message


# --- features -------------------------------------------------------------------------------------
def header(incompat: int = 0, parent: bool = False) -> Header:
    return Header(
        HEADER.pack(
            incompatible_features=incompat,
            parent_uuid=b"\x01" * 16 if parent else b"",
            parent_digest=b"\x02" * 16 if parent else b"",
        )
    )


def test_features_that_match_the_pages_are_sound():
    every = IncompatFeature.PARENT | IncompatFeature.DISK | IncompatFeature.DELTA
    assert list(checks.feature_problems(header(every, True), Counter({D: 1, DL: 1, P: 1}))) == []
    assert list(checks.feature_problems(header(), Counter({S: 3, Z: 1, F: 1}))) == []
    assert list(checks.feature_problems(header(IncompatFeature.DISK), Counter({S: 1}))) == []  # MAY be set


@pytest.mark.parametrize(
    "incompat,parent,classes,expected",
    [
        (0, False, {D: 1}, ("LI-HDR-009", 16, "header.incompatible_features")),
        (IncompatFeature.PARENT, True, {DL: 1}, ("LI-HDR-009", 16, "header.incompatible_features")),
        (0, False, {P: 2}, ("LI-MAP-005", 56, "header.parent_uuid")),
    ],
)
def test_feature_problems(incompat, parent, classes, expected):
    assert found(checks.feature_problems(header(incompat, parent), Counter(classes)), checks.feature_problems) == [
        expected
    ]
    assert expected[1] == HEADER.offset(expected[2].split(".")[1])


def test_class_counts_over_regions():
    counts = checks.class_counts([extents((0, 2, S, 0), (2, 3, Z, 0), (5, 1, S, 2)), extents((0, 4, P, 0))])
    assert counts == Counter({S: 3, Z: 3, P: 4})


# --- digests ---------------------------------------------------------------------------------------
def digests_record(first: int, count: int, *, offset: int, index: int):
    return make_record(
        RecordType.DIGESTS, DIGESTS_BODY.pack(first_page=first, num_pages=count), offset=offset, index=index
    )


def test_digest_coverage_in_page_order_is_sound():
    parts = [(0, 4, None, 100), (4, 2, None, 200)]
    assert list(checks.digest_coverage_problems(0, "ram", 6, parts)) == []


def test_digest_coverage_problems_out_of_order():
    r = digests_record(3, 3, offset=200, index=4)
    parts = [(0, 4, None, 100), (3, 3, r, 200)]
    assert found(checks.digest_coverage_problems(0, "ram", 6, parts), checks.digest_coverage_problems) == [
        ("LI-DIG-001", 200 + RECORD.size + DIGESTS_BODY.offset("first_page"), "record[4].digests.first_page")
    ]


def test_digest_coverage_problems_incomplete():
    assert found(
        checks.digest_coverage_problems(2, "rom", 6, [(0, 4, None, 100)]), checks.digest_coverage_problems
    ) == [("LI-DIG-001", None, "region[2] 'rom'.digests")]
    assert found(
        checks.digest_coverage_problems(2, "rom", 6, [(1, 5, None, 100)]), checks.digest_coverage_problems
    ) == [("LI-DIG-001", 100 + RECORD.size + 8, "region[2].digests")]


def test_digest_ranks_and_digests_before():
    table = extents((0, 2, S, 0), (2, 3, Z, 0), (5, 1, F, 0), (6, 2, P, 0))
    bearing, rank0 = checks.digest_ranks(table)
    assert bearing.tolist() == [True, False, False, True] and rank0.tolist() == [0, 2, 2, 2]
    assert checks.digests_before(table, bearing, rank0, [0, 1, 2, 6, 7, 8]).tolist() == [0, 1, 2, 2, 3, 4]


def test_digest_count_sound_and_wrong():
    table = extents((0, 2, S, 0), (2, 3, Z, 0), (5, 3, P, 0))
    assert list(checks.digest_count_problems(table, [(0, 4, 2, None, 100), (4, 4, 3, None, 200)])) == []
    r = digests_record(4, 4, offset=200, index=7)
    assert found(
        checks.digest_count_problems(table, [(0, 4, 2, None, 100), (4, 4, 4, r, 200)]), checks.digest_count_problems
    ) == [("LI-DIG-003", 200 + RECORD.size + DIGESTS_BODY.offset("num_digests"), "record[7].digests.num_digests")]
    assert found(checks.digest_count_problems(table, [(0, 8, 4, None, 100)]), checks.digest_count_problems) == [
        ("LI-DIG-003", 100 + RECORD.size + 4, "digests.num_digests")
    ]


def test_digest_problems_one_per_differing_page():
    expected = np.arange(64, dtype=np.uint8).reshape(4, 16)
    got = expected.copy()
    assert list(checks.digest_problems(1, "ram", np.array([10, 11, 12, 13]), got, expected)) == []
    got[1, 0] ^= 1
    got[3, 15] ^= 1
    assert found(
        checks.digest_problems(1, "ram", np.array([10, 11, 12, 13]), got, expected), checks.digest_problems
    ) == [("LI-DIG-002", None, "region[1].page[11]"), ("LI-DIG-002", None, "region[1].page[13]")]


def test_disk_content_problems_one_per_differing_page():
    expected = np.zeros((2, 16), np.uint8)
    got = expected.copy()
    got[0, 3] = 1
    problems = list(checks.disk_content_problems(0, "ram", np.array([5, 6]), got, expected, "vda", np.array([8, 16])))
    assert found(problems, checks.disk_content_problems) == [("LI-DSK-005", None, "region[0].page[5]")]
    assert "'vda' sector 8" in problems[0].message


# --- disk references ---------------------------------------------------------------------------------
def refs(*rows) -> np.ndarray:
    table = np.zeros(len(rows), DISK_REF.dtype)
    for k, (disk_id, sector) in enumerate(rows):
        table[k] = (disk_id, 0, sector)
    return table


def test_disk_refs_within_their_disks_are_sound():
    # the last page of a 64 KiB disk starts at sector 120
    assert list(checks.disk_ref_problems({0: 65536, 1: 8192}, refs((0, 0), (0, 120), (1, 8)), 4096, 500, "r")) == []


def test_disk_ref_problems():
    table = refs((0, 0), (0, 121), (2, 0), (0, (1 << 64) - 1))
    assert found(
        checks.disk_ref_problems({0: 65536}, table, 4096, 500, "record[3].disk_refs"), checks.disk_ref_problems
    ) == [("LI-DSK-003", 500 + RECORD.size + 16 + 16 * k, f"record[3].disk_refs.refs[{k}]") for k in (1, 2, 3)]


# --- index -------------------------------------------------------------------------------------------
ENTRIES = [(104, RecordType.REGION, 0, 0, 2), (168, RecordType.PAGE_FRAME, NO_KEY, 0, 1)]
INDEX_AT = 300


def index_record(entries=ENTRIES):
    table = np.array(entries, INDEX_ENTRY.dtype)
    record = make_record(
        RecordType.INDEX, INDEX_BODY.pack(num_entries=len(table)) + table.tobytes(), offset=INDEX_AT, index=len(entries)
    )
    return record, record.parsed["entries"]


def entry_at(k: int) -> int:
    return INDEX_AT + RECORD.size + INDEX_BODY.size + INDEX_ENTRY.size * k


def test_index_listing_every_record_is_sound():
    index, listed = index_record()
    seen = [(ENTRIES[0], 168), (ENTRIES[1], INDEX_AT)]
    assert list(checks.index_problems(index, listed, seen, header_length=104, complete=True, after_index=[])) == []


@pytest.mark.parametrize(
    "seen,kw,expected",
    [
        (
            [(ENTRIES[0], 168), ((168, RecordType.PAGE_FRAME, NO_KEY, 0, 2), INDEX_AT)],
            {},
            (entry_at(1), "record[2].index.entries[1]"),
        ),
        ([(ENTRIES[0], 160), (ENTRIES[1], INDEX_AT)], {}, (entry_at(0), "record[2].index.entries[0]")),
        ([(None, 168)], {}, (INDEX_AT, "record[2].index.entries")),
        ([(ENTRIES[0], 168), (ENTRIES[1], INDEX_AT)], {"header_length": 112}, (entry_at(0), "record[2].index.entries")),
    ],
)
def test_index_problems(seen, kw, expected):
    index, listed = index_record()
    assert found(checks.index_problems(index, listed, seen, complete=True, **kw), checks.index_problems) == [
        ("LI-IDX-001", *expected)
    ]


def test_index_problems_a_record_after_the_index():
    index, listed = index_record()
    late = make_record(RecordType.PAGE_FRAME, bytes(16), offset=400, index=3)
    assert found(checks.index_problems(index, listed, [], after_index=[late]), checks.index_problems) == [
        ("LI-IDX-001", 400, "record[3].page_frame")
    ]


def test_index_problems_no_index():
    assert found(checks.index_problems(None, None, [], footer_offset=900), checks.index_problems) == [
        ("LI-IDX-001", 900, "footer")
    ]


def test_index_problems_checks_one_entry_from_first_entry():
    index, listed = index_record()
    assert list(checks.index_problems(index, listed, [(ENTRIES[1], INDEX_AT)], first_entry=1)) == []
    assert rules(
        checks.index_problems(index, listed, [(ENTRIES[0], INDEX_AT)], first_entry=1), checks.index_problems
    ) == ["LI-IDX-001"]


@pytest.fixture(scope="module")
def child_records(tmp_path_factory):
    chain = write_two_link_chain(tmp_path_factory.mktemp("checks"))
    with open(chain.child, "rb") as f:
        image = ImageFile(f, str(chain.child))
        footer = read_footer(image, read_header(image).header_length)
        records = list(scan_records(image, HEADER.size, footer.offset))
    for record in records:
        parse_body(record)
    return records


def test_index_entry_of_each_record_is_what_the_writer_listed(child_records):
    *records, index = child_records
    listed = [tuple(int(x) for x in e) for e in index.parsed["entries"]]
    assert [checks.index_entry_of(r, 4096) for r in records] == listed


def test_record_references(child_records):
    refs_by_type = {}
    for record in child_records:
        kind, ids = checks.record_references(record)
        assert kind == record.record_type
        refs_by_type.setdefault(kind, []).append(ids)
    assert refs_by_type[RecordType.REGION] == [(0,), (1,)]
    assert refs_by_type[RecordType.PAGE_MAP] == [(0,), (1,)]
    assert refs_by_type[RecordType.DISK_REFS] == [(0,)]
    assert refs_by_type[RecordType.PAGE_FRAME] == [()]


# --- source state ----------------------------------------------------------------------------------
def source_state(sequence: int, index: int):
    return make_record(
        RecordType.SOURCE_STATE,
        SOURCE_STATE_BODY.pack(source_format=1, sequence=sequence) + b"s",
        offset=104 + 40 * index,
        index=index,
    )


def test_source_sequence_from_zero_is_sound():
    records = [source_state(k, k) for k in range(3)]
    assert list(checks.source_sequence_problems([(r.parsed["sequence"], r) for r in records])) == []


def test_source_sequence_problems():
    records = [source_state(0, 0), source_state(2, 1)]
    assert found(
        checks.source_sequence_problems([(r.parsed["sequence"], r) for r in records]), checks.source_sequence_problems
    ) == [("LI-SRC-001", 144 + RECORD.size + SOURCE_STATE_BODY.offset("sequence"), "record[1].source_state.sequence")]


def test_slot_problems_agree_with_counting_every_page():
    """Fast path (ranges contiguous) or slow path (per page): reported exactly when the slots the
    pages use, counted one by one, are not 0..stored-1 each once."""
    rng = np.random.default_rng(5)
    for _ in range(300):
        n = int(rng.integers(1, 6))
        counts = rng.integers(1, 4, n)
        slots = rng.permutation(np.concatenate(([0], np.cumsum(counts)[:-1])))
        slots = slots + rng.choice([0, 0, 0, 1, -1], n)  # sometimes shifted: overlap or gap
        slots = np.maximum(slots, 0)
        firsts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        table = extents(*[(int(f), int(c), S, int(s)) for f, c, s in zip(firsts, counts, slots)])
        stored = int(counts.sum())
        per_page = np.sort(np.concatenate([np.arange(s, s + c) for s, c in zip(slots, counts)]))
        sound = per_page.tolist() == list(range(stored))
        problems = list(checks.slot_problems([table], stored, 0, [], [], []))
        assert (problems == []) == sound, (table, stored)
