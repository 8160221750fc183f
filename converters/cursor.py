"""The byte cursor the source-format parsers read with (converters/qemu.py, converters/xen.py).

A ``Cursor`` reads its input front to back and always knows the absolute offset of the
next byte.  The input is one of

* a stream read strictly sequentially in large chunks and never sought, so a pipe is fine
  (``Cursor.over_stream``): the QEMU migration stream;
* a seekable file of known size, read as asked and skipped by seeking
  (``Cursor.over_file``): a Xen save stream, whose page contents the first pass skips;
* bytes already in memory, with the offset of their first byte in the input
  (``Cursor.over_buffer``): the QEMU device sections after the RAM.

It reads exact lengths (``take``, ``skip``, ``rest``) and integers (``u8``, ``be32``,
``be64``, and ``unpack`` for a ``struct`` layout of either byte order), looks ahead without
consuming (``peek``, ``peek_u8``, ``find``) and tells ``offset``, ``at_end`` and
``remaining``.  Input that ends too early raises the same truncation error for every
parser (``take``, ``skip``, ``need``).  ``error`` and ``unsupported`` build
``SourceFormatError`` / ``UnsupportedError`` with an absolute byte offset (the next byte,
one ``back`` bytes before it, or one given ``at``) and the structure path the parser keeps
in ``structure``, e.g. ``section[3] PART 'ram' id=2`` or ``libxc record[7] PAGE_DATA``.
``start_recording`` / ``stop_recording`` keep a verbatim copy of the bytes taken between
them (the QEMU prologue).

The unread input is ``buf[pos:]``; a parser may look at it and advance ``pos`` past what it
consumed itself.  A refill makes a new buffer and never writes an old one again, so numpy
views over ``buf`` stay valid after the cursor moves on: the QEMU reader takes runs of
pages as strided views of it, with no Python step per page.
"""

from __future__ import annotations

import os
import struct
from typing import BinaryIO

from leanimg.errors import SourceFormatError, UnsupportedError

READ_CHUNK = 4 << 20  # a stream cursor's refill size

_BE32 = struct.Struct(">I")
_BE64 = struct.Struct(">Q")


class Cursor:
    """Exact reads with absolute offsets over a stream, a seekable file or a buffer."""

    def __init__(
        self,
        stream: BinaryIO | None,
        *,
        buffer: bytes | bytearray = b"",
        base: int = 0,
        size: int | None = None,
        chunk: int = READ_CHUNK,
        structure: str = "",
    ):
        self._stream = stream
        self._chunk = chunk  # bytes a refill reads at least; 0: only those asked
        self.size = size  # offset of the end of input; None: unknown
        self.buf = buffer  # buffered input; buf[pos:] is unread
        self.pos = 0
        self.base = base  # offset of buf[0]
        self.structure = structure  # where the parser is, for error messages
        self._recording: list[bytes] | None = None

    @classmethod
    def over_stream(cls, stream: BinaryIO, structure: str = "") -> "Cursor":
        """A sequential stream (a pipe is fine), read in READ_CHUNK pieces."""
        return cls(stream, structure=structure)

    @classmethod
    def over_file(cls, f: BinaryIO, structure: str = "") -> "Cursor":
        """A seekable file from its start: reads what is asked (the file object buffers),
        skips by seeking."""
        size = f.seek(0, os.SEEK_END)
        f.seek(0)
        return cls(f, size=size, chunk=0, structure=structure)

    @classmethod
    def over_buffer(cls, data, base: int = 0, structure: str = "") -> "Cursor":
        """Bytes in memory whose first byte lies at offset ``base`` of the input."""
        return cls(None, buffer=data, base=base, size=base + len(data), structure=structure)

    # --- position ----------------------------------------------------------------------

    @property
    def offset(self) -> int:
        """The absolute offset of the next byte."""
        return self.base + self.pos

    def remaining(self) -> int:
        """Bytes left before the end of input (a file or a buffer: their size is known)."""
        return self.size - self.offset

    def at_end(self) -> bool:
        return not self._has(1)

    def need(self, n: int, what: str) -> None:
        """The truncation error unless ``n`` more bytes exist; consumes nothing."""
        if not self._has(n):
            raise self._truncated(n, what)

    # --- reading -----------------------------------------------------------------------

    def take(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes (``what`` names them in the truncation error)."""
        if len(self.buf) - self.pos < n:
            out = self._take_refilled(n, what)
        else:
            start = self.pos
            self.pos += n
            out = bytes(memoryview(self.buf)[start : self.pos])
        if self._recording is not None:
            self._recording.append(out)
        return out

    def skip(self, n: int, what: str) -> None:
        """Move past ``n`` bytes; a file is sought past those not buffered, not read."""
        if len(self.buf) - self.pos >= n:
            self.pos += n
        elif not self._has(n):
            raise self._truncated(n, what)
        elif len(self.buf) - self.pos >= n:  # a stream has read them
            self.pos += n
        else:  # a file has not
            self._seek(self.base + self.pos + n)

    def jump(self, offset: int) -> None:
        """Go on reading at ``offset`` (at or after the next byte) of a seekable input; the
        bytes between are neither read nor held (a mapped-ram file's page slots)."""
        if offset < self.offset:
            raise ValueError(f"jump back from {self.offset:#x} to {offset:#x}")
        if offset - self.base <= len(self.buf):
            self.pos = offset - self.base
            return
        self._seek(offset)

    def u8(self, what: str) -> int:
        return self.take(1, what)[0]

    def be16(self, what: str) -> int:
        return int.from_bytes(self.take(2, what), "big")

    def be32(self, what: str) -> int:
        return _BE32.unpack(self.take(4, what))[0]

    def be64(self, what: str) -> int:
        return _BE64.unpack(self.take(8, what))[0]

    def unpack(self, layout: struct.Struct, what: str) -> tuple:
        """The fields of ``layout`` (any byte order) read from the next bytes."""
        return layout.unpack(self.take(layout.size, what))

    def rest(self, limit: int, what: str) -> bytes:
        """All remaining input; UnsupportedError if ``what`` exceeds ``limit`` bytes
        (reported at the offset where the bytes buffered before this call end)."""
        held = bytes(memoryview(self.buf)[self.pos :])
        self.base, self.buf, self.pos = self.base + len(self.buf), b"", 0
        parts, more = [held], 0
        while self._stream is not None and (chunk := self._stream.read(READ_CHUNK)):
            more += len(chunk)
            if len(held) + more > limit:
                raise self.unsupported(f"{what} larger than {limit} bytes")
            parts.append(chunk)
        self.base += more
        return b"".join(parts)

    # --- looking ahead -----------------------------------------------------------------

    def peek(self, n: int, ahead: int = 0) -> bytes:
        """Up to ``n`` bytes starting ``ahead`` bytes past the next one, not consumed;
        fewer at the end of input."""
        want = ahead + n if self.size is None else min(ahead + n, self.remaining())
        if len(self.buf) - self.pos < want:
            self._fill(want)
        start = self.pos + ahead
        return bytes(memoryview(self.buf)[start : start + n])

    def peek_u8(self) -> int | None:
        """The next byte, not consumed; None at the end of input."""
        if len(self.buf) - self.pos < 1 and not self._fill(1):
            return None
        return self.buf[self.pos]

    def find(self, pattern: bytes, ahead: int = 0) -> int:
        """How far past the next byte ``pattern`` first occurs, searching from ``ahead`` on,
        among the buffered bytes (all of a buffer cursor's input); -1 if nowhere."""
        at = self.buf.find(pattern, self.pos + ahead)
        return at - self.pos if at >= 0 else -1

    # --- recording ---------------------------------------------------------------------

    def start_recording(self) -> None:
        """Keep a copy of every byte taken from now on (peeks and skips excluded)."""
        self._recording = []

    def stop_recording(self) -> bytes:
        """The bytes taken since ``start_recording``."""
        recorded, self._recording = b"".join(self._recording), None
        return recorded

    @property
    def recording(self) -> bool:
        return self._recording is not None

    # --- errors ------------------------------------------------------------------------

    def error(self, message: str, *, at: int | None = None, back: int = 0) -> SourceFormatError:
        """Bad input at offset ``at``, or ``back`` bytes before the next byte."""
        return SourceFormatError(message, offset=self._where(at, back), structure=self.structure)

    def unsupported(self, message: str, *, at: int | None = None, back: int = 0) -> UnsupportedError:
        """A feature this tool does not handle, at ``at`` or ``back`` as for ``error``."""
        return UnsupportedError(message, offset=self._where(at, back), structure=self.structure)

    def _where(self, at: int | None, back: int) -> int:
        return self.offset - back if at is None else at

    def _truncated(self, n: int, what: str) -> SourceFormatError:
        left = self.remaining() if self.size is not None else len(self.buf) - self.pos
        return self.error(f"truncated stream: expected {n} bytes of {what}, got {left} before end of input")

    # --- buffering ---------------------------------------------------------------------

    def _has(self, n: int) -> bool:
        """Whether ``n`` more bytes exist; reads a stream of unknown size as far as that."""
        if len(self.buf) - self.pos >= n:
            return True
        if self.size is not None:
            return self.base + self.pos + n <= self.size
        return self._fill(n)

    def _take_refilled(self, n: int, what: str) -> bytes:
        """``take`` past the buffered bytes: a file with none buffered reads them directly
        (its file object buffers), anything else refills its buffer."""
        if self._chunk or self.pos < len(self.buf):  # a stream, or a file after a peek
            if not self._fill(n):
                raise self._truncated(n, what)
            self.pos = n
            return bytes(memoryview(self.buf)[:n])
        data = self._stream.read(n) if self.base + self.pos + n <= self.size else b""
        if len(data) < n:
            raise self._truncated(n, what)
        self.base, self.buf, self.pos = self.base + self.pos + n, b"", 0
        return data

    def _fill(self, n: int) -> bool:
        """Make ``n`` bytes available in a new buffer: the unread ones, then input.  False
        if the input ends first (a stream's buffer then holds all that is left)."""
        if self._stream is None or (self.size is not None and self.base + self.pos + n > self.size):
            return False
        buf = self._read_chunk(n) if self._chunk else self._read_exactly(n)
        self.base += self.pos
        self.buf, self.pos = buf, 0
        return len(buf) >= n

    def _read_chunk(self, n: int) -> bytearray:
        """The unread bytes, then input read in place up to ``n`` bytes in all, in a buffer
        of at least a chunk (large reads, no second copy of the pages in them).  The buffer
        grows (doubling) only as input arrives: a length field claiming gigabytes of a short
        stream costs what the stream holds, not what the field says."""
        unread = len(self.buf) - self.pos
        buf = bytearray(max(self._chunk, min(n, 2 * unread + self._chunk)))
        buf[:unread] = memoryview(self.buf)[self.pos :]
        filled = unread
        while filled < n:
            if filled == len(buf):
                buf.extend(bytes(min(len(buf), n - filled)))
            with memoryview(buf) as view:
                got = self._stream.readinto(view[filled:])
            if not got:
                break
            filled += got
        del buf[filled:]
        return buf

    def _read_exactly(self, n: int) -> bytes:
        """The unread bytes, then input up to ``n`` bytes in all (small reads from a
        buffered file)."""
        unread = self.buf[self.pos :]
        more = self._stream.read(n - len(unread))
        return unread + more if unread else more

    def _seek(self, offset: int) -> None:
        self._stream.seek(offset)
        self.base, self.buf, self.pos = offset, b"", 0
