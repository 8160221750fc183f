"""Chain restores read range by range (issue 15 §3): a forward pass decompresses each frame
once and carries the live pages later ranges need; superseded pages are never verified, live
ones always are, whatever the ranges."""

from __future__ import annotations

import random
import struct
from collections import Counter

import numpy as np
import pytest
import zstandard

from helpers import disk_sources
from leanimg.errors import FormatError, LeanImageError
from leanimg import delta
from leanimg.format import DeltaEncoding, PageClass, checksum64, page_digest
from leanimg.frames import FrameBuffers, FrameStore
from leanimg.incremental import parent_link
from leanimg.inspect import class_counts
from leanimg.reader import LeanImage
from leanimg.writer import LeanImageWriter, disk_fingerprint
import leanimg.chain
import leanimg.chain.deltas
import leanimg.writer
from test_chain import PAGES, PS, build_chain

MARK = b"\xab" * PS  # the root's one stored page whose digest lies


def _joined(image, region, ranges, read) -> bytes:
    parts = []
    for first, count in ranges:
        if read == "pieces":
            parts += [
                bytes(n * PS) if data is None else bytes(data) for n, data in image.region_pieces(region, first, count)
            ]
        else:
            parts.append(bytes(image.region_bytes(region, first, count)))
    return b"".join(parts)


def _forward(num_pages: int, step: int) -> list[tuple[int, int]]:
    return [(first, min(step, num_pages - first)) for first in range(0, num_pages, step)]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return build_chain(tmp_path_factory.mktemp("chain"), depth=12)


@pytest.fixture
def counted_loads(monkeypatch):
    """(link path, frame) -> how many times that PAGE_FRAME was decompressed."""
    loads = Counter()
    load = FrameStore._load

    def counting(self, frame, buffers=None):
        loads[(self.tables.file.name, frame)] += 1
        return load(self, frame, buffers)

    monkeypatch.setattr(FrameStore, "_load", counting)
    return loads


@pytest.mark.parametrize("read", ["pieces", "bytes"])
@pytest.mark.parametrize("step", [1, 7, 50, PAGES])
@pytest.mark.parametrize("read_ahead", [True, False])
def test_a_forward_pass_decompresses_each_frame_once(chain, counted_loads, read, step, read_ahead):
    paths, memories = chain
    with LeanImage.open(paths[-1]) as image:
        if read_ahead:
            image.enable_read_ahead()
        assert _joined(image, image.regions[0], _forward(PAGES, step), read) == memories[-1]
        cached = [key for link in image.chain() for key in link.frames._cache if key[0] == "page"]
    assert counted_loads and max(counted_loads.values()) == 1, counted_loads
    assert len({path for path, _ in counted_loads}) > 1  # the pass drew on several links
    assert cached == []  # and holds no frame afterwards


def test_ranges_in_any_order_give_the_same_bytes(chain):
    """Reads that do not continue a pass (random ranges, a range twice, a pass started in the
    middle) end it and read frame by frame: same bytes."""
    paths, memories = chain
    ranges = _forward(PAGES, 11)
    random.Random(3).shuffle(ranges)
    ranges += [ranges[-1], (0, 30), (30, 30), (60, PAGES - 60), (100, 1), (101, 91)]
    with LeanImage.open(paths[-1]) as image:
        image.enable_read_ahead()
        region = image.regions[0]
        for first, count in ranges:
            expected = memories[-1][first * PS : (first + count) * PS]
            assert _joined(image, region, [(first, count)], "pieces") == expected
            assert _joined(image, region, [(first, count)], "bytes") == expected


# --- a later link superseding pages of every frame of an earlier one -----------------------------
ROOT_PAGES, FRAME = 64, 4  # root: pages 0-3 on the disk, 4-63 STORED in frames of 4 pages


def _page(k: int) -> bytes:
    return np.random.default_rng(1000 + k).bytes(PS)


def _changed(page: bytes, word: int, words: int = 1) -> bytes:
    out = bytearray(page)
    out[word * 8 : (word + words) * 8] = b"changed!" * words
    return bytes(out)


def _lying_digests(monkeypatch):
    """The writer gives the MARK page the digest of another page (its bytes are not what it says)."""
    real = leanimg.writer.page_digests

    def lying(data, page_size):
        digests = real(data, page_size).copy()
        pages = np.frombuffer(data, np.uint8).reshape(-1, page_size)
        for row in np.flatnonzero((pages == MARK[0]).all(axis=1)).tolist():
            digests[row] = np.frombuffer(page_digest(_page(999)), np.uint8)
        return digests

    monkeypatch.setattr(leanimg.writer, "page_digests", lying)


def _supersede_chain(tmp_path, monkeypatch, mark_page: int):
    """root (DISK pages 0-3, STORED 4-63 with MARK at ``mark_page``), child (one page of every
    root frame rewritten: 4, 8, ..., 60; the rest PARENT), grandchild (DELTA over PARENT over
    DISK on pages 0-3, DELTA over the child's page 12 and, a RUNS entry, which takes the
    checked path, over the root's page 13).  Returns the
    grandchild's path, the disk and the grandchild's memory."""
    disk = b"".join(_page(k) for k in range(4))
    (tmp_path / "disk.img").write_bytes(disk)
    root_mem = [_page(k) for k in range(ROOT_PAGES)]
    root_mem[mark_page] = MARK
    root = tmp_path / "root.lean"
    with monkeypatch.context() as patch:
        _lying_digests(patch)
        with LeanImageWriter(root, frame_pages=FRAME, threads=1) as w:
            d = w.add_disk("vda", len(disk), disk_fingerprint(lambda o, k: disk[o : o + k], len(disk)))
            rid = w.add_region("pc.ram", ROOT_PAGES * PS, 0)
            for p in range(4):
                w.put_disk(rid, p, d, p * PS // 512, page_digest(disk[p * PS : (p + 1) * PS]))
            w.put_pages(rid, 4, b"".join(root_mem[4:]))
    child_mem = list(root_mem)
    with LeanImage.open(root) as parent:
        link = parent_link(parent)
        digests = [parent.expected_digest(parent.regions[0], p) for p in range(ROOT_PAGES)]
    child = tmp_path / "child.lean"
    with LeanImageWriter(child, parent=link, frame_pages=FRAME) as w:
        rid = w.add_region("pc.ram", ROOT_PAGES * PS, 0)
        for p in range(ROOT_PAGES):
            if p >= 4 and p % FRAME == 0:
                child_mem[p] = _page(500 + p)
                w.put_pages(rid, p, child_mem[p])
            else:
                w.put_parent(rid, p, digests[p])
    with LeanImage.open(child, parents=[root]) as parent:
        link = parent_link(parent)
    grand_mem = list(child_mem)
    grandchild = tmp_path / "grandchild.lean"
    with LeanImageWriter(grandchild, parent=link, frame_pages=FRAME) as w:
        rid = w.add_region("pc.ram", ROOT_PAGES * PS, 0)
        for p in range(ROOT_PAGES):
            if p in (0, 1, 2, 3, 12, 13):
                grand_mem[p] = _changed(child_mem[p], p + 1, words=40 if p == 13 else 1)
                assert w.put_changed(rid, p, child_mem[p], grand_mem[p]) == PageClass.DELTA
            else:
                w.put_parent(rid, p, page_digest(child_mem[p]))
    assert delta.encode(child_mem[13], grand_mem[13])[0] == DeltaEncoding.RUNS
    return grandchild, tmp_path / "disk.img", b"".join(grand_mem)


def _read_all_ways(image, memory_pages: int):
    region = image.regions[0]
    image.enable_read_ahead()
    for step in (memory_pages, 5, 16):
        for read in ("pieces", "bytes"):
            yield lambda: _joined(image, region, _forward(memory_pages, step), read)


def test_pages_superseded_in_every_frame_restore_bit_exact(tmp_path, monkeypatch, counted_loads):
    """The child rewrites a page of every root frame, so every root frame holds a superseded
    page (MARK, whose digest lies, among them) beside live ones; the grandchild's restore
    decompresses each of them once, never checks the superseded pages, and is bit-exact."""
    grandchild, disk, memory = _supersede_chain(tmp_path, monkeypatch, mark_page=8)
    with disk_sources({"vda": disk}) as disks, LeanImage.open(grandchild, disks=disks) as image:
        counts = class_counts(image)
        assert counts[PageClass.DELTA] == 6 and counts[PageClass.PARENT] == ROOT_PAGES - 6
        for read in _read_all_ways(image, ROOT_PAGES):
            counted_loads.clear()
            assert read() == memory
            root_frames = [frame for path, frame in counted_loads if path.endswith("root.lean")]
            assert sorted(root_frames) == list(range((ROOT_PAGES - 4) // FRAME))
            assert max(counted_loads.values()) == 1


def test_a_lying_live_page_is_reported_whatever_the_ranges(tmp_path, monkeypatch):
    """The same chain with MARK on page 10, which no link supersedes: every read names it."""
    grandchild, disk, _ = _supersede_chain(tmp_path, monkeypatch, mark_page=10)
    with disk_sources({"vda": disk}) as disks, LeanImage.open(grandchild, disks=disks) as image:
        for read in _read_all_ways(image, ROOT_PAGES):
            with pytest.raises(FormatError) as info:
                read()
            assert info.value.rule == "LI-DIG-002" and "page 10" in str(info.value)


def test_the_lying_page_is_the_only_difference(tmp_path, monkeypatch):
    """Control for the two tests above: the root alone is refused at MARK's page exactly."""
    for mark in (8, 10):
        (tmp_path / str(mark)).mkdir()
        grandchild, _, _ = _supersede_chain(tmp_path / str(mark), monkeypatch, mark_page=mark)
        with LeanImage.open(grandchild.with_name("root.lean")) as root:
            region = root.regions[0]
            assert root.read_page(region, mark + 1) == _page(mark + 1)
            with pytest.raises(FormatError, match=f"page {mark}"):
                root.read_page(region, mark)


# --- a forward pass folds every delta at once (chain.deltas.ChainPatches) --------------------------
FOLD_PAGES = 16


def _bad_index_list() -> bytes:
    """An INDEX_LIST entry whose word positions descend (LI-DLT-003): not a plain entry."""
    from leanimg.format import DELTA_ENTRY

    return (
        DELTA_ENTRY.pack(encoding=DeltaEncoding.INDEX_LIST, num_words=2)
        + np.array([9, 3], "<u2").tobytes()
        + np.array([1, 2], "<u8").tobytes()
    )


def _fold_chain(directory, links: int = 7, bad_link: int | None = None, runs_only: bool = False):
    """A root of FOLD_PAGES random pages and ``links`` children: every child sets the same
    words of pages 0-3 (the nearest link's value must win), 40 consecutive words of page 4
    (a RUNS entry), 200 scattered words of page 5 (a BITMAP entry), a few words of page 6 and
    a word of page 7 + k; with ``bad_link``, that child's page 8 is a bad INDEX_LIST entry;
    with ``runs_only``, only page 4 changes (no plain INDEX_LIST at all).
    Returns (paths, the last link's memory)."""
    rng = np.random.default_rng(5)
    mem = np.frombuffer(bytearray(rng.bytes(FOLD_PAGES * PS)), np.uint64).reshape(FOLD_PAGES, PS // 8).copy()
    paths, parent = [], None
    for k in range(links + 1):
        before = mem.copy()
        if k and runs_only:
            mem[4, 100 + k : 140 + k] = rng.integers(0, 2**63, 40, dtype=np.uint64)
        elif k:
            mem[0:4, [1, 77, 300]] = rng.integers(0, 2**63, (4, 3), dtype=np.uint64)
            mem[4, 100:140] = rng.integers(0, 2**63, 40, dtype=np.uint64)
            mem[5, rng.choice(PS // 8, 200, replace=False)] = rng.integers(0, 2**63, 200, dtype=np.uint64)
            mem[6, [k, 2 * k + 50]] ^= np.uint64(k)
            mem[7 + k % 8, 11] ^= np.uint64(0xFF)
        path = directory / f"fold{k:02d}.lean"
        w = LeanImageWriter(path, parent=parent, frame_pages=4)
        region = w.add_region("pc.ram", FOLD_PAGES * PS, 0)
        for page in range(FOLD_PAGES):
            if not k:
                w.put_pages(region, page, mem[page].tobytes())
            elif k == bad_link and page == 8:
                w.put_delta(region, page, _bad_index_list(), page_digest(mem[page].tobytes()))
            elif (mem[page] != before[page]).any():
                w.put_changed(region, page, before[page].tobytes(), mem[page].tobytes())
            else:
                w.put_parent(region, page, page_digest(mem[page].tobytes()))
        digest = w.finish()
        parent = leanimg.writer.ParentLink(w.image_uuid, digest)
        paths.append(path)
    return paths, mem.tobytes()


def _encodings(path) -> Counter:
    with LeanImage.open_link(path) as link:
        frames = link.frames
        return Counter(int(bytes(e)[0]) for e in frames.delta_entries(np.arange(frames.delta_frames.total)))


@pytest.mark.parametrize("step", [3, 5, FOLD_PAGES])
@pytest.mark.parametrize("read_ahead", [True, False])
@pytest.mark.parametrize("batch_entries", [1, 3, 1 << 14])
def test_a_forward_pass_folds_the_deltas_of_every_link(tmp_path, monkeypatch, step, read_ahead, batch_entries):
    """Folded in batches of whole DELTA_FRAMEs (one frame a batch, a few, all of them): a word
    every link sets takes the nearest link's value across batches too."""
    monkeypatch.setattr(leanimg.chain.deltas.ChainPatches, "BATCH_ENTRIES", batch_entries)
    paths, memory = _fold_chain(tmp_path)
    assert {DeltaEncoding.INDEX_LIST, DeltaEncoding.RUNS, DeltaEncoding.BITMAP} <= set(_encodings(paths[-1]))
    with LeanImage.open(paths[-1]) as image:
        if read_ahead:
            image.enable_read_ahead()
        region = image.regions[0]
        assert _joined(image, region, _forward(FOLD_PAGES, step), "pieces") == memory
        assert region.region_id in image._resolutions and image.resolution(region).chain_patches is None  # dropped
        assert _joined(image, region, _forward(FOLD_PAGES, step), "bytes") == memory


@pytest.mark.parametrize("batch_entries", [1, 3, 1 << 14])
@pytest.mark.parametrize("ahead_entries", ["same", "other"], ids=["batches-as-folded", "other-batches"])
def test_a_forward_pass_parses_the_delta_frames_while_the_chain_is_resolved(
    tmp_path, monkeypatch, batch_entries, ahead_entries
):
    """A forward pass begins reading and parsing the chain's DELTA_FRAMEs on the read-ahead
    workers before it resolves the chain (chain.parse_deltas_ahead), in the batches it will
    fold: each batch is parsed once. Batches other than the fold's (here: cut by another size,
    as when some frames are not in use) are parsed again by the fold; the memory is the same."""
    monkeypatch.setattr(leanimg.chain.deltas.ChainPatches, "BATCH_ENTRIES", batch_entries)
    parsed, real_parse = [], leanimg.chain.deltas._parse_delta_batch
    monkeypatch.setattr(
        leanimg.chain.deltas,
        "_parse_delta_batch",
        lambda frames, page_size: (
            parsed.append(tuple((link.path, frame) for link, frame in frames)) or real_parse(frames, page_size)
        ),
    )
    real_ahead = leanimg.chain.parse_deltas_ahead

    def ahead(image):
        if ahead_entries == "other":  # one batch of all where the fold's are small, else one a frame
            monkeypatch.setattr(
                leanimg.chain.deltas.ChainPatches, "BATCH_ENTRIES", 1 << 20 if batch_entries < 1 << 14 else 1
            )
        try:
            return real_ahead(image)
        finally:
            monkeypatch.setattr(leanimg.chain.deltas.ChainPatches, "BATCH_ENTRIES", batch_entries)

    monkeypatch.setattr(leanimg.chain, "parse_deltas_ahead", ahead)
    paths, memory = _fold_chain(tmp_path)
    with LeanImage.open(paths[-1]) as image:
        image.enable_read_ahead()
        frames = [(link.path, f) for link in image.chain() for f in range(len(link.frames.delta_frames))]
        assert _joined(image, image.regions[0], _forward(FOLD_PAGES, 5), "pieces") == memory
        assert image.resolution(image.regions[0]).deltas_ahead is None  # taken by the fold, then let go
    folded = [
        tuple(frames[lo:hi])
        for lo, hi in zip(
            *(lambda cuts: (cuts, cuts[1:]))(
                leanimg.chain.deltas._batch_cuts(
                    np.concatenate([LeanImage.open_link(p).frames.delta_frames.counts for p in reversed(paths)])
                )
            )
        )
    ]
    assert len(folded) > (batch_entries == 1)  # several batches where they are small
    if ahead_entries == "same":
        assert sorted(parsed) == sorted(folded)  # each once: the fold used the parses begun ahead
    else:
        assert set(folded) <= set(parsed) and len(parsed) > len(folded)


def test_parses_begun_ahead_are_not_held_where_no_delta_applies(tmp_path):
    """A chain whose one DELTA_FRAME no page needs (a later link stores its pages anew; the
    frame broken): a forward pass parses it ahead, but the resolution does not hold the parse
    (no fold would take it) and nothing is raised, even in a range that builds no page; the
    pages are those the checked path reads."""
    paths, _ = _superseding_chain(tmp_path, superseded=True)
    with LeanImage.open(paths[2]) as image:
        image.enable_read_ahead()
        region = image.regions[0]
        assert sum(len(link.frames.delta_frames) for link in image.chain()) == 1
        first = _joined(image, region, [(0, 4)], "pieces")  # one frame's pages: served as its view
        resolution = image.resolution(region)
        assert not len(resolution.delta_pages) and resolution.deltas_ahead is None
        assert resolution.chain_patches is None  # no fold was made
        rest = _joined(image, region, _forward(FOLD_PAGES, 4)[1:], "pieces")
    with LeanImage.open(paths[2]) as image:
        assert _joined(image, image.regions[0], _forward(FOLD_PAGES, 5), "bytes") == first + rest


def _superseding_chain(directory, superseded: bool):
    """root: FOLD_PAGES random pages; link 1: word deltas on pages 0-3; link 2: pages
    0-3 stored anew (``superseded``) or PARENT; link 3: a word delta on page 9. Link 1's
    DELTA_FRAME then has its record's checksum broken. Returns (paths, the last link's memory)."""
    rng = np.random.default_rng(9)
    mem = np.frombuffer(bytearray(rng.bytes(FOLD_PAGES * PS)), np.uint64).reshape(FOLD_PAGES, PS // 8).copy()
    paths, parent = [], None
    for k in range(4):
        before = mem.copy()
        if k == 1:
            mem[0:4, 7] ^= np.uint64(0x5A5A)
        elif k == 2 and superseded:
            mem[0:4] = rng.integers(0, 2**63, (4, PS // 8), dtype=np.uint64)
        elif k == 3:
            mem[9, 100] ^= np.uint64(1)
        path = directory / f"sup{k}.lean"
        w = LeanImageWriter(path, parent=parent, frame_pages=4)
        region = w.add_region("pc.ram", FOLD_PAGES * PS, 0)
        for page in range(FOLD_PAGES):
            if not k or (k == 2 and superseded and page < 4):
                w.put_pages(region, page, mem[page].tobytes())
            elif (mem[page] != before[page]).any():
                assert w.put_changed(region, page, before[page].tobytes(), mem[page].tobytes()) == PageClass.DELTA
            else:
                w.put_parent(region, page, page_digest(mem[page].tobytes()))
        parent = leanimg.writer.ParentLink(w.image_uuid, w.finish())
        paths.append(path)
    with LeanImage.open_link(paths[1]) as link:
        position = int(link.frames.delta_frames.positions[0])
        offset = int(link.tables.entries["record_offset"][position])
    data = bytearray(paths[1].read_bytes())
    (body_length,) = struct.unpack_from("<Q", data, offset + 8)
    data[offset + 16 + (body_length + 7) // 8 * 8] ^= 0xFF  # the record's checksum
    paths[1].write_bytes(bytes(data))
    return paths, mem.tobytes()


@pytest.mark.parametrize("read_ahead", [True, False])
def test_a_broken_delta_frame_no_page_needs_is_not_read(tmp_path, read_ahead):
    """A forward pass reads only the DELTA_FRAMEs whose entries apply: one whose entries a
    later link's stored pages all supersede does not fail the restore, and one that is needed
    fails it with its own finding, with or without workers."""
    found = []
    for superseded in (True, False):
        directory = tmp_path / f"superseded-{superseded}"
        directory.mkdir()
        paths, memory = _superseding_chain(directory, superseded)
        with LeanImage.open(paths[-1]) as image:
            if read_ahead:
                image.enable_read_ahead()
            region = image.regions[0]
            if superseded:
                assert _joined(image, region, _forward(FOLD_PAGES, 5), "pieces") == memory
                continue
            with pytest.raises(LeanImageError) as info:
                _joined(image, region, _forward(FOLD_PAGES, 5), "pieces")
            found.append((info.value.rule, info.value.offset, info.value.path))
        with LeanImage.open_link(paths[1]) as link, pytest.raises(LeanImageError) as alone:
            link.frames.delta_entry(0)
    assert found == [(alone.value.rule, alone.value.offset, str(paths[1]))]
    assert alone.value.rule.startswith("LI-REC-")


@pytest.mark.parametrize("read", ["pieces", "bytes"])
@pytest.mark.parametrize("batch_entries", [1, 1 << 14])
def test_a_bad_delta_entry_in_a_middle_link_is_reported_alike(tmp_path, monkeypatch, read, batch_entries):
    monkeypatch.setattr(leanimg.chain.deltas.ChainPatches, "BATCH_ENTRIES", batch_entries)
    paths, _ = _fold_chain(tmp_path, bad_link=4)
    with LeanImage.open(paths[-1]) as image, pytest.raises(FormatError) as info:
        image.enable_read_ahead()
        _joined(image, image.regions[0], _forward(FOLD_PAGES, 5), read)
    assert info.value.rule == "LI-DLT-003" and info.value.path == str(paths[4])
    assert info.value.structure.startswith("record[") and ".delta_frame.entries[" in info.value.structure


def test_a_chain_whose_deltas_are_all_runs_restores(tmp_path):
    """No plain INDEX_LIST entry to fold: every delta goes the checked path."""
    paths, memory = _fold_chain(tmp_path, runs_only=True)
    assert set(_encodings(paths[-1])) == {DeltaEncoding.RUNS}
    with LeanImage.open(paths[-1]) as image:
        image.enable_read_ahead()
        assert _joined(image, image.regions[0], _forward(FOLD_PAGES, 5), "pieces") == memory


# --- frames decompressed into buffers used again (frames.FrameBuffers) ---------------------------
def _pieces_pass(path, step: int, read_ahead: bool) -> bytes:
    with LeanImage.open(path) as image:
        if read_ahead:
            image.enable_read_ahead()
        return _joined(image, image.regions[0], _forward(PAGES, step), "pieces")


def test_a_forward_pass_decompresses_into_a_few_buffers(chain, counted_loads, monkeypatch):
    """Far fewer buffers are made than frames decompressed (they are given back and taken
    again), and the restore is bit-exact: no buffer is reused while a page in it is needed."""
    made = []
    take = FrameBuffers.take

    def counting(self, size):
        buffer = take(self, size)
        if all(buffer is not old for old in made):
            made.append(buffer)
        return buffer

    monkeypatch.setattr(FrameBuffers, "take", counting)
    paths, memories = chain
    assert _pieces_pass(paths[-1], 7, read_ahead=True) == memories[-1]
    decompressed = sum(counted_loads.values())
    assert decompressed > 2 * len(made) > 0, (decompressed, len(made))


def test_a_buffer_goes_back_only_from_the_one_it_was_lent_to():
    buffers = FrameBuffers()
    lent = buffers.take(4096)
    view = memoryview(lent)[:100]
    buffers.give(memoryview(bytearray(4096)))  # never lent: ignored
    buffers.give(b"x" * 4096)
    assert buffers.take(4096) is not lent  # still lent: not handed out twice
    buffers.give(view)
    buffers.give(view)  # twice: kept once
    assert buffers.take(100) is lent
    assert buffers.take(100) is not lent
    buffers.give(memoryview(lent))
    big = buffers.take(len(lent) + 1)
    assert big is not lent and len(big) > len(lent)  # one too small is not handed out
    buffers.give(memoryview(big))
    assert buffers.take(10) is lent and buffers.take(10) is big  # the smallest that fits first


def test_a_frame_asked_for_to_keep_is_not_a_lent_buffer(chain):
    """A frame decompressed ahead into a lent buffer but then asked for with keep=True (a
    random read meeting a forward pass) is cached as a copy: giving the buffer back cannot
    change the cached frame."""
    paths, memories = chain
    with LeanImage.open(paths[-1]) as image:
        image.enable_read_ahead()
        root = image.chain()[-1]
        buffers = FrameBuffers()
        root.frames.prefetch([0], image.frames.pool, buffers=buffers)
        content = root.frames.frame(0, keep=True)[0]
        assert isinstance(content, bytes)
        cached = root.frames.frame(0)[0]
        assert cached is content
        expected = bytes(content)
        buffers.take(len(content))[:] = b"\x00" * len(content)  # the lent buffer, written over
        assert root.frames.frame(0)[0] == expected


def _frame_record(link, frame: int) -> tuple[int, int]:
    """(offset, size) of PAGE_FRAME ``frame``'s record in ``link``'s file."""
    record = link.tables.frame_record(link.tables.page_frames, frame)
    return record.offset, record.size


def _spoil(path, offset: int, size: int, how: str) -> None:
    """``truncated``: the file cut inside the record; ``flipped``: a byte of its zstd frame
    changed; ``resealed``: the frame's first block made of the reserved type, the record
    checksum made right again (so the frame itself is refused)."""
    data = bytearray(path.read_bytes())
    if how == "truncated":
        data = data[: offset + size // 2]
    elif how == "flipped":
        data[offset + size // 2] ^= 0xFF
    else:
        frame = data.index(b"\x28\xb5\x2f\xfd", offset)
        data[frame + zstandard.frame_header_size(bytes(data[frame : frame + 18]))] |= 0b110
        struct.pack_into("<Q", data, offset + size - 8, checksum64(bytes(data[offset : offset + size - 8])))
    path.write_bytes(bytes(data))


def _error_of(paths, original: bytes, read: str, step: int, read_ahead: bool, spoil) -> tuple:
    """The error a pass gives when ``spoil`` changes the root's file after the chain is open."""
    paths[0].write_bytes(original)
    with LeanImage.open(paths[-1]) as image:
        if read_ahead:
            image.enable_read_ahead()
        spoil(image)
        with pytest.raises(LeanImageError) as info:
            _joined(image, image.regions[0], _forward(PAGES, step), read)
    e = info.value
    return type(e).__name__, e.rule, e.offset, e.structure, str(e.path), str(e)


@pytest.mark.parametrize("how", ["truncated", "flipped", "resealed"])
def test_a_link_changed_while_read_ahead_gives_the_same_error(tmp_path, how):
    """A link's file cut short or changed after the chain was opened, inside a frame the pass
    needs: the pass decompressing ahead into lent buffers reports what reading without
    read-ahead reports (rule, offset, structure, file, message)."""
    paths, _ = build_chain(tmp_path, depth=4)
    original = paths[0].read_bytes()

    def spoil(image):
        _spoil(paths[0], *_frame_record(image.chain()[-1], 3), how)

    for read in ("pieces", "bytes"):
        for step in (7, PAGES):
            ahead, alone = (_error_of(paths, original, read, step, read_ahead, spoil) for read_ahead in (True, False))
            assert ahead == alone
            kind, rule, offset, structure, path, _ = ahead
            assert path == str(paths[0]) and offset is not None and structure.startswith("record["), ahead
            assert (kind, rule) == {
                "truncated": ("TruncatedError", None),
                "flipped": ("FormatError", "LI-REC-003"),
                "resealed": ("FormatError", "LI-FRM-002"),
            }[how], ahead
