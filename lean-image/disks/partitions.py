"""Partition tables (MBR with extended partitions, GPT): where each partition starts.

A guest caches file pages read from a filesystem, so a page duplicates the disk at the
filesystem's block alignment, which is the partition's start sector: a partition starting at
sector 63 puts every cached page at sector 63 + 8k. The disk scan reads each partition at
its own phase (start sector modulo the sectors of a page): ``scan_segments`` and
``aligned_ranges`` say which page-sized blocks that is, ``scan_bytes`` how many bytes.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

SECTOR = 512
MBR_SIGNATURE = b"\x55\xaa"
GPT_SIGNATURE = b"EFI PART"
EXTENDED_TYPES = (0x05, 0x0F, 0x85)
GPT_PROTECTIVE = 0xEE
MAX_LOGICAL = 128  # bounds a looping chain of extended boot records
MAX_GPT_ENTRIES = 4096


@dataclass(frozen=True)
class Partition:
    start: int  # bytes from the start of the disk
    length: int  # bytes


def read_partitions(read, disk_size: int) -> list[Partition]:
    """Partitions found in the disk's table, clipped to the disk; [] when there is none."""
    if disk_size < 2 * SECTOR:
        return []
    mbr = read(0, SECTOR)
    if mbr[510:512] != MBR_SIGNATURE:
        return []
    entries = _mbr_entries(mbr)
    if any(kind == GPT_PROTECTIVE for kind, _, _ in entries):
        return _clip(_gpt(read, disk_size), disk_size)
    found = []
    for kind, first, count in entries:
        if kind in EXTENDED_TYPES:
            found += _logical(read, first, disk_size)
        elif kind and count:
            found.append(Partition(first * SECTOR, count * SECTOR))
    return _clip(found, disk_size)


def _mbr_entries(sector: bytes) -> list[tuple[int, int, int]]:
    """(type, first LBA, sector count) of the four entries of an MBR or EBR."""
    out = []
    for k in range(4):
        entry = sector[446 + 16 * k : 446 + 16 * (k + 1)]
        first, count = struct.unpack_from("<II", entry, 8)
        out.append((entry[4], first, count))
    return out


def _logical(read, extended_first: int, disk_size: int) -> list[Partition]:
    """Logical partitions: a chain of EBRs, each relative to the extended partition."""
    found, ebr = [], extended_first
    for _ in range(MAX_LOGICAL):
        if (ebr + 1) * SECTOR > disk_size:
            break
        sector = read(ebr * SECTOR, SECTOR)
        if sector[510:512] != MBR_SIGNATURE:
            break
        (kind, first, count), (next_kind, next_first, _), *_ = _mbr_entries(sector)
        if kind and count:
            found.append(Partition((ebr + first) * SECTOR, count * SECTOR))
        if next_kind not in EXTENDED_TYPES or not next_first:
            break
        ebr = extended_first + next_first
    return found


def _gpt(read, disk_size: int) -> list[Partition]:
    header = read(SECTOR, 92)
    if header[:8] != GPT_SIGNATURE:
        return []
    (size,) = struct.unpack_from("<I", header, 12)
    if size != 92 or zlib.crc32(header[:16] + b"\0" * 4 + header[20:92]) != struct.unpack_from("<I", header, 16)[0]:
        return []
    table_lba, count, entry_size = struct.unpack_from("<QII", header, 72)
    if entry_size < 56 or count > MAX_GPT_ENTRIES or (table_lba * SECTOR + count * entry_size) > disk_size:
        return []
    table = read(table_lba * SECTOR, count * entry_size)
    found = []
    for k in range(count):
        entry = table[k * entry_size : (k + 1) * entry_size]
        first, last = struct.unpack_from("<QQ", entry, 32)
        if any(entry[:16]) and last >= first:
            found.append(Partition(first * SECTOR, (last - first + 1) * SECTOR))
    return found


def _clip(parts: list[Partition], disk_size: int) -> list[Partition]:
    out = []
    for p in parts:
        end = min(p.start + p.length, disk_size)
        if p.start < end:
            out.append(Partition(p.start, end - p.start))
    return out


def scan_segments(disk, page_size: int, all_phases: bool = False) -> list[tuple[int, int, int]]:
    """(start, end, phase in bytes) to scan: the whole disk at phase 0, and every partition
    that does not start on a page boundary at its own phase (or the disk at every phase)."""
    if all_phases:
        return [(0, disk.size, p) for p in range(0, page_size, SECTOR)]
    segments = [(0, disk.size, 0)]
    for part in read_partitions(disk.read, disk.size):
        phase = part.start % page_size
        if phase:
            segments.append((part.start, part.start + part.length, phase))
    return segments


def aligned_ranges(ranges, start: int, end: int, phase: int, ps: int):
    """Pieces of the data ``ranges`` within [start, end), cut to whole blocks at ``phase``."""
    for offset, length in ranges:
        lo, hi = max(offset, start), min(offset + length, end)
        lo = lo + (phase - lo) % ps
        hi = lo + (hi - lo) // ps * ps
        if hi > lo:
            yield lo, hi


def scan_bytes(disk, page_size: int, all_phases: bool = False) -> int:
    """How many bytes a scan of ``disk`` reads (the converters' disk scan; for a progress bar)."""
    ranges = disk.data_ranges()
    return sum(
        hi - lo
        for start, end, phase in scan_segments(disk, page_size, all_phases)
        for lo, hi in aligned_ranges(ranges, start, end, phase, page_size)
    )
