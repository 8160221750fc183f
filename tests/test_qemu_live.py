"""A live save: the VM keeps rewriting memory while QEMU migrates it, so pages are sent
more than once. convert must keep the last copy of every page (issue 3 §1): the image
restores to what QEMU itself loads from the original stream."""

from __future__ import annotations

import subprocess
from collections import Counter

import numpy as np
import pytest

from guest.build import build_guest
from guest.qemus import qemu_params
from guest.scenarios import last_heartbeat, wait_heartbeat
from guest.vm import GuestVM, copy_disk
from leanimg.cli import command_line
from leanimg.converters.qemu import Page, PageRun, read_qemu_stream

pytestmark = pytest.mark.qemu

LEANIMG = command_line()
VGA_WINDOW = (0xA0000, 0xC0000)  # pmemsave reads the VGA device there, not pc.ram
MEM_MIB = 128


@pytest.fixture(scope="module", params=qemu_params())
def live_save(request, module_dirs):
    qemu = request.param
    qemu.require()
    work = module_dirs(f"live-{qemu.id}")
    build = build_guest()
    with GuestVM(build, copy_disk(build.disk, work / "disk.img"), mem_mib=MEM_MIB, qemu=qemu) as vm:
        vm.wait_ready()
        vm.run_workload("pages", "24", "0", "1000")  # rewrite all of 24 MiB every round
        wait_heartbeat(vm, "pages", last_heartbeat(vm, "pages") + 2)
        # no stop, and a bandwidth the guest's rewrites outpace for a while: pages get resent
        vm.qmp.execute("migrate-set-parameters", **{"max-bandwidth": 100 << 20})
        vm.qmp.execute("migrate", uri=f"exec:cat > {work / 'live.save'}")
        vm._wait_migration(300)
        assert vm.status() == "postmigrate"
    # The source's memory can still change after the last RAM sync, so its pmemsave is not the
    # truth for a live save: QEMU itself loading the original stream is.
    with GuestVM(
        build,
        copy_disk(build.disk, work / "disk2.img"),
        mem_mib=MEM_MIB,
        incoming=f"exec:cat {work / 'live.save'}",
        qemu=qemu,
    ) as loaded:
        loaded.wait_incoming(timeout=180)
        loaded.pmemsave(work / "live.mem")
    return work


def _sends_per_page(path) -> Counter:
    sends = Counter()
    with open(path, "rb") as f:
        for event in read_qemu_stream(f, batch=True):
            if isinstance(event, PageRun):
                sends.update((event.block, event.offset + k * 4096) for k in range(event.count))
            elif isinstance(event, Page):
                sends[(event.block, event.offset)] += 1
    return sends


def _leanimg(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*LEANIMG, *map(str, args)], capture_output=True, timeout=600, **kw)


def _assert_ram_is(image, mem_path, tmp_path):
    raw = tmp_path / f"{image.stem}.raw"
    assert _leanimg("restore", image, "--to", "raw", "-o", raw).returncode == 0
    ram = np.fromfile(raw, np.uint8, count=MEM_MIB << 20)  # pc.ram is the first region
    mem = np.fromfile(mem_path, np.uint8)
    lo, hi = VGA_WINDOW
    for part in (slice(0, lo), slice(hi, len(mem))):
        diff = np.flatnonzero(ram[part] != mem[part])
        assert not len(diff), (
            f"{len(diff)} bytes differ from QEMU's load of the original stream, first at {part.start + diff[0]:#x}"
        )


def test_the_live_save_resends_pages(live_save):
    sends = _sends_per_page(live_save / "live.save")
    resent = sum(1 for n in sends.values() if n > 1)
    assert resent > 1000, f"only {resent} pages were sent more than once: not a live save"


def test_convert_from_file_keeps_the_last_copy(live_save, tmp_path):
    image = tmp_path / "live.lean"
    proc = _leanimg("convert", live_save / "live.save", "-o", image)
    assert proc.returncode == 0, proc.stderr.decode()
    assert _leanimg("validate", image).returncode == 0
    _assert_ram_is(image, live_save / "live.mem", tmp_path)


def test_convert_from_a_pipe_needs_spool(live_save, tmp_path):
    save = (live_save / "live.save").read_bytes()
    image = tmp_path / "piped.lean"
    refused = _leanimg("convert", "-", "-o", image, input=save)
    assert refused.returncode == 1
    assert b"--spool" in refused.stderr and b"Traceback" not in refused.stderr
    assert not image.exists() and [p.name for p in tmp_path.iterdir()] == []
    spooled = _leanimg("convert", "-", "-o", image, "--spool", input=save)
    assert spooled.returncode == 0, spooled.stderr.decode()
    _assert_ram_is(image, live_save / "live.mem", tmp_path)
