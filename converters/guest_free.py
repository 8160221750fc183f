"""Guest FREE hints for ``leanimg checkpoint --live --guest-free SOCKET`` (spec/hints.md §3.1).

The guest runs ``guest/leanimg-guest-free`` on a virtio-serial port named ``org.leanimg.free.0``;
QEMU connects that port to a unix socket (a ``-chardev socket,...,server=on`` chardev) and
leanimg connects to it. While the precopy runs, ``GuestFreeLink`` asks the guest for its free
pages again and again: it first reads the stream offset P (the bytes of the migration stream
leanimg has received), then sends ``free NONCE``, and keeps the latest complete answer with its
P. leanimg stops asking once the migration has completed: the guest is stopped then and stays
stopped until leanimg resumes it, after ``finish``. So every answer kept was taken after its P
and before the checkpoint instant — what the stream-offset rule (LI-HNT-023) needs; the
converter then makes FREE only the pages whose last copy ended at or before P.

The socket is closed only once the guest runs again (``close`` after the resume). QEMU 7.2's
virtserialport takes its chardev's handlers away while the VM is stopped, so a client that
hangs up then goes unnoticed: the port still counts as connected, the next thing the guest
writes fails on the empty chardev and throttles the port, and the port stays throttled —
every later answer held in the guest's queue — until QEMU sees a client hang up while the VM
runs. A request that hears nothing back therefore asks again over a *new* connection, which
unsticks a port left that way by anyone.

Only the latest answer is kept: a page free in an earlier one and not in the latest was taken
into use in between, and would almost always have been written and re-sent anyway.
"""

from __future__ import annotations

import dataclasses
import io
import secrets
import socket
import threading
import time

import numpy as np

from leanimg.errors import CheckpointError
from leanimg.hints import AddressMap, FreeSource, HintWriter

PORT_NAME = "org.leanimg.free.0"
MAX_RANGES = 1 << 20  # per answer (the helper reports no more)
MAX_SKIPPED = 1 << 26  # bytes of stale output skipped before an answer begins
MAX_LINE = 256  # bytes of any line but a range line
RANGE_LINE = 34  # "%016x %016x\n"
REQUEST_INTERVAL = 0.2  # seconds from one answer to the next request
PAGE_SIZES = {1 << k for k in range(12, 17)}
POLL = 0.1  # seconds a read waits before looking at the stop flag
REASK_AFTER = 2.0  # seconds without a byte back before a request is made again


class GuestFreeError(CheckpointError):
    """The guest's free-list helper broke the protocol, or said it cannot answer."""


@dataclasses.dataclass
class Snapshot:
    """One answer: the guest's free pages as (first pfn, pages) rows, asked at ``stream_offset``."""

    stream_offset: int
    page_size: int
    ranges: np.ndarray  # (n, 2) uint64
    helper_us: int  # how long the guest took to read its page flags
    received_at: float  # time.monotonic()

    @property
    def pages(self) -> int:
        return int(self.ranges[:, 1].sum()) if len(self.ranges) else 0


class Answer:
    """Parses one answer to ``free NONCE`` as its bytes arrive (``feed``); ``snapshot`` once
    its end line has come. Lines before ``begin NONCE`` (the tail of an answer to an earlier
    request that nobody read) are skipped, up to MAX_SKIPPED bytes."""

    def __init__(self, nonce: str):
        self.nonce = nonce
        self.begun = False
        self.page_size = 0
        self.body = bytearray()  # the range lines, as sent
        self.pending = bytearray()  # bytes not yet a whole line
        self.skipped = 0
        self.line_no = 0
        self.end: tuple[int, int, int] | None = None

    @property
    def complete(self) -> bool:
        return self.end is not None

    def feed(self, data: bytes) -> bytes:
        """Take ``data``; return what follows the end line (empty unless the guest sent more)."""
        self.pending += data
        while not self.complete:
            cut = self.pending.find(b"\n")
            if cut < 0:
                self._check_pending()
                return b""
            line = bytes(self.pending[: cut + 1])
            del self.pending[: cut + 1]
            self.line_no += 1
            self._line(line)
        rest, self.pending = bytes(self.pending), bytearray()
        return rest

    def _check_pending(self) -> None:
        if self.begun and len(self.pending) > MAX_LINE:
            raise self._error(f"a line longer than {MAX_LINE} bytes")
        if not self.begun and self.skipped + len(self.pending) > MAX_SKIPPED:
            raise self._error(f"no 'begin {self.nonce}' line in the first {MAX_SKIPPED} bytes")

    def _line(self, line: bytes) -> None:
        if not self.begun:
            self._before_begin(line)
        elif len(line) == RANGE_LINE and line[16:17] == b" ":
            if len(self.body) // RANGE_LINE >= MAX_RANGES:
                raise self._error(f"more than {MAX_RANGES} ranges")
            self.body += line
        elif line.startswith(b"end "):
            self._end(line)
        else:
            raise self._error(f"expected a range line ('%016x %016x') or 'end', got {_show(line)}")

    def _before_begin(self, line: bytes) -> None:
        words = line.split()
        if len(words) >= 2 and words[0] in (b"begin", b"error") and words[1] == self.nonce.encode():
            if words[0] == b"error":
                raise self._error("the guest cannot answer: " + b" ".join(words[2:]).decode(errors="replace"))
            if len(words) != 3 or not words[2].isdigit():
                raise self._error(f"expected 'begin {self.nonce} PAGE_SIZE', got {_show(line)}")
            self.page_size, self.begun = int(words[2]), True
            if self.page_size not in PAGE_SIZES:
                raise self._error(f"page size {self.page_size}: not a power of two 4096-65536")
            return
        self.skipped += len(line)
        if self.skipped > MAX_SKIPPED:
            raise self._error(f"no 'begin {self.nonce}' line in the first {MAX_SKIPPED} bytes")

    def _end(self, line: bytes) -> None:
        words = line.split()
        if len(words) != 5 or words[1] != self.nonce.encode() or not all(w.isdigit() for w in words[2:]):
            raise self._error(f"expected 'end {self.nonce} RANGES PAGES MICROSECONDS', got {_show(line)}")
        ranges = self._ranges()
        count, pages, micros = (int(w) for w in words[2:])
        if count != len(ranges) or pages != int(ranges[:, 1].sum() if len(ranges) else 0):
            raise self._error(
                f"the end line says {count} ranges of {pages} pages; the answer has "
                f"{len(ranges)} ranges of {int(ranges[:, 1].sum()) if len(ranges) else 0} pages"
            )
        self.end = (count, pages, micros)
        self.ranges = ranges

    def _ranges(self) -> np.ndarray:
        rows = np.frombuffer(bytes(self.body), np.uint8).reshape(-1, RANGE_LINE)
        if not len(rows):
            return np.zeros((0, 2), np.uint64)
        digits = np.concatenate([rows[:, :16], rows[:, 17:33]], axis=1).tobytes().decode("ascii", "replace")
        try:
            ranges = np.frombuffer(bytes.fromhex(digits), ">u8").astype(np.uint64).reshape(-1, 2)
        except ValueError:
            raise self._error("a range line is not two 16-digit hex numbers") from None
        first, count = ranges[:, 0], ranges[:, 1]
        if (count == 0).any():
            raise self._error(f"range {int(np.argmax(count == 0))}: zero pages")
        if (first >= (1 << 52)).any() or (count >= (1 << 52)).any():
            raise self._error("a range beyond 2^52 page frames")
        overlap = first[1:] < first[:-1] + count[:-1]
        if overlap.any():
            raise self._error(f"range {int(np.argmax(overlap)) + 1}: not ascending and disjoint")
        return ranges

    def _error(self, why: str) -> GuestFreeError:
        return GuestFreeError(
            f"the guest's free-list answer, line {self.line_no}: {why}", structure="guest free-list protocol"
        )


def _show(line: bytes) -> str:
    return repr(line[:60].decode("ascii", "replace"))


class GuestFreeLink:
    """The connection to the guest's helper; asks in a thread while the precopy runs.

    ``offset`` returns the bytes of the migration stream received so far (P)."""

    def __init__(self, path: str, offset, interval: float = REQUEST_INTERVAL, reask_after: float = REASK_AFTER):
        self.path, self.offset, self.interval, self.reask_after = path, offset, interval, reask_after
        self.latest: Snapshot | None = None
        self.asked = self.answered = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._rest = b""
        self._thread = threading.Thread(target=self._run, name="leanimg-guest-free", daemon=True)
        self.sock = _connect(path)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                snapshot = self._ask()
                if snapshot is not None:
                    self.latest = snapshot
                    self.answered += 1
                    self._stop.wait(self.interval)
        except BaseException as exc:  # handed to the main thread by finish()
            self.error = exc

    def _ask(self) -> Snapshot | None:
        nonce = secrets.token_hex(8)
        offset = self.offset()  # before the request: never later than the guest's look
        self.sock.sendall(f"free {nonce}\n".encode())
        self.asked += 1
        answer, data = Answer(nonce), self._rest
        heard = time.monotonic()
        while not self._stop.is_set():
            if data:
                heard = time.monotonic()
                self._rest = answer.feed(data)
                if answer.complete:
                    return Snapshot(offset, answer.page_size, answer.ranges, answer.end[2], time.monotonic())
            if not answer.begun and time.monotonic() - heard > self.reask_after:
                # nothing back: the port may be stuck (module docstring); ask again, over a new
                # connection, with a new nonce
                self._reconnect()
                return None
            try:
                data = self.sock.recv(1 << 20)
            except socket.timeout:
                data = b""
                continue
            if not data:
                raise GuestFreeError(f"--guest-free {self.path}: QEMU closed the port's socket")
        return None  # stopped mid-answer: dropped

    def finish(self) -> Snapshot | None:
        """Stop asking (call it while the guest is still stopped after the checkpoint instant);
        the latest complete answer, or None. ``close`` the link once the guest runs again."""
        self._stop_asking()
        if self.error is not None:
            raise self.error
        return self.latest

    def close(self) -> None:
        """Hang up; QEMU notices only while the VM runs (module docstring)."""
        self._stop_asking()
        try:
            self.sock.close()
        except OSError:
            pass

    def _stop_asking(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _reconnect(self) -> None:
        self.sock.close()
        self._rest = b""
        self.sock = _connect(self.path)


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError as exc:
        sock.close()
        raise CheckpointError(
            f"--guest-free {path}: cannot connect ({exc.strerror or exc}); give QEMU "
            f"-device virtio-serial-pci -chardev socket,id=lf,path={path},server=on,wait=off "
            f"-device virtserialport,chardev=lf,name={PORT_NAME} and run leanimg-guest-free "
            "in the guest"
        ) from None
    sock.settimeout(POLL)
    return sock


def free_hints(snapshot: Snapshot) -> bytes:
    """The snapshot as hints (spec/hints.md): one FREE set, guest-physical in QEMU's pc map."""
    out = io.BytesIO()
    with HintWriter(out, page_size=snapshot.page_size, address_map=AddressMap.QEMU_PC) as writer:
        rows = snapshot.ranges.copy()
        rows[:, 0] *= np.uint64(snapshot.page_size)
        if len(rows):
            writer.free(rows, stream_offset=snapshot.stream_offset, source=FreeSource.GUEST)
    return out.getvalue()
