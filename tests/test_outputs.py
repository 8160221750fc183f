"""No command writes over its inputs (issue 16 §1): the source save, the image, any link of
its chain, any disk; by path, hard link or symbolic link. An existing output file is
replaced only with -f/--force; binary output to a terminal is refused; a device or FIFO
output is written in place without --force."""

from __future__ import annotations

import hashlib
import os
import pty
import subprocess

import numpy as np
import pytest

from helpers import qemu_save
from click.testing import CliRunner

from leanimg.cli import command_line, main
from leanimg.reader import LeanImage
from leanimg.writer import LeanImageWriter, ParentLink

PS = 4096


def _digest(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture
def chain(tmp_path):
    """parent.lean and child.lean (beside it), a raw save-like input file, a disk file."""
    rng = np.random.default_rng(7)
    memory = rng.integers(0, 256, 32 * PS, dtype=np.uint8).tobytes()
    parent = tmp_path / "parent.lean"
    with LeanImageWriter(parent) as w:
        w.put_pages(w.add_region("pc.ram", len(memory), 0), 0, memory)
    with LeanImage.open(parent) as p:
        link = ParentLink(p.header.image_uuid, p.footer.image_digest)
        digests = b"".join(p.expected_digest(p.regions[0], page) for page in range(32))
    child = tmp_path / "child.lean"
    with LeanImageWriter(child, parent=link) as w:
        w.put_parent(w.add_region("pc.ram", len(memory), 0), 0, digests)
    disk = tmp_path / "disk.raw"
    disk.write_bytes(bytes(1 << 20))
    return dict(parent=parent, child=child, disk=disk, dir=tmp_path)


def run(*args, stdout=subprocess.PIPE):
    return subprocess.run([*command_line(), *map(str, args)], stdout=stdout, stderr=subprocess.PIPE)


def refused(proc, *needles) -> str:
    err = proc.stderr.decode()
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def untouched(paths: list, before: dict) -> None:
    assert {str(p): _digest(p) for p in paths} == before


@pytest.mark.parametrize("command", ["restore", "flatten"])
@pytest.mark.parametrize("victim", ["child", "parent"])
@pytest.mark.parametrize("how", ["path", "hardlink", "symlink"])
def test_an_image_command_never_writes_over_a_link_of_the_chain(chain, command, victim, how):
    inputs = [chain["child"], chain["parent"]]
    before = {str(p): _digest(p) for p in inputs}
    output = chain[victim]
    if how != "path":
        output = chain["dir"] / f"alias-{how}.lean"
        (os.link if how == "hardlink" else os.symlink)(chain[victim], output)
    refused(run(command, chain["child"], "-o", output, "-f"), "is an input of this command")
    untouched(inputs, before)
    with LeanImage.open(chain["child"]) as image:  # the chain still opens
        assert image.parent is not None


def test_merge_never_writes_over_the_parent(chain):
    before = {str(chain["parent"]): _digest(chain["parent"])}
    refused(run("merge", chain["child"], "-o", chain["parent"], "-f"), "is an input of this command")
    untouched([chain["parent"]], before)


def test_restore_never_writes_over_a_disk(chain, tmp_path):
    with LeanImageWriter(tmp_path / "d.lean") as w:
        w.add_disk("vda", 1 << 20, bytes(16))
        w.put_pages(w.add_region("pc.ram", PS, 0), 0, bytes(PS))
    before = {str(chain["disk"]): _digest(chain["disk"])}
    refused(
        run(
            "restore",
            tmp_path / "d.lean",
            "--disk",
            f"vda={chain['disk']}",
            "--any-disk-identity",
            "-o",
            chain["disk"],
            "-f",
        ),
        "is an input of this command",
    )
    untouched([chain["disk"]], before)


def test_convert_never_writes_over_its_save_nor_its_parent_chain(chain, tmp_path):
    save = tmp_path / "vm.save"
    save.write_bytes(qemu_save(bytes(range(256)) * 64))
    before = {str(p): _digest(p) for p in (save, chain["child"], chain["parent"])}
    refused(run("convert", save, "-o", save, "-f"), "is an input of this command")
    # the parent's own parent is found beside it: it is an input too
    refused(
        run("convert", save, "-o", chain["parent"], "--parent", chain["child"], "-f"), "is an input of this command"
    )
    untouched([save, chain["child"], chain["parent"]], before)


@pytest.mark.parametrize("command", ["restore", "flatten"])
def test_an_existing_output_is_replaced_only_with_force(chain, command):
    output = chain["dir"] / "existing.out"
    output.write_bytes(b"keep me")
    refused(run(command, chain["child"], "-o", output), "exists", "-f/--force")
    assert output.read_bytes() == b"keep me"
    proc = run(command, chain["child"], "-o", output, "--force")
    assert proc.returncode == 0, proc.stderr.decode()
    assert output.read_bytes() != b"keep me"


def test_an_existing_map_is_replaced_only_with_force(chain):
    picture = chain["dir"] / "memory.png"
    picture.write_bytes(b"keep me")
    refused(run("inspect", chain["child"], "--map", picture), "exists")
    assert picture.read_bytes() == b"keep me"
    assert run("inspect", chain["child"], "--map", picture, "-f").returncode == 0
    assert picture.read_bytes().startswith(b"\x89PNG")


def test_a_device_output_needs_no_force(chain):
    proc = run("restore", chain["child"], "-o", "/dev/null")
    assert proc.returncode == 0, proc.stderr.decode()


def test_binary_output_to_a_terminal_is_refused(chain):
    leader, follower = pty.openpty()
    try:
        proc = run("restore", chain["child"], "-o", "-", stdout=follower)
    finally:
        os.close(follower)
        os.close(leader)
    refused(proc, "terminal")


# --- user mistakes are usage errors or clear errors, never "internal error" ---------------------
def test_output_into_a_missing_directory_is_a_usage_error(chain):
    refused(run("restore", chain["child"], "-o", chain["dir"] / "no" / "such" / "out.raw"), "does not exist")
    refused(run("flatten", chain["child"], "-o", chain["dir"] / "no" / "out.lean"), "does not exist")


@pytest.mark.parametrize(
    "option", [["--level", "50"], ["--level", "0"], ["--frame-pages", "0"], ["--frame-pages", "100000"]]
)
def test_convert_options_out_of_range_are_usage_errors(chain, option):
    save = chain["dir"] / "vm.save"
    save.write_bytes(qemu_save(bytes(range(256)) * 64))
    refused(run("convert", save, "-o", chain["dir"] / "vm.lean", *option), "Invalid value")


def test_an_output_the_system_refuses_is_a_clear_error(chain):
    proc = run("restore", chain["child"], "-o", "/proc/leanimg-cannot-write-here.raw")
    err = proc.stderr.decode()
    assert proc.returncode == 1, err
    assert err.startswith("leanimg: error:") and "internal error" not in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["restore", "flatten"])
def test_every_command_names_its_temporary_file_alike(chain, command, tmp_path, monkeypatch):
    """One scheme for every output (issue 16 §2): .leanimg-<output name>-<random>.partial beside
    the output, seen here while the command writes."""
    from leanimg import fileutil

    seen = []
    original = fileutil.temporary_beside

    def spy(path):
        name = original(path)
        seen.append((path, name))
        return name

    monkeypatch.setattr(fileutil, "temporary_beside", spy)
    out = tmp_path / "out.file"
    args = ["restore", chain["child"], "--to", "raw"] if command == "restore" else ["flatten", chain["child"]]
    result = CliRunner().invoke(main, [*map(str, args), "-o", str(out)])
    assert result.exit_code == 0, result.output
    ((path, name),) = seen
    assert os.path.dirname(name) == str(tmp_path) and os.path.basename(name).startswith(".leanimg-out.file-")
    assert name.endswith(".partial") and not os.path.exists(name) and out.exists()


@pytest.mark.parametrize("option", ["--stats", "--record-faults"])
def test_serve_never_writes_its_side_files_over_an_input_nor_an_existing_file(chain, tmp_path, option):
    before = {str(p): _digest(p) for p in (chain["child"], chain["parent"])}
    for victim in ("child", "parent"):
        refused(run("serve", chain["child"], "--postcopy", option, chain[victim], "-f"), "is an input of this command")
    side = tmp_path / "side.file"
    side.write_text("kept")
    refused(run("serve", chain["child"], "--postcopy", option, side), "exists; use -f/--force")
    assert side.read_text() == "kept"
    untouched([chain["child"], chain["parent"]], before)


def test_checkpoint_never_writes_over_its_parent_chain_nor_a_disk(chain, tmp_path):
    """Refused before QMP is even reached (the socket here does not exist)."""
    before = {str(p): _digest(p) for p in (chain["child"], chain["parent"], chain["disk"])}
    qmp = tmp_path / "no-qmp.sock"
    # the parent's own parent is found beside it: it is an input too
    refused(
        run("checkpoint", "--qmp", qmp, "-o", chain["parent"], "--parent", chain["child"], "-f"),
        "is an input of this command",
    )
    refused(
        run("checkpoint", "--qmp", qmp, "-o", chain["disk"], "--disk", f"vda={chain['disk']}", "-f"),
        "is an input of this command",
    )
    refused(
        run("checkpoint", "--qmp", qmp, "-o", tmp_path / "new.lean", "--keep-stream", chain["child"]),
        "exists; use -f/--force",
    )
    refused(
        run(
            "checkpoint",
            "--qmp",
            qmp,
            "-o",
            tmp_path / "new.lean",
            "--live",
            "--guest-free",
            qmp,
            "--keep-hints",
            chain["child"],
        ),
        "exists; use -f/--force",
    )
    refused(
        run(
            "checkpoint",
            "--qmp",
            qmp,
            "-o",
            tmp_path / "new.lean",
            "--parent",
            chain["child"],
            "--live",
            "--guest-free",
            qmp,
            "--keep-hints",
            chain["child"],
            "-f",
        ),
        "is an input of this command",
    )
    untouched([chain["child"], chain["parent"], chain["disk"]], before)
