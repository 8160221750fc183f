"""The parser generated from ksy/leanimg.ksy agrees with leanimg's reader.

Every valid test vector and a range of writer-made images are parsed by both;
the Kaitai object, turned into the dict shape of ``dump_structure()``, must be
equal to it field by field. The .ksy's ``valid:`` keys must reject what the
spec forbids.

Needs node and npm (kaitai-struct-compiler from npm, see kaitai_support.py):
without them the tests are skipped, or fail when CI=true.
"""

from __future__ import annotations

import os
import re
import struct
import tempfile
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kaitaistruct
from kaitaistruct import KaitaiStream

import kaitai_support as ks
from leanimg import delta as deltacodec
from leanimg.format import (
    FOOTER,
    HEADER,
    RECORD,
    DeltaEncoding,
    PageClass,
    RecordType,
    SourceFormat,
    page_digest,
)
from leanimg.structures import dump_structure
from leanimg.writer import LeanImageWriter, ParentLink

pytestmark = pytest.mark.kaitai

VALID_VECTORS = sorted((ks.TESTS_DIR / "vectors" / "valid").glob("*.lean"))


@pytest.fixture(scope="session")
def generated(tmp_path_factory):
    """The Python module generated from ksy/leanimg.ksy (compiled once per session)."""
    return ks.generated_parser_for_tests(tmp_path_factory.mktemp("kaitai"))


@pytest.fixture(scope="session")
def Leanimg(generated):
    return generated.Leanimg


# --- comparing the two parsers ------------------------------------------------


def delta_positions(entry, page_size: int) -> list[int]:
    """Changed word positions of a Kaitai-parsed delta entry."""
    if entry.encoding == DeltaEncoding.INDEX_LIST:
        return list(entry.word_indexes)
    if entry.encoding == DeltaEncoding.BITMAP:
        bits = np.unpackbits(np.frombuffer(entry.bitmap, np.uint8), bitorder="little")
        return [int(i) for i in np.flatnonzero(bits)]
    return [run.start_word + k for run in entry.runs for k in range(run.run_length)]


def check_delta_entries(Leanimg, image, page_size: int) -> None:
    """Each DELTA_FRAME entry parses as delta_entry, exactly, and means what leanimg.delta says."""
    for record in image.records:
        if record.record_type != RecordType.DELTA_FRAME:
            continue
        body = record.body
        content = zstandard.ZstdDecompressor().decompress(_substream_bytes(body.frame._io))
        offsets = body.entry_offsets
        assert len(content) == offsets[-1]
        for i in range(body.num_deltas):
            raw = content[offsets[i] : offsets[i + 1]]
            entry = Leanimg.DeltaEntry(page_size, KaitaiStream(kaitaistruct.BytesIO(raw)))
            assert entry._io.is_eof(), f"delta entry {body.first_delta + i}: bytes left after parsing"
            page = np.zeros(page_size // 8, "<u8")
            page[delta_positions(entry, page_size)] = entry.values
            assert deltacodec.apply(raw, bytes(page_size)) == page.tobytes()


def _substream_bytes(io: KaitaiStream) -> bytes:
    io.seek(0)
    return io.read_bytes_full()


def check_image(Leanimg, path) -> None:
    image = Leanimg.from_file(os.fspath(path))
    ks.assert_agrees_with_reader(image, path)
    index = image.records[-1]
    assert image.footer.index.body_length == index.body_length
    for entry in index.body.entries:
        assert entry.record.record_type == entry.record_type
    check_delta_entries(Leanimg, image, image.header.page_size)


# --- the compiler and the .ksy itself -------------------------------------------


def test_ksy_compiles(generated):
    assert hasattr(generated, "Leanimg")


def test_ksy_style():
    """The conventions of STYLE.md that a reader of the .ksy relies on."""
    yaml = pytest.importorskip("yaml")
    text = ks.KSY_PATH.read_text(encoding="utf-8")
    spec = yaml.safe_load(text)
    assert list(spec) == ["meta", "doc", "doc-ref", "seq", "instances", "types", "enums"]
    assert spec["meta"]["id"] == "leanimg"
    assert spec["meta"]["file-extension"] == "lean"
    assert spec["meta"]["endian"] == "le"
    for name, body in spec["types"].items():
        assert "doc-ref" in body, f"type {name} has no doc-ref"
    enum_keys = re.findall(r"^ {4}(\S+):", text.split("\nenums:\n", 1)[1], re.MULTILINE)
    assert enum_keys and all(key.startswith("0x") for key in enum_keys)
    assert set(spec["enums"]["record_type"].keys()) == {int(t) for t in RecordType}
    assert set(spec["enums"]["page_class"].keys()) == {int(c) for c in PageClass}
    assert set(spec["enums"]["delta_encoding"].keys()) == {int(e) for e in DeltaEncoding}
    assert set(spec["enums"]["source_format"].keys()) == {int(f) for f in SourceFormat}
    assert not re.search(r"^\s*#\s*- id:", text, re.MULTILINE), "commented-out field"


# --- valid vectors ----------------------------------------------------------------


def test_valid_vectors_present():
    assert VALID_VECTORS, "tests/vectors/valid/*.lean matched nothing"


@pytest.mark.parametrize("path", VALID_VECTORS, ids=[p.name for p in VALID_VECTORS])
def test_valid_vector(Leanimg, path):
    check_image(Leanimg, path)


# --- writer-made images ------------------------------------------------------------


def _pages(seed: int, count: int, page_size: int) -> bytes:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, count * page_size, dtype=np.uint8)
    data[::7] = 0  # compressible but not zero
    return data.tobytes()


def write_minimal(path, page_size=4096):
    with LeanImageWriter(path, page_size=page_size) as w:
        rid = w.add_region("pc.ram", page_size)
        w.put_pages(rid, 0, _pages(1, 1, page_size))


def write_mixed(path, page_size=4096, frame_pages=256):
    with LeanImageWriter(path, page_size=page_size, frame_pages=frame_pages) as w:
        did = w.add_disk("vda", 64 << 20, bytes(range(16)))
        w.add_source_state(SourceFormat.QEMU, 1, b"QEVM\0\0\0\3")
        w.add_source_state(SourceFormat.QEMU, 2, b"device section" * 50)
        ram = w.add_region("pc.ram", 600 * page_size, guest_phys_base=0)
        vram = w.add_region("vga.vram", 16 * page_size)
        w.put_pages(ram, 0, _pages(2, 300, page_size))
        w.put_zero(ram, 300, 100)
        w.put_free(ram, 400, 50)
        for k in range(20):
            w.put_disk(ram, 450 + k, did, 8 * k, page_digest(bytes([k]) * page_size))
        w.put_pages(ram, 470, bytes(page_size) + _pages(3, 129, page_size))
        w.put_pages(vram, 0, _pages(4, 8, page_size))
        w.put_free(vram, 8, 8)


# changed words of the child's pages, so that every delta encoding gets used:
# one word or a few scattered (INDEX_LIST), many scattered (BITMAP), a run (RUNS)
CHANGED_WORDS = [[3], list(range(0, 64, 5)), list(range(0, 512, 3)), list(range(100, 140))]


def write_child(path, page_size=4096, inherit_digests=True):
    """A child with PARENT, DELTA and STORED pages: format 1.1 (inherited digests) or 1.0."""
    parent_pages = [_pages(10 + i, 1, page_size) for i in range(64)]
    link = ParentLink(uuid=bytes(range(16)), digest=bytes(range(16, 32)))
    with LeanImageWriter(path, page_size=page_size, parent=link, frame_pages=8, inherit_digests=inherit_digests) as w:
        w.declare_source_state()
        ram = w.add_region("pc.ram", 64 * page_size)
        w.add_source_state(SourceFormat.XEN, 7, b"xen record")
        w.put_parent(ram, 0, b"".join(page_digest(p) for p in parent_pages[:16]))
        for page in range(16, 48):
            new = bytearray(parent_pages[page])
            for word in CHANGED_WORDS[page % len(CHANGED_WORDS)]:
                new[word * 8 : (word + 1) * 8] = struct.pack("<Q", page * 1000 + word + 1)
            w.put_changed(ram, page, parent_pages[page], bytes(new))
        w.put_pages(ram, 48, _pages(99, 16, page_size))


WRITERS = {
    "minimal": write_minimal,
    "minimal-64k": lambda p: write_minimal(p, page_size=65536),
    "mixed": write_mixed,
    "mixed-small-frames": lambda p: write_mixed(p, frame_pages=1),
    "mixed-16k": lambda p: write_mixed(p, page_size=16384, frame_pages=7),
    "child-with-deltas": write_child,
    "child-with-deltas-1.0": lambda p: write_child(p, inherit_digests=False),
}


@pytest.mark.parametrize("name", WRITERS)
def test_writer_image(Leanimg, tmp_path, name):
    path = tmp_path / f"{name}.lean"
    WRITERS[name](path)
    check_image(Leanimg, path)


def test_writer_image_has_every_record_type(Leanimg, tmp_path):
    """The writer-made images above exercise every body type of the .ksy."""
    seen = set()
    for name, write in WRITERS.items():
        path = tmp_path / f"{name}.lean"
        write(path)
        seen |= {rec.record_type for rec in Leanimg.from_file(os.fspath(path)).records}
    assert seen >= {Leanimg.RecordType[t.name.lower()] for t in RecordType}


@settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_writer_random_layout(Leanimg, data):
    page_size = data.draw(st.sampled_from([4096, 8192]), label="page_size")
    frame_pages = data.draw(st.integers(1, 16), label="frame_pages")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "random.lean"
        with LeanImageWriter(path, page_size=page_size, frame_pages=frame_pages) as w:
            for r in range(data.draw(st.integers(1, 3), label="regions")):
                pages = data.draw(st.integers(1, 40), label="pages")
                rid = w.add_region(f"region{r}", pages * page_size)
                page = 0
                while page < pages:
                    run = data.draw(st.integers(1, pages - page), label="run")
                    kind = data.draw(st.sampled_from(["stored", "zero", "free"]), label="kind")
                    if kind == "stored":
                        w.put_pages(rid, page, _pages(page, run, page_size))
                    elif kind == "zero":
                        w.put_zero(rid, page, run)
                    else:
                        w.put_free(rid, page, run)
                    page += run
        check_image(Leanimg, path)


# --- what valid: must reject -------------------------------------------------------


@pytest.fixture
def image_bytes(tmp_path) -> bytes:
    path = tmp_path / "mixed.lean"
    write_mixed(path)
    return path.read_bytes()


def _mutated(data: bytes, offset: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


def test_rejects_wrong_header_magic(Leanimg, image_bytes):
    bad = b"\x89LEANIMX" + image_bytes[8:]
    with pytest.raises(kaitaistruct.ValidationNotEqualError) as info:
        Leanimg.from_bytes(bad)
    assert info.value.src_path == "/types/header/seq/0"


def test_rejects_wrong_footer_magic(Leanimg, image_bytes):
    end = len(image_bytes) - FOOTER.size
    bad = image_bytes[:end] + b"\x89LEANENX" + image_bytes[end + 8 :]
    with pytest.raises(kaitaistruct.ValidationNotEqualError):
        Leanimg.from_bytes(bad)


FIRST_RECORD = HEADER.size  # the writer writes a 104-byte header (1.0 and 1.1)


@pytest.mark.parametrize(
    "offset, fmt, value, error",
    [
        (8, "<H", 2, kaitaistruct.ValidationNotEqualError),  # major_version
        (12, "<I", 100, kaitaistruct.ValidationExprError),  # header_length too short
        (12, "<I", 108, kaitaistruct.ValidationExprError),  # not a multiple of 8
        (16, "<Q", 1 << 4, kaitaistruct.ValidationGreaterThanError),  # unknown incompatible bit (1.1 knows 0-3)
        (88, "<I", 4097, kaitaistruct.ValidationNotAnyOfError),  # page_size
        (92, "<I", 1, kaitaistruct.ValidationNotEqualError),  # reserved
        (FIRST_RECORD, "<I", 0x99, kaitaistruct.ValidationExprError),  # unknown mandatory type
        (FIRST_RECORD + 4, "<I", 1, kaitaistruct.ValidationNotEqualError),  # record flags
    ],
    ids=[
        "major",
        "header-length-short",
        "header-length-unaligned",
        "incompat-bit",
        "page-size",
        "header-reserved",
        "unknown-mandatory-record",
        "record-flags",
    ],
)
def test_rejects_invalid_field(Leanimg, image_bytes, offset, fmt, value, error):
    with pytest.raises(error):
        Leanimg.from_bytes(_mutated(image_bytes, offset, fmt, value))


def test_skips_unknown_optional_record(Leanimg, image_bytes):
    """An optional record of an unknown type parses as raw bytes."""
    _, _, length = RECORD.struct.unpack_from(image_bytes, FIRST_RECORD)
    bad = _mutated(image_bytes, FIRST_RECORD, "<I", 0x8000_0099)
    first = Leanimg.from_bytes(bad).records[0]
    assert first.record_type == 0x8000_0099 and first.is_optional
    assert isinstance(first.body, bytes) and len(first.body) == length


def test_rejects_trailing_bytes(Leanimg, image_bytes):
    with pytest.raises(kaitaistruct.ValidationExprError):
        Leanimg.from_bytes(image_bytes + bytes(8))


def _first_record_of(dump: dict, record_type: RecordType) -> dict:
    return next(r for r in dump["records"] if r["record_type"] == record_type)


@pytest.mark.parametrize("num_pages", [0, 1], ids=["zero", "below-num-digests"])
def test_rejects_digests_num_pages(Leanimg, tmp_path, num_pages):
    """DIGESTS: num_pages >= 1 and num_digests <= num_pages (spec §6.5, LI-REC-007)."""
    path = tmp_path / "mixed.lean"
    write_mixed(path)
    digests = _first_record_of(dump_structure(path), RecordType.DIGESTS)
    assert digests["body"]["num_digests"] > 1
    bad = _mutated(path.read_bytes(), digests["offset"] + 16 + 16, "<Q", num_pages)
    with pytest.raises(kaitaistruct.ValidationExprError):
        Leanimg.from_bytes(bad)


def test_digests_hold_only_digest_bearing_pages(Leanimg, tmp_path):
    """The mixed image's FREE and ZERO pages take no room in its DIGESTS records."""
    path = tmp_path / "mixed.lean"
    write_mixed(path)
    image = Leanimg.from_file(os.fspath(path))
    bearing = {PageClass.STORED, PageClass.DISK, PageClass.PARENT, PageClass.DELTA}
    counts = {}
    for rec in image.records:
        if rec.record_type == Leanimg.RecordType.page_map:
            for e in rec.body.extents:
                if e.page_class.value in bearing:
                    counts[rec.body.region_id] = counts.get(rec.body.region_id, 0) + e.num_pages
    stored = {}
    for rec in image.records:
        if rec.record_type == Leanimg.RecordType.digests:
            assert len(rec.body.digests) == rec.body.num_digests <= rec.body.num_pages
            stored[rec.body.region_id] = stored.get(rec.body.region_id, 0) + rec.body.num_digests
    assert stored == counts
