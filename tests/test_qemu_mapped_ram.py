"""mapped-ram files with a real QEMU 10.0 (TCG): QEMU's own files convert and come back, and
leanimg's load into QEMU 10 (issue 31 §2, §3).

One 128 MiB guest boots once in QEMU 10 and runs the page-cache workload; it is then stopped
and saved three times, continued in between (each save with the pmemsave and the disk of its
instant): ``migrate file:`` with the capability mapped-ram, the same with multifd (2
channels), and a plain ``exec:cat`` stream.

* QEMU's mapped-ram files convert and validate, and `restore --to qemu-mapped-ram` gives
  them back byte for byte (sparse: zero pages are holes);
* a fresh QEMU 10 loads leanimg's mapped-ram file (``migrate-incoming file:``, the
  capabilities of the save) with the memory of the save, and the guest runs on;
* the other way round: the image of a mapped-ram file restored as a plain stream
  (``-incoming exec:leanimg restore``, no capability), and the plain save's image restored
  as a mapped-ram file, each load with the save's memory;
* a pipe is no output for a mapped-ram file: refused, nothing written.
"""

from __future__ import annotations

import dataclasses
import shlex
import subprocess
from pathlib import Path

import pytest

from guest.build import build_guest
from guest.qemus import QEMU_10_0, Qemu
from guest.scenarios import last_heartbeat, wait_heartbeat
from guest.vm import GuestVM, copy_disk
from helpers import first_difference
from leanimg.cli import command_line
from leanimg.fileutil import sha256_file

pytestmark = pytest.mark.qemu
LEANIMG = command_line()
MEM_MIB = 128
MAPPED = {"mapped-ram": True}
MAPPED_MULTIFD = {"mapped-ram": True, "multifd": True}


@dataclasses.dataclass(frozen=True)
class Save:
    name: str
    save: Path
    mem: Path
    disk: Path
    capabilities: dict  # the migration capabilities it was made with (and loads with)
    heartbeat: int
    qemu: Qemu


def leanimg(*args, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LEANIMG, *map(str, args)], capture_output=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr.decode(errors="replace")
        assert b"Traceback" not in proc.stderr
    return proc


def set_capabilities(vm: GuestVM, capabilities: dict) -> None:
    names = ("mapped-ram", "multifd")
    vm.qmp.execute(
        "migrate-set-capabilities",
        capabilities=[{"capability": name, "state": bool(capabilities.get(name))} for name in names],
    )
    if capabilities.get("multifd"):
        vm.qmp.execute("migrate-set-parameters", **{"multifd-channels": 2})


def save_as(vm: GuestVM, work: Path, name: str, capabilities: dict) -> Save:
    vm.stop()
    heartbeat = last_heartbeat(vm, "pagecache")
    save = work / f"{name}.save"
    set_capabilities(vm, capabilities)
    vm.qmp.execute("migrate-set-parameters", **{"max-bandwidth": 1 << 40})
    vm.qmp.execute("migrate", uri=f"file:{save}" if capabilities else f"exec:cat > {save}")
    vm._wait_migration(300)
    vm.pmemsave(work / f"{name}.mem")
    disk = copy_disk(vm.disk, work / f"{name}.disk.img")
    vm.cont()
    return Save(name, save, work / f"{name}.mem", disk, capabilities, heartbeat, vm.qemu)


@pytest.fixture(scope="module")
def saves(module_dirs) -> dict[str, Save]:
    QEMU_10_0.require()
    work = module_dirs("mapped-ram")
    build = build_guest()
    (work / "source").mkdir()
    with GuestVM(
        build, copy_disk(build.disk, work / "disk.img"), mem_mib=MEM_MIB, workdir=work / "source", qemu=QEMU_10_0
    ) as vm:
        vm.wait_ready(timeout=300)
        vm.run_workload("pagecache", "/mnt")
        wait_heartbeat(vm, "pagecache", 0)
        return {
            "mapped": save_as(vm, work, "mapped", MAPPED),
            "mapped-multifd": save_as(vm, work, "mapped-multifd", MAPPED_MULTIFD),
            "plain": save_as(vm, work, "plain", {}),
        }


@pytest.fixture(scope="module")
def images(saves, module_dirs) -> dict[str, Path]:
    out = module_dirs("mapped-ram-images")
    result = {}
    for name, s in saves.items():
        result[name] = out / f"{name}.lean"
        leanimg("convert", s.save, "-o", result[name])
        leanimg("validate", result[name])
    return result


def load_file(s: Save, file: Path, capabilities: dict, workdir: Path) -> None:
    """A fresh QEMU 10 on a copy of the save's disk loads ``file`` through `migrate-incoming
    file:` with ``capabilities``: memory equal to the save's pmemsave, the guest runs on."""
    workdir.mkdir()
    with GuestVM(
        build_guest(),
        copy_disk(s.disk, workdir / "disk.img"),
        mem_mib=MEM_MIB,
        workdir=workdir,
        incoming="defer",
        qemu=s.qemu,
    ) as vm:
        set_capabilities(vm, capabilities)
        vm.qmp.execute("migrate-incoming", uri=f"file:{file}")
        assert_loaded(vm, s, workdir)


def load_exec(s: Save, argv: list[str], workdir: Path) -> None:
    workdir.mkdir()
    with GuestVM(
        build_guest(),
        copy_disk(s.disk, workdir / "disk.img"),
        mem_mib=MEM_MIB,
        workdir=workdir,
        incoming=f"exec:{shlex.join(argv)}",
        qemu=s.qemu,
    ) as vm:
        assert_loaded(vm, s, workdir)


def assert_loaded(vm: GuestVM, s: Save, workdir: Path) -> None:
    vm.wait_incoming(timeout=300)
    assert vm.status() == "paused"
    restored = workdir / "restored.mem"
    vm.pmemsave(restored)
    assert sha256_file(restored) == sha256_file(s.mem), first_difference(restored, s.mem)
    assert "leanimg: error" not in vm.qemu_output() and "Traceback" not in vm.qemu_output()
    vm.cont()
    assert wait_heartbeat(vm, "pagecache", s.heartbeat, timeout=60) > s.heartbeat


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize("name", ["mapped", "mapped-multifd"])
def test_qemus_mapped_ram_file_comes_back_byte_for_byte(name, saves, images, tmp_path):
    rebuilt = tmp_path / "rebuilt.save"
    leanimg("restore", images[name], "--to", "qemu-mapped-ram", "-o", rebuilt)
    original = saves[name].save
    assert sha256_file(rebuilt) == sha256_file(original), first_difference(rebuilt, original)
    assert rebuilt.stat().st_blocks <= original.stat().st_blocks * 1.01, "zero pages are holes"
    assert rebuilt.stat().st_blocks * 512 < rebuilt.stat().st_size * 0.7


@pytest.mark.parametrize("name", ["mapped", "mapped-multifd"])
def test_leanimgs_mapped_ram_file_loads_into_qemu_10(name, saves, images, tmp_path):
    rebuilt = tmp_path / "rebuilt.save"
    leanimg("restore", images[name], "--to", "qemu-mapped-ram", "-o", rebuilt)
    load_file(saves[name], rebuilt, saves[name].capabilities, tmp_path / "dest")


def test_a_mapped_ram_image_restores_as_a_plain_stream(saves, images, tmp_path):
    load_exec(
        saves["mapped"], [*LEANIMG, "restore", str(images["mapped"]), "--to", "qemu", "-o", "-"], tmp_path / "dest"
    )


def test_a_plain_save_restores_as_a_mapped_ram_file(saves, images, tmp_path):
    rebuilt = tmp_path / "from-plain.save"
    leanimg("restore", images["plain"], "--to", "qemu-mapped-ram", "-o", rebuilt)
    load_file(saves["plain"], rebuilt, MAPPED, tmp_path / "dest")


def test_a_mapped_ram_file_is_no_pipe(images, tmp_path):
    proc = subprocess.run(
        f"{shlex.join([*LEANIMG, 'restore', str(images['mapped']), '--to', 'qemu-mapped-ram', '-o', '-'])} | cat",
        shell=True,
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.stdout == b"", "nothing written"
    assert b"needs an output that can seek" in proc.stderr and b"Traceback" not in proc.stderr


def test_a_mapped_ram_image_serves_a_post_copy_restore(saves, images, tmp_path):
    """`serve --postcopy` of the image of a mapped-ram file: a post-copy stream carries page
    entries, so its configuration does not list mapped-ram (the destination has it off)."""
    s = saves["mapped"]
    argv = [*LEANIMG, "serve", str(images["mapped"]), "--postcopy", "--precopy-seconds", "0"]
    with GuestVM(
        build_guest(),
        copy_disk(s.disk, tmp_path / "disk.img"),
        mem_mib=MEM_MIB,
        workdir=tmp_path,
        incoming=f"exec:{shlex.join(argv)}",
        qemu=s.qemu,
        extra_args=("-global", "migration.x-postcopy-ram=on"),
    ) as vm:
        assert_loaded(vm, s, tmp_path)
