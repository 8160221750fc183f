"""pytest fixtures for tests that need a real saved guest (import them into a test module).

from guest.fixtures import saved_guest  # noqa: F401  (module-scoped fixture)
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from pathlib import Path

import pytest

from .build import GuestBuild, build_guest
from .scenarios import wait_heartbeat
from .qemus import QEMU_7_2, Qemu, qemu_params
from .vm import GuestVM, copy_disk

MEM_MIB = 128


@dataclasses.dataclass(frozen=True)
class SavedGuest:
    build: GuestBuild
    disk: Path  # the disk as it was at save time (use a copy to boot from it)
    save: Path  # the migration stream QEMU wrote
    mem: Path  # pmemsave of guest-physical [0, mem_mib MiB) at save time
    mem_mib: int
    heartbeat: int  # last heartbeat the guest printed before the save
    workdir: Path
    qemu: Qemu = QEMU_7_2


def save_guest(
    workdir: Path,
    workload: tuple[str, ...] = ("pagecache", "/mnt"),
    mem_mib: int = MEM_MIB,
    build: GuestBuild | None = None,
    qemu: Qemu = QEMU_7_2,
) -> SavedGuest:
    """Boot the test guest, run ``workload``, stop it and save it; QEMU is gone afterwards."""
    build = build or build_guest()
    disk = copy_disk(build.disk, workdir / "disk.img")
    vm_dir = workdir / "source"
    vm_dir.mkdir()
    with GuestVM(build, disk, mem_mib=mem_mib, workdir=vm_dir, qemu=qemu) as vm:
        vm.wait_ready()
        vm.run_workload(*workload)
        vm.wait_heartbeat_after(1)
        vm.stop()
        heartbeat = vm.last_heartbeat()
        vm.save(workdir / "vm.save")
        vm.pmemsave(workdir / "mem.bin")
    return SavedGuest(build, disk, workdir / "vm.save", workdir / "mem.bin", mem_mib, heartbeat, workdir, qemu)


@pytest.fixture(scope="module", params=qemu_params())
def saved_guest(request, tmp_path_factory) -> SavedGuest:
    request.param.require()
    return save_guest(tmp_path_factory.mktemp(f"saved-{request.param.id}"), qemu=request.param)


@contextmanager
def running_guest_with_qmp(work: Path, *, mem_mib: int, devices: list[str], freed_mib: int, qemu: Qemu = QEMU_7_2):
    """A guest for checkpoint tests, booted in ``qemu`` from a copy of the test disk in ``work``
    with ``devices`` and a QMP socket of its own: page cache read from its disk, ``freed_mib``
    MiB written and freed, the ``pages`` workload running. Yields (vm, disk, qmp socket path)."""
    qemu.require()
    build = build_guest()
    disk = copy_disk(build.disk, work / "disk.img")
    (work / "source").mkdir()
    qmp = work / "leanimg-qmp.sock"
    extra = devices + ["-qmp", f"unix:{qmp},server=on,wait=off"]
    with GuestVM(build, disk, mem_mib=mem_mib, workdir=work / "source", extra_args=extra, qemu=qemu) as vm:
        vm.wait_ready(timeout=300)
        vm.run_workload("pagecache", "/mnt")
        vm.run_workload("freed", str(freed_mib))
        vm.run_workload("pages", "16", "0", "50")
        wait_heartbeat(vm, "pages", 1)
        yield vm, disk, qmp
