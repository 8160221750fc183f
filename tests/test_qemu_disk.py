"""DISK references end to end with real qemu-system-x86_64 (TCG), issue 4 §6.

The test guest reads the files of its ext4 disk (page-cache workload) and is saved. For that
save, through the CLI: ``convert --disk vda=DISK`` turns the cached file pages into disk
references (checked: a real share of the guest's non-zero pages, and an image smaller than
``zstd -T0 -3`` of the save); ``validate --disk`` checks every one; then a fresh QEMU whose
disk is the raw disk, and one whose disk is a qcow2 made from it by ``qemu-img convert``,
loads ``leanimg restore IMG --to qemu --disk vda=THAT_DISK -o -`` through ``-incoming``:
its pmemsave equals the original's byte for byte and after ``cont`` the guest runs on.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from guest.scenarios import SavePoint, assert_resumes, run_scenario
from guest.qemus import qemu_params
from guest.vm import copy_disk
from leanimg.cli import command_line

pytestmark = pytest.mark.qemu
LEANIMG = command_line()


def cli(*args) -> subprocess.CompletedProcess:
    proc = subprocess.run([*LEANIMG, *map(str, args)], capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    return proc


@pytest.fixture(scope="module", params=qemu_params())
def saved(request, module_dirs) -> SavePoint:
    request.param.require()
    if shutil.which("qemu-img") is None:
        pytest.skip("qemu-img is not installed")
    steps = (("pagecache", ("pagecache", "/mnt")),)
    return run_scenario(module_dirs(f"disk-{request.param.id}"), steps, mem_mib=128, qemu=request.param)["pagecache"]


@pytest.fixture(scope="module")
def image(saved, module_dirs) -> Path:
    out = module_dirs("disk-image") / "vm.lean"
    cli("convert", saved.save, "-o", out, "--disk", f"vda={saved.disk}")
    return out


def breakdown(image: Path) -> dict:
    info = json.loads(cli("inspect", image, "--json").stdout)
    return Counter(info["classes"])


def test_cached_file_pages_become_disk_references(saved, image, tmp_path):
    pages = breakdown(image)
    # the workload read all 16 MiB of the disk's files (DiskSpec: 12 MiB text, 4 MiB binary):
    # every cached page of them (plus cached ext4 metadata) must have been found on the disk
    assert pages["DISK"] * 4096 >= 16 << 20, pages
    zst = tmp_path / "save.zst"
    subprocess.run(["zstd", "-q", "-T0", "-3", saved.save, "-o", zst], check=True)
    assert image.stat().st_size < zst.stat().st_size < saved.save.stat().st_size


def test_validate_checks_every_reference(saved, image):
    out = cli("validate", image, "--disk", f"vda={saved.disk}").stdout.decode()
    assert ": valid" in out and "disk_pages" in out and "not checked" not in out


@pytest.mark.parametrize("disk_format", ["raw", "qcow2"])
def test_resume_with_disk_references(saved, image, tmp_path, disk_format):
    disk = tmp_path / f"disk.{disk_format}"
    if disk_format == "raw":
        copy_disk(saved.disk, disk)
    else:
        subprocess.run(["qemu-img", "convert", "-O", "qcow2", saved.disk, disk], check=True)
    assert_resumes(
        saved, disk, tmp_path, [*LEANIMG, "restore", str(image), "--to", "qemu", "--disk", f"vda={disk}", "-o", "-"]
    )


def test_inspect_names_the_files_the_guest_read(saved, image):
    info = json.loads(cli("inspect", image, "--files", "--json", "--disk", f"vda={saved.disk}").stdout)
    pages = {f["path"]: f["pages"] for f in info["disk_files"]["vda"]}
    # DiskSpec(): 12 text files and 4 binary files of 1 MiB each, all read by the workload
    files = [p for p in pages if p.startswith(("/text/", "/data/"))]
    assert len(files) == 16 and all(pages[p] == 256 for p in files), pages
