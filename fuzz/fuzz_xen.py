"""atheris harness: arbitrary bytes as a Xen save (xl file, libxl v2, libxc v2/v3), read,
converted, restored.

    python fuzz/make_stream_corpus.py xen /tmp/leanimg-xen-corpus
    LEANIMG_FUZZ_RUNS=100000 nice -n 19 python fuzz/fuzz_xen.py /tmp/leanimg-xen-corpus
    python fuzz/fuzz_xen.py --replay fuzz/regressions/*.xen

(run length, memory cap, keep-going mode: see fuzz/harness.py). Per input:

1. ``scan`` (all three layers, the skeleton) and ``feed_pages`` (the winning copy of every page);
2. ``convert_file`` into a lean image from the file and from a pipe (spooled to a scratch
   file): both succeed exactly when ``scan`` did, or both fail with a LimitError (a guest
   whose tables do not fit under the memory cap);
3. when they do, ``restore --to xen`` of each image gives the same stream; scanned again it
   has the same layers, version, domain type, pfn space and pages, and when every page
   was sent once it is byte-identical to the input.

Steps 2-3 cost most; to keep executions fast they run on every input ``scan`` accepts (the
pipe conversion on a quarter of them) and on a quarter of those it refuses, the quarter
chosen by a hash of the input (``harness.thorough``), so a replay does the same.

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

# Coverage feedback from the stream's modules, not from the lean writer's and reader's: atheris
# keeps the operands of instrumented comparisons alive, and their numpy comparisons of whole page
# tables piled up until a process reached its 3 GiB cap within 20,000 executions (the lean reader
# has a harness of its own, fuzz_reader.py).
LEAN_CORE = [
    "leanimg.format",
    "leanimg.incremental",
    "leanimg.reader",
    "leanimg.pages",
    "leanimg.checks",
    "leanimg.digests",
    "leanimg.tables",
    "leanimg.frames",
    "leanimg.delta",
    "leanimg.parents",
    "leanimg.parent_files",
    "leanimg.writer",
    "leanimg.compression",
]

with atheris.instrument_imports(include=["leanimg"], exclude=LEAN_CORE):
    from leanimg.converters import xen
    from leanimg.converters.convert import convert_file
    from leanimg.errors import LeanImageError, LimitError
    from leanimg.reader import LeanImage
    from leanimg.restore.xen import restore_xen

import xxhash  # noqa: E402

import harness  # noqa: E402  (not instrumented: fuzzing machinery)
import make_stream_corpus  # noqa: E402  (not instrumented: seed builder only)

WRITER = {"threads": 1}

SCRATCH = harness.work_dir("xen")
RUN = os.path.join(SCRATCH, "run")
INPUT = os.path.join(SCRATCH, "input.xen")
harness.scratch_tempdir(SCRATCH)


SUMMARY = ("form", "libxc_version", "domain_type", "num_pfns", "checkpoints", "data_entries", "resent")


def read_stream(path: str):
    """(what scan learned: SUMMARY fields, {pfn: digest of the winning page}), or None when
    ``scan`` refuses. Not the ScanResult: its pfn table (up to 512 MiB) would stay alive
    during the conversions."""
    pages = {}

    def put(first: int, data) -> None:
        view = memoryview(data)
        for k in range(len(view) // xen.PAGE_SIZE):
            pages[first + k] = xxhash.xxh3_128_digest(view[k * xen.PAGE_SIZE : (k + 1) * xen.PAGE_SIZE])

    with open(path, "rb") as f:
        try:
            result = xen.scan(f)
        except LeanImageError:
            return None
        with result.skeleton:
            xen.feed_pages(f, result, put)
    return {name: getattr(result, name) for name in SUMMARY}, pages


def convert(source, name: str) -> str | None:
    """Path of the image ``convert_file`` made, or None when it refused the stream."""
    dest = os.path.join(RUN, name)
    try:
        convert_file(source, dest, source_format="xen", writer_options=WRITER)
    except LeanImageError as exc:
        assert not os.path.exists(dest), "a refused conversion left its output"
        refusals.append((type(exc), str(exc)))  # not the exception: its traceback holds the scan's tables
        return None
    return dest


refusals: list[tuple[type, str]] = []


def restored(image_path: str) -> bytes:
    out = io.BytesIO()
    with LeanImage.open(image_path) as image:
        restore_xen(image, out)
    return out.getvalue()


def check(data: bytes) -> None:
    harness.clear_dir(RUN)
    refusals.clear()
    with open(INPUT, "wb") as f:
        f.write(data)
    original = read_stream(INPUT)
    thorough = harness.thorough(data)
    if original is None and not thorough:
        return
    images = [convert(INPUT, "file.lean")]
    if thorough:
        images.append(convert(io.BufferedReader(harness.Pipe(data)), "pipe.lean"))
    converted = [path is not None for path in images]
    assert len(set(converted)) == 1, f"file and pipe conversions disagree: {images}"
    if original is None:
        assert not converted[0], "conversion accepted what scan refused"
    elif not converted[0]:
        assert all(issubclass(kind, LimitError) for kind, _ in refusals), (
            f"conversion refused what scan read: {refusals[0][1]}"
        )  # a resource limit is no format error
    else:
        check_restore(images, data, *original)


def check_restore(images: list[str], data: bytes, result: dict, pages: dict) -> None:
    streams = [restored(path) for path in images]
    assert streams[-1] == streams[0], "restores of the file and pipe conversions differ"
    path = os.path.join(RUN, "restored.xen")
    with open(path, "wb") as f:
        f.write(streams[0])
    back = read_stream(path)
    assert back is not None, "restore --to xen wrote a stream scan refuses"
    again, pages_again = back
    for field in SUMMARY[:-1]:
        assert again[field] == result[field], f"restored stream: {field} differs"
    assert pages_again == pages, "restored stream's pages differ from the input's"
    if not result["resent"]:
        assert streams[0] == data, "restore of a stream sending each page once is not byte-identical"


def make_seeds(directory: str) -> list[str]:
    return make_stream_corpus.make_corpus("xen", directory)


FUZZER = harness.Fuzzer("xen", check, make_seeds)
os.makedirs(RUN, exist_ok=True)

if __name__ == "__main__":
    sys.exit(FUZZER.main(sys.argv, SCRATCH))
