"""The page-class map (`leanimg inspect IMG --map FILE.png|FILE.svg`): pixels, bucketing, legend, SVG, CLI."""

from __future__ import annotations

import io
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from helpers import write_every_class_chain
from leanimg.cli import main
from leanimg.format import EXTENT, PageClass
from leanimg.inspect import class_counts
from leanimg.memory_picture import (
    BACKGROUND,
    CLASS_COLOURS,
    MAX_ROWS,
    cell_classes,
    layout,
    render_map,
    render_pixels,
    render_svg,
)
from leanimg.reader import LeanImage

PS = 4096


def decode_png(data: bytes) -> np.ndarray:
    """The PNG's pixels, decoded by Pillow (an independent decoder of what we wrote)."""
    with Image.open(io.BytesIO(data)) as picture:
        assert picture.format == "PNG"
        return np.asarray(picture.convert("RGB"))


# the page classes of region "ram" of the child image, page by page (DISK<k>: block k of the disk)
CHILD_PLAN = [
    "STORED",
    "STORED",
    "ZERO",
    "ZERO",
    "FREE",
    "FREE",
    "DISK2",
    "DISK3",
    "PARENT",
    "PARENT",
    "PARENT",
    "DELTA",
    "DELTA",
    "STORED",
    "ZERO",
    "FREE",
]


@pytest.fixture
def chain(tmp_path):
    """A parent and a child image whose region 'ram' has every class at known pages,
    plus a second region 'rom' of the child holding only STORED pages."""
    child, parent, _ = write_every_class_chain(tmp_path, CHILD_PLAN, disk_blocks=4, rom_pages=3, rom_base=0xFFFC0000)
    return child, parent


def _colour(pixels: np.ndarray, x: int, y: int) -> tuple:
    return tuple(int(v) for v in pixels[y, x])


def test_pixels_at_known_pages_have_the_class_colours(chain, tmp_path):
    child, parent = chain
    out = tmp_path / "map.png"
    with LeanImage.open(child, parents=[parent]) as image:
        render_map(image, out)
        lay = layout(image)
    pixels = decode_png(out.read_bytes())
    assert pixels.shape == (lay.height, lay.width, 3)
    assert lay.pages_per_cell == 1
    ram, rom = lay.bands
    assert (ram.region.name, rom.region.name) == ("ram", "rom")
    for page, name in enumerate(CHILD_PLAN):
        x, y = lay.cell_origin(ram, page)
        assert _colour(pixels, x, y) == CLASS_COLOURS[PageClass[name.rstrip("0123456789")]], f"page {page} ({name})"
    for page in range(3):
        x, y = lay.cell_origin(rom, page)
        assert _colour(pixels, x, y) == CLASS_COLOURS[PageClass.STORED]
    # the rest of the last cell row is background
    x, y = lay.cell_origin(rom, 3)
    assert _colour(pixels, x, y) == BACKGROUND


def test_legend_has_every_class_swatch_and_text(chain, tmp_path):
    child, parent = chain
    with LeanImage.open(child, parents=[parent]) as image:
        pixels, lay = render_pixels(image)
    legend = pixels[lay.legend_y :]
    assert (legend != BACKGROUND).any(axis=2).sum() > 500, "legend is empty"
    colours = {tuple(c) for c in legend.reshape(-1, 3).tolist()}
    for cls in PageClass:
        assert CLASS_COLOURS[cls] in colours, f"no {cls.name} swatch"
    # the header (title and scale) has text too
    assert (pixels[: lay.bands[0].label_y] != BACKGROUND).any()


def test_each_class_colour_covers_exactly_its_pages(chain, tmp_path):
    """Cell by cell over every band: a cell has the colour of its page's class, so each class's
    colour appears in as many cells as the image has pages of that class, and nowhere else."""
    child, parent = chain
    out = tmp_path / "map.png"
    with LeanImage.open(child, parents=[parent]) as image:
        render_map(image, out)
        lay = layout(image)
        counts = class_counts(image)
    pixels = decode_png(out.read_bytes())
    assert pixels.shape == (lay.height, lay.width, 3) and lay.cell >= 4
    seen = Counter()
    for band in lay.bands:
        for row in range(band.rows):
            for column in range(lay.columns):
                x, y = lay.band_x + column * lay.cell, band.y + row * lay.cell
                seen[_colour(pixels, x, y)] += 1
    for cls in PageClass:
        assert seen[CLASS_COLOURS[cls]] == counts[cls], cls.name
    assert sum(seen[CLASS_COLOURS[cls]] for cls in PageClass) + seen[BACKGROUND] == sum(seen.values())


def test_legend_states_each_class_size(chain):
    from leanimg.memory_picture import _size, _texts

    child, parent = chain
    with LeanImage.open(child, parents=[parent]) as image:
        texts = _texts(image, layout(image))
        counts = class_counts(image)
    rows = dict(texts["legend"])
    total = sum(counts.values())
    for cls in PageClass:
        name, pages, mib, percent = rows[cls]
        assert name == cls.name and pages == f"{counts[cls]:,} pages"
        assert mib == _size(counts[cls] * PS) and percent == f"{100 * counts[cls] / total:.1f}%"
    assert (
        rows[PageClass.STORED][2] == f"{counts[PageClass.STORED] * 4} KiB"
        and _size(3 * 2**20 // 2) == "1.5 MiB"
        and _size(0) == "0 B"
    )
    assert texts["labels"][0][0].startswith("ram   64 KiB at 0x0")


def _svg(image) -> ET.Element:
    return ET.fromstring(render_svg(image))


def test_svg_parses_and_its_cells_cover_each_class(chain):
    child, parent = chain
    ns = {"svg": "http://www.w3.org/2000/svg"}
    with LeanImage.open(child, parents=[parent]) as image:
        root = _svg(image)
        lay = layout(image)
        counts = class_counts(image)
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert (int(root.get("width")), int(root.get("height"))) == (lay.width, lay.height)
    regions = root.findall("svg:g[@class='region']", ns)
    assert [g.get("data-name") for g in regions] == ["ram", "rom"]
    covered = Counter()
    for g in regions:
        for rect in g.findall("svg:rect", ns):
            covered[rect.get("class")] += int(rect.get("width")) // lay.cell
    for cls in PageClass:
        assert covered[cls.name] == counts[cls], cls.name
    legend = root.find("svg:g[@class='legend']", ns)
    assert {r.get("class") for r in legend.findall("svg:rect", ns)} == {cls.name for cls in PageClass}
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert any(t and t.startswith("ram") for t in texts) and any(t == "0x0" for t in texts)
    style = root.find("svg:style", ns).text
    for cls in PageClass:
        assert f".{cls.name}{{fill:#{'%02x%02x%02x' % CLASS_COLOURS[cls]}}}" in style


def test_cli_inspect_map_svg(chain, tmp_path):
    child, parent = chain
    out = tmp_path / "map.svg"
    result = CliRunner().invoke(main, ["inspect", str(child), "--parent", str(parent), "--map", str(out)])
    assert result.exit_code == 0, result.output
    ET.parse(out)
    with LeanImage.open(child, parents=[parent]) as image:
        assert out.read_text() == render_svg(image)


def test_png_without_pillow_names_the_extra(chain, tmp_path, monkeypatch):
    child, parent = chain
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL raises ImportError
    out = tmp_path / "map.png"
    result = CliRunner().invoke(main, ["inspect", str(child), "--parent", str(parent), "--map", str(out)])
    assert result.exit_code == 1
    assert "pip install 'leanimg[map]'" in result.output and not out.exists()


def _brute_force_cells(extents, num_pages, per_cell):
    classes = np.repeat(extents["page_class"], extents["num_pages"].astype(np.int64))
    cells = []
    for start in range(0, num_pages, per_cell):
        counts = np.bincount(classes[start : start + per_cell], minlength=7)
        cells.append(int(np.argmax(counts)))  # ties: lowest class id, as cell_classes
    return np.array(cells, np.uint8)


def _extents(runs):
    e = np.zeros(len(runs), EXTENT.dtype)
    lengths = np.array([n for n, _ in runs])
    e["first_page"] = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    e["num_pages"] = lengths
    e["page_class"] = [c for _, c in runs]
    return e


@pytest.mark.parametrize("seed", range(20))
def test_majority_buckets_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    runs = [(int(rng.integers(1, 40)), int(rng.integers(1, 7))) for _ in range(int(rng.integers(1, 60)))]
    e = _extents(runs)
    n = int(e["num_pages"].sum())
    for per_cell in (1, 2, 3, 7, 16, 64, n + 5):
        assert np.array_equal(cell_classes(e, n, per_cell), _brute_force_cells(e, n, per_cell)), per_cell


def test_huge_region_is_bucketed_without_per_page_memory():
    """2^36 pages (256 TiB): the map stays within MAX_ROWS and is computed from the extents."""
    n = 1 << 36
    e = _extents([(n // 4, 2), (n // 4, 1), (n // 2 - 8, 3), (8, 1)])
    region = SimpleNamespace(name="huge", region_id=0, num_pages=n, size_bytes=n * PS, guest_phys_base=None, extents=e)
    image = SimpleNamespace(regions=[region], page_size=PS)
    pixels, lay = render_pixels(image)
    band = lay.bands[0]
    assert band.rows <= MAX_ROWS and lay.pages_per_cell > 1
    for page, cls in ((0, 2), (n // 4 + 10, 1), (n - 9 * lay.pages_per_cell, 3)):
        x, y = lay.cell_origin(band, page)
        assert _colour(pixels, x, y) == CLASS_COLOURS[PageClass(cls)]


def test_cli_inspect_map(chain, tmp_path):
    child, parent = chain
    out = tmp_path / "maps" / "out.png"
    out.parent.mkdir()
    result = CliRunner().invoke(main, ["inspect", str(child), "--parent", str(parent), "--map", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["map"] == str(out)
    with LeanImage.open(child, parents=[parent]) as image:
        expected, _ = render_pixels(image)
    assert np.array_equal(decode_png(out.read_bytes()), expected)
    assert os.listdir(out.parent) == ["out.png"], "no temporary file left behind"
