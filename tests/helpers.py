"""Shared test helpers: hypothesis profiles and the write/read round trip.

``tests/conftest.py`` calls ``register_hypothesis_profiles()``; the profile is
chosen by the environment variable HYPOTHESIS_PROFILE (default, ci, expensive).
"""

from __future__ import annotations

import io
import gc
import os
import re
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import numpy as np

VECTORS_DIR = Path(__file__).resolve().parent / "vectors"

_REGISTERED = False


def register_hypothesis_profiles(load: bool = True) -> None:
    """Register the profiles ``default``, ``ci`` and ``expensive``; load HYPOTHESIS_PROFILE."""
    global _REGISTERED
    from hypothesis import HealthCheck, settings

    if not _REGISTERED:
        common = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], deadline=None)
        settings.register_profile("default", max_examples=100, **common)
        settings.register_profile("ci", max_examples=300, derandomize=True, print_blob=True, **common)
        settings.register_profile("expensive", max_examples=3000, **common)
        _REGISTERED = True
    if load:
        settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def write_bytes(build, **writer_kwargs) -> bytes:
    """Run ``build(writer)`` on a LeanImageWriter writing to memory; the image bytes."""
    from leanimg.writer import LeanImageWriter

    out = io.BytesIO()
    writer_kwargs.setdefault("threads", 1)
    with LeanImageWriter(out, **writer_kwargs) as writer:
        build(writer)
    return out.getvalue()


@contextmanager
def disk_sources(paths=None):
    """``paths`` (disk name -> file) opened as disk sources for the block."""
    from leanimg.disks import open_disk

    sources = {}
    try:
        for name, path in (paths or {}).items():
            sources[name] = open_disk(str(path), name)
        yield sources
    finally:
        for source in sources.values():
            source.close()


def validate_with_disks(path, *, disks=None, **kw):
    """``validate`` with ``disks`` (disk name -> file) opened for it."""
    from leanimg.validate import validate

    with disk_sources(disks) as sources:
        return validate(path, disks=sources, **kw)


def restore_bytes(path, *, parents=(), disks=None) -> bytes:
    """Raw restore of ``path`` (regions in file order, concatenated) as bytes."""
    from leanimg.reader import LeanImage
    from leanimg.restore.raw import restore_raw

    out = io.BytesIO()
    with disk_sources(disks) as sources, LeanImage.open(path, parents=list(parents), disks=sources) as image:
        restore_raw(image, out)
    return out.getvalue()


def roundtrip(data: bytes, expected: dict[str, bytes], *, page_size: int, tmpdir=None, parents=(), disks=None) -> None:
    """Check an image (bytes) reads back page-identical: ``expected`` maps region name to its
    full content in file order (FREE pages as zeros). Uses read_page on every page and restore_raw."""
    from leanimg.reader import LeanImage
    from leanimg.validate import validate

    with tempfile.TemporaryDirectory(dir=tmpdir) as d:
        path = os.path.join(d, "image.lean")
        with open(path, "wb") as f:
            f.write(data)
        with disk_sources(disks) as sources:
            report = validate(path, parents=parents, disks=sources)
        assert report.valid, [str(f) for f in report.findings]
        with disk_sources(disks) as sources, LeanImage.open(path, parents=list(parents), disks=sources) as image:
            assert [r.name for r in image.regions] == list(expected)
            for region in image.regions:
                content = expected[region.name]
                assert region.size_bytes == len(content)
                for p in range(region.num_pages):
                    got = image.read_page(region, p)
                    assert got == content[p * page_size : (p + 1) * page_size], (region.name, p)
        assert restore_bytes(path, parents=parents, disks=disks) == b"".join(expected.values())


def make_vectors():
    """tests/vectors/make_vectors.py as a module (its Lean record model and mutation helpers)."""
    import importlib.util
    import sys

    name = "leanimg_test_make_vectors"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, VECTORS_DIR / "make_vectors.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def first_difference(a: Path, b: Path) -> str:
    """Where two files differ, for assertion messages."""
    x, y = np.fromfile(a, np.uint8), np.fromfile(b, np.uint8)
    if len(x) != len(y):
        return f"lengths {len(x)} != {len(y)}"
    diff = np.flatnonzero(x != y)
    return f"{len(diff)} bytes differ, first at {diff[0]:#x} (page {diff[0] // 4096:#x})"


def qemu_save(ram: bytes, *, vmdesc: bool = True, page_size: int = 4096) -> bytes:
    """A small QEMU 7.2 migration stream with one RAM block "pc.ram" holding ``ram`` and one
    device section, written by our own stream writer (for tests that need a save, not a VM)."""
    import json
    import struct
    from leanimg.converters import qemu as q

    machine = b"pc-i440fx-7.2"
    prologue = (
        struct.pack(">II", q.QEVM_MAGIC, 3) + bytes([q.CONFIGURATION]) + struct.pack(">I", len(machine)) + machine
    )
    devices = [q.DeviceSection(q.FULL, q.SectionHeader(3, "timer", 0, 2), b"\x01" * 24)]
    desc = {"page_size": page_size, "devices": [{"name": "timer", "instance_id": 0}]}
    state = q.StreamState(
        prologue=prologue,
        machine=machine.decode(),
        page_size=page_size,
        capabilities=(),
        ram=q.SectionHeader(2, "ram", 0, 4),
        ram_blocks=(q.RamBlock("pc.ram", len(ram)),),
        ram_plan=[(q.START, 0), (q.PART, len(ram) // page_size), (q.END, 0)],
        footers=True,
        devices=devices,
        vmdesc=json.dumps(desc).encode() if vmdesc else None,
    )
    out = io.BytesIO()
    q.write_qemu_stream(out, state, None, lambda b: [ram])
    return out.getvalue()


def assert_clean_failure(
    proc, outdir: Path, *, match: str = "", offset: int | None = None, structure: str | None = ""
) -> str:
    """Exit 1, exactly one stderr line 'leanimg: error: ...', nothing left in ``outdir``."""
    err = proc.stderr.decode(errors="replace")
    lines = err.strip().splitlines()
    assert proc.returncode == 1, f"exit {proc.returncode}, stderr:\n{err}"
    assert "Traceback" not in err and "internal error" not in err, err
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    line = lines[0]
    assert line.startswith("leanimg: error: "), line
    assert match in line, f"expected {match!r} in: {line}"
    if offset == -1:
        pass  # the caller checks where the error points
    elif offset is not None:
        assert f"offset {offset:#x}" in line, f"expected offset {offset:#x} in: {line}"
    else:
        assert re.search(r"offset 0x[0-9a-f]+", line), f"no offset in: {line}"
    if structure is not None:
        assert structure in line, f"expected structure {structure!r} in: {line}"
    left = sorted(os.listdir(outdir))
    assert left == [], f"left behind in {outdir}: {left}"
    return line


def with_source_state_data(image: Path, out: Path, data: bytes) -> None:
    """``image`` with the data of its first SOURCE_STATE record replaced; every checksum, the
    index and the footer recomputed, so the blob's content is the only thing wrong."""
    from leanimg.format import SOURCE_STATE_BODY, RecordType

    mv = make_vectors()
    lean = mv.Lean.parse(image.read_bytes())
    k = next(i for i, r in enumerate(lean.records) if r.type == RecordType.SOURCE_STATE)
    head = lean.records[k].body[: SOURCE_STATE_BODY.struct.size]
    lean.records[k].body = head + data
    lean.records[k].count = len(data)
    out.write_bytes(lean.build())


def make_record(record_type: int, body: bytes, *, offset: int = 0, index: int | None = 0, parse: bool = True):
    """A ``leanimg.structures.Record`` of ``body`` as if read at ``offset`` (record ``index`` in
    file order), parsed with ``parse_body`` unless ``parse`` is false (for unit tests of the
    per-record and cross-record checks without writing a file)."""
    from leanimg.format import checksum64
    from leanimg.structures import Record, parse_body

    record = Record(offset, int(record_type), 0, len(body), checksum64(body), memoryview(bytes(body)), index)
    if parse:
        parse_body(record)
    return record


PS = 4096


def _pages(seed: int, count: int, page_size: int = PS) -> bytes:
    """``count`` pages of random bytes (none all-zero)."""
    return np.random.default_rng(seed).integers(1, 256, count * page_size, dtype=np.uint8).tobytes()


def write_two_link_chain(directory):
    """A parent and a child image (and the child's disk) in ``directory``, small and with every
    record type and page class between them.

    parent.lean (flat, one page per PAGE_FRAME): region "ram" of 8 pages, STORED but page 6
    ZERO; region "rom" of 2 STORED pages at guest_phys_base 0xf0000.
    child.lean (against parent.lean, two SOURCE_STATE records, disk "disk0" = disk0.raw):
    "ram" = PARENT, DELTA, STORED, ZERO, FREE, DISK (disk sector 8), DISK (sector 0), DELTA;
    "rom" = 2 PARENT pages.
    Returns paths (parent, child, disk), the image uuids, and each image's content per region
    as the reader gives it (FREE pages as zeros).
    """
    import types
    from leanimg.format import PageClass, SourceFormat, page_digest
    from leanimg.writer import LeanImageWriter, ParentLink, disk_fingerprint

    directory = Path(directory)
    disk = _pages(50, 4)
    disk_path = directory / "disk0.raw"
    disk_path.write_bytes(disk)
    parent_uuid, child_uuid = bytes([0x11] * 16), bytes([0x22] * 16)

    ram = bytearray(_pages(51, 8))
    ram[6 * PS : 7 * PS] = bytes(PS)
    rom = _pages(52, 2)
    parent_path = directory / "parent.lean"
    with LeanImageWriter(parent_path, frame_pages=1, threads=1, image_uuid=parent_uuid) as w:
        r = w.add_region("ram", 8 * PS)
        w.put_pages(r, 0, bytes(ram))
        o = w.add_region("rom", 2 * PS, guest_phys_base=0xF0000)
        w.put_pages(o, 0, rom)
    parent_digest = parent_path.read_bytes()[-24:-8]

    def page(data, k):
        return bytes(data[k * PS : (k + 1) * PS])

    def changed(k, words):
        new = np.frombuffer(page(ram, k), "<u8").copy()
        new[list(words)] ^= np.uint64(0x0123_4567_89AB_CDEF)
        return new.tobytes()

    child_ram = [
        page(ram, 0),
        changed(1, [0, 5, 511]),
        _pages(53, 1),
        bytes(PS),
        bytes(PS),
        disk[PS : 2 * PS],
        disk[:PS],
        changed(7, range(100, 140)),
    ]
    child_path = directory / "child.lean"
    with LeanImageWriter(
        child_path, frame_pages=2, threads=1, image_uuid=child_uuid, parent=ParentLink(parent_uuid, parent_digest)
    ) as w:
        disk_id = w.add_disk("disk0", len(disk), disk_fingerprint(lambda o, n: disk[o : o + n], len(disk)))
        w.add_source_state(SourceFormat.QEMU, 3, b"cpu state")
        w.add_source_state(SourceFormat.QEMU, 4, b"devices")
        r = w.add_region("ram", 8 * PS)
        w.put_parent(r, 0, page_digest(child_ram[0]))
        assert w.put_changed(r, 1, page(ram, 1), child_ram[1]) == PageClass.DELTA
        w.put_pages(r, 2, child_ram[2])
        w.put_zero(r, 3)
        w.put_free(r, 4)
        w.put_disks(
            r,
            np.array([5, 6]),
            np.array([disk_id, disk_id]),
            np.array([8, 0]),
            np.frombuffer(page_digest(child_ram[5]) + page_digest(child_ram[6]), np.uint8).reshape(2, 16),
        )
        assert w.put_changed(r, 7, page(ram, 7), child_ram[7]) == PageClass.DELTA
        o = w.add_region("rom", 2 * PS, guest_phys_base=0xF0000)
        w.put_parent(o, 0, page_digest(page(rom, 0)) + page_digest(page(rom, 1)))
    return types.SimpleNamespace(
        parent=parent_path,
        child=child_path,
        disk=disk_path,
        parent_uuid=parent_uuid,
        child_uuid=child_uuid,
        parent_content={"ram": bytes(ram), "rom": rom},
        child_content={"ram": b"".join(child_ram), "rom": rom},
    )


def run_leanimg(*args, timeout: float, **kw) -> subprocess.CompletedProcess:
    """The leanimg command line with ``args`` (str() of each), output captured as text."""
    from leanimg.cli import command_line

    return subprocess.run([*command_line(), *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw)


def checkpoint_ok(qmp, image, *args, timeout: float) -> subprocess.CompletedProcess:
    """``leanimg checkpoint --qmp QMP -o IMAGE ARGS``, which must succeed without a traceback."""
    proc = run_leanimg("checkpoint", "--qmp", qmp, "-o", image, *args, timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    return proc


def tagged_page(tag: int, page_size: int = 4096) -> bytes:
    """A page of the 64-bit word ``tag`` repeated: distinct, recognisable content."""
    return np.full(page_size // 8, tag, np.uint64).tobytes()


def write_every_class_chain(
    folder: Path,
    plan: list[str],
    *,
    disk_blocks: int,
    frame_pages: int | None = None,
    ram_base: int = 0,
    rom_pages: int = 2,
    rom_base: int | None = None,
) -> tuple[Path, Path, Path]:
    """A parent image and a child whose region "ram" has the classes ``plan`` gives page by page
    (STORED, ZERO, FREE, DISK<k> = block k of disk "vda", PARENT, DELTA), plus a region "rom"
    of ``rom_pages`` STORED pages. Returns (child, parent, disk file) in ``folder``."""
    from leanimg.format import DISK_SECTOR_SIZE, PageClass, page_digest
    from leanimg.reader import LeanImage
    from leanimg.writer import LeanImageWriter, ParentLink, disk_fingerprint

    n, ps = len(plan), 4096
    parent_pages = [tagged_page(100 + k) for k in range(n)]
    parent_path = folder / "parent.lean"
    with LeanImageWriter(parent_path) as w:
        w.put_pages(w.add_region("ram", n * ps), 0, b"".join(parent_pages))
    with LeanImage.open(parent_path) as parent:
        link = ParentLink(parent.header.image_uuid, parent.footer.image_digest)
    disk = b"".join(tagged_page(200 + k) for k in range(disk_blocks))
    (folder / "disk.img").write_bytes(disk)
    child_path = folder / "child.lean"
    with LeanImageWriter(child_path, parent=link, frame_pages=frame_pages) as w:
        d = w.add_disk("vda", len(disk), disk_fingerprint(lambda o, k: disk[o : o + k], len(disk)))
        ram = w.add_region("ram", n * ps, guest_phys_base=ram_base)
        rom = w.add_region("rom", rom_pages * ps, guest_phys_base=rom_base)
        w.put_pages(rom, 0, b"".join(tagged_page(1 + k) for k in range(rom_pages)))
        for page, name in enumerate(plan):
            if name == "STORED":
                w.put_pages(ram, page, tagged_page(300 + page))
            elif name == "ZERO":
                w.put_zero(ram, page)
            elif name == "FREE":
                w.put_free(ram, page)
            elif name.startswith("DISK"):
                block = int(name[4:])
                w.put_disk(
                    ram, page, d, block * ps // DISK_SECTOR_SIZE, page_digest(disk[block * ps : (block + 1) * ps])
                )
            elif name == "PARENT":
                w.put_parent(ram, page, page_digest(parent_pages[page]))
            else:
                new = bytearray(parent_pages[page])
                new[8:16] = b"changed!"
                assert w.put_changed(ram, page, parent_pages[page], bytes(new)) == PageClass.DELTA
    return child_path, parent_path, folder / "disk.img"


def open_fds() -> int:
    """How many descriptors this process has open."""
    return len(os.listdir("/proc/self/fd"))


def fds_before() -> int:
    """open_fds() for a test to compare with later, after a collection: files earlier tests left
    to the collector would otherwise be closed while the test runs (seen in CI: 39 before, 36 after)."""
    gc.collect()
    return open_fds()
