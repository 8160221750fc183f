"""leanimg.arrays: distinct is np.unique of what it is given; joined lays structured tables end
to end as np.concatenate would, in one copy, views and slices included."""

import subprocess
import sys

import numpy as np
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

from leanimg.arrays import distinct, joined
from leanimg.format import INDEX_ENTRY


@settings(max_examples=200, deadline=None)
@given(hnp.arrays(st.sampled_from([np.int64, np.int32, np.uint8, np.uint64]), hnp.array_shapes(max_dims=2, max_side=40)))
def test_distinct_is_np_unique(values):
    got, want = distinct(values), np.unique(values)
    assert got.dtype == want.dtype and np.array_equal(got, want)


def test_distinct_of_nothing_and_of_one():
    assert distinct(np.zeros(0, np.int64)).shape == (0,)
    assert distinct([7]).tolist() == [7]


def test_distinct_does_not_import_numpy_ma():
    """What it is for: np.unique's first call imports numpy.ma (~8 ms of every restore)."""
    code = "import sys, numpy as np; from leanimg.arrays import distinct; distinct(np.arange(9) % 3); " \
           "print('numpy.ma' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=5 * INDEX_ENTRY.size), min_size=1, max_size=6), st.integers(0, 3))
def test_joined_lays_tables_end_to_end(blobs, skip):
    tables = [np.frombuffer(b[:len(b) // INDEX_ENTRY.size * INDEX_ENTRY.size], INDEX_ENTRY.dtype) for b in blobs]
    tables = [t[min(skip, len(t)):] for t in tables] + [np.zeros(0, INDEX_ENTRY.dtype)]
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
