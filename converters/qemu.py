"""Read and write QEMU's migration stream (``migrate "exec:cat > FILE"``), QEMU 7.2 to 11.0,
and QEMU's mapped-ram files (``migrate file:FILE`` with the capability mapped-ram, QEMU >= 9.0).

The stream's layout (migration/savevm.c, migration/ram.c), its constants and the encoding of
its pieces: ``converters/qemu_wire.py``, shared with the post-copy stream of
``restore/postcopy.py``. A mapped-ram file has no page entries: each MEM_SIZE block entry is
followed by a header, and the block's bitmap and page slots lie at fixed offsets
(converters/mapped_ram.py).

Reading
-------
``read_qemu_stream(f)`` reads a binary file object sequentially (a pipe is fine; only a
mapped-ram file's slots are read at their offsets, so it must be a file) and yields events in
stream order:

* ``RamBlocks(blocks, page_size)`` once, from MEM_SIZE: every ``RamBlock(name, length)``.
* ``Page(block, offset, data, fill)`` per RAM entry.  ``data`` is ``page_size`` bytes, or
  ``None`` for a ZERO entry, whose page is ``page_size`` copies of byte ``fill``.  A page
  can repeat (live saves): the last event for a (block, offset) wins.  Pages never sent
  keep the destination's initial content (zeros for RAM).
* ``StreamEnd(state)`` last: a ``StreamState`` with everything but the pages that QEMU needs
  to accept a rebuilt stream (header, configuration, RAM section framing, device sections
  verbatim, VMDESCRIPTION).  ``state.to_bytes()`` / ``StreamState.from_bytes()`` serialise it.

Memory is bounded: pages are yielded as they are read; only the device sections after the
RAM (typically well under 1 MiB, capped at ``TAIL_LIMIT``) are held.  Bad input raises
``SourceFormatError`` and unsupported features (XBZRLE, compression, multifd packets,
postcopy and other commands, RDMA, block migration, device state before the RAM's end)
``UnsupportedError``, each with the byte ``offset`` and the ``structure`` (e.g.
``section[3] PART 'ram' id=2``).

Writing
-------
``write_qemu_stream(out, state, ram_blocks, page_source, mapped=False)`` writes a stream the
QEMU of the state loads (``mapped``: a mapped-ram file, into a seekable ``out``).
``page_source(block)`` returns an iterable of chunks covering ``block.length`` bytes in
order: bytes-like objects whose length is a multiple of the page size, or ``Zeros(n)``.
Every page is written (all-zero pages as ZERO entries), because a fresh destination starts
with ROM blocks filled by its own firmware.  When the page count matches the original's
(each page sent once, as in a save of a stopped VM) the RAM section boundaries are
reproduced and the output is byte-identical to QEMU's.

``RamImage`` applies ``Page`` events to sparse scratch files (last copy wins) and serves
them back as a ``page_source``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import tempfile
from typing import BinaryIO, Callable, Iterable, Iterator, Union

import numpy as np

from leanimg.errors import SourceFormatError, UnsupportedError, fits_in_memory
from leanimg.fileutil import GatherWriter
from leanimg.format import REGION_SIZE_MAX
from leanimg.native import backend

from . import mapped_ram
from .cursor import Cursor
from .qemu_wire import (
    BE32,
    BE64,
    CMD_SWITCHOVER_START,
    COMMAND,
    CONFIGURATION,
    END,
    EOF,
    F_COMPRESS,
    F_CONTINUE,
    F_EOS,
    F_FULL,
    F_HOOK,
    F_MEM_SIZE,
    F_MULTIFD_FLUSH,
    F_PAGE,
    F_XBZRLE,
    F_ZERO,
    FOOTER,
    FULL,
    MIG_COMMANDS,
    PART,
    QEVM_MAGIC,
    QEVM_VERSION,
    QEVM_VERSION_COMPAT,
    SECTION_NAMES,
    START,
    SUBSECTION,
    VMDESCRIPTION,
    SectionHeader,
    command_bytes,
    footer_bytes,
    name_bytes,
    part_header_bytes,
    ram_block_bytes,
    ram_section_end,
    section_header_bytes,
)

UNSUPPORTED_FLAGS = {
    F_XBZRLE: "XBZRLE-encoded pages",
    F_COMPRESS: "compressed pages",
    F_HOOK: "RDMA hooks",
    # multifd needs a socket (or mapped-ram, which sends no page entries): the
    # pages of a stream with it travel on other channels
    F_MULTIFD_FLUSH: "RAM_SAVE_FLAG_MULTIFD_FLUSH: the main channel of a multifd socket "
    "migration, whose pages travel on other channels (no exec:, fd: or "
    "file: save carries it)",
    F_FULL: "RAM_SAVE_FLAG_FULL (obsolete pre-0.13 stream)",
}

DEFAULT_PAGE_SIZE = 4096
TAIL_LIMIT = 64 << 20  # device sections + VMDESCRIPTION held in memory
SUPPORTED_CAPABILITIES = {"x-ignore-shared", mapped_ram.CAPABILITY}


# ---------------------------------------------------------------------------- events


@dataclasses.dataclass(frozen=True)
class RamBlock:
    name: str
    length: int
    addr: int | None = None  # present with the x-ignore-shared capability


@dataclasses.dataclass(frozen=True)
class RamBlocks:
    blocks: tuple[RamBlock, ...]
    page_size: int


@dataclasses.dataclass(frozen=True, slots=True)
class Page:
    block: str
    offset: int
    data: bytes | None  # None: a ZERO entry, page filled with ``fill``
    fill: int = 0
    end: int = 0  # stream offset just after the entry (spec/hints.md §3)

    def content(self, page_size: int) -> bytes:
        return self.data if self.data is not None else bytes([self.fill]) * page_size


@dataclasses.dataclass(frozen=True, slots=True)
class PageRun:
    """``count`` consecutive pages of one block from ``offset`` (``batch=True`` only).

    ``pages`` is a (count, page_size) uint8 array, a strided view of the page data
    inside the input buffer (no copy; rows lie 8 header bytes apart), or None for a run
    of ZERO entries with fill byte 0.  ``data`` is the same pages as one bytes object.
    ``at`` is the stream offset of the first entry; ``ends()`` where each entry ends.
    """

    block: str
    offset: int
    count: int
    pages: np.ndarray | None
    at: int = 0

    def ends(self) -> np.ndarray:
        stride = 9 if self.pages is None else 8 + self.pages.shape[1]
        return self.at + stride * np.arange(1, self.count + 1, dtype=np.int64)

    @property
    def data(self) -> bytes | None:
        return None if self.pages is None else self.pages.tobytes()


@dataclasses.dataclass(frozen=True)
class Zeros:
    """A page_source chunk of ``length`` zero bytes, without materialising them."""

    length: int


@dataclasses.dataclass(frozen=True)
class Pages:
    """A page_source chunk sent as PAGE entries whatever its content (the caller knows these
    pages are not blank); ``data`` is gathered into the output in place, not copied."""

    data: memoryview


@dataclasses.dataclass(frozen=True)
class DeviceSection:
    """A non-RAM section, body kept verbatim (footer not included)."""

    kind: int  # FULL
    header: SectionHeader
    body: bytes

    def to_bytes(self, footer: bool) -> bytes:
        out = section_header_bytes(self.kind, self.header) + self.body
        return out + footer_bytes(self.header.section_id) if footer else out


@dataclasses.dataclass
class StreamState:
    """Everything of a stream except the RAM pages."""

    prologue: bytes  # magic, version, configuration section: verbatim
    machine: str | None
    page_size: int
    capabilities: tuple[str, ...]
    ram: SectionHeader
    ram_blocks: tuple[RamBlock, ...]
    ram_plan: list[tuple[int, int]]  # (START/PART/END, page entries) per RAM section, or
    # (COMMAND, command id) for a command between them
    footers: bool
    devices: list[DeviceSection]
    vmdesc: bytes | None  # the JSON text

    def to_bytes(self) -> bytes:
        return _state_to_bytes(self)

    @classmethod
    def from_bytes(cls, blob: bytes) -> "StreamState":
        return _state_from_bytes(blob)


@dataclasses.dataclass(frozen=True)
class StreamEnd:
    state: StreamState
    length: int  # bytes read


Event = Union[RamBlocks, Page, PageRun, StreamEnd]
Chunk = Union[bytes, bytearray, memoryview, Zeros, Pages]


# ---------------------------------------------------------------------------- reading


def read_qemu_stream(f: BinaryIO, batch: bool = False) -> Iterator[Event]:
    """Yield the events of the migration stream read from ``f`` (see module docstring).

    With ``batch``, runs of CONTINUE entries at consecutive offsets come as one
    ``PageRun`` each, found with a strided view over the input buffer instead of
    a Python step per page.
    """
    return _StreamReader(f, batch).events()


class _StreamReader:
    def __init__(self, f: BinaryIO, batch: bool = False):
        self.f = f
        self.inp = Cursor.over_stream(f, structure="stream header")
        self.file: mapped_ram.RandomAccess | None = None  # a mapped-ram file's pages
        self.layouts: list[mapped_ram.BlockLayout] = []
        self.batch = batch
        self.page_size = DEFAULT_PAGE_SIZE
        self.machine: str | None = None
        self.capabilities: tuple[str, ...] = ()
        self.ram: SectionHeader | None = None
        self.blocks: dict[str, RamBlock] = {}
        self.plan: list[tuple[int, int]] = []
        self.footers: bool | None = None
        self.last_block: RamBlock | None = None
        self.nsections = 0

    def events(self) -> Iterator[Event]:
        prologue = self._read_prologue()
        inp = self.inp
        while True:
            inp.structure = f"section[{self.nsections}]"
            kind = inp.peek_u8()
            if kind is None:
                raise inp.error("truncated stream: expected a section type or QEMU_VM_EOF, got end of input")
            if kind in (FULL, EOF):
                break
            yield from self._ram_section(inp.u8("section type"))
            self.nsections += 1
        if self.ram is None:
            raise inp.error(f"expected the 'ram' section before device state, got {SECTION_NAMES[kind]}")
        devices, vmdesc = self._read_tail()
        state = StreamState(
            prologue=prologue,
            machine=self.machine,
            page_size=self.page_size,
            capabilities=self.capabilities,
            ram=self.ram,
            ram_blocks=tuple(self.blocks.values()),
            ram_plan=self.plan,
            footers=bool(self.footers),
            devices=devices,
            vmdesc=vmdesc,
        )
        yield StreamEnd(state, inp.offset)

    # --- header and configuration -----------------------------------------------------

    def _read_prologue(self) -> bytes:
        inp = self.inp
        inp.start_recording()
        magic = inp.be32("magic")
        if magic != QEVM_MAGIC:
            raise inp.error(f"expected QEVM magic 0x5145564d, got {magic:#010x}", back=4)
        version = inp.be32("version")
        if version == QEVM_VERSION_COMPAT:
            raise inp.unsupported("stream version 2 (pre-2.x QEMU)", back=4)
        if version != QEVM_VERSION:
            raise inp.error(f"expected stream version 3, got {version}", back=4)
        if inp.peek_u8() == CONFIGURATION:
            inp.structure = "configuration"
            inp.u8("section type")
            self._read_configuration()
        return inp.stop_recording()

    def _read_configuration(self) -> None:
        inp = self.inp
        raw = inp.take(inp.be32("machine type length"), "machine type")
        self.machine = raw.decode("ascii", errors="replace")
        while inp.peek_u8() == SUBSECTION:
            inp.u8("subsection marker")
            name = _read_name(inp, "subsection name")
            inp.be32("subsection version")
            if name == "configuration/target-page-bits":
                bits = inp.be32("target page bits")
                if not 9 <= bits <= 16:
                    raise inp.error(f"expected target page bits 9..16, got {bits}", back=4)
                self.page_size = 1 << bits
            elif name == "configuration/capabilities":
                self._read_capabilities()
            elif name == "configuration/uuid":
                inp.take(16, "uuid")
            else:
                raise inp.unsupported(f"configuration subsection {name!r}")

    def _read_capabilities(self) -> None:
        inp = self.inp
        caps = []
        for _ in range(inp.be32("capability count")):
            cap = _read_name(inp, "capability")
            if cap not in SUPPORTED_CAPABILITIES:
                raise inp.unsupported(f"migration capability {cap!r}")
            caps.append(cap)
        self.capabilities = tuple(caps)
        if mapped_ram.CAPABILITY in caps:
            self.file = mapped_ram.RandomAccess(self.f, inp.offset)

    # --- RAM sections -----------------------------------------------------------------

    def _ram_section(self, kind: int) -> Iterator[Event]:
        inp = self.inp
        if kind == COMMAND:
            self.plan.append((COMMAND, self._command()))
            return
        if kind not in (START, PART, END):
            raise inp.error(f"expected a section type (START, PART, END, FULL, EOF), got {kind:#04x}", back=1)
        section_id = inp.be32("section id")
        if kind == START:
            self._ram_start(section_id)
        elif self.ram is None or section_id != self.ram.section_id:
            raise inp.error(
                f"expected section id of 'ram' "
                f"({self.ram.section_id if self.ram else 'none started'}), "
                f"got {section_id}",
                back=4,
            )
        inp.structure = f"section[{self.nsections}] {SECTION_NAMES[kind]} 'ram' id={section_id}"
        entries = yield from self._ram_entries(kind)
        self.plan.append((kind, entries))
        self._footer(section_id)
        if kind == START:
            yield RamBlocks(tuple(self.blocks.values()), self.page_size)
            yield from self._mapped_pages()

    def _mapped_pages(self) -> Iterator[PageRun]:
        """A mapped-ram file's pages, read from their slots (its sections carry none)."""
        for layout in self.layouts:
            for first, count, data in mapped_ram.page_runs(self.file, layout):
                pages = None if data is None else np.frombuffer(data, np.uint8).reshape(count, self.page_size)
                # a slot holds the page as of the save's end (the bitmap is written last): its copy
                # "ends" after the whole file, so no FREE hint (spec/hints.md §3) can apply to it
                yield PageRun(layout.name, first * self.page_size, count, pages, self.file.size)

    def _command(self) -> int:
        """A QEMU_VM_COMMAND between RAM sections: SWITCHOVER_START, or refused by name."""
        inp = self.inp
        inp.structure = f"section[{self.nsections}] COMMAND"
        cmd, length = inp.be16("command id"), inp.be16("command length")
        name = MIG_COMMANDS.get(cmd)
        if name is None:
            raise inp.error(f"expected a QEMU_VM_COMMAND id 1..{max(MIG_COMMANDS)}, got {cmd}", back=4)
        if cmd != CMD_SWITCHOVER_START:
            raise inp.unsupported(
                f"QEMU_VM_COMMAND {cmd} {name} (postcopy, COLO and return-path "
                "commands need a live destination; a saved stream cannot carry them)",
                back=5,
            )
        if length != 0:
            raise inp.error(f"expected {name} with length 0, got {length}", back=2)
        return cmd

    def _ram_start(self, section_id: int) -> None:
        inp = self.inp
        idstr = _read_name(inp, "section idstr")
        instance_id, version_id = inp.be32("instance id"), inp.be32("version id")
        if idstr != "ram":
            raise inp.unsupported(f"iterative section {idstr!r} (block migration or dirty bitmaps)")
        if self.ram is not None:
            raise inp.error("expected one START section for 'ram', got a second one")
        self.ram = SectionHeader(section_id, idstr, instance_id, version_id)

    def _footer(self, section_id: int) -> None:
        inp = self.inp
        if self.footers is None:
            self.footers = inp.peek_u8() == FOOTER
        if not self.footers:
            return
        marker = inp.u8("section footer")
        if marker != FOOTER:
            raise inp.error(f"expected section footer 0x7e, got {marker:#04x}", back=1)
        got = inp.be32("footer section id")
        if got != section_id:
            raise inp.error(f"expected footer section id {section_id}, got {got}", back=4)

    def _ram_entries(self, kind: int) -> Iterator[Page]:
        """Yield the pages of one RAM section up to EOS; return the number of entries."""
        inp, ps = self.inp, self.page_size
        mask = ps - 1
        count = 0
        while True:
            if self.batch and self.last_block is not None:
                run = self._take_run()
                if run is not None:
                    yield run
                    count += run.count
                    continue
            word = inp.be64("RAM entry header")
            flags, addr = word & mask, word & ~mask
            cont, flags = flags & F_CONTINUE, flags & ~F_CONTINUE
            if flags == F_EOS and not cont:
                return count
            if (flags == F_PAGE or flags == F_ZERO) and self.file is not None:
                raise inp.error(
                    "expected no page entries in a mapped-ram stream (its pages lie in the "
                    f"blocks' slots), got RAM flags {flags | cont:#x}",
                    back=8,
                )
            if (flags == F_PAGE or flags == F_ZERO) and kind == START:
                raise inp.error(
                    "expected MEM_SIZE and EOS in the START section (QEMU sends pages in PART "
                    f"and END sections), got RAM flags {flags | cont:#x}",
                    back=8,
                )
            if flags == F_PAGE or flags == F_ZERO:
                block = self._entry_block(cont)
                if addr + ps > block.length:
                    raise inp.error(
                        f"expected a page offset below block {block.name!r} length {block.length:#x}, got {addr:#x}",
                        back=8,
                    )
                if flags == F_PAGE:
                    yield Page(block.name, addr, inp.take(ps, "page data"), 0, inp.offset)
                else:
                    yield Page(block.name, addr, None, inp.u8("zero page fill byte"), inp.offset)
                count += 1
            elif flags == F_MEM_SIZE and not cont and kind == START and not self.blocks:
                self._mem_size(addr)
            else:
                self._bad_flags(flags | cont, word)

    def _take_run(self) -> PageRun | None:
        """The longest run of well-formed CONTINUE entries already in the buffer, or None.

        Anything unusual (another flag, a jump in offsets, a non-zero fill byte, the
        block's end) ends the run; the per-entry path then reads it and reports errors.
        """
        inp, ps, block = self.inp, self.page_size, self.last_block
        buf, pos = inp.buf, inp.pos
        if len(buf) - pos < 8 or inp.recording:
            return None
        word = int.from_bytes(buf[pos : pos + 8], "big")
        flags, first = word & (ps - 1), word & ~(ps - 1)
        if flags not in (F_PAGE | F_CONTINUE, F_ZERO | F_CONTINUE):
            return None
        stride = 8 + ps if flags & F_PAGE else 9
        limit = min((len(buf) - pos) // stride, (block.length - first) // ps)
        if limit < 2:
            return None
        count = _run_length(buf, pos, first, flags, stride, limit, ps)
        if count < 2:
            return None
        pages = None
        if stride != 9:  # the cursor never writes a buffer again: a refill makes a new one
            pages = np.ndarray((count, ps), np.uint8, buffer=buf, offset=pos + 8, strides=(stride, 1))
        at = inp.offset
        inp.pos += count * stride
        return PageRun(block.name, first, count, pages, at)

    def _bad_flags(self, flags: int, word: int) -> None:
        for bit, feature in UNSUPPORTED_FLAGS.items():
            if flags & bit:
                raise self.inp.unsupported(f"{feature} (RAM flag {bit:#x} in entry {word:#018x})", back=8)
        raise self.inp.error(f"expected RAM flags PAGE, ZERO, MEM_SIZE (first section) or EOS, got {flags:#x}", back=8)

    def _entry_block(self, cont: int) -> RamBlock:
        inp = self.inp
        if cont:
            if self.last_block is None:
                raise inp.error("expected a block name: CONTINUE flag on the first page", back=8)
            return self.last_block
        name = _read_name(inp, "RAM block name")
        block = self.blocks.get(name)
        if block is None:
            raise inp.error(
                f"expected a RAM block listed in MEM_SIZE, got {name!r} (missing from MEM_SIZE)", back=len(name) + 1
            )
        self.last_block = block
        return block

    def _mem_size(self, total: int) -> None:
        inp, seen = self.inp, 0
        while seen < total:
            name = _read_name(inp, "RAM block name")
            length = inp.be64("RAM block length")
            addr = inp.be64("RAM block address") if "x-ignore-shared" in self.capabilities else None
            if name in self.blocks:
                raise inp.error(f"expected unique RAM block names, got {name!r} twice", back=8)
            if length % self.page_size or length == 0 or not name:
                raise inp.error(
                    f"expected a RAM block with a name and a length that is a "
                    f"positive multiple of {self.page_size} (MEM_SIZE {total:#x}, "
                    f"lengths so far add up to {seen:#x}), got {name!r} length "
                    f"{length:#x}",
                    back=8,
                )
            if length > REGION_SIZE_MAX:
                raise inp.error(
                    f"expected a RAM block a lean image region can hold (at most "
                    f"{REGION_SIZE_MAX:#x} bytes), got {name!r} length {length:#x}",
                    back=8,
                )
            self.blocks[name] = RamBlock(name, length, addr)
            seen += length
            if self.file is not None:
                self._mapped_ram_header(name, length)
        if seen != total:
            raise inp.error(f"expected RAM block lengths to add up to MEM_SIZE {total:#x}, got {seen:#x}")

    def _mapped_ram_header(self, name: str, length: int) -> None:
        """A block's mapped-ram header; the stream goes on after the block's pages."""
        inp = self.inp
        at = inp.offset
        raw = inp.take(mapped_ram.HEADER.size, f"mapped-ram header of {name!r}")
        layout = mapped_ram.read_header(
            raw, name, length, self.page_size, at, self.file.size, "x-ignore-shared" in self.capabilities
        )
        self.layouts.append(layout)
        inp.jump(layout.end)

    # --- device sections, EOF, VMDESCRIPTION ------------------------------------------

    def _read_tail(self) -> tuple[list[DeviceSection], bytes | None]:
        inp = self.inp
        inp.structure = f"section[{self.nsections}]"
        base = inp.offset
        tail = Cursor.over_buffer(inp.rest(TAIL_LIMIT, "device state after the RAM"), base)
        parser = _TailParser(tail, self.nsections, self.footers, self.ram.section_id)
        devices = parser.sections()
        vmdesc = parser.trailer()
        _check_vmdesc(devices, vmdesc, parser.vmdesc_at)
        return devices, vmdesc


def _read_name(inp: Cursor, what: str) -> str:
    """A u8 length, then that many ASCII bytes (section idstrs, RAM block names)."""
    raw = inp.take(inp.u8(f"{what} length"), what)
    try:
        return raw.decode("ascii")
    except UnicodeDecodeError:
        raise inp.error(f"expected an ASCII {what}, got {raw!r}", back=len(raw)) from None


def _run_length(buf, pos: int, first: int, flags: int, stride: int, limit: int, ps: int) -> int:
    """How many of the ``limit`` entries at ``pos`` continue the run: headers ``first``,
    ``first + ps``, ... with ``flags`` (and a zero fill byte when stride is 9).  Checked in
    windows that grow 4x, so a short run costs little however much input is buffered; in one
    C pass with the native backend (a real save's runs are short: numpy's calls dominate)."""
    if backend is not None:
        return backend.qemu_run_length(buf, pos, first, flags, stride, limit, ps)
    done, window = 0, 64
    while done < limit:
        n = min(window, limit - done)
        at = pos + done * stride
        headers = np.ndarray((n,), ">u8", buffer=buf, offset=at, strides=(stride,))
        good = headers == (first + ps * np.arange(done, done + n, dtype=np.uint64)) | flags
        if stride == 9:
            good &= np.ndarray((n,), np.uint8, buffer=buf, offset=at + 8, strides=(9,)) == 0
        if not good.all():
            return done + int(np.argmin(good))
        done, window = done + n, window * 4
    return done


class _TailParser:
    """FULL device sections, EOF and VMDESCRIPTION, read with a cursor over the bytes after
    the RAM (held in memory).

    Their bodies are opaque, so a section ends at the first footer (0x7e + its id) that is
    followed by a plausible next structure; the VMDESCRIPTION's device list confirms it."""

    def __init__(self, cur: Cursor, first_index: int, footers: bool | None, ram_id: int):
        self.cur, self.index, self.footers, self.ram_id = cur, first_index, footers, ram_id
        self.vmdesc_at = cur.offset

    def sections(self) -> list[DeviceSection]:
        cur, devices = self.cur, []
        while True:
            cur.structure = f"section[{self.index}]"
            kind = cur.peek_u8()
            if kind != FULL:
                break
            if not self.footers:
                raise cur.unsupported("device sections without section footers (machine types before 2.4)")
            devices.append(self._section())
            self.index += 1
        if kind is None:
            raise cur.error("truncated stream: expected QEMU_VM_EOF, got end of input")
        if kind != EOF:
            raise cur.error(f"expected a FULL section or QEMU_VM_EOF, got {kind:#04x}")
        cur.skip(1, "QEMU_VM_EOF")
        return devices

    def _section(self) -> DeviceSection:
        cur = self.cur
        header = self._header()
        footer = footer_bytes(header.section_id)
        body = cur.take(self._body_length(header, footer), "section body")
        cur.skip(len(footer), "section footer")
        return DeviceSection(FULL, header, body)

    def _body_length(self, header: SectionHeader, footer: bytes) -> int:
        """Bytes from the cursor to the first ``footer`` followed by a plausible next
        structure."""
        cur, eof_candidate, ram_after = self.cur, None, None
        at = cur.find(footer)
        while at >= 0:
            after = at + len(footer)
            if self._plausible_next(after):
                return at
            if eof_candidate is None and cur.peek(1, after) == bytes([EOF]):
                eof_candidate = after
            if ram_after is None and cur.peek(5, after) in (part_header_bytes(k, self.ram_id) for k in (PART, END)):
                ram_after = after
            at = cur.find(footer, at + 1)
        if ram_after is not None:
            raise cur.unsupported(
                f"a RAM section ({SECTION_NAMES[cur.peek(1, ram_after)[0]]}) after device state: "
                f"{header.idstr!r} was sent before the RAM was complete (virtio-mem's early "
                "state)",
                at=cur.offset + ram_after,
            )
        raise self._no_footer(header, eof_candidate)

    def _no_footer(self, header: SectionHeader, eof_candidate: int | None) -> SourceFormatError:
        """A section without its closing footer: garbage after what looks like an EOF (the
        footer found before it), or the input ends."""
        cur = self.cur
        if eof_candidate is not None:
            cur.structure = "after EOF"
            got = cur.peek(1, eof_candidate + 1)[0]
            return cur.error(
                f"expected end of stream or QEMU_VM_VMDESCRIPTION (0x06) after QEMU_VM_EOF, got {got:#04x}",
                at=cur.offset + eof_candidate + 1,
            )
        cur.structure = f"section[{self.index}] FULL {header.idstr!r} id={header.section_id}"
        return cur.error(
            f"truncated stream: expected a section footer 7e "
            f"{header.section_id:08x} followed by a section or EOF, got end of "
            "input",
            at=cur.size,
        )

    def _header(self) -> SectionHeader:
        """The FULL section header at the cursor, up to the body."""
        cur = self.cur
        head = cur.peek(6)
        if len(head) < 6 or cur.remaining() < 6 + head[5] + 8:
            raise cur.error("truncated stream: expected a FULL section header, got end of input", at=cur.size)
        cur.skip(1, "section type")
        section_id = cur.be32("section id")
        idstr = cur.take(cur.u8("section idstr length"), "section idstr")
        if not _printable(idstr):
            raise cur.error(f"expected a printable section idstr, got {idstr!r}", back=len(idstr))
        instance_id, version_id = cur.be32("instance id"), cur.be32("version id")
        return SectionHeader(section_id, idstr.decode(), instance_id, version_id)

    def _plausible_next(self, ahead: int) -> bool:
        """Whether a FULL section header or an EOF (at the end or before VMDESCRIPTION)
        starts ``ahead`` bytes past the cursor."""
        cur = self.cur
        head = cur.peek(6, ahead)
        if not head:
            return False
        if head[0] == EOF:
            return len(head) == 1 or head[1] == VMDESCRIPTION
        if head[0] != FULL or len(head) < 6:
            return False
        n = head[5]
        return n > 0 and cur.remaining() >= ahead + 6 + n + 8 and _printable(cur.peek(n, ahead + 6))

    def trailer(self) -> bytes | None:
        """The VMDESCRIPTION JSON after EOF, or None when the stream ends at EOF."""
        cur = self.cur
        self.vmdesc_at = cur.offset
        kind = cur.peek_u8()
        if kind is None:
            return None
        if kind != VMDESCRIPTION:
            cur.structure = "after EOF"
            raise cur.error(
                f"expected end of stream or QEMU_VM_VMDESCRIPTION (0x06) after QEMU_VM_EOF, got {kind:#04x}"
            )
        cur.structure = "vmdescription"
        if cur.remaining() < 5:
            raise cur.error("truncated stream: expected the VMDESCRIPTION length, got end of input", at=cur.size)
        cur.skip(1, "section type")
        n = cur.be32("VMDESCRIPTION length")
        if cur.remaining() < n:
            raise cur.error(
                f"truncated stream: expected {n} bytes of VMDESCRIPTION JSON, got {cur.remaining()}", at=cur.size
            )
        text = cur.take(n, "VMDESCRIPTION JSON")
        if not cur.at_end():
            cur.structure = "after vmdescription"
            raise cur.error(f"expected end of stream after VMDESCRIPTION, got {cur.remaining()} more bytes")
        return text


def _printable(raw: bytes) -> bool:
    return all(0x20 <= c < 0x7F for c in raw)


def _check_vmdesc(devices: list[DeviceSection], vmdesc: bytes | None, offset: int) -> None:
    if vmdesc is None:
        return
    try:
        desc = json.loads(vmdesc)
        listed = [(d["name"], d["instance_id"]) for d in desc["devices"]]
    except (ValueError, KeyError, TypeError) as e:
        raise SourceFormatError(
            f"expected VMDESCRIPTION JSON with a device list, got {e}", offset=offset, structure="vmdescription"
        ) from None
    found = [(d.header.idstr, d.header.instance_id) for d in devices]
    if listed != found:
        diff = next(i for i in range(max(len(listed), len(found))) if listed[i : i + 1] != found[i : i + 1])
        raise SourceFormatError(
            f"expected device sections to match VMDESCRIPTION, section "
            f"{diff}: described {listed[diff : diff + 1]}, got "
            f"{found[diff : diff + 1]}",
            offset=offset,
            structure="vmdescription",
        )


# ---------------------------------------------------------------------------- writing


def write_qemu_stream(
    out: BinaryIO,
    state: StreamState,
    ram_blocks: Iterable[RamBlock] | None,
    page_source: Callable[[RamBlock], Iterable[Chunk]],
    mapped: bool = False,
) -> int:
    """Write a complete stream to ``out``; return the number of bytes written.

    ``mapped``: a mapped-ram file (``out`` must seek; zero pages are holes), else a stream
    with page entries; either way the configuration lists the capability mapped-ram exactly
    when the output is one, as the loading QEMU checks."""
    blocks = tuple(ram_blocks) if ram_blocks is not None else state.ram_blocks
    state = with_mapped_ram(state, mapped)
    if mapped:
        return _write_mapped(out, state, blocks, page_source)
    w = _RamWriter(out, state, blocks)
    w.put(state.prologue)
    w.start_section()
    for block in blocks:
        for chunk in page_source(block):
            w.chunk(block, chunk)
        w.finish_block(block)
    w.end_sections()
    w.put(_tail_bytes(state))
    return w.written


def _tail_bytes(state: StreamState) -> bytes:
    """The device sections, EOF and VMDESCRIPTION."""
    parts = [dev.to_bytes(state.footers) for dev in state.devices] + [bytes([EOF])]
    if state.vmdesc is not None:
        parts.append(bytes([VMDESCRIPTION]) + BE32.pack(len(state.vmdesc)) + state.vmdesc)
    return b"".join(parts)


def with_mapped_ram(state: StreamState, mapped: bool) -> StreamState:
    """``state`` with the capability mapped-ram on or off (configuration rebuilt)."""
    if (mapped_ram.CAPABILITY in state.capabilities) == mapped:
        return state
    caps = [c for c in state.capabilities if c != mapped_ram.CAPABILITY]
    if mapped:
        caps.append(mapped_ram.CAPABILITY)  # QEMU lists x-ignore-shared first
    return dataclasses.replace(
        state, capabilities=tuple(caps), prologue=_prologue_with_capabilities(state.prologue, caps)
    )


def _prologue_with_capabilities(prologue: bytes, caps: list[str]) -> bytes:
    """The header and configuration section ``prologue`` with its capabilities subsection
    replaced by one listing ``caps`` (none: no subsection, as QEMU writes it), in QEMU's
    subsection order (target-page-bits, capabilities, uuid)."""
    inp = Cursor.over_buffer(prologue, structure="configuration")
    head = inp.take(8, "header")
    if inp.at_end():
        raise UnsupportedError(
            "a stream without a configuration section cannot list capabilities", structure="configuration"
        )
    head += inp.take(1, "section type")
    head += inp.take(4, "machine type length")
    head += inp.take(int.from_bytes(head[-4:], "big"), "machine type")
    subsections = {}
    while not inp.at_end():
        start = inp.offset
        if inp.u8("subsection marker") != SUBSECTION:
            raise inp.error("expected a configuration subsection (0x05)", back=1)
        name = _read_name(inp, "subsection name")
        inp.be32("subsection version")
        if name == "configuration/capabilities":
            for _ in range(inp.be32("capability count")):
                _read_name(inp, "capability")
        elif name in _SUBSECTION_SIZES:
            inp.take(_SUBSECTION_SIZES[name], name)
        else:
            raise inp.unsupported(f"configuration subsection {name!r}")
        subsections[name] = prologue[start : inp.offset]
    if caps:
        listed = b"".join(name_bytes(c) for c in caps)
        subsections["configuration/capabilities"] = (
            bytes([SUBSECTION])
            + name_bytes("configuration/capabilities")
            + BE32.pack(1)
            + BE32.pack(len(caps))
            + listed
        )
    else:
        subsections.pop("configuration/capabilities", None)
    order = ["configuration/target-page-bits", "configuration/capabilities", "configuration/uuid"]
    return head + b"".join(subsections[name] for name in order if name in subsections)


_SUBSECTION_SIZES = {"configuration/target-page-bits": 4, "configuration/uuid": 16}


def _write_mapped(
    out: BinaryIO, state: StreamState, blocks: tuple[RamBlock, ...], page_source: Callable[[RamBlock], Iterable[Chunk]]
) -> int:
    """A mapped-ram file: the block list with each block's header and slots, then the
    original's sections (EOS only) and commands, the device state."""
    if not _output_seeks(out):
        raise UnsupportedError(
            "a mapped-ram file needs an output that can seek (its pages lie at fixed "
            "offsets): give -o FILE, not a pipe",
            structure="output",
        )
    ps, ram = state.page_size, state.ram
    start = out.tell()
    total = sum(b.length for b in blocks)
    out.write(state.prologue + section_header_bytes(START, ram) + BE64.pack(total | F_MEM_SIZE))
    ignore_shared = "x-ignore-shared" in state.capabilities
    for block in blocks:
        out.write(ram_block_bytes(block.name, block.length, (block.addr or 0) if ignore_shared else None))
        layout = mapped_ram.layout_at(block.name, block.length, ps, out.tell() - start)
        out.write(layout.header_bytes())
        slots = mapped_ram.BlockWriter(out, layout, start)
        for chunk in page_source(block):
            _into_slots(slots, chunk, ps)
        slots.finish()
    eos = ram_section_end(ram.section_id, state.footers)
    rest = [eos]
    plan = state.ram_plan if state.ram_plan and state.ram_plan[0][0] == START else [(START, 0), (END, 0)]
    for kind, n in plan[1:]:
        rest.append(command_bytes(n) if kind == COMMAND else part_header_bytes(kind, ram.section_id) + eos)
    out.write(b"".join(rest) + _tail_bytes(state))
    return out.tell() - start


def _output_seeks(out: BinaryIO) -> bool:
    try:
        return out.seekable()
    except (AttributeError, ValueError):
        return False


def _into_slots(slots: mapped_ram.BlockWriter, chunk: Chunk, ps: int) -> None:
    if isinstance(chunk, Zeros):
        slots.zeros(chunk.length // ps)
    elif isinstance(chunk, Pages):
        slots.pages(chunk.data)
    else:
        data = memoryview(chunk).cast("B")
        slots.pages(data, np.frombuffer(data, np.uint64).reshape(-1, ps // 8).any(axis=1))


class _RamWriter:
    """Emits RAM entries, splitting them into START/PART/END sections like the original."""

    def __init__(self, out: BinaryIO, state: StreamState, blocks: tuple[RamBlock, ...]):
        self.out, self.state, self.blocks = out, state, blocks
        self.gather = GatherWriter(out)
        self.ps = state.page_size
        self.last_block: str | None = None
        self.block_pos = 0
        self.plan = _section_plan(state.ram_plan, sum(b.length for b in blocks) // self.ps)
        self.last_section = max(i for i, (kind, _) in enumerate(self.plan) if kind != COMMAND)
        self.section = 0
        self.left = self.plan[0][1]

    @property
    def written(self) -> int:
        return self.gather.written

    def put(self, blob: bytes | memoryview) -> None:
        self.gather.write_all([blob])

    def start_section(self) -> None:
        while self.plan[self.section][0] == COMMAND:
            self.put(command_bytes(self.plan[self.section][1]))
            self.section += 1
        kind = self.plan[self.section][0]
        ram = self.state.ram
        if kind == START:
            self.put(section_header_bytes(START, ram) + self._mem_size())
        else:
            self.put(part_header_bytes(kind, ram.section_id))

    def _close_section(self) -> None:
        self.put(ram_section_end(self.state.ram.section_id, self.state.footers))

    def _next_section(self) -> None:
        while self.left == 0 and self.section < self.last_section:
            self._close_section()
            self.section += 1
            self.start_section()
            self.left = self.plan[self.section][1]

    def end_sections(self) -> None:
        self._next_section()
        if self.left:
            raise ValueError(f"page_source supplied {self.left} pages fewer than planned")
        self._close_section()
        for _, cmd in self.plan[self.section + 1 :]:  # commands after the last RAM section
            self.put(command_bytes(cmd))

    def _mem_size(self) -> bytes:
        total = sum(b.length for b in self.blocks)
        ignore_shared = "x-ignore-shared" in self.state.capabilities
        parts = [BE64.pack(total | F_MEM_SIZE)]
        parts += [ram_block_bytes(b.name, b.length, (b.addr or 0) if ignore_shared else None) for b in self.blocks]
        return b"".join(parts)

    def chunk(self, block: RamBlock, chunk: Chunk) -> None:
        if isinstance(chunk, Zeros):
            self._check(block, chunk.length)
            self._run(block, chunk.length // self.ps, None)
            return
        if isinstance(chunk, Pages):
            data = memoryview(chunk.data).cast("B")
            self._check(block, len(data))
            self._run(block, len(data) // self.ps, data)
            return
        data = memoryview(chunk).cast("B")
        self._check(block, len(data))
        nonzero = np.frombuffer(data, np.uint64).reshape(-1, self.ps // 8).any(axis=1)
        edges = np.flatnonzero(np.diff(nonzero.astype(np.int8))) + 1
        bounds = [0, *edges.tolist(), len(nonzero)]
        for lo, hi in zip(bounds, bounds[1:]):
            self._run(block, hi - lo, data[lo * self.ps : hi * self.ps] if nonzero[lo] else None)

    def _check(self, block: RamBlock, length: int) -> None:
        if length % self.ps or self.block_pos + length > block.length:
            raise ValueError(
                f"page_source chunk of {length} bytes does not fit block "
                f"{block.name!r} at {self.block_pos:#x} (length {block.length:#x})"
            )

    def finish_block(self, block: RamBlock) -> None:
        if self.block_pos != block.length:
            raise ValueError(
                f"page_source supplied {self.block_pos:#x} of block {block.name!r}'s {block.length:#x} bytes"
            )
        self.block_pos = 0

    def _run(self, block: RamBlock, count: int, pages: memoryview | None) -> None:
        """``count`` pages from the current position; ``pages`` None means all zero."""
        done, ps = 0, self.ps
        while done < count:
            self._next_section()
            n = min(count - done, self.left) if self.left else count - done
            sub = None if pages is None else pages[done * ps : (done + n) * ps]
            self.gather.write_all(self._entries(block, self.block_pos, n, sub))
            self.block_pos += n * self.ps
            self.left -= n if self.left else 0
            done += n

    def _entries(self, block: RamBlock, offset: int, n: int, pages: memoryview | None) -> list:
        """n consecutive entries as byte buffers: each is be64 header [+ name] + payload.

        Zero entries after the first are laid out in one array; page entries alternate a
        header with a view of the caller's page, so pages are never copied here.
        """
        ps = self.ps
        first = []
        flag = F_ZERO if pages is None else F_PAGE
        if self.last_block != block.name:
            payload = b"\0" if pages is None else pages[:ps]
            first = [BE64.pack(offset | flag) + name_bytes(block.name), payload]
            self.last_block = block.name
            offset, n = offset + ps, n - 1
            pages = None if pages is None else pages[ps:]
        if n == 0:
            return first
        words = (offset + np.arange(n, dtype=np.uint64) * np.uint64(ps)) | np.uint64(flag | F_CONTINUE)
        headers = words.astype(">u8").view(np.uint8).reshape(n, 8)
        if pages is None:
            entries = np.zeros((n, 9), np.uint8)
            entries[:, :8] = headers
            return first + [memoryview(entries).cast("B")]
        heads = memoryview(headers.tobytes())
        parts = [None] * (2 * n)
        parts[0::2] = [heads[k : k + 8] for k in range(0, 8 * n, 8)]
        parts[1::2] = [pages[k : k + ps] for k in range(0, n * ps, ps)]
        return first + parts


def _section_plan(plan: list[tuple[int, int]], total_pages: int) -> list[tuple[int, int]]:
    """The original's RAM sections and commands when its page count matches (the output is
    then byte-identical), else one PART with every page, the original's commands before END."""
    sections = [n for kind, n in plan if kind != COMMAND]
    if plan and plan[0][0] == START and sum(sections) == total_pages:
        return list(plan)
    commands = [(kind, n) for kind, n in plan if kind == COMMAND]
    return [(START, 0), (PART, total_pages), *commands, (END, 0)]


# ---------------------------------------------------------------------------- state blob

_STATE_MAGIC = b"LEANIMG-QEMU-STATE\0\1"


def _state_to_bytes(s: StreamState) -> bytes:
    """JSON metadata + the opaque blobs, each blob's length recorded in the metadata."""
    blobs = [s.prologue] + [d.body for d in s.devices] + [s.vmdesc or b""]
    meta = {
        "machine": s.machine,
        "page_size": s.page_size,
        "capabilities": list(s.capabilities),
        "ram": dataclasses.asdict(s.ram),
        "ram_blocks": [dataclasses.asdict(b) for b in s.ram_blocks],
        "ram_plan": s.ram_plan,
        "footers": s.footers,
        "devices": [{"kind": d.kind, **dataclasses.asdict(d.header)} for d in s.devices],
        "has_vmdesc": s.vmdesc is not None,
        "blob_lengths": [len(b) for b in blobs],
    }
    text = json.dumps(meta, separators=(",", ":")).encode()
    return _STATE_MAGIC + BE32.pack(len(text)) + text + b"".join(blobs)


def _state_from_bytes(blob: bytes) -> StreamState:
    def bad(msg: str, off: int) -> SourceFormatError:
        return SourceFormatError(msg, offset=off, structure="preserved qemu state")

    if not blob.startswith(_STATE_MAGIC):
        raise bad(f"expected magic {_STATE_MAGIC!r}, got {blob[: len(_STATE_MAGIC)]!r}", 0)
    pos = len(_STATE_MAGIC)
    try:
        n = BE32.unpack_from(blob, pos)[0]
        meta = json.loads(blob[pos + 4 : pos + 4 + n])
        pos += 4 + n
        blobs = []
        for length in meta["blob_lengths"]:
            if pos + length > len(blob):
                raise bad(f"expected {length} bytes of state blob, got {len(blob) - pos}", pos)
            blobs.append(blob[pos : pos + length])
            pos += length
        if pos != len(blob):
            raise bad(f"expected end of state, got {len(blob) - pos} more bytes", pos)
        devices = [
            DeviceSection(d.pop("kind"), SectionHeader(**d), body)
            for d, body in zip(meta["devices"], blobs[1:-1], strict=True)
        ]
        return StreamState(
            prologue=blobs[0],
            machine=meta["machine"],
            page_size=meta["page_size"],
            capabilities=tuple(meta["capabilities"]),
            ram=SectionHeader(**meta["ram"]),
            ram_blocks=tuple(RamBlock(**b) for b in meta["ram_blocks"]),
            ram_plan=_checked_plan(meta["ram_plan"]),
            footers=meta["footers"],
            devices=devices,
            vmdesc=blobs[-1] if meta["has_vmdesc"] else None,
        )
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise bad(f"expected a valid state record, got {e}", pos) from None


def _checked_plan(plan) -> list[tuple[int, int]]:
    """The RAM plan of a state record: RAM sections with their entry counts, SWITCHOVER_START."""
    checked = [tuple(p) for p in plan]
    for entry in checked:
        kind, n = entry
        if not (
            kind in (START, PART, END) and isinstance(n, int) and n >= 0 or entry == (COMMAND, CMD_SWITCHOVER_START)
        ):
            raise ValueError(f"RAM plan entry {entry}")
    return checked


# ---------------------------------------------------------------------------- RAM image


class RamImage:
    """Guest RAM assembled from ``Page`` events in sparse scratch files (last copy wins).

    The scratch files are deleted temporary files (RAM-sized at most, sparse: pages never
    sent or sent as zeros take no space); they vanish when closed or when the process dies."""

    def __init__(self, blocks: RamBlocks, directory: str | os.PathLike | None = None):
        self.page_size = blocks.page_size
        self.blocks = {b.name: b for b in blocks.blocks}
        self._files = {}
        for b in blocks.blocks:
            # deleted at once (O_TMPFILE where the system has it): nothing stays behind a crash
            f = tempfile.TemporaryFile(prefix="leanimg-ram-", dir=directory)
            f.truncate(b.length)
            self._files[b.name] = f
        self.seen = {b.name: _page_table(b, self.page_size, bool, False) for b in blocks.blocks}
        # per page: its spooled content is known to be zeros (never sent, or last sent as a ZERO entry)
        self.zero = {b.name: _page_table(b, self.page_size, bool, True) for b in blocks.blocks}
        # per page: the stream offset where its last copy ends, -1 if never sent (spec/hints.md §3)
        self.last_end = {b.name: _page_table(b, self.page_size, np.int64, -1) for b in blocks.blocks}
        self.stream_length = 0

    def apply(self, page: Page) -> None:
        f = self._files[page.block]
        os.pwrite(f.fileno(), page.content(self.page_size), page.offset)
        self.seen[page.block][page.offset // self.page_size] = True
        self.zero[page.block][page.offset // self.page_size] = False
        self.last_end[page.block][page.offset // self.page_size] = page.end

    def apply_run(self, run: PageRun) -> None:
        """A run of pages; zero pages are written only over a copy sent before (the scratch
        file is sparse, so a page never written reads as zeros)."""
        first = run.offset // self.page_size
        seen = self.seen[run.block][first : first + run.count]
        fd = self._files[run.block].fileno()
        if run.pages is not None:
            os.pwrite(fd, run.data, run.offset)
        elif seen.any():
            os.pwrite(fd, bytes(run.count * self.page_size), run.offset)
        seen[:] = True
        self.zero[run.block][first : first + run.count] = run.pages is None
        self.last_end[run.block][first : first + run.count] = run.ends()

    def read(self, name: str) -> bytes:
        return os.pread(self._files[name].fileno(), self.blocks[name].length, 0)

    def page_source(self, block: RamBlock, chunk: int = 4 << 20) -> Iterator[bytes]:
        fd = self._files[block.name].fileno()
        for off in range(0, block.length, chunk):
            yield os.pread(fd, min(chunk, block.length - off), off)

    def nonzero_spans(self, block: RamBlock, chunk: int = 4 << 20) -> list[tuple[int, int]]:
        """(first, stop) pages: in each ``chunk`` of the block that holds a page not known to be
        zero, from the first such page to the last. Every page outside the spans is zeros."""
        known_zero, per_chunk = self.zero[block.name], max(1, chunk // self.page_size)
        spans = []
        for first in range(0, len(known_zero), per_chunk):
            wanted = np.flatnonzero(~known_zero[first : first + per_chunk])
            if len(wanted):
                spans.append((first + int(wanted[0]), first + int(wanted[-1]) + 1))
        return spans

    def read_pages(self, block: RamBlock, first: int, stop: int) -> bytes:
        ps = self.page_size
        return os.pread(self._files[block.name].fileno(), (stop - first) * ps, first * ps)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "RamImage":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _page_table(block: RamBlock, page_size: int, dtype, fill) -> np.ndarray:
    """One ``dtype`` value per page of ``block``, or a LimitError when that does not fit in this
    process's memory (MEM_SIZE may claim up to 256 TiB)."""
    with fits_in_memory(
        f"RAM block {block.name!r} of {block.length:#x} bytes: a table of its {block.length // page_size} pages",
        "ram MEM_SIZE",
    ):
        return np.full(block.length // page_size, fill, dtype)


def load_stream(f: BinaryIO, directory: str | os.PathLike | None = None) -> tuple[StreamState, RamImage]:
    """Read a whole stream into a ``RamImage``; the caller closes the image."""
    image = None
    try:
        for ev in read_qemu_stream(f, batch=True):
            if isinstance(ev, PageRun):
                image.apply_run(ev)
            elif isinstance(ev, Page):
                image.apply(ev)
            elif isinstance(ev, RamBlocks):
                image = RamImage(ev, directory)
            else:
                image.stream_length = ev.length
                return ev.state, image
    except BaseException:
        if image is not None:
            image.close()
        raise
    raise AssertionError("read_qemu_stream ended without StreamEnd")
