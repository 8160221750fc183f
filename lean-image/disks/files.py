"""Which files the DISK pages came from: ext2/3/4 through e2fsprogs' debugfs (``inspect --files``).

Each filesystem on the disk (the whole disk, or a partition of its MBR/GPT table) is found by
its superblock; a referenced sector maps to the filesystem block holding the page's first
byte, ``icheck`` maps blocks to inodes and ``ncheck`` inodes to path names. debugfs reads raw
files only, so another disk format is first copied to a sparse raw file with qemu-img.
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass

import numpy as np

from leanimg.arrays import distinct
from leanimg.errors import DiskError
from leanimg.format import DISK_SECTOR_SIZE, PageClass

from .partitions import Partition, read_partitions
from .sources import RawDisk

EXT_MAGIC = 0xEF53
NOT_IN_A_FILESYSTEM = "(not in an ext2/3/4 filesystem)"
NO_FILE = "(filesystem metadata, journal or free blocks)"


@dataclass(frozen=True)
class Filesystem:
    offset: int
    length: int
    block_size: int


def find_ext_filesystems(read, size: int) -> list[Filesystem]:
    """ext2/3/4 filesystems on the whole disk or on its partitions."""
    found = []
    for part in [Partition(0, size), *read_partitions(read, size)]:
        if part.length < 2048:
            continue
        sb = read(part.start + 1024, 64)
        (magic,) = struct.unpack_from("<H", sb, 56)
        (log_block,) = struct.unpack_from("<I", sb, 24)
        if magic == EXT_MAGIC and log_block <= 6:
            found.append(Filesystem(part.start, part.length, 1024 << log_block))
    return found


def attribute_pages(image) -> dict[str, Counter[str]]:
    """Per disk name, pages per file path (or per NO_FILE / NOT_IN_A_FILESYSTEM)."""
    if shutil.which("debugfs") is None:
        raise DiskError("--files needs debugfs from e2fsprogs")
    refs = _references(image)
    out = {}
    for info in image.disks:
        sectors = refs.get(info.disk_id)
        if sectors is None:
            continue
        source = image.disk_sources.get(info.disk_id)
        if source is None:
            raise DiskError(f"--files: pass --disk {info.name}=PATH to name the files of disk {info.name!r}")
        out[info.name] = _files_of(source, sectors)
    return out


def _references(image) -> dict[int, np.ndarray]:
    """Referenced sectors (one per DISK page of the image) per disk id."""
    used = []
    for region in image.regions:
        e = region.extents[region.extents["page_class"] == PageClass.DISK]
        for first, count in zip(e["first_slot"].tolist(), e["num_pages"].tolist()):
            used.append(np.arange(first, first + count, dtype=np.int64))
    if not used:
        return {}
    slots = np.concatenate(used)
    refs = image.tables.disk_refs
    ids, sectors = refs.disk_ids[slots], refs.sectors[slots].astype(np.int64)
    return {int(d): sectors[ids == d] for d in distinct(ids)}


def _files_of(source, sectors: np.ndarray) -> Counter[str]:
    pages: Counter[str] = Counter()
    offsets = sectors * DISK_SECTOR_SIZE
    claimed = np.zeros(len(offsets), bool)
    with _raw_path(source) as path:
        for fs in find_ext_filesystems(source.read, source.size):
            inside = ~claimed & (offsets >= fs.offset) & (offsets < fs.offset + fs.length)
            claimed |= inside
            blocks = (offsets[inside] - fs.offset) // fs.block_size
            for name, n in _debugfs_paths(path, fs, blocks).items():
                pages[name] += n
    if (~claimed).any():
        pages[NOT_IN_A_FILESYSTEM] += int((~claimed).sum())
    return pages


def _debugfs_paths(path: str, fs: Filesystem, blocks: np.ndarray) -> Counter[str]:
    """Pages per path name for the filesystem ``blocks`` (one entry per page)."""
    unique, counts = np.unique(blocks, return_counts=True)
    inode_of = _debugfs_table(path, fs, "icheck", unique.tolist())
    inodes = sorted({i for i in inode_of.values() if i.isdigit()})
    name_of = _debugfs_table(path, fs, "ncheck", inodes) if inodes else {}
    pages: Counter[str] = Counter()
    for block, n in zip(unique.tolist(), counts.tolist()):
        inode = inode_of.get(str(block), "")
        pages[name_of.get(inode, NO_FILE).replace("//", "/")] += n
    return pages


def _debugfs_table(path: str, fs: Filesystem, command: str, keys: list) -> dict[str, str]:
    """First column -> second column of debugfs ``command keys...`` (run in batches)."""
    table: dict[str, str] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".debugfs") as script:
        for at in range(0, len(keys), 1000):
            script.write(f"{command} {' '.join(map(str, keys[at : at + 1000]))}\n")
        script.flush()
        device = f"{path}?offset={fs.offset}" if fs.offset else path
        proc = subprocess.run(["debugfs", "-f", script.name, device], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise DiskError(
            f"debugfs cannot read the filesystem at byte {fs.offset} of {path}: "
            f"{proc.stderr.strip().splitlines()[-1:] or 'failed'}"
        )
    for line in proc.stdout.splitlines():
        first, sep, rest = line.partition("\t")
        if sep and first.isdigit():
            table.setdefault(first, rest.strip())
    return table


class _raw_path:
    """The disk as a raw file debugfs can open: itself, or a sparse qemu-img copy."""

    def __init__(self, source):
        self.source, self.tmp = source, None

    def __enter__(self) -> str:
        if isinstance(self.source, RawDisk):
            return self.source.path
        self.tmp = tempfile.TemporaryDirectory(prefix="leanimg-files-")
        raw = os.path.join(self.tmp.name, "disk.raw")
        proc = subprocess.run(
            ["qemu-img", "convert", "-U", "-O", "raw", self.source.path, raw], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise DiskError(f"qemu-img cannot copy {self.source.path} for debugfs: {proc.stderr.strip()}")
        return raw

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            self.tmp.cleanup()
