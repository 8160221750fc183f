"""Two builds of leanimg side by side: cold restores of the same images, interleaved.

Sequential benchmark runs of two commits drift with this host (the same `zstd -d` varies by
20 % from one run to the next); interleaving A and B run by run, every input evicted from
the page cache first, leaves the drift to both alike; the order alternates (A B, B A, ...). Each of A and B is a `leanimg`
executable (e.g. the console script of another checkout's virtualenv).

    python benchmarks/bench_ab.py --a /work/old/.venv/bin/leanimg --b .venv/bin/leanimg \\
        --to raw --runs 9 CHAIN_DIR/d100-0099.lean /var/tmp/leanimg-bench-qemu/vm.lean

An image's ancestors (found beside it) and --disk files are evicted too. Prints the median
of each and B/A per image.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_null_device  # noqa: E402


def evict(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed_restore(leanimg: str, image: str, target: str, extra: list[str], inputs: list[str]) -> float:
    evict(inputs)
    start = time.perf_counter()
    subprocess.run([leanimg, "restore", image, "--to", target, "-o", "/dev/null", *extra], check=True)
    return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="the baseline leanimg executable")
    parser.add_argument("--b", required=True, help="the leanimg executable compared with it")
    parser.add_argument("--to", default="raw", choices=["raw", "qemu", "xen"])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--disk", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("images", nargs="+")
    args = parser.parse_args(argv)
    require_null_device()
    extra = [f"--disk={d}" for d in args.disk]
    disks = [d.partition("=")[2] for d in args.disk]
    for image in args.images:
        inputs = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(image)), "*.lean"))) + disks
        times = {"a": [], "b": []}
        for run in range(args.runs):
            for key in ("a", "b") if run % 2 == 0 else ("b", "a"):      # ABBA: no order bias
                times[key].append(timed_restore(getattr(args, key), image, args.to, extra, inputs))
        a, b = statistics.median(times["a"]), statistics.median(times["b"])
        print(f"{image}: A {a:.3f} s, B {b:.3f} s, B/A {b / a:.3f} (medians of {args.runs}, cold, interleaved)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
