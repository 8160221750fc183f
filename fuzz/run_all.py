"""Run every fuzz harness for N executions each and print executions, coverage and crashes.

    python fuzz/run_all.py --runs 1000000 --workdir /var/tmp/leanimg-fuzz          (issue 16 §4)
    python fuzz/run_all.py --runs 20000 --harness qemu --harness xen --parallel
    python fuzz/run_all.py --runs 1000000 --segment 100000 --harness xen      (ten processes of 10^5)

Each harness (fuzz/fuzz_NAME.py) runs niced (nice 19) in keep-going mode: the first input
of every distinct crash (exception type + innermost leanimg line) is saved to
WORKDIR/NAME/crashes/ with its traceback, and the run goes on. Corpora live in
WORKDIR/NAME/corpus/, seeded on first use and grown by every run, so a later run starts
where the last one stopped. Per harness the table gives executions, executions per second,
wall seconds (seed building included), libFuzzer's executions per second,
coverage (libFuzzer's ``cov``: edges, ``ft``: features), corpus size and crashes (distinct
signatures); the exit status is 1 if any harness crashed or did not finish.

A harness runs in processes of at most --segment executions (default 200000) on the same
corpus, one after another: a long atheris/libFuzzer process grows until allocations fail under
the harness's address-space cap (a 10^6 Xen run stopped so at 172,762 executions, RSS 2.7 GB),
so fresh processes keep every execution under the same limits. The table sums the segments.

To add a harness, add a line to HARNESSES: its script and a function writing its seeds.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _reader_seeds(directory: str) -> None:
    import make_corpus

    make_corpus.make_corpus(directory)


def _stream_seeds(kind: str):
    def write(directory: str) -> None:
        import make_stream_corpus

        make_stream_corpus.make_corpus(kind, directory)

    return write


def _hint_seeds(directory: str) -> None:
    import fuzz_hints

    fuzz_hints.make_seeds(directory)


def _libvirt_seeds(directory: str) -> None:
    import fuzz_libvirt

    fuzz_libvirt.make_seeds(directory)


HARNESSES = {
    "reader": ("fuzz_reader.py", _reader_seeds),
    "qemu": ("fuzz_qemu.py", _stream_seeds("qemu")),
    "xen": ("fuzz_xen.py", _stream_seeds("xen")),
    "hints": ("fuzz_hints.py", _hint_seeds),
    "libvirt": ("fuzz_libvirt.py", _libvirt_seeds),
}

STATUS = re.compile(r"^#(\d+)\s+\S+\s+cov: (\d+) ft: (\d+) corp: (\d+)/")
STAT = re.compile(r"^stat::(\w+):\s+(\d+)")
DONE = re.compile(r"^Done (\d+) (?:runs )?in (\d+) second")


def start(
    name: str, runs: int, workdir: Path, seed: int, extra: list[str], segment: int = 0
) -> tuple[subprocess.Popen, Path]:
    script, write_seeds = HARNESSES[name]
    base = workdir / name
    corpus, crashes = base / "corpus", base / "crashes"
    crashes.mkdir(parents=True, exist_ok=True)
    if not corpus.is_dir() or not any(corpus.iterdir()):
        write_seeds(str(corpus))
    log = base / (f"fuzz-{segment}.log" if segment else "fuzz.log")
    env = dict(os.environ, LEANIMG_FUZZ_CRASH_DIR=str(crashes))
    cmd = [
        "nice",
        "-n",
        "19",
        sys.executable,
        str(HERE / script),
        str(corpus),
        f"-atheris_runs={runs}",
        f"-seed={seed}",
        "-print_final_stats=1",
        f"-artifact_prefix={crashes}/",
        *extra,
    ]
    with open(log, "w") as out:
        out.write(" ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=base, env=env)
    return proc, log


def summarize(name: str, returncode: int, log: Path, seconds: float, workdir: Path) -> dict:
    status, stats, done = None, {}, None
    for line in log.read_text(errors="replace").splitlines():
        if m := STATUS.match(line):
            status = m
        elif m := STAT.match(line):
            stats[m.group(1)] = int(m.group(2))
        elif m := DONE.match(line):
            done = int(m.group(1))
    crashes = sorted(p.stem for p in (workdir / name / "crashes").glob("*.input"))
    executions = stats.get("number_of_executed_units", done or (int(status.group(1)) if status else 0))
    return dict(
        name=name,
        executions=executions,
        seconds=seconds,
        rate=stats.get("average_exec_per_sec", executions / seconds if seconds else 0.0),
        cov=int(status.group(2)) if status else None,
        ft=int(status.group(3)) if status else None,
        corpus=int(status.group(4)) if status else None,
        crashes=crashes,
        finished=returncode == 0 and done is not None,
        returncode=returncode,
        log=log,
    )


def report(results: list[dict]) -> None:
    print(
        f"{'harness':8} {'executions':>11} {'seconds':>8} {'exec/s':>7} {'cov':>6} {'ft':>7} "
        f"{'corpus':>6} {'crashes':>7}  finished"
    )
    for r in results:
        print(
            f"{r['name']:8} {r['executions']:>11} {r['seconds']:>8.0f} {r['rate']:>7.1f} "
            f"{r['cov'] or '-':>6} {r['ft'] or '-':>7} "
            f"{r['corpus'] or '-':>6} {len(r['crashes']):>7}  "
            f"{'yes' if r['finished'] else 'NO (exit %d, see %s)' % (r['returncode'], r['log'])}"
        )
        for crash in r["crashes"]:
            print(f"    crash: {crash}")


def run_harness(name: str, options) -> dict:
    """One harness for --runs executions, in processes of at most --segment executions each
    (same corpus, seed + k): libFuzzer's and atheris's memory grows over a long run until the
    address-space cap makes allocations fail; a fresh process per segment starts from zero."""
    parts, done, k = [], 0, 0
    while done < options.runs:
        runs = min(options.segment or options.runs, options.runs - done)
        proc, log = start(
            name,
            runs,
            options.workdir,
            options.seed + k,
            options.libfuzzer,
            segment=k + 1 if options.segment and options.segment < options.runs else 0,
        )
        part = _finish(name, proc, log, time.monotonic(), options.workdir)
        parts.append(part)
        if not part["finished"] or part["executions"] == 0:
            break
        done, k = done + part["executions"], k + 1
    return _combined(parts)


def _combined(parts: list[dict]) -> dict:
    """The segments of one harness as one result (executions and seconds summed; coverage of the last)."""
    last = parts[-1]
    executions = sum(p["executions"] for p in parts)
    seconds = sum(p["seconds"] for p in parts)
    return dict(
        last,
        executions=executions,
        seconds=seconds,
        rate=executions / seconds if seconds else 0.0,
        finished=all(p["finished"] for p in parts),
        segments=len(parts),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1_000_000, help="executions per harness")
    parser.add_argument(
        "--harness", action="append", choices=sorted(HARNESSES), help="run only these (repeatable); default: all"
    )
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/leanimg-fuzz"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--parallel", action="store_true", help="run the harnesses at the same time")
    parser.add_argument(
        "--segment",
        type=int,
        default=200_000,
        help="executions per fuzzer process (default 200000; 0: one process for all --runs)",
    )
    parser.add_argument("libfuzzer", nargs="*", help="extra libFuzzer flags, after --")
    options = parser.parse_args()
    names = options.harness or list(HARNESSES)
    if options.parallel:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            results = list(pool.map(lambda name: run_harness(name, options), names))
    else:
        results = [run_harness(name, options) for name in names]
    report(results)
    return 0 if all(r["finished"] and not r["crashes"] for r in results) else 1


def _finish(name: str, proc: subprocess.Popen, log: Path, started: float, workdir: Path) -> dict:
    returncode = proc.wait()
    return summarize(name, returncode, log, time.monotonic() - started, workdir)


if __name__ == "__main__":
    sys.exit(main())
