"""Delta folding for a forward pass: every DELTA_FRAME that applies read, parsed and folded
on the read-ahead workers in batches of whole frames, so a range applies one slice of each
batch, however deep the chain (ChainPatches); the reading and parsing begun ahead, while the
chain is resolved (parse_deltas_ahead); a batch's records read in one C call or a few scalar
tests each (_read_delta_batch_native, _quick_delta_frame), any other through the frame store,
which raises its finding. Entries other than plain INDEX_LISTs go through the checked path
(apply_checked).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import zstandard

from ..arrays import distinct
from ..compression import FrameError, decompress_exact
from ..delta import apply as apply_delta, parse_index_lists
from ..errors import LeanImageError
from ..fast_paths import CROSS_CHECK, disagree, fast_path
from ..format import (
    DELTA_FRAME_BODY,
    FRAME_PAGES_MAX_BYTES,
    NO_KEY,
    RECORD,
    RECORD_BODY_MAX,
    RECORD_TRAILER,
    RecordType,
    align8,
    checksum64,
    record_size,
)
from ..frames import DeltaFrameContent
from .resolution import Resolution

from ..native import backend as _native  # batches read and folded in C (None: numpy)

if TYPE_CHECKING:
    from concurrent.futures import Future

    from ..reader import LeanImage

    Frames = list[tuple[LeanImage, int]]  # DELTA_FRAMEs: (link, frame)


class ParsedBatch(NamedTuple):
    """A batch of DELTA_FRAMEs read, checked, decompressed and parsed as one (_parse_delta_batch)."""

    firsts: np.ndarray  # per frame: its first delta
    counts: np.ndarray  # per frame: its entries
    lists: tuple  # parse_index_lists' arrays over the frames' entries laid end to end


class ReadBatch(NamedTuple):
    """A batch of DELTA_FRAMEs read, checked and decompressed, laid end to end (_read_delta_batch)."""

    content: bytes
    offsets: np.ndarray  # entry offsets into content, and its end (int64)
    firsts: np.ndarray  # per frame: its first delta
    counts: np.ndarray  # per frame: its entries


class FoldedBatch(NamedTuple):
    """The entries of a batch that apply, folded (_fold_delta_batch)."""

    firsts: np.ndarray  # per frame: its first delta
    words: np.ndarray  # the words set, page * words per page + word, ascending
    values: np.ndarray  # their values (of a word several set, the nearest link's)
    plain: np.ndarray  # per row: whether its entry is a plain INDEX_LIST (else: the checked path)


class WordBatch(NamedTuple):
    """What a batch's fold takes (_fold_words, _fold_words_native): parse_index_lists' arrays
    over its entries, and the rows that apply (each: its entry and its page)."""

    simple: np.ndarray  # per entry: whether it is a plain INDEX_LIST (bool)
    word_start: np.ndarray  # per entry: its first word in positions and values
    positions: np.ndarray  # each word's index in its page
    values: np.ndarray  # each word's value ("<u8")
    entries: np.ndarray  # per row: its entry
    pages: np.ndarray  # per row: its page
    page_size: int


class _Batch(NamedTuple):
    rows: np.ndarray  # the delta entries (rows of the resolution) it folds
    job: tuple  # _gather_and_fold's arguments
    future: Future | None  # its fold on a worker (None: no workers, folded when first applied)


def chain_patches(resolution: Resolution) -> ChainPatches:
    """Every delta of ``resolution`` that applies, folded once for a forward pass (built on first use)."""
    if resolution.chain_patches is None:
        resolution.chain_patches = ChainPatches(resolution)
    return resolution.chain_patches


class ChainPatches:
    """Every delta entry of a resolved region that applies, for a forward pass (a restore),
    built once on the read-ahead workers: the DELTA_FRAMEs holding them go in batches of
    whole frames (nearest link first), each batch read, decompressed, parsed and folded on a
    worker into the final value of every word it sets (a word several of its links set takes
    the nearest link's value), sorted by page and word. A range applies its slice of each
    batch, deepest batch first, so the nearest link's value is the one left: the work per
    range grows with the number of batches (one per BATCH_ENTRIES entries), not with depth.
    Pages with any entry other than a plain INDEX_LIST go entry by entry, deepest link first,
    all their entries through the fully checked path (apply_checked), as random_access.DeltaPatches does."""

    BATCH_ENTRIES = 1 << 14  # entries a worker reads and folds at once

    def __init__(self, resolution: Resolution):
        """Starts the batches on the workers; without workers the first ``apply`` runs them."""
        r = self.resolution = resolution
        self.words_per_page = r.links[0].page_size // 8
        self.of_frame, frames, sizes = _frames_in_use(r)
        cuts = _batch_cuts(sizes)
        # each frame's rows in their order: a radix sort where the frames fit 16 bits
        by_frame = np.argsort(
            self.of_frame.astype(np.uint16) if len(frames) <= 1 << 16 else self.of_frame, kind="stable"
        )
        row_cuts = np.searchsorted(self.of_frame[by_frame], cuts).tolist()
        pool, ps = r.links[0].frames.pool, r.links[0].page_size
        self.batches: list[_Batch] = []
        ahead, r.deltas_ahead = r.deltas_ahead or {}, None
        for lo, hi, row_lo, row_hi in zip(cuts, cuts[1:], row_cuts, row_cuts[1:]):
            rows = by_frame[row_lo:row_hi]
            parsed = ahead.get(_batch_key(frames[lo:hi]))
            job = (frames[lo:hi], lo, rows, self.of_frame, r.delta_slots, r.delta_pages, ps, parsed)
            self.batches.append(_Batch(rows, job, pool.submit(_gather_and_fold, *job) if pool is not None else None))
        self.folds: list[tuple[np.ndarray, np.ndarray]] | None = None

    def _ready(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The batches' folds (waiting for the workers), deepest first, as (words, values); the
        rows of pages that go the checked path."""
        r = self.resolution
        results = [
            (rows, future.result() if future is not None else _gather_and_fold(*job))
            for rows, job, future in self.batches
        ]
        self.batches = []
        firsts = np.concatenate([folded.firsts for _, folded in results] or [np.zeros(0, np.int64)])
        self.entry_in_frame = r.delta_slots - firsts[self.of_frame]
        plain = np.zeros(len(r.delta_pages), bool)
        for rows, folded in results:
            plain[rows] = folded.plain
        slow_pages = distinct(r.delta_pages[~plain])
        self.slow_rows = np.flatnonzero(np.isin(r.delta_pages, slow_pages))
        folds = [(folded.words, folded.values) for _, folded in reversed(results)]
        if len(slow_pages):  # their words come from the checked path, in its order
            folds = [
                (flat[keep], values[keep])
                for flat, values in folds
                for keep in [~np.isin(flat // self.words_per_page, slow_pages)]
            ]
        self.folds = folds
        return folds

    def apply(self, out: np.ndarray, first_page: int, stop: int) -> None:
        folds = self.folds if self.folds is not None else self._ready()
        wpp, words = self.words_per_page, out.view("<u8")
        for flat, values in folds:
            lo, hi = (int(x) for x in np.searchsorted(flat, [first_page * wpp, stop * wpp]))
            words[flat[lo:hi] - first_page * wpp] = values[lo:hi]
        r = self.resolution
        lo, hi = (int(x) for x in np.searchsorted(r.delta_pages[self.slow_rows], [first_page, stop]))
        for row in self.slow_rows[lo:hi].tolist():
            apply_checked(
                r.links[int(r.delta_links[row])],
                int(r.delta_frames[row]),
                out,
                np.array([int(r.delta_pages[row]) - first_page]),
                self.entry_in_frame[row : row + 1],
                r.links[0].page_size,
            )


def _frames_in_use(r: Resolution) -> tuple[np.ndarray, Frames, np.ndarray]:
    """The DELTA_FRAMEs the delta entries of ``r`` are in, by link then frame: per entry, the
    index of its frame among them; the frames, as (link, frame); their sizes in entries.
    Every link's frames are numbered end to end, so no sort is needed."""
    tables = [link.frames.delta_frames for link in r.links]
    counts = np.array([len(t) for t in tables], np.int64)
    first = np.cumsum(counts) - counts
    numbered = first[r.delta_links] + r.delta_frames
    used = np.zeros(int(counts.sum()), bool)
    used[numbered] = True
    ids = np.flatnonzero(used)
    link_of = np.repeat(np.arange(len(tables)), counts)[ids]
    frames = [(r.links[link], frame) for link, frame in zip(link_of.tolist(), (ids - first[link_of]).tolist())]
    sizes = np.concatenate([t.counts for t in tables] or [np.zeros(0, np.int64)]).astype(np.int64)[ids]
    return (np.cumsum(used) - 1)[numbered], frames, sizes


def _gather_and_fold(
    frames: Frames,
    first_frame: int,
    rows: np.ndarray,
    of_frame: np.ndarray,
    slots: np.ndarray,
    pages: np.ndarray,
    page_size: int,
    parsed: Future[ParsedBatch] | None = None,
) -> FoldedBatch:
    """_fold_delta_batch of the delta entries ``rows`` (their frame, ``of_frame``, counted from
    ``first_frame``; slot; page), gathered here, on the worker: numpy gathers without the GIL.
    ``parsed``: the future of the batch's _parse_delta_batch, begun ahead (parse_deltas_ahead)."""
    return _fold_delta_batch(
        frames,
        of_frame[rows] - first_frame,
        slots[rows],
        pages[rows],
        page_size,
        parsed.result() if parsed is not None else None,
    )


def parse_deltas_ahead(image: LeanImage) -> dict[tuple, Future[ParsedBatch]] | None:
    """Begin reading and parsing the DELTA_FRAMEs of ``image``'s chain on its read-ahead workers
    (idle while the caller resolves the chain), in the batches ChainPatches will make if
    every frame is in use (a chain restored whole): batch key (_batch_key) -> the future of
    its _parse_delta_batch; a batch ChainPatches makes otherwise is read there, as before.
    None without workers or DELTA_FRAMEs. A frame's finding is raised only where a batch that uses it is folded."""
    from concurrent.futures import Future  # (the read-ahead workers imported it)

    links = image.chain()
    pool = links[0].frames.pool
    if pool is None or len(links) < 2:
        return None
    frames = [(link, frame) for link in links for frame in range(len(link.frames.delta_frames))]
    if not frames:
        return None
    sizes = np.concatenate([link.frames.delta_frames.counts for link in links]).astype(np.int64)
    cuts = _batch_cuts(sizes)
    batches: list[tuple[Frames, Future[ParsedBatch]]] = [(frames[lo:hi], Future()) for lo, hi in zip(cuts, cuts[1:])]
    pool.submit(_parse_in_turn, batches, image.page_size)  # one worker: the caller resolves meanwhile
    return {_batch_key(batch): future for batch, future in batches}


def _parse_in_turn(batches: list[tuple[Frames, Future[ParsedBatch]]], page_size: int) -> None:
    """_parse_delta_batch of each (frames, future) in turn, its result (or finding) set in its future."""
    for frames, future in batches:
        try:
            future.set_result(_parse_delta_batch(frames, page_size))
        except BaseException as exc:
            future.set_exception(exc)


def _batch_cuts(sizes: np.ndarray) -> list[int]:
    """Where the batches of frames of ``sizes`` entries (in order) begin, and the end: a new
    batch where the entries so far pass a multiple of ChainPatches.BATCH_ENTRIES."""
    if not len(sizes):
        return [0]
    return [0, *(np.flatnonzero(np.diff(np.cumsum(sizes) // ChainPatches.BATCH_ENTRIES)) + 1).tolist(), len(sizes)]


def _batch_key(frames: Frames) -> tuple:
    """A batch's frames, each (link, frame) with its link by identity (a dict key)."""
    return tuple((id(link), frame) for link, frame in frames)


def _fold_delta_batch(
    frames: Frames,
    frame_of_row: np.ndarray,
    slots: np.ndarray,
    pages: np.ndarray,
    page_size: int,
    parsed: ParsedBatch | None = None,
) -> FoldedBatch:
    """Runs on a read-ahead worker: DELTA_FRAMEs ``frames`` ((link, frame), nearest link first)
    read, checked, decompressed and parsed as one, and the entries that apply (rows: their
    frame's index in ``frames``, slot and page) folded. Only plain entries' words are folded;
    of a word several set, the nearest link's value is kept. ``parsed``: the batch's
    _parse_delta_batch, if done already."""
    firsts, counts, (simple, word_start, _, positions, values) = parsed or _parse_delta_batch(frames, page_size)
    entries = (np.cumsum(counts) - counts)[frame_of_row] + slots - firsts[frame_of_row]
    batch = WordBatch(simple, word_start, positions, values, entries, pages, page_size)
    folded = _fold_words_native(batch) if _native is not None else None
    if folded is not None:
        return FoldedBatch(firsts, *folded)
    return FoldedBatch(firsts, *_fold_words(batch))


def _fold_words_native(batch: WordBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """_fold_words in one call of leanimg._native.fold_words (None: an input it does not take)."""
    assert _native is not None  # called only with the backend
    simple, word_start, positions, values, entries, pages, page_size = batch
    plain = np.zeros(len(entries), bool)
    flat, flat_values = np.empty(len(positions), np.int64), np.empty(len(positions), "<u8")
    count = _native.fold_words(
        simple.view(np.uint8),
        np.ascontiguousarray(word_start, np.int64),
        np.ascontiguousarray(positions, np.int64),
        np.ascontiguousarray(values, "<u8"),
        np.ascontiguousarray(entries, np.int64),
        np.ascontiguousarray(pages, np.int64),
        page_size // 8,
        int(pages.max()) + 1 if len(pages) else 0,
        plain.view(np.uint8),
        flat,
        flat_values,
    )
    return None if count < 0 else (flat[:count], flat_values[:count], plain)


def _fold_words(batch: WordBatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The words of a batch's entries that its rows apply: (page * words per page + word,
    ascending, their values, per row whether its entry is a plain INDEX_LIST). Of a word
    several entries set, the first entry's value is kept (a batch's entries come nearest link
    first)."""
    simple, word_start, positions, values, entries, pages, page_size = batch
    plain = simple[entries]
    page_of_entry = np.full(len(simple), -1, np.int64)
    page_of_entry[entries[plain]] = pages[plain]
    word_page = np.repeat(page_of_entry, np.diff(word_start, append=len(positions)))
    kept = np.flatnonzero(word_page >= 0)
    flat = word_page[kept] * (page_size // 8) + positions[kept]
    order = np.argsort(flat, kind="stable")  # equal words keep the nearest link first
    flat, values = flat[order], values[kept][order]
    first = np.ones(len(flat), bool)
    first[1:] = flat[1:] != flat[:-1]
    return flat[first], values[first], plain


def _parse_delta_batch(frames: Frames, page_size: int) -> ParsedBatch:
    """DELTA_FRAMEs ``frames`` ((link, frame)) read, checked, decompressed and parsed as one."""
    read = _read_delta_batch_native(frames, page_size)
    if read is None:
        read = _read_delta_batch(frames)
    if CROSS_CHECK:
        _cross_check(frames, read)
    content, offsets, firsts, counts = read
    return ParsedBatch(firsts, counts, parse_index_lists(content, offsets, page_size))


def _cross_check(frames: Frames, read: ReadBatch) -> None:
    """LEANIMG_CROSS_CHECK=1: the frame store's checked path reads the batch alike."""
    fast = "chain.deltas (_read_delta_batch_native, _quick_delta_frame)"
    where = ", ".join(f"{link.path} DELTA_FRAME {frame}" for link, frame in frames)
    try:
        checked = _laid_end_to_end([link.frames.read_delta_frame(frame) for link, frame in frames])
    except LeanImageError as exc:
        raise disagree(where, fast, f"the checked read refuses it: {exc}") from exc
    if checked.content != read.content or not all(np.array_equal(a, b) for a, b in zip(checked[1:], read[1:])):
        raise disagree(where, fast, "the checked read gives other content, offsets or counts")


def _read_delta_batch(frames: Frames) -> ReadBatch:
    """DELTA_FRAMEs ``frames`` laid end to end, each read by _quick_delta_frame or, failing
    that, by the frame store's checked path (which raises its finding)."""
    decompressor = zstandard.ZstdDecompressor()  # one per batch: a batch runs on one thread
    return _laid_end_to_end(
        [_quick_delta_frame(link, frame, decompressor) or link.frames.read_delta_frame(frame) for link, frame in frames]
    )


def _laid_end_to_end(read: list[DeltaFrameContent]) -> ReadBatch:
    """DELTA_FRAMEs as read one by one, as one batch."""
    byte_base = np.cumsum([0] + [len(content) for content, _, _ in read])
    offsets = np.concatenate(
        [np.asarray(offsets[:-1], np.int64) + base for (_, offsets, _), base in zip(read, byte_base.tolist())]
        + [byte_base[-1:].astype(np.int64)]
    )
    return ReadBatch(
        b"".join(content for content, _, _ in read),
        offsets,
        np.array([first for _, _, first in read], np.int64),
        np.array([len(offsets) - 1 for _, offsets, _ in read], np.int64),
    )


# what one native call reads of a batch's records, at most (past it, they are read one by one)
NATIVE_BATCH_BYTES_MAX = 256 << 20


_DELTA_FRAME_RULES = (
    *("LI-REC-002", "LI-REC-003", "LI-REC-004", "LI-REC-005", "LI-REC-006", "LI-REC-007", "LI-REC-008"),
    "LI-IDX-001",  # the record's INDEX entry
    *("LI-DLT-001", "LI-FRM-002", "LI-FRM-003", "LI-FRM-004"),
)


@fast_path("FrameStore.read_delta_frame(frame), for each frame", tests=_DELTA_FRAME_RULES)
def _read_delta_batch_native(frames: Frames, page_size: int) -> ReadBatch | None:
    """_read_delta_batch in one call of leanimg._native.read_delta_frames: every record read,
    tested as _quick_delta_frame tests it, and decompressed in C, the GIL released (so a batch
    on a read-ahead worker does not hold back the caller); None when any record is not of
    the plain case (a worker then reads them one by one, and the checked path raises any finding),
    or without the backend (LEANIMG_NATIVE=0)."""
    if _native is None:
        return None
    fds, offsets, lengths, firsts, nums = [], [], [], [], []
    for link, frame in frames:
        tables = link.tables
        position = int(tables.delta_frames.positions[frame])
        offset, kind, key, first, num = tables.entries[position].item()
        length = tables.listed_end(position) - offset
        if (
            kind != RecordType.DELTA_FRAME
            or key != NO_KEY
            or not 0 < num <= 0xFFFF_FFFF
            or first >= 1 << 63
            or offset + length > tables.file.size
        ):
            return None
        try:
            fds.append(tables.file.fileobj.fileno())
        except (OSError, ValueError):  # an object in a store: read through its pread
            return None
        offsets.append(offset)
        lengths.append(length)
        firsts.append(first)
        nums.append(num)
    if sum(lengths) > NATIVE_BATCH_BYTES_MAX:
        return None
    most = sum(nums) * 2 * page_size  # an entry of any encoding is shorter than two pages (spec §7.2)
    read = _native.read_delta_frames(
        np.array(fds, np.int32),
        np.array(offsets, np.int64),
        np.array(lengths, np.int64),
        np.array(firsts, np.int64),
        np.array(nums, np.int64),
        most,
    )
    if read is None:
        return None
    content, entry_offsets = read
    return ReadBatch(
        content, np.frombuffer(entry_offsets, np.int64), np.array(firsts, np.int64), np.array(nums, np.int64)
    )


# a DELTA_FRAME record's header and its body's fixed part (first_delta, num_deltas, reserved)
_DELTA_RECORD = struct.Struct(RECORD.struct.format + DELTA_FRAME_BODY.struct.format.lstrip("<"))


@fast_path("FrameStore.read_delta_frame(frame)", tests=_DELTA_FRAME_RULES)
def _quick_delta_frame(
    link: LeanImage, frame: int, decompressor: zstandard.ZstdDecompressor | None = None
) -> DeltaFrameContent | None:
    """A DELTA_FRAME as FrameStore.read_delta_frame gives it (its entry offsets an array),
    when every rule it checks holds in its plain case: the record's framing,
    checksum, flags and padding (LI-REC-002..005), body length (LI-REC-007), reserved field
    (LI-REC-008), entry offsets (LI-DLT-001), size (LI-FRM-004), its INDEX entry (LI-IDX-001),
    a zstd frame of the declared size; else None, and that path reads it and raises its finding.
    One read and a few scalar tests, not a Record and its checks' generators (a deep chain's
    restore reads one DELTA_FRAME per link); ``decompressor``: one to use again (a batch's).
    leanimg._native.read_delta_frames tests the same (keep them alike)."""
    tables = link.tables
    position = int(tables.delta_frames.positions[frame])
    _, *listed = tables.entries[position].item()  # record_type, key, first, count
    raw = tables.listed_bytes(position, record_size(RECORD_BODY_MAX))
    if raw is None or len(raw) < _DELTA_RECORD.size + 4 + RECORD_TRAILER.size:
        return None
    kind, flags, body_length, first, num, reserved = _DELTA_RECORD.unpack_from(raw)
    body = RECORD.size
    table_end = body + DELTA_FRAME_BODY.size + 4 * (num + 1)
    frame_start = body + align8(DELTA_FRAME_BODY.size + 4 * (num + 1))
    trailer = int.from_bytes(raw[-RECORD_TRAILER.size :], "little")
    if (
        kind != RecordType.DELTA_FRAME
        or flags
        or reserved
        or num < 1
        or len(raw) != record_size(body_length)
        or frame_start > body + body_length
        or listed != [RecordType.DELTA_FRAME, NO_KEY, first, num]
        or any(raw[body + body_length : -RECORD_TRAILER.size])
        or any(raw[table_end:frame_start])
        or checksum64(memoryview(raw)[: -RECORD_TRAILER.size]) != trailer
    ):
        return None
    offsets = np.frombuffer(raw, "<u4", num + 1, body + DELTA_FRAME_BODY.size).astype(np.int64)
    size = int(offsets[-1])
    if offsets[0] != 0 or size > FRAME_PAGES_MAX_BYTES or (offsets[1:] < offsets[:-1]).any():
        return None
    try:
        content = decompress_exact(
            memoryview(raw)[frame_start : body + body_length],
            expected=size,
            limit=FRAME_PAGES_MAX_BYTES,
            decompressor=decompressor,
        )
    except FrameError:
        return None
    return DeltaFrameContent(content, offsets, first)


def apply_checked(
    link: LeanImage, frame: int, out: np.ndarray, rows: np.ndarray, entry_indexes: np.ndarray, ps: int
) -> None:
    """Entries other than plain INDEX_LISTs, one page at a time through delta.apply, which
    decodes them and reports any broken rule."""
    _, content, offsets, _ = link.frames.delta_frame_parsed(frame)
    offset, path = link.frames.delta_frame_location(frame)
    for row, entry_index in zip(rows.tolist(), entry_indexes.tolist()):
        entry = content[offsets[entry_index] : offsets[entry_index + 1]]
        try:
            page = apply_delta(
                entry,
                out[row * ps : (row + 1) * ps].tobytes(),
                offset=offset,
                structure=f"{path}.entries[{entry_index}]",
            )
        except LeanImageError as exc:
            exc.path = exc.path or link.path
            exc.args = (str(exc),)
            raise
        out[row * ps : (row + 1) * ps] = np.frombuffer(page, np.uint8)
