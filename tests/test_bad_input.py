"""Hostile and damaged input: truncation, bit flips, lying lengths, broken chains.

The library must answer with a LeanImageError (offset and rule where the file is
at fault), never another exception, never unbounded memory; `validate` must
report every damage; the CLI must exit 1 without a traceback.
"""

from __future__ import annotations

import struct
import tracemalloc
from pathlib import Path

import pytest

from helpers import VECTORS_DIR, disk_sources, make_vectors, restore_bytes, validate_with_disks, write_bytes
from leanimg.disks import open_disk
from leanimg.errors import ChainError, LeanImageError
from leanimg.format import (
    DIGESTS_BODY,
    FOOTER,
    PAGE_FRAME_BODY,
    RECORD,
    RecordType,
    page_digest,
)
from leanimg.reader import LeanImage
from leanimg.rules import RULES
from leanimg.validate import validate
from leanimg.writer import ParentLink

mv = make_vectors()
Lean, Rec, rewrite_body, patch = mv.Lean, mv.Rec, mv.rewrite_body, mv.patch

BASIC = (VECTORS_DIR / "valid" / "basic.lean").read_bytes()
CHILD = (VECTORS_DIR / "valid" / "child-delta.lean").read_bytes()
DISK = (VECTORS_DIR / "valid" / "disk.lean").read_bytes()
MULTI = (VECTORS_DIR / "valid" / "multi-region.lean").read_bytes()
PARENT_PATH = VECTORS_DIR / "valid" / "parent.lean"
MEMORY_LIMIT = 64 << 20


def record_boundaries(data: bytes) -> list[int]:
    """Offsets where records start, plus the footer offset and the file end."""
    header_length = struct.unpack_from("<I", data, 12)[0]
    offsets, pos = [header_length], header_length
    end = len(data) - FOOTER.size
    while pos < end:
        _, _, body_length = RECORD.struct.unpack_from(data, pos)
        pos += 16 + ((body_length + 7) & ~7) + 8
        offsets.append(pos)
    assert pos == end
    return offsets


def open_and_read_everything(path, **kw) -> bytes:
    """Open, read every page and restore: what a consumer does with an image."""
    with disk_sources(kw.get("disks")) as disks, LeanImage.open(path, **dict(kw, disks=disks)) as image:
        for region in image.regions:
            for page in range(region.num_pages):
                image.read_page(region, page)
    return restore_bytes(path, **kw)


def expect_clean_error(path, **kw) -> LeanImageError:
    with pytest.raises(LeanImageError) as info:
        open_and_read_everything(path, **kw)
    return info.value


# --- truncation -------------------------------------------------------------------------
def _cut_points(data: bytes) -> list[int]:
    points = set()
    for b in record_boundaries(data):
        points.update({b, b + 1, b + 8, b + 16, b + 20})
    points.update({0, 1, 7, 8, 50, 103, 104, len(data) - 1, len(data) - 8, len(data) - 40, len(data) - 47})
    return sorted(p for p in points if 0 <= p < len(data))


@pytest.mark.parametrize("name,data", [("basic", BASIC), ("child", CHILD), ("disk", DISK)])
def test_truncation_is_a_clean_error(tmp_path, name, data):
    path = tmp_path / f"{name}.lean"
    for cut in _cut_points(data):
        path.write_bytes(data[:cut])
        with pytest.raises(LeanImageError) as info:
            LeanImage.open(path).close()
        exc = info.value
        assert exc.offset is not None, f"cut at {cut}: {exc!r} has no offset"
        assert exc.rule in RULES, f"cut at {cut}: {exc!r} has no rule"
        report = validate(path)
        assert report.findings, f"cut at {cut}: validate found nothing"


def test_truncation_inside_records(tmp_path):
    path = tmp_path / "cut.lean"
    bounds = record_boundaries(MULTI)
    for a, b in zip(bounds, bounds[1:]):
        for cut in {a + 3, (a + b) // 2, b - 1, b - 9}:
            path.write_bytes(MULTI[:cut])
            with pytest.raises(LeanImageError) as info:
                LeanImage.open(path).close()
            assert info.value.offset is not None and info.value.rule in RULES
            assert validate(path).findings


# --- bit flips -----------------------------------------------------------------------------
def _flip(data: bytes, pos: int, bit: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 1 << bit
    return bytes(b)


def test_every_byte_flipped_is_reported(tmp_path):
    path = tmp_path / "flip.lean"
    missed = []
    for pos in range(len(BASIC)):
        bit = (pos * 3) % 8
        path.write_bytes(_flip(BASIC, pos, bit))
        if not validate(path).findings:
            missed.append((pos, bit))
    assert not missed, f"flips not reported: {missed[:20]}"


def test_flips_in_header_and_footer_every_bit(tmp_path):
    path = tmp_path / "flip.lean"
    missed = []
    for pos in list(range(104)) + list(range(len(BASIC) - FOOTER.size, len(BASIC))):
        for bit in range(8):
            path.write_bytes(_flip(BASIC, pos, bit))
            if not validate(path).findings:
                missed.append((pos, bit))
    assert not missed, f"flips not reported: {missed[:20]}"


@pytest.mark.parametrize(
    "name,data,kw",
    [
        ("child", CHILD, dict(parents=[str(PARENT_PATH)])),
        ("disk", DISK, dict(disks={"disk0": str(VECTORS_DIR / "valid" / "disk0.raw")})),
    ],
)
def test_flips_with_chain_and_disk_are_reported(tmp_path, name, data, kw):
    path = tmp_path / f"{name}.lean"
    missed = []
    for pos in range(0, len(data), 3):
        bit = (pos * 5) % 8
        path.write_bytes(_flip(data, pos, bit))
        if not validate_with_disks(path, **kw).findings:
            missed.append((pos, bit))
    assert not missed, f"flips not reported: {missed[:20]}"


def test_reader_never_returns_wrong_content(tmp_path):
    """After any single flip the reader raises a LeanImageError or restores the true content
    (flips it does not read, e.g. in the image_digest, are harmless to it)."""
    path = tmp_path / "flip.lean"
    truth = restore_bytes(VECTORS_DIR / "valid" / "basic.lean")
    for pos in range(len(BASIC)):
        path.write_bytes(_flip(BASIC, pos, (pos * 7) % 8))
        try:
            restored = open_and_read_everything(path)
        except LeanImageError:
            continue
        assert restored == truth, f"flip at {pos} restored wrong content silently"


# --- lying lengths, counts and offsets ----------------------------------------------------
def _body_length(data: bytes, record: int, value: int) -> bytes:
    """Set one record's body_length without fixing anything (the framing is the lie)."""
    offset = record_boundaries(data)[record]
    b = bytearray(data)
    struct.pack_into("<Q", b, offset + 8, value)
    return bytes(b)


def _zstd_with_content_size(size: int) -> bytes:
    """A tiny zstd frame whose header declares ``size`` bytes of content (8-byte FCS field)."""
    # magic, frame header descriptor: FCS flag 3 (8 bytes), single segment; then one empty raw block
    return b"\x28\xb5\x2f\xfd" + bytes([0b1110_0000]) + struct.pack("<Q", size) + bytes([0x01, 0x00, 0x00])


def _frame_declaring(size: int, num_pages: int | None = None) -> bytes:
    lean = Lean.parse(BASIC)
    i = lean.find(RecordType.PAGE_FRAME)
    n = lean.records[i].count if num_pages is None else num_pages
    rewrite_body(lean, i, lambda b: PAGE_FRAME_BODY.struct.pack(0, n, 0) + _zstd_with_content_size(size))
    lean.records[i].count = n
    return lean.build()


def _frame_bomb() -> bytes:
    """A frame whose header declares the right size, but whose content is 64 MiB of zeros."""
    import zstandard

    lean = Lean.parse(BASIC)
    i = lean.find(RecordType.PAGE_FRAME)
    n = lean.records[i].count
    bomb = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(64 << 20))
    declared = _zstd_with_content_size(n * 4096)[:13]
    rewrite_body(lean, i, lambda b: b[:16] + declared + bomb[6:])
    return lean.build()


def _count_field(rtype, at, fmt, value, which=0):
    def make(base=BASIC):
        lean = Lean.parse(base)
        rewrite_body(lean, lean.find(rtype, which), lambda b: patch(b, at, fmt, value))
        return lean.build()

    return make


def _index_offset_beyond_eof() -> bytes:
    return Lean.parse(BASIC).build(footer=dict(index_offset=1 << 40))


def _file_length_huge() -> bytes:
    return Lean.parse(BASIC).build(footer=dict(file_length=(1 << 64) - 1))


def _header_length_huge() -> bytes:
    return Lean.parse(BASIC).set_header("I", 12, 0xFFFF_FFF8).build()


def _region_size_huge() -> bytes:
    lean = Lean.parse(BASIC)
    i = lean.find(RecordType.REGION)
    rewrite_body(lean, i, lambda b: patch(b, 16, "Q", 1 << 47))
    lean.records[i].count = (1 << 47) // 4096
    return lean.build()


def _extent_pages_huge(which: int = -1) -> bytes:
    lean = Lean.parse(BASIC)
    i = lean.find(RecordType.PAGE_MAP)
    ext = mv.extents_of(lean.records[i].body)
    ext[which][1] = 0xFFFF_FFFF
    rewrite_body(lean, i, lambda b: mv.page_map_body(0, ext))
    lean.records[i].count = sum(e[1] for e in ext)
    return lean.build()


def _index_entries_huge() -> bytes:
    lean = Lean.parse(BASIC)
    data = lean.build()
    index_offset = struct.unpack_from("<Q", data, len(data) - 40)[0]
    body = bytearray(data[index_offset + 16 : len(data) - 48 - 8])
    struct.pack_into("<I", body, 0, 0xFFFF_FFFF)
    rec = Rec(RecordType.INDEX, bytes(body[: RECORD.struct.unpack_from(data, index_offset)[2]]))
    out = data[:index_offset] + rec.serialize()
    import xxhash
    from leanimg.format import FOOTER_MAGIC, FOOTER, checksum64

    head = FOOTER.struct.pack(FOOTER_MAGIC, index_offset, len(out) + 48, xxhash.xxh3_128_digest(out), 0)[:40]
    return out + head + struct.pack("<Q", checksum64(head))


def _digests_range_overflowing():
    """A DIGESTS record claiming 2^63 pages before the real one, so coverage ends right again."""
    lean = mv.Lean.parse(BASIC)
    at = next(i for i, r in enumerate(lean.records) if r.type == RecordType.DIGESTS)
    region_id = lean.records[at].key
    bogus = mv.Rec(RecordType.DIGESTS, DIGESTS_BODY.struct.pack(region_id, 0, 0, 1 << 63), region_id, 0, 1 << 63)
    lean.records.insert(at, bogus)
    return lean.build()


HOSTILE = {
    "digests-range-2^63-then-valid": _digests_range_overflowing,
    "body-length-2^63": lambda: _body_length(BASIC, 0, 1 << 63),
    "body-length-2^64-1": lambda: _body_length(BASIC, 1, (1 << 64) - 1),
    "body-length-255MiB": lambda: _body_length(BASIC, 1, 255 << 20),
    "index-body-length-huge": lambda: _body_length(BASIC, len(record_boundaries(BASIC)) - 2, 1 << 40),
    "num-extents-2^32-1": _count_field(RecordType.PAGE_MAP, 4, "I", 0xFFFF_FFFF),
    "extent-num-pages-2^32-1": _extent_pages_huge,
    "stored-extent-num-pages-2^32-1": lambda: _extent_pages_huge(0),
    "frame-num-pages-2^32-1": _count_field(RecordType.PAGE_FRAME, 8, "I", 0xFFFF_FFFF),
    "frame-zstd-declares-1TiB": lambda: _frame_declaring(1 << 40),
    "frame-1TiB-pages": lambda: _frame_declaring(1 << 40, num_pages=(1 << 40) // 4096),
    "frame-zstd-bomb": _frame_bomb,
    "digests-num-pages-2^64-1": _count_field(RecordType.DIGESTS, 16, "Q", (1 << 64) - 1),
    "digests-num-pages-2^24": _count_field(RecordType.DIGESTS, 16, "Q", 1 << 24),
    "index-num-entries-2^32-1": _index_entries_huge,
    "index-offset-beyond-eof": _index_offset_beyond_eof,
    "file-length-2^64-1": _file_length_huge,
    "header-length-2^32-8": _header_length_huge,
    "region-size-2^47": _region_size_huge,
    "source-state-seq-2^64-1": lambda: _count_field(RecordType.SOURCE_STATE, 8, "Q", (1 << 64) - 1)(),
    "delta-num-deltas-2^32-1": lambda: _count_field(RecordType.DELTA_FRAME, 8, "I", 0xFFFF_FFFF)(CHILD),
    "disk-refs-num-refs-2^32-1": lambda: _count_field(RecordType.DISK_REFS, 8, "I", 0xFFFF_FFFF)(DISK),
    "disk-ref-sector-2^64-1": lambda: _count_field(RecordType.DISK_REFS, 24, "Q", (1 << 64) - 1)(DISK),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_input_clean_error_bounded_memory(tmp_path, name):
    path = tmp_path / f"{name}.lean"
    path.write_bytes(HOSTILE[name]())
    kw = {}
    if name.startswith("disk-"):
        kw = dict(disks={"disk0": str(VECTORS_DIR / "valid" / "disk0.raw")})
    elif name.startswith("delta-"):
        kw = dict(parents=[str(PARENT_PATH)])
    tracemalloc.start()
    try:
        try:
            open_and_read_everything(path, **kw)
            opened = True
        except LeanImageError as exc:
            opened = False
            assert exc.rule is None or exc.rule in RULES
        report = validate_with_disks(path, **kw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_LIMIT, f"{name}: peak Python allocation {peak >> 20} MiB"
    assert report.findings, f"{name}: validate reported nothing"
    assert not opened or name in ("source-state-seq-2^64-1",), f"{name}: reader accepted it"


# --- chains ---------------------------------------------------------------------------------
def _chain_image(tmp_path, name: str, own: bytes, parent: bytes) -> Path:
    def build(w):
        r = w.add_region("ram", 4096)
        w.put_parent(r, 0, page_digest(bytes(4096)))

    path = tmp_path / f"{name}.lean"
    path.write_bytes(write_bytes(build, image_uuid=own, parent=ParentLink(parent, bytes(range(1, 17)))))
    return path


def test_cyclic_parents(tmp_path):
    ua, ub = bytes([0xA] * 16), bytes([0xB] * 16)
    a = _chain_image(tmp_path, "a", ua, ub)
    b = _chain_image(tmp_path, "b", ub, ua)
    for image, other in ((a, b), (b, a)):
        with pytest.raises(ChainError) as info:
            LeanImage.open(image, parents=[other])
        assert info.value.rule == "LI-CHN-005"
        assert "LI-CHN-005" in {f.rule for f in validate(image, parents=[other]).findings}


def test_self_parent(tmp_path):
    u = bytes([0xC] * 16)
    a = _chain_image(tmp_path, "self", u, u)
    with pytest.raises(ChainError) as info:
        LeanImage.open(a, parents=[a])
    assert info.value.rule == "LI-CHN-005"


def test_long_cycle(tmp_path):
    uuids = [bytes([k + 1] * 16) for k in range(5)]
    paths = [_chain_image(tmp_path, f"c{k}", uuids[k], uuids[(k + 1) % 5]) for k in range(5)]
    with pytest.raises(ChainError) as info:
        LeanImage.open(paths[0], parents=paths[1:])
    assert info.value.rule == "LI-CHN-005"


def test_missing_parent(tmp_path):
    child = tmp_path / "alone" / "child-delta.lean"  # no parent beside it to discover
    child.parent.mkdir()
    child.write_bytes((VECTORS_DIR / "valid" / "child-delta.lean").read_bytes())
    for parents in ([], [VECTORS_DIR / "valid" / "basic.lean"], [tmp_path / "does-not-exist.lean"]):
        with pytest.raises(ChainError) as info:
            LeanImage.open(child, parents=parents)
        assert info.value.rule == "LI-CHN-001" or parents and not Path(parents[0]).exists()
    assert "LI-CHN-001" in {f.rule for f in validate(child, parents=[VECTORS_DIR / "valid" / "basic.lean"]).findings}


def test_parent_found_beside_the_image_by_uuid():
    child = VECTORS_DIR / "valid" / "child-delta.lean"
    with LeanImage.open(child) as image:
        assert image.parent is not None
        assert Path(image.parent.path).name == "parent.lean"


def test_missing_disk_is_a_clean_error(tmp_path):
    disk = VECTORS_DIR / "valid" / "disk.lean"
    with pytest.raises(LeanImageError):
        open_and_read_everything(disk)
    with pytest.raises(LeanImageError):
        LeanImage.open(disk, disks={"disk0": open_disk(str(tmp_path / "nope.raw"), "disk0")})
    short = tmp_path / "short.raw"
    short.write_bytes((VECTORS_DIR / "valid" / "disk0.raw").read_bytes()[:8192])
    with pytest.raises(LeanImageError) as info:
        LeanImage.open(disk, disks={"disk0": open_disk(str(short), "disk0")})
    assert info.value.rule == "LI-DSK-004"


# --- the command line -------------------------------------------------------------------------
def _cli():
    cli = pytest.importorskip("leanimg.cli")
    from click.testing import CliRunner

    try:
        runner = CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2: stderr is always separate
        runner = CliRunner()
    return cli.main, runner


def _bad_inputs(tmp_path) -> dict[str, Path]:
    files = {}
    for name in (
        "body-length-2^63",
        "frame-zstd-declares-1TiB",
        "index-offset-beyond-eof",
        "num-extents-2^32-1",
        "frame-zstd-bomb",
    ):
        files[name] = tmp_path / f"{name}.lean"
        files[name].write_bytes(HOSTILE[name]())
    files["truncated"] = tmp_path / "truncated.lean"
    files["truncated"].write_bytes(BASIC[: len(BASIC) // 2])
    files["empty"] = tmp_path / "empty.lean"
    files["empty"].write_bytes(b"")
    files["flipped"] = tmp_path / "flipped.lean"
    files["flipped"].write_bytes(_flip(BASIC, 700, 3))
    files["qemu-stream"] = tmp_path / "qemu.lean"
    files["qemu-stream"].write_bytes(b"QEVM\x00\x00\x00\x03" + bytes(200))
    return files


def _no_traceback(result) -> None:
    out = result.output + (result.stderr if result.stderr_bytes is not None else "")
    assert "Traceback" not in out, out
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


# inspect reads metadata only: damage inside frames is for validate/restore to find
FRAME_DAMAGE = {"frame-zstd-declares-1TiB", "frame-zstd-bomb", "flipped"}


@pytest.mark.parametrize("command", ["validate", "inspect", "restore"])
def test_cli_bad_input_exit_1(tmp_path, command):
    main, runner = _cli()
    failures = []
    for name, path in _bad_inputs(tmp_path).items():
        if command == "inspect" and name in FRAME_DAMAGE:
            continue
        args = [command, str(path)]
        if command == "restore":
            args += ["--to", "raw", "-o", str(tmp_path / "out.raw")]
        result = runner.invoke(main, args)
        _no_traceback(result)
        if result.exit_code != 1:
            failures.append(f"{command} {name}: exit {result.exit_code}: {result.output[-300:]}")
        if command == "restore" and (tmp_path / "out.raw").exists():
            failures.append(f"{name}: partial output left behind")
    assert not failures, "\n".join(failures)


def test_cli_chain_errors(tmp_path):
    main, runner = _cli()
    ua, ub = bytes([0xA] * 16), bytes([0xB] * 16)
    a = _chain_image(tmp_path, "a", ua, ub)
    b = _chain_image(tmp_path, "b", ub, ua)
    child = tmp_path / "alone" / "child-delta.lean"  # no parent beside it to discover
    child.parent.mkdir()
    child.write_bytes((VECTORS_DIR / "valid" / "child-delta.lean").read_bytes())
    for args in (
        ["restore", str(a), "--parent", str(b), "-o", str(tmp_path / "o.raw")],
        ["inspect", str(a), "--parent", str(b)],
        ["restore", str(child), "-o", str(tmp_path / "o.raw")],
        ["validate", str(child), "--parent", str(VECTORS_DIR / "valid" / "basic.lean")],
        ["restore", str(VECTORS_DIR / "valid" / "disk.lean"), "-o", str(tmp_path / "o.raw")],
    ):
        result = runner.invoke(main, args)
        _no_traceback(result)
        assert result.exit_code == 1, f"{args}: exit {result.exit_code}: {result.output}"


def test_cli_valid_vector_ok(tmp_path):
    main, runner = _cli()
    child = VECTORS_DIR / "valid" / "child-delta.lean"
    out = tmp_path / "out.raw"
    result = runner.invoke(main, ["restore", str(child), "--parent", str(PARENT_PATH), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == restore_bytes(child, parents=[PARENT_PATH])
    result = runner.invoke(main, ["validate", str(child), "--parent", str(PARENT_PATH)])
    assert result.exit_code == 0, result.output
