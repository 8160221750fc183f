"""Restore to a QEMU migration stream that `qemu-system-x86_64 -incoming` accepts (QEMU 7.2 to
11.0, as the image's stream state was saved), or to a mapped-ram file (QEMU >= 9.0)."""

from __future__ import annotations

from typing import BinaryIO


from leanimg.converters import qemu
from leanimg.converters.source_state import QEMU_TAG_STREAM_STATE, unpack_stream_state
from leanimg.errors import FormatError, UnsupportedError
from leanimg.format import SourceFormat
from leanimg.reader import LeanImage

from .targets import fitting_targets


ZEROS_CHUNK = 1 << 30  # blank bytes per Zeros chunk: its ZERO entries are built in one 2.3 MiB array


def stream_state(image: LeanImage) -> qemu.StreamState:
    for state in image.source_states:
        if state.source_format == SourceFormat.QEMU and state.tag == QEMU_TAG_STREAM_STATE:
            return unpack_stream_state(state.data, state.offset)
    raise UnsupportedError(
        "the image has no QEMU stream state (SOURCE_STATE tag 1): it was not "
        f"converted from a QEMU save; use {fitting_targets(image)}",
        structure="source_state",
    )


def _page_source(image: LeanImage, progress):
    def source(block: qemu.RamBlock):
        region = image.region(block.name)
        if region.size_bytes != block.length:
            raise FormatError(
                f"region {block.name!r} has {region.size_bytes} bytes, the stream state says {block.length}",
                structure=f"region[{region.region_id}]",
            )
        ps = image.page_size
        step = image.gather_chunk_pages
        for first, count in image.region_windows(region, step):
            for n, data in image.region_pieces(region, first, count):
                if data is not None:
                    yield qemu.Pages(data)
                    continue
                for at in range(0, n * ps, ZEROS_CHUNK):  # a long blank run: its entries a chunk at a time
                    yield qemu.Zeros(min(ZEROS_CHUNK, n * ps - at))
            if progress:
                progress(count * ps)

    return source


def restore_qemu(image: LeanImage, out: BinaryIO, progress=None) -> int:
    """Write the rebuilt stream to ``out``; return its length."""
    return _restore(image, out, progress, mapped=False)


def restore_qemu_mapped_ram(image: LeanImage, out: BinaryIO, progress=None) -> int:
    """Write a mapped-ram file (QEMU >= 9.0: `migrate-incoming file:FILE` with the capability
    mapped-ram set) to the seekable ``out``: zero pages are holes; return its length."""
    return _restore(image, out, progress, mapped=True)


def _restore(image: LeanImage, out: BinaryIO, progress, mapped: bool) -> int:
    state = stream_state(image)
    image.enable_read_ahead()
    written = qemu.write_qemu_stream(out, state, state.ram_blocks, _page_source(image, progress), mapped)
    out.flush()
    return written
