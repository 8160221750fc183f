"""The toyvm plugins: ``SOURCE`` converts a toyvm save into a lean image, ``TARGET``
restores a lean image converted from one to the canonical toyvm save (leanimg.plugins
defines both protocols)."""

from __future__ import annotations

import sys

import numpy as np

from leanimg.errors import SourceFormatError, UnsupportedError
from leanimg.fileutil import open_input
from leanimg.format import PRIVATE_SOURCE_FORMATS
from leanimg.writer import LeanImageWriter

from . import format as toy

# this plugin's SOURCE_STATE format: a private-use value (spec §5.4), chosen at random
SOURCE_FORMAT = PRIVATE_SOURCE_FORMATS | 0x3B5A_7E00
TAG_HEADER = 1  # data: the save's header and device state, verbatim
REGION = "toyvm.ram"
READ_PAGES = 256  # pages handed to the writer at once


class ToyvmSource:
    name = "toyvm"
    description = "a toyvm save"
    signature = f"magic {toy.MAGIC.hex(' ')}"

    def detect(self, head: bytes) -> bool:
        return head.startswith(toy.MAGIC)

    def convert(
        self, save, output: str, *, writer_options: dict | None = None, progress=None, parents=(), disks=None, **options
    ):
        if parents:
            raise UnsupportedError(
                "toyvm saves convert to full images only: --parent is not supported", structure="toyvm"
            )
        if disks:
            raise UnsupportedError("toyvm saves have no disk references: --disk is not supported", structure="toyvm")
        stream = open_input(save)  # a path, - for stdin, or an open binary file
        try:
            page_size, saved_header, memory, sent = _read_save(stream, progress)
        finally:
            if stream is not save and stream is not sys.stdin.buffer:
                stream.close()
        options = {k: v for k, v in (writer_options or {}).items() if v is not None}
        with LeanImageWriter(output, page_size=page_size, **options) as writer:
            writer.declare_source_state()
            writer.add_source_state(SOURCE_FORMAT, TAG_HEADER, saved_header)
            region = writer.add_region(REGION, len(memory) * page_size, guest_phys_base=0)
            for first, count, was_sent in _runs(sent):
                if was_sent:  # all-zero pages become ZERO, the others STORED
                    for at in range(first, first + count, READ_PAGES):
                        writer.put_pages(region, at, memory[at : min(at + READ_PAGES, first + count)])
                else:
                    writer.put_free(region, first, count)
        return None


def _read_save(stream, progress) -> tuple[int, bytes, np.ndarray, np.ndarray]:
    """The page size, header with device state, memory (pages, page_size) and which pages were sent."""
    raw = _read_exactly(stream, toy.HEADER.size, 0, "header")
    magic, version, page_size, ram_size, device_length, reserved = toy.HEADER.unpack(raw)
    if magic != toy.MAGIC:
        raise SourceFormatError(f"expected magic {toy.MAGIC!r}, got {magic!r}", offset=0, structure="toyvm.magic")
    if version != toy.VERSION or reserved:
        raise SourceFormatError(
            f"expected version 1 and reserved 0, got {version} and {reserved}", offset=8, structure="toyvm.version"
        )
    if page_size & (page_size - 1) or not 4096 <= page_size <= 65536:
        raise SourceFormatError(
            f"page_size {page_size} is not a power of two in 4096..65536", offset=12, structure="toyvm.page_size"
        )
    if not ram_size or ram_size % page_size or ram_size > toy.RAM_SIZE_MAX:
        raise SourceFormatError(
            f"ram_size {ram_size} is not a non-zero multiple of {page_size} up to {toy.RAM_SIZE_MAX}",
            offset=16,
            structure="toyvm.ram_size",
        )
    if device_length > toy.DEVICE_LENGTH_MAX:
        raise SourceFormatError(
            f"device_length {device_length} exceeds {toy.DEVICE_LENGTH_MAX}", offset=24, structure="toyvm.device_length"
        )
    saved_header = raw + _read_exactly(stream, device_length, toy.HEADER.size, "devices")
    memory = np.zeros((ram_size // page_size, page_size), np.uint8)
    sent = np.zeros(len(memory), bool)
    offset = len(saved_header)
    while True:
        (word,) = toy.RECORD.unpack(_read_exactly(stream, toy.RECORD.size, offset, "record"))
        kind, page = word & 0xFF, word >> 8
        if kind == toy.END:
            break
        if kind not in (toy.PAGE, toy.ZERO) or page >= len(memory):
            raise SourceFormatError(
                f"expected a PAGE or ZERO record of a page below {len(memory)}, got kind {kind} page {page}",
                offset=offset,
                structure="toyvm.record",
            )
        offset += toy.RECORD.size
        if kind == toy.PAGE:
            memory[page] = np.frombuffer(_read_exactly(stream, page_size, offset, "page"), np.uint8)
            offset += page_size
        else:
            memory[page] = 0
        sent[page] = True
        if progress:
            progress(toy.RECORD.size + (page_size if kind == toy.PAGE else 0))
    return page_size, saved_header, memory, sent


def _read_exactly(stream, size: int, offset: int, what: str) -> bytes:
    """``size`` bytes; a pipe may give fewer at a time, so read until they are there or the save ends."""
    data = bytearray()
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            raise SourceFormatError(
                f"the save ends inside a {what}: {len(data)} of {size} bytes",
                offset=offset + len(data),
                structure=f"toyvm.{what}",
            )
        data += chunk
    return bytes(data)


def _runs(flags: np.ndarray):
    """(first, count, value) of each run of equal values."""
    edges = np.flatnonzero(np.diff(flags.view(np.int8))) + 1
    starts = np.concatenate(([0], edges))
    ends = np.concatenate((edges, [len(flags)]))
    return [(int(a), int(b - a), bool(flags[a])) for a, b in zip(starts, ends)]


class ToyvmTarget:
    name = "toyvm"
    description = "the canonical toyvm save of the image's memory, for `toyvm --restore`"

    def restore(self, image, out, progress=None) -> int:
        saved_header = self._saved_header(image)
        region = image.region(REGION)
        out.write(saved_header)
        written = len(saved_header)
        for first in range(0, region.num_pages, READ_PAGES):
            count = min(READ_PAGES, region.num_pages - first)
            written += self._write_pages(image, region, first, count, out)
            if progress:
                progress(count * image.page_size)
        out.write(toy.record(toy.END))
        out.flush()
        return written + toy.RECORD.size

    @staticmethod
    def _write_pages(image, region, first: int, count: int, out) -> int:
        from leanimg.format import PageClass

        classes = image.classes(region, first, count)
        rows = np.frombuffer(image.region_bytes(region, first, count), np.uint8).reshape(count, -1)
        written = 0
        for k in np.flatnonzero(classes != PageClass.FREE):  # a FREE page was never sent
            if rows[k].any():
                chunk = toy.record(toy.PAGE, first + int(k)) + rows[k].tobytes()
            else:
                chunk = toy.record(toy.ZERO, first + int(k))
            out.write(chunk)
            written += len(chunk)
        return written

    def describe(self, image) -> str | None:
        states = [s for s in image.source_states if s.source_format == SOURCE_FORMAT and s.tag == TAG_HEADER]
        return f"a toyvm save ({len(states[0].data)} bytes of header and device state)" if states else None

    @staticmethod
    def _saved_header(image) -> bytes:
        for state in image.source_states:
            if state.source_format == SOURCE_FORMAT and state.tag == TAG_HEADER and state.data.startswith(toy.MAGIC):
                return state.data
        raise UnsupportedError(
            "the image was not converted from a toyvm save (no toyvm SOURCE_STATE): use --to raw",
            structure="source_state",
        )


SOURCE = ToyvmSource()
TARGET = ToyvmTarget()
