"""Multi-step guest scenarios: one booted guest, several workloads, a save after each.

    from guest.scenarios import E2E_STEPS, run_scenario
    saves = run_scenario(workdir, E2E_STEPS)          # {"idle": SavePoint, ...}

Booting the Debian kernel under TCG is the slow part of every QEMU test, so a scenario
boots once and runs the workloads one after another in the same guest.  After each one
it ``stop``s the VM, migrates it to ``<name>.save``, takes a ``pmemsave`` ground truth,
copies the disk as it is at that moment (a destination must boot from the same disk
content) and ``cont``s, so the next workload starts from a running guest again.

Every workload process prints its own heartbeat ``HB <mode> <n>`` forever, so with several
workloads alive in one guest the heartbeat of interest is picked by ``mode``
(``GuestVM.last_heartbeat`` mixes them all).
"""

from __future__ import annotations

import dataclasses
import re
import time
from pathlib import Path

from .build import DiskSpec, GuestBuild, build_guest
from .qemus import QEMU_7_2, Qemu
from .vm import GuestVM, copy_disk

# name, workload arguments.  "dirty" writes without sync: its data sits in the guest's
# page cache (writeback may or may not have started when the save is taken).
E2E_STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("idle", ("idle",)),
    ("pagecache", ("pagecache", "/mnt")),
    ("anon", ("anon", "16")),
    ("dirty", ("dirty", "/mnt", "8")),
)

# benchmarks/bench_qemu.py: a 1 GiB guest with a realistic mix.  About 320 MiB of files
# read into the page cache (256 MiB compressible text, 64 MiB random), 128 MiB of random
# anonymous memory, 64 MiB of dirty (random) page cache; the rest is kernel, free or zero.
BENCH_MEM_MIB = 1024
BENCH_DISK = DiskSpec(size_mib=640, text_mib=256, binary_mib=64, seed=11)
BENCH_STEPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("pagecache", ("pagecache", "/mnt")),
    ("anon", ("anon", "128")),
    ("dirty", ("dirty", "/mnt", "64")),
)


@dataclasses.dataclass(frozen=True)
class SavePoint:
    name: str
    workload: tuple[str, ...]
    build: GuestBuild
    save: Path  # the migration stream QEMU wrote (``exec:cat > FILE``)
    mem: Path  # pmemsave of guest-physical [0, mem_mib MiB) at save time
    disk: Path  # copy of the disk at save time (copy it again before booting from it)
    mem_mib: int
    mode: str  # the workload mode whose heartbeat proves a resumed guest runs
    heartbeat: int  # the last ``HB <mode> n`` printed before the save
    save_seconds: float
    qemu: Qemu = QEMU_7_2  # the QEMU and machine type that saved it (restore into the same)


def heartbeats(text: str, mode: str) -> list[int]:
    return [int(n) for n in re.findall(rf"HB {re.escape(mode)} (\d+)", text)]


def last_heartbeat(vm: GuestVM, mode: str) -> int:
    beats = heartbeats(vm.serial.text, mode)
    return beats[-1] if beats else -1


def wait_heartbeat(vm: GuestVM, mode: str, after: int, timeout: float = 60.0) -> int:
    """Wait for a heartbeat ``HB <mode> n`` with ``n > after``; return ``n``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        beat = last_heartbeat(vm, mode)
        if beat > after:
            return beat
        if vm.proc.poll() is not None:
            break
        vm.serial.nudge_if_silent()
        time.sleep(0.1)
    raise vm.serial.timed_out(
        f"no 'HB {mode} n' with n > {after} within {timeout}s; last output:\n"
        f"{vm.serial.text[-1500:]}\nQEMU:\n{vm.qemu_output()[-1500:]}"
    )


def save_point(vm: GuestVM, workdir: Path, name: str, workload: tuple[str, ...], timeout: float = 600.0) -> SavePoint:
    """stop, migrate to ``workdir/<name>.save``, pmemsave, copy the disk, cont."""
    mode = workload[0]
    vm.stop()
    heartbeat = last_heartbeat(vm, mode)
    save, mem, disk = (workdir / f"{name}.save", workdir / f"{name}.mem", workdir / f"{name}.disk.img")
    t0 = time.monotonic()
    vm.save(save, timeout=timeout)
    seconds = time.monotonic() - t0
    vm.pmemsave(mem)
    copy_disk(vm.disk, disk)
    vm.cont()
    return SavePoint(name, workload, vm.build, save, mem, disk, vm.mem_mib, mode, heartbeat, seconds, vm.qemu)


def run_scenario(
    workdir: Path,
    steps=E2E_STEPS,
    mem_mib: int = 128,
    build: GuestBuild | None = None,
    workload_timeout: float = 600.0,
    log=None,
    save_after=None,
    qemu: Qemu = QEMU_7_2,
) -> dict[str, SavePoint]:
    """Boot once (in ``qemu``), run ``steps`` one after another, save after each (or only
    after the steps named in ``save_after``); QEMU is gone afterwards."""
    build = build or build_guest()
    workdir.mkdir(parents=True, exist_ok=True)
    disk = copy_disk(build.disk, workdir / "disk.img")
    vm_dir = workdir / "source"
    vm_dir.mkdir(exist_ok=True)
    saves: dict[str, SavePoint] = {}
    say = log or (lambda msg: None)
    with GuestVM(build, disk, mem_mib=mem_mib, workdir=vm_dir, qemu=qemu) as vm:
        t0 = time.monotonic()
        vm.wait_ready(timeout=300)
        say(f"booted in {time.monotonic() - t0:.1f} s")
        for name, workload in steps:
            t0 = time.monotonic()
            vm.run_workload(*workload, timeout=workload_timeout)
            wait_heartbeat(vm, workload[0], 0)  # the workload is in its heartbeat loop
            say(f"workload {' '.join(workload)}: {time.monotonic() - t0:.1f} s")
            if save_after is not None and name not in save_after:
                continue
            saves[name] = save_point(vm, workdir, name, workload)
            say(f"saved {name}: {saves[name].save.stat().st_size / 2**20:.1f} MiB in {saves[name].save_seconds:.1f} s")
    return saves


def assert_resumes(sp: SavePoint, disk: Path, workdir: Path, restore_argv: list[str]) -> None:
    """A fresh QEMU on ``disk`` loads the stream ``restore_argv`` writes to stdout through
    ``-incoming exec:``: paused, its memory equal to ``sp``'s pmemsave byte for byte, no error
    from the restorer; after ``cont`` the workload's heartbeat goes on."""
    import shlex
    from helpers import first_difference
    from leanimg.fileutil import sha256_file

    vm_dir = workdir / "dest"
    vm_dir.mkdir()
    with GuestVM(
        sp.build, disk, mem_mib=sp.mem_mib, workdir=vm_dir, qemu=sp.qemu, incoming=f"exec:{shlex.join(restore_argv)}"
    ) as vm:
        vm.wait_incoming(timeout=180)
        assert vm.status() == "paused"
        restored = workdir / "restored.mem"
        vm.pmemsave(restored)
        assert restored.stat().st_size == sp.mem.stat().st_size
        assert sha256_file(restored) == sha256_file(sp.mem), first_difference(restored, sp.mem)
        assert "Traceback" not in vm.qemu_output() and "leanimg:" not in vm.qemu_output()
        vm.cont()
        assert wait_heartbeat(vm, sp.mode, sp.heartbeat, timeout=60) > sp.heartbeat
        assert vm.status() == "running"
