"""leanimg.arrays: distinct is np.unique of what it is given; joined lays structured tables end
to end as np.concatenate would, in one copy, views and slices included; gather_rows and
scatter_rows index the rows of a 2-d array as numpy's own indexing does."""

import subprocess
import sys

import numpy as np
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from leanimg.arrays import as_items, distinct, gather_rows, joined, nonzero_rows, scatter_rows
from leanimg.format import INDEX_ENTRY


@settings(max_examples=200, deadline=None)
@given(
    hnp.arrays(st.sampled_from([np.int64, np.int32, np.uint8, np.uint64]), hnp.array_shapes(max_dims=2, max_side=40))
)
def test_distinct_is_np_unique(values):
    got, want = distinct(values), np.unique(values)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_distinct_of_nothing_and_of_one():
    assert distinct(np.zeros(0, np.int64)).shape == (0,)
    assert distinct([7]).tolist() == [7]


def test_distinct_does_not_import_numpy_ma():
    """What it is for: np.unique's first call imports numpy.ma (~8 ms of every restore)."""
    code = (
        "import sys, numpy as np; from leanimg.arrays import distinct; distinct(np.arange(9) % 3); "
        "print('numpy.ma' in sys.modules)"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=5 * INDEX_ENTRY.size), min_size=1, max_size=6), st.integers(0, 3))
def test_joined_lays_tables_end_to_end(blobs, skip):
    tables = [np.frombuffer(b[: len(b) // INDEX_ENTRY.size * INDEX_ENTRY.size], INDEX_ENTRY.dtype) for b in blobs]
    tables = [t[min(skip, len(t)) :] for t in tables] + [np.zeros(0, INDEX_ENTRY.dtype)]
    got = joined(tables)
    assert got.dtype == INDEX_ENTRY.dtype
    assert got.tobytes() == b"".join(t.tobytes() for t in tables)


def test_joined_slices_of_one_array_are_a_view_of_it():
    """A batch's page maps, slices of one joined copy laid end to end, are joined without a
    copy (read-only); slices not end to end, or of other arrays, are copied."""
    base = joined([np.frombuffer(bytes(range(256)) * 2, INDEX_ENTRY.dtype)])
    parts = [base[0:3], base[3:3], base[3:10], base[10:16]]
    span = joined(parts)
    assert np.shares_memory(span, base) and not span.flags.writeable
    assert span.tobytes() == base.tobytes()
    for others in ([base[0:3], base[4:10]], [base[3:10], base[0:3]], [base[0:3], base.copy()[3:10]]):
        copied = joined(others)
        assert not np.shares_memory(copied, base)
        assert copied.tobytes() == b"".join(t.tobytes() for t in others)


@st.composite
def rows_and_picks(draw):
    """(n, 16) uint8 rows, some indexes of them (repeats included) or a mask, and new rows."""
    n = draw(st.integers(0, 30))
    rows = draw(hnp.arrays(np.uint8, (n, 16)))
    if n and draw(st.booleans()):
        at = np.array(draw(st.lists(st.integers(0, n - 1), max_size=40)), np.int64)
    else:
        at = draw(hnp.arrays(bool, n))
    values = draw(hnp.arrays(np.uint8, (int(at.sum()) if at.dtype == bool else len(at), 16)))
    return rows, at, values


@settings(max_examples=300, deadline=None)
@given(case=rows_and_picks())
def test_rows_gathered_and_scattered_as_numpy_does(case):
    rows, at, values = case
    got = gather_rows(rows, at)
    assert got.dtype == rows.dtype and np.array_equal(got, rows[at])
    if at.dtype != bool and len(set(at.tolist())) < len(at):
        values = values[:0] if not len(at) else np.repeat(values[:1], len(at), axis=0)  # repeats: one value
    want = rows.copy()
    want[at] = values
    scatter_rows(rows, at, values)  # in place, through the view as_items gives
    assert np.array_equal(rows, want)


def test_as_items_is_a_view_of_one_item_per_row():
    rows = np.arange(48, dtype=np.uint8).reshape(3, 16)
    items = as_items(rows)
    assert items.shape == (3,) and items.itemsize == 16 and np.shares_memory(items, rows)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 63), st.integers(0, 255)), max_size=8), st.integers(1, 12))
def test_nonzero_rows_finds_a_non_zero_byte_anywhere(pokes, rows):
    """Rows zero but for a byte anywhere (first word or not) are found; zero rows are not."""
    pages = np.zeros((rows, 64), np.uint8)
    for k, (at, value) in enumerate(pokes):
        pages[k % rows, at] = value
    assert nonzero_rows(pages).tolist() == pages.any(axis=1).tolist()


def test_read_ahead_leaves_the_position_and_ignores_what_is_no_file(tmp_path):
    import io
    import os

    from leanimg.fileutil import read_ahead

    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    with open(path, "rb") as f:
        f.seek(100)
        read_ahead(f, 1 << 30)
        assert f.tell() == 100 and f.read(3) == bytes([100, 101, 102])
    read_ahead(io.BytesIO(b"abc"), 10)
    r, w = os.pipe()
    with os.fdopen(r, "rb") as pipe, os.fdopen(w, "wb") as end:
        end.write(b"xyz")
        end.flush()
        read_ahead(pipe, 10)
        assert pipe.read(3) == b"xyz"
