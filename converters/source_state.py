"""How each source format's non-page state is kept in SOURCE_STATE records (spec §5.4).

QEMU (source_format 1) tag 1: one zstd frame holding qemu.StreamState.to_bytes()
(configuration, device sections verbatim, RAM section plan, VMDESCRIPTION).
QEMU (source_format 1) tag 3: one zstd frame holding libvirt's save header, domain XML,
cookie and padding verbatim (converters/libvirt.py), for an image converted from libvirt's save.
Xen (source_format 2) tag 1: one zstd frame holding the stream's skeleton
(converters/xen.py): non-page bytes verbatim, PAGE_DATA pfn arrays.

Kept apart from convert.py so that restoring imports neither the writer nor the converters.
"""

from __future__ import annotations

import io
from typing import BinaryIO

import zstandard

from leanimg.compression import FrameError, FrameReader, decompress_exact
from leanimg.errors import SourceFormatError, UnsupportedError

from . import libvirt, qemu, xen

QEMU_TAG_STREAM_STATE = 1
QEMU_TAG_LIBVIRT_HEADER = 3
XEN_TAG_SKELETON = 1
STATE_LIMIT = 256 << 20  # decompressed QEMU stream state accepted on reading


def _frame(raw: bytes) -> bytes:
    """One zstd frame declaring its content size. Level 9: level 19 took 0.06 s of the main
    thread to save ~200 bytes of a 1 GiB save's stream state."""
    return zstandard.ZstdCompressor(level=9, write_content_size=True).compress(raw)


def _unframe(data: bytes, offset: int | None, limit: int, what: str, structure: str) -> bytes:
    """What _frame stored, refused when it declares more than ``limit`` bytes."""
    try:
        return decompress_exact(data, limit=limit)
    except FrameError as exc:
        raise SourceFormatError(
            f"{what} does not decompress within {limit} bytes: {exc.message}", offset=offset, structure=structure
        ) from None


def pack_stream_state(state: qemu.StreamState) -> bytes:
    return _frame(state.to_bytes())


def unpack_stream_state(data: bytes, offset: int | None = None) -> qemu.StreamState:
    """The state pack_stream_state stored; ``offset`` is where ``data`` lies in the image."""
    structure = "source_state[QEMU tag 1]"
    raw = _unframe(data, offset, STATE_LIMIT, "QEMU stream state", structure)
    try:
        return qemu.StreamState.from_bytes(raw)
    except SourceFormatError as exc:
        raise SourceFormatError(
            f"byte {exc.offset} of the decompressed QEMU stream state: {exc.message}",
            offset=offset,
            structure=structure,
        ) from None


def pack_libvirt_header(header: libvirt.SaveHeader) -> bytes:
    """libvirt's header and data (XML, cookie, padding: mostly zeros) in one zstd frame."""
    return _frame(header.raw)


def unpack_libvirt_header(data: bytes, offset: int | None = None) -> libvirt.SaveHeader:
    """The header pack_libvirt_header stored, checked again as on converting."""
    structure = "source_state[QEMU tag 3]"
    raw = _unframe(data, offset, libvirt.HEADER_SIZE + libvirt.DATA_LIMIT, "libvirt save header", structure)
    try:
        header = libvirt.parse_header(raw)
        if len(raw) != header.payload_offset:
            raise SourceFormatError(
                f"expected {header.payload_offset} bytes (header and data_len), got {len(raw)}",
                offset=len(raw),
                structure="libvirt header data",
            )
        return libvirt.parse_data(raw, header)
    except (SourceFormatError, UnsupportedError) as exc:
        raise type(exc)(
            f"byte {exc.offset} of the decompressed libvirt header ({exc.structure}): {exc.message}",
            offset=offset,
            structure=structure,
        ) from None


def pack_skeleton(skeleton: BinaryIO) -> bytes:
    """One zstd frame declaring its content size, holding the whole skeleton file."""
    size = skeleton.seek(0, io.SEEK_END)
    skeleton.seek(0)
    out = io.BytesIO()
    zstandard.ZstdCompressor(level=9, write_content_size=True).copy_stream(skeleton, out, size=size)
    return out.getvalue()


def unpack_skeleton(data: bytes, offset: int | None = None):
    """The skeleton items pack_skeleton stored, decompressed as they are read."""
    structure = "source_state[Xen tag 1]"
    try:
        reader = FrameReader(data)
        yield from xen.iter_items(reader)
        reader.finish()
    except FrameError as exc:
        raise SourceFormatError(
            f"Xen stream skeleton does not decompress: {exc.message}", offset=offset, structure=structure
        ) from None
    except SourceFormatError as exc:
        raise SourceFormatError(
            f"byte {exc.offset} of the decompressed Xen skeleton: {exc.message}", offset=offset, structure=structure
        ) from None
