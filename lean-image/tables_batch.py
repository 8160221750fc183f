"""Loading the tables of many images at once (the links of a deep chain), with the rules
ImageTables.load checks run as one vectorised pass over all of them, not once per link.

Only images of the common shape take this path: one REGION, one PAGE_MAP, and DIGESTS,
PAGE_FRAME and DELTA_FRAME records (a chain's links as the writer makes them). The rules of
their PAGE_MAP records (framing, checksum, body rules, INDEX entry) are tested for all of
them together; their REGION records are checked one by one (tables.record), once for each
distinct REGION (a chain's links repeat the same bytes at the same place); then every rule
that spans records is *tested* for all of them together: INDEX order, which record refers to
which, page-map coverage, frame numbering and sizes, slot use, digest coverage, feature bits.
An image of another shape, or one for which any test fails (or could fail: the batch accepts
only the plain case of each rule, e.g. slots used in extent order), is loaded by
ImageTables.load, which checks it alone and raises its first finding. Images are finished in
order, so the first image with a finding raises it, with the rule id, offset and structure
opening it alone gives.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import checks
from .arrays import joined
from .errors import LeanImageError
from .format import (
    EXTENT,
    FRAME_PAGES_MAX_BYTES,
    HAS_DIGEST,
    HAS_OWN_DIGEST,
    HAS_SLOT,
    IS_PAGE_CLASS,
    PAGE_MAP_BODY,
    RECORD,
    RECORD_BODY_MAX,
    RECORD_TRAILER,
    REGION_BODY,
    REGION_FLAG_HAS_GPA,
    REGION_NAME_MAX,
    IncompatFeature,
    PageClass,
    RecordType,
    inherits_digests,
    record_size,
    span_checksums,
)
from .fast_paths import CROSS_CHECK, disagree, fast_path
from .tables import ImageTables, Region

from .native import backend as _native  # the page maps' rules in one pass (None: numpy)

if sys.byteorder != "little":  # it reads extents as a little-endian host
    _native = None

# without leanimg._native the batch's work per extent is ~3x that of ImageTables.load, its work
# per link ~1/3: it pays for links of up to ~2000 extents (a deep chain's small links); with it,
# its work per extent is no more than load's. The bound keeps a batch's extents, laid end to end
# with their temporaries, to ~100 MB (CHECK_BATCH links of 1.5 MiB of extents at most)
BATCH_EXTENTS_MAX = 2048 if _native is None else 1 << 16
SHAPE_TYPES = frozenset(
    int(t)
    for t in (RecordType.REGION, RecordType.PAGE_MAP, RecordType.DIGESTS, RecordType.PAGE_FRAME, RecordType.DELTA_FRAME)
)


class _Shape(NamedTuple):
    """The INDEX positions of the one REGION and the one PAGE_MAP of an image of the common shape."""

    region_at: int
    map_at: int


@dataclass
class _Prepared:
    """One image of the common shape as the batch's passes learn it: its region and page map
    (_prepare), then per extent whether it bears digests and the digests before it
    (_extents_hold), then the INDEX positions of its DIGESTS (_digests_cover)."""

    region: Region
    extents: np.ndarray
    shape: _Shape
    bearing: np.ndarray | None = None
    rank0: np.ndarray | None = None
    digests_at: list[int] | None = None


@fast_path(
    "ImageTables.load()",
    tests=(
        "LI-IDX-001",  # entries ascend; the PAGE_MAP's entry matches it
        *("LI-REC-002", "LI-REC-003", "LI-REC-004", "LI-REC-005", "LI-REC-006", "LI-REC-007", "LI-REC-008"),
        "LI-REC-009",  # the REGION precedes its PAGE_MAP and DIGESTS
        *("LI-MAP-001", "LI-MAP-002", "LI-MAP-003", "LI-MAP-004", "LI-MAP-005", "LI-HDR-009"),
        "LI-FRM-001",
        "LI-DIG-001",
    ),
    # the REGION record is read and checked by ImageTables.record and region_table_problems
    calls=(
        "LI-IDX-001",
        *("LI-REC-002", "LI-REC-003", "LI-REC-004", "LI-REC-005", "LI-REC-006", "LI-REC-007", "LI-REC-008"),
        *("LI-REG-001", "LI-REG-002", "LI-REG-003"),
    ),
    by_shape=("LI-DSK-001", "LI-SRC-001"),  # no DISK, no SOURCE_STATE record
)
def load_tables(all_tables: list[ImageTables], on_error=None) -> None:
    """``load`` each of ``all_tables`` (read with load=False), in order; those of the common
    shape whose rules hold are checked together. Raises the first finding, in order, after
    ``on_error(finding, tables)`` (a caller naming the file)."""
    prepared = _prepare_all(all_tables)
    batch = [t for t, p in zip(all_tables, prepared) if p is not None]
    states = [p for p in prepared if p is not None]
    passed = _rules_hold(batch, states)
    adopted = {id(t): p for t, p, ok in zip(batch, states, passed) if ok}
    for t in all_tables:
        p = adopted.get(id(t))
        if p is None:
            try:
                t.load()
            except LeanImageError as exc:
                if on_error is not None:
                    on_error(exc, t)
                raise
        else:
            assert p.bearing is not None and p.rank0 is not None and p.digests_at is not None
            t.adopt_region(p.region, p.extents, p.bearing, p.rank0, p.digests_at)
            if CROSS_CHECK:
                _cross_check(t)


def _cross_check(adopted: ImageTables) -> None:
    """LEANIMG_CROSS_CHECK=1: ImageTables.load of the same image accepts it and leaves the
    state the batch adopted."""
    t = adopted
    alone = ImageTables(t.file, t.header, t.footer, t.index, load=False, frames=(t.page_frames, t.delta_frames))
    try:
        alone.load()
    except LeanImageError as exc:
        raise disagree(t.file.name, "tables_batch.load_tables", f"load refuses it: {exc}") from exc
    mine, theirs = t.regions[0], alone.regions
    if len(theirs) != 1 or alone.disks or alone.source_states:
        raise disagree(t.file.name, "tables_batch.load_tables", "load finds more than one region")
    for name in ("region_id", "name", "size_bytes", "guest_phys_base"):
        if getattr(mine, name) != getattr(theirs[0], name):
            raise disagree(t.file.name, "tables_batch.load_tables", f"the region's {name} differs")
    for name in ("extents", "starts", "digest_bearing", "digest_rank0"):
        if not np.array_equal(getattr(mine, name), getattr(theirs[0], name)):
            raise disagree(t.file.name, "tables_batch.load_tables", f"the region's {name} differs")
    if alone.digest_positions != t.digest_positions:
        raise disagree(t.file.name, "tables_batch.load_tables", "the DIGESTS positions differ")


def _prepare_all(all_tables: list[ImageTables]) -> list:
    """_prepare for each image: its PAGE_MAP's record rules are tested for all together
    (_page_maps_pass), and a REGION record whose bytes, place and INDEX entry are those of
    one checked before in the batch (a chain's links repeat the same REGION) is not checked
    again: the rules are functions of exactly these."""
    shapes = [_shape(t) for t in all_tables]
    maps = _page_maps_pass(
        [t for t, shape in zip(all_tables, shapes) if shape is not None],
        [shape[1] for shape in shapes if shape is not None],
    )
    regions: dict = {}
    prepared = []
    for t, shape in zip(all_tables, shapes):
        prepared.append(None if shape is None else _prepare(t, shape, maps.pop(0), regions))
    return prepared


def _shape(t: ImageTables) -> _Shape | None:
    """Where the REGION and PAGE_MAP of an image of the common shape are, else None."""
    types = t.entries["record_type"].tolist()
    if not set(types) <= SHAPE_TYPES or types.count(RecordType.REGION) != 1 or types.count(RecordType.PAGE_MAP) != 1:
        return None
    map_at = types.index(RecordType.PAGE_MAP)
    if t.listed_end(map_at) - int(t.entries["record_offset"][map_at]) > BATCH_EXTENTS_MAX * EXTENT.size:
        return None  # a link with many extents costs less checked alone
    return _Shape(types.index(RecordType.REGION), map_at)


def _prepare(t: ImageTables, shape: _Shape, extents, regions: dict) -> _Prepared | None:
    """The region and page map of an image of the common shape, its REGION read and checked
    alone (or known from ``regions``: key -> its parsed fields), its PAGE_MAP's ``extents``
    (None: read and checked alone); None on a finding: load reports it."""
    region_at, map_at = shape
    try:
        key = _record_key(t, region_at)
        fields = regions.get(key) if key is not None else None
        if fields is None:
            region_record = t.record(region_at)
            checks.first_problem(checks.region_table_problems([region_record]))
            fields = region_record.fields
            if key is not None:
                regions[key] = fields
        if extents is None:
            extents = t.record(map_at).fields["extents"]
    except LeanImageError:
        return None
    if int(t.entries["key"][map_at]) != fields["region_id"]:  # the PAGE_MAP's region_id (its entry holds it)
        return None
    gpa = fields["guest_phys_base"] if fields["flags"] & REGION_FLAG_HAS_GPA else None
    region = Region(fields["region_id"], fields["name"], fields["size_bytes"], gpa, t.page_size)
    return _Prepared(region, extents, shape)


def _record_key(t: ImageTables, position: int) -> tuple | None:
    """Everything the rules of one small record depend on: its bytes up to the next record,
    its place and INDEX entry, the page size (None: more than a REGION record can hold, or
    unreadable; the caller then reads it with ImageTables.record, which raises the finding)."""
    raw = t.listed_bytes(position, REGION_RECORD_MAX)
    if raw is None:
        return None
    return raw, position, t.listed_end(position), t.page_size, t.entries[position].tobytes()


REGION_RECORD_MAX = record_size(REGION_BODY.size + REGION_NAME_MAX)
_MAP_HEAD = np.dtype(
    [("record_type", "<u4"), ("flags", "<u4"), ("body_length", "<u8"), ("region_id", "<u4"), ("num_extents", "<u4")]
)


def _page_maps_pass(all_tables: list[ImageTables], positions: list[int]) -> list:
    """Per image: the extents of its PAGE_MAP (entry ``positions[k]``) if every rule
    tables.record checks holds for the record (framing, checksum, flags, padding: LI-REC-002..
    005; body length LI-REC-007; reserved fields LI-REC-008; LI-MAP-002/003; its INDEX entry
    LI-IDX-001), in its plain case; else None (the record is read and checked alone)."""
    kept, raws = [], []  # the images whose PAGE_MAP could be of the plain case, its bytes
    shortest = RECORD.size + PAGE_MAP_BODY.size + EXTENT.size + RECORD_TRAILER.size
    for k, (t, position) in enumerate(zip(all_tables, positions)):
        raw = t.listed_bytes(position, record_size(RECORD_BODY_MAX), view=True)  # the extents are copied below
        if raw is not None and len(raw) >= shortest:
            kept.append(k)
            raws.append(raw)
    result: list[np.ndarray | None] = [None] * len(all_tables)
    if not kept:
        return result
    head = np.frombuffer(b"".join(raw[: _MAP_HEAD.itemsize] for raw in raws), _MAP_HEAD)
    sizes = np.array([len(raw) for raw in raws], np.int64)
    body = head["body_length"].astype(np.int64)
    num = head["num_extents"].astype(np.int64)
    ok = (
        (head["record_type"] == RecordType.PAGE_MAP)
        & (head["flags"] == 0)
        & (num >= 1)
        & (body == PAGE_MAP_BODY.size + EXTENT.size * num)
        & (sizes == RECORD.size + body + RECORD_TRAILER.size)
    )
    trailers = np.frombuffer(b"".join(raw[-RECORD_TRAILER.size :] for raw in raws), "<u8")
    ok &= trailers == span_checksums(raws, np.zeros(len(kept), np.int64), sizes - RECORD_TRAILER.size)
    num = np.where(ok, num, 0)
    start = RECORD.size + PAGE_MAP_BODY.size
    first = np.cumsum(num) - num
    e = (
        joined([np.frombuffer(raw, EXTENT.dtype, int(n), start) for raw, n in zip(raws, num.tolist())])
        if num.any()
        else np.zeros(0, EXTENT.dtype)
    )
    e.flags.writeable = False  # the links' page maps, as read from their files
    extents = [e[lo : lo + n] for lo, n in zip(first.tolist(), num.tolist())]  # views: the files' bytes can go
    extents_ok, pages, firsts = (_extents_alone_numpy if _native is None else _extents_alone_native)(e, num)
    entries = joined([all_tables[k].entries[positions[k] : positions[k] + 1] for k in kept])
    ok &= (
        extents_ok
        & (entries["record_type"] == RecordType.PAGE_MAP)
        & (entries["key"] == head["region_id"])
        & (entries["first"] == firsts)
        & (entries["count"] == pages)
    )
    for j, k in enumerate(kept):
        if ok[j]:
            result[k] = extents[j]
    return result


def _extents_alone_native(e: np.ndarray, num: np.ndarray) -> tuple:
    """Per link (``num[k]`` of the extents ``e``, laid end to end): whether each of its
    extents holds alone (reserved zero, a page class, a page at least, first_slot zero for a
    class without slots: LI-MAP-002/003), its pages in all and its first extent's first_page
    (u8). One pass (leanimg._native)."""
    assert _native is not None
    ok, pages, firsts = np.zeros(len(num), np.uint8), np.zeros(len(num), np.uint64), np.zeros(len(num), np.uint64)
    _native.page_map_extents(
        e, num.astype(np.int64), IS_PAGE_CLASS.view(np.uint8), HAS_SLOT.view(np.uint8), ok, pages, firsts
    )
    return ok.view(bool), pages, firsts


def _extents_alone_numpy(e: np.ndarray, num: np.ndarray) -> tuple:
    """_extents_alone_native with numpy (where leanimg._native was not built)."""
    lid, first = _link_ids(num)
    classes = e["page_class"]
    bad = (
        (e["reserved"] != 0)
        | ~IS_PAGE_CLASS[classes]
        | (e["num_pages"] == 0)
        | (~HAS_SLOT[classes] & (e["first_slot"] != 0))
    )
    ok = np.bincount(lid[bad], minlength=len(num)) == 0
    pages = np.zeros(len(num), np.uint64)
    np.add.at(pages, lid, e["num_pages"].astype(np.uint64))
    firsts = np.where(num > 0, e["first_page"][np.minimum(first, max(len(e) - 1, 0))] if len(e) else 0, 0)
    return ok, pages, firsts.astype(np.uint64)


def _rules_hold(all_tables: list[ImageTables], prepared: list) -> np.ndarray:
    """Per image: whether every rule load checks holds (in its plain case); fills each
    prepared entry in with its digest ranks and DIGESTS positions."""
    n = len(all_tables)
    if not n:
        return np.zeros(0, bool)
    ok = _index_ascending(all_tables)
    frames_ok, totals = _frames_hold(all_tables)
    ok &= frames_ok
    ok &= _extents_hold(all_tables, prepared, totals)
    ok &= _digests_cover(all_tables, prepared)
    return ok


def _link_ids(lengths) -> tuple[np.ndarray, np.ndarray]:
    """(link id per item, index of each link's first item) for items laid end to end."""
    lengths = np.asarray(lengths, np.int64)
    return np.repeat(np.arange(len(lengths)), lengths), np.cumsum(lengths) - lengths


def _exclusive_sums(values: np.ndarray, lid: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Per item, the sum of the items before it of the same link (values int64, wrapping as u64 does)."""
    before = np.cumsum(values) - values
    return before - before[first[lid]] if len(values) else before


def _index_ascending(all_tables) -> np.ndarray:
    """LI-IDX-001: entries ascend from header_length."""
    offsets = [t.entries["record_offset"].astype(np.int64) for t in all_tables]
    lid, first = _link_ids([len(o) for o in offsets])
    flat = np.concatenate(offsets)
    ok = flat[first] == np.array([t.header.header_length for t in all_tables], np.int64)
    step_bad = np.zeros(len(flat), bool)
    step_bad[1:] = (flat[1:] <= flat[:-1]) & (lid[1:] == lid[:-1])
    return ok & (np.bincount(lid[step_bad], minlength=len(all_tables)) == 0)


def _frames_hold(all_tables) -> tuple[np.ndarray, dict]:
    """LI-FRM-001 and LI-FRM-004 (from the INDEX): frames number their pages and entries
    from 0 contiguously; a PAGE_FRAME holds 1.. 16 MiB of pages. Also, per kind, each
    image's FrameTable.total (int64 sums, wrapping as its sum does)."""
    n = len(all_tables)
    ok = np.ones(n, bool)
    totals = {}
    for kind in ("page_frames", "delta_frames"):
        tables = [getattr(t, kind) for t in all_tables]
        lengths = [len(f) for f in tables]
        lid, first = _link_ids(lengths)
        starts = np.concatenate([f.starts for f in tables])
        counts = np.concatenate([f.counts for f in tables])
        running = np.concatenate(([0], np.cumsum(counts)))  # the counts before each frame, in all
        totals[kind] = running[first + lengths] - running[first]
        bad = starts != running[:-1] - running[first][lid]  # _exclusive_sums, from the same sums
        if kind == "page_frames":
            most = np.repeat(np.array([FRAME_PAGES_MAX_BYTES // t.page_size for t in all_tables]), lengths)
            bad |= (counts < 1) | (counts > most)
        ok &= np.bincount(lid[bad], minlength=n) == 0
    return ok, totals


def _extents_hold(all_tables, prepared, totals: dict) -> np.ndarray:
    """LI-MAP-001 coverage, LI-MAP-004 slot use (slots in extent order), LI-HDR-009 and
    LI-MAP-005 feature bits; sets each prepared entry's digest ranks. ``totals``: _frames_hold's."""
    n = len(all_tables)
    extents = [p.extents for p in prepared]
    bounds = np.cumsum([0] + [len(e) for e in extents]).tolist()  # each image's extents laid end to end
    if not bounds[-1]:  # no image has extents (LI-MAP-002): load reports it
        for p in prepared:
            p.bearing, p.rank0 = np.zeros(0, bool), np.zeros(0, np.int64)
        return np.zeros(n, bool)
    bits = np.array([t.header.incompatible_features for t in all_tables], np.int64)
    own = np.array([inherits_digests(int(b)) for b in bits])
    pages = np.array([p.region.num_pages for p in prepared], np.int64)
    available = np.stack([totals["page_frames"], np.zeros(n, np.int64), totals["delta_frames"]], axis=1)  # no DISK_REFS
    extents_rules = _extents_rules_numpy if _native is None else _extents_rules_native
    ok, present, bearing, rank0 = extents_rules(extents, pages, available, own)
    has_parent = np.array([t.header.has_parent for t in all_tables])
    ok &= ~present[:, PageClass.DISK] | (bits & IncompatFeature.DISK != 0)
    ok &= ~present[:, PageClass.DELTA] | (bits & IncompatFeature.DELTA != 0)
    ok &= ~(present[:, PageClass.PARENT] | present[:, PageClass.DELTA]) | has_parent
    for p, lo, hi in zip(prepared, bounds, bounds[1:]):
        p.bearing, p.rank0 = bearing[lo:hi], rank0[lo:hi]
    return ok


_SLOT_CLASSES = (PageClass.STORED, PageClass.DISK, PageClass.DELTA)


def _extents_rules_native(extents: list, pages: np.ndarray, available: np.ndarray, own: np.ndarray) -> tuple:
    """Per image (its page map ``extents[k]``, its region's ``pages``, the slots its pages of
    each class of _SLOT_CLASSES must use, whether it ``own``s its digests, format 1.1):
    whether its extents cover the region (LI-MAP-001) and use their slots in extent order
    (LI-MAP-004), which classes it has (an (images, 16) mask); per extent, digest bearing
    and the digests before it in its image. One pass (leanimg._native)."""
    assert _native is not None
    laid = joined(extents)
    ok, present = np.zeros(len(extents), np.uint8), np.zeros(len(extents), np.uint64)
    bearing, rank0 = np.zeros(len(laid), np.uint8), np.zeros(len(laid), np.int64)
    _native.extents_hold(
        laid,
        np.array([len(e) for e in extents], np.int64),
        pages,
        available,
        own.astype(np.uint8),
        HAS_OWN_DIGEST.view(np.uint8),
        HAS_DIGEST.view(np.uint8),
        np.array(_SLOT_CLASSES, np.int64),
        ok,
        present,
        bearing,
        rank0,
    )
    classes = (present[:, None] >> np.arange(16, dtype=np.uint64)) & np.uint64(1) != 0
    return ok.view(bool), classes, bearing.view(bool), rank0


def _extents_rules_numpy(extents: list, pages: np.ndarray, available: np.ndarray, own: np.ndarray) -> tuple:
    """_extents_rules_native with numpy (where leanimg._native was not built)."""
    n = len(extents)
    lid, first = _link_ids([len(e) for e in extents])
    firsts, num, classes, slots = (
        np.concatenate([e[name] for e in extents]).astype(np.int64)
        for name in ("first_page", "num_pages", "page_class", "first_slot")
    )
    ends = firsts + num
    last = np.append(first[1:], len(lid)) - 1
    ok = np.array([len(e) > 0 for e in extents])
    gap = np.zeros(len(lid), bool)
    gap[1:] = (firsts[1:] != ends[:-1]) & (lid[1:] == lid[:-1])
    ok &= np.bincount(lid[gap], minlength=n) == 0
    ok &= np.where(ok, (firsts[np.minimum(first, len(lid) - 1)] == 0) & (ends[np.maximum(last, 0)] == pages), False)
    for have, cls in zip(available.T, _SLOT_CLASSES):
        mine = classes == cls
        sub_lid = lid[mine]
        sub_first = np.searchsorted(sub_lid, np.arange(n))
        follows = slots[mine] == _exclusive_sums(num[mine], sub_lid, sub_first)
        ok &= np.bincount(sub_lid[~follows], minlength=n) == 0
        ok &= np.bincount(sub_lid, weights=num[mine], minlength=n) == have
    present = np.bincount(lid * 16 + classes, minlength=n * 16).reshape(n, 16) > 0
    bearing = HAS_OWN_DIGEST[classes] if own.all() else np.where(own[lid], HAS_OWN_DIGEST[classes], HAS_DIGEST[classes])
    return ok, present, bearing, _exclusive_sums(np.where(bearing, num, 0), lid, first)


def _digests_cover(all_tables, prepared) -> np.ndarray:
    """LI-DIG-001 (each region's DIGESTS cover its pages once, in order) and LI-REC-009 (the
    REGION precedes the PAGE_MAP and the DIGESTS that refer to it); sets each prepared entry's
    DIGESTS positions."""
    n = len(all_tables)
    lid, first = _link_ids([len(t.entries) for t in all_tables])
    flat = joined([t.entries for t in all_tables])
    digests = np.flatnonzero(flat["record_type"] == RecordType.DIGESTS)
    at, d_lid = digests - first[lid[digests]], lid[digests]
    region_at = np.array([p.shape.region_at for p in prepared], np.int64)
    keys = flat["key"][digests].astype(np.int64)
    firsts, counts = flat["first"][digests].astype(np.int64), flat["count"][digests].astype(np.int64)
    covered = _exclusive_sums(counts, d_lid, np.searchsorted(d_lid, np.arange(n)))
    bad = (
        (keys != np.array([p.region.region_id for p in prepared], np.int64)[d_lid])
        | (firsts != covered)
        | (firsts < 0)
        | (counts < 0)
        | (at <= region_at[d_lid])
    )
    ok = np.bincount(d_lid[bad], minlength=n) == 0
    ok &= np.bincount(d_lid, weights=counts.astype(np.float64), minlength=n) == np.array(
        [p.region.num_pages for p in prepared], np.float64
    )
    ok &= region_at < np.array([p.shape.map_at for p in prepared], np.int64)
    bounds = np.searchsorted(d_lid, np.arange(n + 1))
    for k, p in enumerate(prepared):
        p.digests_at = at[bounds[k] : bounds[k + 1]].tolist()
    return ok
