"""The test guests' console (tests/guest/vm.Serial) over a real Unix socket: what it does when
the guest goes silent, when QEMU closes the console, and when its log cannot be written."""

from __future__ import annotations

import errno
import socket

import pytest

from guest import chain_scenarios
from guest.vm import RECONNECT_AFTER, ConsoleSilent, ConsoleStall, GuestError, Serial


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

    def accept_again() -> socket.socket:
        server.settimeout(5)
        guest, _ = server.accept()
        guest.settimeout(5)
        opened.append((None, guest))
        return guest

    connect.accept_again = accept_again
    yield connect
    for serial, guest in opened:
        if serial is not None:
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


def test_a_console_silent_after_heartbeats_connects_again_and_reads_on(console):
    serial, guest = console(nudge_after=0.3)
    guest.sendall(b"HB words 3\n")
    serial.wait_for("HB words 3", 5)
    with pytest.raises(ConsoleSilent, match=r"\d nudges \(1 reconnects\)"):  # the second at 6 x 0.3 s
        with pytest.warns(ConsoleStall, match="after heartbeats: connected again"):
            serial.wait_for("HB words 4", 0.3 * RECONNECT_AFTER + 0.45)
    assert guest.recv(64) == b"\n" * (RECONNECT_AFTER - 1)
    assert guest.recv(64) == b"", "the first connection is closed"
    again = console.accept_again()
    again.sendall(b"HB words 4\n")
    assert serial.wait_for(r"HB words \d+", 5, len("HB words 3\n")).group(0) == "HB words 4"
    assert serial.reconnects == 1


def test_a_console_silent_before_any_heartbeat_is_only_sent_empty_lines(console):
    serial, guest = console(nudge_after=0.1)
    with pytest.raises(ConsoleSilent):
        serial.wait_for("LEANIMG-READY", 0.1 * RECONNECT_AFTER + 0.5)
    assert serial.nudges >= RECONNECT_AFTER and serial.reconnects == 0
    guest.sendall(b"LEANIMG-READY\n")
    serial.wait_for("LEANIMG-READY", 5)


def test_the_chain_scenario_runs_again_on_a_fresh_guest_only_when_its_console_went_silent(monkeypatch, tmp_path):
    calls, said = [], []

    def once(workdir, *args):
        calls.append(workdir.exists())
        (workdir / "cp1.save").parent.mkdir(parents=True, exist_ok=True)
        (workdir / "cp1.save").write_bytes(b"half a save")
        if len(calls) == 1:
            raise ConsoleSilent("timeout waiting for 'WORKLOAD-DONE' (300 s, the last 300 s silent)")
        return ["checkpoints"]

    monkeypatch.setattr(chain_scenarios, "_run_chain_scenario_once", once)
    work = tmp_path / "chain"
    with pytest.warns(ConsoleStall, match="chain scenario run again: timeout waiting for 'WORKLOAD-DONE'"):
        assert chain_scenarios.run_chain_scenario(work, build=object(), log=said.append) == ["checkpoints"]
    assert calls == [False, False], "the second attempt starts from an empty directory"
    assert said == [
        "attempt 1 given up, its console silent: timeout waiting for 'WORKLOAD-DONE' (300 s, the last 300 s silent)"
    ]

    def broken(workdir, *args):
        raise GuestError("workload failed: WORKLOAD-ERROR mmap 24 MiB")

    monkeypatch.setattr(chain_scenarios, "_run_chain_scenario_once", broken)
    with pytest.raises(GuestError, match="WORKLOAD-ERROR"):
        chain_scenarios.run_chain_scenario(work, build=object(), log=said.append)
    assert len(said) == 1, "any other failure is not retried"
