"""Restore to flat raw memory: regions in file order, concatenated (spec §11)."""

from __future__ import annotations

from leanimg.fileutil import GatherWriter
from leanimg.reader import LeanImage

_ZERO_VIEW = memoryview(bytes(1 << 20))


def raw_layout(image: LeanImage) -> list[tuple[str, int, int]]:
    """(region name, offset in the raw output, size) for every region."""
    layout, offset = [], 0
    for region in image.regions:
        layout.append((region.name, offset, region.size_bytes))
        offset += region.size_bytes
    return layout


def restore_raw(image: LeanImage, out, progress=None) -> int:
    """Write every region's pages, verified, to the binary file object ``out``: stored pages
    straight from the decompressed frames, blank ones from one shared zero buffer."""
    gather = GatherWriter(out)
    image.enable_read_ahead()
    ps = image.page_size
    step = image.gather_chunk_pages
    for region in image.regions:
        for first in range(0, region.num_pages, step):
            count = min(step, region.num_pages - first)
            parts = []
            for n, data in image.region_pieces(region, first, count):
                parts.extend(_zeros(n * ps) if data is None else [data])
            gather.write_all(parts)
            if progress:
                progress(count * ps)
    out.flush()
    return gather.written


def _zeros(length: int) -> list[memoryview]:
    return [_ZERO_VIEW[: min(len(_ZERO_VIEW), length - at)] for at in range(0, length, len(_ZERO_VIEW))]
