"""Two builds of leanimg side by side: cold restores of the same images, interleaved.

Sequential benchmark runs of two commits drift with this host (the same `zstd -d` varies by
20 % from one run to the next); interleaving A and B run by run, every input evicted from
the page cache first, leaves the drift to both alike; the order alternates (A B, B A, ...).
Each of A and B is a `leanimg`
executable (e.g. the console script of another checkout's virtualenv).

    python benchmarks/bench_ab.py --a /work/old/.venv/bin/leanimg --b .venv/bin/leanimg \\
        --to raw --runs 9 CHAIN_DIR/d100-0099.lean /var/tmp/leanimg-bench-qemu/vm.lean

An image's ancestors (found beside it) and --disk files are evicted too. Prints the median
of each and B/A per image; with --convert SAVE, the same for converting SAVE (both given -f to
replace their scratch output: a build from before -f existed cannot be A; with --disk, converted
with those disks; with --zstd, ``zstd -T0 -3 SAVE`` + fsync is timed in the same rounds). The
checkouts behind A and B are compiled first (common.compile_checkout).
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compile_checkout, require_null_device  # noqa: E402


def evict(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(command: list[str], inputs: list[str]) -> float:
    evict(inputs)
    start = time.perf_counter()
    subprocess.run(command, check=True)
    return time.perf_counter() - start


def compare(label: str, commands: dict, inputs: list[str], runs: int) -> None:
    """commands: {"a": argv, "b": argv} and perhaps {"zstd": argv}, run in turn, the order
    reversed every other run (A B zstd, zstd B A, ...: no order bias)."""
    times: dict[str, list[float]] = {key: [] for key in commands}
    for run in range(runs):
        for key in list(commands) if run % 2 == 0 else reversed(list(commands)):
            times[key].append(timed(commands[key], inputs))
    med = {key: statistics.median(t) for key, t in times.items()}
    line = f"{label}: A {med['a']:.3f} s, B {med['b']:.3f} s, B/A {med['b'] / med['a']:.3f}"
    if "zstd" in med:
        z = med["zstd"]
        line += f"; zstd -T0 -3 + fsync {z:.3f} s: A/zstd {med['a'] / z:.2f}, B/zstd {med['b'] / z:.2f}"
    print(f"{line} (medians of {runs}, cold, interleaved)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", required=True, help="the baseline leanimg executable")
    parser.add_argument("--b", required=True, help="the leanimg executable compared with it")
    parser.add_argument("--to", default="raw", choices=["raw", "qemu", "xen"])
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--disk", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument(
        "--convert", metavar="SAVE", help="also time `convert SAVE` (into a temporary file; with the --disk files)"
    )
    parser.add_argument("--zstd", action="store_true", help="with --convert: time `zstd -T0 -3 SAVE` + fsync too")
    parser.add_argument("images", nargs="*")
    args = parser.parse_args(argv)
    require_null_device()
    compile_checkout(args.a)
    compile_checkout(args.b)
    extra = [f"--disk={d}" for d in args.disk]
    disks = [d.partition("=")[2] for d in args.disk]
    for image in args.images:
        inputs = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(image)), "*.lean"))) + disks
        compare(
            f"restore --to {args.to} {image}",
            {k: [getattr(args, k), "restore", image, "--to", args.to, "-o", "/dev/null", *extra] for k in ("a", "b")},
            inputs,
            args.runs,
        )
    if args.convert:
        with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.convert))) as scratch:
            out = os.path.join(scratch, "out.lean")
            commands = {k: [getattr(args, k), "convert", args.convert, "-o", out, "-f", *extra] for k in ("a", "b")}
            if args.zstd:
                zst = os.path.join(scratch, "out.zst")
                commands["zstd"] = [
                    "sh",
                    "-c",
                    'zstd -q -f -T0 -3 "$1" -o "$2" && sync "$2"',  # sync FILE: that file's fsync
                    "-",
                    args.convert,
                    zst,
                ]
            compare(f"convert {args.convert} {' '.join(extra)}".rstrip(), commands, [args.convert, *disks], args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
