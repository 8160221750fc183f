"""Guarded zstd decompression: the one place leanimg turns an untrusted zstd frame into bytes.

zstandard allocates whatever a frame declares, so the declared content size is checked
against the caller's expectation and limit before anything is allocated. Callers map the
``FrameError`` kinds to their own error classes and rule ids.
"""

from __future__ import annotations

import zstandard

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
BLOCK_HEADER = 3  # zstd block header: last-block bit, type (2 bits), size (21 bits)
RLE_BLOCK, RESERVED_BLOCK = 1, 3

NOT_A_FRAME = "not-a-frame"  # no zstd frame header, or a damaged one
SIZE = "size"  # no declared content size, or the wrong one, or over the limit
CORRUPT = "corrupt"  # the frame does not decompress, or leaves bytes after it


class FrameError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


def declared_size(data) -> int | None:
    """The content size the frame header declares (None if it declares none)."""
    try:
        size = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as exc:
        raise FrameError(NOT_A_FRAME, f"not a zstd frame: {exc}") from None
    return None if size == zstandard.CONTENTSIZE_UNKNOWN else size


def _required_size(data) -> int:
    """The content size the frame declares; FrameError when it declares none."""
    size = declared_size(data)
    if size is None:
        raise FrameError(SIZE, "the zstd frame does not declare its content size")
    return size


def decompress_exact(data, *, expected: int | None = None, limit: int, decompressor=None) -> bytes:
    """One whole zstd frame that declares its content size: ``expected`` bytes when given,
    at most ``limit`` bytes in any case; never allocates more than that."""
    size = _required_size(data)
    if expected is not None and size != expected:
        raise FrameError(SIZE, f"expected a zstd frame declaring {expected} bytes, got content size {size}")
    if size > limit:
        raise FrameError(SIZE, f"the zstd frame declares {size} bytes, limit {limit}")
    try:
        content = (decompressor or zstandard.ZstdDecompressor()).decompress(
            data, max_output_size=size, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        raise FrameError(CORRUPT, f"zstd frame does not decompress: {exc}") from None
    if len(content) != size:
        raise FrameError(SIZE, f"expected {size} decompressed bytes, got {len(content)}")
    return content


def decompress_into(data, out, *, expected: int | None = None, limit: int, decompressor=None) -> memoryview:
    """decompress_exact, the content written into ``out`` (a writable buffer at least that
    large) instead of new memory: a reader that decompresses many frames into the same few
    buffers takes no page faults for fresh memory.  Returns the view of ``out`` holding the
    content.  It accepts exactly what decompress_exact accepts; a frame it cannot vouch for
    (damaged, misdeclared, followed by other bytes) goes through decompress_exact, which
    raises the same FrameError as always."""
    size = _required_size(data)
    if expected is not None and size != expected or size > limit:
        return _checked_copy(data, out, expected, limit, decompressor)  # raises its FrameError
    if size > len(out):
        raise ValueError(f"a buffer of {len(out)} bytes cannot hold the frame's {size}")
    view = memoryview(out)[:size]
    try:
        whole = _frame_length(data) == len(data) and _read_into(data, view, decompressor) == size
    except zstandard.ZstdError:
        whole = False
    return view if whole else _checked_copy(data, out, expected, limit, decompressor)


def _read_into(data, view: memoryview, decompressor) -> int:
    """Bytes the frame decompresses into ``view``, filling it at most; -1 if it holds more.
    The last read takes the frame's end (its checksum, when it has one)."""
    reader = (decompressor or zstandard.ZstdDecompressor()).stream_reader(data, read_size=len(data))
    got = 0
    while got < len(view):
        n = reader.readinto(view[got:])
        if not n:
            return got
        got += n
    return -1 if reader.read(1) else got


def _frame_length(data) -> int:
    """Bytes the zstd frame at the start of ``data`` spans, from its block headers (0 if
    they run past the end or are not a plain frame's)."""
    view = memoryview(data).cast("B")
    if bytes(view[:4]) != ZSTD_MAGIC:
        return 0
    at, end = zstandard.frame_header_size(data), len(view)
    while at + BLOCK_HEADER <= end:
        header = int.from_bytes(view[at : at + BLOCK_HEADER], "little")
        kind = (header >> 1) & 3
        if kind == RESERVED_BLOCK:
            return 0
        at += BLOCK_HEADER + (1 if kind == RLE_BLOCK else header >> 3)
        if header & 1:
            return at + (4 if view[4] & 0x04 else 0)  # the content checksum, when flagged
    return 0


def _checked_copy(data, out, expected: int | None, limit: int, decompressor) -> memoryview:
    """A frame decompress_into did not take straight: decompress_exact judges it (and raises
    its FrameError); one it accepts after all is copied into ``out``."""
    content = decompress_exact(data, expected=expected, limit=limit, decompressor=decompressor)
    view = memoryview(out)[: len(content)]
    view[:] = content
    return view


class FrameReader:
    """One whole zstd frame that declares its content size, read as a stream (``read``), for
    contents too large to hold at once. Reading past the declared size, a damaged frame, or a
    frame that ends before its declared size (seen by ``finish``) raise FrameError."""

    def __init__(self, data):
        self.declared = _required_size(data)
        self._reader = zstandard.ZstdDecompressor().stream_reader(data)
        self.count = 0

    def read(self, n: int) -> bytes:
        try:
            chunk = self._reader.read(n)
        except zstandard.ZstdError as exc:
            raise FrameError(CORRUPT, f"zstd frame does not decompress: {exc}") from None
        self.count += len(chunk)
        if self.count > self.declared:
            raise FrameError(SIZE, f"the zstd frame declares {self.declared} bytes and holds more")
        return chunk

    def finish(self) -> None:
        """After the last read: the frame held exactly what it declared."""
        if self.count != self.declared or self.read(1):
            raise FrameError(SIZE, f"the zstd frame declares {self.declared} bytes, it holds {self.count}")
