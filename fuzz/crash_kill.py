"""Crash consistency, measured (issue 16 §3): SIGKILL at random moments, and a full disk.

    python fuzz/crash_kill.py [--kills 200] [--seed 1] [--workdir DIR]

Over the bundled real QEMU save (and its disk) and a two-link chain made from it, the script
starts convert, convert --disk, restore (raw and qemu), flatten and merge, and kills each
(SIGKILL) after a delay drawn uniformly from 0 to the time the command takes uninterrupted.
After every kill:
- what stands under the output name is nothing, or the complete output: an image that
  `leanimg validate` calls valid and that restores to the reference memory, a restore
  output byte-identical to the uninterrupted one;
- every input (save, disk, images of the chain) is byte-identical to before (SHA-256);
- a reader opening the temporary file the writer was filling says it is incomplete
  (checked on the kills that caught one), never garbage and never valid-but-short.
Temporary files a SIGKILL leaves (``.leanimg-*.partial``) are counted, then removed.

Then each command writes into a 6 MiB tmpfs (ENOSPC part way through): it must fail with one
clear error line, exit 1, and leave the filesystem empty. Needs root for the tmpfs mount.

Prints the counts and exits 1 if any check failed.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import zstandard

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "lean-image" / "sample"


def leanimg() -> list[str]:
    return [sys.executable, "-c", "from leanimg.cli import main; main()"]


def run(*args, check=True, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([*leanimg(), *map(str, args)], capture_output=True, timeout=600, **kw)
    if check and proc.returncode != 0:
        raise SystemExit(f"setup failed: leanimg {' '.join(map(str, args))}: {proc.stderr.decode()}")
    return proc


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def decompress(src: Path, dest: Path) -> None:
    with open(src, "rb") as fin, open(dest, "wb") as fout:
        zstandard.ZstdDecompressor().copy_stream(fin, fout)


def prepare(work: Path) -> dict:
    """The inputs, and the reference outputs of every command (run uninterrupted, timed)."""
    decompress(SAMPLE / "vm.save.zst", work / "vm.save")
    decompress(SAMPLE / "disk.img.zst", work / "disk.img")
    run("convert", work / "vm.save", "-o", work / "parent.lean")
    run(
        "convert",
        work / "vm.save",
        "-o",
        work / "child.lean",
        "--parent",
        work / "parent.lean",
        "--disk",
        f"vda={work / 'disk.img'}",
    )
    run("restore", work / "parent.lean", "--to", "raw", "-o", work / "memory.raw")
    out = work / "out"
    out.mkdir()
    disk = f"vda={work / 'disk.img'}"
    commands = {
        "convert": (["convert", work / "vm.save", "-o", out / "o.lean"], "image"),
        "convert --disk": (["convert", work / "vm.save", "-o", out / "o.lean", "--disk", disk], "image"),
        "restore raw": (["restore", work / "child.lean", "--to", "raw", "-o", out / "o.raw", "--disk", disk], "raw"),
        "restore qemu": (["restore", work / "parent.lean", "--to", "qemu", "-o", out / "o.save"], "save"),
        "flatten": (["flatten", work / "child.lean", "-o", out / "o.lean", "--disk", disk], "image"),
        "merge": (["merge", work / "child.lean", "-o", out / "o.lean", "--disk", disk], "image"),
    }
    durations = {}
    for name, (args, _) in commands.items():
        start = time.perf_counter()
        run(*args)
        durations[name] = time.perf_counter() - start
        for leftover in out.iterdir():
            leftover.unlink()
    return dict(
        work=work,
        out=out,
        commands=commands,
        durations=durations,
        inputs={p: sha256(p) for p in (work / "vm.save", work / "disk.img", work / "parent.lean", work / "child.lean")},
        references={"raw": sha256(work / "memory.raw"), "save": sha256(work / "vm.save")},
    )


def check_output(setup: dict, args: list, kind: str, counts: Counter, problems: list) -> None:
    """What stands under the output name after a kill: nothing, or the whole right output."""
    output = Path(args[args.index("-o") + 1])
    if not output.exists():
        counts["output absent"] += 1
        return
    if kind == "image":
        disk = args[args.index("--disk") : args.index("--disk") + 2] if "--disk" in args else []
        valid = run("validate", output, *disk, check=False)
        raw = setup["out"] / "check.raw"
        restored = run("restore", output, "--to", "raw", "-o", raw, *disk, check=False)
        right = valid.returncode == 0 and restored.returncode == 0 and sha256(raw) == setup["references"]["raw"]
        raw.unlink(missing_ok=True)
    else:
        right = sha256(output) == setup["references"][kind]
    counts["output complete and right" if right else "OUTPUT PRESENT BUT WRONG"] += 1
    if not right:
        problems.append(f"{' '.join(map(str, args))}: {output} is there but not the complete output")


def check_partial_reader(partial: Path, counts: Counter, problems: list) -> None:
    """A reader given the temporary file being written: refused as incomplete, never valid."""
    proc = run("validate", partial, check=False)
    text = (proc.stdout + proc.stderr).decode(errors="replace")
    if proc.returncode == 0:
        counts["temp file complete (killed before its rename)"] += 1
    elif proc.returncode == 1 and "Traceback" not in text and "internal error" not in text:
        counts["reader refused the temp file"] += 1
    else:
        problems.append(f"validate of a partial file: exit {proc.returncode}: {text[-300:]}")


def kill_once(setup: dict, rng: random.Random, counts: Counter, problems: list) -> None:
    name = rng.choice(sorted(setup["commands"]))
    args, kind = setup["commands"][name]
    delay = rng.uniform(0, setup["durations"][name])
    proc = subprocess.Popen([*leanimg(), *map(str, args)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    counts[f"kills: {name}"] += 1
    if proc.returncode == 0:
        counts["finished before the kill"] += 1
    check_output(setup, args, kind, counts, problems)
    for partial in setup["out"].glob(".leanimg-*.partial"):
        counts["temp files left by SIGKILL"] += 1
        if kind == "image":
            check_partial_reader(partial, counts, problems)
        partial.unlink()
    for leftover in setup["out"].iterdir():
        leftover.unlink()
    for path, digest in setup["inputs"].items():
        if sha256(path) != digest:
            problems.append(f"INPUT CHANGED: {path} after killing {name}")


def full_disk(setup: dict, counts: Counter, problems: list) -> None:
    """Every command writing into a tmpfs too small for its output."""
    small = setup["work"] / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        problems.append(f"could not mount a tmpfs for the ENOSPC runs: {mounted.stderr.decode().strip()}")
        return
    try:
        for name, (args, _) in setup["commands"].items():
            args = list(args)
            out = Path(args[args.index("-o") + 1])
            args[args.index("-o") + 1] = small / out.name
            proc = run(*args, check=False)
            err = proc.stderr.decode(errors="replace").strip()
            left = os.listdir(small)
            clean = (
                proc.returncode == 1
                and len(err.splitlines()) == 1
                and err.startswith("leanimg: error:")
                and "No space left" in err
                and not left
            )
            counts["ENOSPC: clean error, nothing left" if clean else "ENOSPC: NOT CLEAN"] += 1
            if not clean:
                problems.append(f"ENOSPC {name}: exit {proc.returncode}, left {left}: {err[-300:]}")
            for leftover in left:
                os.unlink(small / leftover)
    finally:
        subprocess.run(["umount", str(small)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=None)
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="leanimg-crash-", dir=options.workdir))
    try:
        setup = prepare(work)
        print("uninterrupted seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in setup["durations"].items()))
        rng, counts, problems = random.Random(options.seed), Counter(), []
        for k in range(options.kills):
            kill_once(setup, rng, counts, problems)
        full_disk(setup, counts, problems)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for key, value in sorted(counts.items()):
        print(f"{value:6d}  {key}")
    for problem in problems:
        print("PROBLEM:", problem)
    print(f"{options.kills} kills, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
