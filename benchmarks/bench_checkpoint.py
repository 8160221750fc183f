"""`leanimg checkpoint` of a running guest against QEMU's own saves (issue 13 §6).

The test guest (tests/guest) boots with ``-m MEM`` and reads a quarter of its memory worth of
files from its ext4 disk (page cache: half word-salad text, half random), then fills half of
its memory with random data and frees it (stale free pages). Two guests, in one run:

  plain     no balloon: `stop`, QEMU's ``migrate "exec:cat > FILE"``, then ``zstd -T0 -3 FILE``
            — what a QEMU user gets by default; then, in the same guest (it has the
            virtio-serial port of guest/leanimg-guest-free.c and runs the helper):
            ``leanimg checkpoint --live`` without and with ``--guest-free`` (route iii: the
            guest's own free pages become FREE, no balloon), and with ``--guest-free --disk``,
            all at ``--live-bandwidth`` so the first pass gives the helper time to answer
  balloon   ``-device virtio-balloon-pci,free-page-reporting=on`` (the guest's virtio_balloon
            hands its free blocks to QEMU, which discards them), then in the same guest:
            1. QEMU's own stop-and-save to ``exec:cat`` (its stop to cont is the guest's pause
               under QEMU's save), an fsync of the file and its ``zstd -T0 -3`` size: the share
               the balloon gives without leanimg; then QEMU's stop-and-save through
               ``exec:zstd -q -T0 -3 > FILE.zst`` and an fsync of that file. The three baselines
               of issue 34 §3: exec:cat, exec:cat + fsync, exec:zstd -T0 -3 + fsync
            2. ``leanimg checkpoint --disk vda=DISK`` (default mode: stop, migrate, cont; the disk
               frozen with an overlay): image size, wall time (until the image is durable) against
               1.'s three baselines and the guest's pause (the summary's "guest paused") against
               QEMU's exec:cat pause; then the same without ``--disk`` (no spool: the pages
               stream into the writer)
            3. QEMU's own ``background-snapshot`` migrate to exec:cat: wall time and downtime
            4. ``leanimg checkpoint --background``: image size, wall time, downtime
            1.-4. run ``--repeat`` times in turn (default 3); medians are reported

``--skip-balloon`` runs the plain guest only (a brief run for the guest free-hint numbers).

Targets (issue 13 §6): image 2. <= 0.2 x the plain save's zstd; 4.'s downtime <= 50 ms;
each checkpoint's wall time <= 1.2 x QEMU's own migrate in the same mode. Issue 34 §3 (medians
of >= 3 rounds): 2.'s guest pause <= QEMU's own pause for exec:cat, with and without ``--disk``;
2.'s wall time until the image is durable <= 1.5 x exec:cat + fsync, and kept <=
exec:zstd -T0 -3 + fsync (the durable, compressed save a QEMU user gets without leanimg).
QEMU's exec:cat writes the stream into the page cache and does not fsync it; leanimg compresses
and fsyncs its image, so its CPU seconds, QEMU's save followed by an fsync, and the checkpoint's
own timeline (``checkpoint -v``: the migration, the work after it, the fsync, the rest) are
reported too.
The machine is shared (the load average is reported): read the times as indications.

    python benchmarks/bench_checkpoint.py --mem-mib 1024 --repeat 3 --workdir /var/tmp/leanimg-ckpt --json out.json
    python benchmarks/bench_checkpoint.py --mem-mib 384 --skip-balloon
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from guest.build import DiskSpec, build_guest  # noqa: E402
from guest.scenarios import wait_heartbeat  # noqa: E402
from guest.vm import GuestVM, copy_disk  # noqa: E402

BALLOON = ["-device", "virtio-balloon-pci,free-page-reporting=on"]


def guest_free_port(sock: Path) -> list[str]:
    return [
        "-device",
        "virtio-serial-pci",
        "-chardev",
        f"socket,id=lf,path={sock},server=on,wait=off",
        "-device",
        "virtserialport,chardev=lf,name=org.leanimg.free.0",
    ]


def leanimg_command() -> list[str]:
    script = Path(sys.executable).parent / "leanimg"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "leanimg.cli"]


def prepare(vm: GuestVM, mem_mib: int, say) -> None:
    t0 = time.monotonic()
    vm.wait_ready(timeout=600)
    vm.run_workload("pagecache", "/mnt", timeout=1800)
    vm.run_workload("freed", str(mem_mib // 2), timeout=1800)
    wait_heartbeat(vm, "freed", 4, timeout=120)  # a few seconds for free-page reporting
    say(f"guest ready in {time.monotonic() - t0:.0f} s")


def fsync_seconds(path: Path) -> float:
    """How long making QEMU's save durable takes (leanimg fsyncs its image; exec:cat does not)."""
    t0 = time.monotonic()
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.monotonic() - t0


def qemu_save(vm: GuestVM, path: Path, background: bool = False, through: str = "cat") -> tuple[float, dict]:
    """QEMU's own migrate to ``exec:THROUGH > path``; (wall seconds, final query-migrate).
    In stop mode the seconds run from stop to running again: the guest's pause under QEMU's
    save. With a ``through`` other than cat they run until QEMU's writer has exited too (QEMU
    reports the migration completed before it closes the pipe and waits for the writer, so
    zstd may still be writing the file's tail)."""
    if background:
        vm.qmp.execute("migrate-set-capabilities", capabilities=[{"capability": "background-snapshot", "state": True}])
    else:
        vm.stop()
    t0 = time.monotonic()
    info = vm.save(path, timeout=1800, through=through)
    seconds = time.monotonic() - t0
    if background:
        vm.qmp.execute("migrate-set-capabilities", capabilities=[{"capability": "background-snapshot", "state": False}])
    else:
        vm.cont()
        seconds = time.monotonic() - t0  # stop to running again, as the checkpoint's wall time
    if through != "cat":
        wait_writer_gone(vm.proc.pid, through, path)
        seconds = time.monotonic() - t0
    return seconds, info


def wait_writer_gone(qemu_pid: int, through: str, path: Path, timeout: float = 600.0) -> None:
    """Wait until no descendant of ``qemu_pid`` is QEMU's exec: writer (``sh -c "THROUGH >
    PATH"`` or THROUGH itself)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        parent, cmdline = {}, {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone meanwhile
            pid = int(entry.name)
            parent[pid] = int(stat.rsplit(")", 1)[1].split()[1])
            cmdline[pid] = [c.decode(errors="replace") for c in cmd if c]
        descendants, todo = set(), [qemu_pid]
        while todo:
            up = todo.pop()
            kids = [pid for pid, pp in parent.items() if pp == up and pid not in descendants]
            descendants.update(kids)
            todo.extend(kids)
        if not any(
            str(path) in " ".join(cmdline[pid]) or cmdline[pid][-len(through.split()) :] == through.split()
            for pid in descendants
            if cmdline.get(pid)
        ):
            return
        time.sleep(0.005)
    raise SystemExit(f"QEMU's migration writer ({through} > {path}) still running after {timeout}s")


def zstd_size(path: Path) -> int:
    out = path.with_suffix(path.suffix + ".zst")
    subprocess.run(["zstd", "-q", "-f", "-T0", "-3", str(path), "-o", str(out)], check=True)
    size = out.stat().st_size
    out.unlink()
    return size


def checkpoint(qmp: Path, image: Path, *args, timeline: list | None = None) -> tuple[float, float, str]:
    """(wall seconds, leanimg's CPU seconds, summary line); ``timeline`` receives the steps
    (checkpoint -v: seconds since leanimg reached QEMU's monitor)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(
        [*leanimg_command(), "-v", "checkpoint", "--qmp", str(qmp), "-o", str(image), "-f", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    seconds = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"leanimg checkpoint failed: {proc.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if timeline is not None:
        timeline.extend(
            (m.group(2), float(m.group(1)))
            for m in re.finditer(r"checkpoint +([\d.]+) s +\(\+[\d.]+\) +(.+)", proc.stderr)
        )
    return seconds, cpu, proc.stdout.strip()


def guest_free_runs(vm: GuestVM, qmp: Path, port: Path, disk: Path, work: Path, bandwidth: int, say) -> dict:
    """--live without and with --guest-free (and with --disk), in the plain guest."""
    start = len(vm.serial.text)
    vm.serial.send("free")  # the helper (tests/guest/build.py's init)
    vm.serial.wait_for("LEANIMG-STARTED", 60, start)
    out = {}
    runs = {
        "live": [],
        "live_guest_free": ["--guest-free", port],
        "live_guest_free_disk": ["--guest-free", port, "--disk", f"vda={disk}"],
    }
    for name, extra in runs.items():
        image = work / f"{name}.lean"
        seconds, cpu, summary = checkpoint(qmp, image, "--live", "--max-bandwidth", bandwidth, *extra)
        out[f"{name}_bytes"] = image.stat().st_size
        out[f"{name}_seconds"] = seconds
        out[f"{name}_summary"] = summary
        free = re.search(r"MiB by class:.*?FREE ([\d.]+)", summary)
        out[f"{name}_free_mib"] = float(free.group(1)) if free else 0.0
        say(f"{name}: {summary}")
    note = _checkpoint_note(work / "live_guest_free.lean")
    out["guest_free_helper_ms"] = (note["guest_free"]["helper_us"] or 0) / 1000
    out["guest_free_answers"] = note["guest_free"]["answered"]
    out["live_bandwidth_mib"] = bandwidth
    return out


def _checkpoint_note(image: Path) -> dict:
    from leanimg.reader import LeanImage

    with LeanImage.open(image) as img:
        return json.loads(bytes(next(s for s in img.source_states if s.tag == 2).data))


def downtime_of(summary: str) -> int:
    return int(summary.split("downtime ")[1].split(" ms")[0])


def paused_ms_of(summary: str) -> int | None:
    """The checkpoint's "guest paused NNN ms" (stop to cont), None if the summary has none."""
    m = re.search(r"guest paused (\d+) ms", summary)
    return int(m.group(1)) if m else None


def stop_round(vm: GuestVM, qmp: Path, disk: Path, work: Path, first: bool) -> dict:
    """One round in the balloon guest, each run right after the other: QEMU's stop-and-save
    to exec:cat (``qemu_stop_save_seconds``: stop to cont, the guest's pause under QEMU's save)
    and to exec:zstd -T0 -3, each followed by an fsync, checkpoint --disk, checkpoint without
    disks, QEMU's background snapshot, checkpoint --background."""
    r = {}
    seconds, _ = qemu_save(vm, work / "balloon.save")
    r["qemu_stop_save_seconds"] = seconds
    r["qemu_stop_save_fsync_seconds"] = fsync_seconds(work / "balloon.save")
    if first:  # the sizes of the first round's save (the balloon may report more pages later)
        r["balloon_save_bytes"] = (work / "balloon.save").stat().st_size
        r["balloon_save_zstd_bytes"] = zstd_size(work / "balloon.save")
    (work / "balloon.save").unlink()
    zst = work / "balloon.save.zst"
    seconds, _ = qemu_save(vm, zst, through="zstd -q -T0 -3")
    r["qemu_stop_zstd_seconds"] = seconds
    r["qemu_stop_zstd_fsync_seconds"] = fsync_seconds(zst)
    zst.unlink()

    for name, extra in (("checkpoint_stop", ["--disk", f"vda={disk}"]), ("checkpoint_stop_nodisk", [])):
        timeline = []
        seconds, cpu, summary = checkpoint(qmp, work / f"{name}.lean", *extra, timeline=timeline)
        r[f"{name}_seconds"], r[f"{name}_cpu_seconds"] = seconds, cpu
        r[f"{name}_bytes"] = (work / f"{name}.lean").stat().st_size
        r[f"{name}_summary"], r[f"{name}_timeline"] = summary, timeline
        r[f"{name}_paused_ms"] = paused_ms_of(summary)
        steps = dict(timeline)
        r[f"{name}_migration_seconds"] = steps["migration completed"] - steps["ready to migrate"]
        r[f"{name}_after_migration_seconds"] = steps["image synced"] - steps["migration completed"]
        r[f"{name}_sync_seconds"] = steps["image synced"] - steps["image written"]
        r[f"{name}_outside_seconds"] = seconds - steps["image in place"]  # start-up, connecting, the result
    r["checkpoint_disk_bytes"] = r["checkpoint_stop_bytes"]

    seconds, info = qemu_save(vm, work / "background.save", background=True)
    r["qemu_background_seconds"] = seconds
    r["qemu_background_downtime_ms"] = info.get("downtime")
    (work / "background.save").unlink()
    seconds, cpu, summary = checkpoint(qmp, work / "background.lean", "--background")
    r["checkpoint_background_cpu_seconds"] = cpu
    r["checkpoint_background_bytes"] = (work / "background.lean").stat().st_size
    r["checkpoint_background_seconds"] = seconds
    r["checkpoint_background_downtime_ms"] = downtime_of(summary)
    r["checkpoint_background_summary"] = summary
    return r


def run(args) -> dict:
    def say(msg):
        print(msg, file=sys.stderr, flush=True)

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    quarter = args.mem_mib // 4
    spec = DiskSpec(size_mib=quarter + quarter // 2 + 64, text_mib=quarter // 2, binary_mib=quarter // 2, seed=13)
    build = build_guest(spec)
    results = {"mem_mib": args.mem_mib, "disk_spec": dataclasses.asdict(spec), "repeat": args.repeat}

    (work / "plain").mkdir(exist_ok=True)
    qmp, port, disk = work / "plain-qmp.sock", work / "plain-free.sock", copy_disk(build.disk, work / "plain-disk.img")
    with GuestVM(
        build,
        disk,
        mem_mib=args.mem_mib,
        workdir=work / "plain",
        extra_args=guest_free_port(port) + ["-qmp", f"unix:{qmp},server=on,wait=off"],
    ) as vm:
        prepare(vm, args.mem_mib, say)
        seconds, info = qemu_save(vm, work / "plain.save")
        results["plain_save_bytes"] = (work / "plain.save").stat().st_size
        results["plain_save_zstd_bytes"] = zstd_size(work / "plain.save")
        results["plain_stop_save_seconds"] = seconds
        (work / "plain.save").unlink()
        say(f"plain: {results}")
        results.update(guest_free_runs(vm, qmp, port, disk, work, args.live_bandwidth, say))
    if args.skip_balloon:
        results["load_average"] = os.getloadavg()
        return results

    (work / "balloon").mkdir(exist_ok=True)
    disk = copy_disk(build.disk, work / "balloon-disk.img")
    qmp = work / "leanimg-qmp.sock"
    with GuestVM(
        build,
        disk,
        mem_mib=args.mem_mib,
        workdir=work / "balloon",
        extra_args=BALLOON + ["-qmp", f"unix:{qmp},server=on,wait=off"],
    ) as vm:
        prepare(vm, args.mem_mib, say)
        rounds = [stop_round(vm, qmp, disk, work, k == 0) for k in range(args.repeat)]
        for key, value in rounds[0].items():
            numbers = [r[key] for r in rounds if isinstance(r.get(key), (int, float))]
            if numbers and all(key in r for r in rounds):
                results[key] = statistics.median(numbers)  # (a None, e.g. no "guest paused", left out)
            else:
                results[key] = value  # measured once (the zstd size), or text
        results["rounds"] = rounds
        say(f"balloon: {results}")

    results["load_average"] = os.getloadavg()
    results["ratio_vs_plain_zstd"] = results["checkpoint_disk_bytes"] / results["plain_save_zstd_bytes"]
    results["ratio_vs_balloon_zstd"] = results["checkpoint_disk_bytes"] / results["balloon_save_zstd_bytes"]
    results["durable_qemu_stop_save_seconds"] = (
        results["qemu_stop_save_seconds"] + results["qemu_stop_save_fsync_seconds"]
    )
    results["stop_time_ratio"] = results["checkpoint_stop_seconds"] / results["qemu_stop_save_seconds"]
    results["stop_time_ratio_durable"] = results["checkpoint_stop_seconds"] / results["durable_qemu_stop_save_seconds"]
    results["stop_nodisk_time_ratio"] = results["checkpoint_stop_nodisk_seconds"] / results["qemu_stop_save_seconds"]
    results["durable_qemu_stop_zstd_seconds"] = (
        results["qemu_stop_zstd_seconds"] + results["qemu_stop_zstd_fsync_seconds"]
    )
    results["stop_time_ratio_vs_zstd_durable"] = (
        results["checkpoint_stop_seconds"] / results["durable_qemu_stop_zstd_seconds"]
    )
    for name, key in (("checkpoint_stop", "stop_pause_ratio"), ("checkpoint_stop_nodisk", "stop_nodisk_pause_ratio")):
        paused = results.get(f"{name}_paused_ms")
        results[key] = None if paused is None else paused / 1000 / results["qemu_stop_save_seconds"]
    results["background_time_ratio"] = results["checkpoint_background_seconds"] / results["qemu_background_seconds"]
    return results


def report(r: dict) -> str:
    mb = lambda n: f"{n / 1e6:.0f} MB"  # noqa: E731
    zstd = r["plain_save_zstd_bytes"]
    lines = [
        f"guest {r['mem_mib']} MiB: half freed, a quarter page cache; load average at the end "
        f"{r['load_average'][0]:.1f} on {os.cpu_count()} cores",
        f"plain stop-and-save (no balloon): {mb(r['plain_save_bytes'])}, zstd -T0 -3 {mb(zstd)}",
        f"checkpoint --live (no balloon, --max-bandwidth {r['live_bandwidth_mib']}), x the plain zstd:",
        f"  without guest free hints:       {mb(r['live_bytes'])} = {r['live_bytes'] / zstd:.3f} x "
        f"(FREE {r['live_free_mib']:.0f} MiB)",
        f"  --guest-free:                   {mb(r['live_guest_free_bytes'])} = "
        f"{r['live_guest_free_bytes'] / zstd:.3f} x "
        f"(FREE {r['live_guest_free_free_mib']:.0f} MiB; {r['guest_free_answers']} answers, the last took "
        f"{r['guest_free_helper_ms']:.0f} ms in the guest)",
        f"  --guest-free --disk:            {mb(r['live_guest_free_disk_bytes'])} = "
        f"{r['live_guest_free_disk_bytes'] / zstd:.3f} x (FREE {r['live_guest_free_disk_free_mib']:.0f} MiB)",
    ]
    if "balloon_save_bytes" not in r:
        return "\n".join(lines)
    return "\n".join(
        lines
        + [
            f"same with free-page-reporting:    {mb(r['balloon_save_bytes'])}, "
            f"zstd -T0 -3 {mb(r['balloon_save_zstd_bytes'])}",
            f"checkpoint --disk:                {mb(r['checkpoint_disk_bytes'])} = "
            f"{r['ratio_vs_plain_zstd']:.3f} x the plain "
            f"zstd (target <= 0.2), {r['ratio_vs_balloon_zstd']:.3f} x the balloon zstd",
            f"stop mode wall time (medians of {r['repeat']}): checkpoint --disk {r['checkpoint_stop_seconds']:.2f} s "
            f"(leanimg CPU {r['checkpoint_stop_cpu_seconds']:.2f} s), QEMU exec:cat "
            f"{r['qemu_stop_save_seconds']:.2f} s = {r['stop_time_ratio']:.2f} x (target <= 1.2); "
            f"exec:cat then fsync {r['durable_qemu_stop_save_seconds']:.2f} s = {r['stop_time_ratio_durable']:.2f} x",
            _steps("  --disk", r, "checkpoint_stop"),
            f"  without --disk (streamed into the writer, no spool): {r['checkpoint_stop_nodisk_seconds']:.2f} s "
            f"(leanimg CPU {r['checkpoint_stop_nodisk_cpu_seconds']:.2f} s, {mb(r['checkpoint_stop_nodisk_bytes'])}) = "
            f"{r['stop_nodisk_time_ratio']:.2f} x",
            _steps("  without --disk", r, "checkpoint_stop_nodisk"),
            f"issue 34 baselines (QEMU stop-and-save, medians of {r['repeat']}): exec:cat "
            f"{r['qemu_stop_save_seconds']:.2f} s, exec:cat + fsync {r['durable_qemu_stop_save_seconds']:.2f} s, "
            f"exec:zstd -T0 -3 + fsync {r['durable_qemu_stop_zstd_seconds']:.2f} s "
            f"(zstd {r['qemu_stop_zstd_seconds']:.2f} s + fsync {r['qemu_stop_zstd_fsync_seconds']:.2f} s)",
            f"  checkpoint --disk wall time {r['checkpoint_stop_seconds']:.2f} s = "
            f"{r['stop_time_ratio']:.2f} x exec:cat, "
            f"{r['stop_time_ratio_durable']:.2f} x exec:cat + fsync (target <= 1.5 x exec:cat + fsync), "
            f"{r['stop_time_ratio_vs_zstd_durable']:.2f} x exec:zstd -T0 -3 + fsync (keep <= 1 x zstd + fsync)",
            f"  guest's pause against QEMU's exec:cat pause {r['qemu_stop_save_seconds'] * 1000:.0f} ms: "
            f"checkpoint --disk {_pause(r, 'checkpoint_stop_paused_ms', 'stop_pause_ratio')}, "
            f"without --disk {_pause(r, 'checkpoint_stop_nodisk_paused_ms', 'stop_nodisk_pause_ratio')} "
            f"(target <= 1.0)",
            f"background: checkpoint {r['checkpoint_background_seconds']:.1f} s "
            f"(leanimg CPU {r['checkpoint_background_cpu_seconds']:.1f} s), downtime "
            f"{r['checkpoint_background_downtime_ms']} ms (target <= 50); "
            f"QEMU exec:cat {r['qemu_background_seconds']:.1f} s, "
            f"downtime {r['qemu_background_downtime_ms']} ms = {r['background_time_ratio']:.2f} x (target <= 1.2)",
        ]
    )


def _pause(r: dict, paused: str, ratio: str) -> str:
    if r.get(paused) is None or r.get(ratio) is None:
        return 'n/a (no "guest paused" in the summary)'
    return f"{r[paused]:.0f} ms = {r[ratio]:.2f} x"


def _steps(label: str, r: dict, name: str) -> str:
    return (
        f"{label}: migration {r[name + '_migration_seconds']:.2f} s, after it until synced "
        f"{r[name + '_after_migration_seconds']:.2f} s (fsync {r[name + '_sync_seconds']:.2f} s), outside "
        f"the steps (start-up, QMP, the summary) {r[name + '_outside_seconds']:.2f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mem-mib", type=int, default=1024, help="guest memory (default 1024)")
    parser.add_argument("--workdir", default="/var/tmp/leanimg-bench-checkpoint")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--live-bandwidth",
        type=int,
        default=128,
        metavar="MIB/S",
        help="--max-bandwidth of the --live checkpoints (default 128)",
    )
    parser.add_argument("--skip-balloon", action="store_true", help="only the plain guest")
    parser.add_argument(
        "--repeat",
        type=int,
        default=3,
        metavar="N",
        help="rounds of the balloon guest's runs, alternated; medians reported (default 3)",
    )
    args = parser.parse_args()
    results = run(args)
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
