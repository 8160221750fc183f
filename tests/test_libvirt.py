"""libvirt's save images (converters/libvirt.py, restore/libvirt.py) without libvirt: crafted
headers around QEMU streams (a small one of our own writer, and the bundled real QEMU 7.2 save).

Convert, inspect and restore --to libvirt through the CLI: a raw payload comes back byte for
byte, a compressed one (gzip, bzip2, xz, zstd; lzop when the program is there) decompresses to
the same stream; every bad header of issue 32 §3 is a one-line error naming offset and
structure, with no output left behind. The real libvirtd test is test_libvirt_e2e.py.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import zstandard

from helpers import assert_clean_failure, qemu_save
from leanimg.cli import command_line
from leanimg.converters import libvirt
from leanimg.errors import LimitError, SourceFormatError, UnsupportedError

SAMPLE = Path(__file__).resolve().parents[1] / "lean-image" / "sample" / "vm.save.zst"
LEANIMG = command_line()
XML = b"""<domain type='qemu'>
  <name>web1</name>
  <uuid>4dea22b3-1d52-d8f3-2516-782e98ab3fa0</uuid>
  <memory unit='KiB'>1024</memory>
  <os><type arch='x86_64' machine='pc-i440fx-7.2'>hvm</type></os>
  <devices><emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'><source file='/var/lib/libvirt/images/web1.img'/><target dev='vda'/></disk>
  </devices>
</domain>
"""
COOKIE = b"<qemu-save-cookie>\n</qemu-save-cookie>\n"
COMPRESS = {1: ["gzip", "-c"], 2: ["bzip2", "-c"], 3: ["xz", "-c", "-3"], 4: ["lzop", "-c"], 5: ["zstd", "-c"]}


def libvirt_save(
    payload: bytes,
    *,
    fmt: int = 0,
    magic: bytes = b"LibvirtQemudSave",
    version: int = 2,
    was_running: int = 1,
    xml: bytes = XML + b"\0",
    cookie: bytes | None = COOKIE + b"\0",
    padding: int = 4096,
    data_len: int | None = None,
    cookie_offset: int | None = None,
    endian: str = "<",
) -> bytes:
    """A save image as libvirt's virQEMUSaveDataWrite lays it out, ``payload`` after it."""
    data = xml + (cookie or b"") + bytes(padding)
    if cookie_offset is None:
        cookie_offset = len(xml) if cookie else 0
    header = struct.pack(
        f"{endian}16s5I56s",
        magic,
        version,
        len(data) if data_len is None else data_len,
        was_running,
        fmt,
        cookie_offset,
        bytes(56),
    )
    return header + data + payload


def run(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*LEANIMG, *map(str, args)], input=stdin, capture_output=True, timeout=300)


def ok(*args) -> subprocess.CompletedProcess:
    proc = run(*args)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc


@pytest.fixture(scope="module")
def stream() -> bytes:
    ram = bytearray(64 * 4096)
    for k in range(0, 64, 3):
        ram[k * 4096 : (k + 1) * 4096] = bytes([k + 1]) * 4096
    return qemu_save(bytes(ram))


@pytest.fixture(scope="module")
def sample() -> bytes:
    return zstandard.ZstdDecompressor().decompressobj().decompress(SAMPLE.read_bytes())


def test_header_layout():
    assert libvirt.HEADER.size == libvirt.HEADER_SIZE == 92
    header = libvirt.read_save_header(_reader(libvirt_save(b"QEVM")), None)
    assert header.xml == XML and header.cookie == COOKIE and header.was_running
    assert header.payload_offset == 92 + len(XML) + 1 + len(COOKIE) + 1 + 4096
    domain = libvirt.domain_of(header.xml)
    assert (domain.name, domain.uuid, domain.memory_bytes, domain.machine) == (
        "web1",
        "4dea22b3-1d52-d8f3-2516-782e98ab3fa0",
        1 << 20,
        "pc-i440fx-7.2",
    )
    assert domain.disks == (("vda", "/var/lib/libvirt/images/web1.img"),)


def _reader(data: bytes):
    import io

    return io.BytesIO(data)


def test_raw_round_trip_is_byte_identical(stream, tmp_path):
    save = tmp_path / "web1.save"
    save.write_bytes(libvirt_save(stream))
    ok("convert", save, "-o", tmp_path / "web1.lean")
    ok("validate", tmp_path / "web1.lean")
    ok("restore", tmp_path / "web1.lean", "--to", "libvirt", "-o", tmp_path / "back.save")
    assert (tmp_path / "back.save").read_bytes() == save.read_bytes()
    piped = run("restore", tmp_path / "web1.lean", "--to", "libvirt", "-o", "-")
    assert piped.returncode == 0 and piped.stdout == save.read_bytes()
    # the QEMU stream alone, as before
    ok("restore", tmp_path / "web1.lean", "--to", "qemu", "-o", tmp_path / "stream")
    assert (tmp_path / "stream").read_bytes() == stream


def test_from_a_pipe(stream, tmp_path):
    data = libvirt_save(stream)
    proc = run("convert", "-", "-o", tmp_path / "p.lean", stdin=data)
    assert proc.returncode == 0, proc.stderr
    ok("restore", tmp_path / "p.lean", "--to", "libvirt", "-o", tmp_path / "back.save")
    assert (tmp_path / "back.save").read_bytes() == data


def test_inspect_shows_the_domain(stream, tmp_path):
    save = tmp_path / "web1.save"
    save.write_bytes(libvirt_save(stream, was_running=0))
    ok("convert", save, "-o", tmp_path / "web1.lean")
    text = ok("inspect", tmp_path / "web1.lean").stdout.decode()
    assert "domain  web1  uuid 4dea22b3-1d52-d8f3-2516-782e98ab3fa0" in text
    assert "memory 1 MiB, machine pc-i440fx-7.2, was_running no, payload raw" in text
    details = json.loads(ok("inspect", tmp_path / "web1.lean", "--json").stdout)["source_details"]
    assert details["domain_name"] == "web1" and details["was_running"] is False
    assert details["memory_bytes"] == 1 << 20 and details["machine"] == "pc-i440fx-7.2"
    assert details["disks"] == [{"target": "vda", "file": "/var/lib/libvirt/images/web1.img"}]
    import jsonschema
    from leanimg.output import schema

    jsonschema.validate(json.loads(ok("inspect", tmp_path / "web1.lean", "--json").stdout), schema("inspect"))


@pytest.mark.parametrize("fmt", sorted(COMPRESS))
def test_compressed_payloads(fmt, stream, tmp_path):
    argv = COMPRESS[fmt]
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} is not installed")
    payload = subprocess.run(argv, input=stream, capture_output=True, check=True).stdout
    save = tmp_path / "c.save"
    save.write_bytes(libvirt_save(payload, fmt=fmt))
    ok("convert", save, "-o", tmp_path / "c.lean")
    ok("restore", tmp_path / "c.lean", "--to", "libvirt", "-o", tmp_path / "back.save")
    back = (tmp_path / "back.save").read_bytes()
    header = libvirt.read_save_header(_reader(back), len(back))
    assert back[: header.payload_offset] == save.read_bytes()[: header.payload_offset]
    decompress = [argv[0], "-dc"]
    assert (
        subprocess.run(decompress, input=back[header.payload_offset :], capture_output=True, check=True).stdout
        == stream
    )


def test_sample_xz_with_disk(sample, tmp_path):
    """The real QEMU 7.2 save, xz-compressed as libvirt does it, with --disk: same file back."""
    payload = subprocess.run(COMPRESS[3], input=sample, capture_output=True, check=True).stdout
    save = tmp_path / "vm.save"
    save.write_bytes(libvirt_save(payload, fmt=3))
    disk = tmp_path / "disk.img"
    disk.write_bytes(
        zstandard.ZstdDecompressor().decompressobj().decompress((SAMPLE.parent / "disk.img.zst").read_bytes())
    )
    ok("convert", save, "-o", tmp_path / "vm.lean", "--disk", f"vda={disk}")
    ok("restore", tmp_path / "vm.lean", "--to", "libvirt", "--disk", f"vda={disk}", "-o", tmp_path / "back.save")
    assert (tmp_path / "back.save").read_bytes() == save.read_bytes()  # xz -3 of one version is deterministic


def test_restore_to_libvirt_needs_the_header(stream, tmp_path):
    (tmp_path / "s").write_bytes(stream)
    ok("convert", tmp_path / "s", "-o", tmp_path / "q.lean")
    out = tmp_path / "out"
    out.mkdir()
    proc = run("restore", tmp_path / "q.lean", "--to", "libvirt", "-o", out / "x.save")
    assert_clean_failure(
        proc, out, match="no libvirt save header", offset=None if False else -1, structure="source_state"
    )
    assert "--to qemu" in proc.stderr.decode()


def _bad_inputs(stream: bytes) -> dict:
    """name -> (file, expectations for assert_clean_failure)."""
    good = libvirt_save(stream)
    xml_at = 92
    return {
        "partial": (
            libvirt_save(stream, magic=b"LibvirtQemudPart"),
            dict(match="incomplete save", offset=0, structure="libvirt header.magic"),
        ),
        "version-3": (
            libvirt_save(stream, version=3),
            dict(match="expected save image version 2, got 3", offset=16, structure="libvirt header.version"),
        ),
        "big-endian": (
            libvirt_save(stream, endian=">"),
            dict(match="big-endian host", offset=16, structure="libvirt header.version"),
        ),
        "data-len-beyond-file": (
            libvirt_save(stream, data_len=len(good)),
            dict(match="goes beyond the file", offset=20, structure="libvirt header.data_len"),
        ),
        "data-len-zero": (
            libvirt_save(stream, data_len=0),
            dict(match="data_len 0", offset=20, structure="libvirt header.data_len"),
        ),
        "xml-without-nul": (
            libvirt_save(stream, xml=XML, cookie=None, padding=0, data_len=len(XML)),
            dict(match="no terminating NUL", offset=xml_at, structure="libvirt header data.xml"),
        ),
        "cookie-offset-beyond": (
            libvirt_save(stream, cookie_offset=1 << 20),
            dict(match="lies beyond data_len", offset=32, structure="libvirt header.cookie_offset"),
        ),
        "unknown-compression": (
            libvirt_save(stream, fmt=9),
            dict(match="unknown payload compression code 9", offset=28, structure="libvirt header.format"),
        ),
        "sparse": (libvirt_save(stream, fmt=6), dict(match="mapped-ram", offset=28, structure="libvirt header.format")),
        "not-a-qemu-stream": (
            libvirt_save(b"\x7fELF" + bytes(100)),
            dict(match="", offset=len(libvirt_save(b"")), structure="libvirt payload"),
        ),
        "truncated-payload": (
            good[: len(good) - 2000],
            dict(match="truncated", offset=-1, structure="libvirt payload"),
        ),
        "xz-not-xz": (libvirt_save(stream, fmt=3), dict(match="cannot decompress", offset=-1, structure="xz stream")),
        "truncated-header": (good[:50], dict(match="truncated", offset=-1, structure="libvirt header")),
    }


@pytest.mark.parametrize("name", list(_bad_inputs(b"").keys()))
def test_bad_headers_fail_cleanly(name, stream, tmp_path):
    data, expect = _bad_inputs(stream)[name]
    save = tmp_path / "bad.save"
    save.write_bytes(data)
    out = tmp_path / "out"
    out.mkdir()
    assert_clean_failure(run("convert", save, "-o", out / "x.lean"), out, **expect)
    if name not in ("data-len-beyond-file",):  # a pipe has no length to check data_len against
        assert_clean_failure(run("convert", "-", "-o", out / "x.lean", stdin=data), out, **dict(expect, offset=-1))


def test_library_errors(stream):
    with pytest.raises(SourceFormatError, match="incomplete"):
        libvirt.parse_header(libvirt_save(stream, magic=b"LibvirtQemudPart")[:92])
    with pytest.raises(UnsupportedError):
        libvirt.parse_header(libvirt_save(stream, version=1)[:92])
    with pytest.raises(LimitError):
        libvirt.parse_header(libvirt_save(b"", data_len=libvirt.DATA_LIMIT + 1)[:92])


def test_domain_xml_never_raises():
    assert libvirt.domain_of(b"<domain><name>x").problem
    assert libvirt.domain_of(b"<!DOCTYPE x [<!ENTITY a 'b'>]><domain/>").problem
    assert libvirt.domain_of(b"<other/>").problem
    assert libvirt.domain_of(b"<domain><memory unit='GiB'>2</memory></domain>").memory_bytes == 2 << 30
    assert libvirt.domain_of(b"<domain><memory unit='parsec'>2</memory></domain>").memory_bytes is None


def test_disk_named_by_the_domain_xml(stream, tmp_path):
    """`--disk vda` alone: the file the domain XML gives for target dev vda."""
    disk = tmp_path / "web1.img"
    disk.write_bytes(bytes(range(256)) * 16 * 64)
    xml = XML.replace(b"/var/lib/libvirt/images/web1.img", str(disk).encode()) + b"\0"
    save = tmp_path / "web1.save"
    save.write_bytes(libvirt_save(stream, xml=xml))
    ok("convert", save, "-o", tmp_path / "web1.lean", "--disk", "vda")
    shown = json.loads(ok("inspect", tmp_path / "web1.lean", "--json").stdout)
    assert [d["name"] for d in shown["disks"]] == ["vda"]
    proc = run("convert", save, "-o", tmp_path / "x.lean", "--disk", "vdb")
    assert proc.returncode == 2 and b"names no disk vdb (it names: vda=" in proc.stderr
    assert not (tmp_path / "x.lean").exists()
