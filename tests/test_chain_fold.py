"""A chain folded in one pass: chain.resolve lays every link's own pages end to end, and the
inherited digests (format 1.1) come from every digest link's DIGESTS records read together
(digests.read_tables). Both must give exactly what folding link by link gives, and a bad
DIGESTS record anywhere in the chain must be refused exactly as when its link is read alone
(same class, rule, offset, structure, file, message).

The references here are the link-by-link algorithms the one-pass ones replaced: a loop over
the links from the root, each assigning its own pages; each digest link's digests looked up
through its own DigestStore.table."""

from __future__ import annotations

import struct
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from leanimg.chain import deltas as deltas_module, resolution as resolution_module, resolve
from leanimg.chain.deltas import _quick_delta_frame, _read_delta_batch, _read_delta_batch_native
from leanimg.errors import LeanImageError
from leanimg.format import (
    DIGEST_SIZE,
    INDEX_BODY,
    INDEX_ENTRY,
    IS_CONCRETE,
    RECORD,
    PageClass,
    RecordType,
    page_digest,
    zero_page_digest,
)
from leanimg.reader import LeanImage
from leanimg.restore.raw import restore_raw
from leanimg.writer import LeanImageWriter, ParentLink
from test_chain_open import relink, reseal

PS = 4096
PAGES = 12
KINDS = ("parent", "rewrite", "word", "zero", "free")


# --- the references: link by link -------------------------------------------------------------
def reference_resolve(image, region) -> dict:
    """The fold as it was, one link at a time from the root (nearest link assigned last)."""
    links = image.chain()
    n = region.num_pages
    regions = [region] + [next((r for r in link.regions if r.name == region.name), None) for link in links[1:]]
    base_link = np.full(n, -1, np.int32)
    base_class, base_slot, digest_link = np.zeros(n, np.uint8), np.zeros(n, np.int64), np.full(n, -1, np.int32)
    deltas = []
    for depth in range(len(links) - 1, -1, -1):
        r = regions[depth]
        if r is None:
            continue
        pages, classes, slots = _own_pages(r, n)
        concrete = IS_CONCRETE[classes]
        base_link[pages[concrete]] = depth
        base_class[pages[concrete]] = classes[concrete]
        base_slot[pages[concrete]] = slots[concrete]
        if links[depth].digests.inherits:
            digest_link[pages] = depth
        else:
            digest_link[: min(n, r.num_pages)] = depth
        delta = classes == PageClass.DELTA
        deltas += [(int(p), depth, int(s)) for p, s in zip(pages[delta], slots[delta])]
    applied = sorted(((p, d, s) for p, d, s in deltas if d < base_link[p]), key=lambda e: (e[0], -e[1]))
    return dict(
        base_link=base_link,
        base_class=base_class,
        base_slot=base_slot,
        digest_link=digest_link,
        delta_pages=np.array([e[0] for e in applied], np.int64),
        delta_links=np.array([e[1] for e in applied], np.int64),
        delta_slots=np.array([e[2] for e in applied], np.int64),
    )


def _own_pages(region, limit: int):
    """(page, class, slot) of the region's pages below ``limit`` that are not PARENT."""
    pages, classes, slots = [], [], []
    for e in region.extents:
        for k in range(int(e["num_pages"])):
            page = int(e["first_page"]) + k
            if e["page_class"] != PageClass.PARENT and page < limit:
                pages.append(page)
                classes.append(int(e["page_class"]))
                slots.append(int(e["first_slot"]) + k)
    return np.array(pages, np.int64), np.array(classes, np.uint8), np.array(slots, np.int64)


def reference_inherited(image, region) -> tuple[np.ndarray, np.ndarray]:
    """Each page's digest from its digest link's own table (DigestStore.table, link by link,
    nearest first) and that link where the page is FREE."""
    links, digest_link = image.chain(), image.resolution(region).digest_link
    table = np.zeros((region.num_pages, DIGEST_SIZE), np.uint8)
    free_in = np.full(region.num_pages, -1, np.int32)
    for depth in np.unique(digest_link[digest_link > 0]).tolist():
        link = links[depth]
        r = next(r for r in link.regions if r.name == region.name)
        stored = link.digests.table(r)
        for page in np.flatnonzero(digest_link == depth).tolist():
            i = int(np.searchsorted(r.starts, page, side="right")) - 1
            cls = int(r.extents["page_class"][i])
            if r.digest_bearing[i]:
                table[page] = stored[int(r.digest_rank0[i]) + page - int(r.starts[i])]
            elif cls == PageClass.ZERO:
                table[page] = np.frombuffer(zero_page_digest(PS), np.uint8)
            elif cls == PageClass.FREE:
                free_in[page] = depth
    return table, free_in


# --- chains of any shape ------------------------------------------------------------------------
def write_chain(directory: Path, plan: list, seed: int) -> list[Path]:
    """A chain whose link k writes page p as ``plan[k][1][p]`` says (a kind of KINDS), in format
    1.1 unless ``plan[k][0]`` (then 1.0, its PARENT pages with their digests)."""
    rng = np.random.default_rng(seed)
    mem = np.frombuffer(bytearray(rng.bytes(PAGES * PS)), np.uint64).reshape(PAGES, PS // 8).copy()
    paths, parent, before = [], None, None
    for k, (as_1_0, kinds) in enumerate(plan):
        path = directory / f"link{k:02d}.lean"
        w = LeanImageWriter(
            path,
            parent=parent,
            frame_pages=4,
            threads=1,
            inherit_digests=False if as_1_0 and parent is not None else None,
        )
        region = w.add_region("pc.ram", PAGES * PS, 0)
        for page, kind in enumerate(kinds):
            if kind == "zero" or kind == "free":
                mem[page] = 0
                (w.put_zero if kind == "zero" else w.put_free)(region, page)
            elif parent is None or kind == "rewrite":
                mem[page] = rng.integers(0, 2**63, PS // 8, dtype=np.uint64)
                w.put_pages(region, page, mem[page].tobytes())
            elif kind == "word":
                mem[page, int(rng.integers(0, PS // 8))] ^= np.uint64(k + 1)
                w.put_changed(region, page, before[page].tobytes(), mem[page].tobytes())
            else:
                w.put_parent(region, page, page_digest(mem[page].tobytes()))
        parent, before = ParentLink(w.image_uuid, w.finish()), mem.copy()
        paths.append(path)
    return paths


chain_plans = st.lists(
    st.tuples(st.booleans(), st.lists(st.sampled_from(KINDS), min_size=PAGES, max_size=PAGES)), min_size=2, max_size=7
)


def _outcome(compute):
    try:
        return None, compute()
    except LeanImageError as exc:
        return (type(exc).__name__, exc.rule, exc.offset, exc.structure, exc.path, exc.message), None


def _inherited_outcome(path: Path, inherited) -> tuple:
    with LeanImage.open(path) as image:
        region = image.regions[0]
        found, value = _outcome(lambda: inherited(image, region))
        return found, None if value is None else (value[0].tobytes(), value[1].tobytes())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=chain_plans, seed=st.integers(0, 2**16), part=st.sampled_from([resolution_module.FOLD_ENTRIES, 1, 5]))
def test_the_one_pass_fold_is_the_link_by_link_fold(tmp_path_factory, plan, seed, part):
    """Any chain of 2-7 links mixing 1.0 and 1.1 links, each page of each link PARENT,
    rewritten, changed by a word (DELTA), ZERO or FREE: resolve gives the same arrays as the
    link-by-link fold (folding the links' pages all at once, or ``part`` at a time), and the
    inherited digests (or the finding, e.g. LI-CHN-006 for a page whose digest link holds it
    FREE) are those each digest link's own table gives."""
    paths = write_chain(tmp_path_factory.mktemp("fold"), plan, seed)
    with LeanImage.open(paths[-1]) as image:
        region = image.regions[0]
        found, want = _outcome(lambda: reference_resolve(image, region))
        with mock.patch.object(resolution_module, "FOLD_ENTRIES", part):
            got = _outcome(lambda: resolve(image, region))
        assert (found is None) == (got[0] is None) and (found is None or found == got[0])
        if found is None:
            for name, value in want.items():
                assert np.array_equal(getattr(got[1], name), value), name
    if found is None:
        batched = _inherited_outcome(paths[-1], lambda image, region: image.digests._inherited_table(region, image))
        event(f"refused: {batched[0][1]}" if batched[0] else "inherited")
        assert batched == _inherited_outcome(paths[-1], reference_inherited)


# --- DIGESTS records read together: any edit judged as when read alone ----------------------------
LINKS = 6


@pytest.fixture(scope="module")
def short_chain(tmp_path_factory):
    kinds = ("word", "rewrite", "parent", "zero")
    plan = [(False, ["rewrite"] * PAGES)]
    plan += [(False, [kinds[(k + p) % 4] for p in range(PAGES)]) for k in range(1, LINKS)]
    return write_chain(tmp_path_factory.mktemp("short"), plan, 3)


def _digests_spans(path: Path) -> list[tuple[int, int]]:
    with LeanImage.open_link(path) as link:
        entries = link.tables.entries
        offsets = entries["record_offset"][entries["record_type"] == RecordType.DIGESTS].tolist()
    data = path.read_bytes()
    return [(at, at + RECORD.size + struct.unpack_from("<Q", data, at + 8)[0]) for at in offsets]


def _one_byte_set(short_chain, tmp_path_factory, data, links, spans) -> tuple[list[Path], int]:
    """A copy of the short chain with one byte of a link drawn from ``links`` set to any value:
    in one of the spans ``spans(path)`` gives, mostly in its first RECORD.size + 24 bytes (a
    record's header and fixed fields), never its body_length (reseal walks by it); checksums
    made right again and the links above given the new parent digest. (paths, that link)."""
    directory = tmp_path_factory.mktemp("edited")
    paths = [directory / p.name for p in short_chain]
    for source, target in zip(short_chain, paths):
        target.write_bytes(source.read_bytes())
    bad = data.draw(links, label="link")
    start, end = data.draw(st.sampled_from(spans(paths[bad])), label="record")
    head = min(RECORD.size + 24, end - start)
    at = start + data.draw(
        st.one_of(st.integers(0, head - 1), st.integers(0, end - start - 1)).filter(lambda a: not 8 <= a < 16),
        label="offset",
    )
    spoiled = bytearray(paths[bad].read_bytes())
    spoiled[at] = data.draw(st.integers(0, 255), label="value")
    paths[bad].write_bytes(reseal(bytes(spoiled)))
    relink(paths, bad + 1)
    return paths, bad


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_digests_edit_is_judged_together_as_alone(short_chain, tmp_path_factory, data):
    """A byte of one link's DIGESTS record (not its body_length, which reseal walks by) set to any
    value, checksums made right again: the inherited digests read together are those each link's
    own DigestStore.table gives, or the same finding."""
    paths, bad = _one_byte_set(short_chain, tmp_path_factory, data, st.integers(1, LINKS - 2), _digests_spans)
    batched = _inherited_outcome(paths[-1], lambda image, region: image.digests._inherited_table(region, image))
    event(f"refused: {batched[0][1]}" if batched[0] else "read")
    assert batched == _inherited_outcome(paths[-1], reference_inherited)


# --- DELTA_FRAMEs of a restore read quickly: any edit judged as by the frame store ------------------
def _delta_spans(path: Path) -> list[tuple[int, int]]:
    """The DELTA_FRAME records of a link (not their body_length, which reseal walks by), and
    their INDEX entries."""
    with LeanImage.open_link(path) as link:
        entries, index_at = link.tables.entries, link.footer.index_offset
        positions = np.flatnonzero(entries["record_type"] == RecordType.DELTA_FRAME).tolist()
        offsets = entries["record_offset"].tolist()
    data = path.read_bytes()
    spans = [
        (offsets[k], offsets[k] + RECORD.size + struct.unpack_from("<Q", data, offsets[k] + 8)[0]) for k in positions
    ]
    entry_at = index_at + RECORD.size + INDEX_BODY.size
    return spans + [(entry_at + k * INDEX_ENTRY.size, entry_at + (k + 1) * INDEX_ENTRY.size) for k in positions]


def _delta_outcome(path: Path, depth: int, read) -> tuple:
    """Per DELTA_FRAME of link ``depth`` of the chain ending at ``path``: what ``read(link,
    frame)`` gives, (content, entry offsets, first delta), or its finding (or opening's)."""
    try:
        image = LeanImage.open(path)
    except LeanImageError as exc:
        return "open", type(exc).__name__, exc.rule, exc.offset, exc.structure, exc.path, exc.message
    with image:
        link = image.chain()[depth]
        found = []
        for frame in range(len(link.frames.delta_frames)):
            outcome, value = _outcome(lambda: read(link, frame))
            found.append(outcome or (bytes(value[0]), [int(x) for x in value[1]], int(value[2])))
        return found


def _quick(link, frame):
    """A restore's read of one DELTA_FRAME in Python: the quick path, else the checked one."""
    return _quick_delta_frame(link, frame) or link.frames.read_delta_frame(frame)


def _native(link, frame):
    """A restore's read of one DELTA_FRAME in C (a batch of one), else the checked path."""
    read = _read_delta_batch_native([(link, frame)], link.page_size)
    if read is None:
        return link.frames.read_delta_frame(frame)
    content, offsets, firsts, _ = read
    return content, offsets, firsts[0]


def _checked(link, frame):
    return link.frames.read_delta_frame(frame)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_delta_frame_edit_is_judged_quickly_as_by_the_frame_store(short_chain, tmp_path_factory, data):
    """A byte of a link's DELTA_FRAME record or of its INDEX entry set to any value, checksums
    right again: the quick read of a restore (chain.deltas._quick_delta_frame, else the frame store),
    and its read in C (leanimg._native.read_delta_frames, else the frame store), give what
    FrameStore.read_delta_frame gives, or the same finding."""
    paths, bad = _one_byte_set(short_chain, tmp_path_factory, data, st.integers(1, LINKS - 1), _delta_spans)
    quick = _delta_outcome(paths[-1], LINKS - 1 - bad, _quick)
    refused = any(isinstance(q[0], str) for q in quick)
    event("open refused" if quick[0] == "open" else "refused" if refused else "read")
    assert quick == _delta_outcome(paths[-1], LINKS - 1 - bad, _checked)
    assert quick == _delta_outcome(paths[-1], LINKS - 1 - bad, _native)


@pytest.mark.parametrize("padding", ["after the entry offsets", "after the body"])
def test_a_delta_frame_with_its_padding_set_is_judged_quickly_as_alone(tmp_path, padding):
    """A byte of a DELTA_FRAME record's padding that is not zero, checksums right again (the
    short chain's frames have no padding after their entry offsets, so any edit misses it):
    the quick reads (Python and C) refuse the record, and the frame store gives LI-REC-004."""
    plan = [(False, ["rewrite"] * PAGES), (False, ["word", "word"] + ["parent"] * (PAGES - 2))]
    paths = write_chain(tmp_path, plan, 3)
    data = bytearray(paths[1].read_bytes())
    with LeanImage.open_link(paths[1]) as link:
        entries = link.tables.entries
        at = int(entries["record_offset"][entries["record_type"] == RecordType.DELTA_FRAME][0])
    body_length, num = struct.unpack_from("<Q", data, at + 8)[0], struct.unpack_from("<I", data, at + 24)[0]
    pad = at + RECORD.size + (16 + 4 * (num + 1) if padding == "after the entry offsets" else body_length)
    assert pad % 8, "the record has no padding there"
    data[pad] = 1
    paths[1].write_bytes(reseal(bytes(data)))
    quick = _delta_outcome(paths[1], 0, _quick)
    assert quick == _delta_outcome(paths[1], 0, _checked) == _delta_outcome(paths[1], 0, _native)
    assert quick[0][1] == "LI-REC-004"


@pytest.mark.parametrize("lie", [1 << 40, 8, -8], ids=["huge", "8-more", "8-fewer"])
@pytest.mark.parametrize("record", ["digests", "delta_frame"])
def test_a_lying_body_length_is_judged_quickly_as_alone(short_chain, tmp_path, record, lie):
    """The body_length of a middle link's first DIGESTS or DELTA_FRAME record made huge or 8
    bytes off (left unsealed: reseal walks by it): the quick paths read no more than a record
    can hold and refuse it, with the same finding as the checked path."""
    paths = [tmp_path / p.name for p in short_chain]
    for source, target in zip(short_chain, paths):
        target.write_bytes(source.read_bytes())
    bad = LINKS - 2  # link 1: the digest link of the last link's PARENT pages
    start = (_digests_spans if record == "digests" else _delta_spans)(paths[bad])[0][0]
    spoiled = bytearray(paths[bad].read_bytes())
    length = int.from_bytes(spoiled[start + 8 : start + 16], "little")
    spoiled[start + 8 : start + 16] = (length + lie if lie < 1 << 40 else lie).to_bytes(8, "little")
    paths[bad].write_bytes(bytes(spoiled))
    relink(paths, bad + 1)
    if record == "digests":
        quick = _inherited_outcome(paths[-1], lambda image, region: image.digests._inherited_table(region, image))
        assert quick[0] is not None, "a lying DIGESTS record was read"
        assert quick == _inherited_outcome(paths[-1], reference_inherited)
    else:
        depth = LINKS - 1 - bad
        quick = _delta_outcome(paths[-1], depth, _quick)
        assert quick[0] != "open" and isinstance(quick[0][0], str), "a lying DELTA_FRAME record was read"
        assert quick == _delta_outcome(paths[-1], depth, _checked) == _delta_outcome(paths[-1], depth, _native)


def _copy_to_spoil_a_delta_frame(short_chain, directory: Path, bad: int) -> tuple[list[Path], int, bytearray]:
    """A copy of the short chain; where link ``bad``'s first DELTA_FRAME starts, and its bytes."""
    paths = [directory / p.name for p in short_chain]
    for source, target in zip(short_chain, paths):
        target.write_bytes(source.read_bytes())
    return paths, _delta_spans(paths[bad])[0][0], bytearray(paths[bad].read_bytes())


def test_a_delta_frame_with_a_wrong_checksum_is_judged_quickly_as_alone(short_chain, tmp_path):
    """A middle link's DELTA_FRAME with one entry offset moved (entries still in order, so
    only the record's checksum, left as it was, tells): the quick reads (Python and C)
    refuse the record, and the frame store gives the checksum's finding."""
    bad = LINKS - 2
    paths, start, spoiled = _copy_to_spoil_a_delta_frame(short_chain, tmp_path, bad)
    table = start + RECORD.size + 16  # its entry offsets: the second moved by one
    second, third = struct.unpack_from("<II", spoiled, table + 4)
    assert second + 1 < third, "the second entry should be longer than a byte"
    struct.pack_into("<I", spoiled, table + 4, second + 1)
    paths[bad].write_bytes(bytes(spoiled))
    quick = _delta_outcome(paths[-1], 1, _quick)
    assert quick == _delta_outcome(paths[-1], 1, _checked) == _delta_outcome(paths[-1], 1, _native)
    assert quick[0][1] == "LI-REC-003"


@pytest.mark.parametrize("spoil", ["zstd magic", "declared size huge", "zstd content size"])
def test_a_spoiled_delta_frame_is_refused_by_every_read_alike(short_chain, tmp_path, spoil):
    """A middle link's DELTA_FRAME with its zstd frame's magic broken, its entry table declaring
    4 GiB of content, or its zstd header declaring another content size (checksums made right
    again): the Python and C quick reads refuse it, and every read gives the frame store's
    finding (no traceback, nothing read)."""
    bad = LINKS - 2
    paths, start, spoiled = _copy_to_spoil_a_delta_frame(short_chain, tmp_path, bad)
    num = struct.unpack_from("<I", spoiled, start + RECORD.size + 8)[0]
    table_end = start + RECORD.size + 16 + 4 * (num + 1)
    frame_at = start + RECORD.size + ((16 + 4 * (num + 1) + 7) & ~7)
    assert spoiled[frame_at : frame_at + 4] == b"\x28\xb5\x2f\xfd"
    if spoil == "zstd magic":
        spoiled[frame_at] ^= 0xFF
    elif spoil == "declared size huge":
        struct.pack_into("<I", spoiled, table_end - 4, 0xFFFF_FFFF)
    elif spoil == "zstd content size":
        spoiled[frame_at + 5] ^= 0x01  # the content size that follows the frame header descriptor
    paths[bad].write_bytes(reseal(bytes(spoiled)))
    relink(paths, bad + 1)
    checked = _delta_outcome(paths[-1], 1, _checked)
    assert _delta_outcome(paths[-1], 1, _quick) == checked == _delta_outcome(paths[-1], 1, _native)
    assert checked != "open" and isinstance(checked[0][0], str), f"a DELTA_FRAME with its {spoil} spoiled was read"
    with LeanImage.open(paths[-1]) as image:
        link = image.chain()[1]
        assert _quick_delta_frame(link, 0) is None
        assert _read_delta_batch_native([(link, 0)], PS) is None


@pytest.mark.skipif(deltas_module._native is None, reason="leanimg._native not in use (LEANIMG_NATIVE=0 or not built)")
def test_a_batch_of_delta_frames_read_in_c_is_the_batch_read_in_python(short_chain, tmp_path):
    """Every DELTA_FRAME of the short chain's links read as one batch (a restore's worker):
    leanimg._native.read_delta_frames gives the contents, entry offsets, first deltas and
    entry counts the Python batch gives; one record spoiled in the middle of the batch (its
    checksum made right again), or one file cut short after it was opened, and it reads none
    (None: the batch goes the Python way, which refuses that record with its finding)."""
    with LeanImage.open(short_chain[-1]) as image:
        frames = [(link, frame) for link in image.chain() for frame in range(len(link.frames.delta_frames))]
        assert len({id(link) for link, _ in frames}) >= 3, "the batch should span links"
        native, python = _read_delta_batch_native(frames, PS), _read_delta_batch(frames)
        assert native[0] == python[0] and len(native[0]) > 0
        for a, b in zip(native[1:], python[1:]):
            assert a.dtype == b.dtype == np.int64 and np.array_equal(a, b)
    bad = LINKS - 3
    paths, start, spoiled = _copy_to_spoil_a_delta_frame(short_chain, tmp_path, bad)
    spoiled[start + RECORD.size + 16] ^= 0x01  # the first entry offset: no longer 0
    paths[bad].write_bytes(reseal(bytes(spoiled)))
    relink(paths, bad + 1)
    with LeanImage.open(paths[-1]) as image:
        frames = [(link, frame) for link in image.chain() for frame in range(len(link.frames.delta_frames))]
        assert _read_delta_batch_native(frames, PS) is None
        found, _ = _outcome(lambda: _read_delta_batch(frames))
        assert found is not None and found[4] == str(paths[bad])
    with LeanImage.open(short_chain[-1]) as image:  # a file cut short after it was opened
        link = image.chain()[1]
        frames = [(image, 0), (link, 0)]
        cut = tmp_path / "cut.lean"
        cut.write_bytes(short_chain[-2].read_bytes()[: _delta_spans(short_chain[-2])[0][0] + 8])
        link.tables.file.fileobj = open(cut, "rb")
        try:
            assert _read_delta_batch_native(frames, PS) is None
            assert _outcome(lambda: _read_delta_batch(frames))[0][0] == "TruncatedError"
        finally:
            link.tables.file.fileobj.close()


# --- a deep chain: a bad link in the middle is found and named ------------------------------------
DEEP = 1000


@pytest.fixture(scope="module")
def deep_chain(tmp_path_factory):
    """DEEP links over DEEP pages: the root stores them all, link k changes one word of page k
    (DELTA), so link k is page k's digest link. (paths, final memory)."""
    directory = tmp_path_factory.mktemp("deep")
    rng = np.random.default_rng(9)
    mem = np.frombuffer(bytearray(rng.bytes(DEEP * PS)), np.uint64).reshape(DEEP, PS // 8).copy()
    digests = np.array([np.frombuffer(page_digest(page.tobytes()), np.uint8) for page in mem])
    paths, parent = [], None
    for k in range(DEEP):
        w = LeanImageWriter(directory / f"deep{k:04d}.lean", parent=parent, threads=1)
        region = w.add_region("pc.ram", DEEP * PS, 0)
        if parent is None:
            w.put_pages(region, 0, mem.tobytes())
        else:
            before = mem[k].tobytes()
            mem[k, k % (PS // 8)] ^= np.uint64(k)
            digests[k] = np.frombuffer(page_digest(mem[k].tobytes()), np.uint8)
            w.put_parent(region, 0, digests[:k].tobytes())
            w.put_changed(region, k, before, mem[k].tobytes())
            if k + 1 < DEEP:
                w.put_parent(region, k + 1, digests[k + 1 :].tobytes())
        parent = ParentLink(w.image_uuid, w.finish())
        paths.append(directory / f"deep{k:04d}.lean")
    return paths, mem.tobytes()


def _deep_copy(deep_chain, tmp_path) -> list[Path]:
    copies = []
    for path in deep_chain[0]:
        target = tmp_path / path.name
        target.write_bytes(path.read_bytes())
        copies.append(target)
    return copies


MIDDLE = 500


def test_a_wrong_digest_in_a_middle_link_of_a_deep_chain_is_found(deep_chain, tmp_path):
    """The digest link 500 stores for page 500 changed (checksums right again): the restore of
    the last link refuses page 500 (LI-DIG-002, naming region and page)."""
    paths = _deep_copy(deep_chain, tmp_path)
    start, _ = _digests_spans(paths[MIDDLE])[0]
    data = bytearray(paths[MIDDLE].read_bytes())
    data[start + RECORD.size + 24] ^= 0xFF  # its one stored digest
    paths[MIDDLE].write_bytes(reseal(bytes(data)))
    relink(paths, MIDDLE + 1)
    with LeanImage.open(paths[-1]) as image:
        assert int(image.resolution(image.regions[0]).digest_link[MIDDLE]) == DEEP - 1 - MIDDLE
        with pytest.raises(LeanImageError) as info, open("/dev/null", "wb") as out:
            restore_raw(image, out)
    assert info.value.rule == "LI-DIG-002"
    assert info.value.structure == f"region[0].page[{MIDDLE}]"


def test_a_bad_digests_record_in_a_middle_link_of_a_deep_chain_is_named(deep_chain, tmp_path):
    """num_digests of link 500's DIGESTS made wrong (checksums right again): the finding, with
    its file, is the one reading that link's digests alone gives."""
    paths = _deep_copy(deep_chain, tmp_path)
    start, _ = _digests_spans(paths[MIDDLE])[0]
    data = bytearray(paths[MIDDLE].read_bytes())
    struct.pack_into("<I", data, start + RECORD.size + 4, 2)  # num_digests 1 -> 2
    paths[MIDDLE].write_bytes(reseal(bytes(data)))
    relink(paths, MIDDLE + 1)
    batched = _inherited_outcome(paths[-1], lambda image, region: image.digests._inherited_table(region, image))
    with LeanImage.open_link(paths[MIDDLE]) as alone:
        expected = _outcome(lambda: alone.digests.table(alone.regions[0]))[0]
    assert batched[0] is not None and batched[0][4] == str(paths[MIDDLE])
    assert batched[0] == expected[:4] + (str(paths[MIDDLE]), expected[5])


def test_the_deep_chain_restores_its_final_memory(deep_chain, tmp_path):
    with LeanImage.open(deep_chain[0][-1]) as image, open(tmp_path / "out", "wb") as out:
        restore_raw(image, out)
    assert (tmp_path / "out").read_bytes() == deep_chain[1]


# --- a batch's words folded in C (leanimg._native.fold_words) ---------------------------------
@st.composite
def word_batches(draw):
    """parse_index_lists' arrays of a batch of entries (some not plain) and rows applying them
    (some entries applied twice, some never; pages repeated across entries), as
    _fold_delta_batch hands them to the fold."""
    wpp = draw(st.sampled_from([8, 512]))
    entries = draw(st.integers(0, 40))
    simple = np.array(draw(st.lists(st.booleans(), min_size=entries, max_size=entries)), bool)
    counts = [draw(st.integers(1, min(wpp, 6))) if s else 0 for s in simple]
    positions = np.concatenate(
        [
            np.sort(np.array(draw(st.lists(st.integers(0, wpp - 1), min_size=n, max_size=n, unique=True)), np.int64))
            for n in counts
        ]
        or [np.zeros(0, np.int64)]
    ).astype(np.int64)
    values = np.array(
        draw(st.lists(st.integers(0, 2**64 - 1), min_size=len(positions), max_size=len(positions))), "<u8"
    )
    word_start = (np.cumsum(counts) - counts).astype(np.int64) if entries else np.zeros(0, np.int64)
    rows = draw(st.lists(st.integers(0, entries - 1), max_size=60)) if entries else []
    pages = np.array(
        draw(st.lists(st.sampled_from([0, 1, 2, 7, 300, 70_000]), min_size=len(rows), max_size=len(rows))), np.int64
    )
    return simple, word_start, positions, values, np.array(rows, np.int64), pages, wpp * 8


@pytest.mark.skipif(deltas_module._native is None, reason="leanimg._native not built")
@settings(max_examples=400, deadline=None)
@given(batch=word_batches())
def test_the_words_folded_in_c_are_the_words_numpy_folds(batch):
    """Ascending page * words + word, the first entry's value of a word several set, and
    whether each row's entry is plain: the same from C as from numpy, dtypes included."""
    native = deltas_module._fold_words_native(deltas_module.WordBatch(*batch))
    python = deltas_module._fold_words(deltas_module.WordBatch(*batch))
    assert native is not None
    for got, want in zip(native, python):
        assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.skipif(deltas_module._native is None, reason="leanimg._native not built")
@pytest.mark.parametrize(
    "spoil", ["entry out of range", "word out of its page", "word starts descending", "negative page"]
)
def test_inputs_the_c_fold_does_not_take_go_to_numpy(spoil):
    """fold_words answers -1 (the fold then runs in numpy, which fails as it always did, or
    folds) for inputs that are not as parse_index_lists and the resolution give them."""
    simple = np.array([True, True], bool)
    word_start, positions = np.array([0, 2], np.int64), np.array([1, 3, 0], np.int64)
    values, rows, pages = np.arange(3, dtype="<u8"), np.array([0, 1], np.int64), np.array([4, 5], np.int64)
    if spoil == "entry out of range":
        rows = np.array([0, 2], np.int64)
    elif spoil == "word out of its page":
        positions = np.array([1, 3, 512], np.int64)
    elif spoil == "word starts descending":
        word_start = np.array([2, 0], np.int64)
    else:
        pages = np.array([4, -1], np.int64)
    batch = deltas_module.WordBatch(simple, word_start, positions, values, rows, pages, PS)
    assert deltas_module._fold_words_native(batch) is None
