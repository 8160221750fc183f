"""Every command through click's CliRunner, its output compared with the library API."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import sys
import threading
from importlib.metadata import entry_points

import numpy as np
import pytest
from click.testing import CliRunner

from leanimg.cli import command_line, main
from leanimg.fileutil import PIPE_BUFFER_BYTES, widen_pipe
from leanimg.inspect import summarize
from leanimg.reader import LeanImage
from leanimg.validate import validate
from leanimg.writer import LeanImageWriter, ParentLink

PS = 4096
F_GETPIPE_SZ = 1032


def _memory(pages: int, seed: int) -> bytearray:
    rng = np.random.default_rng(seed)
    mem = bytearray(rng.integers(0, 256, pages * PS, dtype=np.uint8).tobytes())
    mem[PS * 4 : PS * 12] = bytes(PS * 8)
    return mem


@pytest.fixture
def images(tmp_path):
    """A parent image and a child with PARENT, DELTA and STORED pages."""
    parent_mem, child_mem = _memory(64, 1), None
    parent = tmp_path / "parent.lean"
    with LeanImageWriter(parent, frame_pages=8) as w:
        w.put_pages(w.add_region("pc.ram", len(parent_mem), 0), 0, parent_mem)
    child_mem = bytearray(parent_mem)
    child_mem[PS * 20 + 8 : PS * 20 + 16] = b"changed!"
    child_mem[PS * 30 : PS * 31] = os.urandom(PS)
    with LeanImage.open(parent) as p:
        link = ParentLink(p.header.image_uuid, p.footer.image_digest)
        child = tmp_path / "child.lean"
        with LeanImageWriter(child, parent=link) as w:
            r = w.add_region("pc.ram", len(child_mem), 0)
            for page in range(64):
                old, new = parent_mem[page * PS : (page + 1) * PS], child_mem[page * PS : (page + 1) * PS]
                if old == new:
                    w.put_parent(r, page, p.expected_digest(p.regions[0], page))
                else:
                    w.put_changed(r, page, bytes(old), bytes(new))
    return dict(parent=parent, child=child, parent_mem=bytes(parent_mem), child_mem=bytes(child_mem))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_inspect_json_is_the_library_summary(images):
    result = run("inspect", "--json", images["child"], "--parent", images["parent"])
    assert result.exit_code == 0, result.output
    with LeanImage.open(images["child"], parents=[images["parent"]]) as image:
        assert json.loads(result.output) == json.loads(json.dumps(summarize(image)))


def test_inspect_text_shows_classes_and_chain(images):
    result = run("inspect", images["child"], "--parent", images["parent"])
    assert result.exit_code == 0
    for word in ("PARENT", "DELTA", "STORED", "chain", "pc.ram", "ratio"):
        assert word in result.output


def test_inspect_of_a_link_gives_the_chains_totals_beside_its_own(images):
    """A link's own ratio describes one file; what a restore needs is every link (issue 15 §4)."""
    result = run("inspect", "--json", images["child"], "--parent", images["parent"])
    summary = json.loads(result.output)
    sizes = [images["child"].stat().st_size, images["parent"].stat().st_size]
    assert summary["stored_bytes"] == sizes[0]
    assert summary["chain_totals"] == dict(
        links=2,
        logical_bytes=summary["logical_bytes"],
        stored_bytes=sum(sizes),
        ratio=summary["logical_bytes"] / sum(sizes),
    )
    text = run("inspect", images["child"], "--parent", images["parent"]).output
    assert f"stored {sum(sizes) / 2**20:.2f} MiB in all links" in text and "(this link alone)" in text
    flat = run("inspect", "--json", images["parent"])
    assert json.loads(flat.output)["chain_totals"]["links"] == 1
    assert "in all links" not in run("inspect", images["parent"]).output


def test_validate_json_is_the_library_report(images):
    result = run("validate", "--json", images["child"], "--parent", images["parent"])
    assert result.exit_code == 0, result.output
    report = validate(images["child"], parents=[images["parent"]])
    assert json.loads(result.output) == json.loads(json.dumps(report.to_json()))
    assert json.loads(result.output)["checked"]["delta_pages"] == 1


def test_validate_exit_1_with_rule_on_a_flipped_bit(images, tmp_path):
    data = bytearray(images["parent"].read_bytes())
    data[len(data) // 2] ^= 0x10
    bad = tmp_path / "bad.lean"
    bad.write_bytes(data)
    result = run("validate", bad)
    assert result.exit_code == 1
    assert "LI-" in result.output and "offset 0x" in result.output


def test_restore_raw_equals_the_memory_fed_in(images, tmp_path):
    out = tmp_path / "child.raw"
    result = run("restore", images["child"], "--parent", images["parent"], "--to", "raw", "-o", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == images["child_mem"]


def test_restore_without_parent_is_a_clear_error(images, tmp_path):
    alone = tmp_path / "alone"
    alone.mkdir()
    child = alone / "child.lean"
    child.write_bytes(images["child"].read_bytes())
    result = CliRunner().invoke(main, ["restore", str(child), "-o", str(alone / "x.raw")])
    assert result.exit_code == 1
    assert "LI-CHN-001" in result.output and "--parent" in result.output
    assert "Traceback" not in result.output
    assert os.listdir(alone) == ["child.lean"], "no output, no temp file left"


def _read_fifo_in_background(fifo):
    """Start a reader of ``fifo``; the returned dict gets "data" once the writer closes it."""
    got = {}

    def read():
        with open(fifo, "rb") as f:
            got["data"] = f.read()

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return got, thread


def test_restore_into_a_fifo_writes_it_in_place(images, tmp_path):
    # -o naming a FIFO or a device (/dev/null) must not rename a temporary file over it:
    # as root that turns /dev/null into a regular file
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got, reader = _read_fifo_in_background(fifo)
    result = run("restore", images["child"], "--to", "raw", "-o", fifo)
    reader.join(timeout=60)
    assert result.exit_code == 0, result.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced by a regular file"
    assert got.get("data") == images["child_mem"]
    assert sorted(os.listdir(tmp_path)) == ["child.lean", "parent.lean", "pipe"], "no temp file left"


def test_writer_into_a_fifo_writes_a_whole_image(images, tmp_path):
    fifo, copy = tmp_path / "pipe", tmp_path / "copy.lean"
    os.mkfifo(fifo)
    got, reader = _read_fifo_in_background(fifo)
    with LeanImageWriter(fifo, frame_pages=8) as w:
        w.put_pages(w.add_region("pc.ram", len(images["parent_mem"]), 0), 0, images["parent_mem"])
    reader.join(timeout=60)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced by a regular file"
    copy.write_bytes(got["data"])
    with LeanImage.open(copy) as image:
        assert image.region_bytes(image.regions[0], 0, 64) == images["parent_mem"]


def test_widen_pipe_gives_a_pipe_a_1_mib_buffer(tmp_path):
    read_end, write_end = os.pipe()
    try:
        if int(open("/proc/sys/fs/pipe-max-size").read()) < PIPE_BUFFER_BYTES:
            pytest.skip("this kernel caps pipe buffers below 1 MiB")
        widen_pipe(write_end)
        assert fcntl.fcntl(write_end, F_GETPIPE_SZ) == PIPE_BUFFER_BYTES
    finally:
        os.close(read_end)
        os.close(write_end)
    with open(tmp_path / "f", "wb") as f:
        widen_pipe(f.fileno())  # a regular file: left alone, no error


def test_restore_finds_the_parent_beside_the_image(images, tmp_path):
    out = tmp_path / "child.raw"
    result = run("restore", images["child"], "-o", out)
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == images["child_mem"]


def test_missing_file_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(main, ["validate", str(tmp_path / "nope.lean")])
    assert result.exit_code == 2


def test_qemu_stream_gets_a_hint(tmp_path):
    path = tmp_path / "vm.save"
    path.write_bytes(b"QEVM\x00\x00\x00\x03" + bytes(200))
    result = CliRunner().invoke(main, ["inspect", str(path)])
    assert result.exit_code == 1
    assert "LI-HDR-001" in result.output and "leanimg convert" in result.output


# --- the console script's quick exit (cli.run) --------------------------------------------
def _script(*args, **kw) -> subprocess.CompletedProcess:
    """The installed console script (cli.run), as a user runs it."""
    return subprocess.run([*command_line(), *map(str, args)], capture_output=True, timeout=120, **kw)


def test_the_console_script_is_the_quick_exit():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "leanimg"]
    assert script.value == "leanimg.cli:run"


def test_the_console_script_exits_with_each_status_and_all_its_output(images, tmp_path):
    """The quick exit keeps what a normal exit gives: the command's status, every byte of
    stdout however large (here piped), the messages on stderr, the restored file whole."""
    out = tmp_path / "child.raw"
    done = _script("restore", images["child"], "--parent", images["parent"], "--to", "raw", "-o", out, "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["output"] == str(out)
    assert out.read_bytes() == images["child_mem"]
    listing = _script("inspect", images["child"], "--parent", images["parent"], "--json", "-vv")
    assert listing.returncode == 0 and json.loads(listing.stdout)
    bad = tmp_path / "bad.lean"
    bad.write_bytes(b"not an image" * 100)
    refused = _script("inspect", bad)
    assert refused.returncode == 1 and b"[LI-HDR-001]" in refused.stderr and refused.stdout == b""
    usage = _script("inspect", "--no-such-option", bad)
    assert usage.returncode == 2 and b"No such option" in usage.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.lean", "child.lean", "child.raw", "parent.lean"]


QUICK_EXIT_PROGRAM = """
import sys, threading, time
from leanimg import fileutil
from leanimg.cli import _exit_quickly
temp, f = fileutil.create_temporary(sys.argv[1])
f.write(b"half an output")
def late():
    time.sleep(0.3)
    open(sys.argv[2], "w").write("done")
threading.Thread(target=late).start()
sys.stdout.write("x" * 100)                # buffered, not flushed
sys.stderr.write("note")
_exit_quickly(eval(sys.argv[3]))
"""


@pytest.mark.parametrize("code, status, message", [(None, 0, ""), (0, 0, ""), (4, 4, ""), ("bad", 1, "bad")])
def test_the_quick_exit_does_what_a_normal_exit_must(tmp_path, code, status, message):
    """_exit_quickly joins the worker threads (one still writing), runs the atexit handlers
    (a temporary output removed), flushes stdout and stderr, and exits with the status
    sys.exit(code) would give."""
    done = subprocess.run(
        [sys.executable, "-c", QUICK_EXIT_PROGRAM, tmp_path / "out.raw", tmp_path / "late", repr(code)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},
    )  # buffered, as usual
    assert done.returncode == status, done.stderr
    assert done.stdout == "x" * 100 and done.stderr == "note" + (message + "\n" if message else "")
    assert sorted(os.listdir(tmp_path)) == ["late"] and (tmp_path / "late").read_text() == "done"


def test_a_closed_stdout_makes_the_console_script_exit_120_as_python_does(images):
    """Output lost at exit (stdout closed by the reader) is not a success."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "wb") as closed:
        done = subprocess.run(
            [*command_line(), "inspect", str(images["child"]), "--parent", str(images["parent"])],
            stdout=closed,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    assert done.returncode != 0
