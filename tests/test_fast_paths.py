"""The fast paths of the read path cover every rule their authoritative calls enforce
(lean-image/fast_paths.py).

Each registered fast path and its authoritative call are run on images of the shape the fast
path accepts, with a profiler recording which rule implementations (rules.IMPLEMENTATIONS)
run. What the authoritative call runs is what it enforces; the fast path must declare every
such rule (tests, calls or by_shape), and what it calls must be what it declares it calls.
A rule added to checks.py and called where the authoritative call runs fails here until every
fast path says how it covers it (test_a_new_rule_is_caught shows the net holding)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from leanimg import checks, fast_paths, links_batch, reader, rules, tables_batch
from leanimg.chain import deltas
from leanimg.errors import LeanImageError
from leanimg.fast_paths import FAST_PATHS, Disagreement
from leanimg.format import page_digest
from leanimg.reader import WHOLE_READ_BELOW, LeanImage
from leanimg.tables import ImageTables
from leanimg.writer import LeanImageWriter, ParentLink

from helpers import run_leanimg, write_every_class_chain, write_two_link_chain
from test_chain_open import _write_chain

PS = 4096
# the coverage tests trace what a fast path runs, which must not include the authoritative
# call that LEANIMG_CROSS_CHECK=1 runs beside it (the cross-check tests turn it on themselves)
pytestmark = pytest.mark.usefixtures("fast_paths_alone")


def _implementing_codes() -> dict:
    """code object -> the rules of the function it is the body of."""
    codes: dict = {}
    for rule, function in rules.IMPLEMENTATIONS.items():
        codes.setdefault(function.__code__, set()).add(rule)
    return codes


def rules_run(call) -> tuple[set[str], object]:
    """(the rules whose implementations ran while ``call()`` ran, its result)."""
    codes, seen = _implementing_codes(), set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code in codes:
            seen.update(codes[frame.f_code])

    sys.setprofile(profile)
    try:
        result = call()
    finally:
        sys.setprofile(None)
    return seen, result


def _zero_free_link(directory: Path, parent: Path) -> Path:
    """One region of STORED, ZERO, FREE, PARENT and DELTA pages over ``parent`` (format 1.0:
    its PARENT pages bear digests)."""
    with LeanImage.open(parent) as p:
        link = ParentLink(p.header.image_uuid, p.footer.image_digest)
        region = p.regions[0]
        pages = region.num_pages
        before = bytes(p.region_bytes(region, 0, pages))
    rng = np.random.default_rng(3)
    path = directory / "zero-free.lean"
    with LeanImageWriter(path, parent=link, frame_pages=4, inherit_digests=False) as w:
        r = w.add_region(region.name, pages * PS, 0)
        w.put_pages(r, 0, rng.bytes(2 * PS))
        w.put_zero(r, 2, 3)
        w.put_free(r, 5, 2)
        changed = bytearray(before[7 * PS : 8 * PS])
        changed[64:72] = b"changed!"
        w.put_changed(r, 7, before[7 * PS : 8 * PS], bytes(changed))
        for page in range(8, pages):
            w.put_parent(r, page, page_digest(before[page * PS : (page + 1) * PS]))
    return path


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, list[Path]]:
    """Images each fast path accepts: name of the fast path -> paths."""
    folders = {name: tmp_path_factory.mktemp(name) for name in ("chain", "two", "every")}
    chain, _ = _write_chain(folders["chain"])
    two = write_two_link_chain(folders["two"])
    every, parent, _ = write_every_class_chain(
        folders["every"], ["STORED", "DISK0", "ZERO", "PARENT", "DELTA"], disk_blocks=2
    )
    one_region = [chain[0], chain[1], chain[5], _zero_free_link(folders["chain"], chain[4])]
    with_deltas = [chain[1], chain[5], one_region[-1], two.child, every]
    return {
        "leanimg.links_batch.open_links": one_region + [two.parent, two.child, every, parent],
        "leanimg.tables_batch.load_tables": one_region,
        "leanimg.chain.deltas._quick_delta_frame": with_deltas,
        "leanimg.chain.deltas._read_delta_batch_native": with_deltas,
    }


def _open_links_fast(path: Path) -> set[str]:
    ran, opened = rules_run(lambda: links_batch.open_links([str(path)], WHOLE_READ_BELOW))
    assert list(opened) == [str(path)], f"{path}: links_batch declined it"
    for fileobj, *_ in opened.values():
        fileobj.close()
    return ran


def _open_links_authoritative(path: Path) -> set[str]:
    ran, link = rules_run(lambda: LeanImage.open_link(str(path), check=False))
    link.close()
    return ran


def _load_tables_fast(path: Path, monkeypatch) -> set[str]:
    link = LeanImage.open_link(str(path), check=False)
    with link, monkeypatch.context() as m:

        def declined(self):
            raise AssertionError(f"{path}: tables_batch declined it (ImageTables.load ran)")

        m.setattr(ImageTables, "load", declined)
        ran, _ = rules_run(lambda: tables_batch.load_tables([link.tables]))
    return ran


def _load_tables_authoritative(path: Path) -> set[str]:
    link = LeanImage.open_link(str(path), check=False)
    with link:
        ran, _ = rules_run(link.tables.load)
    return ran


def _each_delta_frame(path: Path, read) -> set[str]:
    """The rules run while ``read(link, frame)`` reads every DELTA_FRAME of the image."""
    ran: set[str] = set()
    with LeanImage.open(str(path)) as link:
        assert len(link.tables.delta_frames), f"{path} has no DELTA_FRAME"
        for frame in range(len(link.tables.delta_frames)):
            seen, result = rules_run(lambda: read(link, frame))
            assert result is not None, f"{path}: the fast path declined DELTA_FRAME {frame}"
            ran |= seen
    return ran


def read_checked(path: Path) -> set[str]:
    return _each_delta_frame(path, lambda link, frame: link.frames.read_delta_frame(frame))


def _runs(name: str, monkeypatch):
    """(fast path's rules run, authoritative call's rules run) for one image, by fast path."""
    return {
        "leanimg.links_batch.open_links": (_open_links_fast, _open_links_authoritative),
        "leanimg.tables_batch.load_tables": (
            lambda path: _load_tables_fast(path, monkeypatch),
            _load_tables_authoritative,
        ),
        "leanimg.chain.deltas._quick_delta_frame": (
            lambda path: _each_delta_frame(path, deltas._quick_delta_frame),
            read_checked,
        ),
        "leanimg.chain.deltas._read_delta_batch_native": (
            lambda path: _each_delta_frame(
                path, lambda link, frame: deltas._read_delta_batch_native([(link, frame)], link.page_size)
            ),
            read_checked,
        ),
    }[name]


def coverage_gaps(name: str, paths: list[Path], monkeypatch) -> list[str]:
    """What is wrong with fast path ``name``'s declaration, on ``paths``: rules its
    authoritative call enforces that it does not cover, rules it calls without saying so
    or says it calls without calling."""
    declared = FAST_PATHS[name]
    fast, authoritative = _runs(name, monkeypatch)
    called, enforced = set(), set()
    for path in paths:
        called |= fast(path)
        enforced |= authoritative(path)
    gaps = [
        f"{name} does not cover {rule} ({rules.describe(rule)}), which {declared.instead_of} enforces: "
        f"test it, call its implementation, or decline the links it could fail for"
        for rule in sorted(enforced - declared.covers)
    ]
    gaps += [
        f"{name} calls the implementation of {rule} but does not declare it" for rule in sorted(called - declared.calls)
    ]
    gaps += [f"{name} declares it calls {rule} but does not" for rule in sorted(declared.calls - called)]
    return gaps


def test_every_fast_path_is_tested_here(images):
    assert set(FAST_PATHS) == set(images), "a fast path without images it accepts here (add them to images)"


@pytest.mark.parametrize(
    "name",
    [
        "leanimg.links_batch.open_links",
        "leanimg.tables_batch.load_tables",
        "leanimg.chain.deltas._quick_delta_frame",
        pytest.param(
            "leanimg.chain.deltas._read_delta_batch_native",
            marks=pytest.mark.skipif(deltas._native is None, reason="leanimg._native not in use"),
        ),
    ],
)
def test_fast_path_covers_its_authoritative_rules(name, images, monkeypatch):
    assert coverage_gaps(name, images[name], monkeypatch) == []


def test_a_new_rule_is_caught(images, monkeypatch):
    """A rule implemented in checks.py and run by ImageTables.load, which no fast path declares:
    the coverage check names it."""
    monkeypatch.setitem(rules.RULES, "LI-TST-001", "a rule added by this test")

    def new_rule_problems(tables):
        return iter(())

    monkeypatch.setitem(rules.IMPLEMENTATIONS, "LI-TST-001", new_rule_problems)
    original = ImageTables.load

    def load_with_the_new_rule(self):
        original(self)
        checks.first_problem(new_rule_problems(self))

    monkeypatch.setattr(ImageTables, "load", load_with_the_new_rule)
    gaps = coverage_gaps("leanimg.tables_batch.load_tables", images["leanimg.tables_batch.load_tables"], monkeypatch)
    assert len(gaps) == 1 and gaps[0].startswith("leanimg.tables_batch.load_tables does not cover LI-TST-001")


def test_declarations_name_known_rules():
    for path in FAST_PATHS.values():
        assert path.covers <= set(rules.RULES), path.name
    with pytest.raises(ValueError, match="unknown rules LI-NOPE-001"):
        fast_paths.fast_path("x", tests=("LI-NOPE-001",))(lambda: None)


def test_cross_check_catches_a_fast_path_accepting_too_much(images, monkeypatch):
    """LEANIMG_CROSS_CHECK=1: a fast path that accepts a link its authoritative call refuses
    (here: a good link, which the batch accepts, and ImageTables.load made to refuse every
    image) raises Disagreement."""
    monkeypatch.setattr(tables_batch, "CROSS_CHECK", True)
    path = images["leanimg.tables_batch.load_tables"][1]
    link = LeanImage.open_link(str(path), check=False)

    def refuses(self):
        raise LeanImageError("refused by this test", rule="LI-MAP-001")

    with link:
        with monkeypatch.context() as m:
            m.setattr(ImageTables, "load", refuses)
            with pytest.raises(Disagreement, match="load refuses it"):
                tables_batch.load_tables([link.tables])


def test_cross_check_agrees_on_good_links(images, monkeypatch):
    monkeypatch.setattr(tables_batch, "CROSS_CHECK", True)
    for path in images["leanimg.tables_batch.load_tables"]:
        with LeanImage.open_link(str(path), check=False) as link:
            tables_batch.load_tables([link.tables])
            assert len(link.tables.regions) == 1


def test_cross_check_switch_values():
    """LEANIMG_CROSS_CHECK: 0 (the default) or 1; anything else is refused when leanimg starts."""
    code = "import leanimg.fast_paths as f; print(f.CROSS_CHECK)"
    for value, expected in (("0", "False"), ("1", "True")):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=dict(os.environ, LEANIMG_CROSS_CHECK=value),
            capture_output=True,
            text=True,
        )
        assert out.stdout.strip() == expected, out.stderr
    bad = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, LEANIMG_CROSS_CHECK="yes"), capture_output=True, text=True
    )
    assert bad.returncode != 0 and "LEANIMG_CROSS_CHECK must be one of 0, 1, not 'yes'" in bad.stderr
    proc = run_leanimg("plugins", timeout=60, env=dict(os.environ, LEANIMG_CROSS_CHECK="yes"))
    assert proc.returncode == 2 and "LEANIMG_CROSS_CHECK must be one of 0, 1, not 'yes'" in proc.stderr


def test_cross_check_catches_links_batch_reading_otherwise(images, monkeypatch):
    """LEANIMG_CROSS_CHECK=1: a link links_batch opens with another INDEX than open_link's
    (here: open_link made to read the link's parent instead) raises Disagreement."""
    monkeypatch.setattr(reader, "CROSS_CHECK", True)
    first, second = images["leanimg.tables_batch.load_tables"][:2]
    opened = LeanImage.open_links([str(second)])
    assert list(opened) == [str(second)]
    for link in opened.values():
        LeanImage._cross_check(link)  # the same file: they agree
        real = LeanImage.open_link.__func__
        monkeypatch.setattr(
            LeanImage, "open_link", classmethod(lambda cls, path, check=True: real(cls, str(first), check=check))
        )
        with pytest.raises(Disagreement, match="open_link reads its header, footer or INDEX otherwise"):
            LeanImage._cross_check(link)
        link.close()


def test_cross_check_catches_a_delta_read_that_differs(images, monkeypatch):
    """LEANIMG_CROSS_CHECK=1: a batch whose fast read differs from the frame store's checked
    read (here: one byte of the content changed) raises Disagreement; an equal one passes."""
    with LeanImage.open(str(images["leanimg.chain.deltas._quick_delta_frame"][0])) as link:
        frames = [(link, frame) for frame in range(len(link.tables.delta_frames))]
        read = deltas._read_delta_batch(frames)
        deltas._cross_check(frames, read)
        changed = read._replace(content=bytes([read.content[0] ^ 1]) + read.content[1:])
        with pytest.raises(Disagreement, match="other content, offsets or counts"):
            deltas._cross_check(frames, changed)
