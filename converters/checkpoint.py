"""`leanimg checkpoint`: a running QEMU 7.2, over QMP, straight into a lean image.

No save file is written. leanimg makes a socketpair, hands one end to QEMU over the QMP unix
socket (SCM_RIGHTS, QMP ``getfd``) and starts ``migrate uri=fd:NAME``. ``--live``: a thread
reads the other end into the RAM spool of ``qemu.load_stream`` (deleted, sparse scratch files
holding at most the guest's RAM: live streams resend pages and the last copy wins; never a save
file); when the migration has completed, the image is written from the spool with
``convert.write_spooled``. ``stop`` and ``--background`` need no spool (every page comes once):
``cat`` copies the other end into a scratch file at QEMU's pace (``_Followed``) and ``_Direct``
feeds the writer from it while the stream flows, so the page work (disk lookups included)
overlaps the migration and the guest's pause does not wait for it.

Modes (the checkpoint instant in brackets):

* ``stop`` (default): ``stop``, migrate, then ``--then`` [the stop];
* ``live``: precopy while the guest runs [the migration's final pause];
* ``background``: QEMU's ``background-snapshot`` capability: every page sent once as of the
  instant QEMU write-protects guest RAM, the guest running meanwhile [that instant].

Disks (``--disk NAME=PATH``, PATH one of the guest's own files): DISK references must point at
bytes that never change. If the guest runs on after the checkpoint (``--then continue``), each
disk is frozen at the checkpoint instant with ``blockdev-snapshot-sync`` to a new qcow2
overlay beside it: the guest writes to the overlay from then on and PATH, now QEMU's read-only
backing file, holds the referenced blocks. The instant: ``stop`` mode, after the migration
while still stopped; ``live``, in the ``pre-switchover`` pause (capability
``pause-before-switchover``, then ``migrate-continue``); ``background`` (which QEMU allows with no
pause capability), stopped by leanimg just before ``migrate``, QEMU itself resuming the guest
once RAM is write-protected. The disk's size and fingerprint are taken while the guest is
stopped (``stop``: the stream's first bytes come after the stop) or after the freeze.

The image gets a second SOURCE_STATE record (QEMU, tag 2: ``checkpoint note``, UTF-8 JSON):
mode, downtime, and for every disk the file that holds its referenced blocks and the overlay.

Failures (the monitor unreachable or not QMP, a QMP error, a failed or cancelled migration, a
writer error, SIGINT/SIGTERM) cancel the migration, shut the socket, restore the run state the
guest had (``cont`` if it ran) and the migration capabilities and parameters leanimg changed,
and leave no output file; a block snapshot already taken stays, and the error says where.
A background snapshot is run to its end instead of cancelled (``_finish_background``: QEMU 7.2
leaves a cancelled one's guest RAM write-protected and the guest hangs) — which also means a
``migrate_cancel`` sent by someone else during ``--background`` hangs the guest.

``--balloon-inflate`` (Liu, Jin, Liao, *Optimize Performance of Virtual Machine Checkpointing
via Memory Exclusion*): the balloon is inflated before, deflated after (and after a
failure); the note records its size before, which a restored guest's balloon is deflated to.

``--guest-free SOCKET`` (``--live`` only; spec/hints.md §3.1): while the precopy runs,
``converters.guest_free.GuestFreeLink`` asks the guest's free-list helper for its free pages,
each request at a stream offset P read just before it; the latest answer complete before the
migration has completed (the guest is stopped from the checkpoint instant until leanimg
resumes it, after the link is finished) becomes a FREE hint at P, which ``write_spooled``
applies by the stream-offset rule (the spool records where each page's last copy ended).
Stop mode and ``--background`` refuse it: in both a page the guest writes after its answer is
never sent again, so no offset rule can protect it (spec/hints.md §3.1).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

from leanimg.errors import CheckpointError, CheckpointInterrupted, LeanImageError
from leanimg.fileutil import commit_temporary, create_temporary, punch_hole
from leanimg.locations import Output
from leanimg.format import SourceFormat
from leanimg.rules import implements
from leanimg.writer import LeanImageWriter

from . import qemu
from .convert import DiskOptions, RepeatedPages, convert_qemu, lend_disks, write_spooled
from .diskrefs import BlockIndex, declare_disks
from .guest_free import GuestFreeLink, Snapshot, free_hints
from .hinting import HintOptions

MODES = ("stop", "live", "background")
ONCE_MODES = ("stop", "background")  # QEMU sends every page once: no spool needed without disks
Q35_ALL_LOW = 0xB0000000  # q35 keeps all RAM below 4 GiB when it is smaller (QEMU 7.2 pc_q35.c)
THEN = ("continue", "stop", "quit")
QEMU_TAG_CHECKPOINT_NOTE = 2
CONNECT_TIMEOUT = 10.0  # to connect and read QMP's greeting
COMMAND_TIMEOUT = 60.0  # for one QMP command's reply
CANCEL_TIMEOUT = 60.0  # for a cancelled migration to end
# The QEMU versions whose migration streams converters/qemu.py reads (7.2's format, plus
# SWITCHOVER_START from 10.0 and mapped-ram from 9.0; the same up to 11.0): (major, minor)
SUPPORTED_QEMU = ((7, 2), (11, 99))
ACTIVE = {
    "setup",
    "active",
    "pre-switchover",
    "device",
    "cancelling",
    "wait-unplug",
    "postcopy-active",
    "postcopy-paused",
    "postcopy-recover",
    "colo",
}
UNLIMITED_BANDWIDTH = 1 << 40  # bytes/s: "as fast as the writer reads"
BALLOON_SETTLE = 5.0  # --balloon-inflate: seconds without progress that end the wait
SWITCH_INTERVAL = 0.0005  # seconds: the GIL's switch interval while a checkpoint runs


@dataclasses.dataclass
class CheckpointRequest:
    qmp: str  # path of QEMU's QMP unix socket
    output: str
    mode: str = "stop"
    then: str = "continue"
    disks: dict = dataclasses.field(default_factory=dict)  # name -> path
    parents: tuple = ()
    allow_delta: bool = True
    writer_options: dict = dataclasses.field(default_factory=dict)
    max_bandwidth: int | None = None  # bytes/s; None: unlimited
    keep_stream: str | None = None  # also copy QEMU's raw stream there (debugging, tests)
    hints: object = None  # a hint file's HintOptions: not taken yet (refused)
    guest_free: str | None = None  # --guest-free: the socket of the guest's free-list port
    keep_hints: str | None = None  # also write the guest FREE hints there (debugging, tests)
    balloon_inflate: int = 0  # bytes to inflate the balloon by first (Liu, Jin, Liao)
    progress: bool = False  # a status line on stderr
    workdir: str | None = None  # where the RAM spool lives (default: $TMPDIR)


@dataclasses.dataclass
class FrozenDisk:
    name: str
    path: str  # the file holding the referenced blocks
    device: dict  # how QMP names it: {"device": ...} or {"node-name": ...}
    writable: bool  # the guest writes this file (its active layer)
    overlay: str | None = None  # where the guest writes since the freeze
    referenced: int = 0  # bytes of DISK pages referring to it

    def note(self) -> dict:
        return {
            "name": self.name,
            "file": self.path,
            "frozen": self.overlay is not None or not self.writable,
            "overlay": self.overlay,
        }

    def describe(self) -> str:
        if self.overlay:
            state = f"frozen; the guest now writes to {self.overlay}"
        elif not self.writable:
            state = "a read-only file of the guest's disk"
        else:
            state = "not frozen: the guest is not running on; resuming it changes this file"
        return f"disk {self.name}: {self.referenced / 2**20:.1f} MiB referenced in {self.path} ({state})"


@dataclasses.dataclass
class Balloon:
    """``--balloon-inflate``: the guest's balloon before, the target asked and the size reached."""

    before: int  # query-balloon "actual", bytes of guest RAM
    target: int
    reached: int = 0
    deflated: bool = False

    def note(self) -> dict:
        return {"before_bytes": self.before, "target_bytes": self.target, "reached_bytes": self.reached}

    def describe(self) -> str:
        inflated = (self.before - self.reached) / 2**20
        after = "deflated again" if self.deflated else "still inflated"
        return (
            f"balloon inflated by {inflated:.0f} MiB for the checkpoint ({after}); a guest restored from "
            f"the image has it inflated: deflate it with QMP balloon value={self.before}"
        )


@dataclasses.dataclass
class GuestFree:
    """``--guest-free``: what the guest said and what the stream-offset rule made of it."""

    asked: int
    answered: int
    snapshot: Snapshot | None
    stream_length: int = 0
    report: dict | None = None  # HintOptions.report["FREE"]

    def note(self) -> dict:
        s = self.snapshot
        return {
            "asked": self.asked,
            "answered": self.answered,
            "stream_offset": s.stream_offset if s else None,
            "stream_length": self.stream_length,
            "pages_reported": s.pages if s else 0,
            "helper_us": s.helper_us if s else None,
            "applied": self.applied,
        }

    @property
    def applied(self) -> int:
        return (self.report or {}).get("applied", 0)

    def describe(self) -> str:
        if self.snapshot is None:
            return (
                f"guest free hints: none (asked {self.asked} times, no answer complete before the checkpoint instant)"
            )
        s, report = self.snapshot, self.report or {}
        defeated = report.get("ignored: defeated by a later copy", 0)
        where = s.stream_offset / self.stream_length if self.stream_length else 0
        return (
            f"guest free hints: {s.pages * s.page_size / 2**20:.1f} MiB free in the guest's latest answer "
            f"(answer {self.answered} of {self.asked}, asked at {where:.0%} of the stream), "
            f"{self.applied * s.page_size / 2**20:.1f} MiB made FREE, "
            f"{defeated * s.page_size / 2**20:.1f} MiB sent again after it"
        )


@dataclasses.dataclass
class CheckpointResult:
    output: str
    mode: str
    then: str
    file_bytes: int
    page_size: int
    classes: Counter
    downtime_ms: int | None  # query-migrate's "downtime"
    paused_ms: float | None  # from leanimg's own stop to the guest running again
    seconds: float
    disks: list
    guest: str  # the guest's run state at the end
    balloon: Balloon | None = None
    guest_free: GuestFree | None = None
    timeline: list = dataclasses.field(default_factory=list)  # (step, seconds since the start)

    def summary(self) -> str:
        mib = lambda pages: pages * self.page_size / 2**20  # noqa: E731
        classes = ", ".join(f"{cls.name} {mib(n):.1f}" for cls, n in sorted(self.classes.items()) if n)
        timing = f"downtime {self.downtime_ms} ms" if self.downtime_ms is not None else "downtime unknown"
        if self.paused_ms is not None:
            timing += f", guest paused {self.paused_ms:.0f} ms"
        line = (
            f"{self.output}: {self.file_bytes / 2**20:.1f} MiB, {self.mode} checkpoint in "
            f"{self.seconds:.1f} s, {timing}; MiB by class: {classes}; guest {self.guest}"
        )
        extra = [self.balloon.describe()] if self.balloon else []
        extra += [self.guest_free.describe()] if self.guest_free else []
        return "; ".join([line] + [d.describe() for d in self.disks] + extra)

    def to_json(self) -> dict:
        """``checkpoint --json`` (schemas/checkpoint.schema.json)."""
        classes = {cls.name: int(n) for cls, n in sorted(self.classes.items()) if n}
        return dict(
            output=self.output,
            mode=self.mode,
            then=self.then,
            file_bytes=self.file_bytes,
            page_size=self.page_size,
            classes=classes,
            downtime_ms=self.downtime_ms,
            paused_ms=self.paused_ms,
            seconds=self.seconds,
            guest=self.guest,
            disks=[dict(d.note(), referenced_bytes=d.referenced) for d in self.disks],
            balloon=dict(self.balloon.note(), deflated=self.balloon.deflated) if self.balloon else None,
            guest_free=self.guest_free.note() if self.guest_free else None,
            timeline=[dict(step=step, seconds=round(at, 4)) for step, at in self.timeline],
        )

    def timeline_lines(self) -> list[str]:
        """-v: when each step ended, and how long it took."""
        lines, before = [], 0.0
        for step, at in self.timeline:
            lines.append(f"{at:8.3f} s  (+{at - before:.3f})  {step}")
            before = at
        return lines


# ------------------------------------------------------------------------------ QMP


class Monitor:
    """A synchronous QMP client (qemu.qmp's QMPClient on a private event loop), every wait
    bounded; failures become CheckpointError."""

    def __init__(self, path: str, timeout: float = CONNECT_TIMEOUT):
        from qemu.qmp import QMPClient

        self.path = path
        self._loop = asyncio.new_event_loop()
        self._client = QMPClient("leanimg-checkpoint")
        if not os.path.exists(path):
            self._loop.close()
            raise CheckpointError(
                f"QMP socket {path} does not exist (start QEMU with -qmp unix:{path},server=on,wait=off)"
            )
        try:
            self._run(self._client.connect(path), timeout)
        except asyncio.TimeoutError:
            self.close()
            raise CheckpointError(
                f"{path}: no QMP greeting within {timeout:.0f} s (not a QMP socket, or "
                "another client holds it: QEMU serves one client per -qmp socket)"
            ) from None
        except Exception as exc:  # qemu.qmp's ConnectError wraps the OSError or the bad greeting
            self.close()
            raise CheckpointError(f"{path}: cannot speak QMP: {_cause(exc)}") from None

    def _run(self, coroutine, timeout: float):
        return self._loop.run_until_complete(asyncio.wait_for(coroutine, timeout))

    def execute(self, command: str, timeout: float = COMMAND_TIMEOUT, **arguments):
        from qemu.qmp import ExecuteError

        try:
            return self._run(self._client.execute(command, arguments or None), timeout)
        except ExecuteError as exc:
            raise CheckpointError(f"QMP {command}: {exc.error.error.desc}") from None
        except asyncio.TimeoutError:
            raise CheckpointError(f"QMP {command}: no reply within {timeout:.0f} s") from None
        except Exception as exc:
            raise CheckpointError(f"QMP {command}: {_cause(exc)}") from None

    def send_fd(self, fd: int, name: str) -> None:
        """Pass ``fd`` to QEMU as ``name`` (SCM_RIGHTS, then ``getfd``)."""
        try:
            self._client.send_fd_scm(fd)
        except Exception as exc:
            raise CheckpointError(f"cannot pass a file descriptor over {self.path}: {_cause(exc)}") from None
        self.execute("getfd", fdname=name)

    def close(self) -> None:
        try:
            self._run(self._client.disconnect(), 10)
        except Exception:  # closing after a failure: nothing more to report
            pass
        self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _cause(exc: BaseException) -> str:
    """The reason qemu.qmp gives, on one line."""
    inner = getattr(exc, "exc", None) or exc.__cause__ or exc
    text = str(inner) or type(inner).__name__
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


# ------------------------------------------------------------------------------ signals


class _Signals:
    """SIGINT and SIGTERM set a flag the checkpoint looks at between steps, so it can cancel
    the migration and resume the guest before it exits."""

    def __init__(self):
        self.received = None
        self._saved = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._saved[signum] = signal.signal(signum, self._note)
        return self

    def _note(self, signum, frame):
        self.received = signum

    def check(self) -> None:
        if self.received is not None:
            name = signal.Signals(self.received).name
            raise CheckpointInterrupted(f"interrupted by {name}", self.received)

    def __exit__(self, *exc):
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)


# ------------------------------------------------------------------------------ the stream


class _SocketReader(io.RawIOBase):
    """Our end of the socketpair; counts bytes and copies them to ``keep`` when asked."""

    def __init__(self, sock: socket.socket, keep: str | None):
        self.sock, self.received = sock, 0
        self.keep = open(keep, "wb") if keep else None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self.sock.recv_into(buffer)
        self.received += n
        if self.keep is not None and n:
            self.keep.write(memoryview(buffer)[:n])
        return n

    def close(self) -> None:
        if self.keep is not None:
            self.keep.close()
        super().close()


class _Spool(threading.Thread):
    """Reads the migration stream into qemu.load_stream's RAM spool."""

    def __init__(self, sock: socket.socket, keep: str | None, workdir: str | None):
        super().__init__(name=f"leanimg-checkpoint-{type(self).__name__.strip('_').lower()}", daemon=True)
        self.sock, self.workdir = sock, workdir
        self.reader = self._reader(sock, keep, workdir)
        self.state = self.ram = self.error = None
        self.parsed = threading.Event()  # the whole stream has been read

    def _reader(self, sock: socket.socket, keep: str | None, workdir: str | None) -> io.RawIOBase:
        return _SocketReader(sock, keep)

    def run(self) -> None:
        try:
            with io.BufferedReader(self.reader, 1 << 20) as stream:
                self.state, self.ram = self._consume(stream)
        except BaseException as exc:  # handed to the main thread
            self.error = exc
            self._drain()
        finally:
            self.sock.close()

    def _consume(self, stream):
        state, ram = qemu.load_stream(stream, self.workdir)
        self.parsed.set()
        return state, ram

    def abandon(self) -> None:
        """The checkpoint failed: whatever waits for the main thread stops waiting."""

    def _drain(self) -> None:
        """Read on until the stream ends or is shut: QEMU 7.2 must be able to finish a background
        snapshot (see _Checkpoint._finish_background)."""
        buffer = bytearray(1 << 20)
        try:
            while self.sock.recv_into(buffer):
                pass
        except OSError:
            pass

    def shut(self) -> None:
        """Make a blocked read return: QEMU's writes then fail too."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def result(self) -> tuple[qemu.StreamState, qemu.RamImage]:
        if isinstance(self.error, LeanImageError):
            raise CheckpointError(f"the migration stream: {self.error}") from None
        if self.error is not None:
            raise self.error
        return self.state, self.ram


class _Followed(io.RawIOBase):
    """The stream as ``cat`` copies it from our end of the socketpair into a scratch file (or
    the --keep-stream file), read behind it: a read past what is written waits until more is,
    or cat has exited (the stream's end). QEMU so writes as fast as into its own ``exec:cat``
    whatever the reader does, and the guest's pause does not wait for the page work. Read parts
    of a scratch file are punched out, so the page cache does not write them back."""

    WAIT = 0.002  # seconds between looks at a file that has not grown
    PUNCH = 64 << 20  # bytes read between punches

    def __init__(self, sock: socket.socket, keep: str | None, workdir: str | None):
        self.file = open(keep, "w+b") if keep else tempfile.TemporaryFile(prefix="leanimg-stream-", dir=workdir)
        try:
            self.cat = subprocess.Popen(["cat"], stdin=sock.fileno(), stdout=self.file.fileno(), stderr=subprocess.PIPE)
        except BaseException:
            self.file.close()
            raise
        self.pos = self.punched = 0
        self.punching = keep is None
        self.cut = False

    @property
    def received(self) -> int:
        return os.fstat(self.file.fileno()).st_size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while True:
            ended = self.cat.poll() is not None  # before the read: what cat wrote is then all there
            n = os.preadv(self.file.fileno(), [buffer], self.pos)
            if n:
                self.pos += n
                self._punch()
                return n
            if ended or self.cut:
                self._check_cat()
                return 0
            time.sleep(self.WAIT)

    def _check_cat(self) -> None:
        if self.cut:
            raise CheckpointError("the stream was cut")
        status = self.cat.wait()
        if status != 0:
            why = self.cat.stderr.read().decode(errors="replace").strip() if self.cat.stderr else ""
            raise CheckpointError(f"copying the migration stream (cat) failed with status {status}: {why}")

    def _punch(self) -> None:
        if not self.punching or self.pos - self.punched < self.PUNCH:
            return
        end = self.pos - self.pos % self.PUNCH
        self.punching = punch_hole(self.file.fileno(), self.punched, end - self.punched)
        self.punched = end

    def cut_off(self) -> None:
        """Stop cat (QEMU's writes then fail) and make a waiting read end."""
        self.cut = True
        if self.cat.poll() is None:
            self.cat.kill()

    def release(self) -> None:
        """Once cat has ended (it reads on to the stream's end unless cut off: a background
        snapshot must be able to finish, see _Checkpoint._finish_background)."""
        self.cat.wait()
        if self.cat.stderr:
            self.cat.stderr.close()
        self.file.close()


class _Direct(_Spool):
    """``stop`` or ``--background``: QEMU sends every page once, so pages go into the writer as
    they arrive (convert.convert_qemu; pages never sent become FREE), read from the file cat
    copies the stream into (_Followed) while the migration runs. With disks, their blocks are
    indexed once the first bytes come (the guest is stopped, or its disks frozen, by then)
    and each page is looked up as it arrives (diskrefs.StreamedDiskPages). The writer finishes
    when the main thread hands over the checkpoint note (``finish``)."""

    def __init__(self, sock: socket.socket, keep: str | None, workdir: str | None, out, open_writer, disks):
        super().__init__(sock, keep, workdir)
        self.out, self.open_writer, self.disks = out, open_writer, disks
        self.note = None
        self._go = threading.Event()

    def _reader(self, sock: socket.socket, keep: str | None, workdir: str | None) -> io.RawIOBase:
        reader = _Followed(sock, keep, workdir)
        sock.close()  # cat holds it now
        return reader

    def _consume(self, stream):
        stream.peek(1)  # QEMU sends once the guest is stopped (or its disks frozen): disks as frozen
        with _open_disks(self.disks) as sources, self.open_writer(self.out, sources) as (writer, parent):
            scan = DiskOptions(sources) if sources else None
            try:
                state = convert_qemu(stream, writer, parent=parent, disks=scan)
            except RepeatedPages as exc:
                raise CheckpointError(
                    f"QEMU sent a page twice ({exc}): a stopped migration or a background snapshot sends each page once"
                ) from None
            for disk in self.disks:
                disk.referenced = scan.summary.pages.get(disk.name, 0) * scan.summary.page_size
            self.parsed.set()
            self._go.wait()
            if self.note is None:
                raise CheckpointError("abandoned")
            writer.add_source_state(SourceFormat.QEMU, QEMU_TAG_CHECKPOINT_NOTE, self.note)
        return state, None

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.reader.release()

    def _drain(self) -> None:
        """cat reads the stream to its end by itself."""

    def shut(self) -> None:
        self.reader.cut_off()

    def finish(self, note: bytes) -> None:
        self.note = note
        self._go.set()

    def abandon(self) -> None:
        self._go.set()


@contextlib.contextmanager
def _open_disks(disks: list[FrozenDisk]):
    """The checkpoint's disks as DiskSources by name (closed after)."""
    from leanimg.disks import open_disk

    sources = {}
    try:
        for disk in disks:
            sources[disk.name] = open_disk(disk.path, disk.name)
        yield sources
    finally:
        for source in sources.values():
            source.close()


# ------------------------------------------------------------------------------ the checkpoint


def run_checkpoint(request: CheckpointRequest) -> CheckpointResult:
    """Checkpoint the guest behind ``request.qmp`` into ``request.output`` (see the module)."""
    if request.mode not in MODES or request.then not in THEN:
        raise ValueError(f"mode {request.mode!r}, then {request.then!r}")
    if request.hints is not None:
        raise CheckpointError("hint files (spec/hints.md) are not taken by checkpoint; --guest-free asks the guest")
    if request.guest_free:
        _guest_free_allowed(request.mode)
    with _Signals() as signals, _prompt_main_thread(), Monitor(request.qmp) as monitor:
        return _Checkpoint(monitor, request, signals).run()


@contextlib.contextmanager
def _prompt_main_thread():
    """The main thread's QMP steps (the migration's end, then ``cont``: the guest's pause) must
    not queue behind the page work for the GIL: a thread waiting for it gets it after the
    switch interval, Python's 5 ms by default, many times over in one QMP exchange."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@implements("LI-HNT-026")
def _guest_free_allowed(mode: str) -> None:
    """Guest free-list hints only from a precopy (spec/hints.md §3.1). The other half of the
    rule, answers taken before the checkpoint instant, is _Checkpoint's order of steps: the
    link is finished (an answer in flight dropped) before the guest is resumed."""
    if mode != "live":
        raise CheckpointError(
            "--guest-free needs --live: in a stop-and-save or a background snapshot a page the "
            "guest writes after its answer is not sent again, so its free pages cannot be "
            "trusted (spec/hints.md §3.1)",
            rule="LI-HNT-026",
        )


class _Checkpoint:
    def __init__(self, monitor: Monitor, request: CheckpointRequest, signals: _Signals):
        self.qmp, self.req, self.signals = monitor, request, signals
        self.fd_name = f"leanimg-checkpoint-{os.getpid()}"
        self.spool: _Spool | None = None
        self.staged = None  # stop/--background without disks: the image being written (locations.Output)
        self.disks: list[FrozenDisk] = []
        self.migrating = self.fd_passed = self.fd_used = False
        self.switched_over = False  # --live: migrate-continue sent after the pause
        self.changed_caps: dict[str, bool] = {}
        self.saved_bandwidth = None
        self.stopped_at = self.resumed_at = None
        self.downtime_ms = None
        self.balloon: Balloon | None = None
        self.guest_link: GuestFreeLink | None = None
        self.guest_free: GuestFree | None = None
        self.hint_options: HintOptions | None = None
        self.started = time.monotonic()
        self.timeline: list[tuple[str, float]] = []
        self._status_shown = False

    def _mark(self, step: str) -> None:
        self.timeline.append((step, time.monotonic() - self.started))

    # -- the whole run -------------------------------------------------------------------
    def run(self) -> CheckpointResult:
        self._check_version()
        status = self.qmp.execute("query-status")["status"]
        self.was_running = status == "running"
        if self.qmp.execute("query-migrate").get("status") in ACTIVE:
            raise CheckpointError("a migration is already in progress on this QEMU")
        self.disks = self._match_disks()
        try:
            if self.req.guest_free:
                self._check_address_map()
                self.guest_link = GuestFreeLink(self.req.guest_free, lambda: self.spool.reader.received)
            self._inflate_balloon()
            self._open_stream()
            info = self._migrate()
            self._mark("migration completed")
            self.downtime_ms = info.get("downtime")
            self._resume_if_continuing()
            self._hang_up_guest_port()
            self._deflate_balloon()
            state, ram = self._spooled()
            self._mark("stream parsed")
            self._restore_migration_settings()
            if ram is None:
                staged = self._finish_direct()
            else:
                with ram:
                    staged = self._write_image(state, ram)
            try:
                if self.req.then == "quit":
                    self._quit()
                self._keep_hints()
                staged.commit()
                self._mark("image in place")
            except BaseException:
                staged.discard()
                raise
        except BaseException as exc:
            raise self._recover(exc) from None
        finally:
            self._end_status_line()
        return self._result()

    # -- the balloon (Liu, Jin, Liao) -----------------------------------------------------------
    def _inflate_balloon(self) -> None:
        """Inflate the balloon by --balloon-inflate and wait until the guest has given the pages
        (or stopped giving: no progress for BALLOON_SETTLE seconds)."""
        if not self.req.balloon_inflate:
            return
        before = self.qmp.execute("query-balloon")["actual"]
        self.balloon = Balloon(before, max(before - self.req.balloon_inflate, 0))
        self.qmp.execute("balloon", value=self.balloon.target)
        last, still = before, time.monotonic()
        while True:
            self.signals.check()
            actual = self.qmp.execute("query-balloon")["actual"]
            if actual != last:
                last, still = actual, time.monotonic()
            if actual <= self.balloon.target or time.monotonic() - still > BALLOON_SETTLE:
                self.balloon.reached = actual
                return
            time.sleep(0.1)

    def _deflate_balloon(self) -> None:
        """Give the guest its memory back (if it runs on)."""
        if self.balloon is None or self.balloon.deflated or self.req.then == "quit":
            return
        if self.req.then == "continue" or self.qmp.execute("query-status")["status"] == "running":
            self.qmp.execute("balloon", value=self.balloon.before)
            self.balloon.deflated = True

    # -- disks ---------------------------------------------------------------------------
    def _match_disks(self) -> list[FrozenDisk]:
        """Each --disk PATH must be a file of one of the guest's block devices."""
        if not self.req.disks:
            return []
        devices = [dev for dev in self.qmp.execute("query-block") if dev.get("inserted")]
        found = []
        for name, path in self.req.disks.items():
            match = next((m for m in (_file_of(dev, path) for dev in devices) if m), None)
            if match is None:
                files = ", ".join(f for dev in devices for f in _files(dev["inserted"])) or "none"
                raise CheckpointError(f"--disk {name}={path} is not a file of this guest's disks (its files: {files})")
            device, writable = match
            found.append(FrozenDisk(name, os.path.abspath(path), device, writable))
        return found

    def _freezing(self) -> bool:
        return self.req.then == "continue" and any(d.writable for d in self.disks)

    def _freeze_disks(self) -> None:
        """blockdev-snapshot-sync: the guest writes to a new overlay, the file stays as it is."""
        if not self._freezing():
            return
        for disk in self.disks:
            if disk.writable:
                overlay = _overlay_path(disk.path, self.req.output)
                self.qmp.execute("blockdev-snapshot-sync", **disk.device, format="qcow2", **{"snapshot-file": overlay})
                disk.overlay = overlay

    # -- the migration -------------------------------------------------------------------
    def _open_stream(self) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.qmp.send_fd(theirs.fileno(), self.fd_name)
            self.fd_passed = True
        finally:
            theirs.close()
        if self.req.mode in ONCE_MODES and self._disks_indexable():
            self.staged = Output(self.req.output)
            self.spool = _Direct(
                ours, self.req.keep_stream, self.req.workdir, self.staged.file, self._open_writer, self.disks
            )
        else:
            self.spool = _Spool(ours, self.req.keep_stream, self.req.workdir)
        self.spool.start()

    def _disks_indexable(self) -> bool:
        """Whether the disks' blocks fit the index pages are looked up in as they stream past
        (diskrefs.BlockIndex); else the RAM is spooled and read twice."""
        with _open_disks(self.disks) as sources:
            return BlockIndex.fits(sources, qemu.DEFAULT_PAGE_SIZE)

    def _migrate(self) -> dict:
        params = self.qmp.execute("query-migrate-parameters")
        self.saved_bandwidth = params.get("max-bandwidth")
        self.qmp.execute("migrate-set-parameters", **{"max-bandwidth": self.req.max_bandwidth or UNLIMITED_BANDWIDTH})
        mode = self.req.mode
        self._set_capabilities(
            {
                "pause-before-switchover": mode == "live" and self._freezing(),
                "background-snapshot": mode == "background",
            }
        )
        if mode == "stop" or (mode == "background" and self._freezing()):
            self._stop()
        if mode == "background":
            self._freeze_disks()
        self._mark("ready to migrate")
        self._start_migration()
        if self.guest_link is not None:
            self.guest_link.start()
        info = self._wait_migration()
        self._finish_guest_free()
        if mode == "stop":
            self._freeze_disks()
        return info

    def _check_address_map(self) -> None:
        """The guest's page frame numbers are read through the hint protocol's QEMU pc map
        (spec/hints.md §6: i440fx's split of RAM around the PCI hole). q35 splits it elsewhere
        once RAM reaches 2.75 GiB, and hotplugged memory is not pc.ram: a pfn there would name
        another page, so such guests are refused."""
        machine = self.qmp.execute("qom-get", path="/machine", property="type")
        memory = self.qmp.execute("query-memory-size-summary")
        ram, plugged = memory.get("base-memory", 0), memory.get("plugged-memory", 0)
        fits = machine.startswith("pc-i440fx-") or (machine.startswith("pc-q35-") and ram < Q35_ALL_LOW)
        if not fits or plugged:
            raise CheckpointError(
                f"--guest-free: machine {machine} with {ram / 2**20:.0f} MiB of RAM"
                + (f" and {plugged / 2**20:.0f} MiB plugged in" if plugged else "")
                + ": guest page frame numbers map to QEMU's pc.ram only on i440fx (-machine pc), "
                "or q35 below 2.75 GiB, without hotplugged memory (spec/hints.md §6)"
            )

    def _finish_guest_free(self) -> None:
        """The migration has completed and the guest is stopped: the answers are all in."""
        if self.guest_link is None:
            return
        link = self.guest_link
        snapshot = link.finish()
        self.guest_free = GuestFree(link.asked, link.answered, snapshot, self.spool.reader.received)
        if snapshot is None:
            return
        self.hint_options = HintOptions(source=free_hints(snapshot))

    def _hang_up_guest_port(self) -> None:
        """After the resume: QEMU sees a hang-up only while the guest runs (converters/guest_free.py)."""
        if self.guest_link is not None:
            self.guest_link.close()
            self.guest_link = None

    def _keep_hints(self) -> None:
        """--keep-hints, just before the image is renamed into place (a failed checkpoint leaves neither)."""
        if self.req.keep_hints and self.hint_options is not None:
            temp, out = _temp_beside(self.req.keep_hints)
            with out:
                out.write(self.hint_options.source)
            commit_temporary(temp, self.req.keep_hints)

    def _check_version(self) -> None:
        """Refuse a QEMU whose migration stream this reader was not built for, before the guest
        is touched."""
        v = self.qmp.execute("query-version")["qemu"]
        if not SUPPORTED_QEMU[0] <= (v["major"], v["minor"]) <= SUPPORTED_QEMU[1]:
            raise CheckpointError(
                f"this is QEMU {v['major']}.{v['minor']}.{v['micro']}; leanimg checkpoint reads the migration "
                f"streams of QEMU {'.'.join(map(str, SUPPORTED_QEMU[0]))} to {SUPPORTED_QEMU[1][0]}.x (tested "
                "with 7.2 and 10.0). The guest was not touched. Use a leanimg release that supports this QEMU, "
                'or try `migrate "exec:cat > FILE"` and `leanimg convert FILE`, which refuses what it does not '
                "know by name"
            )

    def _set_capabilities(self, wanted: dict[str, bool]) -> None:
        current = {c["capability"]: c["state"] for c in self.qmp.execute("query-migrate-capabilities")}
        change = {cap: on for cap, on in wanted.items() if current.get(cap, False) != on}
        if change:
            self.qmp.execute(
                "migrate-set-capabilities", capabilities=[{"capability": c, "state": on} for c, on in change.items()]
            )
            self.changed_caps.update({c: not on for c, on in change.items()})

    def _stop(self) -> None:
        if self.qmp.execute("query-status")["status"] == "running":
            self.qmp.execute("stop")
            self.stopped_at = time.monotonic()

    def _start_migration(self) -> None:
        self.signals.check()
        self.qmp.execute("migrate", uri=f"fd:{self.fd_name}")
        self.migrating = self.fd_used = True

    def _wait_migration(self) -> dict:
        while True:
            self.signals.check()
            if self.guest_link is not None and self.guest_link.error is not None:
                raise self.guest_link.error  # a broken answer: cancel now, not after the precopy
            info = self.qmp.execute("query-migrate")
            status = info.get("status")
            self._show_status(status)
            self._note_resumed()
            if status == "completed":
                self.migrating = False
                return info
            if status in ("failed", "cancelled"):
                self.migrating = False
                why = info.get("error-desc")
                raise CheckpointError(f"the migration {status}" + (f": {why}" if why else ""))
            if status == "pre-switchover" and not self.switched_over:
                # once only: QEMU may still report pre-switchover for a moment after
                # migrate-continue (its migration thread has not run yet); a second
                # migrate-continue would then fail ("not in expected state: device")
                self._freeze_disks()
                self.qmp.execute("migrate-continue", state="pre-switchover")
                self.switched_over = True
                continue
            if self.spool.error is not None or not self.spool.is_alive():
                if self.req.mode != "background" and self._stream_ended_first():
                    continue  # the next query-migrate names how the migration ended
                self.spool.result()
                raise CheckpointError("the migration stream ended before the migration completed")
            time.sleep(0.02 if status == "device" else 0.05)

    def _stream_ended_first(self) -> bool:
        """The stream ended while the migration was active: QEMU ending the migration (cancelled,
        failed) cuts the stream first; give its status a moment to say so (True), so the error
        names the migration's end rather than the truncated stream it left."""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if self.qmp.execute("query-migrate").get("status") not in ACTIVE:
                return True
            time.sleep(0.05)
        return False

    def _note_resumed(self) -> None:
        """--background after leanimg's stop: QEMU resumes the guest itself; note when."""
        if self.stopped_at is not None and self.resumed_at is None and self.req.mode == "background":
            if self.qmp.execute("query-status")["status"] == "running":
                self.resumed_at = time.monotonic()

    def _spooled(self):
        while not self.spool.parsed.wait(0.1) and self.spool.is_alive():
            self.signals.check()
        if self.spool.error is not None:
            self.spool.result()
        return self.spool.state, self.spool.ram

    def _finish_direct(self) -> str:
        self.spool.finish(self._note())
        while self.spool.is_alive():
            self.signals.check()
            self.spool.join(0.1)
        self.spool.result()
        self._mark("image written")
        self.staged.sync()
        self._mark("image synced")
        return self.staged

    def _resume_if_continuing(self) -> None:
        if self.req.then == "continue" and self.was_running:
            self._cont()
        elif self.req.then == "stop" and self.qmp.execute("query-status")["status"] == "running":
            self.qmp.execute("stop")  # --background: the guest ran on during the snapshot

    def _cont(self) -> None:
        if self.qmp.execute("query-status")["status"] != "running":
            self.qmp.execute("cont")
        self.resumed_at = time.monotonic()
        self._mark("guest resumed")

    def _quit(self) -> None:
        try:
            self.qmp.execute("quit")
        except CheckpointError:
            pass  # QEMU may close the connection before it replies

    def _restore_migration_settings(self) -> None:
        if self.changed_caps:
            self.qmp.execute(
                "migrate-set-capabilities",
                capabilities=[{"capability": c, "state": on} for c, on in self.changed_caps.items()],
            )
            self.changed_caps = {}
        if self.saved_bandwidth is not None:
            self.qmp.execute("migrate-set-parameters", **{"max-bandwidth": self.saved_bandwidth})
            self.saved_bandwidth = None

    # -- the image -----------------------------------------------------------------------
    def _write_image(self, state, ram) -> Output:
        """The image, written to the output not yet committed (locations.Output)."""
        staged = Output(self.req.output)
        try:
            self._write_into(staged.file, state, ram)
            self._mark("image written")
            staged.sync()
            self._mark("image synced")
        except BaseException:
            staged.discard()
            raise
        return staged

    def _write_into(self, out, state, ram) -> None:
        from leanimg.disks import open_disk

        sources = {}
        try:
            for disk in self.disks:  # opened after the freeze: size and fingerprint of it
                sources[disk.name] = open_disk(disk.path, disk.name)
            scan = DiskOptions(sources) if sources else None
            with self._open_writer(out, sources) as (writer, parent):
                self.signals.check()
                write_spooled(writer, state, ram, parent=parent, disks=scan, unsent_free=True, hints=self.hint_options)
                if self.hint_options is not None:
                    self.guest_free.report = self.hint_options.report.get("FREE", {})
                writer.add_source_state(SourceFormat.QEMU, QEMU_TAG_CHECKPOINT_NOTE, self._note())
                self.signals.check()
            for disk in self.disks:
                disk.referenced = scan.summary.pages.get(disk.name, 0) * scan.summary.page_size
        finally:
            for source in sources.values():
                source.close()

    @contextlib.contextmanager
    def _open_writer(self, out, sources=None):
        """A LeanImageWriter into ``out`` (against the --parent, with the disks declared) and the
        open parent image (or None)."""
        from leanimg.incremental import parent_link
        from leanimg.reader import LeanImage

        parent = LeanImage.open(self.req.parents[0], parents=list(self.req.parents[1:])) if self.req.parents else None
        try:
            if parent is not None and sources:  # a changed page that was a DISK page of the parent
                lend_disks(parent, sources)
            options = dict(self.req.writer_options)
            if parent is not None:
                options.update(parent=parent_link(parent), allow_delta=self.req.allow_delta, page_size=parent.page_size)
            with LeanImageWriter(out, **options) as writer:
                if sources:
                    declare_disks(writer, sources)
                yield writer, parent
        finally:
            if parent is not None:
                parent.close()

    def _note(self) -> bytes:
        note = {
            "written_by": "leanimg checkpoint",
            "mode": self.req.mode,
            "then": self.req.then,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "downtime_ms": self.downtime_ms,
            "paused_ms": self._paused_ms(),
            "disks": [d.note() for d in self.disks],
            "balloon": self.balloon.note() if self.balloon else None,
            "guest_free": self.guest_free.note() if self.guest_free else None,
        }
        return json.dumps(note, indent=1).encode()

    def _paused_ms(self) -> float | None:
        if self.stopped_at is None or self.resumed_at is None:
            return None
        return (self.resumed_at - self.stopped_at) * 1000

    def _result(self) -> CheckpointResult:
        from leanimg.inspect import class_counts
        from leanimg.reader import LeanImage

        with LeanImage.open(self.req.output, parents=list(self.req.parents)) as image:
            counts, page_size, size = class_counts(image), image.page_size, image.tables.file.size
        guest = "quit" if self.req.then == "quit" else self.qmp.execute("query-status")["status"]
        return CheckpointResult(
            self.req.output,
            self.req.mode,
            self.req.then,
            size,
            page_size,
            counts,
            self.downtime_ms,
            self._paused_ms(),
            time.monotonic() - self.started,
            self.disks,
            guest,
            self.balloon,
            self.guest_free,
            self.timeline,
        )

    # -- progress ------------------------------------------------------------------------
    def _show_status(self, status: str) -> None:
        if not self.req.progress:
            return
        received = self.spool.reader.received / 2**20 if self.spool else 0
        sys.stderr.write(
            f"\rcheckpoint ({self.req.mode}): {received:8.1f} MiB received, migration "
            f"{status:<14} {time.monotonic() - self.started:6.1f} s"
        )
        sys.stderr.flush()
        self._status_shown = True

    def _end_status_line(self) -> None:
        if self._status_shown:
            sys.stderr.write("\n")
            sys.stderr.flush()

    # -- failure -------------------------------------------------------------------------
    def _recover(self, exc: BaseException) -> BaseException:
        """Cancel, resume, restore settings; the error to raise (what remains named)."""
        notes = []
        try:
            if self.req.mode == "background":
                self._finish_background()
            else:
                self._cancel_migration()
        except CheckpointError as error:
            notes.append(f"ending the migration failed: {error}")
        if self.spool is not None:
            self.spool.abandon()
            self.spool.shut()
            self.spool.join(CANCEL_TIMEOUT)
            if self.spool.ram is not None:
                self.spool.ram.close()
        if self.staged is not None:
            self.staged.discard()
        for step in (
            self._close_fd,
            self._restore_run_state,
            self._hang_up_guest_port,
            self._restore_migration_settings,
            self._deflate_after_failure,
        ):
            try:
                step()
            except CheckpointError as error:
                notes.append(str(error))
        notes += [
            f"disk {d.name}: the guest now writes to {d.overlay} over {d.path} (block snapshot taken; "
            "merge it back with QMP block-commit if wanted)"
            for d in self.disks
            if d.overlay
        ]
        if not isinstance(exc, LeanImageError):
            if isinstance(exc, OSError):
                return exc if not notes else CheckpointError(f"{exc}; " + "; ".join(notes))
            return exc
        message = exc.message if isinstance(exc, CheckpointError) else str(exc)
        state = "; no image written"
        cls = type(exc) if isinstance(exc, CheckpointError) else CheckpointError
        text = message + state + "".join(f"; {n}" for n in notes)
        if isinstance(exc, CheckpointInterrupted):
            return CheckpointInterrupted(text, exc.signum)
        return cls(text)

    def _cancel_migration(self) -> None:
        if not self.migrating:
            return
        self.qmp.execute("migrate_cancel")
        deadline = time.monotonic() + CANCEL_TIMEOUT
        while self.qmp.execute("query-migrate").get("status") in ACTIVE:
            if time.monotonic() > deadline:
                raise CheckpointError(f"the migration did not end within {CANCEL_TIMEOUT:.0f} s of migrate_cancel")
            self.spool.shut()
            time.sleep(0.05)
        self.migrating = False

    def _finish_background(self) -> None:
        """A background snapshot is never cancelled: QEMU 7.2 does not lift the write protection
        of guest RAM when one is cancelled or fails (ram_write_tracking_stop runs only on
        completion), and the guest then hangs on its next write. So it is run to its end at full
        speed, the stream read and dropped, and the image not written."""
        if not self.migrating:
            return
        self.qmp.execute("migrate-set-parameters", **{"max-bandwidth": UNLIMITED_BANDWIDTH})
        deadline = time.monotonic() + 10 * CANCEL_TIMEOUT
        while self.qmp.execute("query-migrate").get("status") in ACTIVE:
            if time.monotonic() > deadline:
                raise CheckpointError("the background snapshot did not end")
            time.sleep(0.05)
        self.migrating = False

    def _deflate_after_failure(self) -> None:
        if self.balloon is not None and not self.balloon.deflated:
            self.qmp.execute("balloon", value=self.balloon.before)
            self.balloon.deflated = True

    def _close_fd(self) -> None:
        if self.fd_passed and not self.fd_used:
            self.qmp.execute("closefd", fdname=self.fd_name)

    def _restore_run_state(self) -> None:
        status = self.qmp.execute("query-status")["status"]
        if self.was_running and status != "running":
            self.qmp.execute("cont")
        elif not self.was_running and status == "running":
            self.qmp.execute("stop")


# ------------------------------------------------------------------------------ helpers


def _files(inserted: dict) -> list[str]:
    """The files of a block device: its active layer, then its backing chain."""
    files = [inserted.get("file")]
    image = inserted.get("image", {}).get("backing-image")
    while image:
        files.append(image.get("filename"))
        image = image.get("backing-image")
    return [f for f in files if f]


def _file_of(device: dict, path: str):
    """({"device"|"node-name": ...}, writable) if ``path`` is one of ``device``'s files."""
    inserted = device["inserted"]
    for k, name in enumerate(_files(inserted)):
        try:
            same = os.path.samefile(name, path)
        except OSError:
            continue
        if same:
            handle = {"device": device["device"]} if device.get("device") else {"node-name": inserted["node-name"]}
            return handle, k == 0 and not inserted.get("ro", False)
    return None


def _overlay_path(disk: str, output: str) -> str:
    """A new file beside ``disk``, named after it and the image."""
    stem = os.path.splitext(os.path.basename(output))[0]
    base = f"{disk}.after-{stem}"
    candidate, n = f"{base}.qcow2", 1
    while os.path.exists(candidate):
        n += 1
        candidate = f"{base}-{n}.qcow2"
    return candidate


def _temp_beside(output: str):
    """The output's temporary file (fileutil's one naming scheme): (path, binary file object)."""
    return create_temporary(output, buffering=1 << 20)


class QemuCheckpoint:
    """The ``leanimg.checkpoints`` plugin for QEMU 7.2 (leanimg.plugins.checkpointer)."""

    name = "qemu"
    description = "a running QEMU 7.2, over its QMP socket"
    Request = CheckpointRequest

    @staticmethod
    def checkpoint(request: CheckpointRequest) -> CheckpointResult:
        return run_checkpoint(request)


QEMU = QemuCheckpoint()
