"""A real 1 GiB QEMU save: `leanimg convert` / `restore --to qemu` against zstd and cat.

Issue 3 §8.  The test guest (tests/guest) boots with ``-m 1024`` and runs, one after
another in the same guest (tests/guest/scenarios.py, BENCH_STEPS):

  pagecache /mnt        read ~320 MiB of files (256 MiB word-salad text, 64 MiB random)
  anon 128              128 MiB of random anonymous memory
  dirty /mnt 64         64 MiB of random data written to a file, not synced

then it is stopped and migrated to ``WORKDIR/vm.save`` (``exec:cat > FILE``).  The save is
cached: ``--reuse`` skips the boot when WORKDIR already holds it.

Then, in the same run, N times each (interleaved, medians reported), every input evicted
from the page cache first with posix_fadvise(DONTNEED) ("cold"; drop_caches is not
writable here):

  convert     leanimg convert SAVE -o IMG                     (the writer fsyncs IMG)
  zstd        zstd -T0 -3 SAVE -o SAVE.zst, then fsync        (the obvious alternative)
  restore     leanimg restore IMG --to qemu -o - > /dev/null  (what -incoming exec: runs)
  zstd -d     zstd -d -c SAVE.zst > /dev/null
  cat         cat SAVE > /dev/null                            (the I/O floor)

and the sizes of SAVE, SAVE.zst and IMG.  Once, outside the timings, it checks that the
restored stream is SAVE byte for byte.  Targets: convert <= zstd, restore <= zstd -d,
IMG <= SAVE.zst.

    python benchmarks/bench_qemu.py --workdir /var/tmp/leanimg-bench --reuse --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import require_null_device
from leanimg.fileutil import evict_from_page_cache, fsync_path, sha256_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from guest.build import build_guest  # noqa: E402
from guest.scenarios import BENCH_DISK, BENCH_MEM_MIB, BENCH_STEPS, run_scenario  # noqa: E402


def leanimg_command() -> list[str]:
    script = Path(sys.executable).parent / "leanimg"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "leanimg.cli"]




def timed(argv: list[str], *, cold: list[Path], stdout=subprocess.DEVNULL,
          after=None) -> dict:
    """Run ``argv`` once with ``cold`` inputs evicted; wall and child CPU seconds."""
    for path in cold:
        evict_from_page_cache(path)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=stdout, stderr=subprocess.PIPE)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} failed ({proc.returncode}):\n"
                         f"{proc.stderr.decode(errors='replace')}")
    if after:
        after()
    wall = time.perf_counter() - t0
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall": wall, "cpu": (used.ru_utime - before.ru_utime) + (used.ru_stime - before.ru_stime)}


def make_save(workdir: Path, reuse: bool, mem_mib: int) -> dict:
    save, meta_path = workdir / "vm.save", workdir / "save.json"
    if reuse and save.is_file() and meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("save_size") == save.stat().st_size and meta.get("mem_mib") == mem_mib:
            print(f"reusing {save} ({meta['save_size'] / 2**20:.1f} MiB)")
            return meta
    print(f"building the guest (disk {BENCH_DISK}) and booting it with -m {mem_mib} ...")
    build = build_guest(BENCH_DISK)
    guest_dir = workdir / "guest"
    shutil.rmtree(guest_dir, ignore_errors=True)
    t0 = time.monotonic()
    last = BENCH_STEPS[-1][0]
    saves = run_scenario(guest_dir, BENCH_STEPS, mem_mib=mem_mib, build=build,
                         workload_timeout=1200, log=lambda m: print(f"  {m}", flush=True),
                         save_after={last})
    sp = saves[last]
    os.replace(sp.save, save)
    mem = _memory_mix(sp.mem)
    meta = {"mem_mib": mem_mib, "steps": [list(w) for _, w in BENCH_STEPS],
            "disk_spec": str(BENCH_DISK), "save_size": save.stat().st_size,
            "save_seconds": sp.save_seconds, "scenario_seconds": time.monotonic() - t0,
            "guest_memory": mem}
    shutil.rmtree(guest_dir, ignore_errors=True)      # pmemsave, disk copies: not needed
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _memory_mix(pmem: Path) -> dict:
    """Zero / non-zero pages of guest RAM (from the pmemsave ground truth)."""
    import numpy as np
    nonzero = total = 0
    with open(pmem, "rb") as f:
        while chunk := f.read(64 << 20):
            pages = np.frombuffer(chunk, np.uint64).reshape(-1, 512)
            nonzero += int(pages.any(axis=1).sum())
            total += len(pages)
    return {"pages": total, "nonzero_pages": nonzero, "nonzero_fraction": nonzero / total}




def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/leanimg-bench-qemu"))
    ap.add_argument("--reuse", action="store_true", help="reuse WORKDIR/vm.save if present")
    ap.add_argument("--runs", "-n", type=int, default=3, help="repeats per measurement")
    ap.add_argument("--mem-mib", type=int, default=BENCH_MEM_MIB)
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    require_null_device()
    for tool in ("zstd", "cat"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed")
    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)
    meta = make_save(wd, args.reuse, args.mem_mib)

    leanimg = leanimg_command()
    save, img, zst = wd / "vm.save", wd / "vm.lean", wd / "vm.save.zst"
    for stale in (img, zst):
        stale.unlink(missing_ok=True)
    # warm the interpreter's own files (imports) so the first timed run is not special
    subprocess.run([*leanimg, "--version"], check=True, capture_output=True)

    runs: dict[str, list[dict]] = {k: [] for k in
                                   ("convert", "zstd", "restore", "zstd -d", "cat")}
    null = open(os.devnull, "wb")
    for i in range(args.runs):
        runs["convert"].append(timed([*leanimg, "convert", str(save), "-o", str(img), "-f"],
                                     cold=[save]))
        runs["zstd"].append(timed(["zstd", "-T0", "-3", "-q", "-f", str(save), "-o", str(zst)],
                                  cold=[save], after=lambda: fsync_path(zst)))
        runs["restore"].append(timed([*leanimg, "restore", str(img), "--to", "qemu", "-o", "-"],
                                     cold=[img], stdout=null))
        runs["zstd -d"].append(timed(["zstd", "-d", "-c", "-q", str(zst)], cold=[zst],
                                     stdout=null))
        runs["cat"].append(timed(["cat", str(save)], cold=[save], stdout=null))
        print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]['wall']:.2f}s"
                                                       for k, v in runs.items()), flush=True)
    null.close()

    # correctness, outside the timings: the restored stream is the save, byte for byte
    rebuilt = wd / "rebuilt.save"
    subprocess.run([*leanimg, "restore", str(img), "--to", "qemu", "-o", str(rebuilt), "-f"],
                   check=True)
    identical = sha256_file(rebuilt) == sha256_file(save)
    rebuilt.unlink()
    inspect = json.loads(subprocess.run([*leanimg, "inspect", "--json", str(img)], check=True,
                                        capture_output=True).stdout)

    med = {k: statistics.median(r["wall"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu"] for r in v) for k, v in runs.items()}
    sizes = {"save": save.stat().st_size, "zstd": zst.stat().st_size, "lean": img.stat().st_size}
    ratios = {"convert / zstd -T0 -3": med["convert"] / med["zstd"],
              "restore / zstd -d": med["restore"] / med["zstd -d"],
              "restore / cat": med["restore"] / med["cat"],
              "lean size / zstd size": sizes["lean"] / sizes["zstd"],
              "save size / lean size": sizes["save"] / sizes["lean"]}
    targets = {"convert <= zstd": med["convert"] <= med["zstd"],
               "restore <= zstd -d": med["restore"] <= med["zstd -d"],
               "lean <= zstd": sizes["lean"] <= sizes["zstd"]}

    mib = sizes["save"] / 2**20
    print()
    print(f"QEMU save of a {args.mem_mib} MiB guest: {mib:.1f} MiB, "
          f"{meta['guest_memory']['nonzero_fraction']:.0%} of guest RAM non-zero; "
          f"median of {args.runs}, cold inputs")
    print(f"{'step':<10} {'wall s':>8} {'cpu s':>8} {'MiB/s of save':>14}")
    for k in runs:
        print(f"{k:<10} {med[k]:>8.2f} {cpu[k]:>8.2f} {mib / med[k]:>14.0f}")
    print()
    print(f"{'file':<10} {'MiB':>10} {'% of save':>10}")
    for k, v in sizes.items():
        print(f"{k:<10} {v / 2**20:>10.1f} {100 * v / sizes['save']:>9.1f}%")
    print()
    for k, v in ratios.items():
        print(f"{k:<24} {v:.2f}")
    print("targets: " + ", ".join(f"{k} {'MET' if v else 'MISSED'}" for k, v in targets.items()))
    print(f"restored stream identical to the save: {identical}")

    result = {
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else argv,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "zstd": subprocess.run(["zstd", "--version"], capture_output=True,
                                           text=True).stdout.strip()},
        "save": meta, "runs": args.runs, "runs_detail": runs, "median_wall_s": med,
        "median_cpu_s": cpu, "sizes": sizes, "ratios": ratios, "targets": targets,
        "restored_identical": identical,
        "image_classes": inspect.get("classes", inspect),
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
