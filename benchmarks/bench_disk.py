"""DISK references on a real 1 GiB QEMU save: size, and cold restore sorted vs unsorted vs inline.

Issue 4 §4 and §6. The guest of bench_qemu.py (tests/guest, BENCH_STEPS: ~320 MiB of files
read from its ext4 disk, 128 MiB anonymous, 64 MiB dirty page cache) is saved together with
its disk as it was at that moment (cached in WORKDIR; ``--reuse``). Then, in the same run:

  size        vm.save, zstd -T0 -3 of it, lean without --disk (inline), lean with --disk vda=
  convert     leanimg convert (--disk) against zstd -T0 -3, cold inputs, once
  restore     N times each, interleaved, every input evicted first (posix_fadvise DONTNEED):
                inline     leanimg restore inline.lean --to raw -o OUT
                sorted     leanimg restore disk.lean --disk vda=RAW --to raw -o OUT
                unsorted   ... --no-sort-blocks
                qcow2      ... --disk vda=QCOW2 (sorted by host-file offset)
  scan        the disk scan alone over a 20 GiB sparse raw disk holding the guest disk's data
              (and its qcow2 copy), against reading the same data ranges (the I/O floor)

Target (§4): restore with disk references no slower than the same pages stored inline.

    python benchmarks/bench_disk.py --workdir /var/tmp/leanimg-bench-disk --reuse
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from bench_qemu import leanimg_command, timed
from leanimg.fileutil import evict_from_page_cache, sha256_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from guest.build import build_guest  # noqa: E402
from guest.scenarios import BENCH_DISK, BENCH_MEM_MIB, BENCH_STEPS, run_scenario  # noqa: E402

BIG_DISK = 20 << 30


def make_save(workdir: Path, reuse: bool) -> None:
    save, disk = workdir / "vm.save", workdir / "disk.img"
    if reuse and save.is_file() and disk.is_file():
        print(f"reusing {save} ({save.stat().st_size / 2**20:.1f} MiB) and {disk}")
        return
    print(f"building the guest (disk {BENCH_DISK}), booting it with -m {BENCH_MEM_MIB} ...", flush=True)
    guest_dir = workdir / "guest"
    shutil.rmtree(guest_dir, ignore_errors=True)
    last = BENCH_STEPS[-1][0]
    sp = run_scenario(
        guest_dir,
        BENCH_STEPS,
        mem_mib=BENCH_MEM_MIB,
        build=build_guest(BENCH_DISK),
        workload_timeout=1200,
        log=lambda m: print(f"  {m}", flush=True),
        save_after={last},
    )[last]
    os.replace(sp.save, save)
    os.replace(sp.disk, disk)
    shutil.rmtree(guest_dir, ignore_errors=True)


def class_pages(leanimg: list[str], image: Path) -> dict[str, int]:
    info = json.loads(
        subprocess.run([*leanimg, "inspect", "--json", str(image)], check=True, capture_output=True).stdout
    )
    return Counter(info["classes"])


def sparse_copy(src: Path, dst: Path, size: int) -> None:
    """``src``'s bytes at the start of a sparse file of ``size`` bytes (holes stay holes)."""
    subprocess.run(["cp", "--sparse=always", str(src), str(dst)], check=True)
    os.truncate(dst, size)


def time_scan(save: Path, disk_path: Path, leanimg_dir: Path) -> dict:
    """The disk scan alone (index built from the save first, not timed), cold, vs reading
    the same data ranges with one pread each."""
    from leanimg.converters import qemu
    from leanimg.converters.diskrefs import PageIndex, scan_disk
    from leanimg.disks import open_disk

    with open(save, "rb") as f:
        state, ram = qemu.load_stream(f, leanimg_dir)
    index = PageIndex(4096)
    with ram:
        for i, block in enumerate(state.ram_blocks):
            page = 0
            for chunk in ram.page_source(block):
                index.add(i, page, chunk)
                page += len(chunk) // 4096
    index.freeze()
    disk = open_disk(str(disk_path), "vda")
    try:
        evict_from_page_cache(disk_path)
        t0 = time.perf_counter()
        scanned = scan_disk(index, disk, 0)
        scan = time.perf_counter() - t0
        evict_from_page_cache(disk_path)
        t0 = time.perf_counter()
        for start, length in disk.data_ranges():
            for at in range(start, start + length, 8 << 20):
                disk.read(at, min(8 << 20, start + length - at))
        read = time.perf_counter() - t0
    finally:
        disk.close()
    return {
        "scan_s": scan,
        "read_s": read,
        "scanned_mib": scanned / 2**20,
        "disk_pages": int((index.disk_ids >= 0).sum()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/leanimg-bench-disk"))
    ap.add_argument("--reuse", action="store_true", help="reuse WORKDIR/vm.save and disk.img if present")
    ap.add_argument("--runs", "-n", type=int, default=3, help="repeats per restore measurement")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)
    make_save(wd, args.reuse)
    leanimg = leanimg_command()
    save, raw = wd / "vm.save", wd / "disk.img"
    inline, lean, zst, qcow2, out = (
        wd / n for n in ("inline.lean", "disk.lean", "vm.save.zst", "disk.qcow2", "out.raw")
    )
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", str(raw), str(qcow2)], check=True)

    convert = {
        "zstd -T0 -3": timed(["zstd", "-T0", "-3", "-q", "-f", str(save), "-o", str(zst)], cold=[save])["wall"],
        "convert inline": timed([*leanimg, "convert", str(save), "-o", str(inline), "-f"], cold=[save])["wall"],
        "convert --disk": timed(
            [*leanimg, "convert", str(save), "-o", str(lean), "-f", "--disk", f"vda={raw}"], cold=[save, raw]
        )["wall"],
    }
    pages = class_pages(leanimg, lean)
    variants = {
        "inline": ([*leanimg, "restore", str(inline), "--to", "raw", "-o", str(out), "-f"], [inline]),
        "sorted": (
            [*leanimg, "restore", str(lean), "--to", "raw", "-o", str(out), "-f", "--disk", f"vda={raw}"],
            [lean, raw],
        ),
        "unsorted": (
            [
                *leanimg,
                "restore",
                str(lean),
                "--to",
                "raw",
                "-o",
                str(out),
                "-f",
                "--disk",
                f"vda={raw}",
                "--no-sort-blocks",
            ],
            [lean, raw],
        ),
        "qcow2 sorted": (
            [*leanimg, "restore", str(lean), "--to", "raw", "-o", str(out), "-f", "--disk", f"vda={qcow2}"],
            [lean, qcow2],
        ),
        "qcow2 unsorted": (
            [
                *leanimg,
                "restore",
                str(lean),
                "--to",
                "raw",
                "-o",
                str(out),
                "-f",
                "--disk",
                f"vda={qcow2}",
                "--no-sort-blocks",
            ],
            [lean, qcow2],
        ),
    }
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for i in range(args.runs):
        for name, (argv_, cold) in variants.items():
            out.unlink(missing_ok=True)
            runs[name].append(timed(argv_, cold=cold)["wall"])
        print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in runs.items()), flush=True)
    rebuilt = wd / "rebuilt.save"
    subprocess.run(
        [*leanimg, "restore", str(lean), "--to", "qemu", "-o", str(rebuilt), "-f", "--disk", f"vda={qcow2}"], check=True
    )
    identical = sha256_file(rebuilt) == sha256_file(save)
    rebuilt.unlink()
    out.unlink(missing_ok=True)

    big = wd / "big.img"
    sparse_copy(raw, big, BIG_DISK)
    big_qcow2 = wd / "big.qcow2"
    subprocess.run(["qemu-img", "convert", "-O", "qcow2", str(big), str(big_qcow2)], check=True)
    scans = {"20 GiB raw": time_scan(save, big, wd), "20 GiB qcow2": time_scan(save, big_qcow2, wd)}
    big.unlink()
    big_qcow2.unlink()

    med = {k: statistics.median(v) for k, v in runs.items()}
    sizes = {
        "save": save.stat().st_size,
        "zstd -T0 -3": zst.stat().st_size,
        "lean inline": inline.stat().st_size,
        "lean --disk": lean.stat().st_size,
    }
    nonzero = pages["STORED"] + pages["DISK"]
    print()
    print(
        f"DISK pages: {pages['DISK']} ({pages['DISK'] * 4096 / 2**20:.1f} MiB) = "
        f"{100 * pages['DISK'] / nonzero:.1f}% of the {nonzero} non-zero pages"
    )
    print(f"{'file':<14} {'MiB':>9} {'vs save':>8} {'vs zstd':>8}")
    for k, v in sizes.items():
        print(f"{k:<14} {v / 2**20:>9.1f} {v / sizes['save']:>8.3f} {v / sizes['zstd -T0 -3']:>8.3f}")
    print()
    for k, v in convert.items():
        print(f"{k:<16} {v:6.2f} s (x{v / convert['zstd -T0 -3']:.2f} of zstd)")
    print(f"\ncold restore --to raw, median of {args.runs}:")
    for k, v in med.items():
        print(f"  {k:<16} {v:6.2f} s   x{v / med['inline']:.2f} of inline")
    print("\ndisk scan, cold:")
    for k, v in scans.items():
        print(
            f"  {k:<14} scan {v['scan_s']:.2f} s for {v['scanned_mib']:.0f} MiB of data "
            f"({v['scanned_mib'] / v['scan_s']:.0f} MiB/s); reading those ranges alone {v['read_s']:.2f} s "
            f"({v['scanned_mib'] / v['read_s']:.0f} MiB/s); {v['disk_pages']} pages matched"
        )
    print(
        f"\ntarget sorted <= inline: {'MET' if med['sorted'] <= med['inline'] else 'MISSED'}; "
        f"restored stream identical to the save: {identical}"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "pages": pages,
                    "sizes": sizes,
                    "convert": convert,
                    "restore": runs,
                    "scan": scans,
                    "identical": identical,
                },
                indent=2,
            )
            + "\n"
        )
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
