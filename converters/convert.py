"""Hypervisor save file → lean image.

The source format is named, or detected from its first bytes (converters/formats.py, through
the plugin registry leanimg.plugins). A QEMU stream becomes one
region per RAM block; zero pages become ZERO, the rest STORED, and everything
but the pages (configuration, device sections, RAM section plan, VMDESCRIPTION)
is kept as one SOURCE_STATE record so restore can rebuild a stream QEMU accepts.
A libvirt save image (converters/libvirt.py) is its QEMU stream plus SOURCE_STATE tag 3 with
libvirt's header, domain XML and cookie.
A Xen stream (xl, libxl or libxc) becomes the region ``xen-pfn`` and one SOURCE_STATE
record with the stream's skeleton (converters/xen.py).
"""

from __future__ import annotations

import io
import sys
from dataclasses import dataclass, field
from typing import BinaryIO

import numpy as np

from leanimg.arrays import stretches
from leanimg.errors import SourceFormatError, UnsupportedError
from leanimg.fileutil import PrefixedInput, open_input, read_ahead
from leanimg.format import SourceFormat
from leanimg.incremental import AgainstParent, parent_link
from leanimg.plugins import HEAD_BYTES, detect_source
from leanimg.reader import LeanImage
from leanimg.writer import LeanImageWriter, PageGivenTwice

from . import qemu, xen
from .diskrefs import BlockIndex, DiskPages, DiskSummary, StreamedDiskPages, classify_by_disks, declare_disks
from .hinting import HintOptions, HintPlan
from .source_state import (
    QEMU_TAG_LIBVIRT_HEADER,
    QEMU_TAG_STREAM_STATE,
    XEN_TAG_SKELETON,
    pack_libvirt_header,
    pack_skeleton,
    pack_stream_state,
)

RUN_PAGES = 256
READ_AHEAD_WHILE_INDEXING = 1 << 30  # bytes of a saved stream read into the page cache as the disks are indexed


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

    sources: dict = field(default_factory=dict)  # name -> leanimg.disks.DiskSource
    all_phases: bool = False
    progress: object = None
    summary: DiskSummary | None = None
    scan: bool = True  # scan the disks for pages (with DISK hints: only when asked)

    def close(self) -> None:
        for disk in self.sources.values():
            disk.close()


class RepeatedPages(Exception):
    """The stream sends a page twice (a live save): convert it with spooling."""


def _page_sink(writer: LeanImageWriter, parent, names: dict[int, str], disk_stage: DiskPages | None = None):
    """Where a converter's pages go: by content (put_pages), or classified against the parent
    image when there is one. ``disk_stage`` goes in front of what would be written by content:
    pages found on the disks become DISK; with a parent only pages changed since it are looked
    up (an unchanged page stays PARENT: a digest, no reference, no disk read at restore)."""
    if parent is None:
        if disk_stage is None:
            return writer.put_pages
        disk_stage.inner = writer.put_pages_at
        return disk_stage.put
    feeder = AgainstParent(writer, parent)
    if disk_stage is not None:
        disk_stage.inner, feeder.changed = _in_runs(feeder.put_changed), disk_stage.put
    return lambda region, first, data: feeder.put_pages(region, names[region], first, _contiguous(data))


def _in_runs(put_run):
    """A put_pages_at(region, page numbers, rows) made of put_run(region, first page, data)
    calls, one for each run of consecutive page numbers."""

    def put_pages_at(region_id: int, pages: np.ndarray, rows: np.ndarray) -> None:
        for a, b in stretches(pages, step=1):
            put_run(region_id, int(pages[a]), rows[a:b])

    return put_pages_at


def _contiguous(data):
    return np.ascontiguousarray(data) if isinstance(data, np.ndarray) else data


def convert_qemu(
    source: BinaryIO,
    writer: LeanImageWriter,
    progress=None,
    parent=None,
    hints: HintOptions | None = None,
    disks: DiskOptions | None = None,
) -> qemu.StreamState:
    """Stream a QEMU migration stream into ``writer``; each page must come once.

    With ``parent`` (an open LeanImage), pages are classified against it. A page sent
    twice (a live save) raises RepeatedPages, wherever the writer notices it. With ``hints``,
    FREE hints apply by the stream-offset rule and DISK hints are verified against ``disks``.
    With ``disks`` to scan, the disks are indexed when the stream's RAM blocks are known and
    each page is looked up as it arrives (diskrefs.StreamedDiskPages; ``disks.summary``).
    """
    try:
        return _stream_into(source, writer, progress, parent, hints, disks)
    except PageGivenTwice as exc:
        raise RepeatedPages(str(exc)) from None


def _stream_into(
    source: BinaryIO, writer: LeanImageWriter, progress, parent, hints=None, disks=None
) -> qemu.StreamState:
    writer.declare_source_state()
    regions: dict[str, int] = {}
    names: dict[int, str] = {}
    put_data = runs = plan = streamed = None
    page_size = None
    for event in qemu.read_qemu_stream(source, batch=True):
        if isinstance(event, qemu.PageRun):
            runs.flush()
            region, first = regions[event.block], event.offset // page_size
            free = plan.free_mask(region, first, event.ends()) if plan else None
            if free is not None and free.any():
                _put_run_hinted(writer, put_data, region, first, event, free)
            elif event.pages is None:
                writer.put_zero(region, first, event.count)
            else:
                put_data(region, first, event.pages)
            if progress:
                progress(event.count * page_size)
        elif isinstance(event, qemu.Page):
            data = event.data
            if data is None and event.fill:
                data = event.content(page_size)
            region, page = regions[event.block], event.offset // page_size
            if plan and plan.free_mask(region, page, np.array([event.end], np.int64))[0]:
                runs.flush()
                writer.put_free(region, page)
            else:
                runs.add(region, page, data)
            if progress:
                progress(page_size)
        elif isinstance(event, qemu.RamBlocks):
            page_size = event.page_size
            _check_page_size(page_size, writer)
            for block in event.blocks:
                regions[block.name] = writer.add_region(block.name, block.length)
                names[regions[block.name]] = block.name
            if disks and disks.scan:
                streamed = StreamedDiskPages(
                    writer, disks.sources, all_phases=disks.all_phases, progress=disks.progress
                )
            put_data = _page_sink(writer, parent, names, streamed.sink if streamed else None)
            if hints:
                plan = _plan(hints, writer, "qemu", regions, disks, parent)
                put_data = plan.disk_sink(put_data)
            runs = _RunBuffer(writer, page_size, put_data)
        else:
            runs.flush()
            if streamed:
                streamed.sink.flush()
            if plan:
                plan.check_length(event.length)
                plan.finish()
            _free_unsent(writer, regions)
            if disks and disks.scan:
                disks.summary = streamed.summary()
            writer.add_source_state(SourceFormat.QEMU, QEMU_TAG_STREAM_STATE, pack_stream_state(event.state))
            return event.state
    raise SourceFormatError("stream ended without QEMU_VM_EOF", structure="stream")


def write_spooled(
    writer: LeanImageWriter,
    state: qemu.StreamState,
    ram: qemu.RamImage,
    *,
    parent=None,
    disks: DiskOptions | None = None,
    hints: HintOptions | None = None,
    unsent_free: bool = False,
) -> None:
    """The RAM a stream was spooled into (qemu.load_stream) and its state, into ``writer``.

    ``unsent_free``: pages the stream never sent (free pages QEMU skipped under virtio-balloon
    free-page hinting) become FREE; otherwise they are read from the spool as zeros.
    """
    _check_page_size(state.page_size, writer)
    writer.declare_source_state()
    names: dict[int, str] = {}
    regions = []
    for block in state.ram_blocks:
        region = writer.add_region(block.name, block.length)
        names[region] = block.name
        regions.append((region, block))
    ps = ram.page_size

    spans = {block.name: ram.nonzero_spans(block) for _, block in regions}

    def feed(sink):
        """The spooled pages, but for those outside ``spans`` (zeros, which _put_zeros writes)."""
        for region, block in regions:
            seen = ram.seen[block.name]
            for first, stop in spans[block.name]:
                chunk = ram.read_pages(block, first, stop)
                if not unsent_free:
                    sink(region, first, chunk)
                else:
                    view = memoryview(chunk)
                    for a, b in _true_runs(seen[first:stop]):
                        sink(region, first + a, view[a * ps : b * ps])

    plan = None
    if hints:
        plan = _plan(
            hints, writer, "qemu", {block.name: region for region, block in regions}, disks, parent, ram.stream_length
        )
        for region, block in regions:
            plan.free_pages(region, ram.last_end[block.name])
    for region, block in regions:
        zeros = _outside(spans[block.name], len(ram.zero[block.name]))
        if unsent_free:
            zeros &= ram.seen[block.name]
        _put_zeros(writer, plan, region, zeros & writer.missing_pages(region))
    _write_hinted_pages(writer, feed, lambda stage: _page_sink(writer, parent, names, stage), disks, plan)
    if unsent_free:
        _free_unsent(writer, {name: region for region, name in names.items()})
    writer.add_source_state(SourceFormat.QEMU, QEMU_TAG_STREAM_STATE, pack_stream_state(state))


def _outside(spans: list[tuple[int, int]], pages: int) -> np.ndarray:
    flags = np.ones(pages, bool)
    for first, stop in spans:
        flags[first:stop] = False
    return flags


def _put_zeros(writer: LeanImageWriter, plan, region_id: int, zeros: np.ndarray) -> None:
    """ZERO for pages the spool knows to be zeros, without reading them (a hint plan counts
    the DISK hints it had for them: a zero page stays ZERO)."""
    if plan is not None:
        zeros = plan.zero_pages(region_id, zeros)
    for a, b in _true_runs(zeros):
        writer.put_zero(region_id, a, b - a)


def _true_runs(flags: np.ndarray):
    """(start, stop) of every run of True in ``flags``."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], flags.view(np.int8), [0]))))
    return zip(edges[::2].tolist(), edges[1::2].tolist())


def convert_xen(
    source: BinaryIO,
    writer: LeanImageWriter,
    progress=None,
    parent=None,
    workdir=None,
    disks: DiskOptions | None = None,
    hints: HintOptions | None = None,
) -> xen.ScanResult:
    """Convert the Xen stream in the seekable file ``source`` into ``writer``: region
    ``xen-pfn`` (page p = pfn p), the last copy of each page, holes FREE, and the
    skeleton as SOURCE_STATE (source_format XEN, tag 1). With ``disks``, pages found on
    them become DISK references (the pages are read twice)."""
    if writer.page_size != xen.PAGE_SIZE:
        raise UnsupportedError(
            f"Xen streams have {xen.PAGE_SIZE}-byte pages, the image {writer.page_size}", structure="--parent"
        )
    writer.declare_source_state()
    result = xen.scan(source, workdir)
    with result.skeleton:
        region = writer.add_region(xen.REGION_NAME, max(result.num_pfns, 1) * xen.PAGE_SIZE, guest_phys_base=0)
        names = {region: xen.REGION_NAME}

        def feed(sink):
            xen.feed_pages(source, result, lambda pfn, data: sink(region, pfn, data), None if disks else progress)

        plan = None
        if hints:
            plan = _plan(hints, writer, "xen", {xen.REGION_NAME: region}, disks, parent, result.length)
            last_end = np.full(writer.page_classes(region).shape[0], -1, np.int64)
            last_end[: len(result.last_end)] = result.last_end
            plan.free_pages(region, last_end)
        _write_hinted_pages(writer, feed, lambda stage: _page_sink(writer, parent, names, stage), disks, plan)
        _free_unsent(writer, {xen.REGION_NAME: region})
        writer.add_source_state(SourceFormat.XEN, XEN_TAG_SKELETON, pack_skeleton(result.skeleton))
    return result


def _plan(
    hints: HintOptions,
    writer: LeanImageWriter,
    source: str,
    regions: dict,
    disks,
    parent,
    stream_length: int | None = None,
) -> HintPlan:
    """The hints resolved against this save: ``regions`` by name -> region id."""
    sizes = {name: (rid, writer.page_classes(rid).shape[0]) for name, rid in regions.items()}
    return HintPlan(hints, writer, source, sizes, disks.sources if disks else {}, parent, stream_length)


def _put_run_hinted(writer: LeanImageWriter, put_data, region: int, first: int, run, free: np.ndarray) -> None:
    """A run of pages of which some are FREE by a hint: FREE runs, ZERO or data runs for the rest."""
    edges = np.flatnonzero(np.diff(free.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(free)]
    for a, b in zip(bounds, bounds[1:]):
        if free[a]:
            writer.put_free(region, first + a, b - a)
        elif run.pages is None:
            writer.put_zero(region, first + a, b - a)
        else:
            put_data(region, first + a, run.pages[a:b])


def _write_hinted_pages(writer: LeanImageWriter, feed, sink_with, disks: DiskOptions | None, plan) -> None:
    """_write_pages with a HintPlan (or None): its FREE pages skipped, its DISK hints verified
    before the sink sees a page, and what the hints did counted at the end."""
    if plan is None:
        _write_pages(writer, feed, sink_with, disks)
        return
    _write_pages(writer, lambda sink: feed(plan.skip_free(sink)), lambda stage: plan.disk_sink(sink_with(stage)), disks)
    plan.finish()


def _write_pages(writer: LeanImageWriter, feed, sink_with, disks: DiskOptions | None) -> None:
    """Every page ``feed`` gives through the sink ``sink_with(None)`` makes (see _page_sink); with
    ``disks`` to scan, through ``sink_with(disk lookup)``, ``feed`` then called twice."""
    if disks and disks.scan:
        disks.summary = classify_by_disks(
            writer, disks.sources, feed, sink_with, all_phases=disks.all_phases, progress=disks.progress
        )
    else:
        feed(sink_with(None))


def _check_page_size(page_size: int, writer: LeanImageWriter) -> None:
    if page_size != writer.page_size:
        raise UnsupportedError(
            f"stream page size {page_size}, image page size {writer.page_size}", structure="ram MEM_SIZE"
        )


def _free_unsent(writer: LeanImageWriter, regions: dict[str, int]) -> None:
    """Pages the stream never sent keep the destination's own content: FREE."""
    for region_id in regions.values():
        for first, count in writer.missing_runs(region_id):
            writer.put_free(region_id, first, count)


def convert_file(
    src,
    dest: str,
    *,
    source_format: str | None = None,
    spool: bool | None = None,
    writer_options: dict | None = None,
    progress=None,
    parents=(),
    allow_delta: bool = True,
    disks: DiskOptions | None = None,
    hints: HintOptions | None = None,
) -> str:
    """Convert the save file ``src`` (a path, ``-`` for stdin, or an open binary file) into the
    lean image ``dest``; ``source_format`` names the format (by default: detected).

    ``parents``: the parent image first, then any of its ancestors (matched by UUID; the
    parent's directory is searched too). The new image is written against the parent.
    ``disks``: pages found on these disks become DISK references (the RAM is spooled).
    ``hints``: hints to apply (spec/hints.md); their structure is checked before anything is read.
    """
    if hints and not hints.deferred:
        hints.load()
    if not parents:
        return _convert(src, dest, source_format, spool, dict(writer_options or {}), progress, None, disks, hints)
    with LeanImage.open(parents[0], parents=list(parents[1:])) as parent:
        if disks:
            lend_disks(parent, disks.sources)
        options = dict(
            writer_options or {}, parent=parent_link(parent), allow_delta=allow_delta, page_size=parent.page_size
        )
        return _convert(src, dest, source_format, spool, options, progress, parent, disks, hints)


def lend_disks(parent: LeanImage, sources: dict) -> None:
    """Attach the --disk sources the parent chain's disk tables name (where size and fingerprint
    match) to the parent, so that a page that changed since it was a DISK page of the parent
    can be read to encode its delta. The parent closes them; closing twice is harmless."""
    from leanimg.errors import DiskError

    names = {info.name for link in parent.chain() for info in link.disks}
    for name, disk in sources.items():
        if name in names:
            try:
                parent.attach_disks({name: disk})
            except DiskError:  # another disk of that name: the pages it held stay unread
                pass


def _convert(src, dest, source_format, spool, writer_options, progress, parent, disks=None, hints=None) -> str:
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
            _convert_xen(stream if seekable else body, seekable, dest, writer_options, progress, parent, disks, hints)
            return fmt
        if fmt == "libvirt":
            _convert_libvirt(stream if seekable else body, dest, spool, writer_options, progress, parent, disks, hints)
            return fmt
        if fmt != "qemu":
            raise UnsupportedError(f"source format {fmt!r} is not implemented", structure="--from")
        _convert_qemu(body, dest, spool, writer_options, progress, parent, disks, hints)
        return fmt
    finally:
        if stream is not sys.stdin.buffer:
            stream.close()


def _convert_qemu(
    body: BinaryIO, dest, spool, writer_options, progress, parent, disks=None, hints=None, states=()
) -> None:
    """The QEMU stream ``body`` (read from its first byte) into the image ``dest``; ``states``:
    more SOURCE_STATE records (source_format, tag, data) to write after the stream state."""

    def write(convert_into):
        with LeanImageWriter(dest, **writer_options) as writer:
            if disks:
                declare_disks(writer, disks.sources)
            convert_into(writer)
            for state in states:
                writer.add_source_state(*state)

    def spooled(writer):
        """For streams that resend pages: RAM assembled in scratch files first, the last copy of
        each page wins. With ``disks``, pages found on one of the disks become DISK references
        (two passes over the spooled RAM, one over each disk)."""
        state, ram = qemu.load_stream(body)
        with ram:
            write_spooled(writer, state, ram, parent=parent, disks=disks, hints=hints)

    if spool or (disks and disks.scan and not BlockIndex.fits(disks.sources, writer_options.get("page_size", 4096))):
        write(spooled)
        return
    if disks and disks.scan:  # the disks are read and indexed before the first page: read the stream meanwhile
        read_ahead(body, READ_AHEAD_WHILE_INDEXING)
    try:
        write(lambda writer: convert_qemu(body, writer, progress, parent, hints, disks))
    except RepeatedPages as exc:
        if not body.seekable():
            raise UnsupportedError(
                f"this stream sends pages more than once (a live save: {exc}); convert it with --spool", structure="ram"
            ) from None
        body.seek(0)
        write(spooled)


def _convert_libvirt(stream: BinaryIO, dest, spool, writer_options, progress, parent, disks=None, hints=None) -> None:
    """libvirt's save image: its header, XML and cookie checked and kept as SOURCE_STATE tag 3,
    its payload (decompressed while read) converted as the QEMU stream it is."""
    from . import libvirt

    header = libvirt.read_save_header(stream, libvirt.file_size(stream))
    if progress:
        progress(header.payload_offset)
    payload = libvirt.open_payload(stream, header)
    try:
        _convert_qemu(
            payload,
            dest,
            spool,
            writer_options,
            progress,
            parent,
            disks,
            hints,
            states=[(SourceFormat.QEMU, QEMU_TAG_LIBVIRT_HEADER, pack_libvirt_header(header))],
        )
    except (SourceFormatError, UnsupportedError) as exc:
        if exc.structure and exc.structure.startswith(("--", "source_state")):
            raise
        raise libvirt.payload_error(exc, header) from None
    finally:
        payload.close()


def _convert_xen(source, seekable, dest, writer_options, progress, parent, disks, hints=None) -> None:
    """Xen streams are read twice (see converters/xen.py): a pipe is copied to a scratch file."""
    spooled = None if seekable else xen.spool_to_file(source)
    try:
        with LeanImageWriter(dest, **writer_options) as writer:
            if disks:
                declare_disks(writer, disks.sources)
            convert_xen(spooled or source, writer, progress, parent, disks=disks, hints=hints)
    finally:
        if spooled is not None:
            spooled.close()
