"""Build the test guest from Debian packages: kernel, busybox initramfs, workload, ext4 disk.

Everything is made at test time and cached under ``$LEANIMG_GUEST_CACHE`` (default
``/tmp/leanimg-guest-cache``) in a directory named after a hash of the inputs, so a changed
recipe never reuses a stale build.  Needs: linux-image-amd64, busybox-static, gcc (with the
static libc), e2fsprogs.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
GUEST_FREE_HELPER = HERE.parents[1] / "guest" / "leanimg-guest-free.c"

# insmod order for a virtio disk with ext4 on the Debian 6.1 kernel (see ENVIRONMENT.md);
# virtio_balloon lets a guest with a virtio-balloon (free-page-reporting=on) hand its free
# blocks to the host (issue 13); virtio_console gives the guest free-list helper its port
# (guest/leanimg-guest-free.c, `checkpoint --guest-free`); crc32c-intel is left out: the TCG "qemu64" CPU has
# no SSE4.2, crc32c_generic serves ext4.
MODULES = [
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "virtio_blk",
    "crc32c_generic",
    "jbd2",
    "mbcache",
    "crc16",
    "ext4",
    "virtio_balloon",
    "virtio_console",
]
SKIP_MODULES = {"crc32c-intel.ko"}  # pulled in by "crc32c" aliases; see above

READY_MARKER = "LEANIMG-READY"
# The Debian kernel needs about 90 MiB of guest RAM to reach init (it reserves ~60 MiB).
KERNEL_CMDLINE = "console=ttyS0 panic=-1 quiet loglevel=1 nokaslr rdinit=/init mitigations=off"

INIT_SCRIPT = """#!/bin/busybox sh
/bin/busybox mkdir -p /proc /sys /dev /mnt /tmp /usr/bin /usr/sbin /sbin
/bin/busybox --install -s
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
for m in {modules}; do
    insmod /lib/modules/$m.ko || echo "LEANIMG-ERROR insmod $m"
done
mount -t ext4 /dev/vda /mnt || echo "LEANIMG-ERROR mount /dev/vda"
echo {ready}
# Commands arrive on the serial console, one per line.
while read -r cmd rest; do
    case "$cmd" in
        run) /bin/workload $rest & echo "LEANIMG-STARTED $!" ;;
        free) /bin/leanimg-guest-free & echo "LEANIMG-STARTED $!" ;;
        kill) kill $rest; wait $rest; echo "LEANIMG-KILLED $rest" ;;
        sync) sync; echo LEANIMG-SYNCED ;;
        "") ;;
        *) echo "LEANIMG-UNKNOWN $cmd" ;;
    esac
done
"""


@dataclasses.dataclass(frozen=True)
class DiskSpec:
    """Files put on the guest's ext4 disk: compressible text and random binary data."""

    size_mib: int = 64
    text_mib: int = 12
    binary_mib: int = 4
    seed: int = 1


@dataclasses.dataclass(frozen=True)
class GuestBuild:
    kernel: Path
    initrd: Path
    disk: Path  # pristine image: copy it before booting (the guest writes to it)
    disk_spec: DiskSpec
    cmdline: str = KERNEL_CMDLINE


def cache_root() -> Path:
    return Path(os.environ.get("LEANIMG_GUEST_CACHE", "/tmp/leanimg-guest-cache"))


def find_kernel() -> tuple[Path, str]:
    kernels = sorted(glob.glob("/boot/vmlinuz-*"))
    if not kernels:
        raise FileNotFoundError("no /boot/vmlinuz-*: apt-get install linux-image-amd64")
    kernel = Path(kernels[-1])
    return kernel, kernel.name[len("vmlinuz-") :]


def module_paths(version: str) -> list[Path]:
    """The .ko files of MODULES, in insmod order, via modprobe --show-depends."""
    paths: list[Path] = []
    for name in MODULES:
        out = subprocess.run(
            ["modprobe", "-S", version, "--show-depends", name], check=True, capture_output=True, text=True
        ).stdout
        for line in out.splitlines():
            if line.startswith("insmod "):
                path = Path(line.split()[1])
                if path not in paths and path.name not in SKIP_MODULES:
                    paths.append(path)
    return paths


def build_guest(disk_spec: DiskSpec = DiskSpec(), extra_cmdline: str = "") -> GuestBuild:
    """Build (or reuse from the cache) the kernel + initramfs + disk for ``disk_spec``.

    ``extra_cmdline`` is appended to the kernel command line (it needs no rebuild)."""
    kernel, version = find_kernel()
    key = _cache_key(kernel, disk_spec)
    out = cache_root() / f"guest-{key}"
    result = GuestBuild(
        kernel=kernel,
        initrd=out / "initrd.cpio",
        disk=out / "disk.img",
        disk_spec=disk_spec,
        cmdline=f"{KERNEL_CMDLINE} {extra_cmdline}".strip(),
    )
    if (out / "done").exists():
        return result
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=_ensure(cache_root())))
    try:
        programs = {
            "workload": _compile(HERE / "workload.c", tmp / "workload"),
            "leanimg-guest-free": _compile(GUEST_FREE_HELPER, tmp / "leanimg-guest-free"),
        }
        _write_initramfs(tmp / "initrd.cpio", programs, module_paths(version))
        _make_disk(tmp / "disk.img", tmp / "files", disk_spec)
        shutil.rmtree(tmp / "files")
        (tmp / "done").write_text(json.dumps(dataclasses.asdict(disk_spec)))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _cache_key(kernel: Path, disk_spec: DiskSpec) -> str:
    h = hashlib.sha256()
    for src in (Path(__file__), HERE / "workload.c", GUEST_FREE_HELPER):
        h.update(src.read_bytes())
    h.update(f"{kernel}:{kernel.stat().st_size}:{disk_spec}".encode())
    return h.hexdigest()[:16]


def _compile(source: Path, binary: Path) -> Path:
    subprocess.run(["gcc", "-static", "-O2", "-o", str(binary), str(source)], check=True, capture_output=True)
    return binary


def _write_initramfs(path: Path, programs: dict[str, Path], modules: list[Path]) -> None:
    busybox = shutil.which("busybox") or "/bin/busybox"
    names = [m.name[: -len(".ko")] for m in modules]
    init = INIT_SCRIPT.format(modules=" ".join(names), ready=READY_MARKER)
    with open(path, "wb") as f:
        cpio = _CpioWriter(f)
        for d in ("bin", "dev", "lib", "lib/modules", "mnt", "proc", "sys", "tmp"):
            cpio.add("d", d)
        cpio.add("c", "dev/console", mode=0o600, rdev=(5, 1))
        cpio.add("f", "init", init.encode(), mode=0o755)
        cpio.add("f", "bin/busybox", Path(busybox).read_bytes(), mode=0o755)
        for name, binary in programs.items():
            cpio.add("f", f"bin/{name}", binary.read_bytes(), mode=0o755)
        for m in modules:
            cpio.add("f", f"lib/modules/{m.name}", m.read_bytes(), mode=0o644)
        cpio.close()


class _CpioWriter:
    """Minimal 'newc' cpio archive writer (what the kernel unpacks as an initramfs)."""

    _TYPES = {"d": 0o040000, "f": 0o100000, "c": 0o020000}

    def __init__(self, f):
        self.f = f
        self.ino = 1

    def add(self, kind: str, name: str, data: bytes = b"", mode: int = 0o755, rdev: tuple[int, int] = (0, 0)) -> None:
        fields = [
            self.ino,
            self._TYPES[kind] | mode,
            0,
            0,
            2 if kind == "d" else 1,
            0,
            len(data),
            0,
            0,
            rdev[0],
            rdev[1],
            len(name) + 1,
            0,
        ]
        self.ino += 1
        header = b"070701" + b"".join(b"%08X" % v for v in fields)
        self._put(header + name.encode() + b"\0")
        self._put(data)

    def close(self) -> None:
        self.add("f", "TRAILER!!!", mode=0)

    def _put(self, blob: bytes) -> None:
        self.f.write(blob)
        self.f.write(b"\0" * (-self.f.tell() % 4))


def _make_disk(image: Path, files: Path, spec: DiskSpec) -> None:
    _write_files(files, spec)
    subprocess.run(
        ["mkfs.ext4", "-q", "-F", "-b", "4096", "-d", str(files), str(image), f"{spec.size_mib}M"],
        check=True,
        capture_output=True,
    )


def _write_files(root: Path, spec: DiskSpec) -> None:
    """Deterministic content: word salad (compresses like text) and random bytes."""
    rng = np.random.default_rng(spec.seed)
    words = np.array(_vocabulary(rng), dtype=object)
    text_dir, bin_dir = _ensure(root / "text"), _ensure(root / "data")
    for i in range(spec.text_mib):
        picks = words[rng.integers(0, len(words), size=200_000)]
        blob = " ".join(picks).encode()[: 1 << 20]
        (text_dir / f"doc{i:03d}.txt").write_bytes(blob)
    for i in range(spec.binary_mib):
        (bin_dir / f"blob{i:03d}.bin").write_bytes(rng.bytes(1 << 20))
    (root / "hello.txt").write_text("hello from the leanimg test guest\n")


def _vocabulary(rng: np.random.Generator) -> list[str]:
    letters = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz", dtype=np.uint8)
    weights = np.linspace(2.0, 0.2, len(letters))
    weights /= weights.sum()
    vocab = []
    for length in rng.integers(2, 11, size=4000):
        vocab.append(rng.choice(letters, size=length, p=weights).tobytes().decode())
    return vocab
