"""DISK references (issue 4): convert --disk, restore from raw and qcow2 disks, bad disks.

The guest memory here is synthetic but the disks are real files and the qcow2 disks are made
by the real qemu-img (plain, compressed, a backing chain); the end-to-end proof with a real
guest is in test_qemu_disk.py. The disk has an MBR with a partition at sector 63, so its
file pages sit at a 512-byte phase of 7 sectors, and one at sector 4096 (phase 0).
"""

from __future__ import annotations

import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import numpy as np
import pytest

from helpers import qemu_save
from leanimg.cli import command_line
from leanimg.converters.diskrefs import BlockIndex, PageIndex, scan_disk, sketch
from leanimg.errors import DiskError
from leanimg.disks import RawDisk, open_disk
from leanimg.disks.partitions import Partition, read_partitions, scan_segments
from leanimg.format import PageClass, row_digests
from leanimg.reader import LeanImage

PS = 4096
SECTOR = 512
DISK_BYTES = 16 << 20
PART_A = (63, 4096 - 63)  # (first sector, sectors): phase 7
PART_B = (4096, DISK_BYTES // SECTOR - 4096)  # phase 0
LEANIMG = command_line()
needs_qemu_img = pytest.mark.skipif(shutil.which("qemu-img") is None, reason="qemu-img is not installed")


def run(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*LEANIMG, *map(str, args)], capture_output=True, input=stdin, timeout=120)


def ok(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    proc = run(*args, stdin=stdin)
    assert proc.returncode == 0, proc.stderr.decode()
    return proc


def fails(proc: subprocess.CompletedProcess, *needles: str, left_out: Path | None = None) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and err.startswith("leanimg: error:"), err
    for needle in needles:
        assert needle in err, err
    if left_out is not None:
        assert not left_out.exists(), f"{left_out} left behind"
    return err


def mbr(entries) -> bytes:
    sector = bytearray(SECTOR)
    for k, (kind, first, count) in enumerate(entries):
        sector[446 + 16 * k + 4] = kind
        struct.pack_into("<II", sector, 446 + 16 * k + 8, first, count)
    sector[510:512] = b"\x55\xaa"
    return bytes(sector)


def gpt_disk(size: int, partitions) -> bytearray:
    """A disk with a protective MBR and a GPT (CRCs right) listing ``partitions`` (first, last LBA)."""
    disk = bytearray(size)
    disk[:SECTOR] = mbr([(0xEE, 1, size // SECTOR - 1)])
    entries = bytearray(128 * 128)
    for k, (first, last) in enumerate(partitions):
        struct.pack_into("<16s16sQQ", entries, 128 * k, b"\x0f" * 16, bytes([k + 1]) * 16, first, last)
    header = bytearray(92)
    struct.pack_into(
        "<8sIIIIQQQQ16sQIII",
        header,
        0,
        b"EFI PART",
        0x10000,
        92,
        0,
        0,
        1,
        size // SECTOR - 1,
        34,
        size // SECTOR - 34,
        b"\x01" * 16,
        2,
        128,
        128,
        zlib.crc32(entries),
    )
    struct.pack_into("<I", header, 16, zlib.crc32(header))
    disk[SECTOR : SECTOR + 92] = header
    disk[2 * SECTOR : 2 * SECTOR + len(entries)] = entries
    return disk


def text_blocks(rng, count: int) -> bytes:
    """Compressible but distinct blocks (so `qemu-img convert -c` really compresses clusters)."""
    words = np.array([b"lean ", b"image ", b"page ", b"disk ", b"cache ", b"block "], object)
    return b"".join(f"{k:08d} ".encode() + b"".join(rng.choice(words, 800))[: PS - 9] for k in range(count))


class Scenario:
    """A disk file, a save whose memory holds some of its blocks, and what must come out."""

    def __init__(self, root: Path):
        rng = np.random.default_rng(4)
        disk = bytearray(DISK_BYTES)
        disk[:SECTOR] = mbr([(0x83, *PART_A), (0x83, *PART_B)])
        a_start, b_start = PART_A[0] * SECTOR, PART_B[0] * SECTOR
        disk[a_start:b_start] = text_blocks(rng, (b_start - a_start) // PS + 1)[: b_start - a_start]
        disk[b_start : 8 << 20] = rng.bytes((8 << 20) - b_start)  # the rest stays a hole
        self.disk = root / "disk.img"
        self.disk.write_bytes(disk[: 8 << 20])
        with open(self.disk, "r+b") as f:
            f.truncate(DISK_BYTES)
        self.on_disk = [a_start + PS * k for k in range(0, 400, 3)] + [b_start + PS * k for k in range(0, 900, 2)]
        self.odd_phase = a_start + 2 * SECTOR  # sector 65: found only with --all-phases
        pages = [bytes(disk[o : o + PS]) for o in [*self.on_disk, self.odd_phase]]
        pages += [bytes(PS)] * 200 + [rng.bytes(PS) for _ in range(150)]
        pages.append(pages[5])  # a page twice in memory, same disk block
        order = rng.permutation(len(pages))
        ram = b"".join(pages[i] for i in order)
        self.ram = ram + bytes(-len(ram) % (1 << 20))
        self.save = root / "vm.save"
        self.save.write_bytes(qemu_save(self.ram))
        self.disk_pages = len(self.on_disk) + 1  # + the duplicate

    def convert(self, out: Path, *extra) -> LeanImage:
        ok("convert", self.save, "-o", out, "--disk", f"vda={self.disk}", *extra)
        return LeanImage.open(out)


@pytest.fixture(scope="module")
def scene(tmp_path_factory) -> Scenario:
    return Scenario(tmp_path_factory.mktemp("disk-refs"))


@pytest.fixture(scope="module")
def image(scene, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("disk-image") / "vm.lean"
    scene.convert(out).close()
    return out


def classes(path: Path, parents=()) -> np.ndarray:
    with LeanImage.open(path, parents=parents) as img:
        return img.classes(img.regions[0])


# ------------------------------------------------------------------ convert


def test_convert_finds_every_page_on_the_disk_at_the_partitions_phase(scene, image):
    counts = np.bincount(classes(image), minlength=7)
    assert counts[PageClass.DISK] == scene.disk_pages
    assert counts[PageClass.STORED] == 150 + 1  # random pages + the odd-phase page
    with LeanImage.open(image) as img:
        assert [(d.name, d.size_bytes) for d in img.disks] == [("vda", DISK_BYTES)]
        sectors = set(int(s) for s in img.tables.disk_refs.sectors)
    assert sectors == {o // SECTOR for o in scene.on_disk}
    assert any(s % 8 == 7 for s in sectors) and any(s % 8 == 0 for s in sectors)


def test_all_phases_also_finds_a_page_at_an_odd_sector(scene, tmp_path):
    with scene.convert(tmp_path / "all.lean", "--all-phases") as img:
        counts = np.bincount(img.classes(img.regions[0]), minlength=7)
        assert counts[PageClass.DISK] == scene.disk_pages + 1
        assert scene.odd_phase // SECTOR in set(int(s) for s in img.tables.disk_refs.sectors)


def test_convert_reports_the_disk_pages(scene, tmp_path):
    proc = ok("convert", scene.save, "-o", tmp_path / "r.lean", "--disk", f"vda={scene.disk}")
    assert f"disk vda: {scene.disk_pages} pages" in proc.stderr.decode()


def test_convert_from_a_pipe_gives_the_same_references(scene, image, tmp_path):
    ok("convert", "-", "-o", tmp_path / "pipe.lean", "--disk", f"vda={scene.disk}", stdin=scene.save.read_bytes())
    assert np.array_equal(classes(tmp_path / "pipe.lean"), classes(image))


@pytest.mark.parametrize("phases", [(), ("--all-phases",)])
def test_streamed_and_spooled_lookups_give_the_same_references(scene, tmp_path, phases):
    """convert --disk looks pages up as the stream comes (BlockIndex); --spool reads them twice
    (PageIndex): the same pages become the same references."""
    refs = []
    for spool in ("--no-spool", "--spool"):
        with scene.convert(tmp_path / f"{spool}.lean", spool, *phases) as img:
            table = img.tables.disk_refs
            refs.append((img.classes(img.regions[0]).tolist(), table.sectors.tolist(), table.disk_ids.tolist()))
    assert refs[0] == refs[1]


@pytest.mark.parametrize("spool", [False, True])
def test_batches_of_any_size_give_the_same_image(scene, image, tmp_path, monkeypatch, spool):
    """DiskPages gathers runs into batches: cut into batches of 7 pages (runs split across
    them), the references and the stored pages are the same."""
    from leanimg.converters import convert, diskrefs
    from leanimg.disks import open_disk

    monkeypatch.setattr(diskrefs, "BATCH_PAGES", 7)
    options = convert.DiskOptions({"vda": open_disk(str(scene.disk), "vda")})
    try:
        convert.convert_file(str(scene.save), str(tmp_path / "b.lean"), disks=options, spool=spool)
    finally:
        options.close()
    got = []
    for path in (tmp_path / "b.lean", image):
        with LeanImage.open(path, disks={"vda": open_disk(str(scene.disk), "vda")}) as img:
            region = img.regions[0]
            got.append(
                (
                    img.classes(region).tolist(),
                    img.tables.disk_refs.sectors.tolist(),
                    img.region_bytes(region, 0, region.num_pages),
                )
            )
    assert got[0] == got[1] and got[0][2] == scene.ram


@pytest.mark.parametrize("spool", ["--no-spool", "--spool"])
@pytest.mark.parametrize(
    "damage,needle",
    [
        ("truncated", "offset 0x"),
        ("magic", "offset 0x0"),
        ("flipped", "offset 0x"),
    ],
)
def test_a_damaged_save_with_disk_fails_cleanly(scene, tmp_path, spool, damage, needle):
    """The disk lookup in front of the writer, streamed or read twice: a damaged save is one
    clear error naming an offset, and no image is left behind."""
    data = bytearray(scene.save.read_bytes())
    if damage == "truncated":
        data = data[: len(data) * 2 // 3]
    elif damage == "magic":
        data[0] ^= 0xFF
    else:  # the first page entry's header (the block's name follows it) gets XBZRLE's flag
        first = data.find(b"\x06pc.ram", data.find(b"\x06pc.ram") + 1)
        data[first - 1] ^= 0x40
    bad, out = tmp_path / "bad.save", tmp_path / "bad.lean"
    bad.write_bytes(bytes(data))
    fails(run("convert", bad, "-o", out, "--disk", f"vda={scene.disk}", spool), needle, left_out=out)


def test_disks_too_large_to_index_are_read_twice(scene, tmp_path, monkeypatch):
    """Above MAX_INDEXED_BLOCKS the stream is spooled and its pages read twice: same image."""
    from leanimg.converters import convert, diskrefs, qemu
    from leanimg.disks import open_disk

    spooled = []
    load_stream = qemu.load_stream
    monkeypatch.setattr(qemu, "load_stream", lambda *a, **k: spooled.append(1) or load_stream(*a, **k))
    out = {}
    for limit in (diskrefs.MAX_INDEXED_BLOCKS, 10):
        monkeypatch.setattr(diskrefs, "MAX_INDEXED_BLOCKS", limit)
        options = convert.DiskOptions({"vda": open_disk(str(scene.disk), "vda")})
        try:
            convert.convert_file(str(scene.save), str(tmp_path / f"{limit}.lean"), disks=options)
        finally:
            options.close()
        assert options.summary.pages == {"vda": scene.disk_pages}
        out[limit] = classes(tmp_path / f"{limit}.lean")
    assert len(spooled) == 1 and np.array_equal(*out.values())


def test_disk_name_defaults_to_the_file_stem(scene, tmp_path):
    ok("convert", scene.save, "-o", tmp_path / "n.lean", "--disk", scene.disk)
    with LeanImage.open(tmp_path / "n.lean") as img:
        assert [d.name for d in img.disks] == ["disk"]


# ------------------------------------------------------------------ restore


def test_restore_with_the_raw_disk_is_the_save_byte_for_byte(scene, image, tmp_path):
    for flag in ("--sort-blocks", "--no-sort-blocks"):
        out = tmp_path / f"r{flag}.save"
        ok("restore", image, "--to", "qemu", "-o", out, "--disk", f"vda={scene.disk}", flag)
        assert out.read_bytes() == scene.save.read_bytes()
    raw = tmp_path / "mem.raw"
    ok("restore", image, "--to", "raw", "-o", raw, "--disk", str(scene.disk))  # NAME left out: one disk
    assert raw.read_bytes() == scene.ram


def test_validate_checks_every_disk_page(scene, image):
    proc = ok("validate", image, "--disk", f"vda={scene.disk}")
    assert f"{scene.disk_pages} disk_pages" in proc.stdout.decode()
    unchecked = run("validate", image)  # no --disk: no violation, but not all checked
    assert unchecked.returncode == 4 and "not checked" in unchecked.stdout.decode()


@needs_qemu_img
@pytest.mark.parametrize("kind", ["qcow2", "compressed", "backing-chain"])
def test_restore_from_qcow2(scene, image, tmp_path, kind):
    disk = make_qcow2(scene.disk, tmp_path, kind)
    out = tmp_path / "r.save"
    ok("restore", image, "--to", "qemu", "-o", out, "--disk", f"vda={disk}")
    assert out.read_bytes() == scene.save.read_bytes()


def make_qcow2(raw: Path, tmp: Path, kind: str) -> Path:
    if kind == "backing-chain":
        # the base holds partition A only; the overlay gets partition B written through qemu-io
        base_raw, part_b = tmp / "base.img", tmp / "part-b.bin"
        data = raw.read_bytes()
        b_start = PART_B[0] * SECTOR
        base_raw.write_bytes(data[:b_start] + bytes(len(data) - b_start))
        part_b.write_bytes(data[b_start : 8 << 20])
        qemu_img("convert", "-O", "qcow2", base_raw, tmp / "base.qcow2")
        qemu_img("create", "-f", "qcow2", "-b", "base.qcow2", "-F", "qcow2", tmp / "top.qcow2")
        subprocess.run(
            ["qemu-io", "-f", "qcow2", "-c", f"write -s {part_b} {b_start} {(8 << 20) - b_start}", tmp / "top.qcow2"],
            check=True,
            capture_output=True,
        )
        extents = qemu_img_map(tmp / "top.qcow2")
        assert {e["depth"] for e in extents if e["data"]} == {0, 1}, extents
        return tmp / "top.qcow2"
    out = tmp / f"{kind}.qcow2"
    qemu_img("convert", *(["-c"] if kind == "compressed" else []), "-O", "qcow2", raw, out)
    if kind == "compressed":
        assert any(e["data"] and "offset" not in e for e in qemu_img_map(out)), "no compressed cluster"
    return out


def qemu_img(*args) -> None:
    subprocess.run(["qemu-img", *map(str, args)], check=True, capture_output=True, cwd=Path(str(args[-1])).parent)


def qemu_img_map(path: Path) -> list:
    import json

    return json.loads(
        subprocess.run(["qemu-img", "map", "--output=json", path], check=True, capture_output=True).stdout
    )


def test_restore_through_a_chain_reads_the_childs_disk_pages(scene, tmp_path):
    (tmp_path / "zero.save").write_bytes(qemu_save(bytes(len(scene.ram))))
    parent = tmp_path / "zero.lean"
    ok("convert", tmp_path / "zero.save", "-o", parent)
    child = tmp_path / "child.lean"
    ok("convert", scene.save, "-o", child, "--parent", parent, "--disk", f"vda={scene.disk}")
    counts = np.bincount(classes(child, [parent]), minlength=7)
    assert counts[PageClass.DISK] == scene.disk_pages and counts[PageClass.PARENT] == 0
    out = tmp_path / "r.raw"
    ok("restore", child, "--parent", parent, "-o", out, "--disk", f"vda={scene.disk}")
    assert out.read_bytes() == scene.ram


# ------------------------------------------------------------------ bad disks


@pytest.mark.parametrize("spool", ["--no-spool", "--spool"])
def test_a_page_unchanged_since_the_parent_stays_parent_though_on_the_disk(scene, image, tmp_path, spool):
    """The parent first: only pages changed since it are looked up on the disks (either way of
    diskrefs), so a child of the same memory is all PARENT (and ZERO), no DISK reference."""
    child = tmp_path / "child.lean"
    proc = ok("convert", scene.save, "-o", child, "--parent", image, "--disk", f"vda={scene.disk}", spool)
    counts = np.bincount(classes(child, [image]), minlength=7)
    assert counts[PageClass.DISK] == 0 and counts[PageClass.STORED] == 0
    assert counts[PageClass.PARENT] == scene.disk_pages + 151
    assert "disk vda: 0 pages" in proc.stderr.decode()


def test_another_disk_is_refused_before_any_read(scene, image, tmp_path):
    other = tmp_path / "other.img"
    other.write_bytes(np.random.default_rng(9).bytes(DISK_BYTES))
    fails(
        run("restore", image, "-o", tmp_path / "o.raw", "--disk", f"vda={other}"),
        "LI-DSK-004",
        "another identity",
        left_out=tmp_path / "o.raw",
    )


def test_a_truncated_disk_is_refused(scene, image, tmp_path):
    short = tmp_path / "short.img"
    short.write_bytes(scene.disk.read_bytes()[: DISK_BYTES // 2])
    fails(
        run("restore", image, "-o", tmp_path / "o.raw", "--disk", f"vda={short}"),
        "LI-DSK-004",
        f"{DISK_BYTES // 2} bytes",
        left_out=tmp_path / "o.raw",
    )


@pytest.mark.parametrize("sort", ["--sort-blocks", "--no-sort-blocks"])
def test_a_disk_changed_at_a_referenced_block_names_page_region_and_sector(scene, image, tmp_path, sort):
    changed = tmp_path / "changed.img"
    data = bytearray(scene.disk.read_bytes())
    victim = scene.on_disk[-1]  # far from the fingerprint's 64 samples
    assert all(abs(victim - DISK_BYTES * k // 64) >= PS for k in range(64))
    data[victim + 100] ^= 0x01
    changed.write_bytes(data)
    with LeanImage.open(image) as img:
        region = img.regions[0]
        slot = int(np.flatnonzero(img.tables.disk_refs.sectors == victim // SECTOR)[0])
        disk_pages = np.flatnonzero(img.classes(region) == PageClass.DISK)
        page = int(disk_pages[img.page_slots(region, 0, region.num_pages)[disk_pages] == slot][0])
    err = fails(
        run("restore", image, "-o", tmp_path / "o.raw", "--disk", f"vda={changed}", sort),
        "LI-DSK-005",
        f"page {page}",
        "'pc.ram'",
        f"sector {victim // SECTOR}",
        left_out=tmp_path / "o.raw",
    )
    assert "disk changed" in err
    proc = run("validate", image, "--disk", f"vda={changed}")
    assert proc.returncode == 1 and "LI-DSK-005" in proc.stdout.decode() + proc.stderr.decode()


@needs_qemu_img
def test_qcow2_with_a_missing_backing_file(scene, image, tmp_path):
    top = make_qcow2(scene.disk, tmp_path, "backing-chain")
    (tmp_path / "base.qcow2").unlink()
    fails(
        run("restore", image, "-o", tmp_path / "o.raw", "--disk", f"vda={top}"),
        "qemu-img cannot read",
        "base.qcow2",
        left_out=tmp_path / "o.raw",
    )


@needs_qemu_img
def test_a_truncated_or_damaged_qcow2_is_refused(scene, image, tmp_path):
    good = make_qcow2(scene.disk, tmp_path, "qcow2")
    data = good.read_bytes()
    for name, bad in (
        ("truncated", data[: len(data) // 3]),
        ("header-flip", data[:20] + bytes([data[20] ^ 0x40]) + data[21:]),
    ):
        path = tmp_path / f"{name}.qcow2"
        path.write_bytes(bad)
        err = fails(
            run("restore", image, "-o", tmp_path / "o.raw", "--disk", f"vda={path}"), left_out=tmp_path / "o.raw"
        )
        # refused by qemu-img, by the identity check (LI-DSK-004), or as a short read of the file
        # behind the disk, naming the disk, the path and the offset (an I/O failure, not a rule)
        assert "qemu-img cannot read" in err or "LI-DSK" in err or f"({path}): short read at" in err, err


def test_an_ext_superblock_that_lies_about_its_block_size_is_not_a_filesystem():
    from leanimg.disks.files import find_ext_filesystems

    disk = bytearray(1 << 20)
    struct.pack_into("<H", disk, 1024 + 56, 0xEF53)
    struct.pack_into("<I", disk, 1024 + 24, 2)
    assert [fs.block_size for fs in find_ext_filesystems(lambda o, n: bytes(disk[o : o + n]), len(disk))] == [4096]
    struct.pack_into("<I", disk, 1024 + 24, 0xFFFFFFFF)
    assert find_ext_filesystems(lambda o, n: bytes(disk[o : o + n]), len(disk)) == []


def test_a_disk_name_that_matches_nothing(scene, image, tmp_path):
    fails(
        run("restore", image, "-o", tmp_path / "o.raw", "--disk", f"sdz={scene.disk}"),
        "no disk named 'sdz'",
        "vda",
        left_out=tmp_path / "o.raw",
    )


def test_a_missing_disk_file_fails_convert_cleanly(scene, tmp_path):
    fails(
        run("convert", scene.save, "-o", tmp_path / "x.lean", "--disk", f"vda={tmp_path / 'none.img'}"),
        "cannot open",
        left_out=tmp_path / "x.lean",
    )


def test_restore_without_the_disk_says_which_to_pass(image, tmp_path):
    fails(run("restore", image, "-o", tmp_path / "o.raw"), "--disk vda=PATH", left_out=tmp_path / "o.raw")


# ------------------------------------------------------------------ pieces


def test_partition_tables():
    disk = bytearray(8 << 20)
    disk[:SECTOR] = mbr([(0x83, 63, 1000), (0x05, 2048, 8192)])
    disk[2048 * SECTOR : 2049 * SECTOR] = mbr([(0x83, 2, 100), (0x05, 200, 300)])  # EBR 1
    disk[2248 * SECTOR : 2249 * SECTOR] = mbr([(0x83, 7, 50), (0, 0, 0)])  # EBR 2
    found = read_partitions(lambda o, n: bytes(disk[o : o + n]), len(disk))
    assert found == [
        Partition(63 * SECTOR, 1000 * SECTOR),
        Partition(2050 * SECTOR, 100 * SECTOR),
        Partition(2255 * SECTOR, 50 * SECTOR),
    ]
    gpt = gpt_disk(8 << 20, [(34, 2047), (2049, 4095)])
    found = read_partitions(lambda o, n: bytes(gpt[o : o + n]), len(gpt))
    assert found == [Partition(34 * SECTOR, 2014 * SECTOR), Partition(2049 * SECTOR, 2047 * SECTOR)]
    gpt[SECTOR + 40] ^= 1  # header CRC now wrong: not trusted
    assert read_partitions(lambda o, n: bytes(gpt[o : o + n]), len(gpt)) == []
    gpt[SECTOR + 40] ^= 1
    for field, value in ((80, 1 << 31), (72, 1 << 40)):  # entry count, table LBA: beyond the disk
        lying = bytearray(gpt)
        struct.pack_into("<Q" if field == 72 else "<I", lying, SECTOR + field, value)
        struct.pack_into("<I", lying, SECTOR + 16, 0)
        struct.pack_into("<I", lying, SECTOR + 16, zlib.crc32(bytes(lying[SECTOR : SECTOR + 92])))
        reads = []
        assert read_partitions(lambda o, n: reads.append(n) or bytes(lying[o : o + n]), len(lying)) == []
        assert max(reads) <= SECTOR, "a lying GPT made the parser read its declared size"
    assert read_partitions(lambda o, n: bytes(8 << 20)[o : o + n], 8 << 20) == []


def test_a_looping_extended_chain_ends():
    disk = bytearray(4 << 20)
    disk[:SECTOR] = mbr([(0x05, 2048, 4096)])
    disk[2048 * SECTOR : 2049 * SECTOR] = mbr([(0x83, 1, 10), (0x05, 0x0, 1)])  # next = itself... at +0
    disk[2048 * SECTOR + 446 + 16 + 8 : 2048 * SECTOR + 446 + 16 + 12] = struct.pack("<I", 0)
    found = read_partitions(lambda o, n: bytes(disk[o : o + n]), len(disk))
    assert found == [Partition(2049 * SECTOR, 10 * SECTOR)]
    disk[2048 * SECTOR : 2049 * SECTOR] = mbr([(0x83, 1, 10), (0x05, 5000, 1)])  # next beyond the disk
    assert len(read_partitions(lambda o, n: bytes(disk[o : o + n]), len(disk))) == 1


def test_scan_segments_follow_the_partitions(scene):
    disk = RawDisk(str(scene.disk), "vda")
    try:
        assert scan_segments(disk, PS) == [(0, DISK_BYTES, 0), (PART_A[0] * SECTOR, PART_B[0] * SECTOR, 7 * SECTOR)]
        assert len(scan_segments(disk, PS, all_phases=True)) == 8
        assert disk.data_ranges()[-1][0] + disk.data_ranges()[-1][1] <= 8 << 20, "the hole was not skipped"
    finally:
        disk.close()


def test_sketch_is_equal_for_equal_pages_and_zero_only_for_zero_pages():
    rng = np.random.default_rng(0)
    pages = np.frombuffer(rng.bytes(64 * PS), np.uint64).reshape(64, PS // 8).copy()
    pages[3] = 0
    pages[5] = pages[7]
    s = sketch(pages)
    assert s[3] == 0 and np.count_nonzero(s) == 63 and s[5] == s[7]
    assert len(np.unique(s)) == 63
    flipped = pages.copy()
    flipped[:, 100] ^= 1  # one unsampled word changed in every page
    assert not np.any(sketch(flipped)[np.arange(64) != 3] == s[np.arange(64) != 3])


def test_page_index_matches_only_identical_content():
    rng = np.random.default_rng(1)
    ram = np.frombuffer(rng.bytes(16 * PS), np.uint64).reshape(16, PS // 8).copy()
    index = PageIndex(PS)
    index.add(0, 0, ram.tobytes())
    index.freeze()
    blocks = ram[[2, 9]].copy()
    near = ram[4].copy()
    near[0] ^= 1
    index.match_blocks(np.vstack([blocks, near[None]]), np.array([0, PS, 2 * PS]), disk_id=0)
    as_pages = ram.view(np.uint8)
    rows, disk_ids, sectors, digests = index.matches()([(0, 0, 16)], as_pages)
    assert rows.tolist() == [2, 9] and sectors.tolist() == [0, PS // SECTOR] and disk_ids.tolist() == [0, 0]
    assert (digests == row_digests(as_pages, rows)).all()  # the pages' own: what put_disks records
    # a batch of runs laid end to end: rows count from the batch's first page
    rows, _, sectors, _ = index.matches()([(0, 8, 4), (0, 0, 4)], np.vstack([as_pages[8:12], as_pages[0:4]]))
    assert rows.tolist() == [1, 6] and sectors.tolist() == [PS // SECTOR, 0]


class ListDisk:
    """A disk of page-sized blocks in memory (no partition table: one segment, phase 0)."""

    def __init__(self, blocks: np.ndarray):
        self.data = blocks.tobytes()
        self.size = len(self.data)

    def data_ranges(self):
        return [(0, self.size)]

    def read(self, offset: int, length: int) -> bytes:
        return self.data[offset : offset + length]


@pytest.mark.parametrize("chunk_blocks", [None, 3])
def test_block_index_finds_what_the_page_index_finds_first_block_first(monkeypatch, chunk_blocks):
    """The two lookups of diskrefs, one rule: a page refers to the first block in scan order
    (disks in turn, offsets ascending) with its content; zero pages and blocks are never looked
    up. With chunks of 3 blocks, BlockIndex's threads hash many chunks at once: same result."""
    from leanimg.converters import diskrefs

    if chunk_blocks:
        monkeypatch.setattr(diskrefs, "SCAN_CHUNK", chunk_blocks * PS)
    rng = np.random.default_rng(2)
    pool = np.frombuffer(rng.bytes(12 * PS), np.uint64).reshape(12, PS // 8).copy()
    pool[0] = 0
    disks = [ListDisk(pool[rng.integers(0, 8, 40)]), ListDisk(pool[rng.integers(4, 12, 40)])]
    ram = pool[rng.integers(0, 12, 64)].copy()
    pages = PageIndex(PS)
    pages.add(0, 0, ram.tobytes())
    pages.freeze()
    blocks = BlockIndex(PS)
    for disk_id, disk in enumerate(disks):
        scan_disk(pages, disk, disk_id)
        blocks.add_disk(disk, disk_id)
    blocks.freeze()
    want = pages.matches()([(0, 0, 64)], ram.view(np.uint8))
    got = blocks.lookup([(0, 0, 64)], ram.view(np.uint8))
    for a, b in zip(want, got):
        assert a.tolist() == b.tolist()
    assert len(want[0]) and blocks.looked_up == int((ram != 0).any(axis=1).sum())
    first = {}
    for disk_id, disk in enumerate(disks):  # the rule, spelled out
        rows = np.frombuffer(disk.data, np.uint64).reshape(-1, PS // 8)
        for k, row in enumerate(rows):
            first.setdefault(row.tobytes(), (disk_id, k * PS // SECTOR))
    expected = [(r, *first[ram[r].tobytes()]) for r in range(64) if ram[r].any() and ram[r].tobytes() in first]
    assert list(zip(*(a.tolist() for a in got[:3]))) == expected
    assert (got[3] == row_digests(ram.view(np.uint8), got[0])).all()


def test_in_order_keeps_the_order_and_raises_a_failure_at_its_turn():
    """diskrefs.in_order: results in the items' order whatever order the threads finish in; an
    item's failure is raised when its turn comes, and the items queued behind it do not run."""
    import threading
    import time

    from leanimg.converters.diskrefs import in_order

    started, failing = [], set()
    lock = threading.Lock()

    def work(k):
        with lock:
            started.append(k)
        time.sleep(0.002 * (2 - k % 3))  # later items often finish first
        if k in failing:
            raise DiskError(f"item {k}")
        return k * k

    assert list(in_order(work, range(20), 2)) == [(k, k * k) for k in range(20)]
    started.clear()
    failing.add(7)
    got = []
    with pytest.raises(DiskError, match="item 7"):
        for k, r in in_order(work, range(1000), 2):
            got.append(k)
    assert got == list(range(7)) and max(started) < 7 + 2 * 2 + 2


def test_a_disk_read_failing_while_indexed_is_raised():
    """A read error in one of BlockIndex's threads reaches the caller as it was."""

    class FailingDisk(ListDisk):
        def read(self, offset: int, length: int) -> bytes:
            if offset >= 5 * PS:
                raise DiskError(f"disk 'vda': short read at {offset:#x}")
            return super().read(offset, length)

    from leanimg.converters import diskrefs

    rng = np.random.default_rng(4)
    disk = FailingDisk(np.frombuffer(rng.bytes(40 * PS), np.uint64).reshape(40, PS // 8))
    index = BlockIndex(PS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(diskrefs, "SCAN_CHUNK", 2 * PS)
        with pytest.raises(DiskError, match="short read at 0x6000"):
            index.add_disk(disk, disk_id=0)


def test_block_index_matches_only_identical_content():
    """A block one bit away from a page (or holding a page's bytes but the page's neighbour's
    last word) is no reference: the lookup is by the whole page's digest."""
    rng = np.random.default_rng(3)
    ram = np.frombuffer(rng.bytes(16 * PS), np.uint64).reshape(16, PS // 8).copy()
    near = ram[[4, 5]].copy()
    near[0, 0] ^= 1
    near[1, -1] = ram[6, -1]
    blocks = BlockIndex(PS)
    blocks.add_disk(ListDisk(np.vstack([near, ram[[9, 2, 9]]])), disk_id=1)
    blocks.freeze()
    rows, disk_ids, sectors, digests = blocks.lookup([(0, 0, 16)], ram.view(np.uint8))
    assert rows.tolist() == [2, 9] and disk_ids.tolist() == [1, 1]
    assert sectors.tolist() == [3 * PS // SECTOR, 2 * PS // SECTOR]  # 9 at its first block
    assert (digests == row_digests(ram.view(np.uint8), rows)).all()


@needs_qemu_img
def test_sorted_and_unsorted_reads_agree_on_every_disk_kind(scene, tmp_path):
    offsets = np.array(
        [PART_B[0] * SECTOR + PS * k for k in (900, 3, 50, 4, 2)]
        + [PART_A[0] * SECTOR + 7 * SECTOR, PART_B[0] * SECTOR + 2 * PS + SECTOR]
    )  # the last one: same group, other phase
    for path in (
        scene.disk,
        make_qcow2(scene.disk, tmp_path, "compressed"),
        make_qcow2(scene.disk, tmp_path, "backing-chain"),
    ):
        disk = open_disk(str(path), "vda")
        try:
            sorted_reads = disk.read_runs(offsets, PS)
            assert np.array_equal(sorted_reads, disk.read_runs(offsets, PS, sort=False))
            want = b"".join(scene.disk.read_bytes()[o : o + PS] for o in offsets.tolist())
            assert sorted_reads.tobytes() == want
        finally:
            disk.close()


# ------------------------------------------------------------------ inspect --files


@pytest.mark.skipif(
    shutil.which("mkfs.ext4") is None or shutil.which("debugfs") is None, reason="e2fsprogs is not installed"
)
@pytest.mark.parametrize("disk_format", ["raw", "qcow2"])
def test_inspect_files_names_the_files_of_the_disk_pages(tmp_path, disk_format):
    """An ext4 partition at sector 2048 of an MBR disk; memory caches 3 pages of one file,
    all 5 of another and none of a third: --files says so, in pages and MiB."""
    if disk_format == "qcow2" and shutil.which("qemu-img") is None:
        pytest.skip("qemu-img is not installed")
    rng = np.random.default_rng(7)
    files = {"a.bin": rng.bytes(8 * PS), "dir/b.txt": text_blocks(rng, 5), "c.bin": rng.bytes(4 * PS)}
    tree = tmp_path / "tree"
    for name, data in files.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(data)
    fs = tmp_path / "fs.img"
    subprocess.run(["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", tree, fs, "8M"], check=True, capture_output=True)
    disk = tmp_path / "disk.img"
    disk.write_bytes(mbr([(0x83, 2048, 16384)]) + bytes(2048 * SECTOR - SECTOR) + fs.read_bytes())
    cached = [files["a.bin"][k * PS : (k + 1) * PS] for k in (0, 3, 7)] + [
        files["dir/b.txt"][k * PS : (k + 1) * PS] for k in range(5)
    ]
    ram = b"".join(cached) + rng.bytes(4 * PS)
    save = tmp_path / "vm.save"
    save.write_bytes(qemu_save(ram + bytes(-len(ram) % (1 << 20))))
    ok("convert", save, "-o", tmp_path / "vm.lean", "--disk", f"vda={disk}")
    if disk_format == "qcow2":
        subprocess.run(["qemu-img", "convert", "-O", "qcow2", disk, tmp_path / "disk.qcow2"], check=True)
        disk = tmp_path / "disk.qcow2"
    import json

    summary = json.loads(ok("inspect", tmp_path / "vm.lean", "--files", "--json", "--disk", f"vda={disk}").stdout)
    got = {f["path"]: f["pages"] for f in summary["disk_files"]["vda"]}
    assert got == {"/a.bin": 3, "/dir/b.txt": 5}
    text = ok("inspect", tmp_path / "vm.lean", "--files", "--disk", f"vda={disk}").stdout.decode()
    assert "/dir/b.txt" in text and "DISK pages of vda by file" in text


def test_inspect_files_needs_the_disk(image, tmp_path):
    fails(run("inspect", image, "--files"), "--disk vda=PATH")


def test_any_disk_identity_accepts_a_changed_disk_but_still_checks_every_block(scene, image, tmp_path):
    """A disk changed away from every referenced block: refused by identity, accepted with
    --any-disk-identity (and restores exactly); changed at a referenced block: still refused."""
    data = bytearray(scene.disk.read_bytes())
    last_sample = DISK_BYTES * 63 // 64  # fingerprint sample 63 (spec §5.3); no page there
    data[last_sample : last_sample + PS] = b"\xee" * PS
    elsewhere = tmp_path / "elsewhere.img"
    elsewhere.write_bytes(data)
    out = tmp_path / "o.raw"
    fails(run("restore", image, "-o", out, "--disk", f"vda={elsewhere}"), "LI-DSK-004", left_out=out)
    ok("restore", image, "-o", out, "--disk", f"vda={elsewhere}", "--any-disk-identity")
    assert out.read_bytes() == scene.ram
    out.unlink()
    data[scene.on_disk[0] + 7] ^= 0x40
    elsewhere.write_bytes(data)
    fails(
        run("restore", image, "-o", out, "--disk", f"vda={elsewhere}", "--any-disk-identity"),
        "LI-DSK-005",
        f"sector {scene.on_disk[0] // SECTOR}",
        left_out=out,
    )


def test_flatten_and_merge_keep_disk_references_without_reading_the_disk(scene, image, tmp_path):
    child = tmp_path / "child.lean"
    ok("convert", scene.save, "-o", child, "--parent", image, "--disk", f"vda={scene.disk}")
    for command, out in (("flatten", tmp_path / "flat.lean"), ("merge", tmp_path / "merged.lean")):
        ok(command, child, "--parent", image, "-o", out)  # no --disk: refs are copied
        counts = np.bincount(classes(out, [image]), minlength=7)
        assert counts[PageClass.DISK] == scene.disk_pages, (command, counts)
        assert "valid" in ok("validate", out, "--parent", image, "--disk", f"vda={scene.disk}").stdout.decode()
        raw = tmp_path / f"{command}.raw"
        ok("restore", out, "--parent", image, "-o", raw, "--disk", f"vda={scene.disk}")
        assert raw.read_bytes() == scene.ram


def test_flatten_keeps_the_parents_disk_references(scene, image, tmp_path):
    """A child converted without --disk holds PARENT pages whose base is a DISK page of its
    parent: flatten (and merge into a root parent) write them as DISK references again, copied
    from the parent's disk table, never reading the disk nor storing the pages (issue 15 §4)."""
    child = tmp_path / "child.lean"
    ok("convert", scene.save, "-o", child, "--parent", image)
    assert np.bincount(classes(child, [image]), minlength=7)[PageClass.DISK] == 0
    for command, out in (("flatten", tmp_path / "flat.lean"), ("merge", tmp_path / "merged.lean")):
        ok(command, child, "--parent", image, "-o", out)  # no --disk given
        counts = np.bincount(classes(out), minlength=7)
        assert counts[PageClass.DISK] == scene.disk_pages, (command, counts)
        assert counts[PageClass.STORED] == np.bincount(classes(image), minlength=7)[PageClass.STORED]
        with LeanImage.open(out) as flat, LeanImage.open(image) as parent:
            assert flat.header.has_parent is False
            assert [(d.name, d.size_bytes, bytes(d.fingerprint)) for d in flat.disks] == [
                (d.name, d.size_bytes, bytes(d.fingerprint)) for d in parent.disks
            ]
        ok("validate", out, "--disk", f"vda={scene.disk}")
        raw = tmp_path / f"{command}.raw"
        ok("restore", out, "-o", raw, "--disk", f"vda={scene.disk}")
        assert raw.read_bytes() == scene.ram


def test_an_incremental_reads_a_changed_page_that_was_on_the_parents_disk(tmp_path):
    """A page that was a DISK page of the parent and then changed is read from the --disk given
    to the incremental convert (lent to the parent) to encode its delta; without the disk the
    error names the option."""
    rng = np.random.default_rng(3)
    ram = rng.integers(1, 2**63, 8 * 512, dtype=np.uint64).tobytes()
    disk = tmp_path / "vda.img"
    disk.write_bytes(ram[: 4 * PS] + bytes(4 * PS))
    (tmp_path / "one.save").write_bytes(qemu_save(ram))
    changed = bytearray(ram)
    changed[PS + 16 : PS + 24] = b"changed!"  # page 1: on the disk in the parent
    (tmp_path / "two.save").write_bytes(qemu_save(bytes(changed)))
    ok = run("convert", tmp_path / "one.save", "-o", tmp_path / "one.lean", "--disk", f"vda={disk}")
    assert ok.returncode == 0, ok.stderr.decode()
    with LeanImage.open(tmp_path / "one.lean") as parent:
        assert parent.classes(parent.regions[0], 0, 4).tolist() == [PageClass.DISK] * 4
    without = run("convert", tmp_path / "two.save", "-o", tmp_path / "bad.lean", "--parent", tmp_path / "one.lean")
    assert without.returncode == 1 and b"pass --disk vda=PATH" in without.stderr
    proc = run(
        "convert",
        tmp_path / "two.save",
        "-o",
        tmp_path / "two.lean",
        "--parent",
        tmp_path / "one.lean",
        "--disk",
        f"vda={disk}",
    )
    assert proc.returncode == 0, proc.stderr.decode()
    with LeanImage.open(tmp_path / "two.lean") as child:
        assert child.classes(child.regions[0], 1, 1).tolist() == [PageClass.DELTA]
    rebuilt = tmp_path / "rebuilt.save"
    assert run("restore", tmp_path / "two.lean", "--to", "qemu", "--disk", f"vda={disk}", "-o", rebuilt).returncode == 0
    assert rebuilt.read_bytes() == (tmp_path / "two.save").read_bytes()
