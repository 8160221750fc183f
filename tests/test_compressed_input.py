"""`leanimg convert` reads saves kept compressed (zstd, gzip, xz, bzip2): detected by magic,
decompressed while read, treated like a pipe (leanimg.compressed_input).

Each format is made from the bundled real QEMU 7.2 save; the image converted from the
compressed file restores to the original save byte for byte, from a file and from stdin.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import subprocess
from pathlib import Path

import pytest
import zstandard

from leanimg.cli import command_line
from leanimg.compressed_input import compression_of, decompressing
from leanimg.errors import SourceFormatError
from leanimg.fileutil import open_input, sha256_file

SAMPLE_DIR = Path(__file__).resolve().parents[1] / "lean-image" / "sample"
LEANIMG = command_line()
TIMEOUT = 180

COMPRESSORS = {
    "zstd": lambda data: zstandard.ZstdCompressor(level=1).compress(data),
    "gzip": lambda data: gzip.compress(data, compresslevel=1),
    "xz": lambda data: lzma.compress(data, preset=0),
    "bzip2": lambda data: bz2.compress(data, compresslevel=1),
}


def run(*args, stdin=None) -> subprocess.CompletedProcess:
    return subprocess.run([*LEANIMG, *map(str, args)], stdin=stdin, capture_output=True, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def save(tmp_path_factory) -> bytes:
    return zstandard.ZstdDecompressor().decompress((SAMPLE_DIR / "vm.save.zst").read_bytes(), max_output_size=1 << 28)


@pytest.fixture(scope="module")
def compressed(save, tmp_path_factory) -> dict[str, Path]:
    directory = tmp_path_factory.mktemp("compressed")
    paths = {}
    for name, compress in COMPRESSORS.items():
        paths[name] = directory / f"vm.save.{name}"
        paths[name].write_bytes(compress(save))
    (directory / "vm.save").write_bytes(save)
    return paths


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_a_compressed_sample_save_converts_and_restores_to_the_original(kind, compressed, tmp_path):
    image, rebuilt = tmp_path / "vm.lean", tmp_path / "rebuilt.save"
    proc = run("convert", compressed[kind], "-o", image)
    assert proc.returncode == 0, proc.stderr.decode()
    proc = run("restore", image, "--to", "qemu", "-o", rebuilt)
    assert proc.returncode == 0, proc.stderr.decode()
    assert sha256_file(rebuilt) == sha256_file(compressed[kind].parent / "vm.save")


@pytest.mark.parametrize("kind", ["zstd", "xz"])
def test_a_compressed_save_on_stdin_converts(kind, compressed, tmp_path):
    image, rebuilt = tmp_path / "vm.lean", tmp_path / "rebuilt.save"
    with open(compressed[kind], "rb") as stdin:
        proc = subprocess.run(
            [*LEANIMG, "convert", "-", "-o", str(image)], stdin=stdin, capture_output=True, timeout=TIMEOUT
        )
    assert proc.returncode == 0, proc.stderr.decode()
    assert run("restore", image, "--to", "qemu", "-o", rebuilt).returncode == 0
    assert sha256_file(rebuilt) == sha256_file(compressed[kind].parent / "vm.save")


def test_a_compressed_save_converts_with_disk_references(compressed, tmp_path):
    """--disk spools the RAM, as for a pipe: the compressed save needs nothing else."""
    disk = tmp_path / "disk.img"
    disk.write_bytes(
        zstandard.ZstdDecompressor().decompress((SAMPLE_DIR / "disk.img.zst").read_bytes(), max_output_size=1 << 28)
    )
    image = tmp_path / "vm.lean"
    proc = run("convert", compressed["gzip"], "-o", image, "--disk", f"vda={disk}")
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"disk vda: " in proc.stderr and b" 0 pages" not in proc.stderr
    rebuilt = tmp_path / "rebuilt.save"
    assert run("restore", image, "--to", "qemu", "--disk", f"vda={disk}", "-o", rebuilt).returncode == 0
    assert sha256_file(rebuilt) == sha256_file(compressed["gzip"].parent / "vm.save")


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_a_truncated_compressed_save_fails_with_one_clear_line(kind, compressed, tmp_path):
    cut = tmp_path / f"cut.{kind}"
    data = compressed[kind].read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    out.mkdir()
    proc = run("convert", cut, "-o", out / "vm.lean")
    assert proc.returncode == 1, proc.stderr.decode()
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leanimg: error: "), lines
    assert "Traceback" not in lines[0]
    assert list(out.iterdir()) == [], "no image and no temporary file"


def test_corrupt_compressed_data_names_the_compression_and_offset(compressed, tmp_path):
    data = bytearray(compressed["gzip"].read_bytes())
    data[5000:5100] = bytes(100)
    bad = tmp_path / "bad.gz"
    bad.write_bytes(bytes(data))
    with pytest.raises(SourceFormatError) as info:
        with open_input(str(bad)) as stream:
            while stream.read(1 << 20):
                pass
    assert info.value.structure == "gzip stream"
    assert info.value.offset is not None and info.value.offset > 0


@pytest.mark.parametrize("kind", sorted(COMPRESSORS))
def test_detection_by_magic(kind):
    assert compression_of(COMPRESSORS[kind](b"QEVM" + bytes(100))) == kind
    assert compression_of(b"QEVM\x00\x00\x00\x03") is None


def test_an_uncompressed_stream_is_handed_back_unchanged(tmp_path):
    plain = tmp_path / "plain"
    plain.write_bytes(b"QEVM" + bytes(range(200)))
    with open(plain, "rb") as f:
        assert decompressing(f) is f and f.tell() == 0


def test_a_pipe_keeps_its_first_bytes(tmp_path):
    """A non-seekable input: the bytes read to detect the compression are given again."""
    proc = subprocess.Popen(["cat", "/dev/stdin"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc.stdin.write(b"QEVM" + bytes(range(100)))
    proc.stdin.close()
    try:
        stream = decompressing(proc.stdout)
        assert stream.read() == b"QEVM" + bytes(range(100))
    finally:
        proc.wait()


def test_a_compressed_save_converts_through_the_spool(compressed, tmp_path):
    """--spool (what a live save read from a pipe needs) reads the decompressed stream into the
    RAM spool: the image restores to the original."""
    image, rebuilt = tmp_path / "vm.lean", tmp_path / "rebuilt.save"
    proc = run("convert", compressed["xz"], "-o", image, "--spool")
    assert proc.returncode == 0, proc.stderr.decode()
    assert run("restore", image, "--to", "qemu", "-o", rebuilt).returncode == 0
    assert sha256_file(rebuilt) == sha256_file(compressed["xz"].parent / "vm.save")


@pytest.mark.parametrize("kind", ["gzip", "zstd"])
def test_a_compressed_xen_save_converts_and_restores(kind, tmp_path):
    """A Xen stream is read twice: decompressed, it is copied to a scratch file first, as from a pipe."""
    import xen_streams as xs

    stream = xs.build_stream(xs.make_guest(xs.HVM, 96, seed=5), xs.StreamOptions(form="xl"))
    save = tmp_path / f"dom.save.{kind}"
    save.write_bytes(COMPRESSORS[kind](stream))
    image, rebuilt = tmp_path / "dom.lean", tmp_path / "dom.save"
    proc = run("convert", save, "-o", image)
    assert proc.returncode == 0, proc.stderr.decode()
    assert run("restore", image, "--to", "xen", "-o", rebuilt).returncode == 0
    assert rebuilt.read_bytes() == stream
