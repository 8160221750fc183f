"""The test guests' console (tests/guest/vm.Serial) over a real Unix socket: what it does when
the guest goes silent, when QEMU closes the console, and when its log cannot be written."""

from __future__ import annotations

import errno
import socket

import pytest

from guest.vm import GuestError, Serial


@pytest.fixture
def console(tmp_path):
    """A listening socket where QEMU's chardev would be; yields (connect, the guest's end)."""
    path = tmp_path / "serial.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    opened = []

    def connect(**options) -> tuple[Serial, socket.socket]:
        serial = Serial(path, tmp_path / "serial.log", **options)
        guest, _ = server.accept()
        guest.settimeout(5)
        opened.append((serial, guest))
        return serial, guest

    yield connect
    for serial, guest in opened:
        serial.close()
        guest.close()
    server.close()


def test_a_silent_console_is_sent_an_empty_line_and_the_answer_is_seen(console):
    serial, guest = console(nudge_after=0.2)
    guest.sendall(b"LEANIMG-STARTED 7\n")
    serial.wait_for("STARTED", 5)
    with pytest.raises(GuestError):
        serial.wait_for("WORKLOAD-DONE", 0.7)
    assert guest.recv(64).startswith(b"\n")
    assert serial.nudges >= 1
    guest.sendall(b"WORKLOAD-DONE pages 1\n")
    assert serial.wait_for(r"WORKLOAD-DONE \w+", 5).group(0) == "WORKLOAD-DONE pages"


def test_without_nudges_nothing_is_sent_and_the_error_says_how_long_it_was_silent(console):
    serial, guest = console()
    guest.sendall(b"HB words 9\n")
    serial.wait_for("HB words 9", 5)
    with pytest.raises(
        GuestError, match=r"(?s)timeout waiting for 'HB words 10' .*\(1 s, the last 1 s silent\).*HB words 9"
    ):
        serial.wait_for("HB words 10", 1.0)
    guest.settimeout(0.2)
    with pytest.raises(TimeoutError):
        guest.recv(64)
    assert serial.nudges == 0


def test_a_closed_console_is_named_as_such(console):
    serial, guest = console(nudge_after=30)
    guest.sendall(b"LEANIMG-READY\n")
    guest.close()
    with pytest.raises(GuestError, match=r"the serial console closed \(QEMU exited\?\) before 'HB'"):
        serial.wait_for("HB", 10)


def test_a_log_that_cannot_be_written_does_not_stop_the_reading(console):
    class FullDisk:
        def write(self, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

        def close(self):
            pass

    serial, guest = console()
    serial.log = FullDisk()
    guest.sendall(b"first\n")
    serial.wait_for("first", 5)
    guest.sendall(b"second\n")
    serial.wait_for("second", 5)
    assert serial.log_error is not None and serial.log_error.errno == errno.ENOSPC
    with pytest.raises(GuestError, match="the serial log stopped: .*No space left"):
        serial.wait_for("third", 0.5)
