"""Working-set files for `leanimg serve --postcopy` (spec/guides/lazy-restore.md, "Working sets").

A working set lists RAM pages in the order a guest asked for them after a restore;
``serve --record-faults FILE`` writes one, ``serve --working-set FILE`` sends its pages
before the guest runs.  It changes only the ORDER pages travel in: every page is still read
through the reader and checked against its digest, and pages it does not list still travel.

Layout (little-endian):

    header  8  magic 89 4C 45 41 4E 57 4B 53 ("\\x89LEANWKS")
            2  major_version (1)    2  minor_version (0)    4  page_size
            4  block_count (1-255)  4  entry_count (at most MAX_ENTRIES)
    blocks  block_count times: 1 name_length (1-255), name (UTF-8)
    entries entry_count times: 4 block (index into the blocks), 4 page (page number in it)

and nothing after.  A file that breaks a rule is refused whole (LI-WKS-NNN, with the offset
and structure), before anything is sent.
"""

from __future__ import annotations

import struct

import numpy as np

from leanimg.errors import LeanImageError
from leanimg.fileutil import write_atomically
from leanimg.rules import implements

MAGIC = b"\x89LEANWKS"
HEADER = struct.Struct("<8sHHIII")
ENTRY = np.dtype([("block", "<u4"), ("page", "<u4")])
MAX_ENTRIES = 1 << 22  # 16 GiB of 4 KiB pages; the file is at most ~32 MiB


class WorkingSetError(LeanImageError):
    """A working-set file that breaks one of the LI-WKS rules."""


def write_working_set(path: str, page_size: int, names: list[str], entries: list[tuple[int, int]]) -> None:
    """``entries`` ((block index, page) in the order asked, repeats dropped) to ``path`` (a
    temporary file renamed into place once complete, like every leanimg output)."""
    table = np.array(entries, dtype=np.uint32).reshape(-1, 2)
    _, first = np.unique(table, axis=0, return_index=True)
    table = table[np.sort(first)][:MAX_ENTRIES]
    blocks = b"".join(bytes([len(n.encode())]) + n.encode() for n in names)
    data = HEADER.pack(MAGIC, 1, 0, page_size, len(names), len(table)) + blocks + table.astype("<u4").tobytes()
    write_atomically(path, lambda out: out.write(data))


def read_working_set(path: str, page_size: int, block_pages: dict[str, int]) -> list[tuple[str, np.ndarray]]:
    """The working set at ``path`` as [(block name, page numbers)], in file order (runs of one
    block grouped), checked against the image: its ``page_size`` and RAM blocks (name: pages)."""
    with open(path, "rb") as f:
        head = f.read(HEADER.size)
        _check_header(head, page_size, path)
        _, _, _, _, block_count, entry_count = HEADER.unpack(head)
        rest = f.read(256 * block_count + ENTRY.itemsize * entry_count + 1)
    names, at = _block_names(rest, block_count, block_pages, path)
    table = rest[at:]
    _check_length(table, entry_count, HEADER.size + at, path)
    entries = np.frombuffer(table, ENTRY)
    _check_entries(entries, names, block_pages, HEADER.size + at, path)
    return _group(entries, names)


@implements("LI-WKS-001", "LI-WKS-002")
def _check_header(head: bytes, page_size: int, path: str) -> None:
    if head[:8] != MAGIC:
        raise WorkingSetError(
            "not a working-set file (the magic 89 4C 45 41 4E 57 4B 53 is missing)",
            offset=0,
            structure="header.magic",
            rule="LI-WKS-001",
            path=path,
        )
    if len(head) < HEADER.size:
        raise WorkingSetError(
            f"the header is cut short: {len(head)} of {HEADER.size} bytes",
            offset=len(head),
            structure="header",
            rule="LI-WKS-002",
            path=path,
        )
    _, major, _, size, blocks, entries = HEADER.unpack(head)
    if major != 1:
        raise WorkingSetError(
            f"major_version {major} is not 1", offset=8, structure="header.major_version", rule="LI-WKS-002", path=path
        )
    if size != page_size:
        raise WorkingSetError(
            f"page_size {size} is not the image's {page_size}",
            offset=12,
            structure="header.page_size",
            rule="LI-WKS-002",
            path=path,
        )
    if not 1 <= blocks <= 255:
        raise WorkingSetError(
            f"block_count {blocks} is not 1-255",
            offset=16,
            structure="header.block_count",
            rule="LI-WKS-002",
            path=path,
        )
    if entries > MAX_ENTRIES:
        raise WorkingSetError(
            f"entry_count {entries} exceeds {MAX_ENTRIES}",
            offset=20,
            structure="header.entry_count",
            rule="LI-WKS-002",
            path=path,
        )


@implements("LI-WKS-003")
def _block_names(rest: bytes, count: int, block_pages: dict[str, int], path: str) -> tuple[list[str], int]:
    names, at = [], 0
    for index in range(count):
        where = dict(offset=HEADER.size + at, structure=f"blocks[{index}]", rule="LI-WKS-003", path=path)
        length = rest[at] if at < len(rest) else 0
        raw = rest[at + 1 : at + 1 + length]
        if not length or len(raw) < length:
            raise WorkingSetError("the block name is empty or cut short", **where)
        try:
            name = raw.decode()
        except UnicodeDecodeError:
            raise WorkingSetError("the block name is not UTF-8", **where) from None
        if name not in block_pages or name in names:
            raise WorkingSetError(f"block {name!r} is not a RAM block of the image, or named twice", **where)
        names.append(name)
        at += 1 + length
    return names, at


@implements("LI-WKS-004")
def _check_length(table: bytes, count: int, offset: int, path: str) -> None:
    if len(table) != count * ENTRY.itemsize:
        raise WorkingSetError(
            f"entry_count {count} needs {count * ENTRY.itemsize} bytes of entries, the file "
            f"has {len(table)}{'+' if len(table) > count * ENTRY.itemsize else ''}",
            offset=offset,
            structure="entries",
            rule="LI-WKS-004",
            path=path,
        )


@implements("LI-WKS-005")
def _check_entries(entries: np.ndarray, names: list[str], block_pages: dict[str, int], offset: int, path: str) -> None:
    limits = np.array([block_pages[n] for n in names], np.int64)
    blocks = entries["block"].astype(np.int64)
    bad = blocks >= len(names)
    bad[~bad] = entries["page"][~bad] >= limits[blocks[~bad]]
    if bad.any():
        i = int(np.argmax(bad))
        raise WorkingSetError(
            f"entry {i} names block {int(blocks[i])} page {int(entries['page'][i])}, which is not in the image",
            offset=offset + i * ENTRY.itemsize,
            structure=f"entries[{i}]",
            rule="LI-WKS-005",
            path=path,
        )


def _group(entries: np.ndarray, names: list[str]) -> list[tuple[str, np.ndarray]]:
    blocks = entries["block"]
    bounds = [0, *(np.flatnonzero(blocks[1:] != blocks[:-1]) + 1).tolist(), len(entries)]
    return [
        (names[int(blocks[lo])], entries["page"][lo:hi].astype(np.int64))
        for lo, hi in zip(bounds, bounds[1:])
        if hi > lo
    ]
