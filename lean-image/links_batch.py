"""Opening many links of a chain at once: what ``LeanImage.open_link(check=False)`` reads and
checks of each (its header, footer and INDEX record: LI-HDR-001..008/010, LI-FTR-001..003/005,
LI-REC-002..008 of the INDEX) tested for all of them together, in their plain case.

parents.attach_chain opens the links it expects next (found by the UUIDs read from the files
beside the image) CHECK_BATCH at a time through here. A link that fails a test, or is not of the
plain shape (a header with an extension, a file read in parts), is not opened here: the walk
opens it with open_link when it reaches it, which raises its finding, so what is refused and
how is the same as when every link is opened alone.
"""

from __future__ import annotations

import os

import numpy as np

from .format import (
    FOOTER,
    FOOTER_MAGIC,
    FORMAT_MAJOR,
    HEADER,
    HEADER_MAGIC,
    INDEX_BODY,
    INDEX_ENTRY,
    KNOWN_INCOMPAT,
    PAGE_SIZE_MAX,
    PAGE_SIZE_MIN,
    RECORD,
    RECORD_BODY_MAX,
    RECORD_TRAILER,
    IncompatFeature,
    RecordType,
    span_checksums,
)
from .fast_paths import fast_path
from .locations import LocalFile, is_remote
from .structures import Footer, Header, ImageFile, Record
from .tables import FrameTable

# the INDEX record's header and its body's fixed part
_INDEX_HEAD = np.dtype(RECORD.dtype.descr + INDEX_BODY.dtype.descr)
_SMALLEST = HEADER.size + RECORD.size + INDEX_BODY.size + RECORD_TRAILER.size + FOOTER.size


@fast_path(
    "LeanImage.open_link(path, check=False)",
    tests=(
        *("LI-HDR-001", "LI-HDR-002", "LI-HDR-003", "LI-HDR-004", "LI-HDR-005", "LI-HDR-006", "LI-HDR-007"),
        *("LI-HDR-008", "LI-HDR-010"),
        *("LI-FTR-001", "LI-FTR-002", "LI-FTR-003", "LI-FTR-005"),
        # of the INDEX record
        *("LI-REC-002", "LI-REC-003", "LI-REC-004", "LI-REC-005", "LI-REC-006", "LI-REC-007", "LI-REC-008"),
    ),
)
def open_links(paths: list[str], whole_below: int, kept: dict[str, tuple[int, int]] | None = None) -> dict:
    """path -> (fileobj, ImageFile, Header, Footer, INDEX Record, (PAGE_FRAME, DELTA_FRAME
    FrameTable)), as open_link(check=False) makes them, for each of ``paths`` smaller than
    ``whole_below`` bytes (read whole) whose header, footer and INDEX pass every test; the
    others are not opened (nothing raises). ``kept``: path -> (fd, size) of files open already
    (parent_files._image_uuids); those of ``paths`` are taken from it (and removed)."""
    kept = {} if kept is None else kept
    read = [_taken(kept, path, whole_below) or _read_whole(path, whole_below) for path in paths]
    files = [(path, *got) for path, got in zip(paths, read) if got is not None]  # (path, fd, bytes)
    if not files:
        return {}
    ok, index_at, num_entries = _tables_hold([data for _, _, data in files])
    taken, chosen = set(), []
    for j, ((path, fd, _), good) in enumerate(zip(files, ok.tolist())):
        if good and path not in taken:
            taken.add(path)
            chosen.append(j)
        else:
            os.close(fd)
    at, counts = index_at[chosen], num_entries[chosen]
    flat = np.frombuffer(
        b"".join(
            [
                files[j][2][a : a + n * INDEX_ENTRY.size]
                for j, a, n in zip(chosen, (at + _INDEX_HEAD.itemsize).tolist(), counts.tolist())
            ]
        ),
        INDEX_ENTRY.dtype,
    )
    bounds = np.concatenate(([0], np.cumsum(counts))).tolist()
    frames = _frame_tables(flat, counts)
    opened = {}
    for k, j in enumerate(chosen):
        path, fd, data = files[j]
        opened[path] = (*_assembled(path, fd, data, int(at[k]), flat[bounds[k] : bounds[k + 1]]), frames[k])
    return opened


def _frame_tables(flat: np.ndarray, lengths: np.ndarray) -> list[tuple[FrameTable, FrameTable]]:
    """FrameTable.of each INDEX's PAGE_FRAMEs and DELTA_FRAMEs, for INDEX entries laid end to
    end in ``flat`` (``lengths[k]`` of link k)."""
    if not len(lengths):
        return []
    lengths = lengths.astype(np.int64)
    lid = np.repeat(np.arange(len(lengths)), lengths)
    first = np.cumsum(lengths) - lengths
    tables = []
    for record_type in (RecordType.PAGE_FRAME, RecordType.DELTA_FRAME):
        at = np.flatnonzero(flat["record_type"] == record_type)
        starts, counts = flat["first"][at].astype(np.int64), flat["count"][at].astype(np.int64)
        positions = at - first[lid[at]]
        bounds = np.searchsorted(lid[at], np.arange(len(lengths) + 1)).tolist()
        tables.append(
            [FrameTable(starts[lo:hi], counts[lo:hi], positions[lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
        )
    return list(zip(*tables))


def _taken(kept: dict[str, tuple[int, int]], path: str, whole_below: int):
    """(fd, the file's bytes) of ``path`` if it is in ``kept`` (open already: path -> (fd, size);
    removed from it) and read whole would be, else None (its fd closed)."""
    got = kept.pop(path, None)
    return None if got is None else _whole_of(*got, whole_below)


def _read_whole(path: str, whole_below: int):
    """(fd, the file's bytes) of a file ImageFile would read whole, else None (closed; and
    for an object in a store, which open_link reads)."""
    if is_remote(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
    except OSError:
        size = -1
    return _whole_of(fd, size, whole_below)


def _whole_of(fd: int, size: int, whole_below: int):
    """(fd, its ``size`` bytes) if ImageFile would read a file of that size whole and all are
    there, else None (fd closed)."""
    try:
        if _SMALLEST <= size < whole_below:
            data = os.pread(fd, size, 0)
            if len(data) == size:
                return fd, data
    except OSError:
        pass
    os.close(fd)
    return None


def _tables_hold(datas: list[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per file: whether its header, footer and INDEX record pass every test open_link
    makes (in their plain case), the INDEX's offset and its num_entries."""
    sizes = np.array([len(d) for d in datas], np.int64)
    h = np.frombuffer(b"".join([d[: HEADER.size] for d in datas]), HEADER.dtype)
    f = np.frombuffer(b"".join([d[-FOOTER.size :] for d in datas]), FOOTER.dtype)
    ok = _headers_hold(h, datas) & _footers_hold(f, sizes, datas)
    footer_at = sizes - FOOTER.size
    index_at = np.where(ok, f["index_offset"], 0).astype(np.int64)
    heads = np.frombuffer(
        b"".join([d[at : at + _INDEX_HEAD.itemsize] for d, at in zip(datas, index_at.tolist())]), _INDEX_HEAD
    )
    body = heads["body_length"].astype(np.uint64)
    ok &= (
        (heads["record_type"] == RecordType.INDEX)
        & (heads["flags"] == 0)
        & (heads["reserved"] == 0)
        & (body <= RECORD_BODY_MAX)
        & (body == INDEX_BODY.size + INDEX_ENTRY.size * heads["num_entries"].astype(np.uint64))
        & (index_at + RECORD.size + body.astype(np.int64) + RECORD_TRAILER.size == footer_at)
    )
    held = np.flatnonzero(ok)  # the INDEX's checksum (its padding is empty)
    if len(held):
        ends = footer_at[held] - RECORD_TRAILER.size
        stored = np.frombuffer(
            b"".join([datas[k][end : end + RECORD_TRAILER.size] for k, end in zip(held.tolist(), ends.tolist())]), "<u8"
        )
        ok[held] = span_checksums([datas[k] for k in held.tolist()], index_at[held], ends - index_at[held]) == stored
    return ok, index_at, heads["num_entries"].astype(np.int64)


def _headers_hold(h: np.ndarray, datas: list[bytes]) -> np.ndarray:
    """read_header and header_problems (LI-HDR-001..008, 010), for headers of HEADER.size bytes."""
    bits = h["incompatible_features"]
    page_size = h["page_size"].astype(np.int64)
    has_uuid, has_digest = h["parent_uuid"].any(axis=1), h["parent_digest"].any(axis=1)
    has_bit = (bits & np.uint64(IncompatFeature.PARENT)) != 0
    ok = (
        (h["magic"] == HEADER_MAGIC)
        & (h["major_version"] == FORMAT_MAJOR)
        & (h["header_length"] == HEADER.size)
        & ((bits & np.uint64(~KNOWN_INCOMPAT & (2**64 - 1))) == 0)
        & ((page_size & (page_size - 1)) == 0)
        & (page_size >= PAGE_SIZE_MIN)
        & (page_size <= PAGE_SIZE_MAX)
        & (h["reserved"] == 0)
        & (has_uuid == has_digest)
        & (has_digest == has_bit)
        & (((bits & np.uint64(IncompatFeature.INHERITED_DIGESTS)) == 0) | has_bit)
    )
    zeroed = h.copy()  # header_checksum: of the header with its field zero
    zeroed["header_checksum"] = 0
    return ok & (_row_checksums(zeroed, HEADER.size) == h["header_checksum"])


def _footers_hold(f: np.ndarray, sizes: np.ndarray, datas: list[bytes]) -> np.ndarray:
    """read_footer (LI-FTR-001..003, 005) for a header of HEADER.size bytes."""
    footer_at = sizes - FOOTER.size
    index_at = f["index_offset"]
    ok = (
        (f["magic"] == FOOTER_MAGIC)
        & (f["file_length"] == sizes.astype(np.uint64))
        & (index_at >= HEADER.size)
        & (index_at < footer_at.astype(np.uint64))
        & (index_at % 8 == 0)
    )
    return ok & (_row_checksums(f, FOOTER.offset("footer_checksum")) == f["footer_checksum"])


def _row_checksums(rows: np.ndarray, length: int) -> np.ndarray:
    """checksum64 of the first ``length`` bytes of each row of a structured array."""
    laid = np.ascontiguousarray(rows).view(np.uint8)
    return span_checksums(
        [laid] * len(rows),
        np.arange(len(rows), dtype=np.int64) * rows.dtype.itemsize,
        np.full(len(rows), length, np.int64),
    )


def _assembled(path: str, fd: int, data: bytes, index_at: int, entries: np.ndarray) -> tuple:
    """The objects open_link(check=False) makes of a file whose tests passed, its INDEX's
    ``entries`` parsed already (with the batch's)."""
    fileobj = LocalFile(fd, "r")
    file = ImageFile.holding(fileobj, path, data)
    header = Header(data[: HEADER.size])
    footer_at = len(data) - FOOTER.size
    footer = Footer(data[footer_at:], footer_at)
    trailer_at = footer_at - RECORD_TRAILER.size
    body = memoryview(data[index_at + RECORD.size : trailer_at])
    (stored,) = RECORD_TRAILER.unpack_from(data, trailer_at)
    index = Record(index_at, int(RecordType.INDEX), 0, trailer_at - index_at - RECORD.size, stored, body)
    index.parsed = {"num_entries": len(entries), "reserved": 0, "entries": entries}  # as parse_body gives
    return fileobj, file, header, footer, index
