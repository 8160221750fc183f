"""Xen save streams: generated from the specs, checked by Xen's own verify-stream-v2 (that of
Xen 4.17 and that of Xen 4.20: every check runs with both, ``verifier`` below), converted to
lean images, validated and restored (`--to xen`) in the form they had. A missing verifier
skips its tests, or fails them in CI (env CI set): .ci/install unpacks both.

verify-stream-v2 (Xen 4.17 and 4.20 alike, Python 3) rejects any non-empty
EMULATOR_XENSTORE_DATA record ("Data not NUL terminated": it compares bytes with a str).
Streams with that record are therefore checked twice: the verifier gets a copy with the
record's key/value data emptied (``verifier_copy``), and ``test_xenstore_data_is_well_formed``
checks the data the verifier cannot read; ``test_the_verifiers_still_have_the_xenstore_bug``
notices when a verifier is fixed and the copy can go.
"""

from __future__ import annotations

import io
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import xen_streams as xs
from leanimg.cli import command_line
from leanimg.converters.convert import convert_file
from leanimg.converters import xen
from leanimg.format import PageClass
from leanimg.inspect import class_counts
from leanimg.reader import LeanImage
from leanimg.restore.xen import restore_xen
from leanimg.validate import validate

LEANIMG = command_line()

# (form, domain type, checkpoints): every stream the round-trip tests use
CASES = [
    ("xl", xs.HVM, 0),
    ("xl", xs.PV, 0),
    ("libxl", xs.HVM, 0),
    ("libxl", xs.PV, 0),
    ("libxc", xs.HVM, 0),
    ("libxc", xs.PV, 0),
    ("xl-libxc", xs.PV, 0),
    ("libxc", xs.PV, 3),
    ("libxc", xs.HVM, 2),
    ("xl-libxc", xs.HVM, 4),
]
IDS = [f"{form}-{'pv' if t == xs.PV else 'hvm'}-{n}cp" for form, t, n in CASES]


def guest_for(domain_type: int, checkpoints: int, version: int = 3) -> xs.Guest:
    return xs.make_guest(
        domain_type,
        num_pfns=200,
        seed=domain_type * 10 + checkpoints,
        holes=((30, 45), (120, 160)),
        checkpoints=checkpoints,
        version=version,
    )


def run(*args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*LEANIMG, *map(str, args)], input=stdin, capture_output=True, timeout=120)


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stderr.decode()


def verify_ok(path: Path, form: str, verifier: xs.Verifier) -> None:
    proc = xs.verify_stream(path, form, verifier)
    assert proc.returncode == 0, f"Xen {verifier.version}: " + proc.stderr.decode()[-2000:]


@pytest.fixture(params=xs.VERIFIERS, ids=lambda v: v.id)
def verifier(request) -> xs.Verifier:
    """Each Xen release's verify-stream-v2 in turn (missing: skip, in CI fail)."""
    request.param.require()
    return request.param


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request, tmp_path_factory):
    form, domain_type, checkpoints = request.param
    guest = guest_for(domain_type, checkpoints)
    d = tmp_path_factory.mktemp("xen")
    full, checked = d / "vm.save", d / "vm-verifier.save"
    full.write_bytes(xs.build_stream(guest, xs.StreamOptions(form=form)))
    checked.write_bytes(xs.build_stream(guest, xs.StreamOptions(form=form, verifier_copy=True)))
    return form, guest, full, checked


# ---------------------------------------------------------------------------- the generator


def test_generated_streams_pass_the_verifier(case, verifier):
    form, guest, _, checked = case
    verify_ok(checked, form, verifier)


def test_version_2_streams_pass_the_verifier(tmp_path, verifier):
    path = tmp_path / "v2.save"
    path.write_bytes(xs.build_stream(guest_for(xs.PV, 1, version=2), xs.StreamOptions(form="libxc")))
    verify_ok(path, "libxc", verifier)


def test_the_verifier_rejects_a_broken_stream(tmp_path, verifier):
    """The verifier really checks: a PAGE_DATA whose count lies is refused."""
    stream = bytearray(xs.build_stream(guest_for(xs.HVM, 0), xs.StreamOptions(form="libxc")))
    first = stream.index(struct.pack("<I", xs.PAGE_DATA), 40)
    struct.pack_into("<I", stream, first + 8, 17)
    path = tmp_path / "bad.save"
    path.write_bytes(bytes(stream))
    assert xs.verify_stream(path, "libxc", verifier).returncode != 0


def test_xenstore_data_is_well_formed():
    data = xs.xenstore_data(xs.StreamOptions().xenstore)
    assert data.endswith(b"\0")
    parts = data[:-1].split(b"\0")
    assert len(parts) % 2 == 0 and all(parts[0::2])


def test_generated_guests_cover_every_page_type():
    pv = guest_for(xs.PV, 2)
    types = {t for batches in pv.rounds for batch in batches for _, t, _ in batch}
    assert types == set(xs.DATA_TYPES) | {xs.BROKEN, xs.XALLOC, xs.XTAB}
    assert not pv.sends_each_page_once()
    memory = pv.final_memory()
    assert memory[35 * 4096 : 36 * 4096] == bytes(4096)  # a hole


# ---------------------------------------------------------------------------- round trips


def test_round_trip(case, tmp_path):
    form, guest, full, checked = case
    image, restored = tmp_path / "vm.lean", tmp_path / "restored.save"
    check_ok(run("convert", full, "-o", image))
    report = validate(str(image))
    assert report.valid, [str(f) for f in report.findings]
    check_ok(run("restore", image, "--to", "xen", "-o", restored))
    back = restored.read_bytes()
    if guest.sends_each_page_once():
        assert back == full.read_bytes()
    else:
        assert len(back) == len(full.read_bytes())
    assert xs.memory_after(back, form, guest.num_pfns) == guest.final_memory()
    raw = tmp_path / "vm.raw"
    check_ok(run("restore", image, "--to", "raw", "-o", raw))
    assert raw.read_bytes() == guest.final_memory()


@pytest.fixture(scope="module")
def restored_checked(case, tmp_path_factory):
    """The verifier copy of ``case`` converted and restored --to xen (once per case, for
    every verifier)."""
    d = tmp_path_factory.mktemp("restored")
    image, restored = d / "vm.lean", d / "restored.save"
    check_ok(run("convert", case[3], "-o", image))
    check_ok(run("restore", image, "--to", "xen", "-o", restored))
    return restored


def test_restored_stream_passes_the_verifier(case, restored_checked, verifier):
    form, guest, _, checked = case
    verify_ok(restored_checked, form, verifier)
    if guest.sends_each_page_once():
        assert restored_checked.read_bytes() == checked.read_bytes()


def test_page_classes(case, tmp_path):
    """Holes and pages whose last entry has no data are FREE, zero pages ZERO."""
    form, guest, full, _ = case
    image = tmp_path / "vm.lean"
    convert_file(str(full), str(image))
    memory = guest.final_memory()
    with LeanImage.open(str(image)) as img:
        region = img.region(xen.REGION_NAME)
        assert region.num_pages == guest.num_pfns
        classes = img.classes(region)
        last = {}
        for batches in guest.rounds:
            for batch in batches:
                for pfn, t, _ in batch:
                    last[pfn] = t
        for pfn in range(guest.num_pfns):
            page = memory[pfn * 4096 : (pfn + 1) * 4096]
            if last.get(pfn) not in xs.DATA_TYPES:
                assert classes[pfn] == PageClass.FREE, pfn
            elif page == bytes(4096):
                assert classes[pfn] == PageClass.ZERO, pfn
            else:
                assert classes[pfn] == PageClass.STORED, pfn


def test_convert_from_a_pipe(case, tmp_path):
    form, guest, full, _ = case
    image = tmp_path / "vm.lean"
    check_ok(run("convert", "-", "--from", "xen", "-o", image, stdin=full.read_bytes()))
    proc = run("restore", image, "--to", "xen", "-o", "-")
    check_ok(proc)
    assert xs.memory_after(proc.stdout, form, guest.num_pfns) == guest.final_memory()


def test_inspect_names_the_stream(tmp_path):
    path, image = tmp_path / "vm.save", tmp_path / "vm.lean"
    path.write_bytes(xs.build_stream(guest_for(xs.HVM, 0), xs.StreamOptions(form="xl")))
    convert_file(str(path), str(image))
    proc = run("inspect", image)
    check_ok(proc)
    assert "source  Xen xl save file, libxl v2, libxc v3, x86 HVM" in proc.stdout.decode()
    assert "xen-pfn" in proc.stdout.decode()


def test_remus_interleaved_libxl_stream(tmp_path):
    """A checkpointed libxl stream as Xen writes it: each libxc CHECKPOINT hands the stream
    to libxl, whose records end in CHECKPOINT_END (libxl_stream_write.c). verify-stream-v2
    cannot read this form (its libxl verifier reads libxc records up to END), so the libxc
    part is verified on its own, as a plain libxc stream of the same guest."""
    guest = guest_for(xs.HVM, 3)
    stream = xs.build_stream(guest, xs.StreamOptions(form="xl"))
    path, image, restored = tmp_path / "remus.save", tmp_path / "vm.lean", tmp_path / "back.save"
    path.write_bytes(stream)
    check_ok(run("convert", path, "-o", image))
    check_ok(run("restore", image, "--to", "xen", "-o", restored))
    assert xs.memory_after(restored.read_bytes(), "xl", guest.num_pfns) == guest.final_memory()
    assert xs.memory_after(stream, "xl", guest.num_pfns) == guest.final_memory()
    plain = tmp_path / "plain.save"
    plain.write_bytes(xs.build_stream(guest, xs.StreamOptions(form="libxc")))
    xs.verify_with_every_verifier(plain, "libxc")


def test_incremental_against_a_parent(tmp_path):
    """convert --parent: unchanged pages PARENT; restore rebuilds the child's stream exactly."""
    base = guest_for(xs.PV, 0)
    child = xs.make_guest(xs.PV, num_pfns=200, seed=xs.PV * 10, holes=((30, 45), (120, 160)))
    pages = xs._Pages(np.random.default_rng(7))
    batch = child.rounds[0][2]
    child.rounds[0][2] = [(pfn, t, pages.content("random") if t == xs.NOTAB else c) for pfn, t, c in batch]
    for name, guest in (("base", base), ("child", child)):
        (tmp_path / f"{name}.save").write_bytes(xs.build_stream(guest, xs.StreamOptions(form="libxc")))
    check_ok(run("convert", tmp_path / "base.save", "-o", tmp_path / "base.lean"))
    check_ok(run("convert", tmp_path / "child.save", "--parent", tmp_path / "base.lean", "-o", tmp_path / "child.lean"))
    with LeanImage.open(str(tmp_path / "child.lean")) as img:
        counts = class_counts(img)
    assert counts[PageClass.PARENT] > 100
    assert counts[PageClass.STORED] + counts[PageClass.DELTA] >= 1
    check_ok(run("restore", tmp_path / "child.lean", "--to", "xen", "-o", tmp_path / "back.save"))
    assert (tmp_path / "back.save").read_bytes() == (tmp_path / "child.save").read_bytes()


@settings(max_examples=25)
@given(
    form=st.sampled_from(["xl", "libxl", "libxc", "xl-libxc"]),
    domain_type=st.sampled_from([xs.PV, xs.HVM]),
    num_pfns=st.integers(24, 300),
    hole=st.tuples(st.integers(0, 300), st.integers(0, 40)),
    checkpoints=st.integers(0, 3),
    batch=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_any_generated_stream_round_trips(
    tmp_path_factory, form, domain_type, num_pfns, hole, checkpoints, batch, seed
):
    start, length = hole[0], min(hole[1], num_pfns - 16)  # 16 pfns sent: room for every page type
    guest = xs.make_guest(
        domain_type, num_pfns, seed=seed, holes=((start, start + length),), checkpoints=checkpoints, batch=batch
    )
    guest.num_pfns = max(pfn for b in guest.rounds for e in b for pfn, _, _ in e) + 1
    stream = xs.build_stream(guest, xs.StreamOptions(form=form))
    d = tmp_path_factory.mktemp("prop")
    (d / "vm.save").write_bytes(stream)
    convert_file(str(d / "vm.save"), str(d / "vm.lean"))
    out = io.BytesIO()
    with LeanImage.open(str(d / "vm.lean")) as img:
        restore_xen(img, out)
    if guest.sends_each_page_once():
        assert out.getvalue() == stream
    assert xs.memory_after(out.getvalue(), form, guest.num_pfns) == guest.final_memory()


# ------------------------------------------------------------------ disk references (issue 4)


@pytest.mark.parametrize("form", ["xl", "libxc"])
def test_disk_references_for_a_xen_save(tmp_path, form):
    """The shared disk classifier serves Xen saves: pages duplicating the disk become DISK
    references, and restore --to xen with the disk rebuilds the stream byte for byte."""
    guest = xs.make_guest(xs.HVM, 96, seed=5)
    disk = tmp_path / "disk.img"
    disk.write_bytes(guest.disk + bytes(1 << 20))
    save = tmp_path / "vm.xen"
    save.write_bytes(xs.build_stream(guest, xs.StreamOptions(form=form)))
    image = tmp_path / "vm.lean"
    proc = run("convert", save, "-o", image, "--disk", f"xvda={disk}")
    assert proc.returncode == 0, proc.stderr.decode()
    memory = xs.memory_after(save.read_bytes(), form, guest.num_pfns)
    pages = np.frombuffer(memory, np.uint8).reshape(-1, xs.PAGE)
    blocks = {bytes(guest.disk[k : k + xs.PAGE]) for k in range(0, len(guest.disk), xs.PAGE)}
    with LeanImage.open(image) as img:
        classes = img.classes(img.regions[0])
    on_disk = {p for p in range(guest.num_pfns) if pages[p].tobytes() in blocks and classes[p] != PageClass.FREE}
    assert on_disk and set(np.flatnonzero(classes == PageClass.DISK).tolist()) == on_disk
    out = tmp_path / "back.xen"
    proc = run("restore", image, "--to", "xen", "-o", out, "--disk", f"xvda={disk}")
    assert proc.returncode == 0, proc.stderr.decode()
    assert out.read_bytes() == save.read_bytes()
