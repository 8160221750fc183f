"""A restore or serve that fails as QEMU's ``-incoming "exec:..."`` makes the destination fail
at once (issue 31 §4): QEMU 7.2 and 10.0 wait in migration state setup forever when their
source exits without writing a byte, so a failing restore/serve writing to a pipe on stdout
gives them a few bytes that are no migration stream (cli.STREAM_FAILED)."""

from __future__ import annotations

import subprocess
import time

import pytest

from guest.qemus import qemu_params
from helpers import run_leanimg
from leanimg.cli import STREAM_FAILED, command_line

LEANIMG = command_line()
BAD_COMMANDS = {
    "restore-usage": ["restore", "/nonexistent.lean", "--to", "qemu", "-o", "-"],
    "restore-bad-image": ["restore", "NOT_AN_IMAGE", "--to", "qemu", "-o", "-"],
    "serve-usage": ["serve", "/nonexistent.lean", "--postcopy"],
}


@pytest.fixture
def not_an_image(tmp_path):
    path = tmp_path / "broken.lean"
    path.write_bytes(b"LEANIMG\0" + bytes(200))
    return path


def _argv(name: str, not_an_image) -> list[str]:
    return [str(not_an_image) if a == "NOT_AN_IMAGE" else a for a in BAD_COMMANDS[name]]


@pytest.mark.parametrize("name", BAD_COMMANDS)
def test_a_failing_stream_to_a_pipe_is_no_migration_stream(name, not_an_image):
    proc = subprocess.run(
        [*LEANIMG, *_argv(name, not_an_image)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60
    )
    assert proc.returncode != 0 and b"Traceback" not in proc.stderr
    assert proc.stdout == STREAM_FAILED
    assert not proc.stdout.startswith(b"QEVM")


@pytest.mark.parametrize(
    "argv",
    [
        ["restore", "NOT_AN_IMAGE", "--to", "raw", "-o", "-"],
        ["restore", "NOT_AN_IMAGE", "-o", "-"],
        ["restore", "NOT_AN_IMAGE", "--to", "qemu", "-o", "out.save"],
        ["restore", "NOT_AN_IMAGE", "--to=xen", "-o-"],
    ],
)
def test_other_failing_restores_to_a_pipe_write_nothing(argv, not_an_image, tmp_path):
    """Only what QEMU's -incoming reads gets the line: raw memory piped on stays empty."""
    argv = [str(not_an_image) if a == "NOT_AN_IMAGE" else a for a in argv]
    proc = subprocess.run([*LEANIMG, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=60, cwd=tmp_path)
    assert proc.returncode == 1 and proc.stdout == b"" and b"Traceback" not in proc.stderr


def test_the_option_forms_click_takes_are_read():
    from leanimg.cli import _streams_to_stdout

    for argv in (
        ["restore", "x", "--to", "qemu", "-o", "-"],
        ["restore", "--to=qemu", "-o-", "x"],
        ["-q", "restore", "x", "--output=-", "--to", "qemu"],
        ["serve", "x", "--postcopy"],
    ):
        assert _streams_to_stdout(argv), argv
    for argv in (
        ["restore", "x", "--to", "raw", "-o", "-"],
        ["restore", "x", "--to", "qemu", "-o", "f"],
        ["inspect", "x"],
        ["restore", "x", "-o", "-"],
        [],
    ):
        assert not _streams_to_stdout(argv), argv


def test_a_failing_restore_to_a_file_or_another_command_writes_nothing_more(tmp_path, not_an_image):
    out = tmp_path / "stdout.bin"
    with open(out, "wb") as f:
        proc = subprocess.run(
            [*LEANIMG, "restore", str(not_an_image), "--to", "qemu", "-o", "-"],
            stdout=f,
            stderr=subprocess.PIPE,
            timeout=60,
        )
    assert proc.returncode == 1 and out.read_bytes() == b""
    proc = run_leanimg("inspect", str(not_an_image), timeout=60)
    assert proc.returncode == 1 and STREAM_FAILED.decode() not in proc.stdout


@pytest.mark.qemu
@pytest.mark.parametrize("qemu", qemu_params())
@pytest.mark.parametrize("name", BAD_COMMANDS)
def test_qemu_fails_at_once_when_its_source_fails(qemu, name, not_an_image, tmp_path):
    """A QEMU that is never booted (-S, no guest): its incoming migration fails and it exits."""
    qemu.require()
    argv = " ".join([*LEANIMG, *_argv(name, not_an_image)])
    started = time.monotonic()
    proc = subprocess.run(
        [
            qemu.binary,
            "-accel",
            "tcg",
            "-machine",
            qemu.machine,
            "-nodefaults",
            "-display",
            "none",
            "-m",
            "64",
            "-S",
            "-incoming",
            f"exec:{argv}",
        ],
        capture_output=True,
        timeout=60,
    )
    assert time.monotonic() - started < 30
    output = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    assert proc.returncode != 0
    assert "Not a migration stream" in output, output
    assert "Traceback" not in output
