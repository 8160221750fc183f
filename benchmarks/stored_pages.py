"""What the STORED pages of an image are: the size levers left after ZERO, DISK and FREE.

    python benchmarks/stored_pages.py IMG [--disk NAME=PATH ...] [--region pc.ram]

For one region of IMG (restored in memory, so its DISK pages need their disks):

- PostgreSQL's 8 KiB pages: a guest page that begins one (``pd_pagesize_version`` 0x2004,
  8192 bytes and layout 4, at offset 18) by class: a server's shared buffers and the page
  cache's copy of its files; a STORED one is a buffer newer than the disk's block;
- STORED pages that equal another STORED page (what in-image deduplication would save);
- the STORED pages' size each compressed alone with zstd -3 (percentiles of a sample), and
  those made of at most two distinct 8-byte words (fills, poison patterns), by first word.

Used on bench_distro.py's kept image (``--keep``: convert-disk.lean, disk.img) to see why the
Debian guest's 425 MiB of STORED pages were not found on its disk.
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
import zstandard
from leanimg.disks import open_disk
from leanimg.format import PageClass, row_digests
from leanimg.reader import LeanImage

PG_PAGESIZE_VERSION = 8192 | 4
SAMPLE = 10  # every tenth STORED page is compressed alone


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("image")
    ap.add_argument("--disk", action="append", default=[], metavar="NAME=PATH")
    ap.add_argument("--region", default="pc.ram")
    args = ap.parse_args(argv)
    disks = {name: open_disk(path, name) for name, _, path in (d.partition("=") for d in args.disk)}
    with LeanImage.open(args.image, disks=disks) as img:
        region = next(r for r in img.regions if r.name == args.region)
        classes = img.classes(region)
        ps = img.page_size
        pages = np.frombuffer(img.region_bytes(region, 0, region.num_pages), np.uint8).reshape(-1, ps)
    stored = np.flatnonzero(classes == PageClass.STORED)
    print(f"{args.region}: {len(classes)} pages, {len(stored)} STORED ({len(stored) * ps / 2**20:.1f} MiB)")

    version = pages[:, 18].astype(np.uint16) | (pages[:, 19].astype(np.uint16) << 8)
    heads = version == PG_PAGESIZE_VERSION
    by_class = {PageClass(k).name: int((heads & (classes == k)).sum()) for k in np.unique(classes[heads]).tolist()}
    print(f"pages beginning a PostgreSQL page: {int(heads.sum())}, by class {by_class}")

    digests = row_digests(pages, stored).view(np.uint64)[:, 0]
    _, counts = np.unique(digests, return_counts=True)
    repeated = counts[counts > 1]
    print(f"STORED pages equal to another STORED page: {int(repeated.sum())} in {len(repeated)} groups")

    zstd = zstandard.ZstdCompressor(level=3)
    sizes = np.array([len(zstd.compress(pages[p].tobytes())) for p in stored[::SAMPLE].tolist()])
    if len(sizes):
        p10, p25, p50, p75, p90 = np.percentile(sizes, [10, 25, 50, 75, 90]).tolist()
        print(
            f"a STORED page alone with zstd -3 (every {SAMPLE}th): mean {sizes.mean():.0f} B; "
            f"p10 {p10:.0f}, p25 {p25:.0f}, p50 {p50:.0f}, p75 {p75:.0f}, p90 {p90:.0f}"
        )
    fills: collections.Counter = collections.Counter()
    for p in stored.tolist():
        words = pages[p].view(np.uint64)
        if len(np.unique(words)) <= 2:
            fills[f"{int(words[0]):#018x}"] += 1
    print(f"STORED pages of at most two distinct words: {sum(fills.values())}; by first word {fills.most_common(4)}")
    for disk in disks.values():
        disk.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
