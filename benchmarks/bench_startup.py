"""Start-up: what each command costs before (and just after) it opens an image, against the
interpreter's own start, in the same run (issue 34 §5: every command's own start ≤ 60 ms).

    .venv/bin/python benchmarks/bench_startup.py --runs 31 --non-editable

Every case is a fresh process, timed from spawn to exit (time.perf_counter; and its CPU time,
user + system from wait4, which a busy host inflates less than the wall time), run round-robin
with all the others (so the host's drift falls on all alike), after one unmeasured warm-up;
the table gives medians, and each minus ``python -c pass`` of the same install. The checkout is
compiled first (where PYTHONDONTWRITEBYTECODE is set, a module changed since its last compile is
compiled again by every run, as no installed copy is). The cases:

- the interpreter: ``python -S -c pass`` (no site), ``python -c pass`` (site: the .pth files of
  every site directory, e.g. an editable install's finder), ``python -c "import numpy"`` (what
  every command that touches pages imports: the floor of their start), ``python -c "import
  leanimg.cli"``;
- ``leanimg --help`` and ``leanimg CMD --help`` for every command of ``leanimg.cli.COMMANDS``:
  the command line and the command's module, nothing the command imports when it runs;
- the commands on a small image (2 MiB of guest memory, 0.8 MiB on disk, converted from a QEMU
  stream written by tests/helpers.qemu_save): inspect, validate, map, dump, restore (raw and
  qemu), serve (stdin at its end: the stream is pushed, then it stops), convert, and plugins.
  The image's own work is a few milliseconds of that: the last line gives it (the same calls
  in a warm process).

``--non-editable`` also installs this checkout as an ordinary (non-editable) package into a
temporary virtualenv that sees the development virtualenv's dependencies (a path entry: its
.pth files are not run) and runs every case there too, so the editable install's import
finder is out; the virtualenv is removed at the end. ``--compare DIR`` does the same for
another checkout (a copy of the tree before a change: both measured in one run).
``--leanimg PATH`` measures another console script instead of this virtualenv's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from common import compile_checkout  # noqa: E402

PAGES = 512  # the small image's guest memory: 2 MiB


def small_save(path: Path) -> None:
    """A QEMU stream of 2 MiB of guest memory: random, repeated text and zero pages."""
    import numpy as np

    sys.path.insert(0, str(REPO / "tests"))
    from helpers import qemu_save

    rng = np.random.default_rng(1)
    mem = bytearray(PAGES * 4096)
    mem[: 200 * 4096] = rng.integers(0, 256, 200 * 4096, dtype=np.uint8).tobytes()
    mem[300 * 4096 : 400 * 4096] = (b"hello world " * (100 * 4096 // 12 + 1))[: 100 * 4096]
    path.write_bytes(qemu_save(bytes(mem)))


def commands() -> list[str]:
    from leanimg.cli import COMMANDS

    return list(COMMANDS)


def cases(leanimg: str, work: Path) -> list[tuple[str, list[str], dict]]:
    """(label, argv, subprocess options) of every case, for the console script ``leanimg``."""
    python = _script_python(leanimg)
    save, image, out = work / "small.save", work / "small.lean", work / "out.lean"
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [
        ("python -S -c pass", [python, "-S", "-c", "pass"], quiet),
        ("python -c pass", [python, "-c", "pass"], quiet),
        ("python -c 'import numpy'", [python, "-c", "import numpy"], quiet),
        ("python -c 'import leanimg.cli'", [python, "-c", "import leanimg.cli"], quiet),
        ("leanimg --help", [leanimg, "--help"], quiet),
    ]
    rows += [(f"leanimg {name} --help", [leanimg, name, "--help"], quiet) for name in commands()]
    on_image = [
        ("inspect IMG", ["inspect", image]),
        ("inspect IMG --json", ["inspect", image, "--json"]),
        ("validate IMG", ["validate", image]),
        ("map IMG", ["map", image]),
        ("dump IMG", ["dump", image]),
        ("restore IMG --to raw -o /dev/null", ["restore", image, "--to", "raw", "-o", "/dev/null"]),
        ("restore IMG --to qemu -o - >/dev/null", ["restore", image, "--to", "qemu", "-o", "-"]),
        ("serve IMG --postcopy </dev/null >/dev/null", ["serve", image, "--postcopy"]),
        ("convert SAVE -o OUT -f", ["convert", save, "-o", out, "-f"]),
        ("plugins", ["plugins"]),
    ]
    rows += [
        (f"leanimg {label}", [leanimg, *map(str, args)], dict(quiet, stdin=subprocess.DEVNULL))
        for label, args in on_image
    ]
    return rows


def _script_python(leanimg: str) -> str:
    """The interpreter a console script runs with (its #! line)."""
    with open(leanimg, "rb") as f:
        first = f.readline().decode().strip()
    return first[2:].split()[0] if first.startswith("#!") else sys.executable


def timed(argv: list[str], options: dict) -> tuple[float, float]:
    """Wall seconds from spawn to exit, and the CPU seconds (user + system) the process used."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, **options)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, argv))} exited {proc.returncode}")
    return elapsed, usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def non_editable_install(checkout: Path = REPO):
    """A checkout installed as a wheel (no editable finder) into a temporary virtualenv whose
    dependencies are the development virtualenv's (a plain path entry: its .pth files, the
    editable finder among them, are not run); its console script."""
    root = Path(tempfile.mkdtemp(prefix="leanimg-startup-venv-"))
    try:
        venv = root / "venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv], check=True)
        wheels = root / "wheels"
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", wheels, checkout],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        python = venv / "bin" / "python"
        (wheel,) = wheels.glob("leanimg-*.whl")
        subprocess.run(
            [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-deps", wheel],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        site = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        Path(site, "leanimg-dev-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        # compiled as pip compiles an install (PYTHONDONTWRITEBYTECODE set here would keep them uncompiled)
        subprocess.run([python, "-m", "compileall", "-q", Path(site, "leanimg")], check=True, stdout=subprocess.DEVNULL)
        yield str(venv / "bin" / "leanimg")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def work_ms(image: Path, runs: int) -> dict[str, float]:
    """The commands' own work on the small image, in this (warm) process: medians in ms."""
    from leanimg.inspect import summarize
    from leanimg.plugins import target
    from leanimg.reader import LeanImage
    from leanimg.validate import validate

    def inspect():
        with LeanImage.open(str(image)) as img:
            summarize(img)

    def restore():
        with LeanImage.open(str(image)) as img, open(os.devnull, "wb") as out:
            target("raw").restore(img, out)

    calls = {"inspect IMG": inspect, "validate IMG": lambda: validate(str(image)), "restore --to raw": restore}
    found = {}
    for label, call in calls.items():
        call()
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        found[label] = statistics.median(times) * 1000
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=21, help="measured runs of each case (default 21)")
    parser.add_argument("--leanimg", default=str(Path(sys.executable).parent / "leanimg"), help="console script")
    parser.add_argument("--non-editable", action="store_true", help="also measure a non-editable install")
    parser.add_argument(
        "--compare", action="append", default=[], metavar="DIR", help="also another checkout, installed non-editable"
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="leanimg-startup-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        compile_checkout(args.leanimg)  # else every run compiles the modules changed since the last compile
        small_save(work / "small.save")
        subprocess.run([args.leanimg, "-q", "convert", work / "small.save", "-o", work / "small.lean"], check=True)
        installs = {"editable" if _is_editable(args.leanimg) else "given": args.leanimg}
        if args.non_editable:
            installs["non-editable"] = stack.enter_context(non_editable_install())
        for checkout in args.compare:
            installs[Path(checkout).name] = stack.enter_context(non_editable_install(Path(checkout)))
        table = {
            (name, label): (argv, options)
            for name, script in installs.items()
            for label, argv, options in cases(script, work)
        }
        times: dict = {key: [] for key in table}
        for key, (argv, options) in table.items():  # warm-up: page cache, .pyc files
            timed(argv, options)
        for _ in range(args.runs):
            for key, (argv, options) in table.items():
                times[key].append(timed(argv, options))
        work_times = work_ms(work / "small.lean", args.runs)

    names = list(installs)
    labels = list(dict.fromkeys(label for _, label in table))
    print(f"medians of {args.runs} runs, ms: wall (spawn to exit) and CPU (user + system) of the process")
    print(f"{'':46}" + "".join(f"{name:>30}" for name in names))
    print(f"{'case':46}" + "".join(f"{'wall':>8}{'-pass':>7}{'cpu':>8}{'-pass':>7}" for _ in names))
    for label in labels:
        line = f"{label:46}"
        for name in names:
            for column in (0, 1):
                median = statistics.median(t[column] for t in times[name, label]) * 1000
                base = statistics.median(t[column] for t in times[name, "python -c pass"]) * 1000
                line += f"{median:8.1f}{median - base:7.1f}"
        print(line)
    print("'-pass': minus `python -c pass` of the same install, same run")
    print("work on the small image in a warm process (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in work_times.items()))
    return 0


def _is_editable(leanimg: str) -> bool:
    python = _script_python(leanimg)
    code = "import leanimg, sys; print(any('__editable__' in str(p) for p in sys.path))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


if __name__ == "__main__":
    sys.exit(main())
