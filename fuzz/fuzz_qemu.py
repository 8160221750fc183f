"""atheris harness: arbitrary bytes as a QEMU migration stream or mapped-ram file, read, converted, restored.

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
   (LeanImageError, no output left), and neither succeeds where the reader failed. A mapped-ram
   file (capability mapped-ram: pages at fixed offsets, converters/mapped_ram.py) cannot come
   from a pipe: there the pipe conversion must refuse with UnsupportedError, and a conversion
   from the bytes in memory (seekable, no file descriptor; spooled) must agree with the file's;
4. when they succeed (and the guest RAM is at most DIFF_RAM_MAX), ``restore --to qemu`` of
   each image gives the same stream, which reads back to the same pages and device state
   (without the capability mapped-ram); and ``restore --to qemu`` as a mapped-ram file, into a
   BytesIO (QEMU's layout: each block's pages on a 1 MiB boundary, zero pages left as zeros),
   reads back to the same pages and device state, with the capability. The mapped-ram restore
   runs for mapped-ram inputs and thorough ones, when the file is at most MAPPED_RESTORE_MAX
   bytes (a 1 MiB slot area per block: a fuzzed stream of many small blocks would make hundreds);
   it may refuse (UnsupportedError) only a stream without a configuration section, which
   cannot list the capability.

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
    from leanimg.converters import mapped_ram, qemu
    from leanimg.converters.convert import convert_file
    from leanimg.errors import LeanImageError, LimitError, UnsupportedError
    from leanimg.reader import LeanImage
    from leanimg.restore.qemu import restore_qemu, restore_qemu_mapped_ram

import xxhash  # noqa: E402

import harness  # noqa: E402  (not instrumented: fuzzing machinery)
import make_stream_corpus  # noqa: E402  (not instrumented: seed builder only)

harness.small_refills()

DIFF_RAM_MAX = 16 << 20  # restore differential only for guests with at most this much RAM
MAPPED_RESTORE_MAX = 40 << 20  # restore to a mapped-ram BytesIO only when it is at most this large
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
    return {
        (b.name, off): pages.get((b.name, off), zero)
        for b in state.ram_blocks
        for off in range(0, b.length, state.page_size)
    }


def check_load_stream(data: bytes, outcome) -> None:
    try:
        state, ram = qemu.load_stream(io.BytesIO(data), RUN)
    except LimitError:
        return  # more RAM than this process may spool: a limit of the tool, not of the reader
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
                    assert _digest(content[off : off + ps]) == outcome[2][block.name, off], (
                        f"load_stream page {block.name!r}+{off:#x} differs"
                    )


def _ram_bytes(state: qemu.StreamState) -> int:
    return sum(b.length for b in state.ram_blocks)


def convert(source, name: str, refusals: dict | None = None, **options) -> str | None:
    """Path of the image ``convert_file`` made, or None when it refused the stream (then
    ``refusals[name]`` is the exception's type: the type only, the exception would keep the
    conversion's tables alive through its traceback)."""
    dest = os.path.join(RUN, name)
    try:
        convert_file(source, dest, source_format="qemu", writer_options=WRITER, **options)
    except LeanImageError as exc:
        assert not os.path.exists(dest), "a refused conversion left its output"
        if refusals is not None:
            refusals[name] = type(exc)
        return None
    return dest


def restored(image_path: str, mapped: bool = False) -> bytes:
    out = io.BytesIO()
    with LeanImage.open(image_path) as image:
        (restore_qemu_mapped_ram if mapped else restore_qemu)(image, out)
    return out.getvalue()


def is_mapped_ram(state: qemu.StreamState) -> bool:
    return mapped_ram.CAPABILITY in state.capabilities


def mapped_file_size(state: qemu.StreamState) -> int:
    """At least the size of the mapped-ram file of ``state``'s blocks (each block's pages
    begin on the next 1 MiB boundary after its header and bitmap)."""
    return sum(
        mapped_ram.ALIGNMENT + mapped_ram.bitmap_size(b.length // state.page_size) + b.length for b in state.ram_blocks
    )


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
    mapped = outcome[0] != "error" and is_mapped_ram(outcome[1])
    refusals = {}
    images = [convert(INPUT, "file.lean")]
    if thorough:
        pipe = convert(io.BufferedReader(harness.Pipe(data)), "pipe.lean", refusals, spool=True)
        if mapped:
            assert pipe is None and refusals["pipe.lean"] is UnsupportedError, (
                f"a mapped-ram file from a pipe: expected UnsupportedError, got {pipe or refusals['pipe.lean']}"
            )
        else:
            images.append(pipe)
    if mapped:
        images.append(convert(io.BytesIO(data), "memory.lean", spool=True))
    converted = [path is not None for path in images]
    assert len(set(converted)) == 1, f"conversions from the file, a pipe or memory disagree: {images}"
    assert outcome[0] != "error" or not converted[0], "conversion accepted what the reader refused"
    if converted[0] and outcome[2] is not None:
        check_restore(images, outcome[1], outcome[2], mapped or thorough)


def check_restore(images: list[str], state: qemu.StreamState, expected: dict, to_mapped: bool) -> None:
    streams = [restored(path) for path in images]
    assert all(s == streams[0] for s in streams), "restores of the file and pipe (or memory) conversions differ"
    pages, back = read_pages(io.BytesIO(streams[0]), batch=True)
    assert pages != "error", f"restore --to qemu wrote a stream the reader refuses: {back}"
    check_restored(pages, back, state, expected, mapped=False)
    if not to_mapped or mapped_file_size(state) > MAPPED_RESTORE_MAX:
        return
    try:
        mapped = restored(images[0], mapped=True)
    except UnsupportedError:
        assert len(state.prologue) == 8, "restore to mapped-ram refused a stream with a configuration section"
        return
    pages, back = read_pages(io.BytesIO(mapped), batch=False)
    assert pages != "error", f"restore to mapped-ram wrote a file the reader refuses: {back}"
    check_restored(pages, back, state, expected, mapped=True)


def check_restored(pages: dict, back: qemu.StreamState, state: qemu.StreamState, expected: dict, mapped: bool) -> None:
    what = "restored mapped-ram file" if mapped else "restored stream"
    assert expected_ram(pages, back) == expected, f"{what}'s pages differ from the input's"
    assert back.devices == state.devices and back.vmdesc == state.vmdesc, f"{what}'s device state differs"
    assert back.ram_blocks == state.ram_blocks, f"{what}'s RAM blocks differ"
    assert is_mapped_ram(back) == mapped, f"{what}: capabilities {back.capabilities}"
    others = [c for c in back.capabilities if c != mapped_ram.CAPABILITY]
    assert others == [c for c in state.capabilities if c != mapped_ram.CAPABILITY], (
        f"{what}: capabilities {back.capabilities}, the input's {state.capabilities}"
    )


def make_seeds(directory: str) -> list[str]:
    return make_stream_corpus.make_corpus("qemu", directory)


FUZZER = harness.Fuzzer("qemu", check, make_seeds)
os.makedirs(RUN, exist_ok=True)

if __name__ == "__main__":
    sys.exit(FUZZER.main(sys.argv, SCRATCH))
