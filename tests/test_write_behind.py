"""fileutil.WriteBehind: a file's bytes handed to the kernel's writeback as they are written
(sync_file_range), so the fsync at the end of an image waits for little; inert on what is no
regular file; never a change to what is written."""

from __future__ import annotations

import io
import os

import numpy as np

from leanimg import fileutil
from leanimg.fileutil import WriteBehind
from leanimg.reader import LeanImage
from leanimg.validate import validate
from leanimg.writer import LeanImageWriter

PS = 4096


def spy_on_sync_file_range(monkeypatch) -> list[tuple[int, int]]:
    """The (offset, length) of every real sync_file_range call made from now on."""
    calls: list[tuple[int, int]] = []
    real = fileutil._sync_file_range

    def spy(fd, offset, length, flags):
        calls.append((offset, length))
        return real(fd, offset, length, flags)

    monkeypatch.setattr(fileutil, "_sync_file_range", spy)
    return calls


def test_what_reached_the_file_is_started_in_steps_of_the_threshold(tmp_path, monkeypatch):
    monkeypatch.setattr(fileutil, "WRITE_BEHIND_BYTES", 8192)
    calls = spy_on_sync_file_range(monkeypatch)
    path = tmp_path / "f"
    with open(path, "wb", buffering=4096) as f:
        behind = WriteBehind(f)
        f.write(b"a" * 5000)  # 4096 reach the file, the rest stays buffered
        behind.advance()
        assert behind.started == 0 and calls == []
        f.write(b"b" * 20000)
        behind.advance()
        assert behind.started == os.lseek(f.fileno(), 0, os.SEEK_CUR) >= 8192
        assert calls == [(0, behind.started)]
        f.write(b"c" * 9000)
        f.flush()
        behind.advance()
        assert calls[1] == (calls[0][1], 34000 - calls[0][1]) and behind.started == 34000
    assert path.read_bytes() == b"a" * 5000 + b"b" * 20000 + b"c" * 9000


def test_it_starts_after_what_the_file_held_when_it_came(tmp_path, monkeypatch):
    monkeypatch.setattr(fileutil, "WRITE_BEHIND_BYTES", 4096)
    calls = spy_on_sync_file_range(monkeypatch)
    with open(tmp_path / "f", "wb", buffering=0) as f:
        f.write(bytes(10000))
        behind = WriteBehind(f)
        f.write(bytes(5000))
        behind.advance()
    assert calls == [(10000, 5000)]


def test_what_is_no_regular_file_is_left_alone(monkeypatch):
    monkeypatch.setattr(fileutil, "WRITE_BEHIND_BYTES", 1)
    calls = spy_on_sync_file_range(monkeypatch)
    r, w = os.pipe()
    with os.fdopen(r, "rb") as pipe, os.fdopen(w, "wb", buffering=0) as end:
        for target in (io.BytesIO(), end, open(os.devnull, "wb")):
            behind = WriteBehind(target)
            target.write(b"xyz")
            behind.advance()
            assert behind.started == 0
        assert pipe.read(3) == b"xyz"
    assert calls == []


def test_a_system_without_the_call_makes_it_inert_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(fileutil, "WRITE_BEHIND_BYTES", 1)
    refused = []
    monkeypatch.setattr(fileutil, "_sync_file_range", lambda *call: refused.append(call) or False)
    with open(tmp_path / "f", "wb", buffering=0) as f:
        behind = WriteBehind(f)
        for _ in range(3):
            f.write(b"data")
            behind.advance()
    assert len(refused) == 1 and behind.started == 0
    assert (tmp_path / "f").read_bytes() == b"data" * 3


def test_an_image_is_started_whole_as_written_and_stays_valid(tmp_path, monkeypatch):
    """The image's bytes are handed on once, in order, with no gap, all but what the output's
    buffer (1 MiB) and the last step still held at the end; the image is valid, its pages
    read back."""
    monkeypatch.setattr(fileutil, "WRITE_BEHIND_BYTES", 64 << 10)
    calls = spy_on_sync_file_range(monkeypatch)
    content = np.random.default_rng(5).integers(0, 256, 1000 * PS, dtype=np.uint8).tobytes()
    path = tmp_path / "w.lean"
    with LeanImageWriter(path, frame_pages=16) as writer:
        writer.put_pages(writer.add_region("ram", len(content)), 0, content)
    assert calls and calls[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:]))
    covered, size = calls[-1][0] + calls[-1][1], path.stat().st_size
    assert size - (1 << 20) - (64 << 10) <= covered <= size
    assert validate(path).valid
    with LeanImage.open_link(path) as image:
        assert bytes(image.region_bytes(image.region("ram"), 0, 1000)) == content


def test_a_restore_into_a_file_is_started_as_it_is_written(tmp_path, monkeypatch):
    """`restore -o FILE` hands the file's bytes on as the pages are written, in order, from 0
    on (the writes of each progress step; what its buffer holds at the end is left to the
    fsync), and the file is the guest's memory."""
    from click.testing import CliRunner

    from leanimg.cli import main

    monkeypatch.setattr(fileutil, "WRITE_BEHIND_BYTES", 64 << 10)
    content = np.random.default_rng(6).integers(0, 256, 1000 * PS, dtype=np.uint8).tobytes()
    image, out = tmp_path / "w.lean", tmp_path / "out.raw"
    with LeanImageWriter(image, frame_pages=16) as writer:
        writer.put_pages(writer.add_region("ram", len(content)), 0, content)
    calls = spy_on_sync_file_range(monkeypatch)
    result = CliRunner().invoke(main, ["restore", str(image), "--to", "raw", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_bytes() == content
    assert calls and calls[0][0] == 0
    assert all(a + n == b for (a, n), (b, _) in zip(calls, calls[1:]))
    assert calls[-1][0] + calls[-1][1] >= len(content) // 2
