"""leanimg._native (lean-image/_native.c) gives what leanimg computes without it: the page
digests of the xxhash module page by page (spec §6.5), through format.page_digests and
row_digests, the INDEX_LIST parse of delta._parse_index_lists_numpy (spec §7.3), on sound
and damaged entries, tables_batch's page-map rules on sound and spoiled page maps, and
chain.resolution._fold_own_pages_numpy's fold of a chain's pages; it refuses rows, offsets and extents
outside its buffers, and records' places that do not add up; its batch checksums are the
xxhash module's (format.span_checksums). (Its DELTA_FRAME reads are
checked against chain.deltas._quick_delta_frame's in tests/test_chain_fold.py, on damaged records.)
.ci/install builds it (and fails when it cannot), so these tests
require it."""

import numpy as np
import pytest
import xxhash
from hypothesis import assume, given, settings, strategies as st

from leanimg import _native
from leanimg import delta, format as fmt, tables, tables_batch
from leanimg.chain import resolution
from leanimg.format import EXTENT, IS_CONCRETE, PageClass


def _reference(pages: np.ndarray, rows) -> bytes:
    return b"".join(xxhash.xxh3_128_digest(pages[r].tobytes()) for r in rows)


@settings(max_examples=60, deadline=None)
@given(
    page_shift=st.integers(9, 14),
    count=st.integers(1, 9),
    seed=st.integers(0, 2**32 - 1),
    rows=st.lists(st.integers(0, 8), max_size=20),
)
def test_native_digests_are_the_xxhash_digests(page_shift, count, seed, rows):
    page_size = 1 << page_shift
    pages = np.random.default_rng(seed).integers(0, 256, (count, page_size), np.uint8)
    rows = [r % count for r in rows]  # any order, repeats allowed
    out = np.full((len(rows), 16), 0xAA, np.uint8)
    _native.digest_rows(pages, page_size, np.array(rows, np.int64), out)
    assert out.tobytes() == _reference(pages, rows)


def test_format_uses_the_native_digests_and_falls_back_to_the_same(monkeypatch):
    pages = np.random.default_rng(7).integers(0, 256, (6, 4096), np.uint8)
    rows = np.array([5, 0, 3, 3], np.int64)
    assert fmt._native_digests is _native.digest_rows
    native = (
        fmt.row_digests(pages, rows),
        fmt.page_digests(pages.tobytes(), 4096),
        fmt.row_digests(pages[:, :2048], [1]),
    )  # not contiguous: the xxhash module
    monkeypatch.setattr(fmt, "_native_digests", None)
    fallback = (
        fmt.row_digests(pages, rows),
        fmt.page_digests(pages.tobytes(), 4096),
        fmt.row_digests(pages[:, :2048], [1]),
    )
    for a, b in zip(native, fallback):
        assert a.dtype == b.dtype == np.uint8 and np.array_equal(a, b)
    assert native[0].tobytes() == _reference(pages, rows.tolist())
    assert native[1].tobytes() == _reference(pages, range(6))
    assert fmt.row_digests(pages, []).shape == (0, 16)


@pytest.mark.parametrize(
    "rows, out_rows, page_size",
    [
        ([-1], 1, 4096),  # before the first page
        ([4], 1, 4096),  # past the last
        ([0, 1], 1, 4096),  # out too small
        ([0], 1, 0),  # no page size
    ],
)
def test_native_digests_refuse_rows_outside_the_pages(rows, out_rows, page_size):
    pages = np.zeros((4, 4096), np.uint8)
    out = np.full((out_rows, 16), 0xAA, np.uint8)
    with pytest.raises(ValueError, match="outside the pages"):
        _native.digest_rows(pages, page_size, np.array(rows, np.int64), out)
    assert (out == 0xAA).all()  # nothing written


def test_native_digests_refuse_a_rows_buffer_that_is_not_int64():
    with pytest.raises(ValueError):
        _native.digest_rows(bytes(8192), 4096, b"\0" * 7, bytearray(16))
    with pytest.raises(TypeError):
        _native.digest_rows(bytes(8192), 4096, np.zeros(1, np.int64), bytes(16))  # out read-only


def _frame(entries: list[bytes]) -> tuple[bytes, np.ndarray]:
    """A DELTA_FRAME's content and entry offsets."""
    offsets = np.concatenate(([0], np.cumsum([len(e) for e in entries]))).astype(np.int64)
    return b"".join(entries), offsets


@st.composite
def _delta_entries(draw):
    """Entries of a DELTA_FRAME: INDEX_LIST ones, sound or with a byte changed, cut short or
    grown, and arbitrary bytes (of any length, down to none)."""
    page_size = 1 << draw(st.integers(9, 13))
    entries = []
    for _ in range(draw(st.integers(0, 12))):
        kind = draw(st.sampled_from(["index_list", "damaged", "resized", "bytes"]))
        if kind == "bytes":
            entries.append(draw(st.binary(max_size=40)))
            continue
        words = sorted(draw(st.sets(st.integers(0, page_size // 8 - 1), min_size=1, max_size=12)))
        entry = bytearray(
            bytes([1, 0])
            + len(words).to_bytes(2, "little")
            + b"".join(w.to_bytes(2, "little") for w in words)
            + b"".join(draw(st.binary(min_size=8, max_size=8)) for _ in words)
        )
        if kind == "damaged":
            entry[draw(st.integers(0, len(entry) - 1))] = draw(st.integers(0, 255))
        elif kind == "resized":
            entry = entry[: draw(st.integers(0, len(entry) - 1))] if draw(st.booleans()) else entry + b"\0" * 10
        entries.append(bytes(entry))
    return entries, page_size


@settings(max_examples=300, deadline=None)
@given(_delta_entries())
def test_native_index_list_parse_is_the_numpy_parse(drawn):
    entries, page_size = drawn
    content, offsets = _frame(entries)
    native = delta.parse_index_lists(content, offsets, page_size)
    numpy = delta._parse_index_lists_numpy(content, offsets, page_size)
    for got, want, name in zip(native, numpy, ["simple", "word_start", "num_words", "positions", "values"]):
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), name


def test_native_index_list_parse_refuses_offsets_outside_the_content():
    n = 2
    outputs = (np.zeros(n, bool), np.zeros(n, np.int64), np.zeros(n, np.int64))
    for offsets in ([0, 4, 9], [0, 5, 3], [-1, 2, 4]):
        with pytest.raises(ValueError, match="outside the content"):
            _native.index_list_heads(bytes(8), np.array(offsets, np.int64), 4096, *outputs)
    simple = np.ones(1, bool)  # said plain: its words must fit the outputs
    entry = bytes([1, 0, 2, 0]) + bytes(20)
    with pytest.raises(ValueError, match="outputs too small"):
        _native.index_list_words(
            entry,
            np.array([0, 24], np.int64),
            4096,
            simple,
            np.zeros(1, np.int64),
            np.zeros(1, np.int64),
            np.zeros(1, np.uint64),
        )


@st.composite
def _chain_extents(draw):
    """The own extents of a chain of 1-6 links over 1-120 pages as chain.resolution._own_extents lays
    them out (nearest link first, PARENT extents left out, counts cut at the last page), each
    link's page map a random run of extents of any class, with slots, digest ranks and
    bearing; which links inherit digests."""
    n = draw(st.integers(1, 120))
    links = draw(st.integers(1, 6))
    fields = [[] for _ in range(7)]
    for depth in range(links):
        page, slots, rank = 0, {}, 0
        while page < n + 3:  # a region may reach past the pages folded
            count = draw(st.integers(1, 9))
            cls = draw(st.sampled_from(list(PageClass)))
            bearing = draw(st.booleans())
            if cls != PageClass.PARENT and page < n:
                for values, value in zip(
                    fields, (page, cls, min(count, n - page), slots.get(cls, 0), bearing, rank, depth)
                ):
                    values.append(value)
            slots[cls] = slots.get(cls, 0) + count
            rank += count if bearing else 0
            page += count
    extents = resolution.OwnExtents(
        *(
            np.array(values, dtype)
            for values, dtype in zip(fields, (np.int64, np.uint8, np.int64, np.int64, bool, np.int64, np.int32))
        )
    )
    return n, extents, np.array(draw(st.lists(st.booleans(), min_size=links, max_size=links)))


@settings(max_examples=300, deadline=None)
@given(_chain_extents())
def test_native_fold_is_the_numpy_fold(drawn):
    n, extents, inherits = drawn
    folds = resolution._Fold(n), resolution._Fold(n)
    deltas = (
        resolution._fold_own_pages_native(folds[0], extents, inherits),
        resolution._fold_own_pages_numpy(folds[1], extents, inherits),
    )
    for got, want in zip(*deltas):
        assert got.dtype == want.dtype and got.tolist() == want.tolist()
    for kind in ("base", "digest"):
        for got, want in zip(folds[0].result(kind), folds[1].result(kind)):
            assert got.dtype == want.dtype and got.tolist() == want.tolist()
    pages, links, _ = deltas[0]
    base = folds[0].result("base")[0]
    assert (np.diff(pages) >= 0).all() and (links < np.where(base < 0, 4096, base)[pages]).all()


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 40),
    st.lists(
        st.tuples(
            st.lists(st.tuples(st.integers(1, 9), st.sampled_from(list(PageClass)), st.booleans()), max_size=8),
            st.integers(0, 9),
        ),
        min_size=1,
        max_size=5,
    ),
)
def test_native_own_extents_are_the_numpy_ones(limit, links):
    """chain.resolution._own_extents_native lays out what _own_extents does: each link's extents
    (nearest first) but PARENT ones and those from ``limit`` on, counts cut at it."""
    regions, depths = [], []
    for rows, depth in links:
        firsts = np.cumsum([0] + [count for count, _, _ in rows])[:-1]
        extents = np.array(
            [(first, count, cls, 0, 7 * k) for k, (first, (count, cls, _)) in enumerate(zip(firsts.tolist(), rows))],
            EXTENT.dtype,
        )
        region = tables.Region(0, "r", int(firsts[-1] + rows[-1][0]) * 4096 if rows else 0, None, 4096)
        region.extents, region.starts = extents, extents["first_page"].astype(np.int64)
        region.digest_bearing = np.array([bears for _, _, bears in rows], bool)
        region.digest_rank0 = np.arange(len(rows), dtype=np.int64) * 3
        regions.append(region)
        depths.append(depth)
    native, numpy = (
        resolution._own_extents_native(regions, depths, limit),
        resolution._own_extents(regions, depths, limit),
    )
    for got, want in zip(native, numpy):
        assert got.dtype == want.dtype and got.tolist() == want.tolist()


def test_native_own_extents_refuse_items_that_do_not_match():
    extents = np.zeros(2, EXTENT.dtype)
    outputs = [
        np.zeros(2, np.int64),
        np.zeros(2, np.int64),
        np.zeros(2, np.uint8),
        np.zeros(2, np.int64),
        np.zeros(2, np.uint8),
        np.zeros(2, np.int64),
        np.zeros(2, np.int32),
    ]
    for bearing, rank0, depths in (
        ([np.zeros(1, np.uint8)], [np.zeros(2, np.int64)], [0]),
        ([np.zeros(2, np.uint8)], [np.zeros(2, np.int32)], [0]),
        ([np.zeros(2, np.uint8)], [np.zeros(2, np.int64)], [0, 1]),
    ):
        with pytest.raises(ValueError):
            _native.own_extents(
                [extents], bearing, rank0, np.array(depths, np.int32), 8, int(PageClass.PARENT), *outputs
            )
    with pytest.raises(ValueError):  # an output too small
        _native.own_extents(
            [extents],
            [np.zeros(2, np.uint8)],
            [np.zeros(2, np.int64)],
            np.zeros(1, np.int32),
            8,
            int(PageClass.PARENT),
            *outputs[:6],
            np.zeros(1, np.int32),
        )


def _fold_arguments(n=8, starts=(0,), counts=(8,), classes=(PageClass.DELTA,), depths=(0,), room=8):
    extents = [
        np.array(starts, np.int64),
        np.array(counts, np.int64),
        np.array(classes, np.uint8),
        np.zeros(len(starts), np.int64),
        np.zeros(len(starts), np.uint8),
        np.zeros(len(starts), np.int64),
        np.array(depths, np.int32),
        np.ones(2, np.uint8),
        IS_CONCRETE.view(np.uint8),
    ]
    outputs = [
        np.full(n, 4096, np.int32),
        np.zeros(n, np.uint8),
        np.zeros(n, np.int64),
        np.full(n, 4096, np.int32),
        np.zeros(n, np.uint8),
        np.full(n, -1, np.int64),
        np.zeros(room, np.int64),
        np.zeros(room, np.int32),
        np.zeros(room, np.int64),
    ]
    return extents, outputs


@pytest.mark.parametrize(
    "change",
    [
        dict(starts=(1,)),
        dict(starts=(-1,), counts=(1,)),
        dict(counts=(9,)),
        dict(depths=(2,)),
        dict(depths=(-1,)),
        dict(room=7),
        dict(classes=(255,)),
        dict(n=0),
    ],
)
def test_native_fold_refuses_extents_outside_its_tables(change):
    extents, outputs = _fold_arguments(**change)
    if change.get("classes"):
        extents[8] = extents[8][:200]  # a class table too short for the class
    with pytest.raises(ValueError, match="outside"):
        _native.fold_own_pages(*extents, int(PageClass.DELTA), *outputs)
    assert (outputs[0] == 4096).all() and (outputs[6] == 0).all()  # nothing written
    extents, outputs = _fold_arguments()
    assert _native.fold_own_pages(*extents, int(PageClass.DELTA), *outputs) == 8  # the same, sound


@st.composite
def _page_maps(draw):
    """Page maps of 1-5 images, each of any run of extents of the spec's classes with slots
    used in extent order, then perhaps spoiled (a gap, a slot, a count, a short region, a
    wrong number of slots); the region's pages, the slots each class must use, whether each
    image owns its digests."""
    maps, pages, available = [], [], []
    for _ in range(draw(st.integers(1, 5))):
        rows, page, used = [], 0, {c: 0 for c in tables_batch._SLOT_CLASSES}
        for _ in range(draw(st.integers(0, 8))):
            cls, count = draw(st.sampled_from(list(PageClass))), draw(st.integers(1, 6))
            rows.append((page, count, cls, 0, used.get(cls, 0)))
            if cls in used:
                used[cls] += count
            page += count
        extents = np.array(rows, EXTENT.dtype)
        spoil = draw(st.sampled_from(["none", "first_page", "first_slot", "num_pages", "pages", "available"]))
        if spoil in ("first_page", "first_slot", "num_pages") and len(rows):
            extents[draw(st.integers(0, len(rows) - 1))][spoil] += draw(st.integers(1, 3))
        maps.append(extents)
        pages.append(page - (spoil == "pages"))
        available.append([used[c] + (spoil == "available") for c in tables_batch._SLOT_CLASSES])
    own = draw(st.lists(st.booleans(), min_size=len(maps), max_size=len(maps)))
    return maps, np.array(pages, np.int64), np.array(available, np.int64), np.array(own)


@settings(max_examples=300, deadline=None)
@given(_page_maps())
def test_native_page_map_rules_are_the_numpy_rules(drawn):
    maps, pages, available, own = drawn
    assume(sum(len(m) for m in maps))  # no extents at all: _extents_hold refuses them before either runs
    native = tables_batch._extents_rules_native(maps, pages, available, own)
    numpy = tables_batch._extents_rules_numpy(maps, pages, available, own)
    for got, want, name in zip(native, numpy, ["ok", "present", "bearing", "rank0"]):
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), name


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.lists(
            st.tuples(
                st.integers(0, 2**64 - 1),
                st.sampled_from([0, 1, 2, 7, 2**32 - 1]),
                st.one_of(st.sampled_from(list(PageClass)), st.integers(0, 2**16 - 1)),
                st.sampled_from([0, 0, 0, 1, 2**16 - 1]),
                st.sampled_from([0, 0, 3, 2**64 - 1]),
            ),
            max_size=6,
        ),
        min_size=1,
        max_size=5,
    )
)
def test_native_extent_rules_are_the_numpy_rules(links):
    """Each extent's own rules (reserved, class, a page at least, no slot for a class without
    slots), a link's pages in all and its first extent's first_page: the C pass and numpy's
    agree, on extents of any field values, links without extents included."""
    rows = [row for link in links for row in link]
    e = np.array([(first, num, cls, reserved, slot) for first, num, cls, reserved, slot in rows], EXTENT.dtype)
    num = np.array([len(link) for link in links], np.int64)
    native, numpy = tables_batch._extents_alone_native(e, num), tables_batch._extents_alone_numpy(e, num)
    for got, want, name in zip(native, numpy, ["ok", "pages", "firsts"]):
        assert got.dtype == want.dtype and got.tolist() == want.tolist(), name


def test_native_extent_rules_refuse_lengths_that_do_not_add_up():
    extents = np.zeros(3, EXTENT.dtype)
    for lengths in ([2], [4], [-1, 4]):
        ok = np.full(len(lengths), 7, np.uint8)
        with pytest.raises(ValueError, match="do not add up"):
            _native.page_map_extents(
                extents,
                np.array(lengths, np.int64),
                np.ones(1 << 16, np.uint8),
                np.ones(1 << 16, np.uint8),
                ok,
                np.zeros(len(lengths), np.uint64),
                np.zeros(len(lengths), np.uint64),
            )
        assert (ok == 7).all()  # nothing written


def test_native_page_map_rules_refuse_lengths_that_do_not_add_up():
    extents = np.zeros(3, EXTENT.dtype).tobytes()
    tables = (np.ones(1 << 16, np.uint8), np.ones(1 << 16, np.uint8), np.array([1, 4, 6], np.int64))
    for lengths in ([2], [4], [-1, 4]):
        ok = np.full(len(lengths), 7, np.uint8)
        with pytest.raises(ValueError, match="do not add up"):
            _native.extents_hold(
                extents,
                np.array(lengths, np.int64),
                np.zeros(len(lengths), np.int64),
                np.zeros((len(lengths), 3), np.int64),
                np.zeros(len(lengths), np.uint8),
                *tables,
                ok,
                np.zeros(len(lengths), np.uint64),
                np.zeros(3, np.uint8),
                np.zeros(3, np.int64),
            )
        assert (ok == 7).all()  # nothing written


@pytest.mark.parametrize(
    "change",
    [
        dict(fds=np.zeros(2, np.int32)),
        dict(nums=np.array([-1], np.int64)),
        dict(lengths=np.array([-8], np.int64)),
        dict(fds=np.zeros(0, np.int32)),
        dict(offsets=np.zeros(1, np.int32)),
    ],
    ids=["unequal", "negative-count", "negative-length", "empty", "offsets-not-int64"],
)
def test_native_delta_frame_read_refuses_bad_arguments(change):
    """read_delta_frames is given its records' places by the caller: arrays that do not
    describe the same records raise ValueError, and nothing is read."""
    args = dict(
        fds=np.zeros(1, np.int32),
        offsets=np.zeros(1, np.int64),
        lengths=np.full(1, 64, np.int64),
        firsts=np.zeros(1, np.int64),
        nums=np.ones(1, np.int64),
    )
    args.update(change)
    with pytest.raises(ValueError):
        _native.read_delta_frames(*args.values(), 1 << 20)


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 12), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_native_copy_rows_is_numpy_fancy_assignment(rows, seed, data):
    """chain.forward._copy_rows' C copy: dst[dst_rows] = src[src_rows], rows in any order, repeats allowed."""
    item = np.dtype((np.void, 64))
    src = np.random.default_rng(seed).integers(0, 256, rows * 64, np.uint8).view(item)
    src_rows = np.array(data.draw(st.lists(st.integers(0, rows - 1), max_size=20)), np.int64)
    dst_rows = np.array(
        data.draw(st.lists(st.integers(0, 7), min_size=len(src_rows), max_size=len(src_rows))), np.int64
    )
    want, got = np.zeros(8, item), np.zeros(8, item)
    want[dst_rows] = src[src_rows]
    _native.copy_rows(src, src_rows, got, dst_rows, 64)
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("src_rows, dst_rows", [([4], [0]), ([0], [2]), ([-1], [0]), ([0, 1], [0])])
def test_native_copy_rows_refuses_rows_outside_its_buffers(src_rows, dst_rows):
    src, dst = np.arange(4 * 8, dtype=np.uint8), np.zeros(2 * 8, np.uint8)
    with pytest.raises(ValueError):
        _native.copy_rows(src, np.array(src_rows, np.int64), dst, np.array(dst_rows, np.int64), 8)
    assert not dst.any()


@settings(max_examples=60, deadline=None)
@given(buffers=st.lists(st.binary(max_size=200), min_size=1, max_size=8), data=st.data())
def test_native_span_checksums_are_the_xxhash_checksums(buffers, data):
    """format.span_checksums: the xxh3-64 of each span, with leanimg._native and without it."""
    spans = [data.draw(st.tuples(st.integers(0, len(b)), st.integers(0, len(b)))) for b in buffers]
    offsets = [min(a, c) for a, c in spans]
    lengths = [abs(a - c) for a, c in spans]
    expected = [xxhash.xxh3_64_intdigest(b[o : o + n]) for b, o, n in zip(buffers, offsets, lengths)]
    assert fmt.span_checksums(buffers, offsets, lengths).tolist() == expected
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(fmt, "_native_span_checksums", None)
        assert fmt.span_checksums(buffers, offsets, lengths).tolist() == expected


@pytest.mark.parametrize("offset, length", [(-1, 2), (0, 11), (10, 1), (3, -1), (2**62, 2**62)])
@pytest.mark.parametrize("native", [True, False], ids=["native", "numpy"])
def test_span_checksums_refuse_spans_outside_their_buffer(monkeypatch, offset, length, native):
    if not native:
        monkeypatch.setattr(fmt, "_native_span_checksums", None)
    with pytest.raises(ValueError, match="outside its buffer"):
        fmt.span_checksums([b"0123456789", b"ab"], [0, offset], [1, length])


def test_native_span_checksums_refuse_lengths_that_do_not_match():
    with pytest.raises(ValueError, match="one i8 per buffer"):
        _native.span_checksums([b"ab", b"cd"], np.zeros(2, np.int64), np.zeros(1, np.int64), np.zeros(2, np.uint64))


def test_leanimg_native_chooses_the_backend(tmp_path):
    """LEANIMG_NATIVE: auto and 1 use the built module, 0 none (every module takes its numpy
    path); any other value is a usage error before a command runs."""
    import os
    import subprocess
    import sys
    from helpers import run_leanimg

    probe = (
        "from leanimg import native, delta, format, parent_files, tables_batch; "
        "from leanimg.chain import deltas, forward, resolution; "
        "print([m._native is native.backend for m in "
        "(resolution, deltas, forward, delta, parent_files, tables_batch)], "
        "native.backend is None, format._native_digests is None)"
    )
    for mode, none in (("auto", False), ("1", False), ("0", True)):
        out = subprocess.run(
            [sys.executable, "-c", probe],
            capture_output=True,
            text=True,
            check=True,
            env=dict(os.environ, LEANIMG_NATIVE=mode),
        ).stdout.split("] ")
        assert out[0] == "[True, True, True, True, True, True" and out[1].split() == [str(none), str(none)], (mode, out)
    proc = run_leanimg("plugins", timeout=60, env=dict(os.environ, LEANIMG_NATIVE="yes"))
    assert proc.returncode == 2 and "LEANIMG_NATIVE must be one of auto, 0, 1, not 'yes'" in proc.stderr


def test_only_the_native_module_imports_the_backend():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    importers = [
        str(p.relative_to(root))
        for folder in ("lean-image", "converters", "restore")
        for p in (root / folder).rglob("*.py")
        if re.search(r"^\s*(from \. import _native|from \._native import|import leanimg\._native)", p.read_text(), re.M)
    ]
    assert importers == ["lean-image/native.py"]


@st.composite
def _ram_entry_runs(draw):
    """QEMU RAM entries (PAGE or ZERO, CONTINUE) at consecutive offsets, one of them spoiled
    (a header off by a bit, a jump, another flag, a non-zero fill byte) or none."""
    page_size = 1 << draw(st.integers(12, 13))
    zero = draw(st.booleans())
    flags, stride = (0x02 | 0x20, 9) if zero else (0x08 | 0x20, 8 + page_size)
    count = draw(st.integers(0, 40))
    first = draw(st.integers(0, 1 << 20)) * page_size
    buf = bytearray()
    for k in range(count):
        buf += ((first + k * page_size) | flags).to_bytes(8, "big") + (b"\0" if zero else bytes(page_size))
    if count:
        k = draw(st.integers(0, count - 1))
        spoil = draw(st.sampled_from(["none", "bit", "fill", "flag"]))
        at = k * stride
        if spoil == "bit":
            buf[at + draw(st.integers(0, 7))] ^= 1 << draw(st.integers(0, 7))
        elif spoil == "fill" and zero:
            buf[at + 8] = draw(st.integers(1, 255))
        elif spoil == "flag":
            buf[at + 7] ^= 0x10
    buf += bytes(draw(st.integers(0, stride - 1)))  # a partial entry after them
    return bytes(buf), first, flags, stride, count, page_size


@settings(max_examples=300, deadline=None)
@given(_ram_entry_runs(), st.integers(0, 3))
def test_native_qemu_run_length_is_the_numpy_one(drawn, shorten):
    from leanimg.converters import qemu

    buf, first, flags, stride, count, page_size = drawn
    limit = max(0, count - shorten)
    native = _native.qemu_run_length(buf, 0, first, flags, stride, limit, page_size)
    qemu_backend, qemu.backend = qemu.backend, None
    try:
        numpy = qemu._run_length(buf, 0, first, flags, stride, limit, page_size)
    finally:
        qemu.backend = qemu_backend
    assert native == numpy <= limit


def test_native_qemu_run_length_refuses_entries_outside_the_buffer():
    entry = (0x1000 | 0x22).to_bytes(8, "big") + b"\0"
    assert _native.qemu_run_length(entry * 3, 0, 0x1000, 0x22, 9, 3, 4096) == 1
    for pos, limit in ((0, 4), (9, 3), (-1, 1)):
        with pytest.raises(ValueError, match="outside the buffer"):
            _native.qemu_run_length(entry * 3, pos, 0x1000, 0x22, 9, limit, 4096)
