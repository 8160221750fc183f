"""Streaming writer of lean images (spec §2-§8).

Pages are fed per region in any order (regions may interleave); every page of
every region must be given exactly once before ``finish``. STORED pages go into
zstd frames that are compressed on worker threads and written as they fill, so
memory stays bounded by a few frames plus a class byte per guest page and,
for the pages that have them, slots (as runs) and 16-byte digests. Nothing is
ever written twice or patched: the output works through a pipe. A path
destination appears under its name only when complete (temp, fsync, rename).
"""

from __future__ import annotations

import os
import struct
import threading
import uuid as uuidlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import xxhash
import zstandard

from . import delta as deltacodec
from .arrays import as_items, distinct, nonzero_rows
from .errors import LimitError, fits_in_memory
from .locations import Output
from .format import (
    DEFAULT_FRAME_BYTES,
    DEFAULT_ZSTD_LEVEL,
    DELTA_FRAME_BODY,
    DIGEST_CHUNK_PAGES,
    DIGEST_SIZE,
    HAS_SLOT,
    DIGESTS_BODY,
    DISK_BODY,
    DISK_REF,
    DISK_REF_CHUNK,
    DISK_REFS_BODY,
    DISK_SECTOR_SIZE,
    EXTENT,
    EXTENT_CHUNK,
    FINGERPRINT_SAMPLE_SIZE,
    FINGERPRINT_SAMPLED_XXH3,
    FINGERPRINT_SAMPLES,
    FOOTER,
    FOOTER_MAGIC,
    FORMAT_MAJOR,
    FORMAT_MINOR,
    FORMAT_MINOR_PLAIN,
    FRAME_PAGES_MAX_BYTES,
    HEADER,
    HEADER_MAGIC,
    INDEX_BODY,
    INDEX_ENTRY,
    NO_KEY,
    PAGE_FRAME_BODY,
    PAGE_MAP_BODY,
    RECORD,
    RECORD_TRAILER,
    REGION_BODY,
    REGION_FLAG_HAS_GPA,
    REGION_NAME_MAX,
    REGION_SIZE_MAX,
    SOURCE_STATE_BODY,
    CompatFeature,
    IncompatFeature,
    PageClass,
    RecordType,
    align8,
    page_digest,
    digest_class_table,
    page_digests,
    valid_page_size,
)
from .structures import footer_checksum, header_checksum

_MAX_EXTENT_PAGES = 1 << 31


class WriterUsageError(ValueError):
    """The caller used the writer wrongly (not an input error)."""


class PageGivenTwice(WriterUsageError):
    """A page was put a second time (a converter may then fall back to last-copy-wins)."""


@dataclass(frozen=True)
class ParentLink:
    uuid: bytes
    digest: bytes


class _Log:
    """Arrays appended a few rows at a time, joined every 4096 appends: a million one-row
    appends (one DELTA page each) cost their rows, not a million array objects."""

    def __init__(self, row_shape: tuple[int, ...], dtype):
        self.row_shape, self.dtype = row_shape, dtype
        self.joined: list[np.ndarray] = []
        self.recent: list[np.ndarray] = []

    def append(self, rows: np.ndarray) -> None:
        self.recent.append(rows)
        if len(self.recent) >= 4096:
            self.joined.append(np.concatenate(self.recent))
            self.recent = []

    def rows(self) -> np.ndarray:
        return np.concatenate([np.zeros((0, *self.row_shape), self.dtype), *self.joined, *self.recent])


@dataclass
class _Region:
    """What the writer knows of a region's pages: a class byte a page (0: not given yet), and
    only for the pages that have them, their slots (as runs) and digests, so a guest of
    mostly ZERO pages costs a byte a page (a 1 TiB guest 256 MiB), not 25."""

    region_id: int
    name: str
    num_pages: int
    classes: np.ndarray = field(repr=False)
    slot_runs: _Log = field(default_factory=lambda: _Log((3,), np.int64), repr=False)  # first page, count, slot
    digest_pages: _Log = field(default_factory=lambda: _Log((), np.int64), repr=False)  # DISK, PARENT, DELTA pages
    digests: _Log = field(default_factory=lambda: _Log((DIGEST_SIZE,), np.uint8), repr=False)  # their digests

    def add_slots(self, pages: np.ndarray, first_slot: int) -> None:
        """Pages ``pages`` (in the order given) get slots first_slot, first_slot + 1, ..."""
        self.slot_runs.append(_slot_runs(np.asarray(pages, np.int64), first_slot))

    def add_run(self, first_page: int, count: int, first_slot: int) -> None:
        """Pages first_page.. (count of them) get slots first_slot, first_slot + 1, ..."""
        self.slot_runs.append(np.array([[first_page, count, first_slot]], np.int64))

    def add_digests(self, pages: np.ndarray, digests: np.ndarray) -> None:
        self.digest_pages.append(np.asarray(pages, np.int64))
        self.digests.append(digests)

    def sorted_slot_runs(self) -> np.ndarray:
        runs = self.slot_runs.rows()
        return runs[np.argsort(runs[:, 0], kind="stable")]


class _Sink:
    """The output: counts bytes and hashes everything for the footer digest."""

    def __init__(self, fileobj):
        self.fileobj = fileobj
        self.offset = 0
        self.hasher = xxhash.xxh3_128()

    def write(self, data) -> None:
        self.fileobj.write(data)
        self.hasher.update(data)
        self.offset += len(data)


class _Framed(NamedTuple):
    """A record laid out for writing: its parts (head, body parts, padding and trailer)."""

    parts: list
    record_type: int


def _framed(record_type: int, body_parts: list) -> _Framed:
    """A record's head, body, padding to 8 bytes and checksum trailer (spec §2.2)."""
    body_length = sum(len(p) for p in body_parts)
    head = RECORD.pack(record_type=record_type, body_length=body_length)
    padding = bytes(align8(body_length) - body_length)
    hasher = xxhash.xxh3_64(head)
    for part in body_parts:
        hasher.update(part)
    hasher.update(padding)
    return _Framed([head, *body_parts, padding + RECORD_TRAILER.pack(hasher.intdigest())], record_type)


class _FrameRecord(NamedTuple):
    """A PAGE_FRAME record made on a worker thread, with the digests of its pages."""

    record: _Framed
    digests: np.ndarray


class _ParallelCompressor:
    """Page frames compressed, and their pages' digests computed, on worker threads; the
    results handed back in submission order."""

    def __init__(self, level: int, threads: int, page_size: int):
        self.level, self.page_size = level, page_size
        self.local = threading.local()
        self.pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
        self.pending: deque = deque()
        self.max_pending = 2 * threads

    def compress(self, data) -> bytes:
        """``data`` compressed on the calling thread (a DELTA_FRAME's entries)."""
        compressor = getattr(self.local, "compressor", None)
        if compressor is None:
            compressor = self.local.compressor = zstandard.ZstdCompressor(
                level=self.level, write_content_size=True, write_checksum=False
            )
        return compressor.compress(data)

    def _page_frame(self, data, first: int, num_pages: int) -> _FrameRecord:
        head = PAGE_FRAME_BODY.pack(first_ordinal=first, num_pages=num_pages)
        return _FrameRecord(
            _framed(RecordType.PAGE_FRAME, [head, self.compress(data)]), page_digests(data, self.page_size)
        )

    def submit(self, data, first: int, num_pages: int) -> list[_FrameRecord]:
        """Queue a frame of pages; return the PAGE_FRAME records now ready, in order."""
        if self.pool is None:
            return [self._page_frame(data, first, num_pages)]
        self.pending.append(self.pool.submit(self._page_frame, data, first, num_pages))
        ready = []
        while self.pending and (len(self.pending) > self.max_pending or self.pending[0].done()):
            ready.append(self.pending.popleft().result())
        return ready

    def drain(self) -> list[_FrameRecord]:
        ready = [future.result() for future in self.pending]
        self.pending.clear()
        return ready

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def disk_fingerprint(read_at, size_bytes: int) -> bytes:
    """Fingerprint method 1 (spec §5.3): xxh3-128 of the size and 64 sampled blocks.

    ``read_at(offset, length)`` returns disk bytes.
    """
    hasher = xxhash.xxh3_128()
    hasher.update(struct.pack("<Q", size_bytes))
    for k in range(FINGERPRINT_SAMPLES):
        start = (size_bytes * k // FINGERPRINT_SAMPLES) // DISK_SECTOR_SIZE * DISK_SECTOR_SIZE
        hasher.update(read_at(start, min(FINGERPRINT_SAMPLE_SIZE, size_bytes - start)))
    return hasher.digest()


class LeanImageWriter:
    """Write one lean image. Use as a context manager; ``finish`` runs on a clean exit."""

    def __init__(
        self,
        dest,
        *,
        page_size: int = 4096,
        parent: ParentLink | None = None,
        frame_pages: int | None = None,
        level: int = DEFAULT_ZSTD_LEVEL,
        threads: int | None = None,
        image_uuid: bytes | None = None,
        allow_delta: bool | None = None,
        inherit_digests: bool | None = None,
    ):
        """``inherit_digests`` (default: with a parent) writes format 1.1: PARENT pages get no
        stored digest, readers take it from the parent (spec §3.4 INHERITED_DIGESTS); False
        writes a child as format 1.0 does."""
        if not valid_page_size(page_size):
            raise WriterUsageError(f"page_size must be a power of two in 4096..65536, got {page_size}")
        frame_pages = frame_pages or DEFAULT_FRAME_BYTES // page_size
        if not 1 <= frame_pages * page_size <= FRAME_PAGES_MAX_BYTES:
            raise WriterUsageError(f"frame of {frame_pages} pages exceeds {FRAME_PAGES_MAX_BYTES} bytes")
        self.page_size = page_size
        self.parent = parent
        self.frame_pages = frame_pages
        self.image_uuid = image_uuid or uuidlib.uuid4().bytes
        self.allow_delta = parent is not None if allow_delta is None else allow_delta
        if self.allow_delta and parent is None:
            raise WriterUsageError("DELTA pages need a parent")
        self.inherit_digests = parent is not None if inherit_digests is None else inherit_digests
        if self.inherit_digests and parent is None:
            raise WriterUsageError("inherited digests need a parent")
        self._open_destination(dest)
        self._compressor = _ParallelCompressor(level, threads or min(4, os.cpu_count() or 1), page_size)
        self._regions: dict[int, _Region] = {}
        self._disks: dict[int, str] = {}
        self._index: list[tuple] = []
        self._header_written = False
        self._frame = np.empty((frame_pages, page_size), np.uint8)
        self._frames_in_flight: deque[np.ndarray] = deque()  # with the workers, in order
        self._spare_frames: list[np.ndarray] = []
        self._frame_fill = 0
        self._frame_first_ordinal = 0
        self._stored_digests: list[np.ndarray] = []  # per frame, in ordinal order
        self._next_ordinal = 0
        self._next_frame_ordinal = 0
        self._delta_entries: list[bytes] = []
        self._delta_bytes = 0
        self._next_delta = 0
        self._delta_first = 0
        self._disk_refs: list[tuple[int, int]] = []
        self._pending_disks: list[bytes] = []
        self._disk_sizes: list[int] = []  # by disk id
        self._source_sequence = 0
        self._has_source_state = False
        self._finished = False

    # -- destination -------------------------------------------------------
    def _open_destination(self, dest) -> None:
        self._output: Output | None
        self.path: str | None  # None: written to a file object
        if isinstance(dest, (str, os.PathLike)):
            self._output = Output(dest)
            self.path = self._output.name
            self._fileobj = self._output.file
        else:
            self.path, self._output = None, None
            self._fileobj = dest
        self._sink = _Sink(self._fileobj)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finish()
        else:
            self.abort()
        return False

    def abort(self) -> None:
        """Drop everything written; a path destination is left untouched."""
        self._compressor.close()
        if self._output is not None:
            self._output.discard()
        self._finished = True

    # -- header and records --------------------------------------------------
    def _write_header(self) -> None:
        incompat = 0
        if self.parent is not None:
            incompat |= IncompatFeature.PARENT
        if self._disks:
            incompat |= IncompatFeature.DISK
        if self.allow_delta:
            incompat |= IncompatFeature.DELTA
        if self.inherit_digests:
            incompat |= IncompatFeature.INHERITED_DIGESTS
        compat = CompatFeature.SOURCE_STATE if self._has_source_state else 0
        parent_uuid = self.parent.uuid if self.parent else bytes(16)
        parent_digest = self.parent.digest if self.parent else bytes(16)
        fields = dict(
            magic=HEADER_MAGIC,
            major_version=FORMAT_MAJOR,
            minor_version=self._minor_version(incompat),
            header_length=HEADER.size,
            incompatible_features=int(incompat),
            compatible_features=int(compat),
            image_uuid=self.image_uuid,
            parent_uuid=parent_uuid,
            parent_digest=parent_digest,
            page_size=self.page_size,
        )
        header = HEADER.pack(**fields)
        self._sink.write(HEADER.pack(**fields, header_checksum=header_checksum(header)))
        self._header_written = True

    @staticmethod
    def _minor_version(incompat: int) -> int:
        """1 when the image uses a feature of format 1.1, else 0: it is then a 1.0 image."""
        return FORMAT_MINOR if incompat & IncompatFeature.INHERITED_DIGESTS else FORMAT_MINOR_PLAIN

    def _write_record(self, record_type: int, body_parts, key=NO_KEY, first=0, count=0) -> None:
        self._write_framed(_framed(record_type, body_parts), key, first, count)

    def _write_framed(self, record: _Framed, key=NO_KEY, first=0, count=0) -> None:
        if not self._header_written:
            self._write_header()
        self._index.append((self._sink.offset, record.record_type, key, first, count))
        for part in record.parts:
            self._sink.write(part)

    # -- declarations ----------------------------------------------------------
    def add_disk(self, name: str, size_bytes: int, fingerprint: bytes) -> int:
        """Declare a disk; all disks come before the first region or source state."""
        if self._header_written:
            raise WriterUsageError("disks must be declared before any region or source state")
        encoded = _check_name(name, "disk")
        if name in self._disks.values():
            raise WriterUsageError(f"disk name {name!r} declared twice")
        if size_bytes <= 0:
            raise WriterUsageError(f"disk {name!r}: size {size_bytes} is not positive")
        disk_id = len(self._disks)
        self._disks[disk_id] = name
        self._pending_disks.append(
            DISK_BODY.pack(
                disk_id=disk_id,
                size_bytes=size_bytes,
                sector_size=DISK_SECTOR_SIZE,
                fingerprint_method=FINGERPRINT_SAMPLED_XXH3,
                fingerprint=fingerprint,
                name_length=len(encoded),
            )
            + encoded
        )
        self._disk_sizes.append(size_bytes)
        return disk_id

    def disk_id(self, name: str) -> int:
        for disk_id, known in self._disks.items():
            if known == name:
                return disk_id
        raise WriterUsageError(f"no disk named {name!r}")

    def _flush_disks(self) -> None:
        for disk_id, body in enumerate(self._pending_disks):
            self._write_record(RecordType.DISK, [body], disk_id, 0, self._disk_sizes[disk_id] // DISK_SECTOR_SIZE)
        self._pending_disks = []

    def declare_source_state(self) -> None:
        """Promise SOURCE_STATE records before the header is written (sets the compat bit)."""
        if self._header_written:
            raise WriterUsageError("declare_source_state must come before any record")
        self._has_source_state = True

    def add_source_state(self, source_format: int, tag: int, data) -> None:
        if not self._header_written:
            self._has_source_state = True
            self._write_header()
            self._flush_disks()
        elif not self._has_source_state:
            raise WriterUsageError("call declare_source_state() before the first record")
        self._write_record(
            RecordType.SOURCE_STATE,
            [SOURCE_STATE_BODY.pack(source_format=source_format, tag=tag, sequence=self._source_sequence), data],
            tag,
            self._source_sequence,
            len(data),
        )
        self._source_sequence += 1

    def add_region(self, name: str, size_bytes: int, guest_phys_base: int | None = None) -> int:
        encoded = _check_name(name, "region")
        if any(r.name == name for r in self._regions.values()):
            raise WriterUsageError(f"region name {name!r} declared twice")
        if size_bytes <= 0 or size_bytes % self.page_size:
            raise WriterUsageError(
                f"region {name!r}: size {size_bytes} is not a non-zero multiple of page_size {self.page_size}"
            )
        if size_bytes > REGION_SIZE_MAX:
            raise LimitError(
                f"{size_bytes} bytes, more than a lean image holds ({REGION_SIZE_MAX} bytes, LI-REG-002)",
                structure=f"region {name!r}",
            )
        classes = _region_classes(name, size_bytes // self.page_size)
        if not self._header_written:
            self._write_header()
            self._flush_disks()
        region_id = len(self._regions)
        num_pages = size_bytes // self.page_size
        flags = REGION_FLAG_HAS_GPA if guest_phys_base is not None else 0
        body = REGION_BODY.pack(
            region_id=region_id,
            flags=flags,
            guest_phys_base=guest_phys_base or 0,
            size_bytes=size_bytes,
            name_length=len(encoded),
        )
        self._write_record(RecordType.REGION, [body, encoded], region_id, 0, num_pages)
        self._regions[region_id] = _Region(region_id, name, num_pages, classes)
        return region_id

    # -- pages -------------------------------------------------------------------
    def _region(self, region_id: int) -> _Region:
        region = self._regions.get(region_id)
        if region is None:
            raise WriterUsageError(f"unknown region id {region_id}")
        return region

    def _claim(self, region_id: int, first_page: int, count: int) -> _Region:
        region = self._region(region_id)
        if first_page < 0 or count < 0 or first_page + count > region.num_pages:
            raise WriterUsageError(f"region {region.name!r}: pages {first_page}+{count} outside 0..{region.num_pages}")
        given = region.classes[first_page : first_page + count]
        if given.any():
            raise PageGivenTwice(f"region {region.name!r}: page {first_page + int(np.argmax(given != 0))} given twice")
        return region

    def put_pages(self, region_id: int, first_page: int, data) -> None:
        """Contiguous pages by content: all-zero ones become ZERO, the rest STORED.

        ``data`` is bytes-like (whole pages), or a (pages, page_size) uint8 array whose rows
        may lie apart (a strided view into a source's buffer): copied once, into a frame.
        Digests are computed with the compression, on the worker threads.
        """
        rows = self._page_rows(data)
        count = len(rows)
        region = self._claim(region_id, first_page, count)
        stored = np.flatnonzero(nonzero_rows(rows))
        region.classes[first_page : first_page + count] = PageClass.ZERO
        if not len(stored):
            return
        if len(stored) == count:
            region.classes[first_page : first_page + count] = PageClass.STORED
            region.add_run(first_page, count, self._next_ordinal)
            self._next_ordinal += count
            self._append_to_frames(rows)
        else:
            self._store(region, first_page + stored, rows, stored)

    def put_pages_at(self, region_id: int, pages: np.ndarray, data: np.ndarray) -> None:
        """Pages ``pages`` (page numbers, each once, in any order) by content, ``data`` their
        rows: as put_pages for each in turn (the stored ones take their slots in that order),
        in one call; for a sink whose pages come with gaps (DiskPages: those not on a disk)."""
        rows = self._page_rows(data)
        pages = np.asarray(pages, np.int64)
        if len(pages) != len(rows):
            raise WriterUsageError(f"put_pages_at: {len(pages)} page numbers for {len(rows)} pages")
        region = self._claim_pages(region_id, pages, "put_pages_at")
        nonzero = nonzero_rows(rows)
        region.classes[pages] = PageClass.ZERO
        if not nonzero.any():
            return
        if nonzero.all():
            self._store(region, pages, rows)
        else:
            self._store(region, pages[nonzero], rows, np.flatnonzero(nonzero))

    def _store(self, region: _Region, pages: np.ndarray, rows: np.ndarray, at: np.ndarray | None = None) -> None:
        """STORED pages ``pages`` (page numbers, in slot order), ``rows`` their bytes (or
        ``rows[at]``): the next slots, and into the frames."""
        region.classes[pages] = PageClass.STORED
        region.add_slots(pages, self._next_ordinal)
        self._next_ordinal += len(pages)
        self._append_to_frames(rows, at)

    def _claim_pages(self, region_id: int, pages: np.ndarray, what: str) -> _Region:
        """A region's ``pages`` (page numbers, int64), each once and none given before."""
        region = self._region(region_id)
        if len(pages) and (pages.min() < 0 or pages.max() >= region.num_pages or len(distinct(pages)) != len(pages)):
            raise WriterUsageError(f"region {region.name!r}: {what} pages outside 0..{region.num_pages} or repeated")
        taken = pages[region.classes[pages] != 0]
        if len(taken):
            raise PageGivenTwice(f"region {region.name!r}: page {int(taken[0])} given twice")
        return region

    def _page_rows(self, data) -> np.ndarray:
        ps = self.page_size
        if isinstance(data, np.ndarray) and data.ndim == 2:
            if data.dtype != np.uint8 or data.shape[1] != ps or data.strides[1] != 1:
                raise WriterUsageError(
                    f"page rows must be uint8 ({ps} contiguous bytes each), "
                    f"got {data.dtype} {data.shape} strides {data.strides}"
                )
            return data
        data = memoryview(data).cast("B")
        if len(data) % ps:
            raise WriterUsageError(f"data length {len(data)} is not a multiple of {ps}")
        return np.frombuffer(data, np.uint8).reshape(-1, ps)

    def _append_to_frames(self, rows: np.ndarray, at: np.ndarray | None = None) -> None:
        """``rows`` (or ``rows[at]``, gathered straight into the frames) into the frames."""
        if at is not None and not rows.flags.c_contiguous:
            rows, at = rows[at], None
        count, done = len(rows) if at is None else len(at), 0
        while done < count:
            n = min(count - done, self.frame_pages - self._frame_fill)
            into = self._frame[self._frame_fill : self._frame_fill + n]
            if at is None:
                into[:] = rows[done : done + n]
            else:
                # mode "clip" (the indexes are the caller's row numbers): "raise" copies twice
                np.take(as_items(rows), at[done : done + n], out=as_items(into), mode="clip")
            self._frame_fill += n
            done += n
            if self._frame_fill == self.frame_pages:
                self._flush_frame()

    def put_zero(self, region_id: int, first_page: int, count: int = 1) -> None:
        region = self._claim(region_id, first_page, count)
        region.classes[first_page : first_page + count] = PageClass.ZERO

    def put_free(self, region_id: int, first_page: int, count: int = 1) -> None:
        region = self._claim(region_id, first_page, count)
        region.classes[first_page : first_page + count] = PageClass.FREE

    def put_disk(self, region_id: int, page: int, disk_id: int, sector: int, digest: bytes) -> None:
        self.put_disks(
            region_id,
            np.array([page]),
            np.array([disk_id]),
            np.array([sector]),
            np.frombuffer(digest, np.uint8).reshape(1, DIGEST_SIZE),
        )

    def put_disks(
        self, region_id: int, pages: np.ndarray, disk_ids: np.ndarray, sectors: np.ndarray, digests: np.ndarray
    ) -> None:
        """DISK pages: page ``pages[k]`` is at ``sectors[k]`` of disk ``disk_ids[k]`` and has
        digest ``digests[k]`` (a (n, 16) uint8 array)."""
        if not len(pages):
            return
        digests = np.array(digests, np.uint8)  # (a copy: the caller may reuse its array)
        if not len(pages) == len(disk_ids) == len(sectors) == len(digests) or digests.shape[1:] != (DIGEST_SIZE,):
            raise WriterUsageError(
                f"put_disks: {len(pages)} pages, {len(disk_ids)} disk ids, {len(sectors)} "
                f"sectors and {len(digests)} digests of shape {digests.shape[1:]}: expected one of each "
                f"per page, digests of {DIGEST_SIZE} bytes"
            )
        unknown = set(distinct(disk_ids).tolist()) - set(self._disks)
        if unknown:
            raise WriterUsageError(f"unknown disk id {min(unknown)}")
        sizes = np.array(self._disk_sizes, np.float64)[np.asarray(disk_ids, np.int64)]
        ends = np.asarray(sectors, np.float64) * DISK_SECTOR_SIZE + self.page_size  # no u64 overflow
        if (ends > sizes).any():
            k = int(np.flatnonzero(ends > sizes)[0])
            raise WriterUsageError(
                f"page at sector {int(sectors[k])} runs past the end of disk {self._disks[int(disk_ids[k])]!r}"
            )
        pages = np.asarray(pages, np.int64)
        region = self._claim_pages(region_id, pages, "DISK")
        region.classes[pages] = PageClass.DISK
        region.add_slots(pages, len(self._disk_refs))
        region.add_digests(pages, digests)
        self._disk_refs.extend(zip(np.asarray(disk_ids).tolist(), np.asarray(sectors).tolist()))

    def put_parent(self, region_id: int, first_page: int, digests) -> None:
        """Pages unchanged since the parent; ``digests`` holds their 16-byte digests."""
        if self.parent is None:
            raise WriterUsageError("PARENT pages need a parent")
        digests = np.frombuffer(digests, np.uint8).reshape(-1, DIGEST_SIZE)
        region = self._claim(region_id, first_page, len(digests))
        region.classes[first_page : first_page + len(digests)] = PageClass.PARENT
        if not self.inherit_digests:  # format 1.1 takes a PARENT page's digest from the parent
            region.add_digests(np.arange(first_page, first_page + len(digests)), digests.copy())

    def put_changed(self, region_id: int, page: int, parent_page, new_page) -> PageClass:
        """A page that differs from the parent's: DELTA when smaller, else by content."""
        entry = deltacodec.encode(parent_page, new_page) if self.allow_delta else None
        if entry is None:
            self.put_pages(region_id, page, new_page)
            return PageClass.STORED
        self.put_delta(region_id, page, entry, page_digest(new_page))
        return PageClass.DELTA

    def put_delta(self, region_id: int, page: int, entry: bytes, digest: bytes) -> None:
        if not self.allow_delta:
            raise WriterUsageError("DELTA pages need a parent and allow_delta")
        region = self._claim(region_id, page, 1)
        region.classes[page] = PageClass.DELTA
        region.add_slots(np.array([page]), self._next_delta)
        region.add_digests(np.array([page]), np.frombuffer(digest, np.uint8).reshape(1, DIGEST_SIZE).copy())
        self._next_delta += 1
        self._delta_entries.append(bytes(entry))
        self._delta_bytes += len(entry)
        if self._delta_bytes >= self.frame_pages * self.page_size // 2:
            self._flush_deltas()

    # -- frames ------------------------------------------------------------------
    def _flush_frame(self) -> None:
        num_pages = self._frame_fill
        if not num_pages:
            return
        first = self._frame_first_ordinal
        self._frame_first_ordinal += num_pages
        data = self._frame[:num_pages].data.cast("B")  # handed over, not copied
        self._frames_in_flight.append(self._frame)
        self._frame = self._spare_frames.pop() if self._spare_frames else np.empty_like(self._frame)
        self._frame_fill = 0
        for frame in self._compressor.submit(data, first, num_pages):
            self._write_page_frame(frame)

    def _write_page_frame(self, frame: _FrameRecord) -> None:
        """A PAGE_FRAME record (its checksum made with the compression, on a worker); its
        buffer is taken again for a later frame (a fresh one costs a page fault a page)."""
        self._spare_frames.append(self._frames_in_flight.popleft())
        self._stored_digests.append(frame.digests)
        first = self._next_frame_ordinal
        self._next_frame_ordinal += len(frame.digests)
        self._write_framed(frame.record, NO_KEY, first, len(frame.digests))

    def _flush_deltas(self) -> None:
        if not self._delta_entries:
            return
        offsets = np.zeros(len(self._delta_entries) + 1, dtype="<u4")
        np.cumsum([len(e) for e in self._delta_entries], out=offsets[1:])
        head = DELTA_FRAME_BODY.pack(first_delta=self._delta_first, num_deltas=len(self._delta_entries))
        table = offsets.tobytes()
        table += bytes(align8(len(head) + len(table)) - len(head) - len(table))
        compressed = self._compressor.compress(b"".join(self._delta_entries))
        self._write_record(
            RecordType.DELTA_FRAME, [head, table, compressed], NO_KEY, self._delta_first, len(self._delta_entries)
        )
        self._delta_first += len(self._delta_entries)
        self._delta_entries, self._delta_bytes = [], 0

    # -- finish ------------------------------------------------------------------
    def finish(self) -> bytes:
        """Write maps, digests, index and footer; return the image digest."""
        if self._finished:
            raise WriterUsageError("writer already finished")
        try:
            if not self._header_written:
                self._write_header()
                self._flush_disks()
            self._check_complete()
            self._flush_frame()
            for frame in self._compressor.drain():
                self._write_page_frame(frame)
            self._flush_deltas()
            self._write_disk_refs()
            stored_digests = np.concatenate(self._stored_digests) if self._stored_digests else _NO_DIGESTS
            for region in self._regions.values():
                runs = region.sorted_slot_runs()
                self._write_page_map(region, runs)
                self._write_digests(region, *self._bearing_digests(region, runs, stored_digests))
            digest = self._write_index_and_footer()
            self._compressor.close()
            self._commit()
        except BaseException:
            self.abort()
            raise
        self._finished = True
        return digest

    def page_classes(self, region_id: int) -> np.ndarray:
        """The class given so far to each page of a region (0: not yet given); read-only."""
        view = self._regions[region_id].classes.view()
        view.flags.writeable = False
        return view

    def missing_pages(self, region_id: int) -> np.ndarray:
        """True for every page of the region not given yet."""
        return self._regions[region_id].classes == 0

    def missing_runs(self, region_id: int) -> list[tuple[int, int]]:
        """(first_page, count) of every run of pages not given yet."""
        classes = self._regions[region_id].classes
        starts, stops = [], []
        for lo, window in _windows(classes):
            edge = np.zeros(1, np.int8)
            edges = np.flatnonzero(np.diff(np.concatenate((edge, (window == 0).view(np.int8), edge)))) + lo
            starts.append(edges[::2])
            stops.append(edges[1::2])
        runs: list[tuple[int, int]] = []
        for a, b in zip(np.concatenate(starts).tolist(), np.concatenate(stops).tolist()):
            if runs and runs[-1][0] + runs[-1][1] == a:  # a run across windows
                runs[-1] = (runs[-1][0], b - runs[-1][0])
            else:
                runs.append((a, b - a))
        return runs

    def _check_complete(self) -> None:
        for region in self._regions.values():
            missing = sum(int(np.count_nonzero(window == 0)) for _, window in _windows(region.classes))
            if missing:
                first = next(lo + int(np.argmin(w)) for lo, w in _windows(region.classes) if not w.all())
                raise WriterUsageError(f"region {region.name!r}: {missing} pages never given, first is page {first}")

    def _write_disk_refs(self) -> None:
        refs = np.zeros(len(self._disk_refs), dtype=DISK_REF.dtype)
        if len(refs):
            refs["disk_id"], refs["sector"] = zip(*self._disk_refs)
        for first in range(0, len(refs), DISK_REF_CHUNK):
            chunk = refs[first : first + DISK_REF_CHUNK]
            head = DISK_REFS_BODY.pack(first_ref=first, num_refs=len(chunk))
            self._write_record(RecordType.DISK_REFS, [head, chunk.tobytes()], NO_KEY, first, len(chunk))

    def _write_page_map(self, region: _Region, slot_runs: np.ndarray) -> None:
        extents = build_extents(region.classes, slot_runs)
        for first in range(0, len(extents), EXTENT_CHUNK):
            chunk = extents[first : first + EXTENT_CHUNK]
            pages = int(chunk["num_pages"].sum())
            self._write_record(
                RecordType.PAGE_MAP,
                [PAGE_MAP_BODY.pack(region_id=region.region_id, num_extents=len(chunk)), chunk.tobytes()],
                region.region_id,
                int(chunk["first_page"][0]),
                pages,
            )

    def _bearing_digests(
        self, region: _Region, slot_runs: np.ndarray, stored_digests: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The digest-bearing pages of a region (STORED, DISK, DELTA; PARENT unless inherited)
        in page order, and their digests: a STORED page's the workers computed for its ordinal."""
        stored_runs = slot_runs[region.classes[slot_runs[:, 0]] == PageClass.STORED]
        pages = _expand(stored_runs[:, 0], stored_runs[:, 1])
        digests = _by_ordinal(stored_digests, stored_runs)
        others = region.digest_pages.rows()
        if len(others):
            pages, digests = np.concatenate([pages, others]), np.concatenate([digests, region.digests.rows()])
        incompat = IncompatFeature.INHERITED_DIGESTS if self.inherit_digests else 0
        bearing = digest_class_table(incompat)[region.classes[pages]]
        if not bearing.all():
            pages, digests = pages[bearing], digests[bearing]
        if not (pages[1:] > pages[:-1]).all():  # (copies spared when pages came in order)
            order = np.argsort(pages, kind="stable")
            pages, digests = pages[order], digests[order]
        return pages, digests

    def _write_digests(self, region: _Region, pages: np.ndarray, digests: np.ndarray) -> None:
        """Digests of the digest-bearing ``pages`` (in page order), in records of at most
        DIGEST_CHUNK_PAGES pages (1.0) or digests (1.1: a child's records then grow with its
        changed pages, not with the guest)."""
        if self.inherit_digests:
            cuts = pages[DIGEST_CHUNK_PAGES::DIGEST_CHUNK_PAGES].tolist()
        else:
            cuts = list(range(DIGEST_CHUNK_PAGES, region.num_pages, DIGEST_CHUNK_PAGES))
        bounds = [0, *cuts, region.num_pages]
        at = np.searchsorted(pages, bounds).tolist()
        for first, stop, lo, hi in zip(bounds, bounds[1:], at, at[1:]):
            count = stop - first
            chunk = digests[lo:hi]
            self._write_record(
                RecordType.DIGESTS,
                [
                    DIGESTS_BODY.pack(
                        region_id=region.region_id, num_digests=len(chunk), first_page=first, num_pages=count
                    ),
                    chunk.tobytes(),
                ],
                region.region_id,
                first,
                count,
            )

    def _write_index_and_footer(self) -> bytes:
        entries = np.array(self._index, dtype=INDEX_ENTRY.dtype)
        index_offset = self._sink.offset
        self._write_record(RecordType.INDEX, [INDEX_BODY.pack(num_entries=len(entries)), entries.tobytes()])
        digest = self._sink.hasher.digest()
        fields = dict(
            magic=FOOTER_MAGIC,
            index_offset=index_offset,
            file_length=self._sink.offset + FOOTER.size,
            image_digest=digest,
        )
        footer = FOOTER.pack(**fields)
        self._sink.write(FOOTER.pack(**fields, footer_checksum=footer_checksum(footer)))
        return digest

    def _commit(self) -> None:
        if self._output is not None:
            self._output.commit()
        else:
            self._fileobj.flush()


def _region_classes(name: str, num_pages: int) -> np.ndarray:
    """A region's class byte a page, or a LimitError when it does not fit in this process's
    memory (a 1 TiB guest needs 256 MiB)."""
    with fits_in_memory(f"the page classes of {num_pages} pages ({num_pages} bytes)", f"region {name!r}"):
        return np.zeros(num_pages, np.uint8)


_NO_DIGESTS = np.zeros((0, DIGEST_SIZE), np.uint8)
_SCAN_PAGES = 1 << 22  # per-page passes go in windows: their temporaries stay small


def _windows(classes: np.ndarray):
    """(first page, view) of each window of a region's classes."""
    for lo in range(0, len(classes), _SCAN_PAGES):
        yield lo, classes[lo : lo + _SCAN_PAGES]


def _slot_runs(pages: np.ndarray, first_slot: int) -> np.ndarray:
    """(first_page, count, first_slot) rows of ``pages`` given slots first_slot, +1, ...: a
    run ends where the next page is not the next page up."""
    starts = np.flatnonzero(np.diff(pages) != 1) + 1
    starts = np.concatenate(([0], starts))
    counts = np.diff(np.append(starts, len(pages)))
    return np.stack([pages[starts], counts, first_slot + starts], axis=1)


def _expand(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """firsts[k], firsts[k] + 1, ... (counts[k] values) for each k, end to end."""
    offsets = np.cumsum(counts) - counts
    return np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(firsts - offsets, counts)


def _by_ordinal(stored_digests: np.ndarray, stored_runs: np.ndarray) -> np.ndarray:
    """The digests of the pages of ``stored_runs`` (by page), from the workers' table by
    ordinal: that table itself when the runs hold every ordinal in order (one region)."""
    ordinals = _expand(stored_runs[:, 2], stored_runs[:, 1])
    if len(ordinals) == len(stored_digests) and (ordinals == np.arange(len(ordinals))).all():
        return stored_digests
    return stored_digests[ordinals]


def build_extents(classes: np.ndarray, slot_runs: np.ndarray) -> np.ndarray:
    """Run-length extents of a region: a new extent where the class changes or slots jump.
    ``slot_runs``: (first_page, count, first_slot) rows of the slot-bearing pages, by page."""
    n = len(classes)
    firsts, counts, slots = slot_runs[:, 0], slot_runs[:, 1], slot_runs[:, 2]
    starts = [np.arange(0, n, _MAX_EXTENT_PAGES)]
    for lo, window in _windows(classes[1:]):
        starts.append(np.flatnonzero(classes[lo : lo + len(window)] != window) + lo + 1)
    if len(firsts):  # a run continues the one before it when it starts on the next page with the next slot
        continues = (firsts[1:] == firsts[:-1] + counts[:-1]) & (slots[1:] == slots[:-1] + counts[:-1])
        starts.append(firsts[~np.concatenate(([False], continues))])
    start_pages = distinct(np.concatenate(starts))
    extents = np.zeros(len(start_pages), dtype=EXTENT.dtype)
    extents["first_page"] = start_pages
    extents["num_pages"] = np.diff(np.append(start_pages, n))
    extents["page_class"] = classes[start_pages]
    if len(firsts):
        run = np.maximum(np.searchsorted(firsts, start_pages, "right") - 1, 0)
        has_slot = HAS_SLOT[classes[start_pages]]
        extents["first_slot"] = np.where(has_slot, slots[run] + start_pages - firsts[run], 0)
    return extents


def _check_name(name: str, what: str) -> bytes:
    encoded = name.encode("utf-8")
    if not 1 <= len(encoded) <= REGION_NAME_MAX:
        raise WriterUsageError(f"{what} name must be 1..{REGION_NAME_MAX} UTF-8 bytes, got {len(encoded)}")
    return encoded
