"""Random-access reader of lean images (spec §6-§10): ``LeanImage``.

An open image is assembled from parts that each own one concept:

- tables.py:  what opening reads and checks: the INDEX, regions, disks, source state,
  page maps, disk references, frame numbering (every rule that needs no page content);
- parents.py: finding and verifying the parent chain (parent_files.py: the files it looks in);
- frames.py:  reading, decompressing, caching and reading ahead the PAGE_ and DELTA_FRAMEs;
- digests.py: the digest every page must have;
- pages.py:   resolving pages and ranges of pages, each checked against its digest;
- chain/:     a chained region folded once, so work per page does not grow with depth.

Every page handed out has been checked against its digest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from . import pages
from .errors import DiskError, LeanImageError
from .fast_paths import CROSS_CHECK, disagree
from .digests import DigestStore
from .frames import FrameStore, decompress_frame
from .locations import display, open_image
from .parents import attach_chain
from .structures import WHOLE_READ_BELOW, ImageFile, header_problems, read_footer, read_header
from .checks import first_problem
from .tables import DiskInfo, ImageTables, Region, SourceState

KEPT_DIGESTS_MOST = 16 << 10  # a link's DIGESTS record kept from its whole read, if no larger

if TYPE_CHECKING:
    from .chain import Resolution
    from .disks import DiskSource

__all__ = ["LeanImage", "Region", "DiskInfo", "SourceState", "decompress_frame"]


def _name(exc: LeanImageError, path: str) -> None:
    """Have ``exc`` name the file it is about (if it does not already)."""
    exc.path = exc.path or path
    exc.args = (str(exc),)


class LeanImage:
    """An open lean image. Use ``LeanImage.open``; close it (or use ``with``)."""

    def __init__(self, path: str, fileobj, tables: ImageTables):
        self.path = path
        self.fileobj = fileobj
        self.tables = tables
        self.header = tables.header
        self.footer = tables.footer
        self.page_size = tables.page_size
        self.regions: list[Region] = tables.regions
        self.disks: list[DiskInfo] = tables.disks
        self.source_states: list[SourceState] = tables.source_states
        self.frames = FrameStore(tables)
        self.digests = DigestStore(tables, self)
        self.disk_sources: dict[int, DiskSource] = {}  # disk id -> attached disk source
        self.parent: LeanImage | None = None
        self.sort_blocks = True  # DISK pages read in ascending physical order
        self._resolutions: dict[int, Resolution] = {}  # region id -> its chain resolved

    # -- opening -----------------------------------------------------------------
    @classmethod
    def open(cls, path, *, parents=(), disks=None, check_disk_identity: bool = True) -> "LeanImage":
        """Open ``path`` and its chain; ``parents`` are candidate parent images (paths or open
        LeanImages), matched by UUID, and so are the *.lean files beside each link; ``disks``
        maps disk names to open disk sources (``leanimg.disks.open_disk``), attached with
        ``attach_disks``. Without ``check_disk_identity`` a disk's size and fingerprint are not
        compared with the disk table (every block read is still checked against its page's digest)."""
        image = cls.open_link(path)
        try:
            attach_chain(
                image, list(parents), lambda link: cls.open_link(link, check=False), cls.check_links, cls.open_links
            )
            image.attach_disks(disks or {}, check_identity=check_disk_identity)
        except BaseException:
            image.close()
            raise
        return image

    @classmethod
    def open_link(cls, path, *, check: bool = True) -> "LeanImage":
        """One link, without its parent. ``check=False``: its header, footer and INDEX only;
        ``check_links`` must follow (a chain's links are checked together)."""
        path = display(path)
        try:
            fileobj = open_image(path)
        except OSError as exc:
            raise LeanImageError(f"cannot open: {exc.strerror}", path=path) from None
        try:
            file = ImageFile(fileobj, path, whole_below=WHOLE_READ_BELOW)
            header = read_header(file)
            first_problem(header_problems(header))
            image = cls(path, fileobj, ImageTables.read(file, header, read_footer(file, header.header_length), check))
            if check:
                file.drop_whole()
            return image
        except LeanImageError as exc:
            fileobj.close()
            _name(exc, path)
            raise

    @classmethod
    def open_links(cls, paths: list[str], kept: dict | None = None) -> dict:
        """path -> link, as open_link(path, check=False) opens it, for those of ``paths`` whose
        header, footer and INDEX pass the tests links_batch makes of many files at once; the
        others are not opened (open_link then raises the finding). ``kept``: as links_batch's."""
        from .links_batch import open_links

        opened = {
            path: cls(path, fileobj, ImageTables(file, header, footer, index, load=False, frames=frames))
            for path, (fileobj, file, header, footer, index, frames) in open_links(
                paths, WHOLE_READ_BELOW, kept
            ).items()
        }
        if CROSS_CHECK:
            for link in opened.values():
                cls._cross_check(link)
        return opened

    @classmethod
    def _cross_check(cls, link: "LeanImage") -> None:
        """LEANIMG_CROSS_CHECK=1: open_link(check=False) opens the link links_batch opened alike."""
        try:
            alone = cls.open_link(link.path, check=False)
        except LeanImageError as exc:
            raise disagree(link.path, "links_batch.open_links", f"open_link refuses it: {exc}") from exc
        with alone:
            mine, theirs = link.tables, alone.tables
            same = (
                mine.header.__dict__ == theirs.header.__dict__
                and mine.footer.__dict__ == theirs.footer.__dict__
                and (mine.index.offset, mine.index.body_length, mine.index.record_checksum)
                == (theirs.index.offset, theirs.index.body_length, theirs.index.record_checksum)
                and bytes(mine.index.body) == bytes(theirs.index.body)
                and mine.entries.tobytes() == theirs.entries.tobytes()
                and all(
                    np.array_equal(getattr(a, name), getattr(b, name))
                    for a, b in ((mine.page_frames, theirs.page_frames), (mine.delta_frames, theirs.delta_frames))
                    for name in ("starts", "counts", "positions")
                )
            )
        if not same:
            raise disagree(link.path, "links_batch.open_links", "open_link reads its header, footer or INDEX otherwise")

    @staticmethod
    def check_links(links: list["LeanImage"]) -> None:
        """Load and check the tables of links opened with check=False, together
        (tables_batch.load_tables): the first link in order with a finding raises it."""
        from .tables_batch import load_tables

        try:
            load_tables([link.tables for link in links], on_error=lambda exc, tables: _name(exc, tables.file.name))
            for link in links:  # a restore reads the DIGESTS of most links of a 1.1 chain
                if link.digests.inherits:
                    for positions in link.tables.digest_positions.values():
                        link.tables.keep_listed(positions, KEPT_DIGESTS_MOST)
        finally:
            for link in links:
                link.tables.file.drop_whole()

    def attach_disks(self, disks: dict, check_identity: bool = True) -> None:
        """Attach disk sources (``leanimg.disks.DiskSource`` by disk name; under None: the disk of
        an image with one disk) to this image and to every link of its chain that has the disk.
        Each is first checked to be that disk, size and fingerprint (LI-DSK-004), unless not
        ``check_identity``. The image closes the sources attached to it when it closes."""
        if not disks:  # every open attaches none: leanimg.disks (json, subprocess) stays unimported
            return
        from .disks import check_identity as check_disk

        disks = dict(disks)
        if None in disks:
            names = sorted({d.name for link in self.chain() for d in link.disks})
            if len(names) != 1:
                raise DiskError(
                    f"--disk PATH without a NAME needs an image with one disk; this one has "
                    f"{', '.join(names) or 'none'}: give NAME=PATH"
                )
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
                    link.disk_sources[info.disk_id] = disks[info.name]

    @property
    def has_disk_sources(self) -> bool:
        return bool(self.disk_sources)

    def close(self) -> None:
        """Close this image and its whole chain."""
        for link in self.chain():
            link.frames.close()
            for source in link.disk_sources.values():
                source.close()
            link.fileobj.close()

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
        links: list[LeanImage] = []
        image: LeanImage | None = self
        while image is not None:
            links.append(image)
            image = image.parent
        return links

    @property
    def index_entries(self) -> np.ndarray:
        return self.tables.entries

    def resolution(self, region: Region, deltas_ahead: bool = False) -> Resolution:
        """The chain folded once for ``region`` (chain.resolve), cached. ``deltas_ahead``: a
        forward pass begins: its DELTA_FRAMEs are read and parsed on the read-ahead workers
        while the chain is folded (chain.parse_deltas_ahead)."""
        from .chain import parse_deltas_ahead, resolve

        if region.region_id not in self._resolutions:
            ahead = parse_deltas_ahead(self) if deltas_ahead else None
            resolution = resolve(self, region)
            if len(resolution.delta_pages):  # else no fold takes the parses (nor holds them)
                resolution.deltas_ahead = ahead
            self._resolutions[region.region_id] = resolution
        return self._resolutions[region.region_id]

    # -- pages (pages.py) -------------------------------------------------------------
    def _region_of(self, region) -> Region:
        return region if isinstance(region, Region) else self.region(region)

    def page_location(self, region: Region, page: int) -> tuple[int, int]:
        return pages.page_location(region, page)

    def classes(self, region: Region, first_page: int = 0, count: int | None = None) -> np.ndarray:
        return pages.classes(region, first_page, count)

    def page_slots(self, region: Region, first_page: int, count: int) -> np.ndarray:
        return pages.page_slots(region, first_page, count)

    def expected_digest(self, region: Region, page: int) -> bytes | None:
        return self.digests.expected(region, page)

    def read_page(self, region, page: int) -> bytes:
        return pages.read_page(self, self._region_of(region), page)

    def region_bytes(self, region: Region, first_page: int, count: int) -> memoryview:
        return pages.region_bytes(self, region, first_page, count)

    def region_pieces(self, region: Region, first_page: int, count: int) -> list[tuple[int, memoryview | None]]:
        return pages.region_pieces(self, region, first_page, count)

    def region_windows(self, region: Region, step: int):
        return pages.region_windows(self, region, step)

    def fill_disk_pages(
        self, region: Region, first_page: int, out: np.ndarray, rows: np.ndarray, slots: np.ndarray
    ) -> None:
        pages.fill_disk_pages(self, region, first_page, out, rows, slots)

    def enable_read_ahead(self, threads: int = 2, depth: int = 4) -> None:
        self.frames.enable_read_ahead(threads, depth)

    @property
    def restore_chunk_pages(self) -> int:
        return pages.restore_chunk_pages(self)

    @property
    def gather_chunk_pages(self) -> int:
        return pages.gather_chunk_pages(self)
