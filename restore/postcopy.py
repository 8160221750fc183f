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
    PART 'ram' ... EOS                                 pre-copy: the working set, then pushes
                                                       for precopy_seconds (see _precopy)
    COMMAND PACKAGED be32 len, then len bytes:         read whole by the destination, so it
        COMMAND POSTCOPY_LISTEN                        can ask for pages while devices load
        FULL device sections (with footers)
        COMMAND PING                                   answered (PONG) once the devices loaded
        COMMAND POSTCOPY_RUN
    PART 'ram' ... EOS                                 pages: asked for, then pushed
    END 'ram' EOS, EOF                                 every page that must travel has, and
                                                       the PONG came

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
used).  One thread and one select loop parse them as they come and write the stream
(non-blocking): answers go ahead of every queued push, pushes follow the prepaging order
(prepage.py) in sections of CHUNK_PAGES pages, read and verified PUSH_BATCH pages at a time.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import json
import os
import select
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from leanimg import s3
from leanimg.converters import qemu
from leanimg.converters.qemu_wire import (
    BE16,
    BE32,
    BE64,
    CMD_OPEN_RETURN_PATH,
    CMD_PACKAGED,
    CMD_PING,
    CMD_POSTCOPY_ADVISE,
    CMD_POSTCOPY_LISTEN,
    CMD_POSTCOPY_RAM_DISCARD,
    CMD_POSTCOPY_RUN,
    END,
    EOF,
    F_CONTINUE,
    F_MEM_SIZE,
    F_PAGE,
    F_ZERO,
    PART,
    START,
    command_bytes,
    name_bytes,
    part_header_bytes,
    ram_block_bytes,
    ram_section_end,
    section_header_bytes,
)
from leanimg.errors import LeanImageError, UnsupportedError
from leanimg.fileutil import widen_pipe, write_atomically
from leanimg.format import PageClass
from leanimg.reader import LeanImage

from .prepage import STRATEGIES, make_strategy
from .qemu import stream_state
from .working_set import read_working_set, write_working_set

# the PING in the package, before RUN: QEMU's main thread answers it when it has loaded the devices
PING_DEVICES_LOADED = 0x4C4F4144
MAX_PACKAGED = 1 << 24  # MAX_VM_CMD_PACKAGED_SIZE
# return-path messages (migration.c enum mig_rp_message_type)
RP_SHUT, RP_PONG, RP_REQ_PAGES_ID, RP_REQ_PAGES = 1, 2, 3, 4
RP_NAMES = {1: "SHUT", 2: "PONG", 3: "REQ_PAGES_ID", 4: "REQ_PAGES", 5: "RECV_BITMAP", 6: "RESUME_ACK"}

FIRST_REQUESTS = 256
TIMELINE_EVERY = 4096  # pages that travel between two timeline marks
PUSH_BATCH = 256  # pages of the prepaging order read and verified together
CHUNK_PAGES = 16  # pages per pushed section: what a request may wait behind
MERGE_GAP = 64  # pages of a push this close are read in one go (the gap read along)
LOW_WATER = PUSH_BATCH // CHUNK_PAGES  # queue the next push when fewer sections wait than this
MAX_QUEUED = 4 * LOW_WATER  # a fault's own push is queued first only below this
# decompressed frames kept: a fault anywhere would otherwise decompress its whole frame again
# (~4 ms for 2 MiB); every frame is read once by the pushes anyway
FRAME_CACHE_BYTES = 256 << 20
# pages of a working set sent before the guest runs: each delays RUN by its read, check and
# copy (10-35 us, scattered pages the dearer), each saves a fault's round trip (2-3 ms) if the
# guest touches it
WORKING_SET_PAGES = 8192


class ServeError(LeanImageError):
    """The serve cannot go on: a page failed its check, the host or the peer is not fit."""


@dataclass
class ServeStats:
    strategy: str
    pages_total: int = 0  # pages of every RAM block
    pages_to_send: int = 0  # those neither ZERO nor FREE
    demand_pages: int = 0  # sent because the destination asked (faults served on demand)
    demand_blank: int = 0  # of those, ZERO/FREE pages answered with a ZERO entry
    pushed_pages: int = 0  # sent by prepaging before anyone asked
    requests: int = 0  # REQ_PAGES(_ID) messages received
    requests_already_sent: int = 0  # asked for pages already on their way
    bytes_sent: int = 0
    seconds_to_run: float = 0.0  # until POSTCOPY_RUN was written
    seconds_to_complete: float | None = None  # until the last page that must travel was written
    completed: bool = False  # END and EOF sent
    shut: int | None = None  # the destination's SHUT value (0: it loaded everything)
    error: str | None = None
    # (event, Unix time): where the time goes (process start, stream open, package sent, first
    # request, every TIMELINE_EVERY pages, last page, the destination's SHUT)
    timeline: list = field(default_factory=list)
    working_set_pages: int = 0  # sent from --working-set before the guest ran (pre-copy)
    pushed_before_run: int = 0  # of pushed_pages, those sent before the guest ran (--precopy-seconds)
    recorded_faults: int | None = None  # pages written to --record-faults
    demand_wait_max: float = 0.0  # longest time a request waited in our queue before its answer
    demand_wait_total: float = 0.0
    # the first FIRST_REQUESTS requests: (arrival, answer queued) as Unix times, block, first page
    first_requests: list = field(default_factory=list)
    # an image read from object storage (s3://): bytes fetched from the store when the guest
    # was let run, and per object at the end (s3.take_fetched)
    fetched_at_run: int | None = None
    fetched: list = field(default_factory=list)

    def mark(self, event: str) -> None:
        self.timeline.append((event, time.time()))

    def summary(self) -> str:
        done = (
            f"all {self.pages_to_send} pages that travel sent in {self.seconds_to_complete:.2f} s"
            if self.completed
            else "stream not completed"
        )
        return (
            f"serve --postcopy ({self.strategy}): {self.demand_pages} pages on demand "
            f"({self.demand_blank} of them zero), {self.pushed_pages} pushed, {self.requests} requests "
            f"({self.requests_already_sent} for pages already sent); {done}; "
            f"{self.bytes_sent / 2**20:.1f} MiB written{self._fetched_summary()}"
        )

    def _fetched_summary(self) -> str:
        if not self.fetched:
            return ""
        fetched, size = sum(f["fetched_bytes"] for f in self.fetched), sum(f["object_bytes"] for f in self.fetched)
        at_run = (
            f", {self.fetched_at_run / 2**20:.1f} MiB of it before the guest ran"
            if self.fetched_at_run is not None
            else ""
        )
        return f"; fetched {fetched / 2**20:.1f} MiB of the {size / 2**20:.1f} MiB image from the store{at_run}"


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
    raise ServeError(
        f"post-copy needs userfaultfd, refused to uid {os.getuid()}: {os.strerror(err)}. "
        "QEMU 7.2 calls the userfaultfd syscall itself: run it as root (or with "
        "CAP_SYS_PTRACE), or allow unprivileged users with `sysctl vm.unprivileged_userfaultfd=1` "
        "(/dev/userfaultfd is used only by QEMU 8.1 and later)"
    )


# ---------------------------------------------------------------------------- the stream


def _section_end(state: qemu.StreamState) -> bytes:
    return ram_section_end(state.ram.section_id, state.footers)


def opening(state: qemu.StreamState, page_size: int) -> bytes:
    """Everything before the package: prologue, return path, advise, the RAM setup section."""
    if state.capabilities:
        raise UnsupportedError(
            f"post-copy of a stream saved with capabilities {', '.join(state.capabilities)}",
            structure="source_state[QEMU tag 1]",
        )
    ram = state.ram
    total = sum(b.length for b in state.ram_blocks)
    setup = [BE64.pack(total | F_MEM_SIZE)]
    setup += [ram_block_bytes(b.name, b.length) for b in state.ram_blocks]
    start = section_header_bytes(START, ram) + b"".join(setup) + _section_end(state)
    advise = BE64.pack(page_size) + BE64.pack(page_size)
    return (
        state.prologue
        + command_bytes(CMD_OPEN_RETURN_PATH)
        + command_bytes(CMD_POSTCOPY_ADVISE, advise)
        + start
        + _discard_one_page(state.ram_blocks[0], page_size)
    )


def _discard_one_page(block: qemu.RamBlock, page_size: int) -> bytes:
    """A RAM_DISCARD of one page the destination has discarded anyway (at ADVISE).

    Needed: QEMU 7.2's LISTEN handler, when no discard came before it, sets the state to
    LISTENING and then calls postcopy_ram_prepare_discard, which sets it back to DISCARD
    (savevm.c loadvm_postcopy_handle_listen); the listen thread then loads pages the
    precopy way, writing into memory registered with userfaultfd, and blocks for ever on
    the first page.  After a discard, LISTEN leaves the state LISTENING."""
    body = bytes([0]) + name_bytes(block.name) + b"\0" + BE64.pack(0) + BE64.pack(page_size)
    return command_bytes(CMD_POSTCOPY_RAM_DISCARD, body)


def package(state: qemu.StreamState) -> bytes:
    """LISTEN, the device state, a PING, RUN, wrapped in one PACKAGED command.

    The PING: QEMU 7.2's listen thread, after END, waits for the main thread to finish the
    package (savevm.c postcopy_ram_listen_thread, main_thread_load_event) before it
    unregisters userfaultfd.  A device that touches a page while loading (a ZERO or FREE one,
    never pushed) blocks the main thread until the page arrives; were END already sent, the
    request would come too late and both threads would wait for ever.  So the closing waits
    for the PONG, which the main thread sends after the last device (what follows RUN in a
    package is never read)."""
    devices = b"".join(d.to_bytes(state.footers) for d in state.devices)
    blob = (
        command_bytes(CMD_POSTCOPY_LISTEN)
        + devices
        + command_bytes(CMD_PING, BE32.pack(PING_DEVICES_LOADED))
        + command_bytes(CMD_POSTCOPY_RUN)
    )
    if len(blob) > MAX_PACKAGED:
        raise UnsupportedError(
            f"device state of {len(blob)} bytes exceeds QEMU's packaged limit of {MAX_PACKAGED}",
            structure="source_state[QEMU tag 1]",
        )
    return command_bytes(CMD_PACKAGED, BE32.pack(len(blob))) + blob


def closing(state: qemu.StreamState) -> bytes:
    return part_header_bytes(END, state.ram.section_id) + _section_end(state) + bytes([EOF])


def page_entries(name: str, page_size: int, first: int, pages: np.ndarray | None, count: int) -> bytes:
    """``count`` entries of block ``name`` from page ``first``: PAGE entries of ``pages``
    ((count, page_size) uint8), or ZERO entries when ``pages`` is None.  The first entry
    names the block, the others CONTINUE it."""
    flag = F_ZERO if pages is None else F_PAGE
    width = 9 if pages is None else 8 + page_size
    rows = np.zeros((count, width), np.uint8)
    words = (np.arange(first, first + count, dtype=np.uint64) * np.uint64(page_size)) | np.uint64(flag)
    words[1:] |= np.uint64(F_CONTINUE)
    rows[:, :8] = words.astype(">u8").view(np.uint8).reshape(count, 8)
    if pages is not None:
        rows[:, 8:] = pages
    head = rows[0].tobytes()
    return head[:8] + name_bytes(name) + head[8:] + rows[1:].tobytes()


# ---------------------------------------------------------------------------- the return path


class ReturnPath:
    """Parses the destination's messages from file descriptor ``fd`` as they arrive (the
    server's one loop reads it when select says it is readable) into events:
    ("req", block, start, length, monotonic time of arrival), ("shut", value), ("pong", value),
    ("eof",), ("bad", message)."""

    def __init__(self, fd: int):
        self.fd, self.buf, self.block, self.ended = fd, bytearray(), None, False

    def read(self) -> list:
        """The events the bytes readable now complete."""
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        except OSError as exc:
            self.ended = True
            return [("bad", f"return path: {exc.strerror or exc}"), ("eof",)]
        if not data:
            self.ended = True
            cut = []
            if len(self.buf) >= 4:
                name = RP_NAMES.get(BE16.unpack_from(self.buf)[0], BE16.unpack_from(self.buf)[0])
                cut = [("bad", f"return path ended inside a {name} message")]
            return cut + [("eof",)]
        self.buf += data
        return self._messages(time.monotonic())

    def _messages(self, arrival: float) -> list:
        events, at = [], 0
        while len(self.buf) - at >= 4:
            kind, length = BE16.unpack_from(self.buf, at)[0], BE16.unpack_from(self.buf, at + 2)[0]
            if len(self.buf) - at - 4 < length:
                break
            data = bytes(self.buf[at + 4 : at + 4 + length])
            at += 4 + length
            events += self._event(kind, data, arrival)
        del self.buf[:at]
        return events

    def _event(self, kind: int, data: bytes, arrival: float) -> list:
        if kind in (RP_REQ_PAGES_ID, RP_REQ_PAGES) and len(data) >= 12:
            start, size = BE64.unpack_from(data)[0], BE32.unpack_from(data, 8)[0]
            if kind == RP_REQ_PAGES_ID:
                self.block = data[13 : 13 + data[12]].decode(errors="replace") if len(data) > 12 else None
            return [("req", self.block, start, size, arrival)]
        if kind == RP_SHUT and len(data) == 4:
            return [("shut", BE32.unpack(data)[0])]
        if kind == RP_PONG and len(data) == 4:
            return [("pong", BE32.unpack(data)[0])]
        return [("bad", f"unexpected return-path message {RP_NAMES.get(kind, kind)} of {len(data)} bytes")]


@contextlib.contextmanager
def _nonblocking(fd: int):
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_NONBLOCK)
    try:
        yield
    finally:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags)


# ---------------------------------------------------------------------------- the server


@dataclass
class Block:
    """One RAM block served: its region, which pages need sending, which were sent."""

    index: int
    name: str
    region: object
    classes: np.ndarray
    blank: np.ndarray  # ZERO or FREE: never pushed
    sent: np.ndarray = field(init=False)  # written or queued to be written

    def __post_init__(self):
        self.sent = np.zeros(len(self.classes), bool)


@dataclass
class Chunk:
    """One whole section (or the closing) queued for the stream, with the pages it carries."""

    data: bytes
    block: int = -1
    pages: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    last: bool = False  # the closing: END and EOF


class PostcopyServer:
    """One thread, one loop: select on the return path and on the stream; requests are
    answered ahead of every queued push (only a section partly written goes first), and a
    requested page queued in a push moves that push to the front.  Pushes are read and
    verified PUSH_BATCH pages at a time and queued as sections of CHUNK_PAGES pages."""

    def __init__(
        self,
        image: LeanImage,
        out,
        inp,
        strategy: str = "sequential",
        log=None,
        progress=None,
        working_set: str | None = None,
        precopy_seconds: float = 0.0,
    ):
        self.image, self.out, self.inp = image, out, inp
        self.state = qemu.with_mapped_ram(stream_state(image), False)  # post-copy streams carry page entries
        self.ps = image.page_size
        if self.state.page_size != self.ps:
            raise UnsupportedError(
                f"stream target page size {self.state.page_size} differs from the image's page size {self.ps}"
            )
        self.blocks = [self._block(i, b) for i, b in enumerate(self.state.ram_blocks)]
        self.by_name = {b.name: b for b in self.blocks}
        self.stats = ServeStats(strategy)
        self.stats.pages_total = sum(len(b.classes) for b in self.blocks)
        self.stats.pages_to_send = sum(int((~b.blank).sum()) for b in self.blocks)
        self.strategy = make_strategy(strategy, image, self.blocks)
        self.log = log or (lambda msg: print(f"leanimg: {msg}", file=sys.stderr, flush=True))
        self.left = self.stats.pages_to_send
        self.progress = progress  # called with the number of pages that travel, as they are queued
        self.head: Chunk | None = None  # the section being written
        self.head_written = 0  # bytes of it written
        self.urgent: collections.deque[Chunk] = collections.deque()  # answers, pushes asked for
        self.queue: collections.deque[Chunk] = collections.deque()  # pushes
        self.fault_push = False  # the next push follows a fault: it goes first
        self.closing_queued = False
        self.devices_loaded = False  # the PONG to the package's PING came: END may go
        self.faults: list[tuple[int, int]] = []  # (block, page) of every page asked for, in order
        self.working_set = self._working_set(working_set) if working_set else []
        self.precopy_seconds = precopy_seconds
        self._decompress_ahead(image, self._working_set_frames())
        self.t0 = time.monotonic()
        self.stats.mark("server ready")

    @staticmethod
    def _decompress_ahead(image: LeanImage, first: list[int]) -> None:
        """Every frame decompresses once, on a worker thread, from the start when they all fit
        FRAME_CACHE_BYTES (a fault's frame not begun yet is decompressed by the fault itself),
        the frames ``first`` (the working set's) before the others; else the next ones as the
        pushes read them.  The worker runs at our priority: the pushes wait for the frame it is
        decompressing, so a lower one would hold them up under load."""
        frames = image.frames
        frames.keep_decompressed(FRAME_CACHE_BYTES)
        image.enable_read_ahead(threads=1, depth=2)
        stored_bytes = int(frames.page_frames.counts.sum()) * image.page_size
        if image.parent is None and stored_bytes <= FRAME_CACHE_BYTES:
            frames.jump_queue = True
            rest = np.ones(len(frames.page_frames), bool)  # (np.setdiff1d would import numpy.ma: ~8 ms)
            rest[first] = False
            frames.prefetch([*first, *np.flatnonzero(rest).tolist()], frames.pool, with_digests=True)

    def _block(self, index: int, block: qemu.RamBlock) -> Block:
        region = self.image.region(block.name)
        if region.size_bytes != block.length:
            raise LeanImageError(
                f"region {block.name!r} has {region.size_bytes} bytes, the stream state says {block.length}",
                structure=f"region[{region.region_id}]",
            )
        cls = self.image.classes(region)
        return Block(index, block.name, region, cls, (cls == PageClass.ZERO) | (cls == PageClass.FREE))

    def _working_set(self, path: str) -> list[tuple[Block, np.ndarray]]:
        """The first WORKING_SET_PAGES pages of the file that travel (ZERO and FREE dropped), in
        its order, each once."""
        listed = read_working_set(path, self.ps, {b.name: len(b.classes) for b in self.blocks})
        chosen, budget = [], WORKING_SET_PAGES
        seen = {b.index: np.zeros(len(b.classes), bool) for b in self.blocks}
        for name, pages in listed:
            block = self.by_name[name]
            _, first = np.unique(pages, return_index=True)
            pages = pages[np.sort(first)]
            pages = pages[~block.blank[pages] & ~seen[block.index][pages]][:budget]
            seen[block.index][pages] = True
            if len(pages):
                chosen.append((block, pages))
            budget -= len(pages)
        return chosen

    def _working_set_frames(self) -> list[int]:
        """The frames of the working set's STORED pages, in the order it first needs them."""
        ordinals = [
            self.image.page_slots(block.region, 0, len(block.classes))[pages[block.classes[pages] == PageClass.STORED]]
            for block, pages in self.working_set
        ]
        if not ordinals:
            return []
        frames = self.image.frames.page_frames.frame_of(np.concatenate(ordinals))
        _, first = np.unique(frames, return_index=True)
        return frames[np.sort(first)].tolist()

    def _precopy(self) -> None:
        """Pre-copy sections before LISTEN: the working set, then pages in the prepaging order
        until ``precopy_seconds`` after the server was ready.  QEMU writes them straight into
        guest memory (after the discard: no transparent huge page holds them), so the guest
        never faults on them, and places them more cheaply than post-copy pages."""
        for block, pages in self.working_set:
            self._precopy_pages(block, pages)
            self.stats.working_set_pages += len(pages)
        if self.working_set:
            self.stats.mark("working set sent")
        deadline = self.t0 + self.precopy_seconds
        while time.monotonic() < deadline and not self.strategy.exhausted:
            for block, pages in self._batch(self.strategy.next_runs(PUSH_BATCH)):
                self._precopy_pages(block, pages)
                self.stats.pushed_pages += len(pages)
                self.stats.pushed_before_run += len(pages)
        if self.stats.pushed_before_run:
            self.stats.mark("pre-copy sent")

    def _precopy_pages(self, block: Block, pages: np.ndarray) -> None:
        for chunk in self._sections(block, pages, self._read_pages(block, pages, queue_good=False)):
            self._write(chunk.data)
        block.sent[pages] = True
        self._account(len(pages))

    def record_faults(self, path: str) -> None:
        names = [b.name for b in self.blocks]
        write_working_set(path, self.ps, names, self.faults)
        self.stats.recorded_faults = len(set(self.faults))

    # --- reading pages ------------------------------------------------------------------

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
        block.sent[first : first + count] = True
        self._account(int((~blank).sum()))
        return b"".join(parts)

    def _account(self, travelled: int) -> None:
        if (self.left - 1) // TIMELINE_EVERY != (self.left - 1 - travelled) // TIMELINE_EVERY:
            self.stats.mark(f"{self.stats.pages_to_send - self.left + travelled} pages sent")
        self.left -= travelled
        if self.progress is not None:
            self.progress(travelled)

    def _read(self, block: Block, first: int, count: int) -> np.ndarray:
        """Pages verified by the reader; on a failure, the first page that fails is named
        (the error's ``page``)."""
        try:
            data = self.image.region_bytes(block.region, first, count)
        except LeanImageError as exc:
            page, cause = first, exc
            if count > 1:
                for page in range(first, first + count):
                    try:
                        self.image.region_bytes(block.region, page, 1)
                    except LeanImageError as one:
                        cause = one
                        break
            error = ServeError(
                f"stopped before sending block {block.name!r} page {page} "
                f"(offset {page * self.ps:#x}), nothing more sent: {cause}"
            )
            error.page = page
            raise error from None
        return np.frombuffer(data, np.uint8).reshape(count, self.ps)

    # --- serving ------------------------------------------------------------------------

    def serve(self) -> ServeStats:
        try:
            # a 1 MiB pipe (fileutil.widen_pipe; Linux's default 64 KiB holds 16 pages): the serve
            # and QEMU's listen thread hand it to each other far less often; an answer waits
            # behind at most that much of pushed pages (~2 ms at QEMU's rate of placing them)
            widen_pipe(self.out.fileno())
            self._write(opening(self.state, self.ps))
            self._precopy()
            self._write(package(self.state))
            self.out.flush()
            self.stats.mark("package sent")
            self.stats.seconds_to_run = time.monotonic() - self.t0
            total = s3.fetched_total()  # None: the image is not in a store
            self.stats.fetched_at_run = total and total[0]
            self._loop()
        except BrokenPipeError:
            self.stats.error = (
                f"the destination closed the migration stream after {self.stats.bytes_sent} bytes "
                "(its own error says why; is post-copy enabled on it: -global "
                "migration.x-postcopy-ram=on?)"
            )
            raise ServeError(self.stats.error) from None
        except ServeError as exc:
            self.stats.error = str(exc)
            self._drain()
            raise
        return self.stats

    def _write(self, blob: bytes) -> None:
        self.out.write(blob)
        self.stats.bytes_sent += len(blob)

    def _drain(self) -> None:
        """After a page failed: the sections queued before it still go (every page in them
        was verified); then nothing more."""
        try:
            if self.head is not None:
                self._write(self.head.data[self.head_written :])
            for chunk in [*self.urgent, *self.queue]:
                self._write(chunk.data)
            self.out.flush()
        except OSError:
            pass

    def _loop(self) -> None:
        out, rp = self.out.fileno(), ReturnPath(self.inp.fileno())
        with _nonblocking(out), _nonblocking(rp.fd):
            while True:
                pushing = self._queue_more()
                waiting = self.head is not None or self.urgent or self.queue
                readable, writable, _ = select.select(
                    [] if rp.ended else [rp.fd], [out] if waiting else [], [], 0 if pushing else None
                )
                if readable and self._answer(rp.read()):
                    return
                if writable:
                    self._write_head(out)

    def _queue_more(self) -> bool:
        """Queue the next push (or the closing) when the queue runs low; True when more
        pushes are to come without waiting for anything."""
        if self.closing_queued:
            return False
        if self.left == 0:  # nothing more to push; the closing once the devices loaded
            if self.devices_loaded:
                self.queue.append(Chunk(closing(self.state), last=True))
                self.closing_queued = True
            return False
        if self.strategy.exhausted:
            return False
        if self.fault_push:
            self.fault_push = False
            if len(self.queue) < MAX_QUEUED:
                self.queue.extendleft(reversed(self._push(queue=False)))
        elif len(self.queue) < LOW_WATER:
            self._push()
        return len(self.queue) < LOW_WATER and not self.strategy.exhausted

    def _write_head(self, out: int) -> None:
        """Write as much of the next section as the stream takes now: the one begun, else an
        answer, else a push."""
        if self.head is None:
            self.head, self.head_written = (self.urgent or self.queue).popleft(), 0
        try:
            n = os.write(out, memoryview(self.head.data)[self.head_written :])
        except BlockingIOError:
            return
        self.stats.bytes_sent += n
        self.head_written += n
        if self.head_written == len(self.head.data):
            if self.head.last:
                self.stats.completed = True
                self.stats.seconds_to_complete = time.monotonic() - self.t0
                self.stats.mark("last page sent")
            self.head = None

    def _answer(self, events: list) -> bool:
        """Serve the requests among ``events``; True when the destination has gone."""
        parts, arrivals, promoted = [], [], []
        gone = False
        for event in events:
            if event[0] == "req":
                if not self.stats.requests:
                    self.stats.mark("first request")
                parts.append(self._requested(*event[1:4], promoted))
                arrivals.append((event[4], event[1], event[2] // self.ps))
            elif event[0] == "pong":
                self.devices_loaded |= event[1] == PING_DEVICES_LOADED
                self.stats.mark("devices loaded")
            elif event[0] == "shut":
                self.stats.shut = event[1]
                self.stats.mark("shut received")
                gone = True
            elif event[0] == "eof":
                gone = True
            else:
                self.log(f"warning: {event[1]}")
        parts = [p for p in parts if p]
        if gone or self.stats.completed:
            return gone
        if parts:
            self.urgent.append(Chunk(self._section_bytes(parts)))
            self.fault_push = True  # the pages around a fault (bubble) come next
        self.urgent.extend(promoted)
        self._answered(arrivals)
        return False

    def _answered(self, arrivals: list[tuple[float, str, int]]) -> None:
        """Account for the time the requests (arrival, block, page) waited for their answer
        to be queued first."""
        now = time.monotonic()
        for arrival, block, page in arrivals:
            self.stats.demand_wait_total += now - arrival
            self.stats.demand_wait_max = max(self.stats.demand_wait_max, now - arrival)
            if len(self.stats.first_requests) < FIRST_REQUESTS:
                unix = time.time() - now
                self.stats.first_requests.append((unix + arrival, unix + now, block, page))

    def _requested(self, name: str, start: int, size: int, promoted: list[Chunk]) -> bytes:
        """Entries for the requested pages not sent yet; queued sections holding the others
        are moved to ``promoted``."""
        self.stats.requests += 1
        block = self.by_name.get(name)
        if block is None or start % self.ps or size % self.ps or start + size > len(block.sent) * self.ps:
            raise ServeError(
                f"the destination asked for {size} bytes at {start:#x} of block {name!r}, which the image does not have"
            )
        first, count = start // self.ps, size // self.ps
        if self.stats.completed:
            return b""
        self.strategy.fault(block, first)
        parts = []
        self.faults += [(block.index, page) for page in range(first, first + count)]
        for page in range(first, first + count):
            if block.sent[page]:
                self.stats.requests_already_sent += 1
                self._promote(block, page, promoted)
                continue
            self.stats.demand_pages += 1
            self.stats.demand_blank += int(block.blank[page])
            parts.append(self._entries(block, page, 1))
        return b"".join(parts)

    def _promote(self, block: Block, page: int, promoted: list[Chunk]) -> None:
        for i, chunk in enumerate(self.queue):
            if chunk.block == block.index and (chunk.pages == page).any():
                del self.queue[i]
                promoted.append(chunk)
                return

    # --- pushing ------------------------------------------------------------------------

    def _push(self, queue: bool = True) -> list[Chunk]:
        """The next PUSH_BATCH pages of the prepaging order as sections; queued last unless
        not ``queue``."""
        chunks = []
        for block, pages in self._batch(self.strategy.next_runs(PUSH_BATCH)):
            chunks += self._sections(block, pages, self._read_pages(block, pages))
            block.sent[pages] = True
            self.stats.pushed_pages += len(pages)
            self._account(len(pages))
        if queue:
            self.queue.extend(chunks)
        return chunks

    def _batch(self, runs: list) -> list[tuple[Block, np.ndarray]]:
        """The runs' pages, per block in their order."""
        batch: list = []
        for block, first, count in runs:
            pages = np.arange(first, first + count, dtype=np.int64)
            if batch and batch[-1][0] is block:
                batch[-1][1].append(pages)
            else:
                batch.append((block, [pages]))
        return [(block, np.concatenate(parts)) for block, parts in batch]

    def _read_pages(self, block: Block, pages: np.ndarray, queue_good: bool = True) -> np.ndarray:
        """``pages`` (len, page size), read and verified in as few reads as the gaps between
        them allow (a gap of at most MERGE_GAP pages is read along and dropped)."""
        try:
            first = int(pages[0])
            if int(pages[-1]) - first + 1 == len(pages) and (np.diff(pages) == 1).all():
                return self._read(block, first, len(pages))  # one run: no copy
            return self._read_spans(block, pages)
        except ServeError as exc:
            if queue_good:
                self._queue_before_failure(block, pages, exc.page)
            raise

    def _read_spans(self, block: Block, pages: np.ndarray) -> np.ndarray:
        order = np.argsort(pages, kind="stable")
        ascending = pages[order]
        out = np.empty((len(pages), self.ps), np.uint8)
        breaks = np.flatnonzero(np.diff(ascending) > MERGE_GAP) + 1
        bounds = [0, *breaks.tolist(), len(pages)]
        for lo, hi in zip(bounds, bounds[1:]):
            first, last = int(ascending[lo]), int(ascending[hi - 1])
            span = self._read(block, first, last - first + 1)
            out[order[lo:hi]] = span[ascending[lo:hi] - first]
        return out

    def _queue_before_failure(self, block: Block, pages: np.ndarray, failed: int) -> None:
        """Queue the pages of this push before the one that failed, in order (read again, each
        verified), so that the destination has every good page up to the failure."""
        good = pages[: int(np.argmax(pages == failed))] if (pages == failed).any() else pages[pages < failed]
        for page in good.tolist():
            if not block.sent[page]:
                data = self._read(block, page, 1)
                self.queue.extend(self._sections(block, np.array([page]), data))
                block.sent[page] = True

    def _sections(self, block: Block, pages: np.ndarray, data: np.ndarray) -> list[Chunk]:
        """PART sections of CHUNK_PAGES entries each; every section names its block first
        (another section may come between two of them)."""
        count = len(pages)
        rows = np.empty((count, 8 + self.ps), np.uint8)
        words = (pages.astype(np.uint64) * np.uint64(self.ps)) | np.uint64(F_PAGE | F_CONTINUE)
        rows[:, :8] = words.astype(">u8").view(np.uint8).reshape(count, 8)
        rows[:, 8:] = data
        name = name_bytes(block.name)
        chunks = []
        for lo in range(0, count, CHUNK_PAGES):
            hi = min(count, lo + CHUNK_PAGES)
            head = BE64.pack(int(pages[lo]) * self.ps | F_PAGE) + name
            body = [head, memoryview(rows[lo, 8:]), memoryview(rows[lo + 1 : hi].reshape(-1))]  # joined once
            chunks.append(Chunk(self._section_bytes(body), block.index, pages[lo:hi]))
        return chunks

    def _section_bytes(self, parts: list[bytes]) -> bytes:
        sid = self.state.ram.section_id
        return b"".join([part_header_bytes(PART, sid), *parts, _section_end(self.state)])


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


def serve_postcopy(
    image: LeanImage,
    out,
    inp,
    strategy: str = "sequential",
    stats_path: str | None = None,
    log=None,
    progress=None,
    working_set: str | None = None,
    record_faults: str | None = None,
    precopy_seconds: float = 0.0,
) -> ServeStats:
    """Serve ``image`` on the binary file ``out`` (the stream) with the return path on ``inp``;
    report the counts on stderr (and as JSON in ``stats_path``).  ``working_set``: a file of
    pages sent before the guest runs; ``record_faults``: where to write the pages asked for;
    ``precopy_seconds``: how long to send pages in the prepaging order before the guest runs."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown prepaging strategy {strategy!r}")
    check_userfaultfd()
    started = _process_start()
    server = PostcopyServer(image, out, inp, strategy, log, progress, working_set, precopy_seconds)
    if started is not None:
        server.stats.timeline.insert(0, ("process start", started))
    try:
        return server.serve()
    finally:
        if record_faults:
            server.record_faults(record_faults)
        server.stats.fetched = s3.take_fetched()
        server.log(server.stats.summary())
        if stats_path:
            text = json.dumps(asdict(server.stats), indent=2).encode()
            write_atomically(stats_path, lambda f: f.write(text))
