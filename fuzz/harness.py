"""What the stream harnesses (fuzz_qemu.py, fuzz_xen.py) share: scratch dir, memory cap,
crash recording, replay and the libFuzzer command line.

Imports nothing of leanimg, so a harness can import it before instrumenting leanimg.

Every harness takes the same arguments:

    python fuzz/fuzz_X.py [CORPUS_DIR...] [libFuzzer flags]   fuzz (default: seeds in a temp dir)
    python fuzz/fuzz_X.py --replay FILE...                   run inputs once, print tracebacks

Run length: ``-atheris_runs=N`` / ``-runs=N`` / ``-max_total_time=S``, else env
LEANIMG_FUZZ_RUNS (default 2000). Env LEANIMG_FUZZ_MEM_MB caps the address space (default
3072): an input that makes the library allocate without bound raises MemoryError (a bug)
instead of an OOM kill. Env LEANIMG_FUZZ_CRASH_DIR=DIR: keep going after a bug, saving the
first input of each distinct crash (exception type + innermost leanimg line) as
DIR/NAME.input with its traceback in NAME.txt.
"""

from __future__ import annotations

import io
import os
import resource
import shutil
import sys
import tempfile
import traceback
import zlib
from typing import Callable

DEFAULT_RUNS = 2000
MEM_MB = 3072
TIMEOUT_S = 60  # libFuzzer -timeout: one input running longer is a hang


def work_dir(tag: str) -> str:
    """A per-process scratch dir (tmpfs when there is one); stale ones of dead processes go.

    libFuzzer leaves through C exit(), past Python's atexit, so cleanup happens on the next start.
    """
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    prefix = f"leanimg-fuzz-{tag}-"
    for name in os.listdir(base):
        pid = name[len(prefix) :]
        if name.startswith(prefix) and pid.isdigit():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            except PermissionError:
                pass
    path = os.path.join(base, f"{prefix}{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    return path


def clear_dir(path: str) -> None:
    """Remove what one execution left in the scratch dir (kept between runs: it is reused)."""
    for name in os.listdir(path):
        full = os.path.join(path, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            os.unlink(full)


def small_refills(chunk: int = 64 << 10) -> None:
    """Stream cursors refill ``chunk`` bytes at a time instead of READ_CHUNK (4 MiB): a fresh
    4 MiB buffer per input dominated the cost of small inputs, and small refills put buffer
    boundaries inside the inputs, where the batch reader's runs must stop and resume."""
    from leanimg.converters.cursor import Cursor

    Cursor.__init__.__kwdefaults__["chunk"] = chunk


def scratch_tempdir(scratch: str) -> None:
    """Library temp files (spooled RAM, Xen skeletons, pipe copies) into the scratch dir."""
    path = os.path.join(scratch, "tmp")
    os.makedirs(path, exist_ok=True)
    tempfile.tempdir = path


def thorough(data: bytes, one_in: int = 4) -> bool:
    """Whether this input gets the costly checks too: one in ``one_in``, by a hash of the
    input (not at random, so that a replay checks exactly what the fuzzer checked)."""
    return zlib.crc32(data) % one_in == 0


class Pipe(io.RawIOBase):
    """The input as a pipe: readable, not seekable (the path stdin takes)."""

    def __init__(self, data: bytes):
        self.inner = io.BytesIO(data)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self.inner.readinto(buffer)


def limit_memory() -> int:
    mb = int(os.environ.get("LEANIMG_FUZZ_MEM_MB", MEM_MB))
    resource.setrlimit(resource.RLIMIT_AS, (mb << 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return mb


def signature(exc: BaseException) -> str:
    """Exception type and the innermost leanimg frame: one bug, one signature."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/fuzz/" not in f.filename]
    where = frames[-1] if frames else None
    for frame in reversed(frames):
        if any(part in frame.filename for part in ("/lean-image/", "/leanimg/", "/converters/", "/restore/")):
            where = frame
            break
    return f"{type(exc).__name__}@{os.path.basename(where.filename)}:{where.lineno}" if where else type(exc).__name__


class Fuzzer:
    """One harness: ``check(data)`` raises on a bug; the rest is the common machinery."""

    def __init__(self, name: str, check: Callable[[bytes], None], make_seeds: Callable[[str], list]):
        self.name, self.check, self.make_seeds = name, check, make_seeds
        self.crash_dir = os.environ.get("LEANIMG_FUZZ_CRASH_DIR")
        self.seen: set[str] = set()

    def test_one_input(self, data: bytes) -> None:
        if self.crash_dir is None:
            self.check(data)
            return
        try:
            self.check(data)
        except Exception as exc:  # keep-going mode: every bug is recorded, the fuzzer goes on
            self._record(exc, data)

    def _record(self, exc: Exception, data: bytes) -> None:
        sig = signature(exc)
        if sig in self.seen:
            return
        self.seen.add(sig)
        base = os.path.join(self.crash_dir, f"{self.name}-" + sig.replace("@", "-").replace(":", "-"))
        with open(base + ".input", "wb") as f:
            f.write(data)
        with open(base + ".txt", "w") as f:
            f.write(f"signature: {sig}\nreplay: python fuzz/fuzz_{self.name}.py --replay {base}.input\n\n")
            f.write("".join(traceback.format_exception(exc)))
        print(f"\n*** new crash {sig} -> {base}.input", file=sys.stderr)

    def replay(self, paths: list[str]) -> int:
        bugs = 0
        for path in paths:
            try:
                with open(path, "rb") as f:
                    self.check(f.read())
            except Exception:  # report, do not stop: every input gets its traceback
                bugs += 1
                print(f"=== {path}", file=sys.stderr)
                traceback.print_exc()
        print(
            f"{len(paths)} inputs, {bugs} raised something other than LeanImageError or failed a check", file=sys.stderr
        )
        return 1 if bugs else 0

    def main(self, argv: list[str], scratch: str) -> int:
        import atheris

        mb = limit_memory()
        if len(argv) > 1 and argv[1] == "--replay":
            return self.replay(argv[2:])
        args = list(argv)
        if not any(a.startswith("-rss_limit_mb=") for a in args[1:]):
            args.append(f"-rss_limit_mb={mb}")
        if not any(a.startswith("-timeout=") for a in args[1:]):
            args.append(f"-timeout={TIMEOUT_S}")
        if not any(a.startswith(("-atheris_runs=", "-runs=", "-max_total_time=")) for a in args[1:]):
            args.append(f"-atheris_runs={int(os.environ.get('LEANIMG_FUZZ_RUNS', DEFAULT_RUNS))}")
        if not any(not a.startswith("-") for a in args[1:]):
            seed_dir = os.path.join(scratch, "seeds")
            self.make_seeds(seed_dir)
            args.append(seed_dir)
        atheris.Setup(args, self.test_one_input)
        atheris.Fuzz()
        return 0
