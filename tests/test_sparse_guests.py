"""Guests of mostly blank pages (issue 34 §2): reading, restoring and validating them costs work
per extent and per stored page, not per page of the guest.

- a long run of ZERO and FREE pages is one window of a sequential restore (region_windows) and
  one blank piece (region_pieces), and both restores still give every byte;
- validate finds the owners of a frame's ordinals from the STORED extents (``_StoredOwners``),
  as the per-page table it replaced did, overlapping and doubly used slots included.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from helpers import write_bytes
from leanimg import pages, validate
from leanimg.format import PageClass
from leanimg.reader import LeanImage
from leanimg.restore.raw import restore_raw

PS = 4096
PAGES = 1 << 16  # 256 MiB: blank runs longer than a restore's 8192-page step


def _build(writer):
    region = writer.add_region("pc.ram", PAGES * PS)
    rng = np.random.default_rng(3)
    data = {}
    cursor = 0
    for first, count, kind in ((0, 3, "s"), (3, 20000, "z"), (20003, 2, "s"), (20005, 30000, "f"), (50005, 1, "s")):
        assert first == cursor
        if kind == "s":
            pages_ = rng.integers(1, 255, (count, PS), dtype=np.uint8)
            writer.put_pages(region, first, pages_)
            data[first] = pages_.tobytes()
        elif kind == "z":
            writer.put_zero(region, first, count)
        else:
            writer.put_free(region, first, count)
        cursor = first + count
    writer.put_zero(region, cursor, PAGES - cursor)
    return data


@pytest.fixture(scope="module")
def sparse(tmp_path_factory):
    path = tmp_path_factory.mktemp("sparse") / "sparse.lean"
    stored = {}
    path.write_bytes(write_bytes(lambda w: stored.update(_build(w))))
    expected = bytearray(PAGES * PS)
    for first, blob in stored.items():
        expected[first * PS : first * PS + len(blob)] = blob
    return path, bytes(expected)


def test_long_blank_runs_are_one_window_each(sparse):
    path, _ = sparse
    with LeanImage.open(path) as image:
        region = image.regions[0]
        step = image.gather_chunk_pages
        windows = list(image.region_windows(region, step))
        # ZERO 3..20003, FREE 20005..50005 and ZERO 50006..end: each one window
        assert windows == [(0, 3), (3, 20000), (20003, 2), (20005, 30000), (50005, 1), (50006, PAGES - 50006)]
        assert list(image.region_windows(region, 1 << 20)) == [(0, PAGES)]  # no run longer than the step
        assert pages.blank_end(image, region, 3) == 20003
        assert pages.blank_end(image, region, 20005) == 50005  # a FREE run is blank too
        assert pages.blank_end(image, region, 50005) == 50005  # a STORED page
        assert image.region_pieces(region, 50006, PAGES - 50006) == [(PAGES - 50006, None)]


def test_restores_of_a_sparse_image_give_every_byte(sparse, tmp_path):
    path, expected = sparse
    out = tmp_path / "raw"
    with LeanImage.open(path) as image, open(out, "wb") as f:
        assert restore_raw(image, f) == len(expected)
    assert out.read_bytes() == expected
    with LeanImage.open(path) as image:  # no file descriptor: one write per part
        buffer = io.BytesIO()
        restore_raw(image, buffer)
    assert buffer.getvalue() == expected


def test_restore_raw_of_blank_runs_to_the_null_device(sparse):
    """The zeros of a blank run are views of one never-written mapping, written as they are."""
    path, expected = sparse
    with LeanImage.open(path) as image, open(os.devnull, "wb") as f:
        assert restore_raw(image, f) == len(expected)


def _owners_per_page(tables):
    """The per-page table validate built before _StoredOwners: every STORED page as (ordinal,
    expected digest, region id, page), sorted by ordinal (stably)."""
    parts = []
    for region, e, (digest_parts, _), rank0 in tables.values():
        table = np.concatenate(digest_parts) if digest_parts else np.zeros((0, 16), np.uint8)
        stored = np.flatnonzero(e["page_class"] == PageClass.STORED)
        counts = e["num_pages"][stored].astype(np.int64)
        within = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        parts.append(
            (
                np.repeat(e["first_slot"][stored].astype(np.int64), counts) + within,
                table[np.repeat(rank0[stored], counts) + within],
                np.full(len(within), region["region_id"]),
                np.repeat(e["first_page"][stored].astype(np.int64), counts) + within,
            )
        )
    ordinals, digests, region_of, page_of = (np.concatenate(column) for column in zip(*parts))
    order = np.argsort(ordinals, kind="stable")
    return ordinals[order], digests[order], region_of[order], page_of[order]


def _tables(rng, regions: int):
    """validate's per-region lookups for random page maps whose STORED extents use slots in any
    order, some overlapping or used twice (images LI-MAP-004 refuses; validate still checks
    every owner of every ordinal)."""
    from leanimg.checks import digest_ranks
    from leanimg.format import EXTENT

    tables = {}
    for region_id in range(regions):
        n = int(rng.integers(1, 40))
        extents = np.zeros(n, EXTENT.dtype)
        counts = rng.integers(1, 30, n)
        extents["num_pages"] = counts
        extents["first_page"] = np.cumsum(counts) - counts
        extents["page_class"] = rng.choice([PageClass.STORED, PageClass.ZERO, PageClass.FREE], n, p=[0.6, 0.3, 0.1])
        stored = extents["page_class"] == PageClass.STORED
        extents["first_slot"] = np.where(stored, rng.integers(0, 400, n), 0)
        bearing, rank0 = digest_ranks(extents)
        total = int(np.where(bearing, extents["num_pages"].astype(np.int64), 0).sum())
        digests = rng.integers(0, 256, (total, 16), dtype=np.uint8)
        cuts = np.sort(rng.integers(0, total + 1, 3))
        parts = np.split(digests, cuts)  # as DIGESTS records, some empty
        lengths = np.array([len(p) for p in parts], np.int64)
        fields = {"region_id": 10 + region_id, "name": f"r{region_id}"}
        tables[10 + region_id] = (fields, extents, (parts, np.cumsum(lengths) - lengths), rank0)
    return tables


@pytest.mark.parametrize("seed", range(12))
def test_stored_owners_agree_with_the_per_page_table(seed):
    rng = np.random.default_rng(seed)
    tables = _tables(rng, int(rng.integers(1, 4)))
    ordinals, digests, region_of, page_of = _owners_per_page(tables)
    owners = validate._StoredOwners(tables)
    for first, n in [(0, 7), (5, 64), (100, 1), (0, 500), (399, 50), (1000, 10)] + [
        (int(a), int(b)) for a, b in zip(rng.integers(0, 450, 20), rng.integers(1, 80, 20))
    ]:
        lo, hi = np.searchsorted(ordinals, [first, first + n])
        got = owners.in_range(first, n)
        assert np.array_equal(got[0], ordinals[lo:hi])
        assert np.array_equal(got[1], digests[lo:hi])
        assert np.array_equal(got[2], region_of[lo:hi])
        assert np.array_equal(got[3], page_of[lo:hi])


def test_validate_of_a_sparse_image(sparse):
    path, _ = sparse
    report = validate.validate(path)
    assert report.valid and report.checked["stored_pages"] == 6 and report.checked["pages"] == PAGES


@pytest.mark.parametrize("seed", range(8))
def test_blank_ends_and_windows_agree_with_the_page_classes(seed):
    from leanimg.format import EXTENT
    from leanimg.tables import Region

    class Flat:
        parent = None

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 30))
    extents = np.zeros(n, EXTENT.dtype)
    counts = rng.integers(1, 50, n)
    extents["num_pages"] = counts
    extents["first_page"] = np.cumsum(counts) - counts
    extents["page_class"] = rng.choice([PageClass.STORED, PageClass.ZERO, PageClass.FREE, PageClass.DISK], n)
    region = Region(0, "r", int(counts.sum()) * PS, None, PS)
    region.set_extents(extents, np.zeros(8, bool))
    per_page = pages.classes(region)
    blank = (per_page == PageClass.ZERO) | (per_page == PageClass.FREE)
    for page in range(region.num_pages):
        end = page
        while end < region.num_pages and blank[end]:
            end += 1
        assert pages.blank_end(Flat(), region, page) == end
    step = int(rng.integers(1, 40))
    windows = list(pages.region_windows(Flat(), region, step))
    assert [first for first, _ in windows] == sorted(first for first, _ in windows)
    assert all(a + k == b for (a, k), (b, _) in zip(windows, windows[1:]))
    assert windows[0][0] == 0 and sum(k for _, k in windows) == region.num_pages
    for first, count in windows:
        assert count <= step or blank[first : first + count].all()
