"""`convert --disk` where the disk work is at its worst: a save full of the disk's blocks.

Issue 34 §1 (`convert --disk` <= 1.2x `zstd -T0 -3`). A synthetic QEMU stream (tests/helpers
qemu_save) of a 1 GiB guest holding BLOCKS distinct non-zero blocks of DISK (4 KiB-aligned,
at random guest pages: as many page-cache pages as a Debian server's) and RANDOM pages of
random data among zero pages, so that DISK pages, stored pages and zero pages interleave
page by page. Then, interleaved, N rounds of

  convert   leanimg convert SAVE -o IMG -f --disk vda=DISK   (the writer fsyncs IMG)
  zstd      zstd -q -T0 -3 -f SAVE -o SAVE.zst, then fsync   (the obvious alternative)

each cold (SAVE and DISK evicted from the page cache first) and warm; ``--a LEANIMG`` adds
another build's console script as A (see bench_ab.py), compared in the same rounds.
DISK defaults to the Debian guest's disk of bench_distro.py (guest/debian, cached under
/var/tmp/leanimg-debian-guest), which must be built first.

    python benchmarks/bench_disk_lookup.py --runs 3
    python benchmarks/bench_disk_lookup.py --a /var/tmp/old/.venv/bin/leanimg --runs 3
"""

from __future__ import annotations

import argparse
import glob
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "tests"))
from common import compile_checkout, timed  # noqa: E402
from leanimg.fileutil import fsync_path  # noqa: E402

PS = 4096
GUEST_PAGES = 1 << 18  # 1 GiB


def debian_disk() -> str | None:
    found = sorted(glob.glob("/var/tmp/leanimg-debian-guest/*/disk.img"))
    return found[-1] if found else None


def make_save(path: Path, disk: str, blocks: int, random_pages: int, seed: int = 7) -> None:
    from helpers import qemu_save

    rng = np.random.default_rng(seed)
    on_disk = np.memmap(disk, np.uint8, "r").reshape(-1, PS)
    nonzero = np.flatnonzero(on_disk[:, ::512].any(axis=1))  # a sampled byte: cheap, enough
    ram = np.zeros((GUEST_PAGES, PS), np.uint8)
    slots = rng.permutation(GUEST_PAGES)
    ram[slots[:blocks]] = on_disk[np.sort(rng.choice(nonzero, blocks, replace=False))]
    ram[slots[blocks : blocks + random_pages]] = rng.integers(0, 256, (random_pages, PS), dtype=np.uint8)
    path.write_bytes(qemu_save(ram.tobytes()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--disk", help="a raw disk image (default: the Debian guest's)")
    ap.add_argument("--blocks", type=int, default=137_000, help="guest pages copied from the disk")
    ap.add_argument("--random-pages", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--a", help="another build's leanimg, timed as A beside this one (B)")
    ap.add_argument("--workdir", default="/var/tmp")
    args = ap.parse_args(argv)
    disk = args.disk or debian_disk()
    if disk is None:
        raise SystemExit("no --disk given and no Debian guest built (python benchmarks/bench_distro.py builds it)")
    builds = {"B": str(REPO / ".venv" / "bin" / "leanimg")} | ({"A": args.a} if args.a else {})
    for leanimg in builds.values():
        compile_checkout(leanimg)
    work = Path(tempfile.mkdtemp(prefix="leanimg-bench-disk-lookup-", dir=args.workdir))
    try:
        save = work / "vm.save"
        make_save(save, disk, args.blocks, args.random_pages)
        commands = {
            name: [leanimg, "convert", save, "-o", work / f"{name}.lean", "-f", "--disk", f"vda={disk}"]
            for name, leanimg in builds.items()
        }
        zst = work / "vm.save.zst"
        commands["zstd"] = ["zstd", "-q", "-T0", "-3", "-f", save, "-o", zst]
        times: dict[tuple[str, str], list[float]] = {}
        for run in range(args.runs):
            for name in commands if run % 2 == 0 else reversed(commands):
                for temp in ("cold", "warm"):
                    after = (lambda: fsync_path(str(zst))) if name == "zstd" else None  # that file, as convert
                    cold = (save, disk) if temp == "cold" else ()
                    times.setdefault((name, temp), []).append(timed(commands[name], cold=cold, after=after)["wall"])
        size = save.stat().st_size / 2**20
        print(
            f"save {size:.0f} MiB: {args.blocks} pages from {disk}, {args.random_pages} random; medians of {args.runs}"
        )
        for temp in ("cold", "warm"):
            zstd = statistics.median(times[("zstd", temp)])
            line = [f"{temp}: zstd -T0 -3 + fsync {zstd:.2f} s"]
            for name in builds:
                t = statistics.median(times[(name, temp)])
                line.append(f"convert --disk {name} {t:.2f} s ({t / zstd:.2f}x zstd)")
            print("; ".join(line))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
