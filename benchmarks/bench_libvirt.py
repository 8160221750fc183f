"""libvirt's save image against its bare QEMU stream: convert time and sizes (issue 32 §4).

A QEMU save (default: the bundled QEMU 7.2 sample; ``--save``: any, e.g. a save of
bench_qemu.py's 1 GiB guest) is wrapped in libvirt's header, domain XML, cookie and 64 KiB of
padding exactly as libvirt 9.0 writes them (raw payload). Then, interleaved N times each
(medians), the CLI in a subprocess as a user runs it:

  convert stream    `leanimg convert SAVE -o A.lean` on the bare stream
  convert libvirt   `leanimg convert DOM.save -o B.lean` on the libvirt file

and once: `zstd -3` of the libvirt file, `convert --disk vda=DISK` (with ``--disk``; the
sample's bundled disk by default) and the sizes of all of them.

    python benchmarks/bench_libvirt.py                          # the sample, 5 repeats
    python benchmarks/bench_libvirt.py --save vm.save --disk disk.img --repeat 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zstandard

from leanimg.cli import command_line

SAMPLE = Path(__file__).resolve().parents[1] / "lean-image" / "sample"
XML = """<domain type='qemu'>
  <name>bench</name>
  <uuid>0b3f5e0c-5a55-4d1e-8f1b-3c2f4f1a9b10</uuid>
  <memory unit='KiB'>{kib}</memory>
  <os><type arch='x86_64' machine='pc-i440fx-7.2'>hvm</type></os>
  <devices><disk type='file' device='disk'><source file='{disk}'/><target dev='vda' bus='virtio'/></disk></devices>
</domain>
"""
COOKIE = (
    b"<qemu-save-cookie>\n  <cpu mode='custom' match='exact' check='none'><model>qemu64</model></cpu>\n"
    b"</qemu-save-cookie>\n"
)


def wrap(stream_path: Path, out: Path, disk: str, kib: int) -> None:
    """libvirt's layout (virQEMUSaveDataWrite): header, XML\\0, cookie\\0, 64 KiB zeros, stream."""
    xml = XML.format(kib=kib, disk=disk).encode() + b"\0"
    data = xml + COOKIE + b"\0" + bytes(64 * 1024)
    with open(out, "wb") as f:
        f.write(struct.pack("<16s5I56s", b"LibvirtQemudSave", 2, len(data), 1, 0, len(xml), bytes(56)))
        f.write(data)
        with open(stream_path, "rb") as src:
            shutil.copyfileobj(src, f, 1 << 20)


def timed(argv: list[str]) -> float:
    t0 = time.monotonic()
    subprocess.run(argv, check=True, capture_output=True)
    return time.monotonic() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--save", type=Path, help="a QEMU save (default: the bundled sample)")
    parser.add_argument("--disk", type=Path, help="its disk (default: the sample's)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--json", type=Path)
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-libvirt-", dir=options.workdir))
    leanimg = command_line()
    try:
        save, disk = options.save, options.disk
        if save is None:
            save, disk = work / "vm.save", disk or work / "disk.img"
            for name, path in (("vm.save.zst", save), ("disk.img.zst", disk)):
                with open(SAMPLE / name, "rb") as src, open(path, "wb") as dst:
                    zstandard.ZstdDecompressor().copy_stream(src, dst)
        dom = work / "dom.save"
        wrap(save, dom, str(disk) if disk else "/nonexistent", 96 * 1024)
        times = {"stream": [], "libvirt": []}
        for _ in range(options.repeat):
            times["stream"].append(timed([*leanimg, "convert", save, "-o", work / "a.lean", "-f"]))
            times["libvirt"].append(timed([*leanimg, "convert", dom, "-o", work / "b.lean", "-f"]))
        subprocess.run(["zstd", "-q", "-3", "-f", dom, "-o", work / "dom.save.zst"], check=True)
        sizes = {
            "stream": save.stat().st_size,
            "libvirt save": dom.stat().st_size,
            "libvirt save, zstd -3": (work / "dom.save.zst").stat().st_size,
            "lean": (work / "b.lean").stat().st_size,
        }
        if disk:
            subprocess.run(
                [*leanimg, "convert", dom, "-o", work / "c.lean", "--disk", f"vda={disk}"],
                check=True,
                capture_output=True,
            )
            sizes["lean --disk"] = (work / "c.lean").stat().st_size
        result = {
            "repeat": options.repeat,
            "median_seconds": {k: statistics.median(v) for k, v in times.items()},
            "seconds": times,
            "bytes": sizes,
        }
        ratio = result["median_seconds"]["libvirt"] / result["median_seconds"]["stream"]
        print(
            f"convert, median of {options.repeat}: bare stream {result['median_seconds']['stream']:.2f} s, "
            f"libvirt save {result['median_seconds']['libvirt']:.2f} s ({ratio:.2f}x)"
        )
        for name, size in sizes.items():
            print(f"  {name:<24} {size:>13,} bytes  {size / 2**20:9.1f} MiB")
        if options.json:
            options.json.write_text(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
