"""Opening a chain's links ahead, many at once (links_batch.open_links): the header, footer and
INDEX of each tested together. It may only *accept* quickly: a link it opens must be exactly
the link open_link(check=False) opens, and any file open_link refuses it must leave alone
(the walk then opens it with open_link, which raises the finding)."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from leanimg import links_batch
from leanimg.errors import LeanImageError
from leanimg.format import FOOTER, HEADER, INDEX_BODY, RECORD, checksum64
from leanimg.parents import CHECK_BATCH
from leanimg.reader import WHOLE_READ_BELOW, LeanImage

from helpers import fds_before, open_fds, run_leanimg
from test_chain_open import LINKS, _write_chain, finding, open_alone, relink, reseal

pytestmark = pytest.mark.usefixtures("small_batches")


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    directory = tmp_path_factory.mktemp("links-ahead")
    paths, memory = _write_chain(directory)
    return paths, memory


def _alone(path: Path):
    """What open_link(check=False) gives: the finding, or the link's header, footer and INDEX."""
    try:
        link = LeanImage.open_link(str(path), check=False)
    except LeanImageError as exc:
        return (type(exc).__name__, exc.rule, exc.offset, exc.structure), None
    with link:
        return None, _tables(link)


def _tables(link: LeanImage) -> tuple:
    t = link.tables
    index = t.index
    parsed = {k: (v.tobytes() if isinstance(v, np.ndarray) else v) for k, v in index.parsed.items()}
    return (
        link.path,
        t.file.name,
        t.file.size,
        t.file._whole,
        link.header.__dict__,
        link.footer.__dict__,
        (
            index.offset,
            index.record_type,
            index.flags,
            index.body_length,
            index.record_checksum,
            bytes(index.body),
            index.index,
        ),
        parsed,
        index.parsed["entries"].dtype,
        [
            (a.dtype.str, a.tobytes())
            for table in (t.page_frames, t.delta_frames)
            for a in (table.starts, table.counts, table.positions)
        ],
        type(link.fileobj),
    )


def _sealed(data: bytes, index_offset: int) -> bytes:
    """``data`` with the header's, the INDEX's (ending at the footer) and the footer's checksums
    made right again (the edit then reaches the rules behind them)."""
    b = bytearray(data)
    at, end = HEADER.offset("header_checksum"), len(b) - FOOTER.size
    struct.pack_into("<Q", b, at, 0)
    struct.pack_into("<Q", b, at, checksum64(bytes(b[: HEADER.size])))
    struct.pack_into("<Q", b, end - 8, checksum64(bytes(b[index_offset : end - 8])))
    at = end + FOOTER.offset("footer_checksum")
    struct.pack_into("<Q", b, at, checksum64(bytes(b[end:at])))
    return bytes(b)


def _spans(path: Path) -> list[tuple[int, int]]:
    """The bytes open_link(check=False) reads: header, footer, INDEX record."""
    size = path.stat().st_size
    with LeanImage.open_link(path) as link:
        index_offset = link.footer.index_offset
    return [(0, HEADER.size), (size - FOOTER.size, size), (index_offset, size - FOOTER.size)]


def test_a_link_opened_ahead_is_the_link_open_link_opens(chain):
    paths, _ = chain
    names = [str(p) for p in paths[1:9]]
    opened = LeanImage.open_links(names)
    try:
        assert sorted(opened) == sorted(names)
        for name in names:
            assert _tables(opened[name]) == _alone(Path(name))[1]
    finally:
        for link in opened.values():
            link.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_edit_is_accepted_ahead_only_as_open_link_accepts_it(chain, tmp_path_factory, data):
    """A byte of a link's header, footer or INDEX set to any value (checksums made right again,
    or not): open_links either leaves the file alone or opens exactly what open_link opens,
    and it never opens a file open_link refuses."""
    paths, _ = chain
    source = paths[data.draw(st.integers(1, 6), label="link")]
    target = tmp_path_factory.mktemp("edited") / source.name
    spoiled = bytearray(source.read_bytes())
    start, end = data.draw(st.sampled_from(_spans(source)), label="part")
    at = data.draw(st.integers(start, end - 1) | st.integers(start, start + 31), label="offset")  # heads often
    spoiled[at] = data.draw(st.integers(0, 255), label="value")
    sealed = data.draw(st.booleans(), label="resealed")
    target.write_bytes(_sealed(bytes(spoiled), _spans(source)[2][0]) if sealed else bytes(spoiled))
    alone = _alone(target)
    opened = LeanImage.open_links([str(target)])
    try:
        if str(target) in opened:
            event("opened ahead")
            assert alone[0] is None and _tables(opened[str(target)]) == alone[1]
        else:
            event("left to open_link: " + ("refused" if alone[0] else "opened"))
    finally:
        for link in opened.values():
            link.close()


def test_files_open_link_would_not_read_whole_are_left_alone(chain, tmp_path):
    paths, _ = chain
    short = tmp_path / "short.lean"
    short.write_bytes(paths[1].read_bytes()[: HEADER.size])
    large = tmp_path / "large.lean"
    large.write_bytes(bytes(WHOLE_READ_BELOW))
    names = [str(short), str(large), str(tmp_path / "missing.lean"), str(paths[1])]
    assert sorted(links_batch.open_links(names, WHOLE_READ_BELOW)) == [str(paths[1])]
    assert links_batch.open_links([str(paths[1])], paths[1].stat().st_size) == {}


@pytest.mark.usefixtures("fast_paths_alone")
def test_a_deep_chain_is_opened_ahead(chain, monkeypatch):
    """Only the image itself goes through open_link; its links are opened ahead."""
    paths, memory = chain
    alone = []
    real = LeanImage.open_link.__func__
    monkeypatch.setattr(
        LeanImage, "open_link", classmethod(lambda cls, path, **kw: alone.append(path) or real(cls, path, **kw))
    )
    with LeanImage.open(paths[-1]) as image:
        assert [link.path for link in image.chain()] == [str(p) for p in reversed(paths)]
    assert alone == [paths[-1]]


def test_links_opened_ahead_and_not_used_are_closed(chain, copy, tmp_path):
    """Links opened ahead that the walk does not take (it stops at an error, or at an open
    parent, which brings its own chain) leave no file open."""
    paths, _ = chain
    copies, _ = copy
    before = fds_before()
    data = bytearray(copies[LINKS - 20].read_bytes())
    data[HEADER.offset("page_size")] ^= 1  # refused at the header, checksum made right
    copies[LINKS - 20].write_bytes(reseal(bytes(data)))
    expected = finding(open_alone, copies[-1])
    assert expected[1] == "LI-HDR-006" and expected[4] == str(copies[LINKS - 20])
    assert finding(LeanImage.open, copies[-1]) == expected
    assert open_fds() == before
    given = LeanImage.open(paths[LINKS - 5])  # an open parent brings its own chain
    with LeanImage.open(paths[-1], parents=[given]) as image:
        assert image.chain()[4] is given and len(image.chain()) == LINKS
    assert open_fds() == before


@pytest.mark.parametrize(
    "field, value, rule",
    [
        ("magic", b"\x89LEANIMX", "LI-HDR-001"),
        ("major_version", struct.pack("<H", 2), "LI-HDR-002"),
        ("reserved", struct.pack("<I", 1), "LI-HDR-007"),
        ("page_size", struct.pack("<I", 2048), "LI-HDR-006"),
        ("header_length", struct.pack("<I", HEADER.size + 8), "LI-HDR-004"),
    ],
)
@pytest.mark.parametrize("bad", [1, CHECK_BATCH - 1, CHECK_BATCH, LINKS - 2])
def test_a_link_with_a_bad_header_is_refused_as_when_opened_alone(chain, copy, tmp_path, field, value, rule, bad):
    paths, _ = chain
    copies, _ = copy
    data = bytearray(copies[bad].read_bytes())
    at = HEADER.offset(field)
    data[at : at + len(value)] = value
    copies[bad].write_bytes(_sealed(bytes(data), _spans(paths[bad])[2][0]) if field != "magic" else bytes(data))
    relink(copies, bad + 1)
    expected = finding(open_alone, copies[-1])
    assert expected[1] == rule and expected[4] == str(copies[bad])
    assert finding(LeanImage.open, copies[-1]) == expected


def test_a_bad_index_record_deep_down_is_refused_as_when_opened_alone(chain, copy, tmp_path):
    paths, _ = chain
    copies, _ = copy
    bad = CHECK_BATCH + 3
    with LeanImage.open_link(copies[bad]) as link:
        at = link.footer.index_offset + RECORD.size + INDEX_BODY.offset("reserved")
    data = bytearray(copies[bad].read_bytes())
    data[at] = 1
    copies[bad].write_bytes(reseal(bytes(data)))
    relink(copies, bad + 1)
    expected = finding(open_alone, copies[-1])
    assert expected[1] == "LI-REC-008" and expected[4] == str(copies[bad])
    assert finding(LeanImage.open, copies[-1]) == expected


def test_every_head_byte_changed_is_accepted_ahead_only_as_open_link_accepts_it(chain, tmp_path):
    """Each byte of the header, the footer and the INDEX's record header and body head, flipped
    in its low or high bit, checksums made right again or not: as the property test above,
    byte by byte."""
    paths, _ = chain
    source = paths[3]
    original = source.read_bytes()
    header, footer, index = _spans(source)
    offsets = [*range(*header), *range(*footer), *range(index[0], index[0] + RECORD.size + INDEX_BODY.size)]
    target = tmp_path / source.name
    outcomes = set()
    for at in offsets:
        for bit in (0x01, 0x80):
            spoiled = bytearray(original)
            spoiled[at] ^= bit
            for data in (bytes(spoiled), _sealed(bytes(spoiled), index[0])):
                target.write_bytes(data)
                alone = _alone(target)
                opened = LeanImage.open_links([str(target)])
                try:
                    if str(target) in opened:
                        assert alone[0] is None and _tables(opened[str(target)]) == alone[1], at
                        outcomes.add("opened ahead")
                    else:
                        outcomes.add("refused" if alone[0] else "left alone")
                finally:
                    for link in opened.values():
                        link.close()
    assert "opened ahead" in outcomes and "refused" in outcomes


def _cut_by_one(data: bytes, index_at: int) -> bytes:
    return data[:-1]


def _cut_to_header(data: bytes, index_at: int) -> bytes:
    return data[: HEADER.size]


def _index_body_huge(data: bytes, index_at: int) -> bytes:
    b = bytearray(data)
    struct.pack_into("<Q", b, index_at + RECORD.offset("body_length"), 1 << 62)
    return _sealed(bytes(b), index_at)


def _file_length_huge(data: bytes, index_at: int) -> bytes:
    b = bytearray(data)
    struct.pack_into("<Q", b, len(b) - FOOTER.size + FOOTER.offset("file_length"), 1 << 62)
    return _sealed(bytes(b), index_at)


@pytest.mark.parametrize("spoil", [_cut_by_one, _cut_to_header, _index_body_huge, _file_length_huge])
def test_a_cut_or_lying_link_deep_down_is_refused_as_when_opened_alone(chain, copy, tmp_path, spoil):
    """A link cut short, or whose INDEX or footer declares a huge size, past the first batch
    opened ahead: LeanImage.open reports it as opening each link alone does, and `leanimg
    restore` says so in one error line (and perhaps a hint) and writes nothing."""
    paths, _ = chain
    copies, _ = copy
    bad = CHECK_BATCH + 5
    copies[bad].write_bytes(spoil(copies[bad].read_bytes(), _spans(paths[bad])[2][0]))
    expected = finding(open_alone, copies[-1])
    assert expected[4] == str(copies[bad]) and expected[1], expected
    assert finding(LeanImage.open, copies[-1]) == expected
    out = tmp_path / "out.raw"
    proc = run_leanimg("restore", copies[-1], "--to", "raw", "-o", out, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("leanimg: hint:")]
    assert proc.returncode != 0 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert errors[0].startswith("leanimg: error:") and copies[bad].name in errors[0], errors
    assert expected[1] in errors[0], (expected, errors)
    assert not out.exists()
