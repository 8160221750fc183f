"""Hypervisor save file → lean image.

The source format is named, or detected from its first bytes (converters/formats.py, through
the plugin registry leanimg.plugins). A QEMU stream becomes one
region per RAM block; zero pages become ZERO, the rest STORED, and everything
but the pages (configuration, device sections, RAM section plan, VMDESCRIPTION)
is kept as one SOURCE_STATE record so restore can rebuild a stream QEMU accepts.
A Xen stream (xl, libxl or libxc) becomes the region ``xen-pfn`` and one SOURCE_STATE
record with the stream's skeleton (converters/xen.py).
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from leanimg.errors import SourceFormatError, UnsupportedError
from leanimg.fileutil import PrefixedInput, open_input
from leanimg.format import SourceFormat
from leanimg.incremental import AgainstParent, parent_link
from leanimg.plugins import HEAD_BYTES, detect_source
from leanimg.reader import LeanImage
from leanimg.writer import LeanImageWriter, PageGivenTwice

from . import qemu, xen
from .diskrefs import DiskSummary, classify_by_disks, declare_disks
from .source_state import QEMU_TAG_STREAM_STATE, XEN_TAG_SKELETON, pack_skeleton, pack_stream_state

RUN_PAGES = 256


class _RunBuffer:
    """Collects contiguous pages of one block and hands them to the writer in runs."""

    def __init__(self, writer: LeanImageWriter, page_size: int, put_data):
        self.writer, self.page_size, self.put_data = writer, page_size, put_data
        self.region = self.next_page = None
        self.kind = None
        self.data: list[bytes] = []
        self.count = 0

    def add(self, region: int, page: int, data: bytes | None) -> None:
        kind = "zero" if data is None else "data"
        if (region, page, kind) != (self.region, self.next_page, self.kind) or self.count >= RUN_PAGES:
            self.flush()
            self.region, self.kind, self.first = region, kind, page
        if data is not None:
            self.data.append(data)
        self.count += 1
        self.next_page = page + 1

    def flush(self) -> None:
        if not self.count:
            return
        if self.kind == "zero":
            self.writer.put_zero(self.region, self.first, self.count)
        else:
            self.put_data(self.region, self.first, b"".join(self.data))
        self.data, self.count, self.next_page = [], 0, None


@dataclass
class DiskOptions:
    """``convert --disk``: the open disks by name, how to scan them, and what came of it."""
    sources: dict = field(default_factory=dict)          # name -> leanimg.disks.DiskSource
    all_phases: bool = False
    progress: object = None
    summary: DiskSummary | None = None

    def close(self) -> None:
        for disk in self.sources.values():
            disk.close()


class RepeatedPages(Exception):
    """The stream sends a page twice (a live save): convert it with spooling."""


def _page_sink(writer: LeanImageWriter, parent, names: dict[int, str]):
    """put_pages, or classification against the parent image when there is one."""
    if parent is None:
        return writer.put_pages
    feeder = AgainstParent(writer, parent)
    return lambda region, first, data: feeder.put_pages(region, names[region], first, _contiguous(data))


def _contiguous(data):
    return np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data


def convert_qemu(source: BinaryIO, writer: LeanImageWriter, progress=None, parent=None) -> qemu.StreamState:
    """Stream a QEMU migration stream into ``writer``; each page must come once.

    With ``parent`` (an open LeanImage), pages are classified against it. A page sent
    twice (a live save) raises RepeatedPages, wherever the writer notices it.
    """
    try:
        return _stream_into(source, writer, progress, parent)
    except PageGivenTwice as exc:
        raise RepeatedPages(str(exc)) from None


def _stream_into(source: BinaryIO, writer: LeanImageWriter, progress, parent) -> qemu.StreamState:
    writer.declare_source_state()
    regions: dict[str, int] = {}
    names: dict[int, str] = {}
    put_data = _page_sink(writer, parent, names)
    runs = None
    page_size = None
    for event in qemu.read_qemu_stream(source, batch=True):
        if isinstance(event, qemu.PageRun):
            runs.flush()
            region, first = regions[event.block], event.offset // page_size
            if event.pages is None:
                writer.put_zero(region, first, event.count)
            else:
                put_data(region, first, event.pages)
            if progress:
                progress(event.count * page_size)
        elif isinstance(event, qemu.Page):
            data = event.data
            if data is None and event.fill:
                data = event.content(page_size)
            runs.add(regions[event.block], event.offset // page_size, data)
            if progress:
                progress(page_size)
        elif isinstance(event, qemu.RamBlocks):
            page_size = event.page_size
            _check_page_size(page_size, writer)
            runs = _RunBuffer(writer, page_size, put_data)
            for block in event.blocks:
                regions[block.name] = writer.add_region(block.name, block.length)
                names[regions[block.name]] = block.name
        else:
            runs.flush()
            _free_unsent(writer, regions)
            writer.add_source_state(SourceFormat.QEMU, QEMU_TAG_STREAM_STATE, pack_stream_state(event.state))
            return event.state
    raise SourceFormatError("stream ended without QEMU_VM_EOF", structure="stream")


def convert_qemu_spooled(source: BinaryIO, writer: LeanImageWriter, workdir=None, parent=None,
                         disks: DiskOptions | None = None) -> qemu.StreamState:
    """Like convert_qemu for streams that resend pages: the last copy of each page wins.

    With ``disks``, pages found on one of the disks become DISK references (two passes
    over the spooled RAM, one over each disk).
    """
    writer.declare_source_state()
    names: dict[int, str] = {}
    put_data = _page_sink(writer, parent, names)
    state, ram = qemu.load_stream(source, workdir)
    with ram:
        _check_page_size(state.page_size, writer)
        regions = []
        for block in state.ram_blocks:
            region = writer.add_region(block.name, block.length)
            names[region] = block.name
            regions.append((region, block))

        def feed(sink):
            for region, block in regions:
                page = 0
                for chunk in ram.page_source(block):
                    sink(region, page, chunk)
                    page += len(chunk) // ram.page_size

        _write_pages(writer, feed, put_data, disks)
    writer.add_source_state(SourceFormat.QEMU, QEMU_TAG_STREAM_STATE, pack_stream_state(state))
    return state


def convert_xen(source: BinaryIO, writer: LeanImageWriter, progress=None, parent=None,
                workdir=None, disks: DiskOptions | None = None) -> xen.ScanResult:
    """Convert the Xen stream in the seekable file ``source`` into ``writer``: region
    ``xen-pfn`` (page p = pfn p), the last copy of each page, holes FREE, and the
    skeleton as SOURCE_STATE (source_format XEN, tag 1). With ``disks``, pages found on
    them become DISK references (the pages are read twice)."""
    if writer.page_size != xen.PAGE_SIZE:
        raise UnsupportedError(f"Xen streams have {xen.PAGE_SIZE}-byte pages, the image {writer.page_size}",
                               structure="--parent")
    writer.declare_source_state()
    result = xen.scan(source, workdir)
    with result.skeleton:
        region = writer.add_region(xen.REGION_NAME, max(result.num_pfns, 1) * xen.PAGE_SIZE, guest_phys_base=0)
        put_data = _page_sink(writer, parent, {region: xen.REGION_NAME})
        def feed(sink):
            xen.feed_pages(source, result, lambda pfn, data: sink(region, pfn, data), None if disks else progress)

        _write_pages(writer, feed, put_data, disks)
        _free_unsent(writer, {xen.REGION_NAME: region})
        writer.add_source_state(SourceFormat.XEN, XEN_TAG_SKELETON, pack_skeleton(result.skeleton))
    return result


def _write_pages(writer: LeanImageWriter, feed, put_data, disks: DiskOptions | None) -> None:
    """Every page ``feed`` gives through ``put_data``; with ``disks``, pages found on them first
    become DISK references (``feed`` is then called twice)."""
    if disks:
        disks.summary = classify_by_disks(writer, disks.sources, feed, put_data,
                                          all_phases=disks.all_phases, progress=disks.progress)
    else:
        feed(put_data)


def _check_page_size(page_size: int, writer: LeanImageWriter) -> None:
    if page_size != writer.page_size:
        raise UnsupportedError(f"stream page size {page_size}, image page size {writer.page_size}",
                               structure="ram MEM_SIZE")


def _free_unsent(writer: LeanImageWriter, regions: dict[str, int]) -> None:
    """Pages the stream never sent keep the destination's own content: FREE."""
    for region_id in regions.values():
        for first, count in writer.missing_runs(region_id):
            writer.put_free(region_id, first, count)


def convert_file(src, dest: str, *, source_format: str | None = None, spool: bool | None = None,
                 writer_options: dict | None = None, progress=None, parents=(),
                 allow_delta: bool = True, disks: DiskOptions | None = None) -> str:
    """Convert the save file ``src`` (a path, ``-`` for stdin, or an open binary file) into the
    lean image ``dest``; ``source_format`` names the format (by default: detected).

    ``parents``: the parent image first, then any of its ancestors (matched by UUID; the
    parent's directory is searched too). The new image is written against the parent.
    ``disks``: pages found on these disks become DISK references (the RAM is spooled).
    """
    if not parents:
        return _convert(src, dest, source_format, spool, dict(writer_options or {}), progress, None, disks)
    with LeanImage.open(parents[0], parents=list(parents[1:])) as parent:
        options = dict(writer_options or {}, parent=parent_link(parent), allow_delta=allow_delta,
                       page_size=parent.page_size)
        return _convert(src, dest, source_format, spool, options, progress, parent, disks)


def _convert(src, dest, source_format, spool, writer_options, progress, parent, disks=None) -> str:
    stream = open_input(src)
    try:
        head = stream.read(HEAD_BYTES) if source_format is None else b""
        fmt = source_format or detect_source(head).name
        seekable = stream.seekable()
        if seekable:
            stream.seek(0)
            body = stream
        else:
            body = io.BufferedReader(PrefixedInput(head, stream), 1 << 20)
        if fmt == "xen":
            _convert_xen(stream if seekable else body, seekable, dest, writer_options, progress, parent, disks)
            return fmt
        if fmt != "qemu":
            raise UnsupportedError(f"source format {fmt!r} is not implemented", structure="--from")
        if spool or disks:
            with LeanImageWriter(dest, **writer_options) as writer:
                if disks:
                    declare_disks(writer, disks.sources)
                convert_qemu_spooled(body, writer, parent=parent, disks=disks)
            return fmt
        try:
            with LeanImageWriter(dest, **writer_options) as writer:
                convert_qemu(body, writer, progress, parent)
        except RepeatedPages as exc:
            if not seekable:
                raise UnsupportedError(f"this stream sends pages more than once (a live save: {exc}); "
                                       "convert it with --spool", structure="ram") from None
            stream.seek(0)
            with LeanImageWriter(dest, **writer_options) as writer:
                convert_qemu_spooled(stream, writer, parent=parent)
        return fmt
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def _convert_xen(source, seekable, dest, writer_options, progress, parent, disks) -> None:
    """Xen streams are read twice (see converters/xen.py): a pipe is copied to a scratch file."""
    spooled = None if seekable else xen.spool_to_file(source)
    try:
        with LeanImageWriter(dest, **writer_options) as writer:
            if disks:
                declare_disks(writer, disks.sources)
            convert_xen(spooled or source, writer, progress, parent, disks=disks)
    finally:
        if spooled is not None:
            spooled.close()
