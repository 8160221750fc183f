"""The data floor of a chain restore (issue 15 §3): what reading its frames costs before any
restore work, per depth, for chains an earlier ``bench_chain.py --keep`` run left.

A restore of a chain's last link must read, check and decompress whole every frame that holds
a page it restores (the frames also hold pages later links superseded).  This script does
exactly that and nothing else, on two threads as the restore's read-ahead workers do: the
record of every needed PAGE_FRAME and DELTA_FRAME read (pread), its checksum computed (xxh3-64),
its zstd frame decompressed into a buffer used again.  Warm (files in the page cache) and cold
(evicted first), beside a cold read of the chain's whole files in order (bench_chain's "cold
read").  A restore cannot be faster than its cold floor; the floor's own ratios between depths
say how far depth alone moves it.

    python benchmarks/bench_chain_floor.py --reuse /var/tmp/chain256/bench-chain-01hkavxy
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from leanimg.compression import declared_size, decompress_into
from leanimg.format import FRAME_PAGES_MAX_BYTES, RECORD, PageClass
from leanimg.reader import LeanImage

from bench_chain import evict

WORKERS = 2  # as LeanImage.enable_read_ahead's default


def needed_records(last: Path) -> list[tuple[str, int, int, int, int, int]]:
    """(path, record offset, record size, frame offset in the record, frame length, content
    size) of every frame a restore of ``last`` decompresses, link by link, frame order."""
    jobs = []
    with LeanImage.open(last) as image:
        for region in image.regions:
            r = image.resolution(region)
            for link_index, link in enumerate(r.links):
                stored = (r.base_class == PageClass.STORED) & (r.base_link == link_index)
                tables = link.tables
                for table, frames in (
                    (tables.page_frames, np.unique(r.base_frame[stored])),
                    (tables.delta_frames, np.unique(r.delta_frames[r.delta_links == link_index])),
                ):
                    for frame in frames.tolist():
                        jobs.append(_job(link.path, tables.frame_record(table, frame)))
    return jobs


def _job(path, record) -> tuple[str, int, int, int, int, int]:
    frame = record.parsed["frame"]  # the body's tail (structures.parse_body)
    start = RECORD.size + record.body_length - len(frame)
    return str(path), record.offset, record.size, start, len(frame), declared_size(frame)


def data_path(jobs: list, files: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of reading, checking and decompressing ``jobs`` on WORKERS threads."""
    fds = {path: os.open(path, os.O_RDONLY) for path in files}
    local = threading.local()

    def one(job) -> int:
        path, offset, size, start, length, content = job
        raw = os.pread(fds[path], size, offset)
        xxhash.xxh3_64_intdigest(memoryview(raw)[:-8])
        out = getattr(local, "out", None)
        if out is None or len(out) < content:
            out = local.out = bytearray(max(content, 4 << 20))
        decompress_into(memoryview(raw)[start : start + length], out, expected=content, limit=FRAME_PAGES_MAX_BYTES)
        return size

    try:
        t0, c0 = time.perf_counter(), os.times()
        with ThreadPoolExecutor(WORKERS) as pool:
            sum(pool.map(one, jobs))
        c1 = os.times()
        return time.perf_counter() - t0, c1.user + c1.system - c0.user - c0.system
    finally:
        for fd in fds.values():
            os.close(fd)


def cold_read(files: list[str]) -> tuple[float, float]:
    """(wall s, CPU s) of reading the files whole, in order, cold (bench_chain's cold read)."""
    evict(files)
    t0, c0 = time.perf_counter(), os.times()
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 22):
                pass
    c1 = os.times()
    return time.perf_counter() - t0, c1.user + c1.system - c0.user - c0.system


def measure(work: Path, depth: int, repeat: int) -> dict:
    files = sorted(str(p) for p in (work / f"depth{depth}").glob(f"d{depth}-*.lean"))
    jobs = needed_records(Path(files[-1]))
    runs = {"warm": [], "cold": [], "read": []}
    for _ in range(repeat):
        data_path(jobs, files)  # warms the cache
        runs["warm"].append(data_path(jobs, files))
        evict(files)
        runs["cold"].append(data_path(jobs, files))
        runs["read"].append(cold_read(files))
    median = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    return dict(depth=depth, frames=len(jobs), mib=sum(j[2] for j in jobs) / 2**20, **median)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--reuse",
        required=True,
        type=Path,
        metavar="DIR",
        help="the chains of a bench_chain.py --keep run (DIR/depthD/dD-NNNN.lean)",
    )
    parser.add_argument("--depths", type=lambda v: [int(x) for x in v.split(",")], default=[10, 100, 1000])
    parser.add_argument("--repeat", type=int, default=3, help="runs per depth (medians reported)")
    args = parser.parse_args(argv)
    rows = [measure(args.reuse, depth, args.repeat) for depth in args.depths]
    print(
        f"data floor of a restore ({WORKERS} threads: pread + record checksum + zstd into a reused buffer), "
        f"median of {args.repeat}; wall s / CPU s"
    )
    print(f"  {'depth':>6} {'frames':>7} {'MiB':>7} {'warm':>13} {'cold':>13} {'cold read of files':>19}")
    for r in rows:
        print(
            f"  {r['depth']:>6} {r['frames']:>7} {r['mib']:7.0f} {r['warm'][0]:6.3f}/{r['warm'][1]:5.2f} "
            f"{r['cold'][0]:6.3f}/{r['cold'][1]:5.2f} {r['read'][0]:12.3f}/{r['read'][1]:5.2f}"
        )
    base = {r["depth"]: r for r in rows}.get(10)
    if base:
        for r in rows:
            if r["depth"] != 10:
                print(
                    f"  cold floor depth{r['depth']}/depth10 = {r['cold'][0] / base['cold'][0]:.2f} (wall), "
                    f"{r['cold'][1] / base['cold'][1]:.2f} (CPU)"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
