"""QEMU mapped-ram files without QEMU: synthetic files round trip, and every broken header,
bitmap or slot is refused with its offset and structure, nothing written (issue 31 §2, §4).
Real QEMU 10's own files: tests/test_qemu_mapped_ram.py."""

from __future__ import annotations

import dataclasses
import io
import struct
import subprocess
from pathlib import Path

import pytest

from helpers import assert_clean_failure
from leanimg.cli import command_line
from leanimg.converters import mapped_ram
from leanimg.converters import qemu as q
from leanimg.errors import SourceFormatError, UnsupportedError
from test_qemu_stream import PS, SWITCHOVER, emit, parse, synthetic_ram, synthetic_state

LEANIMG = command_line()


def mapped_file(ram=None, state=None) -> bytes:
    out = io.BytesIO()
    q.write_qemu_stream(
        out, state or synthetic_state(plan=SWITCHOVER), None, lambda b: [(ram or synthetic_ram())[b.name]], mapped=True
    )
    return out.getvalue()


def header_at(data: bytes, block: str) -> int:
    """The offset of ``block``'s mapped-ram header (after its MEM_SIZE entry)."""
    entry = bytes([len(block)]) + block.encode()
    return data.index(entry) + len(entry) + 8


def with_header_field(data: bytes, block: str, field: int, value: int) -> bytes:
    """``data`` with header field ``field`` (0 version, 1 page size, 2 bitmap, 3 pages) replaced."""
    at = header_at(data, block)
    fields = list(mapped_ram.HEADER.unpack_from(data, at))
    fields[field] = value
    return data[:at] + mapped_ram.HEADER.pack(*fields) + data[at + mapped_ram.HEADER.size :]


def layout_of(data: bytes, block: str) -> tuple[int, int, int, int]:
    return mapped_ram.HEADER.unpack_from(data, header_at(data, block))


# ------------------------------------------------------------------ round trips


def test_a_mapped_ram_file_round_trips_with_zero_pages_as_holes():
    ram = synthetic_ram()
    data = mapped_file(ram)
    state, ram2 = parse(data)
    assert ram2 == ram
    assert "mapped-ram" in state.capabilities
    assert mapped_file(ram, q.StreamState.from_bytes(state.to_bytes())) == data
    version, size, bitmap, pages = layout_of(data, "blk1")
    assert (version, size, pages % mapped_ram.ALIGNMENT) == (1, PS, 0)
    assert bitmap == header_at(data, "blk1") + mapped_ram.HEADER.size
    assert data[bitmap] == 0b11110011  # blk1's pages 2 and 3 are zero: clear bits
    assert data[pages + 2 * PS : pages + 4 * PS] == bytes(2 * PS)


def test_either_form_restores_to_the_other():
    ram = synthetic_ram(7)
    plain = emit(synthetic_state(plan=SWITCHOVER), ram)
    state, _ = parse(plain)
    as_mapped = mapped_file(ram, state)
    state2, ram2 = parse(as_mapped)
    assert ram2 == ram and state2.capabilities == ("mapped-ram",)
    back = io.BytesIO()
    q.write_qemu_stream(back, state2, None, lambda b: [ram[b.name]])
    state3, ram3 = parse(back.getvalue())
    assert ram3 == ram and state3.capabilities == () and state3.prologue == state.prologue


def test_the_capability_list_keeps_qemus_order_and_other_subsections():
    state = synthetic_state()
    uuid = bytes([q.SUBSECTION]) + bytes([18]) + b"configuration/uuid" + struct.pack(">I", 1) + bytes(range(16))
    caps = (
        bytes([q.SUBSECTION])
        + bytes([26])
        + b"configuration/capabilities"
        + struct.pack(">II", 1, 1)
        + bytes([15])
        + b"x-ignore-shared"
    )
    prologue = state.prologue + caps + uuid
    state = dataclasses.replace(state, prologue=prologue, capabilities=("x-ignore-shared",))
    mapped = q.with_mapped_ram(state, True)
    assert mapped.capabilities == ("x-ignore-shared", "mapped-ram")
    assert mapped.prologue == (
        state.prologue[: -len(caps + uuid)]
        + bytes([q.SUBSECTION, 26])
        + b"configuration/capabilities"
        + struct.pack(">II", 1, 2)
        + bytes([15])
        + b"x-ignore-shared"
        + bytes([10])
        + b"mapped-ram"
        + uuid
    )
    assert q.with_mapped_ram(mapped, False).prologue == prologue


def test_no_capability_left_means_no_subsection():
    plain = synthetic_state()
    assert q.with_mapped_ram(q.with_mapped_ram(plain, True), False).prologue == plain.prologue


# ------------------------------------------------------------------ bad files


def refused(data: bytes, cls=SourceFormatError):
    with pytest.raises(cls) as e:
        parse(data)
    return e.value


def test_an_unknown_header_version_is_refused():
    data = mapped_file()
    err = refused(with_header_field(data, "blk1", 0, 2), UnsupportedError)
    assert "mapped-ram header version 2 (this reader knows 1)" in err.message
    assert err.offset == header_at(data, "blk1") and err.structure == "mapped-ram header of 'blk1'"


def test_another_page_size_is_refused():
    data = mapped_file()
    err = refused(with_header_field(data, "rom", 1, 65536))
    assert "expected the stream's page size 4096, got 65536" in err.message
    assert err.offset == header_at(data, "rom") + 4


def test_a_bitmap_elsewhere_is_refused():
    data = mapped_file()
    at = header_at(data, "blk1")
    err = refused(with_header_field(data, "blk1", 2, at + 4096))
    assert "expected the bitmap right after the header" in err.message and err.offset == at + 12


@pytest.mark.parametrize("pages", ["unaligned", "over the bitmap", "past the end", "huge"])
def test_slots_that_are_not_where_they_may_be_are_refused(pages):
    data = mapped_file()
    _, _, bitmap, offset = layout_of(data, "blk1")
    value = {
        "unaligned": offset + 1,
        "over the bitmap": bitmap - bitmap % PS,
        "past the end": len(data) + PS - len(data) % PS,
        "huge": (1 << 64) - PS,
    }[pages]
    err = refused(with_header_field(data, "blk1", 3, value))
    assert err.offset == header_at(data, "blk1") + 20
    assert ("inside the file" if pages in ("past the end", "huge") else "on a page boundary") in err.message


def test_a_file_cut_inside_the_slots_is_refused():
    data = mapped_file()
    _, _, _, pages = layout_of(data, "blk1")
    err = refused(data[: pages + PS])
    assert "inside the file" in err.message and err.structure == "mapped-ram header of 'blk1'"


def test_page_entries_in_a_mapped_ram_stream_are_refused():
    data = mapped_file()
    end = data.rindex(bytes([q.END]) + struct.pack(">I", 2))
    entry = struct.pack(">Q", q.F_PAGE) + bytes([4]) + b"blk1" + bytes(PS)
    err = refused(data[: end + 5] + entry + data[end + 5 :])
    assert "expected no page entries in a mapped-ram stream" in err.message and err.offset == end + 5


def test_a_mapped_ram_file_from_a_pipe_is_refused(tmp_path):
    save = tmp_path / "mapped.save"
    save.write_bytes(mapped_file())
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run(
        f"cat {save} | {' '.join(LEANIMG)} convert - -o {out / 'x.lean'}", shell=True, capture_output=True, timeout=120
    )
    assert_clean_failure(proc, out, match="a mapped-ram file read from a pipe", structure="configuration")


@pytest.mark.parametrize("field, value", [(0, 9), (3, 1 << 40)])
def test_convert_of_a_broken_file_leaves_nothing(tmp_path, field, value):
    save = tmp_path / "mapped.save"
    data = mapped_file()
    save.write_bytes(with_header_field(data, "blk1", field, value))
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.run([*LEANIMG, "convert", str(save), "-o", str(out / "x.lean")], capture_output=True, timeout=120)
    assert_clean_failure(
        proc,
        out,
        match="mapped-ram header",
        offset=header_at(data, "blk1") + (0, 4, 12, 20)[field],
        structure="mapped-ram header of 'blk1'",
    )


def test_restore_to_a_mapped_ram_file_needs_a_file(tmp_path):
    save, image = tmp_path / "plain.save", tmp_path / "vm.lean"
    save.write_bytes(emit(synthetic_state(), synthetic_ram()))
    assert subprocess.run([*LEANIMG, "convert", str(save), "-o", str(image)], capture_output=True).returncode == 0
    proc = subprocess.run(
        f"{' '.join(LEANIMG)} restore {image} --to qemu-mapped-ram -o - | wc -c",
        shell=True,
        capture_output=True,
        timeout=120,
    )
    assert proc.stdout.split() == [b"0"], "nothing written"
    assert b"needs an output that can seek" in proc.stderr and b"Traceback" not in proc.stderr
    rebuilt = tmp_path / "mapped.save"
    assert (
        subprocess.run(
            [*LEANIMG, "restore", str(image), "--to", "qemu-mapped-ram", "-o", str(rebuilt)], capture_output=True
        ).returncode
        == 0
    )
    assert parse(rebuilt.read_bytes())[1] == synthetic_ram()
    assert Path(rebuilt).stat().st_blocks * 512 < rebuilt.stat().st_size, "sparse"


def test_a_configuration_it_cannot_rebuild_is_refused_not_crashed():
    state = synthetic_state()
    odd = bytes([q.SUBSECTION, 17]) + b"configuration/odd" + struct.pack(">I", 1)
    with pytest.raises(UnsupportedError, match="configuration subsection 'configuration/odd'"):
        q.with_mapped_ram(dataclasses.replace(state, prologue=state.prologue + odd), True)
    with pytest.raises(SourceFormatError, match=r"expected a configuration subsection \(0x05\)"):
        q.with_mapped_ram(dataclasses.replace(state, prologue=state.prologue + b"\x09"), True)


class _RecordingFile:
    """A mapped-ram file in memory whose reads and read-ahead advice are recorded."""

    def __init__(self, data: bytes):
        self.data, self.size, self.calls = data, len(data), []

    def read(self, n: int, offset: int) -> bytes:
        self.calls.append(("read", offset, n))
        return self.data[offset : offset + n]

    def advise(self, offset: int, length: int) -> None:
        self.calls.append(("advise", offset, length))


def test_slots_are_advised_to_the_kernel_before_they_are_read(monkeypatch):
    """Cold, the kernel's read-ahead does not foresee slots between holes: each data run is
    advised (WILLNEED) before it is read, at most READ_AHEAD bytes (plus one run) ahead."""
    ram = synthetic_ram()
    blk1 = bytearray(ram["blk1"])
    blk1[5 * PS : 6 * PS] = bytes(PS)  # data runs: pages 0-1, 4, 6-7
    ram["blk1"] = bytes(blk1)
    data = mapped_file(ram)
    version, size, bitmap, pages = layout_of(data, "blk1")
    layout = mapped_ram.BlockLayout("blk1", 8 * PS, PS, header_at(data, "blk1"), bitmap, pages)
    monkeypatch.setattr(mapped_ram, "READ_AHEAD", 5 * PS)
    source = _RecordingFile(data)
    runs = list(mapped_ram.page_runs(source, layout))
    assert [(first, count, data is not None) for first, count, data in runs] == [
        (0, 2, True),
        (2, 2, False),
        (4, 1, True),
        (5, 1, False),
        (6, 2, True),
    ]
    slot_calls = [c for c in source.calls if c[1] >= pages]
    assert slot_calls == [
        ("advise", pages, 2 * PS),
        ("advise", pages + 4 * PS, PS),
        ("read", pages, 2 * PS),
        ("advise", pages + 6 * PS, 2 * PS),
        ("read", pages + 4 * PS, PS),
        ("read", pages + 6 * PS, 2 * PS),
    ]
