"""What opening an image reads and checks (spec §5-§8, §8.4): the INDEX, then the small records
it points at (regions, disks, source states, page maps, disk references) and the numbering of
the frames. Every cross-record rule that needs no page content is checked here, by the same
functions (checks.py) ``leanimg validate`` uses; the first finding is raised.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Literal, overload

import numpy as np

from . import checks
from .checks import first_problem
from .errors import FormatError, LeanImageError
from .format import (
    FRAME_PAGES_MAX_BYTES,
    RECORD,
    digest_class_table,
    RECORD_OPTIONAL_BIT,
    REGION_FLAG_HAS_GPA,
    SOURCE_STATE_BODY,
    PageClass,
    RecordType,
)
from .structures import (
    Footer,
    Header,
    ImageFile,
    Record,
    body_problems,
    frame_size_problems,
    index_location_problems,
    parse_body,
    read_record,
)


@dataclass
class Region:
    region_id: int
    name: str
    size_bytes: int
    guest_phys_base: int | None
    page_size: int
    # set by set_extents (or ImageTables.adopt_region) before the region is used
    extents: np.ndarray = field(init=False, repr=False)
    starts: np.ndarray = field(init=False, repr=False)  # per extent: its first page
    digest_bearing: np.ndarray = field(init=False, repr=False)  # per extent: digests stored
    digest_rank0: np.ndarray = field(init=False, repr=False)  # per extent: digests before it

    @property
    def num_pages(self) -> int:
        return self.size_bytes // self.page_size

    def set_extents(self, extents: np.ndarray, bearing_classes: np.ndarray) -> None:
        """``bearing_classes``: the image's digest-bearing classes (format.digest_class_table)."""
        self.extents = extents
        self.starts = extents["first_page"].astype(np.int64)
        self.digest_bearing, self.digest_rank0 = checks.digest_ranks(extents, bearing_classes)

    @cached_property
    def blank_ends(self) -> np.ndarray:
        """Per extent: where the run of ZERO and FREE extents it lies in ends (its own first
        page when it is of another class); for a restore to step over blank runs whole."""
        classes = self.extents["page_class"]
        bounds = np.append(self.starts, self.num_pages)
        others = np.flatnonzero((classes != PageClass.ZERO) & (classes != PageClass.FREE))
        after = np.searchsorted(others, np.arange(len(classes)))  # the next extent of another class
        return bounds[np.append(others, len(classes))[after]]

    def extent_span(self, first_page: int, count: int) -> tuple[int, int]:
        """Indexes [lo, hi) of the extents that pages [first_page, first_page+count) lie in."""
        lo = int(np.searchsorted(self.starts, first_page, side="right")) - 1
        hi = int(np.searchsorted(self.starts, first_page + count - 1, side="right"))
        return lo, hi


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
    offset: int | None = None  # file offset of ``data``, for errors about its content


class FrameTable:
    """The PAGE_FRAMEs (or DELTA_FRAMEs) of an image as the INDEX lists them: frame k holds
    ordinals (entries) starts[k] .. starts[k] + counts[k] and is index entry positions[k]."""

    def __init__(self, starts: np.ndarray, counts: np.ndarray, positions: np.ndarray):
        self.starts, self.counts, self.positions = starts, counts, positions

    @classmethod
    def of(cls, entries: np.ndarray, record_type: int, types: np.ndarray | None = None) -> "FrameTable":
        """``types``: entries["record_type"], if the caller has it."""
        positions = np.flatnonzero((entries["record_type"] if types is None else types) == record_type)
        listed = entries[positions]
        return cls(listed["first"].astype(np.int64), listed["count"].astype(np.int64), positions)

    def __len__(self) -> int:
        return len(self.starts)

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def frame_at(self, slot: int) -> int:
        """The frame holding ordinal (entry) ``slot``, one the page maps use (checked on open)."""
        return int(np.searchsorted(self.starts, slot, side="right")) - 1

    def frame_of(self, slots) -> np.ndarray:
        """The frame holding each of ``slots``, ordinals (entries) the page maps use: every one
        lies in a frame (LI-MAP-004, checked on open)."""
        return np.searchsorted(self.starts, slots, side="right") - 1


class DiskRefs:
    """The disk references of an image: reference k is sector sectors[k] of disk disk_ids[k]."""

    def __init__(self, disk_ids: np.ndarray, sectors: np.ndarray):
        self.disk_ids, self.sectors = disk_ids, sectors

    def __len__(self) -> int:
        return len(self.sectors)


_PAGE_FRAME, _DELTA_FRAME = int(RecordType.PAGE_FRAME), int(RecordType.DELTA_FRAME)  # plain ints: faster
SMALL_RECORDS = [RecordType.REGION, RecordType.DISK, RecordType.SOURCE_STATE, RecordType.PAGE_MAP, RecordType.DISK_REFS]
SMALL_RECORD_TYPES = frozenset(int(t) for t in SMALL_RECORDS)


_NO_DISK_IDS, _NO_SECTORS = np.zeros(0, np.uint32), np.zeros(0, np.uint64)  # empty: shared


class ImageTables:
    """The tables of one image, read and checked when it is opened."""

    def __init__(
        self,
        file: ImageFile,
        header: Header,
        footer: Footer,
        index: Record,
        load: bool = True,
        frames: tuple[FrameTable, FrameTable] | None = None,
    ):
        """``load=False``: the INDEX only; ``load`` (or tables_batch.load_tables, for many
        images at once) must follow before anything else is used. ``frames``: the PAGE_FRAME
        and DELTA_FRAME tables FrameTable.of gives, if the caller has them (links_batch)."""
        self.file, self.header, self.footer, self.index = file, header, footer, index
        self.page_size = header.page_size
        self.entries = index.fields["entries"]
        self.regions: list[Region] = []
        self.disks: list[DiskInfo] = []
        self.source_states: list[SourceState] = []
        if frames is None:
            types = self.entries["record_type"]
            frames = FrameTable.of(self.entries, _PAGE_FRAME, types), FrameTable.of(self.entries, _DELTA_FRAME, types)
        self.page_frames, self.delta_frames = frames
        self.disk_refs = DiskRefs(_NO_DISK_IDS, _NO_SECTORS)
        self.digest_positions: dict[int, list[int]] = {}
        self.kept_listed: dict[int, bytes] = {}  # entry position -> its listed bytes (keep_listed)
        if load:
            self.load()

    @classmethod
    def read(cls, file: ImageFile, header: Header, footer: Footer, load: bool = True) -> "ImageTables":
        index = read_record(file, footer.index_offset, footer.offset)
        first_problem(index_location_problems(footer, header.header_length, index=index))
        parse_body(index)
        return cls(file, header, footer, index, load)

    def listed_end(self, position: int) -> int:
        """Where the record after entry ``position`` starts (the INDEX, after the last)."""
        offsets = self.entries["record_offset"]
        return int(offsets[position + 1]) if position + 1 < len(offsets) else self.index.offset

    @overload
    def listed_bytes(self, position: int, most: int, view: Literal[False] = False) -> bytes | None: ...

    @overload
    def listed_bytes(self, position: int, most: int, view: bool) -> bytes | memoryview | None: ...

    def listed_bytes(self, position: int, most: int, view: bool = False) -> bytes | memoryview | None:
        """The bytes of entry ``position``'s record up to the next record, for a quick path
        that tests its rules in their plain case; None when they are more than ``most`` or
        cannot be read (the checked path, ``record``, then reads no more than the limit and
        raises its finding). ``view``: as ImageFile.read_exact's."""
        kept = self.kept_listed.get(position)
        if kept is not None:
            return None if len(kept) > most else memoryview(kept) if view else kept
        offset = int(self.entries["record_offset"][position])
        length = self.listed_end(position) - offset
        if length > most:
            return None
        try:
            return self.file.read_exact(offset, length, lambda: f"record[{position}]", view)
        except LeanImageError:
            return None

    def keep_listed(self, positions: list[int], most: int) -> None:
        """While the file is held whole, copy the listed bytes of entries ``positions`` (those
        of ``most`` bytes at most) for listed_bytes to give later without reading the file."""
        if self.file.holds_whole:
            for position in positions:
                raw = self.listed_bytes(position, most)
                if raw is not None:
                    self.kept_listed[position] = raw

    def record(self, position: int) -> Record:
        """The record of index entry ``position``, checked against its entry and parsed."""
        offset = int(self.entries["record_offset"][position])
        record = read_record(self.file, offset, self.listed_end(position), position)
        parse_body(record, position)
        listed = [(checks.index_entry_of(record, self.page_size), record.end)]
        first_problem(checks.index_problems(self.index, self.entries, listed, first_entry=position))
        first_problem(body_problems(record, position, self.page_size))
        return record

    # -- loading -----------------------------------------------------------------
    def adopt_region(
        self,
        region: Region,
        extents: np.ndarray,
        digest_bearing: np.ndarray,
        digest_rank0: np.ndarray,
        digest_positions: list[int],
    ) -> None:
        """The one region of an image whose tables tables_batch checked: the state ``load``
        would have left."""
        region.extents, region.starts = extents, extents["first_page"].astype(np.int64)
        region.digest_bearing, region.digest_rank0 = digest_bearing, digest_rank0
        self.regions.append(region)
        self.digest_positions[region.region_id] = digest_positions

    def load(self) -> None:
        """Read the small records and check every rule opening checks; raise the first finding."""
        entries = self.entries
        first_problem(checks.index_problems(self.index, entries, [], header_length=self.header.header_length))
        types = entries["record_type"].tolist()
        unknown = [i for i, t in enumerate(types) if not _known_or_optional(t)]
        if unknown:  # refused without reading it (spec §4.2)
            self.record(unknown[0])
        small = [self.record(i) for i, t in enumerate(types) if t in SMALL_RECORD_TYPES]
        by_type = {kind: [r for r in small if r.record_type == kind] for kind in SMALL_RECORDS}
        first_problem(checks.region_table_problems(by_type[RecordType.REGION]))
        first_problem(checks.disk_table_problems(by_type[RecordType.DISK]))
        first_problem(checks.reference_order_problems(self._references(small)))
        self._load_regions(by_type[RecordType.REGION], by_type[RecordType.PAGE_MAP])
        self._load_disks(by_type[RecordType.DISK], by_type[RecordType.DISK_REFS])
        self._load_source_states(by_type[RecordType.SOURCE_STATE])
        self._check_frames(by_type[RecordType.DISK_REFS])
        first_problem(checks.feature_problems(self.header, checks.class_counts([r.extents for r in self.regions])))

    def _references(self, small: list[Record]):
        """The order rule's items, in file order: loaded records, and DIGESTS by their entry."""
        items = [(r.record_type, r.index, r.offset, checks.record_references(r)[1]) for r in small]
        for i in np.flatnonzero(self.entries["record_type"] == RecordType.DIGESTS).tolist():
            items.append((RecordType.DIGESTS, i, int(self.entries["record_offset"][i]), (int(self.entries["key"][i]),)))
        return sorted(items, key=lambda item: item[1])

    def _load_regions(self, records: list[Record], maps: list[Record]) -> None:
        for record in records:
            p = record.fields
            gpa = p["guest_phys_base"] if p["flags"] & REGION_FLAG_HAS_GPA else None
            self.regions.append(Region(p["region_id"], p["name"], p["size_bytes"], gpa, self.page_size))
        digests = np.flatnonzero(self.entries["record_type"] == RecordType.DIGESTS)
        for region in self.regions:
            parts = [m.fields["extents"] for m in maps if m.fields["region_id"] == region.region_id]
            extents = (
                np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, [("first_page", "<u8")])
            )
            first_problem(checks.coverage_problems(region.region_id, region.name, region.num_pages, extents))
            region.set_extents(extents, digest_class_table(self.header.incompatible_features))
            positions = digests[self.entries["key"][digests] == region.region_id].tolist()
            self.digest_positions[region.region_id] = positions
            ranges = [
                (
                    int(self.entries["first"][i]),
                    int(self.entries["count"][i]),
                    None,
                    int(self.entries["record_offset"][i]),
                )
                for i in positions
            ]
            first_problem(checks.digest_coverage_problems(region.region_id, region.name, region.num_pages, ranges))

    def _load_disks(self, records: list[Record], refs: list[Record]) -> None:
        for record in records:
            p = record.fields
            self.disks.append(DiskInfo(p["disk_id"], p["name"], p["size_bytes"], p["fingerprint"]))
        sizes = {d.disk_id: d.size_bytes for d in self.disks}
        for record in refs:
            first_problem(
                checks.disk_ref_problems(sizes, record.fields["refs"], self.page_size, record.offset, record.path())
            )
        if refs:
            self.disk_refs = DiskRefs(
                np.concatenate([r.fields["refs"]["disk_id"] for r in refs]),
                np.concatenate([r.fields["refs"]["sector"] for r in refs]),
            )

    def _load_source_states(self, records: list[Record]) -> None:
        first_problem(checks.source_sequence_problems([(r.fields["sequence"], r) for r in records]))
        for record in records:
            p = record.fields
            self.source_states.append(
                SourceState(
                    p["source_format"],
                    p["tag"],
                    p["sequence"],
                    bytes(p["data"]),
                    record.body_offset + SOURCE_STATE_BODY.size,
                )
            )

    def _check_frames(self, refs: list[Record]) -> None:
        offsets = self.entries["record_offset"].astype(np.int64)
        frames = self.page_frames
        for k in np.flatnonzero((frames.counts == 0) | (frames.counts * self.page_size > FRAME_PAGES_MAX_BYTES))[:1]:
            position = int(frames.positions[k])  # the index says so; the record is read only when used
            first_problem(
                frame_size_problems(
                    RecordType.PAGE_FRAME,
                    int(frames.counts[k]),
                    self.page_size,
                    int(offsets[position]) + RECORD.size,
                    f"record[{position}].page_frame",
                )
            )
        for name, table in (("page_frame", self.page_frames), ("delta_frame", self.delta_frames)):
            first_problem(checks.numbering_problems(name, table.starts, table.counts, offsets[table.positions]))
        first_problem(
            checks.slot_problems(
                [r.extents for r in self.regions],
                self.page_frames.total,
                self.delta_frames.total,
                [r.fields["first_ref"] for r in refs],
                [r.fields["num_refs"] for r in refs],
                [r.offset for r in refs],
            )
        )

    def frame_record(self, table: FrameTable, frame: int) -> Record:
        """The PAGE_FRAME or DELTA_FRAME record of frame ``frame`` of ``table``."""
        if not 0 <= frame < len(table):
            raise FormatError(f"no frame {frame}", structure="index")
        return self.record(int(table.positions[frame]))

    def digest_records(self, region: Region) -> list[Record]:
        return [self.record(i) for i in self.digest_positions.get(region.region_id, [])]


def _known_or_optional(record_type: int) -> bool:
    return record_type in RecordType._value2member_map_ or bool(record_type & RECORD_OPTIONAL_BIT)
