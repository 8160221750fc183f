"""`leanimg map`: where the bytes of every page of an image are, as contiguous extents (like
``qemu-img map --output=json``).

An extent is a run of pages of one region and one class whose bytes lie together: STORED
pages in one PAGE_FRAME (consecutive ordinals), DISK pages at consecutive sectors of one disk,
DELTA pages in one DELTA_FRAME, PARENT pages in the parent image, ZERO and FREE pages nowhere.
The page maps' extents are merged where the class and the place continue and split where a
frame or a disk run ends, with numpy over whole tables: the cost follows the number of
extents, not of pages (DISK references are compared per reference, a table the image holds
in memory already).
"""

from __future__ import annotations

import json
import uuid as uuidlib
from typing import Iterator

import numpy as np

from .format import DISK_SECTOR_SIZE, PageClass
from .reader import LeanImage, Region

MAP_FORMAT = 1  # version of the JSON layout (lean-image/schemas/map.schema.json)
EXTENT_DTYPE = np.dtype([("first_page", "<i8"), ("num_pages", "<i8"), ("page_class", "<u2"), ("first_slot", "<i8")])


def region_extents(image: LeanImage, region: Region, breaks_by_class: dict | None = None) -> np.ndarray:
    """The extents of ``region`` where bytes lie together (EXTENT_DTYPE, in page order);
    ``breaks_by_class``: the image's _breaks_by_class, when the caller has it."""
    breaks_by_class = breaks_by_class if breaks_by_class is not None else _breaks_by_class(image)
    merged = _merge(region.extents)
    pieces = [merged[~np.isin(merged["page_class"], list(breaks_by_class))]]
    for cls, breaks in breaks_by_class.items():
        pieces.append(_split(merged[merged["page_class"] == cls], breaks))
    out = np.concatenate(pieces)
    return out[np.argsort(out["first_page"], kind="stable")]


def _merge(extents: np.ndarray) -> np.ndarray:
    """Adjacent extents of one class joined where their slots continue (or they have none)."""
    out = np.zeros(len(extents), EXTENT_DTYPE)
    if not len(extents):  # a region of no pages
        return out
    for name in EXTENT_DTYPE.names or ():  # (a structured dtype: never None)
        out[name] = extents[name]
    if len(out) < 2:
        return out
    cls, slot, num = out["page_class"], out["first_slot"], out["num_pages"]
    has_slot = np.isin(cls, [PageClass.STORED, PageClass.DISK, PageClass.DELTA])
    continues = (cls[1:] == cls[:-1]) & (~has_slot[1:] | (slot[1:] == slot[:-1] + num[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~continues)))
    merged = out[starts].copy()
    merged["num_pages"] = np.add.reduceat(num, starts)
    return merged


def _breaks_by_class(image: LeanImage) -> dict[int, np.ndarray]:
    """Per slot class, the sorted slots where a new place begins: a frame's first ordinal
    (STORED, DELTA), a reference that does not continue the one before on the same disk (DISK)."""
    tables = image.tables
    refs = tables.disk_refs
    disk_ids, sectors = refs.disk_ids.astype(np.int64), refs.sectors.astype(np.int64)
    step = image.page_size // DISK_SECTOR_SIZE
    disk_breaks = np.flatnonzero((disk_ids[1:] != disk_ids[:-1]) | (sectors[1:] != sectors[:-1] + step)) + 1
    return {
        PageClass.STORED: tables.page_frames.starts[1:],
        PageClass.DELTA: tables.delta_frames.starts[1:],
        PageClass.DISK: disk_breaks.astype(np.int64),
    }


def _split(extents: np.ndarray, breaks: np.ndarray) -> np.ndarray:
    """``extents`` (of one slot class) cut at every slot of ``breaks`` that falls inside one."""
    if not len(extents) or not len(breaks):
        return extents
    slot, num = extents["first_slot"], extents["num_pages"]
    lo = np.searchsorted(breaks, slot, side="right")  # first break after an extent's first slot
    hi = np.searchsorted(breaks, slot + num, side="left")  # breaks before its end
    pieces = 1 + (hi - lo)
    owner = np.repeat(np.arange(len(extents)), pieces)
    nth = np.arange(len(owner)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    at = np.repeat(lo, pieces) + nth - 1  # the break a piece starts at
    start = np.where(nth == 0, slot[owner], breaks[np.clip(at, 0, len(breaks) - 1)])
    last = nth == pieces[owner] - 1
    end = np.where(last, (slot + num)[owner], breaks[np.clip(at + 1, 0, len(breaks) - 1)])
    out = np.zeros(len(owner), EXTENT_DTYPE)
    out["first_page"] = extents["first_page"][owner] + (start - slot[owner])
    out["num_pages"] = end - start
    out["page_class"] = extents["page_class"][owner]
    out["first_slot"] = start
    return out


# --- where the bytes are ----------------------------------------------------------------------
def extent_entries(
    image: LeanImage, region: Region, disk_paths: dict | None = None, breaks_by_class: dict | None = None
) -> Iterator[dict]:
    """One dict per extent of ``region`` (the JSON layout of map.schema.json)."""
    extents = region_extents(image, region, breaks_by_class)
    ps = image.page_size
    where = _Places(image, disk_paths or {})
    for lo in range(0, len(extents), ENTRIES_AT_ONCE):  # a block at a time: memory stays bounded
        block = extents[lo : lo + ENTRIES_AT_ONCE]
        for row, place in zip(block.tolist(), where.of(block)):
            first_page, num_pages, cls, _ = row
            start = first_page * ps
            yield dict(
                region=region.name,
                start=start,
                length=num_pages * ps,
                first_page=first_page,
                pages=num_pages,
                guest_phys=region.guest_phys_base + start if region.guest_phys_base is not None else None,
                page_class=PageClass(cls).name,
                where=place,
            )


ENTRIES_AT_ONCE = 1 << 14  # extents whose places are computed together (as Python objects)


class _Places:
    """The ``where`` of extents, computed for a whole table at once."""

    def __init__(self, image: LeanImage, disk_paths: dict):
        self.image, self.disk_paths = image, disk_paths
        self.disk_names = {d.disk_id: d.name for d in image.disks}
        header = image.header
        self.parent = None
        if header.has_parent:
            self.parent = dict(
                parent=image.parent.path if image.parent is not None else None,
                parent_uuid=str(uuidlib.UUID(bytes=header.parent_uuid)),
            )

    def of(self, extents: np.ndarray) -> list:
        cls, slot = extents["page_class"], extents["first_slot"]
        places: list = [None] * len(extents)
        for k, place in self._frames(
            cls, slot, PageClass.STORED, self.image.tables.page_frames, "frame", "first_page_in_frame"
        ):
            places[k] = place
        for k, place in self._frames(
            cls, slot, PageClass.DELTA, self.image.tables.delta_frames, "delta_frame", "first_entry_in_frame"
        ):
            places[k] = dict(place, **(self.parent or {}))
        refs = self.image.tables.disk_refs
        for k in np.flatnonzero(cls == PageClass.DISK).tolist():
            disk_id = int(refs.disk_ids[slot[k]])
            name = self.disk_names.get(disk_id, str(disk_id))
            places[k] = dict(
                disk=name,
                disk_id=disk_id,
                sector=int(refs.sectors[slot[k]]),
                **({"disk_path": self.disk_paths[name]} if name in self.disk_paths else {}),
            )
        for k in np.flatnonzero(cls == PageClass.PARENT).tolist():
            places[k] = dict(self.parent or {})
        return places

    def _frames(self, cls, slot, which, table, frame_key: str, first_key: str):
        rows = np.flatnonzero(cls == which)
        if not len(rows):
            return
        frames = table.frame_of(slot[rows])
        offsets = self.image.index_entries["record_offset"][table.positions[frames]]
        into = slot[rows] - table.starts[frames]
        for k, frame, offset, first in zip(rows.tolist(), frames.tolist(), offsets.tolist(), into.tolist()):
            yield k, {"file": self.image.path, "record_offset": offset, frame_key: frame, first_key: first}


# --- output -------------------------------------------------------------------------------------
def map_header(image: LeanImage) -> dict:
    return dict(
        map_format=MAP_FORMAT,
        image=image.path,
        page_size=image.page_size,
        start="byte offset in the region; guest_phys: the guest-physical address where the region has one",
        regions=[
            dict(region_id=r.region_id, name=r.name, size_bytes=r.size_bytes, guest_phys_base=r.guest_phys_base)
            for r in image.regions
        ],
    )


def write_json(image: LeanImage, out, disk_paths: dict | None = None) -> int:
    """The map as one JSON object, its extents written as they are computed; the extent count."""
    head = json.dumps(map_header(image), indent=2)
    out.write(head[:-2] + ',\n  "extents": [')
    count = 0
    breaks = _breaks_by_class(image)
    for region in image.regions:
        for entry in extent_entries(image, region, disk_paths, breaks):
            out.write(("," if count else "") + "\n    " + json.dumps(entry))
            count += 1
    out.write("\n  ]\n}\n")
    return count


def write_human(image: LeanImage, out, disk_paths: dict | None = None) -> int:
    """One line per extent: region, start, length, pages, class, where the bytes are."""
    gpa = any(r.guest_phys_base is not None for r in image.regions)
    out.write(
        f"{image.path}: page size {image.page_size}; start is the byte offset in the region"
        + ("; gpa the guest-physical address" if gpa else "")
        + "\n"
    )
    width = max([len(r.name) for r in image.regions] + [6])
    out.write(
        f"{'region':<{width}}  {'start':>14}  {'length':>12}  {'pages':>8}  {'class':<6}  "
        + ("gpa                 " if gpa else "")
        + "where\n"
    )
    count = 0
    breaks = _breaks_by_class(image)
    for region in image.regions:
        for e in extent_entries(image, region, disk_paths, breaks):
            address = f"{e['guest_phys']:#18x}  " if e["guest_phys"] is not None else (" " * 20 if gpa else "")
            out.write(
                f"{e['region']:<{width}}  {e['start']:#14x}  {e['length']:#12x}  {e['pages']:>8}  "
                f"{e['page_class']:<6}  {address}{describe_place(e['page_class'], e['where'])}\n"
            )
            count += 1
    return count


def describe_place(page_class: str, where: dict | None) -> str:
    if where is None:  # ZERO and FREE pages (the other classes always have a place)
        return "-"
    if page_class == "STORED":
        return (
            f"frame {where['frame']} (record at {where['record_offset']:#x}) from page {where['first_page_in_frame']}"
        )
    if page_class == "DELTA":
        return (
            f"delta frame {where['delta_frame']} (record at {where['record_offset']:#x}) from entry "
            f"{where['first_entry_in_frame']}, applied to {where.get('parent') or where.get('parent_uuid')}"
        )
    if page_class == "DISK":
        path = f" ({where['disk_path']})" if "disk_path" in where else ""
        return f"disk {where['disk']}{path} sector {where['sector']}"
    if page_class == "PARENT":
        return f"parent {where.get('parent') or where.get('parent_uuid')}"
    return "-"
