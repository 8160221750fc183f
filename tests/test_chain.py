"""Incremental chains: convert against a parent, the depth-independent resolver, flatten, merge."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import zstandard
from click.testing import CliRunner

from leanimg.cli import main
from leanimg.format import PageClass
from leanimg.incremental import AgainstParent, parent_link, rebase
from leanimg.inspect import class_counts
from leanimg.reader import LeanImage
from leanimg.restore.raw import restore_raw
from leanimg.validate import validate
from leanimg.writer import LeanImageWriter

PS = 4096
PAGES = 192
SAMPLE = Path(__file__).resolve().parents[1] / "lean-image" / "sample" / "vm.save.zst"


def _evolve(mem: bytearray, rng) -> None:
    """One checkpoint's worth of change: a few words, a rewritten page, a page zeroed."""
    for _ in range(6):
        page, word = int(rng.integers(0, PAGES)), int(rng.integers(0, PS // 8))
        mem[page * PS + word * 8 : page * PS + word * 8 + 8] = rng.bytes(8)
    page = int(rng.integers(0, PAGES))
    mem[page * PS : (page + 1) * PS] = rng.bytes(PS)
    page = int(rng.integers(0, PAGES))
    mem[page * PS : (page + 1) * PS] = bytes(PS)


def build_chain(directory: Path, depth: int, seed: int = 7) -> tuple[list[Path], list[bytes]]:
    """depth+1 links, each written against the previous one with AgainstParent."""
    rng = np.random.default_rng(seed)
    mem = bytearray(rng.bytes(PAGES * PS))
    mem[20 * PS : 40 * PS] = bytes(20 * PS)
    paths, memories, parent = [], [], None
    for k in range(depth + 1):
        if k:
            _evolve(mem, rng)
        path = directory / f"link{k:04d}.lean"
        with LeanImageWriter(path, parent=parent_link(parent) if parent else None, frame_pages=32) as w:
            region = w.add_region("pc.ram", len(mem), 0)
            AgainstParent(w, parent).put_pages(region, "pc.ram", 0, mem)
        # the new link takes over the open chain below it (one open per link in all)
        parent = LeanImage.open(path, parents=[parent] if parent else [])
        paths.append(path)
        memories.append(bytes(mem))
    parent.close()
    return paths, memories


def raw(path, parents=()) -> bytes:
    with LeanImage.open(path, parents=parents) as image:
        out = io.BytesIO()
        restore_raw(image, out)
        return out.getvalue()


@pytest.fixture(scope="module")
def chain(module_dirs):
    return build_chain(module_dirs("chain"), depth=12)


def test_every_link_restores_its_own_moment(chain):
    paths, memories = chain
    for path, memory in zip(paths, memories):
        assert raw(path) == memory


def test_links_use_parent_and_delta_pages(chain):
    paths, _ = chain
    with LeanImage.open(paths[-1]) as image:
        counts = class_counts(image)
    assert counts[PageClass.PARENT] > PAGES // 2
    assert counts[PageClass.DELTA] >= 1
    assert counts[PageClass.STORED] >= 1


def test_resolver_agrees_with_page_by_page_walk(chain):
    paths, memories = chain
    with LeanImage.open(paths[-1]) as image:
        region = image.regions[0]
        walked = b"".join(image.read_page(region, p) for p in range(PAGES))
        assert walked == memories[-1] == bytes(image.region_bytes(region, 0, PAGES))


def _joined_pieces(image, region, first, count) -> bytes:
    return b"".join(
        bytes(n * PS) if data is None else bytes(data) for n, data in image.region_pieces(region, first, count)
    )


@pytest.mark.parametrize("direct_frames_max", [0, 1, 32])
def test_pieces_agree_with_region_bytes(chain, monkeypatch, direct_frames_max):
    """Views of frames, pages built with deltas and blank runs, whatever the frame budget."""
    import leanimg.chain.region_pieces
    import leanimg.pages

    for module in (leanimg.pages, leanimg.chain.region_pieces):  # (frames.DIRECT_FRAMES_MAX's users)
        monkeypatch.setattr(module, "DIRECT_FRAMES_MAX", direct_frames_max)
    paths, memories = chain
    for k in (1, len(paths) - 1):
        with LeanImage.open(paths[k]) as image:
            image.enable_read_ahead()
            region = image.regions[0]
            for first, count in ((0, PAGES), (17, 50), (PAGES - 1, 1)):
                expected = memories[k][first * PS : (first + count) * PS]
                assert _joined_pieces(image, region, first, count) == expected
                assert bytes(image.region_bytes(region, first, count)) == expected


@pytest.mark.parametrize("direct_frames_max", [2, 32])
def test_flat_pieces_with_scattered_ordinals(tmp_path, monkeypatch, direct_frames_max):
    """Pages written in reverse order, one per frame: a range touches a frame per page, more
    than the budget of held frames, and is then copied; bytes are the same either way."""
    import leanimg.chain.region_pieces
    import leanimg.pages

    for module in (leanimg.pages, leanimg.chain.region_pieces):  # (frames.DIRECT_FRAMES_MAX's users)
        monkeypatch.setattr(module, "DIRECT_FRAMES_MAX", direct_frames_max)
    mem = np.random.default_rng(5).bytes(24 * PS)
    path = tmp_path / "scattered.lean"
    with LeanImageWriter(path, frame_pages=1) as w:
        rid = w.add_region("pc.ram", len(mem), 0)
        for p in reversed(range(24)):
            w.put_pages(rid, p, mem[p * PS : (p + 1) * PS])
    with LeanImage.open(path) as image:
        image.enable_read_ahead()
        assert _joined_pieces(image, image.regions[0], 0, 24) == mem
        assert _joined_pieces(image, image.regions[0], 5, 3) == mem[5 * PS : 8 * PS]


def _lying_child(tmp_path, parent_path, lie: str) -> Path:
    """A child whose page 3 claims a digest its resolved bytes do not have (a format 1.0 child:
    in 1.1 a PARENT page has no digest of its own to lie with)."""
    child = tmp_path / f"lie-{lie}.lean"
    with LeanImage.open(parent_path) as parent:
        region = parent.regions[0]
        digests = np.array([parent.expected_digest(region, p) or bytes(16) for p in range(PAGES)], dtype="S16")
        link = parent_link(parent)
    with LeanImageWriter(child, parent=link, frame_pages=32, inherit_digests=False) as w:
        rid = w.add_region("pc.ram", PAGES * PS, 0)
        w.put_parent(rid, 0, digests[:3].tobytes())
        if lie == "parent":  # the parent's bytes, a wrong digest
            w.put_parent(rid, 3, b"\x55" * 16)
        elif lie == "blank":  # over the parent's ZERO page 25, a non-zero digest
            w.put_parent(rid, 3, digests[3:25].tobytes())
            w.put_parent(rid, 25, b"\x55" * 16)
        else:  # a delta whose result is not what the digest says
            w.put_delta(rid, 3, _one_word_delta(), b"\x55" * 16)
        done = 26 if lie == "blank" else 4
        w.put_parent(rid, done, digests[done:].tobytes())
    return child


def _one_word_delta() -> bytes:
    from leanimg import delta

    old = bytes(PS)
    return delta.encode(old, b"\x01" + bytes(PS - 1)) or delta.encode(old, b"\x01" * 8 + bytes(PS - 8))


@pytest.mark.parametrize("lie", ["parent", "blank", "delta"])
def test_a_link_digest_that_lies_is_caught(chain, tmp_path, lie):
    from leanimg.errors import FormatError

    paths, _ = chain
    child = _lying_child(tmp_path, paths[0], lie)
    page = 25 if lie == "blank" else 3
    with LeanImage.open(child, parents=[paths[0]]) as image:
        image.enable_read_ahead()
        region = image.regions[0]
        for read in (lambda: image.region_pieces(region, 0, PAGES), lambda: image.region_bytes(region, 0, PAGES)):
            with pytest.raises(FormatError) as info:
                read()
            assert info.value.rule == "LI-DIG-002" and f"page {page}" in str(info.value)


def test_every_link_validates_against_its_parent(chain):
    paths, _ = chain
    for k, path in enumerate(paths):
        report = validate(path, parents=paths[:k])
        assert report.valid, [str(f) for f in report.findings]
        if k:
            assert report.checked["parent_pages"] > 0


def test_flatten_and_merge(chain, tmp_path):
    paths, memories = chain
    with LeanImage.open(paths[-1]) as image:
        rebase(image, tmp_path / "flat.lean", None)
        rebase(image, tmp_path / "merged.lean", image.parent.parent)
        grandparent_uuid = image.parent.parent.header.image_uuid
    with LeanImage.open(tmp_path / "flat.lean") as flat:
        assert flat.parent is None and not flat.header.has_parent
    assert raw(tmp_path / "flat.lean") == memories[-1]
    assert validate(tmp_path / "flat.lean").valid
    with LeanImage.open(tmp_path / "merged.lean", parents=paths) as merged:
        assert merged.header.parent_uuid == grandparent_uuid
    assert raw(tmp_path / "merged.lean", parents=paths) == memories[-1]
    assert validate(tmp_path / "merged.lean", parents=paths).valid


def test_deep_chain_resolves(tmp_path):
    paths, memories = build_chain(tmp_path, depth=1000, seed=3)
    assert raw(paths[-1]) == memories[-1]
    assert raw(paths[150]) == memories[150]


def test_replaced_parent_is_refused(chain, tmp_path):
    paths, _ = chain
    (tmp_path / "other").mkdir()
    other, _ = build_chain(tmp_path / "other", depth=0, seed=99)
    # a different image copied over the parent's name: same place, wrong identity
    moved = tmp_path / "c"
    moved.mkdir()
    for p in paths[-2:]:
        (moved / p.name).write_bytes(p.read_bytes())
    (moved / paths[-2].name).write_bytes(other[0].read_bytes())
    result = CliRunner().invoke(main, ["restore", str(moved / paths[-1].name), "-o", str(moved / "x.raw")])
    assert result.exit_code == 1 and "LI-CHN-001" in result.output


def test_modified_parent_is_refused(chain, tmp_path):
    paths, _ = chain
    for p in paths[-2:]:
        (tmp_path / p.name).write_bytes(p.read_bytes())
    parent = tmp_path / paths[-2].name
    data = bytearray(parent.read_bytes())
    data[-30] ^= 1  # inside the footer's image digest
    parent.write_bytes(bytes(data))
    result = CliRunner().invoke(main, ["validate", str(tmp_path / paths[-1].name)])
    assert result.exit_code == 1
    assert "LI-FTR-002" in result.output or "LI-CHN-002" in result.output


# --- the CLI on the bundled real QEMU save ------------------------------------------------------
@pytest.fixture(scope="module")
def sample_save(module_dirs):
    path = module_dirs("sample") / "vm.save"
    with open(SAMPLE, "rb") as fin, open(path, "wb") as fout:
        zstandard.ZstdDecompressor().copy_stream(fin, fout)
    return path


def _changed_save(save: Path, out: Path) -> None:
    """The sample with a few 8-byte words changed inside RAM page payloads."""
    data = bytearray(save.read_bytes())
    base = len(data) // 3
    for k in range(8):
        at = base + k * 10 * (PS + 8) + 512
        data[at : at + 8] = bytes(8) if any(data[at : at + 8]) else b"\x01" * 8
    out.write_bytes(bytes(data))


def test_cli_convert_against_parent_and_chain_commands(sample_save, tmp_path):
    run = CliRunner()
    first, second = tmp_path / "c1.lean", tmp_path / "c2.lean"
    changed = tmp_path / "changed.save"
    _changed_save(sample_save, changed)
    assert run.invoke(main, ["convert", str(sample_save), "-o", str(first)]).exit_code == 0
    result = run.invoke(main, ["convert", str(changed), "-o", str(second), "--parent", str(first)])
    assert result.exit_code == 0, result.output
    with LeanImage.open(second) as image:
        counts = class_counts(image)
    assert counts[PageClass.DELTA] >= 1 and counts[PageClass.PARENT] > 1000
    assert os.path.getsize(second) < os.path.getsize(first) // 20
    result = run.invoke(main, ["validate", "--chain", str(second)])
    assert result.exit_code == 0, result.output
    assert result.output.count(": valid;") == 2
    rebuilt = tmp_path / "rebuilt.save"
    assert run.invoke(main, ["restore", str(second), "--to", "qemu", "-o", str(rebuilt)]).exit_code == 0
    assert rebuilt.read_bytes() == changed.read_bytes()
    for command in ("flatten", "merge"):
        out = tmp_path / f"{command}.lean"
        result = run.invoke(main, [command, str(second), "-o", str(out)])
        assert result.exit_code == 0, result.output
        assert run.invoke(main, ["restore", str(out), "--to", "qemu", "-o", str(rebuilt), "--force"]).exit_code == 0
        assert rebuilt.read_bytes() == changed.read_bytes(), command
    no_delta = tmp_path / "nodelta.lean"
    assert (
        run.invoke(main, ["convert", str(changed), "-o", str(no_delta), "--parent", str(first), "--no-delta"]).exit_code
        == 0
    )
    with LeanImage.open(no_delta) as image:
        assert class_counts(image)[PageClass.DELTA] == 0
    assert os.path.getsize(second) < os.path.getsize(no_delta)


def test_cli_inspect_shows_each_link(sample_save, tmp_path):
    run = CliRunner()
    first, second = tmp_path / "c1.lean", tmp_path / "c2.lean"
    run.invoke(main, ["convert", str(sample_save), "-o", str(first)])
    run.invoke(main, ["convert", str(sample_save), "-o", str(second), "--parent", str(first)])
    import json

    summary = json.loads(run.invoke(main, ["inspect", "--json", str(second)]).output)
    assert [set(link["classes"]) for link in summary["chain"]] == [{"PARENT", "ZERO"}, {"STORED", "ZERO"}]


@pytest.mark.parametrize("parser", ["native", "numpy"])
def test_vectorised_delta_parsing_agrees_with_the_checked_decoder(parser, monkeypatch):
    """parse_index_lists may only take entries decode_positions accepts, with the same words."""
    from leanimg import delta
    from leanimg.delta import decode_positions, encode, parse_index_lists

    if parser == "numpy":
        monkeypatch.setattr(delta, "_native", None)
    from leanimg.errors import FormatError

    rng = np.random.default_rng(11)
    entries = []
    for _ in range(300):
        old = rng.bytes(PS)
        new = bytearray(old)
        for word in rng.choice(PS // 8, size=int(rng.integers(1, 40)), replace=False):
            new[word * 8 : word * 8 + 8] = rng.bytes(8)
        entry = bytearray(encode(old, bytes(new)))
        if rng.random() < 0.4:  # damage some: any byte, any value
            entry[int(rng.integers(0, len(entry)))] = int(rng.integers(0, 256))
        entries.append(bytes(entry))
    offsets = np.concatenate(([0], np.cumsum([len(e) for e in entries])))
    simple, start, count, positions, values = parse_index_lists(b"".join(entries), offsets, PS)
    taken = 0
    for k, entry in enumerate(entries):
        try:
            want_pos, want_val = decode_positions(entry, PS)
        except FormatError:
            assert not simple[k], f"entry {k} taken by the fast path but invalid"
            continue
        if simple[k]:
            taken += 1
            got = slice(int(start[k]), int(start[k]) + int(count[k]))
            assert list(positions[got]) == list(want_pos) and list(values[got]) == list(want_val)
    assert taken > 100
