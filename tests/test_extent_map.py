"""`leanimg map` (lean-image/extent_map.py) and `leanimg dump` (lean-image/structure_dump.py).

The map is checked against the pages themselves: every page lies in exactly one extent, of its
class, at the place the extent names (the frame record at record_offset holds its bytes, the
disk holds them at the sector, the delta frame holds its entry); no two neighbouring extents
could be one. Both commands' JSON is validated against lean-image/schemas/ with jsonschema.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import zstandard

from helpers import tagged_page, write_every_class_chain
from leanimg.cli import command_line
from leanimg.disks import open_disk
from leanimg.extent_map import region_extents
from leanimg.format import DISK_SECTOR_SIZE, EXTENT, PAGE_FRAME_BODY, PageClass
from leanimg.inspect import class_counts
from leanimg.reader import LeanImage
from leanimg.structures import ImageFile, dump_structure, parse_body, read_record
from leanimg.writer import LeanImageWriter

ROOT = Path(__file__).resolve().parents[1]
SCHEMAS = ROOT / "lean-image" / "schemas"
SAMPLE_DIR = ROOT / "lean-image" / "sample"
LEANIMG = command_line()
PS = 4096


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([*LEANIMG, *map(str, args)], capture_output=True, timeout=300)


def schema(name: str) -> jsonschema.Draft202012Validator:
    loaded = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(loaded)
    return jsonschema.Draft202012Validator(loaded)


# region "ram" of the child, page by page; DISK pages name the disk block in brackets
CHILD_PLAN = ["STORED"] * 7 + [
    "ZERO",
    "ZERO",
    "FREE",
    "DISK0",
    "DISK1",
    "DISK2",
    "DISK5",
    "DISK6",
    "PARENT",
    "PARENT",
    "DELTA",
    "DELTA",
    "STORED",
    "ZERO",
    "FREE",
    "FREE",
]


@pytest.fixture
def chain(tmp_path):
    """A parent and a child with every class in region "ram", frames of 3 pages (so STORED runs
    are cut by frames) and disk references that stop being consecutive at page 13."""
    return write_every_class_chain(tmp_path, CHILD_PLAN, disk_blocks=8, frame_pages=3, ram_base=0x100000)


def _map(image_path, *args) -> dict:
    proc = run("map", image_path, "--output", "json", *args)
    assert proc.returncode == 0, proc.stderr.decode()
    return json.loads(proc.stdout)


def _frame_pages(image_path, record_offset: int) -> bytes:
    with open(image_path, "rb") as f:
        file = ImageFile(f, str(image_path))
        record = read_record(file, record_offset, file.size)
    body = parse_body(record)
    return zstandard.ZstdDecompressor().decompress(bytes(body["frame"]), max_output_size=16 << 20)


def _check_places(image_path, parents, disk_path, mapped: dict) -> None:
    """Every extent's bytes are where it says; every page is covered once, in order."""
    disk = Path(disk_path).read_bytes() if disk_path else b""
    disks = {"vda": open_disk(str(disk_path), "vda")} if disk_path else {}
    with LeanImage.open(image_path, parents=parents, disks=disks) as image:
        by_region = {r.name: r for r in image.regions}
        covered = {name: 0 for name in by_region}
        for e in mapped["extents"]:
            region = by_region[e["region"]]
            assert e["start"] == covered[e["region"]] * PS, "extents in order, without gaps"
            covered[e["region"]] += e["pages"]
            assert e["length"] == e["pages"] * PS and e["first_page"] * PS == e["start"]
            classes = image.classes(region, e["first_page"], e["pages"])
            assert (classes == PageClass[e["page_class"]]).all()
            if region.guest_phys_base is not None:
                assert e["guest_phys"] == region.guest_phys_base + e["start"]
            memory = bytes(image.region_bytes(region, e["first_page"], e["pages"]))
            where = e["where"]
            if e["page_class"] == "STORED":
                frame = _frame_pages(image_path, where["record_offset"])
                first = where["first_page_in_frame"] * PS
                assert frame[first : first + e["length"]] == memory
            elif e["page_class"] == "DISK":
                at = where["sector"] * DISK_SECTOR_SIZE
                assert disk[at : at + e["length"]] == memory
                assert where["disk"] == "vda"
            elif e["page_class"] in ("PARENT", "DELTA"):
                assert where["parent"] == image.parent.path
            else:
                assert where is None
        assert covered == {name: r.num_pages for name, r in by_region.items()}


def test_every_extent_is_where_it_says(chain):
    child, parent, disk = chain
    mapped = _map(child, "--parent", parent, "--disk", f"vda={disk}")
    schema("map").validate(mapped)
    _check_places(child, [parent], disk, mapped)
    ram = [e for e in mapped["extents"] if e["region"] == "ram"]
    # 7 STORED pages in frames of 3 (the rom's 2 pages fill frame 0 first): cut at each frame
    assert [(e["page_class"], e["pages"]) for e in ram] == [
        ("STORED", 1),
        ("STORED", 3),
        ("STORED", 3),
        ("ZERO", 2),
        ("FREE", 1),
        ("DISK", 3),
        ("DISK", 2),
        ("PARENT", 2),
        ("DELTA", 2),
        ("STORED", 1),
        ("ZERO", 1),
        ("FREE", 2),
    ]
    disk_runs = [e["where"] for e in ram if e["page_class"] == "DISK"]
    assert [w["sector"] for w in disk_runs] == [0, 5 * PS // 512] and disk_runs[0]["disk_path"] == str(disk)


def test_no_two_neighbouring_extents_could_be_one(chain):
    child, parent, disk = chain
    extents = _map(child, "--parent", parent)["extents"]
    for a, b in zip(extents, extents[1:]):
        if a["region"] != b["region"] or a["page_class"] != b["page_class"]:
            continue
        wa, wb = a["where"], b["where"]
        if a["page_class"] == "STORED":
            assert (
                wa["record_offset"] != wb["record_offset"]
                or wa["first_page_in_frame"] + a["pages"] != wb["first_page_in_frame"]
            )
        elif a["page_class"] == "DISK":
            assert wa["sector"] + a["pages"] * PS // 512 != wb["sector"]
        else:
            pytest.fail(f"two {a['page_class']} extents side by side: {a}, {b}")


def test_merging_follows_the_page_map_and_frames_vectorised(tmp_path):
    """Many page-map extents of alternating classes over thousands of frames: the extents are
    the runs of a per-page reference built the slow way."""
    rng = np.random.default_rng(7)
    n = 20000
    classes = rng.choice([PageClass.STORED, PageClass.ZERO, PageClass.FREE], n, p=[0.6, 0.3, 0.1])
    path = tmp_path / "many.lean"
    with LeanImageWriter(path, frame_pages=17) as w:
        region = w.add_region("ram", n * PS)
        for page, cls in enumerate(classes.tolist()):
            if cls == PageClass.STORED:
                w.put_pages(region, page, tagged_page(page + 1))
            elif cls == PageClass.ZERO:
                w.put_zero(region, page)
            else:
                w.put_free(region, page)
    with LeanImage.open(path) as image:
        region = image.regions[0]
        got = region_extents(image, region)
        slots = image.page_slots(region, 0, n)
        frames = image.tables.page_frames.frame_of(slots)
        place = np.where(classes == PageClass.STORED, frames, -1)
        # a new extent wherever the class or the frame changes (slots within a frame continue)
        new = np.concatenate(([True], (classes[1:] != classes[:-1]) | (place[1:] != place[:-1])))
        starts = np.flatnonzero(new)
        assert got["first_page"].tolist() == starts.tolist()
        assert got["num_pages"].tolist() == np.diff(np.append(starts, n)).tolist()
        assert got["page_class"].tolist() == classes[starts].tolist()
        counts = class_counts(image)
        for cls in PageClass:
            assert int(got["num_pages"][got["page_class"] == cls].sum()) == counts[cls]


def test_json_flag_is_output_json(chain):
    child, parent, _ = chain
    proc = run("map", child, "--parent", parent, "--json")
    assert proc.returncode == 0 and json.loads(proc.stdout) == _map(child, "--parent", parent)
    assert json.loads(run("dump", child, "--json").stdout) == json.loads(run("dump", child).stdout)


def test_human_output_has_one_line_per_extent(chain):
    child, parent, _ = chain
    mapped = _map(child, "--parent", parent)
    proc = run("map", child, "--parent", parent)
    assert proc.returncode == 0, proc.stderr.decode()
    lines = proc.stdout.decode().splitlines()
    assert "start is the byte offset in the region" in lines[0]
    assert len(lines) == 2 + len(mapped["extents"])
    assert any("DELTA" in line and "delta frame 0" in line for line in lines)
    assert any(line.startswith("ram") and "disk vda sector 40" in line for line in lines)


@pytest.fixture(scope="module")
def sample_image(module_dirs):
    """The bundled real QEMU 7.2 save converted with its disk."""
    directory = module_dirs("sample")
    for name in ("vm.save", "disk.img"):
        with open(SAMPLE_DIR / f"{name}.zst", "rb") as fin, open(directory / name, "wb") as fout:
            zstandard.ZstdDecompressor().copy_stream(fin, fout)
    image = directory / "vm.lean"
    proc = run("convert", directory / "vm.save", "-o", image, "--disk", f"vda={directory / 'disk.img'}")
    assert proc.returncode == 0, proc.stderr.decode()
    return image, directory / "disk.img"


def test_the_sample_map_validates_and_its_places_hold_the_bytes(sample_image):
    image, disk = sample_image
    mapped = _map(image, "--disk", disk)
    schema("map").validate(mapped)
    assert {e["page_class"] for e in mapped["extents"]} >= {"STORED", "ZERO", "DISK"}
    _check_places(image, [], disk, mapped)


# --- dump ----------------------------------------------------------------------------------------
def test_dump_validates_and_agrees_with_dump_structure(chain):
    child, parent, _ = chain
    proc = run("dump", child)
    assert proc.returncode == 0, proc.stderr.decode()
    dumped = json.loads(proc.stdout)
    schema("dump").validate(dumped)
    want = dump_structure(child)
    assert len(dumped["records"]) == len(want["records"])
    types = {r["type"] for r in dumped["records"]}
    assert types >= {"REGION", "DISK", "PAGE_FRAME", "DELTA_FRAME", "DISK_REFS", "PAGE_MAP", "DIGESTS", "INDEX"}
    for got, expected in zip(dumped["records"], want["records"]):
        assert got["offset"] == expected["offset"] and got["record_type"] == expected["record_type"]
        if got["type"] == "PAGE_MAP":
            assert got["body"]["extents"] == expected["body"]["extents"]
            assert set(got["body"]["extents"][0]) == {f.name for f in EXTENT.head}
        if got["type"] == "PAGE_FRAME":
            assert set(got["body"]) == {f.name for f in PAGE_FRAME_BODY.fields}
    assert dumped["header"]["image_uuid"] == want["header"]["image_uuid"].hex()
    assert dumped["footer"]["file_length"] == child.stat().st_size


def test_dump_payloads_in_full(chain):
    child, _, _ = chain
    summary = json.loads(run("dump", child).stdout)
    full = json.loads(run("dump", child, "--payloads").stdout)
    schema("dump").validate(full)
    want = dump_structure(child)
    frames = [
        (s, f, w) for s, f, w in zip(summary["records"], full["records"], want["records"]) if s["type"] == "PAGE_FRAME"
    ]
    assert frames
    for short, whole, expected in frames:
        frame = expected["body"]["frame"]
        assert bytes.fromhex(whole["body"]["frame"]) == frame
        if len(frame) > 64:
            assert short["body"]["frame"] == {"length": len(frame), "head": frame[:16].hex()}


def test_dump_of_the_sample_validates(sample_image):
    image, _ = sample_image
    proc = run("dump", image)
    assert proc.returncode == 0, proc.stderr.decode()
    schema("dump").validate(json.loads(proc.stdout))


def test_dump_of_a_broken_image_is_one_error_line(chain, tmp_path):
    child, _, _ = chain
    data = bytearray(child.read_bytes())
    data[200] ^= 0xFF  # inside the first records: a checksum breaks
    bad = tmp_path / "bad.lean"
    bad.write_bytes(bytes(data))
    proc = run("dump", bad)
    assert proc.returncode == 1
    lines = proc.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leanimg: error: ") and "offset 0x" in lines[0], lines
    assert proc.stdout == b""  # no truncated JSON


def test_dump_json_of_a_broken_image_is_only_the_error(chain, tmp_path):
    """A record that cannot be read late in the file: stdout holds the JSON error alone."""
    child, _, _ = chain
    data = bytearray(child.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad = tmp_path / "bad.lean"
    bad.write_bytes(bytes(data))
    proc = run("dump", bad, "--json")
    assert proc.returncode == 1
    error = json.loads(proc.stdout)["error"]
    assert error["path"] == str(bad) and error["offset"] is not None and error["rule"], error
    bad.write_bytes(b"XXXX" + bytes(data[4:]))  # the header's magic
    error = json.loads(run("dump", bad, "--json").stdout)["error"]
    assert (error["path"], error["offset"], error["rule"]) == (str(bad), 0, "LI-HDR-001"), error
