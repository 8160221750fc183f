"""The Debian 12 benchmark guest of bench_distro.py: its build and a running QEMU of it.

``build()`` runs guest/debian/build.sh (mmdebstrap: systemd, PostgreSQL 15, gcc/make, Debian's
kernel on a raw ext4 disk; cached under /var/tmp/leanimg-debian-guest) and returns its folder.
``DistroVM`` boots a copy of its disk in QEMU (TCG) with -kernel/-initrd, root=/dev/vda, and
gives the benchmark the guest's console (ttyS0, logged), a control channel to the guest's
``leanimg-agent`` (ttyS1: run a shell command, wait for its end), a QMP socket for itself and
another for ``leanimg checkpoint``, and the virtio-serial port of the guest free-list helper.
Every wait has a timeout; QEMU is killed on exit.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from guest.vm import QMP, GuestError, QemuControl, Serial  # noqa: E402

BUILD_SCRIPT = REPO / "guest" / "debian" / "build.sh"
CMDLINE = "root=/dev/vda rw console=ttyS0 quiet"
LOGIN_PROMPT = "login:"


@dataclasses.dataclass(frozen=True)
class DistroBuild:
    folder: Path

    @property
    def disk(self) -> Path:
        return self.folder / "disk.img"

    @property
    def kernel_version(self) -> str:
        return (self.folder / "kernel-version").read_text().strip()


def build(log) -> DistroBuild:
    """The cached guest, built first if needed (~5 min: mmdebstrap downloads ~250 MB)."""
    t0 = time.monotonic()
    proc = subprocess.run(["sh", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{BUILD_SCRIPT} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    folder = Path(proc.stdout.strip().splitlines()[-1])
    log(f"guest build {folder} ({time.monotonic() - t0:.0f} s)")
    return DistroBuild(folder)


def qemu_args(build: DistroBuild, disk: Path, work: Path, mem_mib: int) -> list[str]:
    return [
        *("qemu-system-x86_64", "-accel", "tcg", "-machine", "pc", "-cpu", "qemu64", "-smp", "1"),
        *("-m", f"{mem_mib}M", "-nodefaults", "-vga", "std", "-display", "none", "-no-reboot"),
        *("-kernel", str(build.folder / "vmlinuz"), "-initrd", str(build.folder / "initrd.img"), "-append", CMDLINE),
        *("-drive", f"file={disk},format=raw,if=virtio,cache=writeback"),
        *("-chardev", f"socket,id=ser0,path={work / 'console.sock'},server=on,wait=on", "-serial", "chardev:ser0"),
        *("-chardev", f"socket,id=ctl,path={work / 'ctl.sock'},server=on,wait=off", "-serial", "chardev:ctl"),
        *("-qmp", f"unix:{work / 'qmp.sock'},server=on,wait=off"),
        *("-qmp", f"unix:{work / 'leanimg-qmp.sock'},server=on,wait=off"),
        *("-device", "virtio-serial-pci"),
        *("-chardev", f"socket,id=lf,path={work / 'free.sock'},server=on,wait=off"),
        *("-device", "virtserialport,chardev=lf,name=org.leanimg.free.0"),
    ]


class DistroVM(QemuControl):
    """One QEMU of the Debian guest; ``leanimg_qmp`` and ``free_sock`` are for leanimg."""

    def __init__(self, build: DistroBuild, disk: Path, work: Path, mem_mib: int = 1024):
        self.work, self.mem_mib = work, mem_mib
        self.args = qemu_args(build, disk, work, mem_mib)
        self.leanimg_qmp, self.free_sock = work / "leanimg-qmp.sock", work / "free.sock"
        self.proc = self.console = self.ctl = self.qmp = None
        self._ids = itertools.count(1)

    def _start(self) -> None:
        self.stderr = open(self.work / "qemu.stderr", "wb")
        self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=self.stderr, stderr=subprocess.STDOUT)
        self.console = Serial(self.work / "console.sock", self.work / "console.log")
        self.ctl = Serial(self.work / "ctl.sock", self.work / "ctl.log")
        self.qmp = QMP(self.work / "qmp.sock")

    def _channels(self) -> tuple:
        return self.qmp, self.ctl, self.console

    def wait_booted(self, timeout: float = 900) -> float:
        """Seconds until the agent answers (systemd reached multi-user.target)."""
        t0 = time.monotonic()
        self.console.wait_for(LOGIN_PROMPT, timeout)
        while True:
            try:
                self.run("true", timeout=5)
                return time.monotonic() - t0
            except GuestError:
                if time.monotonic() - t0 > timeout:
                    raise

    def run(self, command: str, timeout: float = 600, check: bool = True) -> list[str]:
        """Run ``command`` in the guest (sh -c, as root); its output lines."""
        ident = f"c{next(self._ids)}"
        start = len(self.ctl.text)
        self.ctl.send(f"{ident} {command}")
        m = self.ctl.wait_for(rf"LEANIMG-DONE {ident} (\d+)", timeout, start)
        prefix = f"{ident}| "
        lines = [line[len(prefix) :] for line in self.ctl.text[start:].splitlines() if line.startswith(prefix)]
        if check and m.group(1) != "0":
            raise GuestError(f"guest command {command!r} exited {m.group(1)}:\n" + "\n".join(lines[-30:]))
        return lines

    def start(self, command: str) -> None:
        """Start ``command`` in the guest and do not wait for it."""
        self.ctl.send(f"bg{next(self._ids)} {command}")

    def meminfo(self) -> dict[str, int]:
        """/proc/meminfo's main lines, in KiB."""
        lines = self.run("leanimg-workload meminfo", timeout=60)
        return {m.group(1): int(m.group(2)) for m in (re.match(r"(\w+):\s+(\d+) kB", x) for x in lines) if m}
