"""`leanimg serve --postcopy` without QEMU: the protocol as a destination sees it, the
prepaging orders, a page that fails its check, the host check, the command line.

A fake destination (``Destination``) reads the stream the server writes into a pipe,
checks its framing against QEMU 7.2's (savevm.c, ram.c), asks for pages on the return path
like QEMU's fault thread (REQ_PAGES_ID, then REQ_PAGES for the same block) and sends SHUT
after EOF.  The real thing is tests/test_qemu_postcopy.py.
"""

from __future__ import annotations

import io
import os
import stat
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import qemu_save
from leanimg.cli import STREAM_FAILED, command_line
from leanimg.converters import qemu as q
from leanimg.converters.convert import convert_file
from leanimg.converters.qemu_wire import command_bytes
from leanimg.format import RecordType
from leanimg.reader import LeanImage
from leanimg.restore import postcopy as pc
from leanimg.restore.prepage import STRATEGIES, make_strategy
from leanimg.restore.qemu import stream_state
from leanimg.restore.working_set import WorkingSetError, read_working_set, write_working_set
from leanimg.structures import dump_structure

PS = 4096
NPAGES = 300


@pytest.fixture(scope="module")
def ram() -> bytes:
    rng = np.random.default_rng(7)
    pages = rng.integers(0, 256, (NPAGES, PS), dtype=np.uint8)
    pages[rng.random(NPAGES) < 0.4] = 0  # 40 % zero pages, scattered
    pages[100:140] = 0  # and a long zero run
    return pages.tobytes()


@pytest.fixture(scope="module")
def image(ram, tmp_path_factory):
    d = tmp_path_factory.mktemp("postcopy")
    (d / "vm.save").write_bytes(qemu_save(ram))
    convert_file(str(d / "vm.save"), str(d / "vm.lean"), writer_options=dict(frame_pages=16))
    return d / "vm.lean"


@pytest.fixture(autouse=True)
def default_pipe(monkeypatch):
    """Linux's default pipe (64 KiB) between the serve and the fake destination: with the
    serve's 1 MiB one the whole 300-page image fits the pipe, the serve completes before the
    destination has read the package, and requests would never meet a running serve.
    (fileutil.widen_pipe has its own test in test_cli.py.)"""
    widened = []  # per call: was the fd given a pipe
    monkeypatch.setattr(pc, "widen_pipe", lambda fd: widened.append(stat.S_ISFIFO(os.fstat(fd).st_mode)))
    return widened


def test_the_serve_widens_its_stream_pipe_once(image, default_pipe):
    _, stats = serve(image)
    assert stats.completed and default_pipe == [True]


class Destination(threading.Thread):
    """Reads the stream; ``requests`` (page numbers of pc.ram) are asked for once the package
    (with RUN) has arrived; records every page entry.  With ``leave``, it closes both ends
    once every asked-for page arrived (as QEMU does when it quits)."""

    def __init__(self, stream, return_path, requests=(), leave=False, pong_after=0.0):
        super().__init__(daemon=True)
        self.pong_after = pong_after  # seconds the "devices" take to load before the PONG
        self.pong_at = self.end_at = None
        self.f, self.rp, self.requests, self.leave = stream, return_path, list(requests), leave
        self.pages: dict[int, bytes | None] = {}  # page -> data, None for a ZERO entry
        self.repeats, self.commands, self.sections = [], [], []
        self.before_run: list[int] | None = None  # pages that arrived before the package
        self.block = None
        self.error = None
        self.ended = False

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise EOFError(f"stream ended: wanted {n} bytes, got {len(data)}")
        return data

    def run(self):
        try:
            self._run()
        except Exception as exc:  # reported by the test
            self.error = exc
        finally:
            self.rp.close()

    def _run(self):
        assert self.read(8) == struct.pack(">II", q.QEVM_MAGIC, 3)
        self.read(1 + 4 + len(b"pc-i440fx-7.2"))  # the configuration section
        while True:
            kind = self.read(1)[0]
            if kind == q.COMMAND:
                self._command()
            elif kind in (q.START, q.PART, q.END):
                self.sections.append(kind)
                if kind == q.END:
                    self.end_at = time.monotonic()
                self.read(4)
                if kind == q.START:
                    self.read(self.read(1)[0] + 8)
                self._entries()
                assert self.read(1)[0] == q.FOOTER
                self.read(4)
            else:
                assert kind == q.EOF, kind
                self.ended = True
                self.rp.write(struct.pack(">HHI", pc.RP_SHUT, 4, 0))
                self.rp.flush()
                return

    def _command(self):
        cmd, length = struct.unpack(">HH", self.read(4))
        data = self.read(length)
        self.commands.append(cmd)
        if cmd == pc.CMD_PACKAGED:
            self.before_run = list(self.pages)
            blob = self.read(struct.unpack(">I", data)[0])
            assert blob.startswith(command_bytes(pc.CMD_POSTCOPY_LISTEN))
            ping = command_bytes(pc.CMD_PING, struct.pack(">I", pc.PING_DEVICES_LOADED))
            assert blob.endswith(ping + command_bytes(pc.CMD_POSTCOPY_RUN)), "a PING just before RUN"
            threading.Timer(self.pong_after, self._pong).start()
            self._ask()

    def _pong(self):
        """As QEMU's main thread does when it reaches the PING, after the devices."""
        self.pong_at = time.monotonic()
        try:
            self.rp.write(struct.pack(">HHI", pc.RP_PONG, 4, pc.PING_DEVICES_LOADED))
            self.rp.flush()
        except (ValueError, OSError):  # the destination has gone already
            pass

    def _ask(self):
        for i, page in enumerate(self.requests):
            head = struct.pack(">QI", page * PS, PS)
            if i == 0:
                msg = struct.pack(">HH", pc.RP_REQ_PAGES_ID, 13 + 6) + head + b"\x06pc.ram"
            else:
                msg = struct.pack(">HH", pc.RP_REQ_PAGES, 12) + head
            self.rp.write(msg)
        self.rp.flush()

    def _entries(self):
        while True:
            word = struct.unpack(">Q", self.read(8))[0]
            flags, addr = word & (PS - 1), word & ~(PS - 1)
            if flags == q.F_EOS:
                return
            if flags & q.F_MEM_SIZE:
                total = addr
                while total:
                    self.read(self.read(1)[0])
                    total -= struct.unpack(">Q", self.read(8))[0]
                continue
            if not flags & q.F_CONTINUE:
                self.block = self.read(self.read(1)[0]).decode()
            assert self.block == "pc.ram"
            page = addr // PS
            data = self.read(PS) if flags & q.F_PAGE else None
            if data is None:
                assert self.read(1) == b"\0"
            if page in self.pages:
                self.repeats.append(page)
            self.pages[page] = data
            if self.leave and set(self.requests) <= set(self.pages):
                raise EOFError("leaving")


def serve(image_path, requests=(), strategy="sequential", working_set=None, precopy_seconds=0.0, pong_after=0.0):
    """Run the server against a Destination; return (destination, stats or the ServeError)."""
    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    dest = Destination(open(down_r, "rb"), open(up_w, "wb"), requests, leave=strategy == "none", pong_after=pong_after)
    dest.start()
    with LeanImage.open(image_path) as img, open(up_r, "rb") as inp:
        out = open(down_w, "wb")
        try:
            result = pc.PostcopyServer(
                img, out, inp, strategy, log=lambda msg: None, working_set=working_set, precopy_seconds=precopy_seconds
            ).serve()
        except pc.ServeError as exc:
            result = exc
        finally:
            try:
                out.close()
            except BrokenPipeError:
                pass
        dest.join(timeout=30)
    return dest, result


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_page_that_must_travel_arrives_once(strategy, image, ram):
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    blank = ~pages.any(axis=1)
    asked = [int(np.flatnonzero(blank)[3]), int(np.flatnonzero(~blank)[-5]), 120, 7]
    dest, stats = serve(image, asked, strategy)
    assert dest.error is None or strategy == "none" and str(dest.error) == "leaving", dest.error
    assert not dest.repeats, f"pages sent twice: {dest.repeats}"
    assert dest.commands[:4] == [
        pc.CMD_OPEN_RETURN_PATH,
        pc.CMD_POSTCOPY_ADVISE,
        pc.CMD_POSTCOPY_RAM_DISCARD,
        pc.CMD_PACKAGED,
    ]
    assert dest.sections[0] == q.START
    for page, data in dest.pages.items():
        assert data == (None if blank[page] else pages[page].tobytes()), page
    assert set(asked) <= set(dest.pages)
    assert isinstance(stats, pc.ServeStats) and stats.pages_to_send == int((~blank).sum())
    if strategy == "none":
        assert stats.pushed_pages == 0 and stats.demand_pages == len(asked) and not stats.completed
        return
    assert dest.sections[-1] == q.END and dest.ended
    assert set(np.flatnonzero(~blank).tolist()) <= set(dest.pages)
    zero_entries = {p for p, data in dest.pages.items() if data is None}
    assert zero_entries <= {p for p in asked if blank[p]}, "only asked-for blank pages travel, as ZERO"
    assert stats.completed and stats.shut == 0
    assert stats.pages_to_send == int((~blank).sum())
    assert stats.pushed_pages + stats.demand_pages - stats.demand_blank == stats.pages_to_send


@pytest.mark.parametrize("strategy", STRATEGIES[1:])
def test_prepaging_orders_cover_each_page_once(strategy, image):
    with LeanImage.open(image) as img:
        server = pc.PostcopyServer(img, io.BytesIO(), io.BytesIO(), strategy)
        blocks = server.blocks
        order = make_strategy(strategy, img, blocks)
        seen, after_fault = [], []
        for step in range(1000):
            if step == 3:
                order.fault(blocks[0], 200)
            runs = order.next_runs(8)
            if not runs:
                break
            for block, first, count in runs:
                assert not block.sent[first : first + count].any() and not block.blank[first : first + count].any()
                block.sent[first : first + count] = True
                seen.extend(range(first, first + count))
                if step == 3:
                    after_fault.extend(range(first, first + count))
        assert sorted(seen) == np.flatnonzero(~blocks[0].blank).tolist()
        if strategy == "bubble":  # after the fault at 200, the pages around it come next
            assert len(after_fault) == 8 and all(abs(p - 200) <= 30 for p in after_fault), after_fault
            assert min(after_fault) < 200 < max(after_fault), after_fault


def with_a_spoiled_frame(image, bad):
    """A copy of ``image`` at ``bad`` with a byte of its middle PAGE_FRAME's payload flipped."""
    blob = bytearray(image.read_bytes())
    frames = [r for r in dump_structure(image)["records"] if r["record_type"] == RecordType.PAGE_FRAME]
    frame = frames[len(frames) // 2]
    blob[frame["offset"] + 32 + frame["body_length"] // 2] ^= 0x55
    bad.write_bytes(bytes(blob))
    return bad


def test_a_page_failing_its_check_stops_the_serve_and_is_never_sent(image, ram, tmp_path):
    bad = with_a_spoiled_frame(image, tmp_path / "bad.lean")
    dest, result = serve(bad)
    assert isinstance(result, pc.ServeError), result
    assert "stopped before sending block 'pc.ram' page " in str(result)
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    assert dest.pages, "pages before the bad frame were sent"
    for page, data in dest.pages.items():
        assert data == pages[page].tobytes(), f"page {page} arrived wrong"
    failed = int(str(result).split("page ")[1].split()[0])
    assert failed not in dest.pages and not dest.ended


def test_opening_matches_qemu_framing(image):
    with LeanImage.open(image) as img:
        state = stream_state(img)
        blob = pc.opening(state, PS)
    advise = command_bytes(pc.CMD_POSTCOPY_ADVISE, struct.pack(">QQ", PS, PS))
    assert blob.startswith(state.prologue + b"\x08\x00\x01\x00\x00" + advise)
    assert b"\x01\x00\x00\x00\x02\x03ram\x00\x00\x00\x00\x00\x00\x00\x04" in blob  # START 'ram' v4
    assert blob.endswith(command_bytes(pc.CMD_POSTCOPY_RAM_DISCARD, b"\x00\x06pc.ram\x00" + struct.pack(">QQ", 0, PS)))


@pytest.mark.skipif(os.geteuid() != 0, reason="drops root to test the refusal")
def test_userfaultfd_refused_is_named_with_the_remedy():
    setting = open("/proc/sys/vm/unprivileged_userfaultfd").read().strip()
    if setting != "0":
        pytest.skip("unprivileged userfaultfd is allowed on this host")
    pc.check_userfaultfd()  # root may
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: as nobody
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            pc.check_userfaultfd()
            os.write(w, b"allowed")
        except pc.ServeError as exc:
            os.write(w, str(exc).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        message = f.read().decode()
    os.waitpid(pid, 0)
    assert "userfaultfd" in message and "uid 65534" in message, message
    assert "vm.unprivileged_userfaultfd=1" in message and "root" in message, message


def test_cli_serve_needs_postcopy(image):
    proc = subprocess.run(
        [*command_line(), "serve", str(image)], capture_output=True, timeout=60, stdin=subprocess.DEVNULL
    )
    assert proc.returncode == 2 and b"--postcopy" in proc.stderr, proc.stderr


def test_cli_serve_answers_a_destination_that_leaves(image):
    """The destination closes both ends after the package: the serve ends cleanly and says
    what it sent."""
    with LeanImage.open(image) as img:
        state = stream_state(img)
        expected = pc.opening(state, PS) + pc.package(state)
    proc = subprocess.Popen(
        [*command_line(), "serve", str(image), "--postcopy", "--prepage", "none"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.read(len(expected)) == expected
    proc.stdin.close()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    assert "serve --postcopy (none): 0 pages on demand" in err and "stream not completed" in err, err


def test_cli_serve_to_a_destination_that_closed_the_stream(image):
    proc = subprocess.Popen(
        [*command_line(), "serve", str(image), "--postcopy"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stdin.close()
    assert proc.wait(timeout=60) == 1, err
    assert "leanimg: error: the destination closed the migration stream after 0 bytes" in err, err
    assert "migration.x-postcopy-ram=on" in err and "Traceback" not in err, err


def test_a_broken_return_path_ends_the_serve_with_a_warning(image):
    """A message cut short, then end of file: the serve warns and ends (never waits for ever)."""
    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    drained = threading.Thread(target=lambda: open(down_r, "rb").read(), daemon=True)
    drained.start()
    os.write(up_w, struct.pack(">HH", pc.RP_REQ_PAGES_ID, 32) + b"abc")
    os.close(up_w)
    said = []
    with LeanImage.open(image) as img, open(up_r, "rb") as inp, open(down_w, "wb") as out:
        stats = pc.PostcopyServer(img, out, inp, "none", log=said.append).serve()
    drained.join(timeout=30)
    assert said == ["warning: return path ended inside a REQ_PAGES_ID message"], said
    assert not stats.completed and stats.requests == 0


def test_return_path_messages_cut_anywhere_parse_alike():
    """The loop reads whatever the pipe holds: a message split over reads waits for its rest."""
    msgs = (
        struct.pack(">HH", pc.RP_REQ_PAGES_ID, 13 + 6)
        + struct.pack(">QI", 5 * PS, PS)
        + b"\x06pc.ram"
        + struct.pack(">HH", pc.RP_PONG, 4)
        + b"\0\0\0\1"
        + struct.pack(">HH", pc.RP_REQ_PAGES, 12)
        + struct.pack(">QI", 9 * PS, 2 * PS)
        + struct.pack(">HHI", pc.RP_SHUT, 4, 0)
    )
    for cut in range(len(msgs) + 1):
        r, w = os.pipe()
        rp = pc.ReturnPath(r)
        events = []
        for piece in (msgs[:cut], msgs[cut:]):
            if piece:
                os.write(w, piece)
                events += rp.read()
        os.close(w)
        events += rp.read()
        os.close(r)
        assert [e[:4] for e in events if e[0] == "req"] == [
            ("req", "pc.ram", 5 * PS, PS),
            ("req", "pc.ram", 9 * PS, 2 * PS),
        ], cut
        assert [e for e in events if e[0] != "req"] == [("pong", 1), ("shut", 0), ("eof",)], cut


def test_a_request_for_a_queued_page_moves_its_section_first(image, ram):
    """A page queued in a push but not written yet is not sent again: its section goes next."""
    with LeanImage.open(image) as img:
        server = pc.PostcopyServer(img, io.BytesIO(), io.BytesIO(), "sequential", log=lambda msg: None)
        server._push()
        queued = list(server.queue)
        assert len(queued) >= 3 and all(len(c.pages) <= pc.CHUNK_PAGES for c in queued)
        wanted = int(queued[2].pages[1])
        gone = server._answer([("req", "pc.ram", wanted * PS, PS, 0.0)])
        assert not gone and list(server.urgent) == [queued[2]] and queued[2] not in server.queue
        assert server.stats.requests_already_sent == 1 and server.stats.demand_pages == 0


def test_pushed_sections_each_name_their_block(image, ram):
    """Another section (an answer) may come between two pushed ones: each names pc.ram first."""
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    with LeanImage.open(image) as img:
        server = pc.PostcopyServer(img, io.BytesIO(), io.BytesIO(), "sequential", log=lambda msg: None)
        server._push()
        for chunk in server.queue:
            head = 1 + 4
            word = struct.unpack_from(">Q", chunk.data, head)[0]
            assert word & (PS - 1) == q.F_PAGE, "first entry without CONTINUE"
            assert chunk.data[head + 8 : head + 15] == b"\x06pc.ram"
            assert word // PS == chunk.pages[0]
            first = chunk.data[head + 15 : head + 15 + PS]
            assert first == pages[chunk.pages[0]].tobytes()


def test_a_frame_whose_prefetch_has_not_begun_is_decompressed_at_once(image):
    """The serve prefetches every frame; a fault must not wait behind the frames before its own."""
    from concurrent.futures import ThreadPoolExecutor

    with LeanImage.open(image) as img:
        frames = img.frames
        last = len(frames.page_frames) - 1
        assert last >= 2
        expected = frames._load(last)
        frames.jump_queue = True
        release = threading.Event()
        with ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(release.wait)  # the worker is busy: no prefetch begins
            frames.prefetch(range(last + 1), pool, with_digests=True)
            got = []
            reader = threading.Thread(target=lambda: got.append(frames.frame(last, with_digests=True)))
            reader.start()
            reader.join(timeout=30)
            release.set()
            assert got, "the frame waited for the prefetches queued before it"
        content, digests = got[0]
        assert content == expected and len(digests) == len(expected) // PS


def test_the_serve_prefetches_every_frame_once_when_they_fit(image):
    with LeanImage.open(image) as img:
        server = pc.PostcopyServer(img, io.BytesIO(), io.BytesIO(), "sequential", log=lambda msg: None)
        frames = img.frames
        assert frames.jump_queue and frames.cache_frames >= len(frames.page_frames)
        assert set(frames._ahead) | {key[1] for key in frames._cache} == set(range(len(frames.page_frames)))
        server._push()


# ---------------------------------------------------------------------------- working sets


def _working_set(path, entries, names=("pc.ram",), page_size=PS):
    write_working_set(str(path), page_size, list(names), entries)
    return str(path)


def test_a_working_set_travels_before_the_guest_runs_in_its_order(image, ram, tmp_path):
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    blank = ~pages.any(axis=1)
    stored = np.flatnonzero(~blank).tolist()
    listed = [
        stored[-1],
        int(np.flatnonzero(blank)[0]),
        stored[5],
        stored[-1],
        stored[0],
        299 if not blank[299] else stored[-2],
    ]
    ws = _working_set(tmp_path / "vm.lws", [(0, p) for p in listed])
    dest, stats = serve(image, working_set=ws)
    assert dest.error is None and not dest.repeats, (dest.error, dest.repeats)
    expected = list(dict.fromkeys(p for p in listed if not blank[p]))  # blank dropped, each once
    assert dest.before_run == expected
    assert stats.working_set_pages == len(expected) and stats.completed
    assert stats.pushed_pages + stats.working_set_pages == stats.pages_to_send
    for page, data in dest.pages.items():
        assert data == pages[page].tobytes(), page
    assert set(stored) == set(dest.pages)
    before_package = dest.commands.index(pc.CMD_PACKAGED)
    assert dest.commands[:before_package] == [
        pc.CMD_OPEN_RETURN_PATH,
        pc.CMD_POSTCOPY_ADVISE,
        pc.CMD_POSTCOPY_RAM_DISCARD,
    ], "pre-copy pages follow the discard"


def test_a_working_set_sends_at_most_its_budget_before_the_guest_runs(image, ram, tmp_path, monkeypatch):
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    stored = np.flatnonzero(pages.any(axis=1))[::-1].tolist()
    monkeypatch.setattr(pc, "WORKING_SET_PAGES", 4)
    dest, stats = serve(image, working_set=_working_set(tmp_path / "vm.lws", [(0, p) for p in stored]))
    assert dest.before_run == stored[:4] and stats.working_set_pages == 4
    assert stats.completed and set(stored) == set(dest.pages) and not dest.repeats


def test_a_working_set_page_failing_its_check_stops_the_serve_before_the_guest_runs(image, ram, tmp_path):
    bad = tmp_path / "bad.lean"
    blob = bytearray(image.read_bytes())
    frames = [r for r in dump_structure(image)["records"] if r["record_type"] == RecordType.PAGE_FRAME]
    blob[frames[-1]["offset"] + 32 + frames[-1]["body_length"] // 2] ^= 0x55
    bad.write_bytes(bytes(blob))
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    last = int(np.flatnonzero(pages.any(axis=1))[-1])  # in the last frame
    dest, result = serve(bad, working_set=_working_set(tmp_path / "vm.lws", [(0, last)]))
    assert isinstance(result, pc.ServeError) and f"page {last} " in str(result), result
    assert dest.before_run is None and last not in dest.pages, "the guest never ran, the page never went"


def test_recorded_faults_read_back_as_a_working_set(image, ram, tmp_path):
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    stored = np.flatnonzero(pages.any(axis=1)).tolist()
    asked = [stored[9], stored[2], stored[9], 120, stored[30]]
    down_r, down_w = os.pipe()
    up_r, up_w = os.pipe()
    dest = Destination(open(down_r, "rb"), open(up_w, "wb"), asked, leave=True)
    dest.start()
    with LeanImage.open(image) as img, open(up_r, "rb") as inp, open(down_w, "wb") as out:
        server = pc.PostcopyServer(img, out, inp, "none", log=lambda msg: None)
        server.serve()
        server.record_faults(str(tmp_path / "rec.lws"))
    dest.join(timeout=30)
    read = read_working_set(str(tmp_path / "rec.lws"), PS, {b.name: len(b.classes) for b in server.blocks})
    assert [(name, p.tolist()) for name, p in read] == [("pc.ram", list(dict.fromkeys(asked)))]
    assert server.stats.recorded_faults == len(set(asked))


def _good_file(tmp_path) -> bytes:
    return Path(_working_set(tmp_path / "good.lws", [(0, 3), (0, 299)])).read_bytes()


BAD_WORKING_SETS = {
    "LI-WKS-001": (lambda b: b"\x89LEANWKX" + b[8:], 0, "header.magic"),
    "LI-WKS-002": (lambda b: b[:8] + struct.pack("<H", 2) + b[10:], 8, "header.major_version"),
    "LI-WKS-002 page size": (lambda b: b[:12] + struct.pack("<I", 8192) + b[16:], 12, "header.page_size"),
    "LI-WKS-002 entries": (lambda b: b[:20] + struct.pack("<I", (1 << 22) + 1) + b[24:], 20, "header.entry_count"),
    "LI-WKS-002 blocks": (lambda b: b[:16] + struct.pack("<I", 0) + b[20:], 16, "header.block_count"),
    "LI-WKS-002 cut short": (lambda b: b[:15], 15, "header"),
    "LI-WKS-003": (lambda b: b[:25] + b"pc.rom" + b[31:], 24, "blocks[0]"),
    "LI-WKS-003 utf8": (lambda b: b[:25] + b"pc.ra\xff" + b[31:], 24, "blocks[0]"),
    "LI-WKS-004": (lambda b: b + b"\0", 31, "entries"),
    "LI-WKS-004 short": (lambda b: b[:-1], 31, "entries"),
    "LI-WKS-005": (lambda b: b[:-4] + struct.pack("<I", NPAGES), 39, "entries[1]"),
    "LI-WKS-005 block": (lambda b: b[:31] + struct.pack("<I", 1) + b[35:], 31, "entries[0]"),
}


@pytest.mark.parametrize("case", sorted(BAD_WORKING_SETS))
def test_a_bad_working_set_is_refused_with_offset_structure_and_rule(case, tmp_path):
    mutate, offset, structure = BAD_WORKING_SETS[case]
    path = tmp_path / "bad.lws"
    path.write_bytes(mutate(_good_file(tmp_path)))
    with pytest.raises(WorkingSetError) as info:
        read_working_set(str(path), PS, {"pc.ram": NPAGES})
    err = info.value
    assert (err.rule, err.offset, err.structure) == (case.split()[0], offset, structure), str(err)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_working_set_cut_anywhere_or_with_any_bit_flipped_is_read_or_refused_cleanly(data):
    """Truncated or bit-flipped: a WorkingSetError naming a LI-WKS rule, or a working set whose
    every page lies in the image (it can only change the order pages travel in)."""
    with tempfile.TemporaryDirectory() as d:
        good = _good_file(Path(d))
        if data.draw(st.booleans(), label="cut"):
            bad = good[: data.draw(st.integers(0, len(good) - 1), label="length")]
        else:
            bit = data.draw(st.integers(0, 8 * len(good) - 1), label="bit")
            bad = bytearray(good)
            bad[bit // 8] ^= 1 << (bit % 8)
        path = Path(d) / "bad.lws"
        path.write_bytes(bytes(bad))
        try:
            listed = read_working_set(str(path), PS, {"pc.ram": NPAGES})
        except WorkingSetError as exc:
            assert exc.rule.startswith("LI-WKS-") and exc.offset is not None and exc.structure, str(exc)
            return
    assert all(name == "pc.ram" and ((0 <= pages) & (pages < NPAGES)).all() for name, pages in listed)


def test_cli_serve_refuses_a_bad_working_set_before_sending_anything(image, tmp_path):
    path = tmp_path / "bad.lws"
    path.write_bytes(_good_file(tmp_path)[:-4] + struct.pack("<I", NPAGES))
    proc = subprocess.run(
        [*command_line(), "serve", str(image), "--postcopy", "--working-set", str(path)],
        capture_output=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    err = proc.stderr.decode()
    assert proc.returncode == 1 and proc.stdout == STREAM_FAILED, err  # no stream byte, the failure line
    assert err.startswith("leanimg: error: ") and "[LI-WKS-005]" in err and "entries[1]" in err, err
    assert "Traceback" not in err, err


def test_cli_serve_records_the_pages_asked_for(image, ram, tmp_path):
    """--record-faults writes the working set when the destination leaves."""
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    page = int(np.flatnonzero(pages.any(axis=1))[7])
    with LeanImage.open(image) as img:
        state = stream_state(img)
        expected = pc.opening(state, PS) + pc.package(state)
    rec = tmp_path / "rec.lws"
    proc = subprocess.Popen(
        [*command_line(), "serve", str(image), "--postcopy", "--prepage", "none", "--record-faults", str(rec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout.read(len(expected)) == expected
    proc.stdin.write(struct.pack(">HH", pc.RP_REQ_PAGES_ID, 13 + 6) + struct.pack(">QI", page * PS, PS) + b"\x06pc.ram")
    proc.stdin.flush()
    assert proc.stdout.read(1) == bytes([q.PART])
    proc.stdin.close()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0, err
    read = read_working_set(str(rec), PS, {"pc.ram": NPAGES, **{n: 1 << 20 for n in _other_blocks(image)}})
    assert [(name, p.tolist()) for name, p in read] == [("pc.ram", [page])]


def _other_blocks(image) -> list[str]:
    with LeanImage.open(image) as img:
        return [b.name for b in stream_state(img).ram_blocks if b.name != "pc.ram"]


# ---------------------------------------------------------------------------- pre-copy before RUN


@pytest.mark.parametrize("strategy", ["sequential", "bubble"])
def test_pages_go_before_the_guest_runs_for_precopy_seconds(strategy, image, ram, tmp_path):
    """A budget long enough for the whole image: every page travels before the package, in
    the prepaging order after the working set, each once and checked."""
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    stored = np.flatnonzero(pages.any(axis=1)).tolist()
    ws = _working_set(tmp_path / "vm.lws", [(0, stored[-1]), (0, stored[3])])
    dest, stats = serve(image, strategy=strategy, working_set=ws, precopy_seconds=60)
    assert dest.error is None and not dest.repeats, (dest.error, dest.repeats)
    assert dest.before_run[:2] == [stored[-1], stored[3]] and sorted(dest.before_run) == stored
    assert stats.pushed_before_run == stats.pushed_pages == len(stored) - 2 and stats.working_set_pages == 2
    assert stats.completed and stats.demand_pages == 0
    for page, data in dest.pages.items():
        assert data == pages[page].tobytes(), page


def test_no_precopy_seconds_sends_nothing_before_the_guest_runs_but_the_working_set(image, tmp_path):
    dest, stats = serve(image, strategy="sequential", precopy_seconds=0)
    assert dest.before_run == [] and stats.pushed_before_run == 0 and stats.completed


def test_a_page_failing_during_the_precopy_stops_the_serve_before_the_guest_runs(image, ram, tmp_path):
    bad = with_a_spoiled_frame(image, tmp_path / "bad.lean")
    dest, result = serve(bad, precopy_seconds=60)
    assert isinstance(result, pc.ServeError), result
    failed = int(str(result).split("page ")[1].split()[0])
    assert dest.before_run is None, "the package (RUN) never went"
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    assert failed not in dest.pages
    for page, data in dest.pages.items():
        assert data == pages[page].tobytes(), f"page {page} arrived wrong"


def test_the_stream_ends_only_after_the_devices_loaded(image, ram):
    """Every page went before RUN; the destination's devices load for 0.5 s (and could fault
    on a ZERO page meanwhile): END waits for the PONG to the package's PING."""
    pages = np.frombuffer(ram, np.uint8).reshape(NPAGES, PS)
    blank = int(np.flatnonzero(~pages.any(axis=1))[0])
    dest, stats = serve(image, [blank], strategy="sequential", precopy_seconds=60, pong_after=0.5)
    assert dest.error is None and stats.completed, dest.error
    assert dest.pong_at is not None and dest.end_at > dest.pong_at, "END went before the devices had loaded"
    assert dest.pages[blank] is None, "a ZERO page asked for while the devices load is answered"
    assert [e for e, _ in stats.timeline].index("devices loaded") < [e for e, _ in stats.timeline].index(
        "last page sent"
    )
