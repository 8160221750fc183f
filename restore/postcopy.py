"""Lazy restore: serve a lean image to QEMU 7.2 as the source of a post-copy migration.

    qemu-system-x86_64 <same machine> -global migration.x-postcopy-ram=on \\
        -incoming "exec:leanimg serve vm.lean --postcopy"

QEMU reads the stream from our stdout and writes its return path to our stdin
(migration/savevm.c, ram.c, postcopy-ram.c, migration.c of QEMU 7.2).  What we send:

    prologue (magic, version, configuration)          verbatim from the image's stream state
    COMMAND OPEN_RETURN_PATH
    COMMAND POSTCOPY_ADVISE  be64 host page size summary, be64 target page size
    START 'ram'  MEM_SIZE + block list, EOS            the setup section; no page yet
    COMMAND POSTCOPY_RAM_DISCARD  one page             see _discard_one_page
    COMMAND PACKAGED be32 len, then len bytes:         read whole by the destination, so it
        COMMAND POSTCOPY_LISTEN                        can ask for pages while devices load
        FULL device sections (with footers)
        COMMAND POSTCOPY_RUN
    PART 'ram' ... EOS                                 pages: asked for, then pushed
    END 'ram' EOS, EOF                                 every page that must travel has

At ADVISE the destination discards all its RAM and at LISTEN registers it with userfaultfd:
a page never sent reads as zero once the migration ends, and until then a fault on it
blocks until it arrives.  So ZERO and FREE pages are never pushed; a fault on one is
answered with a ZERO entry (9 bytes; the destination places it with UFFDIO_ZEROPAGE).
Each page is sent at most once (a second copy fails UFFDIO_COPY with EEXIST on the
destination).  Every page sent was checked against its digest by the reader; a page that
fails stops the serve with an error naming it, and nothing more is sent: the destination
then pauses the migration (postcopy-paused) with that page never placed.

Return-path messages (be16 type, be16 length, data): REQ_PAGES_ID (be64 start, be32 len,
u8 name length, block name), REQ_PAGES (be64 start, be32 len; the block of the last
REQ_PAGES_ID), PONG, SHUT (the destination is done), RECV_BITMAP/RESUME_ACK (recovery, not
used).  A reader thread parses them into a queue; the main thread alone reads the image and
writes the stream, answering requests first and pushing pages in the prepaging order
(prepage.py) in between.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import queue
import struct
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from leanimg.converters import qemu
from leanimg.errors import LeanImageError, UnsupportedError
from leanimg.format import PageClass
from leanimg.reader import LeanImage

from .prepage import STRATEGIES, make_strategy
from .qemu import stream_state

# QEMU_VM_COMMAND sub-commands (savevm.c enum qemu_vm_cmd)
CMD_OPEN_RETURN_PATH, CMD_PING, CMD_POSTCOPY_ADVISE, CMD_POSTCOPY_LISTEN, CMD_POSTCOPY_RUN = 1, 2, 3, 4, 5
CMD_POSTCOPY_RAM_DISCARD, CMD_PACKAGED = 6, 7
MAX_PACKAGED = 1 << 24          # MAX_VM_CMD_PACKAGED_SIZE
# return-path messages (migration.c enum mig_rp_message_type)
RP_SHUT, RP_PONG, RP_REQ_PAGES_ID, RP_REQ_PAGES = 1, 2, 3, 4
RP_NAMES = {1: "SHUT", 2: "PONG", 3: "REQ_PAGES_ID", 4: "REQ_PAGES", 5: "RECV_BITMAP", 6: "RESUME_ACK"}

FIRST_REQUESTS = 256
TIMELINE_EVERY = 4096          # pages that travel between two timeline marks
PUSH_PAGES = 64                 # pages pushed between two looks at the request queue
_BE16, _BE32, _BE64 = struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")


class ServeError(LeanImageError):
    """The serve cannot go on: a page failed its check, the host or the peer is not fit."""


@dataclass
class ServeStats:
    strategy: str
    pages_total: int = 0            # pages of every RAM block
    pages_to_send: int = 0          # those neither ZERO nor FREE
    demand_pages: int = 0           # sent because the destination asked (faults served on demand)
    demand_blank: int = 0           # of those, ZERO/FREE pages answered with a ZERO entry
    pushed_pages: int = 0           # sent by prepaging before anyone asked
    requests: int = 0               # REQ_PAGES(_ID) messages received
    requests_already_sent: int = 0  # asked for pages already on their way
    bytes_sent: int = 0
    seconds_to_run: float = 0.0     # until POSTCOPY_RUN was written
    seconds_to_complete: float | None = None   # until the last page that must travel was written
    completed: bool = False         # END and EOF sent
    shut: int | None = None         # the destination's SHUT value (0: it loaded everything)
    error: str | None = None
    # (event, Unix time): where the time goes (process start, stream open, package sent, first
    # request, every TIMELINE_EVERY pages, last page, the destination's SHUT)
    timeline: list = field(default_factory=list)
    demand_wait_max: float = 0.0     # longest time a request waited in our queue before its answer
    demand_wait_total: float = 0.0
    # the first FIRST_REQUESTS requests: (arrival, answer written) as Unix times
    first_requests: list = field(default_factory=list)

    def mark(self, event: str) -> None:
        self.timeline.append((event, time.time()))

    def summary(self) -> str:
        done = (f"all {self.pages_to_send} pages that travel sent in {self.seconds_to_complete:.2f} s"
                if self.completed else "stream not completed")
        return (f"serve --postcopy ({self.strategy}): {self.demand_pages} pages on demand "
                f"({self.demand_blank} of them zero), {self.pushed_pages} pushed, {self.requests} requests "
                f"({self.requests_already_sent} for pages already sent); {done}; "
                f"{self.bytes_sent / 2**20:.1f} MiB written")


# ---------------------------------------------------------------------------- host check

def check_userfaultfd() -> None:
    """Fail clearly when this user cannot create a userfaultfd the way QEMU 7.2 does
    (``syscall(__NR_userfaultfd, O_CLOEXEC)``): QEMU, our parent, runs as the same user."""
    libc = ctypes.CDLL(None, use_errno=True)
    nr_userfaultfd = {"x86_64": 323, "aarch64": 282}.get(os.uname().machine)
    if nr_userfaultfd is None:
        return
    fd = libc.syscall(nr_userfaultfd, os.O_CLOEXEC)
    if fd >= 0:
        os.close(fd)
        return
    err = ctypes.get_errno()
    if err == errno.ENOSYS:
        raise ServeError("post-copy needs userfaultfd, which this kernel does not have (CONFIG_USERFAULTFD)")
    raise ServeError(f"post-copy needs userfaultfd, refused to uid {os.getuid()}: {os.strerror(err)}. "
                     "QEMU 7.2 calls the userfaultfd syscall itself: run it as root (or with "
                     "CAP_SYS_PTRACE), or allow unprivileged users with `sysctl vm.unprivileged_userfaultfd=1` "
                     "(/dev/userfaultfd is used only by QEMU 8.1 and later)")


# ---------------------------------------------------------------------------- the stream

def _command(cmd: int, data: bytes = b"") -> bytes:
    return bytes([qemu.COMMAND]) + _BE16.pack(cmd) + _BE16.pack(len(data)) + data


def _section_end(state: qemu.StreamState) -> bytes:
    tail = _BE64.pack(qemu.F_EOS)
    return tail + (qemu._footer_bytes(state.ram.section_id) if state.footers else b"")


def opening(state: qemu.StreamState, page_size: int) -> bytes:
    """Everything before the package: prologue, return path, advise, the RAM setup section."""
    if state.capabilities:
        raise UnsupportedError(f"post-copy of a stream saved with capabilities {', '.join(state.capabilities)}",
                               structure="source_state[QEMU tag 1]")
    ram = state.ram
    total = sum(b.length for b in state.ram_blocks)
    setup = [_BE64.pack(total | qemu.F_MEM_SIZE)]
    setup += [qemu._name_bytes(b.name) + _BE64.pack(b.length) for b in state.ram_blocks]
    start = qemu._section_header_bytes(qemu.START, ram) + b"".join(setup) + _section_end(state)
    advise = _BE64.pack(page_size) + _BE64.pack(page_size)
    return (state.prologue + _command(CMD_OPEN_RETURN_PATH) + _command(CMD_POSTCOPY_ADVISE, advise)
            + start + _discard_one_page(state.ram_blocks[0], page_size))


def _discard_one_page(block: qemu.RamBlock, page_size: int) -> bytes:
    """A RAM_DISCARD of one page the destination has discarded anyway (at ADVISE).

    Needed: QEMU 7.2's LISTEN handler, when no discard came before it, sets the state to
    LISTENING and then calls postcopy_ram_prepare_discard, which sets it back to DISCARD
    (savevm.c loadvm_postcopy_handle_listen); the listen thread then loads pages the
    precopy way, writing into memory registered with userfaultfd, and blocks for ever on
    the first page.  After a discard, LISTEN leaves the state LISTENING."""
    name = block.name.encode()
    body = bytes([0, len(name)]) + name + b"\0" + _BE64.pack(0) + _BE64.pack(page_size)
    return _command(CMD_POSTCOPY_RAM_DISCARD, body)


def package(state: qemu.StreamState) -> bytes:
    """LISTEN, the device state, RUN, wrapped in one PACKAGED command."""
    devices = b"".join(d.to_bytes(state.footers) for d in state.devices)
    blob = _command(CMD_POSTCOPY_LISTEN) + devices + _command(CMD_POSTCOPY_RUN)
    if len(blob) > MAX_PACKAGED:
        raise UnsupportedError(f"device state of {len(blob)} bytes exceeds QEMU's packaged limit "
                               f"of {MAX_PACKAGED}", structure="source_state[QEMU tag 1]")
    return _command(CMD_PACKAGED, _BE32.pack(len(blob))) + blob


def closing(state: qemu.StreamState) -> bytes:
    return bytes([qemu.END]) + _BE32.pack(state.ram.section_id) + _section_end(state) + bytes([qemu.EOF])


def page_entries(name: str, page_size: int, first: int, pages: np.ndarray | None, count: int) -> bytes:
    """``count`` entries of block ``name`` from page ``first``: PAGE entries of ``pages``
    ((count, page_size) uint8), or ZERO entries when ``pages`` is None.  The first entry
    names the block, the others CONTINUE it."""
    flag = qemu.F_ZERO if pages is None else qemu.F_PAGE
    width = 9 if pages is None else 8 + page_size
    rows = np.zeros((count, width), np.uint8)
    words = (np.arange(first, first + count, dtype=np.uint64) * np.uint64(page_size)) | np.uint64(flag)
    words[1:] |= np.uint64(qemu.F_CONTINUE)
    rows[:, :8] = words.astype(">u8").view(np.uint8).reshape(count, 8)
    if pages is not None:
        rows[:, 8:] = pages
    head = rows[0].tobytes()
    return head[:8] + qemu._name_bytes(name) + head[8:] + rows[1:].tobytes()


# ---------------------------------------------------------------------------- the return path

class ReturnPath(threading.Thread):
    """Parses the destination's messages from ``fileobj`` into ``events``:
    ("req", block, start, length, monotonic time of arrival), ("shut", value), ("eof",), ("bad", message).

    Reads the file descriptor itself: a buffered reader blocked in this thread would hold
    its lock, and closing it (at exit, after an error) would wait for the destination."""

    def __init__(self, fileobj, events: queue.Queue):
        super().__init__(name="return-path", daemon=True)
        self.fd, self.events = fileobj.fileno(), events

    def run(self) -> None:
        try:
            self._parse()
        except OSError as exc:
            self.events.put(("bad", f"return path: {exc.strerror or exc}"))
        finally:
            self.events.put(("eof",))

    def _parse(self) -> None:
        block = None
        while True:
            head = self._read(4)
            if head is None:
                return
            kind, length = _BE16.unpack_from(head)[0], _BE16.unpack_from(head, 2)[0]
            name = RP_NAMES.get(kind, kind)
            data = self._read(length) if length else b""
            if data is None:
                self.events.put(("bad", f"return path ended inside a {name} message"))
                return
            if kind in (RP_REQ_PAGES_ID, RP_REQ_PAGES) and len(data) >= 12:
                start, size = _BE64.unpack_from(data)[0], _BE32.unpack_from(data, 8)[0]
                if kind == RP_REQ_PAGES_ID:
                    block = data[13:13 + data[12]].decode(errors="replace") if len(data) > 12 else None
                self.events.put(("req", block, start, size, time.monotonic()))
            elif kind == RP_SHUT and length == 4:
                self.events.put(("shut", _BE32.unpack(data)[0]))
            elif kind != RP_PONG:
                self.events.put(("bad", f"unexpected return-path message {name} of {length} bytes"))

    def _read(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            chunk = os.read(self.fd, n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf


# ---------------------------------------------------------------------------- the server

@dataclass
class Block:
    """One RAM block served: its region, which pages need sending, which were sent."""
    index: int
    name: str
    region: object
    classes: np.ndarray
    blank: np.ndarray               # ZERO or FREE: never pushed
    sent: np.ndarray = field(init=False)

    def __post_init__(self):
        self.sent = np.zeros(len(self.classes), bool)


class PostcopyServer:
    def __init__(self, image: LeanImage, out, inp, strategy: str = "sequential", log=None, progress=None):
        self.image, self.out, self.inp = image, out, inp
        self.state = stream_state(image)
        self.ps = image.page_size
        if self.state.page_size != self.ps:
            raise UnsupportedError(f"stream target page size {self.state.page_size} differs from the image's "
                                   f"page size {self.ps}")
        self.blocks = [self._block(i, b) for i, b in enumerate(self.state.ram_blocks)]
        self.by_name = {b.name: b for b in self.blocks}
        self.stats = ServeStats(strategy)
        self.stats.pages_total = sum(len(b.classes) for b in self.blocks)
        self.stats.pages_to_send = sum(int((~b.blank).sum()) for b in self.blocks)
        self.strategy = make_strategy(strategy, image, self.blocks)
        self.events: queue.Queue = queue.Queue()
        self.log = log or (lambda msg: print(f"leanimg: {msg}", file=sys.stderr, flush=True))
        self.left = self.stats.pages_to_send
        self.progress = progress          # called with the number of pages that travel, as they are sent
        self.t0 = time.monotonic()
        self.stats.mark("server ready")

    def _block(self, index: int, block: qemu.RamBlock) -> Block:
        region = self.image.region(block.name)
        if region.size_bytes != block.length:
            raise LeanImageError(f"region {block.name!r} has {region.size_bytes} bytes, the stream state "
                                 f"says {block.length}", structure=f"region[{region.region_id}]")
        cls = self.image.classes(region)
        return Block(index, block.name, region, cls, (cls == PageClass.ZERO) | (cls == PageClass.FREE))

    # --- writing ---------------------------------------------------------------------

    def _write(self, blob: bytes) -> None:
        self.out.write(blob)
        self.stats.bytes_sent += len(blob)

    def _flush(self) -> None:
        self.out.flush()

    def _section(self, parts: list[bytes]) -> None:
        sid = self.state.ram.section_id
        self._write(bytes([qemu.PART]) + _BE32.pack(sid) + b"".join(parts) + _section_end(self.state))
        self._flush()

    def _entries(self, block: Block, first: int, count: int) -> bytes:
        """Pages [first, first+count) of ``block`` not sent yet (all of them, by the callers'
        choice), read and verified, as entries; marks them sent."""
        rows = np.arange(first, first + count)
        blank = block.blank[rows]
        parts = []
        if blank.all():
            parts.append(page_entries(block.name, self.ps, first, None, count))
        else:
            data = self._read(block, first, count)
            for lo, hi in _runs_of(blank):
                pages = None if blank[lo] else data[lo:hi]
                parts.append(page_entries(block.name, self.ps, first + lo, pages, hi - lo))
        block.sent[first:first + count] = True
        travelled = int((~blank).sum())
        if (self.left - 1) // TIMELINE_EVERY != (self.left - 1 - travelled) // TIMELINE_EVERY:
            self.stats.mark(f"{self.stats.pages_to_send - self.left + travelled} pages sent")
        self.left -= travelled
        if self.progress is not None:
            self.progress(int((~blank).sum()))
        return b"".join(parts)

    def _read(self, block: Block, first: int, count: int) -> np.ndarray:
        """Pages verified by the reader; on a failure, the first page that fails is named."""
        try:
            data = self.image.region_bytes(block.region, first, count)
        except LeanImageError as exc:
            page = first
            if count > 1:
                for page in range(first, first + count):
                    try:
                        self.image.region_bytes(block.region, page, 1)
                    except LeanImageError as one:
                        exc = one
                        break
            raise ServeError(f"stopped before sending block {block.name!r} page {page} "
                             f"(offset {page * self.ps:#x}), nothing more sent: {exc}") from None
        return np.frombuffer(data, np.uint8).reshape(count, self.ps)

    # --- serving ------------------------------------------------------------------------

    def serve(self) -> ServeStats:
        ReturnPath(self.inp, self.events).start()
        try:
            self._write(opening(self.state, self.ps))
            self._write(package(self.state))
            self._flush()
            self.stats.mark("package sent")
            self.stats.seconds_to_run = time.monotonic() - self.t0
            self._loop()
        except BrokenPipeError:
            self.stats.error = (f"the destination closed the migration stream after {self.stats.bytes_sent} bytes "
                                "(its own error says why; is post-copy enabled on it: -global "
                                "migration.x-postcopy-ram=on?)")
            raise ServeError(self.stats.error) from None
        except ServeError as exc:
            self.stats.error = str(exc)
            raise
        return self.stats

    def _loop(self) -> None:
        ended = False
        while True:
            wait = ended or (self.strategy.exhausted and self.left > 0)
            if self._answer(self._pending_events(block=wait)):
                return
            if not ended and self.left == 0:
                self._write(closing(self.state))
                self._flush()
                self.stats.completed = True
                self.stats.mark("last page sent")
                self.stats.seconds_to_complete = time.monotonic() - self.t0
                ended = True
                continue
            if not ended:
                self._push()

    def _pending_events(self, block: bool) -> list:
        events = []
        if block:
            events.append(self.events.get())
        while True:
            try:
                events.append(self.events.get_nowait())
            except queue.Empty:
                return events

    def _answer(self, events: list) -> bool:
        """Serve the requests among ``events``; True when the destination has gone."""
        parts, arrivals = [], []
        gone = False
        for event in events:
            if event[0] == "req":
                if not self.stats.requests:
                    self.stats.mark("first request")
                parts.append(self._requested(*event[1:4]))
                arrivals.append(event[4])
            elif event[0] == "shut":
                self.stats.shut = event[1]
                self.stats.mark("shut received")
                gone = True
            elif event[0] == "eof":
                gone = True
            else:
                self.log(f"warning: {event[1]}")
        parts = [p for p in parts if p]
        if parts and not self.stats.completed:
            self._section(parts)
        self._answered(arrivals)
        return gone

    def _answered(self, arrivals: list[float]) -> None:
        """Account for the time the requests that arrived at ``arrivals`` waited for their answer."""
        now = time.monotonic()
        for arrival in arrivals:
            self.stats.demand_wait_total += now - arrival
            self.stats.demand_wait_max = max(self.stats.demand_wait_max, now - arrival)
            if len(self.stats.first_requests) < FIRST_REQUESTS:
                unix = time.time() - now
                self.stats.first_requests.append((unix + arrival, unix + now))

    def _requested(self, name: str, start: int, size: int) -> bytes:
        self.stats.requests += 1
        block = self.by_name.get(name)
        if block is None or start % self.ps or size % self.ps or start + size > len(block.sent) * self.ps:
            raise ServeError(f"the destination asked for {size} bytes at {start:#x} of block {name!r}, "
                             "which the image does not have")
        first, count = start // self.ps, size // self.ps
        if self.stats.completed:
            return b""
        self.strategy.fault(block, first)
        parts = []
        for page in range(first, first + count):
            if block.sent[page]:
                self.stats.requests_already_sent += 1
                continue
            self.stats.demand_pages += 1
            self.stats.demand_blank += int(block.blank[page])
            parts.append(self._entries(block, page, 1))
        return b"".join(parts)

    def _push(self) -> None:
        parts = []
        for block, first, count in self.strategy.next_runs(PUSH_PAGES):
            self.stats.pushed_pages += count
            parts.append(self._entries(block, first, count))
        if parts:
            self._section(parts)


def _runs_of(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(mask[1:] != mask[:-1]) + 1
    bounds = [0, *edges.tolist(), len(mask)]
    return list(zip(bounds, bounds[1:]))


def _process_start() -> float | None:
    """This process's start as Unix time (to 10 ms), from /proc; None where there is none."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")


def serve_postcopy(image: LeanImage, out, inp, strategy: str = "sequential", stats_path: str | None = None,
                   log=None, progress=None) -> ServeStats:
    """Serve ``image`` on the binary file ``out`` (the stream) with the return path on ``inp``;
    report the counts on stderr (and as JSON in ``stats_path``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown prepaging strategy {strategy!r}")
    check_userfaultfd()
    started = _process_start()
    server = PostcopyServer(image, out, inp, strategy, log, progress)
    if started is not None:
        server.stats.timeline.insert(0, ("process start", started))
    try:
        return server.serve()
    finally:
        server.log(server.stats.summary())
        if stats_path:
            with open(stats_path, "w") as f:
                json.dump(asdict(server.stats), f, indent=2)
