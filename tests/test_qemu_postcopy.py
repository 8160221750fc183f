"""Lazy restore end to end (issue 14): `leanimg serve IMG --postcopy` as the source of a real
QEMU 7.2 post-copy migration (TCG), through ``-incoming "exec:leanimg serve ..."``.

One 128 MiB guest boots once (tests/guest/scenarios.py), reads its disk's files into the
page cache and starts ``workload check 16`` (16 MiB of random data whose checksum it checks
again before every heartbeat: a heartbeat after a restore means every page of the buffer
read back as written); checkpoint ``base`` is saved; ``workload words 8 3`` then changes a
few words in many pages and checkpoint ``next`` is saved.  Images, through the CLI:

* inline: ``base`` converted plainly (STORED and ZERO pages);
* disk:   ``base`` with ``--disk vda=DISK`` (DISK pages: the page cache of the files);
* chain:  ``next`` with ``--parent`` the inline image (PARENT and DELTA pages);
* free:   the inline image rewritten with half of its zero runs as FREE.

For each, a destination started paused (-S) with the serve as its incoming loads the device
state, reaches post-copy, receives every page that must travel (query-migrate: completed);
its pmemsave then equals ``leanimg restore IMG --to raw`` and the checkpoint's own pmemsave
(the legacy VGA window excepted: pmemsave reads the VGA device there); after ``cont`` the
check workload's heartbeat goes on.  The serve's counts (``--stats``) add up.

From object storage (a real SeaweedFS, tests/s3store.py): the chain's two links as objects
under one prefix, served from there (the parent found beside the child), the same memory.

Also: a guest that runs while its memory is still arriving (no -S; bubble and disk-sorted
prepaging), pages faulted on demand; a demand-only serve (``--prepage none``) whose every
page is asked for by pmemsave; a disk changed under a DISK page stops the serve with an error
naming the page, the page never reaches the guest, the destination pauses the migration.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from guest.chain_scenarios import VGA_WINDOW
from guest.scenarios import SavePoint, heartbeats, run_scenario
from guest.qemus import qemu_params
from guest.vm import GuestError, GuestVM, copy_disk
from leanimg.cli import command_line
from leanimg.format import PageClass
from leanimg.reader import LeanImage
from leanimg.writer import LeanImageWriter

pytestmark = pytest.mark.qemu

LEANIMG = command_line()
CLI_TIMEOUT = 300
POSTCOPY = ("-global", "migration.x-postcopy-ram=on")
STEPS = (("pagecache", ("pagecache", "/mnt")), ("check", ("check", "16")), ("words", ("words", "8", "3")))
MIGRATION_TIMEOUT = 240


def cli(*args) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LEANIMG, *map(str, args)], capture_output=True, timeout=CLI_TIMEOUT)
    assert proc.returncode == 0, (
        f"leanimg {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr.decode(errors='replace')}"
    )
    return proc


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", params=qemu_params())
def saves(request, module_dirs) -> dict[str, SavePoint]:
    request.param.require()
    points = run_scenario(
        module_dirs(f"postcopy-{request.param.id}"),
        STEPS,
        mem_mib=128,
        save_after={"check", "words"},
        qemu=request.param,
    )
    return {"base": points["check"], "next": points["words"]}


IMAGE_KINDS = ("inline", "disk", "chain", "free")


@pytest.fixture(scope="module")
def images(saves, module_dirs) -> dict[str, tuple[Path, SavePoint, tuple[str, ...]]]:
    """kind -> (image, its checkpoint, the options serve and restore need for it)."""
    out = module_dirs("postcopy-images")
    base, nxt = saves["base"], saves["next"]
    inline, disk, chain, free = (out / f"{k}.lean" for k in IMAGE_KINDS)
    cli("convert", base.save, "-o", inline)
    cli("convert", base.save, "-o", disk, "--disk", f"vda={base.disk}")
    cli("convert", nxt.save, "-o", chain, "--parent", inline)
    with_free_pages(inline, free)
    found = {
        k: _classes(p, *opts)
        for k, p, opts in [
            ("inline", inline, ()),
            ("disk", disk, ("--disk", f"vda={base.disk}")),
            ("chain", chain, ()),
            ("free", free, ()),
        ]
    }
    assert found["disk"]["DISK"] > 1000, found["disk"]
    assert found["chain"]["PARENT"] > 1000 and found["chain"]["DELTA"] > 100, found["chain"]
    assert found["free"]["FREE"] > 1000, found["free"]
    return {
        "inline": (inline, base, ()),
        "disk": (disk, base, ("--disk", f"vda={base.disk}")),
        "chain": (chain, nxt, ()),
        "free": (free, base, ()),
    }


def _classes(image: Path, *options) -> dict[str, int]:
    classes = json.loads(cli("inspect", "--json", image, *options).stdout)["chain"][0]["classes"]
    return {name: classes.get(name, 0) for name in ("STORED", "ZERO", "FREE", "DISK", "PARENT", "DELTA")}


def with_free_pages(src: Path, dest: Path) -> None:
    """``src`` (self-contained, STORED and ZERO pages) rewritten with every other zero run of
    each region as FREE, its source state kept: the kind of image a free-page hint makes."""
    with LeanImage.open(src) as img, LeanImageWriter(dest) as writer:
        writer.declare_source_state()
        ids = {r.name: writer.add_region(r.name, r.size_bytes, r.guest_phys_base) for r in img.regions}
        for region in img.regions:
            rid, cls = ids[region.name], img.classes(region)
            edges = np.flatnonzero(cls[1:] != cls[:-1]) + 1
            zero_runs = 0
            for lo, hi in zip([0, *edges.tolist()], [*edges.tolist(), len(cls)]):
                if cls[lo] == PageClass.STORED:
                    writer.put_pages(rid, lo, img.region_bytes(region, lo, hi - lo))
                elif zero_runs % 2:
                    writer.put_free(rid, lo, hi - lo)
                    zero_runs += 1
                else:
                    writer.put_zero(rid, lo, hi - lo)
                    zero_runs += 1
        for state in img.source_states:
            writer.add_source_state(state.source_format, state.tag, state.data)


# ------------------------------------------------------------------ helpers


@contextmanager
def destination(
    sp: SavePoint,
    image: Path | str,
    workdir: Path,
    *serve_options: str,
    autostart: bool = False,
    env: dict | None = None,
):
    """A fresh QEMU on a copy of the checkpoint's disk, its incoming `leanimg serve IMAGE
    --postcopy` (with ``env`` set for it); yields the VM and the path of the serve's --stats file."""
    disk = copy_disk(sp.disk, workdir / "disk.img")
    stats = workdir / "serve-stats.json"
    argv = [
        *(["env", *[f"{k}={v}" for k, v in env.items()]] if env else []),
        *LEANIMG,
        "serve",
        str(image),
        "--postcopy",
        "--stats",
        str(stats),
        *serve_options,
    ]
    vm_dir = workdir / "dest"
    vm_dir.mkdir()
    with GuestVM(
        sp.build,
        disk,
        mem_mib=sp.mem_mib,
        workdir=vm_dir,
        incoming=f"exec:{shlex.join(argv)}",
        extra_args=POSTCOPY,
        autostart=autostart,
        qemu=sp.qemu,
    ) as vm:
        yield vm, stats


def wait_migration(vm: GuestVM, wanted: set[str], timeout: float = MIGRATION_TIMEOUT) -> str:
    deadline = time.monotonic() + timeout
    status = None
    while time.monotonic() < deadline:
        if vm.proc.poll() is not None:
            raise GuestError(f"destination QEMU exited ({vm.proc.returncode}):\n{vm.qemu_output()[-3000:]}")
        status = vm.qmp.execute("query-migrate").get("status")
        if status in wanted:
            return status
        time.sleep(0.2)
    raise GuestError(f"migration status {status}, not {wanted} after {timeout}s:\n{vm.qemu_output()[-3000:]}")


def read_stats(path: Path, timeout: float = 60) -> dict:
    """The serve writes its counts when it exits (after QEMU's SHUT, or when QEMU is gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            time.sleep(0.2)
            return json.loads(path.read_text())
        time.sleep(0.2)
    raise AssertionError(f"the serve wrote no {path} within {timeout}s")


def outside_vga(mem: np.ndarray) -> np.ndarray:
    return np.concatenate([mem[: VGA_WINDOW[0]], mem[VGA_WINDOW[1] :]])


def assert_same_memory(got: Path, want: np.ndarray, what: str) -> None:
    a = outside_vga(np.fromfile(got, np.uint8))
    b = outside_vga(want[: VGA_WINDOW[0] + len(a) + VGA_WINDOW[1] - VGA_WINDOW[0]])
    assert len(a) == len(b), what
    diff = np.flatnonzero(a != b)
    assert not len(diff), f"{what}: {len(diff)} bytes differ, first at {diff[0]:#x}"


def raw_restore(image: Path, options: tuple[str, ...], workdir: Path, size: int) -> np.ndarray:
    raw = workdir / "restored.raw"
    cli("restore", image, "--to", "raw", "-o", raw, *options)
    return np.fromfile(raw, np.uint8, count=size)


def assert_check_workload_runs(vm: GuestVM, rounds: int = 2, timeout: float = 120) -> None:
    """The check workload printed ``rounds`` heartbeats on this destination, each after reading
    its whole buffer back intact."""
    deadline = time.monotonic() + timeout
    while len(heartbeats(vm.serial.text, "check")) < rounds:
        assert "WORKLOAD-ERROR" not in vm.serial.text, vm.serial.text[-1500:]
        if time.monotonic() > deadline:
            raise GuestError(
                f"no {rounds} check heartbeats within {timeout}s:\n{vm.serial.text[-1500:]}\n{vm.qemu_output()[-1500:]}"
            )
        time.sleep(0.2)
    assert "WORKLOAD-ERROR" not in vm.serial.text, vm.serial.text[-1500:]


def assert_counts_add_up(stats: dict) -> None:
    assert stats["completed"] and stats["error"] is None and stats["shut"] == 0, stats
    travelled = stats["pushed_pages"] + stats["demand_pages"] - stats["demand_blank"] + stats["working_set_pages"]
    assert travelled == stats["pages_to_send"], stats
    assert stats["pages_to_send"] < stats["pages_total"], "ZERO/FREE pages never pushed"


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_lazy_restore_gives_the_checkpoint_memory(kind, images, tmp_path):
    image, sp, options = images[kind]
    with destination(sp, image, tmp_path, *options) as (vm, stats_path):
        assert wait_migration(vm, {"completed"}) == "completed"
        assert vm.status() == "paused"
        vm.pmemsave(tmp_path / "dest.mem")
        size = sp.mem_mib << 20
        assert_same_memory(
            tmp_path / "dest.mem", raw_restore(image, options, tmp_path, size), "pmemsave vs restore --to raw"
        )
        assert_same_memory(tmp_path / "dest.mem", np.fromfile(sp.mem, np.uint8), "pmemsave vs checkpoint")
        vm.cont()
        assert_check_workload_runs(vm)
        assert vm.status() == "running"
        stats = read_stats(stats_path)
    assert_counts_add_up(stats)
    assert "Traceback" not in vm.qemu_output() and "leanimg: error" not in vm.qemu_output()


@pytest.mark.parametrize("kind, strategy", [("inline", "bubble"), ("disk", "disk-sorted"), ("chain", "sequential")])
def test_guest_runs_before_its_memory_arrived(kind, strategy, images, tmp_path):
    """No -S: the guest starts at POSTCOPY_RUN, faults pages in while the rest is pushed
    (no pre-copy before RUN: a 128 MiB guest's pages could all go before it)."""
    image, sp, options = images[kind]
    with destination(
        sp, image, tmp_path, *options, "--prepage", strategy, "--precopy-seconds", "0", autostart=True
    ) as (vm, stats_path):
        assert_check_workload_runs(vm)
        assert wait_migration(vm, {"completed"}) == "completed"
        assert_check_workload_runs(vm, rounds=len(heartbeats(vm.serial.text, "check")) + 2)
        assert vm.status() == "running"
        stats = read_stats(stats_path)
    assert_counts_add_up(stats)
    assert stats["demand_pages"] > 0 and stats["pushed_pages"] > 0, stats


def test_demand_only_serves_every_page_asked_for(images, tmp_path):
    """--prepage none: nothing pushed; pmemsave asks for every page of pc.ram (blank ones get
    ZERO entries) and reads the checkpoint's memory."""
    image, sp, options = images["inline"]
    with destination(sp, image, tmp_path, *options, "--prepage", "none") as (vm, stats_path):
        assert wait_migration(vm, {"postcopy-active"}) == "postcopy-active"
        vm.pmemsave(tmp_path / "dest.mem")
        assert_same_memory(tmp_path / "dest.mem", np.fromfile(sp.mem, np.uint8), "pmemsave vs checkpoint")
        assert vm.qmp.execute("query-migrate")["status"] == "postcopy-active", "pages left that never travelled"
        vm.qmp.execute("quit")
        vm.proc.wait(timeout=60)
    stats = read_stats(stats_path)
    assert stats["pushed_pages"] == 0 and not stats["completed"], stats
    pc_ram_pages = (sp.mem_mib << 20) // 4096
    assert stats["demand_pages"] >= pc_ram_pages - (VGA_WINDOW[1] - VGA_WINDOW[0]) // 4096, stats
    assert stats["demand_blank"] > 0, stats


@pytest.mark.parametrize("kind", ["inline", "chain"])
def test_a_recorded_working_set_arrives_before_the_guest_runs(kind, images, tmp_path):
    """One restore records the pages the running guest asked for (--record-faults); the next
    sends them as pre-copy pages before LISTEN (--working-set): after the last page the
    destination's pmemsave is the checkpoint's memory, and the guest runs on."""
    image, sp, options = images[kind]
    recorded = tmp_path / "faults.lws"
    (tmp_path / "record").mkdir()
    with destination(
        sp, image, tmp_path / "record", *options, "--prepage", "none", "--record-faults", str(recorded), autostart=True
    ) as (vm, stats_path):
        assert_check_workload_runs(vm)
        vm.qmp.execute("quit")
        vm.proc.wait(timeout=60)
    first = read_stats(stats_path)
    assert first["recorded_faults"] > 100 and recorded.stat().st_size == 24 + first["recorded_faults"] * 8 + sum(
        1 + len(name) for name in _ram_block_names(recorded)
    ), first
    (tmp_path / "replay").mkdir()
    with destination(
        sp, image, tmp_path / "replay", *options, "--prepage", "sequential", "--working-set", str(recorded)
    ) as (vm, stats_path):
        assert wait_migration(vm, {"completed"}) == "completed"
        vm.pmemsave(tmp_path / "dest.mem")
        assert_same_memory(tmp_path / "dest.mem", np.fromfile(sp.mem, np.uint8), "pmemsave vs checkpoint")
        vm.cont()
        assert_check_workload_runs(vm)
        stats = read_stats(stats_path)
    assert_counts_add_up(stats)
    assert 100 < stats["working_set_pages"] <= first["recorded_faults"], stats
    asked = {(block, page) for _, _, block, page in stats["first_requests"]}
    assert len(stats["first_requests"]) == stats["requests"], stats  # every request listed (devices
    # loading may touch guest memory under -S; QEMU asks for one 4 KiB page a request)
    assert not asked & _travelled(image, recorded), "a page sent before RUN was asked for: it was not placed"


def _travelled(image: Path, working_set: Path) -> set[tuple[str, int]]:
    """The pages of ``working_set`` that are neither ZERO nor FREE in ``image``."""
    from leanimg.restore.working_set import read_working_set

    with LeanImage.open(image) as img:
        classes = {r.name: img.classes(r) for r in img.regions}
        listed = read_working_set(str(working_set), img.page_size, {n: len(c) for n, c in classes.items()})
    blank = (PageClass.ZERO, PageClass.FREE)
    return {(name, page) for name, pages in listed for page in pages.tolist() if classes[name][page] not in blank}


def _ram_block_names(path: Path) -> list[str]:
    blob = path.read_bytes()
    names, at = [], 24
    for _ in range(int.from_bytes(blob[16:20], "little")):
        names.append(blob[at + 1 : at + 1 + blob[at]].decode())
        at += 1 + blob[at]
    return names


def test_a_disk_changed_under_a_disk_page_stops_the_serve(images, tmp_path):
    """The serve reaches a DISK page whose block changed: it stops with an error naming the
    page; QEMU never got it and pauses the migration (postcopy-paused, the guest's memory kept)."""
    image, sp, _ = images["disk"]
    bad_disk = copy_disk(sp.disk, tmp_path / "changed.img")
    with LeanImage.open(image) as img:
        region = img.region("pc.ram")
        disk_pages = np.flatnonzero(img.classes(region) == PageClass.DISK)
        slots = img.page_slots(region, 0, region.num_pages)[disk_pages]
        offsets = img.tables.disk_refs.sectors[slots].astype(np.int64) * 512
    offset = int(offsets[len(offsets) // 2])
    on_block = disk_pages[(offsets <= offset + 100) & (offset + 100 < offsets + 4096)].tolist()
    with open(bad_disk, "r+b") as f:
        f.seek(offset + 100)
        byte = f.read(1)
        f.seek(offset + 100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with destination(
        sp,
        image,
        tmp_path,
        "--disk",
        f"vda={bad_disk}",
        "--any-disk-identity",
        "--prepage",
        "sequential",
        "--precopy-seconds",
        "0",
    ) as (vm, stats_path):
        assert wait_migration(vm, {"postcopy-paused"}) == "postcopy-paused"
        stats = read_stats(stats_path)
        output = vm.qemu_output()
    assert not stats["completed"] and stats["error"], stats
    named = [page for page in on_block if f"stopped before sending block 'pc.ram' page {page} " in stats["error"]]
    assert len(named) == 1, (on_block, stats["error"])
    assert f"leanimg: error: {stats['error']}" in output, output[-3000:]
    assert "disk 'vda' sector" in stats["error"], stats["error"]


@pytest.fixture(scope="module")
def stored_chain(images, s3store):
    """The chain image and its parent as objects under one prefix of the store."""
    prefix = f"postcopy-{images['chain'][1].qemu.id}/"
    client = s3store.client()
    for kind in ("inline", "chain"):
        client.upload_file(str(images[kind][0]), s3store.bucket, f"{prefix}{kind}.lean")
    yield s3store.url(f"{prefix}chain.lean")
    for kind in ("inline", "chain"):
        client.delete_object(Bucket=s3store.bucket, Key=f"{prefix}{kind}.lean")


def test_lazy_restore_from_object_storage(images, stored_chain, s3store, tmp_path):
    """serve s3://.../chain.lean: its parent found beside it in the store, every page fetched
    by range; the memory equals the local restore's, the guest runs on; the serve says what
    it fetched."""
    image, sp, options = images["chain"]
    with destination(sp, stored_chain, tmp_path, *options, env=s3store.env) as (vm, stats_path):
        assert wait_migration(vm, {"completed"}) == "completed"
        vm.pmemsave(tmp_path / "dest.mem")
        assert_same_memory(
            tmp_path / "dest.mem",
            raw_restore(image, options, tmp_path, sp.mem_mib << 20),
            "pmemsave of the serve from the store vs restore --to raw of the local chain",
        )
        vm.cont()
        assert_check_workload_runs(vm)
        assert vm.status() == "running"
        stats = read_stats(stats_path)
    assert_counts_add_up(stats)
    fetched = {f["location"].rsplit("/", 1)[1]: f for f in stats["fetched"]}
    assert set(fetched) == {"inline.lean", "chain.lean"}, stats["fetched"]
    assert all(0 < f["fetched_bytes"] <= f["object_bytes"] for f in fetched.values()), fetched
    assert stats["fetched_at_run"] is not None and stats["fetched_at_run"] > 0
    assert "Traceback" not in vm.qemu_output() and "leanimg: error" not in vm.qemu_output()
