"""Guarded zstd decompression: the one place leanimg turns an untrusted zstd frame into bytes.

zstandard allocates whatever a frame declares, so the declared content size is checked
against the caller's expectation and limit before anything is allocated. Callers map the
``FrameError`` kinds to their own error classes and rule ids.
"""

from __future__ import annotations

import zstandard

NOT_A_FRAME = "not-a-frame"        # no zstd frame header, or a damaged one
SIZE = "size"                      # no declared content size, or the wrong one, or over the limit
CORRUPT = "corrupt"                # the frame does not decompress, or leaves bytes after it


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
            data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise FrameError(CORRUPT, f"zstd frame does not decompress: {exc}") from None
    if len(content) != size:
        raise FrameError(SIZE, f"expected {size} decompressed bytes, got {len(content)}")
    return content


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
