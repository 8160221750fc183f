"""The structure declarations of leanimg.format agree with the byte tables of spec/format.md
and with the types of ksy/leanimg.ksy: same field names, order, offsets, sizes and types."""

import re
from pathlib import Path

import pytest
import yaml

from leanimg import format as fmt

REPO = Path(__file__).resolve().parents[1]
SPEC = (REPO / "spec" / "format.md").read_text()
KSY = yaml.safe_load((REPO / "ksy" / "leanimg.ksy").read_text())

# spec section heading -> the declarations its byte tables give, in table order
SPEC_TABLES = {
    "## 3. Header": ["header"],
    "### 4.1 Framing": ["record"],
    "### 5.1 REGION": ["region_body"],
    "### 5.2 DISK": ["disk_body"],
    "### 5.4 SOURCE_STATE": ["source_state_body"],
    "### 6.2 PAGE_MAP": ["page_map_body", "extent"],
    "### 6.3 PAGE_FRAME": ["page_frame_body"],
    "### 6.4 DISK_REFS": ["disk_refs_body", "disk_ref"],
    "### 6.5 DIGESTS": ["digests_body"],
    "### 7.1 DELTA_FRAME": ["delta_frame_body"],
    "### 7.2 Delta entry": ["delta_entry"],
    "### 8.1 INDEX": ["index_body", "index_entry"],
    "### 8.2 Footer": ["footer"],
}
# the three encodings of a delta entry (spec §7.3-§7.5) list the fields that follow its head
DELTA_ENCODING_SECTIONS = ["### 7.3 Encoding 1", "### 7.4 Encoding 2", "### 7.5 Encoding 3"]
SIZES = {"u1": 1, "u2": 2, "u4": 4, "u8": 8, "b[8]": 8, "uuid": 16, "digest": 16}


def _section(heading: str) -> str:
    start = SPEC.index(heading)
    following = re.search(r"^#{2,3} ", SPEC[start + len(heading) :], re.M)
    return SPEC[start : start + len(heading) + (following.start() if following else len(SPEC))]


def _tables(text: str) -> list[list[dict]]:
    """Every '| Offset | Size | Type | Name | Description |' table of ``text`` as rows."""
    tables, rows = [], None
    for line in text.splitlines():
        if line.startswith("| Offset | Size | Type | Name |"):
            rows = []
            tables.append(rows)
        elif rows is not None and line.startswith("|") and not line.startswith("|---"):
            offset, size, type_, name = [c.strip() for c in line.strip("|").split("|")[:4]]
            rows.append(dict(offset=offset, size=size, type=type_, name=name.strip("`")))
        elif not line.startswith("|"):
            rows = None
    return tables


def _spec_rows(name: str) -> list[dict]:
    for heading, names in SPEC_TABLES.items():
        if name in names:
            return _tables(_section(heading))[names.index(name)]
    raise KeyError(name)


def test_every_declaration_has_a_spec_table_and_a_ksy_type():
    declared = set(fmt.STRUCTURES)
    assert declared == {n for names in SPEC_TABLES.values() for n in names} | {"delta_run"}
    assert declared <= set(KSY["types"])


@pytest.mark.parametrize("name", [n for names in SPEC_TABLES.values() for n in names])
def test_declaration_matches_the_spec_table(name):
    structure = fmt.STRUCTURES[name]
    rows = [r for r in _spec_rows(name) if r["type"]]  # delta entry: "(encoding)" has none
    declared = structure.fields if name != "delta_entry" else structure.head
    assert [r["name"] for r in rows] == [f.name for f in declared]
    for row, field in zip(rows, declared):
        assert row["type"] == field.type, f"{name}.{field.name}"
        if field.is_fixed:
            assert int(row["size"]) == SIZES[field.type], f"{name}.{field.name}"
        if field in structure.head:  # after a variable field: an expression
            assert int(row["offset"]) == structure.offset(field.name), f"{name}.{field.name}"


def test_delta_entry_encodings_name_declared_fields():
    entry = fmt.DELTA_ENTRY
    for heading in DELTA_ENCODING_SECTIONS:
        (rows,) = _tables(_section(heading))
        for row in rows:
            if row["type"]:  # the "header" row restates §7.2
                assert entry.field(row["name"]).type == row["type"], f"{heading}: {row['name']}"
    runs = _section("### 7.5 Encoding 3")
    assert "u2 `start_word`, u2 `run_length`" in runs
    assert [f.name for f in fmt.DELTA_RUN.fields] == ["start_word", "run_length"]


def _ksy_type_matches(field: fmt.Field, attr: dict) -> bool:
    """The .ksy attribute reads what the declared type says."""
    if field.type in ("u1", "u2", "u4", "u8"):
        return attr.get("type") == field.type
    if field.type == "b[8]":
        return "contents" in attr or attr.get("size") == 8
    if field.type in ("uuid", "digest"):
        return attr.get("size") == 16 and "repeat" not in attr
    if field.type == "b[]":
        return "size" in attr or "size-eos" in attr or (attr.get("type") == "u1" and "repeat" in attr)
    element = field.element
    if element == "digest":
        return attr.get("size") == 16 and "repeat" in attr
    return attr.get("type") == element and "repeat" in attr


@pytest.mark.parametrize("name", sorted(fmt.STRUCTURES))
def test_declaration_matches_the_ksy_type(name):
    structure = fmt.STRUCTURES[name]
    seq = KSY["types"][name]["seq"]
    assert [a["id"] for a in seq] == [f.name for f in structure.fields]
    for attr, field in zip(seq, structure.fields):
        assert _ksy_type_matches(field, attr), f"{name}.{field.name}: ksy {attr} vs declared {field.type}"


def test_record_bodies_are_the_ksy_switch_cases():
    body = next(a for a in KSY["types"]["record"]["seq"] if a["id"] == "body")
    cases = body["type"]["cases"]
    assert {k.split("::")[1]: v for k, v in cases.items()} == {t.name.lower(): s.name for t, s in fmt.BODY_OF.items()}


@pytest.mark.parametrize("name", sorted(fmt.STRUCTURES))
def test_structures_are_little_endian_and_unpadded(name):
    structure = fmt.STRUCTURES[name]
    assert structure.struct.format.startswith("<")
    assert structure.dtype.itemsize == structure.size
    assert list(structure.dtype.names) == [f.name for f in structure.head]


def test_pack_and_unpack_by_field_name():
    raw = fmt.EXTENT.pack(first_page=7, num_pages=3, page_class=fmt.PageClass.DISK, first_slot=9)
    values = fmt.EXTENT.unpack(raw)
    assert (values.first_page, values.num_pages, values.page_class, values.reserved, values.first_slot) == (
        7,
        3,
        4,
        0,
        9,
    )
    with pytest.raises(TypeError, match="no field 'pages'"):
        fmt.EXTENT.pack(pages=1)


def test_magics_and_constants_appear_in_spec():
    assert fmt.HEADER_MAGIC.hex(" ").upper() in SPEC.upper()
    assert fmt.FOOTER_MAGIC.hex(" ").upper() in SPEC.upper()
    for record_type in fmt.RecordType:
        assert f"0x{int(record_type):08X}".lower() in SPEC.lower() or f"0x{int(record_type):x}" in SPEC.lower(), (
            record_type.name
        )
