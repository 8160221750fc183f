"""`leanimg convert` / `restore` / `demo` through the real command line, without QEMU.

Bad QEMU streams are made from the bundled sample (a real QEMU 7.2 save, decompressed into
a temp dir) and from small synthetic streams.  Each must make the CLI exit 1 with one line
``leanimg: error: ...`` on stderr naming the byte offset and the section, no traceback,
and leave nothing in the output directory: neither the image nor a temp file such as
``.leanimg-<name>-*.partial`` (fileutil.temporary_beside).
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest
import zstandard

from helpers import assert_clean_failure, qemu_save, with_source_state_data
from leanimg.cli import STREAM_FAILED, command_line
from leanimg.fileutil import sha256_file
from leanimg.converters import qemu as q
from leanimg.format import RecordType, checksum64
from leanimg.reader import LeanImage
from leanimg.structures import dump_structure
from leanimg.validate import validate as validate_image
from leanimg.writer import LeanImageWriter

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "lean-image" / "sample"
PS = 4096
TIMEOUT = 120


LEANIMG = command_line()


def run(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*LEANIMG, *map(str, args)], input=stdin, capture_output=True, timeout=TIMEOUT)


# ------------------------------------------------------------------ the sample stream


@pytest.fixture(scope="module")
def sample_path(module_dirs) -> Path:
    path = module_dirs("sample") / "vm.save"
    with open(SAMPLE_DIR / "vm.save.zst", "rb") as fin, open(path, "wb") as fout:
        zstandard.ZstdDecompressor().copy_stream(fin, fout)
    return path


@pytest.fixture(scope="module")
def sample(sample_path) -> bytes:
    return sample_path.read_bytes()


class Layout:
    """Offsets of the structures of a stream, found by an independent little walker."""

    def __init__(self, data: bytes):
        self.data = data
        pos = 8
        assert data[pos] == q.CONFIGURATION
        self.config = pos
        # machine type length + name; the sample has no configuration subsections
        n = struct.unpack_from(">I", data, pos + 1)[0]
        pos += 5 + n
        self.sections = []  # (kind, offset, section id, first entry offset)
        self.entries = []  # (offset, flags, block name or None, address)
        self.mem_size = None
        while data[pos] in (q.START, q.PART, q.END):
            kind, sid = data[pos], struct.unpack_from(">I", data, pos + 1)[0]
            start = pos
            pos += 5
            if kind == q.START:
                n = data[pos]
                pos += 1 + n + 8
            self.sections.append((kind, start, sid, pos))
            while True:
                word = struct.unpack_from(">Q", data, pos)[0]
                flags, addr = word & (PS - 1), word & ~(PS - 1)
                at, pos = pos, pos + 8
                if flags == q.F_EOS:
                    break
                if flags == q.F_MEM_SIZE:
                    self.mem_size = at
                    total = 0
                    self.blocks = {}
                    while total < addr:
                        n = data[pos]
                        name = data[pos + 1 : pos + 1 + n].decode()
                        length = struct.unpack_from(">Q", data, pos + 1 + n)[0]
                        self.blocks[name] = (pos, length)
                        pos += 1 + n + 8
                        total += length
                    continue
                name = None
                if not flags & q.F_CONTINUE:
                    n = data[pos]
                    name = data[pos + 1 : pos + 1 + n].decode()
                    pos += 1 + n
                pos += PS if flags & q.F_PAGE else 1
                self.entries.append((at, flags, name, addr))
            assert data[pos] == q.FOOTER
            pos += 5
        self.tail = pos  # first device section
        assert data[pos] == q.FULL
        self.eof = data.rindex(bytes([q.EOF, q.VMDESCRIPTION]))
        self.vmdesc = self.eof + 1

    def first_entry(self, flags_bit: int, named: bool) -> tuple[int, int, str | None, int]:
        return next(e for e in self.entries if e[1] & flags_bit and (e[2] is not None) == named)


@pytest.fixture(scope="module")
def layout(sample) -> Layout:
    return Layout(sample)


def section_label(layout: Layout, index: int) -> str:
    kind, _, sid, _ = layout.sections[index]
    return f"section[{index}] {q.SECTION_NAMES[kind]} 'ram' id={sid}"


def test_layout_walker_sees_the_sample(layout):
    kinds = [s[0] for s in layout.sections]
    assert kinds[0] == q.START and kinds[-1] == q.END and q.PART in kinds
    assert "pc.ram" in layout.blocks and len(layout.entries) > 1000


# ------------------------------------------------------------------ bad streams → convert


def _put(data: bytes, at: int, blob: bytes) -> bytes:
    return data[:at] + blob + data[at + len(blob) :]


def bad_streams(data: bytes, L: Layout) -> dict[str, tuple[bytes, dict]]:
    """name → (stream, expectations for assert_clean_failure)."""
    out = {}
    # --- truncated at several points
    # (detection sees 3 bytes that are not the whole magic)
    out["truncated-in-magic"] = data[:3], dict(match="got 51 45 56", offset=0, structure="magic")
    out["truncated-in-configuration"] = (
        data[: L.config + 7],
        dict(match="truncated", offset=L.config + 5, structure="configuration"),
    )
    mem_pos, _ = L.blocks["pc.ram"]
    out["truncated-in-mem-size"] = (
        data[: mem_pos + 4],
        dict(match="truncated", offset=mem_pos + 1, structure=section_label(L, 0)),
    )
    page = L.first_entry(q.F_PAGE, named=False)
    sec = max(i for i, s in enumerate(L.sections) if s[1] < page[0])
    out["truncated-mid-page"] = (
        data[: page[0] + 8 + 100],
        dict(match="expected 4096 bytes of page data", offset=page[0] + 8, structure=section_label(L, sec)),
    )
    nxt = L.sections[2][1]
    out["truncated-at-section-boundary"] = data[:nxt], dict(match="truncated", offset=nxt, structure="section[2]")
    out["truncated-in-device-sections"] = data[: L.tail + 3000], dict(match="truncated", structure="FULL")
    out["truncated-in-vmdescription"] = (
        data[: len(data) - 10],
        dict(match="VMDESCRIPTION JSON", structure="vmdescription"),
    )
    out["truncated-before-eof"] = data[: L.eof], dict(match="truncated", structure="section[")
    # --- corrupt section id (of a PART) and section type
    part = L.sections[1][1]
    sid = L.sections[1][2]
    out["corrupt-section-id"] = (
        _put(data, part + 1, struct.pack(">I", sid + 40)),
        dict(match=f"expected section id of 'ram' ({sid}), got {sid + 40}", offset=part + 1, structure="section[1]"),
    )
    out["corrupt-section-type"] = _put(data, part, b"\x42"), dict(match="got 0x42", offset=part, structure="section[1]")
    # --- unknown page flag
    at = page[0]
    word = struct.unpack_from(">Q", data, at)[0]
    out["unknown-page-flag"] = (
        _put(data, at, struct.pack(">Q", word | 0x400)),
        dict(match="RAM flags", offset=at, structure=section_label(L, sec)),
    )
    # --- lying lengths
    out["lying-block-length"] = (
        _put(data, mem_pos + 7, struct.pack(">Q", L.blocks["pc.ram"][1] + (1 << 20))),
        dict(match="add up to MEM_SIZE", structure=section_label(L, 0)),
    )
    out["lying-machine-type-length"] = (
        _put(data, L.config + 1, struct.pack(">I", 1 << 30)),
        dict(match="truncated", offset=L.config + 5, structure="configuration"),
    )
    n = struct.unpack_from(">I", data, L.vmdesc + 1)[0]
    out["lying-vmdescription-length-long"] = (
        _put(data, L.vmdesc + 1, struct.pack(">I", n + 100)),
        dict(match="truncated", structure="vmdescription"),
    )
    out["lying-vmdescription-length-short"] = (
        _put(data, L.vmdesc + 1, struct.pack(">I", n - 100)),
        dict(match="end of stream after VMDESCRIPTION", offset=L.vmdesc + 5 + n - 100, structure="after vmdescription"),
    )
    named = L.first_entry(q.F_PAGE, named=True)
    out["lying-block-name-length"] = (
        _put(data, named[0] + 8, bytes([data[named[0] + 8] - 1])),
        dict(match="missing from MEM_SIZE"),
    )
    # --- a RAM block missing from MEM_SIZE
    name = named[2].encode()
    other = name[:-1] + bytes([name[-1] ^ 0x20])
    out["ram-block-missing-from-mem-size"] = (
        _put(data, named[0] + 9, other),
        dict(match=f"got {other.decode()!r} (missing from MEM_SIZE)", offset=named[0] + 8),
    )
    # --- garbage after EOF / after the trailer
    out["garbage-after-vmdescription"] = (
        data + b"garbage",
        dict(match="end of stream after VMDESCRIPTION", offset=len(data), structure="after vmdescription"),
    )
    out["garbage-instead-of-vmdescription"] = (
        data[: L.eof + 1] + b"\x99garbage",
        dict(match="after QEMU_VM_EOF", offset=L.eof + 1, structure="after EOF"),
    )
    return out


BAD_NAMES = [
    "truncated-in-magic",
    "truncated-in-configuration",
    "truncated-in-mem-size",
    "truncated-mid-page",
    "truncated-at-section-boundary",
    "truncated-in-device-sections",
    "truncated-in-vmdescription",
    "truncated-before-eof",
    "corrupt-section-id",
    "corrupt-section-type",
    "unknown-page-flag",
    "lying-block-length",
    "lying-machine-type-length",
    "lying-vmdescription-length-long",
    "lying-vmdescription-length-short",
    "lying-block-name-length",
    "ram-block-missing-from-mem-size",
    "garbage-after-vmdescription",
    "garbage-instead-of-vmdescription",
]


@pytest.fixture(scope="module")
def bad(sample, layout):
    cases = bad_streams(sample, layout)
    assert sorted(cases) == sorted(BAD_NAMES)
    return cases


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_stream_from_file(name, bad, tmp_path):
    data, expect = bad[name]
    src = tmp_path / "in.save"
    src.write_bytes(data)
    outdir = tmp_path / "out"
    outdir.mkdir()
    proc = run("convert", src, "-o", outdir / "vm.lean")
    assert_clean_failure(proc, outdir, **expect)


@pytest.mark.parametrize(
    "name",
    [
        "truncated-mid-page",
        "corrupt-section-id",
        "unknown-page-flag",
        "ram-block-missing-from-mem-size",
        "garbage-after-vmdescription",
        "truncated-in-vmdescription",
    ],
)
def test_bad_stream_from_pipe(name, bad, tmp_path):
    data, expect = bad[name]
    outdir = tmp_path / "out"
    outdir.mkdir()
    proc = run("convert", "-", "-o", outdir / "vm.lean", stdin=data)
    assert_clean_failure(proc, outdir, **expect)


def test_not_a_stream(tmp_path):
    src = tmp_path / "in.save"
    src.write_bytes(b"not a save file at all" * 10)
    outdir = tmp_path / "out"
    outdir.mkdir()
    assert_clean_failure(
        run("convert", src, "-o", outdir / "vm.lean"),
        outdir,
        match="QEMU migration stream",
        offset=0,
        structure="magic",
    )


def test_empty_input_from_pipe(tmp_path):
    outdir = tmp_path / "out"
    outdir.mkdir()
    assert_clean_failure(run("convert", "-", "-o", outdir / "vm.lean", stdin=b""), outdir, offset=0, structure="magic")


# ------------------------------------------------------------------ synthetic streams


def synthetic(vmdesc: bool) -> bytes:
    return qemu_save(bytes(PS) + b"\xab" * PS + bytes(PS) + os.urandom(PS), vmdesc=vmdesc)


def test_synthetic_stream_converts(tmp_path):
    src = tmp_path / "ok.save"
    src.write_bytes(synthetic(vmdesc=False))
    proc = run("convert", src, "-o", tmp_path / "ok.lean")
    assert proc.returncode == 0, proc.stderr
    proc = run("restore", tmp_path / "ok.lean", "--to", "qemu", "-o", "-")
    assert proc.returncode == 0 and proc.stdout == src.read_bytes()


@pytest.mark.parametrize("vmdesc", [False, True])
def test_synthetic_garbage_after_eof(vmdesc, tmp_path):
    data = synthetic(vmdesc)
    src = tmp_path / "in.save"
    src.write_bytes(data + b"\x07junk")
    outdir = tmp_path / "out"
    outdir.mkdir()
    match = "end of stream after VMDESCRIPTION" if vmdesc else "after QEMU_VM_EOF"
    assert_clean_failure(run("convert", src, "-o", outdir / "vm.lean"), outdir, match=match, offset=len(data))


def test_synthetic_truncated_everywhere(tmp_path):
    """Every cut of a small stream: exit 1, one line, nothing left (a few subprocesses)."""
    data = synthetic(vmdesc=True)
    outdir = tmp_path / "out"
    outdir.mkdir()
    for cut in (0, 5, 12, 30, 60, 100, 2000, len(data) - 40, len(data) - 1):
        proc = run("convert", "-", "-o", outdir / "vm.lean", stdin=data[:cut])
        line = assert_clean_failure(proc, outdir, structure=None)
        offset = int(re.search(r"offset (0x[0-9a-f]+)", line).group(1), 16)
        assert offset <= cut, line


# ------------------------------------------------------------------ restore


@pytest.fixture(scope="module")
def sample_image(sample_path, module_dirs) -> Path:
    img = module_dirs("img") / "vm.lean"
    proc = run("convert", sample_path, "-o", img)
    assert proc.returncode == 0, proc.stderr
    return img


def test_restore_to_qemu_without_qemu_state(tmp_path):
    img = tmp_path / "plain.lean"
    with LeanImageWriter(str(img)) as w:
        region = w.add_region("ram", 16 * PS)
        w.put_pages(region, 0, os.urandom(8 * PS))
        w.put_zero(region, 8, 8)
    assert run("validate", img).returncode == 0
    outdir = tmp_path / "out"
    outdir.mkdir()
    proc = run("restore", img, "--to", "qemu", "-o", outdir / "vm.save")
    err = proc.stderr.decode()
    assert proc.returncode == 1 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leanimg: error: "), err
    assert "no QEMU stream state" in lines[0] and "--to raw" in lines[0]
    assert os.listdir(outdir) == []
    proc = run("restore", img, "--to", "qemu", "-o", "-")
    assert proc.returncode == 1 and proc.stdout == STREAM_FAILED, "no stream: the line a waiting QEMU refuses"
    # --to raw of the same image is fine
    assert run("restore", img, "--to", "raw", "-o", outdir / "mem.raw").returncode == 0


def _damage_that_decompresses(data: bytearray, frame_at: int, frame_length: int, start: int) -> int:
    """The first offset from ``start`` on where flipping two bytes (^0x5A, ^0xA5) leaves a zstd
    frame that decompresses to as many bytes, other ones (a literal, say): which offsets do
    depends on the compressor's output, not on the format."""
    frame = bytes(data[frame_at : frame_at + frame_length])
    content = zstandard.ZstdDecompressor().decompress(frame)
    for at in range(start - frame_at, frame_length - 1):
        damaged = bytearray(frame)
        damaged[at] ^= 0x5A
        damaged[at + 1] ^= 0xA5
        try:
            other = zstandard.ZstdDecompressor().decompress(bytes(damaged), max_output_size=len(content))
        except zstandard.ZstdError:
            continue
        if len(other) == len(content) and other != content:
            return frame_at + at
    raise AssertionError("no two bytes of the frame decompress to other content when flipped")


def _page_frame_in_the_middle(img: Path) -> dict:
    frames = [r for r in dump_structure(img)["records"] if r["record_type"] == RecordType.PAGE_FRAME]
    assert len(frames) > 10
    return frames[len(frames) // 2]


@pytest.mark.parametrize("target", ["qemu", "raw"])
@pytest.mark.parametrize("fix_checksum", [False, True])
def test_restore_corrupt_midway_leaves_nothing(target, fix_checksum, sample_image, tmp_path):
    """A page frame in the middle is damaged: restore fails part-way, no output is left.

    With ``fix_checksum`` the record checksum is recomputed and the damage is two bytes of
    the zstd frame that still decompress (to other bytes), so only the page digests can
    catch it; without, two bytes in the middle of the frame."""
    data = bytearray(sample_image.read_bytes())
    rec = _page_frame_in_the_middle(sample_image)
    body_at = rec["offset"] + 16
    at = body_at + rec["body_length"] // 2
    if fix_checksum:
        at = _damage_that_decompresses(data, body_at + 16, rec["body_length"] - 16, at)
    data[at] ^= 0x5A
    data[at + 1] ^= 0xA5
    if fix_checksum:
        end = body_at + (rec["body_length"] + 7) // 8 * 8
        data[end : end + 8] = struct.pack("<Q", checksum64(bytes(data[rec["offset"] : end])))
    img = tmp_path / "bad.lean"
    img.write_bytes(bytes(data))
    outdir = tmp_path / "out"
    outdir.mkdir()
    proc = run("restore", img, "--to", target, "-o", outdir / "restored")
    line = assert_clean_failure(proc, outdir, offset=-1, structure=None)
    if fix_checksum:  # caught by the page digest: names the page, not a file offset
        assert re.search(r"region\[0\]\.page\[\d+\]: \[LI-DIG-002\]", line), line
    else:  # caught by the record checksum: names the record and its offset
        assert re.search(r"offset 0x[0-9a-f]+", line) and "record" in line, line


def test_restore_sample_image_is_the_sample(sample_image, sample_path, tmp_path):
    out = tmp_path / "vm.save"
    proc = run("restore", sample_image, "--to", "qemu", "-o", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["vm.save"]
    assert sha256_file(out) == sha256_file(sample_path)


# ------------------------------------------------------------------ demo


def test_demo_workdir(tmp_path, sample_path):
    """The demo shows each lean feature on the real sample, with sizes measured in the run,
    and restores both images bit-exact."""
    from leanimg.demo import zstd_size
    from leanimg.format import PageClass
    from leanimg.inspect import class_counts
    import numpy as np

    workdir = tmp_path / "demo"
    proc = run("demo", "--workdir", workdir)
    out = proc.stdout.decode()
    assert proc.returncode == 0, out + proc.stderr.decode()
    assert b"Traceback" not in proc.stderr
    assert out.count("IDENTICAL") == 2 and "OK: both images valid, both restored bit-exact" in out
    rebuilt = workdir / "rebuilt.save"
    assert sha256_file(rebuilt) == sha256_file(sample_path)
    info = json.loads((SAMPLE_DIR / "sample.json").read_text())
    assert sha256_file(rebuilt) == info["files"]["vm.save"]["sha256"]
    assert sha256_file(workdir / "rebuilt2.save") == sha256_file(workdir / "vm2.save")
    # the second save is the first with page contents changed, nothing else
    first, second = (np.fromfile(workdir / name, np.uint8) for name in ("vm.save", "vm2.save"))
    assert len(first) == len(second)
    assert 0 < np.count_nonzero(first != second) <= 240 * PS
    assert (workdir / "vm2.save").read_bytes()[:4] == b"QEVM"
    with LeanImage.open(workdir / "plain.lean") as plain, LeanImage.open(workdir / "vm.lean") as lean:
        counts = class_counts(lean)
        assert all(counts[cls] for cls in (PageClass.STORED, PageClass.ZERO, PageClass.FREE, PageClass.DISK))
        ram, plain_ram = lean.region("pc.ram"), plain.region("pc.ram")
        free = lean.classes(ram) == PageClass.FREE
        assert (plain.classes(plain_ram)[free] == PageClass.ZERO).all(), "FREE hints name zero pages only"
    with LeanImage.open(workdir / "vm2.lean", parents=[workdir / "vm.lean"]) as child:
        counts = class_counts(child)
        assert counts[PageClass.PARENT] > 10000 and counts[PageClass.DELTA] >= 200
    disk = f"vda={workdir / 'disk.img'}"
    assert run("validate", workdir / "vm.lean", "--disk", disk).returncode == 0
    assert run("validate", workdir / "vm2.lean", "--disk", disk).returncode == 0
    # the sizes printed are this run's: each file's bytes, and zstd -3 of each save
    for name in ("vm.save", "vm2.save"):
        assert f"{zstd_size(str(workdir / name)):,}" in out
    for name in ("plain.lean", "vm.lean", "vm2.lean"):
        assert f"{(workdir / name).stat().st_size:,}" in out
    assert "inspect vm.lean --files" in out and "/text/doc000.txt" in out
    assert (workdir / "memory.png").exists() or (workdir / "memory.svg").exists()


# ------------------------------------------------------------------ interrupted runs


def _partials(directory: Path) -> list[str]:
    return [n for n in os.listdir(directory) if "partial" in n]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_convert_interrupted_leaves_nothing(sig, sample, tmp_path):
    """convert from a pipe, signalled half-way (Ctrl-C, or `timeout`/QEMU/systemd
    sending SIGTERM): no image and no `.leanimg-*.partial` temp file stays behind."""
    outdir = tmp_path / "out"
    outdir.mkdir()
    proc = subprocess.Popen(
        [*LEANIMG, "convert", "-", "-o", str(outdir / "vm.lean")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        proc.stdin.write(sample[: len(sample) // 2])
        proc.stdin.flush()
        deadline = time.monotonic() + 30
        while not _partials(outdir):  # the writer has started its temp file
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.01)
        time.sleep(0.3)
        proc.send_signal(sig)
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read().decode(errors="replace")
    assert proc.returncode != 0, err
    assert "Traceback" not in err, err
    assert os.listdir(outdir) == [], f"left behind after {sig.name}: {os.listdir(outdir)}"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_restore_interrupted_leaves_nothing(sig, sample_image, tmp_path):
    outdir = tmp_path / "out"
    outdir.mkdir()
    for attempt in range(5):
        proc = subprocess.Popen(
            [*LEANIMG, "restore", str(sample_image), "--to", "qemu", "-o", str(outdir / "vm.save")],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        while proc.poll() is None and not _partials(outdir):
            time.sleep(0.001)
        if proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(timeout=30)
            break
        proc.wait()  # finished before we caught it: try again
        for name in os.listdir(outdir):
            os.unlink(outdir / name)
    else:
        pytest.skip("restore always finished before the signal could be sent")
    err = proc.stderr.read().decode(errors="replace")
    assert "Traceback" not in err, err
    # what stands under the output name is nothing or the whole, right stream: the signal may
    # also land after the rename, before the process exits (then it exits non-zero all the same)
    left = os.listdir(outdir)
    if proc.returncode == 0 or left == ["vm.save"]:
        info = json.loads((SAMPLE_DIR / "sample.json").read_text())
        assert left == ["vm.save"], f"left behind after {sig.name}: {left}"
        assert sha256_file(outdir / "vm.save") == info["files"]["vm.save"]["sha256"]
    else:
        assert left == [], f"left behind after {sig.name}: {left}"


# ------------------------------------------------------------------ a damaged QEMU state blob


def _state_cases(blob: bytes) -> dict[str, bytes]:
    raw = zstandard.ZstdDecompressor().decompress(blob)
    flipped = bytearray(blob)
    flipped[len(flipped) // 2] ^= 0x04
    return {
        "truncated": blob[: len(blob) // 2],
        "wrong-magic": b"\x00" * 4 + blob[4:],
        "bit-flip": bytes(flipped),
        # a frame header: magic, single-segment with an 8-byte content size of 1 TiB, then garbage
        "declares-1TiB": b"\x28\xb5\x2f\xfd\xe0" + (1 << 40).to_bytes(8, "little") + b"\x01" * 16,
        "state-truncated-inside": zstandard.ZstdCompressor(write_content_size=True).compress(raw[: len(raw) // 3]),
        "state-wrong-magic": zstandard.ZstdCompressor(write_content_size=True).compress(b"XXXX" + raw[4:]),
    }


STATE_CASES = ["truncated", "wrong-magic", "bit-flip", "declares-1TiB", "state-truncated-inside", "state-wrong-magic"]


@pytest.mark.parametrize("case", STATE_CASES)
def test_restore_qemu_with_a_damaged_state_blob(case, sample_image, tmp_path):
    with LeanImage.open(sample_image) as image:
        blob = image.source_states[0].data
    damaged = tmp_path / "damaged.lean"
    with_source_state_data(sample_image, damaged, _state_cases(blob)[case])
    assert validate_image(damaged).valid, "only the blob's meaning is wrong, the image itself is valid"
    outdir = tmp_path / "out"
    outdir.mkdir()
    proc = run("restore", damaged, "--to", "qemu", "-o", outdir / "vm.save")
    assert_clean_failure(proc, outdir, match="QEMU stream state", structure="source_state[QEMU tag 1]")
