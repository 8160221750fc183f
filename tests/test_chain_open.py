"""Opening a deep chain: the links' tables checked together (tables_batch), small link files
read in one read, DELTA_FRAMEs of a restore folded at once (chain.deltas.ChainPatches).

A chain with a bad link must be refused exactly as when each link was opened and checked on
its own (same error class, rule, offset, structure, file); the reference here is that path,
attach_chain without check_links (every link through ImageTables.load as it is found)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from helpers import fds_before, open_fds
from leanimg import parent_files
from leanimg import parents as parents_module
from leanimg import reader as reader_module
from leanimg.errors import LeanImageError
from leanimg.format import (
    EXTENT,
    FOOTER,
    HEADER,
    INDEX_BODY,
    INDEX_ENTRY,
    PAGE_MAP_BODY,
    RECORD,
    IncompatFeature,
    PageClass,
    RecordType,
    align8,
    checksum64,
    page_digest,
)
from leanimg.parents import CHECK_BATCH, attach_chain
from leanimg.reader import LeanImage
from leanimg.restore.raw import restore_raw
from leanimg.writer import LeanImageWriter, ParentLink

PS = 4096
PAGES = 24
LINKS = 2 * CHECK_BATCH + 20  # three batches (small_batches): a bad link can sit in any of them
pytestmark = pytest.mark.usefixtures("small_batches")


def reseal(data: bytes) -> bytes:
    """``data`` with its header, record and footer checksums and image digest made right again
    (an edit then reaches the rules behind them)."""
    b = bytearray(data)
    (length,) = struct.unpack_from("<I", b, HEADER.offset("header_length"))
    struct.pack_into("<Q", b, HEADER.offset("header_checksum"), 0)
    struct.pack_into("<Q", b, HEADER.offset("header_checksum"), checksum64(bytes(b[:length])))
    end = len(b) - FOOTER.size
    offset = length
    while offset < end:
        (body_length,) = struct.unpack_from("<Q", b, offset + 8)
        size = RECORD.size + align8(body_length) + 8
        struct.pack_into("<Q", b, offset + size - 8, checksum64(bytes(b[offset : offset + size - 8])))
        offset += size
    struct.pack_into("<16s", b, end + FOOTER.offset("image_digest"), xxhash.xxh3_128_digest(bytes(b[:end])))
    struct.pack_into(
        "<Q",
        b,
        end + FOOTER.offset("footer_checksum"),
        checksum64(bytes(b[end : end + FOOTER.offset("footer_checksum")])),
    )
    return bytes(b)


def image_digest(path: Path) -> bytes:
    data = path.read_bytes()
    at = len(data) - FOOTER.size + FOOTER.offset("image_digest")
    return data[at : at + 16]


def _write_chain(directory: Path) -> tuple[list[Path], bytes]:
    """LINKS links over PAGES pages: each link after the root rewrites one page (STORED) and
    changes one word of another (DELTA), PARENT elsewhere. Returns the paths and final memory."""
    rng = np.random.default_rng(15)
    mem = np.frombuffer(bytearray(rng.bytes(PAGES * PS)), np.uint64).reshape(PAGES, PS // 8).copy()
    paths, parent, snap = [], None, None
    for k in range(LINKS):
        path = directory / f"link{k:04d}.lean"
        w = LeanImageWriter(path, parent=parent, frame_pages=8)
        region = w.add_region("pc.ram", PAGES * PS, 0)
        if parent is None:
            w.put_pages(region, 0, mem.tobytes())
        else:
            rewritten, worded = (2 * k) % PAGES, (2 * k + 1) % PAGES
            mem[rewritten] = rng.integers(0, 2**63, PS // 8, dtype=np.uint64)
            mem[worded, k % (PS // 8)] ^= np.uint64(k + 1)
            for page in range(PAGES):
                if page in (rewritten, worded):
                    w.put_changed(region, page, snap[page].tobytes(), mem[page].tobytes())
                else:
                    w.put_parent(region, page, page_digest(mem[page].tobytes()))
        digest = w.finish()
        parent, snap = ParentLink(w.image_uuid, digest), mem.copy()
        paths.append(path)
    return paths, mem.tobytes()


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deep-chain")
    paths, memory = _write_chain(directory)
    return paths, memory


def open_alone(path) -> LeanImage:
    """Each link loaded and checked as it is found: the path before tables_batch."""
    image = LeanImage.open_link(path)
    try:
        attach_chain(image, [], LeanImage.open_link)
    except BaseException:
        image.close()
        raise
    return image


def finding(open_image, path) -> tuple:
    with pytest.raises(LeanImageError) as info:
        open_image(path).close()
    exc = info.value
    return type(exc).__name__, exc.rule, exc.offset, exc.structure, exc.path, exc.message


# --- edits of one link, checksums made right again ------------------------------------------
def _entries(path: Path):
    with LeanImage.open_link(path) as link:
        return link.footer.index_offset, link.tables.entries.copy()


def _entry_field(path: Path, position: int, field: str) -> tuple[int, str]:
    index_offset, _ = _entries(path)
    at = index_offset + RECORD.size + INDEX_BODY.size + position * INDEX_ENTRY.size + INDEX_ENTRY.offset(field)
    return at, "<" + {"u8": "Q", "u4": "I"}[INDEX_ENTRY.field(field).type]


def _first_of(path: Path, record_type: int) -> int:
    return int(np.flatnonzero(_entries(path)[1]["record_type"] == record_type)[0])


def add_to_entry(record_type: int, field: str, amount: int | None, nth: int = 0):
    """An edit adding ``amount`` to a field of an INDEX entry (None: setting it to 0)."""

    def edit(path: Path, data: bytearray) -> None:
        positions = np.flatnonzero(_entries(path)[1]["record_type"] == record_type)
        at, fmt = _entry_field(path, int(positions[nth]), field)
        (value,) = struct.unpack_from(fmt, data, at)
        struct.pack_into(fmt, data, at, 0 if amount is None else (value + amount) % (1 << 8 * struct.calcsize(fmt)))

    return edit


def swap_last_offsets(path: Path, data: bytearray) -> None:
    n = len(_entries(path)[1])
    a, _ = _entry_field(path, n - 2, "record_offset")
    b, _ = _entry_field(path, n - 1, "record_offset")
    data[a : a + 8], data[b : b + 8] = data[b : b + 8], data[a : a + 8]


def edit_extent(field: str, amount: int, page_class: int | None = None):
    def edit(path: Path, data: bytearray) -> None:
        with LeanImage.open_link(path) as link:
            extents = link.regions[0].extents
            offset = int(link.tables.entries["record_offset"][_first_of(path, RecordType.PAGE_MAP)])
        j = 0 if page_class is None else int(np.flatnonzero(extents["page_class"] == page_class)[0])
        at = offset + RECORD.size + PAGE_MAP_BODY.size + j * EXTENT.size + EXTENT.offset(field)
        fmt = "<" + {"u8": "Q", "u4": "I", "u2": "H"}[EXTENT.field(field).type]
        (value,) = struct.unpack_from(fmt, data, at)
        struct.pack_into(fmt, data, at, value + amount)

    return edit


def clear_feature(bit: int):
    def edit(path: Path, data: bytearray) -> None:
        at = HEADER.offset("incompatible_features")
        (value,) = struct.unpack_from("<Q", data, at)
        struct.pack_into("<Q", data, at, value & ~bit)

    return edit


def both(*edits):
    def edit(path: Path, data: bytearray) -> None:
        for one in edits:
            one(path, data)

    return edit


def spoil(path: Path, edit) -> None:
    data = bytearray(path.read_bytes())
    edit(path, data)
    path.write_bytes(reseal(bytes(data)))


def relink(paths: list[Path], first: int) -> None:
    """Links first.. name their parent's new image_digest (as if written against it)."""
    for k in range(first, len(paths)):
        data = bytearray(paths[k].read_bytes())
        at = HEADER.offset("parent_digest")
        data[at : at + 16] = image_digest(paths[k - 1])
        paths[k].write_bytes(reseal(bytes(data)))


EDITS = {  # name: (edit, the rule opening the link alone reports)
    "digests first": (add_to_entry(RecordType.DIGESTS, "first", 1), "LI-DIG-001"),
    "digests count": (add_to_entry(RecordType.DIGESTS, "count", -1), "LI-DIG-001"),
    "digests key": (add_to_entry(RecordType.DIGESTS, "key", 1), "LI-REC-009"),
    "page frame first": (add_to_entry(RecordType.PAGE_FRAME, "first", 1), "LI-FRM-001"),
    "page frame count": (add_to_entry(RecordType.PAGE_FRAME, "count", 1), "LI-MAP-004"),
    "page frame count zero": (add_to_entry(RecordType.PAGE_FRAME, "count", None), "LI-FRM-004"),
    "delta frame count": (add_to_entry(RecordType.DELTA_FRAME, "count", 1), "LI-MAP-004"),
    "page map entry count": (add_to_entry(RecordType.PAGE_MAP, "count", 1), "LI-IDX-001"),
    "entries out of order": (swap_last_offsets, "LI-IDX-001"),
    "extent pages": (edit_extent("num_pages", 1), "LI-IDX-001"),
    "extent pages, entry too": (
        both(edit_extent("num_pages", 1), add_to_entry(RecordType.PAGE_MAP, "count", 1)),
        "LI-MAP-001",
    ),
    "stored slot": (edit_extent("first_slot", 1, PageClass.STORED), "LI-MAP-004"),
    "delta slot": (edit_extent("first_slot", 1, PageClass.DELTA), "LI-MAP-004"),
    "extent class": (edit_extent("page_class", 40), "LI-MAP-002"),
    "no DELTA bit": (clear_feature(IncompatFeature.DELTA), "LI-HDR-009"),
}


def test_the_chain_opens_batched_and_alone_alike(chain):
    paths, memory = chain
    with LeanImage.open(paths[-1]) as image, open_alone(paths[-1]) as alone:
        assert len(image.chain()) == len(alone.chain()) == LINKS
        for a, b in zip(image.chain(), alone.chain()):
            ra, rb = a.regions[0], b.regions[0]
            assert (ra.name, ra.size_bytes, ra.guest_phys_base) == (rb.name, rb.size_bytes, rb.guest_phys_base)
            for name in ("extents", "starts", "digest_bearing", "digest_rank0"):
                got, want = getattr(ra, name), getattr(rb, name)
                assert got.dtype == want.dtype and np.array_equal(got, want), name
            assert a.tables.digest_positions == b.tables.digest_positions
            ia, ib = a.tables.index, b.tables.index
            assert (ia.offset, ia.body_length, ia.record_checksum, bytes(ia.body)) == (
                ib.offset,
                ib.body_length,
                ib.record_checksum,
                bytes(ib.body),
            )
            assert ia.parsed.keys() == ib.parsed.keys() and ia.parsed["num_entries"] == ib.parsed["num_entries"]
            assert ia.parsed["entries"].dtype == ib.parsed["entries"].dtype
            assert ia.parsed["entries"].tobytes() == ib.parsed["entries"].tobytes()
            assert (a.disks, a.source_states, len(a.tables.disk_refs)) == (b.disks, b.source_states, 0)


@pytest.mark.parametrize("whole", [True, False], ids=["whole-read", "record-reads"])
@pytest.mark.parametrize("edit, rule", EDITS.values(), ids=EDITS.keys())
@pytest.mark.parametrize("bad", [1, CHECK_BATCH + 37, LINKS - 2], ids=["first-batch", "middle", "last-batch"])
def test_a_bad_link_is_refused_as_when_opened_alone(copy, monkeypatch, edit, rule, bad, whole):
    paths, _ = copy
    if not whole:
        for module in (reader_module, parents_module, parent_files):  # (structures.WHOLE_READ_BELOW's users)
            monkeypatch.setattr(module, "WHOLE_READ_BELOW", 0)
    spoil(paths[bad], edit)
    relink(paths, bad + 1)
    expected = finding(open_alone, paths[-1])
    assert expected[1] == rule and expected[4] == str(paths[bad])  # the edit reaches its rule in link bad
    assert finding(LeanImage.open, paths[-1]) == expected


def _checksum_at(where: str):
    """Where a checksum field of a link file is: its header's, footer's, INDEX's or PAGE_MAP's."""

    def at(path: Path, data: bytearray) -> int:
        if where == "header":
            return HEADER.offset("header_checksum")
        if where == "footer":
            return len(data) - FOOTER.size + FOOTER.offset("footer_checksum")
        index_offset, entries = _entries(path)
        if where == "index":
            return len(data) - FOOTER.size - 8
        position = int(np.flatnonzero(entries["record_type"] == RecordType.PAGE_MAP)[0])
        ends = list(entries["record_offset"][1:]) + [index_offset]
        return int(ends[position]) - 8

    return at


CHECKSUMS = {"header": "LI-HDR-004", "footer": "LI-FTR-002", "index": "LI-REC-003", "page map": "LI-REC-003"}


@pytest.mark.parametrize("where, rule", CHECKSUMS.items(), ids=CHECKSUMS.keys())
@pytest.mark.parametrize("bad", [1, CHECK_BATCH + 37], ids=["first-batch", "middle"])
def test_a_link_whose_checksum_fails_is_refused_as_when_opened_alone(copy, where, rule, bad):
    """A checksum the batch computes for all its links at once (format.span_checksums) that
    fails in one link: refused as opening it alone refuses it."""
    paths, _ = copy
    data = bytearray(paths[bad].read_bytes())
    data[_checksum_at(where)(paths[bad], data)] ^= 0x10
    paths[bad].write_bytes(bytes(data))
    relink(paths, bad + 1)
    expected = finding(open_alone, paths[-1])
    assert expected[1] == rule and expected[4] == str(paths[bad])
    assert finding(LeanImage.open, paths[-1]) == expected


def test_an_earlier_bad_link_is_reported_before_a_later_unreadable_one(copy):
    """The walk reads a later link's header before the earlier links' tables are checked: the
    earlier link's finding must still come first."""
    paths, _ = copy
    spoil(paths[LINKS - 10], add_to_entry(RecordType.DIGESTS, "first", 1))
    data = bytearray(paths[LINKS - 12].read_bytes())
    data[0] ^= 0xFF  # bad magic: refused at the header
    paths[LINKS - 12].write_bytes(bytes(data))
    expected = finding(open_alone, paths[-1])
    assert expected[1] == "LI-DIG-001" and expected[4] == str(paths[LINKS - 10])
    assert finding(LeanImage.open, paths[-1]) == expected


def test_an_earlier_bad_link_is_reported_before_a_missing_parent(copy):
    paths, _ = copy
    spoil(paths[LINKS - 5], edit_extent("num_pages", 1))
    os.unlink(paths[LINKS - 30])
    expected = finding(open_alone, paths[-1])
    assert expected[1] == "LI-IDX-001" and expected[4] == str(paths[LINKS - 5])
    assert finding(LeanImage.open, paths[-1]) == expected


def test_a_missing_parent_deep_down_is_reported_as_before(copy):
    paths, _ = copy
    os.unlink(paths[3])
    expected = finding(open_alone, paths[-1])
    assert expected[1] == "LI-CHN-001" and expected[4] == str(paths[4])
    assert finding(LeanImage.open, paths[-1]) == expected


def _batches(sizes: list[int], first: int, later: int, most_bytes: int) -> list[int]:
    """How many links each batch holds, for links of ``sizes`` in walk order: ``first``
    links, then ``later``, a batch ending early at the link that makes ``most_bytes``."""
    batches, count, held = [], 0, 0
    for size in sizes:
        count, held = count + 1, held + size
        if count >= (later if batches else first) or held >= most_bytes:
            batches.append(count)
            count, held = 0, 0
    return batches + [count] * bool(count)


@pytest.mark.parametrize(
    "later, most_bytes",
    [
        (parents_module.CHECK_BATCH_LATER, parents_module.CHECK_BATCH_BYTES),
        (50, parents_module.CHECK_BATCH_BYTES),
        (parents_module.CHECK_BATCH_LATER, 30),
        (50, 20),
        (parents_module.CHECK_BATCH_LATER, 1),
    ],
    ids=["as-set", "later-50", "30-links-of-bytes", "both", "one-byte"],
)
def test_batches_grow_within_their_bytes(chain, monkeypatch, later, most_bytes):
    """The walk checks CHECK_BATCH links first (a cold chain's checks start early), then
    CHECK_BATCH_LATER at a time (each batch costs the same however small), a batch ending at
    the link whose file makes CHECK_BATCH_BYTES (of files read whole); the links opened ahead
    come in the same runs. (``most_bytes`` under 64: that many of the links' mean size.)"""
    paths, memory = chain
    sizes = [p.stat().st_size for p in paths[-2::-1]]  # the parents, in walk order
    if most_bytes < 64:
        most_bytes = most_bytes * sum(sizes) // len(sizes)
    expected = _batches(sizes, CHECK_BATCH, later, most_bytes)
    assert len(expected) >= 2
    monkeypatch.setattr(parents_module, "CHECK_BATCH_LATER", later)
    monkeypatch.setattr(parents_module, "CHECK_BATCH_BYTES", most_bytes)
    checked, runs = [], []
    real_check, real_open = LeanImage.check_links, LeanImage.open_links
    monkeypatch.setattr(
        LeanImage, "check_links", staticmethod(lambda links: checked.append(len(links)) or real_check(links))
    )
    monkeypatch.setattr(
        LeanImage,
        "open_links",
        classmethod(lambda cls, run, kept=None: runs.append(len(run)) or real_open.__func__(cls, run, kept)),
    )
    with LeanImage.open(paths[-1]) as image:
        assert len(image.chain()) == LINKS
    assert checked == expected and runs == expected


def test_a_small_link_is_opened_with_one_read(chain, monkeypatch):
    paths, _ = chain
    reads = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: reads.append((n, at)) or real(fd, n, at))
    LeanImage.open_link(paths[LINKS // 2]).close()
    assert reads == [(paths[LINKS // 2].stat().st_size, 0)]


def _advised(monkeypatch) -> list:
    """(file size, offset, length) of every WILLNEED asked of the kernel from now on."""
    calls = []
    real = os.posix_fadvise

    def record(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            calls.append((os.fstat(fd).st_size, offset, length))
        return real(fd, offset, length, advice)

    monkeypatch.setattr(os, "posix_fadvise", record)
    return calls


@pytest.fixture(params=["thread", "here"])
def search_mode(request, monkeypatch):
    """How the parents' search reads the files beside an image: on a thread of its own
    (leanimg._native.scan_files), or on the walk's thread (without leanimg._native)."""
    if request.param == "thread" and parent_files._native is None:
        pytest.skip("leanimg._native is not built here")
    if request.param == "here":
        monkeypatch.setattr(parent_files, "_native", None)
    return request.param


@pytest.mark.parametrize("at_once", [parent_files.READ_AHEAD_FILES, 7])
def test_the_links_beside_an_image_are_read_ahead_together(chain, monkeypatch, at_once):
    """The parents' search reads every *.lean beside the image for its UUID; small files (those
    read whole when opened) are first handed to the kernel's read-ahead, the whole file each,
    ``at_once`` files at a time: a cold deep chain's reads are queued together. (Read on the
    walk's thread, where the calls can be seen; the scan on a thread of its own asks for the
    same files: test_the_scan_reads_what_the_walk_would_read.)"""
    paths, _ = chain
    monkeypatch.setattr(parent_files, "_native", None)
    monkeypatch.setattr(parent_files, "READ_AHEAD_FILES", at_once)
    advised = _advised(monkeypatch)
    LeanImage.open(paths[-1]).close()
    assert sorted(advised) == sorted((p.stat().st_size, 0, p.stat().st_size) for p in paths[:-1])  # not the image


def test_read_ahead_stops_at_its_budget_and_skips_large_files(chain, tmp_path, monkeypatch):
    """At most READ_AHEAD_BYTES are asked for; a file too large to be read whole when opened is
    not asked for; a sibling that cannot be opened (a dangling link) simply does not match."""
    paths, memory = chain
    copies = []
    for path in paths[:12]:
        copies.append(tmp_path / path.name)
        copies[-1].write_bytes(path.read_bytes())
    (tmp_path / "aaa-dangling.lean").symlink_to(tmp_path / "missing")
    (tmp_path / "zzz-large.lean").write_bytes(bytes(reader_module.WHOLE_READ_BELOW))
    sizes = sorted(p.stat().st_size for p in copies)
    monkeypatch.setattr(parent_files, "_native", None)
    monkeypatch.setattr(parent_files, "READ_AHEAD_BYTES", sum(sizes[:5]))
    advised = _advised(monkeypatch)
    with LeanImage.open(copies[-1]) as image:
        assert len(image.chain()) == 12
    assert sum(size for size, _, _ in advised) <= sum(sizes[:5]) and len(advised) >= 1
    assert all(size < reader_module.WHOLE_READ_BELOW for size, _, _ in advised)


def _odd_siblings(chain, directory: Path) -> list[str]:
    """Some of the chain's links beside every kind of file the search meets: a dangling link,
    a directory, an empty file, files too short for an image_uuid or a parent_uuid, a large
    file, an image with no parent."""
    paths, _ = chain
    for path in paths[:20]:
        (directory / path.name).write_bytes(path.read_bytes())
    (directory / "dangling.lean").symlink_to(directory / "missing")
    (directory / "a-directory.lean").mkdir()
    (directory / "empty.lean").write_bytes(b"")
    head = paths[5].read_bytes()[: HEADER.size]
    (directory / "no-uuid.lean").write_bytes(head[: HEADER.offset("image_uuid") + 15])
    (directory / "no-parent-uuid.lean").write_bytes(head[: HEADER.offset("parent_uuid") + 15])
    (directory / "large.lean").write_bytes(head + bytes(reader_module.WHOLE_READ_BELOW))
    (directory / "root.lean").write_bytes(paths[0].read_bytes())
    return sorted(str(p) for p in directory.iterdir())


@pytest.mark.skipif(parent_files._native is None, reason="leanimg._native is not built here")
@pytest.mark.parametrize("budget_files, keep", [(None, None), (7, None), (None, 5), (3, 0)])
def test_the_scan_reads_what_the_walk_would_read(chain, tmp_path, monkeypatch, budget_files, keep):
    """The scan on a thread of its own finds, per file, the UUIDs _image_uuids reads on the
    walk's thread, and keeps the same files open (the small ones its read-ahead budget allows,
    up to its limit: a file's size is given back exactly when it was asked for whole), each
    descriptor of that very file."""
    paths = _odd_siblings(chain, tmp_path)
    if budget_files is not None:
        small = sorted(Path(p).stat().st_size for p in paths if Path(p).is_file() and Path(p).stat().st_size)
        monkeypatch.setattr(parent_files, "READ_AHEAD_BYTES", sum(small[:budget_files]))
    if keep is not None:
        monkeypatch.setattr(parent_files, "KEPT_FILES_MAX", keep)
    expected_kept = {}
    expected = parent_files._image_uuids(paths, expected_kept)
    scan = parent_files._Scan(paths, parent_files._kept_most())
    got = []
    while not scan.done():
        got += scan.read(wait=True)
    scan.thread.join()
    try:
        assert [path for path, _, _ in got] == paths
        assert [found for _, found, _ in got] == expected
        assert {path: kept[1] for path, _, kept in got if kept} == {p: size for p, (_, size) in expected_kept.items()}
        assert all(os.readlink(f"/proc/self/fd/{kept[0]}") == path for path, _, kept in got if kept)
        assert any(found is None for found in expected) and any(found and found[1] is None for found in expected)
    finally:
        for fd, _ in list(expected_kept.values()) + [kept for _, _, kept in got if kept]:
            os.close(fd)


@pytest.mark.skipif(parent_files._native is None, reason="leanimg._native is not built here")
@pytest.mark.parametrize("change", ["names-unterminated", "starts-short", "fds-odd", "sizes-short", "heads-uneven"])
def test_the_native_scan_refuses_buffers_that_do_not_match(tmp_path, change):
    """scan_files refuses names and outputs that do not describe the same files (ValueError),
    and opens none of them."""
    names = [os.fsencode(tmp_path / f"{k}.lean") + b"\0" for k in range(3)]
    for name in names:
        Path(os.fsdecode(name[:-1])).write_bytes(b"x" * 100)
    starts = np.cumsum([0] + [len(n) for n in names]).astype(np.int64)
    blob = b"".join(names)
    fds, sizes, got = np.full(3, -2, np.int32), np.zeros(3, np.int64), np.zeros(3, np.int64)
    heads, progress = np.zeros((3, 48), np.uint8), np.zeros(1, np.int64)
    if change == "names-unterminated":
        blob = blob[:-1] + b"x"
    elif change == "starts-short":
        starts = starts[:-1]
    elif change == "fds-odd":
        fds = np.full(3, -2, np.int16)
    elif change == "sizes-short":
        sizes = sizes[:2]
    else:
        heads = np.zeros(3 * 48 + 1, np.uint8)
    before = fds_before()
    with pytest.raises(ValueError, match="scan_files"):
        parent_files._native.scan_files(blob, starts, 1 << 20, 1 << 30, 10, 2, fds, sizes, got, heads, progress)
    assert progress[0] == 0 and open_fds() == before


def test_a_uuid_two_files_share_is_taken_from_the_nearest_before_the_image(chain, tmp_path, search_mode):
    """Two files beside an image with the same image_uuid: the search takes the one sorting
    nearest before the image's name (a chain's links are usually named in order), on either
    path alike; here a damaged copy of the parent (its footer's checksum fails), refused
    by name. Without it the chain opens: the far copy is never taken."""
    paths, _ = chain
    for k, path in enumerate(paths[:30]):
        (tmp_path / f"link-{k:03d}.lean").write_bytes(path.read_bytes())
    parent = tmp_path / "link-028.lean"
    spoiled = bytearray(parent.read_bytes())
    spoiled[-FOOTER.size + FOOTER.offset("image_digest")] ^= 1
    (tmp_path / "link-028b.lean").write_bytes(bytes(spoiled))
    (tmp_path / "link-000a.lean").write_bytes(bytes(spoiled))  # far before: not taken
    with pytest.raises(LeanImageError) as caught:
        LeanImage.open(tmp_path / "link-029.lean").close()
    assert caught.value.path == str(tmp_path / "link-028b.lean")
    os.unlink(tmp_path / "link-028b.lean")
    with LeanImage.open(tmp_path / "link-029.lean") as image:
        assert len(image.chain()) == 30


def test_a_failed_walk_leaves_no_scan_or_file_open(copy, search_mode):
    """A parent missing deep down: the walk raises, the scan's thread has ended and every
    file it opened is closed."""
    import threading

    paths, _ = copy
    os.unlink(paths[40])
    before = fds_before()
    with pytest.raises(LeanImageError, match="not found"):
        LeanImage.open(paths[-1]).close()
    assert open_fds() == before
    assert not [t for t in threading.enumerate() if t.name == "leanimg-scan"]


@pytest.mark.usefixtures("fast_paths_alone")
@pytest.mark.parametrize("kept", [parent_files.KEPT_FILES_MAX, 5], ids=["all-kept", "five-kept"])
def test_the_links_found_beside_the_image_are_not_opened_again(chain, monkeypatch, kept, search_mode):
    """The parents' search opens each small *.lean beside the image, reads its UUIDs and keeps
    it open (KEPT_FILES_MAX at most); opening a link it kept reads that file whole, once: each
    parent is opened once (by the scan's thread, where the walk's thread does not open it);
    the files no link took are closed; the parents beyond the limit are opened again, as before."""
    paths, memory = chain
    monkeypatch.setattr(parent_files, "KEPT_FILES_MAX", kept)
    opened, whole_reads = [], []
    real_open, real_pread = os.open, os.pread
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(os.fspath(path)) or real_open(path, *a, **k))
    monkeypatch.setattr(
        os,
        "pread",
        lambda fd, n, at: (
            (n == os.fstat(fd).st_size and whole_reads.append(os.readlink(f"/proc/self/fd/{fd}")))
            or real_pread(fd, n, at)
        ),
    )
    before = fds_before()
    with LeanImage.open(paths[-1]) as image:
        assert [link.path for link in image.chain()][::-1] == [str(p) for p in paths]
        assert open_fds() == before + len(paths)  # one file open per link, nothing else
    assert open_fds() == before
    counts = [opened.count(str(p)) for p in paths[:-1]]
    once = 0 if search_mode == "thread" else 1  # the scan's own opens are not os.open's
    assert set(counts) <= {once, once + 1} and counts.count(once) == min(kept, len(counts))
    assert sorted(whole_reads) == sorted(str(p) for p in paths)  # every link read whole once


LOW_LIMIT_PROGRAM = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (400, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
from leanimg.reader import LeanImage
with LeanImage.open(sys.argv[1]) as image:
    print(len(image.chain()))
"""


def test_small_siblings_kept_open_stay_within_the_open_file_limit(chain, tmp_path):
    """The parents' search keeps small files open, but no more than a quarter of the open-file
    limit: with a limit of 400 and 500 small *.lean beside a 12-link chain (sorted first), the
    chain is still found and opened (keeping them all would leave no descriptor for it; the
    search opens READ_AHEAD_FILES, 256, at once, as it always did)."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 400:
        pytest.skip(f"the open-file limit's hard maximum here is {hard}")
    paths, _ = chain
    for k in range(500):
        (tmp_path / f"aaa-{k:03d}.lean").write_bytes(bytes(range(256)) * 4)
    copies = []
    for path in paths[:12]:
        copies.append(tmp_path / f"zzz-{path.name}")
        copies[-1].write_bytes(path.read_bytes())
    done = subprocess.run(
        [sys.executable, "-c", LOW_LIMIT_PROGRAM, str(copies[-1])], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.split() == ["12"], done.stderr


@pytest.mark.parametrize("most", [reader_module.KEPT_DIGESTS_MOST, 0], ids=["kept", "none-kept"])
def test_a_restore_reads_the_digests_its_links_kept_when_opened(chain, tmp_path, monkeypatch, most):
    """A 1.1 link read whole when opened keeps its DIGESTS bytes (up to KEPT_DIGESTS_MOST):
    the restore, which needs the digests of most links, reads no DIGESTS record again. Over
    the limit, the restore reads them from the files, as before; both restore the memory."""
    paths, memory = chain
    monkeypatch.setattr(reader_module, "KEPT_DIGESTS_MOST", most)
    digests_at = {}
    for path in paths[:-1]:
        index_offset, entries = _entries(path)
        digests_at[str(path)] = set(entries["record_offset"][entries["record_type"] == RecordType.DIGESTS].tolist())
    reads = []
    real_pread = os.pread
    monkeypatch.setattr(
        os, "pread", lambda fd, n, at: reads.append((os.readlink(f"/proc/self/fd/{fd}"), at)) or real_pread(fd, n, at)
    )
    out = tmp_path / "restored.raw"
    with LeanImage.open(paths[-1]) as image:
        links = image.chain()[1:-1]  # the root inherits nothing
        assert all(link.digests.inherits for link in links)
        for link in links:
            kept = link.tables.kept_listed
            assert sorted(kept) == (sorted(link.tables.digest_positions[0]) if most else [])
            for position, raw in kept.items():
                offset = int(link.tables.entries["record_offset"][position])
                assert raw == Path(link.path).read_bytes()[offset : link.tables.listed_end(position)]
        del reads[:]
        with open(out, "wb") as f:
            restore_raw(image, f)
    assert out.read_bytes() == memory
    digest_reads = [(path, at) for path, at in reads if at in digests_at.get(path, ())]
    assert (digest_reads == []) if most else len(digest_reads) > 0


def test_a_truncated_digests_record_in_a_link_is_reported_by_the_restore(copy):
    """DIGESTS are read when a restore first needs them (LI-DIG-003 names the link): those of
    a link near the top, whose changed pages no later link changes again."""
    paths, _ = copy
    bad = LINKS - 3

    def shorten(path: Path, data: bytearray) -> None:
        position = _first_of(path, RecordType.DIGESTS)
        offset = int(_entries(path)[1]["record_offset"][position])
        at = offset + RECORD.size + 4  # digests_body.num_digests
        (value,) = struct.unpack_from("<I", data, at)
        struct.pack_into("<I", data, at, value - 1)

    spoil(paths[bad], shorten)
    relink(paths, bad + 1)
    found = []
    for open_image in (LeanImage.open, open_alone):
        with open_image(paths[-1]) as image, pytest.raises(LeanImageError) as info:
            restore_raw(image, open(os.devnull, "wb"))
        found.append((info.value.rule, info.value.offset, info.value.structure, info.value.path))
    assert found[0] == found[1] and found[0][0] == "LI-REC-007" and found[0][3] == str(paths[bad])


def test_the_deep_chain_restores_its_final_memory(chain, tmp_path):
    paths, memory = chain
    out = tmp_path / "out.raw"
    with LeanImage.open(paths[-1]) as image, open(out, "wb") as f:
        restore_raw(image, f)
    assert out.read_bytes() == memory


@pytest.mark.usefixtures("fast_paths_alone")
@pytest.mark.parametrize("most, alone", [(None, 0), (0, LINKS - 1)], ids=["small-links-batched", "large-links-alone"])
def test_links_with_many_extents_are_checked_alone(chain, monkeypatch, most, alone):
    """The batch pays for small links only: a link whose PAGE_MAP holds more than
    BATCH_EXTENTS_MAX extents goes to ImageTables.load (here every link, with the limit 0)."""
    from leanimg import tables_batch
    from leanimg.tables import ImageTables

    paths, _ = chain
    if most is not None:
        monkeypatch.setattr(tables_batch, "BATCH_EXTENTS_MAX", most)
    loads = []
    real = ImageTables.load
    monkeypatch.setattr(ImageTables, "load", lambda self: loads.append(self.file.name) or real(self))
    with LeanImage.open(paths[-1]) as image:
        assert len(image.chain()) == LINKS
    assert len(loads) == 1 + alone  # the child itself is opened alone


# --- any edit of the tables: the batch agrees with the one-link-at-a-time open ---------------
SHORT = 4  # links of the chain the property test spoils (one batch)


def _record_spans(path: Path) -> list[tuple[int, int]]:
    """(start, end) of the bytes a table check reads: the whole of the REGION, PAGE_MAP,
    DIGESTS and INDEX records, the record header of each frame."""
    index_offset, entries = _entries(path)
    data = path.read_bytes()
    spans = []
    for offset, record_type in [
        *zip(entries["record_offset"].tolist(), entries["record_type"].tolist()),
        (index_offset, int(RecordType.INDEX)),
    ]:
        (body_length,) = struct.unpack_from("<Q", data, offset + 8)
        tables = record_type in (RecordType.REGION, RecordType.PAGE_MAP, RecordType.DIGESTS, RecordType.INDEX)
        spans.append((offset, offset + (RECORD.size + align8(body_length) if tables else RECORD.size)))
    return spans


def _outcome(open_image, path: Path):
    """None and the tables when the chain opens, else the finding."""
    try:
        image = open_image(path)
    except LeanImageError as exc:
        return (type(exc).__name__, exc.rule, exc.offset, exc.structure, exc.path, exc.message), None
    with image:
        return None, [
            (r.extents.tobytes(), r.starts.tobytes(), r.digest_bearing.tobytes(), r.digest_rank0.tobytes())
            for link in image.chain()
            for r in link.regions
        ]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_table_edit_is_judged_by_the_batch_as_by_each_link_alone(chain, tmp_path_factory, data):
    """A byte of a table record (or a frame's record header; not a body_length, which reseal
    walks by) of one link of a short chain set to any value, checksums made right again: opening the chain
    batched either gives the same
    tables as opening each link alone, or the same finding (class, rule, offset, structure,
    file, message). The batch only *accepts* quickly; it must never accept what a link's own
    checks refuse, nor refuse differently."""
    paths, _ = chain
    directory = tmp_path_factory.mktemp("edited")
    short = [directory / p.name for p in paths[:SHORT]]
    for source, target in zip(paths, short):
        target.write_bytes(source.read_bytes())
    bad = data.draw(st.integers(0, SHORT - 1), label="link")
    start, end = data.draw(st.sampled_from(_record_spans(short[bad])), label="record")
    at = data.draw(st.integers(start, end - 1).filter(lambda a: not 8 <= a - start < 16), label="offset")
    value = data.draw(st.integers(0, 255), label="value")
    spoiled = bytearray(short[bad].read_bytes())
    spoiled[at] = value
    short[bad].write_bytes(reseal(bytes(spoiled)))
    relink(short, bad + 1)
    batched = _outcome(LeanImage.open, short[-1])
    event("refused" if batched[0] else "opened")
    assert batched == _outcome(open_alone, short[-1])
