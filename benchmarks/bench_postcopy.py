"""Lazy restore (`leanimg serve --postcopy`) against the full restore, with real QEMU (TCG).

Issue 14 §4.  Two guests with the same working set and different memory sizes (default 256
MiB and 2 GiB) each boot, read their disk's files into the page cache, run ``workload check
16`` (16 MiB it reads back before every heartbeat) and are saved stopped; each save is
converted to a lean image.  Then, per guest, one destination QEMU after another (no -S: the
guest starts as soon as it can), in the same run:

  full        -incoming "exec:leanimg restore IMG --to qemu -o -", then `cont` as soon as
              the load completed (a pre-copy load of a stopped VM's save stays paused; a
              post-copy destination starts the guest at POSTCOPY_RUN by itself)
  postcopy S  -incoming "exec:leanimg serve IMG --postcopy --prepage S", S in --strategies;
              "S+ws" adds --working-set FILE: FILE recorded per guest before the timed runs by
              one demand-only serve with --record-faults (not run for --baseline); "S@T" (also
              "S+ws@T") serves with --precopy-seconds T instead of the default

and for each:

  qmp          destination started -> its QMP socket answers (QEMU's own start-up)
  started      destination started -> query-status "running" (the vCPU runs; for the full
               restore, after our `cont`)
  to running   destination started -> the guest's serial console printing again (the first
               heartbeat of any workload; the page-cache one touches little memory)
  working set  destination started -> the first heartbeat of the check workload, which it
               prints after reading its 16 MiB back
  resident     destination started -> query-migrate "completed" (every page that must travel
               has arrived; for the full restore, the whole stream is loaded)
  on demand    pages the serve sent because the destination faulted on them (its --stats)

The save and images are cached under --workdir (``--reuse`` skips the boots).  Every (size,
restore) pair runs ``--repeat`` times, interleaved, and the medians are compared with issue
14's targets: to running <= 1 s, the largest guest's to running <= 1.2x the smallest's,
resident <= 1.2x the full restore.  "to running" is the first line of a 20 ms heartbeat
(``workload beacon``) on the destination's console.

    python benchmarks/bench_postcopy.py --workdir /var/tmp/leanimg-postcopy --reuse --repeat 3 --json out.json

``--baseline DIR`` adds the same runs served by another checkout of leanimg (DIR, with its
own .venv), interleaved with these: "base full", "base postcopy S".  Each serve's timeline
(its --stats) is printed against the destination's launch.  The sources of both are compiled
to bytecode first: with PYTHONDONTWRITEBYTECODE set, every leanimg process would otherwise
compile them again (~0.1 s of its start-up).
"""

from __future__ import annotations

import argparse
import compileall
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from guest.build import build_guest  # noqa: E402
from guest.scenarios import heartbeats, run_scenario  # noqa: E402
from guest.vm import GuestVM, copy_disk  # noqa: E402

from leanimg.cli import command_line  # noqa: E402

# the beacon heartbeats every 20 ms: "to running" is seen to within 20 ms, not the 500 ms
# of the other workloads' heartbeats
STEPS = (("pagecache", ("pagecache", "/mnt")), ("beacon", ("beacon",)), ("check", ("check", "16")))
POSTCOPY = ("-global", "migration.x-postcopy-ram=on")
TIMEOUT = 600


def prepare(workdir: Path, mem_mib: int, reuse: bool) -> tuple[Path, Path]:
    """(image, disk at save time) of a guest of ``mem_mib`` MiB after STEPS."""
    out = workdir / f"guest-{mem_mib}-{'-'.join(name for name, _ in STEPS)}"  # --reuse only the same steps
    image, disk = out / "vm.lean", out / "check.disk.img"
    if reuse and image.exists() and disk.exists():
        return image, disk
    points = run_scenario(
        out,
        STEPS,
        mem_mib=mem_mib,
        save_after={"check"},
        log=lambda msg: print(f"[{mem_mib} MiB guest] {msg}", flush=True),
    )
    _run([*command_line(), "convert", str(points["check"].save), "-o", str(image), "-f"])
    return image, disk


def _run(argv: list[str]) -> None:
    import subprocess

    subprocess.run(argv, check=True, capture_output=True, timeout=TIMEOUT)


def measure(
    build, image: Path, disk: Path, mem_mib: int, incoming_argv: list[str], postcopy: bool, completes: bool = True
) -> dict:
    """Seconds from starting the destination to the first heartbeat and to "completed"
    (not waited for when the run never ``completes``: a demand-only serve)."""
    with tempfile.TemporaryDirectory(prefix="bench-postcopy-") as tmp:
        work = Path(tmp)
        copy = copy_disk(disk, work / "disk.img")
        (work / "vm").mkdir()
        t0, launched = time.monotonic(), time.time()
        with GuestVM(
            build,
            copy,
            mem_mib=mem_mib,
            workdir=work / "vm",
            autostart=True,
            incoming=f"exec:{shlex.join(incoming_argv)}",
            extra_args=POSTCOPY if postcopy else (),
        ) as vm:
            qmp = time.monotonic() - t0  # GuestVM returns once QMP answered
            running = working = resident = started = None
            deadline = t0 + TIMEOUT
            while (working is None or (completes and resident is None)) and time.monotonic() < deadline:
                if started is None and vm.status() == "running":
                    started = time.monotonic() - t0
                if running is None and "HB beacon" in vm.serial.text:
                    running = time.monotonic() - t0
                if working is None and heartbeats(vm.serial.text, "check"):
                    working = time.monotonic() - t0
                if resident is None and vm.qmp.execute("query-migrate").get("status") == "completed":
                    resident = time.monotonic() - t0
                    if not postcopy and vm.status() == "paused":
                        vm.cont()  # the save was of a stopped VM: a pre-copy load stays paused
                if vm.proc.poll() is not None or "WORKLOAD-ERROR" in vm.serial.text:
                    raise RuntimeError(f"destination failed:\n{vm.serial.text[-1000:]}\n{vm.qemu_output()[-2000:]}")
                time.sleep(0.02)
            vm.qmp.execute("quit")
            vm.proc.wait(timeout=60)
    return {
        "qmp_s": qmp,
        "started_s": started,
        "to_running_s": running,
        "working_set_s": working,
        "resident_s": resident,
        "launched": launched,
    }


def read_stats(path: Path) -> dict:
    """The serve writes --stats when it exits (QEMU gone)."""
    for _ in range(300):
        if path.exists() and path.stat().st_size:
            time.sleep(0.1)
            stats = json.loads(path.read_text())
            return {
                k: stats.get(k, [] if k in ("timeline", "first_requests") else None)
                for k in (
                    "demand_pages",
                    "pushed_pages",
                    "pages_to_send",
                    "requests",
                    "demand_wait_max",
                    "demand_wait_total",
                    "timeline",
                    "first_requests",
                )
            }
        time.sleep(0.1)
    raise RuntimeError(f"the serve wrote no {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/var/tmp/leanimg-postcopy"))
    ap.add_argument("--reuse", action="store_true", help="Reuse the saves and images in --workdir.")
    ap.add_argument("--sizes", default="256,2048", help="Guest memory sizes in MiB (comma-separated).")
    ap.add_argument("--strategies", default="none,sequential,bubble", help="Prepaging strategies to run.")
    ap.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="Runs of every (size, restore) pair, interleaved; medians reported (default 3).",
    )
    ap.add_argument("--json", type=Path, help="Write the results here too.")
    ap.add_argument(
        "--baseline",
        type=Path,
        metavar="DIR",
        help="Also run every restore with the leanimg of this checkout (DIR/.venv/bin/leanimg).",
    )
    args = ap.parse_args()
    build = build_guest()
    leanimg = command_line()
    versions = [("", leanimg, REPO)]
    if args.baseline:
        versions.append(("base ", [str(args.baseline / ".venv" / "bin" / "leanimg")], args.baseline))
    for _, _, checkout in versions:
        for package in ("lean-image", "restore", "converters"):
            compileall.compile_dir(checkout / package, quiet=1)
    sizes = [int(s) for s in args.sizes.split(",")]
    images = {mem_mib: prepare(args.workdir, mem_mib, args.reuse) for mem_mib in sizes}
    strategies = args.strategies.split(",")
    if any("+ws" in s for s in strategies):
        for mem_mib in sizes:
            record_working_set(build, leanimg, args.workdir, *images[mem_mib], mem_mib)
    runs = [(f"{tag}full", None, argv) for tag, argv, _ in versions]
    runs += [
        (f"{tag}postcopy {s}", s, argv)
        for s in strategies
        for tag, argv, _ in versions
        if not (tag and ("+ws" in s or "@" in s))
    ]  # options the baseline may not have
    results = []
    for repeat in range(args.repeat):  # interleaved: drift on a shared host hits every run alike
        for mem_mib in sizes:
            image, disk = images[mem_mib]
            for name, strategy, argv in runs[repeat % len(runs) :] + runs[: repeat % len(runs)]:  # no run always first
                row = dict(
                    mem_mib=mem_mib, run=name, repeat=repeat, image_bytes=image.stat().st_size, demand_pages=None
                )
                row.update(one_run(build, argv, args.workdir, image, disk, mem_mib, strategy))
                results.append(row)
                print(_line(row), flush=True)
    summary = summarize(results, sizes)
    print(render_summary(summary, args.repeat))
    if args.json:
        args.json.write_text(json.dumps({"runs": results, "summary": summary}, indent=2))


def working_set_path(workdir: Path, mem_mib: int) -> Path:
    return workdir / f"faults-{mem_mib}.lws"


def record_working_set(build, leanimg, workdir: Path, image: Path, disk: Path, mem_mib: int) -> None:
    """The pages a demand-only serve is asked for, up to the check workload's first heartbeat."""
    path = working_set_path(workdir, mem_mib)
    path.unlink(missing_ok=True)
    argv = [*leanimg, "serve", str(image), "--postcopy", "--prepage", "none", "--record-faults", str(path)]
    measure(build, image, disk, mem_mib, argv, True, completes=False)
    for _ in range(300):
        if path.exists():
            return
        time.sleep(0.1)
    raise RuntimeError(f"the serve wrote no {path}")


def one_run(build, leanimg, workdir: Path, image: Path, disk: Path, mem_mib: int, strategy) -> dict:
    if strategy is None:
        return measure(build, image, disk, mem_mib, [*leanimg, "restore", str(image), "--to", "qemu", "-o", "-"], False)
    stats = workdir / f"stats-{mem_mib}-{strategy}.json"
    stats.unlink(missing_ok=True)
    named, _, budget = strategy.partition("@")
    prepage, _, ws = named.partition("+")
    argv = [*leanimg, "serve", str(image), "--postcopy", "--prepage", prepage, "--stats", str(stats)]
    if ws:
        argv += ["--working-set", str(working_set_path(workdir, mem_mib))]
    if budget:
        argv += ["--precopy-seconds", budget]
    row = measure(build, image, disk, mem_mib, argv, True, completes=prepage != "none")
    row.update(read_stats(stats))
    launched = row["launched"]
    row["timeline"] = [(event, t - launched) for event, t in row["timeline"]]
    row["first_requests"] = [(a - launched, b - launched, *rest) for a, b, *rest in row["first_requests"]]
    return row


TIMES = ("qmp_s", "started_s", "to_running_s", "working_set_s", "resident_s", "demand_pages")
# issue 14 §4
TARGETS = {"to running (s)": 1.0, "to running, largest / smallest guest": 1.2, "resident, postcopy / full restore": 1.2}


def summarize(results: list[dict], sizes: list[int]) -> dict:
    """Medians per (size, run) and the targets' ratios from them."""
    medians: dict = {}
    for row in results:
        cell = medians.setdefault(f"{row['mem_mib']} {row['run']}", {k: [] for k in TIMES})
        for k in TIMES:
            if row.get(k) is not None:
                cell[k].append(row[k])
    medians = {key: {k: statistics.median(v) if v else None for k, v in cell.items()} for key, cell in medians.items()}
    checks = []
    for key, m in medians.items():
        mem, run = key.split(" ", 1)
        tag = "base " if run.startswith("base ") else ""
        if run[len(tag) :].startswith("postcopy") and m["to_running_s"] is not None:
            checks.append(("to running (s)", key, m["to_running_s"]))
            full = medians[f"{mem} {tag}full"]["resident_s"]
            if m["resident_s"] is not None and full:
                checks.append(("resident, postcopy / full restore", key, m["resident_s"] / full))
    small, large = min(sizes), max(sizes)
    for key, m in medians.items():
        mem, run = key.split(" ", 1)
        other = medians.get(f"{small} {run}")
        if int(mem) == large and large != small and not run.endswith("full") and other and other["to_running_s"]:
            checks.append(("to running, largest / smallest guest", run, m["to_running_s"] / other["to_running_s"]))
    return {
        "medians": medians,
        "targets": TARGETS,
        "checks": [dict(target=t, run=r, value=v, met=v <= TARGETS[t]) for t, r, v in checks],
    }


def render_summary(summary: dict, repeat: int) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = [f"medians of {repeat} runs:"]
    for key, m in summary["medians"].items():
        lines.append(
            f"  {key:<28} qmp {fmt(m['qmp_s'])}  started {fmt(m['started_s'])}  to running "
            f"{fmt(m['to_running_s'])}  working set {fmt(m['working_set_s'])}  resident "
            f"{fmt(m['resident_s'])}  on demand {fmt(m['demand_pages'])}"
        )
    for c in summary["checks"]:
        lines.append(
            f"  {c['target']:<38} {c['run']:<28} {c['value']:.3f}  (target <= "
            f"{summary['targets'][c['target']]}: {'met' if c['met'] else 'NOT met'})"
        )
    return "\n".join(lines)


def _line(row: dict) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.2f} s"  # noqa: E731
    demand = (
        ""
        if row["demand_pages"] is None
        else (f"  on demand {row['demand_pages']} pages, pushed {row['pushed_pages']} of {row['pages_to_send']}")
    )
    timeline = "".join(f"\n        {t:6.3f} s  {event}" for event, t in row.get("timeline", ()))
    if row.get("requests") and row.get("demand_wait_max") is not None:
        firsts = row["first_requests"]
        before = sum(1 for a, *_ in firsts if row["to_running_s"] and a < row["to_running_s"])
        timeline += (
            f"\n        requests {row['requests']}, {before} before the console printed; wait max "
            f"{row['demand_wait_max'] * 1000:.1f} ms, mean {row['demand_wait_total'] / row['requests'] * 1000:.2f} ms"
        )
    return (
        f"{row['mem_mib']:>5} MiB  {row['run']:<22} qmp {fmt(row['qmp_s']):>7}  started "
        f"{fmt(row['started_s']):>7}  to running {fmt(row['to_running_s']):>8}  "
        f"working set {fmt(row['working_set_s']):>8}  resident {fmt(row['resident_s']):>8}{demand}{timeline}"
    )


if __name__ == "__main__":
    main()
