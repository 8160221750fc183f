"""Unit tests of leanimg.reader.LeanImage and the parts it is assembled from: opening and
closing, region lookups, page classes and slots, reading pages of every class, ranges as one
buffer or as pieces, expected digests, disks, the tables (FrameTable), the frame store, the
digest store and the parent chain (leanimg.parents.attach_chain)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from helpers import VECTORS_DIR, disk_sources, write_two_link_chain
from leanimg.delta import apply
from leanimg.errors import ChainError, DiskError, LeanImageError
from leanimg.format import DIGEST_SIZE, HEADER, PageClass, page_digest, page_digests, zero_page_digest
from leanimg.frames import FRAME_CACHE_SIZE
from leanimg.parents import attach_chain
from leanimg.reader import LeanImage
from leanimg.tables import FrameTable
from leanimg.writer import LeanImageWriter, ParentLink

PS = 4096
S, Z, F, D, P, DL = (
    PageClass.STORED,
    PageClass.ZERO,
    PageClass.FREE,
    PageClass.DISK,
    PageClass.PARENT,
    PageClass.DELTA,
)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    return write_two_link_chain(tmp_path_factory.mktemp("reader"))


@pytest.fixture
def child(chain):
    """The child opened with its parent and its disk."""
    with (
        disk_sources({"disk0": chain.disk}) as disks,
        LeanImage.open(chain.child, parents=[chain.parent], disks=disks) as image,
    ):
        yield image


@pytest.fixture
def parent(chain):
    with LeanImage.open(chain.parent) as image:
        yield image


def page_of(content: bytes, page: int) -> bytes:
    return content[page * PS : (page + 1) * PS]


# --- opening and closing ---------------------------------------------------------------------
def test_close_closes_every_link_of_the_chain(chain):
    image = LeanImage.open(chain.child, parents=[chain.parent])
    links = image.chain()
    assert [Path(link.path).name for link in links] == ["child.lean", "parent.lean"]
    image.close()
    assert all(link.fileobj.closed for link in links)


def test_context_manager_closes_the_image(chain):
    with LeanImage.open(chain.parent) as image:
        assert not image.fileobj.closed
    assert image.fileobj.closed


def test_open_a_missing_file_names_it(tmp_path):
    missing = tmp_path / "missing.lean"
    with pytest.raises(LeanImageError) as info:
        LeanImage.open(missing)
    assert info.value.path == str(missing) and "cannot open" in str(info.value)


def test_open_a_damaged_file_names_it_and_the_rule(chain, tmp_path):
    path = tmp_path / "damaged.lean"
    data = bytearray(chain.parent.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(LeanImageError) as info:
        LeanImage.open(path)
    assert info.value.path == str(path) and info.value.rule == "LI-HDR-001"
    assert str(info.value).startswith(str(path))


# --- lookups --------------------------------------------------------------------------------------
def test_region_by_name_and_by_id(parent):
    assert parent.region("ram") is parent.regions[0]
    assert parent.region(1).name == "rom"
    assert (parent.region("rom").guest_phys_base, parent.region("ram").guest_phys_base) == (0xF0000, None)
    assert (parent.region("ram").num_pages, parent.region("rom").size_bytes) == (8, 2 * PS)


def test_region_unknown_lists_the_regions(parent):
    for key in ("vram", 7):
        with pytest.raises(LeanImageError, match=r"no region .*regions: ram, rom"):
            parent.region(key)


def test_classes_of_a_region_and_of_a_range(child):
    ram = child.region("ram")
    assert child.classes(ram).tolist() == [P, DL, S, Z, F, D, D, DL]
    assert child.classes(ram, 3, 3).tolist() == [Z, F, D]
    assert child.classes(ram, 6).tolist() == [D, DL]
    assert len(child.classes(ram, 8)) == 0


def test_page_slots_and_page_location(child):
    ram = child.region("ram")
    assert child.page_slots(ram, 5, 3).tolist() == [0, 1, 1]  # disk refs 0, 1; delta entry 1
    assert child.page_slots(ram, 1, 2).tolist() == [0, 0]  # delta entry 0, stored ordinal 0
    assert [child.page_location(ram, p) for p in range(8)] == [
        (P, 0),
        (DL, 0),
        (S, 0),
        (Z, 0),
        (F, 0),
        (D, 0),
        (D, 1),
        (DL, 1),
    ]
    for page in (-1, 8):
        with pytest.raises(LeanImageError, match="outside region 'ram'"):
            child.page_location(ram, page)


def test_read_page_of_every_class(chain, child):
    seen = set()
    for region in child.regions:
        content = chain.child_content[region.name]
        for page in range(region.num_pages):
            seen.add(child.page_location(region, page)[0])
            assert child.read_page(region, page) == page_of(content, page), (region.name, page)
    assert seen == set(PageClass)


def test_read_page_by_region_name(chain, child):
    assert child.read_page("rom", 1) == page_of(chain.child_content["rom"], 1)


def test_read_page_on_a_disk_not_attached(chain):
    with LeanImage.open(chain.child, parents=[chain.parent]) as image:
        assert image.read_page("ram", 4) == bytes(PS)  # FREE: nothing to read
        with pytest.raises(DiskError, match=r"page 5 is on disk 'disk0': pass --disk disk0=PATH"):
            image.read_page("ram", 5)


def _joined_pieces(image, region, first, count) -> bytes:
    return b"".join(
        bytes(n * PS) if data is None else bytes(data) for n, data in image.region_pieces(region, first, count)
    )


@pytest.mark.parametrize("which", ["parent", "child"])
def test_region_bytes_equals_region_pieces_joined(chain, which, request):
    image = request.getfixturevalue(which)
    for region in image.regions:
        content = getattr(chain, f"{which}_content")[region.name]
        n = region.num_pages
        for first, count in ((0, n), (1, n - 1), (n - 1, 1)):
            want = content[first * PS : (first + count) * PS]
            assert bytes(image.region_bytes(region, first, count)) == want, (region.name, first, count)
            assert _joined_pieces(image, region, first, count) == want, (region.name, first, count)


def test_region_pieces_of_a_flat_image_are_runs_of_views(parent):
    pieces = parent.region_pieces(parent.region("ram"), 4, 4)
    assert [(n, data is None) for n, data in pieces] == [(1, False), (1, False), (1, True), (1, False)]


def test_expected_digest_by_class(chain, child):
    ram = child.region("ram")
    content = chain.child_content["ram"]
    for page, cls in enumerate(child.classes(ram).tolist()):
        want = None if cls == F else zero_page_digest(PS) if cls == Z else page_digest(page_of(content, page))
        assert child.expected_digest(ram, page) == want, (page, cls)


def test_chain_lists_the_links_from_the_image_down(child, parent):
    links = child.chain()
    assert [link.header.image_uuid for link in links] == [bytes([0x22] * 16), bytes([0x11] * 16)]
    assert links[1].parent is None and parent.chain() == [parent]


# --- disks ----------------------------------------------------------------------------------------
def test_attach_disks_under_no_name_takes_the_only_disk(chain):
    with disk_sources({"anything": chain.disk}) as disks, LeanImage.open(chain.child, parents=[chain.parent]) as image:
        source = disks["anything"]
        image.attach_disks({None: source})
        assert image.disk_sources == {0: source} and source.name == "disk0"
        assert image.read_page("ram", 6) == page_of(chain.child_content["ram"], 6)


def test_attach_disks_errors(chain):
    with disk_sources({"disk0": chain.disk}) as disks, LeanImage.open(chain.child, parents=[chain.parent]) as image:
        with pytest.raises(DiskError, match=r"no disk named 'vdb' \(its disks: disk0\)"):
            image.attach_disks({"vdb": disks["disk0"]})
        with pytest.raises(DiskError, match="needs an image with one disk; this one has none"):
            image.chain()[1].attach_disks({None: disks["disk0"]})
        assert image.disk_sources == {}


def test_attach_disks_refuses_another_disk_of_the_same_size(chain, tmp_path):
    other = tmp_path / "other.raw"
    other.write_bytes(bytes(chain.disk.stat().st_size))
    with disk_sources({"disk0": other}) as disks, LeanImage.open(chain.child, parents=[chain.parent]) as image:
        with pytest.raises(DiskError) as info:
            image.attach_disks(disks)
        assert info.value.rule == "LI-DSK-004"


class _FakeDisk:
    name, path, size = "disk0", "fake", 0

    def __init__(self):
        self.closed = 0

    def close(self):
        self.closed += 1


def test_close_closes_attached_disk_sources(chain):
    fake = _FakeDisk()
    image = LeanImage.open(chain.child, parents=[chain.parent])
    image.attach_disks({"disk0": fake}, check_identity=False)
    assert image.has_disk_sources
    image.close()
    assert fake.closed >= 1


# --- tables, frames, digests -------------------------------------------------------------------------
def test_frame_table_frame_of():
    # the ordinals a page map uses all lie in frames (LI-MAP-004, checked when the image opens)
    table = FrameTable(np.array([0, 2, 5]), np.array([2, 3, 1]), np.array([1, 2, 3]))
    assert (len(table), table.total) == (3, 6)
    assert table.frame_of([0, 1, 2, 4, 5]).tolist() == [0, 0, 1, 1, 2]
    assert [table.frame_at(k) for k in (0, 1, 2, 4, 5)] == [0, 0, 1, 1, 2]


def test_image_tables_list_the_frames(parent, child):
    frames = parent.tables.page_frames
    assert (len(frames), frames.total) == (9, 9)  # one page per frame
    assert frames.frame_of([0, 8]).tolist() == [0, 8]
    assert (parent.index_entries["record_type"][frames.positions] == 0x10).all()
    assert (len(child.tables.delta_frames), child.tables.delta_frames.total) == (1, 2)
    assert child.tables.disk_refs.sectors.tolist() == [8, 0]


def test_frame_store_caches_a_few_frames(chain, parent):
    frames = parent.frames
    first, digests = frames.frame(0, with_digests=True)
    assert first == page_of(chain.parent_content["ram"], 0)
    assert digests.tolist() == page_digests(first, PS).tolist()
    assert frames.frame(0)[0] is first  # cached
    for k in range(1, FRAME_CACHE_SIZE + 1):
        frames.frame(k)
    again = frames.frame(0)[0]
    assert again is not first and again == first  # evicted, read again
    assert frames.stored_page(8) == page_of(chain.parent_content["rom"], 1)


def test_frame_store_delta_entries(chain, child):
    entries = child.frames.delta_entries(np.array([0, 1]))
    assert entries == [child.frames.delta_entry(0), child.frames.delta_entry(1)]
    parent_ram, child_ram = chain.parent_content["ram"], chain.child_content["ram"]
    for entry, page in zip(entries, (1, 7)):
        assert apply(entry, page_of(parent_ram, page)) == page_of(child_ram, page)


def test_digest_store_expected_range(chain, child):
    ram = child.region("ram")
    classes, expected = child.digests.expected_range(ram, 2, 5)
    assert classes.tolist() == [S, Z, F, D, D]
    content = chain.child_content["ram"]
    assert expected[0].tobytes() == page_digest(page_of(content, 2))
    assert expected[1].tobytes() == zero_page_digest(PS)
    assert expected[2].tobytes() == bytes(DIGEST_SIZE)
    assert expected[4].tobytes() == page_digest(page_of(content, 6))
    own = np.isin(child.classes(ram), [S, D, PageClass.DELTA]).sum()
    assert child.digests.table(ram).shape == (own, DIGEST_SIZE) == (5, DIGEST_SIZE)  # no ZERO, FREE, PARENT


# --- the parent chain --------------------------------------------------------------------------------
def spy(opened: list):
    """An open_link that records the names of the files it opens."""

    def open_link(path):
        opened.append(Path(path).name)
        return LeanImage.open_link(path)

    return open_link


@pytest.fixture
def lone_child(chain, tmp_path):
    """The child copied into a directory of its own (no parent beside it)."""
    (tmp_path / "lone").mkdir()
    return Path(shutil.copy(chain.child, tmp_path / "lone" / "child.lean"))


def test_attach_chain_finds_the_parent_beside_the_image_by_uuid(chain, lone_child):
    shutil.copy(chain.parent, lone_child.parent / "zzz.lean")
    shutil.copy(VECTORS_DIR / "valid" / "basic.lean", lone_child.parent / "aaa.lean")  # another image
    opened = []
    with LeanImage.open_link(lone_child) as image:
        attach_chain(image, [], spy(opened))
        assert opened == ["zzz.lean"] and image.parent.header.image_uuid == chain.parent_uuid


def test_attach_chain_among_the_parents_given(chain, lone_child):
    opened = []
    with LeanImage.open_link(lone_child) as image:
        attach_chain(image, [VECTORS_DIR / "valid" / "basic.lean", str(chain.parent)], spy(opened))
        assert opened == ["parent.lean"]
    parent = LeanImage.open(chain.parent)
    with LeanImage.open_link(lone_child) as image:
        attach_chain(image, [parent], spy(opened))
        assert image.parent is parent and opened == ["parent.lean"]  # an open parent is not reopened
    assert parent.fileobj.closed


def test_attach_chain_missing_parent(lone_child):
    with LeanImage.open_link(lone_child) as image, pytest.raises(ChainError) as info:
        attach_chain(image, [VECTORS_DIR / "valid" / "basic.lean"], spy([]))
    error = info.value
    assert (error.rule, error.offset, error.structure, error.path) == (
        "LI-CHN-001",
        HEADER.offset("parent_uuid"),
        "header.parent_uuid",
        str(lone_child),
    )


def _parent_only_image(path, own: bytes, parent: bytes, page_size: int = PS, digest: bytes = b"\x01" * 16):
    with LeanImageWriter(path, image_uuid=own, parent=ParentLink(parent, digest), page_size=page_size, threads=1) as w:
        w.put_parent(w.add_region("ram", page_size), 0, page_digest(bytes(page_size)))


def test_attach_chain_cycle(tmp_path):
    a, b = bytes([0xA] * 16), bytes([0xB] * 16)
    _parent_only_image(tmp_path / "a.lean", a, b)
    _parent_only_image(tmp_path / "b.lean", b, a)
    opened = []
    with LeanImage.open_link(tmp_path / "a.lean") as image, pytest.raises(ChainError) as info:
        attach_chain(image, [], spy(opened))
    assert (info.value.rule, info.value.structure) == ("LI-CHN-005", "header.parent_uuid")
    assert opened == ["b.lean"] and info.value.path == str(tmp_path / "b.lean")


def test_attach_chain_modified_parent(chain, lone_child):
    with LeanImageWriter(lone_child.parent / "parent.lean", image_uuid=chain.parent_uuid, threads=1) as w:
        w.put_pages(w.add_region("ram", 8 * PS), 0, chain.parent_content["ram"][:-1] + b"\x01")
    with LeanImage.open_link(lone_child) as image, pytest.raises(ChainError) as info:
        attach_chain(image, [], LeanImage.open_link)
    error = info.value
    assert (error.rule, error.offset, error.structure, error.path) == (
        "LI-CHN-002",
        HEADER.offset("parent_digest"),
        "header.parent_digest",
        str(lone_child),
    )


def test_attach_chain_parent_of_another_page_size(tmp_path):
    parent_uuid = bytes([0x33] * 16)
    with LeanImageWriter(tmp_path / "p.lean", image_uuid=parent_uuid, page_size=8192, threads=1) as w:
        w.put_zero(w.add_region("ram", 8192), 0)
    digest = (tmp_path / "p.lean").read_bytes()[-24:-8]
    _parent_only_image(tmp_path / "c.lean", bytes([0x44] * 16), parent_uuid, digest=digest)
    with LeanImage.open_link(tmp_path / "c.lean") as image, pytest.raises(ChainError) as info:
        attach_chain(image, [], LeanImage.open_link)
    assert (info.value.rule, info.value.structure) == ("LI-CHN-003", "header.page_size")


def test_a_malformed_delta_entry_read_through_the_chain_is_located():
    vector = VECTORS_DIR / "invalid" / "dlt-002-encoding.lean"  # entry 0 of record[2] (at 400) has encoding 4
    with (
        LeanImage.open(vector, parents=[VECTORS_DIR / "valid" / "parent.lean"]) as image,
        pytest.raises(LeanImageError) as info,
    ):
        for region in image.regions:
            image.region_bytes(region, 0, region.num_pages)
    assert info.value.rule == "LI-DLT-002"
    assert (info.value.offset, info.value.structure) == (400, "record[2].delta_frame.entries[0]")
