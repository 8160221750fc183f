"""End to end with real qemu-system-x86_64 (TCG) and the real `leanimg` command line.

On QEMU 7.2 and 10.0, each with its newest i440fx and q35 machine types (tests/guest/qemus.py),
one 128 MiB guest boots once and runs the four workloads of issue 3 one after another
(idle, page-cache heavy, anonymous random memory, dirty page cache); after each it is
stopped, migrated to a file (``exec:cat > FILE``), pmemsaved and continued
(tests/guest/scenarios.py).  For every save, through the CLI in a subprocess:

* ``leanimg convert SAVE -o IMG`` and ``leanimg validate IMG`` exit 0;
* the parser Kaitai generates from ksy/leanimg.ksy reads IMG and agrees with dump_structure;
* ``leanimg restore IMG --to qemu -o FILE`` rebuilds S exactly: same pages per
  (block, offset), same device sections, and (a stopped VM sends each page once) the same
  bytes;
* a fresh QEMU with the same devices and ``-incoming "exec:leanimg restore IMG --to qemu
  -o -"`` loads the stream from our CLI's stdout, its pmemsave equals the original's byte
  for byte, and after ``cont`` the workload's serial heartbeat continues.

Plus: ``cat SAVE | leanimg convert - -o IMG`` gives an image with identical pages.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
from pathlib import Path

import numpy as np
import pytest
import xxhash

import kaitai_support as ks
from guest.scenarios import E2E_STEPS, SavePoint, assert_resumes, run_scenario
from guest.qemus import qemu_params
from guest.vm import copy_disk
from helpers import first_difference
from leanimg.cli import command_line
from leanimg.fileutil import sha256_file
from leanimg.converters import qemu as q
from leanimg.reader import LeanImage
from leanimg.structures import dump_structure

pytestmark = pytest.mark.qemu

WORKLOADS = [name for name, _ in E2E_STEPS]
CLI_TIMEOUT = 300


LEANIMG = command_line()


def cli(*args, input_file=None, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LEANIMG, *map(str, args)], capture_output=True, timeout=CLI_TIMEOUT, stdin=input_file)
    if check:
        assert proc.returncode == 0, (
            f"leanimg {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr.decode(errors='replace')}"
        )
        assert b"Traceback" not in proc.stderr
    return proc


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", params=qemu_params(("pc", "q35")))
def saves(request, module_dirs) -> dict[str, SavePoint]:
    request.param.require()
    return run_scenario(module_dirs(f"e2e-{request.param.id}"), E2E_STEPS, mem_mib=128, qemu=request.param)


@pytest.fixture(scope="module")
def images(saves, module_dirs) -> dict[str, Path]:
    """`leanimg convert` of every save (through the CLI)."""
    out = module_dirs("e2e-images")
    result = {}
    for name, sp in saves.items():
        img = out / f"{name}.lean"
        cli("convert", sp.save, "-o", img)
        assert img.is_file()
        result[name] = img
    return result


@pytest.fixture(scope="module")
def Leanimg(module_dirs):
    return ks.generated_parser_for_tests(module_dirs("e2e-kaitai")).Leanimg


# ------------------------------------------------------------------ helpers


def stream_summary(path: Path):
    """(page digest per (block, offset), RAM blocks, state) of a migration stream.

    Pages are compared by their xxh3-128 digest (a ZERO entry by the digest of its fill),
    keeping the last copy of a page sent twice; each page must come once here."""
    pages: dict[tuple[str, int], bytes] = {}
    blocks = state = None
    repeats = 0
    with open(path, "rb") as f:
        for ev in q.read_qemu_stream(f):
            if isinstance(ev, q.Page):
                key = (ev.block, ev.offset)
                repeats += key in pages
                pages[key] = xxhash.xxh3_128_digest(ev.content(blocks.page_size))
            elif isinstance(ev, q.RamBlocks):
                blocks = ev
            else:
                state = ev.state
    assert repeats == 0, f"{path}: {repeats} pages sent more than once in a stopped-VM save"
    return pages, blocks, state


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize("workload", WORKLOADS)
def test_validate_cli(workload, images):
    proc = cli("validate", images[workload])
    assert b"valid" in proc.stdout and b"INVALID" not in proc.stdout, proc.stdout


@pytest.mark.kaitai
@pytest.mark.parametrize("workload", WORKLOADS)
def test_kaitai_parser_reads_image(workload, images, Leanimg):
    path = images[workload]
    parsed = Leanimg.from_file(os.fspath(path))
    ks.assert_agrees_with_reader(parsed, path)
    types = {r["record_type"] for r in dump_structure(path)["records"]}
    assert len(types) >= 5, f"a real image has regions, maps, frames, digests, state: {types}"


@pytest.mark.parametrize("workload", WORKLOADS)
def test_restore_rebuilds_the_save(workload, saves, images, tmp_path):
    """restore(convert(S)) has S's pages and device sections, and is S byte for byte."""
    sp = saves[workload]
    rebuilt = tmp_path / "rebuilt.save"
    cli("restore", images[workload], "--to", "qemu", "-o", rebuilt)
    assert sorted(os.listdir(tmp_path)) == ["rebuilt.save"], "no temp files left"

    pages0, blocks0, state0 = stream_summary(sp.save)
    pages1, blocks1, state1 = stream_summary(rebuilt)
    assert blocks1 == blocks0
    assert pages1.keys() == pages0.keys()
    differing = [k for k in pages0 if pages0[k] != pages1[k]]
    assert not differing, f"{len(differing)} pages differ, first {differing[:3]}"
    assert [(d.kind, d.header, d.body) for d in state1.devices] == [(d.kind, d.header, d.body) for d in state0.devices]
    assert len(state0.devices) > 10
    assert state1.vmdesc == state0.vmdesc and state1.prologue == state0.prologue
    assert sha256_file(rebuilt) == sha256_file(sp.save), first_difference(rebuilt, sp.save)


@pytest.mark.parametrize("workload", WORKLOADS)
def test_resume_from_leanimg_pipe(workload, saves, images, tmp_path):
    """A fresh QEMU loads `leanimg restore IMG --to qemu -o -` through -incoming exec:."""
    sp = saves[workload]
    assert_resumes(
        sp,
        copy_disk(sp.disk, tmp_path / "disk.img"),
        tmp_path,
        [*LEANIMG, "restore", str(images[workload]), "--to", "qemu", "-o", "-"],
    )


def test_convert_from_pipe(saves, images, tmp_path):
    """`cat SAVE | leanimg convert - -o IMG`: an image with the same pages."""
    sp = saves["dirty"]
    piped = tmp_path / "piped.lean"
    cmd = f"cat {shlex.quote(str(sp.save))} | {shlex.join(LEANIMG)} convert - -o {shlex.quote(str(piped))}"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, timeout=CLI_TIMEOUT)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert sorted(os.listdir(tmp_path)) == ["piped.lean"]
    cli("validate", piped)
    with LeanImage.open(images["dirty"]) as a, LeanImage.open(piped) as b:
        assert [(r.name, r.size_bytes) for r in a.regions] == [(r.name, r.size_bytes) for r in b.regions]
        for ra, rb in zip(a.regions, b.regions):
            assert np.array_equal(a.classes(ra), b.classes(rb)), ra.name
            assert np.array_equal(a.digests.table(ra), b.digests.table(rb)), ra.name
            step = 4096
            for first in range(0, ra.num_pages, step):
                count = min(step, ra.num_pages - first)
                assert a.region_bytes(ra, first, count) == b.region_bytes(rb, first, count), (
                    f"{ra.name} pages {first}..{first + count}"
                )
        assert [(s.source_format, s.tag, s.data) for s in a.source_states] == [
            (s.source_format, s.tag, s.data) for s in b.source_states
        ]


def _xorshift_words(n: int) -> bytes:
    """The first ``n`` words of workload.c's next_random() (every process starts anew)."""
    state, mask, out = 0x9E3779B97F4A7C15, (1 << 64) - 1, []
    for _ in range(n):
        state ^= (state << 13) & mask
        state ^= state >> 7
        state ^= (state << 17) & mask
        out.append(state)
    return np.array(out, "<u8").tobytes()


def _page_digests(path: Path) -> set[bytes]:
    data = np.fromfile(path, np.uint8).reshape(-1, 4096)
    nonzero = np.flatnonzero(data.view(np.uint64).any(axis=1))
    return {xxhash.xxh3_128_digest(data[i]) for i in nonzero}


def test_workloads_did_their_work(saves):
    """Each save holds what its workload put in guest RAM (so the round trips above covered
    page cache of disk files, anonymous random memory and dirty file pages)."""
    mems = {name: sp.mem.read_bytes() for name, sp in saves.items()}
    assert len({hashlib.sha256(m).digest() for m in mems.values()}) == len(mems)
    # page cache: pages of the files on the disk are now in RAM
    disk_pages = _page_digests(saves["idle"].disk)
    cached = {name: len(disk_pages & _page_digests(sp.mem)) for name, sp in saves.items()}
    assert cached["pagecache"] - cached["idle"] > (12 << 20) // 4096, cached
    # anonymous memory: the workload's random words (malloc'd, so not page aligned)
    first = _xorshift_words(1024)
    assert first not in mems["idle"] and first not in mems["pagecache"]
    assert first in mems["anon"]
    # dirty page cache: the written file's first page, page aligned
    page = first[:4096]

    def aligned(m):
        return any(m[i : i + 4096] == page for i in range(0, len(m), 4096) if m[i : i + 8] == page[:8])

    assert not aligned(mems["anon"]) and aligned(mems["dirty"])
