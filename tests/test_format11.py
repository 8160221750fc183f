"""Format 1.1 (spec §3.4 INHERITED_DIGESTS): a child's PARENT pages carry no stored digest,
so a link's size follows what changed; a 1.0 reader refuses such a child at its header; 1.0
and 1.1 links mix in one chain."""

from __future__ import annotations

import numpy as np
import pytest

import leanimg.structures
from leanimg.errors import FormatError
from leanimg.format import DIGESTS_BODY, IncompatFeature, PageClass, RecordType, record_size
from leanimg.incremental import AgainstParent, parent_link
from leanimg.reader import LeanImage
from leanimg.structures import dump_structure
from leanimg.validate import validate
from leanimg.writer import LeanImageWriter

from test_chain import build_chain, raw

PS = 4096


def _write(path, mem: bytes, parent: LeanImage | None = None, **kw) -> None:
    with LeanImageWriter(path, parent=parent_link(parent) if parent else None, frame_pages=64, **kw) as w:
        region = w.add_region("pc.ram", len(mem), 0)
        AgainstParent(w, parent).put_pages(region, "pc.ram", 0, mem)


def _digest_bytes(path) -> int:
    """Bytes of the DIGESTS records of an image (record framing included)."""
    return sum(
        record_size(r["body_length"]) for r in dump_structure(path)["records"] if r["record_type"] == RecordType.DIGESTS
    )


def _child_digest_bytes(tmp_path, pages: int, changed: int, **kw) -> int:
    rng = np.random.default_rng(pages + changed)
    mem = bytearray(rng.bytes(pages * PS))
    _write(tmp_path / "base.lean", bytes(mem))
    for page in rng.choice(pages, changed, replace=False).tolist():
        mem[page * PS] ^= 0xFF  # one byte: a DELTA page
    child = tmp_path / f"child-{pages}-{changed}-{sorted(kw.items())}.lean"
    with LeanImage.open(tmp_path / "base.lean") as base:
        _write(child, bytes(mem), base, **kw)
    with LeanImage.open(child, parents=[tmp_path / "base.lean"]) as image:
        assert np.count_nonzero(image.classes(image.regions[0]) == PageClass.DELTA) == changed
    return _digest_bytes(child)


def test_a_1_1_childs_digests_grow_with_the_changed_pages_not_the_guest(tmp_path):
    """N changed pages of M: DIGESTS hold 16 bytes per changed page plus a constant, whatever M."""
    small = _child_digest_bytes(tmp_path, pages=1024, changed=8)
    large = _child_digest_bytes(tmp_path, pages=16384, changed=8)
    more = _child_digest_bytes(tmp_path, pages=16384, changed=64)
    overhead = record_size(DIGESTS_BODY.size)  # one record without digests
    assert small == large == overhead + 16 * 8
    assert more == overhead + 16 * 64
    as_1_0 = _child_digest_bytes(tmp_path, pages=16384, changed=8, inherit_digests=False)
    assert as_1_0 >= 16 * 16384  # 1.0: one digest per PARENT page too


def test_a_1_0_reader_refuses_a_1_1_child_at_its_header(tmp_path, monkeypatch):
    """A reader that knows only the bits of 1.0 (0x7) refuses the INHERITED_DIGESTS bit (LI-HDR-005)
    before reading any record, and still reads the 1.0 parent."""
    paths, _ = build_chain(tmp_path, 1)
    monkeypatch.setattr(
        leanimg.structures, "KNOWN_INCOMPAT", int(IncompatFeature.PARENT | IncompatFeature.DISK | IncompatFeature.DELTA)
    )
    with LeanImage.open(paths[0]) as parent:
        assert parent.header.minor_version == 0
    with pytest.raises(FormatError) as info:
        LeanImage.open(paths[1], parents=[paths[0]])
    assert info.value.rule == "LI-HDR-005" and info.value.structure == "header.incompatible_features"


def test_1_0_and_1_1_links_mix_in_one_chain(tmp_path):
    """base (1.0) <- child as 1.0 <- grandchild 1.1 <- great-grandchild 1.1: every link restores
    bit-exactly and validates, and AgainstParent classifies against a 1.1 parent by its inherited digests."""
    rng = np.random.default_rng(3)
    mem = bytearray(rng.bytes(96 * PS))
    paths, memories, parent = [], [], None
    for k, inherit in enumerate([None, False, True, True]):
        if k:
            for page in rng.choice(96, 5, replace=False).tolist():
                mem[page * PS + 8 * k] ^= 0x5A
        path = tmp_path / f"mixed{k}.lean"
        _write(path, bytes(mem), parent, inherit_digests=inherit)
        if parent is not None:
            parent.close()
        parent = LeanImage.open(path, parents=paths[-1:])
        paths.append(path)
        memories.append(bytes(mem))
    parent.close()
    for k, path in enumerate(paths):
        with LeanImage.open(path, parents=paths[:k]) as image:
            inherits = bool(image.header.incompatible_features & IncompatFeature.INHERITED_DIGESTS)
            assert inherits == (k >= 2) and image.header.minor_version == int(k >= 2)
            counts = np.bincount(image.classes(image.regions[0]), minlength=7)
            if k:
                assert counts[PageClass.PARENT] >= 96 - 5 * k and counts[PageClass.DELTA] >= 1
        assert raw(path, paths[:k]) == memories[k]
        report = validate(path, parents=paths[:k])
        assert report.valid, [str(f) for f in report.findings]


def test_validate_says_inherited_digests_are_not_checked_without_the_parent(tmp_path):
    paths, _ = build_chain(tmp_path, 1)
    report = validate(paths[1])
    assert report.valid and "LI-CHN-006" in report.not_checked
    assert any("LI-CHN-006" in note for note in report.not_checked_reasons)


def test_reading_an_inherited_digest_without_the_parent_says_so(tmp_path):
    paths, _ = build_chain(tmp_path, 1)
    with LeanImage.open_link(paths[1]) as link:
        region = link.regions[0]
        page = int(np.flatnonzero(link.classes(region) == PageClass.PARENT)[0])
        with pytest.raises(Exception, match="inherits its digest"):
            link.expected_digest(region, page)


def test_inspect_names_the_format_version_and_the_inherited_digests_bit(tmp_path):
    from leanimg.inspect import render_text, summarize

    paths, _ = build_chain(tmp_path, 1)
    with LeanImage.open(paths[0]) as parent, LeanImage.open(paths[1], parents=[paths[0]]) as child:
        assert summarize(parent)["format_version"] == "1.0"
        summary = summarize(child)
        assert summary["format_version"] == "1.1" and "INHERITED_DIGESTS" in summary["incompatible_features"]
        assert "lean image v1.1" in render_text(summary)


def test_deep_1_1_chain_restores_bit_exact(tmp_path):
    paths, memories = build_chain(tmp_path, 12)
    for k in (1, 6, 12):
        assert raw(paths[k], paths[:k]) == memories[k]
