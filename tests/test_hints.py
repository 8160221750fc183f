"""The hint protocol (spec/hints.md): the reader and writer, the vectors, the rules that need
the save, and `convert --hints` end to end on the bundled real QEMU save, on synthetic QEMU
streams that send a page twice, and on generated Xen streams checked by verify-stream-v2."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings, strategies as st

import xen_streams as xs
from helpers import qemu_save
from leanimg.cli import command_line
from leanimg.converters import qemu as q
from leanimg.format import PageClass
from leanimg.hints import (
    MAX_RANGES,
    AddressMap,
    FreeSource,
    Guest,
    HintError,
    HintReader,
    HintWriter,
    RecordType,
    check_against,
    check_hints,
    qemu_pc_low_ram,
    read_hints,
    resolve,
)
from leanimg.reader import LeanImage

REPO = Path(__file__).resolve().parents[1]
VECTORS = REPO / "tests" / "vectors" / "hints"
META = json.loads((VECTORS / "hints.json").read_text())["vectors"]
SAMPLE = REPO / "lean-image" / "sample"
LEANIMG = command_line()
PS = 4096
GIB = 1 << 30


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*LEANIMG, *map(str, args)], capture_output=True, timeout=300)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return proc.stderr.decode()


def write_hints(build, **header) -> bytes:
    out = io.BytesIO()
    with HintWriter(out, **header) as w:
        build(w)
    return out.getvalue()


def raw_memory(image: Path, disks=(), parents=()) -> dict[str, bytes]:
    args = [a for d in disks for a in ("--disk", d)] + [a for p in parents for a in ("--parent", p)]
    out = image.with_suffix(".raw")
    ok(run("restore", image, "--to", "raw", "-o", out, "-f", *args))
    with LeanImage.open(str(image), parents=list(parents)) as img:
        sizes = [(r.name, r.size_bytes) for r in img.regions]
    data, regions, at = out.read_bytes(), {}, 0
    for name, size in sizes:
        regions[name] = data[at : at + size]
        at += size
    return regions


def classes_of(image: Path, region: str = "pc.ram", parents=()) -> np.ndarray:
    with LeanImage.open(str(image), parents=list(parents)) as img:
        return img.classes(img.region(region)).copy()


# ------------------------------------------------------------------ reader and writer


def test_writer_output_reads_back():
    data = write_hints(
        lambda w: (
            w.free([(0x3000, 2), (0x1000, 2), (0x2000, 1)], stream_offset=10, source=FreeSource.BALLOON),
            w.disk_runs([(0x8000, 3, "vda", 64), (0x4000, 1, "vdb", 8)], stream_offset=20),
            w.parent(b"\x01" * 16),
            w.unchanged([(5, 2)], stream_offset=0, region="pc.ram"),
        ),
        address_map=AddressMap.QEMU_PC,
    )
    hints = read_hints(data)
    free, disk, unchanged = hints.records
    assert free.kind == RecordType.FREE and free.source == FreeSource.BALLOON and free.stream_offset == 10
    assert free.entries.tolist() == [(0x1000, 4)]  # sorted and merged
    assert [
        (int(e["first"]), int(e["num_pages"]), hints.disks[int(e["disk_id"])], int(e["sector"])) for e in disk.entries
    ] == [(0x4000, 1, "vdb", 8), (0x8000, 3, "vda", 64)]
    assert hints.parent_uuid == b"\x01" * 16 and hints.regions[unchanged.region_id] == "pc.ram"
    assert check_hints(data)[1] == []


def test_writer_splits_records_at_the_payload_limit():
    ranges = [(2 * k * PS, 1) for k in range(70000)]  # 70000 disjoint ranges: two records
    hints = read_hints(write_hints(lambda w: w.free(ranges, stream_offset=0), address_map=AddressMap.QEMU_PC))
    assert [len(r.entries) for r in hints.records] == [65534, 4466]


def test_live_reader_yields_records_as_they_arrive():
    """HintReader on a pipe: each record once written and flushed, END last."""
    import os
    import threading

    read_fd, write_fd = os.pipe()
    got, proceed = [], threading.Event()

    def consume():
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            reader = HintReader(pipe)
            for record in reader.records():
                got.append(record.stream_offset)
                proceed.set()

    thread = threading.Thread(target=consume)
    thread.start()
    with os.fdopen(write_fd, "wb", buffering=0) as pipe, HintWriter(pipe, address_map=AddressMap.QEMU_PC) as w:
        w.free([(0, 1)], stream_offset=111)
        assert proceed.wait(10), "the first record did not arrive before the writer went on"
        w.free([(PS, 1)], stream_offset=222)
    thread.join(10)
    assert got == [111, 222]


@pytest.mark.parametrize("rel", sorted(META))
def test_vectors(rel):
    meta = META[rel]
    hints, findings = check_hints(VECTORS / rel)
    if meta["kind"] == "valid":
        assert findings == [] and read_hints(VECTORS / rel) is not None
        return
    assert findings and findings[0].rule == meta["rule"], f"{rel}: {findings[:2]}"
    with pytest.raises(HintError) as info:
        read_hints(VECTORS / rel)
    assert info.value.rule == meta["rule"] and info.value.offset is not None and info.value.structure


def test_the_spec_rule_table_lists_every_hint_rule():
    import re
    from leanimg.rules import HINT_RULES

    table = re.findall(r"^\| (LI-HNT-\d{3}) \|", (REPO / "spec" / "hints.md").read_text(), re.M)
    assert table == sorted(HINT_RULES)


def test_every_structural_rule_has_an_invalid_vector():
    rules = {m["rule"] for m in META.values() if m["kind"] == "invalid"}
    assert rules == {f"LI-HNT-{n:03d}" for n in range(1, 17)}


def test_vectors_are_what_the_generator_writes(tmp_path):
    subprocess.run([sys.executable, REPO / "spec" / "tools" / "make_hint_vectors.py", tmp_path], check=True)
    for rel in META:
        assert (tmp_path / rel).read_bytes() == (VECTORS / rel).read_bytes(), rel


def test_every_cut_of_a_valid_file_is_refused():
    data = (VECTORS / "valid" / "everything.hnt").read_bytes()
    for cut in range(len(data)):
        with pytest.raises(HintError) as info:
            read_hints(data[:cut])
        assert info.value.rule in ("LI-HNT-001", "LI-HNT-005"), (cut, info.value)


def test_a_huge_declared_payload_is_refused_before_reading():
    class Endless(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, b):
            b[:] = b"\0" * len(b)
            return len(b)

    head = (VECTORS / "valid" / "empty.hnt").read_bytes()[:32]
    stream = io.BufferedReader(_Prefixed(head + struct.pack("<HHI", 4, 0, 0xFFFFFFFF), Endless()))
    with pytest.raises(HintError) as info:
        read_hints(stream)
    assert info.value.rule == "LI-HNT-006"


class _Prefixed(io.RawIOBase):
    def __init__(self, head: bytes, rest):
        self.head, self.rest = head, rest

    def readable(self):
        return True

    def readinto(self, b):
        if self.head:
            n = min(len(b), len(self.head))
            b[:n], self.head = self.head[:n], self.head[n:]
            return n
        return self.rest.readinto(b)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400), st.integers(0, 400))
def test_any_bytes_give_hints_or_a_hint_error(junk, at):
    """Random bytes, and a valid file with bytes overwritten: never another exception."""
    base = bytearray((VECTORS / "valid" / "everything.hnt").read_bytes())
    base[at : at + len(junk)] = junk
    for data in (junk, bytes(base)):
        try:
            read_hints(data)
        except HintError as exc:
            assert exc.rule and exc.rule.startswith("LI-HNT-") and exc.offset is not None
        check_hints(data)


def test_total_ranges_are_limited():
    per_record = 65534
    out = io.BytesIO()
    w = HintWriter(out, address_map=AddressMap.QEMU_PC)
    for k in range(MAX_RANGES // per_record + 1):
        w.free([(2 * i * PS, 1) for i in range(per_record)], stream_offset=k)
    w.close()
    with pytest.raises(HintError) as info:
        read_hints(out.getvalue())
    assert info.value.rule == "LI-HNT-014"


# ------------------------------------------------------------------ against the save (017-021)


def qemu_guest(ram_pages: int, **kw) -> Guest:
    return Guest(PS, "qemu", {"pc.ram": ram_pages, "vga.vram": 16}, **kw)


def findings_for(data: bytes, guest: Guest) -> list[str]:
    return [f.rule for f in check_against(read_hints(data), guest)]


def test_qemu_pc_address_map():
    assert qemu_pc_low_ram(2 * GIB) == 2 * GIB and qemu_pc_low_ram(4 * GIB) == 3 * GIB
    ram = 4 * GIB // PS  # 3 GiB low, 1 GiB above 4 GiB
    data = write_hints(
        lambda w: w.free([(0, 1), (3 * GIB - PS, 1), (4 * GIB, 2), (5 * GIB - PS, 1)], stream_offset=0),
        address_map=AddressMap.QEMU_PC,
    )
    (r,) = resolve(read_hints(data), qemu_guest(ram))
    assert r.region == "pc.ram"
    assert r.first.tolist() == [0, 3 * GIB // PS - 1, 3 * GIB // PS, 4 * GIB // PS - 1]
    for bad in (3 * GIB, 5 * GIB, 3 * GIB - PS):  # the hole, beyond RAM, across the hole
        data = write_hints(lambda w: w.free([(bad, 2)], stream_offset=0), address_map=AddressMap.QEMU_PC)
        assert findings_for(data, qemu_guest(ram)) == ["LI-HNT-018"], hex(bad)


def test_rules_that_need_the_save():
    guest = qemu_guest(256, stream_length=1000, disks={"vda": 1 << 20}, parent_uuid=b"\x02" * 16)
    cases = {
        "LI-HNT-017": (write_hints(lambda w: None, page_size=8192, address_map=AddressMap.QEMU_PC), guest),
        "LI-HNT-018": (write_hints(lambda w: w.free([(300, 1)], stream_offset=0, region="pc.ram")), guest),
        "LI-HNT-019": (write_hints(lambda w: w.free([(0, 1)], stream_offset=1001, region="pc.ram")), guest),
        "LI-HNT-020": (write_hints(lambda w: w.disk_runs([(0, 1, "vdb", 0)], stream_offset=0, region="pc.ram")), guest),
    }
    for rule, (data, g) in cases.items():
        assert findings_for(data, g) == [rule], rule
    too_far = write_hints(lambda w: w.disk_runs([(0, 2, "vda", 2040)], stream_offset=0, region="pc.ram"))
    assert findings_for(too_far, guest) == ["LI-HNT-020"]
    other_region = write_hints(lambda w: w.free([(0, 1)], stream_offset=0, region="nvdimm"))
    assert findings_for(other_region, guest) == ["LI-HNT-018"]
    xen_map = write_hints(lambda w: None, address_map=AddressMap.XEN)
    assert findings_for(xen_map, guest) == ["LI-HNT-017"]
    unchanged = write_hints(lambda w: (w.parent(b"\x03" * 16), w.unchanged([(0, 1)], stream_offset=0, region="pc.ram")))
    assert findings_for(unchanged, guest) == ["LI-HNT-021"]
    assert findings_for(unchanged, qemu_guest(256)) == ["LI-HNT-021"]  # no parent given
    assert findings_for(unchanged, qemu_guest(256, parent_uuid=b"\x03" * 16)) == []
    assert findings_for(cases["LI-HNT-019"][0], qemu_guest(256, stream_length=1001)) == []


# ------------------------------------------------------------------ the real QEMU sample: DISK hints


@pytest.fixture(scope="module")
def sample(module_dirs):
    d = module_dirs("sample")
    for name in ("vm.save", "disk.img"):
        with open(SAMPLE / f"{name}.zst", "rb") as fin, open(d / name, "wb") as fout:
            zstandard.ZstdDecompressor().copy_stream(fin, fout)
    ok(run("convert", d / "vm.save", "-o", d / "scan.lean", "--disk", f"vda={d / 'disk.img'}"))
    ok(run("convert", d / "vm.save", "-o", d / "plain.lean"))
    with LeanImage.open(str(d / "scan.lean")) as img:
        region = img.region("pc.ram")
        pages = np.flatnonzero(img.classes(region) == PageClass.DISK)
        sectors = img.tables.disk_refs.sectors[img.page_slots(region, 0, region.num_pages)[pages]]
    return d, pages.astype(np.int64), sectors.astype(np.int64)


def test_true_disk_hints_give_the_scan_s_disk_references(sample):
    d, pages, sectors = sample
    assert len(pages) > 1000
    (d / "true.hnt").write_bytes(
        write_hints(
            lambda w: w.disk_runs([(int(p) * PS, 1, "vda", int(s)) for p, s in zip(pages, sectors)], stream_offset=0),
            address_map=AddressMap.QEMU_PC,
        )
    )
    ok(run("validate-hints", d / "true.hnt", "--save", d / "vm.save"))
    report = ok(
        run(
            "convert",
            d / "vm.save",
            "-o",
            d / "true.lean",
            "--disk",
            f"vda={d / 'disk.img'}",
            "--hints",
            d / "true.hnt",
        )
    )
    assert f"hints DISK: {len(pages)} applied" in report
    assert "disks scanned" not in report  # only the hinted blocks were read
    assert np.array_equal(np.flatnonzero(classes_of(d / "true.lean") == PageClass.DISK), pages)
    ok(run("validate", d / "true.lean", "--disk", f"vda={d / 'disk.img'}"))
    assert raw_memory(d / "true.lean", [f"vda={d / 'disk.img'}"]) == raw_memory(d / "plain.lean")


def test_lying_disk_hints_change_nothing_but_counts(sample):
    """Half the hints point at the wrong sector, some at a page that is not on the disk at all:
    those pages are stored as without hints, every page restores as in the plain conversion."""
    d, pages, sectors = sample
    rng = np.random.default_rng(1)
    lie = rng.random(len(pages)) < 0.5
    wrong = np.where(lie, (sectors + 8) % (32 << 11), sectors)  # another page of the 32 MiB disk
    classes = classes_of(d / "plain.lean")
    stored = np.flatnonzero(classes == PageClass.STORED)
    not_on_disk = np.setdiff1d(stored, pages)[:200]
    runs = [(int(p) * PS, 1, "vda", int(s)) for p, s in zip(pages, wrong)] + [
        (int(p) * PS, 1, "vda", 2048) for p in not_on_disk
    ]
    (d / "lies.hnt").write_bytes(
        write_hints(lambda w: w.disk_runs(runs, stream_offset=0), address_map=AddressMap.QEMU_PC)
    )
    report = ok(
        run(
            "convert",
            d / "vm.save",
            "-o",
            d / "lies.lean",
            "--disk",
            f"vda={d / 'disk.img'}",
            "--hints",
            d / "lies.hnt",
        )
    )
    assert f"hints DISK: {int((~lie).sum())} applied, {int(lie.sum()) + len(not_on_disk)} ignored" in report
    got = classes_of(d / "lies.lean")
    assert np.array_equal(np.flatnonzero(got == PageClass.DISK), pages[~lie])
    ok(run("validate", d / "lies.lean", "--disk", f"vda={d / 'disk.img'}"))
    assert raw_memory(d / "lies.lean", [f"vda={d / 'disk.img'}"]) == raw_memory(d / "plain.lean")


def test_disk_hints_with_a_full_scan_as_well(sample):
    d, pages, sectors = sample
    half = pages[::2], sectors[::2]
    (d / "half.hnt").write_bytes(
        write_hints(
            lambda w: w.disk_runs([(int(p), 1, "vda", int(s)) for p, s in zip(*half)], stream_offset=0, region="pc.ram")
        )
    )
    hinted_only = d / "half.lean"
    ok(run("convert", d / "vm.save", "-o", hinted_only, "--disk", f"vda={d / 'disk.img'}", "--hints", d / "half.hnt"))
    assert np.array_equal(np.flatnonzero(classes_of(hinted_only) == PageClass.DISK), half[0])
    both = d / "both.lean"
    ok(
        run(
            "convert",
            d / "vm.save",
            "-o",
            both,
            "--disk",
            f"vda={d / 'disk.img'}",
            "--hints",
            d / "half.hnt",
            "--disk-scan",
        )
    )
    assert np.array_equal(np.flatnonzero(classes_of(both) == PageClass.DISK), pages)


def test_hints_that_do_not_fit_the_save_are_refused(sample, tmp_path):
    d, pages, sectors = sample
    bad = {
        "LI-HNT-018": write_hints(lambda w: w.free([(200 * GIB, 1)], stream_offset=0), address_map=AddressMap.QEMU_PC),
        "LI-HNT-019": write_hints(lambda w: w.free([(0, 1)], stream_offset=10**12), address_map=AddressMap.QEMU_PC),
        "LI-HNT-020": write_hints(lambda w: w.disk_runs([(0, 1, "vdz", 0)], stream_offset=0, region="pc.ram")),
        "LI-HNT-017": write_hints(lambda w: None, address_map=AddressMap.XEN),
    }
    for rule, data in bad.items():
        path = tmp_path / f"{rule}.hnt"
        path.write_bytes(data)
        out = tmp_path / f"{rule}.lean"
        proc = run("convert", d / "vm.save", "-o", out, "--disk", f"vda={d / 'disk.img'}", "--hints", path)
        assert proc.returncode == 1 and rule in proc.stderr.decode(), (rule, proc.stderr.decode())
        assert not out.exists() and not list(tmp_path.glob(f"{rule}.lean*"))
        if rule != "LI-HNT-020":  # a save names no disks: validate-hints --image checks that one
            check = run("validate-hints", path, "--save", d / "vm.save", "--json")
            assert check.returncode == 1 and rule in [f["rule"] for f in json.loads(check.stdout)["findings"]]
    broken = tmp_path / "cut.hnt"
    broken.write_bytes(bad["LI-HNT-019"][:-3])
    proc = run("convert", d / "vm.save", "-o", tmp_path / "cut.lean", "--hints", broken)
    assert proc.returncode == 1 and "LI-HNT-005" in proc.stderr.decode() and not (tmp_path / "cut.lean").exists()
    assert run("validate-hints", tmp_path / "nothing.hnt").returncode == 2


# ------------------------------------------------------------------ FREE: the stream-offset rule

N = 64


def precopy_stream(resend: tuple[int, ...] = ()) -> tuple[bytes, list[bytes], dict[int, bytes]]:
    """A QEMU stream of N random pages sent once in order, then ``resend`` pages sent again
    with new contents in a second PART section (a second precopy pass)."""
    rng = np.random.default_rng(3)
    pages = [rng.bytes(PS) for _ in range(N)]
    data = qemu_save(b"".join(pages))
    again = {p: rng.bytes(PS) for p in resend}
    if resend:
        name = b"pc.ram"
        entries = b"".join(
            struct.pack(">Q", p * PS | q.F_PAGE | (q.F_CONTINUE if i else 0))
            + (b"" if i else bytes([len(name)]) + name)
            + again[p]
            for i, p in enumerate(resend)
        )
        part = bytes([q.PART]) + struct.pack(">I", 2) + entries + struct.pack(">Q", q.F_EOS) + b"\x7e\0\0\0\x02"
        end_section = struct.pack(">Q", q.F_EOS) + b"\x7e\0\0\0\x02" + bytes([q.END]) + struct.pack(">I", 2)
        at = data.index(end_section) + len(end_section) - 5
        data = data[:at] + part + data[at:]
    return data, pages, again


def copy_end(stream: bytes, content: bytes, start: int = 0) -> int:
    """Where the copy with ``content`` ends, found by content (independent of the parser)."""
    return stream.index(content, start) + PS


def free_all(tmp_path: Path, stream_offset: int, source=FreeSource.GUEST) -> Path:
    path = tmp_path / f"free-{stream_offset}.hnt"
    path.write_bytes(
        write_hints(lambda w: w.free([(0, N)], stream_offset=stream_offset, source=source, region="pc.ram"))
    )
    return path


@pytest.mark.parametrize("spool", [False, True])
def test_free_applies_only_to_pages_whose_last_copy_ended_before_the_hint(tmp_path, spool):
    stream, pages, _ = precopy_stream()
    save = tmp_path / "vm.save"
    save.write_bytes(stream)
    p = copy_end(stream, pages[31])  # the hint came right after page 31's copy
    image = tmp_path / "vm.lean"
    report = ok(run("convert", save, "-o", image, "--hints", free_all(tmp_path, p), *(["--spool"] if spool else [])))
    assert "hints FREE: 32 applied, 32 ignored: defeated by a later copy" in report
    classes = classes_of(image)
    assert (classes[:32] == PageClass.FREE).all() and (classes[32:] == PageClass.STORED).all()
    memory = raw_memory(image)["pc.ram"]
    assert memory[32 * PS :] == b"".join(pages[32:])
    p_one_short = free_all(tmp_path, p - 1)  # page 31's copy had not quite ended
    ok(run("convert", save, "-o", image, "--hints", p_one_short, "-f"))
    assert (classes_of(image) == PageClass.FREE).sum() == 31


def test_a_page_sent_again_after_the_hint_is_not_free(tmp_path):
    """Pages 3 and 10 were sent before the hint and again after it (the guest wrote them):
    their second copy wins and the FREE hint is defeated for them alone."""
    stream, pages, again = precopy_stream(resend=(3, 10))
    save = tmp_path / "vm.save"
    save.write_bytes(stream)
    p = copy_end(stream, pages[N - 1])  # after the first pass, before the second
    image = tmp_path / "vm.lean"
    report = ok(run("convert", save, "-o", image, "--hints", free_all(tmp_path, p)))
    assert "hints FREE: 62 applied, 2 ignored: defeated by a later copy" in report
    classes = classes_of(image)
    assert np.flatnonzero(classes != PageClass.FREE).tolist() == [3, 10]
    memory = raw_memory(image)["pc.ram"]
    assert memory[3 * PS : 4 * PS] == again[3] and memory[10 * PS : 11 * PS] == again[10]
    ok(run("validate", image))
    after_all = free_all(tmp_path, len(stream))  # the end of the stream: every page qualifies
    ok(run("convert", save, "-o", image, "--hints", after_all, "-f"))
    assert (classes_of(image) == PageClass.FREE).all()


def test_free_hints_before_a_stop_and_save_apply_to_nothing(tmp_path):
    stream, pages, _ = precopy_stream()
    save = tmp_path / "vm.save"
    save.write_bytes(stream)
    report = ok(run("convert", save, "-o", tmp_path / "vm.lean", "--hints", free_all(tmp_path, 0)))
    assert "hints FREE: 0 applied, 64 ignored: defeated by a later copy" in report
    assert raw_memory(tmp_path / "vm.lean")["pc.ram"] == b"".join(pages)


def test_convert_without_hints_is_unchanged(tmp_path):
    """The same image bytes with and without an empty hint file (same UUID): hints that say
    nothing change nothing, on the single-pass and spooled paths."""
    from leanimg.converters.convert import convert_file
    from leanimg.converters.hinting import HintOptions

    stream, _, _ = precopy_stream(resend=(5,))
    save = tmp_path / "vm.save"
    save.write_bytes(stream)
    empty = write_hints(lambda w: None)
    uuid = b"\x07" * 16
    for spool in (False, True):
        convert_file(str(save), str(tmp_path / "a.lean"), spool=spool, writer_options={"image_uuid": uuid})
        convert_file(
            str(save),
            str(tmp_path / "b.lean"),
            spool=spool,
            writer_options={"image_uuid": uuid},
            hints=HintOptions(empty),
        )
        assert (tmp_path / "a.lean").read_bytes() == (tmp_path / "b.lean").read_bytes()


# ------------------------------------------------------------------ UNCHANGED against a parent (Xen)


def xen_save(path: Path, guest: xs.Guest, form: str = "libxc") -> bytes:
    """The stream as Xen's verify-stream-v2 can read it (see tests/test_xen.py: verifier_copy)."""
    data = xs.build_stream(guest, xs.StreamOptions(form=form, verifier_copy=True))
    path.write_bytes(data)
    return data


def test_unchanged_hints_against_a_parent(tmp_path):
    base = xs.make_guest(xs.HVM, 96, seed=4, holes=())
    xen_save(tmp_path / "base.save", base)
    ok(run("convert", tmp_path / "base.save", "-o", tmp_path / "base.lean"))
    with LeanImage.open(str(tmp_path / "base.lean")) as img:
        parent_uuid = img.header.image_uuid
    # the child: pfns 0-15 and 95 rewritten, the rest not sent at all (a dirty-log checkpoint)
    rng = np.random.default_rng(9)
    child = xs.Guest(base.domain_type, 96, [[[(pfn, xs.NOTAB, rng.bytes(PS)) for pfn in [*range(16), 95]]]])
    xen_save(tmp_path / "child.save", child)
    hints = tmp_path / "dirty.hnt"
    hints.write_bytes(
        write_hints(
            lambda w: (w.parent(parent_uuid), w.unchanged([(8, 87)], stream_offset=0, region="xen-pfn")),
            address_map=AddressMap.XEN,
        )
    )
    beyond = tmp_path / "beyond.hnt"  # pfn 96: outside the guest
    beyond.write_bytes(
        write_hints(
            lambda w: (w.parent(parent_uuid), w.unchanged([(90, 7)], stream_offset=0, region="xen-pfn")),
            address_map=AddressMap.XEN,
        )
    )
    proc = run("validate-hints", beyond, "--save", tmp_path / "child.save")
    assert proc.returncode == 1 and "LI-HNT-018" in proc.stdout.decode()
    ok(run("validate-hints", hints, "--save", tmp_path / "child.save"))
    out = tmp_path / "child.lean"
    proc = run("convert", tmp_path / "child.save", "-o", out, "--parent", tmp_path / "base.lean", "--hints", hints)
    assert (
        proc.returncode == 1
        and "LI-HNT-022" in proc.stderr.decode()
        and "--trust-dirty-log" in proc.stderr.decode()
        and "page 16" in proc.stderr.decode()
        and not out.exists()
    )
    proc = run("convert", tmp_path / "child.save", "-o", out, "--hints", hints)
    assert proc.returncode == 1 and "LI-HNT-021" in proc.stderr.decode()
    report = ok(
        run(
            "convert",
            tmp_path / "child.save",
            "-o",
            out,
            "--parent",
            tmp_path / "base.lean",
            "--hints",
            hints,
            "--trust-dirty-log",
        )
    )
    assert "hints UNCHANGED: 0 verified: PARENT, 8 ignored: page changed" in report  # pfns 8-15 lied
    assert "79 applied on trust" in report
    ok(run("validate", out, "--parent", tmp_path / "base.lean"))
    checked = run("validate-hints", hints, "--image", out)  # an image does not record stream offsets
    assert checked.returncode == 4 and "not checked: LI-HNT-019" in checked.stdout.decode(), checked.stdout.decode()
    memory = raw_memory(out, parents=[tmp_path / "base.lean"])["xen-pfn"]
    base_memory = base.final_memory()
    assert memory[: 16 * PS] == child.final_memory()[: 16 * PS] and memory[95 * PS :] == child.final_memory()[95 * PS :]
    assert memory[16 * PS : 95 * PS] == base_memory[16 * PS : 95 * PS]
    classes = classes_of(out, "xen-pfn", parents=[tmp_path / "base.lean"])
    assert (classes[:16] != PageClass.PARENT).all() and (classes[16:95] == PageClass.PARENT).sum() > 40


# ------------------------------------------------------------------ Xen: balloon FREE + I/O-tracking DISK


@pytest.mark.parametrize("form", ["xl", "libxc"])
def test_xen_save_with_a_toolstack_hint_file(tmp_path, form):
    """A patched toolstack's hint file: FREE for the pfns its balloon holds (snapshot taken with
    the guest paused, after the last page: P = the stream's length) and DISK for pages its disk
    backend read. convert -> validate -> restore --to xen -> verify-stream-v2, pages right."""
    guest = xs.make_guest(xs.HVM, 128, seed=11, holes=((100, 110),))
    disk = tmp_path / "disk.img"
    disk.write_bytes(guest.disk + bytes(1 << 20))
    save = tmp_path / "vm.xen"
    stream = xen_save(save, guest, form)
    memory = np.frombuffer(guest.final_memory(), np.uint8).reshape(-1, PS)
    blocks = {bytes(guest.disk[k : k + PS]): k // 512 for k in range(0, len(guest.disk), PS)}
    on_disk = [
        (p, blocks[memory[p].tobytes()])
        for p in range(guest.num_pfns)
        if memory[p].tobytes() in blocks and memory[p].any()
    ]
    balloon = [(p << 12, 1) for p in range(60, 80) if p not in dict(on_disk)]
    lying = (on_disk[0][0], on_disk[0][1] + 8)
    hints = tmp_path / "toolstack.hnt"
    hints.write_bytes(
        write_hints(
            lambda w: (
                w.free(balloon, stream_offset=len(stream), source=FreeSource.BALLOON),
                w.disk_runs(
                    [(p << 12, 1, "xvda", s) for p, s in on_disk[1:]] + [(lying[0] << 12, 1, "xvda", lying[1])],
                    stream_offset=0,
                ),
            ),
            address_map=AddressMap.XEN,
        )
    )
    ok(run("validate-hints", hints, "--save", save))
    image = tmp_path / "vm.lean"
    report = ok(run("convert", save, "-o", image, "--hints", hints, "--disk", f"xvda={disk}"))
    assert f"hints FREE: {len(balloon)} applied" in report
    assert f"hints DISK: {len(on_disk) - 1} applied, 1 ignored" in report
    classes = classes_of(image, "xen-pfn")
    assert set(np.flatnonzero(classes == PageClass.DISK).tolist()) == {p for p, _ in on_disk[1:]}
    assert {int(p) << 12 for p in np.flatnonzero(classes == PageClass.FREE)} >= {p for p, _ in balloon}
    ok(run("validate", image, "--disk", f"xvda={disk}"))
    back = tmp_path / "back.xen"
    ok(run("restore", image, "--to", "xen", "-o", back, "--disk", f"xvda={disk}"))
    restored = np.frombuffer(xs.memory_after(back.read_bytes(), form, guest.num_pfns), np.uint8).reshape(-1, PS)
    freed = np.array(sorted(p >> 12 for p, _ in balloon))
    assert not restored[freed].any()  # FREE pfns come back as zero pages
    kept = np.setdiff1d(np.arange(guest.num_pfns), freed)
    assert np.array_equal(restored[kept], memory[kept])
    assert len(back.read_bytes()) == len(stream)  # same records, same layout
    xs.verify_with_every_verifier(back, form)  # Xen 4.17's and 4.20's


@pytest.mark.parametrize("spool", [False, True])
def test_unchanged_hints_for_a_qemu_stream_that_omits_clean_pages(tmp_path, spool):
    """A dirty-log QEMU stream sends pages 0-39 only (5 of them changed); the hints say 0-63 are
    unchanged. Without --trust-dirty-log: refused; with it, 40-63 come from the parent."""
    stream, pages, _ = precopy_stream()
    (tmp_path / "base.save").write_bytes(stream)
    ok(run("convert", tmp_path / "base.save", "-o", tmp_path / "base.lean"))
    with LeanImage.open(str(tmp_path / "base.lean")) as img:
        parent_uuid = img.header.image_uuid
    changed = {p: bytes([p]) * PS for p in (1, 7, 20, 21, 39)}
    child = b"".join(changed.get(p, pages[p]) for p in range(N))
    data = qemu_save(child)
    start, stop = data.index(pages[40]) - 8, data.index(pages[N - 1]) + PS  # drop entries 40..63
    (tmp_path / "child.save").write_bytes(data[:start] + data[stop:])
    hints = tmp_path / "dirty.hnt"
    hints.write_bytes(
        write_hints(lambda w: (w.parent(parent_uuid), w.unchanged([(0, N)], stream_offset=0, region="pc.ram")))
    )
    out, spooling = tmp_path / "child.lean", ["--spool"] if spool else []
    args = ["convert", tmp_path / "child.save", "-o", out, "--parent", tmp_path / "base.lean", "--hints", hints]
    proc = run(*args, *spooling)
    assert proc.returncode == 1 and "LI-HNT-022" in proc.stderr.decode() and "page 40" in proc.stderr.decode()
    report = ok(run(*args, *spooling, "--trust-dirty-log"))
    assert "hints UNCHANGED: 35 verified: PARENT, 5 ignored: page changed" in report
    assert "24 applied on trust" in report
    classes = classes_of(out, parents=[tmp_path / "base.lean"])
    assert np.flatnonzero(classes != PageClass.PARENT).tolist() == sorted(changed)
    assert raw_memory(out, parents=[tmp_path / "base.lean"])["pc.ram"] == child


def test_hints_written_while_the_stream_flows(tmp_path):
    """What `leanimg checkpoint` does: the stream goes through a CountingReader into the
    converter; a snapshot requested when page 47's copy had been read is a FREE hint at that
    offset; the hints are complete before the stream ends and handed over lazily."""
    import threading
    from leanimg.converters.convert import convert_file
    from leanimg.converters.hinting import HintOptions
    from leanimg.hints import CountingReader

    stream, pages, again = precopy_stream(resend=(5, 50))
    hint_bytes = io.BytesIO()
    hints = HintWriter(hint_bytes)
    page_47_end = copy_end(stream, pages[47])
    done = threading.Event()

    class Feeding(io.RawIOBase):
        """The migration fd: hands out the stream in small pieces; once page 47's copy is
        through, the 'guest' is asked for its free pages (all of them, here)."""

        pos = 0

        def readable(self):
            return True

        def readinto(self, b):
            n = min(len(b), 1000, len(stream) - self.pos)
            b[:n] = stream[self.pos : self.pos + n]
            self.pos += n
            if counting.offset + n >= page_47_end and not done.is_set():
                hints.free([(0, N)], stream_offset=counting.offset + n, region="pc.ram")
                hints.close()
                done.set()
            return n

    counting = CountingReader(Feeding())
    convert_file(counting, str(tmp_path / "live.lean"), spool=True, hints=HintOptions(lambda: hint_bytes.getvalue()))
    classes = classes_of(tmp_path / "live.lean")
    sent_late = np.array([p for p in range(N) if copy_end(stream, pages[p]) > page_47_end + 999] + [5, 50])
    assert (classes[sent_late] != PageClass.FREE).all()
    early = np.array([p for p in range(N) if copy_end(stream, pages[p]) <= page_47_end and p not in (5, 50)])
    assert len(early) >= 47 and (classes[early] == PageClass.FREE).all()
    memory = raw_memory(tmp_path / "live.lean")["pc.ram"]
    assert memory[50 * PS : 51 * PS] == again[50]


def _vector_builder():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_hint_vectors", REPO / "spec" / "tools" / "make_hint_vectors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_contradictory_hints_are_refused():
    mv = _vector_builder()
    cases = {
        "two parents": (mv.hints(mv.parent(), mv.record(mv.PARENT, b"\x09" * 16 + bytes(8))), "LI-HNT-015"),
        "a disk id declared twice": (
            mv.hints(mv.name(mv.DISK_NAME, 0, b"vda"), mv.name(mv.DISK_NAME, 0, b"vdb")),
            "LI-HNT-012",
        ),
        "a disk name declared twice": (
            mv.hints(mv.name(mv.DISK_NAME, 0, b"vda"), mv.name(mv.DISK_NAME, 1, b"vda")),
            "LI-HNT-012",
        ),
        "PARENT after UNCHANGED": (mv.hints(mv.parent(), mv.ranges(mv.UNCHANGED, [(0, 1)]), mv.parent()), "LI-HNT-015"),
        "a name that is not UTF-8": (mv.hints(mv.name(mv.REGION_NAME, 0, b"\xff\xfe")), "LI-HNT-012"),
        "guest-physical without an address map": (
            mv.hints(mv.ranges(mv.FREE, [(0, 1)]), head=mv.header(address_map=0)),
            "LI-HNT-013",
        ),
        "an unaligned address": (mv.hints(mv.ranges(mv.FREE, [(100, 1)])), "LI-HNT-013"),
        "bytes after END": (mv.hints() + b"\0", "LI-HNT-011"),
    }
    for what, (data, rule) in cases.items():
        _, findings = check_hints(data)
        assert [f.rule for f in findings][:1] == [rule], what


def test_free_hints_on_a_stream_read_from_a_pipe(tmp_path):
    """The single-pass converter (no scratch copy of the stream) applies the offset rule too."""
    stream, pages, _ = precopy_stream()
    p = copy_end(stream, pages[9])
    hints = free_all(tmp_path, p)
    proc = subprocess.run(
        [*LEANIMG, "convert", "-", "-o", tmp_path / "pipe.lean", "--hints", hints],
        input=stream,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert "hints FREE: 10 applied, 54 ignored" in proc.stderr.decode()
    assert np.flatnonzero(classes_of(tmp_path / "pipe.lean") == PageClass.FREE).tolist() == list(range(10))


@pytest.mark.parametrize("spool", [False, True])
def test_free_hints_never_apply_to_a_mapped_ram_file(tmp_path, spool):
    """A mapped-ram file has no stream order for its pages: each slot holds the page as of the
    save's end, so a FREE hint, even at the file's last byte, frees nothing (hints cost size,
    never a page)."""
    stream, pages, _ = precopy_stream()
    state, ram = q.load_stream(io.BytesIO(stream))
    with ram:
        out = io.BytesIO()
        q.write_qemu_stream(out, state, None, ram.page_source, mapped=True)
    save = tmp_path / "mapped.save"
    save.write_bytes(out.getvalue())
    image = tmp_path / "vm.lean"
    ok(
        run(
            "convert",
            save,
            "-o",
            image,
            "--hints",
            free_all(tmp_path, len(out.getvalue())),
            *(["--spool"] if spool else []),
        )
    )
    assert (classes_of(image) == PageClass.STORED).all()
    assert raw_memory(image)["pc.ram"] == b"".join(pages)
