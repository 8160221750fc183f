"""Unit tests of leanimg.writer.LeanImageWriter: what each put_* call makes of the pages, the
usage errors, atomic creation of a path destination, and build_extents."""

from __future__ import annotations

import io
import os
from contextlib import contextmanager

import numpy as np
import pytest

from helpers import write_bytes
from leanimg.fileutil import umask
from leanimg.format import (
    EXTENT,
    CompatFeature,
    IncompatFeature,
    PageClass,
    page_digest,
)
from leanimg.reader import LeanImage
from leanimg.writer import LeanImageWriter, PageGivenTwice, ParentLink, WriterUsageError, build_extents

PS = 4096
S, Z, F, D, P, DL = (
    PageClass.STORED,
    PageClass.ZERO,
    PageClass.FREE,
    PageClass.DISK,
    PageClass.PARENT,
    PageClass.DELTA,
)
LINK = ParentLink(bytes([7] * 16), bytes([8] * 16))


def pages(seed: int, count: int) -> bytes:
    return np.random.default_rng(seed).integers(1, 256, count * PS, dtype=np.uint8).tobytes()


@contextmanager
def written(tmp_path, build, **kw):
    """The image ``build(writer)`` writes, opened as one link (its parent is not looked for)."""
    path = tmp_path / "w.lean"
    path.write_bytes(write_bytes(build, **kw))
    with LeanImage.open_link(path) as image:
        yield image


# --- pages ------------------------------------------------------------------------------------------
def test_put_pages_all_zero_pages_become_zero(tmp_path):
    content = pages(1, 1) + bytes(PS) + pages(2, 1)

    def build(w):
        w.put_pages(w.add_region("ram", 3 * PS), 0, content)

    with written(tmp_path, build) as image:
        ram = image.region("ram")
        assert image.classes(ram).tolist() == [S, Z, S]
        assert [image.page_location(ram, p) for p in (0, 2)] == [(S, 0), (S, 1)]
        assert bytes(image.region_bytes(ram, 0, 3)) == content


def test_many_puts_in_any_order_keep_their_slots_and_digests(tmp_path):
    """More than 4096 puts (the writer joins its logs of slot runs and digests every 4096) of
    one page each, in shuffled order, some on the page before the last put: every page reads
    back, its digest verified."""
    count = 5000
    content = np.frombuffer(pages(7, count), np.uint8).reshape(count, PS).copy()
    content[::3] = 0
    order = np.random.default_rng(8).permutation(count)

    def build(w):
        ram = w.add_region("ram", count * PS)
        for page in order.tolist():
            w.put_pages(ram, page, content[page])

    with written(tmp_path, build) as image:
        ram = image.region("ram")
        assert (image.classes(ram) == np.where(np.arange(count) % 3 == 0, Z, S)).all()
        assert bytes(image.region_bytes(ram, 0, count)) == content.tobytes()


def test_put_pages_fills_frames_of_frame_pages(tmp_path):
    def build(w):
        w.put_pages(w.add_region("ram", 5 * PS), 0, pages(3, 5))

    with written(tmp_path, build, frame_pages=2) as image:
        assert image.tables.page_frames.counts.tolist() == [2, 2, 1]


@pytest.mark.parametrize("strided", [False, True])
def test_zero_pages_among_stored_ones_are_left_out_across_frames(tmp_path, strided):
    """put_pages and put_pages_at gather the non-zero rows into frames of 2 pages (straight from
    a contiguous buffer, through a copy from a strided one): same bytes, zero pages ZERO."""
    buffer = np.frombuffer(pages(5, 16), np.uint8).reshape(16, PS).copy()
    buffer[[2, 6, 7, 12]] = 0
    rows = buffer[::2] if strided else buffer[:8]

    def build(w):
        w.put_pages(w.add_region("a", 8 * PS), 0, rows)
        w.put_pages_at(w.add_region("b", 8 * PS), np.array([7, 0, 3, 5, 1, 2, 4, 6]), rows)

    with written(tmp_path, build, frame_pages=2) as image:
        a, b = image.region("a"), image.region("b")
        assert bytes(image.region_bytes(a, 0, 8)) == rows.tobytes()
        zero = ~rows.any(axis=1)
        assert (image.classes(a) == PageClass.ZERO).tolist() == zero.tolist()
        order = [7, 0, 3, 5, 1, 2, 4, 6]
        want = bytearray(8 * PS)
        for k, page in enumerate(order):
            want[page * PS : (page + 1) * PS] = rows[k].tobytes()
        assert bytes(image.region_bytes(b, 0, 8)) == bytes(want)


def test_put_pages_takes_strided_rows(tmp_path):
    buffer = np.frombuffer(pages(4, 6), np.uint8).reshape(6, PS)

    def build(w):
        w.put_pages(w.add_region("ram", 3 * PS), 0, buffer[::2])

    with written(tmp_path, build) as image:
        assert bytes(image.region_bytes(image.region("ram"), 0, 3)) == buffer[::2].tobytes()


def test_put_zero_and_put_free(tmp_path):
    def build(w):
        r = w.add_region("ram", 5 * PS)
        w.put_free(r, 3, 2)
        w.put_zero(r, 0, 3)

    with written(tmp_path, build) as image:
        ram = image.region("ram")
        assert image.classes(ram).tolist() == [Z, Z, Z, F, F]
        assert image.read_page(ram, 4) == bytes(PS)
        assert image.tables.page_frames.total == 0


def test_put_disks_records_references_and_digests(tmp_path):
    digests = np.arange(32, dtype=np.uint8).reshape(2, 16)

    def build(w):
        vda = w.add_disk("vda", 1 << 20, bytes(16))
        vdb = w.add_disk("vdb", 1 << 20, bytes(16))
        r = w.add_region("ram", 3 * PS)
        w.put_disks(r, np.array([2, 0]), np.array([vdb, vda]), np.array([64, 8]), digests)
        w.put_disks(r, np.array([], np.int64), np.array([]), np.array([]), np.zeros((0, 16), np.uint8))
        w.put_zero(r, 1)

    with written(tmp_path, build) as image:
        ram = image.region("ram")
        assert image.header.incompatible_features == IncompatFeature.DISK
        assert [d.name for d in image.disks] == ["vda", "vdb"]
        assert [image.page_location(ram, p) for p in (0, 2)] == [(D, 1), (D, 0)]
        assert image.tables.disk_refs.disk_ids.tolist() == [1, 0]
        assert image.tables.disk_refs.sectors.tolist() == [64, 8]
        assert image.expected_digest(ram, 2) == digests[0].tobytes()


def test_put_parent_records_the_digests_given_in_a_1_0_child(tmp_path):
    digests = page_digest(b"a" * PS) + page_digest(b"b" * PS)

    def build(w):
        r = w.add_region("ram", 2 * PS)
        w.put_parent(r, 0, digests)

    with written(tmp_path, build, parent=LINK, inherit_digests=False) as image:
        ram = image.region("ram")
        assert image.classes(ram).tolist() == [P, P]
        assert image.expected_digest(ram, 1) == page_digest(b"b" * PS)
        assert (image.header.parent_uuid, image.header.parent_digest) == (LINK.uuid, LINK.digest)
        assert image.header.incompatible_features == IncompatFeature.PARENT | IncompatFeature.DELTA
        assert image.header.minor_version == 0


def test_a_child_is_format_1_1_and_stores_no_parent_digests(tmp_path):
    """By default a child inherits its PARENT pages' digests: header bit, minor 1, no digests stored."""

    def build(w):
        r = w.add_region("ram", 3 * PS)
        w.put_parent(r, 0, page_digest(b"a" * PS) + page_digest(b"b" * PS))
        w.put_pages(r, 2, b"c" * PS)

    with written(tmp_path, build, parent=LINK) as image:
        ram = image.region("ram")
        assert image.classes(ram).tolist() == [P, P, S]
        assert (
            image.header.incompatible_features
            == IncompatFeature.PARENT | IncompatFeature.DELTA | IncompatFeature.INHERITED_DIGESTS
        )
        assert image.header.minor_version == 1
        assert image.digests.table(ram).tolist() == [list(page_digest(b"c" * PS))]
        assert image.expected_digest(ram, 2) == page_digest(b"c" * PS)


def test_a_parentless_image_is_format_1_0(tmp_path):
    def build(w):
        w.put_pages(w.add_region("ram", PS), 0, b"c" * PS)

    with written(tmp_path, build) as image:
        assert image.header.minor_version == 0 and image.header.incompatible_features == 0
    with pytest.raises(WriterUsageError):
        LeanImageWriter(io.BytesIO(), inherit_digests=True)


def test_put_changed_delta_when_smaller_else_stored(tmp_path):
    old = pages(5, 1)
    few = bytearray(old)
    few[8:16] = bytes(8)
    every = bytes(b ^ 0xFF for b in old)
    got = []

    def build(w):
        r = w.add_region("ram", 2 * PS)
        got.append(w.put_changed(r, 0, old, bytes(few)))
        got.append(w.put_changed(r, 1, old, every))

    with written(tmp_path, build, parent=LINK) as image:
        assert got == [DL, S]
        assert image.classes(image.region("ram")).tolist() == [DL, S]
        assert image.expected_digest(image.region("ram"), 0) == page_digest(bytes(few))


def test_put_changed_without_delta_stores_the_page(tmp_path):
    old = pages(6, 1)
    new = old[:-1] + bytes([old[-1] ^ 1])

    def build(w):
        assert w.put_changed(w.add_region("ram", PS), 0, old, new) == S

    with written(tmp_path, build, parent=LINK, allow_delta=False) as image:
        assert not image.header.incompatible_features & IncompatFeature.DELTA


def test_put_delta_stores_the_entry_given(tmp_path):
    entry = bytes([1, 0, 1, 0, 3, 0]) + (42).to_bytes(8, "little")  # INDEX_LIST: word 3 := 42

    def build(w):
        r = w.add_region("ram", 2 * PS)
        w.put_delta(r, 1, entry, bytes(16))
        w.put_parent(r, 0, bytes(16))

    with written(tmp_path, build, parent=LINK) as image:
        assert image.frames.delta_entry(0) == entry
        assert image.page_location(image.region("ram"), 1) == (DL, 0)


# --- usage errors ---------------------------------------------------------------------------------------
def test_put_pages_at_writes_what_put_pages_writes_run_by_run():
    """Pages with gaps in one call (DiskPages: those between DISK pages) give the image bytes
    that put_pages of each run in turn gives: same classes, slots, frames."""
    content = np.frombuffer(pages(5, 12), np.uint8).reshape(12, PS).copy()
    content[[3, 8]] = 0
    at = np.array([9, 10, 2, 3, 4, 0, 7, 8])

    def runs(w):
        ram = w.add_region("ram", 12 * PS)
        for first, stop in ((9, 11), (2, 5), (0, 1), (7, 9)):
            w.put_pages(ram, first, content[first:stop])
        w.put_zero(ram, 1)
        w.put_free(ram, 5, 2)
        w.put_free(ram, 11)

    def at_once(w):
        ram = w.add_region("ram", 12 * PS)
        w.put_pages_at(ram, at, content[at])
        w.put_zero(ram, 1)
        w.put_free(ram, 5, 2)
        w.put_free(ram, 11)

    same = dict(frame_pages=4, image_uuid=bytes(range(16)))
    assert write_bytes(at_once, **same) == write_bytes(runs, **same)


def _region_with_page_0(w):
    r = w.add_region("ram", 2 * PS)
    w.put_pages(r, 0, pages(7, 1))
    return r


@pytest.mark.parametrize(
    "again",
    [
        lambda w, r: w.put_pages(r, 0, pages(8, 2)),
        lambda w, r: w.put_zero(r, 0),
        lambda w, r: w.put_free(r, 0, 2),
        lambda w, r: w.put_parent(r, 0, bytes(16)),
        lambda w, r: w.put_delta(r, 0, b"entry", bytes(16)),
        lambda w, r: w.put_disk(r, 0, 0, 0, bytes(16)),
        lambda w, r: w.put_pages_at(r, np.array([1, 0]), np.frombuffer(pages(8, 2), np.uint8).reshape(2, PS)),
    ],
)
def test_a_page_given_twice(again):
    w = LeanImageWriter(io.BytesIO(), parent=LINK, threads=1)
    w.add_disk("vda", 1 << 20, bytes(16))
    r = _region_with_page_0(w)
    with pytest.raises(PageGivenTwice, match="page 0 given twice"):
        again(w, r)
    w.abort()


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(page_size=5000), "page_size"),
        (dict(page_size=2048), "page_size"),
        (dict(page_size=131072), "page_size"),
        (dict(frame_pages=4097), "exceeds"),
        (dict(allow_delta=True), "DELTA pages need a parent"),
    ],
)
def test_constructor_usage_errors(kw, match):
    with pytest.raises(WriterUsageError, match=match):
        LeanImageWriter(io.BytesIO(), **kw)


@pytest.mark.parametrize(
    "misuse,match",
    [
        (lambda w, r: w.put_pages(r + 1, 0, pages(9, 1)), "unknown region id 1"),
        (lambda w, r: w.put_zero(r + 5, 0), "unknown region id 5"),
        (lambda w, r: w.put_disks(r + 1, [0], [0], [0], np.zeros((1, 16), np.uint8)), "unknown region id 1"),
        (lambda w, r: w.put_disks(r, [0], [3], [0], np.zeros((1, 16), np.uint8)), "unknown disk id 3"),
        (lambda w, r: w.put_disks(r, [1, 1], [0, 0], [0, 8], np.zeros((2, 16), np.uint8)), "repeated"),
        (lambda w, r: w.put_pages(r, 1, pages(9, 2)), "outside"),
        (lambda w, r: w.put_free(r, -1), "outside"),
        (lambda w, r: w.put_pages(r, 0, b"x" * 100), "not a multiple"),
        (lambda w, r: w.put_pages(r, 0, np.zeros((1, PS), np.uint16)), "uint8"),
        (lambda w, r: w.put_pages_at(r, np.array([1, 2]), np.zeros((2, PS), np.uint8)), "outside"),
        (lambda w, r: w.put_pages_at(r, np.array([1]), np.zeros((2, PS), np.uint8)), "1 page numbers for 2 pages"),
        (lambda w, r: w.put_pages_at(r, np.array([1, 1]), np.ones((2, PS), np.uint8)), "outside 0..2 or repeated"),
        (lambda w, r: w.put_parent(r, 0, bytes(16)), "PARENT pages need a parent"),
        (lambda w, r: w.put_delta(r, 0, b"entry", bytes(16)), "DELTA pages need a parent"),
        (lambda w, r: w.add_disk("vdb", 1 << 20, bytes(16)), "before any region"),
        (lambda w, r: w.declare_source_state(), "before any record"),
        (lambda w, r: w.add_source_state(1, 0, b"s"), "declare_source_state"),
        (lambda w, r: w.add_region("ram", PS), "declared twice"),
        (lambda w, r: w.add_region("", PS), "1..255"),
        (lambda w, r: w.add_region("x" * 256, PS), "1..255"),
        (lambda w, r: w.add_region("odd", PS + 1), "multiple of page_size"),
        (lambda w, r: w.disk_id("vdb"), "no disk named"),
    ],
)
def test_usage_errors(misuse, match):
    w = LeanImageWriter(io.BytesIO(), threads=1)
    w.add_disk("vda", 1 << 20, bytes(16))
    r = w.add_region("ram", 2 * PS)
    with pytest.raises(WriterUsageError, match=match):
        misuse(w, r)
    w.abort()


def test_missing_pages_at_finish_leave_no_file(tmp_path):
    path = tmp_path / "out.lean"
    w = LeanImageWriter(path, threads=1)
    r = w.add_region("ram", 4 * PS)
    w.put_zero(r, 0)
    w.put_free(r, 2)
    assert w.missing_runs(r) == [(1, 1), (3, 1)]
    with pytest.raises(WriterUsageError, match="2 pages never given, first is page 1"):
        w.finish()
    assert os.listdir(tmp_path) == []


def test_finish_twice():
    w = LeanImageWriter(io.BytesIO(), threads=1)
    w.put_zero(w.add_region("ram", PS), 0)
    w.finish()
    with pytest.raises(WriterUsageError, match="already finished"):
        w.finish()


def test_finish_returns_the_image_digest():
    out = io.BytesIO()
    w = LeanImageWriter(out, threads=1)
    w.put_zero(w.add_region("ram", PS), 0)
    digest = w.finish()
    assert digest == out.getvalue()[-24:-8] and len(digest) == 16


def test_source_state_sets_the_compatible_bit(tmp_path):
    def build(w):
        w.add_source_state(2, 9, b"xen")
        w.put_zero(w.add_region("ram", PS), 0)

    with written(tmp_path, build) as image:
        assert image.header.compatible_features == CompatFeature.SOURCE_STATE
        assert [(s.source_format, s.tag, s.data) for s in image.source_states] == [(2, 9, b"xen")]


# --- the destination ---------------------------------------------------------------------------------------
def test_a_path_appears_only_when_complete(tmp_path):
    path = tmp_path / "out.lean"
    w = LeanImageWriter(path, frame_pages=1, threads=1)
    w.put_pages(w.add_region("ram", 2 * PS), 0, pages(10, 2))
    (partial,) = os.listdir(tmp_path)
    assert not path.exists() and partial.startswith(".leanimg-") and partial.endswith(".partial")
    w.finish()
    assert os.listdir(tmp_path) == ["out.lean"]
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask()
    with LeanImage.open(path) as image:
        assert image.read_page("ram", 1) == pages(10, 2)[PS:]


def test_abort_leaves_no_file(tmp_path):
    path = tmp_path / "out.lean"
    w = LeanImageWriter(path, frame_pages=1, threads=1)
    w.put_pages(w.add_region("ram", 3 * PS), 0, pages(11, 2))
    w.abort()
    assert os.listdir(tmp_path) == []


def test_abort_keeps_an_existing_file(tmp_path):
    path = tmp_path / "out.lean"
    path.write_bytes(b"previous")
    with pytest.raises(RuntimeError):
        with LeanImageWriter(path, threads=1) as w:
            w.put_zero(w.add_region("ram", PS), 0)
            raise RuntimeError("stop")
    assert os.listdir(tmp_path) == ["out.lean"] and path.read_bytes() == b"previous"


# --- build_extents ---------------------------------------------------------------------------------------------
def _page_runs(classes: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Each slot-bearing page as a run of its own: (page, 1, slot) rows, by page."""
    from leanimg.format import HAS_SLOT

    pages = np.flatnonzero(HAS_SLOT[classes])
    return np.stack([pages, np.ones_like(pages), slots[pages].astype(np.int64)], axis=1)


def test_build_extents_splits_where_the_class_changes_or_slots_jump():
    classes = np.array([S, S, S, Z, Z, F, D, D, S, DL, P], np.uint8)
    slots = np.array([0, 1, 5, 9, 9, 9, 0, 1, 2, 0, 7], np.uint64)
    table = build_extents(classes, _page_runs(classes, slots))
    assert table.dtype == EXTENT.dtype
    assert [tuple(int(x) for x in row) for row in table[["first_page", "num_pages", "page_class", "first_slot"]]] == [
        (0, 2, S, 0),
        (2, 1, S, 5),
        (3, 2, Z, 0),
        (5, 1, F, 0),
        (6, 2, D, 0),
        (8, 1, S, 2),
        (9, 1, DL, 0),
        (10, 1, P, 0),
    ]
    assert not table["reserved"].any()


def test_build_extents_of_one_class():
    table = build_extents(np.full(1000, Z, np.uint8), np.zeros((0, 3), np.int64))
    assert len(table) == 1 and (int(table["first_page"][0]), int(table["num_pages"][0])) == (0, 1000)


# --- arguments that would make an invalid image -------------------------------------------------------------------
# The writer refuses most such arguments with WriterUsageError (names, region sizes, unknown
# disk ids, pages given twice); these it accepts and then writes an image validate rejects.
def test_put_disks_arrays_of_different_lengths_are_a_usage_error():
    w = LeanImageWriter(io.BytesIO(), threads=1)
    vda = w.add_disk("vda", 1 << 20, bytes(16))
    r = w.add_region("ram", 2 * PS)
    try:
        with pytest.raises(WriterUsageError):
            w.put_disks(r, np.array([0, 1]), np.array([vda]), np.array([0, 8]), np.zeros((2, 16), np.uint8))
    finally:
        w.abort()


def test_put_disks_digests_of_another_shape_are_a_usage_error():
    w = LeanImageWriter(io.BytesIO(), threads=1)
    vda = w.add_disk("vda", 1 << 20, bytes(16))
    r = w.add_region("ram", 2 * PS)
    try:
        with pytest.raises(WriterUsageError, match="digests of 16 bytes"):
            w.put_disks(r, np.array([0, 1]), np.array([vda, vda]), np.array([0, 8]), np.zeros((2, 8), np.uint8))
    finally:
        w.abort()


def test_put_disk_past_the_end_of_the_disk_is_a_usage_error():
    w = LeanImageWriter(io.BytesIO(), threads=1)
    vda = w.add_disk("vda", 8192, bytes(16))
    r = w.add_region("ram", PS)
    try:
        with pytest.raises(WriterUsageError):
            w.put_disk(r, 0, vda, 9, bytes(16))  # sector 9: bytes 4608..8704 of an 8192-byte disk
    finally:
        w.abort()


def test_add_disk_of_size_zero_is_a_usage_error():
    w = LeanImageWriter(io.BytesIO(), threads=1)
    try:
        with pytest.raises(WriterUsageError):
            w.add_disk("vda", 0, bytes(16))
    finally:
        w.abort()


def test_build_extents_in_chunks_equals_the_whole_region_at_once(monkeypatch):
    """build_extents scans in windows (small temporaries for 2^28-page regions) and takes slots
    as runs; the windows' boundaries must not add or lose extent starts, and runs that continue
    each other (next page, next slot) make one extent."""
    import leanimg.writer as writer_module
    from leanimg.format import HAS_SLOT

    rng = np.random.default_rng(5)
    classes = rng.choice(np.array([S, Z, F, D, P], np.uint8), 5000, p=[0.5, 0.2, 0.1, 0.1, 0.1])
    slots = np.cumsum(rng.integers(0, 3, 5000)).astype(np.uint64)
    has_slot = HAS_SLOT[classes]
    starts = np.ones(len(classes), bool)
    starts[1:] = (classes[1:] != classes[:-1]) | (has_slot[1:] & (slots[1:] != slots[:-1] + 1))
    monkeypatch.setattr(writer_module, "_SCAN_PAGES", 7)
    table = build_extents(classes, _page_runs(classes, slots))
    assert table["first_page"].tolist() == np.flatnonzero(starts).tolist()
    assert int(table["num_pages"].sum()) == len(classes)
    assert table["first_slot"].tolist() == np.where(has_slot, slots, 0)[table["first_page"]].tolist()


@pytest.mark.parametrize("window", [3, 1 << 22])
def test_missing_runs_of_a_region(monkeypatch, window):
    """The same runs whether the classes are scanned in one window or in windows of 3 pages
    (a run across a window's edge is one run)."""
    import leanimg.writer as writer_module

    monkeypatch.setattr(writer_module, "_SCAN_PAGES", window)
    with LeanImageWriter(io.BytesIO(), threads=1) as w:
        r = w.add_region("ram", 10 * PS)
        w.put_zero(r, 2, 3)
        w.put_pages(r, 9, pages(1, 1))
        assert w.missing_runs(r) == [(0, 2), (5, 4)]
        w.put_free(r, 0, 2)
        w.put_free(r, 5, 4)
