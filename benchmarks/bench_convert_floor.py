"""How close `convert` is to what a lean image's pages cost at least, beside `zstd -T0 -3`
in the same run (issue 34 §1: convert <= 1.0x zstd).

    python benchmarks/bench_convert_floor.py SAVE [--runs 5] [--workdir /var/tmp]

SAVE is a QEMU migration stream (e.g. bench_qemu.py's WORKDIR/vm.save, or the one
bench_memory.py writes). It is read once first, so every run reads it from the page cache:
what is compared is the work, not the disk. Then, ``--runs`` rounds, the order reversed every
other round:

  zstd       zstd -T0 -3 SAVE -o TMP, then fsync TMP
  convert    leanimg convert SAVE -o TMP (the writer fsyncs before the rename)

each timed from spawn to exit, with its CPU time (user + system of the child). Then, in this
process on one thread, the CPU seconds of the work no writer of this format can skip,
measured alone on the same save:

  parse      the stream split into pages (read_qemu_stream, runs as strided views)
  gather     the non-zero pages copied into frames of the writer's size
  compress   each frame with the writer's compressor and level (zstd frames of 2 MiB, each
             decompressible alone: what lazy restores fetch)
  digests    every stored page's digest (spec: each page verified at restore)
  write      the compressed frames written to a file (what zstd writes too; no fsync)

Their sum is the floor of convert's CPU time (the writer's bookkeeping, the tables, the
record and file checksums and the fsync come on top). With C cores the wall time cannot be below floor / C
however the work is spread. The last lines give convert / zstd and floor / zstd, wall and CPU:
where floor / zstd CPU is near 1, a convert as fast as zstd needs a compressor cheaper than
zstd's own on the same bytes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

from common import timed
from leanimg.arrays import nonzero_rows
from leanimg.converters.qemu import Page, PageRun, read_qemu_stream
from leanimg.fileutil import fsync_path
from leanimg.format import DEFAULT_FRAME_BYTES, DEFAULT_ZSTD_LEVEL, page_digests

LEANIMG = Path(sys.executable).with_name("leanimg")


def rounds(save: Path, work: Path, runs: int) -> dict[str, list[tuple[float, float]]]:
    out = work / "out"
    commands = {
        "zstd": (["zstd", "-q", "-T0", "-3", "-f", save, "-o", out], lambda: fsync_path(str(out))),
        "convert": ([LEANIMG, "convert", save, "-o", out, "-f"], None),
    }
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in commands}
    for i in range(runs):
        for name in list(commands)[:: 1 if i % 2 == 0 else -1]:
            argv, after = commands[name]
            result = timed(argv, after=after)
            times[name].append((result["wall"], result["cpu"]))
            out.unlink()
    return times


class Floor:
    """The CPU seconds of each unskippable part, on this thread."""

    def __init__(self, out, page_size: int = 4096):
        self.out = out
        self.page_size = page_size
        self.frame = np.empty((DEFAULT_FRAME_BYTES // page_size, page_size), np.uint8)
        self.fill = 0
        self.compressor = zstandard.ZstdCompressor(level=DEFAULT_ZSTD_LEVEL, write_content_size=True)
        self.seconds = dict.fromkeys(("parse", "gather", "compress", "digests", "write"), 0.0)
        self.pages = 0

    def measure(self, save: Path) -> dict[str, float]:
        start = time.thread_time()
        with open(save, "rb") as f:
            for event in read_qemu_stream(f, batch=True):
                if isinstance(event, PageRun) and event.pages is not None:
                    self.add(event.pages)
                elif isinstance(event, Page) and event.data is not None:
                    self.add(np.frombuffer(event.data, np.uint8).reshape(1, -1))
        self.flush()
        self.seconds["parse"] = time.thread_time() - start - sum(self.seconds.values())
        return self.seconds

    def add(self, rows: np.ndarray) -> None:
        start = time.thread_time()
        kept = np.flatnonzero(nonzero_rows(rows))
        self.pages += len(kept)
        whole = len(kept) == len(rows)  # (a QEMU stream's runs nearly always: one strided copy)
        while len(kept):
            n = min(len(kept), len(self.frame) - self.fill)
            into = self.frame[self.fill : self.fill + n]
            into[:] = rows[kept[0] : kept[0] + n] if whole else rows[kept[:n]]
            self.fill, kept = self.fill + n, kept[n:]
            if self.fill == len(self.frame):
                self.seconds["gather"] += time.thread_time() - start
                self.flush()
                start = time.thread_time()
        self.seconds["gather"] += time.thread_time() - start

    def flush(self) -> None:
        data = self.frame[: self.fill].data.cast("B")
        t0 = time.thread_time()
        frame = self.compressor.compress(data)
        t1 = time.thread_time()
        page_digests(data, self.page_size)
        t2 = time.thread_time()
        self.out.write(frame)
        self.seconds["compress"] += t1 - t0
        self.seconds["digests"] += t2 - t1
        self.seconds["write"] += time.thread_time() - t2
        self.fill = 0


def report(times: dict, floor: dict[str, float], pages: int, cores: int) -> None:
    wall = {name: statistics.median(t for t, _ in runs) for name, runs in times.items()}
    cpu = {name: statistics.median(c for _, c in runs) for name, runs in times.items()}
    total = sum(floor.values())
    print(f"{'':12}{'wall s':>9}{'CPU s':>9}")
    for name in times:
        print(f"{name:12}{wall[name]:9.3f}{cpu[name]:9.3f}")
    print(f"floor (one thread, {pages} non-zero pages): " + ", ".join(f"{k} {v:.3f}" for k, v in floor.items()))
    print(f"{'floor':12}{total / cores:9.3f}{total:9.3f}   (wall: CPU / {cores} cores)")
    z_wall, z_cpu = wall["zstd"], cpu["zstd"]
    print(f"convert / zstd: wall {wall['convert'] / z_wall:.2f}, CPU {cpu['convert'] / z_cpu:.2f}")
    print(f"floor / zstd:   wall {total / cores / z_wall:.2f}, CPU {total / z_cpu:.2f}")
    print(f"compress alone / zstd CPU: {floor['compress'] / z_cpu:.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("save", type=Path)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp"))
    options = parser.parse_args(argv)
    with open(options.save, "rb") as f:  # into the page cache: every run reads it warm
        while f.read(16 << 20):
            pass
    work = Path(tempfile.mkdtemp(prefix="leanimg-bench-floor-", dir=options.workdir))
    try:
        times = rounds(options.save, work, options.runs)
        with open(work / "frames", "wb", buffering=0) as out:
            floor = Floor(out)
            seconds = floor.measure(options.save)
    finally:
        shutil.rmtree(work)
    report(times, seconds, floor.pages, os.cpu_count() or 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
