"""Random-access reader of lean images (spec §6-§10).

``LeanImage.open`` reads header, footer and INDEX, then the small records the
index points at (regions, disks, page maps, disk references). Frames are read
on demand, checksum-verified, decompressed within their declared size and kept
in a small cache. Every page handed out has been checked against its digest.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import zstandard

from . import delta as deltacodec
from .compression import SIZE, FrameError, decompress_exact
from .errors import ChainError, DiskError, FormatError, LeanImageError
from .format import (
    CHAIN_DEPTH_MAX, DIGEST_CLASSES, DIGEST_SIZE, DISK_SECTOR_SIZE, DISKS_MAX, FRAME_PAGES_MAX_BYTES, REGIONS_MAX,
    RECORD_HEADER_STRUCT, SOURCE_STATE_STRUCT, PageClass, RecordType, page_digest, page_digests, row_digests, zero_page_digest,
)
from .structures import (
    Footer, Header, ImageFile, Record, body_problems, header_problems, parse_body, raw_body_dict,
    read_footer, read_header, read_record, record_path,
)

FRAME_CACHE_SIZE = 8


@dataclass
class Region:
    region_id: int
    name: str
    size_bytes: int
    guest_phys_base: int | None
    page_size: int
    extents: np.ndarray = field(default=None, repr=False)
    _starts: np.ndarray = field(default=None, repr=False)
    _bearing: np.ndarray = field(default=None, repr=False)     # per extent: digests stored
    _rank0: np.ndarray = field(default=None, repr=False)       # per extent: digests before it

    @property
    def num_pages(self) -> int:
        return self.size_bytes // self.page_size


@dataclass
class DiskInfo:
    disk_id: int
    name: str
    size_bytes: int
    fingerprint: bytes


@dataclass
class SourceState:
    source_format: int
    tag: int
    sequence: int
    data: bytes
    offset: int | None = None        # file offset of ``data``, for errors about its content


def _first_problem(problems):
    for problem in problems:
        raise problem


class LeanImage:
    """An open lean image. Use ``LeanImage.open``; close it (or use ``with``)."""

    def __init__(self, path: str, fileobj, header: Header, footer: Footer, records: list):
        self.path = path
        self._file = ImageFile(fileobj, path)
        self.header = header
        self.footer = footer
        self.index_entries = records
        self.page_size = header.page_size
        self.regions: list[Region] = []
        self.disks: list[DiskInfo] = []
        self.source_states: list[SourceState] = []
        self.parent: LeanImage | None = None
        self._frame_starts = np.zeros(0, np.int64)
        self._frame_offsets = np.zeros(0, np.int64)
        self._delta_starts = np.zeros(0, np.int64)
        self._delta_offsets = np.zeros(0, np.int64)
        self._disk_refs = np.zeros(0, np.uint64)
        self._disk_ref_ids = np.zeros(0, np.uint32)
        self._digest_records: dict[int, list[int]] = {}
        self._digests: dict[int, np.ndarray] = {}
        self._frame_cache: OrderedDict = OrderedDict()
        self._decompressor = zstandard.ZstdDecompressor()
        self._disk_sources: dict[int, object] = {}
        self.sort_blocks = True                   # DISK pages read in ascending physical order
        self._resolutions: dict = {}              # region id -> chain.Resolution
        self._pool = None                         # read-ahead workers (enable_read_ahead)
        self._ahead: dict[int, object] = {}
        self._depth = 0

    # -- opening -----------------------------------------------------------------
    @classmethod
    def open(cls, path, *, parents=(), disks=None, check_disk_identity: bool = True) -> "LeanImage":
        """Open ``path`` and its chain; ``parents`` are candidate parent images (paths or open
        LeanImages), matched by UUID, and so are the *.lean files beside each link; ``disks``
        maps disk names to open disk sources (``leanimg.disks.open_disk``), attached with
        ``attach_disks``. Without ``check_disk_identity`` a disk's size and fingerprint are not
        compared with the disk table (every block read is still checked against its page's digest)."""
        image = cls._open_one(path)
        try:
            image._attach_chain(list(parents))
            image.attach_disks(disks or {}, check_identity=check_disk_identity)
        except BaseException:
            image.close()
            raise
        return image

    @classmethod
    def _open_one(cls, path) -> "LeanImage":
        """One link, without its parent."""
        path = os.fspath(path)
        try:
            fileobj = open(path, "rb")
        except OSError as exc:
            raise LeanImageError(f"cannot open: {exc.strerror}", path=path) from None
        try:
            return cls._load(path, fileobj)
        except LeanImageError as exc:
            fileobj.close()
            exc.path = exc.path or path
            exc.args = (str(exc),)
            raise

    @classmethod
    def _load(cls, path: str, fileobj) -> "LeanImage":
        image_file = ImageFile(fileobj, path)
        header = read_header(image_file)
        _first_problem(header_problems(header))
        footer = read_footer(image_file, header.header_length)
        index = read_record(image_file, footer.index_offset, footer.offset)
        if index.record_type != RecordType.INDEX or index.end != footer.offset:
            raise FormatError(f"expected the INDEX record ending at the footer {footer.offset:#x}, got "
                              f"{index.name} ending at {index.end:#x}", offset=footer.index_offset,
                              structure="footer.index_offset", rule="LI-FTR-005")
        entries = parse_body(index)["entries"]
        image = cls(path, fileobj, header, footer, entries)
        image._load_records()
        return image

    def _record_at(self, i: int) -> Record:
        entry = self.index_entries[i]
        offset = int(entry["record_offset"])
        limit = int(self.index_entries[i + 1]["record_offset"]) if i + 1 < len(self.index_entries) \
            else self.footer.index_offset
        record = read_record(self._file, offset, limit, i)
        if record.record_type != int(entry["record_type"]) or record.end != limit:
            raise FormatError(f"index entry {i} says type {int(entry['record_type']):#x} at {offset:#x} "
                              f"ending at {limit:#x}, found {record.record_type:#x} ending at {record.end:#x}",
                              offset=offset, structure=f"index.entries[{i}]", rule="LI-IDX-001")
        parse_body(record, i)
        _first_problem(body_problems(record, i, self.page_size))
        return record

    def _load_records(self) -> None:
        entries = self.index_entries
        offsets = entries["record_offset"].astype(np.int64)
        if len(entries) and (offsets[0] != self.header.header_length or (np.diff(offsets) <= 0).any()):
            raise FormatError("expected index entries ascending from header_length", structure="index",
                              offset=self.footer.index_offset, rule="LI-IDX-001")
        kinds = entries["record_type"]
        frames = np.flatnonzero(kinds == RecordType.PAGE_FRAME)
        self._frame_starts = entries["first"][frames].astype(np.int64)
        self._frame_counts = entries["count"][frames].astype(np.int64)
        self._frame_entries = frames
        deltas = np.flatnonzero(kinds == RecordType.DELTA_FRAME)
        self._delta_starts = entries["first"][deltas].astype(np.int64)
        self._delta_entries = deltas
        _check_numbering(self._frame_starts, self._frame_counts, "page_frame", "LI-FRM-001")
        _check_numbering(self._delta_starts, entries["count"][deltas].astype(np.int64), "delta_frame",
                         "LI-FRM-001")
        maps: dict[int, list[np.ndarray]] = {}
        refs = []
        for i in np.flatnonzero(kinds == RecordType.DIGESTS):
            self._digest_records.setdefault(int(entries["key"][i]), []).append(int(i))
        for i in np.flatnonzero(np.isin(kinds, [RecordType.REGION, RecordType.DISK, RecordType.SOURCE_STATE,
                                                 RecordType.PAGE_MAP, RecordType.DISK_REFS])):
            self._load_small_record(int(i), maps, refs)
        if refs:
            self._disk_ref_ids = np.concatenate([r["disk_id"] for r in refs])
            self._disk_refs = np.concatenate([r["sector"] for r in refs])
        for region in self.regions:
            region.extents = np.concatenate(maps.get(region.region_id, [])) if region.region_id in maps \
                else np.zeros(0, dtype=[("first_page", "<u8"), ("num_pages", "<u4")])
            self._check_digest_presence(region)
            _check_coverage(region)
            region._starts = region.extents["first_page"].astype(np.int64)
            region._bearing = np.isin(region.extents["page_class"], [int(c) for c in DIGEST_CLASSES])
            counts = np.where(region._bearing, region.extents["num_pages"].astype(np.int64), 0)
            region._rank0 = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts

    def _check_digest_presence(self, region: Region) -> None:
        listed = sum(int(self.index_entries["count"][i]) for i in self._digest_records.get(region.region_id, []))
        if listed != region.num_pages:
            raise FormatError(f"region {region.name!r} has {region.num_pages} pages but the index lists "
                              f"DIGESTS records covering {listed}",
                              structure=f"region[{region.region_id}].digests", rule="LI-DIG-001")

    def _load_small_record(self, i: int, maps: dict, refs: list) -> None:
        record = self._record_at(i)
        p = record.parsed
        kind = record.record_type
        if kind == RecordType.REGION:
            if len(self.regions) >= REGIONS_MAX or any(r.region_id == p["region_id"] or r.name == p["name"]
                                                       for r in self.regions):
                raise FormatError(f"region id {p['region_id']} / name {p['name']!r} repeated or too many regions",
                                  offset=record.offset, structure=record_path(i, record), rule="LI-REG-001")
            gpa = p["guest_phys_base"] if p["flags"] & 1 else None
            self.regions.append(Region(p["region_id"], p["name"], p["size_bytes"], gpa, self.page_size))
        elif kind == RecordType.DISK:
            if len(self.disks) >= DISKS_MAX or any(d.disk_id == p["disk_id"] or d.name == p["name"]
                                                   for d in self.disks):
                raise FormatError(f"disk id {p['disk_id']} / name {p['name']!r} repeated or too many disks",
                                  offset=record.offset, structure=record_path(i, record), rule="LI-DSK-001")
            self.disks.append(DiskInfo(p["disk_id"], p["name"], p["size_bytes"], p["fingerprint"]))
        elif kind == RecordType.SOURCE_STATE:
            self.source_states.append(SourceState(p["source_format"], p["tag"], p["sequence"], bytes(p["data"]),
                                                  record.offset + RECORD_HEADER_STRUCT.size + SOURCE_STATE_STRUCT.size))
        elif kind == RecordType.PAGE_MAP:
            if not any(r.region_id == p["region_id"] for r in self.regions):
                raise FormatError(f"page map of region {p['region_id']} before its REGION record",
                                  offset=record.offset, structure=record_path(i, record, "region_id"),
                                  rule="LI-REC-009")
            maps.setdefault(p["region_id"], []).append(p["extents"])
        elif kind == RecordType.DISK_REFS:
            expected = sum(len(r) for r in refs)
            if p["first_ref"] != expected:
                raise FormatError(f"expected first_ref {expected}, got {p['first_ref']}", offset=record.offset + 16,
                                  structure=record_path(i, record, "first_ref"), rule="LI-MAP-004")
            refs.append(p["refs"])

    def _attach_chain(self, parents: list) -> None:
        """Open the parent, its parent and so on, one link at a time (chains may be 4096 deep)."""
        index: dict = {}
        seen = {self.header.image_uuid}
        link = self
        while link.header.has_parent:
            wanted = link.header.parent_uuid
            if wanted in seen:
                raise ChainError(f"parent {_uuid(wanted)} is already in the chain (cycle)", offset=56,
                                 structure="header.parent_uuid", rule="LI-CHN-005", path=link.path)
            if len(seen) >= CHAIN_DEPTH_MAX:
                raise ChainError(f"chain deeper than {CHAIN_DEPTH_MAX}", offset=56, structure="header.parent_uuid",
                                 rule="LI-CHN-005", path=link.path)
            candidate = _find_candidate(wanted, parents, index) or \
                _find_candidate(wanted, _siblings(link.path, index), index)
            if candidate is None:
                raise ChainError(f"parent image {_uuid(wanted)} not found among {len(parents)} candidate(s) "
                                 "and the files beside the image; pass it with --parent", offset=56,
                                 structure="header.parent_uuid", rule="LI-CHN-001", path=link.path)
            if isinstance(candidate, LeanImage):
                link.parent = candidate              # an open image brings its own chain
                break
            link.parent = LeanImage._open_one(candidate)
            seen.add(link.parent.header.image_uuid)
            link = link.parent
        # links are joined by UUID first, so a cycle is reported as one; then verified by digest
        for link in self.chain():
            if link.parent is not None:
                link._check_parent(link.parent)

    def _check_parent(self, parent: "LeanImage") -> None:
        if parent.footer.image_digest != self.header.parent_digest:
            raise ChainError(f"parent {parent.path} has image_digest {parent.footer.image_digest.hex()}, "
                             f"expected {self.header.parent_digest.hex()} (parent modified or replaced)",
                             offset=72, structure="header.parent_digest", rule="LI-CHN-002", path=self.path)
        if parent.page_size != self.page_size:
            raise ChainError(f"parent page_size {parent.page_size}, expected {self.page_size}", offset=88,
                             structure="header.page_size", rule="LI-CHN-003", path=self.path)
        self.parent = parent

    def attach_disks(self, disks: dict, check_identity: bool = True) -> None:
        """Attach disk sources (``leanimg.disks.DiskSource`` by disk name; under None: the disk of
        an image with one disk) to this image and to every link of its chain that has the disk.
        Each is first checked to be that disk, size and fingerprint (LI-DSK-004), unless not
        ``check_identity``. The image closes the sources attached to it when it closes."""
        from .disks import check_identity as check_disk
        disks = dict(disks)
        if None in disks:
            names = sorted({d.name for link in self.chain() for d in link.disks})
            if len(names) != 1:
                raise DiskError(f"--disk PATH without a NAME needs an image with one disk; this one has "
                                f"{', '.join(names) or 'none'}: give NAME=PATH")
            disks[names[0]] = disks.pop(None)
            disks[names[0]].name = names[0]
        for name in disks:
            if not any(d.name == name for link in self.chain() for d in link.disks):
                known = ", ".join(d.name for d in self.disks) or "none"
                raise DiskError(f"--disk {name}=...: the image has no disk named {name!r} (its disks: {known})")
        for link in self.chain():
            for info in link.disks:
                if info.name in disks:
                    if check_identity:
                        check_disk(disks[info.name], info)
                    link._disk_sources[info.disk_id] = disks[info.name]

    def close(self) -> None:
        """Close this image and its whole chain."""
        for link in self.chain():
            if link._pool is not None:
                link._pool.shutdown(wait=True, cancel_futures=True)
            for source in link._disk_sources.values():
                source.close()
            link._file.fileobj.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- lookups -------------------------------------------------------------------
    def region(self, key) -> Region:
        for region in self.regions:
            if region.name == key or (isinstance(key, int) and region.region_id == key):
                return region
        raise LeanImageError(f"no region {key!r} (regions: {', '.join(r.name for r in self.regions)})")

    def chain(self) -> list["LeanImage"]:
        links, image = [], self
        while image is not None:
            links.append(image)
            image = image.parent
        return links

    def page_location(self, region: Region, page: int) -> tuple[int, int]:
        """(class, slot) of one page: binary search over the region's extents."""
        if not 0 <= page < region.num_pages:
            raise LeanImageError(f"page {page} outside region {region.name!r} of {region.num_pages} pages")
        i = int(np.searchsorted(region._starts, page, side="right")) - 1
        extent = region.extents[i]
        cls = int(extent["page_class"])
        slot = int(extent["first_slot"]) + page - int(extent["first_page"]) if cls in (1, 4, 6) else 0
        return cls, slot

    def digests(self, region: Region) -> np.ndarray:
        """The stored digests of a region, (pages with digests, 16) uint8, in page order."""
        if region.region_id not in self._digests:
            parts, covered = [], 0
            for i in self._digest_records.get(region.region_id, []):
                p = self._record_at(i).parsed
                at = int(self.index_entries[i]["record_offset"])
                if p["first_page"] != covered or covered + p["num_pages"] > region.num_pages:
                    raise FormatError(f"expected digests from page {covered}, got {p['first_page']}+"
                                      f"{p['num_pages']}", offset=at, structure=f"record[{i}].digests",
                                      rule="LI-DIG-001")
                expected = self._bearing_count(region, covered, covered + p["num_pages"])
                if p["num_digests"] != expected:
                    raise FormatError(f"pages {covered}..{covered + p['num_pages']} have {expected} pages with "
                                      f"digests, num_digests is {p['num_digests']}", offset=at + 20,
                                      structure=f"record[{i}].digests.num_digests", rule="LI-DIG-003")
                parts.append(p["digests"])
                covered += p["num_pages"]
            self._digests[region.region_id] = np.concatenate(parts) if parts else np.zeros((0, DIGEST_SIZE), np.uint8)
        return self._digests[region.region_id]

    def _bearing_count(self, region: Region, start: int, stop: int) -> int:
        """Pages with stored digests in [start, stop)."""
        return self._rank_at(region, stop) - self._rank_at(region, start)

    def _rank_at(self, region: Region, page: int) -> int:
        if page >= region.num_pages:
            return int(region._rank0[-1] + (region.extents["num_pages"][-1] if region._bearing[-1] else 0))
        i = int(np.searchsorted(region._starts, page, side="right")) - 1
        return int(region._rank0[i]) + (page - int(region._starts[i]) if region._bearing[i] else 0)

    def expected_digest(self, region: Region, page: int) -> bytes | None:
        """The digest page ``page`` must have: stored, implied (ZERO) or None (FREE)."""
        cls, _ = self.page_location(region, page)
        if cls == PageClass.FREE:
            return None
        if cls == PageClass.ZERO:
            return zero_page_digest(self.page_size)
        return self.digests(region)[self._rank_at(region, page)].tobytes()

    def _expected_range(self, region: Region, first_page: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Classes of a range and the digest each page must have (zero rows for FREE)."""
        lo = int(np.searchsorted(region._starts, first_page, side="right")) - 1
        hi = int(np.searchsorted(region._starts, first_page + count - 1, side="right"))
        e = region.extents[lo:hi]
        sizes = e["num_pages"].astype(np.int64)
        skip = first_page - int(region._starts[lo])
        classes = np.repeat(e["page_class"].astype(np.uint8), sizes)[skip:skip + count]
        within = np.arange(count) + skip - np.repeat(np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes)[skip:skip + count]
        ranks = np.repeat(region._rank0[lo:hi], sizes)[skip:skip + count] + within
        bearing = np.repeat(region._bearing[lo:hi], sizes)[skip:skip + count]
        expected = np.zeros((count, DIGEST_SIZE), np.uint8)
        table = self.digests(region)
        expected[bearing] = table[ranks[bearing]]
        expected[classes == PageClass.ZERO] = np.frombuffer(zero_page_digest(self.page_size), np.uint8)
        return classes, expected

    def page_slots(self, region: Region, first_page: int, count: int) -> np.ndarray:
        """Per page of a range, its slot (stored ordinal, disk reference or delta entry index;
        meaningless for classes without slots)."""
        if count <= 0:
            return np.zeros(0, np.int64)
        lo = int(np.searchsorted(region._starts, first_page, side="right")) - 1
        hi = int(np.searchsorted(region._starts, first_page + count - 1, side="right"))
        e = region.extents[lo:hi]
        sizes = e["num_pages"].astype(np.int64)
        skip = first_page - int(region._starts[lo])
        starts = np.repeat(e["first_slot"].astype(np.int64) - e["first_page"].astype(np.int64), sizes)
        return starts[skip:skip + count] + first_page + np.arange(count)

    # -- frames ----------------------------------------------------------------------
    def enable_read_ahead(self, threads: int = 2, depth: int = 4) -> None:
        """Decompress the next frames on worker threads while the caller reads sequentially."""
        from concurrent.futures import ThreadPoolExecutor
        self._pool = ThreadPoolExecutor(max_workers=threads)
        self._depth = depth
        try:            # frames are read in file order: let the kernel read further ahead
            os.posix_fadvise(self._file.fileobj.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError, ValueError):
            pass

    def frame_pages(self, frame: int) -> bytes:
        """Decompressed content of PAGE_FRAME number ``frame`` (cached)."""
        return self._frame(frame)[0]

    def _frame(self, frame: int, with_digests: bool = False) -> tuple[bytes, np.ndarray | None]:
        """(content, page digests or None) of a frame; read-ahead workers compute both."""
        key = ("page", frame)
        if key in self._frame_cache:
            self._frame_cache.move_to_end(key)
            content, digests = self._frame_cache[key]
        else:
            pool = self._pool
            if frame in self._ahead:                 # asked for ahead of time (prefetch_frames)
                content, digests = self._ahead.pop(frame).result()
            elif pool is None:
                content, digests = self._load_frame(frame), None
            else:
                for ahead in range(frame, min(frame + self._depth + 1, len(self._frame_entries))):
                    if ahead not in self._ahead and ("page", ahead) not in self._frame_cache:
                        self._ahead[ahead] = pool.submit(self._load_frame_with_digests, ahead)
                content, digests = self._ahead.pop(frame).result()
        if with_digests and digests is None:
            digests = self._digests_of(content)
        self._cache(key, (content, digests))
        return content, digests

    def prefetch_frames(self, frames, pool, with_digests: bool = False) -> None:
        """Decompress these PAGE_FRAMEs (and digest their pages) on ``pool``'s workers before
        they are asked for."""
        load = self._load_frame_with_digests if with_digests else self._load_frame_only
        for frame in frames:
            if frame not in self._ahead and ("page", frame) not in self._frame_cache:
                self._ahead[frame] = pool.submit(load, frame)

    def _load_frame_only(self, frame: int) -> tuple[bytes, None]:
        return self._load_frame(frame), None

    def _digests_of(self, content: bytes) -> np.ndarray:
        return page_digests(content, self.page_size)

    def _load_frame_with_digests(self, frame: int) -> tuple[bytes, np.ndarray]:
        content = self._load_frame(frame)
        return content, self._digests_of(content)

    def _load_frame(self, frame: int) -> bytes:
        i = int(self._frame_entries[frame])
        record = self._record_at(i)
        expected = record.parsed["num_pages"] * self.page_size
        if record.parsed["first_ordinal"] != self._frame_starts[frame] or \
                record.parsed["num_pages"] != self._frame_counts[frame]:
            raise FormatError("frame header disagrees with its index entry", offset=record.offset,
                              structure=record_path(i, record), rule="LI-IDX-001")
        return decompress_frame(zstandard.ZstdDecompressor(), record.body[16:], expected, record.offset,
                                record_path(i, record, "zstd"))

    def delta_entries(self, slots: np.ndarray) -> list:
        """The delta entries of many slots, each DELTA_FRAME looked up once per run."""
        frames = np.searchsorted(self._delta_starts, slots, side="right") - 1
        out = []
        for frame, slot in zip(frames.tolist(), slots.tolist()):
            if frame < 0:
                raise FormatError(f"delta entry {slot} is in no DELTA_FRAME", structure="delta_frame",
                                  rule="LI-MAP-004", path=self.path)
            content, offsets, first = self._delta_frame(frame)
            k = slot - first
            if not 0 <= k < len(offsets) - 1:
                raise FormatError(f"delta entry {slot} is in no DELTA_FRAME", structure="delta_frame",
                                  rule="LI-MAP-004", path=self.path)
            out.append(content[offsets[k]:offsets[k + 1]])
        return out

    def delta_frame_parsed(self, frame: int):
        """(first_delta, content, offsets, parse_index_lists(...)) of a DELTA_FRAME, cached."""
        key = ("delta-parsed", frame)
        if key not in self._frame_cache:
            from .delta import parse_index_lists
            content, offsets, first = self._delta_frame(frame)
            self._cache(key, (first, content, offsets,
                              parse_index_lists(content, np.array(offsets, np.int64), self.page_size)))
        return self._frame_cache[key]

    def _delta_frame(self, frame: int):
        key = ("delta", frame)
        if key not in self._frame_cache:
            i = int(self._delta_entries[frame])
            record = self._record_at(i)
            p = record.parsed
            content = self._decompress(record, i, record.body[p["ofs_zstd"] - record.offset - 16:],
                                       int(p["entry_offsets"][-1]))
            self._cache(key, (content, p["entry_offsets"].tolist(), p["first_delta"]))
        return self._frame_cache[key]

    def delta_entry(self, slot: int) -> bytes:
        return self.delta_entries(np.array([slot], np.int64))[0]

    def _cache(self, key, value):
        self._frame_cache[key] = value
        while len(self._frame_cache) > FRAME_CACHE_SIZE:
            self._frame_cache.popitem(last=False)
        return value

    def _decompress(self, record: Record, i: int, data, expected: int) -> bytes:
        return decompress_frame(self._decompressor, data, expected, record.offset, record_path(i, record, "zstd"))

    # -- pages -------------------------------------------------------------------------
    def read_page(self, region, page: int) -> bytes:
        """One page, resolved through disks and the parent chain, checked against its digest."""
        region = region if isinstance(region, Region) else self.region(region)
        cls, slot = self.page_location(region, page)
        if cls in (PageClass.ZERO, PageClass.FREE):
            data = bytes(self.page_size)
            if cls == PageClass.FREE:
                return data
        elif cls == PageClass.STORED:
            data = self._stored_page(slot)
        elif cls == PageClass.DISK:
            data = self._disk_page(region, page, slot)
        else:
            data = self._chained_page(region, page)
        self._verify(region, page, data)
        return data

    def _stored_page(self, ordinal: int) -> bytes:
        frame = int(np.searchsorted(self._frame_starts, ordinal, side="right")) - 1
        if frame < 0 or ordinal >= self._frame_starts[frame] + self._frame_counts[frame]:
            raise FormatError(f"stored ordinal {ordinal} is in no PAGE_FRAME", structure="page_map",
                              rule="LI-MAP-004")
        start = (ordinal - int(self._frame_starts[frame])) * self.page_size
        return self.frame_pages(frame)[start:start + self.page_size]

    def _disk_page(self, region: Region, page: int, slot: int) -> bytes:
        out = np.zeros(self.page_size, np.uint8)
        self.fill_disk_pages(region, page, out, np.zeros(1, np.int64), np.array([slot], np.int64))
        return out.tobytes()

    def fill_disk_pages(self, region: Region, first_page: int, out: np.ndarray, rows: np.ndarray,
                        slots: np.ndarray) -> None:
        """Pages ``first_page + rows`` (DISK, references ``slots``) into ``out``, each checked
        against its digest; with sort_blocks every disk's blocks are read in ascending physical
        order, neighbours coalesced, else one read per page in page order."""
        ps = self.page_size
        if int(slots.max()) >= len(self._disk_refs):
            raise FormatError(f"disk reference {int(slots.max())} does not exist", structure="page_map",
                              rule="LI-MAP-004")
        ids, sectors = self._disk_ref_ids[slots], self._disk_refs[slots].astype(np.int64)
        _, expected = self._expected_range(region, first_page, int(rows.max()) + 1)
        for disk_id in np.unique(ids).tolist():
            mine = np.flatnonzero(ids == disk_id)
            source = self._disk_source(region, first_page + int(rows[mine[0]]), disk_id, sectors[mine])
            pages = out.reshape(-1, ps)
            source.read_runs(sectors[mine] * DISK_SECTOR_SIZE, ps, sort=self.sort_blocks, out=pages,
                             rows=rows[mine])
            got = row_digests(pages, rows[mine])
            bad = np.flatnonzero((got != expected[rows[mine]]).any(axis=1))
            if len(bad):
                k, row = int(mine[bad[0]]), int(rows[mine[bad[0]]])
                raise DiskError(f"region {region.name!r} page {first_page + row}: disk {source.name!r} "
                                f"sector {int(sectors[k])} does not hold the page recorded at checkpoint "
                                "(disk changed since?)", rule="LI-DSK-005",
                                structure=f"region[{region.region_id}].page[{first_page + row}]")

    def _disk_source(self, region: Region, page: int, disk_id: int, sectors: np.ndarray):
        """The attached source of ``disk_id``, after checking ``sectors`` lie within the disk."""
        source = self._disk_sources.get(disk_id)
        info = next((d for d in self.disks if d.disk_id == disk_id), None)
        if info is None or int(sectors.max()) * DISK_SECTOR_SIZE + self.page_size > info.size_bytes:
            raise FormatError(f"region {region.name!r} page {page}: reference to disk {disk_id} sector "
                              f"{int(sectors.max())} lies outside the disk table's disks", rule="LI-DSK-003",
                              structure="disk_refs")
        if source is None:
            raise DiskError(f"region {region.name!r} page {page} is on disk {info.name!r}: "
                            f"pass --disk {info.name}=PATH")
        return source

    def _chained_page(self, region: Region, page: int) -> bytes:
        """PARENT/DELTA: walk down to the first link that has the bytes, then apply deltas upward."""
        deltas, image, name = [], self, region.name
        while True:
            r = image.region(name) if image is not self else region
            cls, slot = image.page_location(r, page)
            if cls == PageClass.DELTA:
                deltas.append(image.delta_entry(slot))
            elif cls != PageClass.PARENT:
                base = image.read_page(r, page)
                break
            parent = image.parent
            if parent is None:
                raise ChainError(f"region {name!r} page {page} needs a parent image", rule="LI-MAP-005",
                                 structure=f"region[{r.region_id}].page[{page}]")
            if not any(pr.name == name and page < pr.num_pages for pr in parent.regions):
                raise ChainError(f"parent {parent.path} has no page {page} in a region {name!r}",
                                 rule="LI-CHN-004", structure=f"region[{r.region_id}].page[{page}]")
            image = parent
        for entry in reversed(deltas):
            base = deltacodec.apply(entry, base, structure=f"region {name!r} page {page} delta")
        return base

    def _verify(self, region: Region, page: int, data: bytes) -> None:
        expected = self.expected_digest(region, page)
        if expected is not None and page_digest(data) != expected:
            raise FormatError(f"region {region.name!r} page {page}: content digest {page_digest(data).hex()} "
                              f"differs from recorded {expected.hex()}",
                              structure=f"region[{region.region_id}].page[{page}]", rule="LI-DIG-002")

    @property
    def restore_chunk_pages(self) -> int:
        """Pages per region_bytes call for a sequential restore: larger for chains, whose cost
        per call grows with the number of links a chunk draws on."""
        large = self.parent is not None or len(self._disk_refs)
        return (64 << 20) // self.page_size if large else (4 << 20) // self.page_size

    @property
    def gather_chunk_pages(self) -> int:
        """Pages per region_pieces call for a sequential restore: STORED pages come as views of
        frames (no buffer this size is allocated), and fewer, larger calls cost less per page."""
        return max(self.restore_chunk_pages, (32 << 20) // self.page_size)

    def region_bytes(self, region: Region, first_page: int, count: int) -> memoryview:
        """Pages [first_page, first_page+count) resolved and verified, in one buffer."""
        if self.parent is not None:
            return self._chained_region_bytes(region, first_page, count)
        ps = self.page_size
        out = np.zeros(count * ps, np.uint8)
        got = np.zeros((count, DIGEST_SIZE), np.uint8)
        page, end = first_page, first_page + count
        disk_rows, disk_slots = [], []
        i = int(np.searchsorted(region._starts, page, side="right")) - 1
        while page < end:
            extent = region.extents[i]
            e_first, e_count = int(extent["first_page"]), int(extent["num_pages"])
            stop = min(end, e_first + e_count)
            cls = int(extent["page_class"])
            if cls == PageClass.STORED:
                self._copy_stored(out, got, page - first_page, int(extent["first_slot"]) + page - e_first,
                                  stop - page)
            elif cls == PageClass.DISK:
                disk_rows.append(np.arange(page, stop) - first_page)
                disk_slots.append(int(extent["first_slot"]) + np.arange(page - e_first, stop - e_first))
            elif cls in (PageClass.PARENT, PageClass.DELTA):
                for p in range(page, stop):
                    out[(p - first_page) * ps:(p - first_page + 1) * ps] = np.frombuffer(
                        self.read_page(region, p), np.uint8)
            page = stop
            i += 1
        if disk_rows:
            self.fill_disk_pages(region, first_page, out, np.concatenate(disk_rows), np.concatenate(disk_slots))
        self._verify_stored(region, first_page, out, got)
        return memoryview(out)

    def _chained_region_bytes(self, region: Region, first_page: int, count: int) -> memoryview:
        """Through the chain resolved once per region (chain.py): work per page independent of depth."""
        from .chain import check_built, fill
        out = np.zeros(count * self.page_size, np.uint8)
        fill(self._resolution(region), out, first_page, count)
        classes, expected = self._expected_range(region, first_page, count)
        checked = np.flatnonzero((classes != PageClass.FREE) & (classes != PageClass.ZERO))
        check_built(self, region, first_page, out, checked, expected)
        return memoryview(out)

    def region_pieces(self, region: Region, first_page: int, count: int) -> list[tuple[int, memoryview | None]]:
        """Pages [first_page, first_page+count) in order as verified runs ``(n, data)``: data
        None for ZERO and FREE pages, else n pages of bytes.  In a self-contained image the
        STORED runs are views of the decompressed frames (checked by the frames' digests), so a
        restorer can hand them to the kernel without copying them."""
        if self.parent is not None:
            from .chain import pieces
            return pieces(self, region, self._resolution(region), first_page, count)
        classes, expected = self._expected_range(region, first_page, count)
        blank = (classes == PageClass.ZERO) | (classes == PageClass.FREE)
        if blank.all():
            return [(count, None)]
        slots = self.page_slots(region, first_page, count)
        if (~blank & (classes != PageClass.STORED)).any() or self._frames_touched(slots[~blank]) > _held_frames_max():
            return self._split_pieces(self.region_bytes(region, first_page, count), blank)
        starts = np.ones(count, bool)
        starts[1:] = (blank[1:] != blank[:-1]) | (~blank[1:] & (slots[1:] != slots[:-1] + 1))
        bounds = [*np.flatnonzero(starts).tolist(), count]
        pieces = []
        for lo, hi in zip(bounds, bounds[1:]):
            if blank[lo]:
                pieces.append((hi - lo, None))
                continue
            row = lo
            for data, digests, start, n in self._stored_spans(int(slots[lo]), hi - lo):
                bad = np.flatnonzero((digests[start:start + n] != expected[row:row + n]).any(axis=1))
                view = memoryview(data)[start * self.page_size:(start + n) * self.page_size]
                if len(bad):
                    k = int(bad[0])
                    self._verify(region, first_page + row + k,
                                 bytes(view[k * self.page_size:(k + 1) * self.page_size]))
                pieces.append((n, view))
                row += n
        return pieces

    def _frames_touched(self, ordinals: np.ndarray) -> int:
        return len(np.unique(np.searchsorted(self._frame_starts, ordinals, side="right")))

    def _split_pieces(self, data: memoryview, blank: np.ndarray) -> list[tuple[int, memoryview | None]]:
        edges = np.flatnonzero(blank[1:] != blank[:-1]) + 1
        bounds = [0, *edges.tolist(), len(blank)]
        ps = self.page_size
        return [(hi - lo, None if blank[lo] else data[lo * ps:hi * ps]) for lo, hi in zip(bounds, bounds[1:])]

    def _stored_spans(self, ordinal: int, count: int, with_digests: bool = True):
        """(frame content, its page digests or None, first page in it, pages) covering
        STORED ordinals [ordinal, ordinal+count)."""
        while count:
            frame = int(np.searchsorted(self._frame_starts, ordinal, side="right")) - 1
            if frame < 0 or ordinal >= self._frame_starts[frame] + self._frame_counts[frame]:
                raise FormatError(f"stored ordinal {ordinal} is in no PAGE_FRAME", rule="LI-MAP-004",
                                  structure="page_map")
            start = ordinal - int(self._frame_starts[frame])
            n = min(count, int(self._frame_counts[frame]) - start)
            data, digests = self._frame(frame, with_digests=with_digests)
            yield data, digests, start, n
            ordinal, count = ordinal + n, count - n

    def _resolution(self, region: Region):
        """The chain folded once for ``region`` (chain.resolve), cached."""
        from .chain import resolve
        if region.region_id not in self._resolutions:
            self._resolutions[region.region_id] = resolve(self, region)
        return self._resolutions[region.region_id]

    def _copy_stored(self, out: np.ndarray, got: np.ndarray | None, row: int, ordinal: int, count: int) -> None:
        """Copy STORED pages into ``out`` from row ``row``; with ``got``, their digests too."""
        ps = self.page_size
        for data, digests, start, n in self._stored_spans(ordinal, count, with_digests=got is not None):
            out[row * ps:(row + n) * ps] = np.frombuffer(data, np.uint8, n * ps, start * ps)
            if got is not None:
                got[row:row + n] = digests[start:start + n]
            row += n

    def _verify_stored(self, region: Region, first_page: int, out: np.ndarray, got: np.ndarray) -> None:
        """Check STORED pages against their digests in one comparison; read_page checked DISK,
        PARENT and DELTA pages already, and ZERO/FREE pages are zeros written here."""
        classes, expected = self._expected_range(region, first_page, len(got))
        stored = classes == PageClass.STORED
        bad = np.flatnonzero(stored & (got != expected).any(axis=1))
        if len(bad):
            k = int(bad[0])
            self._verify(region, first_page + k, out[k * self.page_size:(k + 1) * self.page_size].tobytes())

    def classes(self, region: Region, first_page: int = 0, count: int | None = None) -> np.ndarray:
        """Per-page class of a range of a region (uint8 array), from the extents it overlaps."""
        count = region.num_pages - first_page if count is None else count
        if count <= 0:
            return np.zeros(0, np.uint8)
        lo = int(np.searchsorted(region._starts, first_page, side="right")) - 1
        hi = int(np.searchsorted(region._starts, first_page + count - 1, side="right"))
        e = region.extents[lo:hi]
        full = np.repeat(e["page_class"].astype(np.uint8), e["num_pages"].astype(np.int64))
        skip = first_page - int(region._starts[lo])
        return full[skip:skip + count]


def _held_frames_max() -> int:
    """Frames one region_pieces call may hand out views of (chain.DIRECT_FRAMES_MAX); a range
    whose pages lie in more is copied into one buffer instead, so memory stays bounded."""
    from . import chain
    return chain.DIRECT_FRAMES_MAX


def decompress_frame(decompressor, data, expected: int, offset: int, structure: str) -> bytes:
    """One zstd frame of exactly ``expected`` bytes; never allocates beyond that."""
    if expected > FRAME_PAGES_MAX_BYTES:
        raise FormatError(f"frame declares {expected} bytes, limit {FRAME_PAGES_MAX_BYTES}",
                          offset=offset, structure=structure, rule="LI-FRM-004")
    try:
        return decompress_exact(data, expected=expected, limit=FRAME_PAGES_MAX_BYTES, decompressor=decompressor)
    except FrameError as exc:
        rule = "LI-FRM-003" if exc.kind == SIZE else "LI-FRM-002"
        raise FormatError(exc.message, offset=offset, structure=structure, rule=rule) from None


def _check_numbering(starts: np.ndarray, counts: np.ndarray, name: str, rule: str) -> None:
    expected = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts
    bad = np.flatnonzero(starts != expected)
    if len(bad):
        k = int(bad[0])
        raise FormatError(f"{name} {k}: expected first {int(expected[k])}, got {int(starts[k])}",
                          structure=f"index.{name}[{k}]", rule=rule)


def _check_coverage(region: Region) -> None:
    e = region.extents
    if len(e) == 0:
        raise FormatError(f"region {region.name!r} has no page map", structure=f"region[{region.region_id}]",
                          rule="LI-MAP-001")
    first = e["first_page"].astype(np.int64)
    ends = first + e["num_pages"].astype(np.int64)
    gaps = np.flatnonzero(first[1:] != ends[:-1])
    if first[0] != 0 or len(gaps) or ends[-1] != region.num_pages:
        at = int(gaps[0]) + 1 if len(gaps) else 0
        raise FormatError(f"region {region.name!r}: extents must cover pages 0..{region.num_pages} "
                          f"contiguously; extent {at} starts at {int(first[at]) if len(first) > at else '?'}, "
                          f"last ends at {int(ends[-1])}", structure=f"region[{region.region_id}].page_map",
                          rule="LI-MAP-001")


def _uuid(raw: bytes) -> str:
    import uuid
    return str(uuid.UUID(bytes=bytes(raw)))


SIBLINGS_MAX = 100_000


def _find_candidate(uuid: bytes, candidates, index: dict):
    """The candidate (LeanImage or path) whose image_uuid is ``uuid``; ``index`` caches reads."""
    for candidate in candidates:
        if isinstance(candidate, LeanImage):
            if candidate.header.image_uuid == uuid:
                return candidate
            continue
        key = os.path.abspath(os.fspath(candidate))
        if key not in index:
            index[key] = _image_uuid(key)
    for key, found in index.items():
        if found == uuid and isinstance(key, str):
            return key
    return None


def _siblings(path: str, index: dict) -> list[str]:
    """The *.lean files beside ``path`` (where the links of a chain usually live), listed once."""
    directory = os.path.dirname(os.path.abspath(path))
    marker = ("scanned", directory)
    if marker in index:
        return []
    index[marker] = True
    try:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".lean"))[:SIBLINGS_MAX]
    except OSError:
        return []
    return [os.path.join(directory, n) for n in names]


def _image_uuid(path) -> bytes | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(56)
    except OSError:
        return None        # unreadable candidates simply do not match
    return raw[40:56] if len(raw) == 56 else None


def dump_structure(path) -> dict:
    """Every structure of an image, fields named as in the spec and the .ksy."""
    with open(path, "rb") as fileobj:
        image = ImageFile(fileobj, os.fspath(path))
        header = read_header(image)
        footer = read_footer(image, header.header_length)
        records, offset, i = [], header.header_length, 0
        while offset < footer.offset:
            record = read_record(image, offset, footer.offset, i)
            body = parse_body(record, i)
            records.append(dict(offset=record.offset, record_type=record.record_type, flags=record.flags,
                                body_length=record.body_length, record_checksum=record.record_checksum,
                                body=raw_body_dict(record) if body is not None else {}))
            offset, i = record.end, i + 1
    header_dict = {k: v for k, v in vars(header).items() if k not in ("raw", "reserved")}
    footer_dict = {k: v for k, v in vars(footer).items() if k != "offset"}
    return dict(header=header_dict, records=records, footer=footer_dict)
