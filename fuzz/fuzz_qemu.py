"""atheris harness: arbitrary bytes as a QEMU 7.2 migration stream, read, converted, restored.

    python fuzz/make_stream_corpus.py qemu /tmp/leanimg-qemu-corpus
    LEANIMG_FUZZ_RUNS=100000 nice -n 19 python fuzz/fuzz_qemu.py /tmp/leanimg-qemu-corpus
    python fuzz/fuzz_qemu.py --replay fuzz/regressions/*.qemu

(run length, memory cap, keep-going mode: see fuzz/harness.py). Per input:

1. ``read_qemu_stream`` page by page and in batch mode: both fail with the same error at the
   same offset, or both give the same pages (last copy wins) and the same stream state;
2. ``load_stream`` (the spooled RAM) fails likewise (or with a LimitError: RAM too big to
   spool in this process), or holds those pages;
3. ``convert_file`` into a lean image, from the file (streaming, falling back to the spooled
   path for a live save) and from a pipe with ``spool=True``: both succeed or both fail
   (LeanImageError, no output left), and neither succeeds where the reader failed;
4. when they succeed (and the guest RAM is at most DIFF_RAM_MAX), ``restore --to qemu`` of
   each image gives the same stream, which reads back to the same pages and device state.

Steps 3-4 cost most; to keep executions fast they run on every input the reader accepts
(the pipe conversion on a quarter of them) and on a quarter of those it refuses, the
quarter chosen by a hash of the input (``harness.thorough``), so a replay does the same.

Bad input must raise LeanImageError and nothing else; any other exception, a failed
check (AssertionError), a hang (-timeout) or a MemoryError under the address-space cap is a bug.
"""

from __future__ import annotations

import io
import os
import sys

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

with atheris.instrument_imports(include=["leanimg"]):
    from leanimg.converters import qemu
    from leanimg.converters.convert import convert_file
    from leanimg.errors import LeanImageError, LimitError
    from leanimg.reader import LeanImage
    from leanimg.restore.qemu import restore_qemu

import xxhash  # noqa: E402

import harness  # noqa: E402  (not instrumented: fuzzing machinery)
import make_stream_corpus  # noqa: E402  (not instrumented: seed builder only)

harness.small_refills()

DIFF_RAM_MAX = 16 << 20     # restore differential only for guests with at most this much RAM
WRITER = {"threads": 1}

SCRATCH = harness.work_dir("qemu")
RUN = os.path.join(SCRATCH, "run")
INPUT = os.path.join(SCRATCH, "input.qemu")
harness.scratch_tempdir(SCRATCH)


def _digest(data) -> bytes:
    return xxhash.xxh3_128_digest(data)


def read_pages(stream, batch: bool):
    """(pages, state) where pages maps (block, offset) to the digest of the last copy sent;
    or ("error", type, offset) when the reader refuses the stream."""
    pages, page_size = {}, None
    try:
        for event in qemu.read_qemu_stream(stream, batch=batch):
            if isinstance(event, qemu.RamBlocks):
                page_size = event.page_size
            elif isinstance(event, qemu.Page):
                pages[event.block, event.offset] = _digest(event.content(page_size))
            elif isinstance(event, qemu.PageRun):
                zero = None if event.pages is not None else _digest(bytes(page_size))
                for k in range(event.count):
                    pages[event.block, event.offset + k * page_size] = zero or _digest(event.pages[k])
            else:
                return pages, event.state
    except LeanImageError as exc:
        return "error", type(exc), exc.offset
    raise AssertionError("read_qemu_stream ended without StreamEnd")


def expected_ram(pages: dict, state: qemu.StreamState) -> dict:
    """Digest of every page of every block: the last copy sent, zeros for pages never sent."""
    zero = _digest(bytes(state.page_size))
    return {(b.name, off): pages.get((b.name, off), zero)
            for b in state.ram_blocks for off in range(0, b.length, state.page_size)}


def check_load_stream(data: bytes, outcome) -> None:
    try:
        state, ram = qemu.load_stream(io.BytesIO(data), RUN)
    except LimitError:
        return      # more RAM than this process may spool: a limit of the tool, not of the reader
    except LeanImageError as exc:
        assert outcome[0] == "error", f"load_stream refused what the reader accepted: {exc}"
        return
    with ram:
        assert outcome[0] != "error", "load_stream accepted what the reader refused"
        assert state.to_bytes() == outcome[1].to_bytes(), "load_stream's state differs from the reader's"
        if _ram_bytes(state) <= DIFF_RAM_MAX:
            ps = state.page_size
            for block in state.ram_blocks:
                content = ram.read(block.name)
                for off in range(0, block.length, ps):
                    assert _digest(content[off:off + ps]) == outcome[2][block.name, off], \
                        f"load_stream page {block.name!r}+{off:#x} differs"


def _ram_bytes(state: qemu.StreamState) -> int:
    return sum(b.length for b in state.ram_blocks)


def convert(source, name: str, **options) -> str | None:
    """Path of the image ``convert_file`` made, or None when it refused the stream."""
    dest = os.path.join(RUN, name)
    try:
        convert_file(source, dest, source_format="qemu", writer_options=WRITER, **options)
    except LeanImageError:
        assert not os.path.exists(dest), "a refused conversion left its output"
        return None
    return dest


def restored(image_path: str) -> bytes:
    out = io.BytesIO()
    with LeanImage.open(image_path) as image:
        restore_qemu(image, out)
    return out.getvalue()


def check(data: bytes) -> None:
    harness.clear_dir(RUN)
    sequential = read_pages(io.BytesIO(data), batch=False)
    batched = read_pages(io.BytesIO(data), batch=True)
    if sequential[0] == "error":
        assert batched == sequential, f"batch reader: {batched[:3]}, page by page: {sequential}"
        outcome = sequential
    else:
        assert batched[0] != "error", f"batch reader refused ({batched}) what the page-by-page one read"
        assert batched[0] == sequential[0], "batch and page-by-page readers give different pages"
        assert batched[1].to_bytes() == sequential[1].to_bytes(), "batch and page-by-page states differ"
        pages, state = sequential
        small = _ram_bytes(state) <= DIFF_RAM_MAX
        outcome = ("ok", state, expected_ram(pages, state) if small else None)
    check_load_stream(data, outcome)
    thorough = harness.thorough(data)
    if outcome[0] == "error" and not thorough:
        return
    with open(INPUT, "wb") as f:
        f.write(data)
    images = [convert(INPUT, "file.lean")]
    if thorough:
        images.append(convert(io.BufferedReader(harness.Pipe(data)), "pipe.lean", spool=True))
    converted = [path is not None for path in images]
    assert len(set(converted)) == 1, f"file and pipe conversions disagree: {images}"
    assert outcome[0] != "error" or not converted[0], "conversion accepted what the reader refused"
    if converted[0] and outcome[2] is not None:
        check_restore(images, outcome[1], outcome[2])


def check_restore(images: list[str], state: qemu.StreamState, expected: dict) -> None:
    streams = [restored(path) for path in images]
    assert streams[-1] == streams[0], "restores of the file and pipe conversions differ"
    pages, back = read_pages(io.BytesIO(streams[0]), batch=True)
    assert pages != "error", f"restore --to qemu wrote a stream the reader refuses: {back}"
    assert expected_ram(pages, back) == expected, "restored stream's pages differ from the input's"
    assert back.devices == state.devices and back.vmdesc == state.vmdesc, "restored device state differs"
    assert back.ram_blocks == state.ram_blocks, "restored RAM blocks differ"


def make_seeds(directory: str) -> list[str]:
    return make_stream_corpus.make_corpus("qemu", directory)


FUZZER = harness.Fuzzer("qemu", check, make_seeds)
os.makedirs(RUN, exist_ok=True)

if __name__ == "__main__":
    sys.exit(FUZZER.main(sys.argv, SCRATCH))
