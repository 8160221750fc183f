"""Unit tests of leanimg.compression: declared_size and decompress_exact, each kind of
FrameError, and that nothing is allocated for what a hostile frame header declares;
decompress_into takes exactly what decompress_exact takes, with the same errors."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings, strategies as st

from leanimg.compression import (
    CORRUPT,
    NOT_A_FRAME,
    SIZE,
    FrameError,
    FrameReader,
    declared_size,
    decompress_exact,
    decompress_into,
)

CONTENT = bytes(range(256)) * 40
LIMIT = 1 << 20


def frame(data: bytes = CONTENT, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=3, write_content_size=content_size).compress(data)


def declaring(size: int) -> bytes:
    """A zstd frame header declaring ``size`` bytes (8-byte content size field), then one empty last raw block."""
    return b"\x28\xb5\x2f\xfd" + bytes([0b1110_0000]) + struct.pack("<Q", size) + bytes([0x01, 0x00, 0x00])


class Spy:
    """A decompressor that records whether it was asked to decompress."""

    def __init__(self):
        self.calls = 0

    def decompress(self, *args, **kwargs):
        self.calls += 1
        return zstandard.ZstdDecompressor().decompress(*args, **kwargs)


def kind_of(data, **kw) -> str:
    with pytest.raises(FrameError) as info:
        decompress_exact(data, **kw)
    assert info.value.message == str(info.value)
    return info.value.kind


def test_decompress_exact_gives_the_content():
    assert decompress_exact(frame(), expected=len(CONTENT), limit=LIMIT) == CONTENT
    assert decompress_exact(frame(), limit=len(CONTENT)) == CONTENT  # no expectation, at the limit
    spy = Spy()
    assert decompress_exact(frame(), limit=LIMIT, decompressor=spy) == CONTENT and spy.calls == 1


def test_declared_size():
    assert declared_size(frame()) == len(CONTENT)
    assert declared_size(frame(content_size=False)) is None
    assert declared_size(declaring(1 << 40)) == 1 << 40


@pytest.mark.parametrize("data", [b"", b"\x28\xb5", b"not a zstd frame", b"\x00" * 64])
def test_not_a_frame(data):
    with pytest.raises(FrameError) as info:
        declared_size(data)
    assert info.value.kind == NOT_A_FRAME
    assert kind_of(data, limit=LIMIT) == NOT_A_FRAME


@pytest.mark.parametrize(
    "data,kw,match",
    [
        (frame(content_size=False), {}, "does not declare its content size"),
        (frame(), dict(expected=len(CONTENT) + 4096), f"expected a zstd frame declaring {len(CONTENT) + 4096} bytes"),
        (frame(), dict(limit=len(CONTENT) - 1), f"declares {len(CONTENT)} bytes, limit {len(CONTENT) - 1}"),
    ],
)
def test_size(data, kw, match):
    kw = dict(dict(limit=LIMIT), **kw)
    with pytest.raises(FrameError, match=match) as info:
        decompress_exact(data, **kw)
    assert info.value.kind == SIZE


@pytest.mark.parametrize("kw", [dict(limit=16 << 20), dict(expected=4096, limit=16 << 20)])
def test_a_frame_declaring_1_tib_is_refused_before_decompressing(kw):
    spy = Spy()
    tracemalloc.start()
    try:
        assert kind_of(declaring(1 << 40), decompressor=spy, **kw) == SIZE
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert spy.calls == 0 and peak < 1 << 20


def test_two_frames_are_corrupt():
    assert kind_of(frame() + frame(b"more"), expected=len(CONTENT), limit=LIMIT) == CORRUPT


def test_trailing_bytes_are_corrupt():
    assert kind_of(frame() + b"\x00", limit=LIMIT) == CORRUPT


def test_a_damaged_block_is_corrupt():
    data = bytearray(frame())
    at = 4 + 1 + 2  # magic, descriptor (single segment, 2-byte content size): the first block header
    assert data[4] == 0x60
    data[at] |= 0b110  # block type 3: reserved
    assert kind_of(bytes(data), expected=len(CONTENT), limit=LIMIT) == CORRUPT


def test_a_truncated_frame_is_corrupt():
    assert kind_of(frame()[:-4], expected=len(CONTENT), limit=LIMIT) == CORRUPT


def test_content_shorter_than_declared_is_refused():
    assert kind_of(declaring(4096), expected=4096, limit=LIMIT) in (CORRUPT, SIZE)


# --- FrameReader: the same guards, for contents read as a stream -------------------------
def read_all(data: bytes, n: int = 1000) -> bytes:
    reader = FrameReader(data)
    parts = []
    while chunk := reader.read(n):
        parts.append(chunk)
    reader.finish()
    return b"".join(parts)


def stream_kind(data: bytes) -> str:
    with pytest.raises(FrameError) as info:
        read_all(data)
    return info.value.kind


def test_frame_reader_streams_the_content():
    assert read_all(frame()) == CONTENT
    assert read_all(frame(), n=7) == CONTENT


def test_frame_reader_refuses_a_frame_without_its_size():
    assert stream_kind(frame(content_size=False)) == SIZE


def test_frame_reader_refuses_content_longer_than_declared():
    longer = bytearray(frame())
    assert longer[4] == 0x60  # single segment, 2-byte content size field
    struct.pack_into("<H", longer, 5, len(CONTENT) - 256 - 100)  # declares 100 bytes fewer
    assert stream_kind(bytes(longer)) in (SIZE, CORRUPT)  # our count, or zstd's own check


def test_frame_reader_refuses_content_shorter_than_declared():
    assert stream_kind(declaring(4096)) in (SIZE, CORRUPT)


def test_frame_reader_refuses_a_damaged_frame():
    assert stream_kind(frame()[:-4]) in (CORRUPT, SIZE)
    assert stream_kind(b"not a zstd frame") == NOT_A_FRAME


# --- decompress_into: decompress_exact into a caller's buffer --------------------------------
def into_or_error(data, out=None, **kw):
    """(content, None) or (None, (kind, message)) of decompress_into."""
    out = bytearray(len(CONTENT) + 8192) if out is None else out
    try:
        return bytes(decompress_into(data, out, **kw)), None
    except FrameError as exc:
        return None, (exc.kind, exc.message)


def exact_or_error(data, **kw):
    try:
        return decompress_exact(data, **kw), None
    except FrameError as exc:
        return None, (exc.kind, exc.message)


def test_decompress_into_fills_the_callers_buffer():
    out = bytearray(LIMIT)
    view = decompress_into(frame(), out, expected=len(CONTENT), limit=LIMIT)
    assert view.obj is out and len(view) == len(CONTENT) and bytes(out[: len(CONTENT)]) == CONTENT
    assert bytes(decompress_into(frame(b""), out, limit=LIMIT)) == b""


def test_decompress_into_a_buffer_too_small_is_the_callers_error():
    with pytest.raises(ValueError, match="cannot hold"):
        decompress_into(frame(), bytearray(100), limit=LIMIT)


CHECKSUMMED = zstandard.ZstdCompressor(level=3, write_checksum=True).compress(CONTENT)
RAW_CONTENT = bytes(range(256)) + __import__("os").urandom(70000)  # stored in raw blocks
ORIGINALS = [
    (frame(), len(CONTENT)),
    (CHECKSUMMED, len(CONTENT)),
    (zstandard.ZstdCompressor(level=3).compress(RAW_CONTENT), len(RAW_CONTENT)),
    (frame(b"x" * 5000), 5000),
]


@pytest.mark.parametrize(
    "data,kw",
    [
        (frame(content_size=False), {}),
        (frame(), dict(expected=len(CONTENT) + 4096)),
        (frame(), dict(limit=100)),
        (frame() + frame(b"more"), {}),
        (frame() + b"\x00", {}),
        (frame()[:-4], {}),
        (declaring(4096), {}),
        (b"not a zstd frame", {}),
        (CHECKSUMMED[:-1] + bytes([CHECKSUMMED[-1] ^ 1]), {}),
        (frame() + zstandard.ZstdCompressor().compress(b""), {}),
        (frame() + b"\x50\x2a\x4d\x18" + bytes(4), {}),  # a skippable frame after it
    ],
)
def test_decompress_into_refuses_what_decompress_exact_refuses_alike(data, kw):
    kw = dict(dict(limit=LIMIT), **kw)
    refused = exact_or_error(data, **kw)
    assert refused[0] is None
    assert into_or_error(data, **kw) == refused


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, len(ORIGINALS) - 1), st.data())
def test_decompress_into_agrees_with_decompress_exact_on_any_edit(which, data):
    """Any bytes set, cut or appended: the same content, or the same FrameError (kind and
    message), as a frame reader asks (expecting the size the frame was written with)."""
    original, expected = ORIGINALS[which]
    edited = bytearray(original)
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(edited) - 1))
        edited[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, 8))
    edited = edited[: len(edited) - cut] + data.draw(st.binary(max_size=8))
    kw = dict(expected=expected, limit=LIMIT)
    assert into_or_error(bytes(edited), bytearray(expected), **kw) == exact_or_error(bytes(edited), **kw)
