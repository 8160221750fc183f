"""Helpers shared by the benchmark scripts (run as `python benchmarks/NAME.py`)."""

from __future__ import annotations

import argparse
import os
import re
import resource
import shlex
import stat
import subprocess
import time
from pathlib import Path

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TB": 1 << 40,
    "TIB": 1 << 40,
}


def size_parser(multiple: int):
    """An argparse type for sizes like 64MiB or 1GiB that must be a non-zero multiple of ``multiple``."""

    def parse(text: str) -> int:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        if not m or m.group(2).upper() not in _UNITS:
            raise argparse.ArgumentTypeError(f"expected a size like 64MiB or 1GiB, got {text!r}")
        size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
        if size <= 0 or size % multiple:
            raise argparse.ArgumentTypeError(f"size must be a non-zero multiple of {multiple} bytes, got {size}")
        return size

    return parse


def require_null_device() -> None:
    """Exit unless /dev/null is the null character device.  Output timed into /dev/null is
    otherwise stored: on a machine where it had become a regular file (a tool that renamed a
    finished file over it as root) every run appended ~600 MiB to it, and the timings
    measured that."""
    if not stat.S_ISCHR(os.stat(os.devnull).st_mode):
        raise SystemExit(
            f"{os.devnull} is not a character device here, so writes into it are "
            f"kept; recreate it (as root: rm {os.devnull} && mknod -m 666 {os.devnull} "
            f"c 1 3) before timing anything written to it"
        )


def compile_checkout(leanimg: str) -> None:
    """Compile the modules of the checkout whose virtualenv holds the executable ``leanimg``
    (``CHECKOUT/.venv/bin/leanimg``), if it is one. Where PYTHONDONTWRITEBYTECODE is set (as on
    these machines) an uncompiled checkout compiles every module again at every run, ~0.05-0.1 s
    that an A/B would count against it; .ci/install compiles the main checkout, a checkout
    made by hand for a baseline is not."""
    venv_bin = Path(leanimg).resolve().parent if os.sep in leanimg else None
    root = venv_bin.parent.parent if venv_bin is not None else None
    if root is not None and (root / "lean-image").is_dir() and (venv_bin / "python").exists():
        subprocess.run(
            [str(venv_bin / "python"), "-m", "compileall", "-q", "lean-image", "converters", "restore"],
            cwd=root,
            stdout=subprocess.DEVNULL,
            check=True,
        )


def timed(argv: list, cold=(), stdout=subprocess.PIPE, after=None) -> dict:
    """Run ``argv`` once, the ``cold`` files evicted from the page cache first (and ``after``
    run before the clock stops: an fsync): its wall and child CPU seconds, its stderr, and its
    stdout when captured (``stdout`` PIPE; a file object takes it instead)."""
    from leanimg.fileutil import evict_from_page_cache

    argv = [str(a) for a in argv]
    for path in cold:
        evict_from_page_cache(path)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=stdout, stderr=subprocess.PIPE)
    stderr = proc.stderr.decode(errors="replace")
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    if after:
        after()
    wall = time.perf_counter() - t0
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (used.ru_utime - before.ru_utime) + (used.ru_stime - before.ru_stime)
    out = proc.stdout.decode(errors="replace").strip() if stdout is subprocess.PIPE else None
    return {"wall": wall, "cpu": cpu, "stdout": out, "stderr": stderr}
