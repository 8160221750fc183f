"""atheris harness: arbitrary bytes through LeanImage.open, every page, inspect and validate.

The library's contract (STYLE.md) is that bad input raises LeanImageError (or a
subclass) and nothing else: any other exception, a hang or unbounded memory is a bug.

    python fuzz/make_corpus.py /tmp/leanimg-corpus
    LEANIMG_FUZZ_RUNS=200000 python fuzz/fuzz_reader.py /tmp/leanimg-corpus
    python fuzz/fuzz_reader.py /tmp/leanimg-corpus -max_total_time=300 -artifact_prefix=/tmp/crashes/

Run length: ``-atheris_runs=N`` / ``-runs=N`` / ``-max_total_time=S`` on the command line,
else env LEANIMG_FUZZ_RUNS (default 2000). With no corpus directory given, the seeds of
make_corpus.py are used from a temp dir. A fixed parent image and disk (the ones
make_corpus.py builds) are passed to the reader so chain and disk paths are reached.
``python fuzz/fuzz_reader.py --replay FILE...`` runs inputs once without atheris and
prints the traceback of every non-LeanImageError exception.
With env LEANIMG_FUZZ_CRASH_DIR=DIR the fuzzer keeps going after a bug: the first
input of each distinct crash (exception type + innermost leanimg line) is saved
to DIR as NAME.input (as run, checksums already fixed) with its traceback in NAME.txt.
"""

from __future__ import annotations

import os
import resource
import shutil
import sys
import tempfile
import traceback
from contextlib import contextmanager

import atheris

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

with atheris.instrument_imports(include=["leanimg"]):
    from leanimg.disks import open_disk
    from leanimg.errors import LeanImageError
    from leanimg.format import (
        FOOTER,
        HEADER,
        HEADER_LENGTH_MAX,
        HEADER_MAGIC,
        RECORD_BODY_MAX,
        RECORD,
        align8,
        checksum64,
    )
    from leanimg.inspect import summarize
    from leanimg.reader import LeanImage
    from leanimg.validate import validate

import make_corpus  # noqa: E402  (not instrumented: seed builder only)
import struct  # noqa: E402

import xxhash  # noqa: E402

DEFAULT_RUNS = 2000
MEM_MB = 3072
PAGES_READ_MAX = 4096  # read every page of images up to this size, sample bigger ones
PAGES_SAMPLED = 64


def _work_dir() -> str:
    """A per-process scratch dir (tmpfs when there is one); stale ones of dead processes go.

    libFuzzer leaves through C exit(), past Python's atexit, so cleanup happens on the next start.
    """
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for name in os.listdir(base):
        if name.startswith("leanimg-fuzz-") and name[13:].isdigit():
            try:
                os.kill(int(name[13:]), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            except PermissionError:
                pass
    path = os.path.join(base, f"leanimg-fuzz-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    return path


_work = _work_dir()
PARENT, DISK = make_corpus.build_fixtures(_work)
INPUT = os.path.join(_work, "input.lean")


def read_everything(image: LeanImage) -> None:
    """Every page of small images (bulk and one by one), a sample of pages of big ones."""
    for region in image.regions:
        n = region.num_pages
        image.classes(region)
        if n <= PAGES_READ_MAX:
            image.region_bytes(region, 0, n)
            pages = range(n)
        else:
            starts = region.extents["first_page"][:PAGES_SAMPLED].astype(int).tolist()
            pages = sorted(set(starts + [n - 1]))
            image.region_bytes(region, 0, min(n, 16))
        for page in pages:
            image.read_page(region, page)


def exercise(path: str) -> None:
    """The whole read surface on one file; only LeanImageError may escape (and is swallowed)."""
    disks = {}
    try:
        with LeanImage.open(path, parents=[PARENT]) as image, disk_sources({make_corpus.DISK_NAME: DISK}) as sources:
            if any(d.name == make_corpus.DISK_NAME for d in image.disks):
                disks = {make_corpus.DISK_NAME: DISK}
                image.attach_disks(sources)
            summarize(image)
            read_everything(image)
    except LeanImageError:
        pass
    try:
        with disk_sources(disks) as sources:
            validate(path, disks=sources, parents=[PARENT])
    except LeanImageError:
        pass


@contextmanager
def disk_sources(disks: dict):
    """``disks`` (name -> path) opened as disk sources for the block."""
    sources = {name: open_disk(path, name) for name, path in disks.items()}
    try:
        yield sources
    finally:
        for source in sources.values():
            source.close()


def fix_checksums(data: bytes) -> bytes:
    """The input with header, record and footer checksums (and footer digest/length) made right.

    Random mutations almost never keep xxh3 checksums valid, so without this the
    fuzzer would stop at the checksum checks; with it, it reaches the structure checks.
    """
    b = bytearray(data)
    if len(b) < HEADER.size + FOOTER.size or b[:8] != HEADER_MAGIC:
        return data
    (length,) = struct.unpack_from("<I", b, 12)
    end = len(b) - FOOTER.size
    if length % 8 or not HEADER.size <= length <= min(HEADER_LENGTH_MAX, end):
        return data
    b[HEADER.offset("header_checksum") : HEADER.offset("header_checksum") + 8] = bytes(8)
    struct.pack_into("<Q", b, HEADER.offset("header_checksum"), checksum64(bytes(b[:length])))
    offset = length
    while offset + RECORD.struct.size <= end:
        _, _, body_length = RECORD.struct.unpack_from(b, offset)
        size = RECORD.struct.size + align8(body_length) + 8
        if body_length > RECORD_BODY_MAX or offset + size > end:
            break
        struct.pack_into("<Q", b, offset + size - 8, checksum64(bytes(b[offset : offset + size - 8])))
        offset += size
    struct.pack_into("<Q16s", b, end + 16, len(b), xxhash.xxh3_128_digest(bytes(b[:end])))
    struct.pack_into("<Q", b, end + 40, checksum64(bytes(b[end : end + 40])))
    return bytes(b)


def run_one(data: bytes) -> None:
    with open(INPUT, "wb") as f:
        f.write(data)
    exercise(INPUT)


def _signature(exc: BaseException) -> str:
    """Exception type and the innermost leanimg frame: one bug, one signature."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "fuzz_reader" not in f.filename]
    where = frames[-1] if frames else None
    for frame in reversed(frames):
        if "/lean-image/" in frame.filename or "/leanimg/" in frame.filename:
            where = frame
            break
    return f"{type(exc).__name__}@{os.path.basename(where.filename)}:{where.lineno}" if where else type(exc).__name__


_seen_signatures: set[str] = set()


def _record(exc: Exception, data: bytes, fixed: bool) -> None:
    """Keep-going mode: save the first input of each new crash signature with its traceback."""
    sig = _signature(exc)
    if sig in _seen_signatures:
        return
    _seen_signatures.add(sig)
    name = sig.replace("@", "-").replace(":", "-").replace("/", "_")
    base = os.path.join(CRASH_DIR, name)
    with open(base + ".input", "wb") as f:
        f.write(data)
    with open(base + ".txt", "w") as f:
        f.write(
            f"signature: {sig}\nchecksums fixed by the harness: {fixed}\n"
            f"replay: python fuzz/fuzz_reader.py --replay {base}.input\n\n"
        )
        f.write("".join(traceback.format_exception(exc)))
    print(f"\n*** new crash {sig} -> {base}.input", file=sys.stderr)


CRASH_DIR = os.environ.get("LEANIMG_FUZZ_CRASH_DIR")


def TestOneInput(data: bytes) -> None:
    fixed = fix_checksums(data)
    for variant in (data, fixed) if fixed != data else (data,):
        if CRASH_DIR is None:
            run_one(variant)
            continue
        try:
            run_one(variant)
        except Exception as exc:  # keep-going mode: every non-LeanImageError is recorded
            _record(exc, variant, variant is fixed)


def replay(paths: list[str]) -> int:
    global CRASH_DIR
    CRASH_DIR = None
    bugs = 0
    for path in paths:
        try:
            with open(path, "rb") as f:
                TestOneInput(f.read())
        except Exception:  # report, do not stop: every input gets its traceback
            bugs += 1
            print(f"=== {path}", file=sys.stderr)
            traceback.print_exc()
    print(f"{len(paths)} inputs, {bugs} raised something other than LeanImageError", file=sys.stderr)
    return 1 if bugs else 0


def limit_memory() -> int:
    """Cap the address space (env LEANIMG_FUZZ_MEM_MB, default 3072) so that an input making the
    library allocate without bound raises MemoryError, with a traceback, instead of an OOM kill."""
    mb = int(os.environ.get("LEANIMG_FUZZ_MEM_MB", MEM_MB))
    resource.setrlimit(resource.RLIMIT_AS, (mb << 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return mb


def main(argv: list[str]) -> int:
    mb = limit_memory()
    if len(argv) > 1 and argv[1] == "--replay":
        return replay(argv[2:])
    args = list(argv)
    if not any(a.startswith("-rss_limit_mb=") for a in args[1:]):
        args.append(f"-rss_limit_mb={mb}")
    if not any(a.startswith(("-atheris_runs=", "-runs=", "-max_total_time=")) for a in args[1:]):
        args.append(f"-atheris_runs={int(os.environ.get('LEANIMG_FUZZ_RUNS', DEFAULT_RUNS))}")
    if not any(not a.startswith("-") for a in args[1:]):
        seed_dir = os.path.join(_work, "corpus")
        make_corpus.make_corpus(seed_dir)
        args.append(seed_dir)
    atheris.Setup(args, TestOneInput)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
