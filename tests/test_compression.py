"""Unit tests of leanimg.compression: declared_size and decompress_exact, each kind of
FrameError, and that nothing is allocated for what a hostile frame header declares."""

from __future__ import annotations

import struct
import tracemalloc

import pytest
import zstandard

from leanimg.compression import CORRUPT, NOT_A_FRAME, SIZE, FrameError, FrameReader, declared_size, decompress_exact

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
    assert decompress_exact(frame(), limit=len(CONTENT)) == CONTENT          # no expectation, at the limit
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


@pytest.mark.parametrize("data,kw,match", [
    (frame(content_size=False), {}, "does not declare its content size"),
    (frame(), dict(expected=len(CONTENT) + 4096), f"expected a zstd frame declaring {len(CONTENT) + 4096} bytes"),
    (frame(), dict(limit=len(CONTENT) - 1), f"declares {len(CONTENT)} bytes, limit {len(CONTENT) - 1}"),
])
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
    at = 4 + 1 + 2                 # magic, descriptor (single segment, 2-byte content size): the first block header
    assert data[4] == 0x60
    data[at] |= 0b110              # block type 3: reserved
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
    assert longer[4] == 0x60                      # single segment, 2-byte content size field
    struct.pack_into("<H", longer, 5, len(CONTENT) - 256 - 100)    # declares 100 bytes fewer
    assert stream_kind(bytes(longer)) in (SIZE, CORRUPT)          # our count, or zstd's own check


def test_frame_reader_refuses_content_shorter_than_declared():
    assert stream_kind(declaring(4096)) in (SIZE, CORRUPT)


def test_frame_reader_refuses_a_damaged_frame():
    assert stream_kind(frame()[:-4]) in (CORRUPT, SIZE)
    assert stream_kind(b"not a zstd frame") == NOT_A_FRAME
