"""The guest free-list protocol (spec/hints.md §3.1): the helper guest/leanimg-guest-free.c as
built for a guest, and leanimg's reading of its answers (converters/guest_free.py), including
answers that break the protocol. The helper against a real guest and QEMU:
tests/test_qemu_guest_free.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from leanimg.converters.guest_free import MAX_LINE, Answer, GuestFreeError, GuestFreeLink, Snapshot, free_hints
from leanimg.errors import CheckpointError
from leanimg.hints import AddressMap, FreeSource, RecordType, read_hints

HELPER = Path(__file__).resolve().parents[1] / "guest" / "leanimg-guest-free.c"


def answer_bytes(nonce: str, ranges, page_size: int = 4096, end=None) -> bytes:
    lines = [f"begin {nonce} {page_size}\n"] + [f"{a:016x} {n:016x}\n" for a, n in ranges]
    count, pages = end if end is not None else (len(ranges), sum(n for _, n in ranges))
    return ("".join(lines) + f"end {nonce} {count} {pages} 1234\n").encode()


def parse(nonce: str, data: bytes, chunk: int = 7) -> Answer:
    answer = Answer(nonce)
    for i in range(0, len(data), chunk):
        answer.feed(data[i : i + chunk])
    return answer


def test_an_answer_in_pieces():
    answer = parse("ab12", answer_bytes("ab12", [(16, 4), (100, 1 << 20)]))
    assert answer.complete and answer.page_size == 4096 and answer.end == (2, 4 + (1 << 20), 1234)
    assert answer.ranges.tolist() == [[16, 4], [100, 1 << 20]]


def test_the_tail_of_an_earlier_answer_is_skipped():
    stale = answer_bytes("0ld", [(1, 1), (5, 2)])[20:]
    answer = parse("new1", stale + answer_bytes("new1", [(7, 3)]))
    assert answer.ranges.tolist() == [[7, 3]]


def test_an_empty_answer():
    answer = parse("e", answer_bytes("e", []))
    assert answer.complete and answer.ranges.shape == (0, 2)


@pytest.mark.parametrize(
    "data,why",
    [
        (answer_bytes("n", [(5, 2), (6, 1)]), "range 1: not ascending and disjoint"),
        (answer_bytes("n", [(9, 1), (2, 1)]), "range 1: not ascending and disjoint"),
        (answer_bytes("n", [(5, 0)]), "range 0: zero pages"),
        (answer_bytes("n", [(1 << 52, 1)]), "beyond 2^52"),
        (
            answer_bytes("n", [(5, 2)], end=(1, 3)),
            "the end line says 1 ranges of 3 pages; the answer has 1 ranges of 2",
        ),
        (answer_bytes("n", [(5, 2)], page_size=4097), "page size 4097"),
        (b"begin n 4096\n00000000000000zz 0000000000000001\nend n 1 1 0\n", "not two 16-digit hex numbers"),
        (b"begin n 4096\n5 2\nend n 1 2 0\n", "expected a range line"),
        (b"begin n 4096\nend n 0 0\n", "expected 'end n RANGES PAGES MICROSECONDS'"),
        (b"begin n\n", "expected 'begin n PAGE_SIZE'"),
        (b"error n page poisoning is on\n", "the guest cannot answer: page poisoning is on"),
        (b"begin n 4096\n" + b"x" * (MAX_LINE + 1), f"a line longer than {MAX_LINE} bytes"),
    ],
)
def test_a_broken_answer_is_refused_with_its_line(data, why):
    with pytest.raises(GuestFreeError) as info:
        parse("n", data)
    assert why in str(info.value) and "guest free-list protocol" in str(info.value)


def test_free_hints_are_guest_physical_at_the_offset_asked():
    snapshot = Snapshot(12345, 4096, np.array([[16, 4], [1000, 24]], np.uint64), 10, 0.0)
    hints = read_hints(free_hints(snapshot))
    assert hints.address_map == AddressMap.QEMU_PC and hints.page_size == 4096
    (record,) = hints.of_kind(RecordType.FREE)
    assert record.stream_offset == 12345 and record.source == FreeSource.GUEST
    assert record.entries["first"].tolist() == [16 * 4096, 1000 * 4096]
    assert record.entries["num_pages"].tolist() == [4, 24]


def test_the_link_keeps_the_latest_answer_and_the_offset_read_before_asking(tmp_path):
    """A guest helper played over a real unix socket: each answer is taken with the offset
    read before its request; a request stopped mid-answer is dropped."""
    path = tmp_path / "port.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    offsets = iter(range(100, 10**6, 100))
    answered = threading.Event()

    def helper():
        conn, _ = server.accept()
        with conn, conn.makefile("rb") as requests, contextlib.suppress(ConnectionResetError):
            for n, line in enumerate(requests):  # until leanimg hangs up (reset: its data unread)
                nonce = line.split()[1].decode()
                if n < 2:
                    conn.sendall(answer_bytes(nonce, [(n, 1)]))
                else:
                    conn.sendall(b"begin " + nonce.encode() + b" 4096\n")  # and nothing more
                    answered.set()

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    link = GuestFreeLink(str(path), lambda: next(offsets), interval=0.01)
    link.start()
    assert answered.wait(30)
    snapshot = link.finish()
    assert (link.asked, link.answered) == (3, 2)
    assert snapshot.stream_offset == 200 and snapshot.ranges.tolist() == [[1, 1]]
    link.close()
    server.close()


def test_a_request_that_hears_nothing_back_is_made_again_over_a_new_connection(tmp_path):
    """The first request's answer is lost (the helper never sends it; a stuck QEMU port does
    that): after reask_after seconds of silence leanimg hangs up, connects again and asks with a
    new nonce, takes that answer with the offset read before the second request, and keeps the
    connection open until closed."""
    path = tmp_path / "port.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(2)
    offsets = iter(range(100, 10**6, 100))
    nonces, answered, hung_up = [], threading.Event(), threading.Event()

    def helper():
        for connection in range(2):
            conn, _ = server.accept()
            with conn, conn.makefile("rb") as requests, contextlib.suppress(ConnectionResetError):
                for line in requests:
                    nonces.append((connection, line.split()[1].decode()))
                    if connection == 1:
                        conn.sendall(answer_bytes(nonces[-1][1], [(7, 3)]))
                        answered.set()
            if connection == 1:
                hung_up.set()

    threading.Thread(target=helper, daemon=True).start()
    link = GuestFreeLink(str(path), lambda: next(offsets), interval=30, reask_after=0.3)
    link.start()
    assert answered.wait(30)
    deadline = time.monotonic() + 30
    while link.answered < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    snapshot = link.finish()
    assert [c for c, _ in nonces] == [0, 1] and len({n for _, n in nonces}) == 2
    assert (link.asked, link.answered) == (2, 1)
    assert snapshot.stream_offset == 200 and snapshot.ranges.tolist() == [[7, 3]]
    assert not hung_up.wait(0.3)  # finish() stops asking, the connection stays
    link.close()
    assert hung_up.wait(30)
    server.close()


def test_a_missing_port_socket_names_the_qemu_options(tmp_path):
    with pytest.raises(CheckpointError) as info:
        GuestFreeLink(str(tmp_path / "none.sock"), lambda: 0)
    assert "cannot connect" in str(info.value) and "name=org.leanimg.free.0" in str(info.value)


@pytest.fixture(scope="module")
def helper_binary(tmp_path_factory):
    if not shutil.which("gcc"):
        pytest.skip("gcc is not installed")
    binary = tmp_path_factory.mktemp("helper") / "leanimg-guest-free"
    subprocess.run(
        ["gcc", "-static", "-O2", "-Wall", "-Wextra", "-Werror", "-o", str(binary), str(HELPER)],
        check=True,
        capture_output=True,
    )
    return binary


def test_the_helper_answers_in_the_protocol_leanimg_reads(helper_binary):
    """--once on this machine's own kernel: the answer parses, and its free pages are pages."""
    if not os.access("/proc/kpageflags", os.R_OK):
        pytest.skip("/proc/kpageflags is not readable here (needs root)")
    out = subprocess.run([str(helper_binary), "--once"], capture_output=True, timeout=120, check=True).stdout
    answer = parse("0", out, chunk=1 << 16)
    assert answer.complete and answer.page_size == os.sysconf("SC_PAGESIZE")
    pages = int(answer.ranges[:, 1].sum())
    total = os.sysconf("SC_PHYS_PAGES")
    assert 0 < pages <= total


def test_the_helper_refuses_arguments(helper_binary):
    proc = subprocess.run([str(helper_binary), "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "usage: leanimg-guest-free" in proc.stderr


@pytest.mark.parametrize("mode", ["stop", "background"])
def test_the_checkpoint_api_refuses_guest_free_hints_outside_a_precopy(tmp_path, mode):
    """LI-HNT-026: refused before QEMU is reached (the QMP socket here does not exist)."""
    from leanimg.converters.checkpoint import CheckpointRequest, run_checkpoint

    request = CheckpointRequest(
        qmp=str(tmp_path / "qmp.sock"),
        output=str(tmp_path / "x.lean"),
        mode=mode,
        guest_free=str(tmp_path / "free.sock"),
    )
    with pytest.raises(CheckpointError) as info:
        run_checkpoint(request)
    assert info.value.rule == "LI-HNT-026" and "needs --live" in str(info.value)
    assert list(tmp_path.iterdir()) == []
