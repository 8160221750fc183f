"""A real distribution guest: Debian 12 with PostgreSQL under pgbench and a gcc build (issue 34 §4).

The guest (guest/debian/build.sh, cached under /var/tmp/leanimg-debian-guest) is a Debian 12
root file system made by mmdebstrap from Debian's packages (systemd, PostgreSQL 15 with
shared_buffers = 256MB, gcc/make, Debian's 6.1 kernel and its initrd) on a raw ext4 disk,
booted in QEMU 7.2 under TCG (-m MEM, one vCPU, i440fx) with root=/dev/vda. Through its
control channel (benchmarks/distro_guest.py) the guest runs, in turn:

  pginit      createdb, pgbench -i -s SCALE, pg_prewarm of the tables (a warmed-up server)
  pgbench     pgbench -c 4 -j 1 -T PGBENCH_SECONDS
  build       untar and compile lua 5.4 and zlib (Debian's source packages) with gcc -O2
  idle        IDLE_SECONDS of nothing, so that the memory the processes had is free again

then, the guest idle, on its memory (sizes against QEMU's plain save and ``zstd -T0 -3`` of it;
times of the rounds as medians of --repeat, interleaved; inputs evicted from the page cache):

  save        stop, QEMU ``migrate "exec:cat > FILE"``, fsync; the guest stays stopped while
  zstd        zstd -T0 -3 SAVE, fsync                       (the obvious alternative)
  convert     leanimg convert SAVE                           (zero pages, compression)
  convert --disk  leanimg convert SAVE --disk vda=DISK       (pages found on the disk: DISK)
  (cont)
  checkpoint --disk                   leanimg checkpoint --disk vda=DISK (stop mode, --then
                                      continue; the first freezes DISK into an overlay, later
                                      ones refer to the same frozen DISK)
  checkpoint --live --guest-free --disk   the same, --live --max-bandwidth LIVE_BANDWIDTH, with
                                      the guest's free-list helper (guest/leanimg-guest-free.c,
                                      a systemd unit in the guest): free pages become FREE
  each round also times QEMU's own stop save (exec:cat, then fsync) as the baseline

and last a chain: the guest serves a light pgbench load (2 clients, 5 tx/s) while CHAIN
``leanimg checkpoint --live [--parent PREV] --keep-stream STREAM`` run CHAIN_INTERVAL seconds
apart; each link is set against a page-level incremental: the pages whose content differs
between the raw restores of the link and its parent, compressed with zstd -3 (as
bench_link_size.py). The chain is taken without --disk: ``checkpoint --parent P --disk`` failed
("page N is on disk 'vda': pass --disk vda=PATH") when a page that was a DISK page of P had
changed, because checkpoint opened P without lending it the disks (fixed since: it lends them,
as convert --parent does). So the kept streams are also converted with ``convert --parent --disk vda=DISK`` into a
second chain: the link sizes the checkpoint would have with --disk.

    python benchmarks/bench_distro.py --json /var/tmp/distro.json
    python benchmarks/bench_distro.py --scale 20 --pgbench-seconds 180 --idle-seconds 120 \\
        --repeat 3 --chain 5 --chain-interval 60

Slow (~21 min on 2 cores under TCG, plus ~5-10 min for the first guest build); not run by CI.
The work folder (default /var/tmp/leanimg-bench-distro) is removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zstandard
from common import require_null_device, timed
from distro_guest import DistroVM, build
from leanimg.cli import command_line
from leanimg.fileutil import fsync_path

LEANIMG = command_line()
PAGE = 4096
MIB = 1 << 20
CLASSES = ("STORED", "ZERO", "DISK", "FREE", "PARENT", "DELTA")
CHAIN_LOAD = (2, 5)  # pgbench clients, tx/s while the chain is taken


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ running things


def classes_of(image: Path) -> dict:
    """Pages per class, stored bytes per record type and the size of ``image``."""
    out = subprocess.run([*LEANIMG, "inspect", "--json", str(image)], check=True, capture_output=True, text=True)
    doc = json.loads(out.stdout)
    return {"bytes": image.stat().st_size, "classes": doc["classes"], "record_bytes": doc["record_bytes"]}


def medians(rounds: list[dict]) -> dict:
    keys = [k for k, v in rounds[0].items() if isinstance(v, (int, float))]
    return {k: statistics.median(r[k] for r in rounds) for k in keys}


# ------------------------------------------------------------------------------ the workload


def workload(vm: DistroVM, args) -> dict:
    phases = {}
    steps = (
        ("pginit", f"leanimg-workload pginit {args.scale}"),
        ("pgbench", f"leanimg-workload pgbench {args.pgbench_seconds}"),
        ("build", "leanimg-workload build"),
    )
    for name, command in steps if args.gcc else steps[:2]:
        t0 = time.monotonic()
        lines = vm.run(command, timeout=3600)
        phases[name] = time.monotonic() - t0
        tps = [x for x in lines if x.startswith("tps =")]
        log(f"{name}: {phases[name]:.0f} s {tps[-1] if tps else ''}")
        if tps:
            phases["pgbench_tps"] = float(tps[-1].split()[2])
    phases["meminfo_before_idle"] = vm.meminfo()
    time.sleep(args.idle_seconds)
    phases["idle"] = args.idle_seconds
    phases["meminfo_idle"] = vm.meminfo()
    log(f"idle {args.idle_seconds} s; meminfo {phases['meminfo_idle']}")
    return phases


# ------------------------------------------------------------------------------ save and convert


def plain_save(vm: DistroVM, save: Path) -> dict:
    """Stop, QEMU's exec:cat save, fsync; the guest stays stopped."""
    vm.stop()
    t0 = time.perf_counter()
    info = vm.save(save)
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    fsync_path(str(save))
    return {"save_s": seconds, "fsync_s": time.perf_counter() - t1, "downtime_ms": info.get("downtime")}


def conversion_round(save: Path, disk: Path, work: Path) -> dict:
    zst, img, dimg = work / "vm.save.zst", work / "convert.lean", work / "convert-disk.lean"
    zstd = timed(["zstd", "-T0", "-3", "-q", "-f", save, "-o", zst], [save], after=lambda: fsync_path(str(zst)))
    convert = timed([*LEANIMG, "convert", save, "-o", img, "-f"], [save])
    convert_disk = timed([*LEANIMG, "convert", save, "-o", dimg, "-f", "--disk", f"vda={disk}"], [save, disk])
    return {"zstd_s": zstd["wall"], "convert_s": convert["wall"], "convert_disk_s": convert_disk["wall"]} | {
        "zstd_cpu_s": zstd["cpu"],
        "convert_cpu_s": convert["cpu"],
        "convert_disk_cpu_s": convert_disk["cpu"],
    }


def convert_phase(vm: DistroVM, work: Path, disk: Path, repeat: int, keep: bool = False) -> dict:
    save = work / "vm.save"
    result = {"save": plain_save(vm, save)}
    rounds = []
    for k in range(repeat):
        rounds.append(conversion_round(save, disk, work))
        log(f"conversion round {k + 1}/{repeat}: " + ", ".join(f"{a} {b:.2f}" for a, b in rounds[-1].items()))
    vm.cont()
    result["rounds"], result["median"] = rounds, medians(rounds)
    result["sizes"] = {"save": save.stat().st_size, "zstd": (work / "vm.save.zst").stat().st_size}
    result["convert"] = classes_of(work / "convert.lean")
    result["convert_disk"] = classes_of(work / "convert-disk.lean")
    if not keep:
        for path in (save, work / "vm.save.zst", work / "convert.lean", work / "convert-disk.lean"):
            path.unlink()
    return result


# ------------------------------------------------------------------------------ checkpoints


def checkpoint(vm: DistroVM, image: Path, *extra) -> dict:
    run = timed([*LEANIMG, "-v", "checkpoint", "--qmp", vm.leanimg_qmp, "-o", image, "-f", *extra])
    paused = re.search(r"guest paused (\d+) ms", run["stdout"])
    info = classes_of(image) | {"wall_s": run["wall"], "cpu_s": run["cpu"], "summary": run["stdout"]}
    info["paused_ms"] = int(paused.group(1)) if paused else None  # against qemu_stop_save's qemu_save_s
    steps = dict(
        (m.group(2), float(m.group(1)))
        for m in re.finditer(r"checkpoint +([\d.]+) s +\(\+[\d.]+\) +(.+)", run["stderr"])
    )
    if "migration completed" in steps and "ready to migrate" in steps:
        info["migration_s"] = steps["migration completed"] - steps["ready to migrate"]
    return info


def qemu_stop_save(vm: DistroVM, path: Path) -> dict:
    """QEMU's own stop-and-save until the guest runs again, and the fsync after it."""
    vm.stop()
    t0 = time.perf_counter()
    vm.save(path)
    vm.cont()
    seconds = time.perf_counter() - t0
    t1 = time.perf_counter()
    fsync_path(str(path))
    out = {"qemu_save_s": seconds, "qemu_fsync_s": time.perf_counter() - t1}
    path.unlink()
    return out


def checkpoint_round(vm: DistroVM, work: Path, disk: Path, bandwidth: int) -> dict:
    out = qemu_stop_save(vm, work / "qemu.save")
    stop = checkpoint(vm, work / "stop-disk.lean", "--disk", f"vda={disk}")
    live_args = ["--live", "--max-bandwidth", bandwidth, "--guest-free", vm.free_sock, "--disk", f"vda={disk}"]
    live = checkpoint(vm, work / "live-free-disk.lean", *live_args)
    return out | {"stop_disk": stop, "live_free_disk": live}


def checkpoint_phase(vm: DistroVM, work: Path, disk: Path, args) -> dict:
    helper = vm.run("systemctl is-active leanimg-guest-free; ls /sys/class/virtio-ports", check=False)
    log(f"guest free-list helper: {' '.join(helper)}")
    rounds = []
    for k in range(args.repeat):
        rounds.append(checkpoint_round(vm, work, disk, args.live_bandwidth))
        r = rounds[-1]
        log(f"checkpoint round {k + 1}/{args.repeat}: QEMU {r['qemu_save_s']:.2f}+{r['qemu_fsync_s']:.2f} s")
        log(f"  stop --disk: {r['stop_disk']['summary']} ({r['stop_disk']['wall_s']:.2f} s)")
        log(f"  live --guest-free --disk: {r['live_free_disk']['summary']} ({r['live_free_disk']['wall_s']:.2f} s)")
    return {"helper": helper, "rounds": rounds}


# ------------------------------------------------------------------------------ the chain


def chain_phase(vm: DistroVM, work: Path, args) -> list[dict]:
    """``--chain`` live checkpoints against the previous one, each keeping QEMU's stream."""
    clients, rate = CHAIN_LOAD
    vm.start(f"leanimg-workload pgbench {args.chain * args.chain_interval + 120} {clients} {rate}")
    time.sleep(10)
    folder = work / "chain"
    folder.mkdir()
    links, t0 = [], time.monotonic()
    for i in range(args.chain):
        image, stream = folder / f"cp{i + 1}.lean", work / f"cp{i + 1}.stream"
        parent = ["--parent", links[-1]["path"]] if links else []
        links.append(checkpoint(vm, image, "--live", "--keep-stream", stream, *parent) | {"path": str(image)})
        log(f"chain cp{i + 1}: {links[-1]['summary']} ({links[-1]['wall_s']:.2f} s)")
        if i + 1 < args.chain:
            time.sleep(max(0.0, t0 + (i + 1) * args.chain_interval - time.monotonic()))
    return links


def disk_chain(links: list[dict], work: Path, disk: Path) -> list[dict]:
    """The chain's kept streams converted with ``--disk``: the links a ``checkpoint --parent
    --disk`` chain would have (the measured chain was taken before that worked)."""
    folder = work / "disk-chain"
    folder.mkdir()
    out = []
    for i in range(len(links)):
        image, stream = folder / f"cp{i + 1}.lean", work / f"cp{i + 1}.stream"
        parent = ["--parent", out[-1]["path"]] if out else []
        run = timed([*LEANIMG, "convert", stream, "-o", image, "--disk", f"vda={disk}", *parent])
        out.append(classes_of(image) | {"path": str(image), "wall_s": run["wall"]})
        stream.unlink()
    return out


def raw_restore(link: str, out: Path, *disk) -> np.ndarray:
    subprocess.run(
        [*LEANIMG, "restore", link, "--to", "raw", "-o", str(out), "-f", *disk], check=True, capture_output=True
    )
    return np.memmap(out, np.uint8, "r").reshape(-1, PAGE)


def changed_zstd3(before: np.ndarray, after: np.ndarray) -> tuple[int, int]:
    """(pages that differ, bytes of zstd -3 of those pages of ``after``), in 64 MiB steps."""
    compressor = zstandard.ZstdCompressor(level=3).compressobj()
    pages, size, step = 0, 0, 16384
    for start in range(0, len(after), step):
        a, b = after[start : start + step], before[start : start + step]
        n = min(len(a), len(b))
        changed = np.concatenate([np.flatnonzero((a[:n] != b[:n]).any(axis=1)), np.arange(n, len(a))])
        pages += len(changed)
        size += len(compressor.compress(np.ascontiguousarray(a[changed]).tobytes()))
    return pages, size + len(compressor.flush())


def link_baselines(links: list[dict], disk_links: list[dict], disk: Path, work: Path) -> None:
    """Adds each link's page-level incremental (changed pages, their zstd -3 bytes); checks
    that the --disk chain's link restores to the same memory."""
    raws = [work / "raw-a", work / "raw-b"]
    before = None
    for i, (link, disk_link) in enumerate(zip(links, disk_links)):
        after = raw_restore(link["path"], raws[i % 2])
        disk_link["same_memory"] = bool(
            np.array_equal(after, raw_restore(disk_link["path"], work / "raw-d", "--disk", f"vda={disk}"))
        )
        if before is not None:
            link["changed_pages"], link["page_incremental_bytes"] = changed_zstd3(before, after)
        before = after
    for path in [*raws, work / "raw-d"]:
        path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------ the report


def mib_by_class(info: dict) -> str:
    c = info["classes"]
    return " ".join(f"{k} {c[k] * PAGE / MIB:.0f}" for k in CLASSES if c.get(k))


def summary_rows(r: dict) -> list[dict]:
    """One row per way of keeping the idle guest's memory: bytes, seconds, the classes."""
    c, m, rounds = r["convert"], r["convert"]["median"], r["checkpoints"]["rounds"]

    def med(name: str, key: str) -> float:
        return statistics.median(x[name][key] for x in rounds)

    rows = [
        {"name": "QEMU save (exec:cat)", "bytes": c["sizes"]["save"], "seconds": c["save"]["save_s"]},
        {"name": "zstd -T0 -3 of it", "bytes": c["sizes"]["zstd"], "seconds": m["zstd_s"]},
        {"name": "leanimg convert", "bytes": c["convert"]["bytes"], "seconds": m["convert_s"], "info": c["convert"]},
    ]
    rows.append(
        {"name": "leanimg convert --disk", "bytes": c["convert_disk"]["bytes"], "seconds": m["convert_disk_s"]}
        | {"info": c["convert_disk"]}
    )
    for name, key in (
        ("checkpoint --disk (stop)", "stop_disk"),
        ("checkpoint --live --guest-free --disk", "live_free_disk"),
    ):
        rows.append({"name": name, "bytes": med(key, "bytes"), "seconds": med(key, "wall_s"), "info": rounds[-1][key]})
    save, zstd = rows[0]["bytes"], rows[1]["bytes"]
    everything = c["convert"]["classes"]
    for row in rows:
        row["vs_save"], row["vs_zstd"] = row["bytes"] / save - 1, row["bytes"] / zstd
        row["kept_pages"] = kept_pages(row.get("info", {"classes": everything}))
    return rows


def kept_pages(info: dict) -> float:
    """The share of guest pages whose bytes the file keeps (seed 000's measure: its Xen saves
    kept every page of RAM, uncompressed): STORED and DELTA pages. For QEMU's save and its zstd
    the classes of the plain convert are given: every page that is not zero."""
    c = info["classes"]
    return (c.get("STORED", 0) + c.get("DELTA", 0)) / sum(c.values())


def header(r: dict) -> list[str]:
    meminfo = r["workload"]["meminfo_idle"]
    return [
        f"Debian 12 guest, {r['mem_mib']} MiB, kernel {r['kernel']}, QEMU 7.2 TCG; pgbench -s {r['args']['scale']} "
        f"({r['workload'].get('pgbench_tps', 0):.1f} tps), gcc build, {r['args']['idle_seconds']} s idle",
        "guest /proc/meminfo when measured (MiB): "
        + ", ".join(f"{k} {v / 1024:.0f}" for k, v in meminfo.items() if k != "MemTotal"),
        f"times: medians of {r['args']['repeat']}; load average {r['load_average'][0]:.1f} on {os.cpu_count()} cores",
        "kept: the share of guest pages whose bytes are kept (STORED, DELTA; for the save: not zero)",
        "",
    ]


def size_table(r: dict) -> list[str]:
    rows, rounds = r["summary"], r["checkpoints"]["rounds"]
    lines = [f"{'':<38} {'MB':>8} {'vs save':>8} {'x zstd':>7} {'kept':>6} {'wall s':>7}  MiB of guest memory by class"]
    for row in rows:
        classes = mib_by_class(row["info"]) if "info" in row else ""
        lines.append(
            f"{row['name']:<38} {row['bytes'] / 1e6:8.1f} {100 * row['vs_save']:+7.1f}% {row['vs_zstd']:7.3f} "
            f"{100 * row['kept_pages']:5.1f}% "
            f"{row['seconds']:7.2f}  {classes}".rstrip()
        )
    qemu = statistics.median(x["qemu_save_s"] for x in rounds)
    durable = statistics.median(x["qemu_save_s"] + x["qemu_fsync_s"] for x in rounds)
    m = r["convert"]["median"]
    return lines + [
        "",
        f"convert / zstd time {m['convert_s'] / m['zstd_s']:.2f}x, "
        f"convert --disk / zstd {m['convert_disk_s'] / m['zstd_s']:.2f}x; QEMU's own stop save "
        f"until running again {qemu:.2f} s, then fsync {durable:.2f} s",
        f"live --guest-free (--max-bandwidth {r['args']['live_bandwidth']}): {rounds[-1]['live_free_disk']['summary']}",
        "",
    ]


def chain_table(r: dict) -> list[str]:
    lines = [
        f"chain: {r['args']['chain']} x checkpoint --live [--parent PREV], {r['args']['chain_interval']} s apart, "
        f"pgbench -c {CHAIN_LOAD[0]} -R {CHAIN_LOAD[1]} running; --disk: their streams, convert --parent --disk",
        "page-level: zstd -3 of the pages that differ from the previous link; ratio: link / page-level",
        f"{'link':<5} {'changed pages':>14} {'page-level MB':>14} {'link MB':>8} {'ratio':>6} "
        f"{'--disk MB':>9} {'ratio':>6}  MiB by class (link; --disk link)",
    ]
    for i, (link, disk) in enumerate(zip(r["chain"], r["disk_chain"]), 1):
        base = link.get("page_incremental_bytes")
        pages = f"{link['changed_pages']:>14} {base / 1e6:>14.2f}" if base else " " * 29
        ratios = [f"{x['bytes'] / base:6.3f}" if base else " " * 6 for x in (link, disk)]
        lines.append(
            f"cp{i:<3} {pages} {link['bytes'] / 1e6:8.2f} {ratios[0]} {disk['bytes'] / 1e6:9.2f} {ratios[1]}  "
            f"{mib_by_class(link)}; {mib_by_class(disk)}"
        )
    same = all(x["same_memory"] for x in r["disk_chain"])
    return lines + [f"the --disk chain restores to the same memory as the checkpoint chain, link by link: {same}"]


def report(r: dict) -> str:
    return "\n".join(header(r) + size_table(r) + chain_table(r))


# ------------------------------------------------------------------------------ main


def run(args) -> dict:
    guest = build(log)
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    disk = work / "disk.img"
    subprocess.run(["cp", "--sparse=always", str(guest.disk), str(disk)], check=True)
    results = {"args": vars(args), "mem_mib": args.mem_mib, "kernel": guest.kernel_version, "guest": str(guest.folder)}
    with DistroVM(guest, disk, work, args.mem_mib) as vm:
        results["boot_s"] = vm.wait_booted()
        log(f"booted in {results['boot_s']:.0f} s")
        results["workload"] = workload(vm, args)
        results["convert"] = convert_phase(vm, work, disk, args.repeat, keep=args.keep)
        results["checkpoints"] = checkpoint_phase(vm, work, disk, args)
        results["chain"] = chain_phase(vm, work, args)
        results["load_average"] = os.getloadavg()
    results["disk_chain"] = disk_chain(results["chain"], work, disk)
    link_baselines(results["chain"], results["disk_chain"], disk, work)
    results["summary"] = summary_rows(results)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mem-mib", type=int, default=1024)
    ap.add_argument("--scale", type=int, default=20, help="pgbench -i -s (default 20, ~300 MB)")
    ap.add_argument("--pgbench-seconds", type=int, default=180)
    ap.add_argument("--idle-seconds", type=int, default=120)
    ap.add_argument("--no-gcc", dest="gcc", action="store_false", help="skip the gcc build (a quick trial run)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of conversions and of checkpoints (medians)")
    ap.add_argument("--live-bandwidth", type=int, default=128, metavar="MIB/S")
    ap.add_argument("--chain", type=int, default=5, help="checkpoints in the chain")
    ap.add_argument("--chain-interval", type=int, default=60, metavar="SECONDS")
    ap.add_argument("--workdir", default="/var/tmp/leanimg-bench-distro")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (disk, overlays, save, images)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    require_null_device()
    try:
        results = run(args)
    finally:
        if not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)
    results["command"] = shlex.join([sys.executable, *sys.argv])
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
