"""Save files kept compressed (zstd, gzip, xz, bzip2), read as they are: recognised by their
magic and decompressed while they are read, like a pipe (spec/guides/cli.md, convert).

A decompressing reader cannot seek, so a converter treats it as it treats standard input:
a QEMU stream that sends pages twice needs ``--spool``, a Xen stream is copied to a scratch
file first. Decoder failures become a SourceFormatError naming the compression and the
offset in the compressed file where the decoder was.
"""

from __future__ import annotations

import io
from typing import IO, Any, BinaryIO, Protocol, cast

from .errors import SourceFormatError

# how compressed files start (RFC 8878, RFC 1952, the xz and bzip2 file formats): name, the pipe
COMPRESSED = {
    b"\x28\xb5\x2f\xfd": ("zstd", "zstd -dc"),
    b"\x1f\x8b": ("gzip", "gzip -dc"),
    b"\xfd7zXZ\x00": ("xz", "xz -dc"),
    b"BZh": ("bzip2", "bzip2 -dc"),
}
MAGIC_BYTES = max(len(magic) for magic in COMPRESSED)


def compression_of(head: bytes) -> str | None:
    """``zstd``, ``gzip``, ``xz`` or ``bzip2`` when ``head`` starts like one, else None."""
    return next((name for magic, (name, _) in COMPRESSED.items() if head.startswith(magic)), None)


def decompressing(stream: BinaryIO, close_stream: bool = True) -> BinaryIO:
    """``stream`` itself when it is not compressed (rewound, or, when it cannot seek, with its
    first bytes given again), else a buffered reader of its decompressed bytes that cannot seek."""
    head = _read_head(stream)
    raw: BinaryIO | PrefixedInput
    if stream.seekable():
        stream.seek(-len(head), io.SEEK_CUR)
        raw = stream
    else:
        raw = PrefixedInput(head, stream, close_rest=close_stream)
    kind = compression_of(head)
    if kind is None:
        return io.BufferedReader(raw, 1 << 20) if isinstance(raw, PrefixedInput) else raw
    return io.BufferedReader(Decompressing(raw, kind, close_stream), 1 << 20)


def _read_head(stream: BinaryIO) -> bytes:
    head = b""
    while len(head) < MAGIC_BYTES:
        more = stream.read(MAGIC_BYTES - len(head))
        if not more:
            break
        head += more
    return head


class _Decoder(Protocol):
    """What Decompressing uses of a decoder (zstandard's, gzip's, lzma's or bz2's reader)."""

    def readinto(self, buffer: Any, /) -> int: ...

    def close(self) -> None: ...


def _decoder(raw: BinaryIO | PrefixedInput, kind: str) -> _Decoder:
    source = cast(IO[bytes], raw)  # (the decoders only read it: a PrefixedInput does that)
    if kind == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(
            source, read_size=1 << 20, read_across_frames=True, closefd=False
        )
    if kind == "gzip":
        import gzip

        return gzip.GzipFile(fileobj=source, mode="rb")
    if kind == "xz":
        import lzma

        return lzma.LZMAFile(source, "rb")
    import bz2

    return bz2.BZ2File(source, "rb")


def _decoder_errors() -> tuple:
    import lzma
    import zlib

    import zstandard

    return (zstandard.ZstdError, lzma.LZMAError, zlib.error, EOFError, OSError)


class Decompressing(io.RawIOBase):
    """The decompressed bytes of ``raw`` (compressed as ``kind``), read forward only."""

    def __init__(self, raw: BinaryIO | PrefixedInput, kind: str, close_raw: bool = True):
        self.raw, self.kind, self.close_raw = raw, kind, close_raw
        self.decoder = _decoder(raw, kind)
        self.errors = _decoder_errors()
        self.delivered = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def readinto(self, buffer) -> int:
        try:
            n = self.decoder.readinto(buffer)
        except self.errors as exc:
            raise self._error(exc) from None
        except MemoryError:  # the decoder's own tables, sized by the stream (an xz dictionary)
            from .errors import LimitError

            raise LimitError(
                f"the {self.kind} decoder needs more memory than this process may use (after "
                f"{self.delivered} decompressed bytes)",
                structure=f"{self.kind} stream",
            ) from None
        self.delivered += n
        return n

    def _error(self, exc: Exception) -> SourceFormatError:
        offset = None
        try:
            offset = self.raw.tell()
        except (OSError, ValueError, AttributeError):
            pass
        what = str(exc) or type(exc).__name__
        if isinstance(exc, EOFError):
            what = f"the compressed data ends early ({what})"
        return SourceFormatError(
            f"cannot decompress: {what} (after {self.delivered} decompressed bytes)",
            offset=offset,
            structure=f"{self.kind} stream",
        )

    def close(self) -> None:
        if not self.closed:
            try:
                self.decoder.close()
            finally:
                if self.close_raw:
                    self.raw.close()
        super().close()


class PrefixedInput(io.RawIOBase):
    """A non-seekable input whose first bytes were already read (for format detection)."""

    def __init__(self, head: bytes, rest: BinaryIO, close_rest: bool = False):
        self.head, self.rest, self.close_rest = head, rest, close_rest

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        return super().read(size) if self.head else self.rest.read(size)

    def readinto(self, buffer) -> int:
        if self.head:
            n = min(len(buffer), len(self.head))
            buffer[:n] = self.head[:n]
            self.head = self.head[n:]
            return n
        data = self.rest.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def close(self) -> None:
        if self.close_rest and not self.closed:
            self.rest.close()
        super().close()
