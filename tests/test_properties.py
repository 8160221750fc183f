"""Property tests (hypothesis): writer -> reader round trip, bit flips, delta codec.

Profiles (default, ci, expensive) come from helpers.register_hypothesis_profiles,
selected by HYPOTHESIS_PROFILE.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from hypothesis import assume, given, note
from hypothesis import strategies as st

from helpers import register_hypothesis_profiles, roundtrip, write_bytes
from leanimg import delta as deltacodec
from leanimg.format import DeltaEncoding, page_digest
from leanimg.validate import validate
from leanimg.writer import ParentLink, disk_fingerprint

register_hypothesis_profiles()

KINDS = ("stored", "zero-content", "zero", "free", "disk")
DISK_PAGES = 4


def page_content(seed: int, page_size: int, sparse: bool) -> bytes:
    r = np.random.default_rng(seed)
    if sparse:
        words = np.zeros(page_size // 8, np.uint64)
        idx = r.choice(page_size // 8, int(r.integers(1, 6)), replace=False)
        words[idx] = r.integers(1, 1 << 63, len(idx), dtype=np.uint64)
    else:
        words = r.integers(0, 1 << 63, page_size // 8, dtype=np.uint64)
        words[0] |= np.uint64(1)
    return words.astype("<u8").tobytes()


@st.composite
def image_plans(draw):
    page_size = draw(st.sampled_from([4096, 4096, 8192, 16384]))
    frame_pages = draw(st.integers(1, 4))
    regions = []
    for k in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 10))
        kinds = draw(st.lists(st.sampled_from(KINDS), min_size=n, max_size=n))
        gpa = draw(st.one_of(st.none(), st.integers(0, 1 << 40).map(lambda x: x * page_size)))
        regions.append(
            dict(
                name=f"r{k}-" + draw(st.text("abcé.", min_size=0, max_size=4)),
                kinds=kinds,
                gpa=gpa,
                seed=draw(st.integers(0, 2**32 - 1)),
            )
        )
    return page_size, frame_pages, regions


def feed_operations(data, regions, page_size, disk):
    """Contiguous same-kind chunks of random size, in random order; returns (ops, expected)."""
    ops, expected = [], {}
    for r_index, region in enumerate(regions):
        content = bytearray(len(region["kinds"]) * page_size)
        page = 0
        kinds = region["kinds"]
        while page < len(kinds):
            run = 1
            while page + run < len(kinds) and kinds[page + run] == kinds[page]:
                run += 1
            size = data.draw(st.integers(1, run), label="chunk")
            kind = kinds[page]
            for p in range(page, page + size):
                if kind == "stored":
                    sparse = data.draw(st.booleans(), label="sparse")
                    content[p * page_size : (p + 1) * page_size] = page_content(region["seed"] + p, page_size, sparse)
                elif kind == "disk":
                    sector = data.draw(st.integers(0, (len(disk) - page_size) // 512), label="sector")
                    content[p * page_size : (p + 1) * page_size] = disk[sector * 512 : sector * 512 + page_size]
                    ops.append((r_index, "disk", p, sector))
            if kind in ("stored", "zero-content"):
                ops.append((r_index, "pages", page, size))
            elif kind in ("zero", "free"):
                ops.append((r_index, kind, page, size))
            page += size
        expected[region["name"]] = bytes(content)
    order = data.draw(st.permutations(range(len(ops))), label="order")
    return [ops[i] for i in order], expected


@given(plan=image_plans(), data=st.data())
def test_writer_round_trip(plan, data):
    page_size, frame_pages, regions = plan
    disk = b"".join(page_content(99 + k, 4096, False) for k in range(DISK_PAGES * max(1, page_size // 4096)))
    names = [r["name"] for r in regions]
    assume(len(set(names)) == len(names))
    ops, expected = feed_operations(data, regions, page_size, disk)
    uses_disk = any(op[1] == "disk" for op in ops)
    with tempfile.TemporaryDirectory() as d:
        disk_path = os.path.join(d, "disk0.raw")
        with open(disk_path, "wb") as f:
            f.write(disk)

        def build(w):
            disk_id = (
                w.add_disk("disk0", len(disk), disk_fingerprint(lambda o, n: disk[o : o + n], len(disk)))
                if uses_disk
                else None
            )
            ids = [w.add_region(r["name"], len(r["kinds"]) * page_size, guest_phys_base=r["gpa"]) for r in regions]
            for r_index, kind, first, arg in ops:
                rid, name = ids[r_index], regions[r_index]["name"]
                if kind == "pages":
                    w.put_pages(rid, first, expected[name][first * page_size : (first + arg) * page_size])
                elif kind == "zero":
                    w.put_zero(rid, first, arg)
                elif kind == "free":
                    w.put_free(rid, first, arg)
                elif kind == "disk":
                    w.put_disk(rid, first, disk_id, arg, page_digest(disk[arg * 512 : arg * 512 + page_size]))

        image = write_bytes(
            build,
            page_size=page_size,
            frame_pages=frame_pages,
            threads=data.draw(st.sampled_from([1, 2]), label="threads"),
        )
        note(f"{len(image)} bytes, ops {ops}")
        roundtrip(image, expected, page_size=page_size, tmpdir=d, disks={"disk0": disk_path} if uses_disk else None)


@given(
    seed=st.integers(0, 2**32 - 1),
    changes=st.lists(
        st.tuples(st.integers(0, 11), st.lists(st.integers(0, 511), min_size=0, max_size=80)), max_size=12
    ),
    frame_pages=st.integers(1, 3),
)
def test_chain_round_trip(seed, changes, frame_pages):
    """A child of a random parent: PARENT, DELTA (any encoding) and STORED pages read back."""
    ps, n = 4096, 12
    parent_pages = [page_content(seed + k, ps, k % 3 == 0) for k in range(n)]

    def build_parent(w):
        r = w.add_region("ram", n * ps)
        w.put_pages(r, 0, b"".join(parent_pages))

    parent = write_bytes(build_parent, image_uuid=bytes([1] * 16), frame_pages=frame_pages)
    new_pages = list(parent_pages)
    for page, positions in changes:
        words = np.frombuffer(new_pages[page], "<u8").copy()
        words[positions] ^= np.uint64(0xFFFF_0000_1234)
        new_pages[page] = words.tobytes()
    with tempfile.TemporaryDirectory() as d:
        parent_path = os.path.join(d, "parent.lean")
        with open(parent_path, "wb") as f:
            f.write(parent)

        def build_child(w):
            r = w.add_region("ram", n * ps)
            for k in range(n):
                if new_pages[k] == parent_pages[k]:
                    w.put_parent(r, k, page_digest(parent_pages[k]))
                else:
                    w.put_changed(r, k, parent_pages[k], new_pages[k])

        child = write_bytes(build_child, parent=ParentLink(bytes([1] * 16), parent[-24:-8]), frame_pages=frame_pages)
        roundtrip(child, {"ram": b"".join(new_pages)}, page_size=ps, tmpdir=d, parents=[parent_path])


def _small_image(seed: int) -> bytes:
    ps = 4096

    def build(w):
        w.add_source_state(1, 0, b"state")
        r = w.add_region("ram", 6 * ps, guest_phys_base=0)
        w.put_pages(r, 0, b"".join(page_content(seed + k, ps, k % 2 == 0) for k in range(3)))
        w.put_zero(r, 3)
        w.put_free(r, 4, 2)

    return write_bytes(build, frame_pages=2, image_uuid=bytes(range(16)))


SMALL = {seed: _small_image(seed) for seed in (1, 2)}


@given(seed=st.sampled_from(sorted(SMALL)), data=st.data())
def test_single_bit_flip_is_reported(seed, data):
    image = SMALL[seed]
    pos = data.draw(st.integers(0, len(image) - 1), label="pos")
    bit = data.draw(st.integers(0, 7), label="bit")
    flipped = bytearray(image)
    flipped[pos] ^= 1 << bit
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f.lean")
        with open(path, "wb") as f:
            f.write(flipped)
        assert validate(path).findings, f"flip of bit {bit} at {pos} not reported"


@st.composite
def page_pairs(draw):
    page_size = draw(st.sampled_from([4096, 8192, 65536]))
    words = page_size // 8
    seed = draw(st.integers(0, 2**32 - 1))
    old = np.random.default_rng(seed).integers(0, 1 << 63, words, dtype=np.uint64)
    style = draw(st.sampled_from(["scattered", "runs", "mixed", "dense"]))
    if style == "scattered":
        positions = draw(st.lists(st.integers(0, words - 1), max_size=150, unique=True))
    elif style == "runs":
        positions = []
        for _ in range(draw(st.integers(1, 6))):
            start = draw(st.integers(0, words - 1))
            positions += range(start, min(words, start + draw(st.integers(1, 300))))
    elif style == "mixed":
        positions = draw(st.lists(st.integers(0, words - 1), max_size=40)) + list(
            range(draw(st.integers(0, words - 100)), words - draw(st.integers(0, words - 100)))
        )
    else:
        positions = range(0, words, draw(st.integers(1, 3)))
    new = old.copy()
    pos = np.unique(np.asarray(list(positions), dtype=np.int64))
    new[pos] ^= np.uint64(0x8000_0000_0000_0001)
    return page_size, old.astype("<u8").tobytes(), new.astype("<u8").tobytes(), pos


@given(page_pairs())
def test_delta_round_trip_and_smallest_encoding(pair):
    page_size, old, new, positions = pair
    entry = deltacodec.encode(old, new)
    if len(positions) == 0:
        assert entry is None
        return
    runs = 1 + int((np.diff(positions) != 1).sum())
    sizes = deltacodec.encoded_sizes(len(positions), runs, page_size)
    smallest = min(sizes.values())
    if smallest >= page_size:
        assert entry is None  # LI-DLT-004: store the page instead
        return
    assert entry is not None
    encoding = DeltaEncoding(entry[0])
    assert len(entry) == sizes[encoding] == smallest, (encoding, sizes)
    assert deltacodec.apply(entry, old) == new
    got_positions, values = deltacodec.decode_positions(entry, page_size)
    assert list(got_positions) == list(positions)
    assert values.tobytes() == np.frombuffer(new, "<u8")[positions].tobytes()


@pytest.mark.parametrize(
    "positions,encoding",
    [
        ([3, 77, 400], DeltaEncoding.INDEX_LIST),
        (list(range(5, 512, 12)), DeltaEncoding.BITMAP),
        (list(range(10, 70)) + list(range(200, 260)), DeltaEncoding.RUNS),
    ],
)
def test_delta_encoder_choices(positions, encoding):
    old = np.arange(512, dtype="<u8")
    new = old.copy()
    new[positions] += np.uint64(1)
    entry = deltacodec.encode(old.tobytes(), new.tobytes())
    assert entry[0] == encoding
    assert deltacodec.apply(entry, old.tobytes()) == new.tobytes()
