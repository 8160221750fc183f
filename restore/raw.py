"""Restore to flat raw memory: regions in file order, concatenated (spec §11)."""

from __future__ import annotations

from leanimg.reader import LeanImage

def raw_layout(image: LeanImage) -> list[tuple[str, int, int]]:
    """(region name, offset in the raw output, size) for every region."""
    layout, offset = [], 0
    for region in image.regions:
        layout.append((region.name, offset, region.size_bytes))
        offset += region.size_bytes
    return layout


def restore_raw(image: LeanImage, out, progress=None) -> int:
    """Write every region's pages, verified, to the binary file object ``out``."""
    written = 0
    image.enable_read_ahead()
    for region in image.regions:
        step = image.restore_chunk_pages
        for first in range(0, region.num_pages, step):
            count = min(step, region.num_pages - first)
            data = image.region_bytes(region, first, count)
            out.write(data)
            written += len(data)
            if progress:
                progress(len(data))
    out.flush()
    return written
