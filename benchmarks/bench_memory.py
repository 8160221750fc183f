"""Peak memory (RSS) and wall time of every command as the guest grows (issue 16 §5, issue 34 §2).

For each guest size a QEMU 7.2 migration stream of one RAM block is written straight to the
save file, never materialising the guest: most of the address space is zero pages, each the
9-byte ZERO entry QEMU sends for it (be64 offset|flags, one fill byte), and the non-zero data
is chunks of bench_format's page mix (45 % zero, 35 % text-like, 20 % random pages, in runs),
4 MiB each, spread evenly over the whole address space. ``--nonzero`` says how much: a size
(default 16 GiB, at most what the mix gives when every chunk is data, 55 % of the guest, so
1 GiB and 16 GiB guests are the plain mix as before and 256 GiB and 1 TiB guests both hold
16 GiB) or a fraction of the guest (``1/64``). Then each command runs as a child process, its
input evicted from the page cache first, and GNU time gives its peak RSS and wall time:

  convert         the save -> a lean image (streamed, one pass)
  validate        every rule of the image
  inspect         the page classes of the image
  map             the image's extents (human output)
  restore raw     the image -> /dev/null, every page digest-checked
  restore qemu    the image -> the stream, to /dev/null
  zstd -T0 -3     the baseline: `zstd -T0 -3` of the save, then `sync FILE` (convert fsyncs)
  convert --spool the save -> a lean image (RAM spooled to a sparse scratch file; only when
                  named in --commands)

The save, image and zstd output of each size are deleted before the next size is written.

    python benchmarks/bench_memory.py --sizes 1GiB 16GiB 256GiB 1TiB [--workdir /var/tmp]
    python benchmarks/bench_memory.py --sizes 16GiB --nonzero 1/64 --commands validate inspect
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from fractions import Fraction
from pathlib import Path

import numpy as np

from bench_format import CHUNK, MIX, PAGE, memory_chunks
from common import require_null_device, size_parser
from leanimg.converters import qemu as q
from leanimg.fileutil import evict_from_page_cache

MIB, GIB = 1 << 20, 1 << 30
GNU_TIME = "/usr/bin/time"  # Debian package "time"
CLASS_BYTES_PER_PAGE = 1  # the writer's page classes; slots and digests only where pages have them
DATA_SHARE = 1 - MIX["zero"]  # the non-zero share of a chunk of the mix
ZEROS_MAX = 1 << 30  # one Zeros chunk: 262144 entries, a 2.3 MiB array in write_qemu_stream
COMMANDS = ("convert", "validate", "inspect", "map", "restore raw", "restore qemu", "zstd -T0 -3")
OPTIONAL = ("convert --spool",)


def data_chunks(size: int, nonzero: int | Fraction) -> int:
    """How many of the guest's CHUNKs hold the page mix."""
    total = size // CHUNK
    want = nonzero * size if isinstance(nonzero, Fraction) else nonzero
    return max(1, min(total, round(want / (DATA_SHARE * CHUNK))))


def write_save(save: Path, size: int, chunks: int, seed: int = 1) -> dict[str, int]:
    """A QEMU 7.2 stream of a ``size``-byte guest whose ``chunks`` data chunks lie evenly
    spread over the address space, the rest zero pages; return its pages per kind."""
    machine = b"pc-i440fx-7.2"
    prologue = (
        struct.pack(">II", q.QEVM_MAGIC, 3) + bytes([q.CONFIGURATION]) + struct.pack(">I", len(machine)) + machine
    )
    devices = [q.DeviceSection(q.FULL, q.SectionHeader(3, "timer", 0, 2), b"\x01" * 24)]
    state = q.StreamState(
        prologue=prologue,
        machine=machine.decode(),
        page_size=PAGE,
        capabilities=(),
        ram=q.SectionHeader(2, "ram", 0, 4),
        ram_blocks=(q.RamBlock("pc.ram", size),),
        ram_plan=[(q.START, 0), (q.PART, size // PAGE), (q.END, 0)],
        footers=True,
        devices=devices,
        vmdesc=json.dumps({"page_size": PAGE, "devices": [{"name": "timer", "instance_id": 0}]}).encode(),
    )
    total = size // CHUNK
    at = (np.arange(chunks, dtype=np.int64) * total) // chunks  # chunk index of each data chunk
    counts = dict.fromkeys(MIX, 0)

    def zeros(length: int):
        for done in range(0, length, ZEROS_MAX):
            yield q.Zeros(min(ZEROS_MAX, length - done))

    def source(block):
        pos = 0
        for index, chunk in zip(at.tolist(), memory_chunks(np.random.default_rng(seed), chunks, counts)):
            yield from zeros((index - pos) * CHUNK)
            yield chunk.data  # its zero pages become ZERO entries, the rest PAGE entries
            pos = index + 1
        yield from zeros((total - pos) * CHUNK)

    with open(save, "wb") as out:
        q.write_qemu_stream(out, state, None, source)
    counts["zero"] += (total - chunks) * (CHUNK // PAGE)
    return counts


def run_measured(args: list[str], work: Path) -> tuple[int, float]:
    """(peak RSS in bytes, wall seconds) of running ``args`` to completion, as GNU time reports
    them. Not os.wait4 on our own child: a child forked from this process inherits its
    high-water RSS (Linux keeps maxrss across exec), so every command would show ours."""
    report = work / "time.txt"
    proc = subprocess.run(
        [GNU_TIME, "-f", "%M %e", "-o", str(report), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed: {proc.stderr.decode()[-500:]}")
    kib, seconds = report.read_text().split()
    return int(kib) * 1024, float(seconds)


def measure(size: int, nonzero: int | Fraction, commands: list[str], work: Path) -> dict:
    save, lean, zst = work / "vm.save", work / "vm.lean", work / "vm.save.zst"
    leanimg = [sys.executable, "-c", "from leanimg.cli import main; main()"]
    argv = {
        "convert": (save, [*leanimg, "convert", str(save), "-o", str(lean), "-f"]),
        "convert --spool": (save, [*leanimg, "convert", str(save), "-o", str(lean), "-f", "--spool"]),
        "validate": (lean, [*leanimg, "validate", str(lean)]),
        "inspect": (lean, [*leanimg, "inspect", str(lean)]),
        "map": (lean, [*leanimg, "map", str(lean)]),
        "restore raw": (lean, [*leanimg, "restore", str(lean), "--to", "raw", "-o", os.devnull]),
        "restore qemu": (lean, [*leanimg, "restore", str(lean), "--to", "qemu", "-o", os.devnull]),
        # then fsync, as convert fsyncs its image before renaming it into place
        "zstd -T0 -3": (save, ["sh", "-c", 'zstd -q -f -T0 -3 "$1" -o "$2" && sync "$2"', "sh", str(save), str(zst)]),
    }
    try:
        start = time.perf_counter()
        pages = write_save(save, size, data_chunks(size, nonzero))
        result: dict = {"generate_seconds": time.perf_counter() - start, "pages": pages, "commands": {}}
        result["save_bytes"] = save.stat().st_size
        needs_image = any(argv[name][0] == lean for name in commands)
        order = (["convert"] if needs_image and "convert" not in commands else []) + commands
        for name in order:
            evict_from_page_cache(argv[name][0])
            rss, seconds = run_measured(argv[name][1], work)
            if name in commands:
                result["commands"][name] = {"peak_rss": rss, "seconds": seconds}
            print(f"  {_size(size):>8} {name:<16} {rss / MIB:8.0f} MiB {seconds:8.1f} s", file=sys.stderr)
            if name == "zstd -T0 -3":
                result["zstd_bytes"] = zst.stat().st_size
                zst.unlink()
            if name.startswith("convert"):
                result["image_bytes"] = lean.stat().st_size
    finally:
        for path in (save, lean, zst):
            path.unlink(missing_ok=True)
    return result


def _size(size: int) -> str:
    if size >= 1 << 40:
        return f"{size / (1 << 40):g} TiB"
    return f"{size / GIB:g} GiB" if size >= GIB else f"{size / MIB:g} MiB"


def _nonzero(text: str) -> int | Fraction:
    """A fraction of the guest (``1/64``, ``0.25``) or a size (``16GiB``)."""
    try:
        value = Fraction(text)
    except ValueError:
        return size_parser(PAGE)(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a fraction of the guest must be in (0, 1], got {text}")
    return value


def render(table: dict[int, dict]) -> str:
    sizes = list(table)
    names = list(next(iter(table.values()))["commands"])
    lines = ["peak RSS in MiB and wall seconds per command, by guest size (cold input)", ""]
    lines.append(f"{'':<18}" + "".join(f"{_size(s):>20}" for s in sizes))
    lines.append(f"{'':<18}" + "".join(f"{'MiB':>11}{'s':>9}" for _ in sizes))
    for name in names:
        cells = [table[s]["commands"][name] for s in sizes]
        lines.append(f"{name:<18}" + "".join(f"{c['peak_rss'] / MIB:>11.0f}{c['seconds']:>9.1f}" for c in cells))
    lines.append("")

    def row(label: str, values) -> str:
        return f"{label:<18}" + "".join(f"{v:>20}" for v in values)

    lines.append(row("non-zero data", [f"{_nz_bytes(table[s]) / GIB:.2f} GiB" for s in sizes]))
    lines.append(row("save", [f"{table[s]['save_bytes'] / GIB:.2f} GiB" for s in sizes]))
    if all("image_bytes" in table[s] for s in sizes):
        lines.append(row("image", [f"{table[s]['image_bytes'] / GIB:.2f} GiB" for s in sizes]))
    if all("zstd_bytes" in table[s] for s in sizes):
        lines.append(row("save.zst", [f"{table[s]['zstd_bytes'] / GIB:.2f} GiB" for s in sizes]))
    lines.append(row("generate (s)", [f"{table[s]['generate_seconds']:.1f}" for s in sizes]))
    lines.append(row("classes, 1 B/page", [f"{s // PAGE * CLASS_BYTES_PER_PAGE / MIB:.0f} MiB" for s in sizes]))
    return "\n".join(lines)


def _nz_bytes(result: dict) -> int:
    return (result["pages"]["text"] + result["pages"]["random"]) * PAGE


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=size_parser(CHUNK), default=[GIB, 16 * GIB])
    parser.add_argument(
        "--nonzero",
        type=_nonzero,
        default=16 * GIB,
        help="non-zero data: a size (at most 55%% of the guest) or a fraction of the guest like 1/64 (default 16GiB)",
    )
    parser.add_argument(
        "--commands", nargs="+", choices=COMMANDS + OPTIONAL, default=list(COMMANDS), help="what to measure, in order"
    )
    parser.add_argument("--workdir", type=Path, default=None, help="where the save and image go")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON here")
    options = parser.parse_args(argv)
    require_null_device()
    if not os.path.exists(GNU_TIME):
        raise SystemExit(f"{GNU_TIME} is missing: apt-get install time")
    if options.workdir is not None:
        options.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="leanimg-bench-memory-", dir=options.workdir))
    table = {}
    try:
        for size in options.sizes:
            table[size] = measure(size, options.nonzero, options.commands, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(render(table))
    if options.json:
        options.json.write_text(json.dumps({str(s): r for s, r in table.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
