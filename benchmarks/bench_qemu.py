"""A real 1 GiB QEMU save: `leanimg convert` / `restore --to qemu` against zstd and cat.

Issue 3 §8, issue 31 §5.  The test guest (tests/guest) boots with ``-m 1024`` in the QEMU
``--qemu`` names (7.2, Debian's, or 10.0, tests/guest/qemus.py; its default i440fx machine,
``-machine pc``) and runs, one after another in the same guest (tests/guest/scenarios.py,
BENCH_STEPS):

  pagecache /mnt        read ~320 MiB of files (256 MiB word-salad text, 64 MiB random)
  anon 128              128 MiB of random anonymous memory
  dirty /mnt 64         64 MiB of random data written to a file, not synced

then it is stopped and migrated to ``WORKDIR/vm.save`` (``exec:cat > FILE``).  The save is
cached with the QEMU that made it (version, machine): ``--reuse`` skips the boot when
WORKDIR holds a save of the same QEMU, memory size (and mapped-ram file, if asked for).
WORKDIR defaults to /var/tmp/leanimg-bench-qemu-VERSION.

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
IMG <= SAVE.zst.  On a machine shared with other work the wall-clock medians of the two
sides can meet different load, so it also reports each pair's median per-round ratio and
its CPU-time ratio.

``--mapped-ram`` (QEMU 10.0 only): right after the plain save the guest is continued,
stopped again and saved once more with the capability mapped-ram (``migrate file:MAPPED``;
QEMU 10 refuses a second migrate of a guest a migration left paused, hence ``cont`` then
``stop``, as tests/guest/scenarios.save_point does), so the two saves hold nearly, not
exactly, the same memory.  QEMU's own time for that save is recorded (``migrate`` to
``completed`` as seen over QMP, and query-migrate's total-time; QEMU does not fsync a file:
migration, so the fsync after it is timed apart), ``--qemu-saves`` times (the first file
is kept, the others only timed).  The timing loop then adds

  convert mapped-ram  leanimg convert MAPPED -o MIMG          (against convert SAVE)
  restore mapped-ram  leanimg restore MIMG --to qemu-mapped-ram -o FILE, then fsync
                      (against QEMU's own mapped-ram save of the live guest's RAM)

and the sizes of MAPPED (apparent and allocated) and MIMG; once, outside the timings, the
restored mapped-ram file is compared with MAPPED (cmp).

``--cpus 0`` runs every timed command (both sides) on CPU 0 only (``taskset -c``): the ratio
when neither side can spread its work over cores.

    python benchmarks/bench_qemu.py --qemu 10.0 --mapped-ram --reuse --json out.json
    python benchmarks/bench_qemu.py --qemu 10.0 --reuse --cpus 0
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common
from common import require_null_device
from leanimg.fileutil import fsync_path, sha256_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from guest.build import build_guest  # noqa: E402
from guest.qemus import QEMU_7_2, QEMU_10_0, version_of  # noqa: E402
from guest.scenarios import (  # noqa: E402
    BENCH_DISK,
    BENCH_MEM_MIB,
    BENCH_STEPS,
    save_point,
    wait_heartbeat,
)
from guest.vm import GuestVM, copy_disk  # noqa: E402

QEMUS = {q.version: q for q in (QEMU_7_2, QEMU_10_0)}
MAPPED_RAM_SINCE = (10, 0)  # the QEMUs this benchmark runs that write mapped-ram files


def leanimg_command() -> list[str]:
    script = Path(sys.executable).parent / "leanimg"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "leanimg.cli"]


PINNED: list[str] = []  # --cpus: every timed command runs under taskset -c LIST


def timed(argv: list[str], *, cold: list[Path], stdout=subprocess.DEVNULL, after=None) -> dict:
    """Run ``argv`` once with ``cold`` inputs evicted; wall and child CPU seconds."""
    run = common.timed([*PINNED, *argv], cold, stdout, after)
    return {"wall": run["wall"], "cpu": run["cpu"]}


def qemu_identity(qemu) -> dict:
    return {
        "version": qemu.version,
        "full_version": version_of(qemu.binary),
        "binary": qemu.binary,
        "machine": qemu.machine,
    }


def _cached(workdir: Path, qemu, mem_mib: int, mapped_ram: bool) -> tuple[dict | None, str]:
    """The cached save's metadata if it fits this run, else None and why not."""
    save, meta_path = workdir / "vm.save", workdir / "save.json"
    if not (save.is_file() and meta_path.is_file()):
        return None, f"no save in {workdir}"
    meta = json.loads(meta_path.read_text())
    made_by = meta.get("qemu") or {"version": "7.2", "machine": "pc"}  # older caches: 7.2 only
    if (made_by.get("version"), made_by.get("machine")) != (qemu.version, qemu.machine):
        return None, (
            f"the save in {workdir} was made by QEMU {made_by.get('version')} "
            f"-machine {made_by.get('machine')}, not {qemu.version} -machine {qemu.machine}"
        )
    if meta.get("save_size") != save.stat().st_size or meta.get("mem_mib") != mem_mib:
        return None, f"the save in {workdir} is of another size or guest"
    if mapped_ram:
        mr = meta.get("mapped_ram")
        path = workdir / "vm.mapped-ram"
        if not mr or not path.is_file() or mr.get("size") != path.stat().st_size:
            return None, f"{workdir} holds no mapped-ram file of the same guest moment"
    return meta, ""


def make_save(workdir: Path, reuse: bool, mem_mib: int, qemu, mapped_ram: bool, qemu_saves: int) -> dict:
    if reuse:
        meta, why = _cached(workdir, qemu, mem_mib, mapped_ram)
        if meta is not None:
            print(
                f"reusing {workdir / 'vm.save'} ({meta['save_size'] / 2**20:.1f} MiB, "
                f"QEMU {meta['qemu']['full_version']})"
            )
            return meta
        print(f"not reusing: {why}")
    save, meta_path = workdir / "vm.save", workdir / "save.json"
    meta_path.unlink(missing_ok=True)
    for stale in (save, workdir / "vm.mapped-ram"):
        stale.unlink(missing_ok=True)
    print(
        f"building the guest (disk {BENCH_DISK}) and booting it in QEMU {qemu.version} "
        f"(-machine {qemu.machine}) with -m {mem_mib} ..."
    )
    build = build_guest(BENCH_DISK)
    guest_dir = workdir / "guest"
    shutil.rmtree(guest_dir, ignore_errors=True)
    guest_dir.mkdir(parents=True)
    t0 = time.monotonic()
    say = lambda m: print(f"  {m}", flush=True)  # noqa: E731
    # run_scenario's boot and workloads, with the mapped-ram save(s) added after the plain one
    disk = copy_disk(build.disk, guest_dir / "disk.img")
    (guest_dir / "source").mkdir()
    mapped = None
    with GuestVM(build, disk, mem_mib=mem_mib, workdir=guest_dir / "source", qemu=qemu) as vm:
        t1 = time.monotonic()
        vm.wait_ready(timeout=300)
        say(f"booted in {time.monotonic() - t1:.1f} s")
        for name, workload in BENCH_STEPS:
            t1 = time.monotonic()
            vm.run_workload(*workload, timeout=1200)
            wait_heartbeat(vm, workload[0], 0)
            say(f"workload {' '.join(workload)}: {time.monotonic() - t1:.1f} s")
        name, workload = BENCH_STEPS[-1]
        sp = save_point(vm, guest_dir, name, workload)  # stop, exec:cat save, pmemsave, cont
        say(f"saved {name}: {sp.save.stat().st_size / 2**20:.1f} MiB in {sp.save_seconds:.1f} s")
        if mapped_ram:
            mapped = mapped_ram_saves(vm, workdir / "vm.mapped-ram", qemu_saves, say)
    os.replace(sp.save, save)
    mem = _memory_mix(sp.mem)
    meta = {
        "qemu": qemu_identity(qemu),
        "mem_mib": mem_mib,
        "made_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_when_made": os.getloadavg(),
        "steps": [list(w) for _, w in BENCH_STEPS],
        "disk_spec": str(BENCH_DISK),
        "save_size": save.stat().st_size,
        "save_seconds": sp.save_seconds,
        "scenario_seconds": time.monotonic() - t0,
        "guest_memory": mem,
    }
    if mapped is not None:
        meta["mapped_ram"] = mapped
    shutil.rmtree(guest_dir, ignore_errors=True)  # pmemsave, disk copies: not needed
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def mapped_ram_saves(vm: GuestVM, path: Path, count: int, say) -> dict:
    """``count`` mapped-ram saves of the running guest, each after ``cont`` and ``stop``
    (QEMU 10 refuses to migrate a guest that a migration left paused); the first is kept
    at ``path``, the others are only timed.  QEMU's wall time (``migrate`` to
    ``completed``, polled every 5 ms), its total-time, and the fsync after it (QEMU does
    not sync a file: migration)."""
    vm.qmp.execute(
        "migrate-set-capabilities",
        capabilities=[{"capability": "mapped-ram", "state": True}, {"capability": "multifd", "state": False}],
    )
    vm.qmp.execute("migrate-set-parameters", **{"max-bandwidth": 1 << 40})
    saves = []
    for i in range(count):
        target = path if i == 0 else path.with_name(path.name + ".extra")
        target.unlink(missing_ok=True)
        if i:
            vm.cont()  # save_point continued the guest after the plain save; each round does too
        vm.stop()
        t0 = time.perf_counter()
        vm.qmp.execute("migrate", uri=f"file:{target}")
        while True:
            info = vm.qmp.execute("query-migrate")
            if info.get("status") == "completed":
                wall = time.perf_counter() - t0
                break
            if info.get("status") in ("failed", "cancelled"):
                raise SystemExit(f"mapped-ram migrate {info.get('status')}: {info}")
            if time.perf_counter() - t0 > 600:
                raise SystemExit(f"mapped-ram migrate not complete after 600 s: {info}")
            time.sleep(0.005)
        t1 = time.perf_counter()
        fsync_path(target)
        fsync_s = time.perf_counter() - t1
        st = target.stat()
        saves.append(
            {
                "wall_s": wall,
                "total_time_ms": info.get("total-time"),
                "downtime_ms": info.get("downtime"),
                "fsync_s": fsync_s,
                "size": st.st_size,
                "allocated": st.st_blocks * 512,
                "ram": info.get("ram"),
            }
        )
        say(
            f"mapped-ram save {i + 1}/{count}: {st.st_size / 2**20:.1f} MiB apparent, "
            f"{st.st_blocks * 512 / 2**20:.1f} MiB allocated; migrate→completed {wall:.2f} s, "
            f"total-time {info.get('total-time')} ms, fsync after {fsync_s:.2f} s"
        )
        if i:
            target.unlink()
    vm.cont()
    first = saves[0]
    return {
        "size": first["size"],
        "allocated": first["allocated"],
        "saves": saves,
        "wall_s_median": statistics.median(s["wall_s"] for s in saves),
        "total_time_ms_median": statistics.median(s["total_time_ms"] for s in saves),
        "fsync_s_median": statistics.median(s["fsync_s"] for s in saves),
        "wall_plus_fsync_s_median": statistics.median(s["wall_s"] + s["fsync_s"] for s in saves),
        "capabilities": {"mapped-ram": True, "multifd": False},
    }


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


def _load(loadavg) -> str:
    return f"{loadavg[0]:.1f}" if loadavg else "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--qemu",
        choices=sorted(QEMUS),
        default="7.2",
        help="the QEMU that boots the guest and makes the save (its -machine pc)",
    )
    ap.add_argument(
        "--mapped-ram",
        action="store_true",
        help="also save as a mapped-ram file and time convert/restore of it (QEMU >= 10.0)",
    )
    ap.add_argument(
        "--qemu-saves", type=int, default=3, help="with --mapped-ram: QEMU's mapped-ram saves timed (the first is kept)"
    )
    ap.add_argument("--workdir", type=Path, help="default /var/tmp/leanimg-bench-qemu-VERSION")
    ap.add_argument("--reuse", action="store_true", help="reuse WORKDIR's save if the same QEMU made it")
    ap.add_argument("--runs", "-n", type=int, default=3, help="repeats per measurement")
    ap.add_argument("--mem-mib", type=int, default=BENCH_MEM_MIB)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--cpus", help="run every timed command on these CPUs only (taskset -c, e.g. 0)")
    args = ap.parse_args(argv)
    if args.cpus:
        PINNED[:] = ["taskset", "-c", args.cpus]
    qemu = QEMUS[args.qemu]
    if args.mapped_ram and tuple(map(int, qemu.version.split("."))) < MAPPED_RAM_SINCE:
        ap.error(
            f"--mapped-ram needs --qemu 10.0: QEMU {qemu.version} writes no mapped-ram "
            f"files (the capability came in QEMU 9.0)"
        )
    if args.qemu_saves < 1:
        ap.error("--qemu-saves must be at least 1")
    require_null_device()
    for tool in ("zstd", "cat", "cmp"):
        if not shutil.which(tool):
            raise SystemExit(f"{tool} is not installed")
    wd = args.workdir or Path(f"/var/tmp/leanimg-bench-qemu-{qemu.version}")
    wd.mkdir(parents=True, exist_ok=True)
    if not (args.reuse and _cached(wd, qemu, args.mem_mib, args.mapped_ram)[0]):
        if why := qemu.missing():
            raise SystemExit(f"QEMU {qemu.version}: {why}")
    load_before = os.getloadavg()
    meta = make_save(wd, args.reuse, args.mem_mib, qemu, args.mapped_ram, args.qemu_saves)

    leanimg = leanimg_command()
    save, img, zst = wd / "vm.save", wd / "vm.lean", wd / "vm.save.zst"
    mapped, mimg, mout = wd / "vm.mapped-ram", wd / "vm-mapped.lean", wd / "restored.mapped-ram"
    for stale in (img, zst, mimg, mout):
        stale.unlink(missing_ok=True)
    # warm the interpreter's own files (imports) so the first timed run is not special
    subprocess.run([*leanimg, "--version"], check=True, capture_output=True)

    steps = ["convert", "zstd", "restore", "zstd -d", "cat"]
    if args.mapped_ram:
        steps += ["convert mapped-ram", "restore mapped-ram"]
    runs: dict[str, list[dict]] = {k: [] for k in steps}
    null = open(os.devnull, "wb")
    for i in range(args.runs):
        runs["convert"].append(timed([*leanimg, "convert", str(save), "-o", str(img), "-f"], cold=[save]))
        runs["zstd"].append(
            timed(
                ["zstd", "-T0", "-3", "-q", "-f", str(save), "-o", str(zst)], cold=[save], after=lambda: fsync_path(zst)
            )
        )
        runs["restore"].append(
            timed([*leanimg, "restore", str(img), "--to", "qemu", "-o", "-"], cold=[img], stdout=null)
        )
        runs["zstd -d"].append(timed(["zstd", "-d", "-c", "-q", str(zst)], cold=[zst], stdout=null))
        runs["cat"].append(timed(["cat", str(save)], cold=[save], stdout=null))
        if args.mapped_ram:
            runs["convert mapped-ram"].append(
                timed([*leanimg, "convert", str(mapped), "-o", str(mimg), "-f"], cold=[mapped])
            )
            mout.unlink(missing_ok=True)  # a new file, as QEMU's file: migration makes
            runs["restore mapped-ram"].append(
                timed(
                    [*leanimg, "restore", str(mimg), "--to", "qemu-mapped-ram", "-o", str(mout)],
                    cold=[mimg],
                    after=lambda: fsync_path(mout),
                )
            )
        print(
            f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]['wall']:.2f}s" for k, v in runs.items()), flush=True
        )
    null.close()
    load_after = os.getloadavg()

    # correctness, outside the timings: the restored stream is the save, byte for byte
    rebuilt = wd / "rebuilt.save"
    subprocess.run([*leanimg, "restore", str(img), "--to", "qemu", "-o", str(rebuilt), "-f"], check=True)
    identical = sha256_file(rebuilt) == sha256_file(save)
    rebuilt.unlink()
    inspect = json.loads(
        subprocess.run([*leanimg, "inspect", "--json", str(img)], check=True, capture_output=True).stdout
    )
    mapped_identical = None
    if args.mapped_ram:
        # the last timed restore's file (fsynced) against QEMU's own mapped-ram file
        cmp = subprocess.run(["cmp", str(mout), str(mapped)], capture_output=True, text=True)
        mapped_identical = cmp.returncode == 0
        if not mapped_identical:
            print(f"cmp {mout} {mapped}: {(cmp.stdout + cmp.stderr).strip()}")
        mst = mout.stat()
        restored_mapped = {"size": mst.st_size, "allocated": mst.st_blocks * 512}
        mout.unlink()

    med = {k: statistics.median(r["wall"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu"] for r in v) for k, v in runs.items()}
    sizes = {"save": save.stat().st_size, "zstd": zst.stat().st_size, "lean": img.stat().st_size}
    if args.mapped_ram:
        sizes["mapped-ram"] = mapped.stat().st_size
        sizes["mapped-ram alloc"] = mapped.stat().st_blocks * 512
        sizes["lean of mapped"] = mimg.stat().st_size
        sizes["restored mapped alloc"] = restored_mapped["allocated"]
    ratios = {
        "convert / zstd -T0 -3": med["convert"] / med["zstd"],
        "restore / zstd -d": med["restore"] / med["zstd -d"],
        "restore / cat": med["restore"] / med["cat"],
        "lean size / zstd size": sizes["lean"] / sizes["zstd"],
        "save size / lean size": sizes["save"] / sizes["lean"],
    }
    targets = {
        "convert <= zstd": med["convert"] <= med["zstd"],
        "restore <= zstd -d": med["restore"] <= med["zstd -d"],
        "lean <= zstd": sizes["lean"] <= sizes["zstd"],
    }
    # the same ratios less exposed to other load on the machine: the median of each round's
    # own ratio (both sides timed seconds apart), and of CPU seconds rather than wall
    pairs = [("convert", "zstd"), ("restore", "zstd -d")]
    if args.mapped_ram:
        pairs.append(("convert mapped-ram", "convert"))
    paired = {
        f"{a} / {b}": {
            "wall, median per round": statistics.median(x["wall"] / y["wall"] for x, y in zip(runs[a], runs[b])),
            "cpu, median per round": statistics.median(x["cpu"] / y["cpu"] for x, y in zip(runs[a], runs[b])),
            "cpu, of medians": cpu[a] / cpu[b],
        }
        for a, b in pairs
    }
    qemu_mapped = None
    if args.mapped_ram:
        mr = meta["mapped_ram"]
        qemu_mapped = {
            "migrate→completed (median)": mr["wall_s_median"],
            "query-migrate total-time (median)": mr["total_time_ms_median"] / 1000,
            "fsync after it (median)": mr["fsync_s_median"],
            "migrate→completed + fsync (median)": mr["wall_plus_fsync_s_median"],
        }
        ratios.update(
            {
                "convert mapped-ram / convert plain": med["convert mapped-ram"] / med["convert"],
                "restore mapped-ram / QEMU mapped-ram save": med["restore mapped-ram"] / mr["wall_s_median"],
                "restore mapped-ram / QEMU total-time": med["restore mapped-ram"] / (mr["total_time_ms_median"] / 1000),
                "restore mapped-ram / QEMU save + fsync": med["restore mapped-ram"] / mr["wall_plus_fsync_s_median"],
                "lean of mapped / lean of plain": sizes["lean of mapped"] / sizes["lean"],
                "mapped-ram alloc / lean of mapped": sizes["mapped-ram alloc"] / sizes["lean of mapped"],
            }
        )

    mib = sizes["save"] / 2**20
    print()
    print(
        f"QEMU {meta['qemu']['full_version']} (-machine {meta['qemu']['machine']}) save of a "
        f"{args.mem_mib} MiB guest: {mib:.1f} MiB, "
        f"{meta['guest_memory']['nonzero_fraction']:.0%} of guest RAM non-zero; "
        f"median of {args.runs}, cold inputs; load average {load_before[0]:.1f} before, "
        f"{load_after[0]:.1f} after the timings"
    )
    if args.mapped_ram:
        print(
            "the mapped-ram file is a second save of the same guest, continued and stopped "
            "again right after the plain save: nearly, not exactly, the same memory"
        )
    print(f"{'step':<20} {'wall s':>8} {'cpu s':>8} {'MiB/s of save':>14}")
    for k in runs:
        print(f"{k:<20} {med[k]:>8.2f} {cpu[k]:>8.2f} {mib / med[k]:>14.0f}")
    if qemu_mapped:
        print(
            f"QEMU's own mapped-ram save of the live guest's RAM, median of "
            f"{len(meta['mapped_ram']['saves'])} (QEMU does not fsync it), timed when the save "
            f"was made ({meta.get('made_at', '?')}, load average "
            f"{_load(meta.get('loadavg_when_made'))}), not in this loop:"
        )
        for k, v in qemu_mapped.items():
            print(f"  {k:<36} {v:>8.2f} s")
    print()
    print(f"{'file':<22} {'MiB':>10} {'% of save':>10}")
    for k, v in sizes.items():
        print(f"{k:<22} {v / 2**20:>10.1f} {100 * v / sizes['save']:>9.1f}%")
    print()
    for k, v in ratios.items():
        print(f"{k:<42} {v:.2f}")
    print(f"{'paired':<42} {'wall/rnd':>8} {'cpu/rnd':>8} {'cpu med':>8}")
    for k, v in paired.items():
        print(f"{k:<42} " + " ".join(f"{x:>8.2f}" for x in v.values()))
    if args.cpus:
        print(f"every timed command ran on CPU(s) {args.cpus} only (taskset -c)")
    print("targets: " + ", ".join(f"{k} {'MET' if v else 'MISSED'}" for k, v in targets.items()))
    print(f"restored stream identical to the save: {identical}")
    if args.mapped_ram:
        print(f"restored mapped-ram file identical to QEMU's (cmp): {mapped_identical}")

    result = {
        "command": shlex.join([sys.executable, *sys.argv]) if argv is None else argv,
        "machine": {
            "cpus": os.cpu_count(),
            "pinned_to": args.cpus,
            "python": platform.python_version(),
            "zstd": subprocess.run(["zstd", "--version"], capture_output=True, text=True).stdout.strip(),
            "loadavg_before": load_before,
            "loadavg_after": load_after,
        },
        "qemu": meta["qemu"],
        "save": meta,
        "runs": args.runs,
        "runs_detail": runs,
        "median_wall_s": med,
        "median_cpu_s": cpu,
        "sizes": sizes,
        "ratios": ratios,
        "paired_ratios": paired,
        "targets": targets,
        "restored_identical": identical,
        "image_classes": inspect.get("classes", inspect),
    }
    if args.mapped_ram:
        result["mapped_ram"] = {
            "qemu_save_s": qemu_mapped,
            "restored_identical": mapped_identical,
            "restored_file": restored_mapped,
            "note": "a second save of the guest continued and stopped again "
            "after the plain one: nearly the same memory; QEMU's time "
            "is of a live process's RAM, not of a file",
        }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if identical and mapped_identical is not False else 1


if __name__ == "__main__":
    sys.exit(main())
