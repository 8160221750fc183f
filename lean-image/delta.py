"""DELTA entries: the changed 8-byte words of a page against its parent (spec §7).

Three encodings of the word positions; the encoder picks the smallest. Values
are always the new words in ascending position order.
"""

from __future__ import annotations

import struct

import numpy as np

from .errors import FormatError
from .format import DELTA_ENTRY, DELTA_RUN, WORD_SIZE, DeltaEncoding
from .rules import implements
from .structures import reserved_problems

from .native import backend as _native  # parse_index_lists in one pass, without the GIL (None: numpy)

_HEAD = DELTA_ENTRY.size
_NUM_RUNS = DELTA_ENTRY.field("num_runs").struct
_RUNS_HEAD = _NUM_RUNS.size
_RUN_SIZE = DELTA_RUN.size


def _words(page) -> np.ndarray:
    return np.frombuffer(page, dtype="<u8")


def _runs(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = positions[np.concatenate(([0], breaks))]
    ends = positions[np.concatenate((breaks - 1, [len(positions) - 1]))]
    return starts, ends - starts + 1


def encoded_sizes(num_words: int, num_runs: int, page_size: int) -> dict[DeltaEncoding, int]:
    values = WORD_SIZE * num_words
    return {
        DeltaEncoding.INDEX_LIST: _HEAD + 2 * num_words + values,
        DeltaEncoding.BITMAP: _HEAD + page_size // 64 + values,
        DeltaEncoding.RUNS: _HEAD + _RUNS_HEAD + _RUN_SIZE * num_runs + values,
    }


def encode(old_page, new_page) -> bytes | None:
    """The smallest delta entry turning old_page into new_page.

    None when the pages are equal or no entry is smaller than a page (the
    caller then stores the page, rule LI-DLT-004).
    """
    page_size = len(new_page)
    old, new = _words(old_page), _words(new_page)
    positions = np.flatnonzero(old != new).astype("<u2")
    if len(positions) == 0:
        return None
    starts, lengths = _runs(positions)
    sizes = encoded_sizes(len(positions), len(starts), page_size)
    encoding = min(sizes, key=sizes.__getitem__)
    if sizes[encoding] >= page_size:
        return None
    head = DELTA_ENTRY.pack(encoding=encoding, num_words=len(positions))
    values = new[positions].astype("<u8").tobytes()
    if encoding == DeltaEncoding.INDEX_LIST:
        return head + positions.tobytes() + values
    if encoding == DeltaEncoding.BITMAP:
        bits = np.zeros(page_size // WORD_SIZE, dtype=bool)
        bits[positions] = True
        return head + np.packbits(bits, bitorder="little").tobytes() + values
    runs = np.empty((len(starts), 2), dtype="<u2")
    runs[:, 0], runs[:, 1] = starts, lengths
    return head + _NUM_RUNS.pack(len(starts)) + runs.tobytes() + values


def _fail(rule: str, message: str, offset: int | None, structure: str) -> FormatError:
    return FormatError(message, rule=rule, offset=offset, structure=structure)


@implements("LI-DLT-002", "LI-DLT-003", "LI-DLT-004")
def decode_positions(
    entry, page_size: int, *, offset: int | None = None, structure: str = "delta_entry"
) -> tuple[np.ndarray, np.ndarray]:
    """Word positions and new values of a delta entry, checking every rule of §7."""
    entry = memoryview(entry)
    if len(entry) < _HEAD:
        raise _fail("LI-DLT-002", f"expected at least {_HEAD} bytes, got {len(entry)}", offset, structure)
    if len(entry) >= page_size:
        raise _fail(
            "LI-DLT-004", f"expected an entry smaller than {page_size} bytes, got {len(entry)}", offset, structure
        )
    encoding, reserved, num_words = DELTA_ENTRY.unpack(entry)
    words_per_page = page_size // WORD_SIZE
    for problem in reserved_problems(DELTA_ENTRY, {"reserved": reserved}, None, structure):
        problem.offset = offset  # inside a frame's content: the frame record's offset
        raise problem
    if encoding not in DeltaEncoding.__members__.values() or num_words == 0:
        raise _fail(
            "LI-DLT-002",
            f"expected encoding 1-3 and num_words >= 1, got encoding {encoding}, num_words {num_words}",
            offset,
            structure,
        )
    body = entry[_HEAD:]
    if encoding == DeltaEncoding.INDEX_LIST:
        positions_len = 2 * num_words
        _expect_length(body, positions_len + WORD_SIZE * num_words, offset, structure)
        positions = np.frombuffer(body[:positions_len], dtype="<u2").astype(np.int64)
    elif encoding == DeltaEncoding.BITMAP:
        positions_len = page_size // 64
        _expect_length(body, positions_len + WORD_SIZE * num_words, offset, structure)
        bits = np.unpackbits(np.frombuffer(body[:positions_len], dtype=np.uint8), bitorder="little")
        positions = np.flatnonzero(bits)
        if len(positions) != num_words:
            raise _fail("LI-DLT-002", f"expected {num_words} bits set, got {len(positions)}", offset, structure)
    else:
        positions, positions_len = _run_positions(body, num_words, offset, structure)
    _check_ascending(positions, words_per_page, offset, structure)
    values = np.frombuffer(body[positions_len:], dtype="<u8")
    return positions, values


def _expect_length(body, expected: int, offset, structure) -> None:
    if len(body) != expected:
        raise _fail(
            "LI-DLT-002", f"expected {expected + _HEAD} entry bytes, got {len(body) + _HEAD}", offset, structure
        )


def _run_positions(body, num_words: int, offset, structure):
    if len(body) < _RUNS_HEAD:
        raise _fail("LI-DLT-002", "expected a run count, got end of entry", offset, structure)
    (num_runs,) = _NUM_RUNS.unpack_from(body)
    positions_len = _RUNS_HEAD + _RUN_SIZE * num_runs
    _expect_length(body, positions_len + WORD_SIZE * num_words, offset, structure)
    runs = np.frombuffer(body[_RUNS_HEAD:positions_len], dtype="<u2").reshape(-1, 2).astype(np.int64)
    starts, lengths = runs[:, 0], runs[:, 1]
    if num_runs == 0 or (lengths == 0).any():
        raise _fail("LI-DLT-003", "expected at least one run, each of length >= 1", offset, structure)
    if int(lengths.sum()) != num_words:
        raise _fail(
            "LI-DLT-002", f"expected runs totalling {num_words} words, got {int(lengths.sum())}", offset, structure
        )
    if (starts[1:] <= starts[:-1] + lengths[:-1]).any():
        raise _fail("LI-DLT-003", "expected runs ascending and not touching", offset, structure)
    positions = np.repeat(starts - np.cumsum(np.concatenate(([0], lengths[:-1]))), lengths) + np.arange(num_words)
    return positions, positions_len


def _check_ascending(positions: np.ndarray, words_per_page: int, offset, structure) -> None:
    if (np.diff(positions) <= 0).any():
        raise _fail("LI-DLT-003", "expected strictly ascending word indexes", offset, structure)
    if len(positions) and positions[-1] >= words_per_page:
        raise _fail(
            "LI-DLT-003", f"expected word indexes below {words_per_page}, got {int(positions[-1])}", offset, structure
        )


FAST_WORDS = 32


def apply(entry, parent_page, *, offset: int | None = None, structure: str = "delta_entry") -> bytes:
    """The page a delta entry makes of its parent's page."""
    fast = _apply_small_index_list(entry, parent_page)
    if fast is not None:
        return fast
    positions, values = decode_positions(entry, len(parent_page), offset=offset, structure=structure)
    words = np.frombuffer(parent_page, dtype="<u8").copy()
    words[positions] = values
    return words.tobytes()


def small_index_list(entry, page_size: int) -> tuple[tuple, bytes] | None:
    """(word positions, new values) of an INDEX_LIST entry of a few words (the common case),
    decoded without numpy; None when the entry is anything else or breaks a rule of §7,
    so that the checking path decodes (and reports) it."""
    entry = bytes(entry)
    if len(entry) < _HEAD or len(entry) >= page_size:
        return None
    encoding, reserved, num_words = DELTA_ENTRY.unpack(entry)
    if (
        encoding != DeltaEncoding.INDEX_LIST
        or reserved
        or not 0 < num_words <= FAST_WORDS
        or len(entry) != _HEAD + 10 * num_words
    ):
        return None
    positions = struct.unpack_from(f"<{num_words}H", entry, _HEAD)
    if any(b <= a for a, b in zip(positions, positions[1:])) or positions[-1] >= page_size // WORD_SIZE:
        return None
    return positions, entry[_HEAD + 2 * num_words :]


def _apply_small_index_list(entry, parent_page) -> bytes | None:
    parsed = small_index_list(entry, len(parent_page))
    if parsed is None:
        return None
    positions, values = parsed
    page = bytearray(parent_page)
    for i, word in enumerate(positions):
        page[word * 8 : word * 8 + 8] = values[8 * i : 8 * i + 8]
    return bytes(page)


def _at_every_byte(c: np.ndarray, dtype: str) -> np.ndarray:
    """A view of bytes ``c`` as one ``dtype`` item starting at each byte (unaligned): item k
    is the value in bytes k .. k + size - 1, so a gather reads words at any byte offset."""
    size = np.dtype(dtype).itemsize
    return np.ndarray((max(len(c) - size + 1, 0),), dtype, buffer=c, strides=(1,))


def parse_index_lists(content: bytes, offsets: np.ndarray, page_size: int):
    """All entries of one decompressed DELTA_FRAME at once.

    Returns (simple, word_start, num_words, positions, values): for each entry whether it
    is an INDEX_LIST entry that passes every rule of §7 (the others go through
    ``apply``, which decodes and reports them), where its words start in the flat
    ``positions``/``values`` arrays, and how many it has (0 for an entry shorter than its
    head). leanimg._native parses them in one pass without the GIL; else numpy does.
    """
    offsets = np.ascontiguousarray(offsets, np.int64)
    if _native is None:
        return _parse_index_lists_numpy(content, offsets, page_size)
    n = len(offsets) - 1
    simple, word_start, num_words = np.empty(n, bool), np.empty(n, np.int64), np.empty(n, np.int64)
    words = _native.index_list_heads(content, offsets, page_size, simple, word_start, num_words)
    positions, values = np.empty(words, np.int64), np.empty(words, "<u8")
    _native.index_list_words(content, offsets, page_size, simple, word_start, positions, values)
    return simple, word_start, num_words, positions, values


def _parse_index_lists_numpy(content: bytes, offsets: np.ndarray, page_size: int):
    """parse_index_lists with numpy (where leanimg._native was not built)."""
    c = np.frombuffer(content, np.uint8)
    if len(c) < _HEAD:  # no entry has a head: read one of zeros
        c = np.zeros(_HEAD, np.uint8)
    starts, lengths = offsets[:-1], np.diff(offsets)
    safe = np.where(lengths >= _HEAD, starts, 0)
    encoding, reserved = c[safe], c[safe + 1]
    num_words = np.where(lengths >= _HEAD, c[safe + 2].astype(np.int64) | (c[safe + 3].astype(np.int64) << 8), 0)
    simple = (
        (lengths >= _HEAD)
        & (encoding == DeltaEncoding.INDEX_LIST)
        & (reserved == 0)
        & (num_words > 0)
        & (lengths == _HEAD + 10 * num_words)
        & (lengths < page_size)
    )
    counts = np.where(simple, num_words, 0)
    word_start = np.concatenate(([0], np.cumsum(counts)[:-1])) if len(counts) else counts
    k = np.arange(int(counts.sum()))  # word k is word k - word_start[e] of its entry e
    positions = _at_every_byte(c, "<u2")[np.repeat(starts + _HEAD - 2 * word_start, counts) + 2 * k]
    values = _at_every_byte(c, "<u8")[np.repeat(starts + _HEAD + 2 * num_words - 8 * word_start, counts) + 8 * k]
    positions = positions.astype(np.int64)
    first_word = np.zeros(len(k), bool)
    first_word[word_start[counts > 0]] = True
    bad_word = positions >= page_size // WORD_SIZE
    bad_word[1:] |= ~first_word[1:] & (positions[1:] <= positions[:-1])
    bad = np.flatnonzero(bad_word)
    if len(bad):  # their entries: the last whose words start at or before them
        simple[np.searchsorted(word_start, bad, side="right") - 1] = False
    return simple, word_start, num_words, positions, values
