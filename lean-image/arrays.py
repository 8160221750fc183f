"""numpy helpers the tables, the writers and the restores share."""

from __future__ import annotations

import numpy as np


def joined(tables: list[np.ndarray]) -> np.ndarray:
    """Structured arrays of one dtype (a file's tables) laid end to end, by their bytes: one
    copy (np.concatenate of the arrays themselves promotes the fields of each, ~50 us a
    table; tobytes and a join copy twice, which costs less for small tables). Tables that
    already lie end to end in one array (slices of what an earlier call returned, as
    tables_batch keeps a batch's page maps) are not copied: a read-only view of them is
    returned."""
    span = _adjacent_span(tables)
    if span is not None:
        return span
    if sum(t.nbytes for t in tables) < SMALL_TABLES_BYTES:  # a view of each costs more than copying twice
        return np.frombuffer(b"".join([t.tobytes() for t in tables]), tables[0].dtype)
    return np.concatenate([np.ascontiguousarray(t).view(np.uint8) for t in tables]).view(tables[0].dtype)


SMALL_TABLES_BYTES = 64 << 10


def _adjacent_span(tables: list[np.ndarray]) -> np.ndarray | None:
    """A read-only view of the bytes ``tables`` cover, if they are contiguous views of one
    array, each starting where the one before ends; else None."""
    dtype, tables = tables[0].dtype, [t for t in tables if len(t)]  # an empty slice may point anywhere
    owner = tables[0].base if tables else None
    if owner is None or not isinstance(owner, np.ndarray) or not owner.flags.c_contiguous:
        return None
    at = owner.ctypes.data  # (a structured array's __array_interface__ costs ~5 us to build)
    end = tables[0].ctypes.data
    start = end
    for t in tables:
        if t.base is not owner or not t.flags.c_contiguous or t.dtype != dtype or t.ctypes.data != end:
            return None
        end += t.nbytes
    span = owner.reshape(-1).view(np.uint8)[start - at : end - at].view(dtype)
    span.flags.writeable = False
    return span


def distinct(values) -> np.ndarray:
    """The distinct values, ascending: np.unique(values), without its cost at its first call
    in a process (numpy 2's np.unique asks np.ma.is_masked, which imports numpy.ma: ~8 ms,
    a sixth of a small chain's restore)."""
    values = np.sort(np.asarray(values).ravel())
    if len(values) < 2:
        return values
    return values[np.concatenate(([True], values[1:] != values[:-1]))]


def stretches(values: np.ndarray, step: int = 0) -> list[tuple[int, int]]:
    """(start, stop) of each stretch of ``values`` in which every value is the one before plus
    ``step`` (0: runs of equal values; 1: runs of consecutive numbers)."""
    if not len(values):
        return []
    edges = (np.flatnonzero(np.diff(values) != step) + 1).tolist()
    return list(zip([0, *edges], [*edges, len(values)]))


def nonzero_rows(rows: np.ndarray) -> np.ndarray:
    """Which rows of an (n, k) array of pages (each row's bytes contiguous, k a multiple of 8)
    hold a non-zero byte, as a bool mask: most show one in their first word, so only the
    others are read whole (``any`` over every word casts each to bool first, ~3x the time)."""
    words = rows.view(np.uint64)
    nonzero = words[:, 0] != 0
    unsure = np.flatnonzero(~nonzero)
    if len(unsure):
        nonzero[unsure] = words[unsure].any(axis=1)
    return nonzero


def as_items(rows: np.ndarray) -> np.ndarray:
    """An (n, k) C-contiguous array as a view of n items of k bytes each: numpy gathers and
    scatters those with one copy per item, where rows of an (n, 16) uint8 array (digests) go
    byte by byte, ~9x the time."""
    return rows.view(np.dtype((np.void, rows.shape[1] * rows.itemsize))).reshape(len(rows))


def gather_rows(rows: np.ndarray, at) -> np.ndarray:
    """rows[at] (``at``: indexes or a mask) of an (n, k) C-contiguous array, through as_items."""
    return as_items(rows)[at].view(rows.dtype).reshape(-1, rows.shape[1])


def scatter_rows(rows: np.ndarray, at, values: np.ndarray) -> None:
    """rows[at] = values, for an (n, k) C-contiguous ``rows``, through as_items."""
    as_items(rows)[at] = as_items(np.ascontiguousarray(values, rows.dtype))
