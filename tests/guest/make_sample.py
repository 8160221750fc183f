"""Make the bundled sample: a real QEMU 7.2 save of the test guest plus its disk, zstd-compressed.

    python tests/guest/make_sample.py OUTDIR [--mem-mib 96]

Writes OUTDIR/vm.save.zst (the migration stream after a page-cache-heavy workload),
OUTDIR/disk.img.zst (the guest's ext4 disk at save time) and OUTDIR/sample.json (sizes,
sha256 of the uncompressed files and of a pmemsave of guest RAM at save time, QEMU command).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import zstandard

from leanimg.fileutil import sha256_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from guest.build import DiskSpec, build_guest  # noqa: E402
from guest.fixtures import save_guest  # noqa: E402
from guest.vm import qemu_args  # noqa: E402

# Small enough to ship: the page cache holds compressible text.  The floor is the Debian
# kernel itself (~25 MiB of code and data in guest RAM, ~8 MB compressed).
SAMPLE_DISK = DiskSpec(size_mib=32, text_mib=6, binary_mib=0, seed=7)
# Freed memory is zeroed so that stale boot data (the compressed kernel, the initramfs
# archive) does not dominate the compressed sample.
SAMPLE_CMDLINE = "init_on_free=1"


def compress(src: Path, dst: Path, level: int = 19) -> int:
    cctx = zstandard.ZstdCompressor(level=level, threads=-1, write_checksum=True)
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        cctx.copy_stream(fin, fout, size=src.stat().st_size)
    return dst.stat().st_size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--mem-mib", type=int, default=96)
    args = ap.parse_args(argv)
    args.outdir.mkdir(parents=True, exist_ok=True)
    build = build_guest(SAMPLE_DISK, SAMPLE_CMDLINE)
    with tempfile.TemporaryDirectory(prefix="leanimg-sample-") as tmp:
        saved = save_guest(Path(tmp), ("pagecache", "/mnt"), args.mem_mib, build)
        info = {
            "mem_mib": args.mem_mib,
            "machine": "pc (pc-i440fx-7.2)",
            "qemu_version": _qemu_version(),
            "qemu_args": [a for a in qemu_args(build, Path("disk.img"), Path("."), args.mem_mib)],
            "files": {},
        }
        for name, path in (("vm.save", saved.save), ("disk.img", saved.disk)):
            size = compress(path, args.outdir / f"{name}.zst")
            info["files"][name] = {"size": path.stat().st_size, "zst_size": size, "sha256": sha256_file(path)}
        info["pmemsave_sha256"] = sha256_file(saved.mem)
        info["kernel_cmdline"] = build.cmdline
    (args.outdir / "sample.json").write_text(json.dumps(info, indent=2) + "\n")
    for name, f in info["files"].items():
        print(f"{name}: {f['size']} bytes -> {name}.zst {f['zst_size']} bytes")
    return 0


def _qemu_version() -> str:
    out = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0] if out.stdout else "unknown"


if __name__ == "__main__":
    sys.exit(main())
