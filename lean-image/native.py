"""The one door to leanimg's accelerated backend, ``leanimg._native`` (lean-image/_native.c).

``LEANIMG_NATIVE`` chooses it when leanimg is imported:

- ``auto`` (the default): used when it was built (setup.py builds it where gcc, Python's
  headers, xxhash.h and libzstd are found);
- ``0``: never; every caller takes its numpy or library path, which gives the same results
  (CI runs the reader, chain, restore and delta tests once so);
- ``1``: required; importing leanimg fails when it was not built.

No other module imports ``_native``: each takes ``backend`` (None when not in use), whose
functions ``Backend`` types. Arrays are numpy arrays of the dtypes the C code checks; every
function raises ValueError or TypeError on a buffer of the wrong size, type or layout.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import numpy as np

MODES = ("auto", "0", "1")


class Backend(Protocol):
    """What leanimg._native exposes (each function documented where it is used)."""

    def digest_rows(self, data, page_size: int, rows: np.ndarray, out) -> None:
        """xxh3-128 of pages ``rows`` of ``data`` into ``out`` (format.page_digests)."""

    def span_checksums(self, buffers: list, offsets: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> None:
        """xxh3-64 of ``buffers[k][offsets[k]:offsets[k] + lengths[k]]`` into ``out`` (format.span_checksums)."""

    def qemu_run_length(self, buf, pos: int, first: int, flags: int, stride: int, limit: int, page_size: int) -> int:
        """How many QEMU RAM entries at ``pos`` continue a run (converters/qemu.py _run_length)."""

    def index_list_heads(self, *arrays) -> int:
        """The heads of the INDEX_LIST entries of a DELTA_FRAME: (content, offsets, page_size,
        simple, word_start, num_words) (delta.parse_index_lists)."""

    def index_list_words(self, *arrays) -> None:
        """Their words: (content, offsets, page_size, simple, word_start, positions, values)
        (delta.parse_index_lists)."""

    def copy_rows(self, src, src_rows: np.ndarray, dst, dst_rows: np.ndarray, row_size: int) -> None:
        """``dst[dst_rows] = src[src_rows]``, rows of ``row_size`` bytes (chain.forward._copy_rows)."""

    def read_delta_frames(
        self, fds: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, firsts: np.ndarray, nums: np.ndarray, most: int
    ) -> tuple[bytes, bytes] | None:
        """DELTA_FRAME records read, tested and decompressed (chain.deltas._read_delta_batch_native)."""

    def page_map_extents(
        self,
        extents: np.ndarray,
        lengths: np.ndarray,
        is_page_class: np.ndarray,
        has_slot: np.ndarray,
        ok: np.ndarray,
        pages: np.ndarray,
        firsts: np.ndarray,
    ) -> None:
        """Each extent's own rules (tables_batch._extents_alone_native)."""

    def extents_hold(self, *arrays) -> None:
        """The page-map rules of a batch of links (tables_batch._extents_rules_native)."""

    def own_extents(self, *arrays) -> int:
        """The links' own extents a chain folds (chain.resolution._own_extents_native)."""

    def fold_own_pages(self, *arrays) -> int:
        """The fold of a chain's own pages (chain.resolution._fold_own_pages_native)."""

    def fold_words(self, *arrays) -> int:
        """A delta batch's words folded by page (chain.deltas._fold_words_native); -1: not taken."""

    def scan_files(self, *arrays) -> None:
        """The UUIDs of many files read on a thread of its own (parent_files._Scan)."""


def _chosen() -> Backend | None:
    mode = os.environ.get("LEANIMG_NATIVE", "auto")
    if mode not in MODES:
        raise ImportError(f"LEANIMG_NATIVE must be one of {', '.join(MODES)}, not {mode!r}")
    if mode == "0":
        return None
    try:
        import leanimg._native as _native  # (mypy takes `from . import _native` for an attribute)
    except ImportError as exc:
        if mode == "1":
            raise ImportError(
                f"LEANIMG_NATIVE=1, but leanimg._native was not built ({exc}): gcc, python3-dev, "
                "libxxhash-dev and libzstd-dev are needed when pip installs leanimg"
            ) from None
        return None
    return _native


backend: Backend | None = _chosen()
