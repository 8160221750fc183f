"""Restore to a QEMU 7.2 migration stream that `qemu-system-x86_64 -incoming` accepts."""

from __future__ import annotations

from typing import BinaryIO


from leanimg.converters import qemu
from leanimg.converters.convert import QEMU_TAG_STREAM_STATE, unpack_stream_state
from leanimg.errors import FormatError, UnsupportedError
from leanimg.format import PageClass, SourceFormat
from leanimg.reader import LeanImage

def stream_state(image: LeanImage) -> qemu.StreamState:
    for state in image.source_states:
        if state.source_format == SourceFormat.QEMU and state.tag == QEMU_TAG_STREAM_STATE:
            return unpack_stream_state(state.data, state.offset)
    raise UnsupportedError("the image has no QEMU stream state (SOURCE_STATE tag 1): it was not "
                           "converted from a QEMU save; use --to raw", structure="source_state")


def _page_source(image: LeanImage, progress):
    def source(block: qemu.RamBlock):
        region = image.region(block.name)
        if region.size_bytes != block.length:
            raise FormatError(f"region {block.name!r} has {region.size_bytes} bytes, the stream state "
                              f"says {block.length}", structure=f"region[{region.region_id}]")
        classes = image.classes(region)
        blank = (classes == PageClass.ZERO) | (classes == PageClass.FREE)
        step = image.restore_chunk_pages
        for first in range(0, region.num_pages, step):
            count = min(step, region.num_pages - first)
            if blank[first:first + count].all():
                chunk = qemu.Zeros(count * image.page_size)
            else:
                chunk = image.region_bytes(region, first, count)
            if progress:
                progress(count * image.page_size)
            yield chunk
    return source


def restore_qemu(image: LeanImage, out: BinaryIO, progress=None) -> int:
    """Write the rebuilt stream to ``out``; return its length."""
    state = stream_state(image)
    image.enable_read_ahead()
    written = qemu.write_qemu_stream(out, state, state.ram_blocks, _page_source(image, progress))
    out.flush()
    return written
