"""A picture of guest memory coloured by page class (``leanimg inspect IMG --map FILE.png|FILE.svg``).

Every region is a band of cells in page order, left to right, top to bottom, under a label
with its name, size and class shares; the left margin gives the byte offset in the region at
which rows start (rows hold a power of two of pages, so the offsets are round). A legend gives
each class's colour, pages, MiB and share. A cell is one page when the map fits in about
``MAX_BANDS_HEIGHT`` pixels with cells of 2 px or more; larger guests get 1-pixel cells of
``pages_per_cell`` pages (a power of two) coloured by the class most of them have. Cells are
computed from the extents, never from a per-page array, so a map of a huge region costs
memory in proportion to the picture, not to the guest.

PNG is drawn with Pillow (the ``map`` extra: ``pip install leanimg[map]``) and its built-in
font; SVG is written as text and needs nothing beyond the standard library.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING
from xml.sax.saxutils import escape

import numpy as np

from .errors import UnsupportedError
from .fileutil import write_atomically
from .format import PageClass

if TYPE_CHECKING:
    from .tables import Region

MAX_ROWS = 2048  # cell rows of all bands together, before pages are bucketed
MAX_BANDS_HEIGHT = 760  # small maps take the biggest cell that keeps their bands below this
CELL_SIZES = (16, 8, 4, 2)
BAND_WIDTH = 1024  # pixels of cells in a row (columns x cell, a power of two)
MARGIN = 24
GUTTER = 96  # left of the bands: the offset scale
TITLE_SIZE, TEXT_SIZE, SMALL_SIZE = 20, 14, 12
LINE = TEXT_SIZE + 6
LABELLED_REGIONS_MAX = 64  # more regions than this: bands without labels
SWATCH = 14
LEGEND_COLUMNS = 2
LEGEND_COLUMN_WIDTH = 420
LEGEND_CELLS = ((SWATCH + 8, "l"), (SWATCH + 200, "r"), (SWATCH + 300, "r"), (SWATCH + 370, "r"))  # x, alignment

# Okabe-Ito colours (distinguishable with the common colour-vision deficiencies),
# and a light grey for ZERO pages, which hold nothing.
CLASS_COLOURS = {
    PageClass.STORED: (0x00, 0x72, 0xB2),  # blue
    PageClass.ZERO: (0xD9, 0xD9, 0xD9),  # light grey
    PageClass.FREE: (0x00, 0x9E, 0x73),  # bluish green
    PageClass.DISK: (0x56, 0xB4, 0xE9),  # sky blue
    PageClass.PARENT: (0xCC, 0x79, 0xA7),  # reddish purple
    PageClass.DELTA: (0xE6, 0x9F, 0x00),  # orange
}
BACKGROUND = (0xFF, 0xFF, 0xFF)
INK = (0x22, 0x22, 0x22)
MUTED = (0x66, 0x66, 0x66)
RULE = (0xBB, 0xBB, 0xBB)
UNKNOWN = (0x00, 0x00, 0x00)  # a class id outside the spec (the reader rejects those)
MIB = 1 << 20


# --- layout ------------------------------------------------------------------------------------
@dataclass
class Band:
    region: Region
    label_y: int | None  # top of the label line, None when labels are off
    y: int  # top pixel row of the band
    rows: int  # cell rows
    cells: int  # cells in use (the rest of the last row is background)
    tick_rows: int  # the offset scale labels every tick_rows rows


@dataclass
class Layout:
    width: int
    height: int
    cell: int  # cell edge in pixels
    columns: int  # cells per row
    pages_per_cell: int
    bands: list
    title_y: int
    subtitle_y: int
    legend_y: int
    band_x: int = MARGIN + GUTTER

    def cell_origin(self, band: Band, page: int) -> tuple[int, int]:
        """(x, y) of the top-left pixel of the cell that holds ``page`` of the band's region."""
        k = page // self.pages_per_cell
        return self.band_x + (k % self.columns) * self.cell, band.y + (k // self.columns) * self.cell


def _rows(pages: list[int], columns: int, per_cell: int) -> int:
    return sum(math.ceil(math.ceil(n / per_cell) / columns) for n in pages)


def _scale(pages: list[int]) -> tuple[int, int, int]:
    """(cell px, columns, pages per cell): one page per cell of the biggest size that keeps the
    bands under MAX_BANDS_HEIGHT, else 1-px cells of a power of two pages under MAX_ROWS rows."""
    for cell in CELL_SIZES:
        columns = BAND_WIDTH // cell
        if _rows(pages, columns, 1) * cell <= MAX_BANDS_HEIGHT:
            return cell, columns, 1
    columns, per_cell = BAND_WIDTH, 1
    while _rows(pages, columns, per_cell) > MAX_ROWS and per_cell < max(pages, default=1):
        per_cell *= 2
    return 1, columns, per_cell


def layout(image) -> Layout:
    """Where everything goes: cell size, pages per cell, bands, legend."""
    pages = [r.num_pages for r in image.regions]
    cell, columns, per_cell = _scale(pages)
    labels = len(pages) <= LABELLED_REGIONS_MAX
    title_y = MARGIN
    subtitle_y = title_y + TITLE_SIZE + 8
    y = subtitle_y + LINE + 14
    bands = []
    for k, region in enumerate(image.regions):
        if k:
            y += 14  # a rule between bands, space around it
        label_y = None
        if labels:
            label_y, y = y, y + LINE
        cells = math.ceil(region.num_pages / per_cell)
        rows = max(1, math.ceil(cells / columns))
        tick_rows = 1 << max(0, math.ceil(math.log2(max(1, (SMALL_SIZE + 8) / cell))))
        bands.append(Band(region, label_y, y, rows, cells, tick_rows))
        y += rows * cell
    legend_y = y + 24
    legend_rows = math.ceil(len(PageClass) / LEGEND_COLUMNS)
    height = legend_y + LINE + legend_rows * LINE + MARGIN
    width = max(MARGIN + GUTTER + BAND_WIDTH, MARGIN + LEGEND_COLUMNS * LEGEND_COLUMN_WIDTH) + MARGIN
    return Layout(width, height, cell, columns, per_cell, bands, title_y, subtitle_y, legend_y)


# --- cells ---------------------------------------------------------------------------------------
def cell_classes(extents: np.ndarray, num_pages: int, per_cell: int) -> np.ndarray:
    """The class of every cell: per page when ``per_cell`` is 1, else the majority of its pages.

    Works on the extents (cumulative page counts per class at the cell boundaries), so
    memory is O(extents + cells) whatever the region size. Ties go to the lower class id.
    """
    first = extents["first_page"].astype(np.int64)
    num = extents["num_pages"].astype(np.int64)
    cls = extents["page_class"].astype(np.int64)
    if per_cell == 1:
        return np.repeat(cls, num)[:num_pages].astype(np.uint8)
    cells = math.ceil(num_pages / per_cell)
    bounds = np.minimum(np.arange(cells + 1, dtype=np.int64) * per_cell, num_pages)
    at = np.maximum(np.searchsorted(first, bounds, side="right") - 1, 0)
    into = bounds - first[at]
    best = np.zeros(cells, np.int64)
    winner = np.zeros(cells, np.uint8)
    for c in PageClass:
        mine = cls == c
        if not mine.any():
            continue
        before = np.concatenate(([0], np.cumsum(np.where(mine, num, 0))))
        upto = before[at] + np.where(mine[at], into, 0)
        count = np.diff(upto)
        better = count > best
        best = np.where(better, count, best)
        winner[better] = c
    return winner


def band_grid(lay: Layout, band: Band) -> np.ndarray:
    """(rows, columns) class ids of a band's cells; 0 where the last row has no cell."""
    grid = np.zeros(band.rows * lay.columns, np.uint8)
    grid[: band.cells] = cell_classes(band.region.extents, band.region.num_pages, lay.pages_per_cell)
    return grid.reshape(band.rows, lay.columns)


def _palette() -> np.ndarray:
    palette = np.tile(np.array(UNKNOWN, np.uint8), (256, 1))
    palette[0] = BACKGROUND
    for cls, colour in CLASS_COLOURS.items():
        palette[int(cls)] = colour
    return palette


def class_totals(image) -> np.ndarray:
    """Pages of each class id (index 0..6) over all regions."""
    totals = np.zeros(7, np.int64)
    for region in image.regions:
        cls = region.extents["page_class"].astype(np.int64)
        known = cls <= max(PageClass)
        totals += np.bincount(
            cls[known], weights=region.extents["num_pages"][known].astype(np.float64), minlength=7
        ).astype(np.int64)
    return totals


# --- text -----------------------------------------------------------------------------------------
def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n // scale} {unit}" if n % scale == 0 else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _texts(image, lay: Layout) -> dict:
    """Every string of the figure: title, subtitle, region labels, legend rows."""
    regions = image.regions
    total_bytes = sum(r.size_bytes for r in regions)
    name = os.path.basename(getattr(image, "path", "") or "") or "image"
    title = f"{name}: guest memory by page class"
    if lay.pages_per_cell == 1:
        unit = f"1 cell = 1 page of {_size(image.page_size)}"
    else:
        unit = f"1 pixel = {lay.pages_per_cell} pages of {_size(image.page_size)} (the class most of them have)"
    row_bytes = lay.columns * lay.pages_per_cell * image.page_size
    subtitle = (
        f"{_size(total_bytes)} in {len(regions)} region{'s' if len(regions) != 1 else ''}; {unit}; "
        f"a row is {_size(row_bytes)}; left: byte offset in the region"
    )
    labels = []
    for band in lay.bands:
        region = band.region
        label = f"{region.name}   {_size(region.size_bytes)}"
        if region.guest_phys_base is not None:
            label += f" at {region.guest_phys_base:#x}"
        shares = _shares(region)
        labels.append((label, shares))
    totals = class_totals(image)
    pages = int(totals.sum()) or 1
    legend = [
        (
            cls,
            (
                cls.name,
                f"{int(totals[cls]):,} pages",
                _size(int(totals[cls]) * image.page_size),
                f"{100.0 * totals[cls] / pages:.1f}%",
            ),
        )
        for cls in PageClass
    ]
    return dict(title=title, subtitle=subtitle, labels=labels, legend=legend, row_bytes=row_bytes)


def _shares(region) -> str:
    e = region.extents
    counts = np.bincount(e["page_class"].astype(np.int64), weights=e["num_pages"].astype(np.float64), minlength=7)
    total = counts.sum() or 1
    parts = [f"{cls.name} {_percent(100 * counts[cls] / total)}" for cls in PageClass if counts[cls]]
    return ", ".join(parts)


def _percent(value: float) -> str:
    return f"{value:.0f}%" if value >= 9.5 or value == 0 else f"{value:.1f}%"


def _ticks(lay: Layout, band: Band, row_bytes: int) -> list[tuple[int, str]]:
    """(y, label) of the offset scale of a band: every tick_rows rows, from its top."""
    return [(band.y + row * lay.cell, f"{row * row_bytes:#x}") for row in range(0, band.rows, band.tick_rows)]


# --- PNG (Pillow) ------------------------------------------------------------------------------------
def _pillow():
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        raise UnsupportedError(
            "drawing a PNG map needs Pillow: pip install 'leanimg[map]' (or write an SVG: --map FILE.svg)",
            structure="--map",
        ) from None
    return Image, ImageDraw, ImageFont


def _font(ImageFont, size: int):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one small bitmap font
        return ImageFont.load_default()


def render_pixels(image) -> tuple[np.ndarray, Layout]:
    """The map as an (height, width, 3) uint8 array, and its layout."""
    Image, ImageDraw, ImageFont = _pillow()
    lay = layout(image)
    texts = _texts(image, lay)
    canvas = np.empty((lay.height, lay.width, 3), np.uint8)
    canvas[:] = BACKGROUND
    palette = _palette()
    for band in lay.bands:
        rgb = palette[band_grid(lay, band)]
        s = lay.cell
        if s > 1:
            rgb = np.broadcast_to(rgb[:, None, :, None, :], (band.rows, s, lay.columns, s, 3))
            rgb = rgb.reshape(band.rows * s, lay.columns * s, 3).copy()
            if s >= 4:  # a 1-pixel gap between cells
                rgb[s - 1 :: s, :] = BACKGROUND
                rgb[:, s - 1 :: s] = BACKGROUND
        canvas[band.y : band.y + rgb.shape[0], lay.band_x : lay.band_x + rgb.shape[1]] = rgb
    picture = Image.fromarray(canvas, "RGB")
    draw = ImageDraw.Draw(picture)
    fonts = {size: _font(ImageFont, size) for size in (TITLE_SIZE, TEXT_SIZE, SMALL_SIZE)}
    draw.text((MARGIN, lay.title_y), texts["title"], font=fonts[TITLE_SIZE], fill=INK)
    draw.text((MARGIN, lay.subtitle_y), texts["subtitle"], font=fonts[TEXT_SIZE], fill=MUTED)
    right = lay.band_x + lay.columns * lay.cell
    for k, (band, (label, shares)) in enumerate(zip(lay.bands, texts["labels"])):
        if k:
            top = (band.label_y if band.label_y is not None else band.y) - 8
            draw.line([(MARGIN, top), (right, top)], fill=RULE)
        if band.label_y is not None:
            draw.text((lay.band_x, band.label_y), label, font=fonts[TEXT_SIZE], fill=INK)
            width = draw.textlength(label, font=fonts[TEXT_SIZE])
            draw.text((lay.band_x + width + 16, band.label_y + 2), shares, font=fonts[SMALL_SIZE], fill=MUTED)
        for y, text in _ticks(lay, band, texts["row_bytes"]):
            draw.line([(lay.band_x - 6, y), (lay.band_x - 2, y)], fill=MUTED)
            draw.text((lay.band_x - 9, y), text, font=fonts[SMALL_SIZE], fill=MUTED, anchor="rm")
    draw.text((MARGIN, lay.legend_y), "page classes (all regions)", font=fonts[TEXT_SIZE], fill=INK)
    for k, (cls, cells) in enumerate(texts["legend"]):
        x, y = _legend_origin(lay, k)
        draw.rectangle([x, y, x + SWATCH - 1, y + SWATCH - 1], fill=CLASS_COLOURS[cls], outline=INK)
        for (dx, align), text in zip(LEGEND_CELLS, cells):
            draw.text((x + dx, y + SWATCH // 2), text, font=fonts[TEXT_SIZE], fill=INK, anchor=align + "m")
    return np.asarray(picture), lay


def _legend_origin(lay: Layout, k: int) -> tuple[int, int]:
    rows = math.ceil(len(PageClass) / LEGEND_COLUMNS)
    return MARGIN + (k // rows) * LEGEND_COLUMN_WIDTH, lay.legend_y + LINE + (k % rows) * LINE


def encode_png(rgb: np.ndarray) -> bytes:
    Image = _pillow()[0]
    import io

    out = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(out, format="PNG", optimize=True)
    return out.getvalue()


# --- SVG (text) ---------------------------------------------------------------------------------------
def render_svg(image) -> str:
    """The same figure as SVG: one rect per run of cells of one class in a row."""
    lay = layout(image)
    texts = _texts(image, lay)
    style = "".join(f".{cls.name}{{fill:#{'%02x%02x%02x' % CLASS_COLOURS[cls]}}}" for cls in PageClass)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{lay.width}" height="{lay.height}" '
        f'viewBox="0 0 {lay.width} {lay.height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">',
        f"<style>{style} text{{fill:#222}} .muted{{fill:#666}}</style>",
        f'<rect width="{lay.width}" height="{lay.height}" fill="#fff"/>',
        _svg_text(MARGIN, lay.title_y + TITLE_SIZE, texts["title"], TITLE_SIZE),
        _svg_text(MARGIN, lay.subtitle_y + TEXT_SIZE, texts["subtitle"], TEXT_SIZE, "muted"),
    ]
    right = lay.band_x + lay.columns * lay.cell
    for k, (band, (label, shares)) in enumerate(zip(lay.bands, texts["labels"])):
        out.append(f'<g class="region" data-name="{escape(str(band.region.name), {chr(34): "&quot;"})}">')
        if k:
            top = (band.label_y if band.label_y is not None else band.y) - 8
            out.append(f'<line x1="{MARGIN}" y1="{top}" x2="{right}" y2="{top}" stroke="#bbb"/>')
        if band.label_y is not None:
            out.append(_svg_text(lay.band_x, band.label_y + TEXT_SIZE, label, TEXT_SIZE))
            out.append(
                _svg_text(
                    lay.band_x + 0.6 * TEXT_SIZE * len(label) + 16,
                    band.label_y + TEXT_SIZE,
                    shares,
                    SMALL_SIZE,
                    "muted",
                )
            )
        out.extend(_svg_cells(lay, band))
        for y, text in _ticks(lay, band, texts["row_bytes"]):
            out.append(f'<line x1="{lay.band_x - 6}" y1="{y}" x2="{lay.band_x - 2}" y2="{y}" stroke="#666"/>')
            out.append(_svg_text(lay.band_x - 9, y + SMALL_SIZE // 3, text, SMALL_SIZE, "muted", anchor="end"))
        out.append("</g>")
    out.append(
        f'<g class="legend">{_svg_text(MARGIN, lay.legend_y + TEXT_SIZE, "page classes (all regions)", TEXT_SIZE)}'
    )
    for k, (cls, cells) in enumerate(texts["legend"]):
        x, y = _legend_origin(lay, k)
        out.append(f'<rect class="{cls.name}" x="{x}" y="{y}" width="{SWATCH}" height="{SWATCH}" stroke="#222"/>')
        for (dx, align), text in zip(LEGEND_CELLS, cells):
            out.append(_svg_text(x + dx, y + SWATCH - 2, text, TEXT_SIZE, anchor="end" if align == "r" else None))
    out.append("</g></svg>\n")
    return "\n".join(out)


def _svg_text(x, y, text: str, size: int, css: str | None = None, anchor: str | None = None) -> str:
    attrs = f' class="{css}"' if css else ""
    attrs += f' text-anchor="{anchor}"' if anchor else ""
    return f'<text x="{x:g}" y="{y:g}" font-size="{size}"{attrs}>{escape(text)}</text>'


def _svg_cells(lay: Layout, band: Band) -> list[str]:
    """A rect per run of equal cells in a row (found with numpy); empty cells draw nothing."""
    grid = band_grid(lay, band)
    rows, columns = grid.shape
    starts = np.ones(grid.shape, bool)
    starts[:, 1:] = grid[:, 1:] != grid[:, :-1]
    at = np.flatnonzero(starts)
    row, column = at // columns, at % columns
    end = np.minimum(np.append(at[1:], rows * columns), (row + 1) * columns)
    length = end - at
    cls = grid.reshape(-1)[at]
    keep = cls != 0
    s = lay.cell
    return [
        f'<rect class="{_class_name(c)}" x="{lay.band_x + x * s}" y="{band.y + r * s}" width="{n * s}" height="{s}"/>'
        for c, r, x, n in zip(cls[keep].tolist(), row[keep].tolist(), column[keep].tolist(), length[keep].tolist())
    ]


def _class_name(cls: int) -> str:
    try:
        return PageClass(cls).name
    except ValueError:
        return "UNKNOWN"


# --- output -------------------------------------------------------------------------------------------
def render_map(image, path) -> None:
    """Draw ``image``'s guest memory by page class at ``path`` (written atomically): SVG when
    the name ends in .svg, else PNG."""
    path = os.fspath(path)
    if path.lower().endswith(".svg"):
        data = render_svg(image).encode("utf-8")
    else:
        data = encode_png(render_pixels(image)[0])
    write_atomically(path, lambda out: out.write(data))
