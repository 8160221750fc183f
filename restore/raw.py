"""Restore to flat raw memory: regions in file order, concatenated (spec §11)."""

from __future__ import annotations

import mmap

from leanimg.fileutil import GatherWriter
from leanimg.reader import LeanImage

ZEROS_WRITE = 64 << 20  # the zeros of a blank run are views of this many bytes each
ZERO_VIEWS_MOST = 64  # a long blank run's zeros go to the writer this many views at a time
# the zeros: a private anonymous mapping never written, whose pages read as the kernel's one
# zero page, so a blank run costs no memory however long it is
_ZERO_VIEW = memoryview(mmap.mmap(-1, ZEROS_WRITE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ))


def raw_layout(image: LeanImage) -> list[tuple[str, int, int]]:
    """(region name, offset in the raw output, size) for every region."""
    layout, offset = [], 0
    for region in image.regions:
        layout.append((region.name, offset, region.size_bytes))
        offset += region.size_bytes
    return layout


def restore_raw(image: LeanImage, out, progress=None) -> int:
    """Write every region's pages, verified, to the binary file object ``out``: stored pages
    straight from the decompressed frames, blank ones from one shared zero mapping."""
    gather = GatherWriter(out)
    image.enable_read_ahead()
    ps = image.page_size
    step = image.gather_chunk_pages
    for region in image.regions:
        for first, count in image.region_windows(region, step):
            parts: list = []
            for n, data in image.region_pieces(region, first, count):
                if data is not None:
                    parts.append(data)
                    continue
                for at in range(0, n * ps, ZEROS_WRITE):
                    parts.append(_ZERO_VIEW[: min(ZEROS_WRITE, n * ps - at)])
                    if len(parts) >= ZERO_VIEWS_MOST:
                        gather.write_all(parts)
                        parts = []
            gather.write_all(parts)
            if progress:
                progress(count * ps)
    out.flush()
    return gather.written
