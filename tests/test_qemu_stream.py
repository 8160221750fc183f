"""The QEMU 7.2 migration stream reader/writer: real saves, round trips, bad input."""

from __future__ import annotations

import dataclasses
import io
import json
import struct

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from guest.fixtures import saved_guest  # noqa: F401  (module-scoped fixture)
from guest.vm import GuestVM, copy_disk
from leanimg.converters import qemu as q
from leanimg.errors import SourceFormatError, UnsupportedError

PS = 4096


# ------------------------------------------------------------------ synthetic streams


def synthetic_state(plan=None, devices=None, vmdesc=True) -> q.StreamState:
    machine = b"pc-i440fx-7.2"
    prologue = (
        struct.pack(">II", q.QEVM_MAGIC, 3) + bytes([q.CONFIGURATION]) + struct.pack(">I", len(machine)) + machine
    )
    if devices is None:
        devices = [
            q.DeviceSection(q.FULL, q.SectionHeader(3, "timer", 0, 2), b"\x01" * 24),
            # a body that contains its own footer pattern must not end the section early
            q.DeviceSection(q.FULL, q.SectionHeader(4, "dev2", 0, 1), b"ab\x7e\x00\x00\x00\x04cd" + bytes(range(256))),
        ]
    desc = {
        "page_size": PS,
        "devices": [{"name": d.header.idstr, "instance_id": d.header.instance_id} for d in devices],
    }
    blocks = (q.RamBlock("blk1", 8 * PS), q.RamBlock("rom", 2 * PS))
    return q.StreamState(
        prologue=prologue,
        machine=machine.decode(),
        page_size=PS,
        capabilities=(),
        ram=q.SectionHeader(2, "ram", 0, 4),
        ram_blocks=blocks,
        ram_plan=plan or [(q.START, 0), (q.PART, 6), (q.END, 4)],
        footers=True,
        devices=devices,
        vmdesc=json.dumps(desc).encode() if vmdesc else None,
    )


def synthetic_ram(seed=0) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    blk1 = bytearray(rng.bytes(8 * PS))
    blk1[2 * PS : 4 * PS] = bytes(2 * PS)  # two zero pages in the middle
    return {"blk1": bytes(blk1), "rom": bytes(PS) + rng.bytes(PS)}


def emit(state, ram) -> bytes:
    out = io.BytesIO()
    q.write_qemu_stream(out, state, None, lambda b: [ram[b.name]])
    return out.getvalue()


def parse(data: bytes) -> tuple[q.StreamState, dict[str, bytes]]:
    state, image = q.load_stream(io.BytesIO(data))
    try:
        return state, {name: image.read(name) for name in image.blocks}
    finally:
        image.close()


def entry(block: str, offset: int, flags: int) -> bytes:
    return struct.pack(">Q", offset | flags) + bytes([len(block)]) + block.encode()


# ------------------------------------------------------------------ synthetic round trips


def test_synthetic_round_trip_is_exact():
    state, ram = synthetic_state(), synthetic_ram()
    data = emit(state, ram)
    state2, ram2 = parse(data)
    assert ram2 == ram
    assert state2 == state
    assert emit(state2, ram2) == data


def test_events_in_stream_order_with_cheap_zero_pages():
    data = emit(synthetic_state(), synthetic_ram())
    events = list(q.read_qemu_stream(io.BytesIO(data)))
    assert isinstance(events[0], q.RamBlocks) and isinstance(events[-1], q.StreamEnd)
    pages = [e for e in events if isinstance(e, q.Page)]
    assert [(p.block, p.offset) for p in pages] == [("blk1", i * PS) for i in range(8)] + [("rom", 0), ("rom", PS)]
    assert [p.data is None for p in pages] == [False, False, True, True, False, False, False, False, True, False]
    assert events[-1].length == len(data)


def test_batched_runs_end_exactly_where_the_entries_change():
    # runs longer than the first 64-entry window, ending inside a later window
    state = dataclasses.replace(
        synthetic_state(), ram_blocks=(q.RamBlock("big", 700 * PS),), ram_plan=[(q.START, 0), (q.PART, 700), (q.END, 0)]
    )
    rng = np.random.default_rng(5)
    mem = bytearray(rng.bytes(700 * PS))
    mem[300 * PS : 400 * PS] = bytes(100 * PS)
    data = emit(state, {"big": bytes(mem)})
    got, kinds = bytearray(), []
    for event in q.read_qemu_stream(io.BytesIO(data), batch=True):
        if isinstance(event, q.PageRun):
            assert event.offset == len(got)
            got += bytes(event.count * PS) if event.pages is None else event.data
            kinds += [event.pages is None] * event.count
        elif isinstance(event, q.Page):
            assert event.offset == len(got)
            got += bytes(PS) if event.data is None else event.data
            kinds.append(event.data is None)
    assert got == mem
    assert kinds == [False] * 300 + [True] * 100 + [False] * 300
    runs = [e for e in q.read_qemu_stream(io.BytesIO(data), batch=True) if isinstance(e, q.PageRun)]
    assert max(r.count for r in runs) > 64


def test_state_serialises_to_bytes_and_back():
    state = synthetic_state()
    blob = state.to_bytes()
    assert q.StreamState.from_bytes(blob) == state
    with pytest.raises(SourceFormatError) as e:
        q.StreamState.from_bytes(blob[:-1])
    assert e.value.offset is not None


def test_page_sent_twice_keeps_last_copy():
    state, ram = synthetic_state(), synthetic_ram()
    data = emit(state, ram)
    start_end = data.index(b"\x7e\x00\x00\x00\x02") + 5  # after START's footer
    early = (
        bytes([q.PART])
        + struct.pack(">I", 2)
        + entry("blk1", 0, q.F_PAGE)
        + b"A" * PS
        + struct.pack(">Q", q.F_EOS)
        + b"\x7e\x00\x00\x00\x02"
    )
    _, ram2 = parse(data[:start_end] + early + data[start_end:])
    assert ram2 == ram


def test_writer_without_matching_plan_still_round_trips():
    state = dataclasses.replace(synthetic_state(), ram_plan=[])
    ram = synthetic_ram(3)
    state2, ram2 = parse(emit(state, ram))
    assert ram2 == ram
    assert [k for k, _ in state2.ram_plan] == [q.START, q.PART, q.END]


# ------------------------------------------------------------------ QEMU >= 10: commands in a saved stream

SWITCHOVER = [(q.START, 0), (q.PART, 6), (q.COMMAND, q.CMD_SWITCHOVER_START), (q.END, 4)]


def test_switchover_start_is_kept_and_given_back_byte_for_byte():
    """QEMU 10's machine types send MIG_CMD_SWITCHOVER_START (08 000b 0000) before the END
    section: read, kept in the plan, written back in its place."""
    state, ram = synthetic_state(plan=SWITCHOVER), synthetic_ram()
    data = emit(state, ram)
    end = data.index(bytes([q.END]) + struct.pack(">I", 2))
    assert data[end - 5 : end] == b"\x08\x00\x0b\x00\x00"
    state2, ram2 = parse(data)
    assert ram2 == ram and state2.ram_plan == SWITCHOVER
    assert emit(q.StreamState.from_bytes(state2.to_bytes()), ram2) == data


def test_switchover_start_survives_a_plan_that_no_longer_fits():
    state = synthetic_state(plan=[(q.START, 0), (q.PART, 3), (q.COMMAND, q.CMD_SWITCHOVER_START), (q.END, 2)])
    state2, ram2 = parse(emit(state, synthetic_ram(5)))
    assert ram2 == synthetic_ram(5)
    assert state2.ram_plan == [(q.START, 0), (q.PART, 10), (q.COMMAND, q.CMD_SWITCHOVER_START), (q.END, 0)]


def _with_command(cmd: int, length: int = 0, data: bytes = b"") -> tuple[bytes, int]:
    stream = emit(synthetic_state(plan=SWITCHOVER), synthetic_ram())
    at = stream.index(b"\x08\x00\x0b\x00\x00")
    return stream[:at] + bytes([q.COMMAND]) + struct.pack(">HH", cmd, length) + data + stream[at + 5 :], at


@pytest.mark.parametrize(
    "cmd, name",
    [
        (1, "OPEN_RETURN_PATH"),
        (2, "PING"),
        (3, "POSTCOPY_ADVISE"),
        (7, "PACKAGED"),
        (8, "ENABLE_COLO"),
        (10, "RECV_BITMAP"),
    ],
)
def test_commands_a_saved_stream_cannot_carry_are_refused_by_name(cmd, name):
    stream, at = _with_command(cmd, 4, b"\0" * 4)
    with pytest.raises(UnsupportedError, match=rf"QEMU_VM_COMMAND {cmd} {name}") as e:
        parse(stream)
    assert e.value.offset == at and e.value.structure.endswith("COMMAND")


@pytest.mark.parametrize("cmd", [0, 12, 0xFFFF])
def test_an_unknown_command_is_refused_with_its_offset(cmd):
    stream, at = _with_command(cmd)
    with pytest.raises(SourceFormatError, match=rf"expected a QEMU_VM_COMMAND id 1..11, got {cmd}") as e:
        parse(stream)
    assert e.value.offset == at + 1


def test_switchover_start_with_data_is_refused():
    stream, at = _with_command(q.CMD_SWITCHOVER_START, 2, b"\0\0")
    with pytest.raises(SourceFormatError, match="expected SWITCHOVER_START with length 0, got 2") as e:
        parse(stream)
    assert e.value.offset == at + 3


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([b"\0", b"\1", b"\xff", None]), min_size=10, max_size=10), st.integers(0, 10))
def test_property_pages_survive_round_trip(kinds, split):
    """Any mix of zero / non-zero pages and any section split gives back the same pages."""
    rng = np.random.default_rng(len(kinds) + split)
    pages = [rng.bytes(PS) if k is None else k * PS for k in kinds]
    ram = {"blk1": b"".join(pages[:8]), "rom": b"".join(pages[8:])}
    state = synthetic_state(plan=[(q.START, 0), (q.PART, split), (q.END, 10 - split)])
    state2, ram2 = parse(emit(state, ram))
    assert ram2 == ram
    assert state2.devices == state.devices


# ------------------------------------------------------------------ bad input


def expect_error(data: bytes, cls=SourceFormatError, match: str = "", offset=None):
    with pytest.raises(cls) as e:
        q.load_stream(io.BytesIO(data))
    err = e.value
    assert type(err) is cls, repr(err)
    assert err.offset is not None and err.structure
    assert match in err.message, err.message
    if offset is not None:
        assert err.offset == offset, str(err)
    return err


@pytest.fixture(scope="module")
def good():
    return emit(synthetic_state(), synthetic_ram())


@pytest.mark.parametrize("cut", [0, 3, 9, 20, 40, 60, 200, 5000, -400, -120, -1])
def test_truncation_anywhere(good, cut):
    data = good[:cut] if cut >= 0 else good[: len(good) + cut]
    err = expect_error(data, match="truncated")
    assert err.offset <= len(data)


def test_bad_magic(good):
    expect_error(b"QEVX" + good[4:], match="QEVM magic", offset=0)


def test_corrupt_section_id(good):
    part = good.index(bytes([q.PART]) + struct.pack(">I", 2))
    bad = good[: part + 1] + struct.pack(">I", 9) + good[part + 5 :]
    err = expect_error(bad, match="section id", offset=part + 1)
    assert "'ram'" in err.message


def test_corrupt_section_type(good):
    part = good.index(bytes([q.PART]) + struct.pack(">I", 2))
    expect_error(good[:part] + b"\x42" + good[part + 1 :], match="section type", offset=part)


def test_unknown_page_flag(good):
    at = good.index(entry("blk1", 0, q.F_PAGE))
    bad = good[:at] + struct.pack(">Q", q.F_PAGE | 0x400) + good[at + 8 :]
    expect_error(bad, match="RAM flags", offset=at)


@pytest.mark.parametrize(
    "flag,feature",
    [(q.F_XBZRLE, "XBZRLE"), (q.F_COMPRESS, "compressed"), (q.F_HOOK, "RDMA"), (q.F_MULTIFD_FLUSH, "multifd")],
)
def test_unsupported_page_encodings(good, flag, feature):
    at = good.index(entry("blk1", 0, q.F_PAGE))
    bad = good[:at] + struct.pack(">Q", flag) + good[at + 8 :]
    err = expect_error(bad, UnsupportedError, match=feature, offset=at)
    assert "PART 'ram'" in err.structure


def test_postcopy_command_is_unsupported(good):
    start = good.index(bytes([q.START]))
    cmd = bytes([q.COMMAND]) + struct.pack(">HH", 3, 0)
    expect_error(good[:start] + cmd + good[start:], UnsupportedError, match="QEMU_VM_COMMAND", offset=start)


def test_lying_block_length_in_mem_size(good):
    at = good.index(b"\x04blk1") + 5
    bad = good[:at] + struct.pack(">Q", 4 * PS) + good[at + 8 :]
    expect_error(bad, match="MEM_SIZE 0xa000, lengths so far add up to 0x6000")
    bad = good[:at] + struct.pack(">Q", 9 * PS) + good[at + 8 :]
    expect_error(bad, match="add up to MEM_SIZE 0xa000, got 0xb000")


def test_page_beyond_block_length(good):
    # shrink blk1 and grow rom so MEM_SIZE still adds up: page 4.. of blk1 now lie
    at, rom_at = good.index(b"\x04blk1") + 5, good.index(b"\x03rom") + 4
    bad = bytearray(good)
    bad[at : at + 8] = struct.pack(">Q", 4 * PS)
    bad[rom_at : rom_at + 8] = struct.pack(">Q", 6 * PS)
    expect_error(bytes(bad), match="below block 'blk1' length")


def test_ram_block_missing_from_mem_size(good):
    at = good.index(entry("blk1", 0, q.F_PAGE))
    bad = good[:at] + entry("blkX", 0, q.F_PAGE) + good[at + 13 :]
    expect_error(bad, match="missing from MEM_SIZE", offset=at + 8)


def test_garbage_after_vmdescription(good):
    expect_error(good + b"junk", match="end of stream after VMDESCRIPTION", offset=len(good))


def test_garbage_after_eof_without_vmdescription():
    data = emit(synthetic_state(vmdesc=False), synthetic_ram())
    expect_error(data + b"\x99junk", match="after QEMU_VM_EOF", offset=len(data))


def test_device_sections_must_match_vmdescription():
    state = synthetic_state()
    desc = json.loads(state.vmdesc)
    desc["devices"][1]["name"] = "other"
    data = emit(dataclasses.replace(state, vmdesc=json.dumps(desc).encode()), synthetic_ram())
    expect_error(data, match="match VMDESCRIPTION")


def test_unsupported_capability():
    state = synthetic_state()
    caps = (
        bytes([q.SUBSECTION, 26])
        + b"configuration/capabilities"
        + struct.pack(">II", 1, 1)
        + bytes([10])
        + b"mapped-ram"
    )
    data = emit(dataclasses.replace(state, prologue=state.prologue + caps), synthetic_ram())
    expect_error(data, UnsupportedError, match="mapped-ram")


# ------------------------------------------------------------------ real QEMU


@pytest.mark.qemu
def test_parse_real_save(saved_guest):
    with open(saved_guest.save, "rb") as f:
        events = q.read_qemu_stream(f)
        blocks = next(events)
        assert isinstance(blocks, q.RamBlocks)
        names = {b.name: b.length for b in blocks.blocks}
        assert names["pc.ram"] == saved_guest.mem_mib << 20
        assert {"pc.bios", "pc.rom"} <= names.keys()
        sent = {name: np.zeros(length // PS, np.int32) for name, length in names.items()}
        for ev in events:
            if isinstance(ev, q.Page):
                sent[ev.block][ev.offset // PS] += 1
    state = ev.state
    assert all((counts == 1).all() for counts in sent.values()), "stopped VM: each page once"
    assert state.machine.startswith("pc-i440fx-")
    assert len(state.devices) > 10 and state.vmdesc.startswith(b"{")
    assert any(d.header.idstr == "cpu" for d in state.devices)


@pytest.mark.qemu
def test_real_save_pages_match_pmemsave(saved_guest):
    with open(saved_guest.save, "rb") as f:
        state, image = q.load_stream(f)
    with image:
        ram = np.frombuffer(image.read("pc.ram"), np.uint8)
    mem = np.fromfile(saved_guest.mem, np.uint8)
    low = slice(0, 0xA0000)  # below the VGA / BIOS window
    high = slice(0x100000, len(mem))
    assert np.array_equal(ram[low], mem[low]) and np.array_equal(ram[high], mem[high])


@pytest.mark.qemu
def test_real_save_reemitted_byte_identical(saved_guest, tmp_path):
    with open(saved_guest.save, "rb") as f:
        state, image = q.load_stream(f, tmp_path)
    out = tmp_path / "again.save"
    with image, open(out, "wb") as f:
        q.write_qemu_stream(f, q.StreamState.from_bytes(state.to_bytes()), None, image.page_source)
    assert out.read_bytes() == saved_guest.save.read_bytes()


@pytest.mark.qemu
def test_real_save_truncated_and_garbage(saved_guest):
    data = saved_guest.save.read_bytes()
    for cut in (7, 300, len(data) // 2, len(data) - 1000, len(data) - 1):
        err = expect_error(data[:cut], match="truncated")
        assert err.offset <= cut
    expect_error(data + b"\0", offset=len(data))


@pytest.mark.qemu
def test_restore_into_fresh_qemu(saved_guest, tmp_path):
    """parse -> write (new section layout) -> QEMU -incoming: same memory, guest resumes."""
    with open(saved_guest.save, "rb") as f:
        state, image = q.load_stream(f, tmp_path)
    total = sum(n for kind, n in state.ram_plan if kind != q.COMMAND)
    # pages spread over PART sections unlike the original's (whose split depends on timing)
    plan = next(p for p in (_split_plan(total, 3), _split_plan(total, 5)) if p != state.ram_plan)
    rebuilt = tmp_path / "rebuilt.save"
    with image, open(rebuilt, "wb") as f:
        q.write_qemu_stream(f, dataclasses.replace(state, ram_plan=plan), None, image.page_source)
    assert rebuilt.read_bytes() != saved_guest.save.read_bytes()  # a different stream
    disk = copy_disk(saved_guest.disk, tmp_path / "disk.img")
    vm_dir = tmp_path / "dest"
    vm_dir.mkdir()
    with GuestVM(
        saved_guest.build,
        disk,
        mem_mib=saved_guest.mem_mib,
        workdir=vm_dir,
        incoming=f"exec:cat {rebuilt}",
        qemu=saved_guest.qemu,
    ) as vm:
        vm.wait_incoming()
        vm.pmemsave(tmp_path / "restored.bin")
        assert (tmp_path / "restored.bin").read_bytes() == saved_guest.mem.read_bytes()
        vm.cont()
        beat = vm.wait_heartbeat_after(saved_guest.heartbeat, timeout=60)
        assert beat > saved_guest.heartbeat
        assert vm.status() == "running"


def _split_plan(total: int, parts: int) -> list[tuple[int, int]]:
    sizes = [total // parts] * (parts - 1) + [total - (total // parts) * (parts - 1)]
    return [(q.START, 0), *[(q.PART, n) for n in sizes], (q.END, 0)]


def test_ram_after_device_state_is_refused_by_name():
    """virtio-mem (machine types >= 8.0) sends a FULL section during setup, before the RAM's
    PART sections: refused, not taken for the device tail."""
    stream = emit(synthetic_state(), synthetic_ram())
    start_end = stream.index(b"\x7e\x00\x00\x00\x02") + 5  # after START's footer
    early = q.DeviceSection(q.FULL, q.SectionHeader(9, "0000:00:02.0/virtio-mem-device-early", 0, 1), b"\x00" * 8)
    with pytest.raises(UnsupportedError, match=r"a RAM section \(PART\) after device state") as e:
        parse(stream[:start_end] + early.to_bytes(True) + stream[start_end:])
    assert e.value.offset == start_end + len(early.to_bytes(True))


@pytest.mark.parametrize("plan", [[[99, 1]], [[q.PART, -1]], [[q.COMMAND, 3]], [[q.START, 0, 1]], [["x", 0]]])
def test_a_state_record_with_a_plan_no_stream_has_is_refused(plan):
    blob = synthetic_state().to_bytes()
    head = len(q._STATE_MAGIC)
    n = struct.unpack_from(">I", blob, head)[0]
    meta = json.loads(blob[head + 4 : head + 4 + n])
    meta["ram_plan"] = plan
    text = json.dumps(meta).encode()
    with pytest.raises(SourceFormatError, match="expected a valid state record"):
        q.StreamState.from_bytes(blob[:head] + struct.pack(">I", len(text)) + text + blob[head + 4 + n :])
