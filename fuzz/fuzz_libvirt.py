"""atheris harness: arbitrary bytes as libvirt's QEMU save image (converters/libvirt.py).

    LEANIMG_FUZZ_RUNS=1000000 nice -n 19 python fuzz/fuzz_libvirt.py /tmp/leanimg-libvirt-corpus
    python fuzz/fuzz_libvirt.py --replay fuzz/regressions/*.libvirt

(run length, memory cap, keep-going mode: see fuzz/harness.py). Per input:

1. ``read_save_header`` from the file (length known) and from a pipe (length unknown): both
   refuse with a LeanImageError, or the pipe accepts what the file refuses only for data_len
   beyond the file, or both give the same header, each reading exactly header + data_len;
2. for an accepted header: ``domain_of`` and ``details`` never raise, ``describe`` is one line,
   the SOURCE_STATE tag 3 data (``pack_libvirt_header``) unpacks to the same header;
3. ``open_payload`` gives the bytes after the header (a raw payload) or a LeanImageError while
   decompressing (the others), read to the end;
4. on one input in 64 of those accepted (``harness.thorough``): ``convert_file`` with the
   libvirt format converts or refuses (no output left), and a converted image restores with
   ``--to libvirt`` to the header verbatim followed by a payload (a raw one starts "QEVM").

The QEMU stream reader behind the payload has its own harness (fuzz_qemu.py); this one is the
header parser's, cheap enough for 10^6 executions. Bad input must raise LeanImageError.
"""

from __future__ import annotations

import io
import os
import struct
import sys

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

with atheris.instrument_imports(include=["leanimg"]):
    from leanimg.converters import libvirt
    from leanimg.converters.convert import convert_file
    from leanimg.converters.source_state import pack_libvirt_header, unpack_libvirt_header
    from leanimg.errors import LeanImageError
    from leanimg.reader import LeanImage
    from leanimg.restore.libvirt import restore_libvirt

import harness  # noqa: E402  (not instrumented: fuzzing machinery)
import make_stream_corpus  # noqa: E402  (not instrumented: seed builder only)

harness.small_refills()
WRITER = {"threads": 1}
SCRATCH = harness.work_dir("libvirt")
RUN = os.path.join(SCRATCH, "run")
harness.scratch_tempdir(SCRATCH)


def header_of(stream, size):
    try:
        header = libvirt.read_save_header(stream, size)
    except LeanImageError as exc:
        return "error", type(exc), exc.offset, exc.structure
    return header, None


def check(data: bytes) -> None:
    harness.clear_dir(RUN)
    as_file = io.BytesIO(data)
    by_file = header_of(as_file, len(data))
    pipe = io.BufferedReader(harness.Pipe(data), 4096)
    by_pipe = header_of(pipe, None)
    if by_file[0] == "error":
        if by_pipe[0] != "error":
            assert by_file[3] == "libvirt header.data_len", f"the pipe accepted what the file refused: {by_file}"
        else:
            assert by_pipe[1:] == by_file[1:] or by_file[3] == "libvirt header.data_len", (by_file, by_pipe)
        return
    header = by_file[0]
    assert by_pipe[0] != "error", f"the pipe refused what the file accepted: {by_pipe}"
    assert by_pipe[0] == header, "file and pipe read different headers"
    assert as_file.tell() == header.payload_offset
    assert data[: header.payload_offset] == header.raw
    domain = libvirt.domain_of(header.xml)
    libvirt.details(header)
    assert "\n" not in libvirt.describe(header, domain), "describe is not one line"
    assert unpack_libvirt_header(pack_libvirt_header(header)) == header
    try:
        payload = libvirt.open_payload(as_file, header)
        try:
            rest = _read_bounded(payload)
        finally:
            payload.close()
    except LeanImageError:
        assert header.compression != libvirt.Compression.RAW, "a raw payload cannot fail to read"
        return
    if header.compression == libvirt.Compression.RAW:
        assert rest == data[header.payload_offset :]
    elif rest is None:
        return  # a decompression bomb: convert streams it, the harness does not
    if harness.thorough(data, 64):
        check_convert(data, header)


PAYLOAD_READ_MAX = 64 << 20


def _read_bounded(payload):
    """The payload's bytes (read in chunks, as convert reads it), or None past PAYLOAD_READ_MAX."""
    parts, total = [], 0
    while chunk := payload.read(1 << 20):
        total += len(chunk)
        if total > PAYLOAD_READ_MAX:
            return None
        parts.append(chunk)
    return b"".join(parts)


def check_convert(data: bytes, header) -> None:
    source = os.path.join(RUN, "input.save")
    with open(source, "wb") as f:
        f.write(data)
    dest = os.path.join(RUN, "image.lean")
    try:
        convert_file(source, dest, source_format="libvirt", writer_options=WRITER)
    except LeanImageError:
        assert not os.path.exists(dest), "a refused conversion left its output"
        return
    out = io.BytesIO()
    with LeanImage.open(dest) as image:
        restore_libvirt(image, out)
    assert out.getvalue()[: header.payload_offset] == header.raw, "restore changed libvirt's header"
    if header.compression == libvirt.Compression.RAW:  # a compressed one starts with its program's magic
        assert out.getvalue()[header.payload_offset : header.payload_offset + 4] == b"QEVM"
    else:
        assert len(out.getvalue()) > header.payload_offset, "restore wrote no payload"


def libvirt_file(
    payload: bytes, *, fmt: int = 0, was_running: int = 1, cookie: bool = True, padding: int = 64
) -> bytes:
    xml = (
        b"<domain type='qemu'><name>d</name><uuid>4dea22b3-1d52-d8f3-2516-782e98ab3fa0</uuid>"
        b"<memory unit='KiB'>4</memory><os><type machine='pc-i440fx-7.2'>hvm</type></os>"
        b"<devices><disk type='file' device='disk'><source file='/d.img'/><target dev='vda'/></disk>"
        b"</devices></domain>\0"
    )
    data = xml + (b"<qemu-save-cookie/>\0" if cookie else b"") + bytes(padding)
    return (
        struct.pack("<16s5I56s", libvirt.MAGIC, 2, len(data), was_running, fmt, len(xml) if cookie else 0, bytes(56))
        + data
        + payload
    )


def make_seeds(directory: str) -> list[str]:
    """A few small files: the smallest synthetic QEMU stream in raw, gzip and xz payloads."""
    import gzip
    import lzma

    stream = make_stream_corpus.qemu_seeds(real=False)["synthetic"]
    seeds = {
        "raw": libvirt_file(stream),
        "paused_nocookie": libvirt_file(stream, was_running=0, cookie=False),
        "gzip": libvirt_file(gzip.compress(stream, mtime=0), fmt=1),
        "xz": libvirt_file(lzma.compress(stream, preset=3), fmt=3),
        "partial": libvirt_file(stream).replace(libvirt.MAGIC, libvirt.PARTIAL_MAGIC, 1),
    }
    return make_stream_corpus.write_seeds(seeds, directory, "libvirt")


FUZZER = harness.Fuzzer("libvirt", check, make_seeds)
os.makedirs(RUN, exist_ok=True)

if __name__ == "__main__":
    sys.exit(FUZZER.main(sys.argv, SCRATCH))
