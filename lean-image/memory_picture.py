"""A PNG picture of guest memory coloured by page class (``leanimg inspect IMG --map FILE.png``).

Every region is a band of cells in page order, left to right, top to bottom, under a
label with its name and size; a legend gives each class's colour and share of all pages.
A cell is one page when the map fits ``MAX_ROWS`` rows (small images get bigger cells),
else a bucket of ``pages_per_cell`` pages coloured by the class most of them have.
Cells are computed from the extents, never from a per-page array, so a map of a huge
region costs memory in proportion to the picture, not to the guest.

No dependency beyond numpy: the PNG is encoded here with zlib (8-bit RGB, filter 0),
and text uses a built-in 5x7 bitmap font.
"""

from __future__ import annotations

import math
import os
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from .fileutil import write_atomically
from .format import PageClass
from .reader import LeanImage, Region

MAX_ROWS = 2048          # cell rows of all bands together, before pages are bucketed
SMALL_MAP_ROWS = 768     # small maps get cells of up to CELL_MAX px while they stay below this
CELL_MAX = 16
MARGIN = 8
TEXT_SCALE = 2
GLYPH_W, GLYPH_H = 5, 7
ADVANCE = (GLYPH_W + 1) * TEXT_SCALE
LINE = GLYPH_H * TEXT_SCALE
LABELLED_REGIONS_MAX = 64  # more regions than this: bands without labels
SWATCH = LINE

# Okabe-Ito colours (distinguishable with the common colour-vision deficiencies),
# and a light grey for ZERO pages, which hold nothing.
CLASS_COLOURS = {
    PageClass.STORED: (0x00, 0x72, 0xB2),   # blue
    PageClass.ZERO: (0xD9, 0xD9, 0xD9),     # light grey
    PageClass.FREE: (0x00, 0x9E, 0x73),     # bluish green
    PageClass.DISK: (0x56, 0xB4, 0xE9),     # sky blue
    PageClass.PARENT: (0xCC, 0x79, 0xA7),   # reddish purple
    PageClass.DELTA: (0xE6, 0x9F, 0x00),    # orange
}
BACKGROUND = (0xFF, 0xFF, 0xFF)
INK = (0x22, 0x22, 0x22)
SEPARATOR = (0x88, 0x88, 0x88)
UNKNOWN = (0x00, 0x00, 0x00)             # a class id outside the spec (the reader rejects those)

# 5x7 glyphs: 7 rows of 5 bits (MSB left), as 14 hex digits.
_GLYPHS = {
    "A": "0E11111F111111", "B": "1E11111E11111E", "C": "0E11101010110E", "D": "1C12111111121C",
    "E": "1F10101E10101F", "F": "1F10101E101010", "G": "0E11101711110F", "H": "1111111F111111",
    "I": "0E04040404040E", "J": "0702020202120C", "K": "11121418141211", "L": "1010101010101F",
    "M": "111B1515111111", "N": "11111915131111", "O": "0E11111111110E", "P": "1E11111E101010",
    "Q": "0E11111115120D", "R": "1E11111E141211", "S": "0F10100E01011E", "T": "1F040404040404",
    "U": "1111111111110E", "V": "11111111110A04", "W": "1111111515150A", "X": "11110A040A1111",
    "Y": "1111110A040404", "Z": "1F01020408101F", "0": "0E11131519110E", "1": "040C040404040E",
    "2": "0E11010204081F", "3": "1F02040201110E", "4": "02060A121F0202", "5": "1F101E0101110E",
    "6": "0608101E11110E", "7": "1F010204080808", "8": "0E11110E11110E", "9": "0E11110F01020C",
    ".": "00000000000C0C", "%": "18190204081303", "-": "0000001F000000", "_": "0000000000001F",
    "/": "00010204081000", " ": "00000000000000", ":": "000C0C000C0C00", ",": "00000000000C04",
    "(": "02040808080402", ")": "08040202020408", "+": "0004041F040400", "=": "00001F001F0000",
    "?": "0E110102040004", "#": "0A0A1F0A1F0A0A", "x": "0000110A040A11",
}


def _font() -> np.ndarray:
    """(128, 7, 5) bool bitmaps; characters without a glyph draw as '?'."""
    font = np.zeros((128, GLYPH_H, GLYPH_W), bool)
    bits = 1 << np.arange(GLYPH_W - 1, -1, -1)
    for ch, code in _GLYPHS.items():
        rows = np.frombuffer(bytes.fromhex(code), np.uint8)
        font[ord(ch)] = (rows[:, None] & bits) != 0
    missing = [c for c in range(128) if chr(c) not in _GLYPHS]
    font[missing] = font[ord("?")]
    return font


_FONT = _font()


def text_mask(text: str, scale: int = TEXT_SCALE) -> np.ndarray:
    """Boolean pixels of ``text`` (upper-cased but for the x of 0x; a blank column after each glyph)."""
    text = text.upper().replace("0X", "0x")
    codes = np.frombuffer(text.encode("ascii", "replace"), np.uint8) & 0x7F
    glyphs = np.zeros((len(codes), GLYPH_H, GLYPH_W + 1), bool)
    glyphs[:, :, :GLYPH_W] = _FONT[codes]
    line = glyphs.transpose(1, 0, 2).reshape(GLYPH_H, -1)
    return line.repeat(scale, 0).repeat(scale, 1)


def _fit(text: str, width_px: int) -> str:
    chars = max(0, width_px // ADVANCE)
    return text if len(text) <= chars else text[:max(0, chars - 2)] + ".."


# --- layout ------------------------------------------------------------------------------------
@dataclass
class Band:
    region: Region
    label_y: int | None     # top of the label line, None when labels are off
    y: int                  # top pixel row of the band
    rows: int               # cell rows
    cells: int              # cells in use (the rest of the last row is background)


@dataclass
class Layout:
    width: int
    height: int
    cell: int               # cell edge in pixels
    columns: int            # cells per row
    pages_per_cell: int
    bands: list
    header_y: int
    legend_y: int

    def cell_origin(self, band: Band, page: int) -> tuple[int, int]:
        """(x, y) of the top-left pixel of the cell that holds ``page`` of the band's region."""
        k = page // self.pages_per_cell
        return MARGIN + (k % self.columns) * self.cell, band.y + (k // self.columns) * self.cell


def _rows(pages: list[int], columns: int, per_cell: int) -> int:
    return sum(math.ceil(math.ceil(n / per_cell) / columns) for n in pages)


def layout(image: LeanImage, width: int = 512) -> Layout:
    """Where everything goes: cell size, pages per cell, bands, legend."""
    if width < 2 * MARGIN + 20 * ADVANCE:
        raise ValueError(f"map width must be at least {2 * MARGIN + 20 * ADVANCE} pixels, got {width}")
    inner = width - 2 * MARGIN
    pages = [r.num_pages for r in image.regions]
    total = sum(pages)
    per_cell, cell = 1, 1
    if _rows(pages, inner, 1) > MAX_ROWS:
        per_cell = max(1, math.ceil(total / (inner * max(1, MAX_ROWS - len(pages)))))
        while _rows(pages, inner, per_cell) > MAX_ROWS and per_cell < total:
            per_cell *= 2
    else:
        for size in (CELL_MAX, 8, 4, 2):
            if _rows(pages, inner // size, 1) * size <= SMALL_MAP_ROWS:
                cell = size
                break
    columns = inner // cell
    labels = len(pages) <= LABELLED_REGIONS_MAX
    y = MARGIN + 2 * LINE + 3 * MARGIN // 2          # two header lines
    bands = []
    for k, region in enumerate(image.regions):
        if k:
            y += MARGIN // 2 + 1 + MARGIN // 2       # separator line with space around it
        label_y = None
        if labels:
            label_y, y = y, y + LINE + MARGIN // 2
        cells = math.ceil(region.num_pages / per_cell)
        rows = math.ceil(cells / columns)
        bands.append(Band(region, label_y, y, rows, cells))
        y += rows * cell
    legend_y = y + MARGIN + MARGIN // 2
    height = legend_y + 3 * (LINE + MARGIN // 2) + MARGIN
    return Layout(width, height, cell, columns, per_cell, bands, MARGIN, legend_y)


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


def _palette() -> np.ndarray:
    palette = np.tile(np.array(UNKNOWN, np.uint8), (256, 1))
    palette[0] = BACKGROUND
    for cls, colour in CLASS_COLOURS.items():
        palette[int(cls)] = colour
    return palette


# --- drawing -------------------------------------------------------------------------------------
def _draw_text(canvas: np.ndarray, x: int, y: int, text: str, colour=INK) -> None:
    mask = text_mask(text)
    h, w = mask.shape
    w = min(w, canvas.shape[1] - x)
    if w > 0:
        canvas[y:y + h, x:x + w][mask[:, :w]] = colour


def _draw_band(canvas: np.ndarray, lay: Layout, band: Band, palette: np.ndarray) -> None:
    region = band.region
    grid = np.zeros(band.rows * lay.columns, np.uint8)
    grid[:band.cells] = cell_classes(region.extents, region.num_pages, lay.pages_per_cell)
    rgb = palette[grid.reshape(band.rows, lay.columns)]
    s = lay.cell
    if s > 1:
        rgb = np.broadcast_to(rgb[:, None, :, None, :], (band.rows, s, lay.columns, s, 3))
        rgb = rgb.reshape(band.rows * s, lay.columns * s, 3).copy()
        if s >= 4:   # a 1-pixel gap between cells
            rgb[s - 1::s, :] = BACKGROUND
            rgb[:, s - 1::s] = BACKGROUND
    canvas[band.y:band.y + rgb.shape[0], MARGIN:MARGIN + rgb.shape[1]] = rgb


def _size(n: int) -> str:
    for unit, scale in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def render_pixels(image: LeanImage, width: int = 512) -> tuple[np.ndarray, Layout]:
    """The map as an (height, width, 3) uint8 array, and its layout."""
    lay = layout(image, width)
    canvas = np.empty((lay.height, lay.width, 3), np.uint8)
    canvas[:] = BACKGROUND
    palette = _palette()
    inner = width - 2 * MARGIN
    total_pages = sum(r.num_pages for r in image.regions)
    total_bytes = sum(r.size_bytes for r in image.regions)
    title = f"LEANIMG MAP  {_size(total_bytes)}  {len(image.regions)} REGION" + \
        ("S" if len(image.regions) != 1 else "")
    _draw_text(canvas, MARGIN, lay.header_y, _fit(title, inner))
    if lay.pages_per_cell == 1:
        scale = f"1 {'PX' if lay.cell == 1 else 'CELL'} = 1 PAGE OF {image.page_size} B"
    else:
        scale = f"1 PX = {lay.pages_per_cell} PAGES (MAJORITY CLASS)"
    _draw_text(canvas, MARGIN, lay.header_y + LINE + MARGIN // 2, _fit(scale, inner), SEPARATOR)
    for k, band in enumerate(lay.bands):
        region = band.region
        if k:
            top = band.label_y if band.label_y is not None else band.y
            canvas[top - MARGIN // 2 - 1, MARGIN:width - MARGIN] = SEPARATOR
        if band.label_y is not None:
            label = f"{region.name}  {_size(region.size_bytes)}"
            if region.guest_phys_base is not None:
                label += f"  AT {region.guest_phys_base:#x}"
            _draw_text(canvas, MARGIN, band.label_y, _fit(label, inner))
        _draw_band(canvas, lay, band, palette)
    _draw_legend(canvas, lay, image, total_pages)
    return canvas, lay


def class_totals(image: LeanImage) -> np.ndarray:
    """Pages of each class id (index 0..6) over all regions."""
    totals = np.zeros(7, np.int64)
    for region in image.regions:
        cls = region.extents["page_class"].astype(np.int64)
        known = cls <= max(PageClass)
        totals += np.bincount(cls[known], weights=region.extents["num_pages"][known].astype(np.float64),
                              minlength=7).astype(np.int64)
    return totals


def _draw_legend(canvas: np.ndarray, lay: Layout, image: LeanImage, total_pages: int) -> None:
    totals = class_totals(image)
    column = (lay.width - 2 * MARGIN) // 2
    for k, cls in enumerate(PageClass):
        x = MARGIN + (k % 2) * column
        y = lay.legend_y + (k // 2) * (LINE + MARGIN // 2)
        canvas[y:y + SWATCH, x:x + SWATCH] = INK
        canvas[y + 1:y + SWATCH - 1, x + 1:x + SWATCH - 1] = CLASS_COLOURS[cls]
        percent = 100.0 * totals[int(cls)] / total_pages if total_pages else 0.0
        _draw_text(canvas, x + SWATCH + MARGIN, y, _fit(f"{cls.name:<7}{percent:5.1f}%", column - SWATCH - MARGIN))


# --- PNG ----------------------------------------------------------------------------------------------
def encode_png(rgb: np.ndarray) -> bytes:
    """8-bit RGB PNG, every scanline with filter type 0 (None)."""
    height, width, _ = rgb.shape
    rows = np.zeros((height, 1 + 3 * width), np.uint8)
    rows[:, 1:] = rgb.reshape(height, 3 * width)

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows.tobytes(), 6))
            + chunk(b"IEND", b""))


def render_map(image: LeanImage, path: str, width: int = 512) -> None:
    """Draw ``image``'s guest memory by page class as a PNG at ``path`` (written atomically)."""
    canvas, _ = render_pixels(image, width)
    data = encode_png(canvas)
    path = os.fspath(path)
    write_atomically(path, lambda out: out.write(data))
