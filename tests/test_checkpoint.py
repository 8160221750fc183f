"""The parts of `leanimg checkpoint` that need no QEMU: writing a spooled stream whose unsent
pages become FREE (what free-page hinting leaves), the summary line. Real QEMU:
tests/test_qemu_checkpoint.py."""

from __future__ import annotations

import io
import os
from collections import Counter

import numpy as np
import pytest

from helpers import qemu_save, run_leanimg
from leanimg.converters import qemu
from leanimg.converters.checkpoint import CheckpointResult, FrozenDisk
from leanimg.converters.convert import write_spooled
from leanimg.errors import CheckpointError
from leanimg.format import PageClass
from leanimg.inspect import class_counts
from leanimg.reader import LeanImage
from leanimg.writer import LeanImageWriter

PAGES = 64


def _ram() -> bytes:
    rng = np.random.default_rng(5)
    ram = bytearray(rng.bytes(PAGES * 4096))
    ram[8 * 4096 : 12 * 4096] = bytes(4 * 4096)  # zero pages, sent as ZERO entries
    return bytes(ram)


def test_pages_never_sent_become_free_and_the_rest_is_kept(tmp_path):
    ram = _ram()
    state, spool = qemu.load_stream(io.BytesIO(qemu_save(ram)), tmp_path)
    with spool:
        seen = spool.seen["pc.ram"]
        seen[20:30] = False  # as if QEMU had skipped them
        seen[PAGES - 2 :] = False
        out = tmp_path / "img.lean"
        with LeanImageWriter(out) as writer:
            write_spooled(writer, state, spool, unsent_free=True)
    with LeanImage.open(out) as image:
        region = image.region("pc.ram")
        classes = image.classes(region)
        assert np.flatnonzero(classes == PageClass.FREE).tolist() == [*range(20, 30), PAGES - 2, PAGES - 1]
        assert np.flatnonzero(classes == PageClass.ZERO).tolist() == list(range(8, 12))
        kept = np.flatnonzero(classes == PageClass.STORED)
        got = np.frombuffer(bytes(image.region_bytes(region, 0, PAGES)), np.uint8).reshape(PAGES, 4096)
        want = np.frombuffer(ram, np.uint8).reshape(PAGES, 4096)
        assert np.array_equal(got[kept], want[kept])
        assert not got[20:30].any()  # FREE restores as zeros


def test_without_unsent_free_every_page_is_read_from_the_spool(tmp_path):
    state, spool = qemu.load_stream(io.BytesIO(qemu_save(_ram())), tmp_path)
    with spool:
        spool.seen["pc.ram"][20:30] = False
        with LeanImageWriter(tmp_path / "img.lean") as writer:
            write_spooled(writer, state, spool)
    with LeanImage.open(tmp_path / "img.lean") as image:
        assert class_counts(image)[PageClass.FREE] == 0


def test_pages_known_to_be_zero_are_never_read_back_from_the_spool(tmp_path, monkeypatch):
    """A 4 MiB chunk sent as ZERO entries, and the zero pages at a chunk's ends, become ZERO
    without a read of the spool; zero pages between data pages are read and classed as before."""
    pages = 2048
    ram = bytearray(pages * 4096)
    for page in (1030, 1031, 1500, 1900):
        ram[page * 4096 : (page + 1) * 4096] = bytes([page % 251 + 1]) * 4096
    state, spool = qemu.load_stream(io.BytesIO(qemu_save(bytes(ram))), tmp_path)
    reads = []
    read_pages = qemu.RamImage.read_pages
    monkeypatch.setattr(
        qemu.RamImage,
        "read_pages",
        lambda self, block, first, stop: reads.append((first, stop)) or read_pages(self, block, first, stop),
    )
    with spool:
        zero_entries = np.flatnonzero(spool.zero["pc.ram"])
        spans = spool.nonzero_spans(state.ram_blocks[0])
        with LeanImageWriter(tmp_path / "img.lean") as writer:
            write_spooled(writer, state, spool)
    assert len(zero_entries) >= pages - 5  # our stream writer sends zero pages as ZERO entries
    assert reads == spans and spans[-1] == (1030, 1901)
    read = np.zeros(pages, bool)
    for first, stop in reads:
        read[first:stop] = True
    assert not read[1:1030].any() and not read[1901:].any()
    with LeanImage.open(tmp_path / "img.lean") as image:
        region = image.region("pc.ram")
        assert np.flatnonzero(image.classes(region) == PageClass.STORED).tolist() == [1030, 1031, 1500, 1900]
        assert bytes(image.region_bytes(region, 0, pages)) == bytes(ram)


def test_a_page_s_last_copy_decides_whether_it_is_known_to_be_zero():
    blocks = qemu.RamBlocks((qemu.RamBlock("pc.ram", 8 * 4096),), 4096)
    with qemu.RamImage(blocks) as spool:
        data = np.full((2, 4096), 7, np.uint8)
        spool.apply_run(qemu.PageRun("pc.ram", 0, 2, data))  # pages 0-1: data
        spool.apply_run(qemu.PageRun("pc.ram", 4096, 2, None))  # pages 1-2: zeros (1 sent again)
        spool.apply_run(qemu.PageRun("pc.ram", 3 * 4096, 1, None))  # page 3: zeros, then data
        spool.apply_run(qemu.PageRun("pc.ram", 3 * 4096, 1, data[:1]))
        assert spool.zero["pc.ram"].tolist() == [False, True, True, False, True, True, True, True]
        assert spool.read_pages(blocks.blocks[0], 0, 4) == bytes([7]) * 4096 + bytes(8192) + bytes([7]) * 4096


def test_the_image_s_temporary_file_is_named_like_every_output_s(tmp_path):
    from leanimg.converters.checkpoint import _temp_beside

    temp, out = _temp_beside(str(tmp_path / "vm.lean"))
    with out:
        name = os.path.basename(temp)
        assert name.startswith(".leanimg-vm.lean-") and name.endswith(".partial")
        assert os.path.dirname(temp) == str(tmp_path)


def test_the_scratch_files_are_deleted_from_the_start(tmp_path):
    state, spool = qemu.load_stream(io.BytesIO(qemu_save(_ram())), tmp_path)
    with spool:
        assert list(tmp_path.iterdir()) == []


def test_the_summary_names_sizes_classes_downtime_and_the_disk_file():
    disk = FrozenDisk(
        "vda", "/vm/disk.img", {"device": "virtio0"}, True, overlay="/vm/disk.img.after-x.qcow2", referenced=16 << 20
    )
    result = CheckpointResult(
        "x.lean",
        "live",
        "continue",
        3 << 20,
        4096,
        Counter({PageClass.STORED: 256, PageClass.DISK: 4096}),
        12,
        None,
        1.5,
        [disk],
        "running",
    )
    assert result.summary() == (
        "x.lean: 3.0 MiB, live checkpoint in 1.5 s, downtime 12 ms; MiB by class: STORED 1.0, DISK 16.0; "
        "guest running; disk vda: 16.0 MiB referenced in /vm/disk.img (frozen; the guest now writes to "
        "/vm/disk.img.after-x.qcow2)"
    )


class _ScriptedMonitor:
    """Answers query-migrate from a script and records every other command."""

    def __init__(self, statuses: list[str]):
        self.statuses, self.sent = list(statuses), []

    def execute(self, command: str, **arguments):
        if command == "query-migrate":
            return {"status": self.statuses.pop(0)}
        self.sent.append((command, arguments))
        return {}


class _Flowing:
    """A stream reader still reading, without error."""

    error = None

    def is_alive(self) -> bool:
        return True


def test_a_live_checkpoint_leaves_the_pre_switchover_pause_once():
    """QEMU may report pre-switchover again right after migrate-continue (its migration thread
    has not moved on yet): a second freeze and migrate-continue would fail the checkpoint."""
    from leanimg.converters.checkpoint import CheckpointRequest, _Checkpoint, _Signals

    monitor = _ScriptedMonitor(["active", "pre-switchover", "pre-switchover", "device", "completed"])
    run = _Checkpoint(monitor, CheckpointRequest(qmp="unused", output="unused.lean", mode="live"), _Signals())
    run.spool = _Flowing()
    with run.signals:
        assert run._wait_migration() == {"status": "completed"}
    assert [c for c, _ in monitor.sent] == ["migrate-continue"]
    assert monitor.sent[0][1] == {"state": "pre-switchover"}


class _VersionedMonitor:
    """A QEMU of a given version: answers query-version, records every command."""

    def __init__(self, major: int, minor: int):
        self.version, self.sent = {"major": major, "minor": minor, "micro": 0}, []

    def execute(self, command: str, **arguments):
        self.sent.append(command)
        return {"qemu": self.version, "package": ""} if command == "query-version" else {"status": "running"}


@pytest.mark.parametrize("major, minor", [(6, 2), (7, 1), (12, 0)])
def test_a_qemu_it_does_not_read_is_refused_before_the_guest_is_touched(major, minor):
    from leanimg.converters.checkpoint import CheckpointRequest, _Checkpoint, _Signals

    monitor = _VersionedMonitor(major, minor)
    run = _Checkpoint(monitor, CheckpointRequest(qmp="unused", output="unused.lean"), _Signals())
    with pytest.raises(
        CheckpointError,
        match=rf"this is QEMU {major}\.{minor}\.0; leanimg checkpoint reads the "
        r"migration streams of QEMU 7\.2 to 11\.x .*The guest was not touched",
    ):
        run.run()
    assert monitor.sent == ["query-version"]


@pytest.mark.parametrize("major, minor", [(7, 2), (8, 2), (10, 0), (11, 0)])
def test_the_qemus_it_reads_pass_the_version_check(major, minor):
    from leanimg.converters.checkpoint import CheckpointRequest, _Checkpoint, _Signals

    monitor = _VersionedMonitor(major, minor)
    _Checkpoint(monitor, CheckpointRequest(qmp="unused", output="unused.lean"), _Signals())._check_version()
    assert monitor.sent == ["query-version"]


def test_an_incremental_checkpoint_lends_its_disks_to_the_parent(tmp_path):
    """`checkpoint --parent P --disk vda=PATH`: a page that was a DISK page of P and changed is
    read from PATH (lent to P, as convert --parent does) to encode its delta. Before, P was
    opened without disks and the checkpoint failed ("pass --disk vda=PATH")."""
    from types import SimpleNamespace

    from leanimg.converters.checkpoint import CheckpointRequest, _Checkpoint
    from leanimg.converters.convert import DiskOptions
    from leanimg.disks import open_disk

    ram = _ram()
    disk = tmp_path / "vda.img"
    disk.write_bytes(ram[: 4 * 4096] + bytes(4 * 4096))
    (tmp_path / "one.save").write_bytes(qemu_save(ram))
    parent = tmp_path / "one.lean"
    proc = run_leanimg("convert", tmp_path / "one.save", "-o", parent, "--disk", f"vda={disk}", timeout=120)
    assert proc.returncode == 0, proc.stderr
    changed = bytearray(ram)
    changed[4096 + 16 : 4096 + 24] = b"changed!"  # page 1: on the disk in the parent
    state, spool = qemu.load_stream(io.BytesIO(qemu_save(bytes(changed))), tmp_path)
    request = CheckpointRequest(qmp="", output="", parents=(str(parent),), disks={"vda": str(disk)})
    sources = {"vda": open_disk(str(disk), "vda")}
    child = tmp_path / "two.lean"
    with spool, open(child, "wb") as out:
        with _Checkpoint._open_writer(SimpleNamespace(req=request), out, sources) as (writer, opened):
            write_spooled(writer, state, spool, parent=opened, disks=DiskOptions(sources), unsent_free=True)
    with LeanImage.open(child, disks={"vda": open_disk(str(disk), "vda")}) as image:
        region = image.region("pc.ram")
        assert image.classes(region, 1, 1).tolist() == [PageClass.DELTA]
        assert bytes(image.region_bytes(region, 0, PAGES)) == bytes(changed)


# ------------------------------------------------------------------ the stream behind cat


def _followed(tmp_path, keep=None):
    import socket

    from leanimg.converters.checkpoint import _Followed

    ours, theirs = socket.socketpair()
    reader = _Followed(ours, keep, str(tmp_path))
    ours.close()
    return reader, theirs


def test_the_followed_stream_waits_for_what_is_not_yet_written(tmp_path, monkeypatch):
    """Reads behind cat return every byte once, wait while the file has not grown, end when
    the sender hangs up; the part read is punched out of the scratch file."""
    import threading
    import time

    from leanimg.converters.checkpoint import _Followed

    monkeypatch.setattr(_Followed, "PUNCH", 1 << 20)
    data = np.random.default_rng(3).bytes(6 << 20)
    reader, sender = _followed(tmp_path)

    def send():
        for k in range(0, len(data), 1 << 20):
            sender.sendall(data[k : k + (1 << 20)])
            time.sleep(0.02)
        sender.close()

    thread = threading.Thread(target=send)
    thread.start()
    got = bytearray()
    with io.BufferedReader(reader, 1 << 16) as stream:
        while chunk := stream.read(100_000):
            got += chunk
        thread.join()
        assert bytes(got) == data and reader.received == len(data)
        assert os.fstat(reader.file.fileno()).st_blocks * 512 < (1 << 20)  # all of it read: punched
    reader.release()


def test_a_cut_stream_is_an_error_not_an_end(tmp_path):
    reader, sender = _followed(tmp_path)
    sender.sendall(b"x" * 1000)
    buffer = bytearray(4096)
    while not reader.readinto(buffer):
        pass
    reader.cut_off()
    with pytest.raises(CheckpointError, match="cut"):
        reader.readinto(buffer)
    sender.close()
    reader.release()


def test_the_kept_stream_is_the_file_cat_writes(tmp_path):
    keep = tmp_path / "kept.stream"
    reader, sender = _followed(tmp_path, str(keep))
    sender.sendall(b"QEVM" * 5000)
    sender.close()
    with io.BufferedReader(reader) as stream:
        assert stream.read() == b"QEVM" * 5000
    reader.release()
    assert keep.read_bytes() == b"QEVM" * 5000
