"""Unit tests of leanimg.validate: ``validate`` and its ``Report`` (findings, counts of what
was checked, what the inputs did not allow checking, suppression, JSON) and the one-line form
of a finding that spec/conformance.md describes."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from helpers import disk_sources, make_vectors, write_bytes, write_two_link_chain
from leanimg.errors import FormatError, LeanImageError, LimitError
from leanimg.format import FOOTER, RecordType
from leanimg.reader import LeanImage
from leanimg.validate import FINDINGS_PER_RULE, Finding, Report, validate

PS = 4096
FINDING_LINE = re.compile(r"^(LI-[A-Z]{3}-\d{3}) offset (0x[0-9a-f]+|-) (\S.*?): (.+)$")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return write_two_link_chain(tmp_path_factory.mktemp("validate"))


def records_in(path) -> int:
    with LeanImage.open_link(path) as image:
        return len(image.index_entries) + 1  # and the INDEX itself


def flipped(tmp_path, source, *positions, name="flipped.lean"):
    data = bytearray(source.read_bytes())
    for at in positions:
        data[at] ^= 1
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def frame_checksum_offsets(path) -> list[int]:
    """File offsets of the record_checksum of each PAGE_FRAME."""
    with LeanImage.open_link(path) as image:
        entries = image.index_entries
        ends = list(entries["record_offset"][1:]) + [image.footer.index_offset]
        return [int(end) - 8 for end, kind in zip(ends, entries["record_type"]) if kind == RecordType.PAGE_FRAME]


# --- a valid image ---------------------------------------------------------------------------------
def test_a_valid_image_has_no_findings_and_counts_what_it_checked(chain):
    report = validate(chain.parent)
    assert report.valid and report.findings == [] and not report.suppressed and report.not_checked == []
    assert report.path == str(chain.parent)
    assert dict(report.checked) == {"records": records_in(chain.parent), "pages": 10, "stored_pages": 9}


def test_with_parent_and_disk_every_page_is_resolved(chain):
    with disk_sources({"disk0": chain.disk}) as disks:
        report = validate(chain.child, parents=[chain.parent], disks=disks)
    assert report.valid and report.not_checked == []
    assert dict(report.checked) == {
        "records": records_in(chain.child),
        "pages": 10,
        "stored_pages": 1,
        "parent_pages": 3,
        "delta_pages": 2,
        "disk_pages": 2,
    }


def test_not_checked_says_what_was_not_supplied(chain):
    report = validate(chain.child)
    assert report.valid  # rules not checked do not make an image invalid
    assert report.not_checked == [
        "LI-CHN-001",
        "LI-CHN-002",
        "LI-CHN-003",
        "LI-CHN-004",
        "LI-CHN-005",
        "LI-CHN-006",
        "LI-DIG-002",
        "LI-DSK-004",
        "LI-DSK-005",
    ]
    disk_note, parent_note = report.not_checked_reasons
    assert disk_note.startswith("LI-DSK-004, LI-DSK-005") and disk_note.endswith("no --disk for disk0")
    assert parent_note.startswith("LI-CHN-001..005") and parent_note.endswith("no --parent")
    assert "parent_pages" not in report.checked and "disk_pages" not in report.checked
    with_parent = validate(chain.child, parents=[chain.parent])
    assert with_parent.not_checked == ["LI-DIG-002", "LI-DSK-004", "LI-DSK-005"]
    assert with_parent.not_checked_reasons == [disk_note] and not with_parent.complete


# --- the report ------------------------------------------------------------------------------------
def test_to_json_shape(chain, tmp_path):
    report = validate(flipped(tmp_path, chain.parent, frame_checksum_offsets(chain.parent)[0]))
    out = json.loads(json.dumps(report.to_json()))
    assert set(out) == {
        "path",
        "valid",
        "complete",
        "findings",
        "suppressed",
        "checked",
        "not_checked",
        "not_checked_reasons",
    }
    assert out["valid"] is False and out["path"] == report.path
    assert all(set(f) == {"rule", "offset", "structure", "message"} for f in out["findings"])
    assert [f["rule"] for f in out["findings"]] == [f.rule for f in report.findings]
    assert out["checked"] == dict(report.checked) and out["not_checked"] == report.not_checked == []
    assert out["not_checked_reasons"] == [] and out["complete"] is True


def test_report_keeps_findings_per_rule_and_counts_the_rest():
    report = Report("x.lean")
    for k in range(FINDINGS_PER_RULE + 5):
        report.add(FormatError(f"page {k}", rule="LI-DIG-002", structure=f"region[0].page[{k}]"))
    report.add(FormatError("other", rule="LI-REC-003", offset=8))
    assert [f.rule for f in report.findings] == ["LI-DIG-002"] * FINDINGS_PER_RULE + ["LI-REC-003"]
    assert report.suppressed == {"LI-DIG-002": 5} and report.to_json()["suppressed"] == {"LI-DIG-002": 5}
    assert not report.valid


def test_report_names_findings_without_a_rule():
    report = Report("x.lean")
    report.add(LimitError("too big", offset=24))
    report.add(LeanImageError("cannot read"))
    assert [(f.rule, f.offset, f.structure) for f in report.findings] == [("reader-limit", 24, ""), ("io", None, "")]


def test_many_wrong_digests_are_suppressed_past_the_limit(tmp_path):
    mv = make_vectors()
    n = FINDINGS_PER_RULE + 5
    data = write_bytes(
        lambda w: w.put_pages(
            w.add_region("ram", n * PS), 0, np.random.default_rng(3).integers(1, 255, n * PS, np.uint8).tobytes()
        )
    )
    lean = mv.Lean.parse(data)
    mv.rewrite_body(lean, lean.find(RecordType.DIGESTS), lambda b: b[:24] + bytes(len(b) - 24))
    path = tmp_path / "digests.lean"
    path.write_bytes(lean.build())
    report = validate(path)
    assert [f.rule for f in report.findings] == ["LI-DIG-002"] * FINDINGS_PER_RULE
    assert report.suppressed == {"LI-DIG-002": 5}
    assert report.findings[0].structure == "region[0].page[0]"


def test_validate_a_missing_file(tmp_path):
    report = validate(tmp_path / "missing.lean")
    assert [(f.rule, f.offset) for f in report.findings] == [("io", None)]
    assert "cannot open" in report.findings[0].message


# --- findings ----------------------------------------------------------------------------------------
def test_finding_str_is_the_conformance_line():
    finding = Finding("LI-REC-003", 0xD8, "record[1].page_frame.record_checksum", "expected 0x1, got 0x2")
    assert str(finding) == "LI-REC-003 offset 0xd8 record[1].page_frame.record_checksum: expected 0x1, got 0x2"
    about_no_place = Finding("LI-MAP-004", None, "page_map", "2 pages use stored ordinals and 0 exist")
    assert str(about_no_place) == "LI-MAP-004 offset - page_map: 2 pages use stored ordinals and 0 exist"


def test_findings_of_a_damaged_image_are_conformance_lines(chain, tmp_path):
    at = frame_checksum_offsets(chain.parent)[1]
    report = validate(flipped(tmp_path, chain.parent, at))
    assert report.findings and all(FINDING_LINE.match(str(f)) for f in report.findings)
    first = report.findings[0]
    assert (first.rule, first.offset, first.structure) == ("LI-REC-003", at, "record[2].page_frame.record_checksum")
    assert re.fullmatch(r"expected record_checksum 0x[0-9a-f]{16}, got 0x[0-9a-f]{16}", first.message)


def test_validate_goes_on_past_the_first_damage(chain, tmp_path):
    offsets = frame_checksum_offsets(chain.parent)
    report = validate(flipped(tmp_path, chain.parent, offsets[0], offsets[4]))
    damaged = [f.offset for f in report.findings if f.rule == "LI-REC-003"]
    assert damaged == [offsets[0], offsets[4]]


def test_image_digest_is_checked_by_validate_only(chain, tmp_path):
    size = chain.parent.stat().st_size
    path = flipped(tmp_path, chain.parent, size - FOOTER.size + FOOTER.offset("image_digest"))
    path.write_bytes(_with_footer_checksum(path.read_bytes()))
    with LeanImage.open(path) as image:  # the reader does not read the whole file to open it
        assert image.read_page("ram", 0) == chain.parent_content["ram"][:PS]
    assert [(f.rule, f.structure) for f in validate(path).findings] == [("LI-FTR-004", "footer.image_digest")]


def _with_footer_checksum(data: bytes) -> bytes:
    from leanimg.structures import footer_checksum

    footer = data[-FOOTER.size :]
    return data[:-8] + footer_checksum(footer).to_bytes(8, "little")


def test_a_malformed_delta_entry_is_located_alike_with_or_without_its_parent():
    from helpers import VECTORS_DIR

    vector = VECTORS_DIR / "invalid" / "dlt-002-encoding.lean"
    alone = [str(f) for f in validate(vector).findings]
    with_parent = [str(f) for f in validate(vector, parents=[VECTORS_DIR / "valid" / "parent.lean"]).findings]
    assert alone == [
        "LI-DLT-002 offset 0x190 record[2].delta_frame.entries[0]: expected encoding 1-3 and "
        "num_words >= 1, got encoding 4, num_words 3"
    ]
    assert with_parent == alone
