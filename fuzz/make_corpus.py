"""Seed corpus for fuzz/fuzz_reader.py: small writer-made images of every page class.

    python fuzz/make_corpus.py /tmp/leanimg-corpus

Also builds the fixed parent image and disk the harness passes to the reader, so
that seeds with PARENT, DELTA and DISK pages get past chain and disk resolution.
Everything is deterministic (fixed seeds and UUIDs); binary corpora are not committed.
"""

from __future__ import annotations

import os
import sys

import numpy as np

from leanimg.format import DISK_SECTOR_SIZE, SourceFormat, page_digest
from leanimg.writer import LeanImageWriter, ParentLink, disk_fingerprint

PS = 4096
PARENT_UUID = bytes(range(16))
DISK_NAME = "vda"
DISK_PAGES = 8
PARENT_PAGES = 12


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _text_page(rng, tag: int) -> bytes:
    words = rng.integers(0, 16, PS // 8, dtype=np.uint64) + np.uint64(tag << 32)
    return words.tobytes()


def disk_bytes() -> bytes:
    rng = _rng(7)
    return b"".join(_text_page(rng, 0x1000 + k) for k in range(DISK_PAGES))


def parent_pages() -> list[bytes]:
    rng = _rng(11)
    return [bytes(PS) if k % 4 == 3 else _text_page(rng, k) for k in range(PARENT_PAGES)]


def build_fixtures(directory: str) -> tuple[str, str]:
    """(parent image path, disk path), rebuilt bit-identically every time."""
    disk_path = os.path.join(directory, "disk.raw")
    with open(disk_path, "wb") as f:
        f.write(disk_bytes())
    parent_path = os.path.join(directory, "parent.lean")
    with LeanImageWriter(parent_path, image_uuid=PARENT_UUID, threads=1) as w:
        region = w.add_region("ram", PARENT_PAGES * PS, guest_phys_base=0)
        w.put_pages(region, 0, b"".join(parent_pages()))
    return parent_path, disk_path


def _parent_link(parent_path: str) -> ParentLink:
    with open(parent_path, "rb") as f:
        data = f.read()
    return ParentLink(PARENT_UUID, data[-48 + 24 : -48 + 40])  # footer image_digest


def seeds(parent_path: str) -> dict[str, callable]:
    """name -> function(path) writing one seed image."""
    rng = _rng(3)

    def plain(path):
        with LeanImageWriter(path, threads=1, frame_pages=2, image_uuid=bytes(16)) as w:
            r = w.add_region("ram", 6 * PS, guest_phys_base=0)
            w.put_pages(r, 0, _text_page(rng, 1) + bytes(PS) + _text_page(rng, 2) + rng.bytes(PS))
            w.put_free(r, 4, 2)

    def regions_and_state(path):
        with LeanImageWriter(path, threads=1, frame_pages=3, image_uuid=b"\x01" * 16) as w:
            w.declare_source_state()
            w.add_source_state(SourceFormat.QEMU, 1, b"QEVM\x00\x00\x00\x03prologue")
            a = w.add_region("pc.ram", 4 * PS, guest_phys_base=0)
            b = w.add_region("vga.vram", 2 * PS)
            w.put_pages(b, 0, _text_page(rng, 3) + bytes(PS))
            w.put_pages(a, 2, _text_page(rng, 4) + _text_page(rng, 5))
            w.put_zero(a, 0, 2)
            w.add_source_state(SourceFormat.QEMU, 2, b"device state" * 3)

    def with_disk(path):
        disk = disk_bytes()
        with LeanImageWriter(path, threads=1, image_uuid=b"\x02" * 16) as w:
            d = w.add_disk(DISK_NAME, len(disk), disk_fingerprint(lambda o, n: disk[o : o + n], len(disk)))
            r = w.add_region("ram", 5 * PS)
            for page, disk_page in ((0, 3), (1, 4), (3, 0)):
                content = disk[disk_page * PS : (disk_page + 1) * PS]
                w.put_disk(r, page, d, disk_page * PS // DISK_SECTOR_SIZE, page_digest(content))
            w.put_pages(r, 2, _text_page(rng, 6))
            w.put_free(r, 4)

    def child(path):
        pages = parent_pages()
        with LeanImageWriter(path, threads=1, parent=_parent_link(parent_path), image_uuid=b"\x03" * 16) as w:
            r = w.add_region("ram", PARENT_PAGES * PS)
            w.put_parent(r, 0, b"".join(page_digest(p) for p in pages[:4]))
            for k in range(4, 8):
                new = bytearray(pages[k])
                new[8 * k : 8 * k + 8] = b"changed!"
                w.put_changed(r, k, pages[k], bytes(new))
            w.put_pages(r, 8, rng.bytes(PS) + bytes(PS))
            w.put_parent(r, 10, b"".join(page_digest(p) for p in pages[10:12]))

    def big_page(path):
        with LeanImageWriter(path, threads=1, page_size=16384, image_uuid=b"\x04" * 16) as w:
            r = w.add_region("ram", 3 * 16384, guest_phys_base=0x100000)
            w.put_pages(r, 0, bytes(16384) + rng.bytes(16384))
            w.put_free(r, 2)

    return dict(plain=plain, regions_and_state=regions_and_state, with_disk=with_disk, child=child, big_page=big_page)


def make_corpus(directory: str) -> list[str]:
    os.makedirs(directory, exist_ok=True)
    parent_path, _ = build_fixtures(directory)
    paths = [parent_path]
    for name, write in seeds(parent_path).items():
        path = os.path.join(directory, f"{name}.lean")
        write(path)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    for path in make_corpus(argv[0]):
        print(f"{path}  {os.path.getsize(path)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
