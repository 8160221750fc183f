"""leanimg._native (lean-image/_native.c) gives what leanimg computes without it: the page
digests of the xxhash module page by page (spec §6.5), through format.page_digests and
row_digests, and the INDEX_LIST parse of delta._parse_index_lists_numpy (spec §7.3), on sound
and damaged entries; it refuses rows and offsets outside its buffers. .ci/install builds it
(and fails when it cannot), so these tests require it."""

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from leanimg import _native
from leanimg import delta, format as fmt


def _reference(pages: np.ndarray, rows) -> bytes:
    return b"".join(xxhash.xxh3_128_digest(pages[r].tobytes()) for r in rows)


@settings(max_examples=60, deadline=None)
@given(page_shift=st.integers(9, 14), count=st.integers(1, 9), seed=st.integers(0, 2**32 - 1),
       rows=st.lists(st.integers(0, 8), max_size=20))
def test_native_digests_are_the_xxhash_digests(page_shift, count, seed, rows):
    page_size = 1 << page_shift
    pages = np.random.default_rng(seed).integers(0, 256, (count, page_size), np.uint8)
    rows = [r % count for r in rows]              # any order, repeats allowed
    out = np.full((len(rows), 16), 0xAA, np.uint8)
    _native.digest_rows(pages, page_size, np.array(rows, np.int64), out)
    assert out.tobytes() == _reference(pages, rows)


def test_format_uses_the_native_digests_and_falls_back_to_the_same(monkeypatch):
    pages = np.random.default_rng(7).integers(0, 256, (6, 4096), np.uint8)
    rows = np.array([5, 0, 3, 3], np.int64)
    assert fmt._native_digests is _native.digest_rows
    native = (fmt.row_digests(pages, rows), fmt.page_digests(pages.tobytes(), 4096),
              fmt.row_digests(pages[:, :2048], [1]))         # not contiguous: the xxhash module
    monkeypatch.setattr(fmt, "_native_digests", None)
    fallback = (fmt.row_digests(pages, rows), fmt.page_digests(pages.tobytes(), 4096),
                fmt.row_digests(pages[:, :2048], [1]))
    for a, b in zip(native, fallback):
        assert a.dtype == b.dtype == np.uint8 and np.array_equal(a, b)
    assert native[0].tobytes() == _reference(pages, rows.tolist())
    assert native[1].tobytes() == _reference(pages, range(6))
    assert fmt.row_digests(pages, []).shape == (0, 16)


@pytest.mark.parametrize("rows, out_rows, page_size", [
    ([-1], 1, 4096),             # before the first page
    ([4], 1, 4096),              # past the last
    ([0, 1], 1, 4096),           # out too small
    ([0], 1, 0),                 # no page size
])
def test_native_digests_refuse_rows_outside_the_pages(rows, out_rows, page_size):
    pages = np.zeros((4, 4096), np.uint8)
    out = np.full((out_rows, 16), 0xAA, np.uint8)
    with pytest.raises(ValueError, match="outside the pages"):
        _native.digest_rows(pages, page_size, np.array(rows, np.int64), out)
    assert (out == 0xAA).all()                     # nothing written


def test_native_digests_refuse_a_rows_buffer_that_is_not_int64():
    with pytest.raises(ValueError):
        _native.digest_rows(bytes(8192), 4096, b"\0" * 7, bytearray(16))
    with pytest.raises(TypeError):
        _native.digest_rows(bytes(8192), 4096, np.zeros(1, np.int64), bytes(16))   # out read-only


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
        entry = bytearray(bytes([1, 0]) + len(words).to_bytes(2, "little") +
                          b"".join(w.to_bytes(2, "little") for w in words) +
                          b"".join(draw(st.binary(min_size=8, max_size=8)) for _ in words))
        if kind == "damaged":
            entry[draw(st.integers(0, len(entry) - 1))] = draw(st.integers(0, 255))
        elif kind == "resized":
            entry = entry[:draw(st.integers(0, len(entry) - 1))] if draw(st.booleans()) else entry + b"\0" * 10
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
    simple = np.ones(1, bool)                   # said plain: its words must fit the outputs
    entry = bytes([1, 0, 2, 0]) + bytes(20)
    with pytest.raises(ValueError, match="outputs too small"):
        _native.index_list_words(entry, np.array([0, 24], np.int64), 4096, simple, np.zeros(1, np.int64),
                                 np.zeros(1, np.int64), np.zeros(1, np.uint64))
