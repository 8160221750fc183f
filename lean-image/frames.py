"""The frames of one image (spec §6.3, §7.1): PAGE_FRAMEs hold stored pages, DELTA_FRAMEs
delta entries. A frame is read when first needed, its record checked, its zstd frame
decompressed within its declared size; a few are cached, and during a sequential restore the
next ones are decompressed (and their pages digested) ahead on worker threads.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import TYPE_CHECKING, Literal, NamedTuple, overload

import numpy as np
import zstandard

from .arrays import distinct
from .compression import SIZE, FrameError, decompress_exact, decompress_into
from .delta import parse_index_lists
from .errors import FormatError, LeanImageError
from .format import FRAME_PAGES_MAX_BYTES, page_digests
from .rules import implements
from .tables import FrameTable, ImageTables

if TYPE_CHECKING:
    from concurrent.futures import Future, ThreadPoolExecutor

FRAME_CACHE_SIZE = 8
# Decompressed frames whose pages one region_pieces call may hand out as views (holding
# them until written); a range whose pages lie in more frames is copied into one buffer.
DIRECT_FRAMES_MAX = 32


class DeltaFrameContent(NamedTuple):
    """A DELTA_FRAME read, checked and decompressed (FrameStore.read_delta_frame)."""

    content: bytes  # its entries laid end to end
    offsets: list[int] | np.ndarray  # where each entry begins in content, and its end
    first: int  # the delta slot of its first entry


@overload
def decompress_frame(decompressor, data, expected: int, offset: int, structure: str, into: None = None) -> bytes: ...


@overload
def decompress_frame(decompressor, data, expected: int, offset: int, structure: str, into: bytearray) -> memoryview: ...


@overload
def decompress_frame(
    decompressor, data, expected: int, offset: int, structure: str, into: bytearray | None
) -> bytes | memoryview: ...


@implements("LI-FRM-002", "LI-FRM-003")
def decompress_frame(
    decompressor, data, expected: int, offset: int, structure: str, into: bytearray | None = None
) -> bytes | memoryview:
    """One zstd frame of exactly ``expected`` bytes (at most 16 MiB); never allocates beyond
    that. ``into``: a buffer of at least ``expected`` bytes to decompress into (a view of it
    is returned)."""
    try:
        if into is not None:
            return decompress_into(
                data, into, expected=expected, limit=FRAME_PAGES_MAX_BYTES, decompressor=decompressor
            )
        return decompress_exact(data, expected=expected, limit=FRAME_PAGES_MAX_BYTES, decompressor=decompressor)
    except FrameError as exc:
        rule = "LI-FRM-003" if exc.kind == SIZE else "LI-FRM-002"
        raise FormatError(exc.message, offset=offset, structure=structure, rule=rule) from None


class _Buffer(bytearray):
    __slots__ = ("__weakref__",)


class FrameBuffers:
    """Memory for decompressed frames, used again: a forward pass decompresses many times the
    memory it restores (a chain's frames hold superseded pages too), and fresh memory costs a
    page fault and a cleared page every 4 KiB, which used-again memory does not.  ``take``
    lends a buffer; ``give`` takes back the content of a frame loaded into one once nothing
    refers to it any more (anything else given is ignored)."""

    KEEP = 32  # free buffers kept
    GRAIN = 1 << 20  # sizes rounded up to this: frames of a few pages more or less share buffers

    def __init__(self) -> None:
        self._free: list[_Buffer] = []
        # id -> buffer lent (one never given back just goes)
        self._lent: weakref.WeakValueDictionary[int, _Buffer] = weakref.WeakValueDictionary()
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        with self._lock:
            fitting = [k for k, buffer in enumerate(self._free) if len(buffer) >= size]
            if fitting:
                buffer = self._free.pop(min(fitting, key=lambda k: len(self._free[k])))
            else:
                buffer = _Buffer(-(-size // self.GRAIN) * self.GRAIN)
            self._lent[id(buffer)] = buffer
            return buffer

    def give(self, content) -> None:
        buffer = content.obj if isinstance(content, memoryview) else None
        with self._lock:
            lent = self._lent.pop(id(buffer), None) if buffer is not None else None
            if lent is not None and lent is buffer:
                self._free.append(lent)
                if len(self._free) > self.KEEP:
                    self._free.pop(min(range(len(self._free)), key=lambda k: len(self._free[k])))


class FrameStore:
    def __init__(self, tables: ImageTables):
        self.tables = tables
        self.page_size = tables.page_size
        self.page_frames: FrameTable = tables.page_frames
        self.delta_frames: FrameTable = tables.delta_frames
        self.pool: ThreadPoolExecutor | None = None  # read-ahead workers, see enable_read_ahead
        self._depth = 0
        self._cache: OrderedDict = OrderedDict()
        self.cache_frames = FRAME_CACHE_SIZE  # frames kept decompressed (see keep_decompressed)
        self.jump_queue = False  # a frame asked for whose prefetch has not begun is loaded at once
        self._ahead: dict[int, Future[tuple[bytes | memoryview, np.ndarray | None]]] = {}
        self._ahead_deltas: dict[int, Future[tuple]] = {}  # DELTA_FRAME -> its parse on a worker

    def enable_read_ahead(self, threads: int = 2, depth: int = 4) -> None:
        """Decompress the next frames on worker threads while the caller reads sequentially."""
        from concurrent.futures import ThreadPoolExecutor  # a restore's only use of threads

        self.pool = ThreadPoolExecutor(max_workers=threads)
        self._depth = depth
        try:  # frames are read in file order: let the kernel read further ahead
            os.posix_fadvise(self.tables.file.fileobj.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (AttributeError, OSError, ValueError):
            pass

    def keep_decompressed(self, limit_bytes: int) -> None:
        """Keep up to ``limit_bytes`` of decompressed frames (at least FRAME_CACHE_SIZE frames):
        for a reader that comes back to frames in no order, as a post-copy serve does."""
        largest = max([int(self.page_frames.counts.max(initial=0)) * self.page_size, 1])
        self.cache_frames = max(FRAME_CACHE_SIZE, limit_bytes // largest)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    # -- page frames ---------------------------------------------------------------
    @overload
    def frame(
        self, frame: int, with_digests: bool = False, keep: Literal[True] = True
    ) -> tuple[bytes, np.ndarray | None]: ...

    @overload
    def frame(
        self, frame: int, with_digests: bool = False, keep: bool = True
    ) -> tuple[bytes | memoryview, np.ndarray | None]: ...

    def frame(
        self, frame: int, with_digests: bool = False, keep: bool = True
    ) -> tuple[bytes | memoryview, np.ndarray | None]:
        """(content, page digests or None) of PAGE_FRAME ``frame``; read-ahead workers compute both.
        ``keep=False``: not cached (a caller that reads each frame once, like a chain restore,
        which would otherwise hold FRAME_CACHE_SIZE frames of every link), and the content may be
        a view of a buffer lent by FrameBuffers (prefetch); kept, it is bytes."""
        key = ("page", frame)
        content: bytes | memoryview
        digests: np.ndarray | None
        if key in self._cache:
            self._cache.move_to_end(key)
            content, digests = self._cache[key]
        elif frame in self._ahead:  # asked for ahead of time (prefetch)
            future = self._ahead.pop(frame)
            if self.jump_queue and future.cancel():  # not begun: here, rather than behind the others
                content, digests = self._load(frame), None
            else:
                content, digests = future.result()
        elif self.pool is None:
            content, digests = self._load(frame), None
        else:
            for ahead in range(frame, min(frame + self._depth + 1, len(self.page_frames))):
                if ahead not in self._ahead and ("page", ahead) not in self._cache:
                    self._ahead[ahead] = self.pool.submit(self._load_with_digests, ahead)
            content, digests = self._ahead.pop(frame).result()
        if with_digests and digests is None:
            digests = page_digests(content, self.page_size)
        if keep:
            if isinstance(content, memoryview):  # a lent buffer (prefetched for a forward pass)
                content = bytes(content)
            self._keep(key, (content, digests))
        return content, digests

    def frame_pages(self, frame: int) -> bytes:
        """Decompressed content of PAGE_FRAME number ``frame`` (cached)."""
        return self.frame(frame)[0]

    def prefetch(self, frames, pool, with_digests: bool = False, buffers: FrameBuffers | None = None) -> None:
        """Decompress these PAGE_FRAMEs (and digest their pages) on ``pool``'s workers before
        they are asked for; with ``buffers``, into buffers taken from it (the caller asks for
        them with keep=False and gives each content back when done with it)."""
        load = self._load_with_digests if with_digests else self._load_only
        for frame in frames:
            if frame not in self._ahead and ("page", frame) not in self._cache:
                self._ahead[frame] = pool.submit(load, frame, buffers)

    def stored_spans(self, ordinal: int, count: int, with_digests: bool = True):
        """(frame content, its page digests or None, first page in it, pages) covering
        STORED ordinals [ordinal, ordinal+count)."""
        while count:
            frame = self.page_frames.frame_at(ordinal)
            start = ordinal - int(self.page_frames.starts[frame])
            n = min(count, int(self.page_frames.counts[frame]) - start)
            data, digests = self.frame(frame, with_digests=with_digests)
            yield data, digests, start, n
            ordinal, count = ordinal + n, count - n

    def stored_page(self, ordinal: int) -> bytes:
        data, _, start, _ = next(self.stored_spans(ordinal, 1, with_digests=False))
        return data[start * self.page_size : (start + 1) * self.page_size]

    def frames_touched(self, ordinals: np.ndarray) -> int:
        return len(distinct(self.page_frames.frame_of(ordinals)))

    def _load_only(self, frame: int, buffers: FrameBuffers | None = None) -> tuple[bytes | memoryview, None]:
        return self._load(frame, buffers), None

    def _load_with_digests(
        self, frame: int, buffers: FrameBuffers | None = None
    ) -> tuple[bytes | memoryview, np.ndarray]:
        content = self._load(frame, buffers)
        return content, page_digests(content, self.page_size)

    def _load(self, frame: int, buffers: FrameBuffers | None = None) -> bytes | memoryview:
        """The content of PAGE_FRAME ``frame``; with ``buffers``, a view of a buffer taken from it."""
        with self._naming_the_file():
            record = self.tables.frame_record(self.page_frames, frame)
            p = record.fields
            size = p["num_pages"] * self.page_size
            into = buffers.take(size) if buffers is not None else None
            return decompress_frame(
                zstandard.ZstdDecompressor(), p["frame"], size, record.offset, record.path("frame"), into
            )

    @contextmanager
    def _naming_the_file(self):
        """A frame that cannot be read names its file (in a chain, which link's frame it is)."""
        try:
            yield
        except LeanImageError as exc:
            exc.path = exc.path or self.tables.file.name
            exc.args = (str(exc),)
            raise

    # -- delta frames ----------------------------------------------------------------
    def delta_entries(self, slots: np.ndarray) -> list:
        """The delta entries of many slots, each DELTA_FRAME looked up once per run."""
        frames = self.delta_frames.frame_of(slots)
        out = []
        for frame, slot in zip(frames.tolist(), np.asarray(slots).tolist()):
            content, offsets, first = self._delta_frame(frame)
            k = slot - first
            out.append(content[offsets[k] : offsets[k + 1]])
        return out

    def delta_frame_location(self, frame: int) -> tuple[int, str]:
        """(record offset, structure path) of DELTA_FRAME ``frame``, for findings about its entries."""
        position = int(self.delta_frames.positions[frame])
        return int(self.tables.entries["record_offset"][position]), f"record[{position}].delta_frame"

    def delta_entry(self, slot: int) -> bytes:
        return self.delta_entries(np.array([slot], np.int64))[0]

    def delta_frame_parsed(self, frame: int):
        """(first_delta, content, offsets, parse_index_lists(...)) of a DELTA_FRAME, cached."""
        key = ("delta-parsed", frame)
        if key not in self._cache:
            ahead = self._ahead_deltas.pop(frame, None)
            self._keep(key, ahead.result() if ahead is not None else self._parse_delta_frame(frame))
        return self._cache[key]

    def prefetch_deltas(self, frames, pool) -> None:
        """Read, decompress and parse these DELTA_FRAMEs on ``pool``'s workers before they are asked for."""
        for frame in frames:
            if frame not in self._ahead_deltas and ("delta-parsed", frame) not in self._cache:
                self._ahead_deltas[frame] = pool.submit(self._parse_delta_frame, frame)

    def _parse_delta_frame(self, frame: int):
        """Runs on a read-ahead worker too: reads the file, touches no cache."""
        content, offsets, first = self.read_delta_frame(frame)
        return first, content, offsets, parse_index_lists(content, np.array(offsets, np.int64), self.page_size)

    def _delta_frame(self, frame: int):
        key = ("delta", frame)
        if key not in self._cache:
            self._keep(key, self.read_delta_frame(frame))
        return self._cache[key]

    def read_delta_frame(self, frame: int) -> DeltaFrameContent:
        """DELTA_FRAME ``frame`` read, its record checked, decompressed (not cached): a finding
        names the file."""
        with self._naming_the_file():
            record = self.tables.frame_record(self.delta_frames, frame)
            p = record.fields
            content = decompress_frame(
                zstandard.ZstdDecompressor(),
                p["frame"],
                int(p["entry_offsets"][-1]),
                record.offset,
                record.path("frame"),
            )
        return DeltaFrameContent(content, p["entry_offsets"].tolist(), p["first_delta"])

    def _keep(self, key, value) -> None:
        self._cache[key] = value
        while len(self._cache) > self.cache_frames:
            self._cache.popitem(last=False)
