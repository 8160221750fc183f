"""Peak memory (RSS) of convert, restore and validate as the guest grows (issue 16 §5).

For each guest size a synthetic memory with bench_format's page mix (45 % zero, 35 %
text-like, 20 % random) is wrapped into a real-format QEMU 7.2 migration stream; then each
command runs as a child process and its peak RSS is read from wait4's rusage:

  convert         the save -> a lean image (streamed, one pass)
  convert --spool the save -> a lean image (RAM spooled to a sparse scratch file)
  restore raw     the image -> /dev/null, every page digest-checked
  restore qemu    the image -> the stream, to /dev/null
  validate        every rule of the image
  cat | zstd -3   the baseline: `zstd -T0 -3` of the save, for scale

The per-page tables a command may hold grow with the guest (the writer keeps class, slot
and digest: 25 bytes a page, 6.25 MiB per GiB); everything else must stay bounded.

    python benchmarks/bench_memory.py --sizes 1GiB 4GiB [--workdir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_format import CHUNK, generate
from common import require_null_device, size_parser
from leanimg.converters import qemu as q

MIB = 1 << 20
GNU_TIME = "/usr/bin/time"  # Debian package "time"
TABLE_BYTES_PER_PAGE = 25


def make_save(raw: Path, save: Path) -> None:
    """``raw`` guest memory as the RAM block pc.ram of a QEMU stream with one device section."""
    import json
    import struct

    size = raw.stat().st_size
    machine = b"pc-i440fx-7.2"
    prologue = (
        struct.pack(">II", q.QEVM_MAGIC, 3) + bytes([q.CONFIGURATION]) + struct.pack(">I", len(machine)) + machine
    )
    devices = [q.DeviceSection(q.FULL, q.SectionHeader(3, "timer", 0, 2), b"\x01" * 24)]
    state = q.StreamState(
        prologue=prologue,
        machine=machine.decode(),
        page_size=4096,
        capabilities=(),
        ram=q.SectionHeader(2, "ram", 0, 4),
        ram_blocks=(q.RamBlock("pc.ram", size),),
        ram_plan=[(q.START, 0), (q.PART, size // 4096), (q.END, 0)],
        footers=True,
        devices=devices,
        vmdesc=json.dumps({"page_size": 4096, "devices": [{"name": "timer", "instance_id": 0}]}).encode(),
    )

    def chunks(block):
        with open(raw, "rb") as f:
            while chunk := f.read(CHUNK):
                yield chunk

    with open(save, "wb") as out:
        q.write_qemu_stream(out, state, None, chunks)


def peak_rss(args: list[str], work: Path) -> tuple[int, float]:
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


def measure(size: int, work: Path) -> dict:
    raw, save, lean = work / "memory.raw", work / "vm.save", work / "vm.lean"
    generate(str(raw), size, seed=1)
    make_save(raw, save)
    raw.unlink()
    leanimg = [sys.executable, "-c", "from leanimg.cli import main; main()"]
    commands = {
        "convert": [*leanimg, "convert", str(save), "-o", str(lean), "-f"],
        "convert --spool": [*leanimg, "convert", str(save), "-o", str(lean), "-f", "--spool"],
        "restore raw": [*leanimg, "restore", str(lean), "--to", "raw", "-o", os.devnull],
        "restore qemu": [*leanimg, "restore", str(lean), "--to", "qemu", "-o", os.devnull],
        "validate": [*leanimg, "validate", str(lean)],
        "zstd -T0 -3": ["zstd", "-q", "-f", "-T0", "-3", str(save), "-o", str(work / "vm.save.zst")],
    }
    results = {name: peak_rss(args, work) for name, args in commands.items()}
    for path in (save, lean, work / "vm.save.zst"):
        path.unlink(missing_ok=True)
    return results


def _size(size: int) -> str:
    return f"{size / (1 << 30):g} GiB" if size >= 1 << 30 else f"{size / MIB:g} MiB"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=size_parser(CHUNK), default=[1 << 30, 4 << 30])
    parser.add_argument("--workdir", type=Path, default=None, help="where the save and image go (needs 2x the size)")
    options = parser.parse_args(argv)
    require_null_device()
    if not os.path.exists(GNU_TIME):
        raise SystemExit(f"{GNU_TIME} is missing: apt-get install time")
    work = Path(tempfile.mkdtemp(prefix="leanimg-bench-memory-", dir=options.workdir))
    try:
        table = {size: measure(size, work) for size in options.sizes}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    names = list(next(iter(table.values())))
    print("peak RSS in MiB (wall seconds), by guest size")
    print(f"{'':<24}" + "".join(f"{_size(size):>18}" for size in table))
    for name in names:
        print(f"{name:<24}" + "".join(f"{table[s][name][0] / MIB:>10.0f} ({table[s][name][1]:5.1f})" for s in table))
    print(
        f"{'page tables, 25 B/page':<24}"
        + "".join(f"{s // 4096 * TABLE_BYTES_PER_PAGE / MIB:>10.1f}        " for s in table)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
